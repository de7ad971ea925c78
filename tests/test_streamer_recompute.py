"""The recompute cost the planners use: the configured one, or the caller's recent
recomputes when they show it slower (``streamer.adapt.recompute``)."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, strategies as st

from streamer.adapt.recompute import RECENT, RecomputeCost, recompute_cost

FLAT = RecomputeCost(1e-4)


def test_nothing_observed_plans_at_the_configured_cost() -> None:
    assert recompute_cost(FLAT, []) == FLAT


def test_a_slower_caller_is_planned_at_its_measured_rate() -> None:
    assert recompute_cost(FLAT, [(0, 1000, 0.3)]).per_token == pytest.approx(3e-4)


def test_a_faster_caller_is_still_planned_at_the_configured_cost() -> None:
    assert recompute_cost(FLAT, [(0, 1000, 0.01)]) == FLAT


def test_only_the_last_few_recomputes_count() -> None:
    slow_then_fast = [(0, 1000, 1.0)] + [(0, 1000, 0.2)] * RECENT
    assert recompute_cost(FLAT, slow_then_fast).per_token == pytest.approx(2e-4)


def test_the_rate_is_weighted_by_predicted_work() -> None:
    # a short call's fixed overhead must not dominate: 0.11 s over 1100 tokens, not the mean of rates
    assert recompute_cost(RecomputeCost(1e-6), [(0, 100, 0.01), (0, 1000, 0.1)]).per_token == pytest.approx(1e-4)


def test_empty_recomputes_are_ignored() -> None:
    assert recompute_cost(FLAT, [(0, 1000, 0.5), (0, 0, 0.3)]).per_token == pytest.approx(5e-4)


def test_a_chunk_costs_more_the_more_tokens_come_before_it() -> None:
    cost = RecomputeCost(1e-3, 1e-6)
    # 256 tokens after 3840: 256 * 3840 + 256 * 255 / 2 earlier tokens attended to
    assert cost.seconds(3840, 256) == pytest.approx(256 * 1e-3 + (256 * 3840 + 256 * 255 / 2) * 1e-6)
    assert cost.seconds(0, 256) < cost.seconds(256, 256) < cost.seconds(3840, 256)
    # splitting a range into chunks costs what the range costs at once (the same pairs)
    assert cost.seconds(0, 512) == pytest.approx(cost.seconds(0, 256) + cost.seconds(256, 256))


def test_late_chunks_measured_slow_scale_both_terms() -> None:
    cost = RecomputeCost(1e-3, 1e-6)
    slow = [(3840, 256, 2 * cost.seconds(3840, 256))]
    assert recompute_cost(cost, slow) == RecomputeCost(2e-3, 2e-6)
    # the same seconds at position 0 would be judged against the cheaper prediction there
    assert recompute_cost(cost, [(0, 256, 2 * cost.seconds(3840, 256))]).per_token > 2e-3


@pytest.mark.parametrize("per_token, per_context", [(0.0, 0.0), (-1.0, 0.0), (math.nan, 0.0), (1e-4, -1e-9),
                                                    (1e-4, math.inf)])
def test_a_configured_cost_must_be_positive_and_finite(per_token: float, per_context: float) -> None:
    with pytest.raises(ValueError, match="recompute cost"):
        RecomputeCost(per_token, per_context)


def test_negative_seconds_are_refused() -> None:
    with pytest.raises(ValueError, match="seconds"):
        recompute_cost(FLAT, [(0, 10, -1.0)])


@given(st.floats(1e-7, 1e-2), st.floats(0, 1e-5),
       st.lists(st.tuples(st.integers(0, 8192), st.integers(1, 10_000), st.floats(0, 10)), max_size=8))
def test_never_cheaper_than_configured_nor_dearer_than_the_slowest_recent_call(per_token, per_context,
                                                                                observed) -> None:
    configured = RecomputeCost(per_token, per_context)
    cost = recompute_cost(configured, observed)
    recent = observed[-RECENT:]
    assert cost.per_token >= configured.per_token and cost.per_context_token >= configured.per_context_token
    slowest = max([1.0] + [s / configured.seconds(a, t) for a, t, s in recent])
    assert cost.per_token <= configured.per_token * slowest * (1 + 1e-9)
