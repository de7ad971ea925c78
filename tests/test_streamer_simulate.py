"""The socket-free simulator and the oracle: exactness of the oracle, the oracle as a bound
on every policy, the policies' deadline rule, and decision agreement with a real
StreamSession on a recorded throughput history. No timing thresholds."""
from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from netsim.trace import Trace
from streamer.adapt import cancel, estimator, overlap
from streamer.fetch import controller as controller_module
from streamer.fetch import events as ev
from streamer.adapt.decide import decide
from streamer.adapt import mpc as mpc_rule
from streamer.adapt.base import link_seconds
from streamer.wire.manifest import ChunkInfo, Manifest
from streamer.adapt.policies import TEXT, Observation, PlanInput, get_policy, predicted_seconds
from streamer.adapt.estimator import MIN_SAMPLE_BYTES
from streamer.fetch.links import VectorLink
from streamer.fetch.simulate import Simulator, oracle
from streamer.adapt.recompute import RecomputeCost

TARGETS = (2.5e-4, 1e-3, 4.2e-3, 1.3e-2, 3.5e-2)


def make_manifest(sizes: list[list[int]], tokens: list[int], text_bytes: int = 3000, layers: int = 4,
                  distortion: tuple[float, ...] | None = None) -> Manifest:
    levels = len(sizes[0])
    chunks, start = [], 0
    for i, (row, n) in enumerate(zip(sizes, tokens)):
        chunks.append(ChunkInfo(i, start, start + n, tuple(int(s) for s in row), text_bytes, 0))
        start += n
    return Manifest("ctx", "v1", layers, 2, 8, "float16", start, "prof",
                    TARGETS[:levels] if distortion is None else distortion, tuple(chunks), 0.0)


# ------------------------------------------------------------------ strategies
@st.composite
def scenarios(draw):
    chunks = draw(st.integers(1, 5))
    levels = draw(st.integers(1, 4))
    sizes = []
    for _ in range(chunks):
        base = draw(st.integers(200_000, 6_000_000))
        ratios = sorted(draw(st.lists(st.floats(0.2, 1.0), min_size=levels, max_size=levels)),
                        reverse=True)
        sizes.append([max(1, int(base * r)) for r in ratios])
    tokens = [draw(st.integers(64, 2048)) for _ in range(chunks)]
    steps = draw(st.integers(1, 6))
    rates = draw(st.lists(st.sampled_from([0.0, 5.0, 20.0, 80.0, 200.0, 800.0]),
                          min_size=steps, max_size=steps))
    if rates[-1] == 0:
        rates[-1] = 50.0
    step = draw(st.sampled_from([0.05, 0.1, 0.3]))
    trace = Trace([i * step for i in range(steps)], rates)
    return {
        "manifest": make_manifest(sizes, tokens, draw(st.integers(100, 20_000))),
        "trace": trace,
        "rtt": draw(st.sampled_from([0.0, 0.002, 0.02])),
        "slo": draw(st.sampled_from([0.1, 0.3, 1.0, 3.0])),
        "start": draw(st.sampled_from([0.0, 0.07, 0.25])),
        "recompute": draw(st.sampled_from([1e-5, 1e-4, 1e-3])),
        "decode": draw(st.sampled_from([0.0, 0.001, 0.02])),
        "prior": draw(st.sampled_from([None, 1e6, 2e7, 1e8])),
    }


def _sim(s) -> Simulator:
    return Simulator(s["manifest"], rtt=s["rtt"], recompute_seconds_per_token=s["recompute"],
                     decode_seconds=s["decode"])


POLICIES = ["greedy", "mpc", "text", "fixed:0", "fixed:1", "fixed:2", "fixed:3"]


