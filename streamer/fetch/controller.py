"""FetchController: every decision of one fetch, as a sans-I/O state machine.

A driver feeds it timestamped inputs (``streamer.fetch.events``: answers arriving, sections
decoded, layers delivered, timers) and carries out the actions it returns (request a
chunk at a level or as text, cancel one, reconnect, fail). It reads no clock and touches
no socket, thread, store or model, so ``StreamSession`` (sockets and decode threads) and
the simulator (a link model on a virtual clock) run the very same rule, and a recorded
input sequence replays to the same actions.

What it decides, and why:

* **What to request, and when.** Each chunk's choice is ``adapt.decide`` on what was
  observed (the policy plans the rest of the context against the deadline). The next
  request goes out once the bytes still due on those in flight would take about one
  request's answer time (round trip, or the first answer's latency if longer) plus a
  minimum sample: the link never idles and each decision sees the freshest measurement.
  At most ``MAX_QUEUED_AHEAD`` KV chunks wait behind the one arriving.
* **What the link carries.** Throughput is measured at the receiver over busy time only:
  a chunk's clock starts when its request could first have been answered (sent + one
  round trip) or the previous chunk ended, whichever is later, so neither idle time nor
  a burst of buffered bytes distorts it. Transfers under a minimum sample are pooled; the
  chunk in flight adds its recent half as a partial sample (``estimator``).
* **What the receiver costs.** Decoding is a pipeline stage: decisions are timed by the
  decoder's recent sections (``adapt.decoding``) and the decoding still owed; text by the
  caller's recompute rate, the slower of configured and observed (``adapt.recompute``).
  A prior for the decoder stands in only until this fetch decodes its first section, so a
  prior that is far off costs at most the chunks decided before that.
* **Giving a chunk up.** While a KV chunk arrives, the cancel rule (``adapt.cancel``) looks
  at it on arrivals (at most every ``MIN_LOOK_S``) and every ``RECONSIDER_S``. On a switch
  the chunk and every KV chunk queued behind it are cancelled and re-requested when their
  answers end (the abandoned one at the rule's choice, the others decided afresh); if the
  CANCEL is not answered in time the connection is dropped instead. A chunk some of whose
  layers went out can switch to text, or, on a connection that takes continuations
  (protocol version 2), have its other layers continue at a lower level.
* **Faults.** A corrupt section refetches its chunk (delivered layers are skipped), twice
  at most, then the chunk goes to text. A broken connection, or no data for
  ``stall_timeout`` while answers are due, reconnects (``max_reconnects`` per fetch) and
  re-requests what was in flight.

The delivery contract it keeps: a layer counts as delivered from the moment its
``on_layer`` is called, and each layer is delivered once. Once a chunk has delivered a
layer, what follows it is a continuation (the layers not delivered yet, at the same
level or a lower one: ``first_layer`` is the count delivered when the request goes out,
so no running ``on_layer`` loses its layer and none comes twice) or text, which
supersedes the chunk as a whole. Where the context's levels predict each layer from
the one before (``Manifest.restart``), a continuation asks from the layer coded alone
at or before that count (``Manifest.resume_layer``): the layers up to the count come
again, are decoded and not delivered, and their bytes count as the answer's. A
continued chunk's report lists its runs of layers and their levels
(``ChunkReport.layer_levels``).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from streamer.adapt import cancel, decoding, estimator
from streamer.adapt.base import TEXT, Abandon, Choice, Observation, Policy, probe_level
from streamer.adapt.decide import MAX_QUEUED_AHEAD, decide, plan_input, time_left
from streamer.adapt.decoding import DecodeCost
from streamer.adapt.estimator import MIN_SAMPLE_BYTES, LinkMemory
from streamer.adapt.policies import get_policy
from streamer.adapt.recompute import RecomputeCost, recompute_cost
from streamer.fetch import events as ev
from streamer.fetch.report import ChunkReport, FetchReport
from streamer.wire.manifest import Manifest

#: Refetches of one chunk after corrupt sections before giving up on it (it goes to text).
MAX_CORRUPT_RETRIES = 2
#: A request is due once the bytes still due exceed its lookahead by no more than this: the
#: estimate moves with every byte of the partial sample, so an exact threshold would be
#: chased a few bytes at a time by a driver that wakes at the watermark.
_REQUEST_SLACK_BYTES = 1024
#: Answers whose wait for their first byte the look-ahead covers (the slowest of them).
RECENT_RESPONSES = 8


@dataclass(frozen=True)
class FetchSettings:
    """What the controller needs of a session's configuration."""

    slo: float
    policy: str = "mpc"
    cancels: bool = True
    recompute_seconds_per_token: float = 1e-4
    #: recompute seconds per token for each token before it (``adapt.recompute``)
    recompute_context_seconds: float = 0.0
    #: the caller's recompute runs beside the decoder (``PlanInput.recompute_overlaps``)
    recompute_overlaps: bool = True
    stall_timeout: float = 2.0
    max_reconnects: int = 4
    #: chunks can be delivered as text (the consumer has ``on_text``, or consumes nothing)
    text_consumable: bool = True
    #: a chunk some layers of which went out may continue at a lower level, where the
    #: connection takes it (protocol version 2); False: only text can follow them
    continuations: bool = True


