"""Recompute overlapped with transfer: the cost model, the planner over it, and the policies
and cancel rule that use it."""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamer.adapt import overlap
from streamer.adapt.base import Observation, PlanInput
from streamer.adapt.cancel import InFlight, reconsider
from streamer.adapt.mpc import guarded
from streamer.adapt.plan import DEFAULT_BINS
from streamer.adapt.plan import solve as solve_series
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


def test_where_recompute_shares_the_decoders_cores_only_series_plans_fit() -> None:
    """Text in front hides behind two 0.5 s transfers when recompute runs beside them
    (1.0 s); on shared cores each second of recompute is one the decoder loses (1.4 s)."""
    link = np.array([[0.5, 0.0]] * 3)
    recompute, costs = np.array([0.4] * 3), np.array([[0.01, 1.0]] * 3)
    beside = overlap.solve(link, recompute, costs, 1.1)
    assert beside.feasible and beside.columns == (1, 0, 0) and beside.seconds == pytest.approx(1.0)
    shared = overlap.solve(link, recompute, costs, 1.1, overlaps=False)
    assert not shared.feasible
    assert np.isinf(overlap.first_option_costs(link, recompute, costs, 1.1, overlaps=False)).all()
    # with room for it, the series plan, timed after the recompute still owed
    roomy = overlap.solve(link, recompute, costs, 2.0, busy=0.2, overlaps=False)
    assert roomy.feasible and roomy.columns == (0, 0, 0) and roomy.seconds == pytest.approx(1.7)


def _finish_of(link: np.ndarray, recompute: np.ndarray, columns, busy: float) -> float:
    """:func:`overlap.finish` of the plan ``columns`` (the last column: text)."""
    cols = np.array(columns)
    return overlap.finish(link[np.arange(len(cols)), cols], np.where(cols == link.shape[1] - 1, recompute, 0.0),
                          busy)


def _schedules(link: np.ndarray, recompute: np.ndarray, costs: np.ndarray, busy: float):
    """Every plan with its columns, its cost and its :func:`overlap.finish`."""
    rows = np.arange(link.shape[0])
    for columns in itertools.product(range(link.shape[1]), repeat=link.shape[0]):
        yield columns, float(costs[rows, list(columns)].sum()), _finish_of(link, recompute, columns, busy)


def _shapes(link: np.ndarray, recompute: np.ndarray, costs: np.ndarray, busy: float):
    """Every plan with its cost and the time the series and text-prefix shapes give it
    (inf for a plan of neither shape)."""
    chunks, options = link.shape
    rows = np.arange(chunks)
    for columns, cost, seconds in _schedules(link, recompute, costs, busy):
        is_text = np.array(columns) == options - 1
        series = busy + link[rows, list(columns)].sum() + recompute[is_text].sum()
        q = int(np.argmin(is_text)) if not is_text.all() else chunks
        yield columns, cost, min(series, np.inf if is_text[q:].any() else seconds)


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


small = st.integers(3, 5).flatmap(lambda n: st.integers(2, 4).flatmap(lambda m: st.tuples(
    st.lists(st.lists(st.floats(0.0, 1.0), min_size=m, max_size=m), min_size=n, max_size=n),
    st.lists(st.floats(0.0, 1.0), min_size=n, max_size=n),
    st.lists(st.lists(st.floats(0.0, 1.0), min_size=m, max_size=m), min_size=n, max_size=n))))


@settings(deadline=None)
@given(small, st.floats(0.05, 4.0), st.floats(0.0, 1.0), st.sampled_from([16, 64, DEFAULT_BINS]))
def test_plans_match_a_brute_force_over_every_schedule(problem, budget, busy, bins) -> None:
    """Against every schedule timed by ``finish``, text anywhere: a plan called feasible
    finishes within the budget (never optimistic), and whenever some schedule finishes
    within ``budget - (chunks + 1) * budget / bins`` (each term of ``D`` gathers at most
    ``chunks + 1`` roundings up to a bin) the plan is feasible and costs no more than it;
    the same for the cheapest plan starting with each option of chunk 0. Nor is the plan
    costlier than the series knapsack alone."""
    link, recompute, costs = (np.asarray(x, dtype=np.float64) for x in problem)
    chunks, options = link.shape
    inside = budget - (chunks + 1) * budget / bins
    schedules = list(_schedules(link, recompute, costs, busy))
    plan = overlap.solve(link, recompute, costs, budget, busy, bins)
    first = overlap.first_option_costs(link, recompute, costs, budget, busy, bins)
    if plan.feasible:
        assert _finish_of(link, recompute, plan.columns, busy) <= budget * (1 + 1e-9)
    fitting = [cost for _, cost, seconds in schedules if seconds <= inside]
    if fitting:
        assert plan.feasible and plan.cost <= min(fitting) + 1e-9
    for j in range(options):
        within = [cost for cols, cost, seconds in schedules if cols[0] == j and seconds <= budget * (1 + 1e-9)]
        if np.isfinite(first[j]):
            assert within and first[j] >= min(within) - 1e-9
        fitting = [cost for cols, cost, seconds in schedules if cols[0] == j and seconds <= inside]
        if fitting:
            assert first[j] <= min(fitting) + 1e-9
    serial = link.copy()
    serial[:, -1] += recompute
    series = solve_series(serial, costs, budget - busy, bins) if budget > busy else None
    if series is not None and series.feasible:
        assert plan.feasible and plan.cost <= series.cost + 1e-12


