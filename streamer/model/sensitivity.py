"""How much each (layer, K/V) of a model's KV matters to its output: the sensitivities
``codec.allocation.allocate`` turns into per-section target weights.

White noise of MSE/var ``e`` in one section (per element variance ``e * v / C``, ``v`` the
section's per-token energy around its mean, ``C`` its channels: the chunk-own MSE/var the
step control holds) costs, to second order, ``0.5 * (e * v / C) * T`` for a quality proxy
whose Hessian with respect to that section's KV has trace ``T``. So the sensitivity, the
proxy per unit MSE/var, is ``0.5 * v / C * T``, and it adds up over sections (independent
errors), as the allocation assumes. ``T`` comes for every section at once from one
backward pass per draw (Hutchinson-style): the squared gradient of a random scalar whose
expected outer product is that Hessian, summed per section.

* **Causal LMs**: the proxy is the KL divergence of the model's next-token distributions
  on a continuation after a perturbed context KV from those after the original one (what
  perplexity and top-1 agreement move with), and ``T = tr(F)``, the Fisher information of
  the continuation's distributions. With each continuation token ``y_t`` drawn from the
  model's own distribution, the score ``g_t = d log p_t(y_t) / d kv`` has mean zero and
  the draws are independent, so ``E ||sum_t g_t||^2 = sum_t E ||g_t||^2 = tr(F)``. The
  sensitivity is in KL (nats) per token of continuation per unit MSE/var.
* **Encoders** (MiniLM): the proxy is ``1 - cos`` of the sentence embedding (mean-pooled,
  L2-normalised; what ``kvwire bench quality`` reports). For unit embeddings ``e, ê``,
  ``1 - e.ê = 0.5 ||ê - e||^2 ~ 0.5 ||J d||^2`` with ``J`` the Jacobian of the normalised
  embedding with respect to the KV, so ``T = ||J||_F^2 = E_z ||J^T z||^2`` for
  ``z ~ N(0, I)`` in embedding space: the gradient of ``z.ê``. The sensitivity is in
  ``1 - cos`` per window embedding per unit MSE/var.

A few draws over a few windows of the calibration text average it: 60 sections of SmolLM2
cost four forward and backward passes instead of 60 perturbed forwards. Only the ratios
of the sensitivities matter to the allocation, not their unit.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from codec.profile import DEFAULT_SINK_TOKENS

from streamer.model import hf

#: context and scored continuation tokens per window (an encoder's window is the context,
#: up to its positions), windows and draws per window
CONTEXT_TOKENS = 512
CONTINUATION_TOKENS = 256
WINDOWS = 2
DRAWS = 2
#: an encoder's draws per window: a pass over MiniLM's 512 positions costs a fraction of
#: SmolLM2's, and an encoder's per-section estimates are noisier between seeds, so more
#: draws buy a steadier estimate cheaply
ENCODER_DRAWS = 8


def _window_pairs(ids: list[int], windows: int, context: int, continuation: int
                  ) -> list[tuple[list[int], list[int]]]:
    """Up to ``windows`` consecutive (context, continuation) pieces of ``ids``."""
    size = context + continuation
    if len(ids) < size:
        raise ValueError(f"sensitivity needs {size} tokens ({context} context + {continuation} "
                         f"continuation), the text has {len(ids)}")
    count = min(windows, len(ids) // size)
    return [(ids[i * size:i * size + context], ids[i * size + context:(i + 1) * size]) for i in range(count)]


def _squared_gradients(kv: torch.Tensor, draws: int, scalar: Callable[[torch.Tensor], torch.Tensor]
                       ) -> torch.Tensor:
    """float64 [layers, 2, tokens]: the mean over ``draws`` of the squared gradient of
    ``scalar(kv)`` (a fresh random scalar per call), summed over heads and head_dim."""
    leaf = kv.detach().clone().requires_grad_(True)
    total = torch.zeros(kv.shape[:3], dtype=torch.float64)
    with torch.enable_grad():
        for _ in range(draws):
            (grad,) = torch.autograd.grad(scalar(leaf), leaf)
            total += grad.double().square().sum(dim=(3, 4)).cpu()
    return total / draws


def fisher_traces(model, kv: torch.Tensor, continuation: Sequence[int], *, draws: int,
                  generator: torch.Generator) -> torch.Tensor:
    """float64 [layers, 2, tokens] estimates of tr(F) per (layer, K/V) and context token
    (summed over heads and head_dim) for ``continuation`` run after the context ``kv``."""
    def score(leaf: torch.Tensor) -> torch.Tensor:
        cache = hf.kv_to_cache(leaf, model=model)
        logits = hf.decoder_forward(model, list(continuation), cache, logits=True).logits[0]
        logp = torch.log_softmax(logits.double(), dim=-1)
        drawn = torch.multinomial(logp.detach().exp().float().cpu(), 1, generator=generator)
        return logp.gather(1, drawn.to(logp.device)).sum()

    return _squared_gradients(kv, draws, score)


def jacobian_traces(model, kv: torch.Tensor, token_ids: Sequence[int], *, draws: int,
                    generator: torch.Generator) -> torch.Tensor:
    """float64 [layers, 2, tokens] estimates of ||J||_F^2 per (layer, K/V) and token, ``J``
    the Jacobian of an encoder's sentence embedding of ``token_ids`` with respect to ``kv``."""
    def projection(leaf: torch.Tensor) -> torch.Tensor:
        embedding = hf._embedding(model, token_ids, leaf)
        z = torch.randn(embedding.shape, generator=generator, dtype=embedding.dtype)
        return z @ embedding

    return _squared_gradients(kv, draws, projection)