# ---------------------------------------------------------------------- oracle
def _oracle_timing(sim: Simulator, trace: Trace, choices, start: float, layer_levels=None) -> float:
    """Completion of a schedule under the oracle's timing, by scalar Trace calls: the link
    with no gaps, each text chunk recomputed once it is in and the chunk before it is
    delivered (overlapping later transfers), only the last chunk's decode tail. A chunk
    whose ``layer_levels`` entry is ``((0, a), (k, b))`` carries k/layers of level a's
    bytes and level b's from the layer its prediction restarts at before k (k itself
    without prediction: ``Manifest.restart`` 1)."""
    owd = sim.rtt / 2
    t = owd
    done = 0.0
    last = len(choices) - 1
    layers = sim.manifest.layers
    for j, c in enumerate(choices):
        runs = layer_levels[j] if layer_levels else ()
        if runs:
            (_, a), (k, b) = runs
            fetched_from = k - k % sim.manifest.restart
            size = (k * sim.sizes[j][a] + (layers - fetched_from) * sim.sizes[j][b]) / layers
        else:
            size = sim.text_bytes[j] if c == TEXT else sim.sizes[j][c]
        t += trace.time_to_send(8.0 * size, start + t)
        if c == TEXT:
            done = max(done, t + owd) + sim.recompute * sim.tokens[j]
        else:
            tail = sim.decode[-1] / sim.manifest.layers if j == last else 0.0
            done = max(done, t + owd + tail)
    return done


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_oracle_is_the_exact_optimum_by_brute_force(s) -> None:
    sim = _sim(s)
    levels = s["manifest"].levels
    best = None
    for combo in itertools.product([*range(levels), TEXT], repeat=len(sim.sizes)):
        if _oracle_timing(sim, s["trace"], combo, s["start"]) <= s["slo"] + 1e-9:
            cost = sim.cost_of(combo)
            best = cost if best is None else min(best, cost)
    o = sim.oracle(s["trace"], slo=s["slo"], start=s["start"], splits=False)
    assert o.feasible == (best is not None)
    assert o.layer_levels == [()] * len(sim.sizes)
    if best is not None:
        assert o.cost == pytest.approx(best, rel=1e-9, abs=1e-12)
        assert _oracle_timing(sim, s["trace"], o.choices, s["start"]) <= s["slo"] + 1e-6


@st.composite
def split_scenarios(draw):
    """Few chunks, levels and layers (every one-switch split of every chunk is tried),
    and distortions drawn apart from the sizes, so that a chunk's hull of (bytes,
    distortion) can skip levels and splits of levels not adjacent on it can matter; the
    levels may predict each layer from the one before (a restart period over 1), so a
    split's second level is fetched from before its first layer."""
    s = draw(scenarios())
    m = s["manifest"]
    levels, chunks = min(m.levels, 3), m.chunks[:3]
    distortion = tuple(sorted(draw(st.lists(st.floats(1e-4, 0.4), min_size=levels, max_size=levels,
                                            unique=True))))
    layers = draw(st.integers(2, 5))
    s["manifest"] = dataclasses.replace(
        make_manifest([list(c.sizes[:levels]) for c in chunks], [c.tokens for c in chunks],
                      chunks[0].text_bytes, layers, distortion),
        restart=draw(st.integers(1, layers)))
    return s


