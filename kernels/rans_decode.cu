// rANS lane decoder: the GPU twin of codec/rans.py:decode_lanes (see codec/FORMAT.md).
//
// One thread decodes one lane (a run of rows of one layer's K or V). Each decoded value is
// dequantized in float32 with explicit round-to-nearest multiply and add (no FMA
// contraction), so the coefficients are bit-identical to the CPU decoder's.
//
// Output layout is token-major, out[t * rows + r], so the threads of a warp (consecutive
// lanes, one row each for long chunks) write consecutive addresses, and the result is the
// [tokens, rows] operand of the inverse-transform GEMM without a transpose.
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

extern "C" __global__ void rans_decode_lanes(
    const uint16_t* __restrict__ words,
    const long long* __restrict__ lane_word_start,  // [n_lanes + 1]
    const uint32_t* __restrict__ final_state,       // [n_lanes]
    const long long* __restrict__ lane_rows,        // [n_lanes + 1]
    int n_lanes,
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
    for (long long r = lane_rows[lane]; r < lane_rows[lane + 1] && err == OK; ++r) {
        const float s = step[r];
        const int g = group[r];
        float anchor = 0.0f;
        for (int t = 0; t < tokens; ++t) {
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
