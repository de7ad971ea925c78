"""Synthetic link-capacity traces.

Public traces (FCC, HSDPA) are video scale and licensed separately, so the project makes
its own shapes and rescales them to KV scale (100 Mbit/s - 10 Gbit/s). Every generator
takes ``seed`` (an int or a numpy ``Generator``): the same arguments always give the
same trace, which is what lets ``make_traces.py`` rewrite the committed files byte for
byte. All but :func:`markov_modulated` sample on a uniform ``step`` grid; that one
writes its change points (state switches, fade edges, jitter steps) at 1 ms resolution,
so 20-200 ms fades are exact without a 1 ms grid.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from netsim.trace import Trace

Seed = int | np.random.Generator


def constant(mbit_per_s: float, seconds: float, step: float = 0.1, name: str = "") -> Trace:
    """A flat trace sampled on the grid (unlike :meth:`Trace.constant`'s two points),
    so it looks like every other generated file."""
    times = _grid(seconds, step)
    return _trace(times, np.full(len(times), float(mbit_per_s)), name or f"constant-{mbit_per_s:g}")


def steps(levels: Sequence[float], hold: float, step: float = 0.1, name: str = "steps") -> Trace:
    """Hold each level for ``hold`` seconds in turn: clean drops and recoveries whose
    timing a test or benchmark can predict exactly."""
    if not levels:
        raise ValueError("steps() needs at least one level")
    times = _grid(hold * len(levels), step)
    idx = np.minimum((times / hold + 1e-9).astype(int), len(levels) - 1)
    return _trace(times, np.asarray(levels, dtype=float)[idx], name)


def on_off(high: float, low: float, seconds: float, *, mean_on: float = 2.0, mean_off: float = 0.5,
           step: float = 0.1, seed: Seed = 0, name: str = "on_off") -> Trace:
    """Alternate ``high`` and ``low`` with exponentially distributed dwell times: outages
    (``low`` near 0) of the kind a streamer must ride out without stalling the GPU."""
    rng = np.random.default_rng(seed)
    times = _grid(seconds, step)
    rates = np.empty(len(times))
    t, on = 0.0, True
    while t <= seconds:
        dwell = rng.exponential(mean_on if on else mean_off)
        rates[(times >= t) & (times < t + dwell)] = high if on else low
        t, on = t + dwell, not on
    return _trace(times, rates, name)


def random_walk(start: float, low: float, high: float, seconds: float, *, volatility: float = 0.3,
                step: float = 0.1, seed: Seed = 0, name: str = "random_walk") -> Trace:
    """A geometric random walk (``volatility`` is the log-rate std per sqrt-second),
    reflected into ``[low, high]``: capacity that drifts like a shared link's."""
    if not 0 < low <= start <= high:
        raise ValueError(f"need 0 < low <= start <= high, got {low}, {start}, {high}")
    rng = np.random.default_rng(seed)
    times = _grid(seconds, step)
    lo, hi = np.log(low), np.log(high)
    x = np.empty(len(times))
    x[0] = np.log(start)
    shocks = rng.normal(0.0, volatility * np.sqrt(step), len(times) - 1)
    for i, dx in enumerate(shocks, start=1):
        v = x[i - 1] + dx
        v = lo + abs(v - lo)  # reflect at the bounds so the walk does not stick to them
        v = hi - abs(hi - v)
        x[i] = min(max(v, lo), hi)
    return _trace(times, np.exp(x), name)


def markov(levels: Sequence[float], seconds: float, *, mean_dwell: float = 1.5, noise: float = 0.05,
           step: float = 0.1, seed: Seed = 0, name: str = "markov") -> Trace:
    """Markov-modulated capacity: the link sits in one of ``levels`` for an exponential
    dwell, then jumps to a uniformly chosen other level; ``noise`` is the relative
    per-sample jitter within a state. Models cells or shared uplinks that switch regimes."""
    if len(levels) < 2:
        raise ValueError("markov() needs at least two levels")
    rng = np.random.default_rng(seed)
    times = _grid(seconds, step)
    lv = np.asarray(levels, dtype=float)
    state = np.empty(len(times), dtype=int)
    t, s = 0.0, int(rng.integers(len(lv)))
    while t <= seconds:
        dwell = rng.exponential(mean_dwell)
        state[(times >= t) & (times < t + dwell)] = s
        t = t + dwell
        s = (s + 1 + int(rng.integers(len(lv) - 1))) % len(lv)
    rates = lv[state] * np.clip(1.0 + rng.normal(0.0, noise, len(times)), 0.0, None)
    return _trace(times, rates, name)


@dataclass(frozen=True)
class Modulated:
    """What :func:`markov_modulated_parts` drew: the trace and how it was made.

    ``base`` is the same trace without the fades; ``levels`` the capacity states;
    ``dwells`` each visit as ``(start, seconds, state)``; ``fades`` each fade as
    ``(start, end, depth)`` (the rate in ``[start, end)`` is ``depth`` times ``base``'s).
    """

    trace: Trace
    base: Trace
    levels: tuple[float, ...]
    dwells: tuple[tuple[float, float, int], ...]
    fades: tuple[tuple[float, float, float], ...]


def markov_modulated_parts(seconds: float, *, low: float = 50.0, high: float = 10_000.0,
                           states: int = 6, min_dwell: float = 0.2, tail: float = 1.5,
                           max_dwell: float | None = None, noise: float = 0.1, noise_step: float = 0.1,
                           fade_rate: float = 0.5, fade_depth: tuple[float, float] = (0.01, 0.05),
                           fade_seconds: tuple[float, float] = (0.02, 0.2), seed: Seed = 0,
                           name: str = "markov_modulated") -> Modulated:
    """:func:`markov_modulated`, with the states, visits and fades it drew."""
    if not 0 < low < high:
        raise ValueError(f"need 0 < low < high, got {low}, {high}")
    if states < 2:
        raise ValueError("markov_modulated() needs at least two states")
    if not (min_dwell > 0 and tail > 0 and noise >= 0 and noise_step > 0 and fade_rate >= 0):
        raise ValueError("min_dwell, tail and noise_step must be > 0; noise and fade_rate >= 0")
    if not (0 < fade_depth[0] <= fade_depth[1] <= 1 and 0 < fade_seconds[0] <= fade_seconds[1]):
        raise ValueError(f"bad fade_depth {fade_depth} or fade_seconds {fade_seconds}")
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    rng = np.random.default_rng(seed)
    ms = lambda x: float(np.round(x, 3))  # noqa: E731 - change points at 1 ms resolution
    # States log-uniform over [low, high]; a random transition matrix without self-loops.
    levels = np.sort(np.exp(rng.uniform(np.log(low), np.log(high), states)))
    trans = rng.dirichlet(np.ones(states - 1), size=states)
    # Visits: Pareto (type I) dwell times, heavy-tailed with index ``tail``.
    dwells: list[tuple[float, float, int]] = []
    t, s = 0.0, int(rng.integers(states))
    while t < seconds:
        d = min_dwell * (1.0 + rng.pareto(tail))
        if max_dwell is not None:
            d = min(d, max_dwell)
        end = max(ms(t + d), ms(t + 0.001))
        dwells.append((t, ms(end - t), s))
        others = [k for k in range(states) if k != s]
        s = others[int(rng.choice(states - 1, p=trans[s]))]
        t = end
    # Jitter within a state: lognormal, one draw per ``noise_step`` cell, clipped to the range.
    cells = int(np.ceil(seconds / noise_step)) + 1
    jitter = np.exp(rng.normal(0.0, noise, cells)) if noise > 0 else np.ones(cells)
    # Fades: a Poisson process of ``fade_rate`` per second, never overlapping.
    fades: list[tuple[float, float, float]] = []
    t = 0.0
    while fade_rate > 0:
        t += rng.exponential(1.0 / fade_rate)
        length = np.exp(rng.uniform(np.log(fade_seconds[0]), np.log(fade_seconds[1])))
        depth = float(np.round(rng.uniform(*fade_depth), 4))
        start, end = ms(t), ms(t + length)
        if end > seconds:  # only whole fades, inside the trace
            break
        if end > start:
            fades.append((start, end, depth))
        t = end
    # Change points: visits, jitter cells and fade edges, at 1 ms.
    points = {0.0, ms(seconds)}
    points.update(ms(a) for a, _, _ in dwells)
    points.update(ms(k * noise_step) for k in range(cells) if k * noise_step < seconds)
    for a, b, _ in fades:
        points.update((a, b))
    times = np.array(sorted(p for p in points if p <= seconds))
    starts = np.array([a for a, _, _ in dwells])
    state_of = np.array([k for _, _, k in dwells])[np.searchsorted(starts, times + 1e-9, side="right") - 1]
    cell_of = np.minimum((times / noise_step + 1e-9).astype(int), cells - 1)
    base = np.clip(levels[state_of] * jitter[cell_of], low, high)
    rates = base.copy()
    for a, b, depth in fades:
        rates[(times >= a - 1e-9) & (times < b - 1e-9)] *= depth
    return Modulated(_trace(times, rates, name), _trace(times, base, name),
                     tuple(float(x) for x in levels), tuple(dwells), tuple(fades))


def markov_modulated(seconds: float, *, low: float = 50.0, high: float = 10_000.0, states: int = 6,
                     min_dwell: float = 0.2, tail: float = 1.5, max_dwell: float | None = None,
                     noise: float = 0.1, noise_step: float = 0.1, fade_rate: float = 0.5,
                     fade_depth: tuple[float, float] = (0.01, 0.05),
                     fade_seconds: tuple[float, float] = (0.02, 0.2), seed: Seed = 0,
                     name: str = "markov_modulated") -> Trace:
    """Markov-modulated capacity with heavy-tailed dwells and short deep fades.

    ``states`` capacity levels drawn log-uniformly over ``[low, high]`` Mbit/s; the link
    stays in a state for a Pareto dwell (minimum ``min_dwell`` s, tail index ``tail``:
    1.5 gives a finite mean of 3x the minimum and an infinite variance, so most visits
    are short and a few last many seconds; ``max_dwell`` caps them), then moves to
    another state by a transition matrix drawn per trace (Dirichlet rows, no
    self-loops). Within a state the rate jitters (lognormal, sigma ``noise``, one draw
    per ``noise_step`` s) and stays in ``[low, high]``. On top, fades arrive as a
    Poisson process of ``fade_rate`` per second: each lasts log-uniformly
    ``fade_seconds`` (20-200 ms) and cuts the current rate to ``fade_depth`` (1-5%) of
    it. The trace ends with a sample at ``seconds``.
    """
    return markov_modulated_parts(seconds, low=low, high=high, states=states, min_dwell=min_dwell,
                                  tail=tail, max_dwell=max_dwell, noise=noise, noise_step=noise_step,
                                  fade_rate=fade_rate, fade_depth=fade_depth, fade_seconds=fade_seconds,
                                  seed=seed, name=name).trace


def _grid(seconds: float, step: float) -> np.ndarray:
    if seconds <= 0 or step <= 0:
        raise ValueError(f"seconds and step must be positive, got {seconds}, {step}")
    n = int(round(seconds / step)) + 1
    return np.round(np.arange(n) * step, 6)


def _trace(times: np.ndarray, rates: np.ndarray, name: str) -> Trace:
    # Rounded to 0.001 Mbit/s so the committed CSVs stay short and readable.
    return Trace(times, np.round(rates, 3), name=name)
