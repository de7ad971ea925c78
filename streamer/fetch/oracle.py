"""The oracle: the best schedule in hindsight, knowing the bandwidth trace in advance.

It minimises the policies' own objective (each chunk's level distortion from the
manifest, ``TEXT_PENALTY`` per text chunk) subject to the deadline, by an exact dynamic
program over chunks (no time discretisation). Its timing is the link with no idle gaps
(requests sent ahead, as the oracle can), each text chunk recomputed once its token ids
are in and the chunk before it is delivered (overlapping later transfers), and only the
last chunk's decode tail: never later than the simulator's timing of the same schedule,
so the oracle's cost is a lower bound on every policy that met the deadline. With ``R``
the recompute seconds of the text chunks so far, the last chunk is delivered at
``R_total + max(0, max_i(arrival_i - R_before_i))``, so its states are, per number of
recomputed tokens, the Pareto-optimal (link free time, that running maximum, cost)
triples. The oracle never cancels: knowing the trace, it never starts a transfer it would
abandon, and an abandoned transfer only spends link time.

Per-layer splits (``splits=True``, the default). The fetch controller may continue a
chunk some of whose layers went out at level ``a`` with its remaining layers at a lower
level ``b > a``. Such a chunk, layers ``[0, k)`` at ``a`` and ``[k, layers)`` at ``b``,
costs the layer-weighted distortion ``(k d[a] + (layers - k) d[b]) / layers`` and carries
``k / layers`` of level ``a``'s bytes and ``(layers - k) / layers`` of level ``b``'s
(sections are equal shares of an answer); where the levels predict each layer from the
one before (``Manifest.restart``), level ``b`` is fetched from the layer coded alone at
or before ``k``, the layers between decoded and not delivered. Knowing the trace, the
oracle never cancels, so a split is one more KV option of the chunk: no recompute, and a
level's decode tail when it is the last chunk.

Which splits. A split's (bytes, distortion) is the convex combination of its two levels'
points at weight ``k / layers``; off the chunk's lower convex hull of (bytes, distortion)
it is beaten by a mix of the two hull vertices around it, so only pairs adjacent on that
hull are on the frontier, but only up to a layer's granularity: the hull pairs' mixes
come in steps of ``1 / layers`` too, and between two of them a mix of other levels can
survive (two levels of nearly the same size, one of them off the hull, say). Offering
the hull pairs alone would leave the oracle no lower bound on a controller that
continues any pair, so every pair ``a < b`` of stored levels is offered at every ``k``
in ``1 .. layers - 1``, less the chunk's KV options (levels and splits) that another of
its KV options matches or beats in both bytes and cost. That drop is exact, as a KV
option's timing only grows with its bytes; on a ladder whose distortion is convex in
bytes it leaves the hull pairs. Levels not stored take part in no split. The program is
then exact over every schedule that sends each chunk as text, as one level, or as one
level continued once at a lower one; chunks continued twice or more are not offered.

A chunk then has up to ``(levels - 1)(layers - 1)`` more options. To keep the search in
bounds, the program without splits runs first: where it cannot meet the deadline its
fastest schedule is the answer (no split is faster than its smaller level), and
otherwise its cost bounds the split program, which drops a state whose cost plus a lower
bound on the rest (:func:`cost_to_go`: the convex relaxation of the rest's options
within the bytes the link can still carry before the deadline) does not come below that
cost by more than float rounding.
"""
from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from codec.prediction import restart_layer
from streamer.adapt.base import TEXT, Choice
from streamer.fetch.links import VectorLink

if TYPE_CHECKING:
    from streamer.fetch.simulate import Simulator

#: Tolerance (seconds) on deadline comparisons, against float rounding in the integrals.
EPS = 1e-9
#: The objective weight of a text chunk the policies use (``adapt.decide`` passes the default).
TEXT_PENALTY = 1.0
#: Points :func:`_pareto3` takes one by one, and compares all pairs at once in a block
#: (a speed setting).
_BLOCK = 128


@dataclass
class OracleResult:
    """The best schedule in hindsight (``feasible``), else the fastest one."""

    choices: list[Choice]
    feasible: bool
    cost: float
    completion: float     # under the oracle's timing (a lower bound on the simulator's)
    text_chunks: int
    slo: float
    states: int = 0       # Pareto states explored (for the curious)
    #: per chunk, () unless it is split: then its runs ``((0, a), (k, b))``, layers
    #: ``[0, k)`` at level ``a`` and the rest at ``b``; its ``choices`` entry is ``b``
    #: (what a continued chunk's report says), so where sizes fall with the level,
    #: replaying ``choices`` sends no more bytes than the plan
    layer_levels: list[tuple[tuple[int, int], ...]] = field(default_factory=list)

    @property
    def met(self) -> bool:
        return self.feasible


