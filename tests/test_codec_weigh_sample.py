"""``control.weigh_sample`` (a numba kernel) against the numpy statement of the same rule.

The step control's outlier weighting was numpy code; the kernel computes it in one pass
per statistic. A slip in it (a pass too few, the median taken before the last pass, the
scale applied in the wrong precision) moves every step the control picks, so it is
checked here against the rule written the obvious way, on data with and without
outliers and on the degenerate sizes (no tokens, one token)."""
from __future__ import annotations

import numpy as np
import pytest

from codec import control


def _reference(own: np.ndarray, sample: np.ndarray, mean: np.ndarray, factor: float, passes: int):
    weights = np.ones(own.shape[0])
    for _ in range(passes if own.shape[0] else 0):
        center = (weights[:, None] * own).sum(axis=0) / float(weights.sum())
        spread = np.square(own - center, dtype=np.float64).sum(axis=1)
        cap = factor * float(np.median(spread))
        with np.errstate(divide="ignore", invalid="ignore"):
            weights = np.where(spread > cap, cap / np.where(spread > 0, spread, 1.0), 1.0)
    center = (weights[:, None] * own).sum(axis=0) / max(float(weights.sum()), 1e-300)
    energy = np.square(own - center, dtype=np.float64).sum(axis=1)
    variance = float((weights * energy).sum()) / max(own.shape[0], 1)
    typical = float(np.median(energy)) if energy.size else 0.0
    centered = (sample - mean) * np.sqrt(weights, dtype=np.float32)[:, None]
    return variance, typical, centered, np.square(centered, dtype=np.float64).sum(axis=1)


def _data(tokens: int, channels: int, outliers: int, seed: int):
    rng = np.random.default_rng(seed)
    own = rng.standard_normal((tokens, channels)).astype(np.float32)
    own[rng.choice(tokens, size=min(outliers, tokens), replace=False)] *= 50.0
    sample = (own @ rng.standard_normal((channels, channels)).astype(np.float32)).astype(np.float32)
    mean = rng.standard_normal(channels).astype(np.float32)
    return own, sample, mean


@pytest.mark.parametrize("tokens,outliers", [(0, 0), (1, 0), (2, 1), (64, 0), (256, 3), (300, 40)])
def test_weigh_sample_matches_the_numpy_rule(tokens: int, outliers: int) -> None:
    own, sample, mean = _data(tokens, 16, outliers, seed=tokens + outliers)
    got = control.weigh_sample(own, sample, mean, control.OUTLIER_FACTOR, control.OUTLIER_PASSES)
    want = _reference(own, sample, mean, control.OUTLIER_FACTOR, control.OUTLIER_PASSES)
    assert got[0] == pytest.approx(want[0], rel=1e-9, abs=1e-300)
    assert got[1] == pytest.approx(want[1], rel=1e-9, abs=1e-300)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-6, atol=0)   # float32, same operations
    np.testing.assert_allclose(got[3], want[3], rtol=1e-6, atol=0)
    assert got[2].dtype == np.float32 and got[2].shape == sample.shape


def test_outliers_are_weighed_down() -> None:
    """The point of the rule: a token 50x the others' scale carries ~factor x the median
    token's energy, not its own thousands-fold."""
    own, _, _ = _data(256, 16, 3, seed=7)
    zero = np.zeros(16, np.float32)
    weighted = control.weigh_sample(own, own, zero, control.OUTLIER_FACTOR, control.OUTLIER_PASSES)[3]
    plain = np.square(own, dtype=np.float64).sum(axis=1)
    assert plain.max() > 1000 * np.median(plain)
    assert weighted.max() < 2 * control.OUTLIER_FACTOR * np.median(plain)
