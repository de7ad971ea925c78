"""Round trips through codec.encode / codec.decode on synthetic correlated KV.

Covers: every level x dtype with a calibrated profile (shape/dtype kept, distortion
near the level's target, monotone quality/size ladder, bit-exact sinks), profile=None,
the transform/delta variants, odd shapes, sink_tokens overrides, outliers far outside
the calibrated range (escape codes), and the layer-addressable API (decode_layers,
parse_header / header_length / decode_section on each section alone).
"""
from __future__ import annotations

import pytest
import torch

import codec

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
LEVELS = list(range(len(codec.DEFAULT_TARGETS)))
#: measured distortion on unseen data may exceed the calibrated target by this factor
SLACK = 1.6


def assert_same_decode(a: torch.Tensor, b: torch.Tensor) -> None:
    """Every decode path writes the very same bits (the GEMM always targets a fresh tensor)."""
    assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def _sinks(kv: torch.Tensor, sink_tokens: int = 4) -> int:
    return min(sink_tokens, kv.shape[2])


# ------------------------------------------------------------------ level ladder
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("level", LEVELS)
def test_roundtrip_every_level_and_dtype(codec_profile, codec_test_kv, codec_distortion, dtype, level):
    kv = codec_test_kv.to(dtype)
    blob = codec.encode(kv, level=level, profile=codec_profile)
    assert isinstance(blob, bytes)
    out = codec.decode(blob, profile=codec_profile)
    assert out.shape == kv.shape
    assert out.dtype == dtype
    assert out.device.type == "cpu"
    assert bool(torch.isfinite(out).all())
    # sinks are stored verbatim: bit-exact in the input dtype
    assert torch.equal(out[:, :, :4], kv[:, :, :4])
    d = codec_distortion(kv, out, sinks=4)
    target = codec_profile.levels[level].target_distortion
    assert d <= SLACK * target, f"level {level}: distortion {d:.3g} vs target {target:.3g}"
    # and not absurdly better either (a level that ignores its target is a bug too)
    assert d >= target / 10


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ladder_is_monotone(codec_profile, codec_test_kv, codec_distortion, dtype):
    kv = codec_test_kv.to(dtype)
    sizes, dists = [], []
    for level in LEVELS:
        blob = codec.encode(kv, level=level, profile=codec_profile)
        sizes.append(len(blob))
        dists.append(codec_distortion(kv, codec.decode(blob, profile=codec_profile), sinks=4))
    assert all(a < b for a, b in zip(dists, dists[1:])), dists
    assert all(a > b for a, b in zip(sizes, sizes[1:])), sizes
    # the best level must actually cost more than raw fp16 would not: compression happened
    raw = kv.numel() * kv.element_size()
    assert sizes[codec.DEFAULT_LEVEL] < raw / 2, (sizes, raw)


def test_profile_levels_describe_the_ladder(codec_profile):
    levels = codec_profile.levels
    assert len(levels) == len(codec.DEFAULT_TARGETS)
    assert all(isinstance(lv, codec.Level) for lv in levels)
    assert [lv.index for lv in levels] == LEVELS
    assert [lv.target_distortion for lv in levels] == pytest.approx(list(codec.DEFAULT_TARGETS))
    bits = [lv.estimated_bits for lv in levels]
    assert all(a > b > 0 for a, b in zip(bits, bits[1:])), bits
    assert 0 <= codec.DEFAULT_LEVEL < len(levels)


def test_estimated_bits_track_real_size(codec_profile, codec_test_kv):
    """Level.estimated_bits (calibration data) should predict the coded size of unseen data."""
    kv = codec_test_kv
    coded = kv[:, :, 4:].numel()
    for level in codec_profile.levels:
        blob = codec.encode(kv, level=level.index, profile=codec_profile)
        layers, _, _, heads, head_dim = kv.shape
        sink_bytes = layers * 2 * 4 * heads * head_dim * kv.element_size()
        payload = sum(codec.inspect(blob)["sections"]["layers"]) - sink_bytes
        bits = 8 * payload / coded
        assert bits == pytest.approx(level.estimated_bits, rel=0.35), (level, bits)


