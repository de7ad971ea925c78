"""Cancel and downgrade: whether to abandon the chunk in flight for a cheaper answer.

A chunk is requested at the level the estimate allowed when it was decided; if the
link then drops, the rest of that chunk alone can outlast the deadline, and no later
decision can repair it. Mooncake's rule, made concrete with the planners' cost model
(``base.predicted_seconds``): keep the transfer while finishing it still leaves the
later chunks time for their cheapest answers; otherwise CANCEL it and re-request the
chunk at the best option that makes the deadline, or, when none does, at the fastest
option, provided that finishes sooner than keeping would (by ``MIN_GAIN``).

Cancelling is not free: bytes already on their way (the sender's socket buffer and
whatever the path queues) still arrive before the new answer, and the new request
costs a round trip. When everything left of the chunk is already on its way and its
transfer, not its decode, is what holds the pipeline, a CANCEL stops nothing (the chunk
arrives whole), so none is sent. When those bytes would take longer than opening a new connection
(measured when the session connected), the session aborts the connection instead,
which discards them, and re-requests on a fresh one (``Switch.abort``), as video
players abort a segment download. A lower level re-requests the layers not delivered yet:
the whole chunk while none went out, else, where the connection takes continuations
(``InFlight.continuable``), the rest of them (``InFlight.remaining_share`` of its bytes and
decode), so a chunk that turns slow halfway finishes at a cheaper level instead of costing
the whole chunk as text; without continuations only text can follow a delivered layer.
Text is always possible (it supersedes delivered layers: the caller recomputes the whole
chunk).

A drop is not given up at once. Links shared with other traffic fade for tens to
hundreds of milliseconds and come back, and a chunk given up is a text chunk for sure
(``text_penalty``, as bad as losing it), while one kept through a short fade costs
nothing. So the rule keeps a chunk, however slow, while giving it up for text would
still fit after ``PATIENCE_S`` more (three looks' worth of noticing a collapse), and
decides only when that margin runs out (a lower level that makes the deadline is taken
at once: it costs little, and may not fit later).

Nor is text taken before it is needed. A text chunk's recompute starts only once the
caller has recomputed the text chunks before it, so while that recompute still outlasts
giving the chunk up (the restart and its token ids, with a look to spare), a switch to
text is put off at no cost: the link may come back meanwhile. This is what makes the
planner's free tries of a chunk it would send as text (``mpc.free_probe``) free.

A CANCEL is answered once the bytes the sender had committed have drained, which a fade
can hold up for as long as it lasts. Each switch says by when its answer is due
(``Switch.escalate_after``: the drain at ``shortfall`` of the rate, and a round trip);
the session drops the connection when it has not come by then, as it would have if the
rule had chosen to abort. (The abort/CANCEL choice itself weighs the drain at that share
too.)

Pure: the session calls it on every arrival and on a short timer while a chunk is in
flight; unit tests call it on hand-made situations.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from codec.prediction import restart_layer
from streamer.adapt.base import (TEXT, Choice, Observation, PlanInput, link_seconds, option_seconds,
                                 pipeline_budget, predicted_seconds)
from streamer.adapt.estimator import GUARD_FACTOR, MIN_SAMPLE_BYTES

#: Bytes assumed already committed to the path when a CANCEL goes out and so still to
#: arrive: the sender keeps at most this much queued in its process and kernel (see
#: ``streamer.net.sender``), plus what the link holds in flight (rate x round trip).
COMMITTED_BYTES = 256 * 1024
#: How often the rule looks at the chunk in flight between arrivals (seconds).
RECONSIDER_S = 0.02
#: The least time between two looks, however fast bytes arrive: a look costs the receiving
#: loop ~1 ms of Python (the estimate, the plan), and on every arrival at 200 Mbit/s the
#: looks took 0.16 s of the loop's time in a 0.9 s fetch of ``kvwire demo`` (cProfile,
#: 121 looks), time the decode thread waits for the GIL.
MIN_LOOK_S = RECONSIDER_S / 2
#: The span of recent arrivals a chunk is also judged by (see ``chunk_rate``).
RECENT_S = 0.02
#: How long a slow chunk is waited for: it is kept while giving it up for text would
#: still fit after this much more time (three looks' worth of noticing a collapse, each
#: RECONSIDER_S + RECENT_S). With one look's worth, the margin ran out between looks on
#: tight deadlines and the 0.5 s violations rose by a third in ``kvwire bench policies``.
PATIENCE_S = 3 * (RECONSIDER_S + RECENT_S)
#: Switch only when it saves at least this share of the time keeping would take: a
#: marginal gain is not worth the bytes thrown away and the estimate's noise.
MIN_GAIN = 0.25


def cancels_by_default(policy: str) -> bool:
    """Whether a fetch runs the rule when the caller does not say: for mpc, which plans
    against the deadline; greedy stays CacheGen's rule, fixed levels stay fixed."""
    return policy == "mpc"


