"""The simulator: ``FetchController`` driven on a virtual clock by a link and a receiver model.

``StreamSession`` drives the controller with sockets and decode threads; this driver
drives the same controller with models of them, so ``kvwire bench policies`` measures the
rule that ships, over whole trace sets in seconds:

* **Link** (``streamer.fetch.links``): a sender answering in order over a path whose
  capacity follows a bandwidth trace (or, for validation, a real fetch's recorded arrival
  timeline). CANCEL and dropped connections act on it as on the real sender.
* **Receiver**: the session's decoder and consumer. Each section goes to one decoder as
  its last byte lands and decodes in turn (``decode_seconds`` of its chunk over the
  layers); layers are delivered in order as they decode; a text chunk is recomputed once
  its token ids are in and the chunk before it is delivered, while later chunks keep
  arriving and decoding. A new connection takes ``reconnect_seconds``.
* **Clock**: the next link event, the next decoder or recompute completion, the next
  connection, or the controller's own timer, whichever is first. Before a timer fires the
  chunk arriving reports its bytes so far (the session's parts do the same as they land),
  so the controller's estimates and stall timer see the link as it is.

A fetch meets its SLO when its last chunk is delivered by ``slo``. A fetch the controller
gives up on (reconnects exhausted on a dead link) never completes: its chunks not
delivered count as text in the objective.
"""
from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from netsim.trace import Trace
from streamer.adapt.base import TEXT, Abandon, Choice, Observation, PlanInput, Policy
from streamer.adapt.cancel import cancels_by_default
from streamer.adapt.decide import DEFAULT_RECOMPUTE_SECONDS_PER_TOKEN, decide
from streamer.adapt.decoding import DecodeCost
from streamer.adapt.policies import get_policy
from streamer.adapt.recompute import RecomputeCost
from streamer.fetch import events as ev
from streamer.fetch.controller import Beliefs, Decision, FetchController, FetchSettings, Switch
from streamer.fetch.links import (BEGIN, END, PARTIAL, POINT, SECTION, TEXT_END, Link, LinkEvent, TraceLink,
                                  VectorLink)
from streamer.fetch.oracle import EPS, TEXT_PENALTY, OracleResult, solve
from streamer.wire.manifest import Manifest

#: Bound on simulation steps per chunk: a safety net against a bug, not a schedule.
_MAX_STEPS_PER_CHUNK = 50_000

#: (first layer, level) of each run of a chunk's layers delivered at one level (``ChunkReport.layer_levels``)
LayerLevels = Sequence[tuple[int, int]]
#: (chunk, layer, coded bytes) -> decoder seconds; (chunk, tokens) -> recompute seconds
DecodeTime = Callable[[int, int, int], float]
#: (chunk, layer, when the section reached the decoder) -> when the decoder is done with it
DecodeDone = Callable[[int, int, float], float]
RecomputeTime = Callable[[int, int], float]


@dataclass(frozen=True)
class ChunkTiming:
    """One simulated chunk: receiver-clock times (0 = fetch start), bytes, choice."""

    index: int
    choice: Choice
    bytes: int
    requested: float
    begin: float          # first byte at the receiver
    end: float            # last byte at the receiver
    done: float           # decoded and delivered (ordered), or recomputed
    busy: float           # receiver-measured busy seconds


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
    #: the actions the controller took, in order (the equivalence tests compare them)
    actions: list[ev.Action] = field(default_factory=list)
    #: why the controller gave up, if it did (the fetch never completed)
    failure: str | None = None
    #: per chunk, its runs of layers at one level (``ChunkReport.layer_levels``; () for text)
    layer_levels: list[tuple[tuple[int, int], ...]] = field(default_factory=list)

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


