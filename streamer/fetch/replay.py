"""A recorded fetch as the simulator's models: what proves the two drivers drive alike.

``StreamSession`` with ``SessionConfig.record`` keeps its controller's inputs and actions
(``FetchController.log``). From them this module takes what the *world* did, not what
the controller was told: the answers' arrival timeline (each answer's first byte,
sections and parts, and end, in request order: ``links.RecordedLink``), how long the
decoder took for each section, and how long each recompute took. The simulator, given
that as its link, decoder and recompute models, and the recorded driver's wake-ups as its
clock (a live timer fires a little late, and a decision taken a millisecond apart sees
another partial sample), drives its own controller with its own delivery model; the
actions it takes should be the session's (``tests/test_fetch_replay.py``).
"""
from __future__ import annotations

import math
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Sequence

from streamer.fetch import events as ev
from streamer.fetch.links import (BEGIN, END, PARTIAL, POINT, SECTION, TEXT_END, LinkEvent, RecordedAnswer,
                                  RecordedLink)


@dataclass
class Recording:
    """The world of one recorded fetch, on its own clock (0 at ``fetch()``). Consumed by
    the run it drives (each section's recorded seconds are handed out once, in order):
    a second run needs its own ``recording(log)``."""

    answers: list[RecordedAnswer]
    #: (chunk, layer) -> the decoder's seconds for each time that section was decoded, and
    #: when it was done (the fetch's clock): the decoder ran as many sections at once as
    #: it had threads, which a model of one worker would not reproduce
    decodes: dict[tuple[int, int], deque[float]] = field(default_factory=dict)
    decoded_at: dict[tuple[int, int], deque[float]] = field(default_factory=dict)
    #: chunk -> seconds of each recompute of it
    recomputes: dict[int, deque[float]] = field(default_factory=dict)
    rtt: float = 0.0
    connect_seconds: float = 0.0
    #: whether the recorded connections took continuations (protocol version 2)
    continuations: bool = False
    #: the actions the recorded controller took, in order
    actions: list[ev.Action] = field(default_factory=list)
    #: when the recorded driver woke the controller with nothing arrived (its ``Tick``s)
    wakes: list[float] = field(default_factory=list)
    #: each new connection after a reconnect: (when it was ready, its rtt, what it took)
    connects: list[tuple[float, float, float]] = field(default_factory=list)
    #: (when, paused) each time the recorded driver paused (True) or resumed (False)
    #: reading: its backlog over budget, which the simulator's receiver does not model
    pauses: list[tuple[float, bool]] = field(default_factory=list)

    def link(self) -> RecordedLink:
        return RecordedLink(self.answers)

    def decode_time(self, chunk: int, layer: int, nbytes: int) -> float:
        """The recorded seconds of this section's decode (the mean of all, past the record)."""
        times = self.decodes.get((chunk, layer))
        return times.popleft() if times else self._mean_decode()

    def decode_done(self, chunk: int, layer: int, handed: float) -> float:
        """When the recorded decoder was done with this section (past the record: its
        mean seconds after ``handed``)."""
        times = self.decoded_at.get((chunk, layer))
        return times.popleft() if times else handed + self._mean_decode()

    def _mean_decode(self) -> float:
        """The mean of the decode seconds not replayed yet (0 without any)."""
        every = [t for queue in self.decodes.values() for t in queue] or [0.0]
        return sum(every) / len(every)

    def recompute_time(self, chunk: int, tokens: int) -> float:
        times = self.recomputes.get(chunk)
        return times.popleft() if times else 0.0


