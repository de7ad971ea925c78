"""The receiver's socket: an asyncio Protocol around the sans-I/O ``Connection``.

A Protocol (not StreamReader) because the receive path is the hot one: bytes go
straight from ``data_received`` into the protocol's frame buffer, and each event
is queued with the monotonic time of the read that completed it, which is what
the throughput estimator needs (arrival times at the receiver, not send times).
"""
from __future__ import annotations

import asyncio
import contextlib
import ssl as _ssl
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence, Union

from streamer.wire import auth, protocol as p
from streamer.wire.events import Level
from streamer.wire.manifest import Manifest

CLIENT_NAME = "kvwire-receiver/1"
#: Largest profile accepted from a sender (bytes, all its PROFILE frames together). A
#: profile is dominated by its float32 PCA bases, 8 x layers x channels^2 bytes:
#: ~270 MB for Llama-3-8B (32 layers, 1024 KV channels), ~680 MB for 80 such layers.
#: The sender refuses to send a larger one; ``get_profile`` refuses one frame past it.
MAX_PROFILE_BYTES = 1 << 30


class StreamError(Exception):
    """Base of the receiver's errors."""


class ServerError(StreamError):
    """The sender answered with an ERROR frame."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class ConnectionLost(StreamError):
    """The connection closed, reset, stalled or broke the protocol."""


class ProfileTooLarge(ConnectionLost):
    """A sender sent more profile bytes than the receiver accepts (``MAX_PROFILE_BYTES``);
    the connection is dropped (another sender may be tried)."""


class LookupUnsupported(StreamError):
    """The sender speaks a protocol version without LOOKUP (before version 3): it cannot
    say which prefixes it holds. Retrying the same sender cannot help."""


class AuthenticationFailed(StreamError):
    """The handshake's authentication failed: the sender refused our token (or we have
    none and it requires one), or the sender could not prove it knows the token (or does
    not authenticate at all while we have a token). Retrying cannot help."""


@dataclass(frozen=True)
class Arrival:
    event: p.Event
    at: float  # time.monotonic() of the read that completed the event


class ArrivalQueue(asyncio.Queue):
    """The received events, counting the payload bytes they hold (``nbytes``)."""

    nbytes = 0

    def _put(self, item: Arrival) -> None:
        self.nbytes += len(getattr(item.event, "data", b""))
        super()._put(item)

    def _get(self) -> Arrival:
        item = super()._get()
        self.nbytes -= len(getattr(item.event, "data", b""))
        return item


class _ReceiverProtocol(asyncio.Protocol):
    def __init__(self, conn: p.Connection, queue: asyncio.Queue[Arrival]) -> None:
        self.conn = conn
        self.queue = queue
        self.transport: asyncio.Transport | None = None
        #: called after every read's events are queued: the session's backpressure check
        self.on_data: Callable[[], None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        try:
            events = self.conn.receive_data(data)
        except p.ProtocolError as exc:
            for event in exc.events:
                self.queue.put_nowait(Arrival(event, now))
            with contextlib.suppress(Exception):
                self.transport.write(self.conn.error_frame(exc))  # type: ignore[union-attr]
            code = exc.code if exc.code in p.ERROR_CODES else "protocol"
            self.queue.put_nowait(Arrival(p.Error(code, str(exc), fatal=True), now))
            self.transport.abort()  # type: ignore[union-attr]
            return
        for event in events:
            self.queue.put_nowait(Arrival(event, now))
        if self.on_data is not None:
            self.on_data()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.queue.put_nowait(Arrival(p.ConnectionClosed(clean=exc is None), time.monotonic()))


class ClientConnection:
    """One connection to a sender: handshake, requests out, timed events in."""

    def __init__(self, transport: asyncio.Transport, protocol: _ReceiverProtocol,
                 queue: asyncio.Queue[Arrival], address: tuple[str, int]) -> None:
        self._transport = transport
        self._protocol = protocol
        self.queue = queue
        self.address = address
        self.rtt: float = 0.0
        self.closed = False

    @property
    def conn(self) -> p.Connection:
        return self._protocol.conn

    @classmethod
    async def connect(cls, host: str, port: int, *, timeout: float = 5.0,
                      max_frame: int = p.DEFAULT_MAX_FRAME,
                      auth_token: Optional[auth.Token] = None,
                      ssl: Union[_ssl.SSLContext, bool, None] = None,
                      server_hostname: Optional[str] = None,
                      versions: Iterable[int] = p.SUPPORTED_VERSIONS) -> "ClientConnection":
        """Connect (over TLS when ``ssl`` is a context or True) and complete the handshake,
        authenticating with ``auth_token`` when given and offering the protocol
        ``versions`` (default: all this build speaks; the sender picks the highest it
        shares). The whole handshake must finish within ``timeout`` seconds.
        AuthenticationFailed when authentication fails, ServerError when the sender
        refuses us (e.g. "unavailable": at capacity), ConnectionLost on any other failure."""
        loop = asyncio.get_running_loop()
        queue = ArrivalQueue()
        conn = p.Connection(p.Role.CLIENT, max_frame=max_frame, auth_token=auth_token, versions=versions)
        if ssl is True:
            ssl = _ssl.create_default_context()
        tls = {} if not ssl else {"ssl": ssl, "server_hostname": server_hostname or host,
                                  "ssl_handshake_timeout": timeout}
        deadline = loop.time() + timeout
        try:
            # asyncio.timeout, not wait_for: 3.11's wait_for can lose a cancel that lands
            # as the inner call completes (and leak the connection it made)
            async with asyncio.timeout(timeout):
                transport, protocol = await loop.create_connection(
                    lambda: _ReceiverProtocol(conn, queue), host, port, **tls)
        except _ssl.SSLError as exc:
            raise ConnectionLost(f"TLS handshake with {host}:{port} failed: {exc}") from exc
        except (OSError, asyncio.TimeoutError) as exc:
            raise ConnectionLost(f"cannot connect to {host}:{port}: {exc or 'timeout'}") from exc
        client = cls(transport, protocol, queue, (host, port))
        try:
            start = time.monotonic()
            if conn.state is p.State.START:   # else the sender spoke first (a refusal)
                client.send(p.Hello(versions=conn.versions, client=CLIENT_NAME))
            arrival = await client.next(max(deadline - loop.time(), 0.0))
            client._expect_handshake(arrival.event, p.Welcome)
            client.rtt = arrival.at - start
            if conn.state is p.State.SEND_AUTH:
                client.send(conn.auth_event())
                arrival = await client.next(max(deadline - loop.time(), 0.0))
                client._expect_handshake(arrival.event, p.AuthOk)
        except BaseException:
            client.abort()
            raise
        return client

    def _expect_handshake(self, event: p.Event, wanted: type) -> None:
        where = f"{self.address[0]}:{self.address[1]}"
        if isinstance(event, wanted):
            return
        if isinstance(event, p.Error):
            if event.code == "auth":
                raise AuthenticationFailed(f"authentication with {where} failed: {event.message}")
            raise ServerError(event.code, event.message)
        if isinstance(event, p.ConnectionClosed):
            raise ConnectionLost(f"handshake with {where} failed: the connection closed")
        raise ConnectionLost(f"handshake with {where} failed: got {event!r:.200}")

    @property
    def queued_bytes(self) -> int:
        """Payload bytes received and queued, not yet taken by the session."""
        return getattr(self.queue, "nbytes", 0)

    def set_on_data(self, hook: Callable[[], None] | None) -> None:
        """Call ``hook`` after each socket read has been queued (backpressure checks)."""
        self._protocol.on_data = hook

    def pause_reading(self) -> None:
        """Stop taking bytes from the socket (backpressure: TCP stalls the sender)."""
        with contextlib.suppress(Exception):
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        with contextlib.suppress(Exception):
            self._transport.resume_reading()

    def send(self, event: p.Event) -> None:
        if self.closed or self._transport.is_closing():
            raise ConnectionLost("connection is closed")
        self._transport.writelines(self.conn.send_parts(event))

    def request(self, chunk: int, level: Level, first_layer: int = 0, *, manifest: Manifest | None = None) -> None:
        """Send REQUEST for ``chunk`` at ``level``: the whole chunk, or with ``first_layer``
        > 0 a continuation (the blob's header and the sections of layers ``first_layer``
        on; needs ``conn.continuations``, i.e. a sender speaking protocol version 2).
        Checked against ``manifest`` first when given (ValueError for a chunk, level or
        first layer it has not, which the sender would refuse with ERROR "bad_request");
        LocalProtocolError when the connection cannot carry it (a continuation on a
        version 1 connection or of text, a second request for the chunk), nothing sent."""
        if manifest is not None:
            manifest.check_request(chunk, level, first_layer)
        self.send(p.Request(chunk=chunk, level=level, first_layer=first_layer))

    async def next(self, timeout: float | None) -> Arrival:
        """The next event; ConnectionLost if none comes within ``timeout`` seconds."""
        try:
            async with asyncio.timeout(timeout):   # not wait_for: see connect()
                return await self.queue.get()
        except asyncio.TimeoutError:
            raise ConnectionLost(f"no data from {self.address[0]}:{self.address[1]} for {timeout:g} s") from None

    async def call(self, request: p.Event, answer: type, timeout: float) -> p.Event:
        """Send a request with nothing else outstanding and await its answer."""
        self.send(request)
        arrival = await self.next(timeout)
        event = arrival.event
        if isinstance(event, p.Error):
            raise ServerError(event.code, event.message)
        if not isinstance(event, answer):
            raise ConnectionLost(f"expected {answer.__name__}, got {event!r}")
        return event

    async def lookup(self, chain: Sequence[str], timeout: float) -> p.Prefix:
        """Which stored context holds the longest prefix of ``chain`` (1 .. ``p.MAX_LOOKUP_CHAIN``
        lowercase-hex hashes, ``streamer.store.prefix.prefix_chain``): one round trip, with
        nothing else outstanding. The answer's ``context_id`` is None (and ``chunks`` 0) when
        not even the first chunk is stored. LookupUnsupported on a connection below protocol
        version 3, LocalProtocolError (nothing sent) for a chain the protocol refuses,
        ServerError when the sender's store fails."""
        if not self.conn.lookups:
            raise LookupUnsupported(f"{self.address[0]}:{self.address[1]} speaks protocol version "
                                    f"{self.conn.version}; lookups need version {p.LOOKUP_VERSION}")
        answer = await self.call(p.Lookup(chain=tuple(chain)), p.Prefix, timeout)
        assert isinstance(answer, p.Prefix)
        return answer

    async def get_profile(self, profile_id: str, timeout: float, *,
                          max_bytes: int = MAX_PROFILE_BYTES) -> bytes:
        """A profile's bytes, reassembled from as many PROFILE frames as the sender used.

        ProfileTooLarge (the connection is aborted, its unread frames dropped) as soon as
        the frames received exceed ``max_bytes``: at most one frame is held past it.
        """
        pieces = []
        received = 0
        event = await self.call(p.GetProfile(profile_id=profile_id), p.ProfileData, timeout)
        while True:
            if event.profile_id != profile_id:
                raise ConnectionLost(f"asked for profile {profile_id}, the sender sends {event.profile_id}")
            received += len(event.data)
            if received > max_bytes:
                self.abort()
                raise ProfileTooLarge(f"profile {profile_id} from {self.address[0]}:{self.address[1]} "
                                      f"exceeds {max_bytes} bytes (MAX_PROFILE_BYTES); refused")
            pieces.append(event.data)
            if not event.more:
                return b"".join(pieces)
            event = (await self.next(timeout)).event
            if isinstance(event, p.Error):
                raise ServerError(event.code, event.message)
            if not isinstance(event, p.ProfileData):
                raise ConnectionLost(f"expected the rest of profile {profile_id}, got {event!r}")

    @property
    def reusable(self) -> bool:
        """Open, handshake done, nothing outstanding and nothing unread: a new OPEN may follow."""
        return (not self.closed and not self._transport.is_closing() and self.conn.state is p.State.READY
                and not self.conn.outstanding and self.queue.empty())

    def abort(self) -> None:
        self.closed = True
        self._transport.abort()

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.conn.state is p.State.READY:
            with contextlib.suppress(Exception):
                self._transport.write(self.conn.send(p.Close()))
        self._transport.close()
