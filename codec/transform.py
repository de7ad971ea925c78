"""Decorrelating transform: mean removal + PCA across all heads of a layer's K or V.

Why across heads: on real KV, PCA over the layer's full H*D channels needs ~40%
fewer bits than per-head PCA at the same distortion (shared/reference.md, and
``kvwire bench codec --transform`` measures it again). The inverse costs one
[tokens, kept] x [kept, H*D] matrix product per layer and K/V, which torch runs on
all cores (and the GPU decoder as a GEMM), in bfloat16 (:func:`product`).

All functions here are pure: tensors in, tensors out.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
import torch

from .rotary import Rotary, rotate_in_place
from .stages import CONVERT, ROPE, TRANSFORM, stage

#: float32's unit roundoff
_UNIT = 2.0 ** -24


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

    ``basis`` [kept, C] float32, or None for the identity transform. The reference the
    encoder's integers follow: the product runs in float64 and is rounded once to
    float32. A float32 GEMM rounds differently on each BLAS kernel (AVX2, AVX-512,
    another library), so the same KV and profile would give other coefficients, and
    other bytes, on another machine; float64's differences are far below float32's
    rounding step, so the rounded coefficients agree. The coded coefficients come from
    :func:`forward_bounded`, which is twice as fast and quantizes the same.
    """
    centered = x.to(torch.float32) - mean
    if basis is None:
        return centered.T.contiguous()
    return project(centered, basis)


