"""Ablations for ``kvwire bench quality --ablation``: where a level's perplexity cost comes
from, and what taking bits out in other ways would buy, measured on the model.

Each ablation turns one window's KV, coded at one level, into another decoded KV and its
size. Two kinds:

* **codec**: the real encoder, run differently. ``layer-predicted`` calibrates the
  profile again with inter-layer prediction (``codec.prediction``, blob format 7: each
  layer's residual from a prediction out of the previous decoded layer), with its maps in
  blocks (``-kind``, ``-head``) or restarting every few layers.
  ``sinks-0`` / ``sinks-16`` code the context with 0 or 16 leading tokens kept verbatim (``codec.encode``'s ``sink_tokens``;
  the profile's default is 4); ``recent-finer`` codes the context's last tokens as a
  second blob two levels finer (a chunk cut in two at a token boundary, each part with
  its own start position): distortion allocated per token group within today's format.
  Their bits are the blobs' bytes, as for the plain level.
* **oracle**: the plain level's decoded KV with the original values put back into one
  part of it: K or V (``exact-K``, ``exact-V``), a third of the layers, the first or the
  most recent tokens, the tokens that receive the most attention from the context's own
  queries, or, as controls of equal size, tokens in the middle or spread evenly. They
  charge the plain level's bits (the exact values are not paid for): the perplexity
  change they remove is the most a technique protecting that part could gain, and the
  perplexity change they leave is what the other parts cost.

Pure functions of tensors plus ``codec``; the model is not run here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

import codec
from codec import prediction
from codec.calibration import calibrate_like

#: tokens of a token-group ablation, at most a quarter of the context (short test windows)
SINK_GROUP = 16
RECENT_GROUP = 128
ATTENTION_GROUP = 32
#: the high-attention tokens are chosen after these leading ones (the sinks, their own group)
ATTENTION_SKIP = 16
#: ``recent-finer`` codes the recent tokens this many levels finer (at most level 0)
FINER_LEVELS = 2
#: ``layer-predicted-restart*`` codes layers 0, N, 2N, .. (N this) without prediction
RESTART_LAYERS = 5


@dataclass(frozen=True)
class Window:
    """What an ablation sees of one measured window: the context's KV, its queries per
    layer ``[layers, tokens, heads, head_dim]`` and their attention ``scaling``, and the
    plain level's decoded KV and blob size."""

    kv: torch.Tensor
    queries: torch.Tensor
    scaling: Sequence[float]
    decoded: torch.Tensor
    nbytes: int


Apply = Callable[[Window, codec.Profile, int], tuple[torch.Tensor, int]]


@dataclass(frozen=True)
class Fitted:
    """An ablation ready to measure: what it does to a window, and what fitting it found
    that its bits do not show (for inter-layer prediction: the maps' size and the
    multiply-adds they add to a decode)."""

    apply: Apply
    facts: dict


@dataclass(frozen=True)
class Ablation:
    name: str
    kind: str          # "codec" (bits charged) or "oracle" (the plain level's bits)
    description: str
    apply: Apply | None
    #: for an ablation fitted at calibration: (calibration KV samples, profile) -> it, fitted
    prepare: Callable[[Sequence[torch.Tensor], codec.Profile], Fitted] | None = None

    @property
    def needs_calibration(self) -> bool:
        return self.prepare is not None

    def applier(self, samples: Sequence[torch.Tensor] | None, profile: codec.Profile) -> Fitted:
        """What measures this ablation for ``profile`` (fitted on ``samples`` if it needs them)."""
        if self.prepare is None:
            assert self.apply is not None
            return Fitted(self.apply, {})
        if not samples:
            raise ValueError(f"ablation {self.name} is fitted on calibration samples, and none were given")
        return self.prepare(samples, profile)


