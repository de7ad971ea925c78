"""Throughput estimation from finished chunk transfers (pure functions, no clocks).

The adaptation policies need one number, the bytes/s the next chunk will see. The
inputs are receiver-side :class:`~streamer.adapt.base.Observation` records whose
duration is the time the link was *busy* delivering the chunk (Mooncake's rule:
idle and queueing time would make a fast link look slow). Everything here works on
the whole history and recomputes from scratch: histories are short (one fetch),
and statelessness is what lets the live session and the simulator share the code.

The robust estimate follows robustMPC (Yin et al., SIGCOMM'15): the harmonic mean
of the last few samples (dominated by the slow ones, as transfer time is), divided
by one plus the worst recent relative prediction error, so a volatile link is
planned for pessimistically and a steady one at its measured rate.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # only for annotations; policy.base imports nothing from here
    from streamer.adapt.base import Observation

#: Samples in the harmonic mean and predictions in the error window (robustMPC's 5).
DEFAULT_WINDOW = 5


#: Shorter busy times are clock noise, not measurements (a 1e-300 s sample is an infinite rate).
_MIN_BUSY_SECONDS = 1e-9


def throughputs(history: Sequence[Observation]) -> np.ndarray:
    """Bytes/s of each informative observation, oldest first.

    An observation with no busy time (the bytes were already buffered when the
    receiver looked) or no bytes says nothing about the link's rate: keeping it
    would put an infinite or zero sample into a mean, so it is dropped rather than
    guessed at.
    """
    if not history:
        return np.empty(0)
    nbytes = np.fromiter((o.bytes for o in history), dtype=np.float64, count=len(history))
    busy = np.fromiter((o.busy_seconds for o in history), dtype=np.float64,
                       count=len(history))
    keep = (busy > _MIN_BUSY_SECONDS) & (nbytes > 0) & np.isfinite(busy)
    return nbytes[keep] / busy[keep]


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


def prediction_errors(history: Sequence[Observation],
                      window: int = DEFAULT_WINDOW) -> np.ndarray:
    """Relative error ``|prediction - actual| / actual`` for each sample after the first.

    The prediction for sample ``i`` is the harmonic mean of the ``window`` samples
    before it, i.e. what :func:`harmonic_mean` would have said just before that
    chunk. The first sample had no prediction from history, so it has no error;
    the result has one entry fewer than :func:`throughputs`.
    """
    _check_window(window)
    rates = throughputs(history)
    if rates.size < 2:
        return np.empty(0)
    # Row i of `before` holds the reciprocals of the `window` samples preceding
    # sample i, zero-padded at the start (a direct sum: prefix-sum differences
    # would cancel catastrophically when rates span orders of magnitude).
    padded = np.concatenate((np.zeros(window), 1.0 / rates[:-1]))
    before = np.lib.stride_tricks.sliding_window_view(padded, window)[1:]
    counts = np.minimum(np.arange(1, rates.size), window)
    predictions = counts / before.sum(axis=1)
    actual = rates[1:]
    return np.abs(predictions - actual) / actual


def robust_estimate(history: Sequence[Observation], window: int = DEFAULT_WINDOW,
                    prior: float | None = None) -> float | None:
    """robustMPC's throughput: harmonic mean / (1 + max of the last ``window`` errors).

    With no informative sample the prior is returned as is (there are no errors to
    discount it by), and None when there is no prior either.
    """
    mean = harmonic_mean(history, window, prior)
    if mean is None:
        return None
    errors = prediction_errors(history, window)[-window:]
    return mean / (1.0 + float(errors.max())) if errors.size else mean
