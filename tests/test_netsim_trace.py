"""Trace parsing, validation, integration and generators."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import netsim
from netsim import generators as g
from netsim import make_traces
from netsim.trace import Trace


# --------------------------------------------------------------------- parsing
def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "t.csv"
    p.write_text(text)
    return p


def test_load_header_comments_and_whitespace(tmp_path: Path) -> None:
    p = _write(tmp_path, "# FCC style\nseconds, mbit_per_s\n0, 10\n\n1.5,20  # inline\n3 5\n")
    t = Trace.load(p)
    assert list(t.times) == [0, 1.5, 3]
    assert list(t.rates) == [10, 20, 5]
    assert t.name == "t"


def test_save_load_roundtrip_is_exact(tmp_path: Path) -> None:
    t = g.random_walk(300, 100, 1000, 5, seed=3)
    t.save(tmp_path / "w.csv")
    assert Trace.load(tmp_path / "w.csv") == t


@pytest.mark.parametrize("text, message", [
    ("", "no samples"),
    ("# only a comment\nseconds,mbit\n", "no samples"),
    ("0,10\n2,10\n1,10\n", "strictly increase"),
    ("0,10\n0,20\n", "strictly increase"),
    ("0,10\n1,-5\n", "non-negative"),
    ("0,10\n1\n", "missing value"),
    ("0,10\n1,abc\n", "non-numeric"),
    ("0,10\n1,nan\n", "finite"),
    ("0,10,3\n", "2 columns"),
    ("-1,10\n", "non-negative"),
])
def test_load_rejects_bad_files(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Trace.load(_write(tmp_path, text))


def test_bad_row_error_names_the_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"t\.csv:3"):
        Trace.load(_write(tmp_path, "0,1\n1,2\n2,x\n"))


# --------------------------------------------------------------------- queries
def test_rate_at_is_stepwise_and_holds_last() -> None:
    t = Trace([0, 1, 2], [10, 20, 5])
    assert t.rate_at(0) == 10
    assert t.rate_at(0.999) == 10
    assert t.rate_at(1) == 20
    assert t.rate_at(2) == 5
    assert t.rate_at(1000) == 5


def test_integrals_exact_on_a_small_trace() -> None:
    t = Trace([0, 1, 2], [10, 20, 5])
    assert t.bits_between(0, 2) == pytest.approx(30e6)
    assert t.bits_between(0.5, 1.5) == pytest.approx(15e6)
    assert t.bits_between(2, 4) == pytest.approx(10e6)  # held past the end
    assert t.time_to_send(15e6, 0.5) == pytest.approx(1.0)
    assert t.time_to_send(0, 1.0) == 0.0
    assert t.duration == 2
    assert t.mean == pytest.approx(15)


def test_time_to_send_never_on_a_dead_link() -> None:
    t = Trace([0, 1], [10, 0])
    assert t.time_to_send(5e6, 0) == pytest.approx(0.5)
    assert math.isinf(t.time_to_send(20e6, 0))


def test_constant_and_percentile() -> None:
    t = Trace.constant(250, 4)
    assert t.duration == 4 and t.mean == 250 and t.rate_at(100) == 250
    s = g.steps([100, 200, 300, 400], hold=1, step=0.5)
    assert s.percentile(10) == 100
    assert s.percentile(60) == 300
    assert s.percentile(100) == 400


def test_rescaled_by_mean_and_range() -> None:
    t = Trace([0, 1, 2, 3], [1, 3, 2, 2])
    assert t.rescaled(mean=100).mean == pytest.approx(100)
    r = t.rescaled(low=100, high=1000)
    assert (r.low, r.high) == pytest.approx((100, 1000))
    with pytest.raises(ValueError, match="flat"):
        Trace.constant(5, 1).rescaled(low=1, high=2)
    with pytest.raises(ValueError, match="either"):
        t.rescaled(mean=1, low=1, high=2)


# --------------------------------------------------------------------- properties
@st.composite
def traces(draw: st.DrawFn) -> Trace:
    n = draw(st.integers(1, 12))
    steps = draw(st.lists(st.floats(0.01, 5), min_size=n, max_size=n))
    rate = st.one_of(st.just(0.0), st.floats(0.001, 10_000))  # an outage, or a real rate
    rates = draw(st.lists(rate, min_size=n, max_size=n))
    start = draw(st.floats(0, 2))
    return Trace(start + np.cumsum([0.0, *steps[:-1]]), rates)


@given(traces(), st.floats(0, 30), st.floats(0, 30), st.floats(0, 30))
def test_bits_between_is_additive(t: Trace, a: float, b: float, c: float) -> None:
    x, y, z = sorted((a, b, c))
    whole = t.bits_between(x, z)
    assert t.bits_between(x, y) + t.bits_between(y, z) == pytest.approx(whole, rel=1e-9, abs=1e-3)
    assert whole >= 0


@given(traces(), st.floats(0, 30), st.floats(1, 1e10))
def test_time_to_send_inverts_bits_between(t: Trace, start: float, bits: float) -> None:
    d = t.time_to_send(bits, start)
    if math.isinf(d):
        assert t.rates[-1] == 0
        return
    assert t.bits_between(start, start + d) == pytest.approx(bits, rel=1e-6, abs=1e-3)


@given(traces(), st.floats(1, 5000))
def test_rescale_to_mean_keeps_shape(t: Trace, mean: float) -> None:
    if t.mean == 0:
        return
    r = t.rescaled(mean=mean)
    assert r.mean == pytest.approx(mean, rel=1e-9)
    np.testing.assert_allclose(r.rates * t.mean, t.rates * r.mean, rtol=1e-9, atol=1e-6)
    assert np.array_equal(r.times, t.times)


@given(traces(), st.floats(0, 100), st.floats(1, 10_000))
def test_rescale_to_range_keeps_normalised_shape(t: Trace, low: float, span: float) -> None:
    if t.high == t.low:
        return
    r = t.rescaled(low=low, high=low + span)
    norm = lambda x: (x.rates - x.low) / (x.high - x.low)  # noqa: E731
    np.testing.assert_allclose(norm(r), norm(t), atol=1e-6)


# --------------------------------------------------------------------- generators
@pytest.mark.parametrize("make", [
    lambda s: g.on_off(1000, 0, 10, seed=s),
    lambda s: g.random_walk(500, 100, 2000, 10, seed=s),
    lambda s: g.markov([1000, 300, 100], 10, seed=s),
])
def test_generators_are_seeded(make) -> None:
    assert make(1) == make(1)
    assert make(1) != make(2)
    assert make(np.random.default_rng(7)) == make(7)


def test_generator_shapes() -> None:
    st_ = g.steps([100, 50], hold=2, step=0.5)
    assert st_.rate_at(1.9) == 100 and st_.rate_at(2.0) == 50 and st_.duration == 4
    w = g.random_walk(500, 100, 2000, 20, volatility=2.0, seed=1)
    assert w.low >= 100 - 1e-3 and w.high <= 2000 + 1e-3
    o = g.on_off(1000, 10, 30, seed=2)
    assert set(np.unique(o.rates)) == {10, 1000}
    m = g.markov([1000, 100], 20, noise=0.0, seed=3)
    assert set(np.unique(m.rates)) == {100, 1000}
    c = g.constant(42, 3, step=0.5)
    assert len(c) == 7 and c.mean == 42


def test_markov_modulated_is_deterministic_per_seed() -> None:
    assert g.markov_modulated(10, seed=4) == g.markov_modulated(10, seed=4)
    assert g.markov_modulated(10, seed=4) != g.markov_modulated(10, seed=5)
    assert g.markov_modulated(10, seed=np.random.default_rng(4)) == g.markov_modulated(10, seed=4)


def test_markov_modulated_states_range_dwells_and_fades() -> None:
    low, high = 50.0, 10_000.0
    m = g.markov_modulated_parts(20, low=low, high=high, states=6, min_dwell=0.2, tail=1.5,
                                 fade_rate=1.0, seed=9)
    t, base = m.trace, m.base
    assert t.duration == 20 and np.array_equal(t.times, base.times)
    assert len(m.levels) == 6 and all(low <= x <= high for x in m.levels)
    # without the fades the rate stays in [low, high]; with them never above base
    assert base.low >= low - 1e-3 and base.high <= high + 1e-3
    assert np.all(t.rates <= base.rates)
    # heavy-tailed dwells: none under the minimum, consecutive, covering the trace
    assert all(d >= 0.2 - 1e-3 for _, d, _ in m.dwells[:-1])
    assert m.dwells[0][0] == 0 and m.dwells[-1][0] + m.dwells[-1][1] >= 20 - 1e-9
    assert all(k1 != k2 for (_, _, k1), (_, _, k2) in zip(m.dwells, m.dwells[1:]))
    # deep fades: 20-200 ms at 1-5% of the current rate, and nothing else is cut
    assert len(m.fades) >= 5
    faded = np.zeros(len(t.times), dtype=bool)
    for start, end, depth in m.fades:
        assert 0.02 - 1e-3 <= end - start <= 0.2 + 1e-3
        assert 0.01 <= depth <= 0.05
        inside = (t.times >= start - 1e-9) & (t.times < end - 1e-9)
        assert inside.any()
        np.testing.assert_allclose(t.rates[inside], base.rates[inside] * depth, atol=1e-3)
        faded |= inside
    np.testing.assert_array_equal(t.rates[~faded], base.rates[~faded])


def test_markov_modulated_rejects_bad_arguments() -> None:
    for kwargs in (dict(low=0), dict(low=100, high=50), dict(states=1), dict(fade_depth=(0.05, 0.01)),
                   dict(min_dwell=0)):
        with pytest.raises(ValueError):
            g.markov_modulated(5, **kwargs)


# --------------------------------------------------------------------- trace set
def test_trace_set_is_committed_and_in_range() -> None:
    ts = netsim.trace_set()
    assert len(ts) >= 20
    for name, t in ts.items():
        assert t.name == name
        assert 10 <= t.duration <= 30, name
        step = float(t.times[1] - t.times[0])
        assert 0.1 - 1e-9 <= step <= 0.5 + 1e-9, name
        assert t.high <= 11_000, name
    assert min(t.mean for t in ts.values()) <= 150
    assert max(t.mean for t in ts.values()) >= 9000


def test_unseen_trace_set_is_committed_and_markov_modulated() -> None:
    ts = netsim.trace_set("unseen")
    assert 12 <= len(ts) <= 20 and set(ts) == set(make_traces.UNSEEN_RECIPES)
    assert not set(ts) & set(netsim.trace_set())
    for name, t in ts.items():
        assert t.name == name
        assert 15 <= t.duration <= 20, name
        assert t.high <= 10_000 + 1e-3 and t.low > 0, name
        drops = t.rates[1:] / np.maximum(t.rates[:-1], 1e-9)
        assert drops.min() <= 0.05 + 1e-3, name  # at least one deep fade
    with pytest.raises(ValueError, match="unknown trace set"):
        netsim.trace_set("nope")


def test_make_traces_reproduces_the_committed_files() -> None:
    assert make_traces.main(["--check"]) == 0  # both sets


def test_make_traces_check_catches_an_edited_unseen_file(tmp_path: Path, monkeypatch) -> None:
    unseen = make_traces.SETS["unseen"]
    copy = tmp_path / "traces_unseen"
    copy.mkdir()
    for p in unseen.directory.iterdir():
        (copy / p.name).write_text(p.read_text())
    monkeypatch.setitem(make_traces.SETS, "unseen", make_traces.TraceSet(
        "unseen", copy, unseen.recipes, unseen.readme))
    assert make_traces.main(["--check", "--set", "unseen"]) == 0
    first = sorted(copy.glob("*.csv"))[0]
    first.write_text(first.read_text().replace(",", ", ", 3))
    assert make_traces.main(["--check", "--set", "unseen"]) == 1


# --------------------------------------------------------------------- cli
def test_cli_registers_handlers_and_lists_traces(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from streamer.tools import netsim_cli as cli

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    bench = sub.add_parser("bench").add_subparsers()
    cli.register(sub, bench)
    args = parser.parse_args(["netsim", "traces"])
    assert args.handler(args) == 0
    assert "walk-1g" in capsys.readouterr().out
    for argv in (["netsim", "proxy", "--upstream", "127.0.0.1:1", "--rate", "10", "--stall", "1:2"],
                 ["netsim", "netns", "--rate", "10", "--", "true"], ["bench", "netsim", "--json"]):
        assert callable(parser.parse_args(argv).handler)
