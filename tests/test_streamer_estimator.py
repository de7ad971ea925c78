"""Throughput estimators: definitions, robustMPC discount and invariances."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from streamer.adapt.estimator import (harmonic_mean, last_sample, prediction_errors,
                                      robust_estimate, throughputs)
from streamer.adapt.base import Observation

observations = st.builds(
    Observation,
    bytes=st.integers(1, 10**9),
    busy_seconds=st.floats(1e-4, 100.0),
)
histories = st.lists(observations, min_size=1, max_size=20)
windows = st.integers(1, 8)


def _rates(history: list[Observation]) -> np.ndarray:
    return np.array([o.bytes / o.busy_seconds for o in history])


def test_no_information_is_none_and_prior_is_used() -> None:
    for f in (last_sample, harmonic_mean, robust_estimate):
        assert f([]) is None
        assert f([], prior=5e6) == 5e6
        assert f([Observation(1000, 0.0)]) is None   # zero duration says nothing
    assert prediction_errors([]).size == 0


def test_zero_duration_and_empty_observations_are_ignored() -> None:
    history = [Observation(1000, 0.5), Observation(500, 0.0), Observation(0, 0.2),
               Observation(3000, 1.0)]
    assert throughputs(history).tolist() == [2000.0, 3000.0]
    assert last_sample(history) == 3000.0


def test_prior_is_ignored_once_there_is_a_sample() -> None:
    history = [Observation(1000, 1.0)]
    assert last_sample(history, prior=1e9) == 1000.0
    assert robust_estimate(history, prior=1e9) == 1000.0


def test_harmonic_mean_uses_only_the_window() -> None:
    history = [Observation(100, 1.0)] + [Observation(400, 1.0)] * 3
    assert harmonic_mean(history, window=3) == pytest.approx(400.0)
    assert harmonic_mean(history, window=4) == pytest.approx(4 / (1 / 100 + 3 / 400))


def test_prediction_errors_match_a_direct_computation() -> None:
    history = [Observation(b, 1.0) for b in (100, 200, 50, 400, 100, 300, 80)]
    window = 3
    rates = _rates(history)
    expected = []
    for i in range(1, rates.size):
        past = rates[max(0, i - window):i]
        pred = past.size / np.sum(1 / past)
        expected.append(abs(pred - rates[i]) / rates[i])
    np.testing.assert_allclose(prediction_errors(history, window), expected)


def test_robust_estimate_discounts_by_the_worst_recent_error() -> None:
    history = [Observation(b, 1.0) for b in (100, 200, 50, 400, 100, 300, 80)]
    errors = prediction_errors(history, 3)[-3:]
    assert robust_estimate(history, 3) == pytest.approx(
        harmonic_mean(history, 3) / (1 + errors.max()))


def test_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="window"):
        harmonic_mean([Observation(1, 1.0)], window=0)


@given(histories, windows)
def test_harmonic_mean_is_at_most_the_arithmetic_mean(history, window) -> None:
    rates = _rates(history)[-window:]
    assert harmonic_mean(history, window) <= rates.mean() * (1 + 1e-12)
    assert rates.min() * (1 - 1e-12) <= harmonic_mean(history, window)


@given(histories, windows)
def test_robust_is_at_most_harmonic(history, window) -> None:
    robust = robust_estimate(history, window)
    assert 0 < robust <= harmonic_mean(history, window)
    assert np.all(prediction_errors(history, window) >= 0)


@given(histories, windows, st.sampled_from([2, 3, 1000, 2**20]))
def test_scaling_bytes_scales_every_estimate(history, window, k) -> None:
    scaled = [Observation(o.bytes * k, o.busy_seconds) for o in history]
    for f in (harmonic_mean, robust_estimate):
        assert f(scaled, window) == pytest.approx(k * f(history, window), rel=1e-9)
        assert f([], window, prior=k * 1e6) == pytest.approx(k * f([], window, prior=1e6))
    assert last_sample(scaled) == pytest.approx(k * last_sample(history), rel=1e-12)
    np.testing.assert_allclose(prediction_errors(scaled, window),
                               prediction_errors(history, window), rtol=1e-9, atol=1e-12)


@given(st.integers(1, 10**8), st.floats(1e-3, 10.0), st.integers(1, 15), windows)
def test_constant_link_is_estimated_exactly(nbytes, seconds, count, window) -> None:
    history = [Observation(nbytes, seconds)] * count
    rate = nbytes / seconds
    assert robust_estimate(history, window) == pytest.approx(rate, rel=1e-9)
    assert math.isclose(last_sample(history), rate)
