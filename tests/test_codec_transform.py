"""The fast forward transform quantizes exactly as the float64 reference does.

``transform.forward_bounded`` takes the coefficients from a float32 GEMM, whose rounding
depends on the BLAS kernel, and ``rans.quantize_rows`` uses their error bound to decide
each integer as the reference coefficients (``transform.forward``: float64, rounded once)
would. Here another BLAS's rounding is stood in for by moving every value anywhere
within its bound, pushed towards the nearest rounding boundary where that is possible:
the integers must not move. A bound too small by a factor would let them.
"""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import codec
from codec import layer_codec, rans, transform
from codec.entropy import symbol_cost_bits


def _basis(channels: int, kept: int, seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(channels, channels, generator=torch.Generator().manual_seed(seed),
                                       dtype=torch.float64))
    return q.T[:kept].to(torch.float32).contiguous()


def _quantize(values: np.ndarray, coef: transform.Coefficients, step: float, group: int = 0) -> np.ndarray:
    rows, tokens = values.shape
    freq = np.full((1, 128), 32, dtype=np.uint16)  # flat, and typed as the coder's own tables
    q = np.empty((rows, tokens), dtype=np.int32)
    status = rans.quantize_rows(values, coef.basis, coef.tokens, coef.row_bound, coef.token_norm,
                                np.full(rows, step, np.float32), np.full(rows, group, np.int32),
                                np.zeros((rows, 2), np.uint8), np.zeros((rows, 2), np.uint8), freq,
                                symbol_cost_bits(freq), q, np.empty(rows))
    assert status == rans.OK
    return q


@settings(max_examples=40, deadline=None)
@given(channels=st.integers(2, 96), tokens=st.integers(1, 64), seed=st.integers(0, 2 ** 16),
       scale=st.sampled_from([1e-3, 1.0, 40.0]), steps_per_sigma=st.sampled_from([0.5, 4.0, 64.0]),
       group=st.sampled_from([0, 3]), push=st.sampled_from([-1.0, 1.0, 0.0]))
def test_values_anywhere_within_the_bound_quantize_as_the_reference(channels, tokens, seed, scale,
                                                                    steps_per_sigma, group, push):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, channels, generator=gen) * scale
    mean = torch.randn(channels, generator=gen) * scale * 0.1
    basis = _basis(channels, max(1, channels * 3 // 4), seed)
    fast = transform.forward_bounded(x, mean, basis)
    reference = transform.forward(x, mean, basis).numpy()
    step = float(np.float32(scale / steps_per_sigma))
    exact = transform.Coefficients(reference, fast.basis, fast.tokens, np.zeros_like(fast.row_bound),
                                   fast.token_norm)
    expected = _quantize(reference, exact, step, group)
    assert np.array_equal(_quantize(fast.values, fast, step, group), expected)
    # another kernel's rounding, as far off as any float32 dot product may be (gamma_C sum|b_i x_i|
    # from the exact value, which is within half an ulp of the reference), towards a boundary
    gamma = channels * 2.0 ** -24 / (1 - channels * 2.0 ** -24)
    centered = (x - mean).double().abs().numpy()
    bound = (gamma * (basis.double().abs().numpy() @ centered.T) + 2.0 ** -25 * np.abs(reference)).astype(np.float32)
    rng = np.random.default_rng(seed)
    direction = np.sign(reference / step - np.rint(reference / step)) if push == 0 else push
    moved = (reference + direction * bound * rng.uniform(0.5, 1.0, reference.shape).astype(np.float32))
    assert np.array_equal(_quantize(moved.astype(np.float32), fast, step, group), expected)


def test_values_at_rounding_boundaries_are_decided_by_the_reference():
    """Coefficients put on a half step (where a float32 GEMM's last bit decides) quantize as
    the float64 reference does, whichever side of the boundary the fast values fall."""
    gen = torch.Generator().manual_seed(3)
    channels, tokens = 64, 200
    basis = _basis(channels, channels, 3)
    x = torch.randn(tokens, channels, generator=gen)
    step = 0.125
    # move each token along basis row 0 so that its first coefficient lands on a half step
    first = transform.forward(x, torch.zeros(channels), basis).numpy()[0].astype(np.float64)
    target = (np.floor(first / step) + 0.5) * step
    x = x + torch.from_numpy(target - first).float()[:, None] * basis[0]
    fast = transform.forward_bounded(x, torch.zeros(channels), basis)
    reference = transform.forward(x, torch.zeros(channels), basis).numpy()
    near = np.abs(np.abs(reference[0] / step - np.floor(reference[0] / step)) - 0.5) < 1e-4
    assert near.mean() > 0.9  # the construction did put them on the boundary
    exact = transform.Coefficients(reference, fast.basis, fast.tokens, np.zeros_like(fast.row_bound),
                                   fast.token_norm)
    expected = _quantize(reference, exact, step)
    for nudge in (-1, 1):  # a kernel that rounds the other way, by an ulp each side
        values = fast.values.copy()
        values[0] = np.nextafter(reference[0], np.float32(nudge * np.inf))
        assert np.array_equal(_quantize(values, fast, step), expected)


def test_identity_and_reduced_precision_products_are_exact():
    """No basis (identity) and a caller's bf16/TF32 matmul setting both give the reference's
    own values, marked exact (bound 0), and the same blob bytes."""
    x = torch.randn(30, 12)
    mean = torch.randn(12)
    identity = transform.forward_bounded(x, mean, None)
    assert np.array_equal(identity.values, transform.forward(x, mean, None).numpy())
    assert not identity.row_bound.any()
    basis = _basis(12, 8, 1)
    kv = torch.randn(2, 2, 300, 2, 6).to(torch.float16)
    profile = codec.calibrate([kv])
    blob = codec.encode(kv, 1, profile)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        slow = transform.forward_bounded(x, mean, basis)
        assert np.array_equal(slow.values, transform.forward(x, mean, basis).numpy())
        assert not slow.row_bound.any()
        assert codec.encode(kv, 1, profile) == blob
    finally:
        torch.set_float32_matmul_precision(before)


def test_layer_coefficients_split_into_k_and_v_rows():
    """quantize_layer quantizes K's kept rows then V's, each with its own basis rows."""
    kv = torch.randn(1, 2, 400, 2, 8)
    kv[:, 1] *= 30.0  # V far larger than K: swapped rows would not quantize alike
    profile = codec.calibrate([kv])
    body = kv[0].flatten(2)
    plan, q, _ = layer_codec.quantize_layer(profile, 1, 0, body[0], body[1])
    for kind, rows in ((0, slice(0, plan.kept[0])), (1, slice(plan.kept[0], plan.rows))):
        basis = torch.from_numpy(profile.basis[0, kind, :plan.kept[kind]])
        reference = transform.forward(body[kind], torch.from_numpy(profile.mean[0, kind]), basis).numpy()
        assert np.array_equal(q[rows], np.rint(reference / plan.step[rows, None]).astype(np.int32))
