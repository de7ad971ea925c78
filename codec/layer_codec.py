"""One layer's K and V <-> the rANS lane payload of its section.

Glue between the pure pieces: transform (torch), quantizer and coder (numba),
and the lane layout (FORMAT.md, "Rows and lanes"). A lane is either ``rows_per_lane``
whole rows of K or of V (never both), or one ``piece`` of one row: ``piece``
consecutive tokens starting at an anchor. The encoder picks the shape per layer
so each lane carries at least about ``LANE_BITS`` ideal bits: its 6 bytes of lane
table and the ~3 bytes a rANS flush wastes then stay under ~2% of the payload,
and a chunk gets as many lanes as that budget allows (tens of thousands for a
Llama-3-8B-shaped 1536-token chunk: one GPU thread each).
"""
from __future__ import annotations

import math
import struct
import weakref
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch

from . import control, entropy, parallel, prediction, rans, transform
from .errors import CorruptBitstream
from .profile import Profile
from .stages import ENTROPY, TRANSFORM, stage

#: ideal bits the encoder aims to put in one lane (FORMAT.md, "The encoder's choice")
LANE_BITS = 2048
#: most values one lane may hold, so its word count fits the u16 lane table entry: each
#: value takes at most MAX_STEPS_PER_VALUE coder steps and each step at most one word
MAX_LANE_VALUES = 0xFFFF // rans.MAX_STEPS_PER_VALUE
#: version 5's lane table head: n_lanes, piece (0: whole rows), rows_per_lane, the section's
#: float32 step of K and of V, and its kept rows of K and of V (FORMAT.md, "Section")
LANE_HEAD = struct.Struct("<IHHffHH")
#: version 4's: n_lanes, piece, rows_per_lane (steps and kept rows are the profile's)
V4_LANE_HEAD = struct.Struct("<IHH")
#: versions 2 and 3: n_lanes only; lanes of whole rows, at least LEGACY_LANE_VALUES values each
LEGACY_LANE_HEAD = struct.Struct("<I")
LEGACY_LANE_VALUES = 4096


class NotCodable(ValueError):
    """A layer the lanes cannot carry at this level (the encoder then sends it raw)."""


class ValuesOutOfRange(NotCodable):
    """A layer's values are too far from the profile's mean to quantize at this level."""


class RowsTooLong(NotCodable):
    """Rows too long for one lane that cannot be cut into pieces starting at anchors
    (a profile whose delta group exceeds MAX_LANE_VALUES, for chunks longer than that)."""


@dataclass(frozen=True)
class CoderTables:
    freq: np.ndarray
    cdf: np.ndarray
    lut: np.ndarray
    coder: np.ndarray       # u32 [classes, ALPHABET]: freq | cdf << 16, what the CPU decoder loads
    cost: np.ndarray        # f64 [classes, ALPHABET]: entropy.symbol_cost_bits
    value_bits: np.ndarray  # f64 [classes, PROB_BITS + 1]: rans.min_value_bits


_coder_tables: "weakref.WeakKeyDictionary[Profile, CoderTables]" = weakref.WeakKeyDictionary()


def coder_tables(profile: Profile) -> CoderTables:
    """Frequency, cumulative and slot tables of a profile (built once per profile)."""
    tables = _coder_tables.get(profile)
    if tables is None:
        tables = CoderTables(freq=profile.tables, cdf=entropy.cumulative(profile.tables),
                             lut=entropy.slot_lookup(profile.tables),
                             coder=entropy.packed_coder(profile.tables),
                             cost=entropy.symbol_cost_bits(profile.tables),
                             value_bits=rans.min_value_bits(profile.tables))
        _coder_tables[profile] = tables
    return tables


