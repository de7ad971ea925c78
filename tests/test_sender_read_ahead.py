"""The sender reads the next queued chunk request's blob from its store while it answers
the one before (``sender.READ_AHEAD``), over real sockets and a real file store whose
reads the test holds and releases: answers still go in request order with the stored
bytes, a read that fails is answered in its turn, and a request cancelled before its
turn is not read at all."""
from __future__ import annotations

import asyncio
import collections

import pytest

import codec
import streamer
from streamer.net.client import ClientConnection
from streamer.store import ChunkNotFound
from streamer.wire import protocol as p
from streamer.wire.manifest import Manifest
from streamer_helpers import put_context_now, synthetic_kv

LAYERS, HEADS, HEAD_DIM, CHUNK_TOKENS, CHUNKS = 3, 2, 16, 64, 3


@pytest.fixture(scope="module")
def store_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("read-ahead-store"))
    profile = codec.calibrate([synthetic_kv(1, 256, LAYERS, HEADS, HEAD_DIM)])
    put_context_now(root, "ctx", synthetic_kv(2, CHUNKS * CHUNK_TOKENS, LAYERS, HEADS, HEAD_DIM),
                    list(range(CHUNKS * CHUNK_TOKENS)), profile=profile, chunk_tokens=CHUNK_TOKENS)
    return root


class HeldStore:
    """The file store, each chunk read held until the test releases it (``missing``: chunks
    whose read fails as a missing blob once released)."""

    def __init__(self, store: streamer.Store, missing: frozenset[int] = frozenset()) -> None:
        self._store, self.missing = store, missing
        self.started: dict[int, asyncio.Event] = collections.defaultdict(asyncio.Event)
        self.release: dict[int, asyncio.Event] = collections.defaultdict(asyncio.Event)
        self.reads: list[int] = []

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    async def get_chunk(self, context_id: str, version: str, chunk: int, level: int) -> bytes:
        self.reads.append(chunk)
        self.started[chunk].set()
        await self.release[chunk].wait()
        if chunk in self.missing:
            raise ChunkNotFound(context_id, version, f"chunk {chunk}", "test")
        return await self._store.get_chunk(context_id, version, chunk, level)


class Served:
    def __init__(self, root: str, missing: frozenset[int] = frozenset()) -> None:
        self.root, self.missing = root, missing

    async def __aenter__(self) -> "Served":
        self.files = await streamer.open_store(self.root)
        self.store = HeldStore(self.files, self.missing)
        self.sender = await streamer.serve(self.store)  # type: ignore[arg-type]
        self.client = await ClientConnection.connect("127.0.0.1", self.sender.port)
        answer = await self.client.call(p.Open(context_id="ctx", slo=None), p.ManifestData, 5.0)
        self.manifest = Manifest.from_bytes(answer.data)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for event in self.store.release.values():
            event.set()
        await self.client.close()
        await self.sender.close()
        await self.files.close()

    async def answer(self) -> list[p.Event]:
        """The events of one answer, up to its CHUNK_END or ERROR."""
        events: list[p.Event] = []
        while not events or not isinstance(events[-1], (p.ChunkEnd, p.Error)):
            events.append((await self.client.next(5.0)).event)
        return events

    async def stored(self, chunk: int) -> bytes:
        return await self.files.get_chunk("ctx", self.manifest.version, chunk, 0)


def payload(answer: list[p.Event]) -> bytes:
    assert isinstance(answer[0], p.ChunkBegin) and answer[-1] == p.ChunkEnd(chunk=answer[0].chunk)
    return b"".join(bytes(event.data) for event in answer if isinstance(event, p.ChunkPart))


async def test_the_next_request_is_read_while_the_one_before_is_answered(store_root: str) -> None:
    async with Served(store_root) as served:
        served.client.request(0, 0)
        served.client.request(1, 0)
        await asyncio.wait_for(served.store.started[1].wait(), 5.0)   # read ahead...
        assert not served.store.release[0].is_set()                     # ...while chunk 0's read is held
        served.store.release[1].set()
        served.store.release[0].set()
        first, second = await served.answer(), await served.answer()
        assert first[0].chunk == 0 and payload(first) == await served.stored(0)
        assert second[0].chunk == 1 and payload(second) == await served.stored(1)
        served.client.request(2, 0)   # nothing queued behind it: read when its turn comes
        served.store.release[2].set()
        assert payload(await served.answer()) == await served.stored(2)
        assert served.store.reads == [0, 1, 2]


async def test_a_read_ahead_that_fails_is_answered_in_its_turn(store_root: str) -> None:
    async with Served(store_root, missing=frozenset({1})) as served:
        served.client.request(0, 0)
        served.client.request(1, 0)
        await asyncio.wait_for(served.store.started[1].wait(), 5.0)
        served.store.release[1].set()   # chunk 1's read fails, chunk 0's still held
        served.store.release[0].set()
        assert payload(await served.answer()) == await served.stored(0)
        error = await served.answer()
        assert error == [p.Error("not_found", error[0].message)] and "chunk 1" in error[0].message
        served.client.request(2, 0)   # the connection lives on
        served.store.release[2].set()
        assert payload(await served.answer()) == await served.stored(2)


async def test_a_request_cancelled_before_its_turn_is_not_read(store_root: str) -> None:
    """REQUEST 0, REQUEST 1 and CANCEL 1 in one write: when the sender takes request 0 up,
    request 1 is cancelled already, so nothing reads it; it is answered CHUNK_END
    cancelled, after chunk 0."""
    async with Served(store_root) as served:
        served.client.request(0, 0)
        served.client.request(1, 0)
        served.client.send(p.Cancel(chunk=1))
        await asyncio.wait_for(served.store.started[0].wait(), 5.0)
        served.store.release[0].set()
        assert payload(await served.answer()) == await served.stored(0)
        assert await served.answer() == [p.ChunkEnd(chunk=1, cancelled=True)]
        assert served.store.reads == [0]
