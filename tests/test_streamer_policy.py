"""Adaptation policies: the deadline DP against brute force, and each policy's rule."""
from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from streamer.adapt.estimator import last_sample, robust_estimate
from streamer.adapt.policies import (Observation, PlanInput, TEXT, describe, get_policy, greedy,
                                     mpc, mpc_plan, names, predicted_seconds)
from streamer.adapt.base import Abandon, choice_of, option_costs, option_seconds
from streamer.adapt import mpc as mpc_module
from streamer.adapt.mpc import PLAN_MARGIN, TEXT_LATER, expected_costs, guarded, plan_costs, with_margin
from streamer.adapt.plan import DEFAULT_BINS, fastest, solve

REL = 1e-9  # float slack on "fits the budget"


# ------------------------------------------------------------------ strategies
@st.composite
def plan_inputs(draw, max_chunks: int = 5, max_levels: int = 4, history: bool = True):
    """Small PlanInputs: decreasing sizes per level, increasing distortion, a
    constant-throughput history (so every estimator returns that rate)."""
    chunks = draw(st.integers(1, max_chunks))
    levels = draw(st.integers(1, max_levels))
    base = draw(st.lists(st.integers(1_000, 1_000_000), min_size=chunks, max_size=chunks))
    ratios = sorted(draw(st.lists(st.floats(0.05, 1.0), min_size=levels, max_size=levels)),
                    reverse=True)
    sizes = [[max(1, int(b * r)) for r in ratios] for b in base]
    distortion = sorted(draw(st.lists(st.floats(1e-5, 0.5), min_size=levels, max_size=levels)))
    rate = draw(st.floats(1e4, 1e8))
    count = draw(st.integers(1, 6)) if history else 0
    return PlanInput(
        sizes=sizes,
        text_bytes=draw(st.lists(st.integers(0, 5_000), min_size=chunks, max_size=chunks)),
        text_seconds=draw(st.lists(st.floats(0.0, 0.5), min_size=chunks, max_size=chunks)),
        distortion=distortion,
        time_left=draw(st.floats(-0.5, 5.0)),
        history=[Observation(int(rate), 1.0)] * count,
        text_penalty=draw(st.floats(0.0, 2.0)),
    )


def _brute_force(seconds: np.ndarray, costs: np.ndarray):
    """Every plan as (columns, exact seconds, cost)."""
    chunks, options = seconds.shape
    rows = np.arange(chunks)
    for columns in itertools.product(range(options), repeat=chunks):
        cols = np.array(columns)
        yield columns, seconds[rows, cols].sum(), costs[rows, cols].sum()


matrices = st.integers(1, 5).flatmap(lambda n: st.integers(1, 5).flatmap(lambda m: st.tuples(
    st.lists(st.lists(st.one_of(st.floats(0.0, 3.0), st.just(np.inf)), min_size=m, max_size=m),
             min_size=n, max_size=n),
    st.lists(st.lists(st.floats(0.0, 1.0), min_size=m, max_size=m), min_size=n, max_size=n))))


# ------------------------------------------------------------------ the DP
@given(matrices, st.one_of(st.just(0.0), st.floats(1e-6, 10.0)),
       st.sampled_from([1, 3, 16, 256, DEFAULT_BINS]))
def test_solve_matches_brute_force(matrix, budget, bins) -> None:
    seconds, costs = (np.array(a) for a in matrix)
    plan = solve(seconds, costs, budget, bins)
    plans = list(_brute_force(seconds, costs))
    slack = budget - seconds.shape[0] * budget / bins  # rounding costs <= 1 bin per chunk
    if plan.feasible:
        assert plan.seconds <= budget * (1 + REL)
        safe = [c for _, t, c in plans if t <= slack]
        assert all(plan.cost <= c + 1e-12 for c in safe)
    else:
        assert not any(t <= slack for _, t, _ in plans)
        assert plan == fastest(seconds, costs)
    if not any(t <= budget for _, t, _ in plans):
        assert not plan.feasible
    rows = np.arange(seconds.shape[0])
    assert plan.cost == pytest.approx(costs[rows, list(plan.columns)].sum())


