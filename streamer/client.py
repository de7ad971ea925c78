"""The receiver's socket: an asyncio Protocol around the sans-I/O ``Connection``.

A Protocol (not StreamReader) because the receive path is the hot one: bytes go
straight from ``data_received`` into the protocol's frame buffer, and each event
is queued with the monotonic time of the read that completed it, which is what
the throughput estimator needs (arrival times at the receiver, not send times).
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

from . import protocol as p

CLIENT_NAME = "kvwire-receiver/1"


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


@dataclass(frozen=True)
class Arrival:
    event: p.Event
    at: float  # time.monotonic() of the read that completed the event


class _ReceiverProtocol(asyncio.Protocol):
    def __init__(self, conn: p.Connection, queue: asyncio.Queue[Arrival]) -> None:
        self.conn = conn
        self.queue = queue
        self.transport: asyncio.Transport | None = None

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
            self.queue.put_nowait(Arrival(p.Error("protocol", str(exc), fatal=True), now))
            self.transport.abort()  # type: ignore[union-attr]
            return
        for event in events:
            self.queue.put_nowait(Arrival(event, now))

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
                      max_frame: int = p.DEFAULT_MAX_FRAME) -> "ClientConnection":
        """Connect and complete the handshake; ConnectionLost on any failure."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Arrival] = asyncio.Queue()
        conn = p.Connection(p.Role.CLIENT, max_frame=max_frame)
        try:
            transport, protocol = await asyncio.wait_for(
                loop.create_connection(lambda: _ReceiverProtocol(conn, queue), host, port), timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            raise ConnectionLost(f"cannot connect to {host}:{port}: {exc or 'timeout'}") from exc
        client = cls(transport, protocol, queue, (host, port))
        start = time.monotonic()
        client.send(p.Hello(versions=tuple(p.SUPPORTED_VERSIONS), client=CLIENT_NAME))
        arrival = await client.next(timeout)
        if not isinstance(arrival.event, p.Welcome):
            client.abort()
            raise ConnectionLost(f"handshake with {host}:{port} failed: got {arrival.event!r}")
        client.rtt = arrival.at - start
        return client

    def send(self, event: p.Event) -> None:
        if self.closed or self._transport.is_closing():
            raise ConnectionLost("connection is closed")
        self._transport.writelines(self.conn.send_parts(event))

    async def next(self, timeout: float | None) -> Arrival:
        """The next event; ConnectionLost if none comes within ``timeout`` seconds."""
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
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

    async def get_profile(self, profile_id: str, timeout: float) -> bytes:
        """A profile's bytes, reassembled from as many PROFILE frames as the sender used."""
        pieces = []
        event = await self.call(p.GetProfile(profile_id=profile_id), p.Profile, timeout)
        pieces.append(event.data)
        while event.more:
            event = (await self.next(timeout)).event
            if isinstance(event, p.Error):
                raise ServerError(event.code, event.message)
            if not isinstance(event, p.Profile):
                raise ConnectionLost(f"expected the rest of profile {profile_id}, got {event!r}")
            pieces.append(event.data)
        return b"".join(pieces)

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
