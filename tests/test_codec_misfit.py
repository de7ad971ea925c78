"""A profile that does not fit the data is detected while encoding (issue #14 item 7).

A same-shape profile from another model used to be accepted silently: a level-1 blob
larger than fp16 with 24x the level's target error. Now ``encode`` measures, per layer
K/V, the MSE/var the components the profile's level drops lose (no step corrects it); past
``MISFIT_FACTOR`` times the target the layer is stored raw (exact, never larger than the tensor) and a
``ProfileMismatchWarning`` names the layers and the error.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import codec
from codec import api
from codec.errors import ProfileMismatchWarning
from codec.profile import CodedBody
from codec.synthetic import synthetic_kv
from streamer.model import hf

LAYERS, KV_HEADS, HEAD_DIM, TOKENS = 2, 2, 32, 256


def _llama_kv(seed: int) -> torch.Tensor:
    """KV of a small random Llama (2 layers x 2 KV heads x 32): real model activations."""
    model, _ = hf.random_llama(layers=LAYERS, hidden=128, heads=4, kv_heads=KV_HEADS, seed=0)
    ids = torch.randint(0, 256, (2 * TOKENS,), generator=torch.Generator().manual_seed(seed)).tolist()
    return hf.capture_kv(model, None, ids)


@pytest.fixture(scope="module")
def llama_kv() -> torch.Tensor:
    return _llama_kv(1)


@pytest.fixture(scope="module")
def own_profile(llama_kv) -> codec.Profile:
    return codec.calibrate([llama_kv[:, :, :TOKENS]])


@pytest.fixture(scope="module")
def other_profile() -> codec.Profile:
    """Same shape, another 'model': structured synthetic KV whose PCA keeps other components."""
    return codec.calibrate([synthetic_kv(LAYERS, KV_HEADS, HEAD_DIM, 512, seed=1)])


def _encode(kv: torch.Tensor, level: int, profile: codec.Profile) -> tuple[bytes, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        blob = codec.encode(kv, level, profile)
    return blob, [w for w in caught if issubclass(w.category, ProfileMismatchWarning)]


def _per_part(kv: torch.Tensor, out: torch.Tensor, sinks: int) -> torch.Tensor:
    x, y = kv[:, :, sinks:].double(), out[:, :, sinks:].double()
    tokens = x.shape[2]
    err = (x - y).square().reshape(LAYERS, 2, tokens, -1).sum(-1).mean(-1)
    return err / x.reshape(LAYERS, 2, tokens, -1).var(dim=2, unbiased=False).sum(-1)


def test_the_controlled_distortion_is_what_the_decoder_gives(llama_kv, own_profile) -> None:
    """The control measures the encoder's real error (sampled), not a guess: compared with a
    decode of the same blob, per layer K/V, within sampling noise."""
    kv = llama_kv[:, :, TOKENS:].half()
    sinks = own_profile.sink_tokens
    for level in (0, 2, 4):
        controls = api.control_chunk(own_profile, level, api.control_samples(
            own_profile, [level], CodedBody(kv, sinks, None)))
        estimated = torch.tensor([[part.achieved for part in parts] for parts in controls], dtype=torch.float64)
        out = codec.decode(codec.encode(kv, level, own_profile), own_profile)
        real = _per_part(kv.float(), out.float(), sinks)
        torch.testing.assert_close(estimated, real, rtol=0.15, atol=0.0)


@pytest.mark.parametrize("level", [1, 3])
def test_a_fitting_profile_codes_every_layer_without_a_warning(llama_kv, own_profile, level) -> None:
    blob, caught = _encode(llama_kv[:, :, TOKENS:].half(), level, own_profile)
    assert caught == []
    assert codec.inspect(blob)["sections"]["raw_layers"] == []


@pytest.mark.parametrize("level", [1, 3])
def test_a_profile_from_another_model_is_detected_and_never_costs_quality(llama_kv, other_profile, level) -> None:
    kv = llama_kv[:, :, TOKENS:].half()
    blob, caught = _encode(kv, level, other_profile)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert other_profile.id in message and "another model" in message and f"level {level}" in message
    info = codec.inspect(blob)
    assert info["sections"]["raw_layers"] == list(range(LAYERS))
    header = info["sections"]["header"]
    assert len(blob) <= kv.numel() * 2 + header          # never bigger than fp16 plus the header
    assert torch.equal(codec.decode(blob, other_profile), kv)  # and exact, not 24x the target


def test_the_warning_can_be_made_an_error(llama_kv, other_profile) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProfileMismatchWarning)
        with pytest.raises(ProfileMismatchWarning, match="does not fit this KV"):
            codec.encode(llama_kv[:, :, TOKENS:].half(), 1, other_profile)


def test_only_the_layers_that_do_not_fit_go_raw(llama_kv, own_profile) -> None:
    kv = llama_kv[:, :, TOKENS:].clone()
    kv[1] = kv[1] * 1e-3 + 0.5   # layer 1: far below the calibrated spread, off its mean
    blob, caught = _encode(kv.half(), 1, own_profile)
    assert len(caught) == 1 and "Layers [1]" in str(caught[0].message)
    assert codec.inspect(blob)["sections"]["raw_layers"] == [1]


def test_short_chunks_are_not_judged(other_profile) -> None:
    """Under MISFIT_MIN_TOKENS coded tokens the data's own variance says too little."""
    kv = _llama_kv(2)[:, :, :api.MISFIT_MIN_TOKENS - 1].half()
    _, caught = _encode(kv, 1, other_profile)
    assert caught == []


def test_a_constant_tensor_is_named_for_its_zero_variance_not_an_infinite_ratio(own_profile, llama_kv) -> None:
    """MSE/var of a part with no variance is infinite for any error: the warning says so
    in words instead of printing 'inf (infx its target)'."""
    constant = torch.full_like(llama_kv[:, :, :TOKENS], 0.75) + llama_kv[:, :, :1]   # each channel constant in time
    blob, warned = _encode(constant, 0, own_profile)
    assert warned, "a constant tensor does not fit a profile calibrated on real KV"
    message = str(warned[0].message)
    assert "zero variance" in message and "measures inf" not in message and "infx" not in message, message
    assert torch.equal(codec.decode(blob, own_profile).to(constant.dtype), constant)   # raw: exact
