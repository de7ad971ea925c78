"""Inter-layer prediction (profile version 4, blob format 7): each layer coded as what a map
from the previous *decoded* layer misses, held to the values' error, decoded layer by layer."""
from __future__ import annotations

import json
import struct
import warnings

import numpy as np
import pytest
import torch
from streamer_helpers import put_context_now

import codec
from codec import container, prediction
from codec.errors import CorruptBitstream, ProfileMismatchWarning
from codec.profile import Profile
from codec.rotary import Rotary, rotate
from codec.synthetic import chained_kv
from streamer.wire.manifest import Manifest, ManifestError


def chained(seed: int, tokens: int = 400) -> torch.Tensor:
    """fp16 KV of 6 layers that follow from one another (``codec.synthetic.chained_kv``)."""
    return chained_kv(6, 2, 16, tokens, seed).half()


@pytest.fixture(scope="module")
def profiles() -> tuple[Profile, Profile]:
    samples = [chained(seed) for seed in range(3)]
    return codec.calibrate(samples), codec.calibrate(samples, predict=3)


def relative_error(decoded: torch.Tensor, kv: torch.Tensor) -> float:
    x = kv.float()
    return float(((decoded.float() - x) ** 2).sum() / ((x - x.mean(dim=2, keepdim=True)) ** 2).sum())


def test_predicted_levels_hold_the_plain_error_in_fewer_bits(profiles):
    plain, predicted = profiles
    kv = chained(99)
    for level in range(len(plain.targets)):
        plain_blob, predicted_blob = codec.encode(kv, level, plain), codec.encode(kv, level, predicted)
        assert codec.inspect(plain_blob)["format_version"] == 5
        assert codec.inspect(predicted_blob)["format_version"] == container.PREDICTED_VERSION
        assert len(predicted_blob) < len(plain_blob), level
        # the step control holds each section against the values' variance, not the residual's
        assert relative_error(codec.decode(predicted_blob, predicted), kv) == pytest.approx(
            relative_error(codec.decode(plain_blob, plain), kv), rel=0.15), level


def test_every_decode_path_gives_the_same_layers(profiles):
    _, predicted = profiles
    kv = chained(7)
    blob = codec.encode(kv, 2, predicted, start=40, sink_tokens=0)
    whole = codec.decode(blob, predicted)
    layered = torch.stack([torch.stack([k, v]) for _, k, v in codec.decode_layers(blob, predicted)])
    assert torch.equal(layered, whole)
    into = torch.full_like(whole, float("nan"))   # a used buffer: every element is written
    assert codec.decode(blob, predicted, out=into) is into and torch.equal(into, whole)
    header = codec.parse_header(blob)
    chain = codec.LayerChain()
    for layer in range(header.layers):
        k, v = codec.decode_section(header, predicted, layer, container.section(blob, header, layer), chain=chain)
        assert torch.equal(k, whole[layer, 0]) and torch.equal(v, whole[layer, 1])


def test_a_decode_starts_at_an_intra_layer_and_needs_the_chain_elsewhere(profiles):
    _, predicted = profiles
    kv = chained(8)
    blob = codec.encode(kv, 3, predicted)
    whole, header = codec.decode(blob, predicted), codec.parse_header(blob)
    assert prediction.restart_layer(4, predicted.restart) == 3
    with pytest.raises(ValueError, match="pass the LayerChain"):
        codec.decode_section(header, predicted, 4, container.section(blob, header, 4))
    chain = codec.LayerChain()
    with pytest.raises(ValueError, match="decode sections in order from layer 3"):
        codec.decode_section(header, predicted, 4, container.section(blob, header, 4), chain=chain)
    for layer in range(3, header.layers):   # layer 3 is coded alone: nothing before it is needed
        k, v = codec.decode_section(header, predicted, layer, container.section(blob, header, layer), chain=chain)
        assert torch.equal(k, whole[layer, 0]) and torch.equal(v, whole[layer, 1])
    k, _ = codec.decode_section(header, predicted, 0, container.section(blob, header, 0))
    assert torch.equal(k, whole[0, 0])


