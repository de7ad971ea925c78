"""The fault matrix (docs/FAULTS.md): one test per row.

Every row checks the same invariants: each delivery is in order and exactly once
(``Recorder`` asserts as deliveries happen), every delivered layer is bit-identical to
decoding the stored blob at the level the report names (never a wrong tensor), and the
stored context is intact afterwards (the old version or the new one, never half).
"""
from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import codec
import netsim
from codec.synthetic import chained_kv
import streamer
from streamer_helpers import arrived_bytes, synthetic_kv
from netsim.proxy import LinkSpec
from netsim.shaping import Cut
from streamer.wire import frames
from streamer.wire.frames import MIN_MAX_FRAME
from streamer.adapt.policies import TEXT
from streamer.net import sender as sender_module
from streamer.fetch.controller import MAX_CORRUPT_RETRIES
from streamer.store import StoreError, open_store

LAYERS, HEADS, HEAD_DIM = 4, 8, 32
CHUNK_TOKENS = 256
CHUNKS = 8
TOKENS = CHUNKS * CHUNK_TOKENS
pytestmark = pytest.mark.timeout(60)


def _kv(seed: int, tokens: int) -> torch.Tensor:
    return synthetic_kv(seed, tokens, LAYERS, HEADS, HEAD_DIM)


async def _put(url: str, context_id: str, ctx: dict, tokens: int = TOKENS) -> streamer.Manifest:
    store = await open_store(url)
    try:
        return await streamer.put_context(store, context_id, ctx["kv"][:, :, :tokens], ctx["tokens"][:tokens],
                                          profile=ctx["profile"], chunk_tokens=CHUNK_TOKENS)
    finally:
        await store.close()


@pytest.fixture(scope="module")
def _contexts() -> dict:
    """The contexts stored so far, by kind: pytest sets a fixture up once per parametrize
    entry, not per value, so the rows that share one share it through here."""
    return {}


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest, _contexts: dict):
    """An 8-chunk context in a file store. A row parametrized with ``"predicted"``
    (indirect) stores it with a predicting profile (blob format 7; layers 0 and 2 coded
    alone, 1 and 3 from the layer before)."""
    kind = getattr(request, "param", "plain")
    if kind not in _contexts:
        _contexts[kind] = _stored_context(tmp_path_factory, kind)
    return _contexts[kind]


def _stored_context(tmp_path_factory: pytest.TempPathFactory, kind: str) -> dict:
    root = tmp_path_factory.mktemp("faults-store")
    if kind == "predicted":
        kv = chained_kv(LAYERS, HEADS, HEAD_DIM, TOKENS, 2)
        profile = codec.calibrate([chained_kv(LAYERS, HEADS, HEAD_DIM, 2048, 1)], predict=2)
    else:
        kv, profile = _kv(2, TOKENS), codec.calibrate([_kv(1, 2048)])
    out = {"root": str(root), "kv": kv, "tokens": [(7 * i) % 30000 for i in range(TOKENS)], "profile": profile}
    out["manifest"] = asyncio.run(_put(str(root), "ctx", out))
    return out


async def _reference(url: str, manifest: streamer.Manifest, profile: codec.Profile) -> dict:
    """{(chunk, level): decoded tensor} of everything stored for ``manifest``'s version."""
    store = await open_store(url)
    try:
        ref = {}
        for i, info in enumerate(manifest.chunks):
            for level in range(len(info.sizes)):
                blob = await store.get_chunk(manifest.context_id, manifest.version, i, level)
                ref[i, level] = codec.decode(blob, profile)
        return ref
    finally:
        await store.close()


@pytest.fixture(scope="module")
def reference(ctx):
    """The reference decode of every blob stored for ``ctx`` (made once per context)."""
    if "reference" not in ctx:
        ctx["reference"] = asyncio.run(_reference(ctx["root"], ctx["manifest"], ctx["profile"]))
    return ctx["reference"]


