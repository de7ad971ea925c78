"""Recompute overlapped with transfer: the cost model, and deadline plans that use it.

Two resources work at once. The **link** carries the chunks in order (a KV chunk's
bytes, or a text chunk's token ids). The caller's **compute** recomputes the chunks sent
as text, in order: chunk ``i``'s prefill attends to chunks ``0..i-1``, so it starts once
its token ids are in and chunk ``i-1`` is delivered, and it runs while the link carries
later chunks. Delivery is strictly in order: a KV chunk is delivered once it has
arrived and chunk ``i-1`` is delivered. With ``A_i`` the link time by which chunk ``i``
has arrived and ``r_i`` its recompute seconds (0 for a KV chunk), chunk ``i`` is
delivered at

    D_i = max(D_{i-1}, A_i) + r_i,        D_{-1} = busy

where ``busy`` is the recompute still owed for earlier chunks already sent to text
(:func:`finish`). Text at the front of a fetch therefore costs compute, not link time:
it is recomputed while the KV of the later chunks streams (Cake, arXiv 2410.03065,
computes from the front and loads from the back), whereas text after a KV chunk waits
for that chunk and adds its recompute in series.

The plan (:func:`solve`) is exact within two shapes of schedule and takes the cheaper:

* **series**: any mix of levels and text, timed as if nothing overlapped
  (``busy + sum(link + recompute)``, an upper bound on ``D``): the knapsack of
  :mod:`streamer.adapt.plan` over a budget less ``busy``;
* **text prefix**: the next ``q`` chunks as text, then levels only, timed exactly as
  ``max(D_q, A_n)``: for each ``q`` the best level-only suffix from one knapsack table
  over the whole budget.

A plan one shape calls feasible is feasible under the model, so the planner may be
pessimistic (a schedule with text between KV chunks is timed in series), never optimistic.

The receiver's **decoder** is a third stage, between the link and delivery: a KV chunk's
sections decode while the next chunk's arrive, so a chunk holds the pipeline for the
slower of its transfer and its decode. ``link`` here is that time
(``base.link_seconds``), and the decoding owed for chunks already requested comes off the
budget (``base.pipeline_budget``, ``adapt.decoding``); where the decoder keeps up (the
simulator's receiver, a GPU decoder) both reduce to the link alone.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

from streamer.adapt.plan import DEFAULT_BINS, Plan, bins_needed, fastest, validate, value_table, walk
from streamer.adapt.plan import solve as solve_series


def finish(link: Sequence[float], recompute: Sequence[float], busy: float = 0.0) -> float:
    """``D`` of the last chunk (see the module docstring): ``link[i]`` the link seconds of
    chunk ``i`` as chosen, ``recompute[i]`` its recompute seconds (0 for a KV chunk)."""
    arrived, done = 0.0, float(busy)
    for seconds, compute in zip(link, recompute):
        arrived += float(seconds)
        done = max(done, arrived) + float(compute)
    return done


def _tables(link: ArrayLike, recompute: ArrayLike, costs: ArrayLike, budget: float, busy: float,
            bins: int, series: bool = True):
    """The series knapsack and the level-only one, and each text prefix's cost and bins.

    Returns (t, c, r, series, levels, prefix) where ``series`` is (need, best) over a
    budget of ``budget - busy`` (None when that is not positive, or not asked for),
    ``levels`` is (costs with text barred, need, best) over ``budget``, and ``prefix[q]``
    the least total cost of ``q`` text chunks followed by levels only (inf where that misses).
    """
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    if not busy >= 0:
        raise ValueError(f"busy must be >= 0 seconds, got {busy}")
    t, c = validate(link, costs)
    chunks = t.shape[0]
    r = np.asarray(recompute, dtype=np.float64)
    if r.shape != (chunks,) or np.isnan(r).any() or (r < 0).any():
        raise ValueError(f"recompute needs one value >= 0 per chunk ({chunks}), got shape {r.shape}")
    table = None
    if series and budget - busy > 0:
        need = bins_needed(_serial(t, r), budget - busy, bins)
        table = (need, value_table(c, need, bins, first=0))
    prefix = np.full(chunks + 1, np.inf)
    levels = None
    if budget > 0:
        barred = c.copy()
        barred[:, -1] = np.inf
        need = bins_needed(t, budget, bins)
        best = value_table(barred, need, bins, first=0)
        levels = (barred, need, best)
        spent = np.concatenate(([0], np.cumsum(need[:, -1])))
        paid = np.concatenate(([0.0], np.cumsum(c[:, -1])))
        arrived, done = np.cumsum(t[:, -1]), float(busy)
        for q in range(chunks + 1):
            if q:
                done = max(done, arrived[q - 1]) + r[q - 1]
            if done <= budget and spent[q] <= bins:
                prefix[q] = paid[q] + best[q, spent[q]]
    return t, c, r, table, levels, prefix


def _serial(t: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Each option's time counted in series: text's recompute added to its token ids."""
    serial = t.copy()
    serial[:, -1] += r
    return serial


def solve(link: ArrayLike, recompute: ArrayLike, costs: ArrayLike, budget: float, busy: float = 0.0,
          bins: int = DEFAULT_BINS) -> Plan:
    """Minimum-cost plan finishing within ``budget`` under the overlap model, else the fastest.

    ``link`` [chunks, options] is each option's link seconds (the last column: text,
    its token ids only), ``recompute`` [chunks] each chunk's recompute seconds as text,
    ``busy`` the recompute still owed for earlier chunks. ``Plan.seconds`` is the
    plan's :func:`finish`. Ties go to the series shape (text as late as the costs put it).
    A budget of zero or less fits nothing.
    """
    t, c, r, _, levels, prefix = _tables(link, recompute, costs, budget, busy, bins, series=False)
    serial = _serial(t, r)
    series = solve_series(serial, c, budget - busy, bins) if budget - busy > 0 else None
    q = int(np.argmin(prefix))
    if series is not None and series.feasible and series.cost <= prefix[q]:
        columns = np.array(series.columns, dtype=np.intp)
    elif np.isfinite(prefix[q]):
        barred, need, best = levels
        text = t.shape[1] - 1
        columns = np.concatenate((np.full(q, text, dtype=np.intp),
                                  walk(barred, need, best, first=q, spent=int(need[:q, -1].sum()))))
    else:
        return fastest(serial, c)
    rows = np.arange(t.shape[0])
    is_text = columns == t.shape[1] - 1
    return Plan(tuple(int(j) for j in columns), float(c[rows, columns].sum()),
                finish(t[rows, columns], np.where(is_text, r, 0.0), busy), True)


def first_option_costs(link: ArrayLike, recompute: ArrayLike, costs: ArrayLike, budget: float,
                       busy: float = 0.0, bins: int = DEFAULT_BINS) -> np.ndarray:
    """For each option of chunk 0, the least total cost of a plan (of either shape) that
    starts with it and finishes within ``budget`` (inf where none does)."""
    t, c, r, series, levels, prefix = _tables(link, recompute, costs, budget, busy, bins)
    out = np.full(t.shape[1], np.inf)
    if series is not None:
        need, best = series
        out = c[0] + best[1, need[0]]
    if levels is not None and busy <= budget:
        barred, need, best = levels
        out[:-1] = np.minimum(out[:-1], barred[0, :-1] + best[1, need[0, :-1]])
    out[-1] = min(out[-1], prefix[1:].min())
    return out
