"""Distortion allocation across (layer, K/V) sections (issue #14 item 3): the weights as a
pure function of the sensitivities, profiles that carry them (and older ones that do not),
and the closed-loop control holding each section to its weighted target."""
from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load, save

import codec
from codec import allocation
from codec.errors import CorruptBitstream
from codec.profile import MAX_SECTION_TARGET, PROFILE_VERSION, PROFILE_VERSION_WEIGHTS
# the closed-loop control's own test data and yardstick: a small random Llama's KV, and
# MSE/var per (layer, K/V) against the chunk's own variance, within +-BAND
from test_codec_control import BAND, LAYERS, TOKENS, _per_part, llama_kv  # noqa: F401 (a fixture)

GOLDEN_PROFILE = Path(__file__).parent / "data" / "golden_profile.safetensors"

sensitivities = st.lists(st.floats(min_value=1e-6, max_value=1e6), min_size=1, max_size=64).map(np.array)


# ---------------------------------------------------------------- allocation math
@settings(max_examples=200, deadline=None)
@given(sensitivities)
def test_weights_keep_the_geometric_mean_and_the_clamp(s: np.ndarray) -> None:
    w = allocation.allocate(s).astype(np.float64)
    assert w.shape == s.shape and w.dtype == np.float64
    assert abs(float(np.log(w).mean())) < 1e-5  # equal bits under the high-rate model
    assert w.min() >= 1 / allocation.MAX_WEIGHT * (1 - 1e-6) and w.max() <= allocation.MAX_WEIGHT * (1 + 1e-6)


@settings(max_examples=200, deadline=None)
@given(sensitivities)
def test_weights_fall_as_sensitivity_rises(s: np.ndarray) -> None:
    w = allocation.allocate(s)
    order = np.argsort(s, kind="stable")
    assert np.all(np.diff(w[order].astype(np.float64)) <= 1e-6 * w.max())


@settings(max_examples=100, deadline=None)
@given(sensitivities, st.floats(min_value=1e-3, max_value=1e3))
def test_weights_depend_only_on_ratios(s: np.ndarray, scale: float) -> None:
    np.testing.assert_allclose(allocation.allocate(s * scale), allocation.allocate(s), rtol=1e-5)


def test_unclamped_weights_are_inverse_sensitivity() -> None:
    s = np.array([1.0, 2.0, 4.0, 0.5])
    w = allocation.allocate(s)
    np.testing.assert_allclose(w * s, np.full(4, (s.prod()) ** 0.25), rtol=1e-5)
    np.testing.assert_allclose(allocation.allocate(np.full(6, 3.0)), np.ones(6), rtol=1e-6)


def test_clamped_weights_minimise_the_proxy_at_equal_bits() -> None:
    """Against random feasible weights of the same geometric mean, none has a lower
    sum(s * w) (the optimum under the clamp)."""
    rng = np.random.default_rng(0)
    s = np.exp(rng.normal(0, 3, size=20))  # a spread far past the clamp
    w = allocation.allocate(s).astype(np.float64)
    assert np.isclose(w.max(), 8, rtol=1e-5) and np.isclose(w.min(), 1 / 8, rtol=1e-5)
    best = float(s @ w)
    bound = math.log(allocation.MAX_WEIGHT)
    for _ in range(2000):
        other = np.log(w) + rng.normal(0, 0.3, size=20)
        for _ in range(50):  # project onto mean 0 within the clamp
            other = np.clip(other - other.mean(), -bound, bound)
        if abs(other.mean()) < 1e-9:
            assert float(s @ np.exp(other)) >= best * (1 - 1e-6)


def _low_rate_overspend(target: float):
    """Bits over the uniform split under a rate model with a floor: -0.5 * log2(t) bits
    per section, but never below 0 (a section coarser than its variance costs nothing,
    so past that point it saves no more): the low-rate regime the geometric mean misses."""
    def bits(t: np.ndarray) -> float:
        return float(np.maximum(-0.5 * np.log2(np.minimum(t, 1.0)), 0.0).sum())

    return lambda w: bits(target * w.astype(np.float64)) - bits(np.full(w.shape, target))