@given(st.integers(1, 5).flatmap(lambda n: st.lists(
    st.lists(st.integers(0, 4), min_size=3, max_size=3), min_size=n, max_size=n)),
    st.integers(1, 12), st.randoms(use_true_random=False))
def test_solve_is_exact_on_whole_bins(seconds, budget, rnd) -> None:
    """With times that are whole bins, rounding up loses nothing: the DP is optimal."""
    seconds = np.array(seconds, dtype=float)
    costs = np.array([[rnd.random() for _ in range(3)] for _ in seconds])
    plan = solve(seconds, costs, float(budget), bins=budget)
    fitting = [c for _, t, c in _brute_force(seconds, costs) if t <= budget]
    assert plan.feasible == bool(fitting)
    if fitting:
        assert plan.cost == pytest.approx(min(fitting))


def test_fastest_breaks_time_ties_by_cost() -> None:
    plan = fastest([[1.0, 1.0, 2.0], [np.inf, np.inf, np.inf]], [[0.5, 0.2, 0.0], [0.3, 0.1, 0.2]])
    assert plan.columns == (1, 1) and not plan.feasible


def test_solve_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="bins"):
        solve([[1.0]], [0.0], 1.0, bins=0)
    with pytest.raises(ValueError, match=">= 0"):
        solve([[-1.0]], [0.0], 1.0)
    with pytest.raises(ValueError, match="matrix"):
        solve([1.0, 2.0], [0.0], 1.0)


# ------------------------------------------------------------------ mpc
@given(plan_inputs(), st.data())
def test_mpc_plan_is_no_worse_than_any_feasible_plan(inp, data) -> None:
    plan = mpc_plan(inp)
    estimate = robust_estimate(inp.history)
    seconds = option_seconds(inp, estimate)
    costs = np.broadcast_to(option_costs(inp), seconds.shape)
    chunks = len(inp.sizes)
    other = data.draw(st.lists(st.integers(0, inp.levels), min_size=chunks, max_size=chunks))
    rows = np.arange(chunks)
    other_time = seconds[rows, other].sum()
    budget = with_margin(inp).time_left   # mpc plans for all but PLAN_MARGIN of the time left
    if budget > 0 and other_time <= budget - chunks * budget / DEFAULT_BINS:   # no budget fits nothing
        # the text-last tie-break adds at most TEXT_LATER * chunks per chunk
        assert plan.feasible and plan.cost <= costs[rows, other].sum() + TEXT_LATER * chunks ** 2 + 1e-12
    choice = mpc(inp)
    column = inp.levels if choice == TEXT else choice
    # the plan's first step, or one the guard passes; with none passed, the least expected
    # cost over all options (mpc's docstring), which may differ from the one-rate plan's
    safe = guarded(with_margin(inp))
    assert choice == choice_of(plan.columns[0], inp.levels) or safe[column] or not safe.any()


@given(plan_inputs())
def test_mpc_choice_fits_whenever_some_plan_does(inp) -> None:
    """Constant link: mpc never sends more than can arrive in time while a smaller
    level or text would have fit, and when nothing fits it takes the fastest option.
    Timed in series (recompute on the decoder's cores), the accounting these sums make:
    a recompute that overlaps later transfers may take longer than its share and still fit."""
    inp = PlanInput(**{**inp.__dict__, "recompute_overlaps": False})
    estimate = robust_estimate(inp.history)
    choice = mpc(inp)
    spent = predicted_seconds(inp, choice, estimate)
    seconds = option_seconds(inp, estimate)
    quickest_rest = seconds[1:].min(axis=1).sum()
    chunks = len(inp.sizes)
    slack = inp.time_left - chunks * inp.time_left / DEFAULT_BINS
    if seconds[0].min() + quickest_rest <= slack:
        assert spent + quickest_rest <= inp.time_left * (1 + REL)
    if seconds.min(axis=1).sum() > inp.time_left:
        assert spent == seconds[0].min()


