"""Distortion allocation across (layer, K/V) sections: from sensitivities to target weights.

A level's target t is one MSE/var for the whole cache, but a unit of MSE/var does not
cost the model the same everywhere: some layers' keys or values move its output far more
than others' (``streamer.model.sensitivity`` measures by how much). With a quality proxy
that adds up over sections, ``sum_s s_s * t_s`` for sensitivities ``s_s``, and the
high-rate rate model, bits ~ -0.5 * log2(t_s) per element (every section has the same
number of elements), the best split of a fixed bit budget is reverse water-filling:
``t_s`` proportional to ``1 / s_s``, scaled so the geometric mean of the ``t_s`` is ``t``
(the same bits as the uniform split). Weights are clamped to [1 / MAX_WEIGHT, MAX_WEIGHT]
so no section is starved or coded needlessly well; under the clamp the optimum is still
``w_s = clip(c / s_s)`` with the one scale ``c`` that keeps the geometric mean at 1
(Karush-Kuhn-Tucker), found by bisection.

The high-rate model is off at low rates: a section coded coarser saves fewer bits than a
finer one spends (its entropy cannot fall below 0), so at equal geometric mean the
weighted split costs more than the uniform one. ``fit_to_budget`` therefore scales the
weights up, ``clip(c * w)`` with the smallest ``c >= 1``, until a measured bit estimate
(``codec.profile`` uses each section's rate-distortion curve on the calibration sample)
is no more than the uniform split's.

A profile stores the weights ``[layers, 2]`` (one set for every level: the proxy is linear
in the targets, so the optimal split does not depend on the level); the closed-loop step
control then holds each section to ``t * w_s`` (``Profile.section_target``).
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

#: weights stay within [1 / MAX_WEIGHT, MAX_WEIGHT]: no section is coded more than 8x
#: coarser (or finer) than the level's target, whatever its measured sensitivity
MAX_WEIGHT = 8.0
_BISECTION_STEPS = 100


def allocate(sensitivity: np.ndarray, max_weight: float = MAX_WEIGHT) -> np.ndarray:
    """Per-section target weights (float32, the shape of ``sensitivity``) minimising
    ``sum(s * w)`` subject to ``mean(log w) = 0`` (equal bits) and
    ``1 / max_weight <= w <= max_weight``.

    ``sensitivity``: the proxy's change per unit MSE/var of each section, finite and
    positive (a section measured as insensitive should be given a small positive value,
    e.g. the smallest measured one; the clamp then decides its weight).
    """
    s = np.asarray(sensitivity, dtype=np.float64)
    if s.size == 0:
        raise ValueError("allocate needs at least one sensitivity")
    if not np.all(np.isfinite(s)) or np.any(s <= 0):
        raise ValueError("sensitivities must be finite and positive")
    if not math.isfinite(max_weight) or max_weight < 1:
        raise ValueError(f"max_weight must be finite and >= 1, got {max_weight!r}")
    bound = math.log(max_weight)
    log_inverse = -np.log(s)

    def log_weights(shift: float) -> np.ndarray:
        return np.clip(log_inverse + shift, -bound, bound)

    # mean(log_weights(shift)) rises monotonically with shift, from -bound to +bound
    lo = -float(log_inverse.max()) - bound
    hi = -float(log_inverse.min()) + bound
    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        if float(log_weights(mid).mean()) < 0:
            lo = mid
        else:
            hi = mid
    return np.exp(log_weights(0.5 * (lo + hi))).astype(np.float32)


def fit_to_budget(weights: np.ndarray, overspend: Callable[[np.ndarray], float],
                  max_weight: float = MAX_WEIGHT, steps: int = 24) -> np.ndarray:
    """``weights`` scaled up to ``clip(c * weights)`` with the smallest ``c >= 1`` whose
    ``overspend`` (e.g. estimated bits minus the uniform split's) is at most 0.

    The geometric-mean normalisation of ``allocate`` means equal bits only at high rate;
    at low rate a section coded coarser saves fewer bits than a finer one spends, so the
    allocation would cost more than the uniform split. ``overspend`` must not rise with c
    (coarser targets never cost more bits); ``c = max_weight ** 2`` puts every weight at
    ``max_weight``, i.e. every target at least the uniform one, so it always fits.
    Weights already within budget (uniform ones, say) are returned as they are.
    """
    w = np.asarray(weights, dtype=np.float64)
    if overspend(w.astype(np.float32)) <= 0:
        return w.astype(np.float32)

    def scaled(log_c: float) -> np.ndarray:
        return np.clip(w * math.exp(log_c), 1 / max_weight, max_weight).astype(np.float32)

    lo, hi = 0.0, 2 * math.log(max_weight)  # overspend(lo) > 0 >= overspend(hi)
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        if overspend(scaled(mid)) <= 0:
            hi = mid
        else:
            lo = mid
    return scaled(hi)


def validate_weights(weights: np.ndarray, layers: int) -> None:
    """ValueError unless ``weights`` is float32 [layers, 2], finite, within the clamp."""
    if not isinstance(weights, np.ndarray) or weights.dtype != np.float32 or weights.shape != (layers, 2):
        got = (getattr(weights, "dtype", type(weights)), getattr(weights, "shape", None))
        raise ValueError(f"profile.weights must be float32 ({layers}, 2), got {got}")
    # a float32 rounding's worth of slack at the bounds
    if not np.all(np.isfinite(weights)) or np.any(weights < np.float32(1 / MAX_WEIGHT) * (1 - 1e-6)) \
            or np.any(weights > np.float32(MAX_WEIGHT) * (1 + 1e-6)):
        raise ValueError(f"profile.weights must be finite and within [1/{MAX_WEIGHT:g}, {MAX_WEIGHT:g}]")
