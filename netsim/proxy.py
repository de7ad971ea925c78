"""``ShapingProxy``: a loopback TCP proxy that imposes a link's rate, delay and faults.

The kernel here has no ``netem``, so delay, jitter, stalls and resets come from user
space. All timing decisions live in the pure classes of ``shaping.py``; this module only
moves bytes: read a large chunk, ask the bucket, sleep, write. Large reads (256 KiB) and
one timer per *piece* rather than per packet keep ~1 Gbit/s within one core.

Usage::

    async with ShapingProxy(upstream=("127.0.0.1", port), trace=trace, delay_ms=20) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)

"up" is client->upstream, "down" is upstream->client. Each direction is one shared link
(its token bucket is shared by all connections, like a real bottleneck); faults apply per
connection.
"""
from __future__ import annotations

import asyncio
import itertools
import random
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Literal

from netsim.shaping import Cut, DelayLine, FaultSchedule, KiB, Stall, TokenBucket
from netsim.trace import Trace

READ_SIZE = 256 * KiB
# How often a sleeping sender re-reads the bucket: the bound on how late a runtime
# set_trace() takes effect, and on how long a zero-rate link is polled.
POLL_S = 0.02
# Bytes a delay line may hold before reading pauses. Shaped links never get near it
# (the bucket bounds the queue to rate x delay); it bounds unshaped-but-delayed links.
QUEUE_HIGH_WATER = 32 * 1024 * KiB
# The bottleneck's queue, like a tbf ``limit``: what the proxy reads ahead from the
# upstream beyond the piece it is shaping (asyncio pauses the socket at twice
# UPSTREAM_BUFFER) plus its kernel receive buffer, fixed at UPSTREAM_RCVBUF (autotuning
# would grow it to megabytes while the link is fast, a queue no router keeps). Bytes
# beyond it wait in the sender's socket, where TCP backpressure (and a CANCEL) reach them.
UPSTREAM_BUFFER = 64 * KiB
UPSTREAM_RCVBUF = 128 * KiB

Direction = Literal["up", "down", "both"]


@dataclass(frozen=True)
class LinkSpec:
    """One direction's link. ``trace`` None means unshaped."""

    trace: Trace | None = None
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    stalls: tuple[Stall, ...] = ()
    cut: Cut | None = None


@dataclass
class ConnectionStats:
    """Bytes forwarded into each direction's link for one connection."""

    id: int
    opened: float
    up_bytes: int = 0
    down_bytes: int = 0
    closed: float | None = None
    ended_by: str = ""


@dataclass
class ProxyStats:
    connections: int = 0
    up_bytes: int = 0
    down_bytes: int = 0
    per_connection: list[ConnectionStats] = field(default_factory=list)


def _as_trace(trace: Trace | float | None) -> Trace | None:
    if trace is None or isinstance(trace, Trace):
        return trace
    return Trace.constant(float(trace), 1.0)


