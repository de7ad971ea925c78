"""Inter-layer prediction (profile version 4, blob format 6): each layer coded as what a map
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
    """K-from-K/V-from-V maps are found as such and predicted with their two diagonal
    blocks (half the work): the same numbers as the dense product, and a round trip that
    holds the plain level's error; a dense map is not mistaken for one."""
    plain, dense = profiles
    by_kind = codec.calibrate([chained(seed) for seed in range(3)], predict=3, predict_groups="kind")
    assert by_kind.predictor_by_kind.all()
    assert list(dense.predictor_by_kind) == [prediction.is_intra(layer, 3) for layer in range(6)]
    previous = torch.randn(2, 50, 32, generator=torch.Generator().manual_seed(3))
    for layer in (1, 2, 4, 5):
        maps = by_kind.predictor32[layer]
        torch.testing.assert_close(prediction.predict(previous, maps, kind_blocks=True),
                                   prediction.predict(previous, maps), rtol=1e-5, atol=1e-5)
    kv = chained(21)
    blob = codec.encode(kv, 2, by_kind)
    layered = torch.stack([torch.stack([k, v]) for _, k, v in codec.decode_layers(blob, by_kind)])
    assert torch.equal(layered, codec.decode(blob, by_kind))
    assert relative_error(layered, kv) == pytest.approx(
        relative_error(codec.decode(codec.encode(kv, 2, plain), plain), kv), rel=0.15)


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


