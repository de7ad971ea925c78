"""StreamSession against a real sender over real loopback sockets, with and without
the shaping proxy: ordering and exactly-once delivery, adaptation to a rate drop,
pipelining, and recovery from resets, stalls, dead senders and corrupt chunks."""
from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import codec
import netsim
import streamer
from streamer_helpers import synthetic_kv
from netsim.proxy import LinkSpec
from netsim.shaping import Cut, Stall
from streamer.adapt import decoding
from streamer.adapt.policies import TEXT

LAYERS, HEADS, HEAD_DIM = 4, 8, 32
CHUNK_TOKENS = 256
TOKENS = 12 * CHUNK_TOKENS


def _kv(seed: int, tokens: int) -> torch.Tensor:
    return synthetic_kv(seed, tokens, LAYERS, HEADS, HEAD_DIM)


@pytest.fixture(scope="module")
def context(tmp_path_factory: pytest.TempPathFactory):
    """A 12-chunk context put into a file store once for the whole module."""
    root = tmp_path_factory.mktemp("store")
    kv = _kv(2, TOKENS)
    token_ids = [(7 * i) % 30000 for i in range(TOKENS)]
    profile = codec.calibrate([_kv(1, 2048)])

    async def put() -> streamer.Manifest:
        store = await streamer.open_store(str(root))
        try:
            return await streamer.put_context(store, "ctx", kv, token_ids, profile=profile,
                                              chunk_tokens=CHUNK_TOKENS)
        finally:
            await store.close()

    manifest = asyncio.run(put())
    return {"root": str(root), "kv": kv, "tokens": token_ids, "profile": profile, "manifest": manifest}


@pytest.fixture
async def sender(context):
    store = await streamer.open_store(context["root"])
    server = await streamer.serve(store)
    yield server
    await server.close()
    await store.close()


