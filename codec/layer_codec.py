"""One layer's K and V <-> the rANS lane payload of its section.

Glue between the pure pieces: transform (torch), quantizer and coder (numba),
and the lane layout. A lane holds ``rows_per_lane`` consecutive components of K
or of V (never both), chosen so each stream carries at least ``LANE_SYMBOLS``
values: one 4-byte final state per lane is then < 1% of the payload even for
short chunks, while long chunks still get one lane per component (the most
parallelism the GPU decoder can use).
"""
from __future__ import annotations

import struct
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from . import entropy, parallel, rans, transform
from .errors import CorruptBitstream
from .profile import Profile

LANE_SYMBOLS = 4096
_U32 = struct.Struct("<I")


class ValuesOutOfRange(ValueError):
    """A layer's values are too far from the profile's mean to quantize at this level
    (the encoder then sends the layer raw)."""


@dataclass(frozen=True)
class CoderTables:
    freq: np.ndarray
    cdf: np.ndarray
    lut: np.ndarray
    value_bits: np.ndarray  # f64 [classes, PROB_BITS + 1]: rans.min_value_bits


_coder_tables: "weakref.WeakKeyDictionary[Profile, CoderTables]" = weakref.WeakKeyDictionary()


def coder_tables(profile: Profile) -> CoderTables:
    """Frequency, cumulative and slot tables of a profile (built once per profile)."""
    tables = _coder_tables.get(profile)
    if tables is None:
        tables = CoderTables(freq=profile.tables, cdf=entropy.cumulative(profile.tables),
                             lut=entropy.slot_lookup(profile.tables),
                             value_bits=rans.min_value_bits(profile.tables))
        _coder_tables[profile] = tables
    return tables


@dataclass(frozen=True)
class LayerPlan:
    """Row parameters and lane boundaries of one layer at one level."""

    kept: tuple[int, int]
    step: np.ndarray       # f32 [R]
    group: np.ndarray      # i32 [R]
    table: np.ndarray      # u8 [R, 2]
    shift: np.ndarray      # u8 [R, 2]
    lane_rows: np.ndarray  # i64 [lanes + 1]

    @property
    def rows(self) -> int:
        return int(self.step.shape[0])

    @property
    def lanes(self) -> int:
        return int(self.lane_rows.shape[0] - 1)


