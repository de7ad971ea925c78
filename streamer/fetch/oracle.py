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
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from streamer.adapt.base import TEXT, Choice
from streamer.fetch.links import VectorLink

if TYPE_CHECKING:
    from streamer.fetch.simulate import Simulator

#: Tolerance (seconds) on deadline comparisons, against float rounding in the integrals.
EPS = 1e-9
#: The objective weight of a text chunk the policies use (``adapt.decide`` passes the default).
TEXT_PENALTY = 1.0


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

    @property
    def met(self) -> bool:
        return self.feasible


def _pareto(t: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Indices of the points not dominated in (time, cost), lower is better in both."""
    order = np.lexsort((c, t))
    cs = c[order]
    best_before = np.minimum.accumulate(np.concatenate(([np.inf], cs[:-1])))
    return order[cs < best_before - 1e-15]


def _pareto3(t: np.ndarray, m: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Indices of the points not dominated in (t, m, c), lower is better in all three.

    In order of t, a point is dominated iff an earlier one has m and c no greater; the
    earlier points' (m, c) staircase (c falling as m grows) answers that by bisection.
    """
    order = np.lexsort((c, m, t))
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


def solve(sim: Simulator, link: VectorLink, *, slo: float, start: float) -> OracleResult:
    n = len(sim.sizes)
    L = sim.manifest.levels
    owd = sim.rtt / 2
    costs = np.append(np.asarray(sim.manifest.level_distortion, dtype=np.float64), TEXT_PENALTY)
    size = np.array([[*s, tb] for s, tb in zip(sim.sizes, sim.text_bytes)], dtype=np.float64)
    size[:, :L][size[:, :L] <= 0] = np.inf  # levels not stored
    tokens = sim.tokens.astype(np.int64)
    layers = sim.manifest.layers
    tail = sim.decode / layers                    # the last chunk's decode after its last byte
    rate = sim.recompute

    def run(deadline: float | None):
        # states: link-free time T (sender clock), M = max over chunks so far of (delivery
        # lower bound - recompute before it), cost C, text tokens K; parent, column
        T = np.array([owd])
        M = np.array([0.0])
        C = np.array([0.0])
        K = np.array([0], dtype=np.int64)
        parents: list[np.ndarray] = []
        columns: list[np.ndarray] = []
        explored = 0
        for i in range(n):
            opts = np.flatnonzero(np.isfinite(size[i]))
            S = T.size
            nt = (T[:, None] + link.time_to_send(size[i][opts][None, :], start + T[:, None])).ravel()
            nc = (C[:, None] + costs[opts][None, :]).ravel()
            is_text = (opts == L)
            ready = nt + owd + np.tile(np.where(is_text | (i < n - 1), 0.0, tail[i]), S)
            nm = np.maximum(np.repeat(M, opts.size), ready - rate * np.repeat(K, opts.size))
            nk = (K[:, None] + np.where(is_text, tokens[i], 0)[None, :]).ravel()
            par = np.repeat(np.arange(S), opts.size)
            col = np.tile(opts, S)
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
            columns.append(col[keep])
        finish = rate * K + np.maximum(M, 0.0)
        return T, C, K, finish, parents, columns, explored

    out = run(slo)
    feasible = False
    if out is not None:
        T, C, K, finish, parents, columns, explored = out
        ok = np.flatnonzero(finish <= slo + EPS)
        if ok.size:
            feasible = True
            best = ok[np.lexsort((finish[ok], C[ok]))[0]]
    if not feasible:
        T, C, K, finish, parents, columns, explored = run(None)
        best = int(np.argmin(finish))
    cols = []
    j = int(best)
    for i in range(n - 1, -1, -1):
        cols.append(int(columns[i][j]))
        j = int(parents[i][j])
    cols.reverse()
    choices: list[Choice] = [TEXT if c == L else c for c in cols]
    return OracleResult(choices=choices, feasible=feasible, cost=sim.cost_of(choices),
                        completion=float(finish[best]),
                        text_chunks=sum(c == TEXT for c in choices), slo=float(slo), states=explored)



__all__ = ["EPS", "OracleResult", "TEXT_PENALTY", "solve"]