def test_default_level_is_used(codec_profile, codec_test_kv):
    blob = codec.encode(codec_test_kv, profile=codec_profile)
    assert codec.inspect(blob)["level"] == codec.DEFAULT_LEVEL
    assert blob == codec.encode(codec_test_kv, level=codec.DEFAULT_LEVEL, profile=codec_profile)


# ------------------------------------------------------------------ profile=None
@pytest.mark.parametrize("level", LEVELS)
def test_roundtrip_without_profile(codec_test_kv, codec_distortion, level):
    kv = codec_test_kv.to(torch.float16)
    blob = codec.encode(kv, level=level)
    info = codec.inspect(blob)
    assert info["embedded_profile"] is True and info["sections"]["embedded_profile"] > 0
    assert info["level"] == level
    out = codec.decode(blob)
    assert out.shape == kv.shape and out.dtype == kv.dtype
    assert torch.equal(out[:, :, :4], kv[:, :, :4])
    d = codec_distortion(kv, out, sinks=4)
    # the embedded profile is fitted on this very data: its target holds tightly
    assert codec.DEFAULT_TARGETS[level] / 10 <= d <= 1.15 * codec.DEFAULT_TARGETS[level]
    # a profile passed for a self-contained blob is ignored, not an error
    other = codec.calibrate([kv.float()], targets=(0.01,))
    assert torch.equal(codec.decode(blob, profile=other), out)


def test_calibrated_profile_beats_embedded(codec_profile, codec_test_kv):
    for level in LEVELS:
        with_profile = len(codec.encode(codec_test_kv, level=level, profile=codec_profile))
        without = len(codec.encode(codec_test_kv, level=level))
        assert with_profile < without, (level, with_profile, without)


# ------------------------------------------------------------------ profile variants
@pytest.mark.parametrize("transform", ["layer", "head", "identity"])
@pytest.mark.parametrize("delta", ["auto", "never", "always"])
def test_profile_variants_roundtrip(codec_make_kv, codec_test_kv, codec_distortion, transform, delta):
    profile = codec.calibrate([codec_make_kv(0)], transform=transform, delta=delta)
    assert profile.transform == transform
    if delta == "always":
        assert (profile.delta_group == 10).all()
    elif delta == "never":
        assert (profile.delta_group == 0).all()
    if transform == "identity":
        assert profile.basis is None
    else:
        assert profile.basis is not None
    for level in (0, codec.DEFAULT_LEVEL, LEVELS[-1]):
        blob = codec.encode(codec_test_kv, level=level, profile=profile)
        out = codec.decode(blob, profile=profile)
        assert out.shape == codec_test_kv.shape
        assert torch.equal(out[:, :, :4], codec_test_kv[:, :, :4])
        assert codec_distortion(codec_test_kv, out, sinks=4) <= SLACK * profile.targets[level]


def test_transforms_rank_as_designed(codec_make_kv, codec_test_kv):
    """On cross-channel-correlated data, PCA across the layer codes smallest, identity largest."""
    sizes = {}
    for transform in ("layer", "head", "identity"):
        profile = codec.calibrate([codec_make_kv(0)], transform=transform, delta="never")
        sizes[transform] = len(codec.encode(codec_test_kv, level=codec.DEFAULT_LEVEL, profile=profile))
    assert sizes["layer"] < sizes["head"] < sizes["identity"], sizes


def test_delta_coding_pays_on_smooth_data(codec_make_kv, codec_test_kv):
    """The synthetic data is AR(1) with rho=0.9, so anchor/delta coding must be smaller."""
    never = codec.calibrate([codec_make_kv(0)], transform="identity", delta="never")
    always = codec.calibrate([codec_make_kv(0)], transform="identity", delta="always")
    level = codec.DEFAULT_LEVEL
    assert len(codec.encode(codec_test_kv, level, always)) < len(codec.encode(codec_test_kv, level, never))


