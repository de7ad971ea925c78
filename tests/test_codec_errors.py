"""Errors the codec must raise, with messages that name what is wrong.

Bad inputs (shape, dtype, values, level, sink_tokens, device) are ValueError; a blob
encoded against another profile (or needing one that is not given) is ProfileMismatch;
damaged bytes are CorruptBitstream (fuzzed at scale in test_codec_fuzz.py). The tests
at the bottom pin bugs that were found and fixed, each with its root cause.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import codec


@pytest.fixture(scope="module")
def small_kv(codec_make_kv):
    return codec_make_kv(2, tokens=40)


@pytest.fixture(scope="module")
def blob(codec_profile, small_kv):
    return codec.encode(small_kv, 1, codec_profile)


def test_error_hierarchy():
    assert issubclass(codec.CorruptBitstream, codec.CodecError)
    assert issubclass(codec.ProfileMismatch, codec.CodecError)
    assert issubclass(codec.CodecError, Exception)
    assert not issubclass(codec.CorruptBitstream, ValueError)
    assert not issubclass(codec.ProfileMismatch, codec.CorruptBitstream)


# ------------------------------------------------------------------ bad tensors
BAD_TENSORS = [
    (torch.zeros(2, 2, 0, 3, 5), "empty"),
    (torch.zeros(0, 2, 4, 3, 5), "empty"),
    (torch.zeros(2, 2, 4, 3, 0), "empty"),
    (torch.zeros(2, 2, 4, 15), "shape"),               # 4-D
    (torch.zeros(1, 2, 2, 4, 3, 5), "shape"),          # 6-D
    (torch.zeros(2, 3, 4, 3, 5), "shape"),             # dim 1 must be 2 (K, V)
    (torch.zeros(2, 1, 4, 3, 5), "shape"),
    (torch.zeros(2, 2, 4, 3, 5, dtype=torch.int32), "dtype"),
    (torch.zeros(2, 2, 4, 3, 5, dtype=torch.int8), "dtype"),
    (torch.zeros(2, 2, 4, 3, 5, dtype=torch.float64), "dtype"),
    (torch.zeros(2, 2, 4, 3, 5, dtype=torch.bool), "dtype"),
    (torch.zeros(2, 2, 4, 3, 5, dtype=torch.complex64), "dtype"),
]


@pytest.mark.parametrize("kv,word", BAD_TENSORS, ids=[f"{w}-{tuple(t.shape)}-{t.dtype}" for t, w in BAD_TENSORS])
@pytest.mark.parametrize("with_profile", [False, True])
def test_bad_tensor_is_value_error(codec_profile, kv, word, with_profile):
    profile = codec_profile if with_profile else None
    with pytest.raises(ValueError, match=word):
        codec.encode(kv, 1, profile)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("where", [(0, 0, 0, 0, 0), (1, 1, 39, 2, 4), (0, 1, 3, 1, 1)])
def test_non_finite_is_value_error(codec_profile, small_kv, value, dtype, where):
    kv = small_kv.to(dtype).clone()
    kv[where] = value
    with pytest.raises(ValueError, match="NaN or inf"):
        codec.encode(kv, 1, codec_profile)
    with pytest.raises(ValueError, match="NaN or inf"):
        codec.encode(kv, 1)
    with pytest.raises(ValueError, match="NaN or inf"):
        codec.calibrate([kv])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_huge_finite_values_are_not_taken_for_infinities(dtype):
    """The finite check takes the largest magnitude: huge finite values (whose sum would
    overflow) pass, and a NaN among them does not."""
    kv = torch.full((1, 2, 8, 2, 4), 3e38, dtype=dtype)
    assert codec.profile.validate_kv(kv) is kv
    kv[0, 1, 3, 1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        codec.profile.validate_kv(kv)


@pytest.mark.parametrize("obj", [None, [[1.0]], np.zeros((2, 2, 4, 3, 5), np.float32), b"kv", 3.0],
                         ids=["None", "list", "ndarray", "bytes", "float"])
def test_non_tensor_is_value_error(codec_profile, obj):
    with pytest.raises(ValueError, match="torch.Tensor"):
        codec.encode(obj, 1, codec_profile)
    with pytest.raises(ValueError, match="torch.Tensor"):
        codec.encode(obj)
    with pytest.raises(ValueError, match="torch.Tensor"):
        codec.calibrate([obj])


@pytest.mark.parametrize("level", [-1, 5, 6, 255, 256, 1.0, "1", 1.5])
@pytest.mark.parametrize("with_profile", [False, True])
def test_level_out_of_range(codec_profile, small_kv, level, with_profile):
    profile = codec_profile if with_profile else None
    with pytest.raises(ValueError, match="level"):
        codec.encode(small_kv, level, profile)


def test_level_range_follows_the_profile(codec_make_kv, small_kv):
    profile = codec.calibrate([codec_make_kv(0)], targets=(0.01, 0.02))
    codec.encode(small_kv, 1, profile)
    with pytest.raises(ValueError, match=r"level must be an int in \[0, 1\]"):
        codec.encode(small_kv, 2, profile)


@pytest.mark.parametrize("sinks", [-1, 65536, 2.0, "4"])
def test_bad_sink_tokens(codec_profile, small_kv, sinks):
    with pytest.raises(ValueError, match="sink_tokens"):
        codec.encode(small_kv, 1, codec_profile, sink_tokens=sinks)
    with pytest.raises(ValueError, match="sink_tokens"):
        codec.encode(small_kv, 1, sink_tokens=sinks)


@pytest.mark.parametrize("shape,word", [
    ((3, 2, 40, 3, 5), "layers=3"),
    ((2, 2, 40, 5, 3), "heads=5"),
    ((2, 2, 40, 3, 4), "head_dim=4"),
    ((1, 2, 40, 15, 1), "layers=1"),
])
def test_profile_shape_mismatch_is_value_error(codec_profile, shape, word):
    with pytest.raises(ValueError, match=word) as info:
        codec.encode(torch.zeros(shape), 1, codec_profile)
    assert codec_profile.id in str(info.value)


def test_calibrate_errors(codec_make_kv):
    kv = codec_make_kv(0, tokens=40)
    with pytest.raises(ValueError, match="at least one sample"):
        codec.calibrate([])
    with pytest.raises(ValueError, match="sink tokens"):
        codec.calibrate([kv[:, :, :4]])  # nothing beyond the sinks
    with pytest.raises(ValueError, match="disagree on shape"):
        codec.calibrate([kv, codec_make_kv(0, tokens=40, heads=5, head_dim=3)])
    with pytest.raises(ValueError, match="transform"):
        codec.calibrate([kv], transform="pca")
    with pytest.raises(ValueError, match="delta"):
        codec.calibrate([kv], delta="sometimes")
    with pytest.raises(ValueError, match="increasing"):
        codec.calibrate([kv], targets=(1e-2, 1e-3))
    with pytest.raises(ValueError, match="increasing"):
        codec.calibrate([kv], targets=())
    with pytest.raises(ValueError, match="target distortion"):
        codec.calibrate([kv], targets=(1e-3, 1.5))


# ------------------------------------------------------------------ wrong profile
def test_wrong_profile_is_profile_mismatch(codec_make_kv, blob, codec_profile):
    other = codec.calibrate([codec_make_kv(3)])
    assert other.id != codec_profile.id
    with pytest.raises(codec.ProfileMismatch, match=codec_profile.id):
        codec.decode(blob, profile=other)
    with pytest.raises(codec.ProfileMismatch):
        next(codec.decode_layers(blob, profile=other))
    header = codec.parse_header(blob)
    start = header.section_offset(0)
    with pytest.raises(codec.ProfileMismatch):
        codec.decode_section(header, other, 0, blob[start:start + header.sections[0][0]])


def test_same_data_other_settings_is_another_profile(codec_make_kv, blob, codec_profile):
    """Any calibration difference (here: sink_tokens) gives a new id, and is refused."""
    other = codec.calibrate([codec_make_kv(0)], sink_tokens=3)
    assert other.id != codec_profile.id
    with pytest.raises(codec.ProfileMismatch):
        codec.decode(blob, profile=other)


def test_missing_profile_is_profile_mismatch(blob, codec_profile):
    with pytest.raises(codec.ProfileMismatch, match=codec_profile.id):
        codec.decode(blob)
    with pytest.raises(codec.ProfileMismatch):
        list(codec.decode_layers(blob))
    header = codec.parse_header(blob)
    start = header.section_offset(1)
    with pytest.raises(codec.ProfileMismatch):
        codec.decode_section(header, None, 1, blob[start:start + header.sections[1][0]])


def test_decode_layers_fails_before_yielding(codec_make_kv, blob):
    gen = codec.decode_layers(blob, profile=codec.calibrate([codec_make_kv(3)]))
    with pytest.raises(codec.ProfileMismatch):
        next(gen)


# ------------------------------------------------------------------ device
def _gpu_errors() -> tuple[type[Exception], ...]:
    """ValueError, plus codec.GpuUnavailable (no backend registered, no pycuda, no GPU)."""
    return (ValueError, codec.GpuUnavailable)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda")], ids=str)
def test_cuda_device_without_gpu_is_clear_error(blob, codec_profile, device):
    """No GPU here: a clear error naming cuda and what is missing, raised before any work.

    (The brief asked for ValueError; the GPU path raises codec.GpuUnavailable, a
    RuntimeError with the same purpose, so both are accepted.)
    """
    for call in (lambda: codec.decode(blob, codec_profile, device=device),
                 lambda: next(codec.decode_layers(blob, codec_profile, device=device))):
        with pytest.raises(_gpu_errors()) as info:
            call()
        message = str(info.value)
        assert "cuda" in message.lower()
        assert any(word in message.lower() for word in ("gpu", "pycuda", "not supported", "no cuda"))


def test_meta_device_is_value_error(blob, codec_profile):
    with pytest.raises(ValueError, match="meta"):
        codec.decode(blob, codec_profile, device="meta")


def test_decode_into_a_wrong_buffer_is_refused(blob, codec_profile, small_kv):
    header = codec.parse_header(blob)
    for out in (torch.empty(header.shape, dtype=torch.float32 if header.dtype != torch.float32 else torch.float16),
                torch.empty((header.shape[0] + 1, *header.shape[1:]), dtype=header.dtype),
                torch.empty((*header.shape[:-1], 2 * header.shape[-1]), dtype=header.dtype)[..., ::2],
                torch.empty(header.shape, dtype=header.dtype, device="meta"),
                header.shape):
        with pytest.raises(ValueError, match="out must be"):
            codec.decode(blob, codec_profile, out=out)


def test_a_corrupt_blob_leaves_the_callers_buffer_as_it_was(blob, codec_profile):
    header = codec.parse_header(blob)
    last = header.section_offset(header.layers - 1)
    broken = bytearray(blob)
    broken[last + header.sections[header.layers - 1][0] // 2] ^= 0x40
    out = torch.full(header.shape, 7.0, dtype=header.dtype)
    with pytest.raises(codec.CorruptBitstream):
        codec.decode(bytes(broken), codec_profile, out=out)
    assert (out == 7.0).all()


# ------------------------------------------------------------------ decode_section misuse
def test_decode_section_bad_arguments(blob, codec_profile, small_kv):
    header = codec.parse_header(blob)
    start, length = header.section_offset(0), header.sections[0][0]
    section = blob[start:start + length]
    for layer in (-1, header.layers, 99):
        with pytest.raises(ValueError, match="layer"):
            codec.decode_section(header, codec_profile, layer, section)
    # layer 0's bytes passed as layer 1: caught by length/checksum, never decoded
    with pytest.raises(codec.CorruptBitstream):
        codec.decode_section(header, codec_profile, 1, section)
    with pytest.raises(codec.CorruptBitstream):
        codec.decode_section(header, codec_profile, 0, section[:-1])
    with pytest.raises(codec.CorruptBitstream):
        codec.decode_section(header, codec_profile, 0, section + b"\0")
    good_shape = (2, *small_kv.shape[2:])
    for out in (torch.empty(good_shape, dtype=torch.float16),               # wrong dtype
                torch.empty((2, 39, 3, 5)),                                 # wrong shape
                torch.empty((*good_shape[:-1], 10))[..., ::2]):             # not contiguous
        with pytest.raises(ValueError, match="out"):
            codec.decode_section(header, codec_profile, 0, section, out=out)


def test_decode_rejects_trailing_bytes(blob, codec_profile):
    with pytest.raises(codec.CorruptBitstream, match="header says"):
        codec.decode(blob + b"\0", codec_profile)


@pytest.mark.parametrize("whole", [True, False], ids=["decode", "decode_layers"])
def test_cpu_decode_computes_each_sections_crc_once(blob, codec_profile, crc_calls, whole):
    """The CPU path hands each section over unverified and decode_section's own check
    computes its CRC, once (it was twice: container.section verified it first, issue
    #16); a corrupt section and a truncated blob are still refused."""
    def decode(data: bytes) -> None:
        if whole:
            codec.decode(data, codec_profile)
        else:
            list(codec.decode_layers(data, codec_profile))

    header = codec.parse_header(blob)
    at = header.offsets
    crc_calls.clear()
    decode(blob)
    assert [crc_calls[bytes(blob[at[l]:at[l + 1]])] for l in range(header.layers)] == [1] * header.layers
    damaged = bytearray(blob)
    damaged[at[1] + 9] ^= 0x10
    with pytest.raises(codec.CorruptBitstream, match="layer 1's section checksum"):
        decode(bytes(damaged))
    with pytest.raises(codec.CorruptBitstream, match="header says" if whole else "layer 1's section is"):
        decode(blob[:-1])


def test_parse_header_of_garbage():
    for data in (b"", b"KVWB", b"\0" * 31, b"\0" * 64, b"KVWB" + b"\x02" + b"\0" * 59):
        with pytest.raises(codec.CorruptBitstream):
            codec.parse_header(data)
        with pytest.raises(codec.CorruptBitstream):
            codec.decode(data)
        with pytest.raises(codec.CorruptBitstream):
            codec.inspect(data)


def test_values_too_large_to_quantize_go_raw(codec_profile, small_kv):
    """|x - mean| beyond 2^30 steps cannot be coded: that layer is stored verbatim
    (a raw section, FORMAT.md), exactly, and the other layers are coded as usual."""
    kv = small_kv.clone()
    kv[0, 0, 10] = 3e38
    blob = codec.encode(kv, 0, codec_profile)
    assert codec.inspect(blob)["sections"]["raw_layers"] == [0]
    out = codec.decode(blob, codec_profile)
    assert torch.equal(out[0], kv[0])


# ------------------------------------------------------------------ regressions (bugs found and fixed)
@pytest.mark.parametrize("with_profile", [False, True])
def test_fp16_near_max_decodes_finite(with_profile):
    gen = torch.Generator().manual_seed(0)
    kv = ((torch.rand(1, 2, 200, 2, 3, generator=gen) * 2 - 1) * 65504).half()
    assert bool(torch.isfinite(kv).all())
    profile = codec.calibrate([kv.float()]) if with_profile else None
    out = codec.decode(codec.encode(kv, 4, profile), profile)
    assert bool(torch.isfinite(out).all()), "finite input decoded to inf"


def test_tiny_scale_fp32_meets_target(codec_distortion):
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 2, 50, 2, 3, generator=gen) * 1e-25
    out = codec.decode(codec.encode(kv, 1))
    assert codec_distortion(kv, out, sinks=4) <= 1.15 * codec.DEFAULT_TARGETS[1]


