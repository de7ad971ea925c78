"""The proxy's pure schedulers, then the proxy itself with real sockets on loopback.

Timing asserts are deliberately loose (a loaded 2-core CI box must pass them); exact
arithmetic is checked in the pure tests instead.
"""
from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

import netsim
from netsim.proxy import LinkSpec, ShapingProxy
from netsim.shaping import Cut, DelayLine, FaultSchedule, KiB, Stall, TokenBucket
from netsim.trace import Trace

MBIT = 1e6 / 8  # bytes per second in one Mbit/s


# ===================================================================== token bucket
def _drive(bucket: TokenBucket, start: float, seconds: float, piece: int) -> tuple[int, float]:
    """Send greedily for ``seconds`` of simulated time, sleeping exactly as told."""
    now, sent = start, 0
    while now < start + seconds:
        wait = bucket.take(piece, now)
        if wait == 0:
            sent += piece
        else:
            now += wait
    return sent, now


def test_unshaped_bucket_never_waits() -> None:
    b = TokenBucket(None, now=0.0)
    assert b.take(10**9, 0.0) == 0.0
    assert b.piece(0.0) == 256 * KiB


def test_bucket_starts_empty_and_wait_is_exact() -> None:
    b = TokenBucket(Trace.constant(80, 1), now=100.0)  # 10 MB/s
    wait = b.take(10_000, 100.0)
    assert wait == pytest.approx(10_000 / (80 * MBIT))
    assert b.take(10_000, 100.0 + wait) == 0.0


@pytest.mark.parametrize("mbit", [10, 2000])
def test_bucket_long_run_rate_is_exact(mbit: float) -> None:
    b = TokenBucket(Trace.constant(mbit, 1), now=0.0)
    piece = b.piece(0.0)
    sent, end = _drive(b, 0.0, 5.0, piece)
    # The loop stops having paid for one piece it did not count.
    assert (sent + piece) / end == pytest.approx(mbit * MBIT, rel=1e-6)


def test_bucket_burst_is_bounded_after_idle() -> None:
    b = TokenBucket(Trace.constant(100, 1), now=0.0, burst_s=0.02, min_burst=32 * KiB)
    burst = 100 * MBIT * 0.02
    assert b.take(int(burst), 60.0) == 0.0  # an hour idle buys one burst...
    assert b.take(1000, 60.0) > 0  # ...and no more


def test_bucket_pieces_scale_with_rate() -> None:
    assert TokenBucket(Trace.constant(10, 1), 0.0).piece(0.0) == 16 * KiB
    assert TokenBucket(Trace.constant(2000, 1), 0.0).piece(0.0) == 256 * KiB


def test_bucket_grants_oversize_request_into_debt() -> None:
    b = TokenBucket(Trace.constant(10, 1), 0.0)  # burst 32 KiB
    wait = b.take(1_000_000, 0.0)
    assert 0 < wait < 0.05  # waits for a full bucket, not for 1 MB
    assert b.take(1_000_000, wait) == 0.0
    assert b.take(1, wait) > 0.7  # then repays ~1 MB at 1.25 MB/s


def test_bucket_follows_a_trace_exactly() -> None:
    trace = Trace([0, 1, 2], [100, 400, 100])
    b = TokenBucket(trace, now=0.0)
    sent, end = _drive(b, 0.0, 3.0, 8 * KiB)
    assert sent == pytest.approx(trace.bits_between(0, end) / 8, abs=64 * KiB)


def test_bucket_set_trace_takes_effect_at_once() -> None:
    b = TokenBucket(Trace.constant(10, 1), now=0.0)
    b.take(16 * KiB, 0.0)
    b.set_trace(Trace.constant(1000, 1), now=0.5)
    wait = b.take(64 * KiB, 0.5)
    assert wait < 64 * KiB / (1000 * MBIT) + 1e-9


def test_bucket_on_a_dead_link_waits_forever() -> None:
    b = TokenBucket(Trace([0, 1], [100, 0]), now=0.0)
    b.take(1, 5.0)
    assert b.take(10**6, 5.0) == float("inf")


