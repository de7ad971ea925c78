"""Throughput estimators: definitions, the calibrated error discount and invariances."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from streamer.adapt.estimator import (ERROR_QUANTILE, MIN_SAMPLE_BYTES, SCENARIO_QUANTILES, error_factor,
                                      harmonic_mean, last_sample, log_errors, pool_sample,
                                      rate_scenarios, robust_estimate, throughputs)
from streamer.adapt import estimator
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
    assert log_errors([]).size == 0


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


def test_robust_estimate_plans_for_a_low_quantile_of_log_errors() -> None:
    history = [Observation(b, 1.0) for b in (100, 200, 50, 400, 100, 300, 80)]
    errors = log_errors(history, 3)
    expected = harmonic_mean(history, 3) * math.exp(min(0.0, float(np.quantile(errors, ERROR_QUANTILE))))
    assert robust_estimate(history, 3) == pytest.approx(expected)


def test_log_errors_match_a_direct_computation() -> None:
    history = [Observation(b, 1.0) for b in (100, 200, 50, 400)]
    rates = _rates(history)
    expected = [math.log(rates[i] / (min(i, 2) / np.sum(1 / rates[max(0, i - 2):i])))
                for i in range(1, rates.size)]
    np.testing.assert_allclose(log_errors(history, 2), expected)


@given(histories, windows)
def test_log_errors_match_the_definition_on_any_history(history, window) -> None:
    """Each sample's error against the harmonic mean of the (up to) ``window`` before it."""
    rates = _rates(history)
    expected = [math.log(rates[i] / (min(i, window) / math.fsum(1 / rates[max(0, i - window):i])))
                for i in range(1, rates.size)]
    np.testing.assert_allclose(log_errors(history, window), expected, rtol=1e-12, atol=1e-12)


@given(st.lists(st.floats(-50, 50), min_size=1, max_size=40), st.floats(0, 1))
def test_quantile_is_numpys_to_the_last_bit(values, q) -> None:
    """The estimator's own quantile (numpy's is ~0.2 ms a call on the event loop) stands
    for ``np.quantile``: the same float, so plans do not move with the implementation."""
    assert estimator._quantiles(values, [q]) == [float(np.quantile(np.array(values), q))]


def test_one_deep_fade_does_not_collapse_the_estimate() -> None:
    """robustMPC's 1 + max error would divide this estimate by ~20 for five chunks."""
    steady = [Observation(100_000_000, 1.0)] * 10
    history = steady + [Observation(5_000_000, 1.0)] + [Observation(100_000_000, 1.0)] * 3
    assert robust_estimate(history) >= 0.9 * harmonic_mean(history)


def test_a_link_that_usually_falls_short_is_planned_at_what_it_delivers() -> None:
    """Each sample 20% under the last: the harmonic mean keeps predicting too much."""
    history = [Observation(int(1e8 * 0.8 ** i), 1.0) for i in range(10)]
    assert robust_estimate(history) < 0.8 * harmonic_mean(history)


def test_the_peers_earlier_errors_calibrate_a_new_fetch() -> None:
    history = [Observation(1000, 1.0)]
    assert robust_estimate(history) == 1000.0            # nothing to calibrate on
    halved = [math.log(0.5)] * 10
    assert robust_estimate(history, prior_errors=halved) == pytest.approx(500.0)
    assert error_factor([]) is None and error_factor([0.7, 1.2]) == 1.0   # never optimistic


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


@given(histories, windows, st.sampled_from([2, 3, 1000, 2**20]))
def test_scaling_bytes_scales_every_estimate(history, window, k) -> None:
    scaled = [Observation(o.bytes * k, o.busy_seconds) for o in history]
    for f in (harmonic_mean, robust_estimate):
        assert f(scaled, window) == pytest.approx(k * f(history, window), rel=1e-9)
        assert f([], window, prior=k * 1e6) == pytest.approx(k * f([], window, prior=1e6))
    assert last_sample(scaled) == pytest.approx(k * last_sample(history), rel=1e-12)
    np.testing.assert_allclose(log_errors(scaled, window), log_errors(history, window),
                               rtol=1e-9, atol=1e-12)


@given(st.integers(1, 10**8), st.floats(1e-3, 10.0), st.integers(1, 15), windows)
def test_constant_link_is_estimated_exactly(nbytes, seconds, count, window) -> None:
    history = [Observation(nbytes, seconds)] * count
    rate = nbytes / seconds
    assert robust_estimate(history, window) == pytest.approx(rate, rel=1e-9)
    assert math.isclose(last_sample(history), rate)


