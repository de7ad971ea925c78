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

LAYERS, HEADS, HEAD_DIM, TOKENS = 3, 2, 16, 256


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
    Assembly(manifest, 0, 0, len(blob)).add(blob)   # first-call caches are not what an answer holds
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


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first_layer=st.integers(min_value=1, max_value=LAYERS - 1),
       cuts=st.lists(st.integers(min_value=0, max_value=1 << 20), max_size=8))
def test_a_continuation_gives_the_same_sections_from_its_first_layer(stored, first_layer: int,
                                                                      cuts: list[int]) -> None:
    """The header and the sections from ``first_layer`` on (protocol version 2), split
    anywhere: the very sections of the whole blob, numbered by their layer."""
    manifest, blob = stored
    header = codec.parse_header(blob)
    answer = blob[:header.size] + blob[header.section_offset(first_layer):]
    bounds = sorted({0, len(answer), *(cut % len(answer) for cut in cuts)})
    assembly = Assembly(manifest, 0, 0, len(answer), first_layer=first_layer)
    assert assembly.sections == first_layer
    sections = [s for start, end in zip(bounds, bounds[1:]) for s in assembly.add(answer[start:end])]
    assert sections == [(layer, bytes(section(blob, header, layer))) for layer in range(first_layer, LAYERS)]
    assert assembly.sections == LAYERS and assembly.buffered == 0


def test_a_continuation_whose_header_disagrees_with_its_bytes_is_corrupt(stored) -> None:
    """A header whose sections from the first layer do not add up to the answer's bytes,
    or whose blob is not the manifest's size, is refused before any section is cut."""
    manifest, blob = stored
    header = codec.parse_header(blob)
    answer = blob[:header.size] + blob[header.section_offset(1):]
    assembly = Assembly(manifest, 0, 0, len(answer) - 1, first_layer=1)
    with pytest.raises(codec.CorruptBitstream, match=f"{len(answer)} bytes from layer 1"):
        assembly.add(answer)
    assert assembly.discarded and assembly.add(answer) == []
    whole = Assembly(manifest, 0, 0, len(blob) - 1)
    with pytest.raises(codec.CorruptBitstream, match=f"the manifest says {len(blob)} bytes"):
        whole.add(blob)


@pytest.mark.parametrize("first_layer, expected, message", [
    (LAYERS, 10, "first layer 3 out of range"), (1, None, "the whole blob has"), (-1, 10, "out of range")])
def test_a_continuation_beyond_the_manifest_is_refused_before_anything_is_held(stored, first_layer: int,
                                                                               expected: int | None,
                                                                               message: str) -> None:
    manifest, blob = stored
    with pytest.raises(ValueError, match=message):
        Assembly(manifest, 0, 0, len(blob) + 1 if expected is None else expected, first_layer=first_layer)