class Recorder:
    """Every delivery, asserting order and exactly-once as it happens."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.position = (0, 0)
        self.superseded: dict[int, int] = {}   # chunk -> layers delivered before its text

    def on_layer(self, chunk: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        assert (chunk, layer) == self.position, f"got {(chunk, layer)}, expected {self.position}"
        self.position = (chunk, layer + 1) if layer + 1 < LAYERS else (chunk + 1, 0)
        self.events.append((chunk, layer, k.clone(), v.clone()))

    def on_text(self, chunk: int, token_ids: list[int]) -> None:
        # a chunk may switch to text after some of its layers went out (superseding them)
        assert self.position[0] == chunk, f"text for chunk {chunk} at {self.position}"
        self.superseded[chunk] = self.position[1]
        self.position = (chunk + 1, 0)
        self.events.append((chunk, TEXT, token_ids))


def check_delivery(rec: Recorder, report, ctx: dict, reference: dict, *, complete: bool = True,
                   superseded_level: int = 0) -> None:
    """No wrong tensor, no wrong text: each delivery equals the reference of its level
    (``superseded_level`` for layers of a chunk that then switched to text)."""
    manifest = ctx["manifest"]
    for c in report.chunks:
        assert c.superseded_layers == rec.superseded.get(c.index, 0), (c.index, rec.superseded)
    if complete:
        assert rec.position == (len(manifest.chunks), 0), rec.position
    for event in rec.events:
        chunk, info = event[0], manifest.chunks[event[0]]
        if event[1] == TEXT:
            assert event[2] == ctx["tokens"][info.start:info.end]
            continue
        level = report.chunks[chunk].level
        if level == TEXT:   # layers that went out before the chunk switched to text
            assert event[1] < report.chunks[chunk].superseded_layers, \
                f"chunk {chunk} delivered layer {event[1]} but reports text"
            level = superseded_level
        ref = reference[chunk, level]
        assert torch.equal(event[2], ref[event[1], 0]), f"wrong K for chunk {chunk} layer {event[1]}"
        assert torch.equal(event[3], ref[event[1], 1]), f"wrong V for chunk {chunk} layer {event[1]}"


def _session(port: int, rec: Recorder, **kw) -> streamer.StreamSession:
    kw.setdefault("slo", 30.0)
    kw.setdefault("policy", "fixed:0")
    return streamer.StreamSession("127.0.0.1", port, "ctx", on_layer=rec.on_layer, on_text=rec.on_text, **kw)


async def _warm_profile_cache(port: int) -> None:
    """A first fetch caches the profile, so the faults below land in chunk data."""
    async with streamer.StreamSession("127.0.0.1", port, "ctx", slo=10.0, policy="text") as session:
        await session.fetch()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn_sender(root: str, port: int = 0) -> tuple[subprocess.Popen, int]:
    """``kvwire serve`` as a separate process; returns it and its port."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "streamer.tools.cli", "serve", "--store", root,
                             "--listen", f"127.0.0.1:{port}"], stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if "kvwire serve:" not in line:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"sender did not start: {line!r}")
    return proc, int(line.rsplit(":", 1)[1])


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------- row 1: sender SIGKILLed
@pytest.mark.slow
async def test_sender_killed_mid_chunk_resumes_on_fallback(ctx, reference) -> None:
    proc, port = await asyncio.to_thread(_spawn_sender, ctx["root"])
    fallback_store = await open_store(ctx["root"])
    fallback = await streamer.serve(fallback_store)
    killed: list[int] = []
    rec = Recorder()
    try:
        await _warm_profile_cache(port)
        async with netsim.ShapingProxy(upstream=("127.0.0.1", port), trace=20.0) as proxy:
            def on_layer(chunk: int, layer: int, k, v) -> None:
                rec.on_layer(chunk, layer, k, v)
                if (chunk, layer) == (1, 1) and not killed:
                    os.kill(proc.pid, signal.SIGKILL)   # mid-chunk: layers 2.. of chunk 1 still due
                    killed.append(proxy.stats.down_bytes)

            async with streamer.StreamSession("127.0.0.1", proxy.port, "ctx", slo=30.0, policy="fixed:0",
                                              servers=[("127.0.0.1", fallback.port)], stall_timeout=1.0,
                                              on_layer=on_layer, on_text=rec.on_text) as session:
                report = await session.fetch()
    finally:
        _stop(proc)
        await fallback.close()
        await fallback_store.close()
    assert killed and proc.returncode == -signal.SIGKILL
    assert report.reconnects >= 1
    check_delivery(rec, report, ctx, reference)
    assert all(c.level == 0 for c in report.chunks)


