"""Throughput estimation from finished chunk transfers (pure functions, no clocks).

The adaptation policies need one number, the bytes/s the next chunk will see. The
inputs are receiver-side :class:`~streamer.adapt.base.Observation` records whose
duration is the time the link was *busy* delivering the chunk (Mooncake's rule:
idle and queueing time would make a fast link look slow). Everything here works on
the whole history and recomputes from scratch: histories are short (one fetch),
and statelessness is what lets the live session and the simulator share the code.

The robust estimate starts from robustMPC (Yin et al., SIGCOMM'15): the harmonic mean
of the last few samples (dominated by the slow ones, as transfer time is). robustMPC
then divides by one plus the *worst* recent relative error, so one deep fade makes
every plan for the next five chunks several times too pessimistic (the planner then
gives the KV up for text). Here the estimate is calibrated instead: the harmonic mean
is scaled by the median of the recent prediction errors measured in the log domain
(``log(actual / predicted)``, never above 1), over a longer window that may include the
same peer's earlier fetches. A steady link has errors near zero and is planned at its
measured rate; a link that usually delivers less than its recent mean predicts is
planned at what it usually delivers. A drop that lasts must not wait for five samples
to outweigh the old ones, so the estimate is the lower of that slow one and the harmonic
mean of the last two samples (as dash.js plans at the lower of a fast and a slow
average): a level shift is believed at once, a single fade for two chunks. Risk is not
folded into this estimate: the planner weighs its first step over the rates at several
quantiles of the same errors (:func:`rate_scenarios`) and guards it separately
(:func:`guard_estimate`, ``adapt.mpc``).
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from streamer.adapt.base import Observation

#: A transfer smaller than this is dominated by round-trip time: on its own it is no
#: throughput sample (consecutive small ones are pooled into one, see ``pool_sample``).
MIN_SAMPLE_BYTES = 64 * 1024
#: Samples in the harmonic mean (robustMPC's 5).
DEFAULT_WINDOW = 5
#: Samples in the fast estimate: a level shift shows in it at once (dash.js's rule: plan
#: at the lower of a fast and a slow average), a single fade only for two chunks.
FAST_WINDOW = 2
#: Prediction errors the pessimism is calibrated on (this fetch's, after the peer's earlier ones).
ERROR_WINDOW = 20
#: The quantile of log prediction errors the robust estimate plans for (the median: a
#: central estimate; planning at a lower quantile gives up more KV for text than it saves
#: in deadlines, and risk is weighed separately by the scenarios and the guard).
ERROR_QUANTILE = 0.5
#: Errors a calibration needs before it speaks for itself: with fewer, the missing ones
#: count as 0 (predicted right), so one surprise moves the central estimate only once
#: another agrees with it. Otherwise a single deep fade is the whole calibration: the
#: peer's next estimates are divided by it, its next fetches go all text, measure nothing,
#: and stay text until the memory expires. The low quantiles of :func:`rate_scenarios`
#: and the guard's shortfall still see the fade.
MIN_ERRORS = 3
#: The quantiles of the recent log prediction errors a planner weighs its choice at
#: (:func:`rate_scenarios`): the central one is the robust estimate's.
SCENARIO_QUANTILES = (0.05, 0.15, 0.3, 0.5, 0.7)
#: The guard assumes the link may fall to this share of its mean, or only to its worst
#: recent shortfall when the peer's errors show it steadier than that.
GUARD_FACTOR = 0.5

#: The least time a sample of the chunk in flight spans (:func:`in_flight_sample`): two of
#: the shaping proxy's lumps (it releases 10 ms of its rate at once).
MIN_PARTIAL_SECONDS = 0.02

#: Shorter busy times are clock noise, not measurements (a 1e-300 s sample is an infinite rate).
_MIN_BUSY_SECONDS = 1e-9


def throughputs(history: Sequence[Observation]) -> np.ndarray:
    """Bytes/s of each informative observation, oldest first.

    An observation with no busy time (the bytes were already buffered when the
    receiver looked) or no bytes says nothing about the link's rate: keeping it
    would put an infinite or zero sample into a mean, so it is dropped rather than
    guessed at. So is a stall's upper bound (``Observation.upper_bound``: the chunk
    abandoned before enough of it came to measure) once a later transfer measured more:
    the bound said the link gave at most that while it stalled, and the stall is over.
    Kept, one low bound beside fast samples after the link came back would hold the
    harmonic mean near the bound and send the rest of the fetch to text.

    A plain loop, not array code: a history holds a few dozen observations, and the
    session runs this on its event loop at every look (numpy's per-call overhead
    dominates at this size, and the decode thread waits for the GIL meanwhile).
    """
    rates: list[float] = []
    bounds: list[bool] = []
    for o in history:
        if o.bytes > 0 and _MIN_BUSY_SECONDS < o.busy_seconds < math.inf:
            rates.append(o.bytes / o.busy_seconds)
            bounds.append(o.upper_bound)
    if any(bounds):
        kept, fastest_after = [], 0.0   # the fastest measured (not bound) rate after each
        for rate, bound in zip(reversed(rates), reversed(bounds)):
            if not bound:
                fastest_after = max(fastest_after, rate)
            elif fastest_after > rate:
                continue
            kept.append(rate)
        rates = kept[::-1]
    return np.array(rates, dtype=np.float64)


def _check_window(window: int) -> None:
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")


def _prior_or_none(prior: float | None) -> float | None:
    """The prior if it is a usable rate; a non-positive one is no information."""
    return float(prior) if prior is not None and prior > 0 and math.isfinite(prior) else None


def last_sample(history: Sequence[Observation], prior: float | None = None) -> float | None:
    """The most recent throughput (CacheGen's estimator), else ``prior``, else None."""
    rates = throughputs(history)
    return float(rates[-1]) if rates.size else _prior_or_none(prior)


def _harmonic(rates: np.ndarray) -> float:
    return float(rates.size / np.sum(1.0 / rates))


def harmonic_mean(history: Sequence[Observation], window: int = DEFAULT_WINDOW,
                  prior: float | None = None) -> float | None:
    """Harmonic mean of the last ``window`` throughputs, else ``prior``, else None.

    Harmonic, not arithmetic: the quantity that matters is time per byte, and the
    mean of times per byte is the harmonic mean of rates, so one slow sample weighs
    as much as it costs.
    """
    _check_window(window)
    rates = throughputs(history)
    return _harmonic(rates[-window:]) if rates.size else _prior_or_none(prior)


def log_errors(history: Sequence[Observation], window: int = DEFAULT_WINDOW) -> np.ndarray:
    """``log(actual / predicted)`` for each sample after the first (negative: the link
    delivered less than predicted). The log makes a halving and a doubling equally
    large, so a quantile of these is a factor to plan with."""
    predictions, actual = _predictions(history, window)
    return np.log(actual / predictions)


def _predictions(history: Sequence[Observation], window: int) -> tuple[np.ndarray, np.ndarray]:
    """(prediction, actual) rate of every sample after the first: the harmonic mean of
    the ``window`` samples before it (fewer at the start)."""
    _check_window(window)
    rates = throughputs(history)
    if rates.size < 2:
        return np.empty(0), np.empty(0)
    # a direct sum per sample, oldest first (prefix-sum differences would cancel
    # catastrophically when rates span orders of magnitude)
    reciprocals = (1.0 / rates[:-1]).tolist()
    predictions = []
    for i in range(1, rates.size):
        total = 0.0
        for r in reciprocals[max(0, i - window):i]:
            total += r
        predictions.append(min(i, window) / total)
    return np.array(predictions), rates[1:]


def _calibration(errors: Sequence[float] | np.ndarray) -> list[float]:
    """The last ``ERROR_WINDOW`` finite errors, padded with zeros to ``MIN_ERRORS`` when
    there are some (empty when there are none)."""
    e = [float(x) for x in list(errors)[-ERROR_WINDOW:] if math.isfinite(x)]
    if 0 < len(e) < MIN_ERRORS:
        e = [0.0] * (MIN_ERRORS - len(e)) + e
    return e


def _quantiles(values: Sequence[float], qs: Sequence[float]) -> list[float]:
    """``np.quantile(values, qs)`` (its default, linear method), to the last bit: numpy's
    costs ~0.2 ms a call on these few values, and the planners call it at every look."""
    ordered = sorted(values)
    n = len(ordered)
    out = []
    for q in qs:
        virtual = (n - 1) * q
        if virtual >= n - 1:
            out.append(ordered[-1])
            continue
        below = math.floor(virtual)
        gamma = virtual - below
        a, b = ordered[below], ordered[below + 1]
        # numpy's lerp: from the nearer end, so the result is monotonic in q
        out.append(b - (b - a) * (1 - gamma) if gamma >= 0.5 else a + (b - a) * gamma)
    return out


def error_factor(errors: Sequence[float] | np.ndarray, quantile: float = ERROR_QUANTILE) -> float | None:
    """``exp`` of the ``quantile`` of log prediction errors (fewer than ``MIN_ERRORS``
    padded with zeros), capped at 1 (never optimistic); None without errors to calibrate on."""
    e = _calibration(errors)
    if not e:
        return None
    return float(np.exp(min(0.0, _quantiles(e, (quantile,))[0])))


def recent_errors(history: Sequence[Observation], prior_errors: Sequence[float] = (),
                  window: int = DEFAULT_WINDOW) -> np.ndarray:
    """The peer's earlier log errors followed by this fetch's, the last ``ERROR_WINDOW``."""
    return np.concatenate((np.asarray(prior_errors, dtype=np.float64),
                           log_errors(history, window)))[-ERROR_WINDOW:]


def robust_estimate(history: Sequence[Observation], window: int = DEFAULT_WINDOW,
                    prior: float | None = None, prior_errors: Sequence[float] = ()) -> float | None:
    """The lower of the calibrated slow estimate (the harmonic mean of ``window`` samples
    scaled by the error factor, see the module docstring) and the fast one (the harmonic
    mean of the last ``FAST_WINDOW``), so a drop that lasts is believed at once.

    With no informative sample the prior is returned as is; None when there is no sample
    and no prior.
    """
    mean = harmonic_mean(history, window, prior)
    if mean is None:
        return None
    factor = error_factor(recent_errors(history, prior_errors, window))
    slow = mean if factor is None else mean * factor
    fast = harmonic_mean(history, FAST_WINDOW, prior)
    return min(slow, fast)


def rate_scenarios(history: Sequence[Observation], window: int = DEFAULT_WINDOW,
                   prior: float | None = None, prior_errors: Sequence[float] = (),
                   quantiles: Sequence[float] = SCENARIO_QUANTILES) -> np.ndarray:
    """Rates the link may run at for the rest of the fetch, one per quantile of the recent
    log prediction errors (each capped at 1, and at the fast estimate, as
    :func:`robust_estimate` is); equally likely by construction. Just the robust estimate
    while there are no errors to spread it; empty with no information at all.

    What a planner weighs a choice against when overestimating the link costs far more
    than underestimating it (a text chunk against a level step).
    """
    mean = harmonic_mean(history, window, prior)
    if mean is None:
        return np.empty(0)
    fast = harmonic_mean(history, FAST_WINDOW, prior)
    errors = _calibration(recent_errors(history, prior_errors, window))
    if not errors:
        return np.array([min(mean, fast)])
    factors = np.exp(np.minimum(0.0, _quantiles(errors, quantiles)))
    return np.minimum(mean * factors, fast)


@dataclass(frozen=True)
class LinkMemory:
    """What one fetch leaves for the next to the same peer: the harmonic mean of its last
    throughputs (bytes/s) and the recent log prediction errors that calibrate it (the
    next fetch's :func:`robust_estimate` applies them to this rate, once)."""

    rate: float
    errors: tuple[float, ...] = ()


def remember(history: Sequence[Observation], prior_errors: Sequence[float] = ()) -> LinkMemory | None:
    """The memory a fetch with this ``history`` leaves (None when it measured nothing):
    the session keeps one per sender, the simulator hands it to the next fetch.

    A stall's upper bound (``Observation.upper_bound``) is left out: a chunk that waited
    through a long stall leaves a bound of a few kbit/s, and a memory that low makes the
    next fetch all text, which measures nothing, so every later fetch to the peer would
    stay text. The next fetch starts from what was measured, and its own cancel rule
    meets the stall if it is still there.
    """
    history = [o for o in history if not o.upper_bound]
    # the mean, not the calibrated estimate: the next fetch calibrates its prior with the
    # errors carried beside it, and a calibrated rate would be scaled by them twice
    rate = harmonic_mean(history)
    if rate is None:
        return None
    return LinkMemory(rate, tuple(float(e) for e in recent_errors(history, prior_errors)))


def guard_estimate(history: Sequence[Observation], window: int = DEFAULT_WINDOW,
                   prior: float | None = None, prior_errors: Sequence[float] = ()) -> float | None:
    """The rate to assume when checking that a chunk, once requested, cannot sink the
    fetch: the harmonic mean times ``GUARD_FACTOR``, or times the worst recent shortfall
    (``exp`` of the smallest log error) when that is milder. A deeper fade is a stall,
    which the reconnect and the text fallback handle, not the choice of level."""
    mean = harmonic_mean(history, window, prior)
    if mean is None:
        return None
    return mean * shortfall(history, prior_errors, window)


def shortfall(history: Sequence[Observation], prior_errors: Sequence[float] = (),
              window: int = DEFAULT_WINDOW) -> float:
    """The share of its predicted rate the link may fall to, as far as a guard should
    assume: its worst recent shortfall (``exp`` of the smallest log error), but no less
    than ``GUARD_FACTOR``, which is also the answer before there are errors to go by."""
    errors = recent_errors(history, prior_errors, window)
    worst = float(np.exp(min(0.0, float(errors.min())))) if errors.size else 0.0
    return max(GUARD_FACTOR, worst)


def in_flight_sample(start: float, now: float, received: float,
                     received_by: Callable[[float], float]) -> Observation | None:
    """The chunk still arriving as a throughput sample: the second half of its transfer so
    far (by time, ``received_by(t)`` the bytes in by ``t``) when that half carried
    ``MIN_SAMPLE_BYTES`` over ``MIN_PARTIAL_SECONDS``, else all of it since ``start`` (its
    busy start); None while fewer than ``MIN_SAMPLE_BYTES`` are in or the transfer has run
    less than ``MIN_PARTIAL_SECONDS``.

    Why not all of it: a level shift in the middle of a chunk shows in its recent half long
    before it moves the average. And a shaper's bucket, full after the link idled, lets a
    chunk's first bytes through at once (the shaping proxy: 20 ms of its rate; tbf: its
    ``burst``): the average so far counts them as link rate for as long as the chunk
    lasts, the recent half only until the chunk has run twice as long as they took to
    come. Why not sooner: a shaper also releases its credit in lumps (the shaping proxy
    moves half its bucket, 10 ms of its rate, at once; tbf its ``burst``), so a few ms of
    a transfer read line rate or almost nothing, and a decision taken on them would pick
    a level the link cannot carry; ``MIN_PARTIAL_SECONDS`` (two lumps) is the least a
    sample spans. Finished chunks stay whole samples: the estimator's errors are
    calibrated on those.
    """
    if received < MIN_SAMPLE_BYTES or not now - start >= MIN_PARTIAL_SECONDS:
        return None
    middle = start + (now - start) / 2
    recent = received - received_by(middle)
    if recent >= MIN_SAMPLE_BYTES and now - middle >= MIN_PARTIAL_SECONDS:
        return Observation(int(recent), now - middle)
    return Observation(int(received), now - start)


def arrived_by(curve: Sequence[tuple[float, float]], t: float) -> float:
    """Bytes in by time ``t`` on an arrival curve of (time, bytes received) points, oldest
    first: linear between points (bytes come in parts, and a part's bytes arrived over the
    time since the one before), the first point's bytes before it, the last's after it."""
    i = bisect.bisect_right(curve, t, key=lambda point: point[0])
    if i == 0:
        return float(curve[0][1])
    if i == len(curve):
        return float(curve[-1][1])
    (t0, b0), (t1, b1) = curve[i - 1], curve[i]
    return b0 + (b1 - b0) * (t - t0) / (t1 - t0)


def pool_sample(pending: Observation | None, nbytes: int, busy_seconds: float
                ) -> tuple[Observation | None, Observation | None]:
    """Fold one finished transfer into the samples: (sample to record or None, new pending).

    A transfer of at least ``MIN_SAMPLE_BYTES`` is a sample of its own. Smaller ones
    (a context of small chunks) are pooled with the ones before them until
    together they reach that size, so a fetch of small chunks still measures its link
    instead of planning blind on the prior. A transfer with no busy time adds nothing.
    """
    if busy_seconds <= 0 or nbytes <= 0:
        return None, pending
    if nbytes >= MIN_SAMPLE_BYTES:
        return Observation(nbytes, busy_seconds), pending
    pooled = Observation(nbytes + (pending.bytes if pending else 0),
                         busy_seconds + (pending.busy_seconds if pending else 0.0))
    if pooled.bytes >= MIN_SAMPLE_BYTES:
        return pooled, None
    return None, pooled

