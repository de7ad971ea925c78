"""The two drivers drive alike: a real fetch replayed in the simulator takes the same actions.

A StreamSession fetches through the shaping proxy on a variable link with its controller's
inputs and actions recorded (``SessionConfig.record``). ``streamer.fetch.replay`` takes
from that log what the world did (the answers' arrival timeline, the decoder's and the
caller's seconds, the driver's wake-ups and new connections), and the simulator drives its
own controller with that as its link, decoder, recompute and clock, and its own model of
the delivery. Every action must be the session's, in the same order: any drift between
the session's translation of sockets and threads into inputs and the simulator's (what
it counts, when it feeds what) shows as a different decision or request time.
"""
from __future__ import annotations

import asyncio

import pytest

import codec
import netsim
import streamer
from netsim.trace import Trace
from streamer.adapt.base import TEXT
from streamer.fetch import events as ev
from streamer.fetch.replay import recording
from streamer.fetch.simulate import Simulator
from streamer_helpers import synthetic_kv

LAYERS, HEADS, HEAD_DIM, CHUNK_TOKENS, CHUNKS = 4, 8, 32, 512, 8
RECOMPUTE = 2e-4
PRIOR = 3e6

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def context(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("replay-store")
    kv = synthetic_kv(3, CHUNKS * CHUNK_TOKENS, LAYERS, HEADS, HEAD_DIM)
    profile = codec.calibrate([synthetic_kv(4, 2048, LAYERS, HEADS, HEAD_DIM)])

    async def put() -> streamer.Manifest:
        store = await streamer.open_store(str(root))
        try:
            return await streamer.put_context(store, "ctx", kv, list(range(kv.shape[2])), profile=profile,
                                              chunk_tokens=CHUNK_TOKENS)
        finally:
            await store.close()
    return {"root": str(root), "manifest": asyncio.run(put())}


async def _recorded_fetch(root: str, trace: Trace, slo: float):
    store = await streamer.open_store(root)
    sender = await streamer.serve(store)

    async def on_text(chunk: int, token_ids: list[int]) -> None:
        await asyncio.sleep(RECOMPUTE * len(token_ids))   # a GPU's prefill: the loop runs meanwhile

    try:
        async with netsim.ShapingProxy(upstream=("127.0.0.1", sender.port), delay_ms=2.0) as proxy:
            async with streamer.StreamSession("127.0.0.1", proxy.port, "ctx", slo=slo, policy="text") as session:
                await session.fetch()   # caches the profile: the recorded fetch starts with no sample
            async with streamer.StreamSession("127.0.0.1", proxy.port, "ctx", slo=slo, policy="mpc",
                                              prior_bps=PRIOR, recompute_seconds_per_token=RECOMPUTE,
                                              on_text=on_text, record=True) as session:
                proxy.set_trace(trace, direction="down")
                report = await session.fetch()
    finally:
        await sender.close()
        await store.close()
    return report, session.log, session.beliefs


@pytest.mark.parametrize("trace, slo", [
    (Trace([0.0, 0.3, 0.6], [40.0, 1.0, 40.0]), 1.5),   # a fade and a recovery: levels move
    (Trace([0.0, 0.25], [40.0, 2.0]), 1.0),             # a drop: chunks given up for text
], ids=["fade", "drop"])
async def test_a_recorded_fetch_replays_to_the_same_actions(context, trace: Trace, slo: float) -> None:
    report, log, beliefs = await _recorded_fetch(context["root"], trace, slo)
    world = recording(log)
    sim = Simulator(context["manifest"], rtt=world.rtt, reconnect_seconds=world.connect_seconds,
                    recompute_seconds_per_token=RECOMPUTE)
    replayed = sim.run("mpc", None, slo=slo, beliefs=beliefs, link=world.link(), decode_time=world.decode_time,
                       decode_done=world.decode_done,
                       recompute_time=world.recompute_time, wakes=world.wakes, connects=world.connects,
                       pauses=world.pauses, continuations=world.continuations)
    assert replayed.actions == world.actions
    assert replayed.choices == [c.level for c in report.chunks]
    assert len({c for c in replayed.choices}) >= 2, "a fetch of one choice would prove little"
    # the delivery model's finish agrees with the session's to the recorded events' precision
    assert replayed.finish == pytest.approx(report.total_seconds, abs=0.01)
    if trace.rates[-1] < 10:
        assert report.cancels >= 1 and TEXT in replayed.choices
        assert any(isinstance(a, (ev.SendCancel, ev.Reconnect)) for a in replayed.actions)


async def test_the_validation_replays_a_fetch_it_also_simulated_on_its_trace(context) -> None:
    """``kvwire bench policies --validate`` runs a recorded fetch's decoder seconds through
    a simulation on its trace, then replays the fetch. A Recording hands each section's
    seconds out once, so the two runs need one each: sharing one left the replay the
    first run's leftovers (every decode instant), and a fetch whose decodes mattered
    (a busy machine) replayed to other actions."""
    from streamer.tools import bench_policies

    trace, slo = Trace([0.0, 0.3, 0.6], [40.0, 1.0, 40.0]), 1.5
    report, log, beliefs = await _recorded_fetch(context["root"], trace, slo)
    recorded = recording(log)
    assert sum(len(times) for times in recorded.decodes.values()) > 0
    sim = Simulator(context["manifest"], rtt=recorded.rtt, reconnect_seconds=recorded.connect_seconds,
                    recompute_seconds_per_token=RECOMPUTE)
    seen = []
    run = Simulator.run

    def watching(self, policy, trace, **kwargs):
        decode_time = kwargs.get("decode_time")
        if decode_time is not None:
            kwargs["decode_time"] = lambda chunk, layer, nbytes: seen.append(
                (id(self), chunk, layer, decode_time(chunk, layer, nbytes))) or seen[-1][-1]
        return run(self, policy, trace, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Simulator, "run", watching)
        row = bench_policies._compare(sim, report, log, beliefs, trace, "mpc", slo)
    assert row["replay_same"]
    replay = [(chunk, layer, seconds) for who, chunk, layer, seconds in seen if who != id(sim)]
    first = {}
    for chunk, layer, seconds in replay:   # each section's first decode in the replay: its recorded seconds
        first.setdefault((chunk, layer), seconds)
    again = recording(log)
    assert first and all(seconds == again.decodes[key][0] for key, seconds in first.items())
