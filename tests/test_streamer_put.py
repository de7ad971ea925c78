"""put_context, the text fallback and the ``kvwire put`` CLI, against both stores."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

import codec
from streamer.tools import put as put_cli
from streamer.store.put import decode_tokens, encode_tokens, put_context
from streamer.store import ChunkNotFound, ContextNotFound, Store, open_store

TOKENS = 100
CHUNK = 32


@pytest.fixture(scope="module")
def small_kv(codec_make_kv) -> torch.Tensor:
    """2 layers, 2 heads, head_dim 8, 100 tokens of the correlated synthetic model."""
    return codec_make_kv(3, layers=2, tokens=TOKENS, heads=2, head_dim=8)


@pytest.fixture(scope="module")
def small_profile(codec_make_kv) -> codec.Profile:
    return codec.calibrate([codec_make_kv(4, layers=2, tokens=400, heads=2, head_dim=8)])




async def test_put_context_decodes_back_chunk_by_chunk(store: Store, small_kv, codec_distortion) -> None:
    ids = list(range(1000, 1000 + TOKENS))
    manifest = await put_context(store, "doc-1", small_kv, ids, chunk_tokens=CHUNK)
    assert await store.get_manifest("doc-1") == manifest
    assert (manifest.layers, manifest.heads, manifest.head_dim, manifest.tokens) == (2, 2, 8, TOKENS)
    assert manifest.dtype == "float32"
    assert [(c.start, c.end) for c in manifest.chunks] == [(0, 32), (32, 64), (64, 96), (96, 100)]
    assert [c.sink_tokens for c in manifest.chunks] == [4, 0, 0, 0]
    profile = codec.Profile.from_bytes(await store.get_profile_bytes(manifest.profile_id))
    assert manifest.level_distortion == profile.targets
    assembled = torch.empty((len(profile.targets), *small_kv.shape))
    for chunk in manifest.chunks:
        original = small_kv[:, :, chunk.start:chunk.end]
        assert chunk.levels() == tuple(range(len(profile.targets)))
        for level in chunk.levels():
            blob = await store.get_chunk("doc-1", manifest.version, chunk.index, level)
            assert len(blob) == chunk.sizes[level]
            decoded = codec.decode(blob, profile)
            assert decoded.shape == original.shape and decoded.dtype == original.dtype
            assembled[level, :, :, chunk.start:chunk.end] = decoded
        if chunk.sink_tokens:
            assert torch.equal(decoded[:, :, :chunk.sink_tokens], original[:, :, :chunk.sink_tokens])
        text = await store.get_text("doc-1", manifest.version, chunk.index)
        assert len(text) == chunk.text_bytes
        assert decode_tokens(text) == ids[chunk.start:chunk.end]
    for level, target in enumerate(profile.targets):  # a profile fitted on this very context
        assert codec_distortion(small_kv, assembled[level], sinks=4) < 2 * target


async def test_put_context_with_a_profile_and_some_levels(store: Store, small_kv, small_profile) -> None:
    kv = small_kv.to(torch.float16)
    manifest = await put_context(store, "doc-2", kv, torch.arange(TOKENS), profile=small_profile,
                                 chunk_tokens=64, levels=[3, 1])
    assert manifest.profile_id == small_profile.id and manifest.dtype == "float16"
    assert await store.get_profile_bytes(small_profile.id) == small_profile.to_bytes()
    for chunk in manifest.chunks:
        assert chunk.levels() == (1, 3)
        assert chunk.sizes[0] == chunk.sizes[2] == chunk.sizes[4] == 0
        blob = await store.get_chunk("doc-2", manifest.version, chunk.index, 3)
        assert codec.inspect(blob)["level"] == 3
        assert codec.decode(blob, small_profile).dtype == torch.float16
    with pytest.raises(ChunkNotFound):
        await store.get_chunk("doc-2", manifest.version, 0, 0)


async def test_put_context_replaces_the_previous_version(store: Store, small_kv, small_profile) -> None:
    first = await put_context(store, "doc", small_kv, [1] * TOKENS, profile=small_profile, levels=[0])
    second = await put_context(store, "doc", small_kv, [2] * TOKENS, profile=small_profile, levels=[0],
                               chunk_tokens=50)
    assert first.version != second.version
    assert len(second.chunks) == 2 and (await store.get_manifest("doc")) == second
    with pytest.raises(ChunkNotFound):
        await store.get_text("doc", first.version, 0)


@pytest.mark.parametrize("kwargs, message", [
    ({"kv": torch.zeros(2, 2, 10, 4)}, "kv must have shape"),
    ({"token_ids": list(range(TOKENS - 1))}, "flat sequence of 100 ids"),
    ({"token_ids": [[1]] * TOKENS}, "flat sequence"),
    ({"token_ids": [0.5] * TOKENS}, "must be integers"),
    ({"token_ids": [-1] * TOKENS}, r"in \[0, 2\*\*32\)"),
    ({"chunk_tokens": 0}, "chunk_tokens must be an int >= 1"),
    ({"chunk_tokens": True}, "chunk_tokens must be an int >= 1"),
    ({"levels": [9]}, r"level must be an int in \[0, 4\]"),
    ({"levels": []}, "at least one quality level"),
    ({"context_id": "no/slashes"}, "invalid context id"),
])
async def test_put_context_validates_its_input(store: Store, small_kv, small_profile, kwargs, message) -> None:
    args = {"context_id": "doc", "kv": small_kv, "token_ids": list(range(TOKENS))} | kwargs
    options = {k: args.pop(k) for k in ("chunk_tokens", "levels") if k in args}
    with pytest.raises(ValueError, match=message):
        await put_context(store, args["context_id"], args["kv"], args["token_ids"], profile=small_profile,
                          **options)
    assert await store.list_contexts() == []


async def test_put_context_rejects_a_profile_of_another_shape(store: Store, small_kv, codec_profile) -> None:
    with pytest.raises(ValueError, match="does not match profile"):
        await put_context(store, "doc", small_kv, list(range(TOKENS)), profile=codec_profile)


async def test_failure_midway_keeps_the_previous_version(store: Store, small_kv, small_profile,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    old = await put_context(store, "doc", small_kv, list(range(TOKENS)), profile=small_profile,
                            chunk_tokens=CHUNK, levels=[2])
    real_encode = codec.encode_levels
    encoded = []

    def failing_encode(kv, levels, profile, *, sink_tokens=None, start=0):
        if len(encoded) >= 2:
            raise RuntimeError("encoder died")
        encoded.append(start)
        return real_encode(kv, levels, profile, sink_tokens=sink_tokens, start=start)

    monkeypatch.setattr(codec, "encode_levels", failing_encode)
    with pytest.raises(RuntimeError, match="encoder died"):
        await put_context(store, "doc", small_kv, list(range(TOKENS)), profile=small_profile,
                          chunk_tokens=CHUNK, levels=[2])
    assert await store.get_manifest("doc") == old
    for chunk in old.chunks:
        blob = await store.get_chunk("doc", old.version, chunk.index, 2)
        assert codec.decode(blob, small_profile).shape[2] == chunk.tokens
    assert await store.gc() == 0  # nothing was left behind


async def test_a_failed_chunk_leaves_no_sibling_writing_after_put_context_raises(
        store: Store, small_kv, small_profile, monkeypatch: pytest.MonkeyPatch) -> None:
    """One chunk's encode fails while another chunk is still encoding: put_context must
    stop that sibling before it returns, so nothing it encodes is written afterwards. A
    sibling left running wrote its blob after the failed put had discarded its staging
    directory (found as leftover files in the disk-full fault test)."""
    import asyncio
    import os
    import threading

    real_encode = codec.encode_levels
    release, finished = threading.Event(), threading.Event()

    def encode_levels(kv, levels, profile, *, sink_tokens=None, start=0):
        if start > 0:
            raise RuntimeError("encoder died")
        release.wait(10)   # chunk 0 is still encoding when chunk 1 fails
        try:
            return real_encode(kv, levels, profile, sink_tokens=sink_tokens, start=start)
        finally:
            finished.set()

    monkeypatch.setattr(codec, "encode_levels", encode_levels)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)  # two chunks encode at once
    try:
        with pytest.raises(RuntimeError, match="encoder died"):
            await put_context(store, "doc", small_kv[:, :, :2 * CHUNK], list(range(2 * CHUNK)),
                              profile=small_profile, chunk_tokens=CHUNK, levels=[0, 1])
        running = [t for t in asyncio.all_tasks() if not t.done() and t is not asyncio.current_task()
                   and "_gather_bounded" in t.get_coro().__qualname__]
        assert not running, running
    finally:
        release.set()
    assert await asyncio.to_thread(finished.wait, 10)
    await asyncio.sleep(0.05)
    with pytest.raises(ContextNotFound):
        await store.get_manifest("doc")
    assert await store.gc() == 0  # the sibling's blobs were never written


def test_text_fallback_round_trip_and_errors() -> None:
    ids = [0, 1, 2 ** 32 - 1, 50256, 7]
    data = encode_tokens(ids)
    assert decode_tokens(data) == ids
    assert decode_tokens(data, expected_tokens=5) == ids
    with pytest.raises(ValueError, match="not a kvwire text payload"):
        decode_tokens(b"garbage, long enough to hold a header")
    with pytest.raises(ValueError, match="holds 5 token ids, the chunk has 4"):
        decode_tokens(data, expected_tokens=4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        decode_tokens(data, vocab_size=50257)   # hostile payloads: tests/test_text_fallback.py


# ------------------------------------------------------------------------ CLI
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvwire")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench").add_subparsers(dest="bench")
    put_cli.register(sub, bench)
    return parser


def _run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    return args.handler(args)


@pytest.fixture
def kv_file(tmp_path: Path, small_kv) -> Path:
    from safetensors.torch import save_file

    path = tmp_path / "kv.safetensors"
    save_file({"kv": small_kv.to(torch.float16)}, str(path))
    return path


@pytest.mark.parametrize("tokens_format", ["json", "text"])
async def test_cli_put(store_url: str, tmp_path: Path, kv_file: Path, small_profile, capsys,
                       tokens_format: str) -> None:
    ids = list(range(5, 5 + TOKENS))
    if tokens_format == "json":
        tokens = tmp_path / "ids.json"
        tokens.write_text(json.dumps(ids))
    else:
        tokens = tmp_path / "ids.txt"
        tokens.write_text(", ".join(map(str, ids[:50])) + "\n" + " ".join(map(str, ids[50:])))
    profile_path = tmp_path / "model.kvprofile"
    small_profile.save(profile_path)
    argv = ["put", "--store", store_url, "--context", "cli-doc", "--kv", str(kv_file),
            "--tokens", str(tokens), "--profile", str(profile_path), "--chunk-tokens", "40"]
    # the handler runs its own event loop, as it does under the console script
    import asyncio

    assert await asyncio.to_thread(_run, argv) == 0
    out = capsys.readouterr().out
    assert "3 chunks" in out and "level 4" in out and "smaller than fp16" in out
    async with await open_store(store_url) as store:
        manifest = await store.get_manifest("cli-doc")
        assert manifest.profile_id == small_profile.id and manifest.dtype == "float16"
        assert decode_tokens(await store.get_text("cli-doc", manifest.version, 2)) == ids[80:]
        assert not manifest.exact
    assert await asyncio.to_thread(_run, argv + ["--exact"]) == 0
    out = capsys.readouterr().out
    assert "level 0 (exact)" in out and "level 5 (distortion" in out
    async with await open_store(store_url) as store:
        manifest = await store.get_manifest("cli-doc")
        assert manifest.exact and manifest.levels == 1 + len(small_profile.targets)


def test_cli_put_errors(tmp_path: Path, kv_file: Path, capsys) -> None:
    from safetensors.torch import save_file

    wrong = tmp_path / "wrong.safetensors"
    save_file({"keys": torch.zeros(1), "values": torch.zeros(1)}, str(wrong))
    tokens = tmp_path / "ids.txt"
    tokens.write_text(" ".join(map(str, range(TOKENS))))
    store = str(tmp_path / "store")
    base = ["put", "--store", store, "--context", "doc", "--tokens", str(tokens)]
    assert _run(base + ["--kv", str(wrong)]) == 1
    assert "no 'kv' tensor; it holds ['keys', 'values']" in capsys.readouterr().err
    tokens.write_text("1 2 three")
    assert _run(base + ["--kv", str(kv_file)]) == 1
    assert "expected whitespace/comma-separated ints" in capsys.readouterr().err
    tokens.write_text(" ".join(map(str, range(TOKENS))))
    assert _run(["put", "--store", "ftp://x/y", "--context", "doc", "--kv", str(kv_file),
                 "--tokens", str(tokens)]) == 1
    assert "unsupported store URL scheme 'ftp'" in capsys.readouterr().err


async def test_nothing_is_committed_when_the_profile_is_unusable(tmp_path: Path, small_kv) -> None:
    async with await open_store(str(tmp_path / "store")) as store:
        with pytest.raises(ValueError, match="sink tokens"):
            await put_context(store, "doc", small_kv[:, :, :3], [1, 2, 3])
        with pytest.raises(ContextNotFound):
            await store.get_manifest("doc")
