"""RoPE-aware keys: ``codec.Rotary``, profiles that carry it, blobs that record their start.

A rotary profile codes keys rotated back to position-free values and the decoder
re-applies RoPE at the positions the blob header records (codec/FORMAT.md).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import codec
from codec.profile import CodedBody
from codec.rotary import rotate, rotate_in_place
from streamer.model import hf, rotary_of

ROPE = codec.Rotary(head_dim=16, dim=16, theta=10000.0)
L, T, H, D = 2, 160, 2, 16


def _rope_keys(pre: torch.Tensor, start: int, rotary: codec.Rotary = ROPE, inverse: bool = False) -> torch.Tensor:
    """[L, 2, T, H, D] with K rotated to positions start.. (V untouched), as a model caches
    it; ``inverse``: rotated back from them."""
    out = pre.clone()
    tokens = pre.shape[2]
    for layer in range(pre.shape[0]):
        keys = pre[layer, 0].reshape(tokens, -1)
        out[layer, 0] = rotate(keys, rotary, rotary.angles(start, tokens), inverse=inverse).reshape(pre[layer, 0].shape)
    return out


def _pre_rope(seed: int, tokens: int = T) -> torch.Tensor:
    """Position-free KV whose keys have a strong per-channel structure (as real pre-RoPE keys)."""
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(L, 2, tokens, H, D, generator=gen)
    kv[:, 0] = kv[:, 0] * torch.linspace(0.3, 2.0, D) + torch.linspace(-2.0, 2.0, D)
    return kv


@pytest.fixture(scope="module")
def rotary_profile() -> codec.Profile:
    return codec.calibrate([_rope_keys(_pre_rope(1, 400), 0)], rotary=ROPE)


# ------------------------------------------------------------------ the rotation
@pytest.mark.parametrize("rotary", [ROPE, codec.Rotary(head_dim=16, dim=8, theta=500000.0, rope_type="linear",
                                                        factor=4.0),
                                    codec.Rotary(head_dim=16, dim=16, theta=500000.0, rope_type="llama3",
                                                 factor=8.0, original_max_positions=64)])
def test_rotate_then_unrotate_is_identity(rotary) -> None:
    keys = torch.randn(50, 3 * 16, generator=torch.Generator().manual_seed(0))
    angles = rotary.angles(12345, 50)
    back = rotate(rotate(keys, rotary, angles), rotary, angles, inverse=True)
    torch.testing.assert_close(back, keys, rtol=0, atol=1e-5)
    if rotary.dim < rotary.head_dim:  # partial rotary: the other channels pass through
        heads = rotate(keys, rotary, angles).reshape(50, 3, 16)
        assert torch.equal(heads[..., rotary.dim:], keys.reshape(50, 3, 16)[..., rotary.dim:])


def test_rotation_at_position_zero_is_the_identity() -> None:
    keys = torch.randn(1, 16)
    assert torch.equal(rotate(keys, ROPE, ROPE.angles(0, 1)), keys)


def test_angles_are_shared_per_position_range_and_rotate_leaves_them_intact() -> None:
    """Every layer of a chunk reuses one (cos, sin): recomputing them was a sixth of a
    30-layer chunk's decode. Shared tensors must come back equal to a fresh computation
    of another range's neighbours, and no rotation may write into them."""
    cos, sin = ROPE.angles(500, 40)
    assert ROPE.angles(500, 40)[0] is cos and ROPE.angles(501, 40)[0] is not cos
    torch.testing.assert_close(ROPE.angles(501, 40)[0][:-1], cos[1:], rtol=0, atol=0)
    before = cos.clone(), sin.clone()
    keys = torch.randn(40, 2 * 16, generator=torch.Generator().manual_seed(1))
    rotate(rotate(keys, ROPE, (cos, sin)), ROPE, (cos, sin), inverse=True)
    assert torch.equal(cos, before[0]) and torch.equal(sin, before[1])


@pytest.mark.parametrize("inverse", [False, True])
def test_rotating_all_layers_at_once_gives_each_layers_bits(inverse: bool) -> None:
    """The encoder rotates a whole stack (or a sample of tokens across layers) in one call;
    the bytes it codes must be those of layer by layer, bit for bit."""
    keys = torch.randn(3, 40, 2 * 16, generator=torch.Generator().manual_seed(2)) * 30
    angles = ROPE.angles(777, 40)
    stacked = rotate(keys, ROPE, angles, inverse=inverse)
    for layer in range(3):
        assert torch.equal(stacked[layer], rotate(keys[layer], ROPE, angles, inverse=inverse))


@pytest.mark.parametrize("rotary", [ROPE, codec.Rotary(head_dim=16, dim=8, theta=500000.0, rope_type="linear",
                                                        factor=4.0)])
