"""The simulator's links: a sender and the path to the receiver, as seen from the receiver.

A link takes the driver's REQUESTs, CANCELs and dropped connections and says when the
answers' bytes reach the receiver. Two models:

* :class:`TraceLink` -- the sender answers requests in order, each once its request has
  arrived (one-way delay ``owd``) and the answer before it has left; the path carries
  bytes at a bandwidth trace's capacity (exact integrals); the receiver sees them ``owd``
  later. A CANCEL stops an answer after the bytes the sender had committed
  (``adapt.cancel.COMMITTED_BYTES``) beyond what the path had carried when the CANCEL
  arrived; an answer whose CANCEL arrives before it starts ends at once, empty. Framing,
  TCP dynamics and shapers' bursts are not modelled.
* :class:`RecordedLink` -- the answers' arrival timeline of a real fetch, replayed: the
  k-th request gets the k-th recorded answer (and must ask for what it asked for).

Answers are cut into equal sections, one per layer they carry (``layers``, or
``layers - first_layer`` for a continuation; the header is not modelled apart); each
section goes to the decoder when its last byte is in.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from netsim.trace import Trace
from streamer.adapt.cancel import COMMITTED_BYTES

#: Link event kinds (``LinkEvent.kind``)
BEGIN, SECTION, POINT, PARTIAL, END, TEXT_END = "begin", "section", "point", "partial", "end", "text"


@dataclass(frozen=True)
class LinkEvent:
    """Something of an answer reached the receiver at ``at``: its first byte (``BEGIN``;
    ``nbytes`` the answer's announced size), a whole section (``SECTION``: ``layer``, ``nbytes``), a point on its arrival curve
    (``POINT``), its end (``END``, ``cancelled`` if cut short), or a text answer whole
    (``TEXT_END``). ``received`` and ``sections`` are the answer's bytes and whole sections in by then.
    ``stamp``: the time the event says it happened, where a replay hands it over later
    (``fetch.replay``: a recorded driver handled it after items stamped later)."""

    at: float
    chunk: int
    kind: str
    received: int = 0
    sections: int = 0
    layer: int = -1
    nbytes: int = 0
    cancelled: bool = False
    stamp: float | None = None

    @property
    def happened(self) -> float:
        """The time the controller is told the event happened."""
        return self.at if self.stamp is None else self.stamp


class Link(Protocol):
    def request(self, at: float, chunk: int, choice: object, nbytes: int, text: bool,
                first_layer: int = 0) -> None: ...
    def cancel(self, at: float, chunk: int) -> None: ...
    def drop(self, at: float) -> None: ...
    def next_time(self) -> float: ...
    def pop(self) -> LinkEvent: ...
    def progress(self, at: float) -> tuple[int, int, int] | None: ...
    def when(self, chunk: int, received: int) -> float: ...


class VectorLink:
    """A trace's integrals, vectorised: the oracle evaluates thousands of starts at once."""

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


def section_bounds(nbytes: int, layers: int) -> np.ndarray:
    """Byte offsets at which each of ``layers`` equal sections of an answer is whole."""
    return np.ceil(np.arange(1, layers + 1) * (nbytes / layers)).astype(np.int64)


@dataclass
class _Answer:
    chunk: int
    nbytes: int
    text: bool
    arrives: float                    # sender clock: its REQUEST reaches the sender
    first_layer: int                  # the first layer it carries (a continuation's > 0)
    cancel_at: float | None = None    # sender clock: its CANCEL reaches the sender
    start: float | None = None        # sender clock: its first byte leaves
    limit: int = 0                    # bytes it carries (less than nbytes once cut)
    end: float = 0.0                  # sender clock: its last byte leaves
    events: list[LinkEvent] = field(default_factory=list)
    popped: int = 0                   # events already handed to the driver


class TraceLink:
    """A sender answering in order over a path whose capacity follows ``trace`` from
    trace time ``start``; see the module docstring. Times are the receiver's, from 0."""

    def __init__(self, trace: Trace, *, start: float, owd: float, layers: int) -> None:
        self.trace, self.t0, self.owd, self.layers = trace, float(start), float(owd), layers
        self._vector = VectorLink(trace)
        self.answers: deque[_Answer] = deque()
        self.free = 0.0   # sender clock: when the path is free

    def request(self, at: float, chunk: int, choice: object, nbytes: int, text: bool,
                first_layer: int = 0) -> None:
        self.answers.append(_Answer(chunk, int(nbytes), text, at + self.owd, first_layer))
        self._start_head()

    def cancel(self, at: float, chunk: int) -> None:
        for answer in self.answers:
            if answer.chunk == chunk and answer.cancel_at is None:
                answer.cancel_at = at + self.owd
                if answer.start is not None:
                    self._cut(answer)
                return

    def drop(self, at: float) -> None:
        """The connection is gone: the answers not yet in vanish with it."""
        self.answers.clear()
        self.free = at

    def next_time(self) -> float:
        if not self.answers:
            return math.inf
        head = self.answers[0]
        return head.events[head.popped].at

    def pop(self) -> LinkEvent:
        head = self.answers[0]
        event = head.events[head.popped]
        head.popped += 1
        if head.popped == len(head.events):
            self.answers.popleft()
            self.free = head.end
            self._start_head()
        return event

    def progress(self, at: float) -> tuple[int, int, int] | None:
        """(chunk, bytes, whole sections) of the KV answer arriving at ``at``, if any."""
        if not self.answers:
            return None
        head = self.answers[0]
        if head.text or head.start is None or at < head.start + self.owd:
            return None
        carried = self._carried(head, at - self.owd)
        return head.chunk, carried, head.first_layer + int(np.searchsorted(self._bounds(head), carried,
                                                                            side="right"))

    def when(self, chunk: int, received: int) -> float:
        """When ``received`` bytes of ``chunk``'s answer will be in (inf: not arriving, or never)."""
        if not self.answers:
            return math.inf
        head = self.answers[0]
        if head.chunk != chunk or head.text or head.start is None or received > head.limit:
            return math.inf
        return head.start + self._time_to_send(received, head.start) + self.owd

    # ------------------------------------------------------------------ internals
    def _bounds(self, answer: _Answer) -> np.ndarray:
        return section_bounds(answer.nbytes, self.layers - answer.first_layer)

    def _carried(self, answer: _Answer, sender_time: float) -> int:
        assert answer.start is not None
        if sender_time <= answer.start:
            return 0
        sent = self.trace.bits_between(self.t0 + answer.start, self.t0 + min(sender_time, answer.end)) / 8.0
        # rounded, not floored: at when(b)'s time the integral may read b less a float ulp
        return int(min(answer.limit, round(sent)))

    def _time_to_send(self, nbytes: float, start: float) -> float:
        return self.trace.time_to_send(8.0 * nbytes, self.t0 + start)

    def _start_head(self) -> None:
        if not self.answers or self.answers[0].start is not None:
            return
        head = self.answers[0]
        head.start = max(head.arrives, self.free)
        if head.cancel_at is not None and head.cancel_at <= head.start:
            head.limit, head.end = 0, head.start
            head.events = [LinkEvent(head.start + self.owd, head.chunk, END, cancelled=True)]
            return
        head.limit = head.nbytes
        if head.cancel_at is not None:
            head.limit = min(head.nbytes, self._sent_by(head, head.cancel_at) + COMMITTED_BYTES)
        head.end = head.start + self._time_to_send(head.limit, head.start)
        head.events = self._events(head)

    def _sent_by(self, answer: _Answer, sender_time: float) -> int:
        assert answer.start is not None
        return int(self.trace.bits_between(self.t0 + answer.start, self.t0 + max(sender_time, answer.start)) / 8.0)

    def _cut(self, answer: _Answer) -> None:
        """A CANCEL reached the running answer: it stops after what was committed."""
        assert answer.cancel_at is not None
        if answer.cancel_at >= answer.end:
            return   # its last byte had left: the CANCEL crossed the end
        limit = min(answer.limit, self._sent_by(answer, answer.cancel_at) + COMMITTED_BYTES)
        if limit >= answer.limit:
            return
        answer.limit = limit
        answer.end = answer.start + self._time_to_send(limit, answer.start)   # type: ignore[operator]
        # the events already handed out are the regenerated list's first ones: none lies past the cut
        answer.events = self._events(answer)

    def _events(self, answer: _Answer) -> list[LinkEvent]:
        """The receiver's events of a started answer, in time order."""
        owd, start, chunk = self.owd, answer.start, answer.chunk
        assert start is not None
        if answer.text:
            return [LinkEvent(answer.end + owd, chunk, TEXT_END, answer.limit)]
        bounds, first = self._bounds(answer), answer.first_layer
        whole = bounds[bounds <= answer.limit]
        times = start + self._vector.time_to_send(whole.astype(np.float64), np.full(whole.size, self.t0 + start))
        previous = np.concatenate(([0], whole[:-1]))
        events = [LinkEvent(start + owd, chunk, BEGIN, nbytes=answer.nbytes)]
        events += [LinkEvent(float(t) + owd, chunk, SECTION, int(b), first + i + 1, layer=first + i, nbytes=int(b - p))
                   for i, (t, b, p) in enumerate(zip(times, whole, previous))]
        # the trace's rate changes while it arrives: points of its arrival curve
        breaks = self.trace.times[(self.trace.times > self.t0 + start) & (self.trace.times < self.t0 + answer.end)]
        for moment in breaks:
            carried = self._carried(answer, float(moment) - self.t0)
            events.append(LinkEvent(float(moment) - self.t0 + owd, chunk, POINT, carried,
                                    first + int(np.searchsorted(bounds, carried, side="right"))))
        events.sort(key=lambda e: e.at)
        events.append(LinkEvent(answer.end + owd, chunk, END, answer.limit, first + len(whole),
                                cancelled=answer.limit < answer.nbytes))
        return events


@dataclass(frozen=True)
class RecordedAnswer:
    """One answer of a real fetch as it reached the receiver: what was asked, and its
    events (``LinkEvent``s, times on the fetch's clock: 0 at ``fetch()``)."""

    chunk: int
    choice: object
    events: Sequence[LinkEvent]
    first_layer: int = 0


class Diverged(Exception):
    """A replay asked for something the recorded fetch did not."""


class RecordedLink:
    """The answers of a recorded fetch, replayed in order (see the module docstring)."""

    def __init__(self, answers: Sequence[RecordedAnswer]) -> None:
        self._recorded = deque(answers)
        self._pending: deque[list[LinkEvent]] = deque()
        self._requests = 0

    def request(self, at: float, chunk: int, choice: object, nbytes: int, text: bool,
                first_layer: int = 0) -> None:
        self._requests += 1
        if not self._recorded:
            raise Diverged(f"request {self._requests} (chunk {chunk} as {choice!r}): the recorded fetch made fewer")
        answer = self._recorded.popleft()
        if (answer.chunk, answer.choice, answer.first_layer) != (chunk, choice, first_layer):
            raise Diverged(f"request {self._requests} asks for chunk {chunk} as {choice!r} from layer {first_layer}; "
                           f"the recorded fetch asked for chunk {answer.chunk} as {answer.choice!r} from layer "
                           f"{answer.first_layer}")
        self._pending.append([LinkEvent(**{**e.__dict__, "at": max(e.at, at)}) for e in answer.events])

    def cancel(self, at: float, chunk: int) -> None:
        """The recorded answers already end as the CANCEL made them."""

    def drop(self, at: float) -> None:
        self._pending.clear()

    def next_time(self) -> float:
        while self._pending and not self._pending[0]:
            self._pending.popleft()
        return self._pending[0][0].at if self._pending else math.inf

    def pop(self) -> LinkEvent:
        self.next_time()
        return self._pending[0].pop(0)

    def progress(self, at: float) -> tuple[int, int, int] | None:
        return None   # the recorded parts are the arrival curve

    def when(self, chunk: int, received: int) -> float:
        return math.inf   # every recorded part is an input already
