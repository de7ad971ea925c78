"""Sender and receiver resource limits: each one is tripped here and must end in a clean,
typed error (a fatal ERROR frame with its code, or a StreamError), never a hang or an
unbounded buffer: frame size (both sides), concurrent sessions, queued requests per
connection, receiver backpressure, handshake / partial-frame read timeouts (slowloris),
idle timeout and write timeout (a receiver that stops reading); and sizes read from a
store or a sender: a profile over the receiver's limit, stored data whose size is not
the manifest's, a corrupt stored manifest."""
from __future__ import annotations

import asyncio
import os
import struct
import time

import pytest
import torch

import codec
import streamer
from streamer_helpers import put_context_now, synthetic_kv
from streamer.wire import protocol as p
from streamer.wire.frames import encode
from streamer.net.client import ClientConnection, ProfileTooLarge, ServerError
from streamer.net.sender import ServerConfig
from streamer.wire.manifest import ManifestError

LAYERS, HEADS, HEAD_DIM, CHUNK_TOKENS, CHUNKS = 4, 8, 32, 256, 8
PID = "0123456789abcdef"


def _kv(seed: int, tokens: int) -> torch.Tensor:
    return synthetic_kv(seed, tokens, LAYERS, HEADS, HEAD_DIM)


@pytest.fixture(scope="module")
def limits_profile() -> codec.Profile:
    return codec.calibrate([_kv(1, 2048)])


@pytest.fixture(scope="module")
def store_root(tmp_path_factory: pytest.TempPathFactory, limits_profile: codec.Profile) -> str:
    root = str(tmp_path_factory.mktemp("limits-store"))
    put_context_now(root, "ctx", _kv(2, CHUNKS * CHUNK_TOKENS), [i % 3000 for i in range(CHUNKS * CHUNK_TOKENS)],
                    profile=limits_profile, chunk_tokens=CHUNK_TOKENS)
    return root


class Sending:
    """A real sender over the module's store with a given config."""

    def __init__(self, root: str, **config) -> None:
        self.root, self.config = root, ServerConfig(**config)

    async def __aenter__(self) -> streamer.Sender:
        self.store = await streamer.open_store(self.root)
        self.sender = await streamer.serve(self.store, config=self.config)
        return self.sender

    async def __aexit__(self, *exc) -> None:
        await self.sender.close()
        await self.store.close()


class FakeStore:
    """Just enough of a Store for GET_PROFILE: a big profile, optionally slow."""

    def __init__(self, profile: bytes = b"p", delay: float = 0.0) -> None:
        self.profile, self.delay, self.calls = profile, delay, 0

    async def profile_size(self, profile_id: str) -> int:
        return len(self.profile)

    async def get_profile_bytes(self, profile_id: str) -> bytes:
        self.calls += 1
        await asyncio.sleep(self.delay)
        return self.profile

    async def close(self) -> None:
        pass