@dataclass(frozen=True)
class LayerPlan:
    """Row parameters and lane shape of one layer at one level."""

    kept: tuple[int, int]
    steps: tuple[float, float]  # the section's step of K and of V (float32 values)
    step: np.ndarray       # f32 [R]: each row's step, what a decoder dequantizes with
    group: np.ndarray      # i32 [R]
    table: np.ndarray      # u8 [R, 2]
    shift: np.ndarray      # u8 [R, 2]
    tokens: int            # coded tokens N: the length of a row
    rows_per_lane: int = 1
    piece: int = 0         # tokens per piece; 0 (as built) means whole rows, i.e. N

    @property
    def rows(self) -> int:
        return int(self.step.shape[0])

    @property
    def piece_tokens(self) -> int:
        """Tokens per piece: N when lanes hold whole rows."""
        return self.piece or max(self.tokens, 1)

    @property
    def pieces(self) -> int:
        """Pieces per row (one, possibly empty, when lanes hold whole rows)."""
        return max(1, -(-self.tokens // self.piece_tokens))

    @property
    def lanes(self) -> int:
        """FORMAT.md: (ceil(kept_K / G) + ceil(kept_V / G)) * ceil(N / piece)."""
        return sum(-(-k // self.rows_per_lane) for k in self.kept) * self.pieces

    def with_lanes(self, rows_per_lane: int, piece: int) -> "LayerPlan":
        return replace(self, rows_per_lane=rows_per_lane, piece=piece)

    def delta_step(self) -> int:
        """Least common multiple of the delta groups of the coded rows (1 without any):
        a piece must be a multiple of it to start at an anchor in every row."""
        groups = [int(self.group[0 if kv == 0 else self.kept[0]]) for kv in range(2) if self.kept[kv]]
        return math.lcm(1, *(g for g in groups if g > 0))

    def shape_error(self) -> str | None:
        """Why this lane shape is not one FORMAT.md allows, else None."""
        if self.rows_per_lane < 1:
            return "rows_per_lane must be >= 1"
        if self.piece == 0:
            if self.rows_per_lane * self.tokens > MAX_LANE_VALUES:
                return (f"lanes of {self.rows_per_lane} rows x {self.tokens} tokens pass "
                        f"{MAX_LANE_VALUES} values")
            return None
        if self.rows_per_lane != 1:
            return "a lane of pieces holds one row"
        if not self.piece < self.tokens or self.piece > MAX_LANE_VALUES:
            return f"piece of {self.piece} tokens not in [1, min(N - 1, {MAX_LANE_VALUES})] for N = {self.tokens}"
        if self.piece % self.delta_step():
            return f"piece of {self.piece} tokens does not start at anchors (delta groups {self.delta_step()})"
        return None

    def spans(self) -> np.ndarray:
        """i64 [lanes, 4]: each lane's first row, end row, first token, end token."""
        out = np.empty((self.lanes, 4), dtype=np.int64)
        rans.lane_spans(self.kept[0], self.rows, self.rows_per_lane, self.piece_tokens, self.tokens, out)
        return out


def plan_layer(profile: Profile, slot: int, layer: int, coded_tokens: int,
               steps: tuple[float, float] | None = None, kept: tuple[int, int] | None = None) -> LayerPlan:
    """The layer's rows, one lane per whole row until a lane shape is chosen or read.

    ``steps`` and ``kept`` (K, V): the section's own (format version 5, chosen by
    ``codec.control``); None takes the profile's for level ``slot`` (versions 2-4).
    """
    if steps is None:
        steps = (float(profile.steps[slot, layer, 0]), float(profile.steps[slot, layer, 1]))
    if kept is None:
        kept = (int(profile.kept[slot, layer, 0]), int(profile.kept[slot, layer, 1]))
    return LayerPlan(
        kept=kept,
        steps=steps,
        step=np.concatenate([np.full(kept[kv], steps[kv], dtype=np.float32) for kv in range(2)]),
        group=np.concatenate([np.full(kept[kv], profile.delta_group[layer, kv], dtype=np.int32)
                              for kv in range(2)]),
        # C order whatever kept is (concatenating transposes yields Fortran order when both
        # parts have >= 2 rows): one array type per kernel argument, so one numba
        # specialization per kernel to compile or load (codec.warmup)
        table=np.ascontiguousarray(np.concatenate(
            [profile.table[slot, layer, kv, :, : kept[kv]].T for kv in range(2)])),
        shift=np.ascontiguousarray(np.concatenate(
            [profile.shift[slot, layer, kv, :, : kept[kv]].T for kv in range(2)])),
        tokens=coded_tokens,
    )


def shape_lanes(plan: LayerPlan, row_bits: np.ndarray) -> LayerPlan:
    """The encoder's lane shape (FORMAT.md, "The encoder's choice"): lanes of at least
    ``target`` values, the layer's average values per LANE_BITS ideal bits, so the lane
    table and flushes cost at most ~40 bits per LANE_BITS: whole rows when a row holds
    fewer (as few per lane as reach it), else each row cut into as many equal pieces as
    keep them that long, each a multiple of the delta step and at most MAX_LANE_VALUES.

    Raises RowsTooLong when rows longer than MAX_LANE_VALUES cannot be cut at anchors.
    """
    tokens = plan.tokens
    total = float(row_bits.sum())
    target = MAX_LANE_VALUES if total <= 0 else \
        int(min(MAX_LANE_VALUES, max(1.0, math.ceil(LANE_BITS * plan.rows * tokens / total))))
    if tokens <= target:
        return plan.with_lanes(min(-(-target // max(tokens, 1)), MAX_LANE_VALUES // max(tokens, 1)), 0)
    step = plan.delta_step()
    pieces = max(tokens // target, -(-tokens // MAX_LANE_VALUES))
    piece = -(-(-(-tokens // pieces)) // step) * step  # ceil(N / pieces), rounded up to the step
    if pieces > 1 and piece < tokens and piece <= MAX_LANE_VALUES:
        return plan.with_lanes(1, piece)
    if tokens <= MAX_LANE_VALUES:
        return plan.with_lanes(1, 0)
    raise RowsTooLong(f"rows of {tokens} tokens with delta groups of {step} cannot be cut into "
                      f"lanes of at most {MAX_LANE_VALUES} values")


def _basis(profile: Profile, layer: int, kv: int, kept: int) -> torch.Tensor | None:
    if profile.basis is None:
        return None
    return torch.from_numpy(profile.basis[layer, kv, :kept])


Coefficients = tuple[transform.Coefficients, transform.Coefficients]


def layer_coefficients(profile: Profile, layer: int, k: torch.Tensor, v: torch.Tensor,
                       kept: tuple[int, int]) -> Coefficients:
    """The transform of a layer's K and V (float32 [coded_tokens, C]) for their first
    ``kept`` rows: one product serves every level that keeps as many or fewer."""
    return tuple(transform.forward_bounded(x, torch.from_numpy(profile.mean[layer, kv]),
                                           _basis(profile, layer, kv, kept[kv]))
                 for kv, x in enumerate((k, v)))


def quantize_layer(profile: Profile, slot: int, layer: int, k: torch.Tensor, v: torch.Tensor,
                   steps: tuple[float, float] | None = None, kept: tuple[int, int] | None = None,
                   coefficients: Coefficients | None = None) -> tuple[LayerPlan, np.ndarray, np.ndarray]:
    """(plan, quantized rows [R, T] int32, ideal coded bits per row) of one layer.

    k and v are float32 [coded_tokens, C]; ``steps`` and ``kept`` as in plan_layer;
    ``coefficients``: their ``layer_coefficients`` for at least the plan's kept rows
    (None: computed here). The plan's lane shape is not chosen yet (``shape_lanes``
    does, from the bits).
    """
    plan = plan_layer(profile, slot, layer, k.shape[0], steps, kept)
    if coefficients is None:
        coefficients = layer_coefficients(profile, layer, k, v, plan.kept)
    q = np.empty((plan.rows, k.shape[0]), dtype=np.int32)
    row_bits = np.empty(plan.rows, dtype=np.float64)
    tables = coder_tables(profile)
    first = 0
    for kv in range(2):
        coef = coefficients[kv].head(plan.kept[kv])
        rows = slice(first, first + coef.values.shape[0])
        first = rows.stop
        if parallel.launch(rans.quantize_rows, *coef, plan.step[rows], plan.group[rows], plan.table[rows],
                           plan.shift[rows], tables.freq, tables.cost, q[rows], row_bits[rows]) != rans.OK:
            raise ValuesOutOfRange(f"layer {layer}: KV values too large to quantize at this level "
                                   f"(more than {rans.MAX_ABS_Q} steps from the profile mean)")
    return plan, q, row_bits


def ideal_layer_bits(profile: Profile, plan: LayerPlan, q: np.ndarray) -> float:
    """Bits a perfect entropy coder would need for ``q`` under the profile's tables."""
    tables = coder_tables(profile)
    return float(parallel.launch(rans.ideal_bits, q, plan.group, plan.table, plan.shift,
                                 tables.freq, tables.cost).sum())


class EncodedLayer(NamedTuple):
    """A layer's lane payload and the quantized rows it codes."""

    payload: bytes
    plan: LayerPlan
    q: np.ndarray       # i32 [R, T]

    def dequantized(self) -> np.ndarray:
        """f32 [T, R]: the coefficients a decoder gets from ``payload``
        (:func:`decode_coefficients`), bit for bit, from the rows themselves."""
        out = np.empty((self.plan.tokens, self.plan.rows), dtype=np.float32)
        parallel.launch(rans.dequantize_rows, self.q, self.plan.step, self.plan.group, out)
        return out


def encode_layer(profile: Profile, slot: int, layer: int, k: torch.Tensor, v: torch.Tensor,
                 steps: tuple[float, float] | None = None, kept: tuple[int, int] | None = None,
                 coefficients: Coefficients | None = None) -> EncodedLayer:
    """One layer's lanes: k and v are float32 [coded_tokens, C]; ``steps`` and ``kept``
    as in plan_layer (recorded in the lane table); ``coefficients`` as in quantize_layer."""
    plan, q, row_bits = quantize_layer(profile, slot, layer, k, v, steps, kept, coefficients)
    plan = shape_lanes(plan, row_bits)
    return EncodedLayer(pack_lanes(profile, plan, q), plan, q)


def pack_lanes(profile: Profile, plan: LayerPlan, q: np.ndarray) -> bytes:
    """rANS-code quantized rows into the version 5 lane payload (FORMAT.md, "Rows and lanes")."""
    tables = coder_tables(profile)
    spans = plan.spans()
    values = (spans[:, 1] - spans[:, 0]) * (spans[:, 3] - spans[:, 2])
    region_end = np.cumsum(rans.MAX_STEPS_PER_VALUE * values)  # each coder step writes <= 1 word
    words = np.empty(int(region_end[-1]) if plan.lanes else 0, dtype=np.uint16)
    first = np.empty(plan.lanes, dtype=np.int64)
    states = np.empty(plan.lanes, dtype=np.uint32)
    parallel.launch(rans.encode_lanes, q, plan.group, plan.table, plan.shift, tables.freq, tables.cdf,
                    plan.kept[0], plan.rows_per_lane, plan.piece_tokens, region_end, words, first, states)
    counts = region_end - first  # <= 4 * MAX_LANE_VALUES < 2**16 words
    packed_start = np.cumsum(counts) - counts
    used = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(first - packed_start, counts)
    head = LANE_HEAD.pack(plan.lanes, plan.piece, plan.rows_per_lane, *plan.steps, *plan.kept)
    return b"".join((head, states.astype("<u4").tobytes(),
                     counts.astype("<u2").tobytes(), words[used].astype("<u2").tobytes()))


def min_lane_words(profile: Profile, plan: LayerPlan) -> np.ndarray:
    """Fewest words each lane of a valid stream can hold (FORMAT.md, "Limits").

    What ties a header's token count to the bytes present: every decoded value
    shrinks the rANS state by a least amount fixed by its table and shift, and each
    word read restores at most ~16 bits, so a lane of many values needs many words.
    """
    if plan.lanes == 0:
        return np.zeros(0, dtype=np.int64)
    first_row, _, first_token, end_token = plan.spans().T
    tokens = end_token - first_token
    groups = plan.group[first_row].astype(np.int64)  # one group per lane: lanes never mix K and V
    anchors = np.where(groups > 0, -(-tokens // np.maximum(groups, 1)), tokens)  # pieces start at anchors
    value_bits = coder_tables(profile).value_bits[plan.table, plan.shift]       # [R, kind]
    # whole rows: a lane's rows are consecutive and lanes cover them in order; pieces: one row each
    per_lane = np.add.reduceat(value_bits, first_row, axis=0) if plan.pieces == 1 else value_bits[first_row]
    return rans.min_lane_words(anchors * per_lane[:, 0] + (tokens - anchors) * per_lane[:, 1])


@dataclass(frozen=True)
class LanePayload:
    """A parsed lane payload: what either decoder (CPU or GPU) consumes."""

    plan: LayerPlan
    lane_start: np.ndarray  # i64 [lanes + 1]: word offset of each lane
    states: np.ndarray      # u32 [lanes]: final encoder states
    words: np.ndarray       # u16 [sum of word counts]


@dataclass(frozen=True)
class _LaneHead:
    """The fixed head of a lane table, as stored; nothing in it checked yet but its length."""

    lanes: int
    size: int                              # bytes the head takes: where states and counts start
    shape: tuple[int, int] | None          # (rows_per_lane, piece); None before version 4
    steps: tuple[float, float] | None      # the section's own (version 5 only)
    kept: tuple[int, int] | None           # likewise


def _lane_head(layer: int, payload: memoryview, version: int) -> _LaneHead:
    """The lane table head of a blob of format ``version``: the one place it is unpacked."""
    head = LANE_HEAD if version >= 5 else V4_LANE_HEAD if version >= 4 else LEGACY_LANE_HEAD
    if len(payload) < head.size:
        raise CorruptBitstream(f"layer {layer}: lane table truncated")
    lanes, *fields = head.unpack_from(payload, 0)
    if version < 4:
        return _LaneHead(lanes, head.size, None, None, None)
    piece, rows_per_lane, *own = fields
    steps, kept = ((own[0], own[1]), (own[2], own[3])) if own else (None, None)
    return _LaneHead(lanes, head.size, (rows_per_lane, piece), steps, kept)


def _section_plan(profile: Profile, slot: int, layer: int, coded_tokens: int, head: _LaneHead
                  ) -> LayerPlan:
    """A section's plan: a version 5 section's own steps and kept rows, each checked before
    use (a step a finite normal float32 in [MIN_STEP, MAX_STEP]; kept rows at most the
    profile's stored basis rows, every channel for an identity profile); the profile's
    level ``slot`` before version 5."""
    if head.steps is None or head.kept is None:
        return plan_layer(profile, slot, layer, coded_tokens)
    for name, step in zip("KV", head.steps):
        if not control.MIN_STEP <= step <= control.MAX_STEP:  # False for NaN
            raise CorruptBitstream(f"layer {layer}: {name} step {step!r} outside "
                                   f"[{control.MIN_STEP!r}, {control.MAX_STEP!r}]")
    rows = profile.channels if profile.basis is None else profile.basis.shape[2]
    for name, kept in zip("KV", head.kept):
        if kept > rows or (profile.basis is None and kept != rows):
            raise CorruptBitstream(f"layer {layer}: {kept} kept {name} rows, the profile "
                                   f"{'codes every one of' if profile.basis is None else 'stores'} {rows}")
    return plan_layer(profile, slot, layer, coded_tokens, head.steps, head.kept)


def _lane_shape(plan: LayerPlan, layer: int, head: _LaneHead) -> LayerPlan:
    """The plan with the head's lane shape, checked against FORMAT.md before the lane count
    is compared with it. Versions 2 and 3 have no shape fields: whole rows, G = ceil(4096 / N)."""
    if head.shape is None:
        return plan.with_lanes(-(-LEGACY_LANE_VALUES // max(plan.tokens, 1)), 0)
    plan = plan.with_lanes(*head.shape)
    error = plan.shape_error()
    if error:
        raise CorruptBitstream(f"layer {layer}: impossible lane shape: {error}")
    return plan


def parse_lanes(profile: Profile, slot: int, layer: int, coded_tokens: int, payload: memoryview,
                version: int) -> LanePayload:
    """Split a lane payload of a blob of format ``version`` into its parts, checking
    every length against the plan before sizing anything from it.

    The result's ``plan`` is what every decoder (CPU or GPU) dequantizes with:
    ``plan.step`` (f32, one per row) and ``plan.steps`` / ``plan.kept`` (K, V): the
    section's own in version 5, the profile's level ``slot`` before.
    """
    payload = memoryview(payload)
    head = _lane_head(layer, payload, version)
    plan = _lane_shape(_section_plan(profile, slot, layer, coded_tokens, head), layer, head)
    lanes, offset = head.lanes, head.size
    state_type, count_type = "<u4", "<u2" if version >= 4 else "<u4"
    if lanes != plan.lanes:
        raise CorruptBitstream(f"layer {layer}: {lanes} lanes, profile and shape imply {plan.lanes}")
    state_size, count_size = np.dtype(state_type).itemsize, np.dtype(count_type).itemsize
    table_end = offset + (state_size + count_size) * lanes
    if len(payload) < table_end:
        raise CorruptBitstream(f"layer {layer}: lane table truncated")
    states_at, counts_at = (offset, offset + state_size * lanes) if version >= 4 else \
        (offset + count_size * lanes, offset)
    counts = np.frombuffer(payload, dtype=count_type, count=lanes, offset=counts_at).astype(np.int64)
    states = np.frombuffer(payload, dtype=state_type, count=lanes, offset=states_at)
    lane_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    if table_end + 2 * int(lane_start[-1]) != len(payload):
        raise CorruptBitstream(f"layer {layer}: lane lengths disagree with the section size")
    least = min_lane_words(profile, plan)
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
    """Entropy-decode and dequantize parsed lanes to coefficients [coded_tokens, rows],
    token-major: the inverse transform's product reads them so without a transposing
    copy (which costs ten times a plain conversion), as the CUDA kernel writes them."""
    plan = lanes.plan
    coef = np.empty((coded_tokens, plan.rows), dtype=np.float32)
    tables = coder_tables(profile)
    with stage(ENTROPY):
        tasks = np.empty((plan.lanes, 2), dtype=np.int64)
        n_tasks = rans.lane_tasks(plan.kept[0], plan.rows, plan.rows_per_lane, plan.piece_tokens, coded_tokens,
                                  plan.group, tasks)
        status = parallel.launch(rans.decode_lanes, lanes.words, lanes.lane_start, lanes.states, plan.kept[0],
                                 plan.rows_per_lane, plan.piece_tokens, plan.step, plan.group, plan.table,
                                 plan.shift, tables.lut, tables.coder, tasks, n_tasks, coef)
    if status != rans.OK:
        raise CorruptBitstream(f"layer {layer}: entropy-coded data is corrupt (code {status})")
    return coef


def reached(profile: Profile, layer: int, previous: prediction.State | None) -> prediction.Reached | None:
    """``codec.prediction.reached`` for a predicting profile's layer ``layer``, from
    ``previous``, the state of the layer before it (None at an intra layer)."""
    with stage(TRANSFORM):
        return prediction.reached(previous, int(profile.chain_reach[layer]), profile.chain_entries[layer])


def coded_state(profile: Profile, layer: int, coef_t: torch.Tensor, kept: tuple[int, int],
                reached_both: prediction.Reached | None) -> prediction.State:
    """A predicting profile's coded layer's state (K's and V's, bfloat16 [coded_tokens, C];
    ``codec.prediction``) from its token-major coefficients ``coef_t`` ([coded_tokens,
    kept K + kept V]) and what it takes of the layer before (:func:`reached`): what the
    decoder carries to the next layer, and the encoder too."""
    with stage(TRANSFORM):
        return prediction.layer_state((coef_t[:, :kept[0]], coef_t[:, kept[0]:]), profile.chain_matrices[layer],
                                      int(profile.chain_reach[layer]), reached_both)


def decode_layer(profile: Profile, layer: int, lanes: LanePayload, out: torch.Tensor, position: int = 0,
                 previous: prediction.State | None = None) -> prediction.State | None:
    """Decode one layer's parsed lanes into ``out`` [2, coded_tokens, C] (K then V).

    ``position``: the first coded token's absolute position, where a rotary profile's
    keys get their RoPE back (in float32, before rounding to ``out``'s dtype).
    A predicting profile's layer is decoded from ``previous`` (:func:`coded_state`), and
    its own state is returned for the next.
    """
    plan = lanes.plan
    coef_t = torch.from_numpy(decode_coefficients(profile, layer, lanes, plan.tokens))
    state = None if profile.predictor is None else \
        coded_state(profile, layer, coef_t, plan.kept, reached(profile, layer, previous))
    for kv in range(2):
        rope = None
        if kv == 0 and profile.rotary is not None:
            rope = (profile.rotary, profile.rotary.angles(position, plan.tokens))
        if state is None:
            part = coef_t[:, :plan.kept[0]] if kv == 0 else coef_t[:, plan.kept[0]:]
            values = transform.inverse(part, torch.from_numpy(profile.mean[layer, kv]),
                                       None if profile.basis16 is None else profile.basis16[layer, kv])
        else:
            with stage(TRANSFORM):
                values = state[kv].float().add_(profile.chain_offsets[layer, kv])
        transform.finish(values, out[kv], rope)
    return state