class ShapingProxy:
    """Async context manager; ``trace`` may be a :class:`Trace`, a constant Mbit/s, or
    None (unshaped). ``trace``/``delay_ms``/``jitter_ms`` apply to both directions unless
    ``up``/``down`` give a full :class:`LinkSpec` for that direction."""

    def __init__(self, upstream: tuple[str, int], trace: Trace | float | None = None,
                 delay_ms: float = 0.0, jitter_ms: float = 0.0, *,
                 up: LinkSpec | None = None, down: LinkSpec | None = None,
                 listen: tuple[str, int] = ("127.0.0.1", 0), seed: int = 0) -> None:
        both = LinkSpec(trace=_as_trace(trace), delay_ms=delay_ms, jitter_ms=jitter_ms)
        self.upstream = upstream
        self.specs = {"up": up or both, "down": down or both}
        self._listen = listen
        self._seed = seed
        self._buckets: dict[str, TokenBucket] = {}
        self._server: asyncio.Server | None = None
        self._conns: dict[asyncio.Task, _Connection | None] = {}
        self._ids = itertools.count(1)
        self.stats = ProxyStats()

    # ----------------------------------------------------------------- lifecycle
    async def __aenter__(self) -> ShapingProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        now = time.monotonic()
        self._buckets = {d: TokenBucket(self.specs[d].trace, now) for d in ("up", "down")}
        self._server = await asyncio.start_server(self._accept, *self._listen, limit=READ_SIZE)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        # End connections rather than cancel their tasks: asyncio's stream callback
        # (3.11) logs a cancelled client_connected_cb as an error.
        for task, conn in list(self._conns.items()):
            if conn is None:
                task.cancel()
            else:
                conn.end("reset")
        await asyncio.gather(*self._conns, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    @property
    def address(self) -> tuple[str, int]:
        if self._server is None:
            raise RuntimeError("proxy is not started")
        return self._server.sockets[0].getsockname()[:2]

    @property
    def port(self) -> int:
        return self.address[1]

    # ----------------------------------------------------------------- control
    def set_trace(self, trace: Trace | float | None, direction: Direction = "both") -> None:
        """Change a link's capacity now; the new trace's time 0 is now. Senders waiting
        on the old rate notice within ``POLL_S``."""
        now = time.monotonic()
        for d in ("up", "down") if direction == "both" else (direction,):
            self._buckets[d].set_trace(_as_trace(trace), now)

    # ----------------------------------------------------------------- connections
    async def _accept(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns[task] = None
        try:
            try:
                ureader, uwriter = await asyncio.open_connection(*self.upstream, limit=UPSTREAM_BUFFER)
                # fixed before the sender says anything: the kernel stops autotuning it
                uwriter.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF,
                                                            UPSTREAM_RCVBUF)
            except (OSError, asyncio.CancelledError):
                _reset(cwriter)
                return
            stats = ConnectionStats(id=next(self._ids), opened=time.monotonic())
            self.stats.connections += 1
            self.stats.per_connection.append(stats)
            conn = self._conns[task] = _Connection(self, stats, (creader, cwriter), (ureader, uwriter))
            await conn.run()
        finally:
            del self._conns[task]

    def _count(self, direction: str, stats: ConnectionStats, n: int) -> None:
        if direction == "up":
            stats.up_bytes += n
            self.stats.up_bytes += n
        else:
            stats.down_bytes += n
            self.stats.down_bytes += n


class _Connection:
    """Both directions of one proxied connection, and how it ends."""

    def __init__(self, proxy: ShapingProxy, stats: ConnectionStats,
                 client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                 upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
        self.proxy = proxy
        self.stats = stats
        self.client = client
        self.upstream = upstream
        self.ended = False
        self.tasks: list[asyncio.Task] = []

    async def run(self) -> None:
        pumps = [
            asyncio.create_task(self._pump("up", self.client[0], self.upstream[1])),
            asyncio.create_task(self._pump("down", self.upstream[0], self.client[1])),
        ]
        self.tasks = list(pumps)
        cut_times = [(s.cut.at_s, s.cut.action) for s in self.proxy.specs.values()
                     if s.cut is not None and s.cut.at_s is not None]
        if cut_times:
            self.tasks.append(asyncio.create_task(self._cut_at(*min(cut_times))))
        await asyncio.wait(pumps)
        self.end("close")  # no-op if a cut, an error or the proxy ended it first
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def end(self, action: str) -> None:
        """Close (FIN after pending writes) or reset (RST, pending data dropped) both
        sockets and stop the other tasks."""
        if self.ended:
            return
        self.ended = True
        self.stats.closed = time.monotonic()
        self.stats.ended_by = action
        for writer in (self.client[1], self.upstream[1]):
            if action == "reset":
                _reset(writer)
            else:
                writer.close()
        me = asyncio.current_task()
        for t in self.tasks:
            if t is not me:
                t.cancel()

    async def _cut_at(self, at_s: float, action: str) -> None:
        await asyncio.sleep(max(0.0, self.stats.opened + at_s - time.monotonic()))
        self.end(action)

    async def _pump(self, direction: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        spec = self.proxy.specs[direction]
        bucket = self.proxy._buckets[direction]
        faults = FaultSchedule(spec.stalls, spec.cut)
        delay = None
        if spec.delay_ms or spec.jitter_ms:
            rng = random.Random(f"{self.proxy._seed}-{self.stats.id}-{direction}")
            delay = DelayLine(spec.delay_ms / 1e3, spec.jitter_ms / 1e3, rng)
        out = _Output(writer, delay)
        sent = 0
        try:
            while faults.bytes_before_cut(sent) != 0:
                chunk = await reader.read(min(READ_SIZE, bucket.piece(time.monotonic())))
                if not chunk:
                    await out.finish(eof=True)
                    return
                view = memoryview(chunk)
                while view and faults.bytes_before_cut(sent) != 0:
                    await self._wait_stall(faults)
                    n = min(len(view), bucket.piece(time.monotonic()))
                    allowed = faults.bytes_before_cut(sent)
                    if allowed is not None:
                        n = min(n, allowed)
                    while (wait := bucket.take(n, time.monotonic())) > 0:
                        await asyncio.sleep(min(wait, POLL_S))
                    await out.send(view[:n])
                    view = view[n:]
                    sent += n
                    self.proxy._count(direction, self.stats, n)
            await out.finish(eof=False)
            assert faults.cut is not None
            self.end(faults.cut.action)
        except OSError:  # ConnectionResetError, BrokenPipeError, ...
            self.end("reset")  # a reset on one side propagates to the other, like a router
        finally:
            out.cancel()

    async def _wait_stall(self, faults: FaultSchedule) -> None:
        until = faults.stalled_until(time.monotonic() - self.stats.opened)
        if until is not None:
            await asyncio.sleep(self.stats.opened + until - time.monotonic())


class _Output:
    """Writes one direction's pieces, through a release-time queue when it has delay.

    With delay, the pump only stamps and enqueues; a separate task writes each piece at
    its release time, so delay is added once per piece and never throttles throughput.
    """

    def __init__(self, writer: asyncio.StreamWriter, delay: DelayLine | None) -> None:
        self.writer = writer
        self.delay = delay
        self.queued = 0
        self.queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        self.room = asyncio.Event()
        self.room.set()
        self.task = asyncio.create_task(self._drain_queue()) if delay else None

    async def send(self, data: memoryview) -> None:
        if self.delay is None:
            self.writer.write(data)
            await self.writer.drain()
            return
        self._check_writer_task()
        self.queue.put_nowait((self.delay.release_at(time.monotonic()), bytes(data)))
        self.queued += len(data)
        if self.queued > QUEUE_HIGH_WATER:
            self.room.clear()
            await self.room.wait()

    async def finish(self, eof: bool) -> None:
        """Deliver everything queued, then half-close if ``eof``."""
        if self.task is not None:
            self.queue.put_nowait(None)
            await self.task
        await self.writer.drain()
        if eof and self.writer.can_write_eof():
            self.writer.write_eof()

    def cancel(self) -> None:
        if self.task is None:
            return
        if self.task.done():
            if not self.task.cancelled():
                self.task.exception()  # mark retrieved: the pump already handled the end
        else:
            self.task.cancel()

    def _check_writer_task(self) -> None:
        if self.task is not None and self.task.done() and not self.task.cancelled():
            exc = self.task.exception()
            if exc is not None:
                raise exc

    async def _drain_queue(self) -> None:
        while True:
            item = await self.queue.get()
            if item is None:
                return
            release, data = item
            wait = release - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            # Write every piece already due in one go, then wait for the socket once.
            n = len(data)
            self.writer.write(data)
            while not self.queue.empty():
                head = self.queue._queue[0]  # type: ignore[attr-defined]  # peek without popping
                if head is None or head[0] > time.monotonic():
                    break
                self.queue.get_nowait()
                self.writer.write(head[1])
                n += len(head[1])
            await self.writer.drain()
            self.queued -= n
            if self.queued <= QUEUE_HIGH_WATER // 2:
                self.room.set()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Abort with SO_LINGER 0 so the peer gets an RST (ConnectionResetError), not a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass  # already closed: nothing left to reset
    writer.transport.abort()
