"""kvwire codec: KV caches <-> compact, self-describing, layer-addressable bitstreams.

Pipeline per (layer, K/V): mean removal and a calibrated PCA across heads
(``transform``), a uniform quantizer whose step meets each quality level's target
distortion (``levels``), and interleaved-lane rANS coding with tables fixed at
calibration (``entropy``, ``rans``). The bitstream is specified in FORMAT.md.
Decoders for other devices plug in through ``backends`` (``import kvwire_kernels`` for CUDA).
``warm_up()`` compiles or loads the numba kernels ahead of a timed path (not on import);
``parallel`` makes them safe to call from several threads on any numba threading layer.
``Rotary`` (a profile's RoPE parameters) makes keys be coded position-free (``rotary``).
A profile calibrated with ``predict`` codes each layer as what a map from the layer
before it misses (``prediction``; format 7, decoded layer by layer with a ``LayerChain``).
"""
from .api import (LayerChain, decode, decode_layers, decode_section, encode, encode_exact, encode_levels,
                  header_length, inspect, parse_header, resolve_profile, section_decoder)
from .backends import register as register_backend
from .container import EXACT_LEVEL, BlobHeader
from .errors import CodecError, CorruptBitstream, GpuUnavailable, ProfileMismatch, ProfileMismatchWarning
from .levels import DEFAULT_LEVEL, DEFAULT_TARGETS
from .calibration import calibrate
from .profile import Level, Profile, max_profile_bytes
from .rotary import Rotary
from .warmup import warm_up

__all__ = [
    "BlobHeader", "CodecError", "CorruptBitstream", "DEFAULT_LEVEL", "DEFAULT_TARGETS", "EXACT_LEVEL",
    "GpuUnavailable", "LayerChain", "Level", "Profile", "ProfileMismatch", "ProfileMismatchWarning", "calibrate", "decode",
    "decode_layers", "decode_section", "encode", "encode_exact", "encode_levels", "header_length", "inspect",
    "max_profile_bytes",
    "parse_header",
    "register_backend", "resolve_profile", "Rotary", "section_decoder", "warm_up",
]
