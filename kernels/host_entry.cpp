// Host entry point for the shimmed kernel: decodes every lane, as a grid would.
#include "host_shim.h"
#include "rans_decode.cu"

extern "C" void host_rans_decode_lanes(
    const uint16_t* words, const long long* lane_word_start, const uint32_t* final_state,
    int n_lanes, int kept_k, int rows_per_lane, int piece, const float* step, const int* group,
    const uint8_t* table, const uint8_t* shift, const uint16_t* freq, const uint16_t* cdf,
    const uint8_t* lut, int tokens, int rows, float* out, int* status) {
    KVW_HOST_LAUNCH(n_lanes, rans_decode_lanes(words, lane_word_start, final_state, n_lanes, kept_k, rows_per_lane, piece,
                                               step, group, table, shift, freq, cdf, lut, tokens, rows,
                                               out, status));
}
