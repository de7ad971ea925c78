"""The cancel rule (``adapt.cancel.reconsider``) on hand-made situations, and a live
session that abandons a chunk when the link drops under it."""
from __future__ import annotations

import asyncio

import pytest

import netsim
import streamer
from streamer.adapt.base import TEXT, PlanInput
from streamer.adapt.cancel import COMMITTED_BYTES, InFlight, Switch, reconsider

MB = 1_000_000


def _plan(time_left: float, chunks: int = 3) -> PlanInput:
    """``chunks`` chunks of 1 MB / 0.5 MB / 0.25 MB at levels 0-2, 2 kB of text each,
    recomputed in 10 ms."""
    return PlanInput(sizes=[[MB, MB // 2, MB // 4]] * chunks, text_bytes=[2000] * chunks,
                     text_seconds=[0.01] * chunks, distortion=[0.001, 0.01, 0.05],
                     time_left=time_left, history=[])


def test_keeps_a_chunk_that_leaves_the_rest_time() -> None:
    head = InFlight(level=0, remaining_bytes=MB // 2, delivered_layers=0)
    # 0.5 s to finish, two later chunks need at least 2 x 0.01 s as text
    assert reconsider(_plan(0.6), head, rate=MB, rtt=0.001, reconnect_seconds=0.01) is None


def test_downgrades_when_finishing_would_sink_the_deadline() -> None:
    head = InFlight(level=0, remaining_bytes=900_000, delivered_layers=0)
    # at 1 MB/s keeping takes 0.9 s of 0.6 s left; level 2 (0.25 MB) after the
    # committed bytes drain (~0.26 s) fits, and is the best option that does
    switch = reconsider(_plan(0.6), head, rate=MB, rtt=0.001, reconnect_seconds=1.0)
    assert switch == Switch(choice=2, abort=False)


def test_only_text_once_a_layer_went_out() -> None:
    head = InFlight(level=0, remaining_bytes=900_000, delivered_layers=1)
    switch = reconsider(_plan(0.6), head, rate=MB, rtt=0.001, reconnect_seconds=1.0)
    assert switch == Switch(choice=TEXT, abort=False)


def test_aborts_the_connection_when_draining_costs_more_than_reconnecting() -> None:
    head = InFlight(level=0, remaining_bytes=900_000, delivered_layers=0)
    rate = 100_000   # 0.8 Mbit/s: the committed bytes alone take ~2.6 s
    switch = reconsider(_plan(1.0), head, rate=rate, rtt=0.001, reconnect_seconds=0.05)
    assert switch is not None and switch.abort and COMMITTED_BYTES / rate > 0.05


def test_no_switch_that_does_not_save_time() -> None:
    """Nothing fits, and the fastest option is not much faster than finishing: keep."""
    head = InFlight(level=2, remaining_bytes=60_000, delivered_layers=0)
    assert reconsider(_plan(0.01), head, rate=MB, rtt=0.001, reconnect_seconds=1.0) is None


async def test_a_session_abandons_a_chunk_when_the_link_drops(tmp_path) -> None:
    """8 chunks of ~0.5 MB at level 0, a prior of 50 Mbit/s, and a link that drops to
    4 Mbit/s as the fetch starts: the chunk in flight is abandoned (to a lower level or
    text) before all its bytes arrive, and every delivery is whole and in order."""
    import codec
    from streamer_helpers import synthetic_kv

    layers, heads, head_dim, tokens = 4, 8, 64, 8 * 512
    kv = synthetic_kv(3, tokens, layers, heads, head_dim)
    profile = codec.calibrate([synthetic_kv(4, 2048, layers, heads, head_dim)])
    store = await streamer.open_store(str(tmp_path))
    manifest = await streamer.put_context(store, "ctx", kv, list(range(tokens)), profile=profile,
                                          chunk_tokens=512)
    sender = await streamer.serve(store)
    seen: list[tuple] = []
    try:
        async with netsim.ShapingProxy(upstream=("127.0.0.1", sender.port), delay_ms=1.0) as proxy:
            async with streamer.StreamSession("127.0.0.1", proxy.port, "ctx", slo=1.0, policy="mpc",
                                              prior_bps=50e6,
                                              on_layer=lambda c, l, k, v: seen.append((c, l)),
                                              on_text=lambda c, ids: seen.append((c, TEXT))) as session:
                proxy.set_trace(4.0)
                report = await session.fetch()
    finally:
        await sender.close()
        await store.close()
    assert report.cancels >= 1
    cancelled = [c for c in report.chunks if c.cancelled_levels]
    assert cancelled
    for chunk in cancelled:
        assert chunk.level not in chunk.cancelled_levels
        abandoned = manifest.chunks[chunk.index].sizes[chunk.cancelled_levels[0]]
        assert chunk.bytes < abandoned, "the abandoned transfer was drained in full"
    order = [c for c, _ in seen]
    assert order == sorted(order) and {c for c, _ in seen} == set(range(len(manifest.chunks)))
