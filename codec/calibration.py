"""``codec.calibrate``: a profile fitted on sample KV caches.

Above the profile and the encoder: a profile that predicts each layer from the one
before (``predict``) is fitted in closed loop, by running the encoder on the samples
(``_settled_ratios``), so this module sits on top of both.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from . import api, prediction
from .container import MAX_U16
from .errors import ProfileMismatchWarning
from .levels import DEFAULT_TARGETS
from .profile import (DEFAULT_SINK_TOKENS, PREDICT_GROUPS, CodedBody, Profile, fit_profile, split_tokens,
                      validate_kv, validate_level)
from .rotary import Rotary


def calibrate(samples: Iterable[torch.Tensor], *, targets: Sequence[float] = DEFAULT_TARGETS,
              sink_tokens: int = DEFAULT_SINK_TOKENS, transform: str = "layer",
              delta: str = "auto", design_tokens: int = 4096, rotary: Rotary | None = None,
              weights: np.ndarray | None = None, predict: int = 0, predict_groups: str = "all",
              default_level: int | None = None) -> Profile:
    """Fit a profile on sample KV caches [layers, 2, tokens, heads, head_dim].

    Each sample's first ``sink_tokens`` are left out (they are sent verbatim).
    ``transform``: "layer" (PCA across all heads; the default), "head" (PCA
    within each head) or "identity". ``delta``: "auto" switches CacheGen's
    anchor/delta coding on per (layer, K/V) only where it measures >= 1% smaller.
    ``rotary`` (the model's RoPE, e.g. ``streamer.model.rotary_of(model)``): each sample's
    keys, at positions 0 .. tokens - 1, are rotated back before fitting, and the profile
    makes encode and decode do the same at each chunk's own positions.
    ``weights`` (float32 [layers, 2], e.g. ``codec.allocation.allocate(sensitivities)``):
    each level holds layer l's K or V to its target times ``weights[l, kind]``; None
    holds every section to the level's target. Weights whose estimated bits exceed the
    uniform split's at any level are first scaled up until they do not (``_budget_weights``);
    the profile carries the weights it used.
    ``predict`` > 0: inter-layer prediction (``codec.prediction``; blobs of format 7),
    layers 0, predict, 2 predict, .. coded alone; ``predict_groups`` one of PREDICT_GROUPS
    (which channels each map reads). The maps are fitted on the samples' coded tokens, and
    the transform, steps and tables on what the maps leave (from exact previous layers).
    ``default_level``: the level ``codec.encode`` uses when its caller names none (None:
    the codec's, ``DEFAULT_LEVEL``, or the coarsest of fewer ``targets``).
    """
    if not isinstance(predict, int) or isinstance(predict, bool) or not 0 <= predict <= MAX_U16:
        raise ValueError(f"predict must be an int in [0, {MAX_U16}] (0: no prediction), got {predict!r}")
    if predict_groups not in PREDICT_GROUPS:
        raise ValueError(f"predict_groups must be one of {PREDICT_GROUPS}, got {predict_groups!r}")
    if rotary is not None and not isinstance(rotary, Rotary):
        raise ValueError(f"rotary must be a codec.Rotary or None, got {type(rotary).__name__}")
    if default_level is not None:
        validate_level(default_level, len(targets))
    bodies: list[list[list[torch.Tensor]]] = []
    kept_samples: list[torch.Tensor] = []
    shape = None
    for kv in samples:
        validate_kv(kv)
        L, _, T, H, D = kv.shape
        if shape is not None and (L, H, D) != shape:
            raise ValueError(f"calibration samples disagree on shape: {shape} vs {(L, H, D)}")
        shape = (L, H, D)
        if rotary is not None and rotary.head_dim != D:
            raise ValueError(f"rotary head_dim {rotary.head_dim} does not match the samples' head_dim {D}")
        if T > sink_tokens:
            bodies.append(split_tokens(kv, sink_tokens, rotary))
            kept_samples.append(kv)
    if shape is None:
        raise ValueError("calibrate needs at least one sample")
    if not bodies:
        raise ValueError(f"calibration samples have no tokens beyond the {sink_tokens} sink tokens")
    L, H, D = shape
    tokens = [[torch.cat([b[l][i] for b in bodies]) for i in range(2)] for l in range(L)]
    fit = functools.partial(fit_profile, heads=H, head_dim=D, targets=targets, sink_tokens=sink_tokens,
                            transform_kind=transform, delta=delta, design_tokens=design_tokens, rotary=rotary,
                            weights=weights)
    if not predict:
        profile = fit(tokens)
    else:
        profile = _fit_predicted(fit, tokens, kept_samples, [b[0][0].shape[0] for b in bodies], H, len(targets),
                                 predict, predict_groups)
    if default_level is not None:
        profile = dataclasses.replace(profile, default_level=int(default_level))
    return profile


def calibrate_like(profile: Profile, samples: Iterable[torch.Tensor], *, predict: int,
                   predict_groups: str = "all") -> Profile:
    """``profile`` calibrated again on ``samples`` with its targets, sink tokens, transform,
    RoPE, weights and default level, and ``predict`` (as in :func:`calibrate`): a profile's
    twin with (or without) prediction, for measuring one beside the other."""
    return calibrate(samples, targets=profile.targets, sink_tokens=profile.sink_tokens, transform=profile.transform,
                     rotary=profile.rotary, weights=profile.weights, predict=predict, predict_groups=predict_groups,
                     default_level=profile.default_level)


def _sections_variance(values: torch.Tensor) -> np.ndarray:
    """[L, 2]: the summed channel variances of K's and of V's half of ``values`` [L, N, 2C]."""
    channels = values.shape[2] // 2
    var = values.double().var(dim=1, unbiased=False)
    return torch.stack([var[:, :channels].sum(1), var[:, channels:].sum(1)], dim=1).numpy()


def _fit_predicted(fit: Callable[..., Profile], tokens: list[list[torch.Tensor]], samples: list[torch.Tensor],
                   sizes: list[int], heads: int, levels: int, restart: int, groups: str) -> Profile:
    """A predicting profile: maps fitted on the coded tokens (``tokens``, the ``samples``'
    coded tokens of ``sizes`` each, concatenated), the transform, steps and tables on what
    the maps leave. How much a residual's steps may grow against the values' error
    depends on the level: predicted from a coarser decode the residual is larger. So the
    steps are designed twice: from the open loop's variance ratio (maps on exact layers),
    then, after each level's chain has run on the samples as the encoder runs it, where
    the chain settles (``_settled_ratios``)."""
    values = torch.stack([torch.cat(pair, dim=1) for pair in tokens])          # [L, N, 2C]
    channels = values.shape[2] // 2
    factors: tuple[np.ndarray, np.ndarray] | None = None
    if groups == "low-rank":
        predictor, entry, exit_ = prediction.fit_low_rank(values, restart, min(prediction.LOW_RANK, channels))
        factors = (entry, exit_)
    else:
        grouping = {"all": None, "kind": prediction.kind_groups(channels),
                    "head": prediction.head_groups(heads, channels // heads)}[groups]
        predictor = prediction.fit(values, restart, grouping)
    if not all(np.all(np.isfinite(array)) for array in (predictor, *(factors or ()))):
        raise ValueError("inter-layer maps do not fit in float16 (calibration KV too large)")
    left = prediction.residuals(values, predictor, restart)
    variance, open_variance = _sections_variance(values), _sections_variance(left)
    split = [[left[l, :, :channels], left[l, :, channels:]] for l in range(values.shape[0])]
    open_ratio = np.repeat((variance / np.maximum(open_variance, 1e-30))[None], levels, axis=0)
    fit = functools.partial(fit, predictor=predictor, restart=restart, predictor_factors=factors)
    first = fit(split, design_ratio=open_ratio)
    exact = list(zip(samples, values.split(sizes, dim=1)))
    settled = np.stack([_settled_ratios(first, level, exact, variance, open_variance) for level in range(levels)])
    return fit(split, design_ratio=settled)


def _settled_ratios(profile: Profile, level: int, samples: list[tuple[torch.Tensor, torch.Tensor]],
                    variance: np.ndarray, open_variance: np.ndarray) -> np.ndarray:
    """[L, 2]: the values' variance over that of the residual ``level`` codes once every
    layer is coded to its target error. A residual predicted from a decoded layer has the
    open loop's variance plus the previous layer's error carried through the map
    (``coded = open + gain * error``); one run of the level's chain on ``samples`` (each
    a KV and its coded tokens' values, [L, N, 2C]) measures each layer's ``gain``, and
    the ratio is taken where the previous layer's error is its target (a second run
    would swing the other way)."""
    coded, errors = [[] for _ in range(profile.layers)], np.zeros(profile.layers)
    tokens = 0
    for kv, exact in samples:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ProfileMismatchWarning)
            got = CodedBody(api.decode(api.encode(kv, level, profile), profile), profile.sink_tokens, profile.rotary)
        previous = None
        for layer, x in enumerate(exact):
            x_hat = got.layer(layer).permute(1, 0, 2).flatten(1)                # [N, 2C], as ``exact``
            if previous is not None and not prediction.is_intra(layer, profile.restart):
                coded[layer].append(x - prediction.predict_rows(previous, profile.predictor32[layer]))
            errors[layer] += float((x_hat - x).double().pow(2).sum())
            previous = x_hat
        tokens += exact.shape[1]
    error = errors / max(tokens, 1)                                               # per token, K and V
    wanted = (np.array(profile.targets_by_section(level)) * variance).sum(axis=1)
    ratios = np.ones_like(variance)
    for layer in range(1, profile.layers):
        if coded[layer]:
            measured = _sections_variance(torch.cat(coded[layer])[None])[0]
            gain = np.maximum(measured - open_variance[layer], 0.0) / max(error[layer - 1], 1e-30)
            ratios[layer] = variance[layer] / np.maximum(open_variance[layer] + gain * wanted[layer - 1], 1e-30)
    return ratios
