"""The cancel rule (``adapt.cancel.reconsider``) on hand-made situations, and a live
session that abandons a chunk when the link drops under it."""
from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import torch

import netsim
import streamer
from streamer.adapt.base import TEXT, Abandon, Observation, PlanInput
from streamer.adapt.cancel import (COMMITTED_BYTES, PATIENCE_S, RECENT_S, InFlight, Switch, abandon_seconds,
                                   chunk_rate, give_up_seconds, reconsider)
from streamer.adapt.decide import time_left
from streamer.adapt.estimator import GUARD_FACTOR, MIN_SAMPLE_BYTES, shortfall
from streamer.adapt.mpc import mpc, mpc_plan
from streamer.net import driver as driver_module
from streamer.wire import protocol as p

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
    assert switch is not None and (switch.choice, switch.abort) == (2, False)
    # the CANCEL's answer is due once the committed bytes drained at the guard's share of
    # the rate, and a round trip: past that the session drops the connection instead
    drain = (COMMITTED_BYTES + MB * 0.001) / MB
    assert switch.escalate_after == pytest.approx(drain / GUARD_FACTOR + 0.001)


def test_only_text_once_a_layer_went_out() -> None:
    """As above with a layer delivered: only text can follow, and with 0.35 s left it
    cannot wait for the link (~0.29 s to give it up now, ~0.41 s after PATIENCE_S)."""
    head = InFlight(level=0, remaining_bytes=900_000, delivered_layers=1)
    switch = reconsider(_plan(0.35), head, rate=MB, rtt=0.001, reconnect_seconds=1.0)
    assert switch is not None and (switch.choice, switch.abort) == (TEXT, False)


def test_no_cancel_once_everything_left_is_on_its_way() -> None:
    """60 kB left at 2 Mbit/s with 0.3 s to go: giving the chunk up for text looks
    sooner, but the sender has committed more than what is left already: a CANCEL would
    stop nothing (the chunk arrives whole, then the text), so none is sent. Dropping the
    connection could stop it; here that costs more than the drain."""
    head = InFlight(level=0, remaining_bytes=60_000, delivered_layers=0)
    rate = 250_000
    assert head.remaining_bytes <= COMMITTED_BYTES + rate * 0.001
    assert reconsider(_plan(0.3), head, rate=rate, rtt=0.001, reconnect_seconds=5.0) is None


def test_aborts_the_connection_when_draining_costs_more_than_reconnecting() -> None:
    head = InFlight(level=0, remaining_bytes=900_000, delivered_layers=0)
    rate = 100_000   # 0.8 Mbit/s: the committed bytes alone take ~2.6 s
    switch = reconsider(_plan(0.25), head, rate=rate, rtt=0.001, reconnect_seconds=0.05)
    assert switch is not None and switch.abort and COMMITTED_BYTES / rate > 0.05


def test_no_switch_that_does_not_save_time() -> None:
    """Nothing fits, and the fastest option is not much faster than finishing: keep."""
    head = InFlight(level=2, remaining_bytes=60_000, delivered_layers=0)
    assert reconsider(_plan(0.01), head, rate=MB, rtt=0.001, reconnect_seconds=1.0) is None


def test_gives_up_while_giving_up_still_fits() -> None:
    """Keeping is predicted to just make it, but a collapse noticed at a later look
    could no longer be given up for text, and at half the rate it would miss: text now."""
    head = InFlight(level=0, remaining_bytes=50_000, delivered_layers=0)
    # 50 ms to finish + 2 x ~12 ms of later text = 74 ms of 80 ms left; giving it up after
    # a later look would take ~40 ms to notice plus ~23 ms for its text
    assert reconsider(_plan(0.08), head, rate=MB, rtt=0.001, reconnect_seconds=0.01) == Switch(TEXT, True)
    # with time for a later look to give it up, it is kept
    assert reconsider(_plan(0.2), head, rate=MB, rtt=0.001, reconnect_seconds=0.01) is None