def test_custom_targets(codec_make_kv, codec_test_kv, codec_distortion):
    targets = (1e-4, 2e-2)
    profile = codec.calibrate([codec_make_kv(0)], targets=targets)
    assert [lv.target_distortion for lv in profile.levels] == list(targets)
    for level, target in enumerate(targets):
        out = codec.decode(codec.encode(codec_test_kv, level, profile), profile)
        assert codec_distortion(codec_test_kv, out, sinks=4) <= SLACK * target
    with pytest.raises(ValueError, match="level"):
        codec.encode(codec_test_kv, level=2, profile=profile)


def test_calibrate_on_several_samples(codec_make_kv, codec_distortion):
    samples = (codec_make_kv(seed, tokens=120) for seed in (10, 11, 12))  # any iterable works
    profile = codec.calibrate(samples)
    kv = codec_make_kv(13, tokens=120)
    out = codec.decode(codec.encode(kv, 2, profile), profile)
    assert codec_distortion(kv, out, sinks=4) <= SLACK * profile.targets[2]


# ------------------------------------------------------------------ odd shapes
ODD_SHAPES = [
    (1, 1, 1, 1),      # one layer, one token, one head, head_dim 1
    (2, 1, 3, 5),      # a single token: all sinks
    (1, 3, 2, 4),      # fewer tokens than sinks
    (1, 5, 1, 7),      # exactly one coded token
    (2, 57, 1, 7),     # one head, head_dim 7
    (1, 64, 4, 1),     # head_dim 1
    (3, 23, 2, 9),
]


