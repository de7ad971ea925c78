"""Inter-layer prediction, measured on the model before it is built into the format.

Each layer's (position-free) K and V are predicted from the previous layer's *decoded*
K and V by one linear map per layer, fitted by least squares on calibration KV (as
AQUA-KV does), and only the residual is coded, by the real encoder, with a profile
calibrated on the calibration KV's residuals. The decoder does the same in layer order:
a layer needs only the layers before it, so layer-ordered delivery survives, and a
chunk's first layer is coded alone (an intra-coded layer).

The residual has less variance than the layer it predicts, and a level's target is
relative to the variance of what is coded, so each layer's residual profile holds every
section to the plain profile's target times the variance ratio measured at calibration,
aiming at the plain level's absolute error so that the bits the prediction saves show as
smaller blobs. That ratio is the open loop's (predicted from exact layers); predicted
from decoded layers the residual is larger, so a section loses more than the plain
level does.

Measured by ``kvwire bench quality --ablation layer-predicted`` (``streamer.model.ablation``):
one blob per layer, its bytes counted with one blob's header for the whole chunk, as a
format carrying the prediction would. Pure functions on tensors plus ``codec``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

import codec
from codec import container
from codec.allocation import MAX_WEIGHT
from codec.rotary import rotate

#: The largest target a residual profile's coarsest level may be given (targets are
#: MSE/var, below 1).
MAX_TARGET = 0.5

#: Ridge added to the normal equations' diagonal, relative to its mean: the map from a
#: layer's 2 x heads x head_dim values to the next layer's is fitted on a few thousand
#: tokens, and a few directions barely vary.
RIDGE = 1e-4


@dataclass(frozen=True)
class LayerPredictor:
    """The fitted maps (``maps[l]``: [2C + 1, 2C] float64 from layer l-1's K and V and a
    constant to layer l's; None for layer 0) and the residuals' profile, one layer per
    profile (``layer_profiles``) so that each layer is coded after the one before it is
    decoded."""

    maps: list[torch.Tensor | None]
    layer_profiles: list[codec.Profile]
    #: header bytes a whole chunk's blob has beyond a one-layer blob's: its other layers'
    #: section table entries
    extra_header_bytes: int


def position_free(kv: torch.Tensor, rotary: codec.Rotary | None) -> torch.Tensor:
    """float32 [layers, tokens, 2C] of a context starting at position 0: K (RoPE removed
    when ``rotary``) then V, per token."""
    layers, _, tokens, heads, head_dim = kv.shape
    k = kv[:, 0].reshape(layers, tokens, heads * head_dim).float()
    if rotary is not None:
        k = rotate(k, rotary, rotary.angles(0, tokens), inverse=True)
    return torch.cat([k, kv[:, 1].reshape(layers, tokens, heads * head_dim).float()], dim=2)


def as_kv(values: torch.Tensor, heads: int, head_dim: int, rotary: codec.Rotary | None = None) -> torch.Tensor:
    """The inverse of :func:`position_free`: [layers, 2, tokens, heads, head_dim], RoPE put
    back when ``rotary``."""
    layers, tokens, _ = values.shape
    channels = heads * head_dim
    k, v = values[..., :channels], values[..., channels:]
    if rotary is not None:
        k = rotate(k.contiguous(), rotary, rotary.angles(0, tokens))
    return torch.stack([k, v], dim=1).reshape(layers, 2, tokens, heads, head_dim).contiguous()


def _with_constant(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x.double(), torch.ones(x.shape[0], 1, dtype=torch.float64)], dim=1)


def fit_maps(values: torch.Tensor) -> list[torch.Tensor | None]:
    """Per layer the least-squares map (ridge ``RIDGE``) from the previous layer's
    position-free K and V to this layer's, over every token of ``values`` [L, N, 2C]."""
    maps: list[torch.Tensor | None] = [None]
    for layer in range(1, values.shape[0]):
        x = _with_constant(values[layer - 1])
        gram = x.T @ x
        gram += RIDGE * torch.diagonal(gram).mean() * torch.eye(gram.shape[0], dtype=torch.float64)
        maps.append(torch.linalg.solve(gram, x.T @ values[layer].double()))
    return maps


def residuals(values: torch.Tensor, maps: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """Each layer of ``values`` [L, T, 2C] less its prediction from the previous layer's
    exact values (calibration's open loop)."""
    out = values.clone()
    for layer in range(1, values.shape[0]):
        out[layer] -= (_with_constant(values[layer - 1]) @ maps[layer]).float()
    return out


def _section_variance(values: torch.Tensor, channels: int) -> np.ndarray:
    """[L, 2] total variance about the mean of K's and V's channels."""
    var = values.double().var(dim=1, unbiased=False)
    return torch.stack([var[:, :channels].sum(1), var[:, channels:].sum(1)], dim=1).numpy()


def fit(samples: Sequence[torch.Tensor], profile: codec.Profile) -> LayerPredictor:
    """The predictor of ``profile``'s model: maps fitted on ``samples`` (calibration KV,
    each starting at position 0), and per layer a one-layer profile of the residuals, with
    ``profile``'s sink tokens and each section's target (the level's, times the section's
    weight) times the residual's measured variance ratio: the layer's targets scaled by
    the K and V ratios' geometric mean, the rest in its weights."""
    rotary = profile.rotary
    heads, head_dim = profile.heads, profile.head_dim
    values = [position_free(kv, rotary) for kv in samples]
    everything = torch.cat(values, dim=1)   # [L, N, 2C]
    maps = fit_maps(everything)
    left = [residuals(v, maps) for v in values]
    ratio = _section_variance(everything, heads * head_dim) / np.maximum(
        _section_variance(torch.cat(left, dim=1), heads * head_dim), 1e-30)
    base = np.ones((profile.layers, 2)) if profile.weights is None else profile.weights.astype(np.float64)
    multiple = base * ratio
    layer_profiles = []
    for layer in range(profile.layers):
        scale = float(np.clip(np.sqrt(multiple[layer].prod()), 1.0 / MAX_WEIGHT, MAX_TARGET / max(profile.targets)))
        weights = np.clip(multiple[layer] / scale, 1.0 / MAX_WEIGHT, MAX_WEIGHT).astype(np.float32)[None]
        layer_profiles.append(codec.calibrate([as_kv(r[layer:layer + 1], heads, head_dim) for r in left],
                                              targets=tuple(t * scale for t in profile.targets),
                                              sink_tokens=profile.sink_tokens, weights=weights))
    extra = container.plain_header_size(profile.layers) - container.plain_header_size(1)
    return LayerPredictor(maps, layer_profiles, extra)


def code(predictor: LayerPredictor, kv: torch.Tensor, level: int, rotary: codec.Rotary | None
         ) -> tuple[torch.Tensor, int]:
    """``kv`` (a context starting at position 0) coded layer by layer at ``level``, each
    layer's residual from the previous layer's decoded values: the decoded KV and the
    bytes a one-blob chunk would take."""
    layers, _, tokens, heads, head_dim = kv.shape
    values = position_free(kv, rotary)
    decoded = torch.empty_like(values)
    nbytes = predictor.extra_header_bytes
    for layer in range(layers):
        prediction = None if layer == 0 else (_with_constant(decoded[layer - 1]) @ predictor.maps[layer]).float()
        target = values[layer] if prediction is None else values[layer] - prediction
        profile = predictor.layer_profiles[layer]
        blob = codec.encode(as_kv(target[None], heads, head_dim).to(kv.dtype), level, profile)
        nbytes += len(blob)
        got = position_free(codec.decode(blob, profile).float(), None)[0]
        decoded[layer] = got if prediction is None else got + prediction
    return as_kv(decoded, heads, head_dim, rotary), nbytes