def _every_option(sim: Simulator, chunk: int):
    """(choice, runs, cost) of every way to send a chunk: text, a level, or layers
    [0, k) at level a and the rest at a lower level b, at every k."""
    d, layers, levels = sim.manifest.level_distortion, sim.manifest.layers, sim.manifest.levels
    yield TEXT, (), 1.0
    for a in range(levels):
        yield a, (), d[a]
    for a, b in itertools.combinations(range(levels), 2):
        for k in range(1, layers):
            yield b, ((0, a), (k, b)), (k * d[a] + (layers - k) * d[b]) / layers


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(split_scenarios())
def test_split_oracle_is_the_exact_optimum_over_every_one_switch_split(s) -> None:
    """By brute force over every choice of every chunk, splits of every pair of levels at
    every layer included (not only those the oracle keeps): the oracle's cost is the
    optimum, its plan meets the deadline under its timing and costs what it says, and
    replaying its ``choices`` (a split chunk at its last level) is no slower."""
    sim = _sim(s)
    n = len(sim.sizes)
    best = None
    for combo in itertools.product(*(list(_every_option(sim, j)) for j in range(n))):
        choices, runs = [c for c, _, _ in combo], [r for _, r, _ in combo]
        if _oracle_timing(sim, s["trace"], choices, s["start"], runs) <= s["slo"] + 1e-9:
            cost = sum(c for *_, c in combo)
            best = cost if best is None else min(best, cost)
    o = sim.oracle(s["trace"], slo=s["slo"], start=s["start"])
    assert o.feasible == (best is not None)
    assert len(o.layer_levels) == n
    if best is None:
        return
    assert o.cost == pytest.approx(best, rel=1e-9, abs=1e-12)
    layers, d = sim.manifest.layers, sim.manifest.level_distortion
    cost = 0.0
    for c, runs in zip(o.choices, o.layer_levels):
        if runs:
            (zero, a), (k, b) = runs
            assert zero == 0 and 0 < k < layers and a < b == c
            cost += (k * d[a] + (layers - k) * d[b]) / layers
        else:
            cost += 1.0 if c == TEXT else d[c]
    assert o.cost == pytest.approx(cost, rel=1e-12, abs=1e-15)
    planned = _oracle_timing(sim, s["trace"], o.choices, s["start"], o.layer_levels)
    assert planned <= s["slo"] + 1e-6
    assert _oracle_timing(sim, s["trace"], o.choices, s["start"]) <= planned + 1e-9


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_splits_never_raise_the_oracle_cost_nor_change_what_is_feasible(s) -> None:
    sim = _sim(s)
    whole = sim.oracle(s["trace"], slo=s["slo"], start=s["start"], splits=False)
    split = sim.oracle(s["trace"], slo=s["slo"], start=s["start"], splits=True)
    assert split.feasible == whole.feasible
    if whole.feasible:
        assert split.cost <= whole.cost + 1e-12
    else:   # no split is faster than its smaller level: the fastest schedule is unsplit
        assert split.choices == whole.choices and split.layer_levels == [()] * len(sim.sizes)


@pytest.mark.parametrize("sizes, distortion, slo, runs", [
    # between two levels: level 0 takes 0.32 s, level 1 0.16 s, each layer of level 0
    # instead of 1 adds 0.04 s: two layers of each take 0.24 s
    ([4_000_000, 2_000_000], TARGETS[:2], 0.25, ((0, 0), (2, 1))),
    # levels not adjacent in the ladder: level 1 lies above the chord from 0 to 2, and
    # two layers of level 0 then two of level 2 (0.24 s) beat any mix with level 1
    ([4_000_000, 3_000_000, 2_000_000], (1e-3, 0.05, 0.06), 0.25, ((0, 0), (2, 2))),
    # levels adjacent in the ladder but not on the hull (level 1 above the chord from 0
    # to 2): at layer granularity only three layers of 0 then one of 1 (0.3192 s) fit
    # between level 1 (0.3168 s) and level 0 (0.32 s), and no mix of 0 and 2 comes near
    ([4_000_000, 3_960_000, 2_000_000], (0.1, 0.105, 0.3), 0.3196, ((0, 0), (3, 1))),
])
def test_a_split_is_chosen_where_it_is_strictly_cheapest(sizes, distortion, slo, runs) -> None:
    """One 4-layer chunk at 100 Mbit/s (12.5 MB/s), text late (0.5 s of recompute): the
    deadline admits one split that costs less than every single level and every other
    split, and the oracle picks it; without splits it pays a whole level."""
    m = make_manifest([sizes], [512], distortion=distortion)
    trace = Trace.constant(100.0, 10.0)
    d = m.level_distortion
    (_, a), (k, b) = runs
    o = Simulator(m, rtt=0.0, recompute_seconds_per_token=1e-3).oracle(trace, slo=slo)
    assert o.feasible and o.layer_levels == [runs] and o.choices == [b]
    assert o.cost == pytest.approx((k * d[a] + (4 - k) * d[b]) / 4, rel=1e-12)
    assert o.completion == pytest.approx((k * sizes[a] + (4 - k) * sizes[b]) / 4 / 12.5e6, rel=1e-9)
    whole = oracle(m, trace, slo=slo, rtt=0.0, recompute_seconds_per_token=1e-3, splits=False)
    assert whole.feasible and whole.layer_levels == [()] and whole.choices != [TEXT]
    assert o.cost < whole.cost


