"""Closed-loop step control (issue #14 item 3): a level holds its MSE/var target on data
unlike the calibration, and the step each section records is checked before use.

Distortion here is what a user measures per layer K/V: squared error per coded token over
the sum of the chunk's own channel variances (codec.control's docstring).
"""
from __future__ import annotations

import struct
import warnings

import pytest
import torch

import codec
from codec import container, control
from codec.errors import CorruptBitstream
from codec.synthetic import synthetic_kv
from streamer.model import hf

LAYERS, KV_HEADS, HEAD_DIM, TOKENS = 2, 2, 32, 256
#: the levels' promise on any text (issue #14)
BAND = 0.15


@pytest.fixture(scope="module")
def llama_kv() -> torch.Tensor:
    """KV of a small random Llama: calibration on the first TOKENS, measured on the rest."""
    model, _ = hf.random_llama(layers=LAYERS, hidden=128, heads=4, kv_heads=KV_HEADS, seed=0)
    ids = torch.randint(0, 256, (2 * TOKENS,), generator=torch.Generator().manual_seed(1)).tolist()
    return hf.capture_kv(model, None, ids)


@pytest.fixture(scope="module")
def profile(llama_kv) -> codec.Profile:
    return codec.calibrate([llama_kv[:, :, :TOKENS]])


def _assert_within_band(ratio: torch.Tensor) -> None:
    """Every part's MSE/var over its target within +-BAND, the levels' promise."""
    assert float(ratio.min()) > 1 - BAND and float(ratio.max()) < 1 + BAND, ratio


def _per_part(kv: torch.Tensor, out: torch.Tensor, sinks: int) -> torch.Tensor:
    """MSE/var [layers, 2] of a decode, the chunk's own variance."""
    x, y = kv[:, :, sinks:].double(), out[:, :, sinks:].double()
    layers, tokens = x.shape[0], x.shape[2]
    err = (x - y).square().reshape(layers, 2, tokens, -1).sum(-1).mean(-1)
    return err / x.reshape(layers, 2, tokens, -1).var(dim=2, unbiased=False).sum(-1)


def _scaled(kv: torch.Tensor, factor: float) -> torch.Tensor:
    """Each layer K/V's tokens spread ``factor`` times as wide around their own mean."""
    mean = kv.mean(dim=2, keepdim=True)
    return mean + factor * (kv - mean)