class Raw:
    """A hand-driven kvwire client over plain asyncio streams."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.conn = p.Connection(p.Role.CLIENT)

    @classmethod
    async def open(cls, port: int) -> "Raw":
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    def send(self, event: p.Event) -> bytes:
        data = self.conn.send(event)
        self.writer.write(data)
        return data

    async def handshake(self) -> None:
        self.send(p.Hello(versions=(1,), client="raw"))
        assert [type(e) for e in await self.events(1)] == [p.Welcome]

    async def events(self, n: int, timeout: float = 5.0) -> list[p.Event]:
        got: list[p.Event] = []
        async with asyncio.timeout(timeout):
            while len(got) < n:
                got += self.conn.receive_data(await self.reader.read(65536))
        return got

    async def until_closed(self, timeout: float) -> tuple[list[p.Event], float]:
        """Every event until the sender closes; and how long that took."""
        start, got = time.monotonic(), []
        async with asyncio.timeout(timeout):
            while True:
                try:
                    data = await self.reader.read(65536)
                except ConnectionError:
                    break
                got += self.conn.receive_data(data)
                if not data:
                    break
        return got, time.monotonic() - start

    def close(self) -> None:
        self.writer.transport.abort()


def _fatal(events: list[p.Event]) -> p.Error:
    errors = [e for e in events if isinstance(e, p.Error) and e.fatal]
    assert errors, f"no fatal ERROR in {events}"
    return errors[0]


# ------------------------------------------------------------------------ frame size
async def test_oversize_control_frame_is_refused_at_its_header(store_root) -> None:
    async with Sending(store_root) as sender:
        raw = await Raw.open(sender.port)
        await raw.handshake()
        # an OPEN announcing 64 KiB + 1 of JSON: refused before any payload is sent
        raw.writer.write(struct.pack("<IHH", p.MAX_CONTROL_PAYLOAD + 1, p.FrameType.OPEN, 0))
        events, seconds = await raw.until_closed(5.0)
        error = _fatal(events)
        assert error.code == "protocol" and "limit" in error.message
        assert seconds < 2.0


async def test_oversize_data_frame_is_refused_at_its_header(store_root) -> None:
    async with Sending(store_root, max_frame=65536) as sender:
        raw = await Raw.open(sender.port)
        await raw.handshake()
        raw.writer.write(struct.pack("<IHH", 65537, p.FrameType.MANIFEST, 0))
        events, _ = await raw.until_closed(5.0)
        assert "65537" in _fatal(events).message


async def _fake_sender(handler) -> tuple[asyncio.base_events.Server, int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_receiver_refuses_a_frame_over_its_max_frame() -> None:
    """A sender announcing a 32 MiB MANIFEST to a receiver whose limit is 1 MiB."""
    async def handler(reader, writer):
        conn = p.Connection(p.Role.SERVER, versions=(1,))
        conn.receive_data(await reader.read(65536))        # HELLO
        writer.write(conn.send(p.Welcome(1, "evil", p.DEFAULT_MAX_FRAME)))
        await reader.read(65536)                            # OPEN
        writer.write(struct.pack("<IHH", 32 << 20, p.FrameType.MANIFEST, 0) + b"x" * 1000)
        with pytest.raises(Exception):
            await reader.read(65536)
        writer.close()

    server, port = await _fake_sender(handler)
    try:
        with pytest.raises(streamer.ConnectionLost, match="limit 1048576"):
            async with streamer.StreamSession("127.0.0.1", port, "ctx", max_frame=1 << 20,
                                              max_reconnects=0, connect_timeout=2.0):
                pass
    finally:
        server.close()


# ------------------------------------------------------------------------ sessions
async def test_sessions_beyond_max_sessions_get_unavailable(store_root) -> None:
    async with Sending(store_root, max_sessions=2) as sender:
        first = await streamer.StreamSession("127.0.0.1", sender.port, "ctx").__aenter__()
        second = await streamer.StreamSession("127.0.0.1", sender.port, "ctx").__aenter__()
        assert sender.sessions == 2
        start = time.monotonic()
        with pytest.raises(streamer.ServerError) as refused:
            await streamer.net.client.ClientConnection.connect("127.0.0.1", sender.port)
        assert refused.value.code == "unavailable" and "capacity" in refused.value.message
        with pytest.raises(streamer.ConnectionLost, match="unavailable"):
            async with streamer.StreamSession("127.0.0.1", sender.port, "ctx", max_reconnects=0):
                pass
        assert time.monotonic() - start < 5.0
        await first.__aexit__(None, None, None)
        for _ in range(100):   # the handler notices the close
            if sender.sessions < 2:
                break
            await asyncio.sleep(0.02)
        async with streamer.StreamSession("127.0.0.1", sender.port, "ctx", slo=10.0,
                                          policy="fixed:4") as third:
            report = await third.fetch()
        assert len(report.chunks) == CHUNKS
        await second.__aexit__(None, None, None)


async def test_queued_requests_per_connection_are_bounded() -> None:
    """A client pipelining 100k requests without reading: the sender stops reading it."""
    store = FakeStore(delay=0.01)
    sender = await streamer.serve(store, config=ServerConfig(max_pending_requests=8, write_timeout=60))
    try:
        raw = await Raw.open(sender.port)
        await raw.handshake()
        frame = raw.conn.send(p.GetProfile(PID))
        total = 100_000
        raw.writer.write(frame * total)      # 4 MB of requests, buffered by our transport
        handler = next(iter(sender._handlers.values()))
        peak = 0
        for _ in range(50):
            await asyncio.sleep(0.02)
            peak = max(peak, len(handler.conn.outstanding))
        # one read (256 KiB) of frames beyond the cap at most, far from everything sent
        per_read = 256 * 1024 // len(frame) + 1
        assert peak <= 8 + per_read, peak
        assert store.calls < 1000 and peak < total // 10
        raw.close()
    finally:
        await sender.close()


# ------------------------------------------------------------------------ backpressure
async def test_receiver_backlog_is_bounded_by_pausing_reads(store_root, monkeypatch) -> None:
    from streamer.net import client as client_module, delivery, driver as driver_module

    peaks: list[int] = []

    class Measured(delivery.OrderedDelivery):
        def add_section(self, *args, **kw):
            super().add_section(*args, **kw)
            peaks.append(self.backlog_bytes)

    pauses = []
    real_pause = client_module.ClientConnection.pause_reading

    def pause(self):
        pauses.append(time.monotonic())
        real_pause(self)

    monkeypatch.setattr(driver_module, "OrderedDelivery", Measured)
    monkeypatch.setattr(client_module.ClientConnection, "pause_reading", pause)
    delivered: list[tuple[int, int]] = []

    async def slow_consumer(chunk, layer, k, v):
        await asyncio.sleep(0.01)
        delivered.append((chunk, layer))

    async def fetch(limit: int) -> int:
        peaks.clear()
        delivered.clear()
        async with Sending(store_root, write_timeout=30) as sender:
            async with streamer.StreamSession("127.0.0.1", sender.port, "ctx", slo=30.0,
                                              policy="fixed:0", on_layer=slow_consumer,
                                              max_buffered_bytes=limit, stall_timeout=0.5) as s:
                report = await s.fetch()
        assert delivered == [(c, l) for c in range(CHUNKS) for l in range(LAYERS)]
        assert report.reconnects == 0     # pausing is not mistaken for a stalled link
        return max(peaks)

    unbounded = await fetch(1 << 30)
    assert not pauses
    limit = 128 * 1024
    bounded = await fetch(limit)
    assert pauses, "the backlog never reached the limit"
    # the limit, plus what one socket read (256 KiB) and one section can overshoot, and
    # two decoded layers: the one the consumer is on and the next, always admitted
    decoded_layer = 2 * CHUNK_TOKENS * HEADS * HEAD_DIM * 2
    assert bounded <= limit + 256 * 1024 + 80 * 1024 + 2 * decoded_layer, bounded
    assert bounded < unbounded / 2, (bounded, unbounded)


# ------------------------------------------------------------------------ timeouts
async def test_silent_client_is_dropped_at_read_timeout(store_root) -> None:
    async with Sending(store_root, read_timeout=0.3, idle_timeout=60) as sender:
        raw = await Raw.open(sender.port)         # connects, sends nothing
        events, seconds = await raw.until_closed(5.0)
        error = _fatal(events)
        assert error.code == "timeout" and "handshake" in error.message
        assert 0.25 < seconds < 2.0
        assert sender.sessions == 0


async def test_partial_frame_is_dropped_at_read_timeout(store_root) -> None:
    async with Sending(store_root, read_timeout=0.3, idle_timeout=60) as sender:
        raw = await Raw.open(sender.port)
        await raw.handshake()
        open_frame = encode(p.Open("ctx", None))[1][0]
        raw.writer.write(open_frame[:10])          # header and 2 bytes of JSON, then nothing
        events, seconds = await raw.until_closed(5.0)
        error = _fatal(events)
        assert error.code == "timeout" and "incomplete frame" in error.message
        assert seconds < 2.0


@pytest.mark.parametrize("phase", ["handshake", "after handshake"])
async def test_slowloris_dribbling_a_frame_is_dropped(store_root, phase: str) -> None:
    """One byte every 50 ms keeps bytes flowing, but the frame never completes in time."""
    async with Sending(store_root, read_timeout=0.5, idle_timeout=60) as sender:
        raw = await Raw.open(sender.port)
        if phase == "handshake":
            frame = encode(p.Hello((1,), "slow" * 20))[1][0]
        else:
            await raw.handshake()
            frame = encode(p.Open("ctx" * 30, None))[1][0]
        start = time.monotonic()
        dropped = None
        try:
            for byte in frame:
                raw.writer.write(bytes([byte]))
                await raw.writer.drain()
                data = b""
                try:
                    data = await asyncio.wait_for(raw.reader.read(65536), 0.05)
                except asyncio.TimeoutError:
                    continue
                if data:
                    events = raw.conn.receive_data(data)
                    assert _fatal(events).code == "timeout"
                dropped = time.monotonic() - start
                break
        except (ConnectionError, p.ProtocolError):
            dropped = time.monotonic() - start
        assert dropped is not None, f"dribbled all {len(frame)} bytes without being dropped"
        assert 0.4 < dropped < 2.0, dropped


async def test_idle_connection_is_closed_after_its_last_answer(store_root) -> None:
    async with Sending(store_root, idle_timeout=0.4) as sender:
        raw = await Raw.open(sender.port)
        await raw.handshake()
        raw.send(p.Open("ctx", None))
        assert isinstance((await raw.events(1))[0], p.ManifestData)
        events, seconds = await raw.until_closed(5.0)   # then silence
        error = _fatal(events)
        assert error.code == "timeout" and "idle" in error.message
        assert seconds < 2.0


async def test_receiver_that_stops_reading_is_dropped_at_write_timeout() -> None:
    store = FakeStore(profile=bytes(64 << 20))      # far more than the socket buffers hold
    sender = await streamer.serve(store, config=ServerConfig(write_timeout=0.5))
    try:
        raw = await Raw.open(sender.port)
        await raw.handshake()
        raw.send(p.GetProfile(PID))                  # and never read again
        start = time.monotonic()
        while sender.sessions and time.monotonic() - start < 10:
            await asyncio.sleep(0.05)
        assert sender.sessions == 0 and time.monotonic() - start < 5.0
        with pytest.raises((ConnectionError, p.ProtocolError)):  # reset, not a clean end
            for _ in range(10_000):
                data = await asyncio.wait_for(raw.reader.read(1 << 20), 5.0)
                raw.conn.receive_data(data)
                if not data:
                    break
        raw.close()
    finally:
        await sender.close()


@pytest.mark.parametrize("kw", [{"read_timeout": 0}, {"idle_timeout": -1}, {"max_sessions": 0},
                                {"max_pending_requests": 0}, {"max_frame": 1000},
                                {"auth_token": "short"}])
def test_server_config_validation(kw) -> None:
    with pytest.raises(ValueError):
        ServerConfig(**kw)


@pytest.mark.parametrize("kw", [{"max_buffered_bytes": 0}, {"max_frame": 10},
                                {"auth_token": b"short"}])
def test_session_config_validation(kw) -> None:
    with pytest.raises(ValueError):
        streamer.StreamSession("127.0.0.1", 1, "ctx", **kw)


# ------------------------------------------------- stored data and profile sizes
@pytest.fixture
def own_store(store_root: str, tmp_path) -> str:
    """A copy of the module's store that a test may damage."""
    import shutil

    shutil.copytree(store_root, tmp_path / "store")
    return str(tmp_path / "store")