def test_small_transfers_pool_into_one_sample() -> None:
    small = MIN_SAMPLE_BYTES // 3
    sample, pending = pool_sample(None, small, 0.01)
    assert sample is None and pending == Observation(small, 0.01)
    sample, pending = pool_sample(pending, small, 0.02)
    assert sample is None
    sample, pending = pool_sample(pending, small + 3, 0.03)
    assert sample.bytes == 3 * small + 3 and sample.busy_seconds == pytest.approx(0.06)
    assert pending is None
    # a big transfer is a sample of its own and leaves the pool alone
    assert pool_sample(Observation(10, 0.1), MIN_SAMPLE_BYTES, 1.0) == \
        (Observation(MIN_SAMPLE_BYTES, 1.0), Observation(10, 0.1))
    # no busy time: nothing learned
    assert pool_sample(None, small, 0.0) == (None, None)


def test_rate_scenarios_spread_with_the_peers_errors_and_not_without() -> None:
    steady = [Observation(10_000_000, 1.0)] * 6
    assert rate_scenarios([]).size == 0
    assert np.unique(rate_scenarios(steady)).tolist() == pytest.approx([10_000_000.0])   # errors all 0
    assert rate_scenarios([], prior=5e6).tolist() == [5e6]    # nothing measured: the prior
    # a peer that fell to a third of its prediction in 2 fetches out of 10
    errors = [0.0] * 8 + [math.log(1 / 3)] * 2
    rates = rate_scenarios(steady, prior_errors=errors)
    assert len(rates) == len(SCENARIO_QUANTILES)
    assert np.all(np.diff(rates) >= 0) and rates[0] < 0.5 * rates[-1]
    # the central scenario is the robust estimate; none is above the fast estimate
    assert rates[list(SCENARIO_QUANTILES).index(0.5)] == pytest.approx(robust_estimate(steady, prior_errors=errors))
    assert rates.max() <= 10_000_000.0 + 1e-6


def test_a_stalls_upper_bound_leaves_the_estimate_once_the_link_measures_more() -> None:
    """A bound says the link gave at most that while it stalled: it counts until a later
    transfer measures more (the stall is over), and stays while what follows is slower
    or only bounded too."""
    before, stall = Observation(1_000_000, 1.0), Observation(64 * 1024, 1.0, upper_bound=True)
    back = Observation(1_000_000, 1.0)
    assert throughputs([before, stall, back]).tolist() == [1_000_000, 1_000_000]
    assert robust_estimate([before, stall, back]) == pytest.approx(1_000_000)
    still_slow = Observation(10_000, 1.0)
    assert throughputs([before, stall, still_slow]).tolist() == [1_000_000, 64 * 1024, 10_000]
    assert throughputs([before, stall]).tolist() == [1_000_000, 64 * 1024]
    again = Observation(128 * 1024, 1.0, upper_bound=True)   # a bound is no measurement of the end
    assert throughputs([stall, again]).tolist() == [64 * 1024, 128 * 1024]


@given(histories, st.lists(st.booleans(), min_size=20, max_size=20))
def test_throughputs_drop_exactly_the_superseded_bounds(history, bounds) -> None:
    """Against the definition, one observation at a time: every measurement is kept, in
    order, and a bound only while nothing measured after it is faster."""
    history = [Observation(o.bytes, o.busy_seconds, upper_bound=b) for o, b in zip(history, bounds)]
    rates = _rates(history)
    expected = [r for i, (o, r) in enumerate(zip(history, rates))
                if not (o.upper_bound and any(q > r for p, q in zip(history[i + 1:], rates[i + 1:])
                                              if not p.upper_bound))]
    assert throughputs(history).tolist() == expected


def test_a_stalls_upper_bound_is_not_remembered_for_the_next_fetch() -> None:
    """A chunk judged during a long stall leaves a bound of a few kB/s; remembered, it
    would make the next fetch all text, which measures nothing, for good."""
    measured = [Observation(1_000_000, 1.0)] * 3
    stall = Observation(64 * 1024, 10.0, upper_bound=True)
    memory = estimator.remember(measured + [stall])
    assert memory is not None and memory.rate == pytest.approx(1_000_000)
    assert estimator.remember(measured + [Observation(64 * 1024, 10.0)]).rate < 100_000
    assert estimator.remember([stall]) is None


def test_a_remembered_rate_is_calibrated_by_its_errors_once() -> None:
    """The memory carries the mean and the errors beside it; the next fetch's estimate
    from them is this fetch's slow estimate, not that estimate scaled by the errors again."""
    history = [Observation(1_000_000, 1.0), Observation(400_000, 1.0), Observation(1_000_000, 1.0),
               Observation(300_000, 1.0), Observation(800_000, 1.0)]
    memory = estimator.remember(history)
    assert memory is not None and memory.rate == pytest.approx(harmonic_mean(history))
    factor = error_factor(memory.errors)
    assert factor is not None and factor < 1.0
    assert robust_estimate([], prior=memory.rate, prior_errors=memory.errors) == \
        pytest.approx(harmonic_mean(history) * factor)


