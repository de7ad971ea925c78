"""Manifest validation and the file/redis stores (a real redis-server, never a mock)."""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamer.wire.manifest import ChunkInfo, Manifest, ManifestError, validate_context_id
from streamer.store import (ChunkNotFound, ContextNotFound, ProfileNotFound, Store, StoreError,
                            open_store)
from streamer.store.file import FileStore
from streamer.store.redis import RedisStore

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------- manifests
def _manifest(version: str = "v1", *, context_id: str = "ctx", chunk_sizes=((10, 20), (11, 21)),
              chunk_tokens: int = 8, text_sizes=None) -> Manifest:
    text_sizes = text_sizes or (5,) * len(chunk_sizes)
    chunks = tuple(ChunkInfo(index=i, start=i * chunk_tokens, end=(i + 1) * chunk_tokens, sizes=tuple(sizes),
                             text_bytes=text_sizes[i], sink_tokens=4 if i == 0 else 0)
                   for i, sizes in enumerate(chunk_sizes))
    levels = len(chunk_sizes[0])
    return Manifest(context_id=context_id, version=version, layers=2, heads=3, head_dim=4, dtype="float16",
                    tokens=chunk_tokens * len(chunks), profile_id="0123456789abcdef",
                    level_distortion=tuple(1e-3 * 4 ** level for level in range(levels)),
                    chunks=chunks, created=1700000000.5)


_ids = st.text(alphabet="abcXYZ019._-", min_size=1, max_size=40).filter(lambda s: not s.startswith("."))


@st.composite
def manifests(draw) -> Manifest:
    levels = draw(st.integers(1, 6))
    bounds = sorted(draw(st.sets(st.integers(1, 10_000), min_size=1, max_size=12)))
    chunks = []
    start = 0
    for index, end in enumerate(bounds):
        sizes = draw(st.lists(st.integers(0, 2 ** 40), min_size=levels, max_size=levels)
                     .filter(lambda s: any(s)))
        sinks = draw(st.integers(0, min(4, end - start))) if index == 0 else 0
        chunks.append(ChunkInfo(index=index, start=start, end=end, sizes=tuple(sizes),
                                text_bytes=draw(st.integers(1, 2 ** 32)), sink_tokens=sinks))
        start = end
    targets = sorted(draw(st.sets(st.floats(1e-9, 10.0), min_size=levels, max_size=levels)))
    return Manifest(context_id=draw(_ids), version=draw(_ids), layers=draw(st.integers(1, 200)),
                    heads=draw(st.integers(1, 128)), head_dim=draw(st.integers(1, 512)),
                    dtype=draw(st.sampled_from(("float16", "bfloat16", "float32"))), tokens=bounds[-1],
                    profile_id=draw(_ids), level_distortion=tuple(targets), chunks=tuple(chunks),
                    created=draw(st.floats(0, 4e9)))


@given(manifests())
def test_manifest_round_trips(manifest: Manifest) -> None:
    data = manifest.to_bytes()
    assert Manifest.from_bytes(data) == manifest
    assert Manifest.from_bytes(data).to_bytes() == data


@given(st.data())
@settings(max_examples=200)
def test_damaged_manifest_bytes_raise_manifest_error(data: st.DataObject) -> None:
    raw = bytearray(_manifest().to_bytes())
    if data.draw(st.booleans()):
        del raw[data.draw(st.integers(0, len(raw) - 1)):]
    else:
        raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
    try:
        parsed = Manifest.from_bytes(bytes(raw))
    except ManifestError:
        return
    assert isinstance(parsed, Manifest)  # a flip can leave valid JSON: then it must be consistent


def _doc() -> dict:
    return json.loads(_manifest().to_bytes())


def _set(path: str, value):
    def mutate(doc: dict) -> None:
        *parents, last = path.split(".")
        for part in parents:
            doc = doc[int(part)] if isinstance(doc, list) else doc[part]
        if isinstance(doc, list):
            doc[int(last)] = value
        else:
            doc[last] = value
    return mutate


def _drop(key: str):
    return lambda doc: doc.pop(key)


