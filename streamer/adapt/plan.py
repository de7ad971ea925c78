"""Deadline planning: the cheapest choice per chunk whose total time fits a budget.

Every remaining chunk's size at every option is known, so instead of robustMPC's
5-chunk look-ahead over guessed sizes the plan is exact over *all* remaining chunks:
a knapsack-style dynamic program over (chunk, time used). Time is discretized into
``bins`` equal bins of the budget and each option's time is rounded *up* to whole
bins, so a plan the DP calls feasible is feasible in exact time too: the planner
may be pessimistic, never optimistic.

Guarantee (tested against brute force): the returned feasible plan costs no more
than any plan whose exact time is at most ``budget - chunks * budget / bins``
(rounding up costs at most one bin per chunk). The plan is recomputed before every
chunk, so that slack shrinks as the fetch proceeds.

The solver takes a plain ``[chunks, options]`` time matrix and cost matrix;
:mod:`streamer.adapt.overlap` builds its plans from it and from its pieces (the value
table, the walk), with text recomputed while later chunks stream.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

#: Time bins of the budget. 1024 bounds the rounding loss to 1/16 of the budget for
#: 64 remaining chunks (typically half that) and still solves in about a millisecond.
DEFAULT_BINS = 1024


@dataclass(frozen=True)
class Plan:
    """One option column per remaining chunk, with its exact totals."""

    columns: tuple[int, ...]
    cost: float
    seconds: float     # exact (not discretized) predicted total time
    feasible: bool     # fits the budget (with times rounded up to whole bins)


def validate(seconds: ArrayLike, costs: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    t = np.asarray(seconds, dtype=np.float64)
    if t.ndim != 2 or t.shape[0] == 0 or t.shape[1] == 0:
        raise ValueError(f"seconds must be a non-empty [chunks, options] matrix, got {t.shape}")
    if np.isnan(t).any() or (t < 0).any():
        raise ValueError("seconds must be >= 0 (inf marks an option that never fits)")
    c = np.broadcast_to(np.asarray(costs, dtype=np.float64), t.shape)
    if not np.isfinite(c).all():
        raise ValueError("costs must be finite")
    return t, c


def _totals(t: np.ndarray, c: np.ndarray, columns: np.ndarray, feasible: bool) -> Plan:
    rows = np.arange(t.shape[0])
    return Plan(tuple(int(j) for j in columns), float(c[rows, columns].sum()),
                float(t[rows, columns].sum()), feasible)


def fastest(seconds: ArrayLike, costs: ArrayLike) -> Plan:
    """The plan with minimal total time (ties: lower cost, then lower column).

    Chunks are independent once the budget is ignored, so it is a per-row choice.
    ``feasible`` is False: this is what to do when nothing fits.
    """
    t, c = validate(seconds, costs)
    quickest = t == t.min(axis=1, keepdims=True)
    columns = np.argmin(np.where(quickest, c, np.inf), axis=1)
    return _totals(t, c, columns, feasible=False)


def bins_needed(t: np.ndarray, budget: float, bins: int) -> np.ndarray:
    """Whole bins per option, rounded up; anything over the budget is capped at bins + 1
    ("does not fit"), which also keeps inf out of the integer cast. A budget so small
    that a bin's width underflows to 0 leaves only instant options."""
    width = budget / bins
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        return np.where(t == 0, 0, np.minimum(np.ceil(t / width), bins + 1)).astype(np.intp)


def value_table(c: np.ndarray, need: np.ndarray, bins: int, first: int) -> np.ndarray:
    """best[i, e] = least cost of chunks i.. (for i >= first) with e bins already used.

    Padding each row with inf past ``bins`` makes "over budget" an ordinary lookup.
    """
    chunks = c.shape[0]
    best = np.full((chunks + 1, 2 * (bins + 1)), np.inf)
    best[chunks, : bins + 1] = 0.0
    # after[i + 1, q] = best[i + 1, q:q + bins + 1] is "after spending q bins on chunk i",
    # for every e at once
    after = np.lib.stride_tricks.sliding_window_view(best, bins + 1, axis=1)
    for i in range(chunks - 1, first - 1, -1):
        best[i, : bins + 1] = (after[i + 1, need[i]] + c[i][:, None]).min(axis=0)
    return best


def solve(seconds: ArrayLike, costs: ArrayLike, budget: float,
          bins: int = DEFAULT_BINS) -> Plan:
    """Minimum-cost plan with total time within ``budget``; else :func:`fastest`.

    ``seconds`` [chunks, options] is each option's predicted time (``inf`` = never
    fits), ``costs`` [chunks, options] or [options] its cost. Ties between plans of
    equal cost go to the lower column (the better level) for the earliest chunk.
    """
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    t, c = validate(seconds, costs)
    free = t == 0
    if budget == 0 and free.any(axis=1).all():
        # Only instant options fit a zero budget (no bins to discretize into).
        return _totals(t, c, np.argmin(np.where(free, c, np.inf), axis=1), feasible=True)
    if not budget > 0:
        return fastest(t, c)
    need = bins_needed(t, budget, bins)
    best = value_table(c, need, bins, first=0)
    if not np.isfinite(best[0, 0]):
        return fastest(t, c)
    return _totals(t, c, walk(c, need, best, first=0, spent=0), feasible=True)


def walk(c: np.ndarray, need: np.ndarray, best: np.ndarray, first: int, spent: int) -> np.ndarray:
    """The columns of rows ``first..`` from ``spent`` bins used: forward, redoing each
    chunk's minimum at the one state reached (cheaper than storing an argmin for every state)."""
    columns = np.empty(c.shape[0] - first, dtype=np.intp)
    for i in range(first, c.shape[0]):
        columns[i - first] = np.argmin(c[i] + best[i + 1, spent + need[i]])
        spent += need[i, columns[i - first]]
    return columns