def test_one_surprise_is_not_yet_a_calibration() -> None:
    """A single 64x shortfall does not divide the central estimate by 64 (the next fetches
    to the peer would go all text and measure nothing); once MIN_ERRORS agree, it does.
    The low scenarios see it at once."""
    deep = math.log(1 / 64)
    assert error_factor([deep]) == 1.0
    assert error_factor([deep] * estimator.MIN_ERRORS) == pytest.approx(1 / 64)
    assert error_factor([0.0] * 10 + [deep]) == 1.0          # many errors: the median as before
    rates = rate_scenarios([], prior=1e6, prior_errors=[deep])
    assert rates.min() < 0.5e6 and rates.max() == pytest.approx(1e6)


def _burst_then_steady(burst: float, rate: float):
    """Bytes in by time t of a transfer a shaper's full bucket starts with ``burst`` bytes."""
    return lambda t: burst + rate * max(t, 0.0)


def test_a_chunk_in_flight_is_measured_by_its_recent_half_not_its_burst() -> None:
    """A full shaper bucket lets 500 KB in at once, then the link carries 25 MB/s: the
    chunk's average so far reads twice the rate, its second half the rate itself."""
    by = _burst_then_steady(500_000, 25e6)
    sample = estimator.in_flight_sample(0.0, 0.04, by(0.04), by)
    assert sample.bytes / sample.busy_seconds == pytest.approx(25e6, rel=1e-6)
    assert by(0.04) / 0.04 == pytest.approx(37.5e6)
    # a level shift mid-chunk: 0.1 s at 100 MB/s, then 10 MB/s
    shifted = lambda t: 100e6 * min(t, 0.1) + 10e6 * max(t - 0.1, 0.0)  # noqa: E731
    sample = estimator.in_flight_sample(0.0, 0.25, shifted(0.25), shifted)
    assert sample.bytes / sample.busy_seconds == pytest.approx(10e6, rel=1e-6)


def test_a_chunk_in_flight_is_no_sample_before_it_has_run_long_enough_to_average_a_shaper() -> None:
    """A shaper releases its bucket in lumps (the shaping proxy: 10 ms of its rate at once):
    a transfer of a few ms reads line rate or nothing, so it is no sample before it has
    run MIN_PARTIAL_SECONDS, and its recent half counts only once that half has too."""
    short = estimator.MIN_PARTIAL_SECONDS
    by = _burst_then_steady(250_000, 25e6)
    assert estimator.in_flight_sample(0.0, 0.9 * short, by(0.9 * short), by) is None
    whole = estimator.in_flight_sample(0.0, 1.5 * short, by(1.5 * short), by)
    assert (whole.bytes, whole.busy_seconds) == (int(by(1.5 * short)), 1.5 * short)
    recent = estimator.in_flight_sample(0.0, 2 * short, by(2 * short), by)
    assert recent.busy_seconds == pytest.approx(short)
    assert recent.bytes / recent.busy_seconds == pytest.approx(25e6, rel=1e-6)


def test_a_chunk_in_flight_too_slow_for_a_recent_half_is_measured_whole() -> None:
    by = _burst_then_steady(0, 1e6)   # 1 MB/s: the second half of 0.1 s is 50 KB
    sample = estimator.in_flight_sample(0.0, 0.1, by(0.1), by)
    assert (sample.bytes, sample.busy_seconds) == (100_000, 0.1)
    assert estimator.in_flight_sample(0.0, 0.05, by(0.05), by) is None   # under MIN_SAMPLE_BYTES
    assert estimator.in_flight_sample(1.0, 1.0, 10**6, by) is None       # no time has passed


@given(st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(0, 10**6)), min_size=1, max_size=12),
       st.floats(-0.5, 1.5))
def test_arrived_by_interpolates_an_arrival_curve(points, t) -> None:
    curve = sorted(points)
    curve = [(at, count) for i, (at, count) in enumerate(curve) if i == 0 or at > curve[i - 1][0]]
    counts = [count for _, count in curve]
    curve = [(at, c) for (at, _), c in zip(curve, sorted(counts))]   # bytes never fall
    got = estimator.arrived_by(curve, t)
    for at, count in curve:
        assert estimator.arrived_by(curve, at) == pytest.approx(count)
    assert curve[0][1] <= got <= curve[-1][1]
    before = [count for at, count in curve if at <= t]
    after = [count for at, count in curve if at > t]
    assert (before[-1] if before else curve[0][1]) <= got + 1e-6
    assert got <= (after[0] if after else curve[-1][1]) + 1e-6
