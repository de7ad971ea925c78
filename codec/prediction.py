"""Inter-layer prediction: each layer's coded tokens predicted from the previous layer's
decoded ones, so that a section codes only what the prediction misses (format 7).

The prediction is linear (as in AQUA-KV): layer l's position-free K and V of a token,
one row of 2C numbers, is ``[previous, 1] @ predictor[l]``. One map per layer, fitted
by least squares on calibration KV and stored in float16 in the profile. Layers ``0,
restart, 2 restart, ..`` are coded alone (their predictor rows are zero): a decode can
start there with nothing before it.

A decoder carries a layer's *state* to the next: its values less a fixed per-layer
offset, in bfloat16 (FORMAT.md, "Inter-layer prediction"). The state is what the
inverse transform's bfloat16 product gives, and the next layer's prediction is more
rows of that same product: ``[state_{l-1} | Y_l^T] @ [A_l ; B_l]``, one GEMM per layer
and K/V that sums the prediction and the reconstruction before rounding. So a
predicted layer costs its decoder one wider product, not a second, float32 one; and
the state is centered (the offsets follow the means through the maps), so its
bfloat16 rounding is as small as the product's own.

A low-rank profile (``fit_low_rank``) factors each K and V map as ``entry @ exit``
(``C x r`` by ``r x C``): the product takes ``state_{l-1} @ entry`` (r columns) where a
full map takes the whole state (C), so a predicted layer costs ``2 r`` multiply-adds per
token and channel where a full map costs ``C``, for the part of the map's gain its ``r``
leading directions hold.

Pure functions on tensors; the encoder and the decoders call them layer by layer.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from . import transform
from .rotary import Rotary, rotate

#: Ridge added to the normal equations' diagonal, relative to its mean. The map is fitted
#: on exact values but multiplies decoded ones, whose error is about the level's MSE/var
#: of the layer's variance (2.5e-4 to 3.2e-2 of the ladder): directions that vary less
#: than that carry mostly quantization noise into the prediction, and a ridge of that
#: order shrinks them, at the cost of a little prediction at the finest levels, whose
#: error is smaller (kvwire bench codec --predict N measures each level's bits).
RIDGE = 1e-2
#: The rank of each K and V map a "low-rank" calibration fits (``fit_low_rank``).
LOW_RANK = 48


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


def fit_low_rank(values: torch.Tensor, restart: int, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(maps, entry, exit): K-from-K and V-from-V maps (:func:`fit` with
    :func:`kind_groups`), each reduced to the ``rank`` directions its predictions of
    ``values`` vary most along (reduced-rank regression), as float16 factors ``entry``
    [L, 2, C, rank] and ``exit`` [L, 2, rank, C] (orthonormal rows), and ``maps`` the
    dense maps they make (:func:`expand`) with each constant refitted to them. Zero at
    the intra layers."""
    layers, _, width = values.shape
    channels = width // 2
    if not 1 <= rank <= channels:
        raise ValueError(f"a low-rank map's rank must be in [1, {channels}], got {rank}")
    full = fit(values, restart, kind_groups(channels))
    entry = np.zeros((layers, 2, channels, rank), dtype=np.float16)
    exit_ = np.zeros((layers, 2, rank, channels), dtype=np.float16)
    constant = np.zeros((layers, width), dtype=np.float16)
    for layer in range(1, layers):
        if is_intra(layer, restart):
            continue
        for kind in range(2):
            own = slice(kind * channels, (kind + 1) * channels)
            x, y = values[layer - 1][:, own].double(), values[layer][:, own].double()
            matrix = torch.from_numpy(full[layer, own, own].astype(np.float64))
            predicted = (x - x.mean(0)) @ matrix
            leading = torch.linalg.eigh(predicted.T @ predicted).eigenvectors[:, -rank:].flip(1)   # [C, rank]
            entry[layer, kind] = (matrix @ leading).numpy()
            exit_[layer, kind] = leading.T.numpy()
            reduced = torch.from_numpy(entry[layer, kind].astype(np.float64) @ exit_[layer, kind].astype(np.float64))
            constant[layer, own] = (y.mean(0) - x.mean(0) @ reduced).numpy()
    return expand(constant, entry, exit_), entry, exit_


