"""A continuation (protocol version 2) over real sockets: a sender over a file store of a
real encoded context answers REQUEST{first_layer} with the blob's header and the sections
of layers first_layer.. only, the very stored bytes; cut by ``Assembly`` and decoded,
those sections are bit for bit the same layers of a whole-chunk decode. A version 1
client is served as before and cannot send one; the sender refuses a first layer past
the context's layers (ERROR "bad_request", the connection lives on) and a text
continuation (a fatal protocol ERROR)."""
from __future__ import annotations

import asyncio
import json
import struct

import pytest
import torch

import codec
import streamer
from streamer.net.assembly import Assembly
from streamer.net.client import ClientConnection
from streamer.net.sender import blob_parts
from streamer.wire import frames, protocol as p
from streamer.wire.manifest import Manifest
from streamer_helpers import put_context_now, synthetic_kv

LAYERS, HEADS, HEAD_DIM, CHUNK_TOKENS, CHUNKS = 5, 2, 16, 96, 2


@pytest.fixture(scope="module")
def store_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("continuation-store"))
    profile = codec.calibrate([synthetic_kv(1, 512, LAYERS, HEADS, HEAD_DIM)])
    put_context_now(root, "ctx", synthetic_kv(2, CHUNKS * CHUNK_TOKENS, LAYERS, HEADS, HEAD_DIM),
                    list(range(CHUNKS * CHUNK_TOKENS)), profile=profile, chunk_tokens=CHUNK_TOKENS)
    return root


class Served:
    """A real sender over the store, and a client connected to it with the context open."""

    def __init__(self, root: str, versions: tuple[int, ...] = p.SUPPORTED_VERSIONS) -> None:
        self.root, self.versions = root, versions

    async def __aenter__(self) -> "Served":
        self.store = await streamer.open_store(self.root)
        self.sender = await streamer.serve(self.store)
        self.client = await ClientConnection.connect("127.0.0.1", self.sender.port, versions=self.versions)
        answer = await self.client.call(p.Open(context_id="ctx", slo=None), p.ManifestData, 5.0)
        self.manifest = Manifest.from_bytes(answer.data)
        self.profile = codec.Profile.from_bytes(await self.client.get_profile(self.manifest.profile_id, 5.0))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()
        await self.sender.close()
        await self.store.close()

    async def blob(self, chunk: int, level: int) -> bytes:
        return await self.store.get_chunk("ctx", self.manifest.version, chunk, level)

    async def answer(self) -> list[p.Event]:
        """The events of one answer, up to its CHUNK_END, TEXT or ERROR."""
        events: list[p.Event] = []
        while not events or not isinstance(events[-1], (p.ChunkEnd, p.Text, p.Error)):
            events.append((await self.client.next(5.0)).event)
        return events


def continuation_bytes(blob: bytes, first_layer: int) -> bytes:
    """What a continuation from ``first_layer`` must carry: the header and the sections
    from that layer on, as stored (codec/FORMAT.md's layout)."""
    header = codec.parse_header(blob)
    return blob[:header.size] + blob[header.section_offset(first_layer):]