def test_vectorised_link_matches_trace_time_to_send() -> None:
    trace = Trace([0.0, 0.1, 0.25, 0.4], [100.0, 0.0, 30.0, 500.0])
    link = VectorLink(trace)
    starts = np.array([0.0, 0.05, 0.1, 0.2, 0.39, 1.0, 3.0])
    sizes = np.array([0.0, 1.0, 1e4, 1e6, 5e7])
    got = link.time_to_send(sizes[None, :], starts[:, None])
    for i, t0 in enumerate(starts):
        for j, b in enumerate(sizes):
            assert got[i, j] == pytest.approx(trace.time_to_send(8 * b, t0), rel=1e-12, abs=1e-12)


# ------------------------------------------------------------------- simulator
def test_constant_link_with_a_true_prior_never_idles() -> None:
    """Just-in-time requests with an exact estimate keep the link busy: the fetch takes
    one RTT plus the bytes at the link rate plus the last chunk's decode tail."""
    sizes = [[4_000_000, 2_000_000]] * 6
    m = make_manifest(sizes, [512] * 6)
    rate_mbit, rtt, decode = 400.0, 0.01, 0.004
    sim = Simulator(m, rtt=rtt, decode_seconds=decode)
    trace = Trace.constant(rate_mbit, 30.0)
    r = sim.run("fixed:0", trace, slo=10.0, prior_bps=rate_mbit * 1e6 / 8)
    total = sum(row[0] for row in sizes)
    expected = rtt + 8 * total / (rate_mbit * 1e6) + decode / m.layers
    assert r.finish == pytest.approx(expected, rel=1e-9)
    assert r.choices == [0] * 6 and r.met
    # every chunk is measured at the link rate: busy time excludes nothing but idle
    assert [o.bytes for o in r.history] == [row[0] for row in sizes]
    for o in r.history:
        assert o.bytes / o.busy_seconds == pytest.approx(rate_mbit * 1e6 / 8, rel=1e-9)


def test_decisions_see_only_measured_history_and_a_partial_sample() -> None:
    m = make_manifest([[3_000_000, 1_000_000]] * 5, [256] * 5)
    trace = Trace([0.0, 0.2, 0.5], [200.0, 40.0, 300.0])
    sim = Simulator(m, rtt=0.004)
    r = sim.run("mpc", trace, slo=2.0)
    first = r.decisions[0]
    assert first.history == () and first.estimate is None and first.choice == 1  # the probe
    for d in r.decisions[1:]:
        assert all(o.bytes >= MIN_SAMPLE_BYTES and o.busy_seconds > 0 for o in d.history)
        # what the policy saw is exactly the session's estimate of that history
        assert d.estimate == estimator.robust_estimate(list(d.history), prior=d.prior_bps)
        # the decision is adapt.decide on the recorded inputs
        assert sim.decide("mpc", d.chunk, time_left=d.time_left, history=d.history,
                          prior_bps=d.prior_bps)[0] == d.choice
    # requests go out in order, before the previous chunk has fully arrived
    assert all(r.chunks[i].requested < r.chunks[i - 1].end for i in range(1, 5))


