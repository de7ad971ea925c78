// Host entry point for the shimmed kernel: decodes every lane of a group's launch, as a grid would.
#include "host_shim.h"
#include "rans_decode.cu"

extern "C" void host_rans_decode_group(
    const uint8_t* base, const SectionEntry* sections, int n_sections, int n_lanes, const uint16_t* freq,
    const uint16_t* cdf, const uint8_t* lut, int tokens, float* out, int* status) {
    KVW_HOST_LAUNCH(n_lanes, rans_decode_group(base, sections, n_sections, n_lanes, freq, cdf, lut, tokens, out,
                                               status));
}