def decoded_sections(answer: list[p.Event], assembly: Assembly, profile: codec.Profile
                     ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Each layer of an answer, cut by ``assembly`` and decoded on its own."""
    out = {}
    for event in answer:
        if isinstance(event, p.ChunkPart):
            for layer, section in assembly.add(event.data):
                out[layer] = codec.decode_section(assembly.header, profile, layer, section)
    return out


@pytest.mark.parametrize("first_layer", [1, 3, LAYERS - 1])
async def test_a_continuation_is_the_header_and_the_later_sections(store_root: str, first_layer: int) -> None:
    async with Served(store_root) as served:
        assert served.client.conn.version == max(p.SUPPORTED_VERSIONS) and served.client.conn.continuations
        for chunk, level in [(0, 0), (1, 3)]:
            blob = await served.blob(chunk, level)
            want = continuation_bytes(blob, first_layer)
            served.client.request(chunk, level, first_layer, manifest=served.manifest)
            answer = await served.answer()
            begin, parts, end = answer[0], answer[1:-1], answer[-1]
            assert begin == p.ChunkBegin(chunk, level, total_bytes=len(want), parts=len(parts),
                                         first_layer=first_layer)
            assert end == p.ChunkEnd(chunk)
            assert b"".join(part.data for part in parts) == want
            # the header, then one part per section (each under the part size here)
            header = codec.parse_header(blob)
            assert [len(part.data) for part in parts] == [header.size] + [
                header.sections[layer][0] for layer in range(first_layer, LAYERS)]
            assert len(want) < len(blob)


async def test_a_continuation_decodes_like_the_same_layers_of_the_whole_chunk(store_root: str) -> None:
    """Layers 0..2 at level 1 from a whole answer, layers 2..4 at level 4 from a
    continuation: every layer is bit for bit its level's whole-chunk decode, whether
    decoded from the blob in the store or from the whole answer over the wire."""
    first, low, high = 2, 4, 1
    async with Served(store_root) as served:
        served.client.request(1, high, manifest=served.manifest)
        whole = await served.answer()
        served.client.request(1, low, first, manifest=served.manifest)
        rest = await served.answer()
        whole_layers = decoded_sections(whole, Assembly(served.manifest, 1, high, whole[0].total_bytes), served.profile)
        rest_assembly = Assembly(served.manifest, 1, low, rest[0].total_bytes, first_layer=first)
        rest_layers = decoded_sections(rest, rest_assembly, served.profile)
        assert sorted(whole_layers) == list(range(LAYERS)) and sorted(rest_layers) == list(range(first, LAYERS))
        assert rest_assembly.sections == LAYERS and rest_assembly.received == rest[0].total_bytes
        for level, layers in [(high, whole_layers), (low, rest_layers)]:
            reference = codec.decode(await served.blob(1, level), served.profile)   # [layers, 2, T, H, D]
            for layer, (k, v) in layers.items():
                assert torch.equal(k, reference[layer, 0]) and torch.equal(v, reference[layer, 1]), (level, layer)
        # the levels differ, so mixing them is visible: the continuation is not the whole answer's tail
        assert not torch.equal(rest_layers[first][0], whole_layers[first][0])


async def test_a_whole_chunk_request_is_answered_as_before(store_root: str) -> None:
    async with Served(store_root) as served:
        blob = await served.blob(0, 2)
        served.client.request(0, 2)
        answer = await served.answer()
        assert answer[0] == p.ChunkBegin(0, 2, total_bytes=len(blob), parts=1 + LAYERS)
        assert b"".join(e.data for e in answer[1:-1]) == blob


async def test_a_first_layer_past_the_layers_is_a_bad_request(store_root: str) -> None:
    async with Served(store_root) as served:
        with pytest.raises(ValueError, match=f"first layer {LAYERS} out of range: context has {LAYERS} layers"):
            served.client.request(0, 0, LAYERS, manifest=served.manifest)
        assert served.client.conn.outstanding == ()   # nothing sent
        for first_layer in (LAYERS, frames.MAX_FIRST_LAYER):
            served.client.request(0, 0, first_layer)   # unchecked: the sender refuses it
            assert await served.answer() == [p.Error(
                "bad_request", f"first layer {first_layer} out of range: context has {LAYERS} layers")]
        served.client.request(0, 0, LAYERS - 1)   # the connection lives on
        assert isinstance((await served.answer())[-1], p.ChunkEnd)


class RawClient:
    """A hand-driven connection whose frames may be anything (built by hand)."""

    async def open(self, port: int, versions: tuple[int, ...]) -> "RawClient":
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", port)
        self.conn = p.Connection(p.Role.CLIENT, versions=versions)
        self.writer.write(self.conn.send(p.Hello(versions=versions, client="raw")))
        self.events = await self.read_until(p.Welcome)
        self.writer.write(self.conn.send(p.Open(context_id="ctx", slo=None)))
        self.events += await self.read_until(p.ManifestData)
        return self

    async def read_until(self, kind: type) -> list[p.Event]:
        got: list[p.Event] = []
        async with asyncio.timeout(5.0):
            while not got or not isinstance(got[-1], kind):
                got += self.conn.receive_data(await self.reader.read(65536))
        return got

    def write_raw(self, ftype: p.FrameType, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.writer.write(struct.pack("<IHH", len(data), int(ftype), 0) + data)

    async def until_closed(self) -> list[p.Event]:
        got: list[p.Event] = []
        async with asyncio.timeout(5.0):
            while data := await self.reader.read(65536):
                got += self.conn.receive_data(data)
        return got + self.conn.receive_data(b"")


@pytest.mark.parametrize("versions, request_", [
    (p.SUPPORTED_VERSIONS, {"chunk": 0, "level": "text", "first_layer": 1}),
    ((1,), {"chunk": 0, "level": 0, "first_layer": 1}),
    (p.SUPPORTED_VERSIONS, {"chunk": 0, "level": 0, "first_layer": 0}),
    (p.SUPPORTED_VERSIONS, {"chunk": 0, "level": 0, "first_layer": 1 << 16})])
async def test_a_malformed_continuation_is_a_fatal_protocol_error(store_root: str, versions, request_) -> None:
    """A text continuation, one on a version 1 connection, an explicit default and a
    first layer no blob has: the sender's state machine refuses each with a fatal ERROR
    and closes, after answering what came before it."""
    async with Served(store_root) as served:
        raw = await RawClient().open(served.sender.port, versions)
        raw.write_raw(p.FrameType.REQUEST, request_)
        events = raw.events + await raw.until_closed()
        assert [type(e) for e in events] == [p.Welcome, p.ManifestData, p.Error, p.ConnectionClosed]
        assert events[0].version == max(versions)
        assert events[2].fatal and events[2].code == "protocol" and "first_layer" in events[2].message
        served.client.request(0, 0, 1)   # the sender serves others as before
        assert isinstance((await served.answer())[-1], p.ChunkEnd)


async def test_a_version_1_client_is_served_whole_chunks_only(store_root: str) -> None:
    async with Served(store_root, versions=(1,)) as served:
        assert served.client.conn.version == 1 and not served.client.conn.continuations
        with pytest.raises(p.LocalProtocolError, match="needs version 2"):
            served.client.request(0, 1, 2, manifest=served.manifest)
        with pytest.raises(p.LocalProtocolError, match="text has no layers"):
            served.client.request(0, "text", 2)
        assert served.client.conn.outstanding == ()
        blob = await served.blob(0, 1)
        served.client.request(0, 1, manifest=served.manifest)
        answer = await served.answer()
        assert answer[0] == p.ChunkBegin(0, 1, total_bytes=len(blob), parts=1 + LAYERS)
        assert b"".join(e.data for e in answer[1:-1]) == blob


async def test_blob_parts_slices_without_copying_and_cuts_at_the_limit(store_root: str) -> None:
    async with Served(store_root) as served:
        blob = await served.blob(0, 0)
    header = codec.parse_header(blob)
    for first_layer in range(LAYERS):
        parts = blob_parts(blob, 7, first_layer)
        assert all(0 < len(part) <= 7 and part.obj is blob for part in parts)
        assert b"".join(parts) == continuation_bytes(blob, first_layer)
        # a part never straddles the header and a section, nor two sections
        edges = {header.size} | {header.section_offset(layer) for layer in range(first_layer + 1, LAYERS)}
        cut = header.section_offset(first_layer) - header.size
        position = 0
        for part in parts:
            start = position if position < header.size else position + cut
            assert not any(start < edge < start + len(part) for edge in edges)
            position += len(part)
    with pytest.raises(Exception, match="has 5 layers, the manifest has a layer 5"):
        blob_parts(blob, 7, LAYERS)