def section_energy(kv: torch.Tensor, sink_tokens: int) -> torch.Tensor:
    """float64 [layers, 2]: mean over the coded tokens (after the sinks) of each token's
    squared distance to their mean, in the KV's own frame (the control's variance)."""
    body = kv[:, :, sink_tokens:].double().flatten(3)  # [L, 2, N, C]
    return (body - body.mean(dim=2, keepdim=True)).square().sum(dim=3).mean(dim=2)


def kv_sensitivity(model, tokenizer, token_ids: Sequence[int], *, context_tokens: int = CONTEXT_TOKENS,
                   continuation_tokens: int = CONTINUATION_TOKENS, windows: int = WINDOWS,
                   draws: int | None = None, sink_tokens: int = DEFAULT_SINK_TOKENS, seed: int = 0) -> np.ndarray:
    """float64 [layers, 2]: the quality proxy per unit MSE/var of each (layer, K/V) of the
    KV (module docstring), averaged over ``windows`` consecutive windows of ``token_ids``
    with ``draws`` draws each (default DRAWS, ENCODER_DRAWS for an encoder). A causal LM's
    window is ``context_tokens`` of context whose KV is perturbed and
    ``continuation_tokens`` scored after it; an encoder's is ``context_tokens``
    (``continuation_tokens`` unused), its embedding the proxy's. A text or a model's
    positions too short for one window give one window of what fits, split alike. The
    attention-sink tokens, sent verbatim, are left out."""
    decoder = hf.is_decoder(model)
    if not decoder:
        continuation_tokens = 0
    if draws is None:
        draws = DRAWS if decoder else ENCODER_DRAWS
    # a section's energy needs two coded tokens after the sinks
    if min(context_tokens - sink_tokens - 1, windows, draws) < 1 or (decoder and continuation_tokens < 1):
        raise ValueError("context_tokens must exceed sink_tokens + 1; continuation_tokens, windows and draws >= 1")
    ids = list(token_ids)
    fits = min(len(ids), getattr(model.config, "max_position_embeddings", None) or len(ids))
    if context_tokens + continuation_tokens > fits:
        context_tokens = fits * context_tokens // (context_tokens + continuation_tokens)
        continuation_tokens = fits - context_tokens
        if context_tokens < sink_tokens + 2 or (decoder and continuation_tokens < 1):
            raise ValueError(f"sensitivity needs two tokens after the {sink_tokens} sinks (and a continuation "
                             f"for a causal LM), the text or the model's positions allow {fits}")
    generator = torch.Generator().manual_seed(seed)
    pairs = _window_pairs(ids, windows, context_tokens, continuation_tokens)
    total = None
    for context, continuation in pairs:
        kv = hf.capture_kv(model, tokenizer, context)
        if decoder:  # per token of continuation
            trace = fisher_traces(model, kv, continuation, draws=draws, generator=generator) / len(continuation)
        else:
            trace = jacobian_traces(model, kv, context, draws=draws, generator=generator)
        channels = kv.shape[3] * kv.shape[4]
        one = 0.5 * section_energy(kv, sink_tokens) / channels * trace[:, :, sink_tokens:].sum(dim=2)
        total = one if total is None else total + one
    return (total / len(pairs)).numpy()
