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

A profile stores the weights ``[layers, 2]`` (one set for every level: the proxy is linear
in the targets, so the optimal split does not depend on the level); the closed-loop step
control then holds each section to ``t * w_s`` (``Profile.section_target``).
"""
from __future__ import annotations

import math

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


def validate_weights(weights: np.ndarray, layers: int) -> None:
    """ValueError unless ``weights`` is float32 [layers, 2], finite, within the clamp."""
    if not isinstance(weights, np.ndarray) or weights.dtype != np.float32 or weights.shape != (layers, 2):
        got = (getattr(weights, "dtype", type(weights)), getattr(weights, "shape", None))
        raise ValueError(f"profile.weights must be float32 ({layers}, 2), got {got}")
    # a float32 rounding's worth of slack at the bounds
    if not np.all(np.isfinite(weights)) or np.any(weights < np.float32(1 / MAX_WEIGHT) * (1 - 1e-6)) \
            or np.any(weights > np.float32(MAX_WEIGHT) * (1 + 1e-6)):
        raise ValueError(f"profile.weights must be finite and within [1/{MAX_WEIGHT:g}, {MAX_WEIGHT:g}]")
