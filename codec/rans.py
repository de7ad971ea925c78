"""Quantizer and rANS coder kernels (numba), one independent stream per lane.

Coder parameters (written down in FORMAT.md, mirrored by the CUDA decoder):

* state: 32 bits, kept in ``[STATE_LOW, 2**32)`` with ``STATE_LOW = 2**16``;
* renormalisation in 16-bit words: with 12-bit probabilities a decode step
  leaves the state >= 2**4, so exactly one word read restores it (no loop);
* probabilities: 12 bits (``entropy.PROB_SCALE``); decode is a table lookup,
  a multiply and an add: no division and no bit loop.

A *row* is one transformed component (of K or V) over the chunk's coded tokens;
a *lane* is one stream with one state: a run of ``rows_per_lane`` consecutive
whole rows, or one ``piece`` of ``piece`` consecutive tokens of one row (FORMAT.md,
"Rows and lanes"; :func:`lane_span` maps a lane to its rows and tokens). Lanes are
independent, so they decode in parallel (``prange`` here, one thread per lane on
the GPU). Per value the stream holds, in decode order:

* the symbol ``(q >> shift) + ZERO_SYMBOL`` under the row's table, then
  ``shift`` raw low bits as one uniform symbol, or
* ``ESCAPE`` followed by ``zigzag(q)`` as three uniform 12-bit symbols, low first.

Delta rows (CacheGen's anchor/delta option) code every ``group``-th token
directly (the anchor) and the others as the difference to the *reconstructed*
anchor, each kind with its own table and shift. A piece starts at a multiple of
its row's group, i.e. at an anchor, so it needs nothing from the piece before.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .entropy import ESCAPE, PROB_BITS, PROB_SCALE, ZERO_SYMBOL

STATE_LOW = np.int64(1 << 16)
WORD_BITS = 16
WORD_MASK = np.int64(0xFFFF)
SLOT_MASK = np.int64(PROB_SCALE - 1)
ESCAPE_CHUNKS = 3
#: |q| must stay below this so zigzag(q) fits the 36 escape bits with room to spare
MAX_ABS_Q = 1 << 30
#: Most coder steps (each emits at most one word) one value takes: an escape and its chunks.
MAX_STEPS_PER_VALUE = 1 + ESCAPE_CHUNKS

#: Most a state's log2 can grow per word read: (x << 16 | w) < (x + 1) * 2**16, and a
#: state about to be refilled is >= 16 (a symbol step leaves it >= f * 16).
_WORD_GROWTH_BITS = WORD_BITS + np.log2(17.0 / 16.0)


def min_step_bits(freq: np.ndarray) -> np.ndarray:
    """Least log2 a decode step with frequency ``freq`` shrinks any state in [2**16, 2**32).

    x' = f*(x >> 12) + slot - c = x - (4096 - f)*(x >> 12) - c < x*f/4096 + 4096 - f,
    so x'/x < (15*f + 4096) / 2**16 for x >= 2**16 (FORMAT.md, "Limits").
    """
    return WORD_BITS - np.log2(15.0 * np.asarray(freq, dtype=np.float64) + PROB_SCALE)


def min_value_bits(tables: np.ndarray) -> np.ndarray:
    """[classes, PROB_BITS + 1]: the least state bits one coded value can take, by table
    class and shift: its symbol (the likeliest one but the escape) plus its ``shift``
    uniform low bits, or the escape plus its three 12-bit chunks, whichever is less."""
    freq = tables.astype(np.int64)
    likeliest = freq[:, :ESCAPE].max(axis=1)
    shifts = np.arange(PROB_BITS + 1)
    low_bits = np.where(shifts > 0, min_step_bits(1 << (PROB_BITS - shifts)), 0.0)
    symbol = np.where(likeliest > 0, min_step_bits(likeliest), np.inf)
    escaped = min_step_bits(freq[:, ESCAPE]) + ESCAPE_CHUNKS * min_step_bits(1)
    return np.minimum(symbol[:, None] + low_bits[None, :], escaped[:, None])


def min_lane_words(bits: np.ndarray) -> np.ndarray:
    """Fewest words a lane whose decode steps shrink the state by ``bits`` can hold.

    A lane starts below 2**32 and ends at exactly 2**16, so 16 + bits < 32 + words *
    _WORD_GROWTH_BITS; the float margin keeps a valid lane from ever failing the check.
    """
    needed = (np.asarray(bits, dtype=np.float64) * (1 - 1e-9) - WORD_BITS) / _WORD_GROWTH_BITS
    return np.maximum(np.floor(needed), 0).astype(np.int64)


# status codes returned by the kernels
OK = 0
OVERFLOW = 1       # a value too large for the quantizer (encode)
OUT_OF_WORDS = 2   # a lane read past its words (decode)
BAD_FINAL = 3      # a lane ended in the wrong state or with words left (decode)
BAD_ESCAPE = 4     # an escaped value outside the representable range (decode)


@njit(cache=True, nogil=True, inline="always")
def _symbol_kind(t, group):
    """0 for a directly coded value, 1 for a delta against the group's anchor."""
    if group > 0 and t % group != 0:
        return 1
    return 0


