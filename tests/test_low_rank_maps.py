"""Low-rank inter-layer maps (profile version 6): each K and V map stored as two factors,
the decoders' product taking the previous state through the entry factor first."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load, save

import codec
from codec import container, prediction
from codec.errors import CorruptBitstream
from codec.profile import PROFILE_VERSION_FACTORED, Profile
from codec.synthetic import chained_kv

RANK = 8


def chained(seed: int, tokens: int = 400) -> torch.Tensor:
    """fp16 KV of 6 layers that follow from one another, 32 channels per kind."""
    return chained_kv(6, 2, 16, tokens, seed).half()


def relative_error(decoded: torch.Tensor, kv: torch.Tensor) -> float:
    x = kv.float()
    return float(((decoded.float() - x) ** 2).sum() / ((x - x.mean(dim=2, keepdim=True)) ** 2).sum())


@pytest.fixture(scope="module")
def profiles() -> tuple[Profile, Profile, Profile]:
    """Plain, K-from-K maps, and the same maps at rank RANK (of 32 channels)."""
    samples = [chained(seed) for seed in range(3)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prediction, "LOW_RANK", RANK)
        low_rank = codec.calibrate(samples, predict=3, predict_groups="low-rank")
    return codec.calibrate(samples), codec.calibrate(samples, predict=3, predict_groups="kind"), low_rank


def test_the_maps_are_their_factors_product_fitted_on_the_leading_directions() -> None:
    """Reduced-rank regression: the exit rows are orthonormal, the dense map is the
    factors' product, and at full rank the map is the K-from-K fit itself."""
    values = torch.stack([torch.cat(list(layer), dim=1) for layer in codec.profile.split_tokens(chained(1), 0)])
    full = prediction.fit(values, 3, prediction.kind_groups(32))
    for rank in (RANK, 32):
        maps, entry, exit_ = prediction.fit_low_rank(values, 3, rank)
        assert entry.shape == (6, 2, 32, rank) and exit_.shape == (6, 2, rank, 32)
        assert not entry[::3].any() and not exit_[::3].any() and not maps[::3].any()
        assert np.array_equal(maps, prediction.expand(maps[:, -1], entry, exit_))
        assert prediction.by_kind(maps).all()
        for layer in (1, 2, 4, 5):
            for kind in range(2):
                rows = exit_[layer, kind].astype(np.float64)
                np.testing.assert_allclose(rows @ rows.T, np.eye(rank), atol=2e-3)
        if rank == 32:
            np.testing.assert_allclose(maps[:, :-1].astype(np.float32), full[:, :-1].astype(np.float32), atol=2e-2)
    with pytest.raises(ValueError, match="rank must be in"):
        prediction.fit_low_rank(values, 3, 33)


def test_low_rank_levels_hold_the_plain_error_in_fewer_bits(profiles) -> None:
    plain, by_kind, low_rank = profiles
    assert low_rank.map_rank == RANK and list(low_rank.chain_reach) == [0, RANK, RANK, 0, RANK, RANK]
    kv = chained(99)
    for level in range(len(plain.targets)):
        plain_blob, low_blob = codec.encode(kv, level, plain), codec.encode(kv, level, low_rank)
        assert codec.inspect(low_blob)["format_version"] == container.PREDICTED_VERSION
        assert len(low_blob) < len(plain_blob), level
        assert relative_error(codec.decode(low_blob, low_rank), kv) == pytest.approx(
            relative_error(codec.decode(plain_blob, plain), kv), rel=0.15), level


def test_a_low_rank_state_takes_the_previous_state_through_the_entry_factor(profiles) -> None:
    """FORMAT.md: S_l = bf16([bf16(S_{l-1} @ bf16(E)) | bf16(Y^T)] @ [bf16(F) ; bf16(B)]):
    against float64 sums of the same rounded operands (one bfloat16 unit where float32
    sums in another order round the other way)."""
    *_, low_rank = profiles
    generator = torch.Generator().manual_seed(5)
    previous = (torch.randn(2, 70, 32, generator=generator) * 3).bfloat16()
    coef_t = torch.randn(70, 12, generator=generator) * 5
    entry, exit_ = low_rank.predictor_factors
    for kind in range(2):
        reached = (previous[kind].double() @ torch.from_numpy(entry[1, kind]).bfloat16().double()).bfloat16()
        operand = torch.cat([reached, coef_t.bfloat16()], dim=1).double()
        stacked = torch.cat([torch.from_numpy(exit_[1, kind].astype(np.float32)),
                             torch.from_numpy(low_rank.basis[1, kind, :12])]).bfloat16().double()
        want = (operand @ stacked).to(torch.bfloat16)
        got = prediction.coded_state(coef_t, low_rank.chain_matrices[1][kind], RANK,
                                     prediction.reached(previous, RANK, low_rank.chain_entries[1])[kind])
        ulp = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
        assert bool(((got.float() - want.float()).abs() <= 2 * ulp).all())
        assert float((got != want).float().mean()) < 0.02
    assert low_rank.chain_entries[0] is None and low_rank.chain_entries[3] is None


