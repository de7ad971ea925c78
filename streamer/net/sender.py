"""The sender daemon: serves pre-encoded chunks from a store over kvwire's protocol.

A thin asyncio adapter around the sans-I/O ``protocol.Connection``: one reader
task per connection turns bytes into events, one answer task answers requests in
FIFO order (the protocol's rule). A chunk is sent as its blob header followed by
its layer sections (all of them, or for a continuation those from the request's
``first_layer`` on: slices of the stored blob, never re-encoded), cut into parts of at
most ``_PART_BYTES``,
draining the socket after every part: a slow receiver holds at most one part in
our buffers and never makes us read more from the store (backpressure).
The daemon itself is stateless (every answer comes from the store), so any number
of senders can share one redis store. A LOOKUP (protocol version 3) is answered from
``Store.lookup_prefix``: the stored context holding the longest prefix of the chain.

Security and limits (all in :class:`ServerConfig`): an auth token (HMAC
challenge-response in the handshake, required by default off loopback), TLS through
an ``ssl.SSLContext``, a cap on concurrent sessions, on queued requests per session,
a handshake/partial-frame read timeout (slowloris), an idle timeout and a write
timeout (a receiver that stops reading).

Stored data is checked before any of it is sent: a blob or text whose size is not the
one the manifest states, a blob whose header disagrees with its length, a profile over
``MAX_PROFILE_BYTES`` (receivers refuse those) or a manifest that does not parse is
answered with ERROR "internal" naming the fault, and logged. Sizes are asked of the
store before reading (``Store.chunk_size`` and friends), so an item far larger than it
should be is refused without being loaded: what one answer holds in memory is bounded
by the manifest's sizes and ``MAX_PROFILE_BYTES``.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import socket
import ssl as _ssl
from dataclasses import dataclass, field
from typing import Any, Optional

import codec

from streamer.wire import auth, protocol as p
from streamer.wire.frames import PART_HEADER
from streamer.wire.manifest import Manifest, ManifestError, validate_context_id
from streamer.net.client import MAX_PROFILE_BYTES
from streamer.net.config import require_int, require_max_frame, require_positive
from streamer.net.sender_metrics import SenderMetrics, new_session_id, session_logger
from streamer.net.throttle import Throttle
from streamer.store import ChunkNotFound, ContextNotFound, ProfileNotFound, Store, StoreError

log = logging.getLogger("kvwire.server")

SERVER_NAME = "kvwire-sender/1"
_READ_SIZE = 256 * 1024
#: What one connection keeps queued, in this process and in the kernel: a CANCEL stops
#: only bytes not queued yet, so these bound what a cancelled chunk still sends (the
#: cancel rule, ``adapt.cancel.COMMITTED_BYTES``, assumes their sum). Chunk parts are
#: cut to _PART_BYTES so a CANCEL is seen between them.
_WRITE_HIGH_WATER = 128 * 1024
_NOTSENT_LOWAT = 64 * 1024
_PART_BYTES = 128 * 1024
#: connections refused at max_sessions that wait (up to a second) for their peer to read
#: the ERROR; past that many at once, one is closed straight after it (a connection
#: flood must not hold descriptors beyond max_sessions + this)
MAX_REFUSING = 64


class InsecureConfiguration(ValueError):
    """The daemon would listen off loopback with no authentication."""


class StoredDataInvalid(Exception):
    """Something read from the store is not what the manifest (or the format) says:
    answered with ERROR "internal" and this message, never sent on."""


@dataclass(frozen=True)
class ServerConfig:
    #: close a connection with nothing outstanding after this long without a request
    idle_timeout: float = 60.0
    #: the handshake (HELLO .. AUTH) must be done, and a frame whose first byte arrived
    #: must be complete, within this many seconds (also the TLS handshake timeout)
    read_timeout: float = 10.0
    #: give up on a receiver that takes this long to accept one part (it stopped reading)
    write_timeout: float = 30.0
    #: largest data frame payload accepted and announced in WELCOME (control frames: 64 KiB)
    max_frame: int = p.DEFAULT_MAX_FRAME
    #: connections served at once; one more gets a fatal ERROR "unavailable"
    max_sessions: int = 1024
    #: requests (OPEN / GET_PROFILE / REQUEST) queued per connection before the sender
    #: stops reading from it (TCP backpressure) until the answers catch up
    max_pending_requests: int = 256
    #: on close(): how long open connections may finish what they are sending
    shutdown_grace: float = 5.0
    #: shared secret (str/bytes, >= 16 bytes): receivers must authenticate with it
    auth_token: Optional[auth.Token] = field(default=None, repr=False)
    #: TLS: a server-side ssl.SSLContext (see streamer.net.tls.server_context)
    ssl: Optional[_ssl.SSLContext] = None
    #: allow listening on a non-loopback address without authentication
    allow_insecure: bool = False
    #: Prometheus metrics (a SenderMetrics, or True for a fresh one; see Sender.metrics)
    metrics: Optional[SenderMetrics] = field(default=None, repr=False, compare=False)
    #: protocol versions offered (a receiver gets the highest it shares); fewer than all
    #: to roll a fleet forward in steps, or to test against an older sender
    versions: tuple[int, ...] = p.SUPPORTED_VERSIONS

    def __post_init__(self) -> None:
        for name in ("idle_timeout", "read_timeout", "write_timeout", "shutdown_grace"):
            require_positive("ServerConfig", name, getattr(self, name))
        for name in ("max_sessions", "max_pending_requests"):
            require_int("ServerConfig", name, getattr(self, name), 1)
        require_max_frame("ServerConfig", self.max_frame)
        versions = tuple(self.versions)
        if not versions or not set(versions) <= set(p.SUPPORTED_VERSIONS) or len(set(versions)) != len(versions):
            raise ValueError(f"ServerConfig.versions must be distinct versions among {p.SUPPORTED_VERSIONS}, "
                             f"got {self.versions!r}")
        object.__setattr__(self, "versions", versions)
        if self.ssl is not None and not isinstance(self.ssl, _ssl.SSLContext):
            raise TypeError(f"ServerConfig.ssl must be an ssl.SSLContext, got {type(self.ssl).__name__}")
        object.__setattr__(self, "auth_token", auth.normalize_token(self.auth_token))
        if self.metrics is True:
            object.__setattr__(self, "metrics", SenderMetrics())
        elif self.metrics is False:
            object.__setattr__(self, "metrics", None)
        elif self.metrics is not None and not isinstance(self.metrics, SenderMetrics):
            raise TypeError(f"ServerConfig.metrics must be a SenderMetrics, True or None, "
                            f"got {type(self.metrics).__name__}")

    @property
    def authenticates(self) -> bool:
        """True when receivers must prove who they are (a token, or TLS client certificates)."""
        return self.auth_token is not None or (
            self.ssl is not None and self.ssl.verify_mode == _ssl.CERT_REQUIRED)


def is_loopback(host: Any) -> bool:
    """Whether every address in ``host`` (a name, an address or a list; None = all
    interfaces) is loopback. Host names other than ``localhost`` count as not loopback."""
    if host is None:
        return False
    if not isinstance(host, str):
        return all(is_loopback(h) for h in host) and bool(host)
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: Any, config: ServerConfig) -> None:
    """Refuse (InsecureConfiguration) to listen off loopback without authentication."""
    if is_loopback(host) or config.authenticates:
        if not is_loopback(host) and config.ssl is None:
            log.warning("listening on %s with an auth token but without TLS: the token is "
                        "never sent, but the data travels in clear", host)
        return
    if not config.allow_insecure:
        raise InsecureConfiguration(
            f"refusing to listen on {host or 'all interfaces'} without authentication: set an "
            f"auth token (kvwire serve --auth-token-file FILE or ${auth.TOKEN_ENV}; "
            f"serve(..., auth_token=...)), or accept the risk with --insecure-no-auth "
            f"(allow_insecure=True)")
    log.warning("listening on %s WITHOUT authentication (insecure mode): anyone who can "
                "reach this port can read every stored context", host or "all interfaces")


def blob_parts(blob: bytes, limit: int, first_layer: int = 0) -> list[memoryview]:
    """The blob header, then the sections of layers ``first_layer`` .. ``layers-1``, each
    cut to at most ``limit`` bytes: views of ``blob``, nothing copied or re-encoded.

    Receivers cut sections by the header's lengths, not by part boundaries, so a
    section may span parts when it exceeds the frame limit. StoredDataInvalid when the
    header is corrupt, disagrees with the blob's length, or has no layer ``first_layer``.
    """
    view = memoryview(blob)
    try:
        header = codec.parse_header(view)
    except codec.CorruptBitstream as exc:
        raise StoredDataInvalid(f"stored chunk is corrupt: {exc}") from exc
    if header.total_size != len(blob):
        raise StoredDataInvalid(f"stored chunk is corrupt: it is {len(blob)} bytes, its header says "
                                f"{header.total_size}")
    if not 0 <= first_layer < header.layers:
        raise StoredDataInvalid(f"stored chunk is corrupt: its header has {header.layers} layers, "
                                f"the manifest has a layer {first_layer}")
    spans = [(0, header.size)] + [(header.section_offset(layer), header.section_offset(layer + 1))
                                  for layer in range(first_layer, header.layers)]
    return [view[piece:min(end, piece + limit)] for start, end in spans for piece in range(start, end, limit)]


def _check_size(size: int, stated: int, what: str) -> None:
    """StoredDataInvalid unless ``size`` is the ``stated`` one (the manifest's)."""
    if size != stated:
        raise StoredDataInvalid(f"stored {what} is {size} bytes, the manifest says {stated}")


def _check_profile_size(size: int, profile_id: str) -> None:
    """StoredDataInvalid if a stored profile is larger than receivers accept."""
    if size > MAX_PROFILE_BYTES:
        raise StoredDataInvalid(f"stored profile {profile_id} is {size} bytes, "
                                f"more than the {MAX_PROFILE_BYTES} receivers accept")


@dataclass
class _PeerFaultLogs:
    """One throttle per kind of fault a peer can repeat at will by reconnecting (a wrong
    token, a malformed frame, a connection dropped for stalling or closed early), shared
    by all of a sender's connections: a client looping over them must not fill the log,
    so past the first line each kind logs at most one line per second, saying how many
    went unlogged."""

    auth: Throttle = field(default_factory=Throttle)
    protocol: Throttle = field(default_factory=Throttle)
    dropped: Throttle = field(default_factory=Throttle)


class _ConnectionHandler:
    def __init__(self, store: Store, config: ServerConfig, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, fault_logs: _PeerFaultLogs) -> None:
        self.store = store
        self.fault_logs = fault_logs
        self.config = config
        self.reader = reader
        self.writer = writer
        self.conn = p.Connection(p.Role.SERVER, max_frame=config.max_frame,
                                 auth_token=config.auth_token, versions=config.versions)
        self.metrics = config.metrics
        self.session_id = new_session_id()
        #: every log line of this connection carries its session id (record.session)
        self.log = session_logger(log, self.session_id, writer.get_extra_info("peername"))
        # (request, when it was received) in arrival order
        self.requests: asyncio.Queue[tuple[p.Event, float] | None] = asyncio.Queue()
        self.manifest: Manifest | None = None
        self.busy = False
        self.closing = False
        self._reading: asyncio.Task | None = None
        self._answered = asyncio.Event()   # set after each answer: room in the queue
        self._loop = asyncio.get_running_loop()
        self._last_activity = self._loop.time()

    async def run(self) -> None:
        answers = asyncio.create_task(self._answer_loop())
        self._reading = asyncio.create_task(self._read_loop())
        try:
            with contextlib.suppress(asyncio.CancelledError):
                await self._reading
        finally:
            self.requests.put_nowait(None)
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(answers, self.config.shutdown_grace)
            answers.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await answers
            if self.conn.state is p.State.READY:
                with contextlib.suppress(Exception):
                    self.writer.write(self.conn.send(p.Close()))
            self.writer.close()
            try:   # a peer that stopped reading cannot hold the socket open past this
                await asyncio.wait_for(self.writer.wait_closed(), self.config.write_timeout)
            except asyncio.CancelledError:
                self.writer.transport.abort()
                raise
            except Exception:
                self.writer.transport.abort()

    def shut_down(self) -> None:
        """Stop reading new requests; the queued ones are answered (within the grace)."""
        if self._reading is not None:
            self._reading.cancel()

    # ---------------------------------------------------------------- receiving
    _HANDSHAKE = (p.State.AWAIT_HELLO, p.State.SEND_WELCOME, p.State.AWAIT_AUTH,
                  p.State.SEND_AUTH_OK)

    def _deadline(self, handshake_end: float, frame_end: float | None) -> tuple[float | None, str]:
        """The earliest applicable deadline and what it means; None when none applies."""
        cfg = self.config
        found: list[tuple[float, str]] = []
        if self.conn.state in self._HANDSHAKE:
            found.append((handshake_end, f"handshake not completed within {cfg.read_timeout:g} s"))
        if frame_end is not None:
            found.append((frame_end, f"incomplete frame for {cfg.read_timeout:g} s"))
        if not self.busy and self.requests.empty():
            found.append((self._last_activity + cfg.idle_timeout,
                          f"idle for {cfg.idle_timeout:g} s"))
        if not found:
            return None, ""
        return min(found)

    async def _read_loop(self) -> None:
        cfg = self.config
        handshake_end = self._loop.time() + cfg.read_timeout
        frame_end: float | None = None   # deadline of the partial frame buffered, if any
        while not self.closing:
            # bounded memory whatever the client does: stop reading (TCP backpressure)
            # while the answerer is max_pending_requests behind
            while self.requests.qsize() >= cfg.max_pending_requests and not self.closing:
                self._answered.clear()
                await self._answered.wait()
            if self.closing:
                return
            deadline, why = self._deadline(handshake_end, frame_end)
            now = self._loop.time()
            if deadline is not None and deadline <= now:
                self.fault_logs.dropped.log(self.log, logging.INFO, "dropping %s: %s", self._peer(), why)
                self._error("timeout")
                await self._fatal("timeout", why)
                return
            # while busy no deadline may apply yet; look again after idle_timeout anyway
            wait = (deadline if deadline is not None else now + cfg.idle_timeout) - now
            try:
                data = await asyncio.wait_for(self.reader.read(_READ_SIZE), wait)
            except asyncio.TimeoutError:
                continue   # re-evaluate: the deadline may have moved (an answer finished)
            except (ConnectionError, OSError):
                return
            try:
                events = self.conn.receive_data(data)
            except p.ProtocolError as exc:
                for event in exc.events:   # the state is ERROR now: nothing more is sent
                    if isinstance(event, (p.Open, p.GetProfile, p.Lookup, p.Request)):
                        self._dispatch(event)
                self._error("auth" if isinstance(exc, p.AuthenticationError)
                            else getattr(exc, "code", "protocol"))
                if isinstance(exc, p.AuthenticationError):
                    self.fault_logs.auth.log(self.log, logging.WARNING, "authentication failed from %s: %s",
                                             self._peer(), exc)
                else:
                    self.fault_logs.protocol.log(self.log, logging.INFO, "protocol error from %s: %s",
                                                 self._peer(), exc)
                with contextlib.suppress(Exception):
                    self.writer.write(self.conn.error_frame(exc))
                return
            if not self.conn.receiving_frame:
                frame_end = None
            elif frame_end is None or events:   # a new frame began in this read
                frame_end = self._loop.time() + cfg.read_timeout
            for event in events:
                if not self._dispatch(event):
                    return

    def _dispatch(self, event: p.Event) -> bool:
        """Route one received event; False when the connection is over. A CANCEL needs
        no routing: the protocol marked its request in the ledger, which ``_send_chunk``
        asks (``Connection.head_cancelled``)."""
        if isinstance(event, p.Hello):
            version = max(set(event.versions) & set(self.conn.versions))
            required = self.conn.auth_required
            self._send_now(self.conn.send(p.Welcome(
                version=version, server=SERVER_NAME, max_frame=self.config.max_frame,
                auth=p.AUTH_REQUIRED if required else p.AUTH_NONE,
                nonce=auth.new_nonce() if required else "")))
        elif isinstance(event, p.Auth):   # the connection checked the MAC already
            self._send_now(self.conn.send(self.conn.auth_ok_event()))
            self._last_activity = self._loop.time()
        elif isinstance(event, (p.Open, p.GetProfile, p.Lookup, p.Request)):
            self._last_activity = self._loop.time()
            self.requests.put_nowait((event, self._loop.time()))
        elif isinstance(event, (p.Close, p.ConnectionClosed, p.Error)):
            return False
        return True

    # ---------------------------------------------------------------- answering
    async def _answer_loop(self) -> None:
        try:
            while (item := await self.requests.get()) is not None:
                request, received = item
                self.busy = True
                try:
                    kind = await self._answer(request)
                    if self.metrics is not None:
                        self.metrics.request_seconds.labels(kind=kind).observe(
                            self._loop.time() - received)
                except (ConnectionError, OSError, asyncio.TimeoutError) as exc:
                    self._error("write_timeout" if isinstance(exc, asyncio.TimeoutError)
                                else "connection_lost")
                    self.fault_logs.dropped.log(self.log, logging.INFO, "dropping %s: it accepted no data for %g s",
                                                self._peer(), self.config.write_timeout)
                    self.closing = True
                    self.writer.transport.abort()
                    return
                except Exception as exc:  # a bug must cost this connection, never leave the peer hanging
                    if isinstance(exc, p.LocalProtocolError) and self.conn.state is p.State.CLOSED:
                        # the peer closed the connection while this answer was due (a
                        # receiver abandoning a chunk does): nothing to answer, no bug
                        self._error("connection_lost")
                        self.fault_logs.dropped.log(self.log, logging.INFO,
                                                    "%s closed the connection before %r was answered",
                                                    self._peer(), request)
                    else:
                        self._error("handler_failed")
                        self.log.exception("answering %r failed; closing the connection", request)
                    self.closing = True
                    self.writer.transport.abort()
                    return
                finally:
                    self.busy = False
                    self._last_activity = self._loop.time()
                    self._answered.set()
        finally:
            self._answered.set()   # never leave the reader waiting for room

    async def _answer(self, request: p.Event) -> str:
        """Answer one request; its kind for the latency histogram."""
        kind = ("open" if isinstance(request, p.Open) else "profile" if isinstance(request, p.GetProfile)
                else "lookup" if isinstance(request, p.Lookup)
                else "text" if request.level == p.TEXT_LEVEL else "chunk")  # type: ignore[attr-defined]
        try:
            if isinstance(request, p.Open):
                # before the store sees it: no path traversal, no key injection
                context_id = validate_context_id(request.context_id)
                try:
                    self.manifest = await self.store.get_manifest(context_id)
                except ManifestError as exc:
                    raise StoredDataInvalid(f"stored manifest of context {context_id!r} is corrupt: {exc}") \
                        from None
                await self._write(self.conn.send(p.ManifestData(data=self.manifest.to_bytes())))
            elif isinstance(request, p.Lookup):
                await self._write(self.conn.send(await self._lookup(request.chain)))
            elif isinstance(request, p.GetProfile):
                # the size first: an oversize profile is refused without being loaded
                _check_profile_size(await self.store.profile_size(request.profile_id), request.profile_id)
                data = memoryview(await self.store.get_profile_bytes(request.profile_id))
                _check_profile_size(len(data), request.profile_id)  # what was read, should it have changed
                piece = self.conn.send_limit - 17  # the id and the continuation byte
                for start in range(0, max(len(data), 1), piece):
                    end = min(start + piece, len(data))
                    await self._write(*self.conn.send_parts(p.ProfileData(
                        profile_id=request.profile_id, data=data[start:end], more=end < len(data))))
            else:
                await self._send_chunk(request)
        except (ContextNotFound, ChunkNotFound, ProfileNotFound) as exc:
            self._error("not_found")
            await self._write(self.conn.send(p.Error("not_found", str(exc))))
        except ValueError as exc:
            self._error("bad_request")
            await self._write(self.conn.send(p.Error("bad_request", str(exc))))
        except StoreError as exc:   # details (paths, hosts) stay in the log
            self._error("unavailable")
            self.log.error("store error answering %r: %s", request, exc)
            await self._write(self.conn.send(p.Error("unavailable", "store unavailable")))
        except StoredDataInvalid as exc:
            self._error("internal")
            self.log.error("invalid data in the store answering %r: %s", request, exc)
            await self._write(self.conn.send(p.Error("internal", str(exc))))
        return kind

    async def _lookup(self, chain: tuple[str, ...]) -> p.Prefix:
        """The PREFIX answering a LOOKUP of ``chain``: the store's longest match. A match
        the protocol could not carry (more chunks than asked, an invalid context id) is
        the store's fault: StoredDataInvalid, never sent on."""
        match = await self.store.lookup_prefix(chain)
        if match is None:
            return p.Prefix(context_id=None, chunks=0)
        if not 1 <= match.chunks <= len(chain):
            raise StoredDataInvalid(f"the store matched {match.chunks} chunks of a chain of {len(chain)}")
        try:
            validate_context_id(match.context_id)
        except ValueError as exc:
            raise StoredDataInvalid(f"the store matched an invalid context: {exc}") from None
        return p.Prefix(context_id=match.context_id, chunks=match.chunks)

    async def _send_chunk(self, request: p.Request) -> None:
        chunk, level = request.chunk, request.level
        # a CANCEL is marked on its request in the protocol's ledger (which the reader
        # fed it to) and ends with that request's answer: answers go in FIFO order, so
        # this request is the ledger's head
        if self.conn.head_cancelled(chunk):
            await self._write(self.conn.send(p.ChunkEnd(chunk=chunk, cancelled=True)))
            if self.metrics is not None:
                self.metrics.cancelled.inc()
            return
        manifest = self.manifest
        assert manifest is not None  # the protocol refuses REQUEST before MANIFEST
        manifest.check_request(chunk, level, request.first_layer)   # ValueError: bad_request
        # each item's size before reading it (an oversize one is refused without being
        # loaded), then what was read, should the item have changed in between
        if level == p.TEXT_LEVEL:
            stated, what = manifest.chunks[chunk].text_bytes, f"chunk {chunk}'s text"
            _check_size(await self.store.text_size(manifest.context_id, manifest.version, chunk), stated, what)
            data = await self.store.get_text(manifest.context_id, manifest.version, chunk)
            _check_size(len(data), stated, what)
            await self._write(self.conn.send(p.Text(chunk=chunk, data=data)))
            if self.metrics is not None:
                self.metrics.chunks.labels(level="text").inc()
                self.metrics.text_fallbacks.inc()
            return
        stated, what = manifest.chunks[chunk].sizes[level], f"chunk {chunk} at level {level}"
        _check_size(await self.store.chunk_size(manifest.context_id, manifest.version, chunk, level), stated, what)
        blob = await self.store.get_chunk(manifest.context_id, manifest.version, chunk, level)
        _check_size(len(blob), stated, what)
        parts = list(blob_parts(blob, min(self.conn.send_limit - PART_HEADER.size, _PART_BYTES), request.first_layer))
        await self._write(self.conn.send(p.ChunkBegin(chunk=chunk, level=level, total_bytes=sum(map(len, parts)),
                                                      parts=len(parts), first_layer=request.first_layer)))
        for index, part in enumerate(parts):
            if self.conn.head_cancelled(chunk):
                await self._write(self.conn.send(p.ChunkEnd(chunk=chunk, cancelled=True)))
                if self.metrics is not None:
                    self.metrics.cancelled.inc()
                return
            await self._write(*self.conn.send_parts(p.ChunkPart(chunk=chunk, part=index, data=part)))
        await self._write(self.conn.send(p.ChunkEnd(chunk=chunk)))
        if self.metrics is not None:
            self.metrics.chunks.labels(level=str(level)).inc()

    async def _write(self, *pieces: bytes | memoryview) -> None:
        if self.writer.transport.is_closing():
            # the peer went away mid-answer; uvloop's transports raise RuntimeError on a
            # write after close (asyncio's drop it), so say it as the lost connection it is
            raise ConnectionResetError("the connection closed while an answer was being sent")
        self.writer.writelines(pieces)
        if self.metrics is not None:
            self.metrics.bytes_sent.inc(sum(len(piece) for piece in pieces))
        await asyncio.wait_for(self.writer.drain(), self.config.write_timeout)

    def _send_now(self, data: bytes) -> None:
        """Write without draining (handshake answers, small)."""
        self.writer.write(data)
        if self.metrics is not None:
            self.metrics.bytes_sent.inc(len(data))

    def _error(self, code: str) -> None:
        if self.metrics is not None:
            self.metrics.errors.labels(code=code).inc()

    async def _fatal(self, code: str, message: str) -> None:
        with contextlib.suppress(Exception):
            await self._write(self.conn.send(p.Error(code, message, fatal=True)))

    def _peer(self) -> str:
        return str(self.writer.get_extra_info("peername"))


class Sender:
    """A running sender daemon; ``port`` is the bound port, ``close()`` shuts it down."""

    def __init__(self, store: Store, config: ServerConfig | None = None) -> None:
        self.store = store
        self.config = config or ServerConfig()
        #: the Prometheus metrics (ServerConfig.metrics), None when not collected
        self.metrics: SenderMetrics | None = self.config.metrics
        self._server: asyncio.base_events.Server | None = None
        self._handlers: dict[asyncio.Task, _ConnectionHandler] = {}
        #: refused connections waiting for their peer to read the ERROR
        self._refusing = 0
        #: one log line per second at most for refusals: a connection flood must not flood the log
        self._refusal_log = Throttle()
        self._fault_logs = _PeerFaultLogs()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> "Sender":
        """Listen on ``host:port``; InsecureConfiguration off loopback without auth."""
        check_exposure(host, self.config)
        self._server = await asyncio.start_server(
            self._accept, host, port, limit=_READ_SIZE, ssl=self.config.ssl,
            ssl_handshake_timeout=self.config.read_timeout if self.config.ssl else None)
        return self

    @property
    def sessions(self) -> int:
        """Connections being served now."""
        return len(self._handlers)

    @property
    def port(self) -> int:
        assert self._server is not None, "start() the sender first"
        return self._server.sockets[0].getsockname()[1]

    @property
    def address(self) -> tuple[str, int]:
        assert self._server is not None, "start() the sender first"
        return self._server.sockets[0].getsockname()[:2]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER)
        sock = writer.get_extra_info("socket")
        if sock is not None and hasattr(socket, "TCP_NOTSENT_LOWAT"):   # Linux, macOS
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, _NOTSENT_LOWAT)
        metrics = self.metrics
        if len(self._handlers) >= self.config.max_sessions:
            if metrics is not None:
                metrics.refused.inc()
                metrics.errors.labels(code="unavailable").inc()
            await self._refuse(reader, writer)
            return
        handler = _ConnectionHandler(self.store, self.config, reader, writer, self._fault_logs)
        task = asyncio.current_task()
        assert task is not None
        self._handlers[task] = handler
        if metrics is not None:
            metrics.sessions.inc()
            metrics.sessions_open.inc()
        handler.log.debug("session opened from %s", handler._peer())
        try:
            await handler.run()
        except Exception:  # one broken connection must never take the daemon down
            handler._error("handler_failed")
            handler.log.exception("connection handler failed")
        finally:
            self._handlers.pop(task, None)
            if metrics is not None:
                metrics.sessions_open.dec()
            handler.log.debug("session closed")

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """At capacity: a fatal ERROR "unavailable" (the receiver tries another sender)."""
        limit = self.config.max_sessions
        self._refusal_log.log(log, logging.WARNING, "refusing %s: %d sessions already (max_sessions)",
                              writer.get_extra_info("peername"), limit, counted="more refused")
        frame = p.Connection(p.Role.SERVER).send(p.Error(
            "unavailable", f"sender at capacity ({limit} sessions); try another sender", fatal=True))
        self._refusing += 1
        try:
            writer.write(frame)
            if writer.can_write_eof():
                writer.write_eof()
            if self._refusing <= MAX_REFUSING:
                # read what the client already sent (its HELLO) until it closes, briefly, so
                # closing does not reset the connection before it read the ERROR
                async with asyncio.timeout(min(1.0, self.config.read_timeout)):
                    while await reader.read(_READ_SIZE):
                        pass
        except (Exception, asyncio.TimeoutError):
            pass
        finally:
            self._refusing -= 1
            if writer.transport.get_write_buffer_size():
                writer.transport.abort()
            else:
                writer.close()

    async def close(self) -> None:
        """Stop accepting; give open connections ``shutdown_grace`` seconds, then cut them."""
        if self._server is None:
            return
        self._server.close()
        for handler in self._handlers.values():
            handler.shut_down()
        if self._handlers:
            _, pending = await asyncio.wait(set(self._handlers), timeout=2 * self.config.shutdown_grace)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None

    async def __aenter__(self) -> "Sender":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def serve(store: Store, host: str = "127.0.0.1", port: int = 0,
                config: ServerConfig | None = None, *, auth_token: auth.Token | None = None,
                ssl: _ssl.SSLContext | None = None, allow_insecure: bool | None = None) -> Sender:
    """Start a sender daemon on ``host:port`` (port 0: any free port) and return it.

    ``auth_token``, ``ssl`` and ``allow_insecure`` override the same ``config`` fields.
    Off loopback, a token (or TLS client certificates) is required unless
    ``allow_insecure=True``: InsecureConfiguration (a ValueError) otherwise.
    """
    config = config or ServerConfig()
    overrides: dict[str, Any] = {}
    if auth_token is not None:
        overrides["auth_token"] = auth_token
    if ssl is not None:
        overrides["ssl"] = ssl
    if allow_insecure is not None:
        overrides["allow_insecure"] = allow_insecure
    if overrides:
        config = dataclasses.replace(config, **overrides)
    return await Sender(store, config).start(host, port)

