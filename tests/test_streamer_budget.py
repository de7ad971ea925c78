"""The process-wide receive budget (``streamer.net.budget``): fair shares, waking the paused,
and many sessions on real sockets that complete under a budget far smaller than what they
would hold, none starved and none deadlocked."""
from __future__ import annotations

import asyncio

import pytest

import codec
import streamer
from streamer.net import budget as budget_module
from streamer.net.budget import ReceiveBudget
from streamer_helpers import put_context_now, synthetic_kv

LAYERS, HEADS, HEAD_DIM, CHUNK_TOKENS, CHUNKS = 4, 8, 32, 256, 6


def test_a_session_over_its_fair_share_pauses_one_under_it_goes_on() -> None:
    budget = ReceiveBudget(1000)
    woken: list[str] = []
    big, small = budget.join(lambda: woken.append("big")), budget.join(lambda: woken.append("small"))
    big.hold(900)
    assert not big.over()              # under the budget: nobody pauses
    small.hold(200)
    assert budget.total == 1100 and budget.fair_share() == 500
    assert big.over() and not small.over()   # the newcomer is not starved by the large one
    big.paused = True
    small.hold(150)                    # a release, still over the budget: nobody to wake yet
    assert woken == []
    small.hold(50)                     # back under: the paused one looks again
    assert woken == ["big"] and budget.total == 950
    big.close()
    small.close()
    assert budget.total == 0 and budget.peak == 1100


def test_a_budget_is_a_positive_number_of_bytes() -> None:
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError):
            ReceiveBudget(bad)   # type: ignore[arg-type]


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, streamer.Manifest]:
    root = str(tmp_path_factory.mktemp("budget-store"))
    profile = codec.calibrate([synthetic_kv(1, 1024, LAYERS, HEADS, HEAD_DIM)])
    manifest = put_context_now(root, "ctx", synthetic_kv(2, CHUNKS * CHUNK_TOKENS, LAYERS, HEADS, HEAD_DIM),
                               list(range(CHUNKS * CHUNK_TOKENS)), profile=profile, chunk_tokens=CHUNK_TOKENS)
    return root, manifest


async def test_many_sessions_complete_under_a_budget_smaller_than_one_chunk(stored, monkeypatch) -> None:
    """Eight sessions with slow consumers share a budget of 64 kB, less than one chunk: the
    ones over their share stop reading, the consumer of each still gets the section it
    waits for (never a deadlock), and every session gets every layer in order."""
    root, manifest = stored
    shared = ReceiveBudget(64 * 1024)
    monkeypatch.setattr(budget_module, "_process_budget", shared)
    store = await streamer.open_store(root)
    sender = await streamer.serve(store)

    async def fetch() -> list[tuple[int, int]]:
        seen: list[tuple[int, int]] = []

        async def on_layer(chunk: int, layer: int, k, v) -> None:
            seen.append((chunk, layer))
            await asyncio.sleep(0.002)   # a consumer slower than the loopback link

        async with streamer.StreamSession("127.0.0.1", sender.port, "ctx", slo=60.0, policy="fixed:0",
                                          on_layer=on_layer) as session:
            await session.fetch()
        return seen

    try:
        results = await asyncio.wait_for(asyncio.gather(*(fetch() for _ in range(8))), 120)
    finally:
        await sender.close()
        await store.close()
    everything = [(c, l) for c in range(CHUNKS) for l in range(LAYERS)]
    assert all(seen == everything for seen in results)
    assert shared.total == 0
    # over the budget by at most what a session reads before it looks (budget.READ_BYTES),
    # the chunk it is assembling and two decoded layers (the one its consumer is on and
    # the next), each; without the budget every session would hold its whole context (the
    # sender writes it at once over loopback, the consumers are slow)
    chunk = max(info.sizes[0] for info in manifest.chunks)
    decoded_layer = manifest.decoded_bytes // (manifest.layers * len(manifest.chunks))
    assert shared.peak <= shared.limit + 8 * (budget_module.READ_BYTES + chunk + 2 * decoded_layer)
    assert shared.peak < 8 * sum(info.sizes[0] for info in manifest.chunks)