class _Receiver:
    """The session's decoder (one worker, sections in the order they land; or, replaying a
    recorded fetch, each section done when the recording says: ``decode_done``) and its
    ordered consumer (``net.delivery.OrderedDelivery``), on the virtual clock."""

    def __init__(self, manifest: Manifest, decode_time: DecodeTime, recompute_time: RecomputeTime,
                 decode_done: DecodeDone | None = None) -> None:
        n = len(manifest.chunks)
        self.manifest = manifest
        self.layers, self.tokens = manifest.layers, [c.tokens for c in manifest.chunks]
        self.decode_time, self.recompute_time, self.decode_done = decode_time, recompute_time, decode_done
        self.choice: list[Choice | None] = [None] * n
        self.decoded: list[set[int]] = [set() for _ in range(n)]
        self.delivered = [0] * n
        self.text_in = [False] * n
        self.done_at: list[float | None] = [None] * n
        self.position = 0
        self.recompute_end: float | None = None
        self.recompute_seconds = 0.0
        self.queue: deque[tuple[int, int, int, Choice]] = deque()   # (chunk, layer, bytes, level)
        #: sections decoding, soonest done first: (done at, chunk, layer, bytes, level, seconds)
        self.running: list[tuple[float, int, int, int, Choice, float]] = []
        self.out: list[ev.Event] = []

    def next_time(self) -> float:
        times = [self.running[0][0] if self.running else math.inf,
                 self.recompute_end if self.recompute_end is not None else math.inf]
        return min(times)

    def resolve(self, chunk: int, choice: Choice, now: float) -> None:
        """A request for ``chunk`` as ``choice``: another level or text drops what the
        decoder holds of the old one (a refetch at the same level keeps it)."""
        if self.choice[chunk] != choice:
            for item in [q for q in self.queue if q[0] == chunk]:
                self.queue.remove(item)
                self.out.append(ev.SectionDecoded(chunk, item[1], item[2], None, now))
            self.decoded[chunk].clear()
            self.choice[chunk] = choice
        self.text_in[chunk] = False
        self._advance(now)

    def take(self, chunk: int, layer: int, nbytes: int, now: float) -> bool:
        """A section landed: False if it was delivered or decoded already (a refetch's copy).
        At a level that predicts each layer from the one before, every section of an
        answer decodes, in order: the layers after it need it (delivered or not)."""
        level = self.choice[chunk]
        chained = level != TEXT and self.manifest.predicted(level)  # type: ignore[arg-type]
        if not chained and (layer < self.delivered[chunk] or layer in self.decoded[chunk] or
                            any(q[0] == chunk and q[1] == layer for q in self.queue) or
                            any(r[1:3] == (chunk, layer) for r in self.running)):
            return False
        self.queue.append((chunk, layer, nbytes, self.choice[chunk]))   # type: ignore[arg-type]
        self._start_decode(now)
        return True

    def text(self, chunk: int, now: float) -> None:
        self.text_in[chunk] = True
        self._advance(now)

    def step(self, now: float) -> None:
        """The decode or recompute due at ``now`` finishes."""
        if self.running and self.running[0][0] <= now:
            _, chunk, layer, nbytes, level, seconds = self.running.pop(0)
            self.out.append(ev.SectionDecoded(chunk, layer, nbytes, seconds, now))
            if level == self.choice[chunk]:
                self.decoded[chunk].add(layer)
            self._start_decode(now)
        elif self.recompute_end is not None and self.recompute_end <= now:
            chunk, self.recompute_end = self.position, None
            self.out.append(ev.RecomputeFinished(chunk, self.tokens[chunk], self.recompute_seconds, now))
            self._finish_chunk(chunk, now)
        self._advance(now)

    def _start_decode(self, now: float) -> None:
        while self.queue and (self.decode_done is not None or not self.running):
            chunk, layer, nbytes, level = self.queue.popleft()
            seconds = self.decode_time(chunk, layer, nbytes)
            done = now + seconds if self.decode_done is None else max(now, self.decode_done(chunk, layer, now))
            bisect.insort(self.running, (done, chunk, layer, nbytes, level, seconds), key=lambda r: r[0])

    def _finish_chunk(self, chunk: int, now: float) -> None:
        self.done_at[chunk] = now
        self.out.append(ev.ChunkDone(chunk, now))
        self.position += 1

    def _advance(self, now: float) -> None:
        """Deliver what can be delivered now, in order."""
        while self.position < len(self.choice) and self.recompute_end is None:
            chunk = self.position
            if self.choice[chunk] == TEXT:
                if not self.text_in[chunk]:
                    return
                self.out.append(ev.RecomputeStarted(chunk, now))
                self.recompute_seconds = self.recompute_time(chunk, self.tokens[chunk])
                self.recompute_end = now + self.recompute_seconds
                return
            if self.choice[chunk] is None:
                return
            while self.delivered[chunk] < self.layers and self.delivered[chunk] in self.decoded[chunk]:
                self.out.append(ev.LayerDelivering(chunk, self.delivered[chunk], now))
                self.delivered[chunk] += 1
            if self.delivered[chunk] < self.layers:
                return
            self._finish_chunk(chunk, now)


