"""Hostile continuations (protocol version 2's ``first_layer``) and lookups (version 3's
LOOKUP / PREFIX), for ``kvwire bench adversarial``.

A small real context (synthetic KV, a calibrated profile, every level) is put into a
file store in a temporary folder, by name and content-addressed (``put_prefix``), and
served by a sender in this process.

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

Lookups, sender side: a LOOKUP whose chain is one hash too long, empty or not lowercase
hex, whose JSON does not parse, whose header announces more than the 64 KiB control
limit (refused before its payload is read), one on a version 2 connection and one before
authentication: each ends the connection with a fatal ERROR, and the sender stays up.
``lookup_of_512_hashes_repeated`` sends the largest valid lookup over and over (a prompt
of 512 chunks whose first two are stored): its row says how many were answered, with
what match, in how long. Receiver side: a PREFIX answering no LOOKUP, one claiming more
chunks than the lookup asked, and one naming no context but claiming chunks.
"""
from __future__ import annotations

import asyncio
import json
import struct
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from streamer.wire import protocol as p
from streamer.wire.frames import MAX_CONTROL_PAYLOAD, MAX_FIRST_LAYER, MAX_LOOKUP_CHAIN
from streamer.wire.manifest import Manifest

LAYERS, HEADS, HEAD_DIM, CHUNK_TOKENS, CHUNKS = 4, 2, 16, 128, 2
#: continuations of the last layer asked for, one after the other; largest lookups likewise
REPEATS = 400
#: the token of the sender that ``lookup_before_auth`` meets
_TOKEN = "adversarial-wire-token-0123456789"


@dataclass
class _Served:
    """The context being served: its manifest, a blob, the sender's port, the store, and
    the hash chain of a prompt of ``MAX_LOOKUP_CHAIN`` chunks whose first ``CHUNKS`` are
    stored content-addressed."""

    manifest: Manifest
    blob: bytes
    port: int
    store: Any
    chain: list[str]


