"""Hostile continuations (protocol version 2's ``first_layer``), for ``kvwire bench adversarial``.

A small real context (synthetic KV, a calibrated profile, every level) is put into a
file store in a temporary folder and served by a sender in this process.

Sender side: a raw client sends a REQUEST naming a first layer that is wrong in one way
(past the context's layers, the largest the frame allows, one past it, on a text
request, on a version 1 connection). A bound the manifest holds is answered with a
non-fatal ERROR "bad_request" and the same connection then serves a whole chunk; a
frame the protocol forbids ends the connection with a fatal ERROR "protocol". The row
says what came back, the seconds from the frame sent to that answer, the growth of peak
RSS, and whether the sender then still serves a new connection (``daemon_up``).
``continuation_of_the_last_layer_repeated`` asks for the last layer alone of each chunk
over and over: the sender reads each whole blob to send its header and one section, so
its row says how many bytes the answers carried and how many the store read for them.

Receiver side (no socket): a hostile sender's answer to a continuation, fed to the
receiver's protocol state machine and ``Assembly``: a CHUNK_BEGIN that does not repeat
the first layer, one announcing more bytes than the whole blob, and a header whose
sections from the first layer do not add up to the bytes announced.
"""
from __future__ import annotations

import asyncio
import json
import struct
import tempfile
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from streamer.wire import protocol as p
from streamer.wire.frames import MAX_FIRST_LAYER
from streamer.wire.manifest import Manifest

LAYERS, HEADS, HEAD_DIM, CHUNK_TOKENS, CHUNKS = 4, 2, 16, 128, 2
#: continuations of the last layer asked for, one after the other
REPEATS = 400


@dataclass
class _Served:
    """The context being served: its manifest, a blob, and the sender's port."""

    manifest: Manifest
    blob: bytes
    port: int