class _Schedule:
    """A fixed schedule replayed as a policy (the oracle's, say): the chunk's entry."""

    def __init__(self, schedule: Sequence[Choice]) -> None:
        self.schedule = list(schedule)
        self.__name__ = "schedule"

    def __call__(self, inp: PlanInput) -> Choice:
        return self.schedule[len(self.schedule) - len(inp.sizes)]


def _as_policy(policy: str | Policy) -> tuple[Policy, str]:
    if isinstance(policy, str):
        return get_policy(policy), policy
    return policy, getattr(policy, "__name__", "policy")


class _Run:
    """One simulated fetch: the controller, the link, the receiver and the clock."""

    def __init__(self, sim: "Simulator", controller: FetchController, link: Link, receiver: _Receiver,
                 wakes: Sequence[float] | None = None,
                 connects: Sequence[tuple[float, float, float]] | None = None, continuations: bool = True,
                 pauses: Sequence[tuple[float, bool]] = ()) -> None:
        self.sim, self.ctl, self.link, self.receiver = sim, controller, link, receiver
        self.continuations = continuations   # the sender takes REQUESTs from a first layer
        #: a recorded driver's wake-ups, in place of the controller's timers, and its new
        #: connections (ready at, rtt, seconds taken), in place of the reconnect model (a replay)
        self.wakes = None if wakes is None else deque(wakes)
        self.connects = deque(connects or ())
        #: a recorded driver's pauses in reading, (when, paused), fed as they come (a replay)
        self.pauses = deque(pauses)
        self.connection = (sim.rtt, sim.reconnect_seconds)
        self.now = 0.0
        self.connect_at: float | None = None
        self.fed: dict[int, int] = {}     # chunk -> bytes of its answer the controller was told of
        self.actions: list[ev.Action] = []
        self.inbox: deque[ev.Event] = deque()

    def feed(self, *events: ev.Event) -> None:
        """Hand the controller inputs and carry out its actions, and what they cause, in order."""
        self.inbox.extend(events)
        while self.inbox:
            self.ctl.handle(self.inbox.popleft())
            for action in self.ctl.actions():
                self.actions.append(action)
                self._perform(action)
            self.inbox.extend(self._taken())

    def _perform(self, action: ev.Action) -> None:
        now, sim = self.now, self.sim
        if isinstance(action, ev.SendRequest):
            text = action.choice == TEXT
            nbytes = sim.text_bytes[action.chunk] if text else \
                sim.manifest.answer_bytes(action.chunk, action.choice, action.first_layer)  # type: ignore[arg-type]
            self.fed[action.chunk] = 0
            self.link.request(now, action.chunk, action.choice, nbytes, text, action.first_layer)
            self.receiver.resolve(action.chunk, action.choice, now)
        elif isinstance(action, ev.SendCancel):
            self.link.cancel(now, action.chunk)
        elif isinstance(action, ev.Reconnect):
            self.link.drop(now)
            if self.connects:
                self.connect_at, *connection = self.connects.popleft()
                self.connection = (connection[0], connection[1])
            else:
                self.connect_at = now + sim.reconnect_seconds

    def on_link(self, event: LinkEvent) -> None:
        """One link event, handed over at ``event.at`` (to the receiver's models) and told
        to the controller as having happened at ``event.happened``."""
        stamp = event.happened
        if event.kind == BEGIN:
            self.feed(ev.AnswerBegan(event.chunk, event.nbytes, stamp))
        elif event.kind == SECTION:
            if self.receiver.take(event.chunk, event.layer, event.nbytes, event.at):
                self.feed(ev.SectionHanded(event.chunk, event.layer, event.nbytes, stamp))
        elif event.kind == POINT:
            self._progress(event.chunk, event.received, event.sections, stamp)
        elif event.kind == PARTIAL:
            self.feed(ev.Activity(stamp, event.received))
        elif event.kind == END:
            if not event.cancelled or event.received:
                self._progress(event.chunk, event.received, event.sections, stamp)
            self.feed(ev.AnswerEnded(event.chunk, event.cancelled, stamp))
        else:
            assert event.kind == TEXT_END
            self.receiver.text(event.chunk, event.at)
            self.feed(ev.TextArrived(event.chunk, event.received, stamp), *self._taken())

    def _progress(self, chunk: int, received: int, sections: int, at: float) -> None:
        if received != self.fed.get(chunk):
            self.fed[chunk] = received
            self.feed(ev.PartArrived(chunk, received, sections, at))

    def step(self) -> bool:
        """Advance to the next thing that happens; False once the fetch is over."""
        ctl = self.ctl
        if ctl.failure is not None or ctl.done:
            return False
        if self.wakes is not None:
            timer = self.wakes[0] if self.wakes else None
        else:
            timer, wanted = ctl.timer(), ctl.watermark()
            if wanted is not None:
                timer = min(math.inf if timer is None else timer, self.link.when(*wanted))
        sources = [self.link.next_time(), self.receiver.next_time(),
                   math.inf if self.connect_at is None else self.connect_at,
                   math.inf if timer is None else timer,
                   self.pauses[0][0] if self.pauses else math.inf]
        source = int(np.argmin(sources))
        if not math.isfinite(sources[source]):
            raise RuntimeError("simulated fetch waits for nothing: a controller or model bug")
        self.now = max(self.now, sources[source])
        if source == 0:
            self.on_link(self.link.pop())
        elif source == 1:
            self.receiver.step(self.now)
            self.feed(*self._taken())
        elif source == 2:
            self.connect_at = None
            self.feed(ev.Connected(*self.connection, self.now, continuations=self.continuations))
        elif source == 4:
            _, paused = self.pauses.popleft()
            self.feed(ev.ReadingPaused(self.now) if paused else ev.ReadingResumed(self.now))
        else:
            if self.wakes:
                self.wakes.popleft()
            progress = self.link.progress(self.now)
            if progress is not None:
                self._progress(*progress, self.now)
            self.feed(ev.Tick(self.now))
        return True

    def _taken(self) -> list[ev.Event]:
        """What the receiver did since it was last asked."""
        events, self.receiver.out = self.receiver.out, []
        return events