def test_a_raw_layer_is_exact_and_the_next_is_predicted_from_it(profiles):
    _, predicted = profiles
    kv = chained(9)
    kv[2] = (torch.randn(kv[2].shape, generator=torch.Generator().manual_seed(3)) * 40).half()  # unlike anything
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        blob = codec.encode(kv, 2, predicted)
    assert any(issubclass(w.category, ProfileMismatchWarning) for w in caught)
    assert 2 in codec.inspect(blob)["sections"]["raw_layers"]
    decoded = codec.decode(blob, predicted)
    assert torch.equal(decoded[2], kv[2])
    layered = torch.stack([torch.stack([k, v]) for _, k, v in codec.decode_layers(blob, predicted)])
    assert torch.equal(layered, decoded)


def with_rope(kv: torch.Tensor, rotary: Rotary, start: int) -> torch.Tensor:
    """``kv`` as a model at positions ``start ..`` holds it: RoPE on its keys."""
    layers, _, tokens, heads, head_dim = kv.shape
    keys = kv[:, 0].float().reshape(layers, tokens, heads * head_dim)
    out = kv.clone()
    out[:, 0] = rotate(keys, rotary, rotary.angles(start, tokens)).reshape(layers, tokens, heads, head_dim).half()
    return out


def test_rotary_profile_predicts_position_free_keys():
    rotary = Rotary(head_dim=16, dim=16, theta=10000.0)
    samples = [with_rope(chained(seed, tokens=300), rotary, 0) for seed in range(2)]
    predicted = codec.calibrate(samples, rotary=rotary, predict=6)
    plain = codec.calibrate(samples, rotary=rotary)
    kv = with_rope(chained(11, tokens=300), rotary, 1000)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProfileMismatchWarning)
        blob = codec.encode(kv, 1, predicted, start=1000, sink_tokens=0)
        plain_blob = codec.encode(kv, 1, plain, start=1000, sink_tokens=0)
    assert codec.inspect(blob)["sections"]["raw_layers"] == []
    assert len(blob) < len(plain_blob)
    assert relative_error(codec.decode(blob, predicted), kv) == pytest.approx(
        relative_error(codec.decode(plain_blob, plain), kv), rel=0.15)


def test_maps_by_kind_predict_with_their_blocks_alone(profiles):
    """K-from-K/V-from-V maps are found as such and their layers' products take their own
    kind's state alone (half the work): the same numbers as the product over both kinds,
    whose other rows are zero, and a round trip that holds the plain level's error; a
    dense map is not mistaken for one."""
    plain, dense = profiles
    by_kind = codec.calibrate([chained(seed) for seed in range(3)], predict=3, predict_groups="kind")
    assert by_kind.predictor_by_kind.all()
    assert list(dense.predictor_by_kind) == [prediction.is_intra(layer, 3) for layer in range(6)]
    assert list(by_kind.chain_reach) == [0, 32, 32, 0, 32, 32] and list(dense.chain_reach) == [0, 64, 64, 0, 64, 64]
    generator = torch.Generator().manual_seed(3)
    previous = torch.randn(2, 50, 32, generator=generator).bfloat16()
    coef_t = torch.randn(50, 20, generator=generator)
    for layer in (1, 2, 4, 5):
        for kind in range(2):
            whole = prediction.chain_matrix(by_kind.predictor, by_kind.basis, layer, kind, 64)
            assert_one_unit(prediction.coded_state(coef_t, by_kind.chain_matrices[layer][kind], 32,
                                                   prediction.reached(previous, 32, None)[kind]),
                            prediction.coded_state(coef_t, whole, 64, prediction.reached(previous, 64, None)[kind]))
    kv = chained(21)
    blob = codec.encode(kv, 2, by_kind)
    layered = torch.stack([torch.stack([k, v]) for _, k, v in codec.decode_layers(blob, by_kind)])
    assert torch.equal(layered, codec.decode(blob, by_kind))
    assert relative_error(layered, kv) == pytest.approx(
        relative_error(codec.decode(codec.encode(kv, 2, plain), plain), kv), rel=0.15)


def assert_one_unit(got: torch.Tensor, want: torch.Tensor) -> None:
    """bfloat16 tensors equal but where float32 sums in another order round to the next value."""
    ulp = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    assert bool(((got.float() - want.float()).abs() <= ulp).all())
    assert float((got != want).float().mean()) < 0.01