@pytest.mark.parametrize("mutate, message", [
    (_set("format", "something-else"), "not a kvwire manifest"),
    (_set("version", 5), "unsupported manifest version"),
    (_drop("tokens"), "missing keys ['tokens']"),
    (_set("surprise", 1), "unknown keys ['surprise']"),
    (_set("layers", 0), "layers must be an int >= 1"),
    (_set("heads", True), "heads must be an int"),
    (_set("head_dim", 4.0), "head_dim must be an int"),
    (_set("dtype", "int8"), "dtype must be one of"),
    (_set("context_id", "../etc"), "invalid context id"),
    (_set("context_version", ""), "invalid version"),
    (_set("profile_id", "a:b"), "invalid profile id"),
    (_set("tokens", 17), "chunks cover [0, 16) but the context has 17 tokens"),
    (_set("level_distortion", [0.1]), "2 sizes for 1 levels"),
    (_set("level_distortion", [0.1, 0.01]), "strictly increasing"),
    (_set("level_distortion", [0.1, float("nan")]), "finite"),
    (_set("level_distortion", "0.1"), "level_distortion must be a list"),
    (_set("created", -1.0), "created must be >= 0"),
    (_set("chunks", []), "at least one chunk"),
    (_set("chunks", {}), "chunks must be a list"),
    (_set("chunks.1.start", 9), "chunk 1 starts at token 9, expected 8"),
    (_set("chunks.1.index", 5), "chunks[1] has index 5"),
    (_set("chunks.1.sink_tokens", 1), "only chunk 0 may"),
    (_set("chunks.0.sink_tokens", 9), "9 sink tokens but only 8 tokens"),
    (_set("chunks.0.sizes", [10, -1]), "size at level 1 must be an int >= 0"),
    (_set("chunks.0.sizes", [0, 0]), "not stored at any level"),
    (_set("chunks.0.text_bytes", 0), "text_bytes must be an int >= 1"),
    (_set("chunks.0.end", 0), "end must be an int >= 1"),
    (_set("chunks.0", [1, 2]), "chunks[0] must be a JSON object"),
    (_set("chunks.0.extra", 1), "unknown keys ['extra']"),
])
def test_malformed_manifest_is_rejected_with_a_clear_message(mutate, message: str) -> None:
    doc = _doc()
    mutate(doc)
    with pytest.raises(ManifestError) as info:
        Manifest.from_bytes(json.dumps(doc).encode())
    assert message in str(info.value)


@pytest.mark.parametrize("data", [b"", b"\xff\xfe", b"[1, 2]", b"{", b"null", b"[" * 100_000])
def test_non_manifest_bytes_raise_manifest_error(data: bytes) -> None:
    with pytest.raises(ManifestError):
        Manifest.from_bytes(data)


def test_manifest_error_is_a_value_error() -> None:
    assert issubclass(ManifestError, ValueError)
    with pytest.raises(ValueError):
        _manifest(version="bad/version")


@pytest.mark.parametrize("context_id", ["a", "A-b_c.d", "0", "x" * 200, "chat.2024-01-01_v2"])
def test_valid_context_ids(context_id: str) -> None:
    assert validate_context_id(context_id) == context_id


@pytest.mark.parametrize("context_id", ["", ".hidden", ".", "..", "a/b", "a:b", "a b", "x" * 201,
                                        "caf\u00e9", "a\n", None, 7, b"abc"])
def test_invalid_context_ids(context_id) -> None:
    with pytest.raises(ValueError, match="invalid context id"):
        validate_context_id(context_id)


# -------------------------------------------------------------------- stores


class Version:
    """A synthetic version of a context: random blobs and texts and their manifest."""

    def __init__(self, context_id: str, version: str, seed: int, chunks: int = 3, levels: int = 2) -> None:
        rng = random.Random(seed)
        self.blobs = {(i, level): rng.randbytes(rng.randint(1, 300)) for i in range(chunks)
                      for level in range(levels)}
        self.texts = {i: rng.randbytes(rng.randint(1, 50)) for i in range(chunks)}
        self.manifest = _manifest(
            version, context_id=context_id, text_sizes=[len(self.texts[i]) for i in range(chunks)],
            chunk_sizes=[[len(self.blobs[i, level]) for level in range(levels)] for i in range(chunks)])

    async def stage(self, writer) -> None:
        for (i, level), blob in self.blobs.items():
            await writer.put_chunk(i, level, blob)
        for i, text in self.texts.items():
            await writer.put_text(i, text)


async def put_version(store: Store, context_id: str = "ctx", seed: int = 0, **kwargs) -> Version:
    async with store.writer(context_id) as writer:
        version = Version(context_id, writer.version, seed, **kwargs)
        await version.stage(writer)
        await writer.commit(version.manifest)
    return version


async def assert_readable(store: Store, version: Version) -> None:
    manifest = version.manifest
    assert await store.get_manifest(manifest.context_id) == manifest
    for (i, level), blob in version.blobs.items():
        assert await store.get_chunk(manifest.context_id, manifest.version, i, level) == blob
    for i, text in version.texts.items():
        assert await store.get_text(manifest.context_id, manifest.version, i) == text