def test_a_slow_chunk_is_waited_for_while_it_could_still_be_given_up() -> None:
    """The link under a level-0 chunk fell to 100 kB/s: keeping it would take 9 s. A
    fade may end, so it is kept while giving it up for text would still fit after
    PATIENCE_S more (~0.22 s in all here); with less time left it goes to text now."""
    head = InFlight(level=0, remaining_bytes=900_000, delivered_layers=1)
    assert reconsider(_plan(0.3), head, rate=100_000, rtt=0.001, reconnect_seconds=0.01) is None
    assert reconsider(_plan(0.2), head, rate=100_000, rtt=0.001,
                      reconnect_seconds=0.01) == Switch(TEXT, abort=True)
    assert PATIENCE_S > RECENT_S


def test_a_steady_peer_keeps_a_chunk_on_course_near_the_deadline() -> None:
    """The same chunk past the point where it could be given up later: an erratic peer
    (``shortfall`` at its floor, half the rate) gives it up for text; a peer whose rate has
    held keeps it (throwing away a chunk that will make it costs a text chunk for nothing)."""
    head = InFlight(level=0, remaining_bytes=50_000, delivered_layers=0)
    steady = [Observation(MB, 1.0)] * 6
    erratic = [Observation(MB, 1.0), Observation(MB, 4.0)] * 3
    assert shortfall(steady) == pytest.approx(1.0) and shortfall(erratic) == GUARD_FACTOR == shortfall([])
    for history, kept in ((steady, True), (erratic, False)):
        switch = reconsider(_plan(0.08), head, rate=MB, rtt=0.001, reconnect_seconds=0.01,
                            shortfall=shortfall(history))
        assert (switch is None) is kept


def test_a_chunk_is_judged_by_its_own_recent_rate() -> None:
    """Marks every 20 ms: 1 MB/s for 200 ms, then 250 kB/s. The whole-transfer average
    hides the drop; the recent arrivals show it, and that is the sample returned."""
    marks, got = [(0.0, 0)], 0
    for step in range(1, 31):
        got += 20_000 if step <= 10 else 5_000
        marks.append((0.02 * step, got))
    sample = chunk_rate(marks, estimate=MB)
    assert sample is not None and RECENT_S <= sample.busy_seconds < marks[-1][0]
    assert sample.bytes >= MIN_SAMPLE_BYTES
    assert sample.bytes / sample.busy_seconds < 0.6 * got / marks[-1][0]   # 250 vs 500 kB/s
    # bursty arrivals: nothing in the last look after a 100 kB burst is not a stall
    bursty = [(0.0, 0), (0.02, 100_000), (0.04, 100_000)]
    assert chunk_rate(bursty, estimate=MB) == Observation(100_000, 0.04)
    # a steady chunk is judged by its whole transfer
    steady = [(0.02 * i, 20_000 * i) for i in range(15)]
    assert chunk_rate(steady, estimate=MB) == Observation(steady[-1][1], steady[-1][0])


