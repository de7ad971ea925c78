"""How closely two decoders of one blob agree (codec/FORMAT.md, "Inverse transform").

Entropy decoding, dequantization, the means, RoPE and the clamp are exact or float32
operations every decoder shares; the inverse transform's product rounds a float32 sum
to bfloat16, and two GEMMs (per matrix or batched, oneDNN, cuBLAS or a float32
emulation) may order that sum differently: where the two sums lie on either side of a
rounding boundary, the product moves by one bfloat16 unit. Here that unit is bounded at
the largest product (the largest value less the largest mean, the mean being added
after), plus the rounding to the blob's dtype.
"""
from __future__ import annotations

import numpy as np
import torch

import codec


def assert_decoders_agree(got: torch.Tensor, want: torch.Tensor, profile: codec.Profile | None) -> None:
    """``got`` and ``want`` (one blob's KV from two decoders) agree as FORMAT.md allows."""
    mean = 0.0 if profile is None else float(np.abs(profile.mean).max())
    largest_product = float(want.float().abs().max()) + mean
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -10, atol=2 ** -7 * largest_product)
