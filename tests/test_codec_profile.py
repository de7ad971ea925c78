"""Profiles: save/load round trips, content-addressed ids, validation of loaded files."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

import codec

ARRAYS = ("mean", "basis", "steps", "kept", "delta_group", "shift", "table", "tables")


def _arrays(profile: codec.Profile) -> dict[str, np.ndarray]:
    return {name: getattr(profile, name) for name in ARRAYS if getattr(profile, name) is not None}


def _safetensors_arrays(profile: codec.Profile) -> dict[str, np.ndarray]:
    from safetensors.numpy import load

    return dict(load(profile.to_bytes()))


def _save(arrays: dict[str, np.ndarray]) -> bytes:
    from safetensors.numpy import save

    return save({k: np.ascontiguousarray(v) for k, v in arrays.items()})


def test_save_load_roundtrip(tmp_path, codec_profile, codec_test_kv):
    path = tmp_path / "p.safetensors"
    codec_profile.save(path)
    loaded = codec.Profile.load(path)
    assert loaded.id == codec_profile.id
    assert loaded is not codec_profile
    for name, array in _arrays(codec_profile).items():
        got = getattr(loaded, name)
        assert got.dtype == array.dtype and got.shape == array.shape, name
        assert np.array_equal(got, array), name
    for attr in ("layers", "heads", "head_dim", "sink_tokens", "transform", "targets", "estimated_bits"):
        assert getattr(loaded, attr) == getattr(codec_profile, attr), attr
    assert loaded.levels == codec_profile.levels
    # blobs of either object decode with the other: the id is all that links them
    blob = codec.encode(codec_test_kv, 2, codec_profile)
    assert codec.encode(codec_test_kv, 2, loaded) == blob
    assert torch.equal(codec.decode(blob, loaded), codec.decode(blob, codec_profile))
    # str paths work too
    codec_profile.save(str(tmp_path / "q.safetensors"))
    assert codec.Profile.load(str(tmp_path / "q.safetensors")).id == codec_profile.id


def test_bytes_roundtrip_and_id_shape(codec_profile):
    raw = codec_profile.to_bytes()
    assert isinstance(raw, bytes)
    again = codec.Profile.from_bytes(raw)
    assert again.id == codec_profile.id
    assert again.to_bytes() == raw
    assert isinstance(codec_profile.id, str) and len(codec_profile.id) == 16
    int(codec_profile.id, 16)
    assert codec.Profile.from_bytes(bytearray(raw)).id == codec_profile.id
    assert codec.Profile.from_bytes(memoryview(raw)).id == codec_profile.id


@pytest.mark.parametrize("transform", ["head", "identity"])
def test_variant_profiles_roundtrip(codec_make_kv, transform):
    profile = codec.calibrate([codec_make_kv(0, tokens=120)], transform=transform, delta="always",
                              targets=(1e-3, 1e-2), sink_tokens=2)
    loaded = codec.Profile.from_bytes(profile.to_bytes())
    assert loaded.id == profile.id
    assert loaded.transform == transform and loaded.sink_tokens == 2
    assert (loaded.basis is None) == (transform == "identity")
    kv = codec_make_kv(1, tokens=60)
    assert codec.encode(kv, 1, loaded) == codec.encode(kv, 1, profile)


def test_calibration_is_deterministic(codec_make_kv, codec_profile):
    assert codec.calibrate([codec_make_kv(0)]).id == codec_profile.id


def test_id_depends_on_content(codec_make_kv, codec_profile):
    ids = {codec_profile.id}
    for kwargs in ({"sink_tokens": 3}, {"transform": "head"}, {"delta": "never"},
                   {"targets": (1e-3, 1e-2)}):
        ids.add(codec.calibrate([codec_make_kv(0)], **kwargs).id)
    ids.add(codec.calibrate([codec_make_kv(7)]).id)
    assert len(ids) == 6


@pytest.mark.parametrize("name", ARRAYS)
def test_id_changes_when_any_array_changes(codec_profile, name):
    """Change one element of one array (keeping the profile valid): the id changes."""
    arrays = _safetensors_arrays(codec_profile)
    array = arrays[name].copy()
    flat = array.reshape(-1)
    if name == "tables":  # keep each row summing to 4096
        row = array[0]
        i = int(np.argmax(row[:127]))
        j = 0 if i != 0 else 1
        row[i] -= 1
        row[j] += 1
    elif name == "kept":
        flat[0] = max(int(flat[0]) - 1, 0)
    elif name == "delta_group":
        flat[0] = 10 - int(flat[0])
    elif name in ("shift", "table"):
        flat[0] = 1 if flat[0] == 0 else flat[0] - 1
    else:
        flat[0] = flat[0] * 1.5 + 0.125
    arrays[name] = array
    changed = codec.Profile.from_bytes(_save(arrays))
    assert changed.id != codec_profile.id, name
    assert not np.array_equal(getattr(changed, name), getattr(codec_profile, name))


def test_id_changes_when_metadata_changes(codec_profile):
    arrays = _safetensors_arrays(codec_profile)
    meta = json.loads(arrays["metadata"].tobytes())
    meta["estimated_bits"] = [b + 0.5 for b in meta["estimated_bits"]]
    arrays["metadata"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    changed = codec.Profile.from_bytes(_save(arrays))
    assert changed.id != codec_profile.id


def test_id_ignores_file_layout(codec_profile):
    """The id hashes content: metadata JSON key order / whitespace does not matter."""
    arrays = _safetensors_arrays(codec_profile)
    meta = json.loads(arrays["metadata"].tobytes())
    arrays["metadata"] = np.frombuffer(json.dumps(dict(reversed(list(meta.items()))), indent=2).encode(),
                                       dtype=np.uint8)
    assert codec.Profile.from_bytes(_save(arrays)).id == codec_profile.id


def test_decode_with_modified_profile_is_refused(codec_profile, codec_test_kv):
    blob = codec.encode(codec_test_kv, 1, codec_profile)
    arrays = _safetensors_arrays(codec_profile)
    arrays["steps"] = arrays["steps"] * np.float32(1.01)
    with pytest.raises(codec.ProfileMismatch):
        codec.decode(blob, codec.Profile.from_bytes(_save(arrays)))


# ------------------------------------------------------------------ malformed files
def test_load_non_profile_files(tmp_path):
    from safetensors.numpy import save

    cases = {
        "empty": b"",
        "text": b"hello, world\n" * 10,
        "json": json.dumps({"format": "kvwire-profile"}).encode(),
        "other_safetensors": save({"weight": np.zeros((3, 3), np.float32)}),
        "blob_not_profile": b"KVWB\x01" + b"\0" * 100,
    }
    for name, data in cases.items():
        path = tmp_path / f"{name}.bin"
        path.write_bytes(data)
        with pytest.raises(codec.CorruptBitstream):
            codec.Profile.load(path)


def test_load_missing_file_is_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        codec.Profile.load(tmp_path / "nope.safetensors")


@pytest.mark.parametrize("mutation", [
    "drop_metadata", "drop_mean", "drop_tables", "wrong_format", "wrong_version",
    "mean_shape", "steps_dtype", "steps_negative", "steps_nan", "mean_inf",
    "table_out_of_range", "shift_too_big", "tables_sum", "tables_no_escape",
    "kept_too_many", "layers_meta", "transform_meta", "targets_meta", "bad_json", "meta_not_utf8",
    "estimated_bits_len", "basis_for_missing_identity", "negative_delta",
    "kept_past_channels", "kept_negative", "basis_nan", "delta_past_tokens", "too_many_tables",
])
def test_malformed_profile_is_corrupt(codec_profile, mutation):
    arrays = _safetensors_arrays(codec_profile)
    meta = json.loads(arrays["metadata"].tobytes())
    if mutation == "drop_metadata":
        del arrays["metadata"]
    elif mutation == "drop_mean":
        del arrays["mean"]
    elif mutation == "drop_tables":
        del arrays["tables"]
    elif mutation == "wrong_format":
        meta["format"] = "something-else"
    elif mutation == "wrong_version":
        meta["version"] = 2
    elif mutation == "mean_shape":
        arrays["mean"] = arrays["mean"][:, :, :-1]
    elif mutation == "steps_dtype":
        arrays["steps"] = arrays["steps"].astype(np.float64)
    elif mutation == "steps_negative":
        arrays["steps"] = -arrays["steps"]
    elif mutation == "steps_nan":
        arrays["steps"] = arrays["steps"].copy()
        arrays["steps"][0, 0, 0] = np.nan
    elif mutation == "mean_inf":
        arrays["mean"] = arrays["mean"].copy()
        arrays["mean"][0, 0, 0] = np.inf
    elif mutation == "table_out_of_range":
        arrays["table"] = np.full_like(arrays["table"], arrays["tables"].shape[0])
    elif mutation == "shift_too_big":
        arrays["shift"] = np.full_like(arrays["shift"], 13)
    elif mutation == "tables_sum":
        arrays["tables"] = arrays["tables"].copy()
        arrays["tables"][0, 0] += 1
    elif mutation == "tables_no_escape":
        t = arrays["tables"].copy()
        t[:, 63] += t[:, 127]
        t[:, 127] = 0
        arrays["tables"] = t
    elif mutation == "kept_too_many":
        arrays["kept"] = np.full_like(arrays["kept"], arrays["basis"].shape[2] + 1)
    elif mutation == "layers_meta":
        meta["layers"] = 3
    elif mutation == "transform_meta":
        meta["transform"] = "wavelet"
    elif mutation == "targets_meta":
        meta["targets"] = meta["targets"][:-1]
    elif mutation == "bad_json":
        arrays["metadata"] = np.frombuffer(b"{not json", dtype=np.uint8)
    elif mutation == "meta_not_utf8":
        arrays["metadata"] = np.frombuffer(b"\xff\xfe{}", dtype=np.uint8)
    elif mutation == "estimated_bits_len":
        meta["estimated_bits"] = meta["estimated_bits"][:-1]
    elif mutation == "basis_for_missing_identity":
        del arrays["basis"]  # a "layer" profile without its basis
    elif mutation == "negative_delta":
        arrays["delta_group"] = -np.ones_like(arrays["delta_group"])
    elif mutation == "kept_past_channels":  # #15: basis padded so kept <= rows, but rows > channels
        channels = arrays["mean"].shape[2]
        basis = np.zeros(arrays["basis"].shape[:2] + (channels + 8, channels), np.float32)
        basis[:, :, : arrays["basis"].shape[2]] = arrays["basis"]
        arrays["basis"] = basis
        arrays["kept"] = np.full_like(arrays["kept"], channels + 8)
    elif mutation == "kept_negative":
        arrays["kept"] = np.full_like(arrays["kept"], -1)
    elif mutation == "basis_nan":
        arrays["basis"] = arrays["basis"].copy()
        arrays["basis"][0, 0, 0, 0] = np.nan
    elif mutation == "too_many_tables":  # each costs a 4 KiB decode lookup: bounded
        arrays["tables"] = np.repeat(arrays["tables"][:1], 257, axis=0)
    elif mutation == "delta_past_tokens":
        arrays["delta_group"] = np.full_like(arrays["delta_group"], 1 << 30)
    if mutation not in ("bad_json", "meta_not_utf8", "drop_metadata"):
        arrays["metadata"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    with pytest.raises(codec.CorruptBitstream):
        codec.Profile.from_bytes(_save(arrays))


# ------------------------------------------------------------------ regressions (bugs found and fixed)
@pytest.mark.parametrize("metadata", [b"[1, 2]", b'"kvwire-profile"', b"42", b"null"])
def test_metadata_not_an_object_is_corrupt(codec_profile, metadata):
    arrays = _safetensors_arrays(codec_profile)
    arrays["metadata"] = np.frombuffer(metadata, dtype=np.uint8)
    with pytest.raises(codec.CorruptBitstream):
        codec.Profile.from_bytes(_save(arrays))


def test_replaced_profile_gets_a_new_id(codec_profile, codec_test_kv, codec_distortion):
    codec_profile.id  # the id is cached once computed (as any use of the profile does)
    coarser = dataclasses.replace(codec_profile, steps=codec_profile.steps * np.float32(4))
    blob = codec.encode(codec_test_kv, 1, coarser)
    try:
        out = codec.decode(blob, codec_profile)
    except codec.ProfileMismatch:
        return  # correct: the blob names the profile it was really encoded with
    # otherwise it decodes with the wrong steps: far off the level's target
    assert codec_distortion(codec_test_kv, out, sinks=4) <= 1.6 * codec_profile.targets[1]


def test_a_level_that_keeps_no_component_calibrates_with_delta_coding() -> None:
    """A target near 1 drops every component of a section; with anchor/delta coding forced
    on, sizing its (empty) delta groups must not fail, and the level still decodes (to the
    mean)."""
    from codec.synthetic import synthetic_kv

    samples = [synthetic_kv(2, 2, 16, 300, seed=s) for s in (1, 2)]
    profile = codec.calibrate(samples, targets=(0.3, 0.9), delta="always")
    assert int(profile.kept[1].min()) == 0   # some section keeps nothing at the coarse level
    kv = synthetic_kv(2, 2, 16, 300, seed=5)
    decoded = codec.decode(codec.encode(kv, 1, profile), profile)
    assert decoded.shape == kv.shape and torch.isfinite(decoded).all()
