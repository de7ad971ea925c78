"""The exact level: a blob holding its KV bit for bit (codec), a context stored with it as
level 0 (manifest, put_context), and a fetch that takes it when the deadline allows and
delivers the stored KV's own bits (StreamSession over loopback)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import codec
import streamer
from codec import container
from streamer.adapt.decide import plan_input
from streamer.adapt.decoding import DecodeCost
from streamer.adapt.recompute import RecomputeCost
from streamer.wire.manifest import Manifest, ManifestError
from streamer_helpers import synthetic_kv

LAYERS, HEADS, HEAD_DIM, CHUNK = 3, 2, 16, 64


@pytest.fixture(scope="module")
def profile() -> codec.Profile:
    return codec.calibrate([synthetic_kv(1, 512, LAYERS, HEADS, HEAD_DIM)])


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16) if x.element_size() == 2 else x.view(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sinks", [None, 0, 100])
def test_an_exact_blob_decodes_to_its_tensors_own_bits(profile, dtype, sinks) -> None:
    kv = synthetic_kv(2, 70, LAYERS, HEADS, HEAD_DIM).to(dtype)
    kv[0, 0, 3, 0, 0] = -0.0   # bits a lossy level would not keep: a sign of zero, the largest
    kv[1, 1, 5, 1, 2] = torch.finfo(dtype).max   # finite value, the smallest subnormal
    kv[2, 0, 7, 0, 1] = torch.finfo(dtype).smallest_normal / 4
    blob = codec.encode_exact(kv, profile, sink_tokens=sinks, start=9)
    info = codec.inspect(blob)
    assert info["level"] == codec.EXACT_LEVEL and info["sections"]["raw_layers"] == list(range(LAYERS))
    assert info["start"] == 9 and not info["embedded_profile"]
    assert len(blob) == kv.numel() * kv.element_size() + codec.parse_header(blob).size
    assert torch.equal(_bits(codec.decode(blob, profile)), _bits(kv))
    for layer, k, v in codec.decode_layers(blob, profile):
        assert torch.equal(_bits(k), _bits(kv[layer, 0])) and torch.equal(_bits(v), _bits(kv[layer, 1]))


def test_an_exact_blob_names_its_profile_and_needs_it(profile) -> None:
    blob = codec.encode_exact(synthetic_kv(2, 10, LAYERS, HEADS, HEAD_DIM), profile)
    other = codec.calibrate([synthetic_kv(3, 512, LAYERS, HEADS, HEAD_DIM)])
    with pytest.raises(codec.ProfileMismatch):
        codec.decode(blob, other)
    with pytest.raises(codec.ProfileMismatch):
        codec.decode(blob)
    with pytest.raises(ValueError, match="shape"):
        codec.encode_exact(synthetic_kv(2, 10, LAYERS + 1, HEADS, HEAD_DIM), profile)


def test_an_exact_level_header_with_a_coded_section_or_an_embedded_profile_is_corrupt(profile) -> None:
    kv = synthetic_kv(2, 64, LAYERS, HEADS, HEAD_DIM)
    coded = codec.encode(kv, 0, profile)
    header = codec.parse_header(coded)
    sections = [bytes(coded[header.offsets[i]:header.offsets[i + 1]]) for i in range(LAYERS)]
    claimed = container.pack_header(dtype=kv.dtype, level=codec.EXACT_LEVEL, layers=LAYERS, heads=HEADS,
                                    head_dim=HEAD_DIM, sink_tokens=header.sink_tokens, tokens=64, start=0,
                                    profile_id=profile.id, embedded_profile=None, sections=sections,
                                    modes=list(header.modes))
    assert container.MODE_CODED in header.modes
    with pytest.raises(codec.CorruptBitstream, match="exact-level blob"):
        codec.decode(claimed + b"".join(sections), profile)
    embedded = codec.encode(kv, 0)   # embeds its own profile
    eh = codec.parse_header(embedded)
    raw = [bytes(container.token_bytes(64, HEADS * HEAD_DIM, kv.dtype))] * LAYERS
    with_profile = container.pack_header(dtype=kv.dtype, level=codec.EXACT_LEVEL, layers=LAYERS, heads=HEADS,
                                         head_dim=HEAD_DIM, sink_tokens=0, tokens=64, start=0,
                                         profile_id=eh.profile_id, embedded_profile=eh.embedded_profile,
                                         sections=raw, modes=[container.MODE_RAW] * LAYERS)
    with pytest.raises(codec.CorruptBitstream, match="exact-level blob"):
        codec.parse_header(with_profile)


async def test_put_context_stores_the_exact_level_as_level_0(tmp_path, profile) -> None:
    kv = synthetic_kv(4, 150, LAYERS, HEADS, HEAD_DIM)
    store = await streamer.open_store(str(tmp_path))
    try:
        manifest = await streamer.put_context(store, "doc", kv, list(range(150)), profile=profile,
                                              chunk_tokens=CHUNK, exact=True, levels=[1, 3])
        assert manifest.exact and manifest.levels == 1 + len(profile.targets)
        assert manifest.level_distortion == (0.0, *profile.targets)
        assert [manifest.codec_level(level) for level in range(manifest.levels)] == [codec.EXACT_LEVEL, 0, 1, 2, 3, 4]
        for chunk in manifest.chunks:
            assert chunk.levels() == (0, 2, 4)   # the exact level, and the profile's 1 and 3
            exact = await store.get_chunk("doc", manifest.version, chunk.index, 0)
            assert torch.equal(_bits(codec.decode(exact, profile)), _bits(kv[:, :, chunk.start:chunk.end]))
            assert codec.inspect(await store.get_chunk("doc", manifest.version, chunk.index, 4))["level"] == 3
        assert Manifest.from_bytes(manifest.to_bytes()) == manifest
        plain = await streamer.put_context(store, "plain", kv, list(range(150)), profile=profile, chunk_tokens=CHUNK)
        assert not plain.exact and plain.codec_level(2) == 2
        with pytest.raises(ValueError, match="exact must be a bool"):
            await streamer.put_context(store, "bad", kv, list(range(150)), profile=profile, exact=1)
    finally:
        await store.close()
    # a manifest written before the exact level cannot claim one; and only level 0 may be exact
    doc = json.loads(manifest.to_bytes())
    doc["version"] = 2
    with pytest.raises(ManifestError, match="no exact level"):
        Manifest.from_bytes(json.dumps(doc).encode())
    with pytest.raises(ManifestError, match=r"level_distortion\[1\] must be > 0"):
        dataclasses.replace(manifest, level_distortion=(0.0, 0.0, *profile.targets[1:]))
    with pytest.raises(ValueError, match="out of range"):
        manifest.codec_level(manifest.levels)


def test_the_plan_times_the_exact_level_as_a_copy_not_a_decode(profile) -> None:
    chunk = streamer.wire.manifest.ChunkInfo(index=0, start=0, end=64, sizes=(9000, 3000, 2000), text_bytes=10,
                                             sink_tokens=0)
    manifest = Manifest(context_id="c", version="v", layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM,
                        dtype="float16", tokens=64, profile_id=profile.id, level_distortion=(0.0, 1e-3, 4e-3),
                        chunks=(chunk,), created=0.0)
    inp = plan_input(manifest, 0, time_left=1.0, history=[], prior_bps=None, recompute=RecomputeCost(1e-4),
                     decode_cost=DecodeCost(1e-6, 10.0))
    assert inp.decode_seconds[0][0] == 0.0 and min(inp.decode_seconds[0][1:]) > 0
    lossy = dataclasses.replace(manifest, level_distortion=(1e-4, 1e-3, 4e-3))
    inp = plan_input(lossy, 0, time_left=1.0, history=[], prior_bps=None, recompute=RecomputeCost(1e-4),
                     decode_cost=DecodeCost(1e-6, 10.0))
    assert inp.decode_seconds[0][0] > inp.decode_seconds[0][1]


async def test_a_fetch_with_time_to_spare_delivers_the_stored_kv_bit_for_bit(tmp_path, profile) -> None:
    kv = synthetic_kv(5, 4 * CHUNK, LAYERS, HEADS, HEAD_DIM)
    store = await streamer.open_store(str(tmp_path))
    server = await streamer.serve(store)
    got = torch.full_like(kv, float("nan"))

    def on_layer(chunk: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        got[layer, 0, chunk * CHUNK:(chunk + 1) * CHUNK] = k
        got[layer, 1, chunk * CHUNK:(chunk + 1) * CHUNK] = v

    try:
        await streamer.put_context(store, "doc", kv, list(range(4 * CHUNK)), profile=profile, chunk_tokens=CHUNK,
                                   exact=True)
        async with streamer.StreamSession("127.0.0.1", server.port, "doc", slo=5.0, on_layer=on_layer) as session:
            report = await session.fetch()
        assert [c.level for c in report.chunks] == [0, 0, 0, 0]
        assert torch.equal(_bits(got), _bits(kv))
        assert len(session.decodes) == 0   # copies say nothing of the decoder's rate
        # a lossy level of the same context: its blob says the profile's level, one below
        async with streamer.StreamSession("127.0.0.1", server.port, "doc", slo=5.0, policy="fixed:3",
                                          on_layer=on_layer) as session:
            report = await session.fetch()
        assert [c.level for c in report.chunks] == [3, 3, 3, 3]
        expected = torch.cat([codec.decode(codec.encode(kv[:, :, s:s + CHUNK], 2, profile,
                                                        sink_tokens=None if s == 0 else 0, start=s), profile)
                              for s in range(0, 4 * CHUNK, CHUNK)], dim=2)
        assert torch.equal(got, expected)
    finally:
        await server.close()
        await store.close()