def recording(log: Sequence[ev.Event | ev.Action]) -> Recording:
    """The world of the fetch ``log`` records (``FetchController.log``)."""
    if not log or not isinstance(log[0], ev.Started):
        raise ValueError("a fetch log starts with Started")
    start = log[0]
    out = Recording([], rtt=start.rtt, connect_seconds=start.connect_seconds, continuations=start.continuations)
    events: dict[int, list[LinkEvent]] = {}   # chunk -> the events of its latest answer
    arriving: list[int] = []                  # chunks whose answers began and did not end, in order
    awaiting: list[int] = []                  # chunks requested whose answers have not begun, in order
    decodes: dict[tuple[int, int], deque[float]] = defaultdict(deque)
    decoded_at: dict[tuple[int, int], deque[float]] = defaultdict(deque)
    recomputes: dict[int, deque[float]] = defaultdict(deque)
    clock = 0.0   # the latest time among the items the controller had handled
    for item in log:
        at, stamp = getattr(item, "at", 0.0) - start.at, None
        if isinstance(item, _LINK_ITEMS):
            at, stamp = _handed(at, clock)
        clock = max(clock, at)

        def arrived(chunk: int, kind: str, *args, **fields) -> None:
            events[chunk].append(LinkEvent(at, chunk, kind, *args, stamp=stamp, **fields))

        if isinstance(item, ev.SendRequest):
            events[item.chunk] = []
            awaiting.append(item.chunk)
            out.answers.append(RecordedAnswer(item.chunk, item.choice, events[item.chunk],   # type: ignore[arg-type]
                                              item.first_layer))
        if isinstance(item, ev.Reconnect):
            arriving.clear()   # the answers still arriving are gone with the connection
            awaiting.clear()
        if isinstance(item, (ev.SendRequest, ev.SendCancel, ev.Reconnect, ev.ChunkFinished, ev.FailChunk, ev.Fail)):
            out.actions.append(item)
        elif isinstance(item, ev.AnswerBegan):
            arrived(item.chunk, BEGIN, nbytes=item.total_bytes)
            arriving.append(item.chunk)
            _drop_first(awaiting, item.chunk)
        elif isinstance(item, ev.Activity):
            # a socket read inside the answer arriving, or, between answers, one that carried
            # the next answer's first bytes: the driver reports the read before the frames
            # parsed from it, so the controller took it before that answer's AnswerBegan,
            # and the replay must hand it over in the same order
            heads = arriving or awaiting
            if heads and item.partial:
                arrived(heads[0], PARTIAL, item.partial)
        elif isinstance(item, ev.SectionHanded):
            arrived(item.chunk, SECTION, layer=item.layer, nbytes=item.nbytes)
        elif isinstance(item, ev.PartArrived):
            arrived(item.chunk, POINT, item.received, item.sections)
        elif isinstance(item, ev.AnswerEnded):
            _drop_first(arriving, item.chunk)
            last = next((e for e in reversed(events[item.chunk]) if e.kind == POINT), None)
            arrived(item.chunk, END, last.received if last else 0, last.sections if last else 0,
                    cancelled=item.cancelled)
        elif isinstance(item, ev.TextArrived):
            arrived(item.chunk, TEXT_END, item.nbytes)
            _drop_first(awaiting, item.chunk)
        elif isinstance(item, ev.Tick):
            out.wakes.append(at)
        elif isinstance(item, ev.Connected):
            out.connects.append((at, item.rtt, item.connect_seconds))
        elif isinstance(item, (ev.ReadingPaused, ev.ReadingResumed)):
            out.pauses.append((at, isinstance(item, ev.ReadingPaused)))
        elif isinstance(item, ev.SectionDecoded) and item.seconds is not None:
            decodes[(item.chunk, item.layer)].append(item.seconds)
            decoded_at[(item.chunk, item.layer)].append(at)
        elif isinstance(item, ev.RecomputeFinished):
            recomputes[item.chunk].append(item.seconds)
    out.decodes, out.decoded_at, out.recomputes = dict(decodes), dict(decoded_at), dict(recomputes)
    return out


#: What the driver read off the socket: each becomes a ``LinkEvent`` of its answer.
_LINK_ITEMS = (ev.AnswerBegan, ev.Activity, ev.SectionHanded, ev.PartArrived, ev.AnswerEnded, ev.TextArrived)


def _handed(at: float, clock: float) -> tuple[float, float | None]:
    """(when the replay hands a link item over, the stamp it carries if that differs).

    The driver stamps what it reads with the read's time but hands it to the controller
    after what came before it on its queue, decoder reports and timer wake-ups stamped
    later included. The controller saw it then, after those: the replay hands it over
    just after the latest of them (``clock``), stamped as the session stamped it."""
    if at > clock:
        return at, None
    return math.nextafter(clock, math.inf), at


def _drop_first(chunks: list[int], chunk: int) -> None:
    if chunk in chunks:
        chunks.remove(chunk)