def test_the_decoders_in_place_rotation_is_rotates_bit_for_bit(rotary) -> None:
    """The decoder re-applies RoPE in place (one pass, no temporaries): the same float32
    operations as ``rotate``, so the same bits, partial rotary included."""
    keys = torch.randn(70, 3 * 16, generator=torch.Generator().manual_seed(3)) * 50
    angles = rotary.angles(4321, 70)
    expected = rotate(keys, rotary, angles)
    rotate_in_place(keys, rotary, angles)
    assert torch.equal(keys, expected)
    with pytest.raises(ValueError):
        rotate_in_place(keys.T, rotary, angles)


def test_the_decoders_rotation_clamps_in_the_same_pass_as_clamp_does() -> None:
    """With a limit (the decoder's fp16 range), the in-place rotation equals rotating and
    then ``clamp_``: values past it become the limit, NaN stays NaN, the rest untouched."""
    keys = torch.randn(64, 3 * 16, generator=torch.Generator().manual_seed(5)) * 50
    keys[3, 5], keys[7, 9] = 1e9, float("nan")
    rotary = codec.Rotary(head_dim=16, dim=16, theta=10000.0)
    angles = rotary.angles(99, 64)
    limit = float(torch.finfo(torch.float16).max)
    expected = rotate(keys * 1000, rotary, angles).clamp_(-limit, limit)
    clamped = keys * 1000
    rotate_in_place(clamped, rotary, angles, limit=limit)
    assert torch.equal(clamped.isnan(), expected.isnan()) and clamped.isnan().any()
    finite = ~expected.isnan()
    assert torch.equal(clamped[finite], expected[finite])
    assert clamped[finite].abs().max() == limit


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_coded_body_samples_are_the_layers_own_values(dtype: torch.dtype) -> None:
    """The step control samples tokens across layers (``CodedBody.rows``) and the coder
    takes a layer at a time (``CodedBody.layer``): the same float32 values, and the
    caller's KV never written (a float32 KV is converted as a view)."""
    kv = _rope_keys(_pre_rope(5), 900).to(dtype)
    before = kv.clone()
    body = CodedBody(kv, 3, ROPE, start=900)
    rows = torch.tensor([0, 7, 50, 156])
    sampled = body.rows(rows)
    assert body.tokens == T - 3 and sampled.shape == (L, 2, 4, H * D)
    for layer in range(L):
        part = body.layer(layer)
        assert part.shape == (2, T - 3, H * D) and part.dtype == torch.float32
        assert torch.equal(sampled[layer], part[:, rows])
    torch.testing.assert_close(body.layer(1)[0], _pre_rope(5)[1, 0, 3:].reshape(T - 3, -1).to(dtype).float(),
                               rtol=0, atol=0.02 if dtype == torch.float16 else 1e-4)
    assert torch.equal(kv, before)


# ------------------------------------------------------------------ encode / decode
@pytest.mark.parametrize("start", [0, 1, 333, 40_000])
def test_round_trip_at_several_starts_is_within_the_level(rotary_profile, codec_distortion, start) -> None:
    kv = _rope_keys(_pre_rope(2), start)
    for level in (0, 2, 4):
        blob = codec.encode(kv, level, rotary_profile, start=start)
        assert codec.parse_header(blob).start == start
        out = codec.decode(blob, rotary_profile)
        assert torch.equal(out[:, :, :4], kv[:, :, :4])  # sinks verbatim
        assert codec_distortion(kv, out, 4) <= 1.6 * rotary_profile.targets[level]


def test_decoded_keys_are_rope_of_the_position_free_reconstruction(rotary_profile) -> None:
    """A blob encoded at start s decodes to RoPE(s..) of what the same content decodes to at 0."""
    pre = _pre_rope(3)
    start = 1000
    at_s = codec.decode(codec.encode(_rope_keys(pre, start), 2, rotary_profile, start=start, sink_tokens=0),
                        rotary_profile)
    at_0 = codec.decode(codec.encode(_rope_keys(pre, 0), 2, rotary_profile, sink_tokens=0), rotary_profile)
    unrotated = _rope_keys(at_0, 0, inverse=True)  # the position-free reconstruction
    torch.testing.assert_close(at_s, _rope_keys(unrotated, start), rtol=0, atol=1e-3)
    torch.testing.assert_close(at_s[:, 1], at_0[:, 1], rtol=0, atol=1e-5)  # values carry no RoPE


def test_sections_and_layers_reapply_rope_too(rotary_profile) -> None:
    kv = _rope_keys(_pre_rope(4), 77).half()
    blob = codec.encode(kv, 1, rotary_profile, start=77)
    whole = codec.decode(blob, rotary_profile)
    header = codec.parse_header(blob)
    for layer, k, v in codec.decode_layers(blob, rotary_profile):
        section = blob[header.section_offset(layer):header.section_offset(layer + 1)]
        k2, v2 = codec.decode_section(header, rotary_profile, layer, section)
        for a, b in ((k, whole[layer, 0]), (v, whole[layer, 1]), (k2, k), (v2, v)):
            assert torch.equal(a, b)