def test_cancel_abandons_a_chunk_the_link_can_no_longer_carry() -> None:
    """The link falls from 400 to 4 Mbit/s while a 4 MB chunk is arriving: without the
    cancel rule the chunk drains for seconds; with it (mpc's default, as in the session)
    the chunk is abandoned for text and the fetch meets its deadline."""
    m = make_manifest([[4_000_000, 2_000_000]] * 4, [512] * 4)
    trace = Trace([0.0, 0.05], [400.0, 4.0])
    sim = Simulator(m, rtt=0.004, recompute_seconds_per_token=1e-4)
    kept = sim.run("mpc", trace, slo=1.0, prior_bps=50e6, cancel=False)
    assert not kept.met and kept.cancels == 0
    r = sim.run("mpc", trace, slo=1.0, prior_bps=50e6)
    assert r.met and r.cancels >= 1
    chunk, level, _, switched_to = r.cancelled[0]
    assert level != TEXT and switched_to == TEXT and r.choices[chunk] == TEXT
    # a CANCEL went out (or the connection was dropped), then the chunk was re-requested as text
    gave_up = next(i for i, a in enumerate(r.actions) if a == ev.SendCancel(chunk) or isinstance(a, ev.Reconnect))
    assert ev.SendRequest(chunk, TEXT) in r.actions[gave_up:]
    # the abandoned bytes cost link time: the replayed final schedule is never slower
    assert sim.run("fixed:0", trace, slo=1.0, schedule=r.choices).completion <= r.completion + 1e-9


@pytest.mark.parametrize("escalate_after, finishes_by", [(0.05, 1.0), (math.inf, 10.0)])
def test_a_cancel_the_fade_holds_up_is_dropped_once_overdue(monkeypatch, escalate_after, finishes_by) -> None:
    """The link falls to 0.05 Mbit/s as a chunk is given up by CANCEL: the 256 KB the
    sender had committed would take ~40 s to drain. Past the switch's ``escalate_after``
    the connection is dropped and the text re-requested on a new one; with no such bound
    the fetch waits out the drain. (Token ids of 10 bytes: text gets through even so.)"""
    m = make_manifest([[4_000_000, 2_000_000]] * 4, [512] * 4, text_bytes=10)
    trace = Trace([0.0, 0.05], [400.0, 0.05])
    sim = Simulator(m, rtt=0.004, recompute_seconds_per_token=1e-4)

    def cancel_once_slow(plan, head, *, rate, **_):
        return cancel.Switch(TEXT, abort=False, escalate_after=escalate_after) if rate < 1e6 else None

    monkeypatch.setattr(controller_module.cancel, "reconsider", cancel_once_slow)
    r = sim.run("mpc", trace, slo=1.0, prior_bps=50e6)
    assert r.cancels >= 1 and r.finish > 0.05
    if math.isfinite(escalate_after):
        assert r.met and r.finish <= finishes_by
    else:
        assert r.finish >= finishes_by


def test_no_time_left_is_text_and_says_whether_the_deadline_passed() -> None:
    m = make_manifest([[5_000_000]] * 2, [128] * 2)
    policy = get_policy("fixed:0")
    kwargs = dict(time_left=-1.0, history=[], prior_bps=None, recompute=RecomputeCost(1e-4))
    assert decide(policy, m, 0, until_deadline=-0.1, **kwargs) == (TEXT, "deadline passed")
    choice, reason = decide(policy, m, 0, until_deadline=2.0, **kwargs)
    assert choice == TEXT and reason.startswith("no time left") and "2 s to the deadline" in reason
    assert decide(policy, m, 0, time_left=0.5, history=[], prior_bps=None,
                  recompute=RecomputeCost(1e-4), until_deadline=2.0) == (0, None)


