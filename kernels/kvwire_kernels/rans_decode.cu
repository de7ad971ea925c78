// rANS lane decoder: the GPU twin of codec/rans.py:decode_lanes (see codec/FORMAT.md).
//
// One launch decodes every section of a group of layers (issue #16: one launch per arrived
// group): the grid covers all lanes of the group, and a table of sections (SectionEntry,
// packed into the group's buffer by kernels/packing.py) says where each section's arrays
// and coefficients are and which of the launch's lanes are its own.
//
// One thread decodes one lane: a run of whole rows of one layer's K or V, or one piece (a
// run of tokens starting at an anchor) of one row (FORMAT.md, "Rows and lanes"; lane_span below is
// the twin of codec/rans.py:lane_span). Each decoded value is dequantized in float32 with
// explicit round-to-nearest multiply and add (no FMA contraction), so the coefficients are
// bit-identical to the CPU decoder's.
//
// Output layout is token-major, out[t * rows + r] for each section. Lanes run piece by piece
// and, within a piece, row by row, so the threads of a warp (consecutive lanes: the same
// piece of consecutive rows) write consecutive addresses, and each section's result is the
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
    int pos;
    int end;
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

// One section of a launch; kernels/packing.py:SECTION_ENTRY is its twin (48 bytes). Offsets
// are 32-bit (a group's buffer and its coefficients stay under 2^31 bytes and floats).
struct SectionEntry {
    uint32_t words;        // byte offset in the buffer of the section's u16 words,
    uint32_t lane_start;   // of its i32 [lanes + 1] word starts,
    uint32_t states;       // of its u32 [lanes] final states,
    uint32_t rows;         // of its RowCoding [rows]
    uint32_t out;          // offset, in floats, of the section's [tokens, rows] coefficients in out
    int first_lane;        // the launch's lane of the section's lane 0 (ascending over the table)
    int n_lanes, kept_k, rows_per_lane, piece, n_rows, pad;
};

// How one row is coded: its step, delta group (0: none), and for an anchor (kind 0) and a
// delta (kind 1) token the coder table (bits 8 * kind) and low-bit shift (bits 16 + 8 * kind).
struct RowCoding {
    float step;
    int group;
    uint32_t coding;
};

// Decode one lane of one section into out; its status code.
__device__ __forceinline__ int decode_lane(
    int lane, const uint8_t* __restrict__ base, const SectionEntry& sec, const uint16_t* __restrict__ freq,
    const uint16_t* __restrict__ cdf, const uint8_t* __restrict__ lut, int tokens, float* __restrict__ out)
{
    const int* lane_word_start = (const int*)(base + sec.lane_start);
    const RowCoding* rows = (const RowCoding*)(base + sec.rows);
    const int n_rows = sec.n_rows;
    LaneCursor c;
    c.x = __ldg(&((const uint32_t*)(base + sec.states))[lane]);
    c.pos = __ldg(&lane_word_start[lane]);
    c.end = __ldg(&lane_word_start[lane + 1]);
    c.words = (const uint16_t*)(base + sec.words);
    int err = c.x < STATE_LOW ? BAD_FINAL : OK;
    const LaneSpan span = lane_span(lane, sec.kept_k, n_rows, sec.rows_per_lane, sec.piece, tokens);
    for (int r = span.r0; r < span.r1 && err == OK; ++r) {
        const float s = __ldg(&rows[r].step);
        const int g = __ldg(&rows[r].group);
        const uint32_t coding = __ldg(&rows[r].coding);
        float anchor = 0.0f;  // a lane's tokens start at an anchor
        for (int t = span.t0; t < span.t1; ++t) {
            const int kind = (g > 0 && t % g != 0) ? 1 : 0;
            const int tab = (coding >> (8 * kind)) & 0xFF;
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
                const int b = (coding >> (16 + 8 * kind)) & 0xFF;
                v = (long long)(sym - ZERO_SYMBOL) * (1LL << b);
                if (b > 0) v += get_uniform(c, b);
            }
            float value = __fmul_rn((float)v, s);
            if (kind == 1) value = __fadd_rn(anchor, value);
            else if (g > 0) anchor = value;
            out[sec.out + (long long)t * n_rows + r] = value;
        }
        if (c.pos > c.end) err = OUT_OF_WORDS;
    }
    if (err == OK && (c.pos != c.end || c.x != STATE_LOW)) err = BAD_FINAL;
    return err;
}

// Every lane of every section in the table: thread i decodes the launch's lane i, of the
// last section whose first_lane <= i, and writes its status code to status[i].
extern "C" __global__ void __launch_bounds__(128, 16) rans_decode_group(
    const uint8_t* __restrict__ base,               // the group's device buffer
    const SectionEntry* __restrict__ sections,      // [n_sections], in base
    int n_sections,
    int n_lanes,                                    // all sections' lanes
    const uint16_t* __restrict__ freq,              // [classes, ALPHABET]
    const uint16_t* __restrict__ cdf,               // [classes, ALPHABET]
    const uint8_t* __restrict__ lut,                // [classes, 4096]
    int tokens,
    float* __restrict__ out,                        // every section's [tokens, rows], at its offset
    int* __restrict__ status)                       // [n_lanes]
{
    const int lane = blockIdx.x * blockDim.x + threadIdx.x;
    if (lane >= n_lanes) return;
    int lo = 0, hi = n_sections - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (__ldg(&sections[mid].first_lane) <= lane) lo = mid;
        else hi = mid - 1;
    }
    const SectionEntry sec = sections[lo];
    status[lane] = decode_lane(lane - sec.first_lane, base, sec, freq, cdf, lut, tokens, out);
}