def chunk_rate(marks: Sequence[tuple[float, int]], estimate: float | None,
               began: float | None = None) -> Observation | None:
    """The transfer to judge the chunk in flight by, as a sample, or None to leave it alone.

    ``marks`` are (seconds, bytes of the chunk received) at each look, oldest first, the
    first when the link started carrying the chunk (0 bytes). Once ``MIN_SAMPLE_BYTES``
    arrived the chunk is judged by its own rate, not by a history that may predate a
    change (a chunk requested as a probe after a fade must not be cancelled for the
    fade): the slower of its whole transfer so far and its recent arrivals (the last
    ``RECENT_S`` or more, back to a look ``MIN_SAMPLE_BYTES`` ago), where a drop
    mid-chunk shows long before it moves the average. Before that only a chunk already slower
    than ``estimate`` is judged, as ``MIN_SAMPLE_BYTES`` over the time since its answer
    ``began`` (its first byte; the first mark when not given), an upper bound (a stall
    shows as bytes that do not come). Not over the time since the first mark: until the
    first byte the wait is the sender's response, whatever the link's rate, and a sender
    sharing its cores with a busy receiver answered 10-30 ms late, which read as a link of
    a few tens of Mbit/s at the first look. Otherwise there is nothing new to decide on.
    The sample is also what the planner learns when the chunk is abandoned.
    """
    if len(marks) < 2:
        return None
    (start, _), (now, received) = marks[0], marks[-1]
    elapsed = now - start
    if not elapsed > 0:
        return None
    if received < MIN_SAMPLE_BYTES:
        waited = now - (start if began is None else max(start, began))
        if waited > 0 and estimate is not None and MIN_SAMPLE_BYTES / waited < estimate:
            return Observation(MIN_SAMPLE_BYTES, waited, upper_bound=True)
        return None
    whole = Observation(received, elapsed)
    # the latest look at least RECENT_S ago with MIN_SAMPLE_BYTES arrived since (the first
    # look qualifies): arrivals come in bursts, and a window that happens to fall between
    # two would read as a stall
    then, before = next(mark for mark in reversed(marks)
                        if mark[0] <= now - RECENT_S and received - mark[1] >= MIN_SAMPLE_BYTES
                        or mark is marks[0])
    recent = Observation(received - before, now - then)
    return recent if recent.bytes * whole.busy_seconds < whole.bytes * recent.busy_seconds else whole


def abandon_seconds(rate: float, rtt: float, reconnect_seconds: float) -> float:
    """Seconds the rule may take, beyond the transfer itself, to give up a KV chunk whose
    link collapses to ``rate`` bytes/s at any point: ``MIN_SAMPLE_BYTES`` to judge it by
    (if it was slow from the start), the recent window and one look to see the drop,
    then draining what is committed or reconnecting (whichever is shorter), and the
    re-request's round trip. What lets a planner try a chunk it cannot be sure of."""
    return give_up_seconds(rate, rtt, reconnect_seconds) + RECENT_S