@given(plan_inputs(max_chunks=1), st.floats(0.0, 5.0), st.floats(0.0, 5.0))
def test_mpc_single_chunk_more_time_is_never_worse(inp, t1, t2) -> None:
    """mpc weighs each option by its expected cost over its rate scenarios, a fade below
    them included (a worse level that survives the fade can beat a better one that would
    turn to text in it), so more time may change the level either way; what it must not
    do is pick an option that misses when it had one that fits, or one its own scoring
    rates worse than what it picked with less time."""
    short, long = sorted((t1, t2))
    rate = inp.history[0].bytes / inp.history[0].busy_seconds

    def pick(time_left: float) -> tuple[float, bool]:
        plan = PlanInput(**{**inp.__dict__, "time_left": time_left})
        choice = mpc(plan)
        column = inp.levels if choice == TEXT else choice
        scored = with_margin(plan)
        expected = expected_costs(scored, plan_costs(scored))
        return expected[column], predicted_seconds(inp, choice, rate) <= time_left

    (short_cost, short_fits), (long_cost, long_fits) = pick(short), pick(long)
    assert long_fits or not short_fits
    if short_fits and np.isfinite(short_cost):
        assert long_cost <= short_cost + 1e-9


def _ladder(chunks: int, time_left: float, history: list[Observation], **kw) -> PlanInput:
    return PlanInput(sizes=[[8_000_000, 4_000_000, 2_000_000, 1_000_000]] * chunks,
                     text_bytes=[4_000] * chunks, text_seconds=[0.05] * chunks,
                     distortion=[1e-4, 1e-3, 1e-2, 5e-2], time_left=time_left,
                     history=history, **kw)


def test_mpc_lowers_quality_after_a_throughput_drop() -> None:
    steady = [Observation(8_000_000, 0.1)] * 6          # 80 MB/s: 64 MB in 0.8 s
    drop = steady + [Observation(8_000_000, 1.0)]        # 8 MB/s: the harmonic mean falls to 29 MB/s
    assert mpc(_ladder(8, 2.0, steady)) == 0 and mpc_plan(_ladder(8, 2.0, steady)).columns == (0,) * 8
    assert max(mpc_plan(_ladder(8, 2.0, drop)).columns) > 0   # 64 MB would now take 2.2 s


def test_mpc_uses_text_only_as_a_last_resort() -> None:
    link = [Observation(1_000_000, 1.0)] * 3              # 1 MB/s: 1 s for the smallest level
    assert mpc(_ladder(1, 1.5, link)) == 3                 # the smallest level fits
    assert mpc(_ladder(1, 0.5, link)) == TEXT              # only text (0.054 s) fits
    # a penalty below the smallest level's distortion makes text the better deal
    assert mpc(_ladder(1, 1.5, link, text_penalty=1e-2)) == TEXT


def test_mpc_plans_ahead_for_a_big_chunk_later() -> None:
    """Greedy spends an equal share now and then misses; the plan saves time for the
    big last chunk by lowering quality now."""
    inp = PlanInput(sizes=[[1_000, 500], [9_000, 8_900]], text_bytes=[10] * 2,
                    text_seconds=[100.0] * 2, distortion=[0.0, 0.1], time_left=9.85,
                    history=[Observation(1_000, 1.0)])    # 1 kB/s
    assert greedy(inp) == 0          # 1 s <= 4.9 s share, leaving 8.85 s < 8.9 s for the rest
    assert mpc(inp) == 1             # 0.5 + 9 = 9.5 s fits (in 9.85 s less PLAN_MARGIN), at cost 0.1
    assert mpc_plan(inp).columns == (1, 0)