@pytest.mark.parametrize("per_token, per_context, start, want", [
    (1e-4, 0.0, 0, TEXT),        # a GPU host: text is the fastest way to finish
    (1e-3, 0.0, 0, 1),           # a CPU host: 0.26 s of recompute against 0.04 s at level 1
    (1e-4, 1e-7, 3840, 1),       # cheap tokens, but attention over a long prefix makes text dear
    (1e-4, 1e-7, 0, TEXT),       # the same host at the front of a prefix
])
def test_past_the_deadline_a_chunk_goes_at_whatever_finishes_it_soonest(per_token, per_context, start, want) -> None:
    """Once the deadline is out of reach the objective's quality term is moot and every
    second is the caller's: text where recomputing is cheap, the fastest level where it is
    dear: text after the deadline would make a CPU host's long prefix as slow as a full
    prefill."""
    tokens = ([start] if start else []) + [256, 256]
    m = make_manifest([[8_000_000, 4_000_000]] * len(tokens), tokens, text_bytes=600)
    history = [Observation(10_000_000, 0.1)]   # 100 MB/s
    choice, reason = decide(get_policy("mpc"), m, len(tokens) - 2, time_left=-0.5, history=history, prior_bps=None,
                            recompute=RecomputeCost(per_token, per_context), until_deadline=-0.5)
    assert choice == want
    assert reason.startswith("deadline passed")


def test_past_the_deadline_text_waits_for_the_recompute_already_owed() -> None:
    """Text 26 ms of recompute would do, but 1 s of earlier text is still being recomputed:
    a level finishes first."""
    m = make_manifest([[8_000_000, 4_000_000]], [256], text_bytes=600)
    history = [Observation(10_000_000, 0.1)]
    kwargs = dict(time_left=-0.5, history=history, prior_bps=None, recompute=RecomputeCost(1e-4),
                  until_deadline=-0.5)
    assert decide(get_policy("mpc"), m, 0, **kwargs)[0] == TEXT
    assert decide(get_policy("mpc"), m, 0, recompute_busy=1.0, **kwargs)[0] == 1


def test_past_the_deadline_the_rest_is_text() -> None:
    m = make_manifest([[5_000_000]] * 4, [128] * 4)
    sim = Simulator(m, rtt=0.002, recompute_seconds_per_token=1e-4)
    r = sim.run("fixed:0", Trace.constant(10.0, 10.0), slo=0.5)
    assert r.choices[0] == 0 and TEXT in r.choices
    late = [d for d in r.decisions if d.time_left <= 0]
    # the reason tells a deadline that has passed from one the bytes already asked for
    # are predicted to use up
    assert all(d.reason == "deadline passed" for d in late if d.at >= 0.5)
    assert all(d.reason.startswith("no time left: the bytes already requested") for d in late if d.at < 0.5)
    assert late and all(d.choice == TEXT for d in late)
    assert not r.met
    assert r.recompute == pytest.approx(1e-4 * 128 * r.text_chunks)


def test_schedule_replay_and_module_level_oracle_agree() -> None:
    m = make_manifest([[3_000_000, 1_500_000, 600_000]] * 4, [512] * 4)
    trace = Trace([0.0, 0.3], [300.0, 60.0])
    o = oracle(m, trace, slo=0.5, rtt=0.004, recompute_seconds_per_token=2e-4)
    sim = Simulator(m, rtt=0.004, recompute_seconds_per_token=2e-4)
    assert o.choices == sim.oracle(trace, slo=0.5).choices
    replay = sim.run("fixed:0", trace, slo=0.5, schedule=o.choices)
    assert replay.choices == o.choices or TEXT in replay.choices
    assert replay.completion >= o.completion - 1e-9


# ------------------------------------------------- the policies' deadline rule
@st.composite
def plan_inputs(draw):
    chunks = draw(st.integers(1, 6))
    levels = draw(st.integers(1, 5))
    sizes = []
    for _ in range(chunks):
        row = sorted(draw(st.lists(st.integers(1, 10_000_000), min_size=levels, max_size=levels)),
                     reverse=True)
        sizes.append(row)
    # busy times of 0 or >= 1 us: a subnormal busy time gives an infinite rate, which
    # the estimator turns into a 0 estimate (reported separately, not this test's subject)
    busy = st.one_of(st.just(0.0), st.floats(1e-6, 2.0))
    history = draw(st.lists(st.builds(Observation, st.integers(0, 5_000_000), busy), max_size=8))
    return PlanInput(sizes=sizes, text_bytes=[draw(st.integers(1, 50_000)) for _ in range(chunks)],
                     text_seconds=[draw(st.floats(0.0, 1.0)) for _ in range(chunks)],
                     distortion=list(TARGETS[:levels]), time_left=draw(st.floats(0.001, 5.0)),
                     history=history, prior_bps=draw(st.sampled_from([None, 1e5, 1e7, 1e9])))