def test_nothing_to_judge_before_a_sample_unless_the_chunk_stalls() -> None:
    early = [(0.0, 0), (0.001, MIN_SAMPLE_BYTES // 2)]
    assert chunk_rate(early, estimate=MB) is None     # on pace for the estimate: wait
    stalled = [(0.0, 0), (1.0, 10)]
    sample = chunk_rate(stalled, estimate=MB)         # 64 KiB/s at most, far below 1 MB/s
    assert sample == Observation(MIN_SAMPLE_BYTES, 1.0, upper_bound=True)
    assert chunk_rate(stalled, estimate=None) is None and chunk_rate([(0.0, 0)], estimate=MB) is None


def test_a_stall_is_timed_from_the_answers_first_byte() -> None:
    """20 ms without a byte since the link was free, but the answer's first byte only now:
    the wait was the sender's response, not the link's rate, and nothing is judged yet. A
    stall after the first byte is judged from that byte."""
    waited = [(0.0, 0), (0.02, 0)]
    assert chunk_rate(waited, estimate=10 * MB, began=0.02) is None
    assert chunk_rate(waited, estimate=10 * MB, began=0.0) == Observation(MIN_SAMPLE_BYTES, 0.02, upper_bound=True)
    stalled = [(0.0, 0), (0.02, 0), (1.02, 10)]
    assert chunk_rate(stalled, estimate=10 * MB, began=0.02) == Observation(MIN_SAMPLE_BYTES, 1.0, upper_bound=True)


def test_abandoning_costs_detection_plus_the_cheaper_way_out() -> None:
    slow = abandon_seconds(100_000, rtt=0.01, reconnect_seconds=0.05)   # reconnecting is cheaper
    fast = abandon_seconds(100 * MB, rtt=0.01, reconnect_seconds=0.05)  # draining is cheaper
    assert slow == pytest.approx(MIN_SAMPLE_BYTES / 100_000 + 0.04 + 0.05 + 0.01)
    assert fast < 0.05 + 0.04 + 0.01 < slow
    with pytest.raises(ValueError):
        abandon_seconds(0.0, rtt=0.01, reconnect_seconds=0.05)


def test_giving_up_at_a_set_moment_needs_no_window_to_see_a_drop() -> None:
    for rate in (100_000, 100 * MB):
        assert abandon_seconds(rate, rtt=0.01, reconnect_seconds=0.05) == pytest.approx(
            give_up_seconds(rate, rtt=0.01, reconnect_seconds=0.05) + RECENT_S)


def test_text_is_put_off_while_the_recompute_owed_covers_giving_up() -> None:
    """The chunk of ``test_only_text_once_a_layer_went_out`` behind earlier text chunks:
    its own text could start only once their recompute is done, so while that still
    outlasts giving it up (~0.26 s of drain, its token ids, a look) it is kept."""
    head = InFlight(level=0, remaining_bytes=900_000, delivered_layers=1)
    owed = dataclasses.replace(_plan(0.35), recompute_busy=0.3)
    assert reconsider(owed, head, rate=MB, rtt=0.001, reconnect_seconds=1.0) is None
    almost = dataclasses.replace(owed, recompute_busy=0.1)
    switch = reconsider(almost, head, rate=MB, rtt=0.001, reconnect_seconds=1.0)
    assert switch is not None and switch.choice == TEXT


def test_mpc_tries_a_chunk_it_would_send_as_text_while_the_caller_recomputes() -> None:
    """Four 10/5 MB chunks at 10 MB/s, 150 ms of recompute each and 0.2 s still owed, 0.75 s
    left: one chunk fits at level 1, and only if its transfer (0.5 s) hides behind the
    recompute of text chunks before it (level 1 first would finish at 0.95 s), so the plan
    starts with text. Chunk 0's text could not start before 0.2 s, so with the cancel rule
    on it is tried at its smallest level meanwhile, unless holding the link that long would
    push the level-1 chunk past the deadline (0.65 s left)."""
    history = [Observation(10 * MB, 1.0)] * 4
    plan = PlanInput(sizes=[[10 * MB, 5 * MB]] * 4, text_bytes=[2000] * 4, text_seconds=[0.15] * 4,
                     distortion=[0.001, 0.01], time_left=0.75, history=history, recompute_busy=0.2,
                     abandon=Abandon(rtt=0.005, reconnect_seconds=0.02))
    columns = mpc_plan(plan).columns
    assert columns[0] == 2 and sorted(columns) == [1, 2, 2, 2]
    assert mpc(plan) == 1
    assert mpc(dataclasses.replace(plan, abandon=None)) == TEXT          # no way to give it up
    # a 0.2 s round trip: giving it up (~0.25 s) outlasts the recompute owed
    slow_to_give_up = dataclasses.replace(plan, abandon=Abandon(rtt=0.2, reconnect_seconds=0.02))
    assert give_up_seconds(10 * MB, 0.2, 0.02) > 0.2 and mpc(slow_to_give_up) == TEXT
    tight = dataclasses.replace(plan, time_left=0.65)
    assert mpc_plan(tight).columns[0] == 2 and mpc(tight) == TEXT


def test_on_shared_cores_a_chunk_text_would_finish_first_is_tried_while_the_recompute_runs() -> None:
    """Nothing fits (0.3 s left) and the estimate (1 MB/s, after a stall) makes text the
    quickest. Where recompute shares the decoder's cores, each text chunk costs a prefill
    there, and deciding every chunk left as text at once on one estimate is irrevocable:
    while 1 s of earlier text is still being recomputed, chunk 0 is tried at its smallest
    level, which the cancel rule can give up in time. Not with nothing owed, not without
    the cancel rule, and not where recompute runs beside the decoder (text is cheap there)."""
    history = [Observation(MB, 1.0)] * 4
    plan = PlanInput(sizes=[[10 * MB, 5 * MB]] * 4, text_bytes=[2000] * 4, text_seconds=[0.5] * 4,
                     distortion=[0.001, 0.01], time_left=0.3, history=history, recompute_busy=1.0,
                     abandon=Abandon(rtt=0.005, reconnect_seconds=0.02), recompute_overlaps=False)
    assert mpc(plan) == 1
    assert mpc(dataclasses.replace(plan, recompute_busy=0.0)) == TEXT
    assert mpc(dataclasses.replace(plan, abandon=None)) == TEXT
    assert mpc(dataclasses.replace(plan, recompute_overlaps=True)) == TEXT


def test_time_left_counts_at_least_the_round_trip() -> None:
    assert time_left(1.0, 0, None, 0.01) == pytest.approx(0.99)
    assert time_left(1.0, 500_000, MB, 0.01) == pytest.approx(0.5)


def test_mpc_tries_a_level_after_a_fade_only_when_a_slow_chunk_can_be_given_up() -> None:
    """Four 10 MB chunks at 1 s left: after samples at 100 MB/s, one at 1 MB/s pulls the
    estimate down so far that the plan says text. Text would be irrevocable; with the
    cancel rule on, a level is tried (the fade may be over), without it text it is."""
    history = [Observation(10 * MB, 0.1)] * 3 + [Observation(MB, 1.0)]
    plan = PlanInput(sizes=[[10 * MB, 5 * MB]] * 4, text_bytes=[2000] * 4, text_seconds=[0.01] * 4,
                     distortion=[0.001, 0.01], time_left=1.0, history=history)
    assert mpc(plan) == TEXT
    bold = PlanInput(**{**plan.__dict__, "abandon": Abandon(rtt=0.005, reconnect_seconds=0.02)})
    assert mpc(bold) in (0, 1)
    # nothing measured in this fetch and a prior that says text: the smallest level is tried
    cold = PlanInput(**{**bold.__dict__, "history": [], "prior_bps": 1e6})
    assert mpc(cold) == 1
    # not when even giving the chunk up would leave the rest no time as text
    tight = PlanInput(**{**bold.__dict__, "time_left": 0.05})
    assert mpc(tight) == TEXT


def test_mpc_does_not_probe_a_link_whose_best_rate_cannot_carry_the_level() -> None:
    """The same four chunks on a link that has delivered 20 MB/s at best: the smallest
    level (5 MB) then takes longer than the fetch has left at its best rate, so a probe
    could only be given up in turn (on a steady slow link every chunk was tried and
    abandoned until the text came too late)."""
    history = [Observation(2 * MB, 0.1)] * 3 + [Observation(MB, 1.0)]
    slow = PlanInput(sizes=[[10 * MB, 5 * MB]] * 4, text_bytes=[2000] * 4, text_seconds=[0.01] * 4,
                     distortion=[0.001, 0.01], time_left=0.2, history=history,
                     abandon=Abandon(rtt=0.005, reconnect_seconds=0.02))
    assert mpc(slow) == TEXT
    # 100 MB/s at best: the smallest level would make it, so it is tried
    hopeful = PlanInput(**{**slow.__dict__, "history": [Observation(10 * MB, 0.1)] * 3 + [Observation(MB, 1.0)]})
    assert mpc(hopeful) == 1


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


@pytest.mark.parametrize("escalate_after", [0.2, float("inf")])
async def test_a_session_drops_a_connection_whose_cancel_a_stall_holds_up(tmp_path, monkeypatch,
                                                                          escalate_after) -> None:
    """The link (8 Mbit/s) stalls for 5 s 0.6 s after each connection opens (once the
    session's handshake is through), as a fetch starts. The cancel rule (here made to give
    a KV chunk up for text once it is judged slower than 0.2 MB/s) sends CANCEL for the
    chunk the stall caught, and the answer waits behind the committed bytes, stuck in the
    stall. With ``escalate_after`` the session drops that connection and finishes on a new
    one without the stall watchdog (``stall_timeout``) firing; with no bound it waits for
    the watchdog's reconnect."""
    import codec
    from netsim.shaping import Stall
    from streamer.adapt import cancel
    from streamer_helpers import synthetic_kv

    layers, heads, head_dim, tokens = 4, 2, 32, 4 * 512
    kv = synthetic_kv(3, tokens, layers, heads, head_dim)
    profile = codec.calibrate([synthetic_kv(4, 2048, layers, heads, head_dim)])
    store = await streamer.open_store(str(tmp_path))
    await streamer.put_context(store, "ctx", kv, list(range(tokens)), profile=profile, chunk_tokens=512)

    def give_up_when_stalled(plan, head, *, rate, **_):
        return Switch(TEXT, abort=False, escalate_after=escalate_after) if rate < 0.2 * MB else None

    monkeypatch.setattr(cancel, "reconsider", give_up_when_stalled)
    sender = await streamer.serve(store)
    texts: list[int] = []
    stall_at = 0.6
    down = netsim.LinkSpec(trace=netsim.Trace.constant(8.0, 1.0), stalls=(Stall(stall_at, 5.0),))
    try:
        async with netsim.ShapingProxy(upstream=("127.0.0.1", sender.port), down=down,
                                       up=netsim.LinkSpec()) as proxy:
            async with streamer.StreamSession("127.0.0.1", proxy.port, "ctx", slo=5.0, policy="mpc",
                                              prior_bps=1e6, stall_timeout=1.0,
                                              on_text=lambda c, ids: texts.append(c)) as session:
                opened = proxy.stats.per_connection[-1].opened   # the proxy's clock: time.monotonic()
                assert time.monotonic() < opened + stall_at - 0.05, "the handshake ran into the stall"
                await asyncio.sleep(opened + stall_at - 0.05 - time.monotonic())   # chunk 0 meets it
                report = await session.fetch()
    finally:
        await sender.close()
        await store.close()
    assert report.cancels >= 1 and texts
    assert report.reconnects == (0 if escalate_after < 1.0 else 1)


@pytest.mark.parametrize("continuations, predict", [(False, 0), (True, 0), (True, 2)],
                         ids=["text", "continuation", "predicted-continuation"])
async def test_a_switch_while_an_async_on_layer_runs_keeps_its_layer(tmp_path, monkeypatch, continuations,
                                                                      predict) -> None:
    """The consumer's on_layer is async and still awaiting on chunk 0's first layer when
    the cancel rule (here made to ask for level 2 once a layer of the chunk is out) gives
    the chunk up. The layer counts as delivered from the call, so the running call keeps
    it (clearing it raised a KeyError in the consumer). Without continuations the chunk
    goes to text: its layers in order, each once (those already committed to the path keep
    coming until the CANCEL takes effect), then its text, and the report says how many
    layers the text superseded. With them (protocol version 2) the layers not delivered
    come at level 2: every layer exactly once, in order, no text, and the report lists the
    two runs. With a predicting profile (layers 0 and 2 coded alone) the continuation asks
    from the layer coded alone before the first not delivered: the layers between come
    again, feed the decoder's chain and are not delivered again."""
    import codec
    from codec.synthetic import chained_kv
    from streamer.adapt import cancel
    from streamer_helpers import synthetic_kv

    layers, heads, head_dim, tokens = 4, 8, 64, 4 * 512
    if predict:
        kv = chained_kv(layers, heads, head_dim, tokens, 3)
        profile = codec.calibrate([chained_kv(layers, heads, head_dim, 2048, 4)], predict=predict)
    else:
        kv = synthetic_kv(3, tokens, layers, heads, head_dim)
        profile = codec.calibrate([synthetic_kv(4, 2048, layers, heads, head_dim)])
    store = await streamer.open_store(str(tmp_path))
    await streamer.put_context(store, "ctx", kv, list(range(tokens)), profile=profile, chunk_tokens=512)
    asked_with: list[int] = []
    switched = asyncio.Event()

    def give_up_once_a_layer_is_out(plan, head, **_):
        if head.delivered_layers and not asked_with:
            asked_with.append(head.delivered_layers)
            switched.set()
            return Switch(2, abort=False, escalate_after=5.0)
        return None

    monkeypatch.setattr(cancel, "reconsider", give_up_once_a_layer_is_out)
    requested: list[tuple[int, int | str, int]] = []
    sent = driver_module.FetchDriver._send

    def record_requests(self, frame):
        if isinstance(frame, p.Request):
            requested.append((frame.chunk, frame.level, frame.first_layer))
        return sent(self, frame)

    monkeypatch.setattr(driver_module.FetchDriver, "_send", record_requests)
    seen: list[tuple] = []
    decoded: dict[int, torch.Tensor] = {}

    async def on_layer(chunk: int, layer: int, k, v) -> None:
        seen.append((chunk, layer))
        if chunk == 0:
            decoded[layer] = k.clone()
        if (chunk, layer) == (0, 0):
            await asyncio.wait_for(switched.wait(), 10.0)   # the switch is decided meanwhile

    manifest = await store.get_manifest("ctx")
    blobs = {level: await store.get_chunk("ctx", manifest.version, 0, level) for level in (0, 2)}
    sender = await streamer.serve(store)
    try:
        async with netsim.ShapingProxy(upstream=("127.0.0.1", sender.port), delay_ms=1.0) as proxy:
            async with streamer.StreamSession("127.0.0.1", proxy.port, "ctx", slo=30.0, policy="mpc",
                                              prior_bps=1e6, on_layer=on_layer, continuations=continuations,
                                              on_text=lambda c, ids: seen.append((c, TEXT))) as session:
                proxy.set_trace(8.0)   # ~0.7 s per layer section: chunk 0 is still arriving when layer 0 is out
                report = await session.fetch()
    finally:
        await sender.close()
        await store.close()
    assert asked_with == [1]
    first = [layer for chunk, layer in seen if chunk == 0]
    chunk0 = report.chunks[0]
    assert chunk0.cancelled_levels == [0] and report.cancels == 1
    if not continuations:
        superseded = first.index(TEXT)
        assert superseded >= 1 and first == [*range(superseded), TEXT]
        assert chunk0.level == TEXT and chunk0.superseded_layers == superseded and chunk0.layer_levels == []
        return
    assert first == list(range(layers))   # each layer once, in order, nothing superseded
    assert chunk0.level == 2 and chunk0.superseded_layers == 0
    (start, level0), (continued_from, level2) = chunk0.layer_levels
    assert (start, level0, level2) == (0, 0, 2) and 1 <= continued_from < layers
    asked_from = continued_from - continued_from % predict if predict else continued_from
    assert (0, 2, asked_from) in requested
    # the layers came at the levels the report says: each as that level's stored blob decodes it
    for layer, k in decoded.items():
        level = 0 if layer < continued_from else 2
        _, want, _ = list(codec.decode_layers(blobs[level], profile))[layer]
        assert torch.equal(k, want), f"layer {layer} is not level {level}'s"


async def test_a_cancel_that_crosses_a_chunks_end_does_not_cancel_its_next_request(tmp_path, monkeypatch) -> None:
    """The receiver cancels chunk 0 while the sender drains its last part (held there until
    the sender has read the CANCEL): too late to stop it, so chunk 0 ends normally. That
    CANCEL must end with the answer: chunk 0 requested again on the same connection arrives
    whole, and the connection stays fit for the pool (the sender kept the chunk in a set of
    its own and went to answer the new request CHUNK_END cancelled=true: its protocol
    refused that, a request the client did not cancel, and the connection was aborted)."""
    import codec
    from streamer.net import sender as sender_module
    from streamer.net.client import ClientConnection
    from streamer.wire import protocol as p
    from streamer_helpers import synthetic_kv

    layers, heads, head_dim, tokens = 2, 2, 32, 2 * 256
    kv = synthetic_kv(3, tokens, layers, heads, head_dim)
    profile = codec.calibrate([synthetic_kv(4, 1024, layers, heads, head_dim)])
    store = await streamer.open_store(str(tmp_path))
    manifest = await streamer.put_context(store, "ctx", kv, list(range(tokens)), profile=profile,
                                          chunk_tokens=256)
    blob = await store.get_chunk("ctx", manifest.version, 0, 0)
    in_last_part, cancel_read, release = asyncio.Event(), asyncio.Event(), asyncio.Event()
    write, dispatch = sender_module._ConnectionHandler._write, sender_module._ConnectionHandler._dispatch

    async def held_in_the_last_part(self, *pieces):
        # the last CHUNK_PART of chunk 0 is framed (the sender looked for a CANCEL before
        # it) and its CHUNK_END is not yet: hold the part's write until the CANCEL is read
        progress = self.conn.chunk_in_progress
        if not in_last_part.is_set() and progress is not None and progress.parts_seen == progress.parts:
            in_last_part.set()
            await release.wait()
        await write(self, *pieces)

    def noting_cancels(self, event):
        alive = dispatch(self, event)
        if isinstance(event, p.Cancel):
            cancel_read.set()
        return alive

    monkeypatch.setattr(sender_module._ConnectionHandler, "_write", held_in_the_last_part)
    monkeypatch.setattr(sender_module._ConnectionHandler, "_dispatch", noting_cancels)

    async def answer(client: ClientConnection) -> list[p.Event]:
        events = [(await client.next(5.0)).event]
        while not isinstance(events[-1], (p.ChunkEnd, p.Error, p.ConnectionClosed)):
            events.append((await client.next(5.0)).event)
        return events

    sender = await streamer.serve(store)
    try:
        client = await ClientConnection.connect("127.0.0.1", sender.port)
        await client.call(p.Open(context_id="ctx", slo=1.0), p.ManifestData, 5.0)
        client.send(p.Request(chunk=0, level=0))
        await asyncio.wait_for(in_last_part.wait(), 5.0)       # the last part is being written
        client.send(p.Cancel(chunk=0))
        await asyncio.wait_for(cancel_read.wait(), 5.0)  # and the sender has the CANCEL
        release.set()
        first = await answer(client)
        assert first[-1] == p.ChunkEnd(chunk=0, cancelled=False), first[-1]
        client.send(p.Request(chunk=0, level=0))
        again = await answer(client)
        assert again[-1] == p.ChunkEnd(chunk=0, cancelled=False), again[-1]
        assert b"".join(bytes(e.data) for e in again if isinstance(e, p.ChunkPart)) == blob
        assert client.reusable
        await client.close()
    finally:
        await sender.close()
        await store.close()
