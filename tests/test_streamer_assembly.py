"""Assembly: a chunk's answer cut into its header and layer sections however the parts
split it, holding nothing once every section is cut."""
from __future__ import annotations

import asyncio
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import codec
import streamer
from codec.container import section
from streamer.net.assembly import Assembly
from streamer_helpers import put_context_now, synthetic_kv

LAYERS, HEADS, HEAD_DIM, TOKENS = 3, 2, 16, 64


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> tuple[streamer.Manifest, bytes]:
    root = str(tmp_path_factory.mktemp("assembly-store"))
    profile = codec.calibrate([synthetic_kv(1, 256, LAYERS, HEADS, HEAD_DIM)])
    manifest = put_context_now(root, "ctx", synthetic_kv(2, TOKENS, LAYERS, HEADS, HEAD_DIM),
                               list(range(TOKENS)), profile=profile, chunk_tokens=TOKENS)

    async def blob() -> bytes:
        store = await streamer.open_store(root)
        try:
            return await store.get_chunk("ctx", manifest.version, 0, 0)
        finally:
            await store.close()

    return manifest, asyncio.run(blob())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(min_value=0, max_value=1 << 20), max_size=12))
def test_any_split_gives_the_blobs_sections_and_leaves_nothing_held(stored, cuts: list[int]) -> None:
    manifest, blob = stored
    header = codec.parse_header(blob)
    bounds = sorted({0, len(blob), *(cut % len(blob) for cut in cuts)})
    sections: list[tuple[int, bytes]] = []
    tracemalloc.start()
    try:
        assembly = Assembly(manifest, 0, 0, len(blob))
        for start, end in zip(bounds, bounds[1:]):
            sections += assembly.add(blob[start:end])
            assert assembly.buffered <= len(blob)
        assert sections == [(layer, bytes(section(blob, header, layer))) for layer in range(LAYERS)]
        sections.clear()
        # every section cut: the answer's bytes are not kept (they were, outside the
        # budget, for the rest of the fetch)
        assert assembly.buffered == 0
        assert tracemalloc.get_traced_memory()[0] < len(blob) // 4
    finally:
        tracemalloc.stop()