def _undominated_in_order(order: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``order``'s points with a lower c than every point before them."""
    cs = c[order]
    best_before = np.minimum.accumulate(np.concatenate(([np.inf], cs[:-1])))
    return order[cs < best_before - 1e-15]


def _pareto(t: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Indices of the points not dominated in (time, cost), lower is better in both (of
    equal points, the first)."""
    return _undominated_in_order(np.lexsort((np.arange(t.size), c, t)), c)


def _pareto3(t: np.ndarray, m: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Indices of the points not dominated in (t, m, c), lower is better in all three
    (c to within 1e-15, against float rounding in the sums).

    In order of t, a point is dominated iff an earlier one has m and c no greater; the
    earlier points' (m, c) staircase (c falling as m grows: the least c at m or below)
    answers that by bisection, one point at a time for up to ``_BLOCK`` points (numpy's
    overhead per call outweighs Python's per point). More points: where m never falls
    along that order (all KV since the last text chunk, say), every earlier point has m
    no greater and a running minimum of c answers it at once; otherwise they go in
    blocks of ``_BLOCK``, each point checked against the staircase of the blocks before
    and those left against the ones left before them in the block, all pairs at once (a
    point beaten by a dropped one is beaten by what dropped it).
    """
    order = np.lexsort((c, m, t))
    if order.size <= _BLOCK:
        return _staircase(order, m, c)
    ms, cs = m[order], c[order]
    if np.all(np.diff(ms) >= 0):
        return _undominated_in_order(order, c)
    steps_m, steps_c = ms[:0], cs[:0]
    kept = []
    for lo in range(0, order.size, _BLOCK):
        bm, bc = ms[lo:lo + _BLOCK], cs[lo:lo + _BLOCK]
        at = np.searchsorted(steps_m, bm, side="right")
        left = np.flatnonzero((at == 0) | (np.append(steps_c, np.inf)[at - 1] > bc + 1e-15))
        lm, lc = bm[left], bc[left]
        earlier = np.tri(left.size, k=-1, dtype=bool)          # [i, j]: j before i
        left = left[~(earlier & (lm[None, :] <= lm[:, None]) & (lc[None, :] <= lc[:, None] + 1e-15)).any(axis=1)]
        kept.append(lo + left)
        all_m, all_c = np.append(steps_m, bm[left]), np.append(steps_c, bc[left])
        step = _undominated_in_order(np.lexsort((all_c, all_m)), all_c)
        steps_m, steps_c = all_m[step], all_c[step]
    return order[np.concatenate(kept)]


def _staircase(order: np.ndarray, m: np.ndarray, c: np.ndarray) -> np.ndarray:
    """:func:`_pareto3` one point at a time, in ``order``."""
    steps_m: list[float] = []
    steps_c: list[float] = []
    kept = []
    for i in order:
        mi, ci = float(m[i]), float(c[i])
        at = bisect.bisect_right(steps_m, mi)
        if at and steps_c[at - 1] <= ci + 1e-15:
            continue
        kept.append(i)
        # the new step replaces those it dominates in (m, c): from ``at`` on, while c >= ci
        stop = at
        while stop < len(steps_m) and steps_c[stop] >= ci:
            stop += 1
        steps_m[at:stop] = [mi]
        steps_c[at:stop] = [ci]
    return np.asarray(kept, dtype=np.intp)


@dataclass(frozen=True, eq=False)
class _Options:
    """One chunk's options, one entry each: bytes on the link, objective cost, whether
    it is text, its ``choices`` column (a level, or ``levels`` for text) and its runs
    (``OracleResult.layer_levels``)."""

    nbytes: np.ndarray
    cost: np.ndarray
    text: np.ndarray
    column: np.ndarray
    runs: tuple[tuple[tuple[int, int], ...], ...]


@functools.lru_cache(maxsize=4096)
def chunk_options(sizes: tuple[float, ...], text_bytes: float, distortion: tuple[float, ...], layers: int,
                  splits: bool, resume: tuple[int, ...] | None = None) -> _Options:
    """A chunk's options: each stored level (size > 0), with ``splits`` every split
    ``((0, a), (k, b))`` of two stored levels ``a < b`` at ``k`` in ``1 .. layers - 1``,
    less the KV options another KV option beats in (bytes, cost) (see the module
    docstring), then text. ``resume[k]``: the first layer level ``b`` is fetched from to
    continue at layer ``k`` (``Manifest.resume_layer``: before ``k`` where the levels
    predict each layer from the one before; ``k`` when absent). Cached: a simulator asks
    for the same chunks at every start."""
    size = np.asarray(sizes, dtype=np.float64)
    d = np.asarray(distortion, dtype=np.float64)
    levels = np.flatnonzero(size > 0)
    nbytes, cost, column = [size[levels]], [d[levels]], [levels]
    runs: list[tuple[tuple[int, int], ...]] = [()] * levels.size
    if splits:
        k = np.arange(1, layers)
        fetched_from = k if resume is None else np.asarray(resume, dtype=np.int64)[k]
        for a, b in itertools.combinations(levels.tolist(), 2):
            nbytes.append((k * size[a] + (layers - fetched_from) * size[b]) / layers)
            cost.append((k * d[a] + (layers - k) * d[b]) / layers)
            column.append(np.full(k.size, b))
            runs += [((0, a), (int(j), b)) for j in k]
    nb, c, col = np.concatenate(nbytes), np.concatenate(cost), np.concatenate(column)
    if splits:
        keep = np.sort(_pareto(nb, c))     # single levels first, so they win ties
        nb, c, col, runs = nb[keep], c[keep], col[keep], [runs[j] for j in keep]
    return _Options(nbytes=np.append(nb, text_bytes), cost=np.append(c, TEXT_PENALTY),
                    text=np.append(np.zeros(nb.size, dtype=bool), True),
                    column=np.append(col, len(sizes)).astype(np.intp), runs=(*runs, ()))


@functools.lru_cache(maxsize=4096)
def cost_to_go(options: tuple[_Options, ...]) -> tuple[np.ndarray, np.ndarray]:
    """A lower bound on the objective of ``options``' chunks sent within a byte budget:
    ``(budget, cost)`` breakpoints of the convex relaxation (each chunk's cost a convex
    mix along the lower hull of its (bytes, cost) points, the budget spent on the
    steepest falls first), so for a budget ``x`` the bound is the interpolated cost, and
    ``inf`` below the first budget (not even the smallest options fit)."""
    base_x, base_c = 0.0, 0.0
    runs: list[tuple[float, float]] = []
    for opt in options:
        order = np.lexsort((opt.cost, opt.nbytes))
        hull: list[tuple[float, float]] = []
        for x, c in zip(opt.nbytes[order].tolist(), opt.cost[order].tolist()):
            if hull and c >= hull[-1][1]:
                continue      # no cheaper than a smaller option: off the falling hull
            while len(hull) >= 2 and ((hull[-1][1] - hull[-2][1]) * (x - hull[-2][0])
                                      >= (c - hull[-2][1]) * (hull[-1][0] - hull[-2][0])):
                hull.pop()    # the last vertex lies on or above the chord to the new point
            hull.append((x, c))
        base_x += hull[0][0]
        base_c += hull[0][1]
        runs += [(x1 - x0, c1 - c0) for (x0, c0), (x1, c1) in zip(hull, hull[1:])]
    runs.sort(key=lambda r: r[1] / r[0])
    dx = np.array([0.0, *(r[0] for r in runs)])
    dc = np.array([0.0, *(r[1] for r in runs)])
    return base_x + np.cumsum(dx), base_c + np.cumsum(dc)


def _search(sim: Simulator, link: VectorLink, options: Sequence[_Options], *, slo: float, start: float,
            bound: float | None) -> OracleResult | None:
    """The dynamic program over ``options``. Without ``bound``: the best schedule, else
    the fastest. With one (a feasible schedule's cost): the best schedule if it costs less
    (by more than a relative 1e-9, against float rounding), else None, pruning states
    whose cost plus :func:`cost_to_go` of the rest within the link's remaining bytes
    reaches the bound (exact: such a state completes to nothing cheaper)."""
    n = len(options)
    L = sim.manifest.levels
    owd = sim.rtt / 2
    tokens = sim.tokens.astype(np.int64)
    tail = sim.decode / sim.manifest.layers       # the last chunk's decode after its last byte
    rate = sim.recompute
    if bound is not None:
        limit = bound - 1e-9 * max(bound, 1.0)
        rests = [cost_to_go(tuple(options[i:])) for i in range(1, n + 1)]
        # the last byte of the last chunk leaves the sender by ``slo - owd`` at the latest
        budget_end = float(link.bytes_until(np.array(start + slo + EPS - owd)))

        def beyond(cost: np.ndarray, room: np.ndarray, rest: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
            """Whether states of ``cost`` with ``room`` bytes left for ``rest`` reach ``limit``."""
            xs, cs = rest
            room = room + 1e-9 * np.abs(room) + 1e-6
            return cost + np.where(room >= xs[0], np.interp(room, xs, cs), np.inf) > limit

        if beyond(np.zeros(1), budget_end - link.bytes_until(np.array([start + owd])),
                  cost_to_go(tuple(options)))[0]:
            return None

    def run(deadline: float | None):
        # states: link-free time T (sender clock), M = max over chunks so far of (delivery
        # lower bound - recompute before it), cost C, text tokens K; parent, option
        T = np.array([owd])
        M = np.array([0.0])
        C = np.array([0.0])
        K = np.array([0], dtype=np.int64)
        parents: list[np.ndarray] = []
        picks: list[np.ndarray] = []
        explored = 0
        for i, opt in enumerate(options):
            S, P = T.size, opt.nbytes.size
            par = np.repeat(np.arange(S), P)
            pick = np.tile(np.arange(P), S)
            nc = C[par] + opt.cost[pick]
            if bound is not None:
                # the link's bytes from this chunk's last byte to the last one the deadline allows
                room = budget_end - link.bytes_until(start + T)[par] - opt.nbytes[pick]
                near = np.flatnonzero(~beyond(nc, room, rests[i]))
                par, pick, nc = par[near], pick[near], nc[near]
            nt = T[par] + link.time_to_send(opt.nbytes[pick], start + T[par])
            text = opt.text[pick]
            ready = nt + owd + np.where(text | (i < n - 1), 0.0, tail[i])
            nm = np.maximum(M[par], ready - rate * K[par])
            nk = K[par] + np.where(text, tokens[i], 0)
            ok = np.isfinite(nt)
            if deadline is not None:
                # both terms only grow: a state already late is dead
                ok &= rate * nk + nm <= deadline + EPS
            idx = np.flatnonzero(ok)
            if idx.size == 0:
                return None
            keep_all = []
            for k in np.unique(nk[idx]):
                sel = idx[nk[idx] == k]
                if deadline is None:  # fastest: only times matter
                    keep_all.append(sel[_pareto(nt[sel], nm[sel])])
                else:
                    keep_all.append(sel[_pareto3(nt[sel], nm[sel], nc[sel])])
            keep = np.concatenate(keep_all)
            explored += keep.size
            T, M, C, K = nt[keep], nm[keep], nc[keep], nk[keep]
            parents.append(par[keep])
            picks.append(pick[keep])
        finish = rate * K + np.maximum(M, 0.0)
        return C, finish, parents, picks, explored

    out = run(slo)
    feasible = False
    if out is not None:
        C, finish, parents, picks, explored = out
        ok = np.flatnonzero(finish <= slo + EPS)
        if ok.size:
            feasible = True
            best = ok[np.lexsort((finish[ok], C[ok]))[0]]
    if not feasible:
        if bound is not None:
            return None
        C, finish, parents, picks, explored = run(None)
        best = int(np.argmin(finish))
    chosen = []
    j = int(best)
    for i in range(n - 1, -1, -1):
        chosen.append(int(picks[i][j]))
        j = int(parents[i][j])
    chosen.reverse()
    picked = [(opt.column[p], opt.cost[p], opt.runs[p]) for opt, p in zip(options, chosen)]
    choices: list[Choice] = [TEXT if col == L else int(col) for col, _, _ in picked]
    return OracleResult(choices=choices, feasible=feasible, cost=float(sum(float(c) for _, c, _ in picked)),
                        completion=float(finish[best]), text_chunks=sum(c == TEXT for c in choices),
                        slo=float(slo), states=explored, layer_levels=[r for _, _, r in picked])


def solve(sim: Simulator, link: VectorLink, *, slo: float, start: float, splits: bool = True) -> OracleResult:
    """The minimum-objective schedule meeting ``slo`` from trace time ``start`` (else the
    fastest), with ``splits`` the per-layer splits of the module docstring among each
    chunk's options.

    With splits, the program without them runs first: no split is faster than its
    smaller level, so a fetch it cannot fit has no feasible split schedule either (its
    fastest schedule is the answer), and its cost bounds the split program's search."""
    layers, restart = sim.manifest.layers, sim.manifest.restart
    # a split's second level is never the exact one (it is level 0), so it restarts as the profile does
    resume = None if restart == 1 else tuple(restart_layer(k, restart) for k in range(layers))

    def options(with_splits: bool) -> list[_Options]:
        return [chunk_options(tuple(s), tb, tuple(sim.manifest.level_distortion), layers, with_splits, resume)
                for s, tb in zip(sim.sizes, sim.text_bytes)]

    plain = _search(sim, link, options(False), slo=slo, start=start, bound=None)
    assert plain is not None  # without a bound the fastest schedule is the fallback
    if not splits or not plain.feasible:
        return plain
    return _search(sim, link, options(True), slo=slo, start=start, bound=plain.cost) or plain


__all__ = ["EPS", "OracleResult", "TEXT_PENALTY", "chunk_options", "cost_to_go", "solve"]
