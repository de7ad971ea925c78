"""The sender daemon: serves pre-encoded chunks from a store over kvwire's protocol.

A thin asyncio adapter around the sans-I/O ``protocol.Connection``: one reader
task per connection turns bytes into events, one answer task answers requests in
FIFO order (the protocol's rule). A chunk is sent as its blob header followed by
its layer sections (split further only when a section exceeds the frame limit),
draining the socket after every part: a slow receiver holds at most one part in
our buffers and never makes us read more from the store (backpressure).
The daemon itself is stateless (every answer comes from the store), so any number
of senders can share one redis store.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Iterator

import codec

from . import protocol as p
from .frames import PART_HEADER
from .manifest import Manifest
from .stores import ChunkNotFound, ContextNotFound, ProfileNotFound, Store, StoreError

log = logging.getLogger("kvwire.server")

SERVER_NAME = "kvwire-sender/1"
_READ_SIZE = 256 * 1024
_WRITE_HIGH_WATER = 4 * 1024 * 1024


@dataclass(frozen=True)
class ServerConfig:
    #: close a connection with nothing outstanding after this long without a byte
    idle_timeout: float = 60.0
    #: give up on a receiver that takes this long to accept one part (it stopped reading)
    write_timeout: float = 30.0
    max_frame: int = p.DEFAULT_MAX_FRAME
    #: on close(): how long open connections may finish what they are sending
    shutdown_grace: float = 5.0


class _Cancelled:
    """Set of chunk indexes the receiver cancelled, shared by reader and answerer."""

    def __init__(self) -> None:
        self._chunks: set[int] = set()

    def add(self, chunk: int) -> None:
        self._chunks.add(chunk)

    def take(self, chunk: int) -> bool:
        if chunk in self._chunks:
            self._chunks.discard(chunk)
            return True
        return False


def blob_parts(blob: bytes, limit: int) -> Iterator[memoryview]:
    """The blob header, then each layer section, each cut to at most ``limit`` bytes.

    Receivers cut sections by the header's lengths, not by part boundaries, so a
    section may span parts when it exceeds the frame limit.
    """
    view = memoryview(blob)
    header = codec.parse_header(view)
    bounds = [0, header.size] + [header.section_offset(l + 1) for l in range(header.layers)]
    if bounds[-1] != len(blob):
        raise codec.CorruptBitstream(f"stored blob is {len(blob)} bytes, its header says {bounds[-1]}")
    for start, end in zip(bounds, bounds[1:]):
        for piece in range(start, end, limit):
            yield view[piece:min(end, piece + limit)]


class _ConnectionHandler:
    def __init__(self, store: Store, config: ServerConfig, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.store = store
        self.config = config
        self.reader = reader
        self.writer = writer
        self.conn = p.Connection(p.Role.SERVER, max_frame=config.max_frame)
        self.requests: asyncio.Queue[p.Event | None] = asyncio.Queue()
        self.cancelled = _Cancelled()
        self.manifest: Manifest | None = None
        self.busy = False
        self.closing = False
        self._reading: asyncio.Task | None = None

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
            with contextlib.suppress(Exception):
                await self.writer.wait_closed()

    def shut_down(self) -> None:
        """Stop reading new requests; the queued ones are answered (within the grace)."""
        if self._reading is not None:
            self._reading.cancel()

    # ---------------------------------------------------------------- receiving
    async def _read_loop(self) -> None:
        while not self.closing:
            idle = not self.busy and self.requests.empty()
            try:
                data = await asyncio.wait_for(self.reader.read(_READ_SIZE),
                                              self.config.idle_timeout if idle else None)
            except asyncio.TimeoutError:
                await self._fatal("timeout", f"idle for {self.config.idle_timeout:g} s")
                return
            except (ConnectionError, OSError):
                return
            try:
                events = self.conn.receive_data(data)
            except p.ProtocolError as exc:
                for event in exc.events:
                    self._dispatch(event)
                log.info("protocol error from %s: %s", self._peer(), exc)
                with contextlib.suppress(Exception):
                    self.writer.write(self.conn.error_frame(exc))
                return
            for event in events:
                if not self._dispatch(event):
                    return

    def _dispatch(self, event: p.Event) -> bool:
        """Route one received event; False when the connection is over."""
        if isinstance(event, p.Hello):
            version = max(set(event.versions) & set(p.SUPPORTED_VERSIONS))
            self.writer.write(self.conn.send(p.Welcome(version=version, server=SERVER_NAME,
                                                       max_frame=self.config.max_frame)))
        elif isinstance(event, (p.Open, p.GetProfile, p.Request)):
            self.requests.put_nowait(event)
        elif isinstance(event, p.Cancel):
            self.cancelled.add(event.chunk)
        elif isinstance(event, (p.Close, p.ConnectionClosed, p.Error)):
            return False
        return True

    # ---------------------------------------------------------------- answering
    async def _answer_loop(self) -> None:
        while (request := await self.requests.get()) is not None:
            self.busy = True
            try:
                await self._answer(request)
            except (ConnectionError, OSError, asyncio.TimeoutError):
                self.closing = True
                self.writer.transport.abort()
                return
            except Exception:  # a bug must cost this connection, never leave the peer hanging
                log.exception("answering %r failed; closing the connection", request)
                self.closing = True
                self.writer.transport.abort()
                return
            finally:
                self.busy = False

    async def _answer(self, request: p.Event) -> None:
        try:
            if isinstance(request, p.Open):
                self.manifest = await self.store.get_manifest(request.context_id)
                await self._write(self.conn.send(p.Manifest(data=self.manifest.to_bytes())))
            elif isinstance(request, p.GetProfile):
                data = memoryview(await self.store.get_profile_bytes(request.profile_id))
                piece = self.conn.send_limit - 17  # the id and the continuation byte
                for start in range(0, max(len(data), 1), piece):
                    end = min(start + piece, len(data))
                    await self._write(*self.conn.send_parts(p.Profile(
                        profile_id=request.profile_id, data=data[start:end], more=end < len(data))))
            else:
                await self._send_chunk(request)
        except (ContextNotFound, ChunkNotFound, ProfileNotFound) as exc:
            await self._write(self.conn.send(p.Error("not_found", str(exc))))
        except ValueError as exc:
            await self._write(self.conn.send(p.Error("bad_request", str(exc))))
        except StoreError as exc:
            await self._write(self.conn.send(p.Error("unavailable", f"store unavailable: {exc}")))
        except codec.CorruptBitstream as exc:
            log.error("corrupt blob in the store: %s", exc)
            await self._write(self.conn.send(p.Error("internal", f"stored chunk is corrupt: {exc}")))

    async def _send_chunk(self, request: p.Request) -> None:
        chunk, level = request.chunk, request.level
        if self.cancelled.take(chunk):
            await self._write(self.conn.send(p.ChunkEnd(chunk=chunk, cancelled=True)))
            return
        manifest = self.manifest
        assert manifest is not None  # the protocol refuses REQUEST before MANIFEST
        if chunk >= len(manifest.chunks):
            raise ValueError(f"chunk {chunk} out of range: context has {len(manifest.chunks)} chunks")
        if level == p.TEXT_LEVEL:
            data = await self.store.get_text(manifest.context_id, manifest.version, chunk)
            await self._write(self.conn.send(p.Text(chunk=chunk, data=data)))
            return
        if level >= len(manifest.level_distortion):
            raise ValueError(f"level {level} out of range: context has {len(manifest.level_distortion)} levels")
        blob = await self.store.get_chunk(manifest.context_id, manifest.version, chunk, level)
        parts = list(blob_parts(blob, self.conn.send_limit - PART_HEADER.size))
        await self._write(self.conn.send(p.ChunkBegin(chunk=chunk, level=level, total_bytes=len(blob),
                                                      parts=len(parts))))
        for index, part in enumerate(parts):
            if self.cancelled.take(chunk):
                await self._write(self.conn.send(p.ChunkEnd(chunk=chunk, cancelled=True)))
                return
            await self._write(*self.conn.send_parts(p.ChunkPart(chunk=chunk, part=index, data=part)))
        await self._write(self.conn.send(p.ChunkEnd(chunk=chunk)))

    async def _write(self, *pieces: bytes | memoryview) -> None:
        self.writer.writelines(pieces)
        await asyncio.wait_for(self.writer.drain(), self.config.write_timeout)

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
        self._server: asyncio.base_events.Server | None = None
        self._handlers: dict[asyncio.Task, _ConnectionHandler] = {}

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> "Sender":
        self._server = await asyncio.start_server(self._accept, host, port, limit=_READ_SIZE)
        return self

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
        handler = _ConnectionHandler(self.store, self.config, reader, writer)
        task = asyncio.current_task()
        assert task is not None
        self._handlers[task] = handler
        try:
            await handler.run()
        except Exception:  # one broken connection must never take the daemon down
            log.exception("connection handler failed")
        finally:
            self._handlers.pop(task, None)

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
                config: ServerConfig | None = None) -> Sender:
    """Start a sender daemon on ``host:port`` (port 0: any free port) and return it."""
    return await Sender(store, config).start(host, port)