@dataclass(frozen=True)
class Beliefs:
    """What the receiver knows before the fetch: the link (a prior rate and its prediction
    errors, and samples already taken, e.g. the profile's download), the decoder and the
    caller's recomputes measured by earlier fetches, and a decode prior for when there
    are none."""

    prior_bps: float | None = None
    prior_errors: tuple[float, ...] = ()
    #: the prior is only a lower bound on the link (what the handshake's few round trips
    #: carried): it may pick a level, but it alone never sends the first chunk to text
    prior_is_lower_bound: bool = False
    history: tuple[Observation, ...] = ()
    decodes: tuple[tuple[int, int, float], ...] = ()
    #: (first token, tokens, seconds) of the caller's recent recomputes
    recomputes: tuple[tuple[int, int, float], ...] = ()
    decode_prior: DecodeCost | None = None


@dataclass(frozen=True)
class Decision:
    """The inputs one policy decision saw, and what it returned."""

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
class Switch:
    """One chunk the cancel rule abandoned: at which level, with how many of its layers
    delivered, and what it switched to."""

    chunk: int
    abandoned: Choice
    delivered_layers: int
    to: Choice


@dataclass
class _Chunk:
    """One chunk: its current answer, and what was delivered of it across answers."""

    index: int
    tokens: int
    choice: Choice | None = None
    requested_at: float = 0.0
    begin_at: float | None = None
    expected: int = 0
    first_layer: int = 0        # the current answer's first layer (a continuation's > 0)
    received: int = 0           # bytes of the current answer in whole parts
    partial: int = 0            # bytes of the frame still arriving
    sections: int = 0           # the next layer of the current answer to be cut (first_layer before any)
    corrupt_retries: int = 0
    refetch: bool = False       # re-request when the current answer ends
    cancelling: bool = False    # CANCEL sent; re-requested when its answer ends
    switch_to: Choice | None = None   # what to re-request a cancelled chunk at (None: decide afresh)
    #: seconds the receiver was held while this answer arrived: not the link's time (``_hold``)
    held_seconds: float = 0.0
    #: the cancel rule's looks at the current answer: (time, bytes), from its busy start
    marks: list[tuple[float, int]] = field(default_factory=list)
    #: (arrival time, bytes received) after each part: the partial sample's curve
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    report: ChunkReport | None = None
    delivered: int = 0          # layers whose on_layer was called
    done: bool = False
    recompute_began: float | None = None
    recompute_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def progress(self) -> int:
        """Bytes of the current answer in, the frame still arriving included."""
        return min(self.received + self.partial, self.expected)