class Recorder:
    """Collects every delivery and checks order and exactly-once as they happen."""

    def __init__(self, layers: int = LAYERS) -> None:
        self.layers = layers
        self.events: list[tuple] = []
        self.position = (0, 0)  # next expected (chunk, layer)

    def on_layer(self, chunk: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        assert (chunk, layer) == self.position, f"got {(chunk, layer)}, expected {self.position}"
        self.position = (chunk, layer + 1) if layer + 1 < self.layers else (chunk + 1, 0)
        self.events.append((chunk, layer, k.clone(), v.clone()))

    def on_text(self, chunk: int, token_ids: list[int]) -> None:
        # a chunk may switch to text after some of its layers went out (cancelled to meet
        # the deadline): the text then supersedes them, as the session documents
        assert self.position[0] == chunk, f"text for chunk {chunk} at {self.position}"
        self.position = (chunk + 1, 0)
        self.events.append((chunk, TEXT, token_ids))

    def assemble(self, manifest) -> tuple[torch.Tensor, set[int]]:
        out = torch.full((LAYERS, 2, manifest.tokens, HEADS, HEAD_DIM), math.nan, dtype=torch.float16)
        text = set()
        for event in self.events:
            info = manifest.chunks[event[0]]
            if event[1] == TEXT:
                text.add(event[0])
            else:
                out[event[1], 0, info.start:info.end] = event[2]
                out[event[1], 1, info.start:info.end] = event[3]
        return out, text


def _distortion(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return float(((x - y) ** 2).sum() / ((x - x.mean(dim=2, keepdim=True)) ** 2).sum())


async def test_every_layer_in_order_exactly_once_at_a_fixed_level(context, sender) -> None:
    rec = Recorder()
    async with streamer.StreamSession("127.0.0.1", sender.port, "ctx", slo=5.0, policy="fixed:1",
                                      on_layer=rec.on_layer, on_text=rec.on_text) as session:
        report = await session.fetch()
    manifest = context["manifest"]
    assert rec.position == (len(manifest.chunks), 0)
    assert [c.level for c in report.chunks] == [1] * len(manifest.chunks)
    assert report.bytes == sum(c.sizes[1] for c in manifest.chunks)
    got, text = rec.assemble(manifest)
    assert not text
    # bit-identical to decoding the stored blobs directly
    for i, info in enumerate(manifest.chunks):
        blob_kv = codec.decode(codec.encode(context["kv"][:, :, info.start:info.end], 1, context["profile"],
                                            sink_tokens=None if i == 0 else 0), context["profile"])
        assert torch.equal(got[:, :, info.start:info.end], blob_kv)
    assert _distortion(context["kv"], got) < 2 * context["profile"].targets[1]


async def test_a_finished_session_frees_its_consumer_without_the_cyclic_collector(context, sender) -> None:
    """What a consumer's callbacks hold (in the completions server, a prefix's whole KV)
    goes with the session, by reference counting alone: held in a cycle through the
    session, it stayed until the cyclic collector ran, and a server's memory grew by a
    prefix per request meanwhile."""
    import gc
    import weakref

    rec = Recorder()
    gone = weakref.ref(rec)
    gc.disable()
    try:
        async with streamer.StreamSession("127.0.0.1", sender.port, "ctx", slo=5.0, policy="fixed:1",
                                          on_layer=rec.on_layer, on_text=rec.on_text) as session:
            await session.fetch()
            assert session.delivered_layers(0) == context["manifest"].layers
        del session, rec
        assert gone() is None
    finally:
        gc.enable()


async def test_async_callbacks_and_text_policy(context, sender) -> None:
    seen: list[tuple[int, list[int]]] = []

    async def on_text(chunk: int, token_ids: list[int]) -> None:
        await asyncio.sleep(0)
        seen.append((chunk, token_ids))

    async with streamer.StreamSession("127.0.0.1", sender.port, "ctx", slo=5.0, policy="text",
                                      on_text=on_text) as session:
        report = await session.fetch()
    manifest = context["manifest"]
    assert [c for c, _ in seen] == list(range(len(manifest.chunks)))
    for chunk, token_ids in seen:
        info = manifest.chunks[chunk]
        assert token_ids == context["tokens"][info.start:info.end]
    assert report.text_chunks == len(manifest.chunks)
    assert report.first_layer_seconds is None


async def test_a_rate_drop_makes_later_chunks_cheaper(context, sender) -> None:
    rec = Recorder()
    async with netsim.ShapingProxy(upstream=("127.0.0.1", sender.port), trace=200.0) as proxy:
        def on_chunk(report) -> None:
            if report.index == 3:
                proxy.set_trace(netsim.Trace.constant(8.0, 60.0), direction="down")

        async with streamer.StreamSession("127.0.0.1", proxy.port, "ctx", slo=1.5, policy="mpc",
                                          on_layer=rec.on_layer, on_text=rec.on_text,
                                          on_chunk=on_chunk, prior_bps=200e6 / 8) as session:
            report = await session.fetch()
    levels = [c.level for c in report.chunks]
    rank = [len(context["profile"].levels) if lv == TEXT else lv for lv in levels]
    assert rec.position == (len(context["manifest"].chunks), 0)
    assert min(rank[:3]) <= 1, levels            # fast link: high quality
    assert min(rank[6:]) > max(rank[1:3]), levels  # after the drop: strictly cheaper choices


async def test_first_layer_arrives_before_the_last_chunk_is_sent(context, sender) -> None:
    total = sum(c.sizes[2] for c in context["manifest"].chunks)
    sent_at_first_layer: list[int] = []
    async with netsim.ShapingProxy(upstream=("127.0.0.1", sender.port), trace=40.0) as proxy:
        def on_layer(chunk: int, layer: int, k, v) -> None:
            if (chunk, layer) == (0, 0):
                sent_at_first_layer.append(proxy.stats.down_bytes)

        async with streamer.StreamSession("127.0.0.1", proxy.port, "ctx", slo=10.0, policy="fixed:2",
                                          on_layer=on_layer) as session:
            report = await session.fetch()
    assert sent_at_first_layer and sent_at_first_layer[0] < total / 2
    assert report.first_layer_seconds < report.total_seconds / 2


async def test_requests_are_pipelined_so_the_link_never_idles(context, sender) -> None:
    """Over a link with 20 ms one-way delay, the 11 chunks after the first must not cost
    11 round trips: with one chunk queued ahead (``MAX_QUEUED_AHEAD``), at least every
    other request leaves while the chunk before it is still arriving (without pipelining,
    none would). Judged by the order of the report's own timestamps (a chunk's request
    left at ``finished_at - seconds``), not by a duration, which a busy CI machine
    stretches (a bound of 75% of 11 round trips failed there by 2 ms)."""
    async with netsim.ShapingProxy(upstream=("127.0.0.1", sender.port), delay_ms=20.0) as proxy:
        async with streamer.StreamSession("127.0.0.1", proxy.port, "ctx", slo=10.0, policy="fixed:3") as session:
            report = await session.fetch()
    chunks = sorted(report.chunks, key=lambda c: c.index)
    requested = [c.finished_at - c.seconds for c in chunks]
    overlapped = [requested[i] < chunks[i - 1].finished_at for i in range(1, len(chunks))]
    assert len(overlapped) == 11 and sum(overlapped) >= 5, list(zip(requested, [c.finished_at for c in chunks]))


@pytest.mark.parametrize("fault", ["reset", "close", "stall"])
async def test_faults_reconnect_to_the_next_server_and_resume(context, sender, fault: str) -> None:
    # a first fetch fills the receiver's profile cache, so the fault lands in chunk data
    async with streamer.StreamSession("127.0.0.1", sender.port, "ctx", slo=5.0, policy="text") as session:
        await session.fetch()
    down = {"reset": LinkSpec(cut=Cut("reset", at_byte=700_000)),
            "close": LinkSpec(cut=Cut("close", at_byte=300_000)),
            "stall": LinkSpec()}[fault]
    rec = Recorder()
    async with netsim.ShapingProxy(upstream=("127.0.0.1", sender.port), down=down) as proxy:
        def on_chunk(report) -> None:
            if fault == "stall" and report.index == 2:
                proxy.set_trace(0.0, direction="down")  # the link goes silent for good

        async with streamer.StreamSession("127.0.0.1", proxy.port, "ctx", slo=20.0, policy="fixed:0",
                                          servers=[("127.0.0.1", sender.port)], stall_timeout=0.5,
                                          on_layer=rec.on_layer, on_text=rec.on_text,
                                          on_chunk=on_chunk) as session:
            report = await session.fetch()
    assert report.reconnects >= 1
    assert rec.position == (len(context["manifest"].chunks), 0)
    got, text = rec.assemble(context["manifest"])
    assert not text and not torch.isnan(got.float()).any()
    assert _distortion(context["kv"], got) < 2 * context["profile"].targets[0]


async def test_profiles_and_sections_larger_than_a_frame(context) -> None:
    """With the smallest frame limit, the profile and every layer section span many frames."""
    from streamer.net import session as session_module
    from streamer.net.sender import ServerConfig

    session_module._profiles.clear()  # force a profile download
    assert len(context["profile"].to_bytes()) > 4 * 65536
    store = await streamer.open_store(context["root"])
    server = await streamer.serve(store, config=ServerConfig(max_frame=65536))
    rec = Recorder()
    try:
        async with streamer.StreamSession("127.0.0.1", server.port, "ctx", slo=10.0, policy="fixed:0",
                                          on_layer=rec.on_layer) as session:
            await session.fetch()
    finally:
        await server.close()
        await store.close()
    got, _ = rec.assemble(context["manifest"])
    assert _distortion(context["kv"], got) < 2 * context["profile"].targets[0]


async def test_dead_sender_with_no_fallback_fails_with_a_report(context, sender) -> None:
    async with netsim.ShapingProxy(upstream=("127.0.0.1", sender.port),
                                   down=LinkSpec(cut=Cut("reset", at_byte=500_000))) as proxy:
        async with streamer.StreamSession("127.0.0.1", proxy.port, "ctx", slo=20.0, policy="fixed:0",
                                          max_reconnects=1, backoff=0.01) as session:
            with pytest.raises(streamer.FetchFailed) as failure:
                await session.fetch()
    assert failure.value.report.reconnects >= 1


async def test_corrupt_chunk_is_refetched_then_falls_back_to_text(context, tmp_path) -> None:
    # a private copy of the store with chunk 2's level-0 blob damaged inside layer 0
    import shutil

    root = tmp_path / "store"
    shutil.copytree(context["root"], root)
    manifest = context["manifest"]
    blob_path = next(root.glob(f"contexts/ctx/{manifest.version}/chunk-2-L0*"))
    blob = bytearray(blob_path.read_bytes())
    header = codec.parse_header(blob)
    blob[header.size + 40] ^= 0xFF
    blob_path.write_bytes(bytes(blob))
    store = await streamer.open_store(str(root))
    server = await streamer.serve(store)
    rec = Recorder()
    try:
        async with streamer.StreamSession("127.0.0.1", server.port, "ctx", slo=20.0, policy="fixed:0",
                                          on_layer=rec.on_layer, on_text=rec.on_text) as session:
            report = await session.fetch()
    finally:
        await server.close()
        await store.close()
    assert rec.position == (len(manifest.chunks), 0)
    assert report.chunks[2].level == TEXT and "corrupt" in report.chunks[2].reason
    assert report.chunks[2].retries >= 1
    assert all(c.level == 0 for i, c in enumerate(report.chunks) if i != 2)


async def test_hopeless_deadline_sends_the_rest_as_text(context, sender) -> None:
    rec = Recorder()
    async with netsim.ShapingProxy(upstream=("127.0.0.1", sender.port), trace=2.0) as proxy:
        async with streamer.StreamSession("127.0.0.1", proxy.port, "ctx", slo=0.3, policy="mpc",
                                          recompute_seconds_per_token=1e-6,
                                          on_layer=rec.on_layer, on_text=rec.on_text) as session:
            report = await session.fetch()
    assert rec.position == (len(context["manifest"].chunks), 0)
    assert report.text_chunks >= len(context["manifest"].chunks) - 2


async def test_unknown_context_is_a_clear_error(sender) -> None:
    with pytest.raises(streamer.ServerError, match="not_found"):
        async with streamer.StreamSession("127.0.0.1", sender.port, "missing", slo=1.0):
            pass


async def test_many_concurrent_sessions_complete(context, sender) -> None:
    async def one() -> streamer.FetchReport:
        rec = Recorder()
        # on a loaded machine the sender's queue can make a session predict its deadline
        # lost and send the rest as text: completion means every chunk, layers or text
        async with streamer.StreamSession("127.0.0.1", sender.port, "ctx", slo=30.0, policy="fixed:4",
                                          on_layer=rec.on_layer, on_text=rec.on_text) as session:
            report = await session.fetch()
        assert rec.position == (len(context["manifest"].chunks), 0)
        return report

    reports = await asyncio.gather(*[one() for _ in range(16)])
    assert all(len(r.chunks) == len(context["manifest"].chunks) for r in reports)


async def test_a_fetch_cancelled_while_it_drops_a_pending_read_is_cancelled(context, sender, monkeypatch) -> None:
    """A fetch woken by something other than data cancels its pending queue read and waits
    for it to unwind; a cancel of the fetch itself landing then is not the read's own, and
    must end the fetch (it was swallowed: the receiver daemon's shutdown waited for the
    whole fetch)."""
    from streamer.net import client as client_module

    unwinding = asyncio.Event()

    class SlowToUnwind(client_module.ArrivalQueue):
        armed = False

        async def get(self):
            try:
                return await super().get()
            except asyncio.CancelledError:
                if not SlowToUnwind.armed:
                    raise
                unwinding.set()
                await asyncio.Event().wait()   # unwinds only when cancelled once more
                raise

    monkeypatch.setattr(client_module, "ArrivalQueue", SlowToUnwind)
    async with netsim.ShapingProxy(upstream=("127.0.0.1", sender.port), trace=20.0) as proxy:
        async with streamer.StreamSession("127.0.0.1", proxy.port, "ctx", slo=30.0, policy="fixed:4") as session:
            SlowToUnwind.armed = True
            fetch = asyncio.create_task(session.fetch())
            # a chunk in flight: the cancel rule's timer wakes the fetch and drops the read
            await asyncio.wait_for(unwinding.wait(), 30)
            fetch.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(fetch, 30)


async def test_garbage_from_one_client_does_not_hurt_others(context, sender) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", sender.port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 10)
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 5.0) is not None  # server answers and closes
    writer.close()
    async with streamer.StreamSession("127.0.0.1", sender.port, "ctx", slo=5.0, policy="fixed:4") as session:
        report = await session.fetch()
    assert len(report.chunks) == len(context["manifest"].chunks)


@pytest.mark.redis
async def test_senders_share_a_redis_store(context, redis_store_url) -> None:
    store = await streamer.open_store(redis_store_url)
    await streamer.put_context(store, "shared", context["kv"][:, :, :1024], context["tokens"][:1024],
                               profile=context["profile"], chunk_tokens=CHUNK_TOKENS)
    first, second = await streamer.serve(store), await streamer.serve(await streamer.open_store(redis_store_url))
    try:
        for server in (first, second):
            rec = Recorder()
            async with streamer.StreamSession("127.0.0.1", server.port, "shared", slo=5.0, policy="fixed:2",
                                              on_layer=rec.on_layer) as session:
                await session.fetch()
            assert rec.position == (4, 0)
    finally:
        await first.close()
        await second.close()
        await second.store.close()
        await store.close()


@pytest.mark.slow
def test_serve_cli_shuts_down_cleanly_on_sigterm(context, tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "streamer.tools.cli", "serve", "--store", context["root"],
                             "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "kvwire serve:" in line
        port = int(line.rsplit(":", 1)[1])
        out = subprocess.run([sys.executable, "-m", "streamer.tools.cli", "fetch", "--server", f"127.0.0.1:{port}",
                              "--context", "ctx", "--slo", "5", "--json"], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        assert '"deadline_met"' in out.stdout
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


async def test_a_detached_connection_serves_the_next_fetch_without_a_new_handshake(context) -> None:
    from streamer.net.sender import ServerConfig

    store = await streamer.open_store(context["root"])
    server = await streamer.serve(store, config=ServerConfig(metrics=True))
    try:
        async with streamer.StreamSession("127.0.0.1", server.port, "ctx", slo=5.0, policy="fixed:4") as first:
            await first.fetch()
            client = first.detach_connection()
        assert client is not None and client.reusable
        rec = Recorder()
        async with streamer.StreamSession("127.0.0.1", server.port, "ctx", slo=5.0, policy="fixed:2",
                                          on_layer=rec.on_layer, connection=client) as second:
            report = await second.fetch()
        assert rec.position == (len(context["manifest"].chunks), 0)
        assert [c.level for c in report.chunks] == [2] * len(context["manifest"].chunks)
        assert server.metrics.value("kvwire_sender_sessions_total") == 1  # one connection, two fetches
        client.abort()
        # a dead connection handed in is dropped and the session connects anew
        async with streamer.StreamSession("127.0.0.1", server.port, "ctx", slo=5.0, policy="fixed:4",
                                          connection=client) as third:
            await third.fetch()
        assert server.metrics.value("kvwire_sender_sessions_total") == 2
    finally:
        await server.close()
        await store.close()


async def test_a_context_of_small_chunks_arrives_at_the_best_level(tmp_path: Path) -> None:
    """Chunks under 64 KB never made a throughput sample of their own, and the first chunk
    went out at the smallest level: on an unshaped loopback with a 2 s SLO, all came at L4.
    Now the handshake's measured rate is the first prior and small chunks pool into samples."""
    layers, heads, head_dim, chunk_tokens = 2, 4, 16, 64
    kv = synthetic_kv(5, 4 * chunk_tokens, layers, heads, head_dim)
    profile = codec.calibrate([synthetic_kv(6, 1024, layers, heads, head_dim)])
    store = await streamer.open_store(str(tmp_path))
    manifest = await streamer.put_context(store, "small", kv, list(range(kv.shape[2])), profile=profile,
                                          chunk_tokens=chunk_tokens)
    assert len(manifest.chunks) == 4 and max(c.sizes[0] for c in manifest.chunks) < 64 * 1024
    server = await streamer.serve(store)
    try:
        async with streamer.StreamSession("127.0.0.1", server.port, "small", slo=2.0,
                                          on_layer=Recorder(layers).on_layer) as session:
            assert session.handshake_bps is not None and session.handshake_bps > 0
            report = await session.fetch()
    finally:
        await server.close()
        await store.close()
    assert [c.level for c in report.chunks] == [0, 0, 0, 0]


async def test_arrival_times_do_not_wait_for_a_busy_decoder(context, sender, monkeypatch) -> None:
    """The rate is measured where bytes arrive: with a decoder far slower than the link,
    every chunk's measured end still comes before its last layer is even decoded (were
    the clock read when the consumer got round to the chunk, it would come after)."""
    import time

    from streamer.net import session as session_module

    def slow_decoder(device):
        def decode(*args, **kwargs):
            time.sleep(0.05)                 # per layer section, in the decode worker
            return codec.decode_section(*args, **kwargs)
        return decode

    monkeypatch.setattr(session_module, "section_decoder", slow_decoder)
    delivered: dict[int, float] = {}

    def on_layer(chunk: int, layer: int, k, v) -> None:
        delivered[chunk] = time.monotonic()

    async with streamer.StreamSession("127.0.0.1", sender.port, "ctx", slo=60.0, policy="fixed:0",
                                      on_layer=on_layer) as session:
        started = time.monotonic()           # at or before the fetch clock's start
        report = await session.fetch()
    chunks = context["manifest"].chunks
    assert len(report.chunks) == len(chunks) and set(delivered) == set(range(len(chunks)))
    late = [c.index for c in report.chunks if started + c.finished_at >= delivered[c.index]]
    assert late == []
    workers = session_module.decode_executor()._max_workers
    assert report.total_seconds >= 0.05 * LAYERS * len(chunks) / workers   # the decode threads' sleeps add up


async def test_decisions_plan_text_at_the_callers_measured_recompute_rate(context, sender, monkeypatch) -> None:
    """A caller slower than its configured rate: once its on_text calls show it, every
    later decision plans text at the rate they showed, and the next fetch starts there."""
    from streamer.fetch import controller as controller_module

    planned: list[float] = []
    decide = controller_module.decide

    def recording_decide(*args, **kwargs):
        planned.append(kwargs["recompute"].per_token)
        return decide(*args, **kwargs)

    monkeypatch.setattr(controller_module, "decide", recording_decide)
    configured = 1e-7
    pause = 0.02                              # per chunk of CHUNK_TOKENS tokens: 78 us/token

    async def on_text(chunk: int, token_ids: list[int]) -> None:
        await asyncio.sleep(pause)

    async with streamer.StreamSession("127.0.0.1", sender.port, "ctx", slo=30.0, policy="text",
                                      on_text=on_text, recompute_seconds_per_token=configured) as session:
        first = await session.fetch()
        carried = len(planned)
        second = await session.fetch()
    measured = pause / CHUNK_TOKENS
    assert all(c.recompute_seconds >= pause for c in first.chunks)
    assert planned[0] == configured                 # nothing seen yet
    assert first.recompute_seconds_per_token >= measured
    assert all(rate >= measured for rate in planned[carried:])   # the next fetch starts there
    assert second.recompute_seconds_per_token >= measured


async def test_an_invalid_context_id_is_a_typed_error_naming_the_cause(sender) -> None:
    """The sender refuses '../etc' as bad_request: a ServerError with that code, at once,
    not a ConnectionLost after retrying every sender."""
    with pytest.raises(streamer.ServerError) as caught:
        async with streamer.StreamSession("127.0.0.1", sender.port, "../etc", max_reconnects=3):
            pass
    assert caught.value.code == "bad_request" and "context id" in str(caught.value)


def test_a_senders_memory_is_forgotten_after_its_ttl() -> None:
    """A memory too slow to probe under a tight deadline plans every fetch as text, which
    measures nothing; only its age lets a recovered link be tried again."""
    from streamer.adapt.estimator import LinkMemory
    from streamer.net import session as session_module

    address = ("203.0.113.7", 9)
    memory = LinkMemory(rate=1e5, errors=(-0.1,))
    session_module._server_priors[address] = (100.0, memory)
    try:
        assert session_module._recall(address, 100.0 + session_module.MEMORY_TTL_S) is memory
        assert session_module._recall(address, 100.1 + session_module.MEMORY_TTL_S) is None
        assert address not in session_module._server_priors
        assert session_module._recall(address, 0.0) is None
    finally:
        session_module._server_priors.pop(address, None)


@pytest.mark.parametrize("decode_prior, first_levels", [(None, {0}), ("slow", {3, 4})])
async def test_the_first_chunk_is_planned_at_the_decoder_cost_the_caller_measured(
        context, sender, decode_prior, first_levels) -> None:
    """Over a fast link the first chunk goes at level 0 when decoding looks free; with a
    ``decode_prior`` at which every chunk at level 0 would take 1.2 s to decode (12 chunks:
    14 s against a 10 s SLO), the first chunk is already a cheap level, before the session
    has timed any section of its own."""
    manifest = context["manifest"]
    token_layers = CHUNK_TOKENS * LAYERS
    if decode_prior == "slow":
        decode_prior = decoding.measure_whole(CHUNK_TOKENS, LAYERS, manifest.chunks[0].sizes[0], [1.2])
        assert decode_prior.seconds(token_layers, manifest.chunks[0].sizes[0]) == pytest.approx(1.2)
    async with streamer.StreamSession("127.0.0.1", sender.port, "ctx", slo=10.0, policy="mpc",
                                      prior_bps=1e9, decode_prior=decode_prior) as session:
        report = await session.fetch()
    assert report.chunks[0].level in first_levels, [c.level for c in report.chunks]


async def test_each_decision_sees_the_level_the_chunk_before_was_requested_at(context, sender, monkeypatch) -> None:
    """The planner's hold (``adapt.mpc``, "A level held") needs the previous chunk's level:
    the session passes what it requested (None for the first chunk)."""
    from streamer.fetch import controller as controller_module

    seen: list = []

    def alternating(policy, manifest, index, **kw):
        seen.append(kw["previous"])
        return index % 2, None

    monkeypatch.setattr(controller_module, "decide", alternating)
    async with streamer.StreamSession("127.0.0.1", sender.port, "ctx", slo=5.0, policy="mpc") as session:
        report = await session.fetch()
    chunks = len(context["manifest"].chunks)
    assert [c.level for c in report.chunks] == [i % 2 for i in range(chunks)]
    assert seen == [None] + [(i - 1) % 2 for i in range(1, chunks)]


async def test_the_profile_downloaded_at_open_is_the_first_sample(context, sender, monkeypatch) -> None:
    """Opening a context whose profile is not cached downloads it over the same link just
    before the fetch: the first decision's history starts with that transfer (bytes and
    the time after one round trip) instead of planning on the handshake's rate alone; a
    second fetch on the session starts afresh, and a cached profile is no sample."""
    import streamer.net.session as session_module
    from streamer.fetch import controller as controller_module

    monkeypatch.setattr(session_module, "_profiles", session_module.collections.OrderedDict())
    histories: list[list] = []
    real = controller_module.decide

    def recording(policy, manifest, index, **kw):
        if index == 0:
            histories.append(list(kw["history"]))
        return real(policy, manifest, index, **kw)

    monkeypatch.setattr(controller_module, "decide", recording)
    size = len(context["profile"].to_bytes())
    assert size >= session_module.MIN_SAMPLE_BYTES
    async with netsim.ShapingProxy(upstream=("127.0.0.1", sender.port), trace=100.0) as proxy:
        async with streamer.StreamSession("127.0.0.1", proxy.port, "ctx", slo=1.0, policy="mpc") as session:
            await session.fetch()
            await session.fetch()
        async with streamer.StreamSession("127.0.0.1", proxy.port, "ctx", slo=1.0, policy="mpc") as session:
            await session.fetch()
    first, again, cached = histories
    assert first[0].bytes == size
    assert first[0].bytes / first[0].busy_seconds == pytest.approx(100e6 / 8, rel=0.3)
    assert all(o.bytes != size for o in again + cached)


async def test_a_profile_sample_taken_during_a_fetch_does_not_reach_the_next_one(context, sender) -> None:
    """A reconnect's re-open may download the profile again (evicted from the cache
    meanwhile): that sample measured the fetch in progress, so it is dropped when the
    fetch ends instead of heading the next fetch's history."""
    from streamer.adapt.base import Observation

    sessions: list = []

    def reopened(report) -> None:   # what _open_context leaves after a re-download
        sessions[0].open_sample = Observation(10**6, 0.1)

    async with streamer.StreamSession("127.0.0.1", sender.port, "ctx", slo=5.0, policy="fixed:1",
                                      on_chunk=reopened) as session:
        sessions.append(session)
        await session.fetch()
        assert session.open_sample is None
