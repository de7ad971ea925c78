// rANS lane decoder: the GPU twin of codec/rans.py:decode_lanes (see codec/FORMAT.md).
//
// One thread decodes one lane: a run of whole rows of one layer's K or V, or one piece (a
// run of tokens starting at an anchor) of one row (FORMAT.md, "Rows and lanes"; lane_span below is
// the twin of codec/rans.py:lane_span). Each decoded value is dequantized in float32 with
// explicit round-to-nearest multiply and add (no FMA contraction), so the coefficients are
// bit-identical to the CPU decoder's.
//
// Output layout is token-major, out[t * rows + r]. Lanes run piece by piece and, within a
// piece, row by row, so the threads of a warp (consecutive lanes: the same piece of
// consecutive rows) write consecutive addresses, and the result is the [tokens, rows]
// operand of the inverse-transform GEMM without a transpose.
#include <stdint.h>

#define PROB_BITS 12
#define SLOT_MASK 4095u
#define STATE_LOW 65536u
#define ESCAPE 127
#define ZERO_SYMBOL 63
#define ESCAPE_CHUNKS 3
#define MAX_ABS_Q (1 << 30)
#define ALPHABET 128

#define OK 0
#define OUT_OF_WORDS 2
#define BAD_FINAL 3
#define BAD_ESCAPE 4

struct LaneCursor {
    uint64_t x;
    long long pos;
    long long end;
    const uint16_t* words;
};

__device__ __forceinline__ void renorm(LaneCursor& c) {
    if (c.x < STATE_LOW) {
        if (c.pos < c.end) c.x = (c.x << 16) | (uint64_t)__ldg(&c.words[c.pos]);
        c.pos += 1;
    }
}

__device__ __forceinline__ uint32_t get_uniform(LaneCursor& c, int bits) {
    const int width = PROB_BITS - bits;
    const uint32_t slot = (uint32_t)(c.x & SLOT_MASK);
    const uint32_t value = slot >> width;
    c.x = ((uint64_t)1 << width) * (c.x >> PROB_BITS) + slot - ((uint64_t)value << width);
    renorm(c);
    return value;
}

struct LaneSpan {
    int r0, r1;  // rows [r0, r1)
    int t0, t1;  // tokens [t0, t1)
};

// Rows and tokens of a lane: K's lanes then V's; inside each, piece by piece, and within a
// piece over groups of rows_per_lane rows.
__device__ __forceinline__ LaneSpan lane_span(int lane, int kept_k, int rows, int rows_per_lane, int piece,
                                              int tokens) {
    int pieces = (tokens + piece - 1) / piece;
    if (pieces < 1) pieces = 1;
    const int groups_k = (kept_k + rows_per_lane - 1) / rows_per_lane;
    int base = 0, count = kept_k, groups = groups_k, j = lane;
    if (lane >= groups_k * pieces) {
        base = kept_k;
        count = rows - kept_k;
        groups = (count + rows_per_lane - 1) / rows_per_lane;
        j = lane - groups_k * pieces;
    }
    LaneSpan s;
    s.r0 = base + (j % groups) * rows_per_lane;
    s.r1 = s.r0 + rows_per_lane < base + count ? s.r0 + rows_per_lane : base + count;
    s.t0 = (j / groups) * piece;
    s.t1 = s.t0 + piece < tokens ? s.t0 + piece : tokens;
    return s;
}

extern "C" __global__ void rans_decode_lanes(
    const uint16_t* __restrict__ words,
    const long long* __restrict__ lane_word_start,  // [n_lanes + 1]
    const uint32_t* __restrict__ final_state,       // [n_lanes]
    int n_lanes,
    int kept_k,                                     // K rows; V's follow
    int rows_per_lane,                              // G
    int piece,                                      // tokens per piece (N: whole rows)
    const float* __restrict__ step,                 // [rows]
    const int* __restrict__ group,                  // [rows]
    const uint8_t* __restrict__ table,              // [rows, 2]
    const uint8_t* __restrict__ shift,              // [rows, 2]
    const uint16_t* __restrict__ freq,              // [classes, ALPHABET]
    const uint16_t* __restrict__ cdf,               // [classes, ALPHABET]
    const uint8_t* __restrict__ lut,                // [classes, 4096]
    int tokens,
    int rows,
    float* __restrict__ out,                        // [tokens, rows]
    int* __restrict__ status)                       // [n_lanes]
{
    const int lane = blockIdx.x * blockDim.x + threadIdx.x;
    if (lane >= n_lanes) return;
    LaneCursor c;
    c.x = final_state[lane];
    c.pos = lane_word_start[lane];
    c.end = lane_word_start[lane + 1];
    c.words = words;
    int err = c.x < STATE_LOW ? BAD_FINAL : OK;
    const LaneSpan span = lane_span(lane, kept_k, rows, rows_per_lane, piece, tokens);
    for (int r = span.r0; r < span.r1 && err == OK; ++r) {
        const float s = step[r];
        const int g = group[r];
        float anchor = 0.0f;  // a lane's tokens start at an anchor
        for (int t = span.t0; t < span.t1; ++t) {
            const int kind = (g > 0 && t % g != 0) ? 1 : 0;
            const int tab = table[2 * r + kind];
            const uint32_t slot = (uint32_t)(c.x & SLOT_MASK);
            const int sym = __ldg(&lut[tab * 4096 + slot]);
            const uint32_t f = __ldg(&freq[tab * ALPHABET + sym]);
            const uint32_t start = __ldg(&cdf[tab * ALPHABET + sym]);
            c.x = (uint64_t)f * (c.x >> PROB_BITS) + slot - start;
            renorm(c);
            long long v;
            if (sym == ESCAPE) {
                uint64_t z = 0;
                for (int k = 0; k < ESCAPE_CHUNKS; ++k) z |= (uint64_t)get_uniform(c, PROB_BITS) << (PROB_BITS * k);
                v = (long long)(z >> 1) ^ -(long long)(z & 1);
                if (v >= MAX_ABS_Q || v <= -MAX_ABS_Q) { err = BAD_ESCAPE; v = 0; }
            } else {
                const int b = shift[2 * r + kind];
                v = (long long)(sym - ZERO_SYMBOL) * (1LL << b);
                if (b > 0) v += get_uniform(c, b);
            }
            float value = __fmul_rn((float)v, s);
            if (kind == 1) value = __fadd_rn(anchor, value);
            else if (g > 0) anchor = value;
            out[(long long)t * rows + r] = value;
        }
        if (c.pos > c.end) err = OUT_OF_WORDS;
    }
    if (err == OK && (c.pos != c.end || c.x != STATE_LOW)) err = BAD_FINAL;
    status[lane] = err;
}
