"""The receiver's local cache on its own: quality semantics, LRU-by-bytes eviction,
atomic persistence and rebuilding the index from a directory after a crash."""
from __future__ import annotations

import os
import time

import pytest
import torch
from safetensors.torch import load_file

from streamer.receiver.cache import ContextCache, Entry, Quality, serialize


def _entry(cid: str, levels=(1, 1), recomputed=()) -> Entry:
    return Entry(context_id=cid, version="v1", quality=Quality(levels=list(levels), recomputed=list(recomputed)),
                 text=[], report={"slo": 1.0}, shape=[1, 2, 256, 1, 8], dtype="float32",
                 created=1_764_536_000.25)  # fixed: the float's repr length changes the serialized size


def _tensors(fill: float = 1.0) -> dict:
    return {"kv": torch.full((1, 2, 256, 1, 8), fill), "text_ranges": torch.zeros(0, 2, dtype=torch.int64),
            "text_token_ids": torch.zeros(0, dtype=torch.int64)}


def test_quality_worst_level_and_what_it_satisfies() -> None:
    q = Quality(levels=[0, 2, 1])
    assert q.worst_level == 2 and q.complete and q.satisfies(None) and q.satisfies(2) and not q.satisfies(1)
    text = Quality(levels=[1, "text", 3], recomputed=[])
    assert text.text_chunks == [1] and not text.complete and text.worst_level == 3
    recomputed = Quality(levels=["text", 1], recomputed=[0])
    assert recomputed.complete and recomputed.worst_level == 1 and recomputed.satisfies(1)
    assert Quality(levels=["text", "text"]).worst_level is None  # nothing lossy: any floor is met
    assert Quality(levels=["text"]).satisfies(0)


async def test_lru_by_bytes_in_memory() -> None:
    evicted = []
    cache = ContextCache(max_bytes=0, on_evict=evicted.append)
    kept, _ = await cache.put(_entry("x"), _tensors())
    assert not kept and len(cache) == 0  # larger than the whole cache
    size = len(serialize(_entry("x"), _tensors()))
    cache = ContextCache(max_bytes=int(2.5 * size), on_evict=evicted.append)
    for cid in "ab":
        assert (await cache.put(_entry(cid), _tensors()))[0]
    assert cache.get("a") is not None  # "a" is now the most recently used
    kept, gone = await cache.put(_entry("c"), _tensors())
    assert kept and [e.context_id for e in gone] == ["b"] and [e.context_id for e in evicted] == ["b"]
    assert [e.context_id for e in cache.entries()] == ["a", "c"] and cache.total_bytes == 2 * size
    # replacing an entry does not count it twice
    await cache.put(_entry("a", levels=(0, 0)), _tensors(2.0))
    assert len(cache) == 2 and cache.total_bytes == 2 * size and cache.peek("a").quality.worst_level == 0


async def test_directory_entries_survive_a_restart_and_crash_leftovers_go(tmp_path) -> None:
    cache = ContextCache(max_bytes=1 << 30, directory=tmp_path)
    assert cache.load() == 0
    for cid, fill in (("old", 1.0), ("new", 2.0)):
        await cache.put(_entry(cid, levels=("text", 2), recomputed=[0] if cid == "new" else []), _tensors(fill))
    os.utime(tmp_path / "old.safetensors", (time.time() - 100, time.time() - 100))
    (tmp_path / ".tmp-0123-half.safetensors").write_bytes(b"partial")  # a crash mid-write
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors")
    assert load_file(str(tmp_path / "new.safetensors"))["kv"][0, 0, 0, 0, 0] == 2.0
    again = ContextCache(max_bytes=1 << 30, directory=tmp_path)
    assert again.load() == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.safetensors", "old.safetensors"]
    assert [e.context_id for e in again.entries()] == ["old", "new"]  # LRU order from the mtimes
    new = again.peek("new")
    assert new.quality.recomputed == [0] and new.quality.complete and new.report == {"slo": 1.0}
    assert new.path == tmp_path / "new.safetensors" and new.data is None
    # a smaller budget at start evicts the least recently used files
    small = ContextCache(max_bytes=new.nbytes, directory=tmp_path)
    assert small.load() == 1 and small.peek("new") is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.safetensors"]


def test_negative_budget_is_refused() -> None:
    with pytest.raises(ValueError):
        ContextCache(max_bytes=-1)
