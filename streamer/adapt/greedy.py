"""CacheGen's adaptation rule, kept as the baseline the planners are measured against.

Estimate the link by the last chunk's throughput, split the time left equally over
the remaining chunks (as CacheGen's public code does) and take the best level that
fits this chunk's share; if none does, text if it fits the share or at least the
time left, else the smallest level.
It ignores the sizes of later chunks and the estimate's noise, which is what
:mod:`streamer.adapt.mpc` improves on.
"""
from __future__ import annotations

import numpy as np

from streamer.adapt.estimator import last_sample
from streamer.adapt.base import TEXT, Choice, PlanInput, predicted_seconds, probe_level


def greedy(inp: PlanInput) -> Choice:
    """CacheGen's per-chunk rule; the smallest level as a probe when nothing is known."""
    estimate = last_sample(inp.history, inp.prior_bps)
    if estimate is None:
        return probe_level(inp)
    # CacheGen counts recompute in series: what the caller still owes comes off the time
    left = inp.time_left - inp.recompute_busy
    share = left / len(inp.sizes)
    fits = np.asarray(inp.sizes[0], dtype=np.float64) / estimate <= share
    if fits.any():
        return int(np.argmax(fits))  # first True = lowest index = best level
    if predicted_seconds(inp, TEXT, estimate) <= share:
        return TEXT
    # CacheGen's rule falls back to text when no level fits; do so whenever text can
    # still make the deadline, and send the smallest level only when nothing can
    if predicted_seconds(inp, TEXT, estimate) <= left:
        return TEXT
    return probe_level(inp)