def test_text_goes_last_when_a_plan_needs_some(monkeypatch) -> None:
    """Text teaches nothing about the link: a plan that needs one text chunk takes it
    at the end, so the next decision can still avoid it, unless a fade would make the
    levels in front of it miss (the hedge, below)."""
    link = [Observation(1_000_000, 1.0)] * 4              # 1 MB/s, steady
    inp = _ladder(3, 2.2, link)                            # two smallest levels fit, not three
    assert mpc_plan(inp).columns == (3, 3, 4)
    # with the link at 0.3 MB/s, a level first leaves nothing that fits, text first does:
    # hedged, the text goes in front, where its recompute hides behind the transfers
    assert mpc(inp) == TEXT
    monkeypatch.setattr(mpc_module, "FADE_WEIGHT", 0.0)
    assert mpc(inp) == 3


def _unheld(monkeypatch, inp: PlanInput) -> Choice:
    """mpc's choice before a level is held (or a first chunk leans worse): the rules a
    test looks at one by one."""
    with monkeypatch.context() as patch:
        patch.setattr(mpc_module, "held", lambda inp, totals, choice: choice)
        return mpc(inp)


def test_a_budget_filled_at_a_steady_rate_is_hedged_against_a_fade(monkeypatch) -> None:
    """All four chunks at the best level fill the budget at the steady 10 MB/s; a fade the
    history never showed would then turn the last ones into text (1.0 each), while one
    level step on the first chunk (0.001) leaves room to absorb it."""
    steady = [Observation(1_000_000, 0.1)] * 6             # 10 MB/s: 32 MB in 3.2 s of 3.4
    inp = _ladder(4, 3.4, steady)
    assert mpc_plan(inp).columns == (0, 0, 0, 0)           # the plan at the rate seen
    assert _unheld(monkeypatch, inp) == 1
    monkeypatch.setattr(mpc_module, "FADE_WEIGHT", 0.0)
    assert _unheld(monkeypatch, inp) == 0


def test_an_erratic_peer_gets_a_more_cautious_first_step_than_a_steady_one(monkeypatch) -> None:
    """Same samples, same budget: at the central rate level 1 for all eight chunks fits
    with room for an unseen fade (the steady peer takes it); a peer that fell to a third
    of its prediction in 2 fetches out of 10 risks text at the end with it, and mpc steps
    down now instead."""
    link = [Observation(10_000_000, 1.0)] * 6             # 10 MB/s
    steady = _ladder(8, 4.0, link)                         # 8 x 4 MB at 10 MB/s: 3.2 s
    assert _unheld(monkeypatch, steady) == 1
    erratic = _ladder(8, 4.0, link, prior_errors=[0.0] * 8 + [np.log(1 / 3)] * 2)
    assert mpc_plan(erratic).columns[0] == 1              # the central plan alone would not see it
    assert _unheld(monkeypatch, erratic) in (2, 3)


def test_the_guard_refuses_a_chunk_that_a_relapse_would_make_miss() -> None:
    """After a recent shortfall to a tenth, a big first chunk that would fit at the estimate
    but not at the guard rate is not requested."""
    fade = [Observation(8_000_000, 0.1)] * 8 + [Observation(800_000, 0.1)] + [Observation(8_000_000, 0.1)] * 4
    inp = _ladder(1, 0.3, fade)                            # 80 MB/s now: 8 MB in 0.1 s fits
    assert mpc_plan(inp).columns[0] == 0
    assert not guarded(inp)[0]                             # at 8 MB/s it would take 1 s
    assert mpc(inp) != 0