larger = st.integers(2, 12).flatmap(lambda n: st.integers(2, 6).flatmap(lambda m: st.tuples(
    st.lists(st.lists(st.floats(0.0, 0.5), min_size=m, max_size=m), min_size=n, max_size=n),
    st.lists(st.floats(0.0, 0.5), min_size=n, max_size=n),
    st.lists(st.lists(st.floats(0.0, 1.0), min_size=m, max_size=m), min_size=n, max_size=n))))


@settings(deadline=None)
@given(larger, st.floats(0.05, 3.0), st.floats(0.0, 1.0), st.sampled_from([32, DEFAULT_BINS]))
def test_each_first_option_costs_what_the_plan_held_to_it_costs(problem, budget, busy, bins) -> None:
    """Too many schedules to enumerate: chunk 0 held to each option in turn (the others
    made to never fit), the plan is never optimistic and costs what
    ``first_option_costs`` says for that option, and the cheapest of those is the plan."""
    link, recompute, costs = (np.asarray(x, dtype=np.float64) for x in problem)
    first = overlap.first_option_costs(link, recompute, costs, budget, busy, bins)
    plan = overlap.solve(link, recompute, costs, budget, busy, bins)
    assert plan.feasible == np.isfinite(first).any()
    if plan.feasible:
        assert first.min() == pytest.approx(plan.cost)
        assert _finish_of(link, recompute, plan.columns, busy) <= budget * (1 + 1e-9)
    for j in range(link.shape[1]):
        held = link.copy()
        held[0, np.arange(link.shape[1]) != j] = np.inf
        alone = overlap.solve(held, recompute, costs, budget, busy, bins)
        assert alone.feasible == np.isfinite(first[j])
        if alone.feasible:
            assert alone.columns[0] == j and alone.cost == pytest.approx(first[j])
            assert _finish_of(link, recompute, alone.columns, busy) <= budget * (1 + 1e-9)


def test_text_between_kv_chunks_recomputes_while_the_rest_streams() -> None:
    """Four chunks of 0.3 s of KV (or 0.22 s at a worse level), 0.95 s: only chunk 2 is
    quick to recompute (0.3 s). Sent as text after two KV chunks, its recompute runs
    while chunk 3 streams: done at 0.901 s. In series (1.201 s) that misses, so the
    series shape takes the worse level everywhere (4 x 0.4); the text-prefix shape cannot
    reach chunk 2 (chunks 0 and 1 recompute slowly)."""
    link = np.array([[0.3, 0.22, 0.001]] * 4)
    recompute = np.array([2.0, 2.0, 0.3, 2.0])
    costs = np.array([0.0, 0.4, 1.0])
    plan = overlap.solve(link, recompute, costs, 0.95)
    assert plan.feasible and plan.columns == (0, 0, 2, 0)
    assert plan.cost == pytest.approx(1.0) and plan.seconds == pytest.approx(0.901)
    serial = link.copy()
    serial[:, -1] += recompute
    series = solve_series(serial, np.tile(costs, (4, 1)), 0.95)
    assert series.feasible and series.columns == (1, 1, 1, 1) and series.cost == pytest.approx(1.6)
    assert overlap.first_option_costs(link, recompute, costs, 0.95) == pytest.approx([1.0, 1.4, np.inf])
    # with the worse level gone, nothing but the mix fits at all
    plan = overlap.solve(link[:, [0, 2]], recompute, costs[[0, 2]], 0.95)
    assert plan.feasible and plan.columns == (0, 0, 1, 0)
    assert not solve_series(serial[:, [0, 2]], np.tile(costs[[0, 2]], (4, 1)), 0.95).feasible


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


def test_mpc_recomputes_a_chunk_while_the_rest_streams() -> None:
    """In series nothing fits (three chunks and one text: 0.9 + 0.3 s); with one chunk
    recomputed while the chunks after it stream, 0.9 s does. mpc's plan (series and text
    prefix shapes) recomputes the first chunk while the other three stream; with the
    any-mix shape, chunk 2 is the latest whose recompute still hides behind a transfer
    (chunk 3's), so that plan puts text there (text as late as it can go) and chunk 0 goes
    as KV."""
    inp = _four_chunks()
    plan = mpc_plan(inp)
    assert plan.feasible and plan.columns == (1, 0, 0, 0)     # column 1: text
    assert mpc(inp) == TEXT
    mixed = mpc_plan(inp, any_mix=True)
    assert mixed.feasible and mixed.columns == (0, 0, 1, 0)
    assert mixed.seconds == pytest.approx(0.9 + 4_000 / (10 * MB))
    assert mpc(inp, any_mix=True) == 0


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
