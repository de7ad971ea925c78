"""Decorrelating transform: mean removal + PCA across all heads of a layer's K or V.

Why across heads: on real KV, PCA over the layer's full H*D channels needs ~40%
fewer bits than per-head PCA at the same distortion (shared/reference.md, and
``kvwire bench codec --transform`` measures it again). The inverse costs one
[tokens, kept] x [kept, H*D] matrix product per layer and K/V, which torch runs on
all cores (and the GPU decoder as a GEMM).

All functions here are pure: tensors in, tensors out.
"""
from __future__ import annotations

import torch

from .rotary import Rotary, rotate


def channel_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean [C] and covariance [C, C] (float64) of tokens x [N, C]."""
    x = x.to(torch.float64)
    mean = x.mean(dim=0)
    centered = x - mean
    cov = centered.T @ centered / max(x.shape[0] - 1, 1)
    return mean, cov


def pca_basis(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Orthonormal basis rows sorted by decreasing variance, and those variances.

    The sign of each component is fixed (largest-magnitude entry positive) so the
    same data always gives the same profile bytes.
    """
    variances, vectors = torch.linalg.eigh(cov.to(torch.float64))
    order = torch.argsort(variances, descending=True)
    basis = vectors[:, order].T.contiguous()
    variances = variances[order].clamp_min(0.0)
    pivot = basis.abs().argmax(dim=1)
    signs = torch.sign(basis[torch.arange(basis.shape[0]), pivot])
    signs[signs == 0] = 1.0
    return basis * signs[:, None], variances


def forward(x: torch.Tensor, mean: torch.Tensor, basis: torch.Tensor | None) -> torch.Tensor:
    """Coefficients [kept, N] (component-major, as the coder wants rows) of x [N, C].

    ``basis`` [kept, C] float32, or None for the identity transform. The product runs
    in float64 and is rounded once to float32: a float32 GEMM rounds differently on each
    BLAS kernel (AVX2, AVX-512, another library), so the same KV and profile would give
    other coefficients, and other bytes, on another machine; float64's differences are
    far below float32's rounding step, so the rounded coefficients agree.
    """
    centered = x.to(torch.float32) - mean
    if basis is None:
        return centered.T.contiguous()
    return (basis.double() @ centered.double().T).float()


def inverse(coef: torch.Tensor, mean: torch.Tensor, basis: torch.Tensor | None,
            out: torch.Tensor, rope: tuple[Rotary, tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
    """Write tokens [N, C] reconstructed from coefficients [kept, N] into ``out``.

    With a basis, components past ``kept`` were dropped (they reconstruct as the
    mean); the identity transform always keeps every channel. The GEMM always writes
    a fresh (aligned) tensor: writing into a view of a larger output lets the BLAS
    pick another kernel and round differently, and every decode path must agree.
    Values are clamped to the output dtype's finite range, so a reconstruction that
    lands a hair past fp16's largest value never becomes inf. ``rope`` (a rotary and
    its angles for these tokens) re-applies RoPE to reconstructed keys, in float32.
    """
    kept, tokens = coef.shape
    bias = mean.expand(tokens, mean.shape[0])
    if basis is None:
        result = coef.T + mean
    elif kept == 0:
        result = bias.clone()
    else:
        result = torch.addmm(bias, coef.T, basis[:kept])
    if rope is not None:
        result = rotate(result, rope[0], rope[1])
    out.copy_(clamp_to(result, out.dtype))


def clamp_to(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` clamped in place to ``dtype``'s finite range (a no-op for float32)."""
    if dtype != torch.float32:
        limit = torch.finfo(dtype).max
        values.clamp_(-limit, limit)
    return values