class _RawClient:
    """A connection whose frames may be anything (control frames built by hand)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, versions: tuple[int, ...]) -> None:
        self.reader, self.writer = reader, writer
        self.conn = p.Connection(p.Role.CLIENT, versions=versions)

    @classmethod
    async def open(cls, port: int, versions: tuple[int, ...] = p.SUPPORTED_VERSIONS) -> "_RawClient":
        """Connected, handshake done, the context open."""
        client = cls(*await asyncio.open_connection("127.0.0.1", port), versions)
        client.writer.write(client.conn.send(p.Hello(versions=versions, client="hostile")))
        await client.until(p.Welcome)
        client.writer.write(client.conn.send(p.Open(context_id="ctx", slo=None)))
        await client.until(p.ManifestData)
        return client

    def write_control(self, ftype: p.FrameType, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.writer.write(struct.pack("<IHH", len(data), int(ftype), 0) + data)

    async def until(self, *kinds: type) -> list[p.Event]:
        """Events up to one of ``kinds``, an ERROR or the end of the connection."""
        got: list[p.Event] = []
        async with asyncio.timeout(10.0):
            while not got or not isinstance(got[-1], (*kinds, p.Error, p.ConnectionClosed)):
                got += self.conn.receive_data(await self.reader.read(1 << 16))
        return got

    def close(self) -> None:
        self.writer.transport.abort()


def _described(event: p.Event) -> str:
    if isinstance(event, p.Error):
        return f"{'fatal ' if event.fatal else ''}ERROR {event.code}: {event.message[:160]}"
    return type(event).__name__


async def _refused(served: _Served, request: dict, versions: tuple[int, ...] = p.SUPPORTED_VERSIONS, *,
                   ledger: bool = False) -> str:
    """Send ``request`` (through the client's ledger when ``ledger``, as a well-behaved
    client whose sender must refuse it would; else written by hand, as only a hostile
    client does); what came back, and after a non-fatal ERROR whether the same
    connection then serves a whole chunk."""
    client = await _RawClient.open(served.port, versions)
    try:
        if ledger:
            client.writer.write(client.conn.send(p.Request(**request)))
        else:
            client.write_control(p.FrameType.REQUEST, request)
        answer = (await client.until(p.ChunkEnd, p.Text))[-1]
        said = _described(answer)
        if isinstance(answer, p.Error) and not answer.fatal:
            client.writer.write(client.conn.send(p.Request(chunk=0, level=0)))
            served_after = isinstance((await client.until(p.ChunkEnd))[-1], p.ChunkEnd)
            said += "; the connection then served chunk 0" if served_after else "; the connection then FAILED"
        return said
    finally:
        client.close()


async def _last_layer_repeated(served: _Served) -> str:
    """REPEATS continuations of the last layer alone, chunk after chunk: answer bytes
    against the bytes of the blobs the sender read for them."""
    client = await _RawClient.open(served.port)
    sent = read = 0
    try:
        for i in range(REPEATS):
            chunk = i % len(served.manifest.chunks)
            client.writer.write(client.conn.send(p.Request(chunk=chunk, level=0, first_layer=LAYERS - 1)))
            events = await client.until(p.ChunkEnd)
            begin = next(e for e in events if isinstance(e, p.ChunkBegin))
            sent += begin.total_bytes
            read += served.manifest.chunks[chunk].sizes[0]
    finally:
        client.close()
    return (f"{REPEATS} answers of {sent} bytes for {read} bytes of blobs read from the store "
            f"({read / sent:.1f}x what was sent; {LAYERS} layers)")


# ------------------------------------------------------------------------ receiver side
async def _begin_without_first_layer(served: _Served) -> str:
    """A version 2 client with a continuation of chunk 0 outstanding is answered with a
    CHUNK_BEGIN for the whole chunk."""
    from streamer.wire.frames import encode

    client = p.Connection(p.Role.CLIENT)
    server = p.Connection(p.Role.SERVER)
    server.receive_data(client.send(p.Hello(versions=p.SUPPORTED_VERSIONS, client="c")))
    client.receive_data(server.send(p.Welcome(version=max(p.SUPPORTED_VERSIONS), server="s", max_frame=1 << 20)))
    server.receive_data(client.send(p.Open(context_id="ctx", slo=None)))
    client.receive_data(server.send(p.ManifestData(served.manifest.to_bytes())))
    client.send(p.Request(chunk=0, level=0, first_layer=2))
    _, pieces, _ = encode(p.ChunkBegin(chunk=0, level=0, total_bytes=len(served.blob), parts=1))
    try:
        client.receive_data(b"".join(bytes(piece) for piece in pieces))
    except p.RemoteProtocolError as exc:
        return f"RemoteProtocolError: {exc}"
    return "accepted"


def _assembled(served: _Served, expected: int, answer: bytes) -> str:
    import codec

    from streamer.net.assembly import Assembly

    try:
        Assembly(served.manifest, 0, 0, expected, first_layer=1).add(answer)
    except (ValueError, codec.CorruptBitstream) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def _continuation(blob: bytes, first_layer: int) -> bytes:
    import codec

    header = codec.parse_header(blob)
    return blob[:header.size] + blob[header.section_offset(first_layer):]


async def _over_the_blob(served: _Served) -> str:
    """CHUNK_BEGIN announcing 2^40 bytes for a continuation: refused before anything is held."""
    return _assembled(served, 1 << 40, b"")


async def _header_disagreeing(served: _Served) -> str:
    """The real header and sections from layer 1, announced 1000 bytes longer (the rest junk)."""
    answer = _continuation(served.blob, 1)
    return _assembled(served, len(answer) + 1000, answer + bytes(1000))


#: name -> what to do against the served context (the rejection, described)
INPUTS: dict[str, Callable[[_Served], Awaitable[str]]] = {
    "continuation_first_layer_past_the_layers": lambda s: _refused(s, {"chunk": 0, "level": 0, "first_layer": LAYERS},
                                                                   ledger=True),
    "continuation_first_layer_65534": lambda s: _refused(s, {"chunk": 0, "level": 0, "first_layer": MAX_FIRST_LAYER},
                                                         ledger=True),
    "continuation_first_layer_65535": lambda s: _refused(s, {"chunk": 0, "level": 0,
                                                             "first_layer": MAX_FIRST_LAYER + 1}),
    "continuation_first_layer_0_written_out": lambda s: _refused(s, {"chunk": 0, "level": 0, "first_layer": 0}),
    "continuation_of_text": lambda s: _refused(s, {"chunk": 0, "level": "text", "first_layer": 1}),
    "continuation_on_version_1": lambda s: _refused(s, {"chunk": 0, "level": 0, "first_layer": 1}, (1,)),
    "continuation_of_the_last_layer_repeated": _last_layer_repeated,
    "answer_chunk_begin_without_first_layer": _begin_without_first_layer,
    "answer_continuation_of_2^40_bytes": _over_the_blob,
    "answer_continuation_header_disagreeing": _header_disagreeing,
}
NAMES = tuple(INPUTS)
#: the inputs a sender answers (its liveness is checked after them)
SENDER_SIDE = tuple(name for name in NAMES if name.startswith("continuation_"))


async def _serve_and_measure(name: str, reset: Callable[[], None], peak: Callable[[], int]) -> dict:
    import torch

    import codec
    import streamer
    from codec.synthetic import synthetic_kv

    profile = codec.calibrate([synthetic_kv(LAYERS, HEADS, HEAD_DIM, 512, seed=1)])
    kv = synthetic_kv(LAYERS, HEADS, HEAD_DIM, CHUNKS * CHUNK_TOKENS, seed=2).to(torch.float16)
    with tempfile.TemporaryDirectory(prefix="kvwire-hostile-wire-") as root:
        store = await streamer.open_store(root)
        sender = None
        try:
            manifest = await streamer.put_context(store, "ctx", kv, list(range(CHUNKS * CHUNK_TOKENS)),
                                                  profile=profile, chunk_tokens=CHUNK_TOKENS)
            sender = await streamer.serve(store)
            served = _Served(manifest, await store.get_chunk("ctx", manifest.version, 0, 0), sender.port)
            await _whole_chunk(served)   # warm: the first answer's imports are not the input's cost
            reset()
            before = peak()
            start = time.perf_counter()
            error = await INPUTS[name](served)
            seconds = time.perf_counter() - start
            growth = (peak() - before) / 1024
            row = {"input": name, "error": error, "seconds": round(seconds, 4),
                   "peak_rss_growth_mb": round(growth, 1)}
            if name in SENDER_SIDE:
                try:
                    row["daemon_up"] = await _whole_chunk(served)
                except (ConnectionError, OSError, TimeoutError, p.ProtocolError):
                    row["daemon_up"] = False
            return row
        finally:
            if sender is not None:
                await sender.close()
            await store.close()


async def _whole_chunk(served: _Served) -> bool:
    """Whether a new connection is served chunk 0 whole."""
    client = await _RawClient.open(served.port)
    try:
        client.writer.write(client.conn.send(p.Request(chunk=0, level=0)))
        return isinstance((await client.until(p.ChunkEnd))[-1], p.ChunkEnd)
    finally:
        client.close()


def run_one(name: str, reset: Callable[[], None], peak: Callable[[], int]) -> dict:
    """Play one hostile input here (meant for a fresh process); ``reset`` and ``peak``
    reset and read the process's peak RSS (KiB)."""
    return asyncio.run(_serve_and_measure(name, reset, peak))