@settings(max_examples=100, deadline=None)
@given(sensitivities, st.floats(min_value=0.05, max_value=0.9))
def test_budgeted_weights_spend_no_more_than_uniform(s: np.ndarray, target: float) -> None:
    overspend = _low_rate_overspend(target)
    w = allocation.allocate(s)
    fitted = allocation.fit_to_budget(w, overspend)
    assert fitted.dtype == np.float32 and fitted.shape == w.shape
    assert overspend(fitted) <= 1e-9
    bound = allocation.MAX_WEIGHT * (1 + 1e-6)
    assert fitted.min() >= 1 / bound and fitted.max() <= bound
    if overspend(w) <= 0:  # already within budget: left as it was
        np.testing.assert_array_equal(fitted, w)
    else:  # one scale up (ratios kept where unclamped), and the smallest that fits
        assert np.all(fitted >= w * (1 - 1e-6))
        free = (fitted > 1 / bound) & (fitted < allocation.MAX_WEIGHT / (1 + 1e-6))
        if free.sum() > 1:
            ratio = fitted[free].astype(np.float64) / w[free]
            assert np.ptp(ratio) <= 1e-5 * ratio.max()
        tighter = np.clip(fitted.astype(np.float64) * 0.99, 1 / allocation.MAX_WEIGHT, allocation.MAX_WEIGHT)
        assert overspend(tighter) > 0 or np.array_equal(tighter, fitted)


def test_an_overspending_allocation_is_scaled_up() -> None:
    """The geometric-mean weights overspend when one section is past the floor."""
    w = allocation.allocate(np.array([1.0, 64.0]))  # weights 8 and 1/8
    overspend = _low_rate_overspend(0.5)
    assert overspend(w) > 0.5  # 4 - 2 is the finer one's cost; the coarser saves only 0.5
    fitted = allocation.fit_to_budget(w, overspend)
    assert abs(overspend(fitted)) < 1e-3 and fitted[1] > w[1]


def test_uniform_weights_stay_one() -> None:
    ones = np.ones((3, 2), dtype=np.float32)
    np.testing.assert_array_equal(allocation.fit_to_budget(ones, _low_rate_overspend(0.1)), ones)


@pytest.mark.parametrize("bad", [[], [1.0, 0.0], [1.0, -2.0], [1.0, float("nan")], [float("inf")]])
def test_allocate_rejects_unusable_sensitivities(bad) -> None:
    with pytest.raises(ValueError):
        allocation.allocate(np.array(bad))


# ---------------------------------------------------------------- profiles
WEIGHTS = np.array([[4.0, 0.25], [1.0, 1.0]], dtype=np.float32)


@pytest.fixture(scope="module")
def weighted(llama_kv) -> codec.Profile:
    return codec.calibrate([llama_kv[:, :, :TOKENS]], weights=WEIGHTS)


def _version(profile_bytes: bytes) -> int:
    return json.loads(load(profile_bytes)["metadata"].tobytes())["version"]


@pytest.fixture(scope="module")
def drifting_kv() -> torch.Tensor:
    """A smooth random walk over 4096 tokens with values 3x keys: enough tokens that the
    entropy estimates settle, and coarse levels where the rate model's floor shows."""
    g = torch.Generator().manual_seed(0)
    steps = torch.randn(2, 2, 4100, 2, 32, generator=g) * torch.tensor([1.0, 3.0]).view(1, 2, 1, 1, 1)
    return steps.cumsum(2) * 0.05


def test_allocated_profile_spends_no_more_than_uniform(drifting_kv, monkeypatch) -> None:
    """At the default level the allocated profile's own estimate stays within the uniform
    one's, where the geometric-mean weights alone overspend."""
    extreme = np.array([[8.0, 0.125], [8.0, 0.125]], dtype=np.float32)
    uniform = codec.calibrate([drifting_kv])
    fitted = codec.calibrate([drifting_kv], weights=extreme)
    level = codec.DEFAULT_LEVEL
    assert fitted.estimated_bits[level] <= uniform.estimated_bits[level]
    assert np.all(fitted.weights >= extreme) and fitted.weights.max() <= allocation.MAX_WEIGHT
    monkeypatch.setattr(codec.profile, "_budget_weights", lambda bases, targets, w, ratio: w)
    unfitted = codec.calibrate([drifting_kv], weights=extreme)
    assert unfitted.estimated_bits[level] > uniform.estimated_bits[level]  # what the fit corrects


