"""The receiver daemon with a model (``--model``): chunks that arrive as text are
recomputed by the daemon itself, so the caller gets a complete cache. A small
randomly initialised Llama (no download) stands in for the serving model."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch
from safetensors.torch import load as load_safetensors

import codec
import streamer
from streamer.receiver import ReceiverConfig, start_receiver

pytest.importorskip("transformers")
from streamer.model import hf  # noqa: E402

VOCAB = 128


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def llama_context(tmp_path_factory):
    model, tokenizer = hf.random_llama(layers=2, hidden=64, heads=4, kv_heads=2, vocab=VOCAB,
                                       max_positions=512, seed=0)
    ids = _ids(96, 21)
    kv = hf.capture_kv(model, None, ids)
    profile = codec.calibrate([hf.capture_kv(model, None, _ids(256, s)) for s in (22, 23)])
    root = str(tmp_path_factory.mktemp("llama-store"))

    async def put():
        store = await streamer.open_store(root)
        try:
            await streamer.put_context(store, "doc", kv, ids, profile=profile, chunk_tokens=32)
            # a context of another shape: the model cannot recompute it
            other = torch.randn(1, 2, 64, 2, 16)
            other_profile = codec.calibrate([torch.randn(1, 2, 256, 2, 16)])
            await streamer.put_context(store, "other", other, _ids(64, 5), profile=other_profile, chunk_tokens=32)
        finally:
            await store.close()

    asyncio.run(put())
    return {"root": root, "model": (model, tokenizer), "kv": kv, "ids": ids}


async def test_text_chunks_are_recomputed_with_the_model(llama_context) -> None:
    store = await streamer.open_store(llama_context["root"])
    sender = await streamer.serve(store)
    receiver = await start_receiver(ReceiverConfig(servers=[("127.0.0.1", sender.port)], model="random-llama"),
                                    "127.0.0.1", 0, model=llama_context["model"])
    try:
        # the policy weighs text at what the model's recompute measured at start-up costs
        from streamer.model import hf

        measured = hf._measured_rates[llama_context["model"][0]]
        assert receiver.fetcher.session.recompute_seconds_per_token in measured.values()
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{receiver.url}/fetch", json={"context_id": "doc", "slo": 10.0,
                                                                "policy": "text"}) as r:
                body = await r.json()
            assert r.status == 200, body
            assert body["quality"] == {"worst_level": 0, "levels": ["text"] * 3, "text_chunks": [],
                                       "recomputed": [0, 1, 2], "complete": True}
            assert body["text"] == []
            async with http.get(f"{receiver.url}/contexts/doc") as r:
                tensors = load_safetensors(await r.read())
            assert tensors["text_ranges"].shape == (0, 2)
            assert torch.allclose(tensors["kv"], llama_context["kv"], atol=1e-5)
            # a context the model does not fit: its text chunks go to the caller as ids
            async with http.post(f"{receiver.url}/fetch", json={"context_id": "other", "slo": 10.0,
                                                                "policy": "text"}) as r:
                other = await r.json()
            assert r.status == 200 and other["quality"]["text_chunks"] == [0, 1], other
            assert other["text"][0]["token_ids"] == _ids(64, 5)[:32]
            async with http.get(f"{receiver.url}/metrics") as r:
                assert "kvwire_receiver_recomputed_chunks_total 3.0" in await r.text()
    finally:
        await receiver.close()
        await sender.close()
        await store.close()