def test_a_state_is_one_bfloat16_product_of_the_previous_state_and_the_coefficients(profiles):
    """FORMAT.md: S_l = bf16([S_{l-1} | bf16(Y^T)] @ bf16([A ; B])), float32 sums of exact
    products: against a float64 sum of the same rounded operands."""
    _, predicted = profiles
    generator = torch.Generator().manual_seed(5)
    previous = (torch.randn(2, 70, 32, generator=generator) * 3).bfloat16()
    coef_t = torch.randn(70, 12, generator=generator) * 5
    for kind in range(2):
        matrix = predicted.chain_matrices[1][kind]
        operand = torch.cat([previous[0], previous[1], coef_t.bfloat16()], dim=1).double()
        want = (operand @ matrix[:64 + 12].double()).to(torch.bfloat16)
        assert_one_unit(prediction.coded_state(coef_t, matrix, 64, prediction.reached(previous, 64, None)[kind]),
                        want)


def test_the_carried_state_is_centered_so_large_means_cost_nothing(profiles):
    """Keys 300 away from zero (real models have channels like that): the state carried
    to the next layer is the values less offsets that follow the means through the maps,
    so its bfloat16 rounding stays on the centered part. Carrying the values themselves
    would round each at 2^-8 of 300, far past level 0's error."""
    samples = [chained(seed) for seed in range(3)]
    for sample in samples:
        sample[:, 0] += 300
    plain, predicted = codec.calibrate(samples), codec.calibrate(samples, predict=3)
    kv = chained(31)
    kv[:, 0] += 300
    plain_error = relative_error(codec.decode(codec.encode(kv, 0, plain), plain), kv)
    predicted_error = relative_error(codec.decode(codec.encode(kv, 0, predicted), predicted), kv)
    assert predicted_error == pytest.approx(plain_error, rel=0.15)


def test_a_receiver_builds_the_chain_tables_before_its_first_decode(profiles):
    """``prepare_decoding`` (what a session runs when it opens a profile) builds what the
    first decode would otherwise build inside a fetch's clock."""
    _, predicted = profiles
    fresh = Profile.from_bytes(predicted.to_bytes())
    assert not {"chain_offsets", "chain_reach", "chain_matrices"} & vars(fresh).keys()
    fresh.prepare_decoding()
    assert {"chain_offsets", "chain_reach", "chain_matrices"} <= vars(fresh).keys()


def test_a_version_6_blob_is_refused_with_its_reason(profiles):
    _, predicted = profiles
    blob = bytearray(codec.encode(chained(4), 1, predicted))
    blob[4] = 6
    with pytest.raises(CorruptBitstream, match="version 6 is no longer read.*encode it again"):
        codec.decode(bytes(blob), predicted)


def test_profile_version_4_round_trips_and_is_checked(profiles):
    _, predicted = profiles
    again = Profile.from_bytes(predicted.to_bytes())
    assert again.id == predicted.id and again.restart == 3 and np.array_equal(again.predictor, predicted.predictor)
    kv = chained(5)
    assert torch.equal(codec.decode(codec.encode(kv, 1, predicted), again), codec.decode(codec.encode(kv, 1, again), predicted))
    assert predicted.predictor.dtype == np.float16 and not predicted.predictor[::3].any()
    arrays = {name: getattr(predicted, name) for name in ("mean", "basis", "steps", "kept", "delta_group", "shift",
                                                          "table", "tables")}
    base = dict(layers=predicted.layers, heads=predicted.heads, head_dim=predicted.head_dim,
                sink_tokens=predicted.sink_tokens, transform=predicted.transform, targets=predicted.targets,
                estimated_bits=predicted.estimated_bits, **arrays)
    with pytest.raises(ValueError, match="zero at the intra-coded layers"):
        bad = predicted.predictor.copy()
        bad[3, 0, 0] = 1
        Profile(**base, predictor=bad, restart=3)
    with pytest.raises(ValueError, match="float16"):
        Profile(**base, predictor=predicted.predictor.astype(np.float32), restart=3)
    with pytest.raises(ValueError, match="restart"):
        Profile(**base, predictor=predicted.predictor, restart=0)
    with pytest.raises(ValueError, match="without a predictor"):
        Profile(**base, restart=3)