def test_weighted_profile_round_trips(weighted, llama_kv) -> None:
    data = weighted.to_bytes()
    back = codec.Profile.from_bytes(data)
    assert _version(data) == PROFILE_VERSION_WEIGHTS
    np.testing.assert_array_equal(back.weights, WEIGHTS)
    assert back.id == weighted.id
    plain = codec.calibrate([llama_kv[:, :, :TOKENS]])
    assert plain.weights is None and plain.id != weighted.id
    assert _version(plain.to_bytes()) == PROFILE_VERSION
    assert codec.Profile.from_bytes(plain.to_bytes()).weights is None
    # the steps were designed for the weighted targets: coarser where the weight is larger
    assert np.all(weighted.steps[:, 0, 0] > plain.steps[:, 0, 0])
    assert np.all(weighted.steps[:, 0, 1] < plain.steps[:, 0, 1])
    for level in range(len(weighted.targets)):
        assert weighted.section_target(level, 0, 0) == pytest.approx(
            min(4 * weighted.targets[level], MAX_SECTION_TARGET))
        assert weighted.section_target(level, 1, 1) == plain.section_target(level, 1, 1) == plain.targets[level]


def test_an_older_profile_reads_and_writes_as_it_was() -> None:
    data = GOLDEN_PROFILE.read_bytes()
    profile = codec.Profile.from_bytes(data)
    assert profile.weights is None
    again = codec.Profile.from_bytes(profile.to_bytes())
    assert again.id == profile.id and _version(profile.to_bytes()) == _version(data)


def _with_metadata(data: bytes, **changes) -> bytes:
    arrays = load(data)
    meta = json.loads(arrays["metadata"].tobytes())
    meta.update(changes)
    arrays["metadata"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    return save(arrays)


def test_weights_and_version_must_agree(weighted) -> None:
    data = weighted.to_bytes()
    with pytest.raises(CorruptBitstream, match="must not carry weights"):
        codec.Profile.from_bytes(_with_metadata(data, version=PROFILE_VERSION))
    arrays = load(data)
    del arrays["weights"]
    with pytest.raises(CorruptBitstream, match="must carry weights"):
        codec.Profile.from_bytes(save(arrays))


@pytest.mark.parametrize("bad", [np.full((2, 2), 9.0, np.float32), np.full((2, 2), np.nan, np.float32),
                                 np.ones((3, 2), np.float32), np.ones((2, 2), np.float64)])
def test_unusable_weights_are_rejected(weighted, llama_kv, bad) -> None:
    arrays = load(weighted.to_bytes())
    arrays["weights"] = bad
    with pytest.raises(CorruptBitstream, match="weights"):
        codec.Profile.from_bytes(save(arrays))
    if bad.dtype == np.float32:
        with pytest.raises(ValueError, match="weights"):
            codec.calibrate([llama_kv[:, :, :TOKENS]], weights=bad)


# ---------------------------------------------------------------- closed-loop control
@pytest.mark.parametrize("level", [0, 2, 4])
def test_the_control_holds_each_section_to_its_weighted_target(weighted, llama_kv, level) -> None:
    kv = llama_kv[:, :, TOKENS:]
    with warnings.catch_warnings():
        warnings.simplefilter("error", codec.ProfileMismatchWarning)
        blob = codec.encode(kv, level, weighted)
    out = codec.decode(blob, weighted)
    targets = torch.tensor([[weighted.section_target(level, layer, kind) for kind in range(2)]
                            for layer in range(LAYERS)], dtype=torch.float64)
    ratio = _per_part(kv, out, weighted.sink_tokens) / targets
    assert float(ratio.min()) > 1 - BAND and float(ratio.max()) < 1 + BAND, ratio
