"""The text fallback payload as hostile input: hand-made zstd frames (bombs that declare
64 GiB, frames longer than their header says), every single-bit flip of a stored
payload, ids outside the vocabulary, old payloads; and the manifest's ``vocab_size``
(format version 2, version 1 still read). Payloads are built from the format in
``streamer/store/put.py``'s docstring, not from ``encode_tokens``."""
from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest
import zstandard

import streamer
from streamer.net.config import SessionConfig
from streamer.net.session import FetchFailed, StreamSession, TextNotConsumed
from streamer.store.file import FileStore
from streamer.store.put import MAX_TEXT_TOKENS, decode_tokens, encode_tokens, put_context
from streamer.wire.manifest import Manifest, ManifestError
from streamer_helpers import synthetic_kv

IDS = [(7919 * i) % 50257 for i in range(300)]


def _payload(tokens: int, frame: bytes, *, magic: bytes = b"KVTX", version: int = 1) -> bytes:
    """A text payload as a hostile writer would build it: any frame, a valid checksum."""
    body = magic + struct.pack("<BI", version, tokens) + frame
    return body + struct.pack("<I", zlib.crc32(body))


def _ids_frame(ids: list[int]) -> bytes:
    return zstandard.ZstdCompressor().compress(struct.pack(f"<{len(ids)}I", *ids))


def test_the_payload_is_laid_out_as_documented() -> None:
    data = encode_tokens(IDS)
    assert data[:4] == b"KVTX" and data[4] == 1 and struct.unpack_from("<I", data, 5)[0] == len(IDS)
    assert struct.unpack_from("<I", data, len(data) - 4)[0] == zlib.crc32(data[:-4])
    raw = zstandard.ZstdDecompressor().decompress(data[9:-4])
    assert raw == struct.pack(f"<{len(IDS)}I", *IDS)
    assert decode_tokens(data, expected_tokens=len(IDS), vocab_size=50257) == IDS
    assert decode_tokens(_payload(3, _ids_frame([0, 1, 2 ** 32 - 1]))) == [0, 1, 2 ** 32 - 1]


def test_a_frame_declaring_64_gib_is_a_value_error_not_memory_error() -> None:
    # 17 bytes: magic, a single-segment header declaring 2^36 bytes, one 1-byte RLE block
    bomb = b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + struct.pack("<Q", 64 << 30) + bytes([0x0B, 0, 0, 0])
    assert len(bomb) == 17 and zstandard.frame_content_size(bomb) == 64 << 30
    with pytest.raises(ValueError, match="zstd"):
        decode_tokens(_payload(10, bomb), expected_tokens=10)
    with pytest.raises(ValueError, match="zstd"):
        decode_tokens(_payload(10, bomb))  # without an expected count too


def test_a_frame_longer_than_its_header_says_is_not_decompressed_whole() -> None:
    zeros = zstandard.ZstdCompressor().compress(bytes(1 << 28))   # 256 MiB in ~8 kB
    with pytest.raises(ValueError, match="holds 41 bytes, its header says 10 token ids"):
        decode_tokens(_payload(10, zeros), expected_tokens=10)
    with pytest.raises(ValueError, match="holds 40 bytes, its header says 11 token ids"):
        decode_tokens(_payload(11, _ids_frame(list(range(10)))))


