"""Synthetic KV with real KV's statistics, for benchmarks and tests that need no model."""
from __future__ import annotations

import math

import torch


def synthetic_kv(layers: int, heads: int, head_dim: int, tokens: int, seed: int) -> torch.Tensor:
    """Correlated heavy-tailed KV: a per-layer low-rank mixing of Laplacian sources plus noise.

    The spectrum decays like real KV's, so the transform has something to find; the
    mixing depends only on the layer (not ``seed``) so a profile fitted on one draw
    applies to another.
    """
    channels = heads * head_dim
    rank = max(channels // 4, 1)
    out = torch.empty(layers, 2, tokens, channels)
    for l in range(layers):
        for kv in range(2):
            mix_gen = torch.Generator().manual_seed(1000 * l + kv)
            mixing = torch.randn(rank, channels, generator=mix_gen) / math.sqrt(rank)
            decay = torch.exp(-torch.arange(rank, dtype=torch.float32) / (rank / 6))
            offset = torch.randn(channels, generator=mix_gen)
            gen = torch.Generator().manual_seed(seed * 7919 + 31 * l + kv)
            # Laplacian sources: random sign times an exponential magnitude
            sign = (torch.rand(tokens, rank, generator=gen) - 0.5).sign()
            sources = sign * -torch.log1p(-torch.rand(tokens, rank, generator=gen).clamp_max(0.999999))
            noise = 0.05 * torch.randn(tokens, channels, generator=gen)
            out[l, kv] = (sources * decay) @ mixing + noise + offset
    return out.reshape(layers, 2, tokens, heads, head_dim)


def chained_kv(layers: int, heads: int, head_dim: int, tokens: int, seed: int, *,
               fresh: float = 0.05) -> torch.Tensor:
    """KV whose layers follow from one another, as a model's residual stream makes them:
    each layer's position-free K and V are the previous layer's through a fixed map near
    the identity, plus ``fresh`` new signal. What inter-layer prediction
    (``codec.prediction``) is for; the maps depend only on the layer, not ``seed``."""
    width = 2 * heads * head_dim
    rows = torch.Generator().manual_seed(seed)
    maps = torch.Generator().manual_seed(4242)
    out = [torch.randn(tokens, width, generator=rows)]
    for _ in range(1, layers):
        mix = 0.9 * torch.eye(width) + 0.1 * torch.randn(width, width, generator=maps)
        out.append(out[-1] @ mix + fresh * torch.randn(tokens, width, generator=rows))
    return torch.stack(out).reshape(layers, tokens, 2, heads, head_dim).permute(0, 2, 1, 3, 4).contiguous()
