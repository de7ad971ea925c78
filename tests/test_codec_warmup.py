"""codec.warm_up: after it, nothing on the encode or decode paths compiles a numba kernel.

Checked with numba's dispatcher introspection (specializations in memory, cache hits and
misses), never with timings. The subprocess test points NUMBA_CACHE_DIR at a fresh
directory: the first process compiles and writes the cache, the second only loads it.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import codec
import streamer
from codec import container, rans, warmup
from codec.synthetic import synthetic_kv
from streamer_helpers import put_context_now

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def warm() -> warmup.WarmupResult:
    codec.warm_up()
    result = warmup.last_result()
    assert result is not None
    return result


@pytest.fixture(scope="module")
def realistic():
    """A profile fitted the way a real one is (all five levels), and a fresh draw of KV."""
    profile = codec.calibrate([synthetic_kv(4, 4, 16, 600, seed=1)])
    kv = synthetic_kv(4, 4, 16, 300, seed=2)
    return profile, kv


def test_the_warm_up_codes_its_data_without_a_misfit_warning() -> None:
    """Its data is coded, not stored raw: every daemon start-up and session would
    otherwise print a ProfileMismatchWarning, and the coded paths would go unexercised."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", codec.errors.ProfileMismatchWarning)
        warmup._exercise()


def test_warm_up_returns_seconds_and_is_idempotent(warm: warmup.WarmupResult) -> None:
    stats = warmup.cache_stats()
    seconds = codec.warm_up()
    assert isinstance(seconds, float) and seconds >= 0.0
    assert warmup.last_result() is warm          # the work ran once per process
    assert warmup.cache_stats() == stats         # and the second call touched no kernel
    assert isinstance(warm.seconds, float) and warm.seconds > 0.0


def test_warm_up_leaves_one_specialization_per_kernel(warm: warmup.WarmupResult) -> None:
    """The codec fixes the argument types (C-ordered plan rows, read-only lane words), so
    the warm-up has one specialization per kernel to compile or load."""
    for name in warmup.KERNELS:
        assert len(warmup.kernel(name).signatures) == 1, name
    assert not rans.decode_lanes.signatures[0][0].mutable


def test_warm_up_is_not_run_on_import() -> None:
    code = ("import codec, streamer\nfrom codec import warmup\n"
            "assert warmup.last_result() is None\n"
            "assert all(s['signatures'] == 0 for s in warmup.cache_stats().values())\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_codec_paths_compile_nothing_after_warm_up(warm: warmup.WarmupResult, realistic) -> None:
    profile, kv = realistic
    received = codec.Profile.from_bytes(profile.to_bytes())   # what a receiver decodes with
    before = warmup.cache_stats()
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for level in range(len(profile.levels)):
            for sinks in (None, 0):
                blob = codec.encode(kv.to(dtype), level, profile, sink_tokens=sinks)
                header = codec.parse_header(blob)
                for layer in range(header.layers):
                    section = bytes(container.section(blob, header, layer))
                    codec.decode_section(header, received, layer, section)
                    codec.decode_section(header, received, layer, bytearray(section))
                    codec.decode_section(header, received, layer, memoryview(bytearray(section)))
                assert codec.decode(blob, received).dtype == dtype
                assert codec.decode(bytearray(blob), received).dtype == dtype
                for _ in codec.decode_layers(blob, received):
                    pass
    for level in range(len(codec.DEFAULT_TARGETS)):  # blobs carrying their own profile
        codec.decode(codec.encode(kv, level))
        codec.encode(kv, level, received)                # a loaded profile's arrays are read-only
    predicting = codec.calibrate([synthetic_kv(4, 4, 16, 600, seed=1)], predict=2)
    for level in range(len(predicting.levels)):
        for dtype in (torch.float16, torch.bfloat16):
            codec.decode(codec.encode(kv.to(dtype), level, predicting), predicting)
    assert warmup.cache_stats() == before


def test_a_streamed_fetch_compiles_nothing_after_warm_up(warm: warmup.WarmupResult, realistic,
                                                         tmp_path: Path) -> None:
    profile, kv = realistic
    kv = kv.to(torch.float16)
    tokens = kv.shape[2]
    put_context_now(str(tmp_path), "ctx", kv, list(range(tokens)), profile=profile, chunk_tokens=100)
    before = warmup.cache_stats()
    layers: list[tuple[int, int]] = []

    for level in range(len(profile.levels)):
        async def fixed(level: int = level) -> streamer.FetchReport:
            store = await streamer.open_store(str(tmp_path))
            sender = await streamer.serve(store)
            try:
                async with streamer.StreamSession("127.0.0.1", sender.port, "ctx", slo=30.0,
                                                  policy=f"fixed:{level}",
                                                  on_layer=lambda c, l, k, v: layers.append((c, l))) as session:
                    return await session.fetch()
            finally:
                await sender.close()
                await store.close()

        report = asyncio.run(fixed())
        assert [c.level for c in report.chunks] == [level] * 3
    assert len(layers) == 5 * 3 * kv.shape[0]
    assert warmup.cache_stats() == before


_CHILD = """
import dataclasses, json
import codec
from codec import warmup
codec.warm_up()
print(json.dumps(dataclasses.asdict(warmup.last_result())))
"""


def _cache_files(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_mtime_ns for p in directory.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_first_process_compiles_into_the_cache_and_the_next_loads_it(tmp_path: Path) -> None:
    cache = tmp_path / "numba-cache"
    cache.mkdir()
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}

    def child() -> dict:
        done = subprocess.run([sys.executable, "-c", _CHILD], env=env, cwd=ROOT, capture_output=True,
                              text=True, timeout=300, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    first = child()
    files = _cache_files(cache)
    assert first["compiled"] == len(warmup.KERNELS) and first["loaded"] == 0
    index = [f for f in files if f.endswith(".nbi")]
    assert {Path(f).name.split("-")[0] for f in index} == set(warmup.KERNELS)
    second = child()
    assert second == {**second, "compiled": 0, "loaded": first["compiled"]}
    assert _cache_files(cache) == files   # nothing written: every kernel came from the cache
