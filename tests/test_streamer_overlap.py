"""Recompute overlapped with transfer: the cost model, the planner over it, and the policies
and cancel rule that use it."""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from streamer.adapt import overlap
from streamer.adapt.base import Observation, PlanInput
from streamer.adapt.cancel import InFlight, reconsider
from streamer.adapt.mpc import guarded
from streamer.adapt.plan import DEFAULT_BINS
from streamer.adapt.policies import TEXT, greedy, mpc, mpc_plan

MB = 1_000_000


def test_text_in_front_is_recomputed_while_the_rest_streams() -> None:
    # text, then two KV chunks of 0.5 s: the 0.4 s recompute hides behind the first transfer
    assert overlap.finish([0.0, 0.5, 0.5], [0.4, 0.0, 0.0]) == pytest.approx(1.0)
    # text after a KV chunk waits for it to be delivered: in series
    assert overlap.finish([0.5, 0.0], [0.0, 0.4]) == pytest.approx(0.9)
    # recompute still owed delays the next delivery, not the link
    assert overlap.finish([0.2, 0.2], [0.0, 0.0], busy=0.3) == pytest.approx(0.4)
    assert overlap.finish([0.2], [0.0], busy=0.3) == pytest.approx(0.3)


def _shapes(link: np.ndarray, recompute: np.ndarray, costs: np.ndarray, busy: float):
    """Every plan with its cost and the time the planner's two shapes give it (inf for a
    plan of neither shape): series, or a text prefix then levels only."""
    chunks, options = link.shape
    text = options - 1
    rows = np.arange(chunks)
    for columns in itertools.product(range(options), repeat=chunks):
        cols = np.array(columns)
        is_text = cols == text
        cost = costs[rows, cols].sum()
        series = busy + link[rows, cols].sum() + recompute[is_text].sum()
        q = int(np.argmin(is_text)) if not is_text.all() else chunks
        prefix = (overlap.finish(link[rows, cols], np.where(is_text, recompute, 0.0), busy)
                  if not is_text[q:].any() else np.inf)
        yield columns, cost, min(series, prefix)


problems = st.integers(1, 4).flatmap(lambda n: st.integers(1, 3).flatmap(lambda m: st.tuples(
    st.lists(st.lists(st.floats(0.0, 1.0), min_size=m + 1, max_size=m + 1), min_size=n, max_size=n),
    st.lists(st.floats(0.0, 1.0), min_size=n, max_size=n),
    st.lists(st.lists(st.floats(0.0, 1.0), min_size=m + 1, max_size=m + 1), min_size=n, max_size=n))))


@given(problems, st.floats(0.01, 4.0), st.floats(0.0, 1.0), st.sampled_from([4, 64, DEFAULT_BINS]))
def test_solve_is_feasible_and_no_worse_than_any_plan_of_its_shapes(problem, budget, busy, bins) -> None:
    link, recompute, costs = (np.asarray(x, dtype=np.float64) for x in problem)
    plan = overlap.solve(link, recompute, costs, budget, busy, bins)
    rows = np.arange(link.shape[0])
    is_text = np.array(plan.columns) == link.shape[1] - 1
    assert plan.seconds == pytest.approx(overlap.finish(link[rows, list(plan.columns)],
                                                        np.where(is_text, recompute, 0.0), busy)) \
        or not plan.feasible
    if plan.feasible:
        assert plan.seconds <= budget * (1 + 1e-9) + 1e-12
    slack = budget - link.shape[0] * budget / bins
    fitting = [cost for _, cost, seconds in _shapes(link, recompute, costs, busy) if seconds <= slack]
    if fitting:
        assert plan.feasible and plan.cost <= min(fitting) + 1e-9
    first = overlap.first_option_costs(link, recompute, costs, budget, busy, bins)
    if plan.feasible:
        assert first.min() == pytest.approx(plan.cost)
    else:
        assert not np.isfinite(first).any()