async def _client(port: int) -> ClientConnection:
    return await ClientConnection.connect("127.0.0.1", port, timeout=5.0)


async def test_a_profile_larger_than_the_client_accepts_is_refused_past_one_frame() -> None:
    store = FakeStore(profile=bytes(3 << 20))
    sender = await streamer.serve(store, config=ServerConfig(max_frame=1 << 18))
    try:
        client = await _client(sender.port)
        assert len(await client.get_profile(PID, 5.0, max_bytes=3 << 20)) == 3 << 20
        with pytest.raises(ProfileTooLarge, match=f"exceeds {1 << 20} bytes"):
            await client.get_profile(PID, 5.0, max_bytes=1 << 20)
        assert client.closed
    finally:
        await sender.close()


async def test_the_sender_refuses_to_send_a_profile_over_the_receivers_limit(monkeypatch) -> None:
    import streamer.net.sender as sender_module

    monkeypatch.setattr(sender_module, "MAX_PROFILE_BYTES", 1000)
    sender = await streamer.serve(FakeStore(profile=bytes(1001)))
    try:
        client = await _client(sender.port)
        with pytest.raises(ServerError, match="1001 bytes, more than the 1000 receivers accept") as refused:
            await client.get_profile(PID, 5.0)
        assert refused.value.code == "internal"
        await client.close()
    finally:
        await sender.close()


