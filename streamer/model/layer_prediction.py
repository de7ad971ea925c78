"""Inter-layer prediction, measured on the model before it is built into the format.

Each layer's (position-free) K and V are predicted from the previous layer's *decoded*
K and V by one linear map per layer, fitted by least squares on calibration KV (as
AQUA-KV does), and only the residual is coded, by the real encoder, with a profile
calibrated on the calibration KV's residuals. The decoder does the same in layer order:
a layer needs only the layers before it, so layer-ordered delivery survives, and a
chunk's first layer is coded alone (an intra-coded layer).

The residual has less variance than the layer it predicts, and a level's target is
relative to the variance of what is coded, so each layer's residual profile holds every
section to the plain profile's target times the variance ratio of the values to the
residual, aiming at the plain level's absolute error so that the bits the prediction
saves show as smaller blobs at the same error. That ratio is measured in closed loop:
predicted from decoded layers the residual is larger than from exact ones, the more so
the coarser the level (:func:`fit`).

Two choices make a format carrying prediction practical, and are measured too:
block-diagonal maps (a full map per layer is 2C x 2C numbers, together twice a profile's
bases, and 2C multiply-adds per decoded value), and restart layers coded alone every few
layers, where a decode can start without the layers before it (a continued chunk).

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

#: How a layer's channels are predicted: ``all`` from every channel of the previous
#: layer (one 2C x 2C map), ``kind`` K from K and V from V, ``head`` each KV head's K and V
#: from that head's K and V (block-diagonal maps: fewer numbers and multiply-adds).
GROUPINGS = ("all", "kind", "head")


def channel_groups(grouping: str, heads: int, head_dim: int) -> list[torch.Tensor]:
    """The position-free channel indices (K's C, then V's C) of each predicted group."""
    channels = heads * head_dim
    every = torch.arange(2 * channels)
    if grouping == "all":
        return [every]
    if grouping == "kind":
        return [every[:channels], every[channels:]]
    if grouping == "head":
        return [torch.cat([every[h * head_dim:(h + 1) * head_dim],
                           every[channels + h * head_dim:channels + (h + 1) * head_dim]]) for h in range(heads)]
    raise ValueError(f"grouping must be one of {GROUPINGS}, got {grouping!r}")


@dataclass(frozen=True)
class LayerMap:
    """One layer's prediction: each group's channels (``groups[g]``) from the same channels
    of the previous layer's position-free K and V and a constant (``maps[g]``: [n + 1, n])."""

    groups: list[torch.Tensor]
    maps: list[torch.Tensor]

    def predict(self, previous: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(previous)
        for index, matrix in zip(self.groups, self.maps):
            out[:, index] = (_with_constant(previous[:, index]) @ matrix).float()
        return out

    @property
    def values(self) -> int:
        """Numbers a profile would carry for this map."""
        return sum(m.numel() for m in self.maps)


@dataclass(frozen=True)
class LayerPredictor:
    """The fitted maps (``maps[l]``: layer l's prediction; None for an intra-coded layer,
    layer 0 and every ``restart``-th) and the residuals' profile, one layer per profile
    (``layer_profiles``) so that each layer is coded after the one before it is decoded."""

    maps: list[LayerMap | None]
    layer_profiles: list[codec.Profile]
    #: header bytes a whole chunk's blob has beyond a one-layer blob's: its other layers'
    #: section table entries
    extra_header_bytes: int

    def facts(self) -> dict:
        """What the prediction costs beside its bits (modelled, not timed): the numbers its
        maps add to a profile, and the multiply-adds per decoded value it adds to a decode
        (one per map entry and token, over every layer's 2C values)."""
        channels = self.layer_profiles[0].channels * 2
        values = sum(m.values for m in self.maps if m is not None)
        return {"map_values": values,
                "intra_layers": sum(m is None for m in self.maps),
                "added_multiply_adds_per_value": round(values / (channels * len(self.maps)), 1)}


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


def fit_maps(values: torch.Tensor, groups: Sequence[torch.Tensor], *, restart: int = 0
             ) -> list[LayerMap | None]:
    """Per layer the least-squares map (ridge ``RIDGE``) of each group of channels from the
    same channels of the previous layer, over every token of ``values`` [L, N, 2C].
    ``restart`` > 0: layers 0, restart, 2 restart, .. are intra-coded (no map), so that a
    decode can start there."""
    maps: list[LayerMap | None] = [None]
    for layer in range(1, values.shape[0]):
        if restart and layer % restart == 0:
            maps.append(None)
            continue
        fitted = []
        for index in groups:
            x = _with_constant(values[layer - 1][:, index])
            gram = x.T @ x
            gram += RIDGE * torch.diagonal(gram).mean() * torch.eye(gram.shape[0], dtype=torch.float64)
            fitted.append(torch.linalg.solve(gram, x.T @ values[layer][:, index].double()))
        maps.append(LayerMap(list(groups), fitted))
    return maps


def residuals(values: torch.Tensor, maps: Sequence[LayerMap | None]) -> torch.Tensor:
    """Each layer of ``values`` [L, T, 2C] less its prediction from the previous layer's
    exact values (calibration's open loop)."""
    out = values.clone()
    for layer in range(1, values.shape[0]):
        if maps[layer] is not None:
            out[layer] -= maps[layer].predict(values[layer - 1])
    return out


def _section_variance(values: torch.Tensor, channels: int) -> np.ndarray:
    """[L, 2] total variance about the mean of K's and V's channels."""
    var = values.double().var(dim=1, unbiased=False)
    return torch.stack([var[:, :channels].sum(1), var[:, channels:].sum(1)], dim=1).numpy()


def _layer_profiles(left: Sequence[torch.Tensor], profile: codec.Profile, ratios: np.ndarray
                    ) -> list[codec.Profile]:
    """Per layer a one-layer profile of the residuals ``left`` (each [L, T, 2C]) holding
    each (layer, K/V) at each level to the plain profile's target times its weight times
    ``ratios[level, layer, kind]`` (the variance of the values over that of the residual
    coded): the plain level's absolute error. A profile has one target per level and one
    weight per section, so each level's target is scaled by the K and V multiples'
    geometric mean and the weights split K from V by their mean over the levels."""
    heads, head_dim = profile.heads, profile.head_dim
    base = np.ones((profile.layers, 2)) if profile.weights is None else profile.weights.astype(np.float64)
    out = []
    for layer in range(profile.layers):
        multiple = base[layer][None] * ratios[:, layer]                       # [levels, 2]
        scale = np.sqrt(multiple.prod(axis=1))
        split = np.exp(np.log(multiple / scale[:, None]).mean(axis=0))
        targets = []
        for target, s in zip(profile.targets, scale):
            value = target * float(np.clip(s, 1.0 / MAX_WEIGHT, MAX_TARGET / target))
            targets.append(max(value, targets[-1] * (1 + 1e-6)) if targets else value)
        weights = np.clip(split, 1.0 / MAX_WEIGHT, MAX_WEIGHT).astype(np.float32)[None]
        out.append(codec.calibrate([as_kv(r[layer:layer + 1], heads, head_dim) for r in left],
                                   targets=tuple(targets), sink_tokens=profile.sink_tokens, weights=weights))
    return out


def fit(samples: Sequence[torch.Tensor], profile: codec.Profile, *, grouping: str = "all",
        restart: int = 0) -> LayerPredictor:
    """The predictor of ``profile``'s model: maps fitted on ``samples`` (calibration KV,
    each starting at position 0; ``grouping`` one of GROUPINGS, ``restart`` as in
    :func:`fit_maps`), and per layer a one-layer profile of the residuals aiming at the
    plain level's absolute error.

    What a residual's variance is depends on the level: predicted from a coarser decode it
    is larger. So the targets are set in closed loop: a first set from the open loop's
    variance ratio (prediction from exact layers), then each level's chain is run on the
    samples as the decoder will run it and the targets set again where it settles
    (:func:`_fixed_point_ratios`)."""
    channels = profile.channels
    values = [position_free(kv, profile.rotary) for kv in samples]
    everything = torch.cat(values, dim=1)   # [L, N, 2C]
    maps = fit_maps(everything, channel_groups(grouping, profile.heads, profile.head_dim), restart=restart)
    left = [residuals(v, maps) for v in values]
    variance = _section_variance(everything, channels)
    open_loop = variance / np.maximum(_section_variance(torch.cat(left, dim=1), channels), 1e-30)
    levels = len(profile.targets)
    extra = container.plain_header_size(profile.layers) - container.plain_header_size(1)
    first = LayerPredictor(maps, _layer_profiles(left, profile, np.repeat(open_loop[None], levels, 0)), extra)
    ratios = np.stack([_fixed_point_ratios(first, profile, level, values, samples, variance, open_loop)
                       for level in range(levels)])
    return LayerPredictor(maps, _layer_profiles(left, profile, ratios), extra)


def _fixed_point_ratios(predictor: LayerPredictor, profile: codec.Profile, level: int,
                        values: Sequence[torch.Tensor], samples: Sequence[torch.Tensor],
                        variance: np.ndarray, open_loop: np.ndarray) -> np.ndarray:
    """[L, 2] the variance of the values over that of the residual ``level`` will code
    once every layer is coded to the plain level's absolute error.

    A residual predicted from a decoded layer has the open loop's variance plus the
    previous layer's error carried through the map: ``var_r = var_open + gain * error``.
    One run of the level's chain (coded to ``predictor``'s targets) measures each layer's
    ``gain``; the ratio is then taken where the previous layer's error is the plain
    level's, so the targets need no second run (which would swing the other way)."""
    channels = profile.channels
    coded, errors = [], []
    for v, kv in zip(values, samples):
        decoded, residual, _ = _chain(predictor, v, level, profile.heads, profile.head_dim, kv.dtype)
        coded.append(residual)
        errors.append((decoded - v).double().pow(2).sum(dim=2))   # [L, T]
    measured = _section_variance(torch.cat(coded, dim=1), channels)
    error = torch.cat(errors, dim=1).mean(dim=1).numpy()          # [L] squared error per token
    open_variance = variance / open_loop
    wanted = (np.array(profile.targets_by_section(level)) * variance).sum(axis=1)   # [L]
    ratios = np.ones_like(variance)
    for layer, layer_map in enumerate(predictor.maps):
        if layer_map is None:
            continue
        gain = np.maximum(measured[layer] - open_variance[layer], 0.0) / max(error[layer - 1], 1e-30)
        ratios[layer] = variance[layer] / np.maximum(open_variance[layer] + gain * wanted[layer - 1], 1e-30)
    return ratios


def _chain(predictor: LayerPredictor, values: torch.Tensor, level: int, heads: int, head_dim: int,
           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Position-free ``values`` [L, T, 2C] coded layer by layer at ``level`` as the decoder
    will decode them, each layer's residual from the previous layer's decoded values:
    (decoded values, the residuals coded, the bytes a one-blob chunk would take)."""
    decoded = torch.empty_like(values)
    coded = torch.empty_like(values)
    nbytes = predictor.extra_header_bytes
    for layer, layer_map in enumerate(predictor.maps):
        prediction = None if layer_map is None else layer_map.predict(decoded[layer - 1])
        coded[layer] = values[layer] if prediction is None else values[layer] - prediction
        profile = predictor.layer_profiles[layer]
        blob = codec.encode(as_kv(coded[layer][None], heads, head_dim).to(dtype), level, profile)
        nbytes += len(blob)
        got = position_free(codec.decode(blob, profile).float(), None)[0]
        decoded[layer] = got if prediction is None else got + prediction
    return decoded, coded, nbytes


def code(predictor: LayerPredictor, kv: torch.Tensor, level: int, rotary: codec.Rotary | None
         ) -> tuple[torch.Tensor, int]:
    """``kv`` (a context starting at position 0) coded layer by layer at ``level``, each
    layer's residual from the previous layer's decoded values: the decoded KV and the
    bytes a one-blob chunk would take."""
    _, _, _, heads, head_dim = kv.shape
    decoded, _, nbytes = _chain(predictor, position_free(kv, rotary), level, heads, head_dim, kv.dtype)
    return as_kv(decoded, heads, head_dim, rotary), nbytes
