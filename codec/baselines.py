"""Baselines the benchmark measures kvwire against, on the same KV and chunks.

* ``raw_fp16``: the cache as it sits in GPU memory.
* ``int8``: per-(layer, K/V, channel) min/max quantization to 8 bits (the usual
  "quantization baseline" of KV-transfer papers).
* ``zstd_fp16``: lossless zstd on the fp16 bytes (shows lossless is not the way).
* ``cachegen``: CacheGen's paper design (SIGCOMM'24): groups of 10 tokens, the
  anchor token quantized to 8 bits (per-token absmax), the others as deltas to
  the anchor with bins of 0.5/1/1.5 (times ``quality``) per-channel delta std in
  three layer groups, entropy coded with one table per (layer, K/V, channel)
  shipped with every chunk. Its coded size is the *empirical entropy* of its
  symbols (a perfect coder) plus its tables: generous to the baseline.

Each returns an ``Encoded`` with the byte count and the reconstruction, so the
benchmark computes bits and distortion the same way for all of them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import zstandard

CACHEGEN_GROUP = 10
CACHEGEN_BINS = (0.5, 1.0, 1.5)


@dataclass(frozen=True)
class Encoded:
    name: str
    nbytes: int
    reconstruction: torch.Tensor  # float32, same shape as the input


def raw_fp16(kv: torch.Tensor) -> Encoded:
    half = kv.to(torch.float16)
    return Encoded("raw_fp16", half.numel() * 2, half.float())


def zstd_fp16(kv: torch.Tensor, level: int = 3) -> Encoded:
    half = kv.to(torch.float16).contiguous()
    raw = half.view(torch.int16).numpy().tobytes()
    packed = zstandard.ZstdCompressor(level=level).compress(raw)
    restored = np.frombuffer(zstandard.ZstdDecompressor().decompress(packed), dtype=np.int16)
    out = torch.from_numpy(restored.copy()).view(torch.float16).reshape(kv.shape).float()
    return Encoded(f"zstd_fp16(l{level})", len(packed), out)


def int8(kv: torch.Tensor) -> Encoded:
    """Asymmetric 8-bit per (layer, K/V, channel), scale and offset in fp16."""
    x = kv.float()
    lo = x.amin(dim=2, keepdim=True).half().float()
    hi = x.amax(dim=2, keepdim=True).half().float()
    scale = ((hi - lo) / 255.0).clamp_min(1e-8)
    q = torch.clamp(torch.round((x - lo) / scale), 0, 255)
    channels = kv.shape[0] * 2 * kv.shape[3] * kv.shape[4]
    return Encoded("int8", q.numel() + channels * 4, q * scale + lo)


def _entropy_bits(symbols: np.ndarray) -> tuple[float, int]:
    """Empirical entropy (bits) of each row of int symbols, summed; and table entries."""
    bits = 0.0
    entries = 0
    for row in symbols:
        lo = int(row.min())
        counts = np.bincount(row - lo)
        nz = counts[counts > 0]
        p = nz / row.size
        bits += float(-(p * np.log2(p)).sum()) * row.size
        entries += counts.size
    return bits, entries


def cachegen(kv: torch.Tensor, quality: float = 1.0) -> Encoded:
    """CacheGen-style encoding at bin multiplier ``quality`` (larger = coarser)."""
    x = kv.float()
    layers, _, tokens, heads, head_dim = x.shape
    channels = heads * head_dim
    flat = x.reshape(layers, 2, tokens, channels)
    out = torch.empty_like(flat)
    total_bits = 0.0
    for l in range(layers):
        bin_scale = CACHEGEN_BINS[min(3 * l // layers, 2)] * quality
        for kv_i in range(2):
            data = flat[l, kv_i]
            anchors = data[::CACHEGEN_GROUP]
            absmax = anchors.abs().amax(dim=1, keepdim=True).half().float().clamp_min(1e-8)
            anchor_q = torch.round(anchors / absmax * 127).clamp(-127, 127)
            anchor_rec = anchor_q * absmax / 127
            total_bits += anchor_q.numel() * 8 + anchors.shape[0] * 16
            base = anchor_rec.repeat_interleave(CACHEGEN_GROUP, dim=0)[:tokens]
            delta = data - base
            is_anchor = torch.zeros(tokens, dtype=torch.bool)
            is_anchor[::CACHEGEN_GROUP] = True
            deltas = delta[~is_anchor]
            std = deltas.std(dim=0, unbiased=False).half().float().clamp_min(1e-6) if deltas.numel() \
                else torch.ones(channels)
            step = std * bin_scale
            q = torch.round(deltas / step)
            rec = base.clone()
            rec[~is_anchor] = base[~is_anchor] + q * step
            rec[is_anchor] = anchor_rec
            out[l, kv_i] = rec
            if deltas.numel():
                bits, entries = _entropy_bits(q.T.numpy().astype(np.int64))
                # per channel: the table (16-bit counts) + its range (2 x 16 bits) + std (fp16)
                total_bits += bits + entries * 16 + channels * 48
    return Encoded(f"cachegen(q={quality:g})", int(np.ceil(total_bits / 8)),
                   out.reshape(x.shape))