def test_version_and_profile_must_agree(profiles):
    plain, predicted = profiles
    kv = chained(6)
    blob = bytearray(codec.encode(kv, 1, plain))
    blob[4] = container.PREDICTED_VERSION   # a plain blob claiming to be predicted
    size = container.header_length(blob)
    blob[size - 4:size] = struct.pack("<I", container.crc32(bytes(blob[:size - 4])))
    with pytest.raises(CorruptBitstream, match="does not predict"):
        codec.decode(bytes(blob), plain)
    exact = codec.encode_exact(kv, predicted)   # the exact level is raw: version 5 names any profile
    assert codec.inspect(exact)["format_version"] == 5
    assert torch.equal(codec.decode(exact, predicted), kv)


def test_a_predicted_context_says_where_its_continuations_start(profiles, tmp_path):
    """The manifest of a context stored with a predicting profile carries its restart
    period (manifest version 4): a continuation at a profile level starts at the layer
    coded alone before the first not delivered, at the exact level (raw) from that layer.
    A context without prediction is still written as version 3."""
    plain, predicted = profiles
    kv = chained(4)
    manifest = put_context_now(str(tmp_path), "ctx", kv, list(range(kv.shape[2])), profile=predicted,
                               chunk_tokens=200, exact=True)
    assert manifest.restart == 3
    doc = json.loads(manifest.to_bytes())
    assert (doc["version"], doc["restart"]) == (4, 3)
    assert Manifest.from_bytes(manifest.to_bytes()) == manifest
    assert [manifest.resume_layer(1, delivered) for delivered in range(6)] == [0, 0, 0, 3, 3, 3]
    assert [manifest.resume_layer(0, delivered) for delivered in range(6)] == list(range(6))   # exact: raw
    same = put_context_now(str(tmp_path), "other", kv, list(range(kv.shape[2])), profile=plain, chunk_tokens=200)
    doc = json.loads(same.to_bytes())
    assert same.restart == 1 and doc["version"] == 3 and "restart" not in doc
    assert [same.resume_layer(1, delivered) for delivered in range(6)] == list(range(6))
    for version, keep in ((3, True), (4, False)):   # restart only in version 4, and always there
        doc = json.loads(manifest.to_bytes())
        doc["version"] = version
        if not keep:
            del doc["restart"]
        with pytest.raises(ManifestError, match="keys"):
            Manifest.from_bytes(json.dumps(doc).encode())
    doc = json.loads(manifest.to_bytes())
    doc["restart"] = 0
    with pytest.raises(ManifestError, match="restart"):
        Manifest.from_bytes(json.dumps(doc).encode())




@pytest.mark.parametrize("delta", ["never", "always"])
def test_the_encoder_carries_the_state_the_decoder_decodes_bit_for_bit(monkeypatch: pytest.MonkeyPatch,
                                                                     delta: str) -> None:
    """The encoder rebuilds each section's coefficients from its own integers
    (``EncodedLayer.dequantized``) instead of entropy-decoding the section: the
    coefficients and the state it carries to the next layer must be the decoder's, bit
    for bit, or the residuals it codes drift from what the decoder adds them to. Delta
    rows (anchors rebuilt on the way) and rows cut into pieces included."""
    from codec import layer_codec
    profile = codec.calibrate([chained(seed, tokens=1500) for seed in range(2)], predict=3, delta=delta)
    assert (profile.delta_group > 0).any() == (delta == "always")
    calls: list[tuple[int, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = []
    coded_state = layer_codec.coded_state

    def recording(profile, layer, coef_t, kept, reached_both):
        state = coded_state(profile, layer, coef_t, kept, reached_both)
        calls.append((layer, coef_t.clone(), state))
        return state

    monkeypatch.setattr(layer_codec, "coded_state", recording)
    lanes = []
    for level in (0, 3):
        blob = codec.encode(chained(11, tokens=1500), level, profile, sink_tokens=4)
        encoder = calls[:]
        calls.clear()
        codec.decode(blob, profile)
        assert len(encoder) == len(calls) == 6
        for (layer, coef, state), (decoded_layer, decoded_coef, decoded_state) in zip(encoder, calls):
            assert layer == decoded_layer and torch.equal(coef, decoded_coef)
            assert all(torch.equal(mine, theirs) for mine, theirs in zip(state, decoded_state))
        calls.clear()
        lanes += codec.inspect(blob)["sections"]["lanes"]
    assert max(lanes) > 2 * 32      # more lanes than rows: rows cut into pieces