@pytest.mark.parametrize("name, request_, message", [
    ("chunk-1-L2.kvw", p.Request(chunk=1, level=2), "stored chunk 1 at level 2 is {} bytes, the manifest says {}"),
    ("text-3.zst", p.Request(chunk=3, level=p.TEXT_LEVEL), "stored chunk 3's text is {} bytes, the manifest says {}"),
])
async def test_stored_data_whose_size_disagrees_with_the_manifest_is_not_sent(
        own_store: str, name: str, request_: p.Request, message: str) -> None:
    store = await streamer.open_store(own_store)
    manifest = await store.get_manifest("ctx")
    path = store.version_dir("ctx", manifest.version) / name
    stated = path.stat().st_size
    with open(path, "ab") as f:
        f.write(b"\0" * 1000)   # a blob grown behind the manifest's back
    sender = await streamer.serve(store)
    try:
        client = await _client(sender.port)
        await client.call(p.Open(context_id="ctx"), p.ManifestData, 5.0)
        with pytest.raises(ServerError, match=message.format(stated + 1000, stated)) as refused:
            await client.call(request_, p.ChunkBegin if request_.level != p.TEXT_LEVEL else p.Text, 5.0)
        assert refused.value.code == "internal"
        client.send(p.Request(chunk=0, level=2))   # the connection goes on
        assert isinstance((await client.next(5.0)).event, p.ChunkBegin)
        await client.close()
    finally:
        await sender.close()
        await store.close()