async def assert_changes_shared(writer: Store, reader: Store, context_id: str, seed: int) -> None:
    """A re-put of ``context_id`` through ``writer`` is what ``reader`` reads, and a delete
    through ``writer`` is gone for ``reader`` too."""
    newer = await put_version(writer, context_id, seed=seed)
    await assert_readable(reader, newer)
    await writer.delete_context(context_id)
    with pytest.raises(ContextNotFound):
        await reader.get_manifest(context_id)


async def stored_items(store: Store, context_id: str, version: str) -> list[str]:
    """Whatever the backend still holds for one version (files or keys)."""
    if isinstance(store, FileStore):
        directory = store.version_dir(context_id, version)
        return sorted(os.listdir(directory)) if directory.exists() else []
    assert isinstance(store, RedisStore)
    pattern = store.version_pattern(context_id, version)
    return sorted([key.decode() async for key in store._client.scan_iter(match=pattern)])


async def test_put_get_round_trip(store: Store) -> None:
    version = await put_version(store)
    await assert_readable(store, version)
    assert await store.list_contexts() == ["ctx"]


async def test_profile_round_trip(store: Store, codec_profile) -> None:
    import codec

    await store.put_profile(codec_profile)
    await store.put_profile(codec_profile)  # idempotent
    data = await store.get_profile_bytes(codec_profile.id)
    assert data == codec_profile.to_bytes()
    assert codec.Profile.from_bytes(data).id == codec_profile.id


async def test_not_found_errors_name_the_id(store: Store) -> None:
    with pytest.raises(ContextNotFound, match="'nope'"):
        await store.get_manifest("nope")
    with pytest.raises(ProfileNotFound, match="'feedface00000000'"):
        await store.get_profile_bytes("feedface00000000")
    with pytest.raises(ContextNotFound, match="'nope'"):
        await store.delete_context("nope")
    version = await put_version(store)
    with pytest.raises(ChunkNotFound, match="chunk 7 level 0 of context 'ctx'"):
        await store.get_chunk("ctx", version.manifest.version, 7, 0)
    with pytest.raises(ChunkNotFound, match="text of chunk 0 of context 'ctx' version 'zzz'"):
        await store.get_text("ctx", "zzz", 0)
    assert issubclass(ChunkNotFound, StoreError) and issubclass(ContextNotFound, StoreError)


async def test_sizes_are_the_lengths_read_and_missing_items_are_not_found(store: Store, codec_profile) -> None:
    """``chunk_size`` / ``text_size`` / ``profile_size`` (asked before a bounded read)
    agree with what the getters return, and raise the getters' not-found errors."""
    version = await put_version(store)
    context_id, name = version.manifest.context_id, version.manifest.version
    for (i, level), blob in version.blobs.items():
        assert await store.chunk_size(context_id, name, i, level) == len(blob)
    for i, text in version.texts.items():
        assert await store.text_size(context_id, name, i) == len(text)
    await store.put_profile(codec_profile)
    assert await store.profile_size(codec_profile.id) == len(codec_profile.to_bytes())
    with pytest.raises(ChunkNotFound, match="chunk 7 level 0 of context 'ctx'"):
        await store.chunk_size(context_id, name, 7, 0)
    with pytest.raises(ChunkNotFound, match="text of chunk 0 of context 'ctx' version 'zzz'"):
        await store.text_size(context_id, "zzz", 0)
    with pytest.raises(ProfileNotFound, match="'feedface00000000'"):
        await store.profile_size("feedface00000000")
    with pytest.raises(ValueError, match="invalid version"):
        await store.chunk_size(context_id, "../../x", 0, 0)


async def test_ids_and_indices_are_validated(store: Store) -> None:
    with pytest.raises(ValueError, match="invalid context id"):
        await store.get_manifest("../escape")
    with pytest.raises(ValueError, match="invalid context id"):
        store.writer("a/b")
    with pytest.raises(ValueError, match="invalid version"):
        await store.get_chunk("ctx", "../../x", 0, 0)
    with pytest.raises(ValueError, match="chunk must be an int >= 0"):
        await store.get_text("ctx", "v", -1)
    with pytest.raises(ValueError, match="invalid profile id"):
        await store.get_profile_bytes("../p")


async def test_exception_inside_writer_keeps_previous_version(store: Store) -> None:
    old = await put_version(store, seed=1)
    with pytest.raises(RuntimeError, match="boom"):
        async with store.writer("ctx") as writer:
            await Version("ctx", writer.version, seed=2).stage(writer)
            raise RuntimeError("boom")
    await assert_readable(store, old)
    assert await stored_items(store, "ctx", writer.version) == []


