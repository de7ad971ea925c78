"""The inverse transform's bfloat16 product (codec/FORMAT.md, "Inverse transform").

Decoders round the coefficients and the basis to bfloat16, sum the exact products in
float32 and round the sum once to bfloat16; the mean is added after, in float32. The
tests pin that arithmetic against a float64 reference, the float32 emulation a CPU
without bfloat16 hardware runs against the hardware's, and its cost in a level's error,
also where the KV sits far from zero (a product that took the mean in would lose it).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import codec
from codec import transform
from codec.synthetic import synthetic_kv


def _bf16_unit(values: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 numbers at each of ``values`` (float64)."""
    magnitude = values.abs().clamp_min(2.0 ** -126)
    return torch.exp2(torch.floor(torch.log2(magnitude)) - 7)


def _reference(coef_t: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """The format's product with the sum exact: rounded operands, float64 sum, one rounding."""
    exact = coef_t.to(torch.bfloat16).double() @ basis.double()
    return exact.to(torch.bfloat16).double()


def _assert_one_rounding_apart(got: torch.Tensor, want: torch.Tensor, coef_t: torch.Tensor,
                               basis: torch.Tensor) -> None:
    """Equal, but where the two float32 sums straddle a bfloat16 rounding boundary (one
    unit apart there) or their terms cancel (apart by at most the float32 sums' own
    error, ``kept`` units of 2^-24 of the summed magnitudes each); and that is rare."""
    got, want = got.double(), want.double()
    apart = (got - want).abs()
    kept = coef_t.shape[-1]
    magnitudes = coef_t.to(torch.bfloat16).double().abs() @ basis.double().abs()
    sums_error = 2 * kept * 2.0 ** -24 * magnitudes
    bound = _bf16_unit(torch.maximum(got.abs(), want.abs())) + sums_error
    assert bool((apart <= bound * (1 + 1e-9)).all()), float((apart / bound).max())
    assert float((apart > 0).double().mean()) <= 0.01


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(1, 300), kept=st.integers(1, 96), channels=st.integers(1, 96),
       scale=st.sampled_from([1e-3, 1.0, 40.0]), seed=st.integers(0, 2 ** 16))
def test_product_is_one_rounding_of_the_rounded_operands_products(tokens, kept, channels, scale, seed):
    rows = torch.Generator().manual_seed(seed)
    coef_t = torch.randn(tokens, kept, generator=rows) * scale
    basis = torch.randn(kept, channels, generator=rows).to(torch.bfloat16)
    got = transform.product(coef_t, basis)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, channels)
    _assert_one_rounding_apart(got, _reference(coef_t, basis), coef_t, basis)


def test_the_float32_emulation_agrees_with_the_hardware_product(monkeypatch):
    """A CPU without bfloat16 dot products computes the same numbers (here: whatever this
    CPU's own product is, against the emulation forced), batched as the GPU path is."""
    rows = torch.Generator().manual_seed(3)
    coef_t = torch.randn(6, 512, 183, generator=rows)
    basis = torch.randn(6, 183, 192, generator=rows).to(torch.bfloat16)
    own = transform.product(coef_t, basis)
    monkeypatch.setattr(transform, "native_bfloat16", lambda device: False)
    emulated = transform.product(coef_t, basis)
    _assert_one_rounding_apart(emulated, own, coef_t, basis)
    _assert_one_rounding_apart(emulated, _reference(coef_t, basis), coef_t, basis)


def _kv(offset: float, seed: int) -> torch.Tensor:
    """Correlated float32 KV [layers, 2, tokens, heads, head_dim], every channel
    ``offset`` away from zero on top of its own mean."""
    return synthetic_kv(2, 4, 32, 384, seed=seed) + offset


def _float32_product(coef_t: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    return coef_t @ basis.float()


@pytest.mark.parametrize("offset", [0.0, 300.0])
def test_the_product_costs_the_finest_level_little(monkeypatch, offset):
    """Against float32 products, the bfloat16 one adds under 1e-5 of the variance to the
    error (FORMAT.md models 7e-6): under 5% of level 0's, also 300 away from zero, where
    a product that took the mean in would add about 3e-2."""
    kv = _kv(offset, seed=5)
    profile = codec.calibrate([_kv(offset, seed=6)])
    blob = codec.encode(kv, 0, profile)
    centered = kv - kv.mean(dim=2, keepdim=True)

    def distortion() -> float:
        out = codec.decode(blob, profile).double()
        return float(((out - kv.double()) ** 2).sum() / (centered.double() ** 2).sum())

    fast = distortion()
    monkeypatch.setattr(transform, "product", _float32_product)
    monkeypatch.setattr(type(profile), "basis16", property(lambda p: torch.from_numpy(p.basis)))
    exact = distortion()
    assert 0 < exact <= 1.15 * float(profile.targets[0])   # the level's promise, float32 products
    assert fast <= 1.05 * exact and fast - exact <= 1e-5