def rows_per_lane(coded_tokens: int) -> int:
    return max(1, -(-LANE_SYMBOLS // max(coded_tokens, 1)))


def plan_layer(profile: Profile, slot: int, layer: int, coded_tokens: int) -> LayerPlan:
    kept = (int(profile.kept[slot, layer, 0]), int(profile.kept[slot, layer, 1]))
    per_lane = rows_per_lane(coded_tokens)
    starts = list(range(0, kept[0], per_lane)) + list(range(kept[0], kept[0] + kept[1], per_lane))
    return LayerPlan(
        kept=kept,
        step=np.concatenate([np.full(kept[kv], profile.steps[slot, layer, kv], dtype=np.float32)
                             for kv in range(2)]),
        group=np.concatenate([np.full(kept[kv], profile.delta_group[layer, kv], dtype=np.int32)
                              for kv in range(2)]),
        # C order whatever kept is (concatenating transposes yields Fortran order when both
        # parts have >= 2 rows): one array type per kernel argument, so one numba
        # specialization per kernel to compile or load (codec.warmup)
        table=np.ascontiguousarray(np.concatenate(
            [profile.table[slot, layer, kv, :, : kept[kv]].T for kv in range(2)])),
        shift=np.ascontiguousarray(np.concatenate(
            [profile.shift[slot, layer, kv, :, : kept[kv]].T for kv in range(2)])),
        lane_rows=np.array(starts + [kept[0] + kept[1]], dtype=np.int64),
    )


def _basis(profile: Profile, layer: int, kv: int, kept: int) -> torch.Tensor | None:
    if profile.basis is None:
        return None
    return torch.from_numpy(profile.basis[layer, kv, :kept])


def quantize_layer(profile: Profile, slot: int, layer: int, k: torch.Tensor, v: torch.Tensor
                   ) -> tuple[LayerPlan, np.ndarray, np.ndarray]:
    """(plan, quantized rows [R, T] int32, rANS symbols per row) of one layer.

    k and v are float32 [coded_tokens, C].
    """
    plan = plan_layer(profile, slot, layer, k.shape[0])
    coef = torch.cat([
        transform.forward(x, torch.from_numpy(profile.mean[layer, kv]), _basis(profile, layer, kv, plan.kept[kv]))
        for kv, x in enumerate((k, v))
    ]).numpy()
    q = np.empty(coef.shape, dtype=np.int32)
    symbols = np.empty(plan.rows, dtype=np.int64)
    if parallel.launch(rans.quantize_rows, coef, plan.step, plan.group, plan.table, plan.shift,
                       coder_tables(profile).freq, q, symbols) != rans.OK:
        raise ValuesOutOfRange(f"layer {layer}: KV values too large to quantize at this level "
                               f"(more than {rans.MAX_ABS_Q} steps from the profile mean)")
    return plan, q, symbols


def ideal_layer_bits(profile: Profile, plan: LayerPlan, q: np.ndarray) -> float:
    """Bits a perfect entropy coder would need for ``q`` under the profile's tables."""
    return float(parallel.launch(rans.ideal_bits, q, plan.group, plan.table, plan.shift,
                                 coder_tables(profile).freq).sum())


def encode_layer(profile: Profile, slot: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> bytes:
    """Lane payload of one layer: k and v are float32 [coded_tokens, C]."""
    plan, q, symbols = quantize_layer(profile, slot, layer, k, v)
    return pack_lanes(profile, plan, q, symbols)


def pack_lanes(profile: Profile, plan: LayerPlan, q: np.ndarray, symbols: np.ndarray) -> bytes:
    """rANS-code quantized rows into the lane payload (lane count, lengths, states, words)."""
    tables = coder_tables(profile)
    per_row = np.concatenate([[0], np.cumsum(symbols)])
    region_end = per_row[plan.lane_rows[1:]].astype(np.int64)  # one word per symbol at most
    words = np.empty(int(region_end[-1]) if plan.lanes else 0, dtype=np.uint16)
    first = np.empty(plan.lanes, dtype=np.int64)
    states = np.empty(plan.lanes, dtype=np.uint32)
    parallel.launch(rans.encode_lanes, q, plan.group, plan.table, plan.shift, tables.freq, tables.cdf,
                    plan.lane_rows, region_end, words, first, states)
    counts = (region_end - first).astype(np.uint32)
    keep = np.zeros(words.shape[0], dtype=bool)
    for lane in range(plan.lanes):
        keep[first[lane]: region_end[lane]] = True
    return b"".join((_U32.pack(plan.lanes), counts.astype("<u4").tobytes(),
                     states.astype("<u4").tobytes(), words[keep].astype("<u2").tobytes()))


def min_lane_words(profile: Profile, plan: LayerPlan, coded_tokens: int) -> np.ndarray:
    """Fewest words each lane of a valid stream can hold (FORMAT.md, "Limits").

    What ties a header's token count to the bytes present: every decoded value
    shrinks the rANS state by a least amount fixed by its table and shift, and each
    word read restores at most ~16 bits, so a lane of many values needs many words.
    """
    if plan.lanes == 0:
        return np.zeros(0, dtype=np.int64)
    groups = plan.group.astype(np.int64)
    anchors = np.where(groups > 0, -(-coded_tokens // np.maximum(groups, 1)), coded_tokens)
    counts = np.stack([anchors, coded_tokens - anchors], axis=1)               # [R, kind]
    bits = coder_tables(profile).value_bits[plan.table, plan.shift]             # [R, kind]
    lane_bits = np.add.reduceat((counts * bits).sum(axis=1), plan.lane_rows[:-1])  # lanes are never empty
    return rans.min_lane_words(lane_bits)


@dataclass(frozen=True)
class LanePayload:
    """A parsed lane payload: what either decoder (CPU or GPU) consumes."""

    plan: LayerPlan
    lane_start: np.ndarray  # i64 [lanes + 1]: word offset of each lane
    states: np.ndarray      # u32 [lanes]: final encoder states
    words: np.ndarray       # u16 [sum of word counts]


def parse_lanes(profile: Profile, slot: int, layer: int, coded_tokens: int,
                payload: memoryview) -> LanePayload:
    """Split a lane payload into its parts, checking every length against the plan."""
    plan = plan_layer(profile, slot, layer, coded_tokens)
    if len(payload) < _U32.size:
        raise CorruptBitstream(f"layer {layer}: lane table truncated")
    (lanes,) = _U32.unpack_from(payload, 0)
    if lanes != plan.lanes:
        raise CorruptBitstream(f"layer {layer}: {lanes} lanes, profile and shape imply {plan.lanes}")
    table_end = _U32.size + 8 * lanes
    if len(payload) < table_end:
        raise CorruptBitstream(f"layer {layer}: lane table truncated")
    counts = np.frombuffer(payload, dtype="<u4", count=lanes, offset=_U32.size).astype(np.int64)
    states = np.frombuffer(payload, dtype="<u4", count=lanes, offset=_U32.size + 4 * lanes)
    lane_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    if table_end + 2 * int(lane_start[-1]) != len(payload):
        raise CorruptBitstream(f"layer {layer}: lane lengths disagree with the section size")
    least = min_lane_words(profile, plan, coded_tokens)
    short = np.flatnonzero(counts < least)
    if short.size:  # checked before the caller sizes anything from the token count
        lane = int(short[0])
        raise CorruptBitstream(f"layer {layer}: lane {lane} has {int(counts[lane])} words, too few for "
                               f"{coded_tokens} tokens (at least {int(least[lane])})")
    words = np.frombuffer(payload, dtype="<u2", offset=table_end)
    # read-only whether the section came as bytes or as a bytearray: one array type for
    # the decode kernel (see the note in plan_layer)
    states.flags.writeable = False
    words.flags.writeable = False
    return LanePayload(plan, lane_start, states, words)


def decode_coefficients(profile: Profile, layer: int, lanes: LanePayload, coded_tokens: int) -> np.ndarray:
    """Entropy-decode and dequantize parsed lanes to coefficients [rows, coded_tokens]."""
    plan = lanes.plan
    coef = np.empty((plan.rows, coded_tokens), dtype=np.float32)
    tables = coder_tables(profile)
    status = parallel.launch(rans.decode_lanes, lanes.words, lanes.lane_start, lanes.states, plan.lane_rows,
                             plan.step, plan.group, plan.table, plan.shift, tables.freq, tables.cdf,
                             tables.lut, coef)
    if status != rans.OK:
        raise CorruptBitstream(f"layer {layer}: entropy-coded data is corrupt (code {status})")
    return coef


def decode_layer(profile: Profile, layer: int, lanes: LanePayload, out: torch.Tensor, position: int = 0) -> None:
    """Decode one layer's parsed lanes into ``out`` [2, coded_tokens, C] (K then V).

    ``position``: the first coded token's absolute position, where a rotary profile's
    keys get their RoPE back (in float32, before rounding to ``out``'s dtype).
    """
    plan = lanes.plan
    coef_t = torch.from_numpy(decode_coefficients(profile, layer, lanes, out.shape[1]))
    rows = (coef_t[: plan.kept[0]], coef_t[plan.kept[0]:])
    for kv in range(2):
        rope = None
        if kv == 0 and profile.rotary is not None:
            rope = (profile.rotary, profile.rotary.angles(position, out.shape[1]))
        transform.inverse(rows[kv], torch.from_numpy(profile.mean[layer, kv]),
                          _basis(profile, layer, kv, plan.kept[kv]), out[kv], rope)