def test_rope_removal_pays_on_rotated_keys(rotary_profile) -> None:
    """The point of it: position-free keys take fewer bytes than rotated ones."""
    plain = codec.calibrate([_rope_keys(_pre_rope(1, 400), 0)])
    kv = _rope_keys(_pre_rope(5), 2000)
    with_rope = len(codec.encode(kv, 2, rotary_profile, start=2000))
    without = len(codec.encode(kv, 2, plain, start=2000))
    assert with_rope < without


def test_encode_checks_start(rotary_profile) -> None:
    kv = _rope_keys(_pre_rope(6, 8), 0)
    for bad in (-1, 1.5, True, (1 << 32) - 4):
        with pytest.raises(ValueError, match="start"):
            codec.encode(kv, 0, rotary_profile, start=bad)


def test_calibrate_checks_rotary() -> None:
    kv = _pre_rope(7, 32)
    with pytest.raises(ValueError, match="head_dim"):
        codec.calibrate([kv], rotary=codec.Rotary(head_dim=8, dim=8, theta=10000.0))
    with pytest.raises(ValueError, match="codec.Rotary"):
        codec.calibrate([kv], rotary={"theta": 10000.0})


# ------------------------------------------------------------------ the profile
def test_profile_round_trips_rotary(rotary_profile) -> None:
    again = codec.Profile.from_bytes(rotary_profile.to_bytes())
    assert again.rotary == ROPE and again.id == rotary_profile.id
    meta = json.loads(_metadata(rotary_profile.to_bytes()))
    assert meta["version"] == 2 and meta["rotary"]["theta"] == 10000.0
    plain = codec.calibrate([_pre_rope(1, 64)])
    assert json.loads(_metadata(plain.to_bytes()))["version"] == 1 and plain.rotary is None


def _metadata(data: bytes) -> str:
    from safetensors.numpy import load

    return load(data)["metadata"].tobytes().decode()


