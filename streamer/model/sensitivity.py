"""How much each (layer, K/V) of a causal LM's KV matters to its output: the sensitivities
``codec.allocation.allocate`` turns into per-section target weights.

The quality proxy is the KL divergence of the model's next-token distributions on a
continuation after a perturbed context KV from those after the original one (what
perplexity and top-1 agreement move with). White noise of MSE/var ``e`` in one section
(per element variance ``e * v / C``, ``v`` the section's per-token energy around its mean,
``C`` its channels: the chunk-own MSE/var the step control holds) costs, to second order,
``KL = 0.5 * (e * v / C) * tr(F)``, with ``F`` the Fisher information of the continuation's
distributions with respect to that section's KV. So the sensitivity, the KL per token of
continuation per unit MSE/var, is ``0.5 * v / C * tr(F) / tokens``, and it adds up over
sections (independent errors), as the allocation assumes.

``tr(F)`` for every section comes from one backward pass: with each continuation token
``y_t`` drawn from the model's own distribution, the score ``g_t = d log p_t(y_t) / d kv``
has mean zero and the draws are independent, so ``E ||sum_t g_t||^2 = sum_t E ||g_t||^2
= tr(F)`` (Hutchinson-style, per section). A few draws over a few windows of the
calibration text average it: 60 sections of SmolLM2 cost four forward and backward
passes instead of 60 perturbed forwards.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from codec.profile import DEFAULT_SINK_TOKENS

from streamer.model import hf

#: context and scored continuation tokens per window, windows and draws per window
CONTEXT_TOKENS = 512
CONTINUATION_TOKENS = 256
WINDOWS = 2
DRAWS = 2


def _window_pairs(ids: list[int], windows: int, context: int, continuation: int
                  ) -> list[tuple[list[int], list[int]]]:
    """Up to ``windows`` consecutive (context, continuation) pieces of ``ids``."""
    size = context + continuation
    if len(ids) < size:
        raise ValueError(f"sensitivity needs {size} tokens ({context} context + {continuation} "
                         f"continuation), the text has {len(ids)}")
    count = min(windows, len(ids) // size)
    return [(ids[i * size:i * size + context], ids[i * size + context:(i + 1) * size]) for i in range(count)]


def fisher_traces(model, kv: torch.Tensor, continuation: Sequence[int], *, draws: int,
                  generator: torch.Generator) -> torch.Tensor:
    """float64 [layers, 2, tokens] estimates of tr(F) per (layer, K/V) and context token
    (summed over heads and head_dim) for ``continuation`` run after the context ``kv``."""
    leaf = kv.detach().clone().requires_grad_(True)
    total = torch.zeros(kv.shape[:3], dtype=torch.float64)
    with torch.enable_grad():
        for _ in range(draws):
            cache = hf.kv_to_cache(leaf, model=model)
            logits = hf._decoder_forward(model, list(continuation), cache, logits=True).logits[0]
            logp = torch.log_softmax(logits.double(), dim=-1)
            drawn = torch.multinomial(logp.detach().exp().float().cpu(), 1, generator=generator)
            score = logp.gather(1, drawn.to(logp.device)).sum()
            (grad,) = torch.autograd.grad(score, leaf)
            total += grad.double().square().sum(dim=(3, 4)).cpu()
    return total / draws


def section_energy(kv: torch.Tensor, sink_tokens: int) -> torch.Tensor:
    """float64 [layers, 2]: mean over the coded tokens (after the sinks) of each token's
    squared distance to their mean, in the KV's own frame (the control's variance)."""
    body = kv[:, :, sink_tokens:].double().flatten(3)  # [L, 2, N, C]
    return (body - body.mean(dim=2, keepdim=True)).square().sum(dim=3).mean(dim=2)


def kv_sensitivity(model, tokenizer, token_ids: Sequence[int], *, context_tokens: int = CONTEXT_TOKENS,
                   continuation_tokens: int = CONTINUATION_TOKENS, windows: int = WINDOWS,
                   draws: int = DRAWS, sink_tokens: int = DEFAULT_SINK_TOKENS, seed: int = 0) -> np.ndarray:
    """float64 [layers, 2]: the continuation's KL per token per unit MSE/var of each
    (layer, K/V) of the context KV (module docstring), averaged over ``windows`` windows of
    ``token_ids`` with ``draws`` draws each. The attention-sink tokens, sent verbatim,
    are left out. Only causal LMs: ValueError for an encoder."""
    if not hf.is_decoder(model):
        raise ValueError("sensitivity is measured on a causal LM's continuation; this model is an encoder")
    if min(context_tokens - sink_tokens, continuation_tokens, windows, draws) < 1:
        raise ValueError("context_tokens must exceed sink_tokens; continuation_tokens, windows and draws >= 1")
    ids = list(token_ids)
    # a short text or a model with few positions: one window of what fits, split alike
    fits = min(len(ids), getattr(model.config, "max_position_embeddings", None) or len(ids))
    if context_tokens + continuation_tokens > fits:
        context_tokens = fits * context_tokens // (context_tokens + continuation_tokens)
        continuation_tokens = fits - context_tokens
        if context_tokens <= sink_tokens or continuation_tokens < 1:
            raise ValueError(f"sensitivity needs more than {sink_tokens + 1} tokens, the text or the model's "
                             f"positions allow {fits}")
    generator = torch.Generator().manual_seed(seed)
    pairs = _window_pairs(ids, windows, context_tokens, continuation_tokens)
    total = None
    for context, continuation in pairs:
        kv = hf.capture_kv(model, tokenizer, context)
        trace = fisher_traces(model, kv, continuation, draws=draws, generator=generator)
        channels = kv.shape[3] * kv.shape[4]
        per_token = trace[:, :, sink_tokens:].sum(dim=2) / len(continuation)
        one = 0.5 * section_energy(kv, sink_tokens) / channels * per_token
        total = one if total is None else total + one
    return (total / len(pairs)).numpy()
