"""Rotary position embeddings (RoPE) of a model's keys: the parameters, and the rotation.

A causal LM's cached keys are ``RoPE(k, position)``: each pair of channels ``(i, i + dim/2)``
of a head is rotated by ``position * inv_freq[i]``. The same pre-RoPE key at two positions
gives two different cached keys, which the codec's fixed PCA cannot decorrelate. A profile
that carries ``Rotary`` makes the encoder rotate the keys back to position-free values
before the transform and the decoder re-apply RoPE after the inverse transform, so the
bitstream codes what the model computed before the rotation.

The recipe is transformers' Llama rotary (``rotate_half``, float32 angles
``position * inv_freq``): un-rotating with it is the exact inverse, up to float32
rounding, of what the model did. Supported frequency schedules: ``default``, ``linear``
and ``llama3``; the others (dynamic NTK, YaRN, LongRoPE) depend on the sequence length
or scale cos/sin, so a model using them is coded without RoPE removal.
Pure functions of tensors; no I/O.
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch
from numba import njit

ROPE_TYPES = ("default", "linear", "llama3")
#: Positions are u32 in the blob header: a chunk's tokens lie in [0, 2^32).
MAX_POSITION = 1 << 32
_MAX_THETA = 1e12
_MAX_FACTOR = 1e6
_MAX_U16 = 0xFFFF


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"Rotary.{name} must be an int in [{low}, {high}], got {value!r}")


def _check_float(name: str, value: object, low: float, high: float) -> None:
    """``low < value <= high`` and finite (JSON may carry NaN, Infinity or a 400-digit int)."""
    number = float(value) if isinstance(value, float) or (isinstance(value, int) and not isinstance(value, bool)
                                                           and abs(value) <= 2 ** 64) else math.nan
    if not math.isfinite(number) or not low < number <= high:
        raise ValueError(f"Rotary.{name} must be a finite number in ({low}, {high}], got {value!r}")


@dataclass(frozen=True)
class Rotary:
    """RoPE parameters of a model's keys, as transformers' Llama rotary uses them.

    ``dim`` channels of each head are rotated (the first ``dim``; the rest pass through,
    as with a partial rotary factor), ``dim`` even and at most ``head_dim``. ``theta`` is
    the base. ``rope_type`` ``linear`` divides every frequency by ``factor``; ``llama3``
    (Llama 3.1's schedule) divides the low ones by ``factor`` and interpolates the middle
    band by ``low_freq_factor``, ``high_freq_factor`` and ``original_max_positions``.
    Fields a schedule does not use must keep their defaults, so one model always
    gives one profile id.
    """

    head_dim: int
    dim: int
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192

    def __post_init__(self) -> None:
        _check_int("head_dim", self.head_dim, 2, _MAX_U16)
        _check_int("dim", self.dim, 2, self.head_dim)
        if self.dim % 2:
            raise ValueError(f"Rotary.dim must be even (channels rotate in pairs), got {self.dim}")
        _check_float("theta", self.theta, 1.0, _MAX_THETA)
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"Rotary.rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        _check_float("factor", self.factor, 0.0, _MAX_FACTOR)
        _check_float("low_freq_factor", self.low_freq_factor, 0.0, _MAX_FACTOR)
        _check_float("high_freq_factor", self.high_freq_factor, self.low_freq_factor, _MAX_FACTOR)
        _check_int("original_max_positions", self.original_max_positions, 1, MAX_POSITION - 1)
        defaults = Rotary.__dataclass_fields__
        unused = {"default": ("factor", "low_freq_factor", "high_freq_factor", "original_max_positions"),
                  "linear": ("low_freq_factor", "high_freq_factor", "original_max_positions"),
                  "llama3": ()}[self.rope_type]
        for name in unused:
            if getattr(self, name) != defaults[name].default:
                raise ValueError(f"Rotary.{name} is not used by rope_type {self.rope_type!r}; "
                                 f"leave it at {defaults[name].default!r}")

    # ------------------------------------------------------------- serialization
    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: object) -> "Rotary":
        """From ``to_json``'s dict; ValueError for anything else (unknown or missing keys too)."""
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) != names:
            raise ValueError(f"rotary must be an object with exactly the keys {sorted(names)}")
        return cls(**data)

    # ------------------------------------------------------------------ frequencies
    def inv_freq(self) -> torch.Tensor:
        """float32 [dim / 2]: each channel pair's angle per position (transformers' recipe)."""
        exponent = torch.arange(0, self.dim, 2, dtype=torch.int64).to(torch.float32) / self.dim
        inv = 1.0 / (self.theta ** exponent)
        if self.rope_type == "linear":
            return inv / self.factor
        if self.rope_type == "llama3":
            return self._llama3(inv)
        return inv

    def _llama3(self, inv: torch.Tensor) -> torch.Tensor:
        low_wavelen = self.original_max_positions / self.low_freq_factor
        high_wavelen = self.original_max_positions / self.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
        smooth = (self.original_max_positions / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)

    def angles(self, start: int, tokens: int, device: torch.device | str = "cpu"
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), float32 [tokens, dim], of positions ``start .. start + tokens - 1``.

        Every layer of a chunk asks for the same angles (recomputing them was a sixth of
        a 30-layer chunk's decode), so recent ones are kept, up to ``ANGLE_CACHE_BYTES``:
        the tensors are shared between callers, to be read and never written.
        """
        if start < 0 or start + tokens > MAX_POSITION:
            raise ValueError(f"positions {start}..{start + tokens - 1} are outside [0, {MAX_POSITION})")
        return _ANGLES.get(self, start, tokens, torch.device(device))


#: bytes of angle tables kept across calls: a chunk's are a few MB (2 x tokens x dim x 4);
#: a bound in entries would let 16 tables of a hostile header's size stay resident
ANGLE_CACHE_BYTES = 64 << 20


def _angles(rotary: Rotary, start: int, tokens: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(start, start + tokens, dtype=torch.int64, device=device).to(torch.float32)
    freqs = positions[:, None] * rotary.inv_freq().to(device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class _AngleCache:
    """The most recently used angle tables, at most ``limit`` bytes of them (a table
    larger than that is computed and not kept). Decoders ask from several threads."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._tables: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, rotary: Rotary, start: int, tokens: int, device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (rotary, start, tokens, device)
        with self._lock:
            if key in self._tables:
                self._tables.move_to_end(key)
                return self._tables[key]
        angles = _angles(rotary, start, tokens, device)
        size = 2 * angles[0].numel() * angles[0].element_size()
        if size <= self.limit:
            with self._lock:
                if key not in self._tables:
                    self._tables[key] = angles
                    self._bytes += size
                while self._bytes > self.limit:
                    _, (cos, _) = self._tables.popitem(last=False)
                    self._bytes -= 2 * cos.numel() * cos.element_size()
        return angles

    @property
    def nbytes(self) -> int:
        return self._bytes


_ANGLES = _AngleCache(ANGLE_CACHE_BYTES)


def rotate(keys: torch.Tensor, rotary: Rotary, angles: tuple[torch.Tensor, torch.Tensor], *,
           inverse: bool = False) -> torch.Tensor:
    """RoPE (or, ``inverse``, its removal) of float32 keys [..., tokens, heads * head_dim].

    ``angles`` is ``rotary.angles(first position, tokens)``; leading dimensions (layers)
    share them, so a whole chunk's keys rotate in one call: the same float32 operations
    per element as layer by layer, a few large ones in place of many small. Returns a
    new tensor.
    """
    cos, sin = angles
    *lead, tokens, channels = keys.shape
    if channels % rotary.head_dim or cos.shape != (tokens, rotary.dim):
        raise ValueError(f"keys [{tokens}, {channels}] do not fit rotary head_dim {rotary.head_dim}, "
                         f"angles {tuple(cos.shape)}")
    heads = keys.reshape(*lead, tokens, channels // rotary.head_dim, rotary.head_dim)
    out = heads.clone()
    half = rotary.dim // 2
    x1, x2 = heads[..., :half], heads[..., half:rotary.dim]
    c1, c2 = cos[:, None, :half], cos[:, None, half:]
    s1, s2 = sin[:, None, :half], sin[:, None, half:]
    if inverse:  # rotation by -angle: x * cos - rotate_half(x) * sin
        out[..., :half] = x1 * c1 + x2 * s1
        out[..., half:rotary.dim] = x2 * c2 - x1 * s2
    else:        # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
        out[..., :half] = x1 * c1 - x2 * s1
        out[..., half:rotary.dim] = x2 * c2 + x1 * s2
    return out.reshape(keys.shape)


def rotate_in_place(keys: torch.Tensor, rotary: Rotary, angles: tuple[torch.Tensor, torch.Tensor],
                    limit: float = math.inf) -> None:
    """RoPE of float32 keys [tokens, heads * head_dim] (contiguous), in place: what
    :func:`rotate` returns, bit for bit (the same float32 products and sums, no fused
    multiply-add), in one pass over the keys and without temporaries. The decoder's form:
    it clamps to ``[-limit, limit]`` in the same pass (as ``Tensor.clamp_``: NaN stays
    NaN), so a reconstruction bound for a narrower dtype is read and written once."""
    cos, sin = angles
    tokens, channels = keys.shape
    if channels % rotary.head_dim or cos.shape != (tokens, rotary.dim) or not keys.is_contiguous() \
            or keys.dtype != torch.float32:
        raise ValueError(f"keys {keys.dtype} [{tokens}, {channels}] do not fit rotary head_dim "
                         f"{rotary.head_dim}, angles {tuple(cos.shape)}")
    _rope_rows(keys.numpy(), cos.numpy(), sin.numpy(), rotary.head_dim, np.float32(limit))


@njit(cache=True, nogil=True)
def _rope_rows(keys: np.ndarray, cos: np.ndarray, sin: np.ndarray, head_dim: int, limit: np.float32) -> None:
    """keys [tokens, C] rotated in place by cos, sin [tokens, dim] and clamped to
    ``[-limit, limit]``: per head, channel ``i < dim / 2`` pairs with ``i + dim / 2``
    (transformers' ``rotate_half``). Written over row and head slices, not 2-D indices:
    numba then keeps the address arithmetic out of the inner loop."""
    tokens, channels = keys.shape
    half = cos.shape[1] // 2
    for t in range(tokens):
        row, c, s = keys[t], cos[t], sin[t]
        for head in range(0, channels, head_dim):
            first = row[head:head + half]
            second = row[head + half:head + 2 * half]
            for i in range(half):
                x1, x2 = first[i], second[i]
                first[i] = _clamped(x1 * c[i] - x2 * s[i], limit)
                second[i] = _clamped(x2 * c[half + i] + x1 * s[half + i], limit)


@njit(inline="always")
def _clamped(value: np.float32, limit: np.float32) -> np.float32:
    """``value`` clamped to ``[-limit, limit]``, NaN kept (as ``Tensor.clamp_``)."""
    if value > limit:
        return limit
    if value < -limit:
        return -limit
    return value