class Simulator:
    """Simulates fetches of one context (manifest) over traces; see the module docstring.

    ``decode_seconds`` is each chunk's decode time (a scalar for all chunks, or one per
    chunk); ``distortion`` the per-level distortion to report (default: the manifest's
    targets, which are also what the policies optimise); ``reconnect_seconds`` what a new
    connection costs (default: the four round trips of TCP, HELLO, AUTH and OPEN).
    """

    def __init__(self, manifest: Manifest, *, rtt: float,
                 recompute_seconds_per_token: float = DEFAULT_RECOMPUTE_SECONDS_PER_TOKEN,
                 decode_seconds: float | Sequence[float] = 0.0,
                 distortion: Sequence[float] | None = None,
                 reconnect_seconds: float | None = None, stall_timeout: float = FetchSettings.stall_timeout,
                 max_reconnects: int = FetchSettings.max_reconnects) -> None:
        if not rtt >= 0:
            raise ValueError(f"rtt must be >= 0, got {rtt}")
        self.manifest = manifest
        self.rtt = float(rtt)
        self.reconnect_seconds = 4 * self.rtt if reconnect_seconds is None else float(reconnect_seconds)
        if not self.reconnect_seconds >= 0:
            raise ValueError(f"reconnect_seconds must be >= 0, got {reconnect_seconds}")
        self.recompute = float(recompute_seconds_per_token)
        self.stall_timeout, self.max_reconnects = stall_timeout, max_reconnects
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
        self._links: dict[int, VectorLink] = {}

    # ------------------------------------------------------------------ decisions
    def decide(self, policy: str | Policy, chunk: int, *, time_left: float,
               history: Sequence[Observation], prior_bps: float | None,
               prior_errors: Sequence[float] = (), abandon: Abandon | None = None,
               recompute_busy: float = 0.0, until_deadline: float | None = None,
               decode_cost: DecodeCost | None = None, decode_busy: float = 0.0,
               previous: Choice | None = None) -> tuple[Choice, str | None]:
        """``adapt.decide`` with this context's manifest and recompute cost (what the
        controller calls), for replaying recorded decision inputs."""
        fn, _ = _as_policy(policy)
        return decide(fn, self.manifest, chunk, time_left=time_left, history=history,
                      prior_bps=prior_bps, prior_errors=prior_errors, abandon=abandon,
                      recompute_busy=recompute_busy, recompute=RecomputeCost(self.recompute),
                      until_deadline=until_deadline, decode_cost=decode_cost, decode_busy=decode_busy,
                      previous=previous)

    def cost_of(self, choices: Sequence[Choice], layer_levels: Sequence[LayerLevels] | None = None) -> float:
        """The policies' objective for a whole schedule: each level's distortion, or for a
        chunk delivered at several levels (``layer_levels``: its runs, as
        ``ChunkReport.layer_levels``) theirs weighted by their layers; TEXT_PENALTY per text chunk."""
        runs = layer_levels if layer_levels is not None else [()] * len(choices)
        return float(sum(TEXT_PENALTY if c == TEXT else self._distortion(self.manifest.level_distortion, c, r)
                         for c, r in zip(choices, runs, strict=True)))

    def kv_distortion_of(self, choices: Sequence[Choice], layer_levels: Sequence[LayerLevels] | None = None) -> float:
        """Token-weighted mean distortion of the chunks fetched as KV (nan if none was)."""
        kv = [j for j, c in enumerate(choices) if c != TEXT]
        if not kv:
            return math.nan
        runs = layer_levels if layer_levels is not None else [()] * len(choices)
        w = self.tokens[kv]
        return float(sum(self._distortion(self.distortion, choices[j], runs[j]) * wj for j, wj in zip(kv, w))
                     / w.sum())

    def _distortion(self, per_level: Sequence[float], level: Choice, runs: LayerLevels) -> float:
        """A KV chunk's distortion: its level's, or its runs' weighted by their layers."""
        if len(runs) < 2:
            return per_level[level]   # type: ignore[index]
        layers = self.manifest.layers
        ends = [first for first, _ in runs[1:]] + [layers]
        return sum((end - first) * per_level[run_level] for (first, run_level), end in zip(runs, ends)) / layers

    # ------------------------------------------------------------------ one fetch
    def run(self, policy: str | Policy, trace: Trace | None, *, slo: float, start: float = 0.0,
            prior_bps: float | None = None, prior_errors: Sequence[float] = (),
            schedule: Sequence[Choice] | None = None, cancel: bool | None = None,
            decode_prior: DecodeCost | None = None, link: Link | None = None,
            decode_time: DecodeTime | None = None, recompute_time: RecomputeTime | None = None,
            decode_done: DecodeDone | None = None,
            wakes: Sequence[float] | None = None, connects: Sequence[tuple[float, float, float]] | None = None,
            pauses: Sequence[tuple[float, bool]] = (),
            continuations: bool = True, beliefs: Beliefs | None = None, record: bool = False) -> SimResult:
        """Simulate one fetch starting at trace time ``start``.

        ``schedule`` replays fixed choices instead of asking the policy (e.g. the
        oracle's), with the same timing and no cancel. ``prior_bps`` and ``prior_errors``
        are the peer's memory from earlier fetches (:attr:`SimResult.next_prior`,
        :attr:`SimResult.next_errors`); ``decode_prior`` the session's decoder prior.
        ``cancel`` runs the cancel rule (None: the session's default for the policy).
        ``link`` replaces the trace's (a recorded timeline: ``trace`` may then be None);
        ``decode_time`` / ``recompute_time`` replace the decoder and recompute models
        (``decode_done``: each section done when a recording says, the decoder's threads
        however many it had);
        ``wakes`` the controller's timers by a recorded driver's wake-up times, and
        ``connects`` the reconnect model by its new connections, and ``pauses`` its pauses
        in reading ((when, paused), fed as ReadingPaused / ReadingResumed: ``fetch.replay``).
        ``continuations``: the sender takes REQUESTs from a first layer (protocol version 2),
        so the cancel rule may continue a chunk's remaining layers at a lower level.
        ``beliefs`` replaces what the fetch starts from (``prior_bps``, ``prior_errors`` and
        ``decode_prior`` then unused): a recorded session's ``StreamSession.beliefs``.
        ``record`` keeps the controller's inputs and actions (``SimResult.actions`` are kept always).
        """
        if not slo > 0:
            raise ValueError(f"slo must be > 0, got {slo}")
        fn, name = _as_policy(policy)
        if schedule is not None:
            fn, cancels = _Schedule(schedule), False
        else:
            cancels = cancels_by_default(name) if cancel is None else cancel
        layers = self.manifest.layers
        settings = FetchSettings(slo=slo, policy=name, cancels=cancels,
                                 recompute_seconds_per_token=self.recompute, stall_timeout=self.stall_timeout,
                                 max_reconnects=self.max_reconnects)
        controller = FetchController(self.manifest, settings, context_id=self.manifest.context_id, policy=fn,
                                     record=record,
                                     beliefs=beliefs or Beliefs(prior_bps, tuple(prior_errors),
                                                                decode_prior=decode_prior))
        if link is None:
            if trace is None:
                raise ValueError("run() needs a trace or a link")
            link = TraceLink(trace, start=start, owd=self.rtt / 2, layers=layers)
        receiver = _Receiver(self.manifest, decode_time or (lambda chunk, _l, _b: float(self.decode[chunk]) / layers),
                             recompute_time or (lambda _c, tokens: self.recompute * tokens), decode_done)
        run = _Run(self, controller, link, receiver, wakes, connects, continuations, pauses)
        run.feed(ev.Started(self.rtt, self.reconnect_seconds, 0.0, continuations=continuations))
        for _ in range(_MAX_STEPS_PER_CHUNK * len(self.sizes)):
            if not run.step():
                break
        else:  # pragma: no cover - a bug, not a schedule
            raise RuntimeError("simulated fetch did not finish")
        return self._result(controller, receiver, run.actions, slo)

    def _result(self, ctl: FetchController, receiver: _Receiver, actions: list[ev.Action], slo: float) -> SimResult:
        failed = ctl.failure is not None
        choices: list[Choice] = [TEXT if failed and not receiver.done_at[c.index] or c.choice is None else c.choice
                                 for c in ctl.chunks]
        timings = []
        for chunk, choice in zip(ctl.chunks, choices):
            report = chunk.report
            end = report.finished_at if report is not None else math.inf
            done = receiver.done_at[chunk.index]
            timings.append(ChunkTiming(chunk.index, choice, self._bytes_of(chunk.index, choice), chunk.requested_at,
                                       chunk.begin_at if chunk.begin_at is not None else end, end,
                                       math.inf if done is None else done,
                                       report.busy_seconds if report is not None else 0.0))
        finish = max(t.done for t in timings)
        text_tokens = float(sum(self.tokens[j] for j, c in enumerate(choices) if c == TEXT))
        memory = ctl.memory()
        layer_levels = [() if choice == TEXT or chunk.report is None else tuple(chunk.report.layer_levels)
                        for chunk, choice in zip(ctl.chunks, choices)]
        return SimResult(choices=choices, chunks=timings, decisions=list(ctl.decisions), history=list(ctl.history),
                         finish=finish, recompute=self.recompute * text_tokens, slo=float(slo),
                         cost=self.cost_of(choices, layer_levels), text_chunks=sum(c == TEXT for c in choices),
                         next_prior=memory.rate if memory else None,
                         next_errors=memory.errors if memory else (),
                         cancelled=tuple((s.chunk, s.abandoned, s.delivered_layers, s.to) for s in ctl.switches),
                         actions=actions, failure=ctl.failure.message if ctl.failure else None,
                         layer_levels=layer_levels)

    def _bytes_of(self, chunk: int, choice: Choice) -> int:
        return self.text_bytes[chunk] if choice == TEXT else self.sizes[chunk][choice]

    # ------------------------------------------------------------------ oracle
    def oracle(self, trace: Trace, *, slo: float, start: float = 0.0, splits: bool = True) -> OracleResult:
        """The best schedule for this context on ``trace`` known in advance (``fetch.oracle``;
        ``splits``: chunks may be split between two levels by layer)."""
        key = id(trace)
        link = self._links.get(key)
        if link is None or len(self._links) > 256:
            if len(self._links) > 256:
                self._links.clear()
            link = self._links[key] = VectorLink(trace)
        return solve(self, link, slo=slo, start=start, splits=splits)


def oracle(manifest: Manifest, trace: Trace, *, slo: float, rtt: float, start: float = 0.0,
           recompute_seconds_per_token: float = DEFAULT_RECOMPUTE_SECONDS_PER_TOKEN,
           decode_seconds: float | Sequence[float] = 0.0,
           distortion: Sequence[float] | None = None, splits: bool = True) -> OracleResult:
    """The minimum-objective schedule that meets ``slo`` on ``trace`` (known in advance)."""
    sim = Simulator(manifest, rtt=rtt, recompute_seconds_per_token=recompute_seconds_per_token,
                    decode_seconds=decode_seconds, distortion=distortion)
    return sim.oracle(trace, slo=slo, start=start, splits=splits)


__all__ = ["ChunkTiming", "Decision", "OracleResult", "SimResult", "Simulator", "Switch", "oracle"]