async def test_leaving_without_commit_discards(store: Store) -> None:
    async with store.writer("fresh") as writer:
        await Version("fresh", writer.version, seed=3).stage(writer)
    assert await store.list_contexts() == []
    assert await stored_items(store, "fresh", writer.version) == []


async def test_reput_replaces_and_removes_the_old_version(store: Store) -> None:
    old = await put_version(store, seed=1)
    new = await put_version(store, seed=2, chunks=2, levels=3)
    await assert_readable(store, new)
    with pytest.raises(ChunkNotFound):
        await store.get_chunk("ctx", old.manifest.version, 0, 0)
    assert await stored_items(store, "ctx", old.manifest.version) == []
    assert await store.list_contexts() == ["ctx"]


async def test_commit_checks_the_staged_data(store: Store) -> None:
    old = await put_version(store, seed=1)
    async with store.writer("ctx") as writer:
        version = Version("ctx", writer.version, seed=2)
        await version.stage(writer)
        await writer.put_chunk(9, 0, b"not in the manifest")
        with pytest.raises(StoreError, match=r"not in the manifest \[\(9, 0\)\]"):
            await writer.commit(version.manifest)
        with pytest.raises(StoreError, match="this writer stages"):
            await writer.commit(old.manifest)
    await assert_readable(store, old)
    async with store.writer("ctx") as writer:
        version = Version("ctx", writer.version, seed=2)
        await version.stage(writer)
        await writer.put_chunk(0, 0, b"x")  # a different size than the manifest says
        with pytest.raises(StoreError, match=r"wrong size \[\(0, 0\)\]"):
            await writer.commit(version.manifest)
    await assert_readable(store, old)


async def test_writer_is_single_use(store: Store) -> None:
    writer = store.writer("ctx")
    with pytest.raises(StoreError, match="not open"):
        await writer.put_text(0, b"early")
    async with writer:
        version = Version("ctx", writer.version, seed=1)
        await version.stage(writer)
        await writer.commit(version.manifest)
        with pytest.raises(StoreError, match="committed"):
            await writer.put_chunk(0, 0, b"late")
        with pytest.raises(StoreError, match="committed"):
            await writer.commit(version.manifest)
    with pytest.raises(StoreError, match="only once"):
        async with writer:
            pass
    await assert_readable(store, version)  # the committed data survived leaving the block


async def test_delete_context(store: Store) -> None:
    version = await put_version(store)
    other = await put_version(store, "other", seed=5)
    await store.delete_context("ctx")
    assert await store.list_contexts() == ["other"]
    with pytest.raises(ContextNotFound):
        await store.get_manifest("ctx")
    assert await stored_items(store, "ctx", version.manifest.version) == []
    await assert_readable(store, other)
    await assert_readable(store, await put_version(store, seed=6))  # the id can be reused


async def test_live_writer_survives_other_commits_and_gc(store: Store) -> None:
    async with store.writer("ctx") as slow:
        slow_version = Version("ctx", slow.version, seed=1)
        await slow_version.stage(slow)
        await put_version(store, seed=2)  # a faster put of the same context commits first
        await store.gc()
        assert len(await stored_items(store, "ctx", slow.version)) == len(slow_version.blobs) + 3
        await slow.commit(slow_version.manifest)
    await assert_readable(store, slow_version)
    assert await store.gc() == 0


async def test_concurrent_readers_while_reputs_commit(store_url: str) -> None:
    """Readers see one whole version or ChunkNotFound for a superseded one, never a mix."""
    async with await open_store(store_url) as writer_store, await open_store(store_url) as reader_store:
        versions = {}
        first = await put_version(writer_store, seed=0)
        versions[first.manifest.version] = first
        done = asyncio.Event()
        reads = 0

        async def reader() -> None:
            nonlocal reads
            while not done.is_set():
                manifest = await reader_store.get_manifest("ctx")
                expected = versions[manifest.version]
                try:
                    for (i, level), blob in expected.blobs.items():
                        assert await reader_store.get_chunk("ctx", manifest.version, i, level) == blob
                        reads += 1
                except ChunkNotFound:
                    assert (await reader_store.get_manifest("ctx")).version != manifest.version

        async def writer() -> None:
            for seed in range(1, 8):
                async with writer_store.writer("ctx") as w:
                    version = Version("ctx", w.version, seed)
                    versions[w.version] = version  # known before any reader can see it
                    await version.stage(w)
                    await w.commit(version.manifest)
                await asyncio.sleep(0.005)
            done.set()

        await asyncio.wait_for(asyncio.gather(writer(), *(reader() for _ in range(4))), timeout=30)
        assert reads > 0
        await assert_readable(reader_store, versions[(await reader_store.get_manifest("ctx")).version])