async def test_a_corrupt_stored_manifest_and_a_bad_context_id_are_typed_errors(own_store: str) -> None:
    from pathlib import Path

    manifest_path = Path(own_store) / "contexts" / "ctx" / "manifest.json"
    manifest_path.write_bytes(manifest_path.read_bytes().replace(b'"layers":4', b'"layers":0'))
    store = await streamer.open_store(own_store)
    sender = await streamer.serve(store)
    try:
        client = await _client(sender.port)
        with pytest.raises(ServerError, match="stored manifest of context 'ctx' is corrupt: layers must be") as bad:
            await client.call(p.Open(context_id="ctx"), p.ManifestData, 5.0)
        assert bad.value.code == "internal"
        with pytest.raises(ServerError, match="invalid context id '../etc'") as bad:
            await client.call(p.Open(context_id="../etc"), p.ManifestData, 5.0)
        assert (bad.value.code, bad.value.message.split(":")[0]) == ("bad_request", "invalid context id '../etc'")
        await client.close()
    finally:
        await sender.close()
        await store.close()


class CountingReads:
    """A store that counts the bytes its reads (chunks, texts, profiles) return: what a
    sender took into memory from it."""

    def __init__(self, store: streamer.Store) -> None:
        self.store, self.bytes_read = store, 0

    def __getattr__(self, name: str):
        return getattr(self.store, name)

    def _counted(self, data: bytes) -> bytes:
        self.bytes_read += len(data)
        return data

    async def get_chunk(self, *args) -> bytes:
        return self._counted(await self.store.get_chunk(*args))

    async def get_text(self, *args) -> bytes:
        return self._counted(await self.store.get_text(*args))

    async def get_profile_bytes(self, *args) -> bytes:
        return self._counted(await self.store.get_profile_bytes(*args))


#: what a grown stored item is made to measure: far over its manifest size (and the profile limit set below)
_HUGE = 64 << 20