def test_no_budget_no_plan() -> None:
    """A budget of zero (the deadline is here) fits nothing, not even instant options:
    the fastest plan comes back, marked infeasible (``decide`` sends text before asking)."""
    plan = overlap.solve([[0.0, 0.0]], [0.0], [0.0, 1.0], 0.0)
    assert not plan.feasible and plan.columns == (0,)


def test_solve_rejects_bad_recompute() -> None:
    with pytest.raises(ValueError, match="recompute"):
        overlap.solve([[1.0, 0.0]], [-1.0], [0.0, 1.0], 1.0)
    with pytest.raises(ValueError, match="busy"):
        overlap.solve([[1.0, 0.0]], [0.0], [0.0, 1.0], 1.0, busy=-1.0)


def _four_chunks(**kw) -> PlanInput:
    """Four 3 MB chunks at one level, 10 MB/s measured: 1.2 s of link for a 1 s budget;
    text costs 0.3 s of recompute per chunk."""
    args = dict(sizes=[[3 * MB]] * 4, text_bytes=[4_000] * 4, text_seconds=[0.3] * 4,
                distortion=[1e-3], time_left=1.0, history=[Observation(10 * MB, 1.0)] * 4)
    return PlanInput(**{**args, **kw})


def test_mpc_recomputes_the_first_chunk_while_the_rest_streams() -> None:
    """In series nothing fits (three chunks and one text: 0.9 + 0.3 s); with the first
    chunk recomputed while the other three stream, 0.9 s does."""
    inp = _four_chunks()
    plan = mpc_plan(inp)
    assert plan.feasible and plan.columns == (1, 0, 0, 0)     # column 1: text
    assert plan.seconds == pytest.approx(0.9 + 4_000 / (10 * MB))
    assert mpc(inp) == TEXT


def test_recompute_owed_overlaps_the_next_transfers() -> None:
    """With 0.3 s of recompute owed, three chunks of 0.3 s fit a 0.95 s budget: the owed
    recompute runs while they stream (in series, 1.2 s, they would not), and the guard
    counts it the same way."""
    inp = _four_chunks(sizes=[[3 * MB]] * 3, text_bytes=[4_000] * 3, text_seconds=[0.3] * 3,
                       time_left=0.95, recompute_busy=0.3)
    assert mpc(inp) == 0 and mpc_plan(inp).columns == (0, 0, 0)
    assert guarded(inp)[0]


def test_cancel_rule_counts_recompute_owed_as_overlapping() -> None:
    """A chunk in flight behind 0.3 s of owed recompute is kept when it and the rest
    finish by the deadline while that recompute runs. A collapse gives it up, but not
    while that recompute still outlasts giving it up: its text could start no sooner."""
    plan = _four_chunks(sizes=[[3 * MB]] * 3, text_bytes=[4_000] * 3, text_seconds=[0.3] * 3,
                        time_left=0.95, recompute_busy=0.3, history=[])
    head = InFlight(level=0, remaining_bytes=3 * MB, delivered_layers=0)
    assert reconsider(plan, head, rate=10 * MB, rtt=0.01, reconnect_seconds=0.05) is None
    assert reconsider(plan, head, rate=3 * MB, rtt=0.01, reconnect_seconds=0.05) is None
    # 0.25 s on: 0.05 s of recompute left, less than the ~0.06 s of a reconnect and a round trip
    later = dataclasses.replace(plan, time_left=0.7, recompute_busy=0.05)
    switch = reconsider(later, dataclasses.replace(head, remaining_bytes=int(2.25 * MB)),
                        rate=3 * MB, rtt=0.01, reconnect_seconds=0.05)
    assert switch is not None and switch.choice == TEXT


def test_greedy_keeps_cachegens_series_accounting() -> None:
    """CacheGen's rule knows no overlap: what the caller owes comes off its time."""
    assert greedy(_four_chunks(time_left=2.0, recompute_busy=0.0)) == 0      # 0.3 s <= 0.5 s share
    assert greedy(_four_chunks(time_left=2.0, recompute_busy=1.0)) == TEXT   # share 0.25 s