def _with_meta(profile: codec.Profile, **changes) -> bytes:
    from safetensors.numpy import load, save

    arrays = load(profile.to_bytes())
    meta = json.loads(arrays.pop("metadata").tobytes().decode())
    for key, value in changes.items():
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value
    arrays["metadata"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    return save(arrays)


@pytest.mark.parametrize("field, value", [
    ("theta", float("nan")), ("theta", float("inf")), ("theta", -1.0), ("theta", "10000"), ("theta", 10 ** 400),
    ("head_dim", 10 ** 400), ("original_max_positions", 2 ** 32),
    ("dim", 18), ("dim", 7), ("dim", 0), ("dim", 16.0), ("dim", True), ("head_dim", 8),
    ("rope_type", "yarn"), ("factor", 2.0), ("factor", float("nan")), ("original_max_positions", -5),
])
def test_hostile_rotary_fields_are_refused(rotary_profile, field, value) -> None:
    rotary = dict(ROPE.to_json(), **{field: value})
    with pytest.raises(codec.CorruptBitstream):
        codec.Profile.from_bytes(_with_meta(rotary_profile, rotary=rotary))


@pytest.mark.parametrize("changes", [
    {"rotary": None},                                   # version 2 without rotary
    {"rotary": [1, 2]},                                 # not an object
    {"rotary": dict(ROPE.to_json(), extra=1)},          # unknown key
    {"rotary": {"head_dim": 16, "dim": 16}},            # missing keys
    {"version": 1},                                     # version 1 with rotary
    {"version": 3},
])
def test_malformed_rotary_metadata_is_refused(rotary_profile, changes) -> None:
    with pytest.raises(codec.CorruptBitstream):
        codec.Profile.from_bytes(_with_meta(rotary_profile, **changes))


def test_rotary_validates_its_fields() -> None:
    with pytest.raises(ValueError, match="even"):
        codec.Rotary(head_dim=16, dim=15, theta=10000.0)
    with pytest.raises(ValueError, match="dim"):
        codec.Rotary(head_dim=16, dim=32, theta=10000.0)
    with pytest.raises(ValueError, match="theta"):
        codec.Rotary(head_dim=16, dim=16, theta=float("nan"))
    with pytest.raises(ValueError, match="high_freq_factor"):
        codec.Rotary(head_dim=16, dim=16, theta=1e4, rope_type="llama3", factor=8.0,
                     low_freq_factor=4.0, high_freq_factor=1.0)


def test_an_embedded_profile_never_carries_rotary() -> None:
    kv = _rope_keys(_pre_rope(8, 32), 5)
    blob = codec.encode(kv, 2, start=5)
    assert codec.resolve_profile(codec.parse_header(blob), None)[0].rotary is None
    assert codec.parse_header(blob).start == 5


# ------------------------------------------------------------------ rotary_of
def test_rotary_of_a_llama_matches_its_rotary_embedding() -> None:
    model, tokenizer = hf.random_llama(layers=1, hidden=64, heads=4, kv_heads=2)
    rotary = rotary_of(model)
    assert rotary is not None and rotary.head_dim == 16 and rotary.dim == 16
    assert torch.equal(rotary.inv_freq(), model.model.rotary_emb.inv_freq)
    assert hf.rotary_of is rotary_of
    # the cached keys are RoPE(k_proj(x)): un-rotating them gives the projection back
    pre = {}
    attn = model.model.layers[0].self_attn
    handle = attn.k_proj.register_forward_hook(lambda m, i, o: pre.setdefault("k", o.detach()))
    try:
        kv = hf.capture_kv(model, tokenizer, "rotary position embeddings, in a small random Llama")
    finally:
        handle.remove()
    tokens = kv.shape[2]
    keys = kv[0, 0].reshape(tokens, -1)
    torch.testing.assert_close(rotate(keys, rotary, rotary.angles(0, tokens), inverse=True),
                               pre["k"][0], rtol=1e-5, atol=1e-5)


def test_rotary_of_reads_scaled_llama_configs() -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=16384,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    rotary = rotary_of(config)
    assert rotary.rope_type == "llama3" and rotary.factor == 8.0 and rotary.original_max_positions == 8192
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    torch.testing.assert_close(rotary.inv_freq(), expected.float(), rtol=1e-6, atol=0)


def test_rotary_of_an_encoder_is_none() -> None:
    from transformers import BertConfig

    assert rotary_of(BertConfig(hidden_size=64, num_attention_heads=4)) is None


# ------------------------------------------------------------------ put_context
async def test_put_context_encodes_each_chunk_at_its_own_positions(tmp_path, rotary_profile,
                                                                  codec_distortion) -> None:
    from streamer.store import open_store
    from streamer.store.put import put_context

    kv = _rope_keys(_pre_rope(9, 100), 0)
    store = await open_store(f"file://{tmp_path}")
    try:
        manifest = await put_context(store, "doc", kv, list(range(100)), profile=rotary_profile,
                                     chunk_tokens=32, levels=[1])
        for chunk in manifest.chunks:
            blob = await store.get_chunk("doc", manifest.version, chunk.index, 1)
            assert codec.parse_header(blob).start == chunk.start
            original = kv[:, :, chunk.start:chunk.end]
            decoded = codec.decode(blob, rotary_profile)
            assert codec_distortion(original, decoded, chunk.sink_tokens) <= 1.6 * rotary_profile.targets[1]
    finally:
        await store.close()


# ------------------------------------------------------------------ the model helpers
def test_model_profiles_remove_rope_by_default_and_on_request() -> None:
    from streamer.model import quality

    model, tokenizer = hf.random_llama(layers=1, hidden=32, heads=2, kv_heads=1)
    ids = list(range(40, 140))
    default = quality.calibrate_profile(model, tokenizer, ids)
    assert (default.rotary is not None) == quality.ROTARY_DEFAULT
    assert quality.calibrate_profile(model, tokenizer, ids, rotary=True).rotary == rotary_of(model)
    assert quality.calibrate_profile(model, tokenizer, ids, rotary=False).rotary is None


def test_the_angle_cache_is_bounded_in_bytes_not_entries() -> None:
    """Tables are kept up to ANGLE_CACHE_BYTES, most recent first; one larger than that is
    computed but never kept (a hostile header's token count cannot pin memory)."""
    from codec import rotary as rotary_module

    cache = rotary_module._AngleCache(limit=1 << 20)
    rope = codec.Rotary(head_dim=64, dim=64, theta=10000.0)
    per_table = 2 * 1024 * 64 * 4            # cos and sin of 1024 positions x 64 float32
    for start in range(8):
        cos, sin = cache.get(rope, start * 1024, 1024, torch.device("cpu"))
        assert cos.shape == (1024, 64)
        assert cache.nbytes <= 1 << 20
    assert cache.nbytes == (1 << 20) // per_table * per_table
    again = cache.get(rope, 7 * 1024, 1024, torch.device("cpu"))
    assert again[0] is cos                    # the most recent one is still there
    big = cache.get(rope, 0, 1 << 14, torch.device("cpu"))   # 8 MiB: computed, not kept
    assert big[0].shape == (1 << 14, 64) and cache.nbytes <= 1 << 20
    assert torch.equal(big[0][:1024], rope.angles(0, 1024)[0])