# ---------------------------------------------------------------- row 2: sender restarted
@pytest.mark.slow
async def test_sender_restarted_on_the_same_port_resumes(ctx, reference) -> None:
    proc, port = await asyncio.to_thread(_spawn_sender, ctx["root"])
    procs = [proc]
    rec = Recorder()
    restarted = asyncio.Event()

    async def restart() -> None:
        await asyncio.to_thread(_stop, procs[0])
        for _ in range(50):   # the port can linger for a moment; SO_REUSEADDR makes it rare
            try:
                procs.append((await asyncio.to_thread(_spawn_sender, ctx["root"], port))[0])
                break
            except RuntimeError:
                await asyncio.sleep(0.1)
        restarted.set()

    tasks = []
    try:
        await _warm_profile_cache(port)
        async with netsim.ShapingProxy(upstream=("127.0.0.1", port), trace=20.0) as proxy:
            def on_layer(chunk: int, layer: int, k, v) -> None:
                rec.on_layer(chunk, layer, k, v)
                if (chunk, layer) == (1, 1) and not tasks:
                    os.kill(procs[0].pid, signal.SIGKILL)
                    tasks.append(asyncio.ensure_future(restart()))

            # only the one address: reconnects back off until the restarted sender answers
            async with streamer.StreamSession("127.0.0.1", proxy.port, "ctx", slo=30.0, policy="fixed:0",
                                              stall_timeout=1.0, max_reconnects=12, backoff=0.2,
                                              max_backoff=1.0, connect_timeout=2.0,
                                              on_layer=on_layer, on_text=rec.on_text) as session:
                report = await session.fetch()
        await asyncio.wait_for(restarted.wait(), 20)
    finally:
        for task in tasks:
            await asyncio.gather(task, return_exceptions=True)
        for p in procs:
            _stop(p)
    assert len(procs) == 2, "the sender could not be restarted on its port"
    assert report.reconnects >= 1
    check_delivery(rec, report, ctx, reference)


# ---------------------------------------------------------------- row 3: connection reset
@pytest.mark.parametrize("ctx", ["plain", "predicted"], indirect=True)
async def test_connection_reset_resumes(ctx, reference) -> None:
    store = await open_store(ctx["root"])
    sender = await streamer.serve(store)
    rec = Recorder()
    try:
        await _warm_profile_cache(sender.port)
        down = LinkSpec(cut=Cut("reset", at_byte=int(0.4 * sum(c.sizes[0] for c in ctx["manifest"].chunks))))
        async with netsim.ShapingProxy(upstream=("127.0.0.1", sender.port), down=down) as proxy:
            async with _session(proxy.port, rec, servers=[("127.0.0.1", sender.port)], record=True) as session:
                report = await session.fetch()
    finally:
        await sender.close()
        await store.close()
    assert report.reconnects >= 1
    check_delivery(rec, report, ctx, reference)
    assert not any(e[1] == TEXT for e in rec.events)
    # the bytes of the answer the reset cut count too: the report says what crossed the link
    assert report.bytes == arrived_bytes(session.log) > sum(c.sizes[0] for c in ctx["manifest"].chunks)


# ---------------------------------------------------------------- row 4: stall past the deadline
@pytest.mark.parametrize("fallback", [True, False], ids=["fallback", "no-fallback"])
async def test_stall_past_the_deadline(ctx, reference, fallback: bool) -> None:
    """The link goes silent (rate 0) for good at chunk 2, longer than the whole SLO.

    With a fallback sender the session reconnects there after ``stall_timeout``; the
    deadline has passed by then, so every chunk not yet requested comes at whatever
    finishes it soonest, text or a level (a chunk already partly delivered is finished at
    its level). Without one, every reconnect stalls too and the fetch fails with a
    FetchFailed whose report says what was delivered (or, if the shaper's leftover burst
    lets the tiny text answers through, completes with the rest as text). Either way: no
    duplicate, no wrong tensor."""
    store = await open_store(ctx["root"])
    sender = await streamer.serve(store)
    rec = Recorder()
    try:
        await _warm_profile_cache(sender.port)
        async with netsim.ShapingProxy(upstream=("127.0.0.1", sender.port), trace=20.0) as proxy:
            def on_chunk(report) -> None:
                if report.index == 1:
                    proxy.set_trace(0.0, direction="down")

            servers = [("127.0.0.1", sender.port)] if fallback else []
            async with _session(proxy.port, rec, slo=1.0, servers=servers, stall_timeout=1.2,
                                max_reconnects=2, backoff=0.01, connect_timeout=0.5,
                                on_chunk=on_chunk) as session:
                try:
                    report = await session.fetch()
                    completed = True
                except streamer.FetchFailed as failure:
                    assert not fallback, f"the fallback sender should have finished the fetch: {failure}"
                    report, completed = failure.report, False
    finally:
        await sender.close()
        await store.close()
    assert report.reconnects >= 1
    check_delivery(rec, report, ctx, reference, complete=completed)
    if completed:
        # Without a fallback this happens only when the shaper's leftover burst lets the
        # tiny text answers through the dead link; either way the rule, not the policy,
        # decided the rest once the deadline had passed.
        late = [c.index for c in report.chunks if (c.reason or "").startswith(("deadline passed", "no time left"))]
        assert late and max(late) == CHUNKS - 1, [(c.index, c.level, c.reason) for c in report.chunks]
    else:
        assert rec.position < (CHUNKS, 0)