def _own_estimate(name: str, inp: PlanInput) -> float | None:
    if name == "greedy":
        return estimator.last_sample(inp.history, inp.prior_bps)
    return estimator.robust_estimate(inp.history, prior=inp.prior_bps)


@pytest.mark.parametrize("name", ["mpc", "greedy"])
@settings(max_examples=300, deadline=None)
@given(inp=plan_inputs())
def test_no_level_that_misses_the_deadline_when_a_quicker_option_fits(name, inp) -> None:
    """greedy: no level that misses at its estimate when a quicker option fits. mpc plans
    the whole rest: no first option that starts no fitting plan at its estimate when a
    guarded one does (checking chunk 0 alone would miss that the rest must fit too)."""
    estimate = _own_estimate(name, inp)
    choice = get_policy(name)(inp)
    if estimate is None or choice == TEXT:
        return  # no estimate: the probe (smallest level) is the documented rule
    if name == "mpc":
        planned = mpc_rule.with_margin(inp)   # mpc plans for the time left less its margin
        starts = overlap.first_option_costs(link_seconds(planned, estimate), planned.text_seconds,
                                            mpc_rule.plan_costs(planned), planned.time_left,
                                            planned.recompute_busy)
        fits = np.isfinite(starts) & mpc_rule.guarded(planned)
        assert fits[choice] or not fits.any(), (choice, starts, fits)
        return
    mine = predicted_seconds(inp, choice, estimate)
    if mine <= inp.time_left:
        return
    options = [*range(inp.levels), TEXT]
    quicker = [o for o in options if predicted_seconds(inp, o, estimate) < mine
               and predicted_seconds(inp, o, estimate) <= inp.time_left]
    assert not quicker, (choice, mine, quicker, inp.time_left)


@pytest.mark.parametrize("scale", [10.0, 0.1])
def test_a_decode_prior_ten_times_off_costs_at_most_the_first_chunk(scale: float, monkeypatch) -> None:
    """The demo's fetch (12 chunks of 512 MiniLM tokens, its level ladder, its 200 -> 25 ->
    200 Mbit/s trace, 1 s SLO, a CPU decoder at 40 ms a chunk): a decode prior ten times
    too slow or too fast still meets the SLO, with the same choices as the true prior's
    from the second chunk on. Too slow, it would have planned every chunk as text, which
    times no decoder; the first chunk the plan would fetch without it times the decoder."""
    from netsim import generators
    from streamer.adapt import decoding

    trace = generators.steps([200.0, 25.0, 200.0], hold=0.25, step=0.05, name="demo-drop")
    fp16 = 6 * 2 * 512 * 384 * 2
    chunks = tuple(ChunkInfo(i, 512 * i, 512 * (i + 1), tuple(int(fp16 * bits / 16) for bits in (5.4, 4.0, 2.4, 1.5, 1.0)),
                             1200, 4 if i == 0 else 0) for i in range(12))
    m = Manifest("demo", "v1", 6, 12, 32, "float16", 6144, "prof", TARGETS, chunks, 0.0)
    sim = Simulator(m, rtt=0.004, recompute_seconds_per_token=4e-4, decode_seconds=0.04)
    true = decoding.measure_whole(512, 6, chunks[0].sizes[2], [0.04])
    off = decoding.DecodeCost(true.seconds_per_token * scale, true.bytes_per_token)
    right = sim.run("mpc", trace, slo=1.0, prior_bps=25e6, decode_prior=true)
    wrong = sim.run("mpc", trace, slo=1.0, prior_bps=25e6, decode_prior=off)
    assert right.met and wrong.met
    assert wrong.choices[1:] == right.choices[1:]
    if scale > 1:   # what the prior alone would have done: every chunk as text, and late
        monkeypatch.setattr(controller_module.FetchController, "_decoder_untimed", lambda self: False)
        poisoned = sim.run("mpc", trace, slo=1.0, prior_bps=25e6, decode_prior=off)
        assert poisoned.choices == [TEXT] * 12 and not poisoned.met