class _RawClient:
    """A connection whose frames may be anything (control frames built by hand)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, versions: tuple[int, ...]) -> None:
        self.reader, self.writer = reader, writer
        self.conn = p.Connection(p.Role.CLIENT, versions=versions)

    @classmethod
    async def open(cls, port: int, versions: tuple[int, ...] = p.SUPPORTED_VERSIONS, *,
                   context: bool = True) -> "_RawClient":
        """Connected, handshake done, the context open (unless not ``context``)."""
        client = cls(*await asyncio.open_connection("127.0.0.1", port), versions)
        client.writer.write(client.conn.send(p.Hello(versions=versions, client="hostile")))
        await client.until(p.Welcome)
        if context:
            client.writer.write(client.conn.send(p.Open(context_id="ctx", slo=None)))
            await client.until(p.ManifestData)
        return client

    def write_control(self, ftype: p.FrameType, obj: Any) -> None:
        self.writer.write(_control(ftype, obj))

    async def until(self, *kinds: type) -> list[p.Event]:
        """Events up to one of ``kinds``, an ERROR or the end of the connection."""
        got: list[p.Event] = []
        async with asyncio.timeout(10.0):
            while not got or not isinstance(got[-1], (*kinds, p.Error, p.ConnectionClosed)):
                got += self.conn.receive_data(await self.reader.read(1 << 16))
        return got

    def close(self) -> None:
        self.writer.transport.abort()


def _control(ftype: p.FrameType, obj: Any) -> bytes:
    """A control frame of ``obj`` as JSON, whatever it holds (``bytes``: the payload as is)."""
    data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return struct.pack("<IHH", len(data), int(ftype), 0) + data


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


# ------------------------------------------------------------------------ lookups, sender side
async def _lookup_refused(served: _Served, frame: bytes, versions: tuple[int, ...] = p.SUPPORTED_VERSIONS) -> str:
    """Write ``frame`` (a LOOKUP, by hand) after the handshake; what came back."""
    client = await _RawClient.open(served.port, versions, context=False)
    try:
        client.writer.write(frame)
        return _described((await client.until(p.Prefix))[-1])
    finally:
        client.close()


async def _lookup_before_auth(served: _Served) -> str:
    """HELLO and a LOOKUP at once to a sender that requires a token."""
    import streamer

    sender = await streamer.serve(served.store, auth_token=_TOKEN)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", sender.port)
        client = _RawClient(reader, writer, p.SUPPORTED_VERSIONS)
        client.conn = p.Connection(p.Role.CLIENT, auth_token=_TOKEN)
        try:
            writer.write(client.conn.send(p.Hello(versions=p.SUPPORTED_VERSIONS, client="hostile"))
                         + _control(p.FrameType.LOOKUP, {"chain": served.chain[:1]}))
            return _described((await client.until(p.Prefix))[-1])
        finally:
            client.close()
    finally:
        await sender.close()


async def _largest_lookup_repeated(served: _Served) -> str:
    """REPEATS lookups of MAX_LOOKUP_CHAIN hashes, one after the other, on one connection."""
    client = await _RawClient.open(served.port, context=False)
    matched = set()
    try:
        start = time.perf_counter()
        for _ in range(REPEATS):
            client.writer.write(client.conn.send(p.Lookup(chain=tuple(served.chain))))
            answer = (await client.until(p.Prefix))[-1]
            if not isinstance(answer, p.Prefix):
                return f"lookup answered {_described(answer)}"
            matched.add(answer.chunks)
        seconds = time.perf_counter() - start
    finally:
        client.close()
    frame = len(json.dumps({"chain": served.chain}, separators=(",", ":")))
    return (f"{REPEATS} lookups of {MAX_LOOKUP_CHAIN} hashes ({frame} bytes each) answered in {seconds:.3f} s, "
            f"matching {sorted(matched)} chunks")


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


def _prefix_answer(served: _Served, lookups: list[p.Lookup], answer: bytes) -> str:
    """A client with ``lookups`` outstanding fed ``answer`` (a PREFIX, by hand)."""
    client = p.Connection(p.Role.CLIENT)
    server = p.Connection(p.Role.SERVER)
    server.receive_data(client.send(p.Hello(versions=p.SUPPORTED_VERSIONS, client="c")))
    client.receive_data(server.send(p.Welcome(version=max(p.SUPPORTED_VERSIONS), server="s", max_frame=1 << 20)))
    for lookup in lookups:
        client.send(lookup)
    try:
        client.receive_data(answer)
    except p.RemoteProtocolError as exc:
        return f"RemoteProtocolError: {exc}"
    return "accepted"


async def _over_the_blob(served: _Served) -> str:
    """CHUNK_BEGIN announcing 2^40 bytes for a continuation: refused before anything is held."""
    return _assembled(served, 1 << 40, b"")


async def _header_disagreeing(served: _Served) -> str:
    """The real header and sections from layer 1, announced 1000 bytes longer (the rest junk)."""
    answer = _continuation(served.blob, 1)
    return _assembled(served, len(answer) + 1000, answer + bytes(1000))


async def _async(said: str) -> str:
    return said


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
    "lookup_chain_of_513_hashes": lambda s: _lookup_refused(s, _control(p.FrameType.LOOKUP, {
        "chain": s.chain + s.chain[:MAX_LOOKUP_CHAIN + 1 - len(s.chain)]})),
    "lookup_chain_empty": lambda s: _lookup_refused(s, _control(p.FrameType.LOOKUP, {"chain": []})),
    "lookup_chain_uppercase_hex": lambda s: _lookup_refused(s, _control(p.FrameType.LOOKUP, {
        "chain": [s.chain[0].upper()]})),
    "lookup_malformed_json": lambda s: _lookup_refused(s, _control(p.FrameType.LOOKUP, b'{"chain":["')),
    "lookup_over_the_control_limit": lambda s: _lookup_refused(s, struct.pack(
        "<IHH", MAX_CONTROL_PAYLOAD + 1, int(p.FrameType.LOOKUP), 0) + b'{"chain":['),
    "lookup_on_version_2": lambda s: _lookup_refused(s, _control(p.FrameType.LOOKUP, {"chain": s.chain[:1]}), (1, 2)),
    "lookup_before_auth": _lookup_before_auth,
    "lookup_of_512_hashes_repeated": _largest_lookup_repeated,
    "answer_prefix_to_no_lookup": lambda s: _async(_prefix_answer(s, [], _control(
        p.FrameType.PREFIX, {"context_id": "ctx", "chunks": 1}))),
    "answer_prefix_longer_than_the_chain": lambda s: _async(_prefix_answer(s, [p.Lookup(tuple(s.chain[:2]))], _control(
        p.FrameType.PREFIX, {"context_id": "ctx", "chunks": 3}))),
    "answer_prefix_of_no_context_with_chunks": lambda s: _async(_prefix_answer(s, [p.Lookup(tuple(s.chain[:2]))], _control(
        p.FrameType.PREFIX, {"context_id": None, "chunks": 2}))),
}
NAMES = tuple(INPUTS)
#: the inputs a sender answers (its liveness is checked after them)
SENDER_SIDE = tuple(name for name in NAMES if name.startswith(("continuation_", "lookup_")))


def _identity(profile_id: str) -> Any:
    from codec.container import FORMAT_VERSION
    from streamer.store.prefix import PrefixIdentity

    return PrefixIdentity(model="hostile", tokenizer="hostile", profile_id=profile_id, chunk_tokens=CHUNK_TOKENS,
                          format_version=FORMAT_VERSION)


async def prepare(root: str) -> None:
    """Put the served context into a file store at ``root``: by name (``ctx``) and
    content-addressed. Done once for every input (each child process only serves it)."""
    import torch

    import codec
    import streamer
    from codec.synthetic import synthetic_kv
    from streamer.store.put import put_prefix

    profile = codec.calibrate([synthetic_kv(LAYERS, HEADS, HEAD_DIM, 512, seed=1)])
    kv = synthetic_kv(LAYERS, HEADS, HEAD_DIM, CHUNKS * CHUNK_TOKENS, seed=2).to(torch.float16)
    token_ids = list(range(CHUNKS * CHUNK_TOKENS))
    async with await streamer.open_store(root) as store:
        await streamer.put_context(store, "ctx", kv, token_ids, profile=profile, chunk_tokens=CHUNK_TOKENS)
        await put_prefix(store, _identity(profile.id), kv, token_ids, profile, budget_bytes=None)


async def _serve_and_measure(name: str, root: str, reset: Callable[[], None], peak: Callable[[], int]) -> dict:
    import streamer
    from streamer.store.prefix import prefix_chain

    store = await streamer.open_store(root)
    sender = None
    try:
        manifest = await store.get_manifest("ctx")
        prompt = list(range(CHUNKS * CHUNK_TOKENS)) + [7] * ((MAX_LOOKUP_CHAIN - CHUNKS) * CHUNK_TOKENS)
        sender = await streamer.serve(store)
        served = _Served(manifest, await store.get_chunk("ctx", manifest.version, 0, 0), sender.port, store,
                         prefix_chain(_identity(manifest.profile_id), prompt))
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


def run_one(name: str, reset: Callable[[], None], peak: Callable[[], int], root: str | None = None) -> dict:
    """Play one hostile input here (meant for a fresh process) against the store that
    ``prepare`` filled at ``root`` (None: a temporary one, prepared here first); ``reset``
    and ``peak`` reset and read the process's peak RSS (KiB)."""
    if root is not None:
        return asyncio.run(_serve_and_measure(name, root, reset, peak))
    with tempfile.TemporaryDirectory(prefix="kvwire-hostile-wire-") as temporary:
        asyncio.run(prepare(temporary))
        return asyncio.run(_serve_and_measure(name, temporary, reset, peak))
