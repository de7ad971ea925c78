"""Synthetic link-capacity traces.

Public traces (FCC, HSDPA) are video scale and licensed separately, so the project makes
its own shapes and rescales them to KV scale (100 Mbit/s - 10 Gbit/s). Every generator
samples on a uniform ``step`` grid and takes ``seed`` (an int or a numpy ``Generator``):
the same arguments always give the same trace, which is what lets ``make_traces.py``
rewrite the committed files byte for byte.
"""
from __future__ import annotations

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


def _grid(seconds: float, step: float) -> np.ndarray:
    if seconds <= 0 or step <= 0:
        raise ValueError(f"seconds and step must be positive, got {seconds}, {step}")
    n = int(round(seconds / step)) + 1
    return np.round(np.arange(n) * step, 6)


def _trace(times: np.ndarray, rates: np.ndarray, name: str) -> Trace:
    # Rounded to 0.001 Mbit/s so the committed CSVs stay short and readable.
    return Trace(times, np.round(rates, 3), name=name)
