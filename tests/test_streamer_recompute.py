"""The recompute rate the planners use: the configured one, or the caller's recent
recomputes when they show it slower (``streamer.adapt.recompute``)."""
from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from streamer.adapt.recompute import RECENT, recompute_rate


def test_nothing_observed_plans_at_the_configured_rate() -> None:
    assert recompute_rate(1e-4, []) == 1e-4


def test_a_slower_caller_is_planned_at_its_measured_rate() -> None:
    assert recompute_rate(1e-4, [(1000, 0.3)]) == pytest.approx(3e-4)


def test_a_faster_caller_is_still_planned_at_the_configured_rate() -> None:
    assert recompute_rate(1e-4, [(1000, 0.01)]) == 1e-4


def test_only_the_last_few_recomputes_count() -> None:
    slow_then_fast = [(1000, 1.0)] + [(1000, 0.2)] * RECENT
    assert recompute_rate(1e-4, slow_then_fast) == pytest.approx(2e-4)


def test_the_rate_is_token_weighted() -> None:
    # a short call's fixed overhead must not dominate: 0.11 s over 1100 tokens, not the mean of rates
    assert recompute_rate(1e-6, [(100, 0.01), (1000, 0.1)]) == pytest.approx(1e-4)


def test_empty_recomputes_are_ignored() -> None:
    assert recompute_rate(1e-4, [(1000, 0.5), (0, 0.3)]) == pytest.approx(5e-4)


@pytest.mark.parametrize("configured", [0.0, -1.0, float("nan")])
def test_a_configured_rate_must_be_positive(configured: float) -> None:
    with pytest.raises(ValueError, match="configured"):
        recompute_rate(configured, [])


def test_negative_seconds_are_refused() -> None:
    with pytest.raises(ValueError, match="seconds"):
        recompute_rate(1e-4, [(10, -1.0)])


@given(st.floats(1e-7, 1e-2), st.lists(st.tuples(st.integers(1, 10_000), st.floats(0, 10)), max_size=8))
def test_never_faster_than_configured_nor_slower_than_the_slowest_recent_call(configured, observed) -> None:
    rate = recompute_rate(configured, observed)
    recent = observed[-RECENT:]
    assert rate >= configured
    assert rate <= max([configured] + [s / t for t, s in recent]) * (1 + 1e-12)