async def _grow(store: streamer.Store, manifest: streamer.Manifest, item: str) -> None:
    """Make one stored item ``_HUGE`` bytes behind the manifest's back (a sparse file, or
    a SETRANGE past the end of the redis string)."""
    from streamer.store.file import FileStore

    if isinstance(store, FileStore):
        directory = store.version_dir("ctx", manifest.version)
        path = {"chunk": directory / "chunk-1-L2.kvw", "text": directory / "text-3.zst",
                "profile": store.root / "profiles" / f"{manifest.profile_id}.safetensors"}[item]
        os.truncate(path, _HUGE)
        return
    key = {"chunk": store.chunk_key("ctx", manifest.version, 1, 2), "text": store.text_key("ctx", manifest.version, 3),
           "profile": store._key("profile", manifest.profile_id)}[item]
    await store._client.setrange(key, _HUGE - 1, b"\0")


@pytest.mark.parametrize("item, request_, message", [
    ("chunk", p.Request(chunk=1, level=2), "stored chunk 1 at level 2 is {} bytes, the manifest says {}"),
    ("text", p.Request(chunk=3, level=p.TEXT_LEVEL), "stored chunk 3's text is {} bytes, the manifest says {}"),
    ("profile", None, "stored profile {} is {} bytes, more than the {} receivers accept"),
], ids=("chunk", "text", "profile"))
async def test_a_stored_item_far_over_its_size_is_refused_without_reading_it(
        store_url: str, limits_profile: codec.Profile, monkeypatch, item: str, request_: p.Request | None,
        message: str) -> None:
    """The sender asks the store for sizes first: a blob, text or profile grown far past
    what the manifest (or the receivers' profile limit) allows is refused with ERROR
    "internal" before a byte of it is read, and the connection goes on."""
    import streamer.net.sender as sender_module

    monkeypatch.setattr(sender_module, "MAX_PROFILE_BYTES", 1 << 20)
    tokens = 4 * CHUNK_TOKENS
    async with await streamer.open_store(store_url) as backend:
        manifest = await streamer.put_context(backend, "ctx", _kv(3, tokens), list(range(tokens)),
                                              profile=limits_profile, chunk_tokens=CHUNK_TOKENS)
        stated = (manifest.chunks[1].sizes[2] if item == "chunk" else manifest.chunks[3].text_bytes)
        await _grow(backend, manifest, item)
        store = CountingReads(backend)
        sender = await streamer.serve(store)
        try:
            client = await _client(sender.port)
            await client.call(p.Open(context_id="ctx"), p.ManifestData, 5.0)
            with pytest.raises(ServerError) as refused:
                if item == "profile":
                    await client.get_profile(manifest.profile_id, 5.0)
                else:
                    await client.call(request_, p.ChunkBegin if item == "chunk" else p.Text, 5.0)
            expected = (message.format(manifest.profile_id, _HUGE, 1 << 20) if item == "profile"
                        else message.format(_HUGE, stated))
            assert (refused.value.code, refused.value.message) == ("internal", expected)
            assert store.bytes_read == 0
            client.send(p.Request(chunk=0, level=2))   # the connection (and the daemon) go on
            assert isinstance((await client.next(5.0)).event, p.ChunkBegin)
            assert 0 < store.bytes_read == manifest.chunks[0].sizes[2]
            await client.close()
        finally:
            await sender.close()


