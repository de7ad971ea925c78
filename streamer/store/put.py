"""Put a context into a store: split into chunks, encode every chunk at every level.

Each chunk of ``chunk_tokens`` tokens is encoded independently (a receiver can decode
chunk i as soon as it has arrived, at whatever level the sender chose for it) and its
token ids are stored too, as the *text fallback* (``encode_tokens`` / ``decode_tokens``),
from which a receiver can recompute the KV when fetching it would miss the deadline.
The manifest is committed last, so the context appears complete or not at all.
(``kvwire put`` is in ``streamer.tools.put``.)

Text payload format, version 1 (all integers little-endian)::

    offset  size  field
    0       4     magic b"KVTX"
    4       1     format version (1)
    5       4     n: token count (uint32)
    9       ...   one zstd frame of the n ids as uint32 (4n bytes once decompressed)
    end-4   4     CRC-32 (zlib) of every byte before it

The CRC is checked before anything is decompressed and covers the header too, so any
single-bit (indeed any burst of <= 32 bits) corruption is a ValueError, never wrong
ids. A payload comes from a store or a sender, so it is hostile input: ``n`` is
checked against the chunk's token count before decompressing, decompression stops
after 4n + 1 bytes whatever the frame declares (a 17-byte frame may claim 64 GiB),
and the ids are checked against the vocabulary size when the manifest records one.
Payloads written before this format (a bare zstd frame) are refused saying so.
"""
from __future__ import annotations

import asyncio
import functools
import os
import struct
import time
import zlib
from typing import TYPE_CHECKING, Awaitable, Callable, Iterable, Sequence, TypeVar

import numpy as np
import zstandard

from streamer.wire.manifest import ChunkInfo, Manifest, validate_context_id
from streamer.store import ContextExists, ContextNotFound, ContextWriter, Store
from streamer.store.base import check_index
from streamer.store.prefix import PrefixIdentity, PrefixMatch, prefix_chain, prefix_context_id

DEFAULT_CHUNK_TOKENS = 1536
#: How many times put_prefix reads (or stores) and registers a content-addressed context
#: that concurrent puts keep committing or evicting under it.
PUT_PREFIX_ATTEMPTS = 5
_TOKEN_DTYPE = np.dtype("<u4")
TEXT_MAGIC = b"KVTX"
TEXT_VERSION = 1
_TEXT_HEADER = struct.Struct("<4sBI")   # magic, version, token count
_TEXT_CRC = struct.Struct("<I")
#: Most tokens a text payload may hold when the caller does not say how many it expects:
#: the codec's limit per blob (``codec.container.MAX_TOKENS``), i.e. at most 64 MiB of ids.
MAX_TEXT_TOKENS = 1 << 24
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
T = TypeVar("T")

if TYPE_CHECKING:  # imported on use: registering `kvwire put` must not load torch (~1.5 s)
    import torch

    import codec