# ===================================================================== delay line
def test_delay_line_without_jitter() -> None:
    d = DelayLine(0.05)
    assert d.release_at(1.0) == pytest.approx(1.05)


def test_delay_line_jitter_keeps_order_and_mean() -> None:
    dense = DelayLine(0.05, 0.02, random.Random(1))
    rel = [dense.release_at(i * 0.001) for i in range(2000)]
    assert rel == sorted(rel)  # a byte stream is never reordered
    sparse = DelayLine(0.05, 0.02, random.Random(1))  # spaced > 2x jitter: no queueing
    now = [i * 0.05 for i in range(2000)]
    lat = [sparse.release_at(t) - t for t in now]
    assert min(lat) >= 0.03 - 1e-9 and max(lat) <= 0.07 + 1e-9
    assert sum(lat) / len(lat) == pytest.approx(0.05, abs=0.01)


# ===================================================================== faults
def test_stall_schedule_chains_overlaps() -> None:
    f = FaultSchedule([Stall(2.0, 3.0), Stall(1.0, 1.5)])
    assert f.stalled_until(0.5) is None
    assert f.stalled_until(1.2) == 5.0  # 1.0-2.5 runs into 2.0-5.0
    assert f.stalled_until(5.0) is None


def test_byte_cut_allowance() -> None:
    f = FaultSchedule(cut=Cut("close", at_byte=1000))
    assert f.bytes_before_cut(0) == 1000
    assert f.bytes_before_cut(1500) == 0
    assert FaultSchedule().bytes_before_cut(10) is None
    assert FaultSchedule(cut=Cut("reset", at_s=2.0)).cut_time() == 2.0


@pytest.mark.parametrize("kwargs", [
    {"action": "reset"}, {"action": "reset", "at_s": 1, "at_byte": 2}, {"action": "boom", "at_s": 1},
])
def test_cut_validation(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        Cut(**kwargs)


# ===================================================================== real sockets
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[tuple[str, int]]]]:
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> tuple[str, int]:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        servers.append(server)
        return "127.0.0.1", server.sockets[0].getsockname()[1]

    yield start
    for s in servers:
        s.close()
        await s.wait_closed()


