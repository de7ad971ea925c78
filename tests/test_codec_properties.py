"""Hypothesis properties of encode/decode over random shapes, dtypes, levels and scales.

* round trip keeps shape and dtype, sinks bit-exact, and the error within the level's
  target (plus the output dtype's own rounding, which the codec cannot avoid);
* encode and decode are deterministic (same bytes, same tensors);
* decode, decode_layers and decode_section agree on every blob.

KVWIRE_HYPOTHESIS_EXAMPLES=2000 raises the example count (default 60) for a deeper run.
"""
from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import codec

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
#: half an ulp, relative (round to nearest): what rounding the output to the dtype may add
HALF_ULP = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}
EXAMPLES = int(os.environ.get("KVWIRE_HYPOTHESIS_EXAMPLES", "60"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def assert_same_decode(a: torch.Tensor, b: torch.Tensor) -> None:
    """Every decode path writes the very same bits (the GEMM always targets a fresh tensor)."""
    assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


@st.composite
def kv_tensors(draw, max_layers=3, max_tokens=40, max_heads=3, max_head_dim=9):
    layers = draw(st.integers(1, max_layers))
    tokens = draw(st.integers(1, max_tokens))
    heads = draw(st.integers(1, max_heads))
    head_dim = draw(st.integers(1, max_head_dim))
    dtype = draw(st.sampled_from(DTYPES))
    scale = 10.0 ** draw(st.floats(-2, 3))
    offset = draw(st.floats(-5, 5)) * scale
    seed = draw(st.integers(0, 2 ** 31 - 1))
    smooth = draw(st.booleans())
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(layers, 2, tokens, heads, head_dim, generator=gen)
    if smooth:  # temporally correlated (exercises delta coding's gain)
        x = torch.cumsum(x, dim=2) / math.sqrt(max(tokens, 1))
    channel_scale = torch.exp(torch.randn(1, 1, 1, heads, head_dim, generator=gen))
    return (x * channel_scale * scale + offset).to(dtype)


def _check_error(kv: torch.Tensor, out: torch.Tensor, target: float, slack: float, sinks: int) -> None:
    """||err|| <= sqrt(slack * target * variance) + ||output rounding||, over coded tokens."""
    x = kv[:, :, sinks:].double()
    y = out[:, :, sinks:].double()
    if x.shape[2] == 0:
        return
    err = float(((x - y) ** 2).sum().sqrt())
    var = float(((x - x.mean(dim=2, keepdim=True)) ** 2).sum())
    tiny = torch.finfo(kv.dtype).tiny * torch.finfo(kv.dtype).eps  # subnormal spacing
    rounding = float((((x.abs() * HALF_ULP[kv.dtype]) + tiny) ** 2).sum().sqrt())
    bound = math.sqrt(slack * target * var) + rounding + 1e-30
    assert err <= bound * 1.0001, f"error {err:.4g} > bound {bound:.4g} (var {var:.4g})"


@pytest.mark.slow
@SETTINGS
@given(kv=kv_tensors(), level=st.integers(0, len(codec.DEFAULT_TARGETS) - 1),
       sink_tokens=st.one_of(st.none(), st.integers(0, 8)))
def test_roundtrip_without_profile(kv, level, sink_tokens):
    blob = codec.encode(kv, level, sink_tokens=sink_tokens)
    out = codec.decode(blob)
    assert out.shape == kv.shape and out.dtype == kv.dtype
    assert bool(torch.isfinite(out).all())
    sinks = min(4 if sink_tokens is None else sink_tokens, kv.shape[2])
    assert codec.inspect(blob)["sink_tokens"] == sinks
    assert torch.equal(out[:, :, :sinks], kv[:, :, :sinks])
    # fitted on this very data: the target holds (15% slack for delta coding's rounding)
    _check_error(kv, out, codec.DEFAULT_TARGETS[level], 1.15, sinks)
    # deterministic both ways
    assert codec.encode(kv, level, sink_tokens=sink_tokens) == blob
    assert torch.equal(codec.decode(blob), out)


@st.composite
def profile_cases(draw):
    layers = draw(st.integers(1, 3))
    heads = draw(st.integers(1, 3))
    head_dim = draw(st.integers(1, 9))
    transform = draw(st.sampled_from(["layer", "head", "identity"]))
    delta = draw(st.sampled_from(["auto", "never", "always"]))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    scale = 10.0 ** draw(st.floats(-2, 3))
    tokens = draw(st.integers(1, 40))
    dtype = draw(st.sampled_from(DTYPES))
    level = draw(st.integers(0, len(codec.DEFAULT_TARGETS) - 1))
    return layers, heads, head_dim, transform, delta, seed, scale, tokens, dtype, level


def _calibration_for(kv: torch.Tensor, sink_tokens: int = 4) -> codec.Profile:
    """A profile for kv's shape from kv itself plus noise (never zero variance: see
    test_codec_errors.py::test_layer_with_nothing_kept_encodes for why that matters)."""
    x = kv.float()
    gen = torch.Generator().manual_seed(0)
    spread = float(x.std()) if x.numel() > 1 else 0.0
    noise = torch.randn(x.shape[0], 2, 64, *x.shape[3:], generator=gen) * (spread + 1e-3 * float(x.abs().max()) + 1e-6)
    return codec.calibrate([torch.cat([x, x.mean(dim=2, keepdim=True) + noise], dim=2)], sink_tokens=sink_tokens)


def _sample(gen, layers, tokens, heads, head_dim, scale, mix):
    z = torch.randn(layers, 2, tokens, heads * head_dim, generator=gen)
    return ((z @ mix) * scale + scale).reshape(layers, 2, tokens, heads, head_dim)


@SETTINGS
@given(case=profile_cases())
def test_roundtrip_with_profile(case):
    layers, heads, head_dim, transform, delta, seed, scale, tokens, dtype, level = case
    gen = torch.Generator().manual_seed(seed)
    channels = heads * head_dim
    mix = torch.randn(channels, channels, generator=gen) / math.sqrt(channels) + torch.eye(channels)
    calib = _sample(gen, layers, 400, heads, head_dim, scale, mix)
    profile = codec.calibrate([calib], transform=transform, delta=delta)
    kv = _sample(gen, layers, tokens, heads, head_dim, scale, mix).to(dtype)
    blob = codec.encode(kv, level, profile)
    out = codec.decode(blob, profile)
    assert out.shape == kv.shape and out.dtype == dtype
    assert bool(torch.isfinite(out).all())
    sinks = min(4, tokens)
    assert torch.equal(out[:, :, :sinks], kv[:, :, :sinks])
    # unseen data of the calibrated distribution: the *population* variance is known
    # (the sample variance of a handful of tokens is not), so bound the error by it
    coded = tokens - sinks
    if coded >= 8:  # fewer tokens: a single draw far in a dropped component's tail is legal
        err = float(((out[:, :, sinks:].double() - kv[:, :, sinks:].double()) ** 2).sum())
        population_var = float(((calib.double() - calib.double().mean(2, keepdim=True)) ** 2).sum()) \
            / calib.shape[2] * coded
        rounding = float(((kv[:, :, sinks:].double().abs() * HALF_ULP[dtype]) ** 2).sum())
        bound = (math.sqrt(3 * profile.targets[level] * population_var) + math.sqrt(rounding)) ** 2
        # a few tokens can land far from their expectation: allow a generous factor on top
        assert err <= 4 * bound + 1e-30, (err, bound)
    assert codec.encode(kv, level, profile) == blob
    assert torch.equal(codec.decode(blob, profile), out)


@settings(max_examples=max(EXAMPLES // 2, 1), deadline=None)
@given(kv=kv_tensors(max_layers=4), level=st.integers(0, 4), use_profile=st.booleans())
def test_layer_apis_agree(kv, level, use_profile):
    profile = None
    if use_profile:
        profile = _calibration_for(kv, sink_tokens=0)
    blob = codec.encode(kv, level, profile)
    whole = codec.decode(blob, profile)
    header = codec.parse_header(blob[:codec.header_length(blob[:32])])
    assert header.shape == tuple(kv.shape)
    layers = list(codec.decode_layers(blob, profile))
    assert [l for l, _, _ in layers] == list(range(kv.shape[0]))
    for layer, k, v in layers:
        start = header.section_offset(layer)
        section = blob[start:start + header.sections[layer][0]]
        k2, v2 = codec.decode_section(header, profile, layer, section)
        for a, b in ((k, whole[layer, 0]), (v, whole[layer, 1]), (k2, k), (v2, v)):
            assert a.dtype == kv.dtype
            assert_same_decode(a, b)


@settings(max_examples=max(EXAMPLES * 2 // 3, 1), deadline=None)
@given(kv=kv_tensors(), level=st.integers(0, 4))
def test_size_is_monotone_in_level_for_one_input(kv, level):
    """A coarser level never costs more bytes than a finer one (fixed calibrated profile)."""
    profile = _calibration_for(kv)
    if level == len(codec.DEFAULT_TARGETS) - 1:
        return
    fine = len(codec.encode(kv, level, profile))
    coarse = len(codec.encode(kv, level + 1, profile))
    # word-granular rANS: allow a couple of words per lane of slack for tiny inputs
    slack = 16 * kv.shape[0]
    assert coarse <= fine + slack, (fine, coarse)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_many_levels_profile(dtype, codec_make_kv, codec_distortion):
    """A fine-grained 12-level ladder: distortion tracks every target, size strictly falls."""
    targets = tuple(float(t) for t in torch.logspace(-4, -1, 12))
    profile = codec.calibrate([codec_make_kv(0)], targets=targets)
    kv = codec_make_kv(1).to(dtype)
    sizes = []
    for level, target in enumerate(targets):
        blob = codec.encode(kv, level, profile)
        sizes.append(len(blob))
        d = codec_distortion(kv, codec.decode(blob, profile), sinks=4)
        assert target / 4 <= d <= 1.6 * target, (level, d, target)
    assert all(a > b for a, b in zip(sizes, sizes[1:])), sizes
