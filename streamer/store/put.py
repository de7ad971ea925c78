"""Put a context into a store: split into chunks, encode every chunk at every level.

Each chunk of ``chunk_tokens`` tokens is encoded independently (a receiver can decode
chunk i as soon as it has arrived, at whatever level the sender chose for it) and its
token ids are stored too, as the *text fallback*: zstd-compressed little-endian uint32
(``encode_tokens`` / ``decode_tokens``), from which a receiver can recompute the KV
when fetching it would miss the deadline. The manifest is committed last, so the
context appears complete or not at all. (``kvwire put`` is in ``streamer.tools.put``.)
"""
from __future__ import annotations

import asyncio
import functools
import os
import time
from typing import TYPE_CHECKING, Awaitable, Callable, Iterable, Sequence, TypeVar

import numpy as np
import zstandard

from streamer.wire.manifest import ChunkInfo, Manifest, validate_context_id
from streamer.store import ContextWriter, Store

DEFAULT_CHUNK_TOKENS = 1536
_TOKEN_DTYPE = np.dtype("<u4")
_MAX_TEXT_BYTES = 1 << 32  # 2**30 uint32 tokens: far beyond any chunk
T = TypeVar("T")

if TYPE_CHECKING:  # imported on use: registering `kvwire put` must not load torch (~1.5 s)
    import torch

    import codec


def encode_tokens(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as zstd-compressed little-endian uint32 (the text fallback format)."""
    return zstandard.ZstdCompressor(level=9).compress(np.ascontiguousarray(token_ids, _TOKEN_DTYPE).tobytes())


def decode_tokens(data: bytes) -> list[int]:
    """Inverse of ``encode_tokens``; ValueError if ``data`` is not such a payload."""
    try:
        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=_MAX_TEXT_BYTES)
    except zstandard.ZstdError as exc:
        raise ValueError(f"text fallback is not a zstd frame: {exc}") from None
    if len(raw) % _TOKEN_DTYPE.itemsize:
        raise ValueError(f"text fallback holds {len(raw)} bytes, not a whole number of uint32 token ids")
    return np.frombuffer(raw, dtype=_TOKEN_DTYPE).tolist()


def _check_token_ids(token_ids: Sequence[int] | np.ndarray | torch.Tensor, tokens: int) -> np.ndarray:
    ids = np.asarray(token_ids)  # lists, numpy arrays and CPU torch tensors alike
    if ids.ndim != 1 or len(ids) != tokens:
        raise ValueError(f"token_ids must be a flat sequence of {tokens} ids (one per KV token), "
                         f"got shape {ids.shape}")
    if ids.dtype.kind not in "iu":
        raise ValueError(f"token_ids must be integers, got dtype {ids.dtype}")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) > np.iinfo(_TOKEN_DTYPE).max):
        raise ValueError("token ids must be in [0, 2**32)")
    return ids.astype(_TOKEN_DTYPE)


def _check_levels(levels: Iterable[int] | None, profile: codec.Profile) -> tuple[int, ...]:
    if levels is None:
        return tuple(range(len(profile.targets)))
    chosen = tuple(sorted(set(levels)))
    if not chosen:
        raise ValueError("levels must name at least one quality level")
    for level in chosen:
        profile.check_level(level)
    return chosen


async def _gather_bounded(jobs: Sequence[Callable[[], Awaitable[T]]], limit: int) -> list[T]:
    """Results of ``jobs`` (run at most ``limit`` at a time), in order; on the first
    failure cancel the rest and raise it."""
    semaphore = asyncio.Semaphore(limit)

    async def run(job: Callable[[], Awaitable[T]]) -> T:
        async with semaphore:
            return await job()

    tasks = [asyncio.ensure_future(run(job)) for job in jobs]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _put_chunk(writer: ContextWriter, index: int, start: int, kv: torch.Tensor, ids: np.ndarray,
                     profile: codec.Profile, levels: tuple[int, ...]) -> ChunkInfo:
    """Encode and stage one chunk at every level (threads: the codec releases the GIL)."""
    import codec

    sinks = None if index == 0 else 0  # attention sinks exist only at the context's start

    async def level_job(level: int) -> bytes:
        blob = await asyncio.to_thread(codec.encode, kv, level, profile, sink_tokens=sinks)
        await writer.put_chunk(index, level, blob)
        return blob

    blobs = dict(zip(levels, await asyncio.gather(*(level_job(level) for level in levels))))
    text = await asyncio.to_thread(encode_tokens, ids)
    await writer.put_text(index, text)
    return ChunkInfo(index=index, start=start, end=start + kv.shape[2],
                     sizes=tuple(len(blobs.get(level, b"")) for level in range(len(profile.targets))),
                     text_bytes=len(text),
                     sink_tokens=codec.parse_header(blobs[levels[0]]).sink_tokens)


async def put_context(store: Store, context_id: str, kv: torch.Tensor,
                      token_ids: Sequence[int] | np.ndarray | torch.Tensor, *,
                      profile: codec.Profile | None = None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                      levels: Iterable[int] | None = None) -> Manifest:
    """Encode ``kv`` [layers, 2, tokens, heads, head_dim] chunk by chunk at ``levels``
    (default: all of the profile's) and commit it to ``store`` as a new version.

    ``profile=None`` calibrates one on this context itself (fine for a one-off; a
    profile calibrated once per model on other text makes no per-context fitting
    necessary). The profile is stored too. Returns the committed manifest.
    """
    import codec
    from codec.profile import validate_kv

    validate_context_id(context_id)
    validate_kv(kv)
    kv = kv.detach().cpu()
    layers, _, tokens, heads, head_dim = kv.shape
    ids = _check_token_ids(token_ids, tokens)
    if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
    if profile is None:
        profile = await asyncio.to_thread(codec.calibrate, [kv])
    profile.check_shape(layers, heads, head_dim)
    chosen = _check_levels(levels, profile)
    await store.put_profile(profile)
    async with store.writer(context_id) as writer:
        chunks = await _gather_bounded(
            [functools.partial(_put_chunk, writer, i, start, kv[:, :, start:start + chunk_tokens],
                               ids[start:start + chunk_tokens], profile, chosen)
             for i, start in enumerate(range(0, tokens, chunk_tokens))],
            limit=max(1, (os.cpu_count() or 1) // len(chosen)))  # ~one encoding thread per core
        manifest = Manifest(
            context_id=context_id, version=writer.version, layers=layers, heads=heads, head_dim=head_dim,
            dtype=str(kv.dtype).removeprefix("torch."), tokens=tokens, profile_id=profile.id,
            level_distortion=tuple(profile.targets), chunks=tuple(chunks), created=time.time())
        await writer.commit(manifest)
    return manifest
