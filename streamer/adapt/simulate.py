"""Socket-free simulation of one fetch, and the oracle: the best schedule in hindsight.

The simulator replays what :class:`streamer.net.session.StreamSession` does against a link
whose capacity follows a :class:`netsim.Trace`, without sockets or clocks, so the
whole trace set x SLOs x policies runs in seconds. It shares the decision code with
the session (:func:`streamer.adapt.decide`, hence the very same policy functions and
throughput estimator) and mirrors the session's measurement and timing rules:

* **Link.** One FIFO pipe: the sender starts a chunk when its request has arrived
  (one-way delay ``rtt / 2`` after the receiver sent it) and the previous chunk has
  left; the link carries it at the trace's capacity (exact integral,
  :meth:`Trace.time_to_send`); the receiver sees the first byte ``rtt / 2`` after it
  left the sender and the last byte ``rtt / 2`` after the link finished it. A text
  chunk (token ids) arrives as one event, like the session's TEXT frame. Framing
  overhead, TCP dynamics and the proxy's 20 ms token-bucket burst are not modelled
  (validated against the real proxy: :func:`streamer.tools.bench_policies.validate`).
* **Requests, just in time.** Chunk 0 is requested at time 0; every later chunk when
  the bytes still due on the requests in flight drop to ``estimate * rtt + 64 KiB``
  (``estimator.MIN_SAMPLE_BYTES``; at most ``adapt.MAX_QUEUED_AHEAD`` KV chunk queued
  behind the one arriving), or at once when nothing is in flight, exactly the
  session's ``_request_ahead`` rule (including requesting several tiny text chunks
  at the same instant). The condition is re-checked at every chunk end, where the
  estimate changes by a whole sample, and in between at the exact crossing time
  (the session checks at each arriving part, at most one part later).
* **Measurement.** The receiver only sees its own observations, as the session does:
  per finished chunk of >= 64 KiB (smaller ones pooled until they reach it:
  ``estimator.pool_sample``), ``Observation(bytes, busy)`` with busy time from
  ``max(request + rtt, previous chunk's end)`` (here the first byte) to the last byte;
  at a decision the chunk in flight adds a partial sample once 64 KiB of it arrived over
  20 ms (its second half so far, ``estimator.in_flight_sample``, exact here from the trace).
  ``time_left`` is ``adapt.decide.time_left``: ``slo - now - max(outstanding / estimate,
  rtt)``, and the recompute still owed (``PlanInput.recompute_busy``) is that of the text
  chunks not yet delivered, less what the one being recomputed has had, as the session
  counts it; the prior is the caller's (the session's
  per-server prior is the previous fetch's robust estimate: :attr:`SimResult.next_prior`).
* **Cancel** (mpc by default, as in the session: ``cancel=``). While a KV chunk arrives,
  ``adapt.cancel.reconsider`` runs every ``RECONSIDER_S`` on the same inputs the session
  gives it. On a CANCEL the sender stops ``rtt / 2`` later, after the
  ``cancel.COMMITTED_BYTES`` it had queued; the re-request goes out when those bytes and
  the CANCELLED answer are in, or, when that would come later than the switch's
  ``escalate_after``, the connection is dropped then (as the session does) and it goes
  out ``reconnect_seconds`` later. On an abort the bytes in flight are lost and the
  re-request goes out ``reconnect_seconds`` later. Either way every chunk requested
  behind the abandoned one is re-decided, text ones included (the session keeps a text
  request already sent; re-deciding it with the same information gives text again
  unless the estimate rose).
* **After the link** (``adapt.overlap``'s model). Delivery is ordered and pipelined with
  the transfer: a KV chunk is delivered at ``max(arrival + decode / layers, previous
  done + decode)`` (its layers decode as they land; only the last layer's share is left
  after the last byte unless the decoder is the bottleneck); a text chunk is recomputed
  on the caller's compute once its token ids are in and the chunk before it is
  delivered, ``max(arrival, previous done) + recompute_seconds_per_token * tokens``,
  while the link carries the chunks after it. A fetch meets its SLO when its last
  chunk is delivered by ``slo``.

The oracle (:func:`oracle`) knows the true trace in advance and minimises the
policies' own objective (sum of each chunk's level distortion from the manifest,
``text_penalty`` per text chunk) subject to the deadline, by an exact dynamic
program over chunks (no time discretisation). Its timing is the link with no idle
gaps (requests sent ahead, as the oracle can), recompute overlapped as above, and only
the last chunk's decode tail, which is never later than the simulator's timing of the
same schedule, so the oracle's cost is a true lower bound on every policy that met the
deadline. With ``R`` the recompute seconds of the text chunks so far, the last chunk
is delivered at ``R_total + max(0, max_i(arrival_i - R_before_i))``, so its states are,
per number of recomputed tokens, the Pareto-optimal (link free time, that running
maximum, cost) triples. The oracle never cancels: knowing the trace, it never starts a
transfer it would abandon, and an abandoned transfer only spends link time, so cancel
cannot beat it either.
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from netsim.trace import Trace

from streamer.adapt import cancel as cancel_rule
from streamer.adapt.base import Abandon
from streamer.adapt.cancel import RECONSIDER_S
from streamer.adapt.decoding import DecodeCost
from streamer.adapt import estimator
from streamer.adapt.decide import (DEFAULT_RECOMPUTE_SECONDS_PER_TOKEN, MAX_QUEUED_AHEAD, decide,
                                   plan_input, time_left)
from streamer.adapt.estimator import MIN_SAMPLE_BYTES
from streamer.wire.manifest import Manifest
from streamer.adapt.policies import TEXT, Choice, Observation, Policy, get_policy

#: Tolerance (seconds) on deadline comparisons, against float rounding in the integrals.
EPS = 1e-9
#: The objective weight of a text chunk the policies use (``adapt.decide`` passes the default).
TEXT_PENALTY = 1.0
#: Bound on simulation steps per chunk: a safety net against a bug (a chunk's transfer
#: takes a few request checks plus one cancel check per RECONSIDER_S; a chunk whose
#: transfer outlasts 20 000 checks (400 s) is not a case the sweeps have).
_MAX_STEPS_PER_CHUNK = 20_000


@dataclass(frozen=True)
class Decision:
    """The inputs one ``adapt.decide`` call saw, and what it returned."""

    chunk: int
    at: float
    time_left: float
    history: tuple[Observation, ...]
    prior_bps: float | None
    estimate: float | None
    choice: Choice
    reason: str | None
    recompute_busy: float = 0.0


@dataclass(frozen=True)
class ChunkTiming:
    """One simulated chunk: receiver-clock times (0 = fetch start), bytes, choice."""

    index: int
    choice: Choice
    bytes: int
    requested: float
    begin: float          # first byte at the receiver
    end: float            # last byte at the receiver
    done: float           # decoded and delivered (ordered)
    busy: float           # receiver-measured busy seconds (0 for text)


@dataclass
class SimResult:
    """One simulated fetch."""

    choices: list[Choice]
    chunks: list[ChunkTiming]
    decisions: list[Decision]
    history: list[Observation]
    finish: float          # last chunk delivered, text recomputed (the session's total_seconds)
    recompute: float       # seconds of text-chunk recompute (overlapping the transfers)
    slo: float
    cost: float            # the policies' objective: distortion per level + TEXT_PENALTY per text
    text_chunks: int
    next_prior: float | None = None   # the session's per-server prior after this fetch
    next_errors: tuple[float, ...] = ()   # and its memory of log prediction errors
    #: per cancel: (chunk, abandoned level, its layers already delivered, what it switched to)
    cancelled: tuple[tuple[int, Choice, int, Choice], ...] = ()

    @property
    def cancels(self) -> int:
        return len(self.cancelled)

    @property
    def completion(self) -> float:
        """KV of the whole context ready: every chunk fetched and decoded, or recomputed."""
        return self.finish

    @property
    def met(self) -> bool:
        return self.completion <= self.slo + EPS


# ----------------------------------------------------------------------------- helpers
class _Link:
    """Vectorised :meth:`Trace.time_to_send` (the oracle evaluates thousands of starts at once)."""

    def __init__(self, trace: Trace) -> None:
        t = np.asarray(trace.times, dtype=np.float64)
        r = np.asarray(trace.rates, dtype=np.float64) * 1e6 / 8.0  # bytes/s
        self.times, self.rates = t, r
        lead = t[0] * r[0]
        self.cum = np.concatenate(([lead], lead + np.cumsum(r[:-1] * np.diff(t))))  # bytes by times[i]

    def bytes_until(self, at: np.ndarray) -> np.ndarray:
        i = np.searchsorted(self.times, at, side="right") - 1
        before = i < 0
        j = np.maximum(i, 0)
        out = self.cum[j] + self.rates[j] * (at - self.times[j])
        return np.where(before, at * self.rates[0], out)

    def time_to_send(self, nbytes: np.ndarray, start: np.ndarray) -> np.ndarray:
        """Seconds from ``start`` until ``nbytes`` have been carried (``inf`` if never)."""
        nbytes = np.asarray(nbytes, dtype=np.float64)
        start = np.asarray(start, dtype=np.float64)
        target = self.bytes_until(start) + nbytes
        cum, times, rates = self.cum, self.times, self.rates
        j = np.searchsorted(cum, target, side="left")
        inside = j < len(cum)
        jj = np.clip(j - 1, 0, len(cum) - 1)
        with np.errstate(divide="ignore", invalid="ignore"):
            end_in = np.where(j == 0, target / rates[0], times[jj] + (target - cum[jj]) / rates[jj])
            last = rates[-1]
            end_after = times[-1] + (target - cum[-1]) / last if last > 0 else np.full_like(target, np.inf)
        end = np.where(inside, end_in, end_after)
        return np.where(nbytes <= 0, 0.0, np.maximum(end - start, 0.0))


def _as_policy(policy: str | Policy) -> tuple[Policy, str]:
    if isinstance(policy, str):
        return get_policy(policy), policy
    return policy, getattr(policy, "__name__", "policy")


def _default_decode(manifest: Manifest) -> np.ndarray:
    return np.zeros(len(manifest.chunks))


# --------------------------------------------------------------------------- simulator
class Simulator:
    """Simulates fetches of one context (manifest) over traces; see the module docstring.

    ``decode_seconds`` is each chunk's decode time (a scalar for all chunks, or one per
    chunk); ``distortion`` the per-level distortion to report (default: the manifest's
    targets, which are also what the policies optimise).
    """

    def __init__(self, manifest: Manifest, *, rtt: float,
                 recompute_seconds_per_token: float = DEFAULT_RECOMPUTE_SECONDS_PER_TOKEN,
                 decode_seconds: float | Sequence[float] = 0.0,
                 distortion: Sequence[float] | None = None,
                 reconnect_seconds: float | None = None) -> None:
        if not rtt >= 0:
            raise ValueError(f"rtt must be >= 0, got {rtt}")
        self.manifest = manifest
        self.rtt = float(rtt)
        #: what a new connection costs when the cancel rule aborts one: by default the four
        #: round trips of TCP, HELLO, AUTH and OPEN (the profile is cached by then)
        self.reconnect_seconds = 4 * self.rtt if reconnect_seconds is None else float(reconnect_seconds)
        if not self.reconnect_seconds >= 0:
            raise ValueError(f"reconnect_seconds must be >= 0, got {reconnect_seconds}")
        self.recompute = float(recompute_seconds_per_token)
        n = len(manifest.chunks)
        dec = np.broadcast_to(np.asarray(decode_seconds, dtype=np.float64), (n,)).copy()
        if (dec < 0).any():
            raise ValueError("decode_seconds must be >= 0")
        self.decode = dec
        self.distortion = tuple(manifest.level_distortion if distortion is None else distortion)
        if len(self.distortion) != manifest.levels:
            raise ValueError(f"distortion needs one value per level ({manifest.levels})")
        self.tokens = np.array([c.tokens for c in manifest.chunks], dtype=np.float64)
        self.sizes = [tuple(c.sizes) for c in manifest.chunks]
        self.text_bytes = [c.text_bytes for c in manifest.chunks]
        self._links: dict[int, _Link] = {}

    # ------------------------------------------------------------------ decisions
    def decide(self, policy: str | Policy, chunk: int, *, time_left: float,
               history: Sequence[Observation], prior_bps: float | None,
               prior_errors: Sequence[float] = (), abandon: Abandon | None = None,
               recompute_busy: float = 0.0, until_deadline: float | None = None,
               decode_cost: DecodeCost | None = None, decode_busy: float = 0.0,
               previous: Choice | None = None) -> tuple[Choice, str | None]:
        """The simulated receiver's decision for ``chunk``: ``adapt.decide`` with this
        context's manifest and recompute cost (the session calls the same function).
        ``decode_cost`` and ``decode_busy`` replay a session's decoder; the simulated
        receiver's own keeps up with any link (None)."""
        fn, _ = _as_policy(policy)
        return decide(fn, self.manifest, chunk, time_left=time_left, history=history,
                      prior_bps=prior_bps, prior_errors=prior_errors, abandon=abandon,
                      recompute_busy=recompute_busy, recompute_seconds_per_token=self.recompute,
                      until_deadline=until_deadline, decode_cost=decode_cost, decode_busy=decode_busy,
                      previous=previous)

    def _bytes_of(self, chunk: int, choice: Choice) -> int:
        return self.text_bytes[chunk] if choice == TEXT else self.sizes[chunk][choice]

    def cost_of(self, choices: Sequence[Choice]) -> float:
        """The policies' objective for a whole schedule."""
        d = self.manifest.level_distortion
        return float(sum(TEXT_PENALTY if c == TEXT else d[c] for c in choices))

    def kv_distortion_of(self, choices: Sequence[Choice]) -> float:
        """Token-weighted mean distortion of the chunks fetched as KV (nan if none was)."""
        kv = [j for j, c in enumerate(choices) if c != TEXT]
        if not kv:
            return math.nan
        w = self.tokens[kv]
        return float(sum(self.distortion[choices[j]] * wj for j, wj in zip(kv, w)) / w.sum())

    # ------------------------------------------------------------------ one fetch
    def run(self, policy: str | Policy, trace: Trace, *, slo: float, start: float = 0.0,
            prior_bps: float | None = None, prior_errors: Sequence[float] = (),
            schedule: Sequence[Choice] | None = None, cancel: bool | None = None) -> SimResult:
        """Simulate one fetch starting at trace time ``start``.

        ``schedule`` replays fixed choices instead of asking the policy (e.g. the
        oracle's schedule), with the same timing model and no cancel. ``prior_bps`` and
        ``prior_errors`` are the peer's memory from earlier fetches
        (:attr:`SimResult.next_prior`, :attr:`SimResult.next_errors`).
        ``cancel`` runs the cancel rule on the chunk in flight as the session does (None:
        the session's default for the policy, :func:`streamer.adapt.cancel.cancels_by_default`).
        """
        if not slo > 0:
            raise ValueError(f"slo must be > 0, got {slo}")
        fn, name = _as_policy(policy)
        cancels = schedule is None and (cancel_rule.cancels_by_default(name) if cancel is None else cancel)
        abandon = Abandon(self.rtt, self.reconnect_seconds) if cancels else None
        n = len(self.sizes)
        owd = self.rtt / 2
        rtt = self.rtt
        layers = self.manifest.layers

        # per request (in chunk order): bytes, link start (sender clock), begin, end; a
        # cancel drops the chunk in flight and every request after it
        nbytes: list[int] = []
        link_start: list[float] = []
        begin: list[float] = []
        end: list[float] = []
        is_text: list[bool] = []
        requested: list[float] = []
        choices: list[Choice] = []
        decisions: list[Decision] = []
        history: list[Observation] = []
        busy_of: list[float] = [0.0] * n
        pending: Observation | None = None   # small transfers pooled until they make a sample
        completed = 0          # chunks whose end has been processed
        last_end: float | None = None
        link_free = 0.0
        forced: dict[int, tuple[Choice, str]] = {}   # a cancelled chunk's re-request
        cancelled: list[tuple[int, Choice, int, Choice]] = []
        # the cancel rule's looks at the transfer in flight, (time, bytes), and which it is
        marks: list[tuple[float, int]] = []
        looking_at: tuple[int, float] | None = None   # (chunk, first byte) of that transfer

        def received(j: int, now: float) -> float:
            if now >= end[j]:
                return float(nbytes[j])
            if is_text[j] or now <= begin[j]:
                return 0.0
            return min(float(nbytes[j]),
                       trace.bits_between(start + link_start[j], start + now - owd) / 8.0)

        def complete_until(now: float) -> None:
            nonlocal completed, last_end, pending
            while completed < len(end) and end[completed] <= now:
                j = completed
                at = end[j]
                b0 = at if is_text[j] else begin[j]
                busy = max(at - max(b0, last_end if last_end is not None else 0.0), 0.0)
                busy_of[j] = busy
                last_end = at
                sample, pending = estimator.pool_sample(pending, nbytes[j], busy)
                if sample is not None:
                    history.append(sample)
                completed += 1

        def estimate_at(now: float) -> tuple[list[Observation], float | None]:
            hist = list(history)
            if completed < len(end) and now >= begin[completed]:
                j = completed
                s = max(begin[j], last_end if last_end is not None else begin[j])
                sample = estimator.in_flight_sample(s, now, received(j, now), lambda t: received(j, t))
                if sample is not None:
                    hist.append(sample)
            return hist, estimator.robust_estimate(hist, prior=prior_bps, prior_errors=prior_errors)

        def outstanding(now: float) -> float:
            return sum(nbytes[j] - received(j, now) for j in range(completed, len(end)))

        def delivered(count: int) -> list[float]:
            """When each of the first ``count`` requested chunks is delivered (ordered: a
            KV chunk decoded, a text chunk recomputed after the chunk before it)."""
            out, done = [], 0.0
            for j in range(count):
                if is_text[j]:
                    done = max(end[j], done) + self.recompute * float(self.tokens[j])
                else:
                    dec = float(self.decode[j])
                    done = max(end[j] + dec / layers, done + dec)
                out.append(done)
            return out

        def recompute_owed(index: int, now: float) -> float:
            """Recompute seconds of the chunks before ``index`` sent as text and still to
            run at ``now`` (the session's count: each not delivered whole, less what the
            one being recomputed has had)."""
            done = delivered(index)
            return float(sum(min(self.recompute * float(self.tokens[j]), done[j] - now)
                             for j in range(index) if is_text[j] and done[j] > now))

        def crossing(now: float, limit: float) -> float:
            """Earliest time >= now when the bytes still due drop to ``limit``.

            While chunk m is arriving (FIFO: later chunks untouched) the bytes due are
            ``size_m - received_m + (sizes after m)``, so the crossing lies in the first
            in-flight chunk m whose later chunks alone are within ``limit``.
            """
            tails = np.cumsum([0.0] + [float(nbytes[j]) for j in range(len(end) - 1, completed, -1)])
            for m in range(completed, len(end)):
                tail = float(tails[len(end) - 1 - m])
                need = nbytes[m] + tail - limit   # bytes of chunk m that must have arrived
                if need > nbytes[m]:
                    continue
                if need <= 0:
                    return now
                if is_text[m]:
                    return max(now, end[m])
                dt = trace.time_to_send(8.0 * need, start + link_start[m])
                return max(now, link_start[m] + dt + owd)
            return max(now, end[-1])

        def request(index: int, now: float, hist: list[Observation], est: float | None) -> None:
            nonlocal link_free
            left = time_left(slo - now, outstanding(now), est, rtt)
            busy = recompute_owed(index, now)
            if index in forced:
                choice, reason = forced.pop(index)
            elif schedule is not None:
                choice = schedule[index] if left > 0 else TEXT
                reason = None if left > 0 else "deadline passed"
            else:
                choice, reason = decide(fn, self.manifest, index, time_left=left, history=hist,
                                        prior_bps=prior_bps, prior_errors=prior_errors,
                                        recompute_seconds_per_token=self.recompute, abandon=abandon,
                                        recompute_busy=busy, until_deadline=slo - now,
                                        previous=choices[index - 1] if index else None)
            decisions.append(Decision(index, now, left, tuple(hist), prior_bps, est, choice, reason, busy))
            size = self._bytes_of(index, choice)
            s = max(now + owd, link_free)
            e = s + trace.time_to_send(8.0 * size, start + s)
            link_free = e
            choices.append(choice)
            nbytes.append(size)
            link_start.append(s)
            is_text.append(choice == TEXT)
            requested.append(now)
            begin.append(e + owd if choice == TEXT else s + owd)
            end.append(e + owd)

        def reconsider_head(now: float, est: float | None) -> float | None:
            """The cancel rule on the chunk in flight, as the session applies it: on a switch,
            drop it and everything requested after it, and return when its re-request goes out
            (after the CANCELLED answer, or after a reconnect when the rule aborts)."""
            nonlocal link_free, last_end, history, looking_at
            j = completed
            got = received(j, now)
            if looking_at != (j, begin[j]):   # a new transfer: new looks
                looking_at = (j, begin[j])
                marks[:] = [(max(begin[j], last_end if last_end is not None else begin[j]), 0)]
            marks.append((now, int(got)))
            sample = cancel_rule.chunk_rate(marks, est)
            if sample is None:
                return None
            rate = sample.bytes / sample.busy_seconds
            plan = plan_input(self.manifest, j, time_left=slo - now, history=(), prior_bps=None,
                              recompute_seconds_per_token=self.recompute,
                              recompute_busy=recompute_owed(j, now))
            head = cancel_rule.InFlight(level=int(choices[j]), remaining_bytes=int(nbytes[j] - got),
                                        delivered_layers=int(layers * got / nbytes[j]))
            switch = cancel_rule.reconsider(plan, head, rate=rate, rtt=rtt,
                                            reconnect_seconds=self.reconnect_seconds,
                                            shortfall=estimator.shortfall(history, prior_errors))
            if switch is None:
                return None
            if switch.abort:   # what was queued is dropped with the connection
                link_free, last_end, again = now, now, now + self.reconnect_seconds
            else:              # the sender stops after what it had committed to the path
                sent = trace.bits_between(start + link_start[j], start + now + owd) / 8.0
                carried = min(float(nbytes[j]), sent + cancel_rule.COMMITTED_BYTES)
                if carried >= nbytes[j]:
                    return None   # the whole chunk is on its way: nothing left to cancel
                stop = link_start[j] + trace.time_to_send(8.0 * carried, start + link_start[j])
                link_free, last_end, again = stop, stop + owd, stop + owd
                if again > now + switch.escalate_after:   # the drain stalls: drop the connection
                    dropped = now + switch.escalate_after
                    link_free, last_end, again = dropped, dropped, dropped + self.reconnect_seconds
            history = history + [sample]   # what the link was judged to carry: the freshest sample
            cancelled.append((j, choices[j], head.delivered_layers, switch.choice))
            forced[j] = (switch.choice, f"cancelled at level {choices[j]}: predicted to miss the deadline")
            for column in (nbytes, link_start, begin, end, is_text, requested, choices):
                del column[j:]
            return again

        now = 0.0
        index = 0          # next chunk to request
        for _ in range(_MAX_STEPS_PER_CHUNK * n):
            complete_until(now)
            hist, est = estimate_at(now)
            head = completed if completed < len(end) else None
            watching = cancels and head is not None and not is_text[head]
            if watching and now >= begin[head]:
                again = reconsider_head(now, est)
                if again is not None:
                    index, now = head, again
                    continue
            if head is None:
                if index == n:
                    break
                request(index, now, hist, est)   # nothing in flight: request at once
                index += 1
                continue
            nxt = end[head]
            if index < n and sum(not is_text[j] for j in range(head, len(end))) <= MAX_QUEUED_AHEAD:
                # request, as the session does, once the bytes due would take about one RTT
                limit = (est or 0.0) * rtt + MIN_SAMPLE_BYTES
                if outstanding(now) <= limit + 1e-6:
                    request(index, now, hist, est)
                    index += 1
                    continue
                crossed = crossing(now, limit)
                if crossed <= now:   # crossing is now (the integrals differ in the last bits)
                    request(index, now, hist, est)
                    index += 1
                    continue
                nxt = min(nxt, crossed)
            if watching:   # the session looks every RECONSIDER_S while a chunk arrives
                nxt = min(nxt, begin[head] if now < begin[head] else now + RECONSIDER_S)
            now = nxt
        else:  # pragma: no cover - a bug, not a schedule
            raise RuntimeError(f"simulated fetch did not finish in {_MAX_STEPS_PER_CHUNK * n} steps")
        complete_until(math.inf)

        done_at = delivered(n)
        timings = [ChunkTiming(j, choices[j], nbytes[j], requested[j], begin[j], end[j], done_at[j], busy_of[j])
                   for j in range(n)]
        done = done_at[-1]
        text_tokens = float(sum(self.tokens[j] for j in range(n) if is_text[j]))
        memory = estimator.remember(history, prior_errors)
        return SimResult(choices=choices, chunks=timings, decisions=decisions, history=history,
                         finish=done, recompute=self.recompute * text_tokens, slo=float(slo),
                         cost=self.cost_of(choices),
                         text_chunks=sum(is_text),
                         next_prior=memory.rate if memory else None,
                         next_errors=memory.errors if memory else (),
                         cancelled=tuple(cancelled))

    # ------------------------------------------------------------------ oracle
    def oracle(self, trace: Trace, *, slo: float, start: float = 0.0) -> "OracleResult":
        """:func:`oracle` for this context."""
        key = id(trace)
        link = self._links.get(key)
        if link is None or len(self._links) > 256:
            if len(self._links) > 256:
                self._links.clear()
            link = self._links[key] = _Link(trace)
        return _oracle(self, link, slo=slo, start=start)


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


def oracle(manifest: Manifest, trace: Trace, *, slo: float, rtt: float, start: float = 0.0,
           recompute_seconds_per_token: float = DEFAULT_RECOMPUTE_SECONDS_PER_TOKEN,
           decode_seconds: float | Sequence[float] = 0.0,
           distortion: Sequence[float] | None = None) -> OracleResult:
    """The minimum-objective schedule that meets ``slo`` on ``trace`` (known in advance)."""
    sim = Simulator(manifest, rtt=rtt, recompute_seconds_per_token=recompute_seconds_per_token,
                    decode_seconds=decode_seconds, distortion=distortion)
    return sim.oracle(trace, slo=slo, start=start)


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


def _oracle(sim: Simulator, link: _Link, *, slo: float, start: float) -> OracleResult:
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


__all__ = ["ChunkTiming", "Decision", "OracleResult", "SimResult", "Simulator", "oracle"]