@njit(cache=True, nogil=True, inline="always")
def lane_span(lane, kept_k, rows, rows_per_lane, piece, tokens):
    """(first row, end row, first token, end token) of ``lane`` (FORMAT.md, "Rows and lanes").

    K's lanes come first, then V's; inside each, lanes run piece by piece, and within
    a piece over groups of ``rows_per_lane`` rows (the CUDA kernel's twin: lane_span
    in kernels/kvwire_kernels/rans_decode.cu).
    """
    pieces = max(1, (tokens + piece - 1) // piece)
    groups_k = (kept_k + rows_per_lane - 1) // rows_per_lane
    base = 0
    count = kept_k
    groups = groups_k
    j = lane
    if lane >= groups_k * pieces:
        base = kept_k
        count = rows - kept_k
        groups = (count + rows_per_lane - 1) // rows_per_lane
        j = lane - groups_k * pieces
    first = base + (j % groups) * rows_per_lane
    t0 = (j // groups) * piece
    return first, min(first + rows_per_lane, base + count), t0, min(t0 + piece, tokens)


@njit(cache=True, nogil=True, inline="always")
def _value_bits(v, b, tab, freq, cost):
    """Ideal bits of value ``v`` with ``b`` low bits under table ``tab`` (cost: -log2 p)."""
    idx = (v >> b) + ZERO_SYMBOL
    if idx >= 0 and idx < ESCAPE and freq[tab, idx] > 0:
        return cost[tab, idx] + b
    return cost[tab, ESCAPE] + PROB_BITS * ESCAPE_CHUNKS


#: stands for "past MAX_ABS_Q" among quantized values (no valid one reaches it)
_OVERFLOW_Q = np.int64(MAX_ABS_Q) << 2


@njit(cache=True, nogil=True, inline="always")
def _scaled(value, kind, anchor, s):
    """Coefficient ``value`` (float32) in steps, against the anchor for a delta value."""
    return (value - anchor if kind == 1 else value) / s


@njit(cache=True, nogil=True, inline="always")
def _integer(scaled):
    """The quantizer's integer for a value ``scaled`` steps from 0, or _OVERFLOW_Q."""
    return np.int64(np.rint(scaled)) if abs(scaled) < MAX_ABS_Q else _OVERFLOW_Q


@njit(cache=True, nogil=True, inline="always")
def _quantized(value, kind, anchor, s):
    """The quantizer's integer for coefficient ``value`` (float32): non-decreasing in
    ``value`` for a step ``s`` > 0, which is what makes an interval's two ends decide it."""
    return _integer(_scaled(value, kind, anchor, s))


@njit(cache=True, nogil=True, inline="always")
def _exact_coefficient(basis, tokens, r, t):
    """Basis row ``r`` dot token ``t`` in float64, in index order, rounded once to float32."""
    total = 0.0
    for c in range(basis.shape[1]):
        total += np.float64(basis[r, c]) * np.float64(tokens[t, c])
    return np.float32(total)


@njit(cache=True, nogil=True, parallel=True)
def quantize_rows(coef, basis, tokens, row_bound, token_norm, step, group, table, shift, freq, cost,
                  q_out, row_bits):
    """Quantize rows of coefficients to integers; the ideal coded bits of each row.

    ``coef`` is float32 [R, T]; delta values are taken against the anchor as the
    decoder will rebuild it (float32 ``q * step``), so errors never accumulate.
    ``cost`` is ``entropy.symbol_cost_bits`` of the tables. Returns OK, or OVERFLOW
    when a value exceeds the representable range.

    ``coef`` may come from a float32 GEMM of ``basis`` [R, C] by ``tokens`` [T, C],
    whose rounding depends on the BLAS kernel; the integers must not. Each value is
    within ``row_bound[r] * token_norm[t]`` of the reference coefficient (the float64
    product rounded once to float32, :func:`_exact_coefficient`), so where both ends
    of that interval quantize alike the reference does too (the quantizer is monotone);
    elsewhere, a small share, the reference is computed and quantized. A zero
    ``row_bound`` marks exact rows (the identity transform, or a float64 product).
    """
    rows, tokens_n = coef.shape
    status = np.zeros(max(rows, 1), dtype=np.int32)  # a layer may keep no rows at all
    for r in prange(rows):
        s = step[r]
        g = group[r]
        bound = row_bound[r]
        reach = 2.0 * bound / s  # twice the bound in steps, per unit of token norm
        total = 0.0
        if g == 0:  # no anchors: one table and shift for the row (most rows; 2-3x faster so)
            tab, b = table[r, 0], np.int64(shift[r, 0])
            for t in range(tokens_n):
                v = _reference_q(coef[r, t], 0, np.float32(0.0), s, bound, reach, token_norm[t], basis, tokens, r, t)
                if v == _OVERFLOW_Q:
                    status[r], v = OVERFLOW, np.int64(0)
                q_out[r, t] = v
                total += _value_bits(v, b, tab, freq, cost)
        else:
            anchor = np.float32(0.0)
            for t in range(tokens_n):
                kind = _symbol_kind(t, g)
                v = _reference_q(coef[r, t], kind, anchor, s, bound, reach, token_norm[t], basis, tokens, r, t)
                if v == _OVERFLOW_Q:
                    status[r], v = OVERFLOW, np.int64(0)
                q_out[r, t] = v
                if kind == 0:
                    anchor = np.float32(v) * s
                total += _value_bits(v, np.int64(shift[r, kind]), table[r, kind], freq, cost)
        row_bits[r] = total
    return status.max()


@njit(cache=True, nogil=True, parallel=True)
def dequantize_rows(q, step, group, out):
    """The coefficients a decoder rebuilds from quantized rows ``q`` (int32 [R, T]) into
    ``out`` (float32 [T, R], token-major), with :func:`decode_lanes`'s arithmetic: an
    encoder that carries the decoded state (inter-layer prediction) gets it from its own
    integers, bit for bit, without entropy-decoding what it just coded."""
    rows, tokens = q.shape
    for r in prange(rows):
        s = step[r]
        g = group[r]
        anchor = np.float32(0.0)
        for t in range(tokens):
            value = np.float32(q[r, t]) * s
            if _symbol_kind(t, g) == 1:
                value = anchor + value
            elif g > 0:
                anchor = value
            out[t, r] = value


@njit(cache=True, nogil=True, inline="always")
def _reference_q(value, kind, anchor, s, bound, reach, norm, basis, tokens, r, t):
    """The integer the reference coefficient of ``value`` quantizes to (quantize_rows):
    ``value``'s own unless it lies within its bound (``bound * norm``; ``reach``: twice
    ``bound / s``) of a rounding boundary, or _OVERFLOW_Q."""
    scaled = _scaled(value, kind, anchor, s)
    v = _integer(scaled)
    # cheap and conservative: far (in steps) from a rounding boundary, v stands
    if bound > 0 and 0.5 - abs(scaled - np.rint(scaled)) <= reach * norm + 2.0 ** -20 * (abs(scaled) + 1.0):
        # exact: the interval, widened past float32's rounding of its ends
        wide = np.float64(value)
        slack = bound * norm * (1.0 + 2.0 ** -20) + abs(wide) * 2.0 ** -20 + 2.0 ** -140
        lo, hi = np.float32(wide - slack), np.float32(wide + slack)
        if _quantized(lo, kind, anchor, s) != _quantized(hi, kind, anchor, s):
            v = _quantized(_exact_coefficient(basis, tokens, r, t), kind, anchor, s)
    return v


@njit(cache=True, nogil=True, inline="always")
def _put(x, start, f, words, pos):
    """Encode one symbol (slot range [start, start+f)) into state x; words grow down."""
    if x >= (np.int64(f) << (32 - PROB_BITS)):
        words[pos] = x & WORD_MASK
        pos -= 1
        x >>= WORD_BITS
    x = ((x // f) << PROB_BITS) + (x % f) + start
    return x, pos


@njit(cache=True, nogil=True, parallel=True)
def encode_lanes(q, group, table, shift, freq, cdf, kept_k, rows_per_lane, piece, region_end, words,
                 first_word, final_state):
    """rANS-encode every lane; lane i writes its words downwards ending at region_end[i].

    Encoding runs backwards over the lane's values so the decoder reads forwards;
    writing words downwards leaves them in read order at ``words[first_word[i]:region_end[i]]``.
    """
    n_lanes = final_state.shape[0]
    rows, tokens = q.shape
    for lane in prange(n_lanes):
        r0, r1, t0, t1 = lane_span(lane, kept_k, rows, rows_per_lane, piece, tokens)
        x = STATE_LOW
        pos = region_end[lane] - 1
        for r in range(r1 - 1, r0 - 1, -1):
            g = group[r]
            for t in range(t1 - 1, t0 - 1, -1):
                kind = _symbol_kind(t, g)
                v = np.int64(q[r, t])
                b = np.int64(shift[r, kind])
                tab = table[r, kind]
                hi = v >> b
                idx = hi + ZERO_SYMBOL
                if idx >= 0 and idx < ESCAPE and freq[tab, idx] > 0:
                    if b > 0:
                        width = PROB_BITS - b
                        x, pos = _put(x, (v - (hi << b)) << width, np.int64(1) << width, words, pos)
                    x, pos = _put(x, np.int64(cdf[tab, idx]), np.int64(freq[tab, idx]), words, pos)
                else:
                    z = ((v << 1) ^ (v >> 63)) & np.int64(0xFFFFFFFFF)
                    for c in range(ESCAPE_CHUNKS - 1, -1, -1):
                        chunk = (z >> (PROB_BITS * c)) & SLOT_MASK
                        x, pos = _put(x, chunk, np.int64(1), words, pos)
                    x, pos = _put(x, np.int64(cdf[tab, ESCAPE]), np.int64(freq[tab, ESCAPE]), words, pos)
        first_word[lane] = pos + 1
        final_state[lane] = x


@njit(cache=True, nogil=True, inline="always")
def _renorm(x, words, pos, end):
    """Refill one word if the state fell below STATE_LOW; pos > end flags overrun.

    The word is loaded whether or not it is needed (the branch on ``pos < end`` is
    all but always taken, so it predicts well), leaving the refill itself a select:
    a branch on the state would mispredict on about one value in five."""
    word = np.int64(words[pos]) if pos < end else np.int64(0)
    if x < STATE_LOW:
        x = (x << WORD_BITS) | word
        pos += 1
    return x, pos


@njit(cache=True, nogil=True, inline="always")
def _get_uniform(x, bits, words, pos, end):
    width = PROB_BITS - bits
    slot = x & SLOT_MASK
    value = slot >> width
    x = (np.int64(1) << width) * (x >> PROB_BITS) + slot - (value << width)
    x, pos = _renorm(x, words, pos, end)
    return value, x, pos


@njit(cache=True, nogil=True, inline="always")
def _get_value(x, pos, end, tab, b, words, lut, coder):
    """One value (FORMAT.md, "Values in a row") of a row with table ``tab`` and shift
    ``b``: (q, state, word position, status). ``coder[tab, s]`` packs the symbol's
    frequency (low 16 bits) and cumulative frequency (high 16 bits): one load."""
    slot = x & SLOT_MASK
    sym = np.int64(lut[tab, slot])
    packed = np.int64(coder[tab, sym])
    x = (packed & WORD_MASK) * (x >> PROB_BITS) + slot - (packed >> WORD_BITS)
    x, pos = _renorm(x, words, pos, end)
    err = OK
    if sym == ESCAPE:
        z = np.int64(0)
        for c in range(ESCAPE_CHUNKS):
            chunk, x, pos = _get_uniform(x, PROB_BITS, words, pos, end)
            z |= chunk << (PROB_BITS * c)
        v = (z >> 1) ^ -(z & 1)
        if abs(v) >= MAX_ABS_Q:
            err = BAD_ESCAPE
            v = 0
    else:
        v = (sym - ZERO_SYMBOL) << b
        if b > 0:
            low, x, pos = _get_uniform(x, b, words, pos, end)
            v += low
    return v, x, pos, err


@njit(cache=True, nogil=True, inline="always")
def _lane_end(x, pos, end, err):
    """A lane's status once its values are decoded: it must have read exactly its
    words and come back to the encoder's initial state."""
    if err == OK and pos > end:
        return OUT_OF_WORDS
    if err == OK and (pos != end or x != STATE_LOW):
        return BAD_FINAL
    return err


#: lanes one thread decodes in lockstep: a value's decode is a chain of dependent loads
#: and a multiply (~20 cycles), so one lane at a time leaves the core mostly idle;
#: four independent chains fill it
WAYS = 4


@njit(cache=True, nogil=True)
def lane_tasks(kept_k, rows, rows_per_lane, piece, tokens, group, tasks):
    """Split the lanes into tasks for :func:`decode_lanes`: ``tasks[i] = (first lane,
    lanes)``, either WAYS lanes of equal shape (the same token span and row count, no
    delta rows) decoded in lockstep, or one lane. Returns the number of tasks."""
    n_lanes = tasks.shape[0]
    count = 0
    lane = 0
    while lane < n_lanes:
        ways = WAYS if lane + WAYS <= n_lanes else 1
        r0, r1, t0, t1 = lane_span(lane, kept_k, rows, rows_per_lane, piece, tokens)
        for j in range(ways):
            s0, s1, u0, u1 = lane_span(lane + j, kept_k, rows, rows_per_lane, piece, tokens)
            for r in range(s0, s1):
                if group[r] != 0:
                    ways = 1
            if s1 - s0 != r1 - r0 or u0 != t0 or u1 != t1:
                ways = 1
            if ways == 1:
                break
        tasks[count, 0] = lane
        tasks[count, 1] = ways
        count += 1
        lane += ways
    return count


@njit(cache=True, nogil=True, inline="always")
def _decode_lane(lane, words, lane_word_start, final_state, kept_k, rows_per_lane, piece, step, group, table,
                 shift, lut, coder, out):
    """Decode one lane (any rows, delta rows included) into ``out``; its status."""
    tokens, rows = out.shape
    flat = out.reshape(-1)
    r0, r1, t0, t1 = lane_span(lane, kept_k, rows, rows_per_lane, piece, tokens)
    x = np.int64(final_state[lane])
    pos = lane_word_start[lane]
    end = lane_word_start[lane + 1]
    err = OK
    if x < STATE_LOW:
        err = BAD_FINAL
    for r in range(r0, r1):
        if err != OK:
            break
        s = step[r]
        g = group[r]
        anchor = np.float32(0.0)
        at = _at(r, t0, rows)
        for i in range(t1 - t0):
            kind = _symbol_kind(t0 + i, g)
            v, x, pos, e = _get_value(x, pos, end, table[r, kind], np.int64(shift[r, kind]), words, lut, coder)
            err |= e
            value = np.float32(v) * s
            if kind == 1:
                value = anchor + value
            elif g > 0:
                anchor = value
            flat[at] = value
            at += np.uint64(rows)
    return _lane_end(x, pos, end, err)


@njit(cache=True, nogil=True, inline="always")
def _decode_ways(lane, words, lane_word_start, final_state, kept_k, rows_per_lane, piece, step, table,
                 shift, lut, coder, out, status):
    """Decode WAYS (4) lanes of equal shape without delta rows in lockstep (lane_tasks)."""
    tokens, rows = out.shape
    flat = out.reshape(-1)
    ra, r1, t0, t1 = lane_span(lane, kept_k, rows, rows_per_lane, piece, tokens)
    rb = lane_span(lane + 1, kept_k, rows, rows_per_lane, piece, tokens)[0]
    rc = lane_span(lane + 2, kept_k, rows, rows_per_lane, piece, tokens)[0]
    rd = lane_span(lane + 3, kept_k, rows, rows_per_lane, piece, tokens)[0]
    xa, xb = np.int64(final_state[lane]), np.int64(final_state[lane + 1])
    xc, xd = np.int64(final_state[lane + 2]), np.int64(final_state[lane + 3])
    pa, pb, pc, pd = lane_word_start[lane:lane + 4]
    ea, eb, ec, ed = lane_word_start[lane + 1:lane + 5]
    errs = OK
    for k in range(r1 - ra):
        a, b, c, d = ra + k, rb + k, rc + k, rd + k
        ta, tb, tc, td = table[a, 0], table[b, 0], table[c, 0], table[d, 0]
        ba, bb = np.int64(shift[a, 0]), np.int64(shift[b, 0])
        bc, bd = np.int64(shift[c, 0]), np.int64(shift[d, 0])
        sa, sb, sc, sd = step[a], step[b], step[c], step[d]
        da, db, dc, dd = _at(a, t0, rows), _at(b, t0, rows), _at(c, t0, rows), _at(d, t0, rows)
        for i in range(t1 - t0):
            va, xa, pa, e1 = _get_value(xa, pa, ea, ta, ba, words, lut, coder)
            vb, xb, pb, e2 = _get_value(xb, pb, eb, tb, bb, words, lut, coder)
            vc, xc, pc, e3 = _get_value(xc, pc, ec, tc, bc, words, lut, coder)
            vd, xd, pd, e4 = _get_value(xd, pd, ed, td, bd, words, lut, coder)
            errs |= e1 | e2 | e3 | e4
            flat[da] = np.float32(va) * sa
            flat[db] = np.float32(vb) * sb
            flat[dc] = np.float32(vc) * sc
            flat[dd] = np.float32(vd) * sd
            da += np.uint64(rows)
            db += np.uint64(rows)
            dc += np.uint64(rows)
            dd += np.uint64(rows)
    for j, (x, pos, end) in enumerate(((xa, pa, ea), (xb, pb, eb), (xc, pc, ec), (xd, pd, ed))):
        start_bad = BAD_FINAL if final_state[lane + j] < STATE_LOW else OK
        status[lane + j] = _lane_end(x, pos, end, errs | start_bad)


@njit(cache=True, nogil=True, inline="always")
def _at(row, token, rows):
    """Where coefficient (``row``, ``token``) lies in a token-major output of ``rows``
    rows, flattened. Unsigned: numba then drops its wraparound check from the store."""
    return np.uint64(token) * np.uint64(rows) + np.uint64(row)


@njit(cache=True, nogil=True, parallel=True)
def decode_lanes(words, lane_word_start, final_state, kept_k, rows_per_lane, piece, step, group, table,
                 shift, lut, coder, tasks, n_tasks, out):
    """Decode every lane into dequantized float32 coefficients ``out`` [T, R] (C-ordered,
    token-major: what the inverse transform's product reads), task by task
    (``lane_tasks``: ``tasks[:n_tasks]``).

    Never reads outside the section's words (a lane past its own reads zeros), never
    writes outside ``out``; returns OK or the first error code seen (the caller turns
    any non-OK status into CorruptBitstream). A lane decoded in lockstep with others
    reports a corrupt value in any of them: the section is corrupt either way.
    """
    n_lanes = final_state.shape[0]
    status = np.zeros(max(n_lanes, 1), dtype=np.int32)  # a layer may have no lanes at all
    for i in prange(n_tasks):
        lane = tasks[i, 0]
        if tasks[i, 1] == WAYS:
            _decode_ways(lane, words, lane_word_start, final_state, kept_k, rows_per_lane, piece, step, table,
                         shift, lut, coder, out, status)
        else:
            status[lane] = _decode_lane(lane, words, lane_word_start, final_state, kept_k, rows_per_lane, piece,
                                        step, group, table, shift, lut, coder, out)
    return status.max()


@njit(cache=True, nogil=True, parallel=True)
def ideal_bits(q, group, table, shift, freq, cost):
    """Information content (bits) of the coded values under the tables, per row.

    What a perfect entropy coder would spend: the benchmark compares the real
    stream size (final states and lane table included) against it.
    """
    rows, tokens = q.shape
    bits = np.zeros(rows, dtype=np.float64)
    for r in prange(rows):
        total = 0.0
        for t in range(tokens):
            kind = _symbol_kind(t, group[r])
            total += _value_bits(np.int64(q[r, t]), np.int64(shift[r, kind]), table[r, kind], freq, cost)
        bits[r] = total
    return bits


@njit(cache=True, nogil=True)
def lane_spans(kept_k, rows, rows_per_lane, piece, tokens, out):
    """``out[lane] = lane_span(lane, ...)`` for every lane: what the host needs to size
    lanes (encoder regions, the reader's lane minimum) from the one mapping."""
    for lane in range(out.shape[0]):
        r0, r1, t0, t1 = lane_span(lane, kept_k, rows, rows_per_lane, piece, tokens)
        out[lane, 0] = r0
        out[lane, 1] = r1
        out[lane, 2] = t0
        out[lane, 3] = t1