def test_every_decode_path_gives_the_same_layers(profiles) -> None:
    *_, low_rank = profiles
    kv = chained(7)
    blob = codec.encode(kv, 2, low_rank, start=40, sink_tokens=0)
    whole = codec.decode(blob, low_rank)
    layered = torch.stack([torch.stack([k, v]) for _, k, v in codec.decode_layers(blob, low_rank)])
    assert torch.equal(layered, whole)
    header = codec.parse_header(blob)
    chain = codec.LayerChain()
    for layer in range(header.layers):
        k, v = codec.decode_section(header, low_rank, layer, container.section(blob, header, layer), chain=chain)
        assert torch.equal(k, whole[layer, 0]) and torch.equal(v, whole[layer, 1])


def test_profile_version_6_round_trips_and_a_fresh_one_builds_its_tables(profiles) -> None:
    _, by_kind, low_rank = profiles
    data = low_rank.to_bytes()
    assert json.loads(load(data)["metadata"].tobytes())["version"] == PROFILE_VERSION_FACTORED
    assert "predictor" not in load(data) and "predictor" in load(by_kind.to_bytes())
    again = Profile.from_bytes(data)
    assert again.id == low_rank.id and np.array_equal(again.predictor, low_rank.predictor)
    assert all(np.array_equal(a, b) for a, b in zip(again.predictor_factors, low_rank.predictor_factors))
    assert not {"chain_entries", "chain_matrices"} & vars(again).keys()
    again.prepare_decoding()
    assert {"chain_entries", "chain_matrices", "chain_offsets", "chain_reach"} <= vars(again).keys()
    kv = chained(5)
    assert torch.equal(codec.decode(codec.encode(kv, 1, low_rank), again), codec.decode(codec.encode(kv, 1, again),
                                                                                         low_rank))
    assert len(data) < len(by_kind.to_bytes())
    assert len(data) <= codec.max_profile_bytes(6, 2, 16, len(low_rank.targets))
    with_default = Profile.from_bytes(Profile(**{**_fields(low_rank), "default_level": 0}).to_bytes())
    assert with_default.default_level == 0 and with_default.map_rank == RANK


def _fields(profile: Profile) -> dict:
    names = ("layers", "heads", "head_dim", "sink_tokens", "transform", "targets", "estimated_bits", "mean", "basis",
             "steps", "kept", "delta_group", "shift", "table", "tables", "predictor", "restart", "predictor_factors")
    return {name: getattr(profile, name) for name in names}


def test_factors_are_checked(profiles) -> None:
    *_, low_rank = profiles
    fields = _fields(low_rank)
    entry, exit_ = low_rank.predictor_factors
    with pytest.raises(ValueError, match="factors' product"):
        Profile(**{**fields, "predictor": _fields(profiles[1])["predictor"]})
    bad = entry.copy()
    bad[1, 0, 0, 0] += 1
    with pytest.raises(ValueError, match="factors' product"):
        Profile(**{**fields, "predictor_factors": (bad, exit_)})
    bad = entry.copy()
    bad[3, 0, 0, 0] = 1
    with pytest.raises(ValueError, match="zero at the intra-coded layers"):
        Profile(**{**fields, "predictor_factors": (bad, exit_)})
    with pytest.raises(ValueError, match="float16"):
        Profile(**{**fields, "predictor_factors": (entry.astype(np.float32), exit_)})
    with pytest.raises(ValueError, match=r"\[6, 2, 32, r\]"):
        Profile(**{**fields, "predictor_factors": (entry[..., :4], exit_)})
    with pytest.raises(ValueError, match="without a predictor"):
        Profile(**{**fields, "predictor": None, "restart": 0})
    bad = entry.copy()
    bad[1, 0, 0, 0] = np.inf
    with pytest.raises(ValueError, match="finite"):
        Profile(**{**fields, "predictor_factors": (bad, exit_)})


def _edited(profile: Profile, arrays: dict | None = None, drop: tuple[str, ...] = (), **meta) -> bytes:
    stored = load(profile.to_bytes())
    metadata = json.loads(stored.pop("metadata").tobytes())
    stored.update(arrays or {})
    for name in drop:
        del stored[name]
    metadata.update(meta)
    stored["metadata"] = np.frombuffer(json.dumps(metadata).encode(), dtype=np.uint8)
    return save(stored)


def test_a_malformed_version_6_profile_is_corrupt(profiles) -> None:
    _, by_kind, low_rank = profiles
    cases = [
        (_edited(low_rank, drop=("predictor_exit",)), "all of predictor_constant"),
        (_edited(low_rank, {"predictor": by_kind.predictor}), "not both"),
        (_edited(low_rank, version=5), "must not carry a factored predictor"),
        (_edited(by_kind, version=6), "must carry a factored predictor"),
        (_edited(low_rank, {"predictor_entry": np.zeros((6, 2, 32, 33), np.float16)}), "1 <= r <= 32"),
        (_edited(low_rank, {"predictor_entry": np.zeros((6, 2, 64, RANK), np.float16)}), r"\[6, 2, 32, r\]"),
        (_edited(low_rank, {"predictor_constant": low_rank.predictor[:, -1].astype(np.float32)}), "float16"),
        (_edited(low_rank, drop=("predictor_constant", "predictor_entry", "predictor_exit")), "restart period"),
        (_edited(low_rank, default_level=low_rank.default_level), "written as version 1 to 4 \\(or 6\\) without it"),
    ]
    for data, says in cases:
        with pytest.raises(CorruptBitstream, match=says):
            Profile.from_bytes(data)