def test_a_level_the_cancel_rule_can_give_up_is_priced_as_a_bet_not_a_miss(monkeypatch) -> None:
    """A peer at 10 MB/s half the time and at a twentieth of it otherwise: two chunks in
    0.5 s fit as levels only when fast. Without the cancel rule a level would miss in the
    slow scenarios and mpc sends text; with it, a slow level is given up for text in time,
    so the level costs what that leaves (both chunks as text) there, and mpc bets on it.
    Text's own price does not change."""
    link = [Observation(10_000_000, 1.0)] * 6
    final = PlanInput(sizes=[[8_000_000, 4_000_000, 2_000_000, 1_000_000]] * 2, text_bytes=[4_000] * 2,
                      text_seconds=[0.05] * 2, distortion=[1e-4, 1e-3, 1e-2, 5e-2], time_left=0.5,
                      history=link, prior_errors=[0.0] * 5 + [np.log(1 / 20)] * 5)
    cancellable = dataclasses.replace(final, abandon=Abandon(rtt=0.005, reconnect_seconds=0.01))
    assert mpc(final) == TEXT and _unheld(monkeypatch, cancellable) == 2
    plain, bet = (expected_costs(with_margin(inp), plan_costs(with_margin(inp))) for inp in (final, cancellable))
    assert bet[-1] == plain[-1]
    assert np.all(bet[1:-1] < plain[1:-1]) and np.isinf(bet[0]) and np.isinf(plain[0])   # 8 MB never fits


# ------------------------------------------------------------------ first chunk
@pytest.mark.parametrize("policy", [greedy, mpc])
def test_first_chunk_without_information_is_the_smallest_level(policy) -> None:
    inp = _ladder(4, 100.0, [])
    assert policy(inp) == 3
    # zero-duration observations carry no rate either
    assert policy(_ladder(4, 100.0, [Observation(100, 0.0)])) == 3


@pytest.mark.parametrize("policy", [greedy, mpc])
def test_first_chunk_uses_the_prior(policy) -> None:
    assert policy(_ladder(4, 100.0, [], prior_bps=1e9)) == 0
    assert policy(_ladder(4, 1.0, [], prior_bps=1e7)) > 0


# ------------------------------------------------------------------ greedy
@given(plan_inputs(history=False), st.floats(1e3, 1e8), st.booleans())
def test_greedy_follows_cachegens_rule(inp, rate, as_prior) -> None:
    inp = PlanInput(**{**inp.__dict__, **({"prior_bps": rate} if as_prior else
                                          {"history": [Observation(10**6, 10**6 / rate)]})})
    estimate = last_sample(inp.history, inp.prior_bps)
    share = inp.time_left / len(inp.sizes)
    fitting = [j for j, size in enumerate(inp.sizes[0]) if size / estimate <= share]
    text_time = inp.text_bytes[0] / estimate + inp.text_seconds[0]
    expected = (fitting[0] if fitting else TEXT if text_time <= inp.time_left
                else int(np.argmin(inp.sizes[0])))
    assert greedy(inp) == expected


def test_greedy_uses_the_last_sample_only() -> None:
    history = [Observation(8_000_000, 0.01)] * 5 + [Observation(1_000_000, 1.0)]
    assert greedy(_ladder(2, 2.0, history)) == 3          # 1 MB/s, 1 s share


# ------------------------------------------------------------------ helpers
@given(plan_inputs())
def test_predicted_seconds_matches_the_option_matrix(inp) -> None:
    estimate = robust_estimate(inp.history)
    matrix = option_seconds(inp, estimate)
    for chunk in range(len(inp.sizes)):
        for column in range(inp.levels + 1):
            assert predicted_seconds(inp, choice_of(column, inp.levels), estimate, chunk) \
                == pytest.approx(matrix[chunk, column])


def test_plan_input_checks_shapes() -> None:
    with pytest.raises(ValueError, match="at least one remaining chunk"):
        PlanInput([], [], [], [0.1], 1.0, [])
    with pytest.raises(ValueError, match="levels"):
        PlanInput([[1, 2]], [1], [0.1], [0.1], 1.0, [])
    with pytest.raises(ValueError, match="one entry per chunk"):
        PlanInput([[1]], [1, 2], [0.1], [0.1], 1.0, [])
    with pytest.raises(ValueError, match="prior_bps"):
        PlanInput([[1]], [1], [0.1], [0.1], 1.0, [], prior_bps=0.0)
    with pytest.raises(ValueError, match="observation"):
        Observation(-1, 1.0)


