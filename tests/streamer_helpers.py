"""Helpers shared by the streaming tests (imported by name: pytest puts tests/ on sys.path)."""
from __future__ import annotations

import asyncio
import threading

import torch

import streamer


def synthetic_kv(seed: int, tokens: int, layers: int, heads: int, head_dim: int) -> torch.Tensor:
    """fp16 KV with cross-channel correlation; the mixing is fixed, the draw depends on ``seed``,
    so a profile calibrated on one seed fits another."""
    channels = heads * head_dim
    mix = torch.randn(channels, channels, generator=torch.Generator().manual_seed(11)) / channels ** 0.5
    scale = torch.logspace(0.5, -1.5, channels)
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(layers, 2, tokens, channels, generator=gen) * scale) @ mix
    return x.reshape(layers, 2, tokens, heads, head_dim).to(torch.float16)


def put_context_now(root: str, context_id: str, kv: torch.Tensor, token_ids: list[int], *,
                    profile, chunk_tokens: int, exact: bool = False) -> streamer.Manifest:
    """Put a context into the file store at ``root`` from synchronous (fixture) code."""
    async def put() -> streamer.Manifest:
        store = await streamer.open_store(root)
        try:
            return await streamer.put_context(store, context_id, kv, token_ids, profile=profile,
                                              chunk_tokens=chunk_tokens, exact=exact)
        finally:
            await store.close()

    return asyncio.run(put())


def arrived_bytes(log: list) -> int:
    """Chunk payload bytes a session's parts and text answers brought in, from its
    controller log (``SessionConfig.record``): each answer's last count, answers starting
    at their REQUEST. What ``FetchReport.bytes`` must say."""
    from streamer.fetch import events as ev

    total, answer = 0, {}
    for item in log:
        if isinstance(item, ev.SendRequest):
            total += answer.pop(item.chunk, 0)
        elif isinstance(item, ev.PartArrived):
            answer[item.chunk] = item.received
        elif isinstance(item, ev.TextArrived):
            answer[item.chunk] = item.nbytes
    return total + sum(answer.values())


def held_decode(held_layer: int, release: threading.Event):
    """A stand-in section decoder for OrderedDelivery: ``held_layer``'s decode waits for
    ``release`` (at most 5 s), every other returns at once; the output is a dummy tensor pair."""
    def decode(header, profile, layer, section):
        if layer == held_layer:
            release.wait(5.0)
        return torch.zeros(1), torch.zeros(1)
    return decode