@pytest.mark.parametrize("layers,tokens,heads,head_dim", ODD_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_odd_shapes_without_profile(codec_distortion, layers, tokens, heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(layers * 1000 + tokens * 10 + heads + head_dim)
    kv = (torch.randn(layers, 2, tokens, heads, head_dim, generator=gen) * 3 + 1).to(dtype)
    for level in (0, LEVELS[-1]):
        out = codec.decode(codec.encode(kv, level=level))
        assert out.shape == kv.shape and out.dtype == dtype
        s = _sinks(kv)
        assert torch.equal(out[:, :, :s], kv[:, :, :s])
        if tokens > s + 1:
            assert codec_distortion(kv, out, sinks=s) <= 1.15 * codec.DEFAULT_TARGETS[level] + 1e-6
        elif tokens == s + 1:  # one coded token: it is its own mean, reconstructed (near) exactly
            torch.testing.assert_close(out.float(), kv.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("layers,tokens,heads,head_dim", ODD_SHAPES)
def test_odd_shapes_with_profile(codec_distortion, layers, tokens, heads, head_dim):
    gen = torch.Generator().manual_seed(7)
    calib = torch.randn(layers, 2, 200, heads, head_dim, generator=gen)
    profile = codec.calibrate([calib])
    kv = torch.randn(layers, 2, tokens, heads, head_dim, generator=gen)
    for level in LEVELS:
        blob = codec.encode(kv, level=level, profile=profile)
        out = codec.decode(blob, profile=profile)
        assert out.shape == kv.shape and out.dtype == kv.dtype
        s = _sinks(kv)
        assert torch.equal(out[:, :, :s], kv[:, :, :s])
        if tokens > 20:
            assert codec_distortion(kv, out, sinks=s) <= SLACK * profile.targets[level]


@pytest.mark.parametrize("sink_tokens", [0, 1, 4, 17, 1000])
def test_sink_tokens_override(codec_profile, codec_test_kv, codec_distortion, sink_tokens):
    kv = codec_test_kv.to(torch.bfloat16)
    blob = codec.encode(kv, level=2, profile=codec_profile, sink_tokens=sink_tokens)
    s = min(sink_tokens, kv.shape[2])
    assert codec.inspect(blob)["sink_tokens"] == s
    out = codec.decode(blob, profile=codec_profile)
    assert torch.equal(out[:, :, :s], kv[:, :, :s])
    if s < kv.shape[2]:
        assert not torch.equal(out[:, :, s:], kv[:, :, s:])  # the rest is lossy
        assert codec_distortion(kv, out, sinks=s) <= SLACK * codec_profile.targets[2]
    else:
        assert torch.equal(out, kv)


def test_more_sinks_cost_more_bytes(codec_profile, codec_test_kv):
    sizes = [len(codec.encode(codec_test_kv, 3, codec_profile, sink_tokens=s)) for s in (0, 4, 32)]
    assert sizes[0] < sizes[1] < sizes[2], sizes


def test_profile_sink_tokens_is_the_default(codec_make_kv, codec_test_kv):
    profile = codec.calibrate([codec_make_kv(0)], sink_tokens=0)
    assert profile.sink_tokens == 0
    blob = codec.encode(codec_test_kv, 1, profile)
    assert codec.inspect(blob)["sink_tokens"] == 0
    profile9 = codec.calibrate([codec_make_kv(0)], sink_tokens=9)
    assert codec.inspect(codec.encode(codec_test_kv, 1, profile9))["sink_tokens"] == 9


def test_sinks_keep_exact_bits_of_special_values(codec_profile, codec_test_kv):
    """Sinks are raw bits: -0.0, subnormals and the dtype's extremes survive exactly."""
    for dtype in DTYPES:
        kv = codec_test_kv.to(dtype).clone()
        info = torch.finfo(dtype)
        specials = torch.tensor([-0.0, info.tiny / 4, -info.tiny, 1.0 + info.eps], dtype=dtype)
        kv[0, 0, 0, 0, :4] = specials
        kv[1, 1, 3, 2, 0] = info.max / 2
        out = codec.decode(codec.encode(kv, 4, codec_profile), codec_profile)
        sink_in = kv[:, :, :4].contiguous().view(torch.int16 if dtype != torch.float32 else torch.int32)
        sink_out = out[:, :, :4].contiguous().view(sink_in.dtype)
        assert torch.equal(sink_in, sink_out), dtype


# ------------------------------------------------------------------ odd inputs
def test_non_contiguous_and_grad_inputs(codec_profile, codec_test_kv):
    kv = codec_test_kv
    reference = codec.encode(kv, 1, codec_profile)
    # same values, permuted storage
    permuted = kv.permute(4, 3, 2, 1, 0).contiguous().permute(4, 3, 2, 1, 0)
    assert not permuted.is_contiguous()
    assert codec.encode(permuted, 1, codec_profile) == reference
    # a tensor that requires grad encodes without complaint
    assert codec.encode(kv.clone().requires_grad_(True), 1, codec_profile) == reference
    # a token slice (a view with an offset) encodes like its copy
    window = kv[:, :, 100:200]
    assert codec.encode(window, 1, codec_profile) == codec.encode(window.clone(), 1, codec_profile)


def test_numpy_integer_level(codec_profile, codec_test_kv):
    import numpy as np

    assert codec.encode(codec_test_kv, np.int64(2), codec_profile) == codec.encode(codec_test_kv, 2, codec_profile)


def _project_kept(profile, kept, layer, kv, x):
    """What the codec can reconstruct of tokens x [N, C] from ``kept`` rows: mean + projection on them."""
    mean = torch.from_numpy(profile.mean[layer, kv]).double()
    if profile.basis is None:
        return x.double()
    basis = torch.from_numpy(profile.basis[layer, kv, :kept]).double()
    return (x.double() - mean) @ basis.T @ basis + mean


@pytest.mark.parametrize("transform", ["layer", "identity"])
@pytest.mark.parametrize("factor", [1e3, -1e3, 1e5])
def test_outliers_far_outside_calibration(codec_make_kv, codec_test_kv, codec_section_plan, transform, factor):
    """A token 1000x outside the calibrated range is escape-coded, not clipped.

    With PCA, components dropped at a level reconstruct as the mean whatever the
    input, so the outlier is compared with its projection on the kept components
    (for the identity transform that is the token itself).
    """
    profile = codec.calibrate([codec_make_kv(0)], transform=transform)
    kv = codec_test_kv.clone()
    token = 150
    heads, head_dim = kv.shape[3:]
    spike = kv[0, 1, token].clone() * factor
    kv[0, 1, token] = spike
    for level in LEVELS:
        blob = codec.encode(kv, level, profile)
        out = codec.decode(blob, profile)
        assert bool(torch.isfinite(out).all())
        kept = codec_section_plan(blob, profile, 0).kept[1]   # V rows the section records
        reachable = _project_kept(profile, kept, 0, 1, spike.reshape(1, -1)).reshape(heads, head_dim)
        err = (out[0, 1, token].double() - reachable).norm() / spike.double().norm()
        assert err < 0.01, (level, float(err))
        if transform == "identity":
            assert float((out[0, 1, token] - spike).norm() / spike.norm()) < 0.01
        # the rest of the cache is not wrecked by the outlier
        others = torch.cat([out[:, :, 4:token], out[:, :, token + 1:]], dim=2)
        ref = torch.cat([kv[:, :, 4:token], kv[:, :, token + 1:]], dim=2)
        rel = ((others - ref) ** 2).sum() / ((ref - ref.mean(2, keepdim=True)) ** 2).sum()
        assert rel <= SLACK * profile.targets[level]


def test_outlier_channel_without_profile(codec_distortion):
    """Channels whose scales differ by 1e6 all meet the target (identity embedded profile)."""
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(1, 2, 80, 2, 3, generator=gen)
    kv[..., 0, 0] *= 1e4
    kv[..., 1, 2] *= 1e-2
    out = codec.decode(codec.encode(kv, 1))
    assert codec_distortion(kv, out, sinks=4) <= 1.15 * codec.DEFAULT_TARGETS[1]


def test_constant_input(codec_profile):
    """Zero variance: nothing to lose. Both with and without a profile."""
    kv = torch.full((2, 2, 50, 3, 5), 0.75)
    torch.testing.assert_close(codec.decode(codec.encode(kv, 4)), kv, rtol=0, atol=1e-6)
    out = codec.decode(codec.encode(kv, 0, codec_profile), codec_profile)
    assert out.shape == kv.shape and bool(torch.isfinite(out).all())
    assert torch.equal(out[:, :, :4], kv[:, :, :4])
    # every coded token is the same, so every reconstructed token must be the same too
    assert torch.equal(out[:, :, 4:], out[:, :, 4:5].expand_as(out[:, :, 4:]))


# ------------------------------------------------------------------ layer-addressable API
@pytest.mark.parametrize("use_profile", [True, False])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_layers_matches_decode(codec_profile, codec_test_kv, use_profile, dtype):
    kv = codec_test_kv.to(dtype)
    profile = codec_profile if use_profile else None
    blob = codec.encode(kv, 2, profile)
    whole = codec.decode(blob, profile=profile)
    seen = []
    for layer, k, v in codec.decode_layers(blob, profile=profile):
        seen.append(layer)
        assert k.shape == v.shape == kv.shape[2:]
        assert k.dtype == v.dtype == dtype
        assert_same_decode(k, whole[layer, 0])
        assert_same_decode(v, whole[layer, 1])
        if not use_profile:  # identity transform, no GEMM: bit-identical by FORMAT.md
            assert torch.equal(k, whole[layer, 0]) and torch.equal(v, whole[layer, 1])
    assert seen == list(range(kv.shape[0]))


@pytest.mark.parametrize("use_profile", [True, False])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_into_a_callers_buffer(codec_profile, codec_test_kv, use_profile, dtype):
    """``out``: the same decode, written into the caller's tensor (a used one: every
    element is overwritten), sink tokens and raw-free layers alike."""
    kv = codec_test_kv.to(dtype)
    profile = codec_profile if use_profile else None
    blob = codec.encode(kv, 3, profile)
    whole = codec.decode(blob, profile)
    cache = torch.full((2, *kv.shape), float("nan"), dtype=dtype)   # two chunks' room
    into = codec.decode(blob, profile, out=cache[1])
    assert into.data_ptr() == cache[1].data_ptr()
    assert torch.equal(cache[1], whole) and cache[0].isnan().all()


@pytest.mark.parametrize("use_profile", [True, False])
def test_decode_section_alone(codec_profile, codec_test_kv, use_profile):
    kv = codec_test_kv.to(torch.float16)
    profile = codec_profile if use_profile else None
    blob = codec.encode(kv, 3, profile)
    whole = codec.decode(blob, profile=profile)
    assert codec.header_length(blob[:31]) is None
    size = codec.header_length(blob[:32])
    assert size is not None and 32 < size < len(blob)
    header = codec.parse_header(blob[:size])  # the header alone is enough
    assert header.size == size
    assert header.shape == tuple(kv.shape) and header.dtype == kv.dtype
    assert header.total_size == len(blob)
    offsets = []
    for layer in range(header.layers):
        start = header.section_offset(layer)
        length = header.sections[layer][0]
        offsets.append((start, length))
        section = bytes(blob[start:start + length])  # a fresh buffer: nothing else of the blob
        k, v = codec.decode_section(header, profile, layer, section)
        assert_same_decode(k, whole[layer, 0])
        assert_same_decode(v, whole[layer, 1])
        # memoryview input and the in-place `out` form give the same tensors
        out = torch.empty((2, *kv.shape[2:]), dtype=kv.dtype)
        k2, v2 = codec.decode_section(header, profile, layer, memoryview(section), out=out)
        assert_same_decode(out[0], whole[layer, 0])
        assert_same_decode(out[1], whole[layer, 1])
        assert k2.data_ptr() == out.data_ptr()
    # sections tile the blob after the header, in layer order
    assert offsets[0][0] == size
    assert all(a[0] + a[1] == b[0] for a, b in zip(offsets, offsets[1:]))
    assert offsets[-1][0] + offsets[-1][1] == len(blob)


def test_sections_decode_in_any_order(codec_profile, codec_make_kv):
    kv = codec_make_kv(5)
    blob = codec.encode(kv, 1, codec_profile)
    header = codec.parse_header(blob)
    whole = codec.decode(blob, codec_profile)
    for layer in reversed(range(header.layers)):
        start = header.section_offset(layer)
        k, v = codec.decode_section(header, codec_profile, layer,
                                    blob[start:start + header.sections[layer][0]])
        assert_same_decode(k, whole[layer, 0])
        assert_same_decode(v, whole[layer, 1])


def test_decode_accepts_bytearray_and_memoryview(codec_profile, codec_test_kv):
    blob = codec.encode(codec_test_kv, 1, codec_profile)
    ref = codec.decode(blob, codec_profile)
    assert torch.equal(codec.decode(bytearray(blob), codec_profile), ref)
    assert torch.equal(codec.decode(memoryview(blob), codec_profile), ref)


def test_inspect(codec_profile, codec_test_kv):
    kv = codec_test_kv.to(torch.bfloat16)
    blob = codec.encode(kv, 3, codec_profile)
    info = codec.inspect(blob)
    assert info["shape"] == list(kv.shape)
    assert info["dtype"] == "bfloat16"
    assert info["level"] == 3
    assert info["profile_id"] == codec_profile.id
    assert info["embedded_profile"] is False
    assert info["sink_tokens"] == 4
    assert info["total_bytes"] == len(blob)
    assert info["complete"] is True
    assert info["format_version"] == 5
    assert info["start"] == 0
    sections = info["sections"]
    assert len(sections["layers"]) == kv.shape[0]
    assert sections["raw_layers"] == []
    assert sections["header"] + sections["embedded_profile"] + sum(sections["layers"]) == len(blob)
    assert info["bits_per_element"] == pytest.approx(8 * len(blob) / kv.numel())
    # independent lanes: each coded section's n_lanes (the lane table's first u32)
    header = codec.parse_header(blob)
    assert sections["lanes"] == [int.from_bytes(blob[header.section_offset(l) + header.sink_size:][:4], "little")
                                 for l in range(kv.shape[0])]
    assert info["lanes"] == sum(sections["lanes"]) > 0
    # a prefix holding just the header can be inspected, and says it is incomplete
    partial = codec.inspect(blob[:codec.header_length(blob) + 10])
    assert partial["complete"] is False and partial["total_bytes"] == len(blob)
    assert partial["lanes"] is None and partial["sections"]["lanes"][-1] is None


def test_decode_cpu_device_spellings(codec_profile, codec_test_kv):
    blob = codec.encode(codec_test_kv, 1, codec_profile)
    ref = codec.decode(blob, codec_profile)
    assert torch.equal(codec.decode(blob, codec_profile, device=torch.device("cpu")), ref)
    assert torch.equal(codec.decode(blob, codec_profile, device="cpu"), ref)


def test_concurrent_encode_decode_threads(codec_profile, codec_make_kv):
    """encode/decode from several threads at once (numba kernels release the GIL)."""
    import threading

    kvs = [codec_make_kv(seed, tokens=120) for seed in range(20, 24)]
    blobs = [codec.encode(kv, 1, codec_profile) for kv in kvs]
    refs = [codec.decode(blob, codec_profile) for blob in blobs]
    errors: list[str] = []

    def work(i: int) -> None:
        try:
            for _ in range(10):
                assert codec.encode(kvs[i], 1, codec_profile) == blobs[i]
                assert_same_decode(codec.decode(blobs[i], codec_profile), refs[i])
        except Exception as exc:  # collected: an assert in a thread would be lost
            errors.append(f"thread {i}: {exc!r}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(kvs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a codec call hung"
    assert not errors, errors


# ------------------------------------------------------------------ several levels at once
@pytest.mark.parametrize("sink_tokens", [None, 0])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_encode_levels_gives_each_levels_own_blob(codec_profile, codec_test_kv, dtype, sink_tokens):
    """The shared transform and control sample change no byte: each blob is what encode
    writes for its level alone, in the order asked, repeats included."""
    kv = codec_test_kv.to(dtype)
    levels = [3, 0, 4, 1, 2, 0]
    blobs = codec.encode_levels(kv, levels, codec_profile, sink_tokens=sink_tokens, start=17)
    assert blobs == [codec.encode(kv, level, codec_profile, sink_tokens=sink_tokens, start=17) for level in levels]


def test_encode_levels_with_rope_and_without_a_profile(codec_test_kv):
    import test_codec_golden as golden

    profile = golden.rotary_profile(codec.Profile.load(golden.PROFILE_FILE))
    kv = golden.rotary_input()
    assert codec.encode_levels(kv, range(5), profile, start=golden.ROTARY_START) == \
        [codec.encode(kv, level, profile, start=golden.ROTARY_START) for level in range(5)]
    assert codec.encode_levels(codec_test_kv, [0, 2]) == [codec.encode(codec_test_kv, 0), codec.encode(codec_test_kv, 2)]


def test_encode_levels_warns_per_level_as_encode_does(codec_make_kv):
    """A profile that does not fit: each level's blob has the raw layers, and the warnings,
    that encode gives it alone."""
    import warnings

    foreign = codec.calibrate([codec_make_kv(5) * torch.linspace(0.01, 3.0, codec_make_kv(5).shape[-1])])
    kv = codec_make_kv(6)
    with warnings.catch_warnings(record=True) as together:
        warnings.simplefilter("always")
        blobs = codec.encode_levels(kv, [0, 3], foreign)
    alone = []
    with warnings.catch_warnings(record=True) as apart:
        warnings.simplefilter("always")
        alone = [codec.encode(kv, level, foreign) for level in (0, 3)]
    assert blobs == alone
    assert [str(w.message) for w in together] == [str(w.message) for w in apart]
    assert all(w.filename == __file__ for w in together)  # pointed at the caller


@pytest.mark.parametrize("levels,word", [([], "at least one"), ([0, 9], "level"), ([True], "level")])
@pytest.mark.parametrize("with_profile", [True, False])
def test_encode_levels_rejects_bad_levels(codec_profile, codec_test_kv, levels, word, with_profile):
    """A bool is no level (it used to reach the profile's arrays as a mask: a TypeError)."""
    with pytest.raises(ValueError, match=word):
        codec.encode_levels(codec_test_kv, levels, codec_profile if with_profile else None)
    if levels:
        with pytest.raises(ValueError, match=word):
            codec.encode(codec_test_kv, levels[-1], codec_profile if with_profile else None)
