"""kvwire codec: KV caches <-> compact, self-describing, layer-addressable bitstreams.

Pipeline per (layer, K/V): mean removal and a calibrated PCA across heads
(``transform``), a uniform quantizer whose step meets each quality level's target
distortion (``levels``), and interleaved-lane rANS coding with tables fixed at
calibration (``entropy``, ``rans``). The bitstream is specified in FORMAT.md.
"""
from .api import (decode, decode_layers, decode_section, encode, header_length, inspect,
                  parse_header, resolve_profile, section_decoder)
from .container import BlobHeader
from .errors import CodecError, CorruptBitstream, ProfileMismatch
from .levels import DEFAULT_LEVEL, DEFAULT_TARGETS
from .profile import Level, Profile, calibrate

__all__ = [
    "BlobHeader", "CodecError", "CorruptBitstream", "DEFAULT_LEVEL", "DEFAULT_TARGETS", "Level",
    "Profile", "ProfileMismatch", "calibrate", "decode", "decode_layers", "decode_section",
    "encode", "header_length", "inspect", "parse_header", "resolve_profile", "section_decoder",
]