def expand(constant: np.ndarray, entry: np.ndarray, exit_: np.ndarray) -> np.ndarray:
    """float16 [L, 2C + 1, 2C] (:func:`fit`'s layout): the dense maps of factored ones,
    each kind's block ``entry @ exit`` summed in float64 and rounded once, zero across
    K and V, the last row ``constant`` ([L, 2C]). What the offsets and calibration's
    measurements read; the decoders multiply by the factors."""
    layers, _, channels, _ = entry.shape
    out = np.zeros((layers, 2 * channels + 1, 2 * channels), dtype=np.float16)
    for layer in range(layers):     # a layer at a time: a float64 C x C block each, not L of them
        for kind in range(2):
            own = slice(kind * channels, (kind + 1) * channels)
            out[layer, own, own] = entry[layer, kind].astype(np.float64) @ exit_[layer, kind].astype(np.float64)
    out[:, -1] = constant
    return out


def _with_constant(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], dim=1)


def predict_rows(previous: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """float32 [N, 2C]: a layer's rows (a token's K then V) predicted from the previous
    layer's ``previous`` (float32 [N, 2C]) by its map ``matrix`` (float32 [2C + 1, 2C]).

    What calibration fits and measures the maps with, on exact or decoded values; a
    decoder predicts from its carried state instead (:func:`coded_state`)."""
    return torch.addmm(matrix[-1].expand(previous.shape[0], -1), previous, matrix[:-1])


def by_kind(predictor: np.ndarray) -> np.ndarray:
    """bool [L]: the layers whose map predicts K from K and V from V only (zero across
    the two: ``kind_groups``, or a layer coded alone), which take half the dense map's
    multiply-adds (:func:`reach`)."""
    channels = predictor.shape[2] // 2
    k_from_v = predictor[:, channels:2 * channels, :channels].any(axis=(1, 2))
    v_from_k = predictor[:, :channels, channels:].any(axis=(1, 2))
    return ~(k_from_v | v_from_k)


def offsets(mean: np.ndarray, predictor: np.ndarray, restart: int) -> np.ndarray:
    """float32 [L, 2, C]: each layer's offset, what its values are its state plus: the
    transform's mean at an intra layer, and at a predicted one the mean, the map's
    constant row and the previous layer's offset through the map. Summed in float64
    from the profile's numbers and rounded once, so every decoder holds the same."""
    layers, _, channels = mean.shape
    out = np.zeros((layers, 2 * channels))
    for layer in range(layers):
        out[layer] = mean[layer].astype(np.float64).reshape(2 * channels)
        if not is_intra(layer, restart):
            matrix = predictor[layer].astype(np.float64)
            out[layer] += matrix[-1] + out[layer - 1] @ matrix[:-1]
    return out.reshape(layers, 2, channels).astype(np.float32)


def reach(predictor: np.ndarray, restart: int, rank: int = 0) -> np.ndarray:
    """int [L]: how many columns each layer's product takes before its coefficients: 0
    at an intra layer, ``rank`` with factored maps (``rank`` > 0: the state by the
    map's entry), else the previous layer's state channels, C where the map is by kind
    (:func:`by_kind`: K from K, V from V, half the multiply-adds), else 2C."""
    channels = predictor.shape[2] // 2
    out = np.where(by_kind(predictor), channels, 2 * channels) if not rank else np.full(len(predictor), rank)
    out[[is_intra(layer, restart) for layer in range(len(out))]] = 0
    return out


def chain_matrix(predictor: np.ndarray, basis: np.ndarray | None, layer: int, kind: int,
                 rows: int, exit_: np.ndarray | None = None) -> torch.Tensor:
    """bfloat16 [rows + kept rows, C]: what layer ``layer``'s K (kind 0) or V (1) state is
    a product by: the ``rows`` rows of its map that reach this kind (none at an intra
    layer; K's then V's channels), or of its ``exit_`` factor ([L, 2, rank, C]), then its
    basis (``basis``'s stored rows; the identity when None)."""
    channels = predictor.shape[2] // 2
    columns = slice(kind * channels, (kind + 1) * channels)
    first = kind * channels if rows == channels else 0
    mapped = torch.from_numpy((predictor[layer, first:first + rows, columns] if exit_ is None
                               else exit_[layer, kind, :rows]).astype(np.float32))
    own = torch.eye(channels) if basis is None else torch.from_numpy(basis[layer, kind])
    return torch.cat([mapped, own]).to(torch.bfloat16)


#: a layer's state: K's and V's, bfloat16 [2, N, C]
State = torch.Tensor


def chain_entry(entry: np.ndarray, layer: int) -> torch.Tensor:
    """bfloat16 [2, C, rank]: layer ``layer``'s K and V entry factors, what the previous
    layer's K and V states are multiplied by first, the two in one batched product."""
    return torch.from_numpy(entry[layer].astype(np.float32)).to(torch.bfloat16)


#: per kind (K, V), what a predicted layer's map takes of the previous state (:func:`reached`)
Reached = Sequence[torch.Tensor]


def reached(previous: State, rows: int, entry: torch.Tensor | None) -> Reached | None:
    """Per kind (K, V), bfloat16 [N, rows]: what a layer's map takes of the previous
    layer's state ``previous``: its own kind's channels by that kind's ``entry`` factor
    (:func:`chain_entry`; one batched ``transform.product`` for both kinds, which two
    cores run a kind each where a product of only ``rows`` columns splits badly), or
    its own kind's channels (``rows`` C), or K's then V's (2C); None at an intra layer
    (``rows`` 0). Found once per layer: the encoder's :func:`guess` and its state's
    :func:`layer_state` take the same."""
    if rows == 0:
        return None
    if entry is not None:
        return transform.product(previous, entry)
    if rows == previous.shape[-1]:
        return previous
    both = torch.cat([previous[0], previous[1]], dim=1)
    return both, both


def coded_state(coef_t: torch.Tensor, matrix: torch.Tensor, rows: int, reached_kind: torch.Tensor | None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """bfloat16 [N, C]: the state of a coded layer's K or V from its coefficients
    ``coef_t`` (float32 [N, kept]): ``transform.product`` of ``[reached_kind | coef_t]``
    by ``matrix`` (:func:`chain_matrix`), ``reached_kind`` being the kind's
    :func:`reached` (``rows`` columns; None at an intra layer, ``rows`` 0); into ``out``
    when given."""
    tokens, kept = coef_t.shape
    if rows == 0 and kept == 0:
        if out is not None:
            return out.zero_()
        return torch.zeros(tokens, matrix.shape[1], dtype=torch.bfloat16, device=coef_t.device)
    # the product's operand is always token-major, whatever ``coef_t``'s strides: its
    # layout picks the GEMM's kernel, and so how its float32 sums round
    operand = torch.empty(tokens, rows + kept, dtype=torch.bfloat16, device=coef_t.device)
    if rows:
        operand[:, :rows] = reached_kind
    operand[:, rows:] = coef_t
    return transform.product(operand, matrix[:rows + kept], out)


def layer_state(parts: Sequence[torch.Tensor], matrices: Sequence[torch.Tensor], rows: int,
                reached_both: Reached | None) -> State:
    """A coded layer's state, K's and V's :func:`coded_state` from their coefficients
    ``parts`` (float32 [N, kept] each), the layer's ``matrices`` and :func:`reached`,
    in one [2, N, C] tensor (what the next layer's batched entry product takes)."""
    out = torch.empty(2, parts[0].shape[0], matrices[0].shape[1], dtype=torch.bfloat16, device=parts[0].device)
    for kind, (part, matrix) in enumerate(zip(parts, matrices)):
        coded_state(part, matrix, rows, None if reached_both is None else reached_both[kind], out[kind])
    return out


def guess(reached_both: Reached, matrices: Sequence[torch.Tensor], rows: int, shift: torch.Tensor) -> torch.Tensor:
    """float32 [2, N, C]: what the encoder takes from a predicted layer's values before
    its transform: the previous layer's :func:`reached` state by the map's rows of
    ``matrices`` (the layer's K and V :func:`chain_matrix`), plus ``shift`` ([2, C]: the
    layer's offset less its mean). In float32: the decoder sums the same rounded
    operands inside its one bfloat16 product, so the two differ by that product's
    rounding alone."""
    tokens, channels = reached_both[0].shape[0], matrices[0].shape[1]
    out = torch.empty(2, tokens, channels)
    for kind in range(2):
        torch.addmm(shift[kind].expand(tokens, -1), reached_both[kind].float(), matrices[kind][:rows].float(),
                    out=out[kind])
    return out


def values_state(values: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """bfloat16 [2, N, C]: the state of a layer held as values (float32 [2, N, C], a raw
    section's tokens with RoPE removed), its ``offset`` ([2, C]) taken first."""
    return (values - offset[:, None, :]).to(torch.bfloat16)


def raw_state(tokens: torch.Tensor, rotary: Rotary | None, position: int, offset: torch.Tensor) -> torch.Tensor:
    """The state of a raw section's layer from its tokens ([2, N, C] at positions
    ``position ..``): :func:`values_state` of :func:`position_free`."""
    return values_state(position_free(tokens, rotary, position), offset)


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
