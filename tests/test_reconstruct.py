"""Stage 2 of the device decode (kernels/kvwire_kernels/reconstruct.py) on CPU tensors, against the CPU decoder.

Coefficients are the CPU decoder's own (stage 1 is bit-exact between the numba decoder
and the CUDA kernel: tests/test_kernels.py). What may differ is only the GEMM's
summation order (one zero-padded batched GEMM vs one product per matrix): the identity
transform has no GEMM and must match bit for bit; with a basis the two agree but where
their float32 sums round to neighbouring bfloat16 values (FORMAT.md, "Inverse
transform"; tests/agreement.py).
"""
from __future__ import annotations

import warnings

import pytest
import torch

import codec
from codec.synthetic import chained_kv
from codec import container, layer_codec
from kvwire_kernels import reconstruct

from agreement import assert_decoders_agree


def _kv(seed: int, tokens: int = 90, layers: int = 5) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(12, 12, generator=torch.Generator().manual_seed(7))
    return (torch.randn(layers, 2, tokens, 12, generator=gen) @ mix).reshape(layers, 2, tokens, 3, 4)


def _decode(blob: bytes, profile: codec.Profile | None, group_layers: int) -> torch.Tensor:
    header = codec.parse_header(blob)
    out = torch.full(header.shape, float("nan"), dtype=header.dtype)
    reconstruct.decode_into(blob, profile, out, group_layers)
    return out


def test_identity_transform_matches_the_cpu_decoder_bit_for_bit() -> None:
    profile = codec.calibrate([_kv(1)], transform="identity")
    for level in range(len(profile.levels)):
        blob = codec.encode(_kv(2).half(), level, profile)
        assert torch.equal(_decode(blob, profile, 2), codec.decode(blob, profile))


@pytest.mark.parametrize("transform", ["layer", "head"])
@pytest.mark.parametrize("delta", ["never", "always"])
@pytest.mark.parametrize("group_layers", [1, 2, 5])
def test_batched_gemm_matches_the_cpu_decoder(transform: str, delta: str, group_layers: int) -> None:
    profile = codec.calibrate([_kv(1)], transform=transform, delta=delta)
    kv = _kv(3)
    for level in range(len(profile.levels)):
        for dtype in (torch.float16, torch.bfloat16):
            blob = codec.encode(kv.to(dtype), level, profile)
            got, want = _decode(blob, profile, group_layers), codec.decode(blob, profile)
            assert_decoders_agree(got, want, profile)
        blob = codec.encode(kv, level, profile)
        assert_decoders_agree(_decode(blob, profile, group_layers), codec.decode(blob, profile), profile)


def test_rotary_keys_get_their_rope_back() -> None:
    rope = codec.Rotary(head_dim=4, dim=4, theta=10000.0)
    profile = codec.calibrate([_kv(1, tokens=200)], rotary=rope)
    blob = codec.encode(_kv(4, tokens=70).half(), 1, profile, start=300)
    got, want = _decode(blob, profile, 3), codec.decode(blob, profile)
    assert_decoders_agree(got, want, profile)
    # without RoPE re-applied the keys would be far off: the rotation really ran
    assert (got[:, 0].float() - want[:, 0].float()).abs().max() < 1e-2


def test_raw_layers_sinks_and_an_embedded_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    profile = codec.calibrate([_kv(1)])
    kv = _kv(6).half()
    encode_layer = layer_codec.encode_layer

    def not_layer_1(profile, slot, layer, *args, **kwargs):  # the encoder stores layer 1 raw
        if layer == 1:
            raise layer_codec.NotCodable("test")
        return encode_layer(profile, slot, layer, *args, **kwargs)

    monkeypatch.setattr(layer_codec, "encode_layer", not_layer_1)
    blob = codec.encode(kv, 0, profile, sink_tokens=4)
    assert codec.inspect(blob)["sections"]["raw_layers"] == [1]
    got = _decode(blob, profile, 2)
    assert torch.equal(got[1], kv[1]) and torch.equal(got[:, :, :4], kv[:, :, :4])
    assert_decoders_agree(got, codec.decode(blob, profile), profile)
    embedded = codec.encode(_kv(7).half(), 1, None)    # identity profile inside the blob
    assert torch.equal(_decode(embedded, None, 4), codec.decode(embedded))


def test_out_must_fit_the_blob_and_corrupt_sections_are_caught() -> None:
    profile = codec.calibrate([_kv(1)])
    blob = codec.encode(_kv(8).half(), 1, profile)
    header = codec.parse_header(blob)
    with pytest.raises(ValueError, match="contiguous"):
        reconstruct.decode_into(blob, profile, torch.empty(header.shape, dtype=torch.float32))
    damaged = bytearray(blob)
    damaged[header.section_offset(2) + 5] ^= 0x01
    with pytest.raises(codec.CorruptBitstream, match="layer 2"):
        reconstruct.decode_into(bytes(damaged), profile, torch.empty(header.shape, dtype=header.dtype))


@pytest.mark.parametrize("group_layers", [1, 4])
def test_predicted_blobs_match_the_cpu_decoder_at_the_last_layer(group_layers: int) -> None:
    """Format 6: the batched GEMM, then each layer's prediction in turn. The GEMMs' float32
    rounding is carried from layer to layer through the maps, so the last layer before a
    restart is where the two decoders differ most: still one unit in the last place of
    float16, and 1e-5 relative in float32."""
    rope = codec.Rotary(head_dim=4, dim=4, theta=10000.0)
    profile = codec.calibrate([chained_kv(6, 3, 4, 400, seed) for seed in (1, 2, 3)], predict=6, rotary=rope)
    kv = chained_kv(6, 3, 4, 200, 4)
    for level in range(len(profile.levels)):
        with warnings.catch_warnings():
            warnings.simplefilter("error", codec.ProfileMismatchWarning)   # every layer coded: none raw
            blob = codec.encode(kv.half(), level, profile, start=100)
        assert codec.inspect(blob)["format_version"] == container.PREDICTED_VERSION
        got, want = _decode(blob, profile, group_layers), codec.decode(blob, profile)
        assert_decoders_agree(got, want, profile)
        blob = codec.encode(kv, level, profile, start=100)
        assert_decoders_agree(_decode(blob, profile, group_layers), codec.decode(blob, profile), profile)


def test_a_raw_layer_in_a_predicted_blob_is_predicted_from_exactly() -> None:
    profile = codec.calibrate([chained_kv(6, 3, 4, 90, 1)], predict=6)
    kv = chained_kv(6, 3, 4, 90, 4)
    kv[2] = torch.randn(kv[2].shape, generator=torch.Generator().manual_seed(5)) * 50   # unlike anything
    with pytest.warns(codec.ProfileMismatchWarning):
        blob = codec.encode(kv.half(), 2, profile)
    assert 2 in codec.inspect(blob)["sections"]["raw_layers"]
    got, want = _decode(blob, profile, 4), codec.decode(blob, profile)
    assert torch.equal(got[2], want[2])
    assert_decoders_agree(got, want, profile)
