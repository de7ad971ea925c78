"""A profile's own default level (profile version 5): what ``codec.encode`` uses when the
caller names no level, recorded in the profile file, checked when read."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from safetensors.numpy import load, save

import codec
from codec.calibration import calibrate_like
from codec.profile import PROFILE_VERSION, PROFILE_VERSION_DEFAULT_LEVEL, implicit_default_level


def _metadata(data: bytes) -> dict:
    return json.loads(load(data)["metadata"].tobytes())


def _with_metadata(data: bytes, **changes) -> bytes:
    arrays = load(data)
    meta = json.loads(arrays["metadata"].tobytes())
    meta.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del meta[key]
    arrays["metadata"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    return save(arrays)


@pytest.fixture(scope="module")
def coarse(codec_profile) -> codec.Profile:
    return dataclasses.replace(codec_profile, default_level=3)


def test_a_profile_without_one_defaults_to_the_codecs_level(codec_profile, codec_test_kv) -> None:
    assert codec_profile.default_level == codec.DEFAULT_LEVEL == implicit_default_level(5)
    assert codec.encode(codec_test_kv, profile=codec_profile) == codec.encode(codec_test_kv, codec.DEFAULT_LEVEL,
                                                                              codec_profile)
    # ... and is written as it was before version 5: same bytes, same id
    assert "default_level" not in _metadata(codec_profile.to_bytes())
    assert _metadata(codec_profile.to_bytes())["version"] == PROFILE_VERSION


def test_a_named_default_level_is_what_encode_uses(coarse, codec_test_kv) -> None:
    blob = codec.encode(codec_test_kv, profile=coarse)
    assert codec.inspect(blob)["level"] == 3
    assert blob == codec.encode(codec_test_kv, 3, coarse)
    assert codec.inspect(codec.encode(codec_test_kv, 0, coarse))["level"] == 0   # a named level wins


def test_version_5_round_trips_and_changes_the_id(codec_profile, coarse) -> None:
    data = coarse.to_bytes()
    meta = _metadata(data)
    assert (meta["version"], meta["default_level"]) == (PROFILE_VERSION_DEFAULT_LEVEL, 3)
    again = codec.Profile.from_bytes(data)
    assert again.default_level == 3 and again.id == coarse.id != codec_profile.id


def test_a_profile_of_fewer_levels_defaults_to_its_coarsest(codec_make_kv) -> None:
    two = codec.calibrate([codec_make_kv(0)], targets=(1e-3, 1e-2))
    assert two.default_level == 1 == implicit_default_level(2)
    assert "default_level" not in _metadata(two.to_bytes())


@pytest.mark.parametrize("level", [-1, 5, True, 2.0, "3"])
def test_an_impossible_default_level_is_refused(codec_profile, level) -> None:
    with pytest.raises(ValueError, match="default_level"):
        dataclasses.replace(codec_profile, default_level=level)
    with pytest.raises(codec.CorruptBitstream):
        codec.Profile.from_bytes(_with_metadata(codec_profile.to_bytes(), version=PROFILE_VERSION_DEFAULT_LEVEL,
                                                default_level=level))


def test_version_and_default_level_must_agree(codec_profile, coarse) -> None:
    # a version 1 profile naming a default level, a version 5 one naming none
    with pytest.raises(codec.CorruptBitstream, match="must not carry default_level"):
        codec.Profile.from_bytes(_with_metadata(coarse.to_bytes(), version=PROFILE_VERSION))
    with pytest.raises(codec.CorruptBitstream, match="must carry default_level"):
        codec.Profile.from_bytes(_with_metadata(coarse.to_bytes(), default_level=None))
    # version 5 at the codec's own default: one profile, one file (it is written as version 1)
    with pytest.raises(codec.CorruptBitstream, match="written as version 1 to 4"):
        codec.Profile.from_bytes(_with_metadata(codec_profile.to_bytes(), version=PROFILE_VERSION_DEFAULT_LEVEL,
                                                default_level=codec.DEFAULT_LEVEL))


def test_version_5_carries_a_predictor_or_not(codec_make_kv) -> None:
    sample = codec_make_kv(0)
    predicted = codec.calibrate([sample], predict=2, predict_groups="kind", default_level=3)
    again = codec.Profile.from_bytes(predicted.to_bytes())
    assert again.predicts and again.restart == 2 and again.default_level == 3 and again.id == predicted.id
    # a predictor without its restart period (or the reverse) is corrupt in any version
    with pytest.raises(codec.CorruptBitstream, match="restart period, or neither"):
        codec.Profile.from_bytes(_with_metadata(predicted.to_bytes(), restart=None))


def test_calibrate_checks_the_default_level_before_fitting(codec_make_kv) -> None:
    with pytest.raises(ValueError, match="level must be an int in \\[0, 4\\]"):
        codec.calibrate([codec_make_kv(0)], default_level=5)


def test_a_twin_keeps_the_default_level(codec_make_kv) -> None:
    plain = codec.calibrate([codec_make_kv(0)], default_level=3)
    twin = calibrate_like(plain, [codec_make_kv(0)], predict=2, predict_groups="kind")
    assert twin.predicts and twin.default_level == 3