@pytest.mark.redis
async def test_two_redis_stores_share_contexts(redis_store_url: str) -> None:
    async with await open_store(redis_store_url) as a, await open_store(redis_store_url) as b:
        version = await put_version(a, "shared", seed=1)
        assert await b.list_contexts() == ["shared"]
        await assert_readable(b, version)
        await assert_changes_shared(b, a, "shared", seed=2)


@pytest.mark.redis
async def test_redis_prefixes_isolate_stores(redis_store_url: str) -> None:
    other_url = redis_store_url.replace("prefix=test-", "prefix=test-other-")
    async with await open_store(redis_store_url) as a, await open_store(other_url) as b:
        try:
            await put_version(a, "mine")
            assert await b.list_contexts() == []
        finally:
            await a.delete_context("mine")


# ------------------------------------------------------------ crash recovery
_CRASHING_PUT = """
import asyncio, sys
from streamer.store import open_store

async def main(url, context_id):
    store = await open_store(url)
    async with store.writer(context_id) as writer:
        for i in range(3):
            await writer.put_chunk(i, 0, b"x" * 100)
        print(writer.version, flush=True)
        await asyncio.sleep(60)  # killed here, mid-put

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def _crash_mid_put(url: str, context_id: str) -> str:
    """Run a put in a subprocess, SIGKILL it after it staged some chunks; its version."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-c", _CRASHING_PUT, url, context_id], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        version = proc.stdout.readline().strip()
        assert version, proc.stderr.read()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        proc.stdout.close()
        proc.stderr.close()
    return version


async def test_killed_put_leaves_previous_version_readable(store_url: str) -> None:
    async with await open_store(store_url) as store:
        old = await put_version(store, seed=1)
        crashed = await asyncio.to_thread(_crash_mid_put, store_url, "ctx")
        await assert_readable(store, old)
        assert len(await stored_items(store, "ctx", crashed)) >= 3
        if isinstance(store, RedisStore):  # staged keys expire by themselves; gc leaves them
            ttls = [await store._client.ttl(key) for key in await stored_items(store, "ctx", crashed)]
            assert all(ttl > 0 for ttl in ttls)
            assert await store.gc() == 0
        else:  # the dead writer's lock is free: the next commit sweeps its directory
            new = await put_version(store, seed=2)
            assert await stored_items(store, "ctx", crashed) == []
            await assert_readable(store, new)


async def test_gc_removes_a_killed_first_put(tmp_path: Path) -> None:
    async with await open_store(str(tmp_path / "store")) as store:
        crashed = await asyncio.to_thread(_crash_mid_put, store.url, "never-committed")
        assert await store.list_contexts() == []
        assert len(await stored_items(store, "never-committed", crashed)) >= 3
        assert await store.gc() == 1
        assert not (tmp_path / "store" / "contexts" / "never-committed").exists()


# ------------------------------------------------------------------ open_store
async def test_open_store_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    relative = await open_store("rel/store")
    assert isinstance(relative, FileStore) and relative.url == (tmp_path / "rel" / "store").as_uri()
    absolute = await open_store((tmp_path / "abs").as_uri())
    assert isinstance(absolute, FileStore) and absolute.root == tmp_path / "abs"
    with pytest.raises(ValueError, match=r"supported: file:///abs/path.*redis://"):
        await open_store("s3://bucket/x")
    with pytest.raises(ValueError, match="local directories only"):
        await open_store("file://otherhost/x")
    (tmp_path / "plain-file").write_bytes(b"")
    with pytest.raises(StoreError, match="not a directory"):
        await open_store(str(tmp_path / "plain-file"))


def closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_unreachable_redis_fails_fast_naming_the_url() -> None:
    url = f"redis://:hunter2@127.0.0.1:{closed_port()}/3"
    started = time.monotonic()
    with pytest.raises(StoreError, match=r"cannot reach redis store redis://:\*\*\*@127\.0\.0\.1") as info:
        await open_store(url)
    assert "hunter2" not in str(info.value)
    assert time.monotonic() - started < 10


@pytest.mark.redis
async def test_redis_key_prefix_must_be_safe(redis_url: str) -> None:
    sep = "&" if "?" in redis_url else "?"
    with pytest.raises(ValueError, match="invalid redis key prefix"):
        await open_store(f"{redis_url}{sep}prefix=a:b")