def give_up_seconds(rate: float, rtt: float, reconnect_seconds: float) -> float:
    """Seconds the rule takes, from a KV chunk's first byte at ``rate`` bytes/s, to give
    it up at a moment set in advance rather than on seeing a drop: ``MIN_SAMPLE_BYTES`` to
    judge it by and one look, then draining or reconnecting, and the re-request's round
    trip (:func:`abandon_seconds` adds the recent window a drop takes to show)."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 bytes/s, got {rate}")
    drain = (COMMITTED_BYTES + rate * rtt) / rate
    return MIN_SAMPLE_BYTES / rate + RECONSIDER_S + min(drain, reconnect_seconds) + rtt


@dataclass(frozen=True)
class Switch:
    """Abandon the chunk in flight: re-request it as ``choice``; ``abort`` the connection
    (dropping what is queued) rather than send CANCEL."""

    choice: Choice
    abort: bool
    #: after a CANCEL (not an abort), seconds by which its answer should have come: what
    #: is committed drained at ``shortfall`` of the rate, and a round trip. A link that
    #: fades during the drain can hold the answer back for as long as the fade lasts;
    #: past this, the session drops the connection instead (``Switch.abort``'s way).
    escalate_after: float = 0.0


@dataclass(frozen=True)
class InFlight:
    """The chunk being received, as the session sees it."""

    level: int
    remaining_bytes: int
    delivered_layers: int
    #: decoding its sections not received yet will take (``adapt.decoding``)
    remaining_decode_seconds: float = 0.0
    #: the chunk's layers, and whether those not delivered may continue at a lower level
    #: once some went out (the connection takes continuations: protocol version 2)
    layers: int = 1
    continuable: bool = False
    #: the context's prediction period (``Manifest.restart``): a continuation of a
    #: predicted level starts at the layer coded alone before the first not delivered
    restart: int = 1

    @property
    def remaining_share(self) -> float:
        """The share of the chunk's layers a continuation carries: those not delivered, and
        those back to the layer a predicted level restarts at (decoded, not delivered)."""
        return (self.layers - restart_layer(self.delivered_layers, self.restart)) / self.layers


def reconsider(plan: PlanInput, head: InFlight, *, rate: float, rtt: float,
               reconnect_seconds: float, shortfall: float = GUARD_FACTOR) -> Switch | None:
    """What to switch the chunk in flight to, or None to keep it.

    ``plan`` describes the chunk in flight (row 0) and every chunk after it, with
    ``time_left`` the seconds to the deadline, ``recompute_busy`` the recompute still
    owed for earlier text chunks and ``decode_busy`` the decoding owed for the sections
    already in (``base.pipeline_budget`` takes it off); ``rate`` is the robust estimate
    (bytes/s), partial rate of the chunk in flight included; ``reconnect_seconds`` what
    connecting and opening the context took; ``shortfall`` the share of ``rate`` the
    link may still fall to (``estimator.shortfall``: this peer's worst recent shortfall,
    at least ``GUARD_FACTOR``). A chunk on course near the deadline is kept only if it
    would still make it at that share: on a steady peer it is kept, on an erratic one it
    is given up for text while that still fits.
    """
    if not rate > 0:
        return None
    committed = COMMITTED_BYTES + rate * rtt
    drain = min(head.remaining_bytes, committed) / rate
    slow_drain = drain / shortfall   # what the drain may take if the link falls as far as it may
    abort = reconnect_seconds < slow_drain
    if not abort and head.remaining_bytes <= committed and head.remaining_decode_seconds <= drain:
        return None   # everything left is on its way already: a CANCEL would stop nothing
    timing = _Timing(plan, head, rate, restart=(reconnect_seconds if abort else drain) + rtt)
    options: list[Choice] = [TEXT]
    if head.delivered_layers == 0 or head.continuable:
        options += range(head.level + 1, plan.levels)
    choice = _judge(timing, options, shortfall)
    if choice is None:
        return None
    if choice == TEXT and timing.restart + plan.text_bytes[0] / rate + RECONSIDER_S <= plan.recompute_busy:
        return None   # text still lands before the recompute reaches this chunk at the next look
    return Switch(choice, abort, escalate_after=0.0 if abort else slow_drain + rtt)


class _Timing:
    """When the last chunk is delivered, for each way the chunk in flight may go."""

    def __init__(self, plan: PlanInput, head: InFlight, rate: float, restart: float) -> None:
        self.plan, self.head, self.rate, self.restart = plan, head, rate, restart
        self.budget = pipeline_budget(plan)
        self.later_series = float(option_seconds(plan, rate)[1:].min(axis=1).sum())
        self.later_levels = float(link_seconds(plan, rate)[1:, :-1].min(axis=1).sum())

    def finish(self, link: float, recompute: float = 0.0) -> float:
        """If the chunk in flight takes ``link`` more seconds of link time (and ``recompute``
        as text): the later chunks at their cheapest in series, or all at levels, streaming
        while what is owed is recomputed (``adapt.overlap``; not where recompute shares the
        decoder's cores: ``PlanInput.recompute_overlaps``); whichever is sooner."""
        if not self.plan.recompute_overlaps:
            return self.plan.recompute_busy + link + recompute + self.later_series
        done = max(self.plan.recompute_busy, link) + recompute
        return min(done + self.later_series, max(done, link + self.later_levels))

    def keeping(self, at: float) -> float:
        """Seconds the chunk in flight still holds the pipeline if kept, its bytes at ``at`` bytes/s."""
        return max(self.head.remaining_bytes / at, self.head.remaining_decode_seconds)

    def switched(self, option: Choice, at: float) -> float:
        """:meth:`finish` after re-requesting the chunk as ``option``, its bytes at ``at`` bytes/s."""
        plan = self.plan
        if option == TEXT:
            return self.finish(self.restart + plan.text_bytes[0] / at, float(plan.text_seconds[0]))
        return self.finish(self.restart + self.refetch_seconds(option, at))

    def refetch_seconds(self, option: Choice, at: float) -> float:
        """Seconds re-requesting the chunk in flight as ``option`` takes in series, its bytes
        at ``at`` bytes/s: a level re-requests the layers not delivered (all of them, or a
        continuation's share), text the whole chunk."""
        seconds = predicted_seconds(self.plan, option, at)
        return seconds if option == TEXT else self.head.remaining_share * seconds


def _judge(timing: _Timing, options: list[Choice], shortfall: float) -> Choice | None:
    """What to switch to on the link as it is now (None: keep), before text is put off."""
    plan, rate, budget = timing.plan, timing.rate, timing.budget
    keep = timing.keeping(rate)
    can_wait = timing.finish(PATIENCE_S + timing.restart + plan.text_bytes[0] / rate,
                             float(plan.text_seconds[0])) <= budget
    if timing.finish(keep) <= budget:
        # keep while it could still be given up later; past that point, only a chunk
        # that would finish even at ``shortfall`` of this rate
        if can_wait or timing.finish(timing.keeping(rate * shortfall)) <= budget:
            return None
        # at ``shortfall`` of the rate: what a level (re-requested) still makes for sure
        safe = [option for option in options
                if timing.switched(option, rate if option == TEXT else rate * shortfall) <= budget]
        if not safe:
            return None   # nothing is surer than keeping
        return min(safe, key=lambda option: _distortion(plan, option))
    fitting = [option for option in options if timing.switched(option, rate) <= budget]
    levels = [option for option in fitting if option != TEXT]
    if levels:   # a lower level makes the deadline, keeping does not: no gain test needed
        return min(levels, key=lambda option: _distortion(plan, option))
    if can_wait:
        return None   # only text is left, and it can still be had later: a fade may end
    if fitting:
        return TEXT
    cost = {option: timing.restart + timing.refetch_seconds(option, rate) for option in options}
    choice = min(options, key=lambda option: cost[option])
    return choice if cost[choice] <= (1 - MIN_GAIN) * keep else None


def _distortion(plan: PlanInput, choice: Choice) -> float:
    return plan.text_penalty if choice == TEXT else plan.distortion[choice]
