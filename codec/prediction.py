"""Inter-layer prediction: each layer's coded tokens predicted from the previous layer's
decoded ones, so that a section codes only what the prediction misses (format 6).

The prediction is linear (as in AQUA-KV): layer l's position-free K and V of a token,
one row of 2C numbers, is ``[previous, 1] @ predictor[l]``, ``previous`` being layer
l - 1's *decoded* values of that token (float32, keys with RoPE removed, before rounding
to the blob's dtype). One map per layer, fitted by least squares on calibration KV and
stored in float16 in the profile. Layers ``0, restart, 2 restart, ..`` are coded alone
(their predictor rows are zero): a decode can start there with nothing before it.

Pure functions on tensors; the encoder and the decoders call them layer by layer.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .rotary import Rotary, rotate

#: Ridge added to the normal equations' diagonal, relative to its mean. The map is fitted
#: on exact values but multiplies decoded ones, whose error is about the level's MSE/var
#: of the layer's variance (2.5e-4 to 3.2e-2 of the ladder): directions that vary less
#: than that carry mostly quantization noise into the prediction, and a ridge of that
#: order shrinks them, at the cost of a little prediction at the finest levels, whose
#: error is smaller (kvwire bench codec --predict N measures each level's bits).
RIDGE = 1e-2


def is_intra(layer: int, restart: int) -> bool:
    """Whether ``layer`` is coded alone under a profile predicting with period ``restart``."""
    return layer % restart == 0


def restart_layer(layer: int, restart: int) -> int:
    """The intra-coded layer at or before ``layer``: where a decode reaching it starts."""
    return layer - layer % restart


def kind_groups(channels: int) -> list[torch.Tensor]:
    """K from K and V from V: a block-diagonal map, half the numbers and multiply-adds."""
    every = torch.arange(2 * channels)
    return [every[:channels], every[channels:]]


def head_groups(heads: int, head_dim: int) -> list[torch.Tensor]:
    """Each KV head's K and V from that head's K and V."""
    channels = heads * head_dim
    every = torch.arange(2 * channels)
    return [torch.cat([every[h * head_dim:(h + 1) * head_dim],
                       every[channels + h * head_dim:channels + (h + 1) * head_dim]]) for h in range(heads)]


def fit(values: torch.Tensor, restart: int, groups: Sequence[torch.Tensor] | None = None) -> np.ndarray:
    """float16 [L, 2C + 1, 2C]: per layer the least-squares map (ridge ``RIDGE``) from the
    previous layer's values (and a constant, the last row) to the layer's, over the tokens
    of ``values`` (float32 [L, N, 2C], position-free). ``groups``: channel groups each
    predicted from the same channels only (None: every channel from every channel); the
    map is zero elsewhere. Intra layers (``is_intra``) get a zero map."""
    layers, _, width = values.shape
    out = np.zeros((layers, width + 1, width), dtype=np.float16)
    groups = [torch.arange(width)] if groups is None else list(groups)
    for layer in range(1, layers):
        if is_intra(layer, restart):
            continue
        for index in groups:
            x = _with_constant(values[layer - 1][:, index].double())
            gram = x.T @ x
            gram += RIDGE * torch.diagonal(gram).mean() * torch.eye(gram.shape[0], dtype=torch.float64)
            solved = torch.linalg.solve(gram, x.T @ values[layer][:, index].double()).numpy()
            rows = np.append(index.numpy(), width)
            out[layer][np.ix_(rows, index.numpy())] = solved
    return out


def _with_constant(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], dim=1)


def predict_rows(previous: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """float32 [N, 2C]: a layer's rows (a token's K then V) predicted from the previous
    layer's ``previous`` (float32 [N, 2C]) by its map ``matrix`` (float32 [2C + 1, 2C]).

    One float32 product plus the constant row; its summation order is the BLAS's, so
    decoders agree to float32 rounding here (FORMAT.md, "Inter-layer prediction")."""
    return torch.addmm(matrix[-1].expand(previous.shape[0], -1), previous, matrix[:-1])


def by_kind(predictor: np.ndarray) -> np.ndarray:
    """bool [L]: the layers whose map predicts K from K and V from V only (zero across
    the two: ``kind_groups``, or a layer coded alone), whose prediction :func:`predict`
    computes as two C x C products, half the dense map's work."""
    channels = predictor.shape[2] // 2
    k_from_v = predictor[:, channels:2 * channels, :channels].any(axis=(1, 2))
    v_from_k = predictor[:, :channels, channels:].any(axis=(1, 2))
    return ~(k_from_v | v_from_k)


def predict(previous: torch.Tensor, matrix: torch.Tensor, kind_blocks: bool = False) -> torch.Tensor:
    """float32 [2, N, C]: :func:`predict_rows` in the codec's layout of a layer (K's
    tokens, then V's), what the encoder and decoders hold. ``kind_blocks``: the map is
    zero across K and V (:func:`by_kind`), so each is predicted from its own kind with
    the map's two diagonal blocks, skipping the zeros (the same sums, in the BLAS's order)."""
    _, tokens, channels = previous.shape
    if kind_blocks:
        out = torch.empty_like(previous)
        for kind in range(2):
            part = slice(kind * channels, (kind + 1) * channels)
            torch.addmm(matrix[-1, part].expand(tokens, -1), previous[kind], matrix[part, part], out=out[kind])
        return out
    flat = previous.permute(1, 0, 2).reshape(tokens, 2 * channels)
    return predict_rows(flat, matrix).reshape(tokens, 2, channels).permute(1, 0, 2)


def position_free(tokens: torch.Tensor, rotary: Rotary | None, position: int) -> torch.Tensor:
    """float32 [2, N, C] of a layer's coded tokens ``tokens`` ([2, N, C], any float dtype
    and device) as the transform sees them: keys rotated back from positions ``position
    ..`` when ``rotary``. What a raw section's layer is predicted from, computed as the
    encoder computes its values (``codec.profile.CodedBody``), so the two agree bit for
    bit on one device."""
    values = tokens.to(torch.float32, copy=True)
    if rotary is not None and values.shape[1]:
        values[0] = rotate(values[0], rotary, rotary.angles(position, values.shape[1], values.device), inverse=True)
    return values


def residuals(values: torch.Tensor, predictor: np.ndarray, restart: int) -> torch.Tensor:
    """Each layer of ``values`` (float32 [L, N, 2C]) less its prediction from the
    previous layer's exact values: what calibration fits the residual profile on (the
    open loop; the encoder predicts from decoded layers)."""
    out = values.clone()
    for layer in range(1, values.shape[0]):
        if not is_intra(layer, restart):
            out[layer] -= predict_rows(values[layer - 1], torch.from_numpy(predictor[layer].astype(np.float32)))
    return out