# ------------------------------------------------------------------ fixed, text, registry
def test_fixed_and_text() -> None:
    inp = _ladder(3, 0.0, [])
    assert get_policy("fixed:2")(inp) == 2
    assert get_policy("fixed:0")(inp) == 0
    assert get_policy("text")(inp) == TEXT
    with pytest.raises(ValueError, match=r"out of range.*0\.\.3"):
        get_policy("fixed:4")(inp)


def test_registry() -> None:
    assert get_policy("mpc") is mpc and get_policy("greedy") is greedy
    assert set(names()) == {"mpc", "greedy", "fixed:N", "text"}
    for bad in ("bola", "fixed:", "fixed:x", "fixed:-1", "FIXED:1"):
        with pytest.raises(ValueError, match="mpc|fixed:N|level"):
            get_policy(bad)
    with pytest.raises(ValueError, match="valid: mpc, greedy, fixed:N, text"):
        get_policy("bola")
    assert "CacheGen" in describe("greedy") and "level 3" in describe("fixed:3")
    with pytest.raises(ValueError, match="unknown policy"):
        describe("bola")


def test_mpc_keeps_a_margin_rather_than_fill_the_budget_exactly() -> None:
    """On a steady link, a level whose plan needs all but a sliver of the time left is
    passed over for the next one: the margin absorbs a rate that dips within a chunk."""
    rate = 10_000_000.0   # bytes/s
    history = [Observation(int(rate), 1.0)] * 4
    exact = 4 * 4_000_000 / rate   # four chunks at level 1 take exactly this long
    fills = _ladder(4, time_left=exact * (1 + PLAN_MARGIN / 2), history=history)
    roomy = _ladder(4, time_left=exact * (1 + 2 * PLAN_MARGIN), history=history)
    assert mpc_plan(roomy).columns == (1, 1, 1, 1)
    assert sorted(mpc_plan(fills).columns) == [1, 1, 1, 2]   # one level step buys the margin
    assert with_margin(_ladder(1, time_left=-1.0, history=history)).time_left == -1.0


@pytest.mark.parametrize("chunks, better", [(6, 3), (5, 1), (8, 6)])
def test_a_mix_of_two_levels_is_planned_with_its_better_level_last(chunks, better) -> None:
    """A budget that fits ``better`` chunks at level 0 and the rest at level 1: every order
    of that mix costs the same, and the plan takes the worse level first (what it saves
    is slack for the plans after it)."""
    plan = mpc_module.mpc_plan(_mix(chunks, better))
    assert plan.columns == (1,) * (chunks - better) + (0,) * better, plan