def _roundtrip(kv: torch.Tensor, level: int, profile: codec.Profile) -> tuple[bytes, torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("error", codec.ProfileMismatchWarning)  # no layer may go raw here
        blob = codec.encode(kv, level, profile)
    return blob, codec.decode(blob, profile)


@pytest.mark.parametrize("level", range(5))
@pytest.mark.parametrize("factor", [1.0, 10.0, 0.1])
def test_every_level_holds_its_target_on_scaled_chunks(llama_kv, profile, level, factor) -> None:
    """A chunk 10x louder or quieter than the calibration: the profile's step alone would
    give 100x under or over the target; the controlled step lands within +-15%."""
    kv = _scaled(llama_kv[:, :, TOKENS:], factor)
    _, out = _roundtrip(kv, level, profile)
    ratio = _per_part(kv, out, profile.sink_tokens) / profile.targets[level]
    _assert_within_band(ratio)


@pytest.mark.parametrize("level", [1, 3])
def test_a_chunk_from_another_distribution_holds_its_target(llama_kv, profile, level) -> None:
    """Heavy-tailed data of the same shape with the model's layout (its mean and basis):
    not the calibration's distribution, still within +-15% of the target."""
    base = llama_kv[:, :, TOKENS:]
    with torch.random.fork_rng():   # the same draw whatever ran before, and no other test's draw moved
        torch.manual_seed(level)
        noise = torch.distributions.StudentT(3.0).sample(base.shape) * base.std(dim=2, keepdim=True) * 0.3
    kv = base + noise
    _, out = _roundtrip(kv, level, profile)
    ratio = _per_part(kv, out, profile.sink_tokens) / profile.targets[level]
    _assert_within_band(ratio)


def test_the_section_records_the_controlled_step(llama_kv, profile, codec_section_plan) -> None:
    """A 10x louder chunk gets ~10x the profile's step, read back by parse_lanes (the
    function the CPU and GPU decoders take their dequantization step from)."""
    level = 2
    blob, _ = _roundtrip(_scaled(llama_kv[:, :, TOKENS:], 10.0), level, profile)
    for layer in range(LAYERS):
        plan = codec_section_plan(blob, profile, layer)
        for kv in range(2):
            ratio = plan.steps[kv] / float(profile.steps[level, layer, kv])
            assert 4.0 < ratio < 25.0, (layer, kv, ratio)
            assert set(plan.step[:plan.kept[0]] if kv == 0 else plan.step[plan.kept[0]:]) <= {plan.steps[kv]}


def test_short_chunks_keep_the_profiles_steps(llama_kv, profile, codec_section_plan) -> None:
    """Under MISFIT_MIN_TOKENS coded tokens nothing is controlled: their own variance says little."""
    level = 1
    kv = llama_kv[:, :, TOKENS:TOKENS + codec.api.MISFIT_MIN_TOKENS - 1]
    plan = codec_section_plan(codec.encode(kv, level, profile), profile, 0)
    assert plan.steps == tuple(float(profile.steps[level, 0, kv]) for kv in range(2))


def _step_offset(header: container.BlobHeader, layer: int) -> int:
    """Byte offset of layer ``layer``'s K step in the blob (FORMAT.md, version 5 lane table)."""
    return header.section_offset(layer) + header.sink_size + 8


def _forge(blob: bytes, at: int, fmt: str, value) -> bytes:
    """``blob`` with one field rewritten and the section's CRC fixed, so only the value is wrong."""
    header = codec.parse_header(blob)
    forged = bytearray(blob)
    struct.pack_into(fmt, forged, at, value)
    layer = max(l for l in range(header.layers) if header.section_offset(l) <= at)
    start, length = header.section_offset(layer), header.sections[layer][0]
    crc = container.crc32(bytes(forged[start:start + length]))
    struct.pack_into("<I", forged, container.FIXED.size + container.START.size + container.SECTION_ENTRY.size * layer + 4, crc)
    body = bytes(forged[:header.size - 4])
    struct.pack_into("<I", forged, header.size - 4, container.crc32(body))
    return bytes(forged)


@pytest.mark.parametrize("step", [float("nan"), float("inf"), -float("inf"), 0.0, -1.0, 1e-40, 2.0 ** 97])
@pytest.mark.parametrize("part", [0, 1])
def test_a_corrupt_step_is_rejected(llama_kv, profile, step, part) -> None:
    blob = codec.encode(llama_kv[:, :, TOKENS:], 1, profile)
    header = codec.parse_header(blob)
    forged = _forge(blob, _step_offset(header, 1) + 4 * part, "<f", step)
    with pytest.raises(CorruptBitstream, match="step"):
        codec.decode(forged, profile)
    assert torch.isfinite(codec.decode(blob, profile)).all()


def test_kept_rows_beyond_the_profiles_basis_are_rejected(llama_kv, profile) -> None:
    blob = codec.encode(llama_kv[:, :, TOKENS:], 1, profile)
    header = codec.parse_header(blob)
    forged = _forge(blob, _step_offset(header, 0) + 8, "<H", profile.basis.shape[2] + 1)
    with pytest.raises(CorruptBitstream, match="kept"):
        codec.decode(forged, profile)


def test_the_step_bounds_keep_every_value_finite() -> None:
    """FORMAT.md: q < 2^30 steps, an anchor plus a delta < 2^31 steps, finite in float32 at MAX_STEP."""
    import numpy as np

    assert np.isfinite(np.float32(2.0 ** 31) * np.float32(control.MAX_STEP))
    assert np.float32(control.MIN_STEP) == np.finfo(np.float32).tiny  # the least normal float32


def test_embedded_profiles_are_controlled_too() -> None:
    """A blob without a profile fits its own identity profile, controlled the same way."""
    kv = synthetic_kv(LAYERS, KV_HEADS, HEAD_DIM, 300, seed=3)
    for level in (1, 3):
        out = codec.decode(codec.encode(kv, level))
        ratio = _per_part(kv, out, 4) / codec.DEFAULT_TARGETS[level]
        _assert_within_band(ratio)
