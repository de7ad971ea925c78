"""The step design: the calibrated step per level is the bisection's answer, computed fast.

``design_step`` stops its bisection once both ends of the bracket round to the same
float32 step, and ``distortion`` works in place; both must give exactly what the plain
40-step bisection over the textbook formula gives, or every profile's bytes would move.
"""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from codec import levels


def _plain_distortion(coef, variances, step, allow_drop):
    kept = levels.kept_components(variances, step) if allow_drop else coef.shape[0]
    head = coef[:kept]
    err = (head - np.rint(head / step) * step).astype(np.float64)
    return float(np.mean(np.sum(err * err, axis=0))) + float(variances[kept:].sum())


def _plain_design(coef, variances, target, allow_drop):
    goal = target * float(variances.sum())
    scale = float(np.sqrt(variances.max()))
    lo, hi = np.log(scale * 1e-7), np.log(scale * 1e3)
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        if _plain_distortion(coef, variances, float(np.exp(mid)), allow_drop) <= goal:
            lo = mid
        else:
            hi = mid
    step = float(np.float32(np.exp(lo)))
    return step, levels.kept_components(variances, step) if allow_drop else coef.shape[0]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), channels=st.integers(1, 24), tokens=st.integers(1, 80),
       log_scale=st.floats(-12, 8), target=st.sampled_from(levels.DEFAULT_TARGETS + (0.3, 0.9)),
       allow_drop=st.booleans())
def test_design_step_is_the_plain_bisections_answer(seed, channels, tokens, log_scale, target, allow_drop):
    rng = np.random.default_rng(seed)
    spread = np.sort(rng.lognormal(0.0, 2.0, channels))[::-1]
    coef = (rng.standard_normal((channels, tokens)) * spread[:, None] * np.exp(log_scale)).astype(np.float32)
    variances = coef.astype(np.float64).var(axis=1)
    if variances.sum() <= 0:
        return
    step = float(np.exp(log_scale))
    assert levels.distortion(coef, variances, step, allow_drop) == _plain_distortion(coef, variances, step,
                                                                                      allow_drop)
    assert levels.design_step(coef, variances, target, allow_drop) == _plain_design(coef, variances, target,
                                                                                     allow_drop)