@pytest.mark.parametrize("tokens, expected, message", [
    (301, 300, "holds 301 token ids, the chunk has 300"),
    (299, 300, "holds 299 token ids, the chunk has 300"),
    (MAX_TEXT_TOKENS + 1, None, "more than"),
    (2 ** 32 - 1, None, "more than"),
])
def test_the_token_count_is_checked_before_decompressing(tokens: int, expected: int | None,
                                                         message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decode_tokens(_payload(tokens, _ids_frame(IDS)), expected_tokens=expected)


def test_every_single_bit_flip_is_a_value_error() -> None:
    data = encode_tokens(IDS)
    for bit in range(8 * len(data)):
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(ValueError):
            decode_tokens(bytes(flipped), expected_tokens=len(IDS), vocab_size=50257)


@pytest.mark.parametrize("data, message", [
    (b"", "shorter than its header"),
    (b"KVTX\x01\x00\x00", "shorter than its header"),
    (b"garbage that is long enough", "not a kvwire text payload"),
    (zstandard.ZstdCompressor().compress(struct.pack("<3I", 1, 2, 3)), "bare zstd frame"),
    (_payload(3, _ids_frame([1, 2, 3]), version=2), "unsupported text payload version 2"),
    (_payload(3, b"not zstd at all"), "not a zstd frame"),
    (_payload(3, _ids_frame([1, 2, 50257])), "token id 50257, outside the vocabulary of 50257"),
])
def test_malformed_payloads_name_the_fault(data: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decode_tokens(data, vocab_size=50257)


# ------------------------------------------------------------------- manifest
def _manifest(**extra) -> Manifest:
    chunk = streamer.wire.manifest.ChunkInfo(index=0, start=0, end=8, sizes=(10, 5), text_bytes=20,
                                             sink_tokens=0)
    return Manifest(context_id="c", version="v", layers=1, heads=1, head_dim=4, dtype="float16", tokens=8,
                    profile_id="p", level_distortion=(1e-3, 1e-2), chunks=(chunk,), created=1.0, **extra)


def test_manifest_records_the_vocabulary_size() -> None:
    manifest = _manifest(vocab_size=50257)
    doc = json.loads(manifest.to_bytes())
    assert doc["version"] == 3 and doc["vocab_size"] == 50257
    assert Manifest.from_bytes(manifest.to_bytes()) == manifest
    assert json.loads(_manifest().to_bytes())["vocab_size"] is None
    old = {k: v for k, v in json.loads(_manifest().to_bytes()).items() if k != "vocab_size"} | {"version": 1}
    assert Manifest.from_bytes(json.dumps(old).encode()).vocab_size is None


@pytest.mark.parametrize("change, message", [
    ({"vocab_size": 0}, "vocab_size must be an int >= 1"),
    ({"vocab_size": True}, "vocab_size must be an int"),
    ({"vocab_size": "50257"}, "vocab_size must be an int"),
    ({"version": 1}, "unknown keys \\['vocab_size'\\]"),
    ({"version": 5}, "unsupported manifest version 5"),
    ({"version": True}, "unsupported manifest version True"),
])
def test_malformed_vocab_size_or_version(change: dict, message: str) -> None:
    doc = json.loads(_manifest(vocab_size=7).to_bytes()) | change
    with pytest.raises(ManifestError, match=message):
        Manifest.from_bytes(json.dumps(doc).encode())
    doc = json.loads(_manifest().to_bytes())
    del doc["vocab_size"]
    with pytest.raises(ManifestError, match="missing keys \\['vocab_size'\\]"):
        Manifest.from_bytes(json.dumps(doc).encode())


# ------------------------------------------------------------------ put and fetch
KV = synthetic_kv(3, 96, 2, 2, 8)


@pytest.fixture(scope="module")
def profile():
    import codec

    return codec.calibrate([synthetic_kv(4, 400, 2, 2, 8)])


async def test_put_context_records_and_enforces_the_vocabulary(tmp_path: Path, profile) -> None:
    ids = [999 - i for i in range(96)]
    async with await streamer.open_store(str(tmp_path)) as store:
        manifest = await put_context(store, "doc", KV, ids, profile=profile, chunk_tokens=32, levels=[2],
                                     vocab_size=1000)
        assert manifest.vocab_size == 1000 and (await store.get_manifest("doc")).vocab_size == 1000
        text = await store.get_text("doc", manifest.version, 1)
        assert decode_tokens(text, expected_tokens=32, vocab_size=1000) == ids[32:64]
        for bad, message in ((999, "token id 999 is outside the vocabulary of 999"),
                             (0, "vocab_size must be an int >= 1")):
            with pytest.raises(ValueError, match=message):
                await put_context(store, "doc", KV, ids, profile=profile, chunk_tokens=32, levels=[2],
                                  vocab_size=bad)


async def test_a_fetch_never_delivers_ids_outside_the_vocabulary(tmp_path: Path, profile) -> None:
    """A stored text payload with a valid checksum but ids >= vocab_size (a hostile or
    buggy writer: here the manifest is edited after the put) never reaches on_text: the
    fetch fails with a typed error."""
    ids = [5000 + i for i in range(96)]
    async with await streamer.open_store(str(tmp_path)) as store:
        await put_context(store, "doc", KV, ids, profile=profile, chunk_tokens=32, levels=[2])
    manifest_file = tmp_path / "contexts" / "doc" / "manifest.json"
    manifest_file.write_bytes(Manifest.from_bytes(manifest_file.read_bytes()).to_bytes()
                              .replace(b'"vocab_size":null', b'"vocab_size":1000'))
    received: list[list[int]] = []
    store = FileStore(tmp_path)
    sender = await streamer.serve(store)
    try:
        config = SessionConfig(policy="text", slo=5.0, max_reconnects=1, backoff=0.01)
        async with StreamSession("127.0.0.1", sender.port, "doc", config=config,
                                 on_layer=lambda *a: None,
                                 on_text=lambda chunk, t: received.append(list(t))) as session:
            with pytest.raises(FetchFailed) as failure:
                await session.fetch()
        assert "outside the vocabulary" in str(failure.value)
        assert all(max(t) < 1000 for t in received)
    finally:
        await sender.close()
        await store.close()


@pytest.mark.parametrize("how", ["slo", "sender_error"])
async def test_a_text_chunk_without_on_text_is_a_typed_error_not_a_silent_gap(
        tmp_path: Path, profile, how: str) -> None:
    """A chunk that must come as text (an SLO no level can meet, with recomputing far
    quicker than any level, so past the deadline text finishes first; or the sender cannot
    send its blob) while the consumer gave no ``on_text``: the fetch raises
    ``TextNotConsumed`` naming the chunk and the cause, instead of returning with the
    chunk's layers silently missing."""
    async with await streamer.open_store(str(tmp_path)) as store:
        manifest = await put_context(store, "doc", KV, IDS[:96], profile=profile, chunk_tokens=32, levels=[2])
    if how == "sender_error":   # chunk 1's blob is gone: the sender answers not_found, the session asks for text
        (tmp_path / "contexts" / "doc" / manifest.version / "chunk-1-L2.kvw").unlink()
    options = {"slo": 1e-6, "recompute_seconds_per_token": 1e-12} if how == "slo" else {"slo": 30.0, "policy": "fixed:2"}
    layers: list[tuple[int, int]] = []
    store = FileStore(tmp_path)
    sender = await streamer.serve(store)
    try:
        async with StreamSession("127.0.0.1", sender.port, "doc", on_layer=lambda c, l, k, v: layers.append((c, l)),
                                 max_reconnects=1, backoff=0.01, **options) as session:
            with pytest.raises(TextNotConsumed) as failure:
                await session.fetch()
        chunk = 0 if how == "slo" else 1
        assert f"chunk {chunk} has to come as text" in str(failure.value)
        assert "no on_text callback" in str(failure.value)
        assert ("deadline" if how == "slo" else "not_found") in str(failure.value)
        assert isinstance(failure.value, FetchFailed) and failure.value.report is not None
        assert all(c < chunk for c, _ in layers)
    finally:
        await sender.close()
        await store.close()


def test_the_model_helpers_give_and_check_the_vocabulary_size() -> None:
    import dataclasses

    from streamer.model import hf

    model, _ = hf.random_llama(layers=1, hidden=32, heads=2, kv_heads=1, vocab=300)
    assert hf.vocab_size(model) == 300
    layers, heads, head_dim = hf.kv_shape(model)
    chunk = streamer.wire.manifest.ChunkInfo(index=0, start=0, end=8, sizes=(10,), text_bytes=20,
                                             sink_tokens=0)
    manifest = Manifest(context_id="c", version="v", layers=layers, heads=heads, head_dim=head_dim,
                        dtype="float32", tokens=8, profile_id="p", level_distortion=(1e-3,),
                        chunks=(chunk,), created=1.0, vocab_size=300)
    hf.CacheAssembler(model, manifest)
    with pytest.raises(ValueError, match="vocabulary has 301 tokens, the model's 300"):
        hf.CacheAssembler(model, dataclasses.replace(manifest, vocab_size=301))