@pytest.mark.parametrize("degenerate", ["constant_layer", "one_token_calibration"])
def test_layer_with_nothing_kept_encodes(degenerate):
    gen = torch.Generator().manual_seed(0)
    if degenerate == "constant_layer":
        calib = torch.randn(2, 2, 50, 1, 2, generator=gen)
        calib[1] = 0.5
    else:
        calib = torch.randn(2, 2, 5, 1, 2, generator=gen)  # one token beyond the 4 sinks
    profile = codec.calibrate([calib])
    assert (profile.kept[:, 1] == 0).all()  # layer 1 codes nothing at any level
    kv = torch.randn(2, 2, 10, 1, 2, generator=gen)
    out = codec.decode(codec.encode(kv, 1, profile), profile)
    assert out.shape == kv.shape
    # nothing coded: layer 1's tokens reconstruct as the calibrated mean
    mean = torch.from_numpy(profile.mean[1]).reshape(2, 1, 1, 2)
    torch.testing.assert_close(out[1, :, 4:], mean.expand(2, 6, 1, 2))


def test_decode_paths_bit_identical():
    gen = torch.Generator().manual_seed(0)
    mismatches = []
    for trial in range(60):
        layers, tokens = int(torch.randint(2, 4, (1,), generator=gen)), int(torch.randint(2, 12, (1,), generator=gen))
        heads, head_dim = int(torch.randint(1, 4, (1,), generator=gen)), int(torch.randint(2, 10, (1,), generator=gen))
        profile = codec.calibrate([torch.randn(layers, 2, 80, heads, head_dim, generator=gen)], sink_tokens=0)
        kv = torch.randn(layers, 2, tokens, heads, head_dim, generator=gen)
        blob = codec.encode(kv, 0, profile)
        whole = codec.decode(blob, profile)
        for layer, k, v in codec.decode_layers(blob, profile):
            if not (torch.equal(k, whole[layer, 0]) and torch.equal(v, whole[layer, 1])):
                mismatches.append((tuple(kv.shape), layer))
    assert not mismatches, f"{len(mismatches)} layers differ, e.g. {mismatches[:3]}"


@pytest.mark.slow
def test_tokens_beyond_format_limit_rejected_at_encode():
    from codec.container import MAX_TOKENS

    kv = torch.zeros(1, 2, MAX_TOKENS + 1, 1, 1, dtype=torch.float16)
    profile = codec.calibrate([torch.randn(1, 2, 64, 1, 1)])
    try:
        blob = codec.encode(kv, 4, profile)
    except ValueError as exc:
        assert "token" in str(exc) or "limit" in str(exc)
        return
    codec.decode(blob, profile)  # must not produce an undecodable blob