# ---------------------------------------------------------------- row 5: truncated frame
class TruncatingSender:
    """A fake sender in front of a real one: relays ``keep`` whole frames to the
    receiver, then writes the first half of the next frame and closes."""

    def __init__(self, upstream_port: int, keep: int) -> None:
        self.upstream_port, self.keep = upstream_port, keep
        self.truncations = 0
        self.server: asyncio.AbstractServer | None = None

    async def __aenter__(self) -> "TruncatingSender":
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _accept(self, creader, cwriter) -> None:
        ureader, uwriter = await asyncio.open_connection("127.0.0.1", self.upstream_port)

        async def up() -> None:
            with __import__("contextlib").suppress(Exception):
                while data := await creader.read(65536):
                    uwriter.write(data)
                    await uwriter.drain()

        pump = asyncio.ensure_future(up())
        try:
            for _ in range(self.keep + 1):
                head = await ureader.readexactly(frames.HEADER.size)
                length = struct.unpack_from("<I", head)[0]
                frame = head + await ureader.readexactly(length)
                if _ == self.keep:
                    cwriter.write(frame[:max(1, len(frame) // 2)])
                    self.truncations += 1
                else:
                    cwriter.write(frame)
                await cwriter.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            pump.cancel()
            uwriter.close()
            cwriter.close()


@pytest.mark.parametrize("keep", [0, 3, 40], ids=["in-welcome", "after-manifest", "mid-chunk"])
async def test_truncated_frame_resumes_on_fallback(ctx, reference, keep: int) -> None:
    store = await open_store(ctx["root"])
    sender = await streamer.serve(store)
    rec = Recorder()
    try:
        await _warm_profile_cache(sender.port)
        async with TruncatingSender(sender.port, keep) as fake:
            async with _session(fake.port, rec, servers=[("127.0.0.1", sender.port)], backoff=0.01) as session:
                report = await session.fetch()
        assert fake.truncations >= 1
    finally:
        await sender.close()
        await store.close()
    check_delivery(rec, report, ctx, reference)


@pytest.mark.parametrize("keep", [0, 40], ids=["in-welcome", "mid-chunk"])
async def test_truncated_frame_without_fallback_fails_cleanly_or_resumes(ctx, reference, keep: int) -> None:
    """Only the truncating sender: cut in the WELCOME, every attempt fails and the session
    raises a typed error (ConnectionLost from connect); cut mid-chunk, each reconnect
    resumes a little further, so the fetch either completes or fails with FetchFailed.
    Never a crash, a hang, a duplicate or a wrong tensor."""
    store = await open_store(ctx["root"])
    sender = await streamer.serve(store)
    rec = Recorder()
    report, failed = None, None
    try:
        await _warm_profile_cache(sender.port)
        async with TruncatingSender(sender.port, keep) as fake:
            try:
                async with _session(fake.port, rec, max_reconnects=8, backoff=0.01) as session:
                    report = await session.fetch()
            except (streamer.ConnectionLost, streamer.FetchFailed) as exc:
                failed = exc
                report = getattr(exc, "report", None)
        assert fake.truncations >= 1
    finally:
        await sender.close()
        await store.close()
    if keep == 0:
        assert isinstance(failed, streamer.ConnectionLost) and not rec.events
    elif report is not None:
        check_delivery(rec, report, ctx, reference, complete=failed is None)


# ---------------------------------------------------------------- row 6: one corrupted byte
#: where the damaged byte of chunk 2's level-0 blob sits: offset from the start of a
#: layer's section, or in the header (the magic; a field the header CRC covers)
DAMAGE = {"layer0": lambda h: h.section_offset(0) + 17, "layer1": lambda h: h.section_offset(1) + 17,
          "layer2": lambda h: h.section_offset(2) + 17,
          "magic": lambda h: 0, "header_field": lambda h: 20}


async def _fetch_from(store, **serve_options) -> tuple[Recorder, streamer.FetchReport]:
    """Serve ``store`` (closed afterwards) and fetch the context from it at level 0,
    the profile already cached so faults land in chunk data."""
    sender = await streamer.serve(store, **serve_options)
    rec = Recorder()
    try:
        await _warm_profile_cache(sender.port)
        async with _session(sender.port, rec) as session:
            return rec, await session.fetch()
    finally:
        await sender.close()
        await store.close()


@pytest.mark.parametrize("times", [1, 100], ids=["once", "always"])
@pytest.mark.parametrize("ctx, source, where", [
    ("plain", "store", "layer0"), ("plain", "store", "layer2"), ("plain", "wire", "layer2"),
    ("plain", "wire", "magic"), ("plain", "wire", "header_field"),
    ("predicted", "wire", "layer1"), ("predicted", "wire", "layer2")], indirect=["ctx"])
async def test_one_corrupted_byte(ctx, reference, monkeypatch, times: int, source: str, where: str) -> None:
    """Chunk 2's level-0 blob arrives with one byte flipped, once (the refetch is clean:
    every layer at level 0) or every time (after MAX_CORRUPT_RETRIES refetches the chunk
    comes as text, superseding any of its layers already delivered). The damage is in
    the stored blob, or made on the way (after the sender's own checks): a bad header is
    caught like a bad section, and one bad byte costs one refetch, not one per frame. In
    a predicted blob a bad layer takes the layers predicted from it down too, and the
    refetch starts at the layer coded alone before the first not delivered."""
    store = await open_store(ctx["root"])
    real_get_chunk = store.get_chunk
    served: list[int] = []

    def damage(blob: bytes, first_layer: int = 0) -> bytes:
        """``blob``, or a continuation of it from ``first_layer`` (its header, then the
        sections from there), with the byte DAMAGE names flipped."""
        if len(served) >= times:
            return blob
        header = codec.parse_header(blob)
        offset = DAMAGE[where](header)
        if offset >= header.size:   # in a section: where it lies in this answer
            offset -= header.section_offset(first_layer) - header.section_offset(0)
        damaged = bytearray(blob)
        damaged[offset] ^= 0x01
        served.append(2)
        return bytes(damaged)

    async def get_chunk(context_id, version, chunk, level):
        blob = await real_get_chunk(context_id, version, chunk, level)
        return damage(blob) if (chunk, level) == (2, 0) and source == "store" else blob

    real_blob_parts = sender_module.blob_parts

    def blob_parts(blob: bytes, limit: int, first_layer: int = 0):
        parts = list(real_blob_parts(blob, limit, first_layer))
        if source != "wire" or blob != reference_blobs[2]:
            return iter(parts)
        data = damage(b"".join(parts), first_layer)
        return iter(memoryview(data)[start:start + len(part)]
                    for start, part in zip(itertools.accumulate((len(q) for q in parts), initial=0), parts))

    reference_blobs = {2: await real_get_chunk("ctx", ctx["manifest"].version, 2, 0)}
    store.get_chunk = get_chunk
    monkeypatch.setattr(sender_module, "blob_parts", blob_parts)
    # small frames: a chunk's answer spans many parts, so a bad header is seen by each
    rec, report = await _fetch_from(store, config=streamer.ServerConfig(max_frame=MIN_MAX_FRAME))
    check_delivery(rec, report, ctx, reference)
    if times == 1:
        assert len(served) == 1 and report.chunks[2].retries == 1
        assert all(c.level == 0 for c in report.chunks)
    else:
        assert len(served) == 1 + MAX_CORRUPT_RETRIES
        assert report.chunks[2].level == TEXT and "corrupt" in report.chunks[2].reason
        assert report.chunks[2].superseded_layers == {"layer1": 1, "layer2": 2}.get(where, 0)
        assert all(c.level == 0 for i, c in enumerate(report.chunks) if i != 2)


async def test_a_stored_blob_with_a_bad_header_goes_to_text(ctx, reference) -> None:
    """The sender checks a stored blob's header before sending it: a damaged one is
    answered with an error, and the session sends that chunk as text at once."""
    store = await open_store(ctx["root"])
    real_get_chunk = store.get_chunk

    async def get_chunk(context_id, version, chunk, level):
        blob = await real_get_chunk(context_id, version, chunk, level)
        return b"X" + blob[1:] if (chunk, level) == (2, 0) else blob

    store.get_chunk = get_chunk
    rec, report = await _fetch_from(store)
    check_delivery(rec, report, ctx, reference)
    assert report.chunks[2].level == TEXT and "stored chunk is corrupt" in report.chunks[2].reason
    assert all(c.level == 0 for i, c in enumerate(report.chunks) if i != 2)


# ---------------------------------------------------------------- row 7: Redis restarted mid-fetch
def _redis_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _start_redis(port: int, directory: Path) -> subprocess.Popen:
    proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "yes", "--appendfsync", "always",
                             "--dir", str(directory)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not _redis_ping(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("redis-server did not start")
        time.sleep(0.02)
    return proc


def _stop_redis(proc: subprocess.Popen) -> None:
    proc.terminate()   # SIGTERM: redis flushes the AOF and exits
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.mark.redis
@pytest.mark.slow
async def test_redis_restarted_mid_fetch(ctx, tmp_path: Path) -> None:
    """A private redis-server with an append-only file, restarted while a sender reads
    from it. While it is down the sender answers ERROR "unavailable" (non-fatal): the
    chunk asked for falls back to text, and if text is unavailable too the fetch fails
    with FetchFailed. Either way no wrong or duplicate delivery; after the restart the
    context is intact (AOF) and a fresh fetch is complete and exact."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not on PATH")
    port = _free_port()
    procs = [await asyncio.to_thread(_start_redis, port, tmp_path)]
    url = f"redis://127.0.0.1:{port}/0?prefix=faults"
    try:
        manifest = await _put(url, "ctx", ctx)
        reference = await _reference(url, manifest, ctx["profile"])
        local = dict(ctx, manifest=manifest)
        store = await open_store(url)
        sender = await streamer.serve(store)
        tasks: list[asyncio.Future] = []

        async def restart() -> None:
            await asyncio.to_thread(_stop_redis, procs[-1])
            procs.append(await asyncio.to_thread(_start_redis, port, tmp_path))

        rec = Recorder()
        try:
            await _warm_profile_cache(sender.port)
            async with netsim.ShapingProxy(upstream=("127.0.0.1", sender.port), trace=20.0) as proxy:
                def on_chunk(report) -> None:
                    if report.index == 1 and not tasks:
                        tasks.append(asyncio.ensure_future(restart()))

                async with _session(proxy.port, rec, on_chunk=on_chunk) as session:
                    try:
                        report = await session.fetch()
                        complete = True
                    except streamer.FetchFailed as exc:
                        report, complete = exc.report, False
            await asyncio.gather(*tasks)
            check_delivery(rec, report, local, reference, complete=complete)
            # the store survived the restart: same version, and a fresh fetch is exact
            assert (await store.get_manifest("ctx")).version == manifest.version
            rec = Recorder()
            async with _session(sender.port, rec) as session:
                report = await session.fetch()
            check_delivery(rec, report, local, reference)
            assert all(c.level == 0 for c in report.chunks)
        finally:
            await sender.close()
            await store.close()
        assert len(procs) == 2
    finally:
        for proc in procs:
            if proc.poll() is None:
                _stop_redis(proc)


# ---------------------------------------------------------------- row 8: disk full during a put
@pytest.fixture
def tiny_tmpfs(tmp_path: Path):
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def _visible_files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


async def test_disk_full_during_a_put_keeps_the_previous_version(ctx, tiny_tmpfs: Path) -> None:
    root = tiny_tmpfs / "store"
    old = await _put(str(root), "ctx", ctx, tokens=2 * CHUNK_TOKENS)
    before = _visible_files(root)
    store = await open_store(str(root))
    try:
        big = torch.cat([ctx["kv"]] * 4, dim=2)
        with pytest.raises(StoreError):
            await streamer.put_context(store, "ctx", big, ctx["tokens"] * 4, profile=ctx["profile"],
                                       chunk_tokens=CHUNK_TOKENS)
        # the old version is still the current one and reads back exactly
        manifest = await store.get_manifest("ctx")
        assert manifest.version == old.version
        ref = await _reference(str(root), old, ctx["profile"])
        assert len(ref) == sum(len(c.sizes) for c in old.chunks)
        text = await store.get_text("ctx", old.version, 1)
        assert streamer.store.put.decode_tokens(text) == ctx["tokens"][CHUNK_TOKENS:2 * CHUNK_TOKENS]
    finally:
        await store.close()
    # no partial files left visible: nothing but what the old version had
    after = _visible_files(root)
    assert not [f for f in after if ".tmp-" in f], after
    assert after - before == set(), after - before
    # and the store is usable again once space is back: a small put commits
    new = await _put(str(root), "ctx", ctx, tokens=CHUNK_TOKENS)
    assert new.version != old.version