class FetchController:
    """One fetch of ``manifest``'s chunks; see the module docstring."""

    def __init__(self, manifest: Manifest, settings: FetchSettings, *, context_id: str,
                 beliefs: Beliefs = Beliefs(),
                 policy: Policy | None = None, record: bool = False) -> None:
        """``policy`` overrides ``settings.policy``'s function (a replayed schedule);
        ``record`` keeps every input and action in :attr:`log`, in order."""
        self.manifest = manifest
        self.settings = settings
        self._policy = policy or get_policy(settings.policy)
        self.chunks = [_Chunk(i, c.tokens) for i, c in enumerate(manifest.chunks)]
        self.inflight: deque[int] = deque()
        self.next_chunk = 0
        self.history: list[Observation] = list(beliefs.history)
        self.prior = beliefs.prior_bps
        self.prior_errors = tuple(beliefs.prior_errors)
        self._prior_is_lower_bound = beliefs.prior_is_lower_bound
        self._past_decodes = list(beliefs.decodes)
        self._past_recomputes = list(beliefs.recomputes)
        self._configured_recompute = RecomputeCost(settings.recompute_seconds_per_token,
                                                   settings.recompute_context_seconds)
        self._decode_prior = beliefs.decode_prior
        #: (tokens, bytes, seconds) of each section this fetch decoded; (first token, tokens,
        #: seconds) of each recompute: what the next fetch of the session starts from
        self.decodes: list[tuple[int, int, float]] = []
        self.recomputes: list[tuple[int, int, float]] = []
        self._owed: dict[tuple[int, int], int] = {}   # sections in the decoder: bytes
        self.rtt = self.connect_seconds = 0.0
        self.connected, self.paused = False, False
        #: what holds the receiver now (reading paused; a recompute on the decoder's cores)
        #: and since when: time the link is not measured by (``_hold``)
        self._holds: set[object] = set()
        self._held_since = 0.0
        self.continuations = False   # the connection takes REQUESTs from a first layer
        self.pending_sample: Observation | None = None
        #: seconds from a request to its answer's first byte, of recent answers the link
        #: was idle for (``response_latency``)
        self._responses: deque[float] = deque(maxlen=RECENT_RESPONSES)
        self.last_end: float | None = None
        self.last_activity = 0.0
        self.start = self.deadline = 0.0
        self.escalate_at: float | None = None
        self.reconnects = self.cancels = 0
        self._aborting = False
        self._request_due: float | None = None
        self._watermark: tuple[int, int] | None = None
        self.delivered_at: float | None = None
        self.first_layer_at: float | None = None
        self.failure: ev.Fail | None = None
        self._actions: list[ev.Action] = []
        #: every policy decision, and every chunk the cancel rule abandoned, in order
        self.decisions: list[Decision] = []
        self.switches: list[Switch] = []
        #: with ``record``: every input and action, in order (a replayable trace of the fetch)
        self.log: list[ev.Event | ev.Action] | None = [] if record else None
        self.report = FetchReport(context_id, settings.slo, settings.policy)
        self._handlers: dict[type, Callable] = {
            ev.Started: self._started, ev.Tick: self._tick, ev.Activity: self._activity,
            ev.AnswerBegan: self._answer_began, ev.PartArrived: self._part_arrived,
            ev.AnswerEnded: self._answer_ended, ev.TextArrived: self._text_arrived,
            ev.SenderError: self._sender_error, ev.ConnectionBroken: self._broken,
            ev.Connected: self._connected, ev.ReadingPaused: self._paused, ev.ReadingResumed: self._resumed,
            ev.Corrupt: self._corrupt, ev.SectionHanded: self._handed, ev.SectionDecoded: self._decoded,
            ev.LayerDelivering: self._delivering, ev.RecomputeStarted: self._recompute_started,
            ev.RecomputeFinished: self._recompute_finished, ev.ChunkDone: self._chunk_done}

    # ------------------------------------------------------------------ interface
    def handle(self, event: ev.Event) -> None:
        """Take one input; its actions queue for :meth:`actions`."""
        if self.failure is not None:
            return
        if self.log is not None:
            self.log.append(event)
        if self._handlers[type(event)](event) and self.failure is None and self.connected:
            self._poll(event.at)

    def actions(self) -> list[ev.Action]:
        """The actions queued since the last call, in order."""
        out, self._actions = self._actions, []
        if self.log is not None:
            self.log.extend(out)
        return out

    def timer(self) -> float | None:
        """When the controller next needs a ``Tick`` even if nothing arrives (None: only on inputs)."""
        if self.failure is not None or not self.connected:
            return None
        due = [t for t in (self._stall_due(), self.escalate_at, self._look_due(), self._request_due)
               if t is not None]
        return min(due) if due else None

    def watermark(self) -> tuple[int, int] | None:
        """(chunk, bytes): the controller wants an input once the answer arriving for
        ``chunk`` has that many bytes in (the next request is due then). A driver that
        reports every part may ignore it; one that models a continuous link (the
        simulator) wakes it there."""
        return None if self.failure is not None or not self.connected else self._watermark

    @property
    def done(self) -> bool:
        """Every chunk delivered (KV) or recomputed (text), and no answer still arriving."""
        return self.delivered_at is not None and not self.inflight

    def delivered_layers(self, chunk: int) -> int:
        return self.chunks[chunk].delivered

    def chunk_report(self, chunk: int) -> ChunkReport:
        report = self.chunks[chunk].report
        assert report is not None, f"chunk {chunk} was never requested"
        return report

    def finish(self, at: float) -> FetchReport:
        """The report as of ``at`` (the fetch's end, or its failure)."""
        report = self.report
        # the fetch is over when its last chunk is delivered, not when the last answer's end came
        report.total_seconds = (self.delivered_at if self.delivered_at is not None else at) - self.start
        report.first_layer_seconds = None if self.first_layer_at is None else self.first_layer_at - self.start
        report.reconnects, report.cancels = self.reconnects, self.cancels
        cost = self._recompute_cost()
        report.recompute_seconds_per_token = cost.per_token
        report.recompute_context_seconds = cost.per_context_token
        report.chunks = [c.report for c in self.chunks if c.report is not None]
        for chunk in self.chunks:
            if chunk.report is not None:
                chunk.report.decode_seconds = chunk.decode_seconds
                chunk.report.recompute_seconds = chunk.recompute_seconds
                chunk.report.superseded_layers = chunk.delivered if chunk.choice == TEXT else 0
        return report

    def memory(self) -> LinkMemory | None:
        """What this fetch leaves the next one to the same sender (``estimator.remember``)."""
        return estimator.remember(self.history, self.prior_errors)

    # ------------------------------------------------------------------ network inputs
    def _started(self, event: ev.Started) -> bool:
        self.rtt, self.connect_seconds, self.connected = event.rtt, event.connect_seconds, True
        self.continuations = self.settings.continuations and event.continuations
        self.start = self.last_activity = event.at
        self.deadline = event.at + self.settings.slo
        return True

    def _tick(self, event: ev.Tick) -> bool:
        if self._stall_due() is not None and event.at >= self._stall_due():   # type: ignore[operator]
            self._reconnect(f"no data for {self.settings.stall_timeout:g} s")
            return False
        return True

    def _activity(self, event: ev.Activity) -> bool:
        self.last_activity = event.at
        if self.inflight:
            self.chunks[self.inflight[0]].partial = event.partial
        return False

    def _answer_began(self, event: ev.AnswerBegan) -> bool:
        chunk = self.chunks[event.chunk]
        self.last_activity = chunk.begin_at = event.at
        link_was_idle = self.last_end is None or event.at > self.last_end
        if link_was_idle and chunk.corrupt_retries == 0 and not chunk.held_seconds:
            self._responses.append(event.at - chunk.requested_at)
        if chunk.first_layer:
            # a continuation's size was an estimate: the sender's count stands, up to the blob's
            whole = self.manifest.chunks[event.chunk].sizes[chunk.choice]   # type: ignore[index]
            if not 0 < event.total_bytes <= whole:
                self._reconnect(f"chunk {event.chunk} from layer {chunk.first_layer} is {event.total_bytes} "
                                f"bytes, the whole blob {whole}")
                return False
            chunk.expected = event.total_bytes
        elif event.total_bytes != chunk.expected:
            self._reconnect(f"chunk {event.chunk} is {event.total_bytes} bytes, the manifest says {chunk.expected}")
            return False
        return True

    def _part_arrived(self, event: ev.PartArrived) -> bool:
        chunk = self.chunks[event.chunk]
        self.last_activity = event.at
        self._count_bytes(chunk, event.received - chunk.received)
        chunk.received, chunk.partial, chunk.sections = event.received, 0, event.sections
        chunk.arrivals.append((event.at, event.received))
        return True

    def _count_bytes(self, chunk: _Chunk, nbytes: int) -> None:
        """Every byte that arrives counts in the report, whatever becomes of its answer."""
        assert chunk.report is not None
        chunk.report.bytes += nbytes

    def _text_arrived(self, event: ev.TextArrived) -> bool:
        chunk = self.chunks[event.chunk]
        self.last_activity = event.at
        chunk.begin_at = chunk.begin_at or event.at
        self._count_bytes(chunk, event.nbytes)
        chunk.received = event.nbytes
        self._answer_ended(ev.AnswerEnded(event.chunk, False, event.at))
        return True

    def _answer_ended(self, event: ev.AnswerEnded) -> bool:
        chunk, at = self.chunks[event.chunk], event.at
        self.last_activity = at
        if event.chunk in self.inflight:
            self.inflight.remove(event.chunk)
        # a cancelled answer that had every layer in is whole: the switch is moot
        if event.cancelled and not (chunk.choice != TEXT and chunk.sections >= self.manifest.layers):
            self._cancelled(chunk, at)
        else:
            # a CANCEL that crossed the end on the wire is moot: the chunk is whole
            chunk.cancelling, chunk.switch_to = False, None
            self._measure_end(chunk, at)
            self._actions.append(ev.ChunkFinished(chunk.index))
            if chunk.refetch:
                self._send_request(chunk, chunk.choice, at)   # type: ignore[arg-type]
            elif chunk.choice != TEXT and chunk.sections < self.manifest.layers:
                self._corrupt(ev.Corrupt(chunk.index, chunk.sections,
                                         f"chunk {chunk.index} ended before all its layers", at))
        if not any(self.chunks[i].cancelling for i in self.inflight):
            self.escalate_at = None
        return True

    def _measure_end(self, chunk: _Chunk, at: float) -> None:
        """A whole answer: its busy time as a throughput sample, and its report."""
        report = chunk.report
        assert report is not None
        busy = max(at - self._busy_start(chunk), 0.0)
        self.last_end = at
        report.seconds = at - chunk.requested_at
        report.finished_at = at - self.start
        report.busy_seconds = busy
        report.throughput_bps = 8 * chunk.received / busy if busy > 0 else 0.0
        if chunk.choice != TEXT:   # a few kB of token ids measure the round trip, not the link
            sample, self.pending_sample = estimator.pool_sample(self.pending_sample, chunk.received, busy)
            if sample is not None:
                self.history.append(sample)

    def _cancelled(self, chunk: _Chunk, at: float) -> None:
        """A CANCEL took effect: re-request the chunk as the cancel rule chose, or decided
        afresh for a chunk cancelled only because it was queued behind."""
        report = chunk.report
        assert report is not None
        if chunk.begin_at is not None:
            self.last_end = at
        if chunk.switch_to is not None:
            choice = self._apply_switch(chunk)
        else:
            abandoned = chunk.choice
            choice, reason = self._decide_now(chunk.index, at)
            report.level = choice
            report.reason = reason or f"cancelled at level {abandoned}: re-decided behind a cancelled chunk"
            report.cancelled_levels.append(abandoned)  # type: ignore[arg-type]
        self._send_request(chunk, choice, at)

    def _apply_switch(self, chunk: _Chunk) -> Choice:
        """The cancel rule's choice for an abandoned chunk, recorded in its report: if a
        layer went out meanwhile, another level continues past it, or, on a connection
        that takes no continuations, text replaces it (the delivery contract)."""
        report, abandoned, choice = chunk.report, chunk.choice, chunk.switch_to
        assert report is not None and choice is not None
        if choice != TEXT and chunk.delivered and not self.continuations:
            choice = TEXT
        report.level = choice
        report.reason = (f"continued at level {choice} from layer {chunk.delivered}: level {abandoned} was "
                         "predicted to miss the deadline" if choice != TEXT and chunk.delivered
                         else f"cancelled at level {abandoned}: predicted to miss the deadline")
        report.cancelled_levels.append(abandoned)  # type: ignore[arg-type]
        return choice

    def _sender_error(self, event: ev.SenderError) -> bool:
        """A non-fatal ERROR answers the oldest outstanding request: a KV chunk nothing of
        which went out falls back to text; anything else fails the fetch."""
        self.last_activity = event.at
        if not self.inflight:
            self._fail(ev.SERVER_ERROR, f"{event.code}: {event.message}", event.code)
            return False
        chunk = self.chunks[self.inflight.popleft()]
        if chunk.choice != TEXT and chunk.delivered == 0:
            assert chunk.report is not None
            chunk.report.reason = f"sender: {event.code}: {event.message}"
            chunk.report.level = TEXT
            self._send_request(chunk, TEXT, event.at)
            return True
        self._fail(ev.SERVER_ERROR, f"{event.code}: chunk {chunk.index}: {event.message}", event.code)
        return False

    def _broken(self, event: ev.ConnectionBroken) -> bool:
        self._reconnect(event.reason)
        return False

    def _connected(self, event: ev.Connected) -> bool:
        """A new connection: re-request what was in flight (a chunk nothing of which went
        out is decided afresh; an abandoned one goes out at the cancel rule's choice)."""
        at, abort = event.at, self._aborting
        self.rtt, self.connect_seconds = event.rtt, event.connect_seconds
        self.continuations = self.settings.continuations and event.continuations
        self._release("paused", at)
        self.connected, self.paused, self._aborting = True, False, False
        self.last_activity, self.last_end, self.escalate_at = at, None, None
        pending = [i for i in sorted(self.inflight) if not self.chunks[i].done]   # a delivered chunk's end is moot
        self.inflight.clear()
        for index in pending:
            chunk = self.chunks[index]
            report = chunk.report
            assert report is not None
            if chunk.switch_to is not None:
                chunk.choice = self._apply_switch(chunk)
            elif chunk.delivered == 0 and chunk.choice != TEXT:
                chunk.choice, report.reason = self._decide_now(index, at)
                report.level = chunk.choice
            if not abort:
                report.retries += 1
            self._send_request(chunk, chunk.choice, at)   # type: ignore[arg-type]
            if self.failure is not None:
                break
        return True

    def _paused(self, event: ev.ReadingPaused) -> bool:
        self.paused = True
        self._hold("paused", event.at)
        return False

    def _resumed(self, event: ev.ReadingResumed) -> bool:
        self._release("paused", event.at)
        self.paused, self.last_activity = False, event.at   # the stall timer restarts
        return True

    def _hold(self, what: object, at: float) -> None:
        """The receiver is held by ``what`` from ``at``: reading paused (its decoded backlog
        over budget, e.g. behind a text chunk's recompute in ordered delivery), or, where
        recompute shares the decoder's cores (``recompute_overlaps=False``), a recompute
        running. Bytes arriving meanwhile measure the receiver, not the link: a 2 MB chunk
        read across a 1 s pause looks like 16 Mbit/s on a 1 Gbit/s link, the cancel rule
        gives it up for text (more recompute), and the next fetch starts from that rate."""
        if not self._holds:
            self._held_since = at
        self._holds.add(what)

    def _release(self, what: object, at: float) -> None:
        """``what`` no longer holds the receiver; when nothing does, the held time is taken
        out of the link's measure (``_skip_held``)."""
        if what not in self._holds:
            return
        self._holds.discard(what)
        if not self._holds:
            self._skip_held(self._held_since, at)

    def _skip_held(self, began: float, ended: float) -> None:
        """Take the held time out of each answer arriving: its busy start, and its looks and
        arrivals, move forward by the part of the hold after its busy start (all of it for
        an answer that was arriving, the rest for one that began meanwhile), so its rate is
        what the link did while the receiver was free to read it."""
        for index in self.inflight:
            chunk = self.chunks[index]
            if chunk.begin_at is None or chunk.choice == TEXT:
                continue
            since = max(began, self._busy_start(chunk))
            shift = ended - since
            if shift <= 0:
                continue
            chunk.held_seconds += shift

            def moved(points: list[tuple[float, int]]) -> list[tuple[float, int]]:
                return [(at + shift if at <= since else max(at, ended), n) for at, n in points]

            chunk.marks, chunk.arrivals = moved(chunk.marks), moved(chunk.arrivals)

    # ------------------------------------------------------------------ delivery inputs
    def _corrupt(self, event: ev.Corrupt) -> bool:
        """Refetch the chunk once its current answer ends (its delivered layers are skipped);
        after ``MAX_CORRUPT_RETRIES`` refetches it goes to text, superseding what went out."""
        chunk = self.chunks[event.chunk]
        if chunk.refetch:
            return False   # one refetch per answer, however many of its sections are bad
        chunk.corrupt_retries += 1
        report = chunk.report
        assert report is not None
        if chunk.corrupt_retries > MAX_CORRUPT_RETRIES:
            if chunk.choice == TEXT:
                self._actions.append(ev.FailChunk(chunk.index, f"chunk {chunk.index} stays corrupt: {event.message}"))
                return False
            report.reason, report.level, chunk.choice = f"corrupt data: {event.message}", TEXT, TEXT
        report.retries += 1
        chunk.refetch = True
        if chunk.index not in self.inflight and self.connected:
            self._send_request(chunk, chunk.choice, event.at)   # type: ignore[arg-type]
        return False

    def _copied(self, chunk: _Chunk) -> bool:
        """Whether the chunk comes at the exact level: its sections are raw, copied rather
        than decoded, so they owe the decoder nothing and say nothing of its rate."""
        return chunk.choice != TEXT and self.manifest.is_exact(chunk.choice)   # type: ignore[arg-type]

    def _handed(self, event: ev.SectionHanded) -> bool:
        if not self._copied(self.chunks[event.chunk]):
            self._owed[(event.chunk, event.layer)] = event.nbytes
        return False

    def _decoded(self, event: ev.SectionDecoded) -> bool:
        self._owed.pop((event.chunk, event.layer), None)
        if event.seconds is not None:
            chunk = self.chunks[event.chunk]
            chunk.decode_seconds += event.seconds
            if not self._copied(chunk):
                self.decodes.append((chunk.tokens, event.nbytes, event.seconds))
        return False

    def _delivering(self, event: ev.LayerDelivering) -> bool:
        chunk = self.chunks[event.chunk]
        chunk.delivered = max(chunk.delivered, event.layer + 1)
        if self.first_layer_at is None:
            self.first_layer_at = event.at
        return False

    def _recompute_started(self, event: ev.RecomputeStarted) -> bool:
        self.chunks[event.chunk].recompute_began = event.at
        if not self.settings.recompute_overlaps:
            self._hold(("recompute", event.chunk), event.at)
        return False

    def _recompute_finished(self, event: ev.RecomputeFinished) -> bool:
        self._release(("recompute", event.chunk), event.at)
        self.chunks[event.chunk].recompute_seconds = event.seconds
        self.recomputes.append((self.manifest.chunks[event.chunk].start, event.tokens, event.seconds))
        return False

    def _chunk_done(self, event: ev.ChunkDone) -> bool:
        self.chunks[event.chunk].done = True
        if all(chunk.done for chunk in self.chunks):
            self.delivered_at = event.at
        return False

    # ------------------------------------------------------------------ after each input
    def _poll(self, now: float) -> None:
        """The cancel rule on the chunk in flight, then any request now due."""
        self._look(now)
        if self.failure is None and self.connected:
            self._request_ahead(now)

    def _reconnect(self, reason: str, abort: bool = False) -> None:
        if self.delivered_at is not None:
            self.inflight.clear()   # everything is delivered: the answers' ends are moot
            return
        if not abort:
            self.reconnects += 1
            if self.reconnects > self.settings.max_reconnects:
                self._fail(ev.GAVE_UP, f"giving up after {self.reconnects - 1} reconnects: {reason}")
                return
        self.connected, self._aborting, self._request_due, self._watermark = False, abort, None, None
        for index in self.inflight:   # the old answers are gone with the connection
            self.chunks[index].partial = 0
        self._actions.append(ev.Reconnect(reason, abort))

    def _fail(self, kind: str, message: str, code: str | None = None) -> None:
        self.failure = ev.Fail(kind, message, code)
        self._actions.append(self.failure)

    # ------------------------------------------------------------------ timers
    def _stall_due(self) -> float | None:
        if not self.inflight or self.paused:
            return None   # nothing due, or the silence is ours
        return self.last_activity + self.settings.stall_timeout

    def _look_due(self) -> float | None:
        head = self._head_in_progress()
        if not self.settings.cancels or head is None or head.cancelling or self.escalate_at is not None \
                or self._holds:   # the receiver is held: nothing to judge the link by
            return None
        return head.marks[-1][0] + cancel.RECONSIDER_S if head.marks else head.begin_at

    # ------------------------------------------------------------------ beliefs
    def _busy_start(self, chunk: _Chunk) -> float:
        """When the link started carrying ``chunk``: not before its request could have been
        answered (request + one round trip), nor before the previous chunk finished. Not
        the first byte's arrival: bytes queued in socket and shaper buffers arrive in one
        burst, which would make a small chunk look arbitrarily fast. Later by the time
        the receiver was held while it arrived (``_hold``)."""
        return max(chunk.requested_at + self.rtt, self.last_end or 0.0) + chunk.held_seconds

    @property
    def response_latency(self) -> float:
        """How long a request waits for its answer's first byte with nothing queued before
        it (the round trip and the sender's time to read the store and start): the slowest
        of the recent answers the link was idle for, which alone show it. The next request
        goes out that long before the bytes still due run out (``_request_ahead``); asked
        later, the link idles between answers, and the cancel rule reads the idle time as
        a slow link. It moves with the sender's load, so the recent answers, not the first."""
        return max(self._responses, default=0.0)

    def _head_in_progress(self) -> _Chunk | None:
        """The chunk whose answer is arriving now, if it is a level (not text)."""
        if not self.inflight:
            return None
        head = self.chunks[self.inflight[0]]
        return head if head.begin_at is not None and head.choice != TEXT else None

    def _estimate(self, now: float) -> tuple[list[Observation], float | None]:
        """History plus the chunk in flight as a partial sample (its recent half, by its
        parts' arrival times), and the robust estimate."""
        history = list(self.history)
        head = self._head_in_progress()
        if head is not None:
            start, received = self._busy_start(head), head.progress
            curve = [(start, 0.0), *((at, count) for at, count in head.arrivals if at > start), (now, received)]
            partial = estimator.in_flight_sample(start, now, received, lambda t: estimator.arrived_by(curve, t))
            if partial is not None:
                history.append(partial)
        return history, estimator.robust_estimate(history, prior=self.prior, prior_errors=self.prior_errors)

    def _decode_cost(self) -> DecodeCost | None:
        """The decoder's cost over its recent sections (earlier fetches' and this one's);
        the prior only while there are none."""
        measured = [*self._past_decodes, *self.decodes[-decoding.RECENT_SECTIONS:]]
        if measured:
            return decoding.measure(measured)
        if self._decode_prior is None:
            return None
        return decoding.measure(decoding.prior_sections(self._decode_prior, self.chunks[0].tokens,
                                                        self.manifest.layers))

    def _decoder_owed(self, cost: DecodeCost) -> float:
        """Seconds the decoder needs for the sections handed to it and not finished."""
        return sum(cost.seconds(self.chunks[chunk].tokens, size) for (chunk, _), size in self._owed.items())

    def _unarrived_decode(self, chunk: _Chunk, cost: DecodeCost) -> float:
        """Seconds the sections of a requested KV chunk not handed to the decoder yet will take."""
        if chunk.choice == TEXT or self._copied(chunk):
            return 0.0
        unarrived = max(chunk.expected - chunk.received, 0)
        return cost.seconds(chunk.tokens * (self.manifest.layers - chunk.sections), unarrived)

    def _decode_owed(self, cost: DecodeCost) -> float:
        """Seconds of decoding still owed for every chunk requested: the sections in the
        decoder, and those of the chunks in flight still to arrive."""
        return self._decoder_owed(cost) + sum(self._unarrived_decode(self.chunks[i], cost) for i in self.inflight)

    def _recompute_cost(self) -> RecomputeCost:
        return recompute_cost(self._configured_recompute, [*self._past_recomputes, *self.recomputes])

    def _pending_recompute(self, now: float) -> float:
        """Seconds the caller will still spend recomputing chunks already sent as text: each
        not yet done, less what the one being recomputed has had. It overlaps the transfers
        (``adapt.overlap``), and says by when a chunk in flight can still be given up for
        text at no cost (``adapt.cancel``)."""
        cost, owed = self._recompute_cost(), 0.0
        for chunk in self.chunks:
            if chunk.choice == TEXT and not chunk.done:
                whole = cost.seconds(self.manifest.chunks[chunk.index].start, chunk.tokens)
                began = chunk.recompute_began
                owed += whole if began is None else max(whole - (now - began), 0.0)
        return owed

    def _outstanding_bytes(self) -> int:
        return sum(max(self.chunks[i].expected - self.chunks[i].progress, 0) for i in self.inflight)

    # ------------------------------------------------------------------ deciding
    def _decide(self, index: int, now: float) -> tuple[Choice, str | None, float, float | None]:
        """The policy's choice for chunk ``index`` (and the rule's reason, if any), with the
        time left and the estimate it saw.

        A prior alone never sends the fetch's first KV-capable chunk to text: text measures
        neither the decoder nor the link, so a prior that is far too slow would plan every
        chunk as text for good. Until a section has been decoded, the first chunk the plan
        would fetch without the decode prior goes out at that level and times the decoder;
        while the link's only measure is the handshake's lower bound, the first chunk goes
        out at its smallest level and measures it. Either way the cancel rule gives the
        chunk up if it proves as slow as the prior said."""
        history, estimate = self._estimate(now)
        until_deadline = self.deadline - now
        left = time_left(until_deadline, self._outstanding_bytes(), estimate, self.rtt)
        cost = self._decode_cost()
        recompute_busy = self._pending_recompute(now)

        def choose(cost: DecodeCost | None) -> tuple[Choice, str | None]:
            # the decoding owed for what was requested, beyond the wait for its bytes (off ``left``)
            decode_busy = 0.0 if cost is None else max(0.0, self._decode_owed(cost) - (until_deadline - left))
            return decide(self._policy, self.manifest, index, time_left=left, history=history,
                          prior_bps=self.prior, prior_errors=self.prior_errors,
                          abandon=Abandon(self.rtt, self.connect_seconds) if self.settings.cancels else None,
                          recompute_busy=recompute_busy, recompute=self._recompute_cost(),
                          until_deadline=until_deadline, decode_cost=cost, decode_busy=decode_busy,
                          previous=self.chunks[index - 1].choice if index else None,
                          recompute_overlaps=self.settings.recompute_overlaps)

        choice, reason = choose(cost)
        if choice == TEXT and reason is None and self._decoder_untimed():
            probe, _ = choose(None)
            if probe != TEXT:
                choice, reason = probe, "the decoder is not timed yet: this chunk times it (its prior alone said text)"
        if choice == TEXT and reason is None and self._link_unmeasured():
            choice = probe_level(plan_input(self.manifest, index, time_left=left, history=[], prior_bps=None,
                                            recompute=self._recompute_cost(),
                                            recompute_overlaps=self.settings.recompute_overlaps))
            reason = "the link is not measured yet: this chunk measures it (the handshake's lower bound said text)"
        self.decisions.append(Decision(index, now, left, tuple(history), self.prior, estimate, choice, reason,
                                       recompute_busy))
        return choice, reason, left, estimate

    def _sample_pending(self, history: list[Observation]) -> bool:
        """No sample of the link yet, no prior worth planning on, and a KV answer on its way
        that will make one. Text requests are tiny and go out at once, so deciding ahead on
        nothing would send every chunk left to text before the first sample lands."""
        return (not history and (self.prior is None or self._prior_is_lower_bound)
                and any(self.chunks[i].choice != TEXT for i in self.inflight))

    def _link_unmeasured(self) -> bool:
        """The link's only measure is a lower bound, and no KV chunk requested yet will measure
        it (a probe needs the cancel rule, which gives it up if the link is that slow)."""
        return (self.settings.cancels and self._prior_is_lower_bound and not self.history
                and all(chunk.choice in (None, TEXT) for chunk in self.chunks))

    def _decoder_untimed(self) -> bool:
        """Only a prior says what the decoder costs, and no KV chunk requested yet will time
        it (a probe needs the cancel rule, which weighs the decode it proves to take)."""
        return (self.settings.cancels and self._decode_prior is not None and not self._past_decodes
                and not self.decodes and all(chunk.choice in (None, TEXT) for chunk in self.chunks))

    def _decide_now(self, index: int, now: float) -> tuple[Choice, str | None]:
        choice, reason, _, _ = self._decide(index, now)
        return choice, reason

    def _request_ahead(self, now: float) -> None:
        """Request the next chunks once the bytes still due would take about one request's
        answer time; else say when that is expected (a timer)."""
        self._request_due = self._watermark = None
        if any(self.chunks[i].cancelling for i in self.inflight):
            return   # re-requests of cancelled chunks go first, so they keep their order
        while self.next_chunk < len(self.chunks) and self.failure is None:
            if self.inflight:
                if sum(self.chunks[i].choice != TEXT for i in self.inflight) > MAX_QUEUED_AHEAD:
                    return
                history, estimate = self._estimate(now)
                if self._sample_pending(history):
                    return   # the answer arriving is about to measure the link: decide with that
                lookahead = (estimate or 0.0) * max(self.rtt, self.response_latency) + MIN_SAMPLE_BYTES
                excess = self._outstanding_bytes() - lookahead
                if excess > _REQUEST_SLACK_BYTES:
                    if estimate:   # at least 1 ms on: a stalled link must not spin the driver
                        self._request_due = now + max(excess / estimate, 1e-3)
                    head = self.chunks[self.inflight[0]]
                    if head.progress + excess < head.expected:
                        self._watermark = (head.index, head.progress + int(math.ceil(excess)))
                    return
            index = self.next_chunk
            choice, reason, left, estimate = self._decide(index, now)
            chunk = self.chunks[index]
            chunk.report = ChunkReport(index=index, level=choice, time_left=left, reason=reason,
                                       estimate_bps=None if estimate is None else 8 * estimate)
            self.next_chunk += 1
            self._send_request(chunk, choice, now)

    def _send_request(self, chunk: _Chunk, choice: Choice, now: float) -> None:
        if choice == TEXT and not self.settings.text_consumable:
            report = chunk.report
            assert report is not None   # made when the chunk was first decided
            cause = report.reason or (f"the {self.settings.policy} policy chose it with "
                                      f"{report.time_left:.3g} s left before the deadline")
            self._fail(ev.TEXT_NOT_CONSUMED,
                       f"chunk {chunk.index} has to come as text ({cause}) but the session has no on_text "
                       "callback to recompute it from its token ids: pass on_text (e.g. "
                       "streamer.model.CacheAssembler's), or an slo the link can meet")
            return
        info, layers = self.manifest.chunks[chunk.index], self.manifest.layers
        # the layers delivered stay; a predicted level's answer starts at the layer coded alone before them
        delivers_from = chunk.delivered if choice != TEXT and self.continuations and chunk.delivered < layers else 0
        first = 0 if choice == TEXT else self.manifest.resume_layer(choice, delivers_from)   # type: ignore[arg-type]
        chunk.choice, chunk.requested_at, chunk.begin_at, chunk.first_layer = choice, now, None, first
        report = chunk.report
        assert report is not None   # made when the chunk was first decided
        if choice == TEXT:   # final: text supersedes whatever layers went out
            chunk.expected, report.layer_levels = info.text_bytes, []
        else:
            chunk.expected = self.manifest.answer_bytes(chunk.index, choice, first)  # type: ignore[arg-type]
            runs = [run for run in report.layer_levels if run[0] < delivers_from]
            report.layer_levels = runs if runs and runs[-1][1] == choice else [*runs, (delivers_from, choice)]
        chunk.received = chunk.partial = 0
        chunk.sections = first
        chunk.marks, chunk.arrivals, chunk.held_seconds = [], [], 0.0
        chunk.refetch = chunk.cancelling = False
        chunk.switch_to = None
        if not self.inflight:
            self.last_activity = now   # the stall timer runs from the request
        self.inflight.append(chunk.index)
        self._actions.append(ev.SendRequest(chunk.index, choice, first))

    # ------------------------------------------------------------------ the cancel rule
    def _look(self, now: float) -> None:
        """``adapt.cancel`` on the chunk in flight: when finishing it would sink the
        deadline, CANCEL it and every KV chunk requested behind it, or drop the connection
        when what it has queued would take longer to arrive than a new one takes to open."""
        if not self.settings.cancels:
            return
        if self.escalate_at is not None:
            if now >= self.escalate_at:
                self.escalate_at = None
                self._reconnect("cancel: the abandoned chunk's queued bytes are not draining", abort=True)
            return
        head = self._head_in_progress()
        if head is None or head.cancelling or self._holds \
                or head.marks and now - head.marks[-1][0] < cancel.MIN_LOOK_S:
            return   # (while the receiver is held its arrivals do not measure the link)
        if not head.marks:
            head.marks.append((self._busy_start(head), 0))
        head.marks.append((now, head.progress))
        judged = self._judge(head, now)
        if judged is None:
            return
        switch, sample = judged
        self.cancels += 1
        self.switches.append(Switch(head.index, head.choice, head.delivered, switch.choice))  # type: ignore[arg-type]
        head.switch_to = switch.choice
        # what the rule judged the abandoned transfer by is the freshest sample of the link
        self.history.append(sample)
        if switch.abort:
            self._reconnect("cancel: dropping the queued rest of a chunk", abort=True)
            return
        for index in self.inflight:
            chunk = self.chunks[index]
            if chunk.choice != TEXT and not chunk.cancelling:
                chunk.cancelling = True
                self._actions.append(ev.SendCancel(index))
        self.escalate_at = now + switch.escalate_after

    def _judge(self, head: _Chunk, now: float) -> tuple[cancel.Switch, Observation] | None:
        """The cancel rule's switch for ``head`` as its looks show it, with the sample it
        judged by; None to keep it."""
        _, estimate = self._estimate(now)
        sample = cancel.chunk_rate(head.marks, estimate, began=head.begin_at)
        if sample is None:
            return None
        cost = self._decode_cost()
        plan = plan_input(self.manifest, head.index, time_left=self.deadline - now, history=[],
                          prior_bps=None, prior_errors=(), recompute_busy=self._pending_recompute(now),
                          recompute=self._recompute_cost(), decode_cost=cost,
                          decode_busy=0.0 if cost is None else self._decoder_owed(cost),
                          recompute_overlaps=self.settings.recompute_overlaps)
        in_flight = cancel.InFlight(level=head.choice,  # type: ignore[arg-type]
                                    remaining_bytes=head.expected - head.progress,
                                    delivered_layers=head.delivered, layers=self.manifest.layers,
                                    continuable=self.continuations, restart=self.manifest.restart,
                                    remaining_decode_seconds=0.0 if cost is None
                                    else self._unarrived_decode(head, cost))
        switch = cancel.reconsider(plan, in_flight, rate=sample.bytes / sample.busy_seconds, rtt=self.rtt,
                                   reconnect_seconds=self.connect_seconds,
                                   shortfall=estimator.shortfall(self.history, self.prior_errors))
        return None if switch is None else (switch, sample)


__all__: Sequence[str] = ["Beliefs", "Decision", "FetchController", "FetchSettings", "MAX_CORRUPT_RETRIES", "Switch"]