def encode_tokens(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as a text fallback payload (the format is in the module docstring)."""
    ids = np.ascontiguousarray(token_ids, _TOKEN_DTYPE)
    body = _TEXT_HEADER.pack(TEXT_MAGIC, TEXT_VERSION, len(ids)) + \
        zstandard.ZstdCompressor(level=9).compress(ids.tobytes())
    return body + _TEXT_CRC.pack(zlib.crc32(body))


def decode_tokens(data: bytes, *, expected_tokens: int | None = None,
                  vocab_size: int | None = None) -> list[int]:
    """The token ids of a text fallback payload; ValueError naming the fault otherwise.

    ``expected_tokens``: the chunk's token count (the manifest's); the payload must hold
    exactly that many. Never more than :data:`MAX_TEXT_TOKENS` ids (64 MiB) are
    decompressed, whatever the payload claims. ``vocab_size``: every id must be below it.
    """
    view = memoryview(data)
    if len(view) < _TEXT_HEADER.size + _TEXT_CRC.size:
        raise ValueError(f"text payload is {len(view)} bytes, shorter than its header and checksum")
    magic, version, tokens = _TEXT_HEADER.unpack_from(view)
    if magic != TEXT_MAGIC:
        if bytes(view[:4]) == _ZSTD_MAGIC:
            raise ValueError("text payload is a bare zstd frame (written before text format 1, "
                             "which adds a checksum): put the context again")
        raise ValueError(f"not a kvwire text payload (magic {bytes(magic)!r})")
    (crc,) = _TEXT_CRC.unpack_from(view, len(view) - _TEXT_CRC.size)
    if zlib.crc32(view[:-_TEXT_CRC.size]) != crc:
        raise ValueError("text payload checksum mismatch (corrupt token ids)")
    if version != TEXT_VERSION:
        raise ValueError(f"unsupported text payload version {version} (this build reads {TEXT_VERSION})")
    if expected_tokens is not None and tokens != expected_tokens:
        raise ValueError(f"text payload holds {tokens} token ids, the chunk has {expected_tokens}")
    if tokens > MAX_TEXT_TOKENS:
        raise ValueError(f"text payload claims {tokens} token ids, more than {MAX_TEXT_TOKENS}")
    raw = _decompress_at_most(view[_TEXT_HEADER.size:-_TEXT_CRC.size], 4 * tokens)
    if len(raw) != 4 * tokens:
        raise ValueError(f"text payload's zstd frame holds {len(raw)} bytes, its header says "
                         f"{tokens} token ids ({4 * tokens} bytes)")
    ids = np.frombuffer(raw, dtype=_TOKEN_DTYPE)
    if vocab_size is not None and ids.size and int(ids.max()) >= vocab_size:
        raise ValueError(f"text payload holds token id {int(ids.max())}, outside the vocabulary "
                         f"of {vocab_size} tokens")
    return ids.tolist()


def _decompress_at_most(frame: memoryview, limit: int) -> bytes:
    """The content of one zstd frame, reading at most ``limit + 1`` bytes of it (so an
    over-long frame is noticed without decompressing it); ValueError if not zstd."""
    out = bytearray()
    try:
        with zstandard.ZstdDecompressor().stream_reader(frame) as reader:
            while len(out) <= limit and (piece := reader.read(limit + 1 - len(out))):
                out += piece
    except zstandard.ZstdError as exc:
        raise ValueError(f"text payload's token ids are not a zstd frame: {exc}") from None
    return bytes(out)


def _check_token_ids(token_ids: Sequence[int] | np.ndarray | torch.Tensor, tokens: int,
                     vocab_size: int | None) -> np.ndarray:
    ids = np.asarray(token_ids)  # lists, numpy arrays and CPU torch tensors alike
    if ids.ndim != 1 or len(ids) != tokens:
        raise ValueError(f"token_ids must be a flat sequence of {tokens} ids (one per KV token), "
                         f"got shape {ids.shape}")
    if ids.dtype.kind not in "iu":
        raise ValueError(f"token_ids must be integers, got dtype {ids.dtype}")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) > np.iinfo(_TOKEN_DTYPE).max):
        raise ValueError("token ids must be in [0, 2**32)")
    if vocab_size is not None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        if ids.size and int(ids.max()) >= vocab_size:
            raise ValueError(f"token id {int(ids.max())} is outside the vocabulary of {vocab_size} tokens")
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
                     profile: codec.Profile, levels: tuple[int, ...], exact: bool) -> ChunkInfo:
    """Encode one chunk at every level and stage it: one ``encode_levels`` call (the levels
    share its transform, half the work of encoding each) in a thread (the codec releases
    the GIL), and with ``exact`` its exact blob as manifest level 0 (the profile's levels
    then stored one up)."""
    import codec

    sinks = None if index == 0 else 0  # attention sinks exist only at the context's start
    # start: the chunk's positions in the context, where a rotary profile removes RoPE
    coded = await asyncio.to_thread(codec.encode_levels, kv, levels, profile, sink_tokens=sinks, start=start)
    first = 1 if exact else 0   # the manifest level of the profile's level 0
    blobs = {first + level: blob for level, blob in zip(levels, coded)}
    if exact:
        blobs[0] = await asyncio.to_thread(codec.encode_exact, kv, profile, sink_tokens=sinks, start=start)
    # not a plain gather: on a failure the other writes must be stopped (and waited for)
    # before the writer discards the staging, or one still running writes its blob after
    await _gather_bounded([functools.partial(writer.put_chunk, index, level, blob) for level, blob in blobs.items()],
                          limit=len(levels))
    text = await asyncio.to_thread(encode_tokens, ids)
    await writer.put_text(index, text)
    return ChunkInfo(index=index, start=start, end=start + kv.shape[2],
                     sizes=tuple(len(blobs.get(level, b"")) for level in range(first + len(profile.targets))),
                     text_bytes=len(text),
                     sink_tokens=codec.parse_header(coded[0]).sink_tokens)


async def put_context(store: Store, context_id: str, kv: torch.Tensor,
                      token_ids: Sequence[int] | np.ndarray | torch.Tensor, *,
                      profile: codec.Profile | None = None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                      levels: Iterable[int] | None = None, vocab_size: int | None = None,
                      replace: bool = True, exact: bool = False) -> Manifest:
    """Encode ``kv`` [layers, 2, tokens, heads, head_dim] chunk by chunk at ``levels``
    (default: all of the profile's) and commit it to ``store`` as a new version.

    ``exact`` also stores each chunk's KV exactly, as the manifest's level 0 (the
    profile's levels become levels 1..; ``Manifest.exact``): at 16 bits per fp16
    element, the level a receiver picks when its deadline allows and a model must
    compute exactly what it would from the tokens (greedy answers equal to a full
    prefill's). Only for KV computed from the tokens themselves.

    ``profile=None`` calibrates one on this context itself (fine for a one-off; a
    profile calibrated once per model on other text makes no per-context fitting
    necessary). The profile is stored too. ``vocab_size`` (the model's vocabulary size,
    ``streamer.model.hf.vocab_size``) is recorded in the manifest, so a receiver can
    range-check the text fallback's ids; every id must be below it. ``replace=False``:
    ContextExists (nothing committed) if the context already exists. Returns the
    committed manifest.
    """
    import codec
    from codec.profile import validate_kv

    validate_context_id(context_id)
    validate_kv(kv)
    kv = kv.detach().cpu()
    layers, _, tokens, heads, head_dim = kv.shape
    ids = _check_token_ids(token_ids, tokens, vocab_size)
    if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
    if not isinstance(exact, bool):
        raise ValueError(f"exact must be a bool, got {exact!r}")
    if profile is None:
        profile = await asyncio.to_thread(codec.calibrate, [kv])
    profile.check_shape(layers, heads, head_dim)
    chosen = _check_levels(levels, profile)
    await store.put_profile(profile)
    async with store.writer(context_id) as writer:
        chunks = await _gather_bounded(
            [functools.partial(_put_chunk, writer, i, start, kv[:, :, start:start + chunk_tokens],
                               ids[start:start + chunk_tokens], profile, chosen, exact)
             for i, start in enumerate(range(0, tokens, chunk_tokens))],
            limit=max(1, os.cpu_count() or 1))  # ~one encoding thread per core
        manifest = Manifest(
            context_id=context_id, version=writer.version, layers=layers, heads=heads, head_dim=head_dim,
            dtype=str(kv.dtype).removeprefix("torch."), tokens=tokens, profile_id=profile.id,
            level_distortion=(0.0,) * exact + tuple(profile.targets), chunks=tuple(chunks), created=time.time(),
            vocab_size=vocab_size, restart=profile.intra_period)
        await writer.commit(manifest, replace=replace)
    return manifest


def stored_bytes(manifest: Manifest) -> int:
    """What a context holds in the store: its blobs at every level and its texts."""
    return sum(sum(chunk.sizes) + chunk.text_bytes for chunk in manifest.chunks)


async def put_prefix(store: Store, identity: PrefixIdentity, kv: torch.Tensor,
                     token_ids: Sequence[int] | np.ndarray | torch.Tensor, profile: codec.Profile, *,
                     budget_bytes: int | None, levels: Iterable[int] | None = None,
                     vocab_size: int | None = None, exact: bool = False) -> PrefixMatch:
    """Store ``kv`` content-addressed: as ``prefix_context_id(chain)`` (``chain`` =
    ``prefix_chain(identity, token_ids)``), registered and indexed so that a lookup of any
    chain starting with ``chain[:i]`` finds it, then evict least-recently-used
    content-addressed contexts while their total bytes exceed ``budget_bytes`` (None: no
    eviction; the context just put is never evicted, even when it alone exceeds the
    budget). Name-addressed contexts are never evicted.

    ``kv`` must be exact, computed from ``token_ids`` by a full prefill, never on top of a
    lossy fetched prefix: the hash says "these tokens", not how the KV was made. A context
    already stored under the chain (an exact copy) is never replaced: it is registered and
    indexed again and returned. ``profile`` must be the identity's profile, and the
    identity's format version this codec's. ``exact``: as ``put_context``'s. Returns the
    match for the whole chain.

    Concurrent puts under a budget far smaller than what they write can evict the
    context before this returns (a later lookup then misses it); an eviction never
    leaves an index entry or ledger record naming a deleted version: a put that finds
    the version it read deleted under it unregisters it and stores it again.
    """
    from codec.container import FORMAT_VERSION

    if profile.id != identity.profile_id:
        raise ValueError(f"profile {profile.id!r} is not the identity's profile {identity.profile_id!r}")
    if identity.format_version != FORMAT_VERSION:
        raise ValueError(f"identity's format_version {identity.format_version} is not this codec's "
                         f"({FORMAT_VERSION}): the chain would name blobs it does not hold")
    if budget_bytes is not None:
        check_index(budget_bytes, "budget_bytes")
    chain = prefix_chain(identity, token_ids)
    context_id = prefix_context_id(chain)
    for _ in range(PUT_PREFIX_ATTEMPTS):
        manifest = await _current_manifest(store, context_id)
        created = manifest is None
        if manifest is None:
            try:
                manifest = await put_context(store, context_id, kv, token_ids, profile=profile,
                                             chunk_tokens=identity.chunk_tokens, levels=levels,
                                             vocab_size=vocab_size, replace=False, exact=exact)
            except ContextExists:  # a concurrent put of the same tokens committed first
                continue
        await store.register_prefix(chain, manifest.version, stored_bytes(manifest))
        current = await _current_manifest(store, context_id)
        if current is not None and current.version == manifest.version:
            break
        # an eviction deleted the version since we read or wrote it: nothing may name it
        # (and if another put stored a newer one meanwhile, the next round registers that)
        await store.unregister_prefix(chain, manifest.version)
        if current is None and created:  # stored, then evicted for newer contexts: LRU at work
            break
    if budget_bytes is not None:
        await store.evict_prefixes(budget_bytes, keep=context_id)
    return PrefixMatch(context_id, len(chain))


async def _current_manifest(store: Store, context_id: str) -> Manifest | None:
    try:
        return await store.get_manifest(context_id)
    except ContextNotFound:
        return None
