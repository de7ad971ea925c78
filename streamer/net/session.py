"""StreamSession: fetch one context under a deadline, chunk by chunk, into callbacks.

Per chunk the policy (``streamer.adapt``, via ``adapt.decide``) picks a quality
level or text; the request for the next chunk goes out *before* the current one has
fully arrived (when the bytes still to come would take about as long as a request
takes to be answered: one round trip plus the sender's store read), so
the link never idles and each decision sees the freshest measurement, including
the partial rate of the chunk in flight. Throughput is measured at the receiver
over busy time only: a chunk's clock starts when the previous chunk ended or when
its request could first have been answered (sent + one round trip), whichever is
later, so neither idle time nor a burst of buffered bytes distorts it; the profile downloaded
when the context opened (megabytes over the same link) is the first sample. Layer sections are handed to
``OrderedDelivery`` as they land, so decoding overlaps receiving and layer 0 of
chunk 0 reaches the consumer while later chunks are still on the wire. The decoder is
timed too (``adapt.decoding``): every decision sees its seconds per token, as its recent
sections took, and the decoding still owed, so a plan on a receiver whose decoder is
slower than the link is timed by the decoder.

Faults: a reset, a close, a protocol error or a stall longer than ``stall_timeout``
triggers a reconnect with bounded exponential backoff (cycling through
``servers``), and the fetch resumes: chunks that already delivered layers are
re-requested at the same level and their delivered layers are skipped; the others
are decided afresh. A corrupt section is refetched (twice at most). When the
deadline has passed, everything not yet requested goes to text.

Cancel and downgrade: on arrivals (at most every ``cancel.MIN_LOOK_S``) and every
``cancel.RECONSIDER_S`` while a chunk is in flight, ``adapt.cancel.reconsider`` judges
it by its own rate (``cancel.chunk_rate``: its whole transfer so far or its last few
tens of ms, whichever is slower) and asks whether finishing it still leaves the later
chunks time for their cheapest answers, and a collapse time to be given up; if not, the
session sends CANCEL for it (and for any chunk requested behind it, which would
otherwise arrive first) and re-requests it at a lower level or as text (superseding
layers already delivered), the chunks behind it decided afresh with the rate the rule
judged by as the newest sample. A CANCEL not answered by the switch's
``escalate_after`` (a fade holding up what the sender had queued) drops the connection
instead, as an abort would have. Knowing that a slow chunk is given up, mpc may try a
level where the estimate alone says text (``adapt.mpc.probe``, and ``mpc.free_probe``
while the caller still recomputes earlier text): a fade that pulled the estimate down is
not followed to text for the rest of the fetch.

Security and limits: ``auth_token`` authenticates to the sender (and the sender to us)
in the handshake; a refused token raises :class:`AuthenticationFailed` at once (no
retries). ``ssl`` (an ``ssl.SSLContext``, or True for the system CAs) wraps every
connection in TLS. ``max_frame`` caps the frames the sender may send us.
``max_buffered_bytes`` bounds the encoded sections received but not yet delivered:
above it the session stops reading from the socket (TCP backpressure on the sender)
until the consumer catches up -- except while the consumer waits for data not yet
received, so a refetch can never deadlock behind the backlog.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import codec

from streamer.adapt import cancel, decoding, estimator
from streamer.adapt.decoding import RECENT_SECTIONS, DecodeCost
from streamer.adapt.recompute import RECENT, recompute_rate
from streamer.adapt.base import Abandon
from streamer.adapt.decide import MAX_QUEUED_AHEAD, decide, plan_input, time_left
from streamer.adapt.estimator import MIN_SAMPLE_BYTES
from streamer.adapt.policies import TEXT, Choice, Observation, get_policy
from streamer.net.client import (AuthenticationFailed, ClientConnection, ConnectionLost,
                                 ServerError, StreamError)
from streamer.net.config import SessionConfig
from streamer.net.delivery import OrderedDelivery
from streamer.net.devices import section_decoder
from streamer.net.report import ChunkReport, FetchReport
from streamer.store.put import decode_tokens
from streamer.wire import protocol as p
from streamer.wire.manifest import Manifest

#: Refetches of one chunk after corrupt sections before giving up on it.
MAX_CORRUPT_RETRIES = 2

_profiles: "collections.OrderedDict[str, codec.Profile]" = collections.OrderedDict()
_PROFILE_CACHE_SIZE = 8
#: Per sender address: the prior of the next fetch (a reused connection, the receiver
#: daemon and successive sessions of one process all carry it), with when it was measured.
_server_priors: dict[tuple[str, int], tuple[float, estimator.LinkMemory]] = {}
#: A sender's memory is forgotten this long after its last measurement. A fetch that a slow
#: memory plans all as text measures nothing and leaves the memory as it was, so without an
#: age a link that recovered would not be tried again while deadlines stay too tight to probe.
MEMORY_TTL_S = 60.0


def _recall(address: tuple[str, int], now: float) -> estimator.LinkMemory | None:
    """The memory of ``address`` if it is younger than ``MEMORY_TTL_S``."""
    entry = _server_priors.get(address)
    if entry is None or now - entry[0] > MEMORY_TTL_S:
        _server_priors.pop(address, None)
        return None
    return entry[1]


async def connect(config: SessionConfig, host: str, port: int, *, timeout: float | None = None,
                  ssl: Any = None) -> ClientConnection:
    """A handshaken connection to one sender as ``config`` says (auth, TLS, frame limit);
    ``ssl``: a context already built from ``config`` (default: build one)."""
    return await ClientConnection.connect(
        host, port, timeout=config.connect_timeout if timeout is None else timeout,
        max_frame=config.max_frame, auth_token=config.auth_token,
        ssl=config.ssl_context() if ssl is None else ssl, server_hostname=config.server_hostname)


class FetchFailed(StreamError):
    """The fetch could not complete; ``report`` says what was delivered."""

    def __init__(self, message: str, report: FetchReport) -> None:
        super().__init__(message)
        self.report = report


class TextNotConsumed(FetchFailed):
    """A chunk has to come as text (token ids) but the session, which hands layers to an
    ``on_layer``, has no ``on_text``: raised before the text is requested, as the chunk's
    KV would otherwise be silently missing from what ``on_layer`` received. (A session
    with neither callback consumes no data, e.g. a benchmark reading only the report.)"""


class ContextChanged(StreamError):
    """The context was re-put while we were fetching it: chunks would mix versions."""


@dataclass
class _Chunk:
    index: int
    choice: Choice | None = None
    requested_at: float = 0.0
    begin_at: float | None = None
    expected: int = 0
    received: int = 0
    buffer: bytearray = field(default_factory=bytearray)
    consumed: int = 0          # bytes of buffer already cut into header/sections
    header: codec.BlobHeader | None = None
    next_layer: int = 0
    corrupt_retries: int = 0
    refetch: bool = False      # a refetch is due when the current answer ends
    discard: bool = False      # ignore the rest of the current answer (its header was corrupt)
    cancelling: bool = False   # CANCEL sent; re-requested when its answer ends
    switch_to: Choice | None = None   # what to re-request a cancelled chunk at (None: decide afresh)
    escalate_at: float | None = None   # drop the connection if the CANCEL is unanswered by then
    #: the cancel rule's looks at the current answer: (time, bytes received), from its busy start
    marks: list[tuple[float, int]] = field(default_factory=list)
    #: (arrival time, bytes received) after each part of the current answer: where its
    #: in-flight sample's recent half begins (``estimator.in_flight_sample``)
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    report: ChunkReport | None = None


class StreamSession:
    """Receive one context; see the module docstring. Use as an async context manager."""

    def __init__(self, host: str, port: int, context_id: str, *, config: SessionConfig | None = None,
                 on_layer: Callable[..., Any] | None = None, on_text: Callable[..., Any] | None = None,
                 on_chunk: Callable[[ChunkReport], Any] | None = None,
                 servers: Sequence[tuple[str, int]] = (),
                 connection: ClientConnection | None = None, **options: Any) -> None:
        """``config`` says how to fetch; keyword ``options`` (any SessionConfig field, e.g.
        ``slo=0.5``) override it, or build one when ``config`` is None. ``servers`` are
        fallbacks after ``host:port``; ``connection`` is an idle connection to reuse."""
        config = SessionConfig(**options) if config is None else dataclasses.replace(config, **options)
        self.config = config
        self._ssl = config.ssl_context()
        self._given_connection = connection
        self._on_data: Callable[[], None] | None = None   # set by a running fetch
        self._policy = get_policy(config.policy)
        self.context_id = context_id
        self._on_layer = on_layer
        self._on_text = on_text
        self._on_chunk = on_chunk
        self._decode = section_decoder(config.device)
        self._servers = [(host, int(port))] + [(h, int(pt)) for h, pt in servers]
        self._server_index = 0
        self._client: ClientConnection | None = None
        self.manifest: Manifest | None = None
        self.profile: codec.Profile | None = None
        #: bytes/s of the manifest (and profile) answers, measured when the context opens
        self.handshake_bps: float | None = None
        #: the profile's download as a throughput sample, for the next fetch's history (see
        #: ``_open_context``); taken by that fetch
        self.open_sample: Observation | None = None
        #: seconds the last connect + handshake + open took, less the profile download (a
        #: reconnect finds the profile cached): what dropping a connection costs (the cancel
        #: rule weighs it against draining what the old one queued)
        self.connect_seconds = 0.0
        #: the level (or "text") each chunk was last requested at, as soon as it is requested:
        #: lets a consumer label layers before the chunk's report exists
        self.levels: dict[int, Choice] = {}
        #: (tokens, seconds) of the caller's last on_text calls, across fetches: its compute
        #: outlives a fetch, so the next one plans text at the rate it showed (adapt.recompute)
        self.recomputes: collections.deque[tuple[int, float]] = collections.deque(maxlen=RECENT)
        #: (tokens, bytes, seconds) of the last sections decoded, across fetches: the decoder's
        #: cost, so the next fetch's first plan is timed by it too (adapt.decoding)
        self.decodes: collections.deque[tuple[int, int, float]] = collections.deque(maxlen=RECENT_SECTIONS)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvwire-decode")
        self._fetch: _Fetch | None = None

    @property
    def slo(self) -> float:
        return self.config.slo

    @property
    def policy_name(self) -> str:
        return self.config.policy

    @property
    def max_buffered_bytes(self) -> int:
        return self.config.max_buffered_bytes

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> "StreamSession":
        try:
            if self._decode is codec.decode_section:
                # the CPU decoder's numba kernels compile (cold cache) or load now, not in
                # fetch(), whose clock would count the stall as a slow link (once per process)
                await asyncio.get_running_loop().run_in_executor(self._executor, codec.warm_up)
            if not await self._reuse(self._given_connection):
                await self._connect_any()
        except BaseException:
            self._executor.shutdown(wait=False)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            await self._client.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def set_callbacks(self, *, on_layer: Callable[..., Any] | None = None,
                      on_text: Callable[..., Any] | None = None) -> None:
        """Set the consumers after entering, once ``manifest`` tells their shapes."""
        self._on_layer = on_layer
        self._on_text = on_text

    async def _reuse(self, client: ClientConnection | None) -> bool:
        """Open the context on an idle connection handed in by the caller (a pool): no new
        handshake. False, with the connection dropped, if it turns out to be unusable."""
        if client is None:
            return False
        if not client.reusable:
            client.abort()
            return False
        self._client = client
        client.set_on_data(self._on_data)
        client.resume_reading()
        try:
            await self._open_context()
            # not measured on a reused connection: TCP, HELLO, AUTH and OPEN round trips
            self.connect_seconds = 4 * client.rtt
            return True
        except ServerError as exc:
            if exc.code in ("not_found", "bad_request"):
                raise
        except ConnectionLost:
            pass
        client.abort()
        self._client = None
        return False

    def detach_connection(self) -> ClientConnection | None:
        """After ``fetch()``: hand the connection back for reuse (None if it is not reusable);
        the session then leaves it open on exit."""
        client, self._client = self._client, None
        if client is not None and client.reusable:
            client.set_on_data(None)
            return client
        if client is not None:
            client.abort()
        return None

    @property
    def address(self) -> tuple[str, int]:
        return self._servers[self._server_index]

    async def _connect_any(self) -> None:
        """Connect to the servers in turn (with backoff) and open the context."""
        delay = self.config.backoff
        started = time.monotonic()
        last: Exception | None = None
        for attempt in range(self.config.max_reconnects + 1):
            host, port = self._servers[self._server_index]
            try:
                self._client = await connect(self.config, host, port, ssl=self._ssl)
                self._client.set_on_data(self._on_data)
                profile_seconds = await self._open_context()
                self.connect_seconds = time.monotonic() - started - profile_seconds
                return
            except AuthenticationFailed:
                if self._client is not None:
                    self._client.abort()
                    self._client = None
                raise  # a wrong token stays wrong: retrying (or another sender) cannot help
            except ServerError as exc:
                if exc.code in ("not_found", "bad_request"):
                    raise  # no such context, or an invalid id: retrying elsewhere cannot help
                last = exc
            except ConnectionLost as exc:
                last = exc
            if self._client is not None:
                self._client.abort()
                self._client = None
            self._server_index = (self._server_index + 1) % len(self._servers)
            await asyncio.sleep(delay)
            delay = min(2 * delay, self.config.max_backoff)
        raise ConnectionLost(f"could not reach a sender for {self.context_id!r}: {last}")

    async def _open_context(self) -> float:
        """Open the context (manifest, then the profile unless cached); returns the seconds
        the profile download took (0 when cached)."""
        client = self._client
        assert client is not None
        timeout = self.config.connect_timeout
        asked = time.monotonic()
        answer = await client.call(p.Open(context_id=self.context_id, slo=self.slo), p.ManifestData, timeout)
        received = len(answer.data)
        manifest = Manifest.from_bytes(answer.data)
        if self.manifest is not None and manifest.version != self.manifest.version:
            raise ContextChanged(f"context {self.context_id!r} changed from version "
                                 f"{self.manifest.version} to {manifest.version} during the fetch")
        self.manifest = manifest
        profile = _profiles.get(manifest.profile_id)
        profile_seconds = 0.0
        if profile is None:
            profile_asked = time.monotonic()
            data = await client.get_profile(manifest.profile_id, timeout)
            profile_seconds = time.monotonic() - profile_asked
            received += len(data)
            if len(data) >= MIN_SAMPLE_BYTES:
                # busy from one round trip after the request, as a chunk's (``_busy_start``)
                self.open_sample = Observation(len(data), max(profile_seconds - client.rtt, 0.0))
            profile = codec.Profile.from_bytes(data)
            if profile.id != manifest.profile_id:
                raise ConnectionLost(f"sender returned profile {profile.id}, wanted {manifest.profile_id}")
            _profiles[manifest.profile_id] = profile
            while len(_profiles) > _PROFILE_CACHE_SIZE:
                _profiles.popitem(last=False)
        _profiles.move_to_end(manifest.profile_id)
        self.profile = profile
        # round trips included, so a lower bound on the link: the first chunk's prior when
        # neither the caller nor an earlier fetch from this sender gives a better one
        self.handshake_bps = received / max(time.monotonic() - asked, 1e-6)
        return profile_seconds

    # ------------------------------------------------------------------ fetching
    async def fetch(self) -> FetchReport:
        """Fetch every chunk; returns when the last layer or text chunk was delivered."""
        if self.manifest is None or self._client is None:
            raise RuntimeError("use `async with StreamSession(...)` before fetch()")
        if not self.decodes and self.config.decode_prior is not None:
            self.decodes.extend(decoding.prior_sections(self.config.decode_prior, self.manifest.chunks[0].tokens,
                                                        self.manifest.layers))
        self._fetch = _Fetch(self)
        return await self._fetch.run()

    def delivered_layers(self, chunk: int) -> int:
        """Layers of ``chunk`` handed to ``on_layer`` so far in the current (or last) fetch:
        called from ``on_text``, non-zero means the text supersedes them."""
        return self._fetch.delivery.delivered_layers(chunk) if self._fetch is not None else 0


class _Fetch:
    """The state of one fetch() call."""

    def __init__(self, session: StreamSession) -> None:
        self.s = session
        self.manifest: Manifest = session.manifest  # type: ignore[assignment]
        self.start = time.monotonic()
        self.deadline = self.start + session.slo
        self.chunks = [_Chunk(i) for i in range(len(self.manifest.chunks))]
        self.inflight: collections.deque[int] = collections.deque()
        self.next_chunk = 0
        #: the profile just downloaded over this link, when the context opened, is the
        #: first sample: megabytes a moment ago, where a first chunk's first bytes may be a
        #: shaper's burst (``_open_context``)
        self.history: list[Observation] = [session.open_sample] if session.open_sample else []
        session.open_sample = None
        self.last_end: float | None = None
        self.wake = asyncio.Event()
        self.report = FetchReport(session.context_id, session.slo, session.policy_name)
        self.delivery = OrderedDelivery(chunks=len(self.chunks), layers=self.manifest.layers,
                                        on_layer=session._on_layer, on_text=session._on_text,
                                        on_corrupt=self._on_corrupt, executor=session._executor,
                                        decode=session._decode)
        memory = _recall(session.address, time.monotonic())
        #: the first decision's rate: the caller's prior, else the last fetch's from this
        #: sender, else what the handshake measured (a lower bound: it includes round trips)
        self.prior = session.config.prior_bps or (memory.rate if memory else session.handshake_bps)
        self.prior_errors: tuple[float, ...] = memory.errors if memory else ()
        self.pending_sample: Observation | None = None   # small transfers pooled into one sample
        #: request-to-first-byte of a request sent to an idle sender (the first chunk's):
        #: one round trip plus the sender's store read, the lead time the next request needs
        self.response_latency = 0.0
        self.reconnects = 0
        self.cancels = 0
        #: when bytes last arrived or the fetch last acted: the stall timer runs from here
        self.last_activity = self.start
        #: reading paused because the delivery backlog is over max_buffered_bytes
        self.paused = False
        self.pauses = 0
        self.peak_backlog = 0
        self.delivery.on_progress = self._maybe_resume
        session._on_data = self._on_bytes
        if session._client is not None:
            session._client.set_on_data(self._on_bytes)

    # ------------------------------------------------------------------ main loop
    async def run(self) -> FetchReport:
        consumer = asyncio.create_task(self.delivery.run())
        try:
            while not consumer.done():
                await self._reconsider_head()
                self._request_ahead()
                arrival = await self._next_arrival(consumer)
                if arrival is None:
                    continue
                try:
                    self._handle(arrival)
                except (_NeedReconnect, ConnectionLost) as exc:
                    await self._reconnect(str(exc))
                self._maybe_pause()
        except ContextChanged:
            consumer.cancel()
            raise
        except FetchFailed:   # TextNotConsumed: already names its cause
            consumer.cancel()
            self._finish()
            raise
        except StreamError as exc:
            consumer.cancel()
            self._finish()
            raise FetchFailed(str(exc), self.report) from exc
        finally:
            if not consumer.done():
                consumer.cancel()
            # a re-open during this fetch (a reconnect that downloaded the profile again)
            # measured this fetch's link, not the next one's
            self.s.open_sample = None
            self.s._on_data = None
            if self.s._client is not None:
                self.s._client.set_on_data(None)
                if self.paused:
                    self.s._client.resume_reading()
        consumer.result()  # re-raise a callback's exception
        self._finish()
        memory = estimator.remember(self.history, self.prior_errors)
        if memory is not None:
            _server_priors[self.s.address] = (time.monotonic(), memory)
        return self.report

    def _finish(self) -> None:
        now = time.monotonic()
        self.report.total_seconds = now - self.start
        if self.delivery.first_layer_at is not None:
            self.report.first_layer_seconds = self.delivery.first_layer_at - self.start
        self.report.reconnects = self.reconnects
        self.report.cancels = self.cancels
        self.report.recompute_seconds_per_token = self._recompute_rate()
        self.s.recomputes.extend(self.delivery.recomputes)
        self.s.decodes.extend(self._recent_decodes())
        self.report.chunks = [c.report for c in self.chunks if c.report is not None]
        for chunk in self.chunks:
            if chunk.report is not None:
                chunk.report.decode_seconds = self.delivery.decode_seconds(chunk.index)
                chunk.report.recompute_seconds = self.delivery.recompute_seconds(chunk.index)
                chunk.report.superseded_layers = self.delivery.superseded_layers(chunk.index)

    async def _next_arrival(self, consumer: asyncio.Task):
        """The next network event, or None when woken for another reason."""
        client = self.s._client
        getter = asyncio.ensure_future(client.queue.get()) if client is not None else None
        waker = asyncio.ensure_future(self.wake.wait())
        waits = {consumer, waker} | ({getter} if getter else set())
        # while we hold reading paused, silence is ours, not a stalled link
        watching = bool(self.inflight) and not self.paused
        timeout = None
        if watching:
            stall_left = self.s.config.stall_timeout - (time.monotonic() - self.last_activity)
            if self._head_in_progress() is not None:   # the cancel rule looks every RECONSIDER_S
                stall_left = min(stall_left, cancel.RECONSIDER_S)
            timeout = max(stall_left, 0.0)
        done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        waker.cancel()
        self.wake.clear()
        if getter is not None and not getter.done():
            getter.cancel()
            try:
                await getter
            except asyncio.CancelledError:
                # ours to absorb only if the getter's: a cancel of this fetch that lands
                # while the getter unwinds must end the fetch (a shutdown waits for it)
                if asyncio.current_task().cancelling():  # type: ignore[union-attr]
                    raise
            else:  # the item was taken just as we cancelled: keep it
                return getter.result()
        if getter is not None and getter in done:
            return getter.result()
        if waker in done:
            self.last_activity = time.monotonic()
        elif not done and watching and \
                time.monotonic() - self.last_activity >= self.s.config.stall_timeout:
            # stalled: nothing arrived for stall_timeout with requests outstanding
            await self._reconnect(f"no data for {self.s.config.stall_timeout:g} s")
        return None

    def _on_bytes(self) -> None:
        """After each socket read: the link is alive; maybe pause reading."""
        self.last_activity = time.monotonic()
        self._maybe_pause()

    # ------------------------------------------------------------------ backpressure
    def _buffered(self) -> int:
        """Received payload bytes not yet delivered: queued events, sections still being
        assembled from parts, and the delivery backlog."""
        client = self.s._client
        assembling = sum(len(self.chunks[i].buffer) - self.chunks[i].consumed for i in self.inflight)
        return self.delivery.backlog_bytes + assembling + (client.queued_bytes if client is not None else 0)

    def _maybe_pause(self) -> None:
        """After each socket read and each handled event: stop reading when over the limit."""
        buffered = self._buffered()
        self.peak_backlog = max(self.peak_backlog, buffered)
        client = self.s._client
        if (not self.paused and client is not None and buffered > self.s.max_buffered_bytes
                and not self.delivery.starved()):
            client.pause_reading()
            self.paused = True
            self.pauses += 1

    def _maybe_resume(self) -> None:
        if not self.paused:
            return
        if self._buffered() <= self.s.max_buffered_bytes // 2 or self.delivery.starved():
            self.paused = False
            if self.s._client is not None:
                self.s._client.resume_reading()
            self.wake.set()   # restart the stall timer from now

    # ------------------------------------------------------------------ requesting
    def _busy_start(self, chunk: _Chunk) -> float:
        """When the link started carrying ``chunk``: not before its request could have been
        answered (request + one round trip), nor before the previous chunk finished.

        Not the first byte's arrival: bytes queued in socket and shaper buffers arrive in
        one burst, which would make a small chunk look arbitrarily fast.
        """
        rtt = self.s._client.rtt if self.s._client is not None else 0.0
        return max(chunk.requested_at + rtt, self.last_end or 0.0)

    def _head_in_progress(self) -> _Chunk | None:
        """The chunk whose answer is arriving now, if it is a level (not text)."""
        if not self.inflight:
            return None
        head = self.chunks[self.inflight[0]]
        return head if head.begin_at is not None and head.choice != TEXT else None

    def _progress(self, head: _Chunk) -> int:
        """Bytes of ``head`` received so far, the frame still arriving included: a large
        section at a low rate is seen as it trickles in, not only once complete."""
        client = self.s._client
        partial = client.conn.receiving_frame if client is not None and not client.closed else 0
        return min(head.received + partial, head.expected)

    def _partial_sample(self, now: float) -> Observation | None:
        """The chunk in flight so far, as a throughput sample (None while too small): its
        recent half (``estimator.in_flight_sample``), by its parts' arrival times."""
        head = self._head_in_progress()
        if head is None:
            return None
        start, received = self._busy_start(head), self._progress(head)
        curve = [(start, 0.0), *((at, count) for at, count in head.arrivals if at > start), (now, received)]
        return estimator.in_flight_sample(start, now, received, lambda t: estimator.arrived_by(curve, t))

    def _estimate(self, now: float) -> tuple[list[Observation], float | None]:
        """History plus the chunk in flight as a partial sample, and the robust estimate."""
        partial = self._partial_sample(now)
        history = self.history + [partial] if partial is not None else list(self.history)
        return history, estimator.robust_estimate(history, prior=self.prior,
                                                  prior_errors=self.prior_errors)

    def _decide(self, index: int, now: float) -> tuple[Choice, str | None, float, float | None]:
        """The policy's choice for chunk ``index`` (and the rule's reason, if any), with the
        time left and the estimate it saw."""
        client = self.s._client
        rtt = client.rtt if client is not None else 0.0
        history, estimate = self._estimate(now)
        until_deadline = self.deadline - now
        left = time_left(until_deadline, self._outstanding_bytes(), estimate, rtt)
        abandon = Abandon(rtt, self.s.connect_seconds) if self.s.config.cancels else None
        cost = self._decode_cost()
        # the decoding owed for what was requested, beyond the wait for its bytes (off ``left``)
        decode_busy = 0.0 if cost is None else max(0.0, self._decode_owed(cost) - (until_deadline - left))
        choice, reason = decide(self.s._policy, self.manifest, index, time_left=left, history=history,
                                prior_bps=self.prior, prior_errors=self.prior_errors, abandon=abandon,
                                recompute_busy=self._pending_recompute(),
                                recompute_seconds_per_token=self._recompute_rate(),
                                until_deadline=until_deadline, decode_cost=cost, decode_busy=decode_busy,
                                previous=self.chunks[index - 1].choice if index else None)
        return choice, reason, left, estimate

    def _decode_cost(self) -> DecodeCost | None:
        """The decoder's cost, over its recent sections (this fetch's and the session's
        earlier ones); None before any (``adapt.decoding``)."""
        return decoding.measure([*self.s.decodes, *self._recent_decodes()])

    def _tokens(self, chunk: int) -> int:
        return self.manifest.chunks[chunk].end - self.manifest.chunks[chunk].start

    def _recent_decodes(self) -> list[tuple[int, int, float]]:
        """(tokens, bytes, seconds) of the last sections this fetch decoded: only the last
        ``RECENT_SECTIONS`` count, and this runs on every look of the cancel rule."""
        return [(self._tokens(chunk), size, seconds)
                for chunk, size, seconds in self.delivery.decodes[-RECENT_SECTIONS:]]

    def _unarrived_decode(self, chunk: _Chunk, cost: DecodeCost) -> float:
        """Seconds the sections of a requested KV chunk not handed to the decoder yet will take."""
        if chunk.choice == TEXT:
            return 0.0
        header = chunk.header
        unarrived = chunk.expected if header is None else sum(
            length for length, _ in header.sections[chunk.next_layer:])
        return cost.seconds(self._tokens(chunk.index) * (self.manifest.layers - chunk.next_layer), unarrived)

    def _decoder_owed(self, cost: DecodeCost) -> float:
        """Seconds the decoder needs for the sections handed to it and not finished."""
        return sum(cost.seconds(self._tokens(chunk), size) for chunk, size in self.delivery.decoding())

    def _decode_owed(self, cost: DecodeCost) -> float:
        """Seconds of decoding still owed for every chunk requested: the sections in the
        decoder, and those of the chunks in flight still to arrive (it decodes them in turn)."""
        return self._decoder_owed(cost) + sum(self._unarrived_decode(self.chunks[i], cost) for i in self.inflight)

    def _recompute_rate(self) -> float:
        """Seconds per token to plan text at: the configured rate, or the caller's recent
        recomputes (this fetch's and the session's earlier ones) when slower."""
        return recompute_rate(self.s.config.recompute_seconds_per_token,
                              [*self.s.recomputes, *self.delivery.recomputes])

    def _pending_recompute(self) -> float:
        """Seconds the caller will still spend recomputing chunks already sent as text: each
        not yet delivered whole, less what the one being recomputed has had (at least
        nothing). It overlaps the transfers (``adapt.overlap``), and it says by when a chunk
        in flight can still be given up for text at no cost (``adapt.cancel``): counted
        whole, that point came up to a chunk's recompute late."""
        per_token, now, owed = self._recompute_rate(), time.monotonic(), 0.0
        for chunk in self.chunks:
            if chunk.choice == TEXT and not self.delivery.is_done(chunk.index):
                whole = per_token * self.manifest.chunks[chunk.index].tokens
                began = self.delivery.recompute_began(chunk.index)
                owed += whole if began is None else max(whole - (now - began), 0.0)
        return owed

    def _outstanding_bytes(self) -> int:
        return sum(max(self.chunks[i].expected - self.chunks[i].received, 0) for i in self.inflight)

    async def _reconsider_head(self) -> None:
        """The cancel rule (``adapt.cancel``) on the chunk in flight: when finishing it would
        sink the deadline, CANCEL it and every level chunk requested behind it, or drop the
        connection when what it has queued would take longer to arrive than a new one."""
        head = self._head_in_progress()
        client = self.s._client
        if not self.s.config.cancels or head is None or client is None or client.closed:
            return
        now = time.monotonic()
        if head.cancelling:
            if head.escalate_at is not None and now >= head.escalate_at:
                head.escalate_at = None
                await self._reconnect("cancel: the abandoned chunk's queued bytes are not draining",
                                      abort=True)
            return
        if head.marks and now - head.marks[-1][0] < cancel.MIN_LOOK_S:
            return   # looked a moment ago: arrivals come faster than the rule needs to look
        received = self._progress(head)
        if not head.marks:
            head.marks.append((self._busy_start(head), 0))
        head.marks.append((now, received))
        _, estimate = self._estimate(now)
        sample = cancel.chunk_rate(head.marks, estimate)
        if sample is None:
            return
        cost = self._decode_cost()
        plan = plan_input(self.manifest, head.index, time_left=self.deadline - now, history=[],
                          prior_bps=None, prior_errors=(), recompute_busy=self._pending_recompute(),
                          recompute_seconds_per_token=self._recompute_rate(), decode_cost=cost,
                          decode_busy=0.0 if cost is None else self._decoder_owed(cost))
        in_flight = cancel.InFlight(level=head.choice,  # type: ignore[arg-type]
                                    remaining_bytes=head.expected - received,
                                    delivered_layers=self.delivery.delivered_layers(head.index),
                                    remaining_decode_seconds=0.0 if cost is None
                                    else self._unarrived_decode(head, cost))
        switch = cancel.reconsider(plan, in_flight, rate=sample.bytes / sample.busy_seconds, rtt=client.rtt,
                                   reconnect_seconds=self.s.connect_seconds,
                                   shortfall=estimator.shortfall(self.history, self.prior_errors))
        if switch is None:
            return
        self.cancels += 1
        head.switch_to = switch.choice
        # what the rule judged the abandoned transfer by is the freshest sample of the
        # link: the chunks behind it are re-decided with it
        self.history.append(sample)
        if switch.abort:
            await self._reconnect("cancel: dropping the queued rest of a chunk", abort=True)
            return
        for index in list(self.inflight):
            chunk = self.chunks[index]
            if chunk.choice == TEXT or chunk.cancelling:
                continue
            try:
                client.send(p.Cancel(chunk=index))
            except (ConnectionLost, p.ProtocolError):
                return   # the connection-lost event that follows triggers the reconnect
            chunk.cancelling = True
        head.escalate_at = now + switch.escalate_after

    def _request_ahead(self) -> None:
        """Request the next chunk once the bytes still due would take about one request's answer time."""
        client = self.s._client
        if any(self.chunks[i].cancelling for i in self.inflight):
            return   # re-requests of cancelled chunks go first, so they keep their order
        while client is not None and not client.closed and self.next_chunk < len(self.chunks):
            now = time.monotonic()
            if self.inflight:
                if sum(self.chunks[i].choice != TEXT for i in self.inflight) > MAX_QUEUED_AHEAD:
                    return
                _, estimate = self._estimate(now)
                lookahead = (estimate or 0.0) * max(client.rtt, self.response_latency) + MIN_SAMPLE_BYTES
                if self._outstanding_bytes() > lookahead:
                    return
            index = self.next_chunk
            choice, reason, left, estimate = self._decide(index, now)
            chunk = self.chunks[index]
            chunk.report = ChunkReport(index=index, level=choice, time_left=left, reason=reason,
                                       estimate_bps=None if estimate is None else 8 * estimate)
            self.next_chunk += 1
            self._send_request(chunk, choice)

    def _send_request(self, chunk: _Chunk, choice: Choice) -> None:
        if choice == TEXT and self.s._on_text is None and self.s._on_layer is not None:
            report = chunk.report
            assert report is not None   # made when the chunk was first decided
            cause = report.reason or (f"the {self.s.policy_name} policy chose it with "
                                      f"{report.time_left:.3g} s left before the deadline")
            raise TextNotConsumed(f"chunk {chunk.index} has to come as text ({cause}) but the session has "
                                  "no on_text callback to recompute it from its token ids: pass on_text "
                                  "(e.g. streamer.model.CacheAssembler's), or an slo the link can meet",
                                  self.report)
        chunk.choice = choice
        self.s.levels[chunk.index] = choice
        chunk.requested_at = time.monotonic()
        chunk.begin_at = None
        chunk.marks = []
        chunk.arrivals = []
        chunk.received = 0
        chunk.buffer = bytearray()
        chunk.consumed = 0
        chunk.header = None
        chunk.next_layer = 0
        chunk.refetch = False
        chunk.discard = False
        chunk.cancelling = False
        chunk.escalate_at = None
        chunk.switch_to = None
        info = self.manifest.chunks[chunk.index]
        chunk.expected = info.text_bytes if choice == TEXT else info.sizes[choice]
        self.delivery.resolve(chunk.index, choice)
        if not self.inflight:
            self.last_activity = chunk.requested_at   # the stall timer runs from the request
        self.inflight.append(chunk.index)
        try:
            self.s._client.send(p.Request(chunk=chunk.index, level=choice))  # type: ignore[union-attr]
        except (ConnectionLost, p.ProtocolError):
            pass  # the connection-lost event that follows triggers the reconnect

    # ------------------------------------------------------------------ receiving
    def _handle(self, arrival) -> None:
        event, at = arrival.event, arrival.at
        if isinstance(event, p.ChunkBegin):
            chunk = self.chunks[event.chunk]
            chunk.begin_at = at
            if event.chunk == 0 and chunk.corrupt_retries == 0:
                self.response_latency = at - chunk.requested_at
            if event.total_bytes != chunk.expected:
                raise ConnectionLost(f"chunk {event.chunk} is {event.total_bytes} bytes, "
                                     f"the manifest says {chunk.expected}")
        elif isinstance(event, p.ChunkPart):
            self._on_part(self.chunks[event.chunk], event.data, at)
        elif isinstance(event, p.ChunkEnd):
            self._on_end(self.chunks[event.chunk], at, event.cancelled)
        elif isinstance(event, p.Text):
            chunk = self.chunks[event.chunk]
            chunk.begin_at = chunk.begin_at or at
            chunk.received = len(event.data)
            try:
                tokens = decode_tokens(event.data, expected_tokens=self.manifest.chunks[event.chunk].tokens,
                                       vocab_size=self.manifest.vocab_size)
            except ValueError as exc:
                raise ConnectionLost(f"chunk {event.chunk}: bad text fallback: {exc}") from exc
            self.delivery.add_text(event.chunk, tokens)
            self._on_end(chunk, at, cancelled=False)
        elif isinstance(event, p.Error):
            if event.fatal:
                self._schedule_reconnect(f"sender error {event.code}: {event.message}")
            else:
                self._on_error(event)
        elif isinstance(event, p.ConnectionClosed):
            self._schedule_reconnect("connection closed" if event.clean else "connection lost")

    def _on_part(self, chunk: _Chunk, data: bytes, at: float) -> None:
        chunk.received += len(data)
        chunk.arrivals.append((at, chunk.received))
        if chunk.discard:
            return   # the rest of an answer whose header was corrupt: it is refetched whole
        chunk.buffer += data
        if chunk.header is None:
            try:
                size = codec.header_length(chunk.buffer)
                if size is not None and size > chunk.expected:
                    raise codec.CorruptBitstream(f"chunk header claims {size} bytes, the chunk "
                                                 f"has {chunk.expected}")
                if size is None or len(chunk.buffer) < size:
                    return
                header = codec.parse_header(chunk.buffer)
                self._check_header(chunk, header)
            except codec.CorruptBitstream as exc:
                self._on_corrupt(chunk.index, 0, exc)   # discards the rest of this answer
                return
            chunk.header = header
            chunk.consumed = header.size
        header = chunk.header
        while chunk.next_layer < header.layers:
            length = header.sections[chunk.next_layer][0]
            if len(chunk.buffer) - chunk.consumed < length:
                break
            section = bytes(chunk.buffer[chunk.consumed: chunk.consumed + length])
            self.delivery.add_section(chunk.index, chunk.next_layer, header, self.s.profile, section)
            chunk.consumed += length
            chunk.next_layer += 1
        if chunk.consumed > (1 << 20):  # drop what was cut, so the buffer stays small
            del chunk.buffer[: chunk.consumed]
            chunk.consumed = 0

    def _check_header(self, chunk: _Chunk, header: codec.BlobHeader) -> None:
        """The blob must be the one the manifest describes: a stored blob of another
        context, level or shape is corruption, whatever its checksums say."""
        m = self.manifest
        if header.profile_id != m.profile_id or (header.layers, header.heads, header.head_dim) != \
                (m.layers, m.heads, m.head_dim):
            raise codec.CorruptBitstream("chunk header disagrees with the manifest")
        if header.tokens != m.chunks[chunk.index].tokens or header.level != chunk.choice:
            raise codec.CorruptBitstream(
                f"chunk header says {header.tokens} tokens at level {header.level}; the manifest "
                f"says {m.chunks[chunk.index].tokens} tokens and we asked for level {chunk.choice}")

    def _on_end(self, chunk: _Chunk, at: float, cancelled: bool) -> None:
        if chunk.index in self.inflight:
            self.inflight.remove(chunk.index)
        report = chunk.report
        assert report is not None
        if cancelled:
            self._on_cancelled(chunk, at)
            return
        busy = max(at - self._busy_start(chunk), 0.0)
        self.last_end = at
        report.bytes += chunk.received
        report.seconds = at - chunk.requested_at
        report.finished_at = at - self.start
        report.busy_seconds = busy
        report.throughput_bps = 8 * chunk.received / busy if busy > 0 else 0.0
        if chunk.choice != TEXT:   # a few kB of token ids measure the round trip, not the link
            sample, self.pending_sample = estimator.pool_sample(self.pending_sample, chunk.received, busy)
            if sample is not None:
                self.history.append(sample)
        if self.s._on_chunk is not None:
            self.s._on_chunk(report)
        if chunk.refetch:
            self._refetch(chunk)
        elif chunk.choice != TEXT and (chunk.header is None or chunk.next_layer < chunk.header.layers):
            self._on_corrupt(chunk.index, chunk.next_layer,
                             codec.CorruptBitstream(f"chunk {chunk.index} ended before all its layers"))

    def _on_cancelled(self, chunk: _Chunk, at: float) -> None:
        """A CANCEL took effect: re-request the chunk as the cancel rule chose, or decide
        afresh for a chunk cancelled only because it was queued behind."""
        report = chunk.report
        assert report is not None
        report.bytes += chunk.received
        if chunk.begin_at is not None:
            self.last_end = at
        if chunk.switch_to is not None:
            choice = self._apply_switch(chunk)
        else:
            abandoned = chunk.choice
            choice, reason = self._decide_now(chunk.index)
            report.level = choice
            report.reason = reason or f"cancelled at level {abandoned}: re-decided behind a cancelled chunk"
            report.cancelled_levels.append(abandoned)  # type: ignore[arg-type]
        self._send_request(chunk, choice)

    def _apply_switch(self, chunk: _Chunk) -> Choice:
        """The cancel rule's choice for an abandoned chunk, recorded in its report: text
        instead of another level if a layer went out meanwhile (a chunk has one level)."""
        report, abandoned, choice = chunk.report, chunk.choice, chunk.switch_to
        assert report is not None and choice is not None
        if choice != TEXT and self.delivery.delivered_layers(chunk.index):
            choice = TEXT
        report.level, report.reason = choice, f"cancelled at level {abandoned}: predicted to miss the deadline"
        report.cancelled_levels.append(abandoned)  # type: ignore[arg-type]
        return choice

    def _decide_now(self, index: int) -> tuple[Choice, str | None]:
        """The policy's choice for chunk ``index`` with what is known right now."""
        choice, reason, _, _ = self._decide(index, time.monotonic())
        return choice, reason

    def _on_error(self, event: p.Error) -> None:
        """A non-fatal ERROR answers the oldest outstanding request."""
        if not self.inflight:
            raise ServerError(event.code, event.message)
        chunk = self.chunks[self.inflight.popleft()]
        if chunk.choice != TEXT and self.delivery.delivered_layers(chunk.index) == 0:
            chunk.report.reason = f"sender: {event.code}: {event.message}"  # type: ignore[union-attr]
            chunk.report.level = TEXT  # type: ignore[union-attr]
            self._send_request(chunk, TEXT)
            return
        raise ServerError(event.code, f"chunk {chunk.index}: {event.message}")

    def _on_corrupt(self, index: int, layer: int, exc: Exception) -> None:
        """A section (or the header) failed its checks: refetch the chunk once its current
        answer ends (its delivered layers are skipped); after MAX_CORRUPT_RETRIES refetches
        send it as text, even if some of its layers went out (they are superseded)."""
        chunk = self.chunks[index]
        if chunk.refetch:
            return   # one refetch per answer, however many of its sections are bad
        chunk.corrupt_retries += 1
        report = chunk.report
        assert report is not None
        if chunk.corrupt_retries > MAX_CORRUPT_RETRIES:
            if chunk.choice == TEXT:
                self.delivery.fail_chunk(index, FetchFailed(f"chunk {index} stays corrupt: {exc}", self.report))
                return
            report.reason = f"corrupt data: {exc}"
            report.level = TEXT
            chunk.choice = TEXT
        report.retries += 1
        chunk.refetch = True
        chunk.discard = True   # the rest of this answer is superseded by the refetch
        chunk.buffer = bytearray()
        if index not in self.inflight:
            self._refetch(chunk)
        self.wake.set()

    def _refetch(self, chunk: _Chunk) -> None:
        self._send_request(chunk, chunk.choice)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ faults
    @staticmethod
    def _schedule_reconnect(why: str) -> None:
        raise _NeedReconnect(why)

    async def _reconnect(self, why: str, *, abort: bool = False) -> None:
        """Reconnect (servers in turn, bounded backoff) and re-request what was in flight.

        ``abort``: the cancel rule drops this connection on purpose (what it has queued
        would take longer to arrive than a new connection takes to open): same sender,
        not counted against ``max_reconnects``, and the chunk it abandoned is
        re-requested at the rule's choice.
        """
        if not abort:
            self.reconnects += 1
            if self.reconnects > self.s.config.max_reconnects:
                raise ConnectionLost(f"giving up after {self.reconnects - 1} reconnects: {why}")
        if self.s._client is not None:
            self.s._client.abort()
        if not abort:
            self.s._server_index = (self.s._server_index + 1) % len(self.s._servers)
        self.paused = False   # a fresh connection reads
        await self.s._connect_any()
        self.last_activity = time.monotonic()
        pending = sorted(self.inflight)
        self.inflight.clear()
        self.last_end = None
        for index in pending:
            chunk = self.chunks[index]
            report = chunk.report
            assert report is not None
            if chunk.switch_to is not None:
                chunk.choice = self._apply_switch(chunk)
            elif self.delivery.delivered_layers(index) == 0 and chunk.choice != TEXT:
                # nothing went out yet: this chunk may be decided afresh
                chunk.choice, report.reason = self._decide_now(index)
                report.level = chunk.choice
            if not abort:
                report.retries += 1
            self._send_request(chunk, chunk.choice)  # type: ignore[arg-type]


class _NeedReconnect(Exception):
    """Raised inside event handling; the main loop reconnects."""