@pytest.mark.parametrize("continuations, restart", [(True, 1), (False, 1), (True, 3)],
                         ids=["continued", "text", "predicted"])
def test_a_simulated_chunk_continues_its_remaining_layers_at_a_lower_level(monkeypatch, continuations,
                                                                           restart) -> None:
    """The cancel rule (made to ask for level 2 once a layer of chunk 0 is out) on a
    sender that takes continuations: the simulated link answers with the layers not
    delivered only (sections numbered from there), and the result lists both runs and
    costs them by their layers. Without continuations the chunk goes to text. Where the
    levels predict each layer from the one before (restart 3), the continuation starts
    at the layer coded alone before the first not delivered: the layers between are
    handed to the decoder again (its chain needs them) and not delivered again."""
    asked: list[int] = []

    def switch_once_a_layer_is_out(plan, head, **_):
        if head.delivered_layers and not asked:
            asked.append(head.delivered_layers)
            return cancel.Switch(2, abort=False, escalate_after=1.0)
        return None

    monkeypatch.setattr(controller_module.cancel, "reconsider", switch_once_a_layer_is_out)
    m = dataclasses.replace(make_manifest([[400_000, 250_000, 100_000]] * 2, [256, 256], layers=8), restart=restart)
    sim = Simulator(m, rtt=0.004, decode_seconds=0.0)
    decoded: list[tuple[int, int]] = []

    def decode_time(chunk: int, layer: int, nbytes: int) -> float:
        decoded.append((chunk, layer))
        return 0.0

    r = sim.run("mpc", Trace([0.0], [8.0]), slo=5.0, prior_bps=1e6, continuations=continuations,
                decode_time=decode_time)
    assert asked and r.cancels == 1
    requests = [a for a in r.actions if isinstance(a, ev.SendRequest) and a.chunk == 0]
    if not continuations:
        assert r.choices[0] == TEXT and r.layer_levels[0] == ()
        return
    first = requests[-1].first_layer
    delivered = r.layer_levels[0][1][0]
    assert requests[-1].choice == 2 and 1 <= delivered < 8 and first == delivered - delivered % restart
    assert r.choices[0] == 2 and r.layer_levels[0] == ((0, 0), (delivered, 2))
    layers = [layer for chunk, layer in decoded if chunk == 0]
    assert layers[-(8 - first):] == list(range(first, 8))   # the continuation's, its context included
    d = m.level_distortion
    assert r.cost == pytest.approx((delivered * d[0] + (8 - delivered) * d[2]) / 8 + d[r.choices[1]])
    # the continuation carried about its share of level 2's bytes, not the whole blob
    assert m.answer_bytes(0, 2, first) < 100_000 * (8 - first + 1) / 8


def test_a_replayed_decoder_finishes_each_section_when_told_not_one_at_a_time() -> None:
    """The model's decoder takes the sections one at a time; a replay's (``decode_done``)
    finishes each when the recording says, as a session decoding on several threads did:
    the same fetch, its 4 sections of 0.1 s each, done 0.3 s sooner."""
    m = make_manifest([[400_000]], [256], layers=4)
    sim = Simulator(m, rtt=0.0)
    trace = Trace([0.0], [8000.0])    # 1 GB/s: every section is in at once
    one_worker = sim.run("fixed:0", trace, slo=5.0, decode_time=lambda c, l, b: 0.1)
    threads = sim.run("fixed:0", trace, slo=5.0, decode_time=lambda c, l, b: 0.1,
                      decode_done=lambda c, l, handed: handed + 0.1)
    assert one_worker.finish - threads.finish == pytest.approx(0.3, abs=0.01)