def _mix(chunks: int, better: int, **kw) -> PlanInput:
    """A budget that fits ``better`` chunks at level 0 and the rest at level 1 at 100 MB/s."""
    mb = 1_000_000
    exact = better * 0.01 + (chunks - better) * 0.005
    return PlanInput(sizes=[[mb, mb // 2]] * chunks, text_bytes=[100] * chunks, text_seconds=[1.0] * chunks,
                     distortion=[0.001, 0.004], time_left=(exact + 0.002) / (1 - PLAN_MARGIN),
                     history=[Observation(10 * mb, 0.1)] * 4, **kw)


def test_a_step_up_within_the_scatter_of_a_steady_link_is_held(monkeypatch) -> None:
    """A link measured at 100-143 MB/s: the plan would step up to level 0 (it fits every
    chunk at the faster rates, a mix at the slower ones), which is less than a step
    better in expectation, so after a level-1 chunk the next stays at level 1; and a
    first chunk, with no level before it, leans to level 1 the same way."""
    mb = 1_000_000
    scatter = [Observation(10 * mb, s) for s in (0.1, 0.07, 0.1, 0.08, 0.1, 0.075)]
    inp = PlanInput(sizes=[[mb, mb // 2]] * 6, text_bytes=[100] * 6, text_seconds=[1.0] * 6,
                    distortion=[0.001, 0.004], time_left=0.058, history=scatter)
    assert _unheld(monkeypatch, inp) == 0
    assert mpc(dataclasses.replace(inp, previous_level=1)) == 1
    assert mpc(dataclasses.replace(inp, previous_level=0)) == 0
    assert mpc(inp) == 1


def test_a_step_down_within_the_mix_is_held() -> None:
    """The mix's worse level goes first, unless the chunk before was at its better level:
    that level is kept (the plan still mixes it in, so it costs nothing) rather than
    stepping down and back up on a steady link (``kvwire demo``: 1, 1, 1, 2, 1, 1, 1)."""
    assert mpc(_mix(6, 3)) == 1
    assert mpc(_mix(6, 3, previous_level=1)) == 1
    assert mpc(_mix(6, 3, previous_level=0)) == 0


def test_a_level_is_left_when_the_plan_can_do_better_throughout() -> None:
    """Held, level 1 would cost a whole step over the plan at level 0 (which fits every
    chunk): the hold tolerates less than a step, so the plan steps up; and a budget that
    fits no level-0 chunk leaves level 0 behind."""
    assert mpc(_mix(6, 6, previous_level=1)) == 0
    assert mpc(_mix(6, 0, previous_level=0)) == 1


def test_a_level_is_never_held_over_text() -> None:
    link = [Observation(1_000_000, 1.0)] * 3              # 1 MB/s: only text (0.054 s) fits in 0.5 s
    assert mpc(_ladder(1, 0.5, link, previous_level=3)) == TEXT


def test_held_tolerates_a_share_of_the_distortion_step() -> None:
    inp = _mix(4, 2, previous_level=1)
    tolerance = mpc_module.HOLD_SHARE * (0.004 - 0.001)
    assert 0 < mpc_module.HOLD_SHARE < 1   # a plan better on every chunk by a whole step is taken
    assert mpc_module.held(inp, np.array([1.0, 1.0 + 0.99 * tolerance, np.inf]), 0) == 1
    assert mpc_module.held(inp, np.array([1.0, 1.0 + 1.01 * tolerance, np.inf]), 0) == 0
    assert mpc_module.held(inp, np.array([1.0, np.inf, np.inf]), 0) == 0     # unsafe: not held
    down = _mix(4, 2, previous_level=0)                                       # a step down, both ways
    assert mpc_module.held(down, np.array([1.0 + 0.99 * tolerance, 1.0, np.inf]), 1) == 0
    assert mpc_module.held(down, np.array([1.0 + 1.01 * tolerance, 1.0, np.inf]), 1) == 1
    assert mpc_module.held(down, np.array([np.inf, 1.0, np.inf]), 1) == 1     # unsafe: not held
    with pytest.raises(ValueError, match="level 2 out of range"):
        _mix(4, 2, previous_level=2)


def test_a_first_chunk_leans_to_the_next_worse_level_within_the_hold_share() -> None:
    """With no level before it, a chunk takes the level after the plan's choice as if it
    were held there: within ``HOLD_SHARE`` of the step, never when unsafe, and the last
    level has none after it."""
    first = _mix(4, 2)
    tolerance = mpc_module.HOLD_SHARE * (0.004 - 0.001)
    assert mpc_module.held(first, np.array([1.0, 1.0 + 0.99 * tolerance, np.inf]), 0) == 1
    assert mpc_module.held(first, np.array([1.0, 1.0 + 1.01 * tolerance, np.inf]), 0) == 0
    assert mpc_module.held(first, np.array([1.0, np.inf, np.inf]), 0) == 0
    assert mpc_module.held(first, np.array([np.inf, 1.0, 1.0]), 1) == 1
