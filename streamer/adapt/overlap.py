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
for that chunk, and its recompute then overlaps only the chunks after it.

Unrolled, the last chunk is delivered at

    D = max(busy + R_0, max over text chunks k of (A_k + R_k), A_{n-1})

with ``R_k`` the recompute of the text chunks ``k..n-1``: a plan fits the budget iff
the recompute owed fits beside ``busy``, every text chunk's token ids are in by the
budget less the recompute from it on, and the last byte is in by the budget.

The plan (:func:`solve`) is the cheapest of three shapes (ties to the first listed):

* **series**: any mix of levels and text, timed as if nothing overlapped
  (``busy + sum(link + recompute)``, an upper bound on ``D``): the knapsack of
  :mod:`streamer.adapt.plan` over a budget less ``busy``;
* **text prefix**: the next ``q`` chunks as text, then levels only, timed exactly as
  ``max(D_q, A_n)``: for each ``q`` the best level-only suffix from one knapsack table
  over the whole budget;
* **any mix**: levels and text in any order, timed by the unrolled ``D`` above. The
  knapsack over link bins gets one more index, the recompute still owed by the text
  chunks at or after the current one (``R_i``, a *layer*): a text chunk moves its plan
  from layer ``R_i`` to ``R_i - r_i`` and is allowed only where its token ids arrive
  within ``budget - R_i``; layer 0 is the level-only table of the text prefix shape.
  Each layer costs about one knapsack table, so a layer is filled only where a plan
  through it could undercut the cheaper of the other two shapes, by a bound on its cost
  that ignores time and one on its time that ignores cost (:func:`_layers`): no layer
  while levels fit and text costs more than their spread, about one per text chunk the
  plan needs otherwise. Within its rounding this shape is exact for every order of
  levels and text. The other two stay because they round differently (series over the
  budget less ``busy``, the prefix's recompute unrounded), so either may fit a plan the
  mix's rounding just misses, and they bound what the mix must undercut. A caller may
  leave this shape out (``any_mix=False``): mpc does by default (``adapt.mpc.ANY_MIX``).

Rounding: link seconds, recompute seconds and ``busy`` are each rounded *up* to whole
bins of ``budget / bins``, so a plan called feasible is feasible under the model (the
planner may be pessimistic, never optimistic), and each term of ``D`` gathers at most
``chunks + 1`` roundings: the plan costs no more than any schedule whose :func:`finish`
is within ``budget - (chunks + 1) * budget / bins``.

The receiver's **decoder** is a third stage, between the link and delivery: a KV chunk's
sections decode while the next chunk's arrive, so a chunk holds the pipeline for the
slower of its transfer and its decode. ``link`` here is that time
(``base.link_seconds``), and the decoding owed for chunks already requested comes off the
budget (``base.pipeline_budget``, ``adapt.decoding``); where the decoder keeps up (the
simulator's receiver, a GPU decoder) both reduce to the link alone.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True)
class _Tables:
    """What every shape shares: the inputs, each option's link bins over the whole budget,
    the level-only table (layer 0 of the mix; text with no recompute counts as a level)
    and each text prefix's cost."""

    t: np.ndarray          # [chunks, options] link seconds
    c: np.ndarray          # [chunks, options] costs
    r: np.ndarray          # [chunks] recompute seconds as text
    barred: np.ndarray     # c with text barred where it has recompute (what layer 0 may use)
    need: np.ndarray       # [chunks, options] link bins, rounded up
    recompute: np.ndarray  # [chunks] recompute bins, rounded up
    busy: int              # busy in bins, rounded up
    bins: int
    levels: np.ndarray | None   # value_table(barred, need): None without a budget
    prefix: np.ndarray     # [chunks + 1] least cost of q text chunks then level-only (inf: misses)


def _tables(link: ArrayLike, recompute: ArrayLike, costs: ArrayLike, budget: float, busy: float,
            bins: int) -> _Tables:
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    if not busy >= 0:
        raise ValueError(f"busy must be >= 0 seconds, got {busy}")
    t, c = validate(link, costs)
    chunks = t.shape[0]
    r = np.asarray(recompute, dtype=np.float64)
    if r.shape != (chunks,) or np.isnan(r).any() or (r < 0).any():
        raise ValueError(f"recompute needs one value >= 0 per chunk ({chunks}), got shape {r.shape}")
    barred = c.copy()
    barred[r > 0, -1] = np.inf   # text with nothing to recompute is one more level
    prefix = np.full(chunks + 1, np.inf)
    if not budget > 0:
        none = np.full(t.shape, bins + 1, dtype=np.intp)
        return _Tables(t, c, r, barred, none, none[:, -1], bins + 1, bins, None, prefix)
    need = bins_needed(t, budget, bins)
    best = value_table(barred, need, bins, first=0)
    spent = np.concatenate(([0], np.cumsum(need[:, -1])))
    paid = np.concatenate(([0.0], np.cumsum(c[:, -1])))
    arrived, done = np.cumsum(t[:, -1]), float(busy)
    for q in range(chunks + 1):
        if q:
            done = max(done, arrived[q - 1]) + r[q - 1]
        if done <= budget and spent[q] <= bins:
            prefix[q] = paid[q] + best[q, spent[q]]
    owed = int(bins_needed(np.array([busy]), budget, bins)[0])
    return _Tables(t, c, r, barred, need, bins_needed(r, budget, bins), owed, bins, best, prefix)


def _serial(t: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Each option's time counted in series: text's recompute added to its token ids."""
    serial = t.copy()
    serial[:, -1] += r
    return serial


#: Weights at which :func:`_least_makespan` bounds its max of two sums.
_WEIGHTS = np.linspace(0.0, 1.0, 17)[:, None, None]


def _least_makespan(link: np.ndarray, text_link: np.ndarray, recompute: np.ndarray, texts: np.ndarray,
                    head: np.ndarray, behind: np.ndarray) -> np.ndarray:
    """A lower bound, for each (head, behind) pair, on ``max(head + X, behind + R)`` over
    every choice of the chunks: chunk ``i`` at its least level link ``link[i]``, or (where
    ``texts[i]``) as text, ``text_link[i]`` of link and ``recompute[i]`` to recompute.
    ``X`` and ``R`` sum the chosen link and recompute. For every weight ``w`` in [0, 1],
    ``max(a, b) >= w a + (1 - w) b`` and the weighted sum separates by chunk. The weights
    are multiples of 1/16, so whole bins sum exactly."""
    w = _WEIGHTS
    kv = np.where(np.isfinite(link), w * np.where(np.isfinite(link), link, 0.0), np.inf)
    as_text = np.where(texts, w * text_link + (1 - w) * recompute, np.inf)
    rest = np.minimum(kv, as_text).sum(axis=2)
    return (w[:, :, 0] * head + (1 - w[:, :, 0]) * behind + rest).max(axis=0)


def _layers(tab: _Tables, first: int, incumbent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The layers of the mix worth a table, and at each chunk the rows among them worth
    filling: ascending recompute bins ``rho`` (0 first), and ``rows[i]`` the first and
    last row (1-based; none where first > last) of the layers above 0 at chunk ``i``.

    ``incumbent`` is what the mix must undercut: with ``first == 0`` the cost of the
    plan, with ``first == 1`` of each option of chunk 0 (inf where the other shapes have
    none). Layer ``R`` at chunk ``i >= first`` (the text chunks ``i..`` owe ``R`` bins
    of recompute) is filled only where both bounds below allow a plan through it, so
    neither drops a plan the table would find:

    * cost: the cheapest option of each chunk before ``i``, plus the cheapest way for
      chunks ``i..`` to owe exactly ``R`` (a subset-sum over their text chunks, every
      other chunk at its cheapest level), is below the incumbent;
    * time: ``R`` fits beside ``busy``, and chunks ``i..`` can owe exactly ``R`` within
      ``bins`` of link.

    Before those tables, options of chunk 0 that no plan can fit in time
    (:func:`_least_makespan`) drop out of the incumbent, and nothing is filled where the
    cheapest plan with any text, time aside, costs no less than it.
    """
    chunks = tab.c.shape[0]
    bins, room = tab.bins, tab.bins - tab.busy
    none = (np.zeros(1, dtype=np.intp), np.tile(np.array([1, 0], dtype=np.intp), (chunks + 1, 1)))
    if room <= 0:
        return none
    c, need, rb = tab.c, tab.need, tab.recompute
    fits = need <= bins
    usable = fits & np.isfinite(tab.barred)
    level = np.where(usable, tab.barred, np.inf).min(axis=1)
    level_link = np.where(usable, need, np.inf).min(axis=1)
    texts = fits[:, -1] & (tab.r > 0) & (rb <= room)
    text = np.where(texts, c[:, -1], np.inf)
    cheapest = np.minimum(level, text)
    if not texts[first:].any() or not np.isfinite(cheapest).all():
        return none
    lead = c[0] if first else np.zeros(1)
    floor = cheapest[first:].sum() + (text - cheapest)[first:].min()   # the cheapest plan with any text
    known = np.isfinite(incumbent)
    if known.all() and floor >= (incumbent - lead).max():
        return none
    # time, cheaply: an option of chunk 0 (the empty plan head with first == 0) with
    # link d and recompute g before the rest (g counts busy) has no plan where
    # max(d + X, g + R) > bins for every choice of the rest, X its link and R its recompute
    if first:
        head = need[0].astype(np.float64)
        behind = np.full(head.shape, float(tab.busy))
        if texts[0]:
            behind[-1] = max(need[0, -1], tab.busy) + rb[0]
    else:
        head, behind = np.zeros(1), np.full(1, float(tab.busy))
    able = known | ((head <= bins) & (_least_makespan(level_link[first:], need[first:, -1], rb[first:],
                                                       texts[first:], head, behind) <= bins))
    if not able.any():
        return none
    bound = float((incumbent - lead)[able].max())
    if floor >= bound:
        return none
    stages = chunks + 1 - first
    # chunks i.. owing exactly R of recompute: [0] the least cost, [1] the least link
    least = np.empty((stages, 2, room + 1))
    least[-1] = np.inf
    least[-1, :, 0] = 0.0
    kv = np.stack((level, level_link), axis=1)[:, :, None]
    as_text = np.stack((text, need[:, -1]), axis=1)[:, :, None]
    for k in range(stages - 2, -1, -1):
        i = first + k
        np.add(least[k + 1], kv[i], out=least[k])
        if texts[i]:
            d = rb[i]
            np.minimum(least[k, :, d:], least[k + 1, :, : room + 1 - d] + as_text[i], out=least[k, :, d:])
    spend, link = least[:, 0], least[:, 1]
    span = np.arange(room + 1)
    if first:
        # the same over the rest's exact choices: the last byte and the first text chunk
        # after chunk 0 in time, d + max(X, R), with R fitting beside busy
        late = head + np.maximum(link[1], span).min()
        if texts[0]:
            owed = rb[0] + span[: room + 1 - rb[0]]
            late[-1] = head[-1] + np.maximum(link[1, : room + 1 - rb[0]], owed).min()
        able &= known | (late <= bins)
        if not able.any():
            return none
        bound = float((incumbent - lead)[able].max())
    before = np.concatenate(([0.0], np.cumsum(np.where(fits, c, np.inf).min(axis=1)[first:])))
    worth = (spend < (bound - before)[:, None]) & (link <= bins)
    worth[:, 0] = False
    rho = np.concatenate(([0], np.flatnonzero(worth.any(axis=0))))
    at = worth[:, rho]
    filled = at.any(axis=1)
    rows = np.tile(np.array([1, 0], dtype=np.intp), (chunks + 1, 1))
    rows[first:][filled] = np.stack((at.argmax(axis=1), len(rho) - 1 - at[:, ::-1].argmax(axis=1)), axis=1)[filled]
    return rho, rows


@dataclass(frozen=True)
class _Mix:
    """The mix's tables: the least cost of chunks ``i..`` with ``a`` link bins spent before
    chunk ``i`` and ``rho[l]`` recompute bins to come from text chunks ``i..``. ``top[l, a]``
    holds it for the first chunk planned; ``bands[i]`` (kept for a walk) the rows filled
    at chunk ``i`` as (first row, last row, values), inf outside them; row 0 is
    the level-only table. ``source[i, l]`` is the row a text chunk ``i`` moves row ``l``
    to (``len(rho)``: none)."""

    rho: np.ndarray
    source: np.ndarray
    top: np.ndarray
    bands: list

    def value(self, tab: _Tables, i: int, row: int, spent: int) -> float:
        if row == 0:
            return float(tab.levels[i, spent])
        band = self.bands[i]
        if band is None or not band[0] <= row <= band[1]:
            return np.inf
        return float(band[2][row - band[0], spent])


def _mix(tab: _Tables, rho: np.ndarray, rows: np.ndarray, first: int, keep: bool) -> _Mix:
    """Fill the layers ``rho`` (row 0: the level-only table) from the last chunk back to
    ``first``, only the rows ``rows[i]`` at chunk ``i``; with ``keep``, every chunk's band
    for :func:`_walk_mix`."""
    chunks, options = tab.c.shape
    bins, layers = tab.bins, len(rho)
    wanted = rho[None, :] - tab.recompute[:, None]
    at = np.minimum(np.searchsorted(rho, wanted), layers - 1)
    source = np.where(rho[at] == wanted, at, layers)
    # two tables in turn, padded with inf past bins as in value_table; all inf but row 0
    # and the band last filled (reset before reuse)
    tables = [np.full((layers + 1, 2 * (bins + 1)), np.inf) for _ in range(2)]
    tables[chunks % 2][0, : bins + 1] = 0.0
    windows = [np.lib.stride_tricks.sliding_window_view(table, bins + 1, axis=1) for table in tables]
    # a text chunk in layer R needs its token ids in within bins - R
    late = np.where(np.arange(2 * (bins + 1))[None, :] <= bins - rho[:, None], 0.0, np.inf)
    filled: list = [None, None]
    bands: list = [None] * (chunks + 1)
    for i in range(chunks - 1, first - 1, -1):
        nxt, cur = tables[(i + 1) % 2], tables[i % 2]
        if filled[i % 2] is not None:
            cur[filled[i % 2], : bins + 1] = np.inf
            filled[i % 2] = None
        cur[0] = tab.levels[i]
        low, high = rows[i]
        if low > high:
            continue
        band = slice(low, high + 1)
        d = tab.need[i, -1]
        body = nxt[source[i, band], d : d + bins + 1] + late[band, d : d + bins + 1]
        body += tab.c[i, -1]
        if options > 1:
            levels = windows[(i + 1) % 2][band][:, tab.need[i, :-1]]
            levels += tab.c[i, :-1, None]
            np.minimum(body, levels.min(axis=1), out=body)
        cur[band, : bins + 1] = body
        filled[i % 2] = band
        if keep:
            bands[i] = (low, high, body)
    return _Mix(rho, source, tables[first % 2][:layers, : bins + 1], bands)


def _walk_mix(tab: _Tables, mix: _Mix, row: int) -> np.ndarray:
    """The columns of the mix plan starting in ``row`` with no link spent (the argmin redone
    at the one state reached, ties to the lower column, as :func:`plan.walk`)."""
    chunks, options = tab.c.shape
    columns = np.empty(chunks, dtype=np.intp)
    spent = 0
    for i in range(chunks):
        d = spent + tab.need[i]
        values = np.full(options, np.inf)
        for j in np.flatnonzero(d[:-1] <= tab.bins):
            values[j] = tab.c[i, j] + mix.value(tab, i + 1, row, int(d[j]))
        to = mix.source[i, row]
        if to < len(mix.rho) and d[-1] + mix.rho[row] <= tab.bins:
            values[-1] = tab.c[i, -1] + mix.value(tab, i + 1, to, int(d[-1]))
        columns[i] = j = int(np.argmin(values))
        if j == options - 1:
            row = to
        spent = int(d[j])
    return columns


def solve(link: ArrayLike, recompute: ArrayLike, costs: ArrayLike, budget: float, busy: float = 0.0,
          bins: int = DEFAULT_BINS, any_mix: bool = True, overlaps: bool = True) -> Plan:
    """Minimum-cost plan finishing within ``budget`` under the overlap model, else the fastest.

    ``link`` [chunks, options] is each option's link seconds (the last column: text,
    its token ids only), ``recompute`` [chunks] each chunk's recompute seconds as text,
    ``busy`` the recompute still owed for earlier chunks. ``Plan.seconds`` is the
    plan's :func:`finish`. Ties go to the series shape (text as late as the costs put
    it), then the text prefix. A budget of zero or less fits nothing. ``any_mix=False``
    leaves the any-mix shape out (text between KV chunks is then timed in series);
    ``overlaps=False`` (recompute shares the decoder's cores) leaves only the series shape.
    """
    tab = _tables(link, recompute, costs, budget, busy, bins)
    t, c, r = tab.t, tab.c, tab.r
    serial = _serial(t, r)
    series = solve_series(serial, c, budget - busy, bins) if budget - busy > 0 else None
    if not overlaps:   # recompute and decode take turns on the same cores: nothing overlaps
        if series is None or not series.feasible:
            return fastest(serial, c)
        return Plan(series.columns, series.cost, busy + series.seconds, True)
    q = int(np.argmin(tab.prefix))
    incumbent = min(series.cost if series is not None and series.feasible else np.inf, tab.prefix[q])
    mix, mixed, row = None, np.inf, 0
    if any_mix and tab.levels is not None:
        rho, spans = _layers(tab, 0, np.array([incumbent]))
        if len(rho) > 1:
            mix = _mix(tab, rho, spans, 0, keep=True)
            row = int(np.argmin(mix.top[:, 0]))
            mixed = mix.top[row, 0]
    if series is not None and series.feasible and series.cost <= min(tab.prefix[q], mixed):
        columns = np.array(series.columns, dtype=np.intp)
    elif np.isfinite(tab.prefix[q]) and tab.prefix[q] <= mixed:
        text = t.shape[1] - 1
        columns = np.concatenate((np.full(q, text, dtype=np.intp),
                                  walk(tab.barred, tab.need, tab.levels, first=q, spent=int(tab.need[:q, -1].sum()))))
    elif mix is not None and np.isfinite(mixed):
        columns = _walk_mix(tab, mix, row)
    else:
        return fastest(serial, c)
    rows = np.arange(t.shape[0])
    is_text = columns == t.shape[1] - 1
    return Plan(tuple(int(j) for j in columns), float(c[rows, columns].sum()),
                finish(t[rows, columns], np.where(is_text, r, 0.0), busy), True)


def first_option_costs(link: ArrayLike, recompute: ArrayLike, costs: ArrayLike, budget: float,
                       busy: float = 0.0, bins: int = DEFAULT_BINS, any_mix: bool = True,
                       overlaps: bool = True) -> np.ndarray:
    """For each option of chunk 0, the least total cost of a plan (of any shape, of the
    series and text-prefix shapes with ``any_mix=False``, of the series shape alone with
    ``overlaps=False``) that starts with it and finishes within ``budget`` (inf where none
    does)."""
    tab = _tables(link, recompute, costs, budget, busy, bins)
    t, c, r = tab.t, tab.c, tab.r
    out = np.full(t.shape[1], np.inf)
    if budget - busy > 0:
        need = bins_needed(_serial(t, r), budget - busy, bins)
        best = value_table(c, need, bins, first=0)
        out = c[0] + best[1, need[0]]
    if tab.levels is None or not overlaps:
        return out
    if busy <= budget:
        out = np.minimum(out, tab.barred[0] + tab.levels[1, tab.need[0]])
    out[-1] = min(out[-1], tab.prefix[1:].min())
    if not any_mix:
        return out
    rho, spans = _layers(tab, 1, out)
    if len(rho) > 1:
        ahead = _mix(tab, rho, spans, 1, keep=False).top
        kv = np.flatnonzero(tab.need[0, :-1] <= tab.bins)
        out[kv] = np.minimum(out[kv], c[0, kv] + ahead[:, tab.need[0, kv]].min(axis=0))
        d, owed = tab.need[0, -1], rho + tab.recompute[0]
        fits = (owed + tab.busy <= tab.bins) & (owed + d <= tab.bins)
        if d <= tab.bins and fits.any():
            out[-1] = min(out[-1], c[0, -1] + ahead[fits, d].min())
    return out