def group_size(tokens: int, size: int) -> int:
    """A token group of ``size``, cut to a quarter of a ``tokens``-token context (at least 1)."""
    return max(1, min(size, tokens // 4))


def restore(decoded: torch.Tensor, kv: torch.Tensor, *, layers: slice | None = None, kind: int | None = None,
            tokens: slice | torch.Tensor | None = None) -> torch.Tensor:
    """``decoded`` with ``kv``'s values put back at ``layers``, ``kind`` (0 K, 1 V) and
    ``tokens`` (None: all of that axis). Returns a new tensor."""
    out = decoded.clone()
    index = (slice(None) if layers is None else layers, slice(None) if kind is None else kind)
    part, original = out[index], kv[index]
    token_axis = part.dim() - 3   # [.., tokens, heads, head_dim]
    at = (slice(None),) * token_axis + (slice(None) if tokens is None else tokens,)
    part[at] = original[at]
    out[index] = part
    return out


def encode_split(kv: torch.Tensor, profile: codec.Profile, parts: Sequence[tuple[int, int, int | None]]
                 ) -> tuple[torch.Tensor, int]:
    """The context's tokens cut at ``parts`` ``(end, level, sink_tokens)`` (ends increasing,
    the last one the context's length), each range coded as its own blob at its own start
    position; returns the decoded KV and the blobs' bytes."""
    decoded, nbytes, start = [], 0, 0
    for end, level, sinks in parts:
        if not start < end <= kv.shape[2]:
            raise ValueError(f"token ranges must increase within the context, got {start}..{end}")
        blob = codec.encode(kv[:, :, start:end].contiguous(), level, profile, sink_tokens=sinks, start=start)
        decoded.append(codec.decode(blob, profile).float())
        nbytes += len(blob)
        start = end
    if start != kv.shape[2]:
        raise ValueError(f"the ranges end at token {start}, the context has {kv.shape[2]}")
    return torch.cat(decoded, dim=2), nbytes


def attention_received(queries: torch.Tensor, keys: torch.Tensor, scaling: Sequence[float]) -> torch.Tensor:
    """float64 [tokens]: the causal attention each key receives from every query of the
    context, summed over layers and query heads (grouped-query heads share their K head).
    ``queries`` [layers, tokens, heads, head_dim], ``keys`` [layers, tokens, kv_heads, head_dim]."""
    layers, tokens, heads, _ = queries.shape
    group = heads // keys.shape[2]
    mask = torch.ones(tokens, tokens, dtype=torch.bool).tril()
    total = torch.zeros(tokens, dtype=torch.float64)
    for layer in range(layers):
        k = keys[layer].repeat_interleave(group, dim=1).double()
        scores = torch.einsum("thd,shd->hts", queries[layer].double(), k) * scaling[layer]
        total += scores.masked_fill(~mask, float("-inf")).softmax(dim=-1).sum(dim=(0, 1))
    return total


def high_attention_tokens(window: Window, count: int, skip: int) -> torch.Tensor:
    """Indices of the ``count`` tokens after the first ``skip`` that receive the most attention."""
    received = attention_received(window.queries, window.kv[:, 0], window.scaling)
    received[:skip] = -1.0
    return torch.topk(received, min(count, received.shape[0] - skip)).indices


def _exact(**where) -> Callable[[Window, codec.Profile, int], tuple[torch.Tensor, int]]:
    return lambda w, _p, _l: (restore(w.decoded, w.kv, **where), w.nbytes)


def _exact_tokens(pick: Callable[[Window], slice | torch.Tensor]
                  ) -> Callable[[Window, codec.Profile, int], tuple[torch.Tensor, int]]:
    return lambda w, _p, _l: (restore(w.decoded, w.kv, tokens=pick(w)), w.nbytes)


def _layer_third(third: int) -> Callable[[Window, codec.Profile, int], tuple[torch.Tensor, int]]:
    def apply(w: Window, _p: codec.Profile, _l: int) -> tuple[torch.Tensor, int]:
        layers = w.kv.shape[0]
        return restore(w.decoded, w.kv, layers=slice(third * layers // 3, (third + 1) * layers // 3)), w.nbytes
    return apply


def _sinks(count: int) -> Callable[[Window, codec.Profile, int], tuple[torch.Tensor, int]]:
    def apply(w: Window, profile: codec.Profile, level: int) -> tuple[torch.Tensor, int]:
        blob = codec.encode(w.kv, level, profile, sink_tokens=min(count, w.kv.shape[2]))
        return codec.decode(blob, profile).float(), len(blob)
    return apply


def _recent_finer(w: Window, profile: codec.Profile, level: int) -> tuple[torch.Tensor, int]:
    tokens = w.kv.shape[2]
    recent = group_size(tokens, RECENT_GROUP)
    return encode_split(w.kv, profile, [(tokens - recent, level, None),
                                        (tokens, max(level - FINER_LEVELS, 0), 0)])


def _layer_predicted(grouping: str = "all", restart: int = 0
                     ) -> Callable[[Sequence[torch.Tensor], codec.Profile], Fitted]:
    """The format's inter-layer prediction (blob format 7): ``profile`` calibrated again on
    ``samples`` with the same targets, weights and RoPE, and ``predict`` (every
    ``restart``-th layer coded alone; 0: only the first)."""
    def prepare(samples: Sequence[torch.Tensor], profile: codec.Profile) -> Fitted:
        predicted = calibrate_like(profile, samples, predict=restart or profile.layers, predict_groups=grouping)

        def apply(w: Window, _p: codec.Profile, level: int) -> tuple[torch.Tensor, int]:
            blob = codec.encode(w.kv, level, predicted)
            return codec.decode(blob, predicted), len(blob)
        predicted_layers = [layer for layer in range(predicted.layers)
                            if not prediction.is_intra(layer, predicted.restart)]
        # one multiply-add per map row a decoder reads and decoded value: the columns each
        # layer's product reaches (codec.prediction.reach: 2C dense, C by kind, r low-rank),
        # twice for a low-rank map's two factors, on every predicted layer (modelled, not timed)
        factors = 2 if predicted.map_rank else 1
        rows = sum(factors * int(predicted.chain_reach[layer]) for layer in predicted_layers)
        stored = predicted.predictor_factors or (predicted.predictor,)
        return Fitted(apply, {
            "profile_id": predicted.id, "profile_bytes": len(predicted.to_bytes()),
            "map_values": sum(int(np.count_nonzero(array)) for array in stored),
            "intra_layers": predicted.layers - len(predicted_layers),
            "added_multiply_adds_per_value": round(rows / predicted.layers, 1)})
    return prepare


def _tokens(w: Window) -> int:
    return w.kv.shape[2]


ABLATIONS: dict[str, Ablation] = {a.name: a for a in (
    Ablation("sinks-0", "codec", "no leading token kept verbatim", _sinks(0)),
    Ablation("sinks-16", "codec", f"the first {SINK_GROUP} tokens kept verbatim", _sinks(SINK_GROUP)),
    Ablation("recent-finer", "codec", f"the last {RECENT_GROUP} tokens (at most a quarter) coded as a second blob "
             f"{FINER_LEVELS} levels finer", _recent_finer),
    Ablation("layer-predicted", "codec", "each layer's K and V predicted from the previous layer's decoded K and V "
             "(linear maps fitted at calibration), only the residual coded (codec.prediction, format 7)",
             None, _layer_predicted()),
    Ablation("layer-predicted-kind", "codec", "as layer-predicted, K from the previous layer's K and V from its V "
             "(two blocks: half the map)", None, _layer_predicted("kind")),
    Ablation("layer-predicted-low-rank", "codec", f"as layer-predicted-kind, each map reduced to its "
             f"{prediction.LOW_RANK} leading directions (two factors: 2 x {prediction.LOW_RANK} multiply-adds per "
             "value where a map by kind takes C)", None, _layer_predicted("low-rank")),
    Ablation("layer-predicted-head", "codec", "as layer-predicted, each KV head's K and V from that head's "
             "(a block per head)", None, _layer_predicted("head")),
    Ablation(f"layer-predicted-restart{RESTART_LAYERS}", "codec", f"as layer-predicted, every {RESTART_LAYERS}th "
             "layer coded alone (where a continued chunk could start)", None, _layer_predicted(restart=RESTART_LAYERS)),
    Ablation("exact-K", "oracle", "keys exact: only values coded", _exact(kind=0)),
    Ablation("exact-V", "oracle", "values exact: only keys coded", _exact(kind=1)),
    Ablation("exact-layers-1/3", "oracle", "the first third of the layers exact", _layer_third(0)),
    Ablation("exact-layers-2/3", "oracle", "the middle third of the layers exact", _layer_third(1)),
    Ablation("exact-layers-3/3", "oracle", "the last third of the layers exact", _layer_third(2)),
    Ablation("exact-first", "oracle", f"the first {SINK_GROUP} tokens exact",
             _exact_tokens(lambda w: slice(0, group_size(_tokens(w), SINK_GROUP)))),
    Ablation("exact-recent", "oracle", f"the last {RECENT_GROUP} tokens exact",
             _exact_tokens(lambda w: slice(_tokens(w) - group_size(_tokens(w), RECENT_GROUP), _tokens(w)))),
    Ablation("exact-middle", "oracle", f"{RECENT_GROUP} tokens in the middle exact (control of exact-recent)",
             _exact_tokens(lambda w: slice(_tokens(w) // 2, _tokens(w) // 2 + group_size(_tokens(w), RECENT_GROUP)))),
    Ablation("exact-high-attention", "oracle", f"the {ATTENTION_GROUP} tokens after the first {ATTENTION_SKIP} that "
             "receive the most attention from the context's queries exact",
             _exact_tokens(lambda w: high_attention_tokens(w, group_size(_tokens(w), ATTENTION_GROUP),
                                                           min(ATTENTION_SKIP, _tokens(w) // 4)))),
    Ablation("exact-spread", "oracle", f"{ATTENTION_GROUP} evenly spaced tokens exact (control of "
             "exact-high-attention)",
             _exact_tokens(lambda w: torch.linspace(min(ATTENTION_SKIP, _tokens(w) // 4), _tokens(w) - 1,
                                                    group_size(_tokens(w), ATTENTION_GROUP)).round().long())),
)}


def resolve(names: Sequence[str] | None) -> list[Ablation]:
    """The ablations called ``names`` (None or empty: all, in ``ABLATIONS`` order)."""
    if not names:
        return list(ABLATIONS.values())
    unknown = [n for n in names if n not in ABLATIONS]
    if unknown:
        raise ValueError(f"unknown ablation(s) {unknown}; choose from {list(ABLATIONS)}")
    return [ABLATIONS[n] for n in names]