async def _sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Count bytes to EOF, reply with the count."""
    n = 0
    while data := await reader.read(1 << 20):
        n += len(data)
    writer.write(str(n).encode())
    await writer.drain()
    writer.close()


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    writer.close()


def _source(nbytes: int) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(bytes(nbytes))
            await writer.drain()
        except ConnectionError:
            pass
        writer.close()
    return handler


async def _upload(port: int, nbytes: int) -> tuple[int, float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.monotonic()
    chunk = bytes(1 << 20)
    left = nbytes
    while left:
        n = min(left, len(chunk))
        writer.write(chunk[:n])
        await writer.drain()
        left -= n
    writer.write_eof()
    reply = await reader.read()
    writer.close()
    return int(reply), time.monotonic() - t0


async def _download(port: int) -> tuple[int, float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.monotonic()
    n = 0
    while data := await reader.read(1 << 20):
        n += len(data)
    writer.close()
    return n, time.monotonic() - t0


async def test_rate_is_roughly_held(serve) -> None:
    upstream = await serve(_sink)
    async with netsim.ShapingProxy(upstream=upstream, trace=Trace.constant(200, 1)) as proxy:
        got, secs = await _upload(proxy.port, 10_000_000)
    assert got == 10_000_000
    assert 10_000_000 / secs == pytest.approx(200 * MBIT, rel=0.25)


async def test_unshaped_passthrough_and_counters(serve) -> None:
    upstream = await serve(_echo)
    async with ShapingProxy(upstream=upstream) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        payload = bytes(range(256)) * 4000
        writer.write(payload)
        writer.write_eof()
        echoed = await reader.read()
        writer.close()
        await asyncio.sleep(0.05)
        stats = proxy.stats
    assert echoed == payload
    assert stats.connections == 1
    assert stats.up_bytes == stats.down_bytes == len(payload)
    assert stats.per_connection[0].up_bytes == len(payload)


async def test_delay_is_observed_in_round_trips(serve) -> None:
    upstream = await serve(_echo)
    async with ShapingProxy(upstream=upstream, delay_ms=50) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        t0 = time.monotonic()
        writer.write(b"ping")
        assert await reader.readexactly(4) == b"ping"
        rtt = time.monotonic() - t0
        writer.close()
    assert 0.1 <= rtt < 0.6


async def test_delay_does_not_reduce_throughput(serve) -> None:
    upstream = await serve(_sink)
    # 5 MB at 200 Mbit/s is 0.2 s; 100 ms each way adds ~0.2 s. Sleeping 100 ms per
    # read chunk instead of pipelining would take seconds.
    async with ShapingProxy(upstream=upstream, trace=200.0, delay_ms=100) as proxy:
        got, secs = await _upload(proxy.port, 5_000_000)
    assert got == 5_000_000
    assert secs < 0.9


async def test_stall_pauses_forwarding(serve) -> None:
    upstream = await serve(_echo)
    down = LinkSpec(stalls=(Stall(0.2, 0.5),))
    async with ShapingProxy(upstream=upstream, down=down) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"a")
        assert await reader.readexactly(1) == b"a"
        await asyncio.sleep(0.3)  # now inside the stall
        t0 = time.monotonic()
        writer.write(b"b")
        assert await reader.readexactly(1) == b"b"
        waited = time.monotonic() - t0
        writer.close()
    assert 0.3 <= waited < 1.0  # released at ~0.7 s after the connection opened


async def test_reset_at_time_reaches_client_as_connection_reset(serve) -> None:
    upstream = await serve(_echo)
    async with ShapingProxy(upstream=upstream, down=LinkSpec(cut=Cut("reset", at_s=0.2))) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(reader.read(), timeout=3)
        writer.close()
        assert proxy.stats.per_connection[0].ended_by == "reset"


async def test_reset_at_byte_reaches_client(serve) -> None:
    upstream = await serve(_source(5_000_000))
    async with ShapingProxy(upstream=upstream, down=LinkSpec(cut=Cut("reset", at_byte=100_000))) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        received = 0
        with pytest.raises(ConnectionResetError):
            while data := await asyncio.wait_for(reader.read(1 << 16), timeout=3):
                received += len(data)
        writer.close()
    assert received <= 100_000


async def test_clean_close_at_byte_offset(serve) -> None:
    upstream = await serve(_source(1_000_000))
    async with ShapingProxy(upstream=upstream, down=LinkSpec(cut=Cut("close", at_byte=300_000))) as proxy:
        got, _ = await asyncio.wait_for(_download(proxy.port), timeout=5)
    assert got == 300_000


async def test_set_trace_changes_rate_mid_transfer(serve) -> None:
    upstream = await serve(_sink)
    async with ShapingProxy(upstream=upstream, trace=10.0) as proxy:
        upload = asyncio.create_task(_upload(proxy.port, 4_000_000))  # 3.2 s at 10 Mbit/s
        await asyncio.sleep(0.3)
        proxy.set_trace(Trace.constant(400, 1))
        got, secs = await asyncio.wait_for(upload, timeout=5)
    assert got == 4_000_000
    assert secs < 1.5


async def test_per_direction_specs(serve) -> None:
    upstream = await serve(_source(2_500_000))  # 0.4 s at 50 Mbit/s
    async with ShapingProxy(upstream=upstream, trace=Trace.constant(1, 1),
                            down=LinkSpec(trace=Trace.constant(50, 1))) as proxy:
        got, secs = await asyncio.wait_for(_download(proxy.port), timeout=5)
    assert got == 2_500_000
    assert 2_500_000 / secs == pytest.approx(50 * MBIT, rel=0.25)


async def test_unreachable_upstream_resets_client(serve) -> None:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    async with ShapingProxy(upstream=("127.0.0.1", port)) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(reader.read(), timeout=3)
        writer.close()
