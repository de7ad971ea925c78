"""The receiver daemon's cap on concurrent client connections.

Every connection holds a file descriptor, and while it is served a handler task and
buffers. Partial request heads are closed after ``requests.HEAD_TIMEOUT``, but a flood
of connections opened at once would still exhaust the process's descriptors, after
which the daemon could accept nothing, open no cache file and reach no sender. So
``ConnectionGate``, the listener's protocol factory, hands at most ``max_connections``
connections at once to aiohttp (a connection counts from its accept until it is
closed); each one more is answered at once, without reading its
request, with ``REFUSAL`` (503, ``Retry-After``, ``Connection: close``) and closed.

So that a refused client reads the 503 rather than a reset (closing a socket with
unread input resets it), a refused connection is half-closed after the 503 and what it
sends is discarded until it closes, for at most ``REFUSAL_LINGER`` seconds; at most
``MAX_REFUSING`` linger at once, and past that one is closed straight after the 503
(which then may arrive as a reset). Descriptors held by client connections are thus
at most ``max_connections + MAX_REFUSING`` (plus reclaimed ones until their close, within
one turn of the event loop).

An idle keep-alive connection -- one that has had its answer written in full and has
sent nothing since -- would otherwise hold its place until aiohttp's keep-alive timeout
(``requests.HEAD_TIMEOUT``), so a few hundred pooled clients could lock everyone else
out while doing nothing. At the cap, a new connection therefore takes the place of the
connection idle the longest, which is closed (as nginx reuses its keep-alive
connections when it runs out); it is refused only when no connection is idle. HTTP/1.1
lets a server close an idle connection at any time (RFC 9112 §9.3): a client that sent a
request on it in that instant, or pipelined one behind an answer, retries as it would
after any keep-alive close.
"""
from __future__ import annotations

import asyncio
import json
import logging
import resource
from typing import Callable, cast

from aiohttp import web

from streamer.net.throttle import Throttle

log = logging.getLogger("kvwire.receiver")

DEFAULT_MAX_CONNECTIONS = 256
#: seconds a refused connection may stay open for its client to read the 503
REFUSAL_LINGER = 1.0
#: refused connections lingering at once
MAX_REFUSING = 64
#: seconds a refused client is told to wait before it tries again
RETRY_AFTER = 1


def refusal(max_connections: int) -> bytes:
    """The whole 503 response to a connection past the cap (the daemon's JSON error shape)."""
    body = json.dumps({"error": f"the receiver serves at most {max_connections} connections at once; "
                                f"retry after {RETRY_AFTER} s", "status": 503}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json; charset=utf-8\r\n"
            b"Retry-After: %d\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % (RETRY_AFTER, len(body)) + body)


class _Refusal(asyncio.Protocol):
    """One refused connection: the 503, a half-close, input discarded until EOF or the linger ends."""

    def __init__(self, gate: "ConnectionGate") -> None:
        self.gate = gate
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's TCP transport is not an asyncio.Transport subclass, but is one)
        transport = self.transport = cast(asyncio.Transport, transport)
        transport.write(self.gate.response)
        if len(self.gate.refusing) >= MAX_REFUSING or not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        self.gate.refusing.add(self)
        self.timer = asyncio.get_running_loop().call_later(REFUSAL_LINGER, transport.abort)

    def data_received(self, data: bytes) -> None:
        pass   # the request of a refused connection is never read

    def eof_received(self) -> bool:
        return False   # the transport closes

    def connection_lost(self, exc: Exception | None) -> None:
        self.gate.refusing.discard(self)
        if self.timer is not None:
            self.timer.cancel()


class _Counted(asyncio.Protocol):
    """aiohttp's protocol for one connection, counted by the gate until the connection is lost."""

    def __init__(self, inner: web.RequestHandler, gate: "ConnectionGate") -> None:
        self.inner = inner
        self.gate = gate

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.gate.by_handler[self.inner] = self
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.gate.idle.pop(self, None)   # a request (or more of one) is coming: not idle
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.gate.open -= 1
        self.gate.idle.pop(self, None)
        self.gate.reclaimed.discard(self)
        self.gate.by_handler.pop(self.inner, None)
        self.inner.connection_lost(exc)


class ConnectionGate:
    """The protocol factory of the daemon's listener (``loop.create_server(gate, ...)``):
    aiohttp's (``AppRunner.server``), counted, below ``max_connections`` open connections;
    at the cap, the place of the longest idle keep-alive connection (closed), or else a
    refusal. The count is the gate's own, from the accept to the loss of the
    connection: the event loop may accept a batch of connections before any of them is
    made, so aiohttp's list of connections can lag behind. The daemon's HTTP layer says
    when a request starts and when its answer is written (``request_started``,
    ``answer_written``); a connection is idle from the latter until it sends a byte."""

    def __init__(self, server: web.Server, max_connections: int, on_refuse: Callable[[], None],
                 on_reclaim: Callable[[], None] = lambda: None) -> None:
        self.server = server
        self.max_connections = max_connections
        self.response = refusal(max_connections)
        #: connections handed to aiohttp and not yet lost
        self.open = 0
        #: refused connections lingering for their client to read the 503
        self.refusing: set[_Refusal] = set()
        #: idle keep-alive connections, longest idle first (a dict keeps insertion order)
        self.idle: dict[_Counted, None] = {}
        #: idle connections closed to make room, not yet lost (their places are taken)
        self.reclaimed: set[_Counted] = set()
        #: each served connection by its aiohttp handler (``request.protocol``)
        self.by_handler: dict[web.RequestHandler, _Counted] = {}
        self._on_refuse = on_refuse
        self._on_reclaim = on_reclaim
        self._log = Throttle()

    def request_started(self, handler: web.RequestHandler) -> None:
        if (counted := self.by_handler.get(handler)) is not None:
            self.idle.pop(counted, None)

    def answer_written(self, handler: web.RequestHandler) -> None:
        """The request's answer is in the transport: the connection is idle until it sends
        again (bytes already read, e.g. a pipelined request, are not seen here)."""
        if (counted := self.by_handler.get(handler)) is not None and counted not in self.reclaimed:
            self.idle.pop(counted, None)
            self.idle[counted] = None   # now the most recently idle

    def __call__(self) -> asyncio.BaseProtocol:
        if self.open - len(self.reclaimed) >= self.max_connections and self.idle:
            self._reclaim()
        if self.open - len(self.reclaimed) < self.max_connections:
            self.open += 1
            return _Counted(self.server(), self)
        self._on_refuse()
        self._log.log(log, logging.WARNING, "refusing a connection: %d open already (max_connections)",
                      self.max_connections, counted="more refused")
        return _Refusal(self)

    def _reclaim(self) -> None:
        """Close the longest idle connection; the new one takes its place at once."""
        oldest = next(iter(self.idle))
        del self.idle[oldest]
        self.reclaimed.add(oldest)
        self._on_reclaim()
        oldest.inner.force_close()   # its answer is written: the transport flushes it, then closes

    def close(self) -> None:
        """Cut the refused connections still lingering (the listener is closed first)."""
        for refused in list(self.refusing):
            if refused.transport is not None:
                refused.transport.abort()


def check_descriptors(max_connections: int) -> None:
    """Warn at start when the process's descriptor limit leaves no room for the cap:
    each served connection may also hold a sender connection and a cache file."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 3 * max_connections + MAX_REFUSING
    if soft != resource.RLIM_INFINITY and soft < needed:
        log.warning("the descriptor limit (ulimit -n) is %d: with --max-connections %d allow about %d, "
                    "or lower --max-connections", soft, max_connections, needed)