async def test_a_stored_manifest_over_the_limit_is_refused_before_it_is_read(
        store_url: str, limits_profile: codec.Profile, monkeypatch) -> None:
    """A manifest grown past MAX_MANIFEST_BYTES in the store: the store refuses it from its
    size alone (a file store never reads it), the sender answers OPEN with a typed error
    naming the size, and keeps serving."""
    import streamer.store.file as file_module
    import streamer.wire.manifest as manifest_module
    from streamer.store.file import FileStore

    limit = 1 << 20
    monkeypatch.setattr(manifest_module, "MAX_MANIFEST_BYTES", limit)
    real_read = file_module._read

    async def no_manifest_reads(path):
        assert (path.parent.name, path.name) != ("ctx", "manifest.json"), "the oversized manifest was read"
        return await real_read(path)

    monkeypatch.setattr(file_module, "_read", no_manifest_reads)
    tokens = 2 * CHUNK_TOKENS
    async with await streamer.open_store(store_url) as store:
        for cid in ("ctx", "fine"):
            await streamer.put_context(store, cid, _kv(4, tokens), list(range(tokens)),
                                       profile=limits_profile, chunk_tokens=CHUNK_TOKENS)
        if isinstance(store, FileStore):
            os.truncate(store.root / "contexts" / "ctx" / "manifest.json", 2 * limit)
        else:
            await store._client.setrange(store._manifest_key("ctx"), 2 * limit - 1, b"\0")
        with pytest.raises(ManifestError, match=f"manifest is {2 * limit} bytes, over the {limit}-byte limit"):
            await store.get_manifest("ctx")
        sender = await streamer.serve(store)
        try:
            client = await _client(sender.port)
            with pytest.raises(ServerError, match="stored manifest of context 'ctx' is corrupt: manifest is") as bad:
                await client.call(p.Open(context_id="ctx"), p.ManifestData, 5.0)
            assert bad.value.code == "internal"
            await client.close()
            client = await _client(sender.port)
            assert isinstance(await client.call(p.Open(context_id="fine"), p.ManifestData, 5.0), p.ManifestData)
            await client.close()
        finally:
            await sender.close()


async def test_a_context_larger_than_the_receiver_keeps_is_refused_at_open(store_root) -> None:
    """The manifest (which the sender controls) says how much the context decodes to: over
    SessionConfig.max_context_bytes it is ContextTooLarge at open, at once, nothing fetched."""
    decoded = LAYERS * 2 * CHUNKS * CHUNK_TOKENS * HEADS * HEAD_DIM * 2
    async with Sending(store_root) as sender:
        async with streamer.StreamSession("127.0.0.1", sender.port, "ctx", max_context_bytes=decoded) as session:
            assert session.manifest.decoded_bytes == decoded
        with pytest.raises(streamer.ContextTooLarge, match=f"decodes to {decoded} bytes"):
            async with streamer.StreamSession("127.0.0.1", sender.port, "ctx", max_context_bytes=decoded - 1,
                                              max_reconnects=3):
                pass


async def test_a_profile_larger_than_the_manifests_shape_allows_is_refused(tmp_path, limits_profile) -> None:
    """A stored profile file swollen past what a profile of the context's shape can take
    (codec.max_profile_bytes): the receiver refuses it past one frame, never holding it."""
    root = str(tmp_path)
    store = await streamer.open_store(root)
    await streamer.put_context(store, "ctx", _kv(2, CHUNK_TOKENS), list(range(CHUNK_TOKENS)), profile=limits_profile,
                               chunk_tokens=CHUNK_TOKENS)
    await store.close()
    most = codec.max_profile_bytes(LAYERS, HEADS, HEAD_DIM, len(limits_profile.levels))
    assert len(limits_profile.to_bytes()) < most
    path = tmp_path / "profiles" / f"{limits_profile.id}.safetensors"
    path.write_bytes(path.read_bytes() + bytes(most))
    from streamer.net import session as session_module

    session_module._profiles.pop(limits_profile.id, None)
    async with Sending(root) as sender:
        with pytest.raises(streamer.ConnectionLost, match=f"exceeds {most} bytes"):
            async with streamer.StreamSession("127.0.0.1", sender.port, "ctx", max_reconnects=0):
                pass


def test_the_profile_cache_is_bounded_in_bytes(monkeypatch, limits_profile) -> None:
    """Profiles kept for later sessions stay within PROFILE_CACHE_BYTES, least recently used
    out first; the newest stays whatever its size."""
    from collections import OrderedDict

    from streamer.net import session as session_module

    small = codec.calibrate([synthetic_kv(3, 256, 2, 2, 8)])
    monkeypatch.setattr(session_module, "_profiles", OrderedDict())
    monkeypatch.setattr(session_module, "PROFILE_CACHE_BYTES", limits_profile.nbytes + small.nbytes)
    for profile in (small, limits_profile, small):
        session_module._remember_profile(profile)
    assert list(session_module._profiles) == [limits_profile.id, small.id]
    monkeypatch.setattr(session_module, "PROFILE_CACHE_BYTES", 1)
    session_module._remember_profile(limits_profile)
    assert list(session_module._profiles) == [limits_profile.id]