def project(centered: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``basis`` [kept, C] times centered tokens [N, C]: [kept, N], in float64 rounded
    once to float32 (:func:`forward`). Either may already be float64 (``Profile.basis64``
    saves converting the profile's rows for every section)."""
    return (basis.double() @ centered.double().T).float()


class Coefficients(NamedTuple):
    """Coefficients [kept, N] (float32) from a fast product, and what it takes to make
    their quantization what :func:`forward`'s would be (``rans.quantize_rows``)."""

    values: np.ndarray      # f32 [kept, N]
    basis: np.ndarray       # f32 [kept, C]: the rows the values come from ([kept, 0]: exact values)
    tokens: np.ndarray      # f32 [N, C]: the centered tokens ([N, 0]: exact values)
    row_bound: np.ndarray   # f64 [kept]: each value's error bound per unit of its token's norm (0: exact)
    token_norm: np.ndarray  # f64 [N]: each centered token's 2-norm, rounded up

    def head(self, rows: int) -> "Coefficients":
        """The first ``rows`` rows: what a level keeping fewer than the product's rows codes."""
        if not 0 <= rows <= self.values.shape[0]:
            raise ValueError(f"{rows} rows asked of a product of {self.values.shape[0]}")
        return self._replace(values=self.values[:rows], basis=self.basis[:rows], row_bound=self.row_bound[:rows])


def forward_bounded(x: torch.Tensor, mean: torch.Tensor, basis: torch.Tensor | None) -> Coefficients:
    """:func:`forward`'s coefficients by a float32 GEMM (twice float64's speed), with
    their error bound against :func:`forward`.

    Any float32 dot product of C terms, in any order, with or without fused
    multiply-adds, is within gamma * sum|b_i x_i| of the exact one (gamma = C u / (1 - C u),
    u = 2^-24), and sum|b_i x_i| <= |b| |x|; the reference (float64, rounded once) is
    within another u of it. So ``row_bound[r] * token_norm[t]`` bounds each value's
    distance from the reference on any BLAS. Only while torch's float32 products are
    IEEE ones (no bf16 or TF32 shortcut set by the caller); otherwise the values are
    :func:`forward`'s and marked exact. (A caller's ``torch.set_flush_denormal(True)``
    reads subnormal inputs as zero, in the threads it was set in only: no product is
    reproducible then, this one included.)
    """
    if basis is None or not _ieee_float32_products():
        values = forward(x, mean, basis).numpy()
        return Coefficients(values, np.zeros((values.shape[0], 0), np.float32),
                            np.zeros((values.shape[1], 0), np.float32), np.zeros(values.shape[0]),
                            np.zeros(values.shape[1]))
    centered = (x.to(torch.float32) - mean).contiguous()
    values = (basis @ centered.T).numpy()
    channels = basis.shape[1]
    gamma = (channels + 2) * _UNIT / (1.0 - (channels + 2) * _UNIT)
    row_bound = gamma * torch.linalg.vector_norm(basis, dim=1, dtype=torch.float64).numpy() * (1.0 + 1e-9)
    # a float32 norm, raised past its own rounding and past squares that underflow to 0
    token_norm = (torch.linalg.vector_norm(centered, dim=1).numpy().astype(np.float64)
                  * (1.0 + 4.0 * (channels + 3) * _UNIT) + math.sqrt(channels) * 2.0 ** -75)
    return Coefficients(values, basis.numpy(), centered.numpy(), row_bound, token_norm)


def _ieee_float32_products() -> bool:
    """True unless the caller let torch's float32 matmuls run in bf16 or TF32."""
    mkldnn = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
    return (torch.get_float32_matmul_precision() == "highest"
            and getattr(torch.backends, "fp32_precision", "none") in ("none", "ieee")
            and getattr(mkldnn, "fp32_precision", "none") in ("none", "ieee"))


@functools.cache
def _cpu_multiplies_bfloat16() -> bool:
    cpu = getattr(torch, "cpu", None)
    return any(getattr(cpu, probe, lambda: False)() for probe in ("_is_avx512_bf16_supported",
                                                                   "_is_amx_tile_supported"))


def native_bfloat16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 matrices in hardware (a GPU; a CPU with
    AVX-512 BF16 or AMX), at twice float32's rate or more; elsewhere :func:`product`
    gets the same numbers from a float32 GEMM."""
    return device.type != "cpu" or _cpu_multiplies_bfloat16()


def product(coef_t: torch.Tensor, basis: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """bfloat16 ``coef_t @ basis`` ([..., N, k] float32 by [..., k, C] bfloat16; into
    ``out`` when given, contiguous): the
    inverse transform's product, with its operands rounded to bfloat16, every product
    of two exact in the float32 sum, and the sum rounded to bfloat16 (FORMAT.md,
    "Inverse transform").

    Why bfloat16: the product is most of a CPU decode's time, and a CPU with bfloat16
    dot products runs it twice as fast; its three roundings (up to 2^-8 of a value, on
    a product centered on the mean) add about 7e-6 of the variance to the error, against
    the finest default level's 2.5e-4 and the default's 4e-3. A CPU without them sums
    the rounded operands' products with a float32 GEMM (each exact in float32), so
    every device agrees up to the sum's order, which moves a result by one bfloat16
    unit where its float32 sums lie on either side of a rounding boundary, or, where the
    terms cancel, by the float32 sums' own error (``kept`` units of 2^-24 of the terms'
    summed magnitudes at most)."""
    rounded = coef_t.to(torch.bfloat16)
    if native_bfloat16(coef_t.device):
        return torch.matmul(rounded, basis, out=out)
    summed = torch.matmul(rounded.float(), basis.float())
    return summed.to(torch.bfloat16) if out is None else out.copy_(summed)


def centered_inverse(coef_t: torch.Tensor, basis: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """float32 :func:`product` plus ``mean`` (broadcast over its tokens): the inverse
    transform of a layer, or of a batch of them, as every decoder computes it. The
    product is converted before the add: torch.add's bfloat16 + float32 promotion runs
    a kernel about 20x slower than the conversion and an in-place float32 add."""
    return product(coef_t, basis).float().add_(mean)


def inverse(coef_t: torch.Tensor, mean: torch.Tensor, basis: torch.Tensor | None) -> torch.Tensor:
    """float32 tokens [N, C] reconstructed from coefficients [N, kept], a fresh tensor.

    With a basis (bfloat16 [>= kept, C], :func:`product`), components past ``kept``
    were dropped (they reconstruct as the mean); the identity transform always keeps
    every channel. The GEMM always writes a fresh (aligned) tensor: writing into a view
    of a larger output lets the BLAS pick another kernel and round differently, and
    every decode path must agree.
    """
    tokens, kept = coef_t.shape
    with stage(TRANSFORM):
        if basis is None:
            return coef_t + mean
        if kept == 0:
            return mean.expand(tokens, mean.shape[0]).clone()
        return centered_inverse(coef_t, basis[:kept], mean)


def finish(values: torch.Tensor, out: torch.Tensor,
           rope: tuple[Rotary, tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
    """Write reconstructed tokens ``values`` (float32 [N, C], consumed) into ``out``:
    ``rope`` (a rotary and its angles for these tokens) re-applies RoPE to keys, in
    float32, and values are clamped to the output dtype's finite range, so a
    reconstruction that lands a hair past fp16's largest value never becomes inf."""
    if rope is not None:
        with stage(ROPE):   # the clamp in the same pass
            values = values.contiguous()  # an identity profile's sum may keep coef's transposed strides
            rotate_in_place(values, rope[0], rope[1], limit=dtype_limit(out.dtype))
    with stage(CONVERT):
        out.copy_(values if rope is not None else clamp_to(values, out.dtype))


def dtype_limit(dtype: torch.dtype) -> float:
    """The largest finite value a reconstruction is clamped to for ``dtype`` (inf: no
    clamp, for float32)."""
    return math.inf if dtype == torch.float32 else float(torch.finfo(dtype).max)


def clamp_to(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` clamped in place to ``dtype``'s finite range (a no-op for float32)."""
    if dtype != torch.float32:
        limit = dtype_limit(dtype)
        values.clamp_(-limit, limit)
    return values
