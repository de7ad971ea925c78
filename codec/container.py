"""The blob container: header, section table and per-layer sections (see FORMAT.md).

Pure byte packing and parsing with every length and checksum verified, so the
layer decoder only ever sees a section whose bytes are exactly what was written.
The header alone says how long it is after its first 32 bytes (version 3 puts the
chunk's start position right after them), and where each layer's section starts, so a receiver can decode layer l as soon as its bytes land.
"""
from __future__ import annotations

import functools
import itertools
import struct
import zlib
from dataclasses import dataclass

import torch

from .errors import CorruptBitstream
from .rotary import MAX_POSITION  # token positions are u32: start + tokens <= 2^32

MAGIC = b"KVWB"
FORMAT_VERSION = 5
#: Version 7: the layout of version 5, written with a profile that predicts each layer
#: from the one before (FORMAT.md, "Inter-layer prediction"): its coded sections hold
#: what the prediction misses. A profile without prediction still writes version 5.
PREDICTED_VERSION = 7
#: Version 2 blobs (no start position: start = 0), version 3 ones (lanes of whole rows,
#: u32 word counts) and version 4 ones (no per-section steps: the profile's) are still
#: read; layer_codec reads every version's lane table. Version 6 (the first prediction,
#: from float32 values) is not: its decode depends on arithmetic this build no longer does.
READABLE_VERSIONS = (2, 3, 4, 5, PREDICTED_VERSION)
RETIRED_VERSIONS = {6: "a predicted blob of an earlier build, whose prediction this build no longer "
                       "computes: encode it again"}
FIXED = struct.Struct("<4sBBBBHHHHI8sI")
#: Version 3: the absolute position of the blob's first token, right after the fixed header.
START = struct.Struct("<I")
SECTION_ENTRY = struct.Struct("<IIB")  # length, crc32, mode
CRC = struct.Struct("<I")
FLAG_EMBEDDED_PROFILE = 0x01
_KNOWN_FLAGS = FLAG_EMBEDDED_PROFILE
#: Section modes: rANS lanes, or the layer's tokens verbatim (when coding would not be smaller).
MODE_CODED = 0
MODE_RAW = 1
_MODES = (MODE_CODED, MODE_RAW)
_LANE_COUNT = 4  # u32 n_lanes (every version): the least a coded section holds after its sinks

# Limits (FORMAT.md, "Limits"): every size a reader takes from untrusted bytes is
# checked against one of these before anything is allocated from it.
#: Largest token count a blob may claim.
MAX_TOKENS = 1 << 24
#: layers, heads, head_dim and sink tokens are u16 fields.
MAX_U16 = 0xFFFF
#: Largest channel count (heads * head_dim) of one K or V.
MAX_CHANNELS = 1 << 16
#: Largest tokens * channels of one layer's K or V (1 GiB of float32 coefficients).
MAX_LAYER_VALUES = 1 << 28
#: decoded bytes (the header's dtype) a coded section may claim per byte it holds: 1/64 of
#: a bit per fp16 element. The lowest level on real KV decodes to ~60 per byte; data the
#: profile does not fit is stored raw (1 per byte). The lane minimum alone would let a
#: table whose likeliest symbol is almost certain carry ~48,000 values per word, so an
#: 11 KB section could claim 1 GiB: this bound keeps it to ~11 MB, checked at the header.
MAX_OUTPUT_PER_BYTE = 1024
#: The level is a u8 field; its last value names the exact level, so a profile has at
#: most 255 lossy levels.
MAX_LEVELS = 255
#: The level of a blob that holds its KV exactly: every section raw (FORMAT.md, "Exact level").
EXACT_LEVEL = 255
#: Table classes are u8 indices, so a profile has at most 256 frequency tables.
MAX_TABLES = 256
#: An embedded profile never decompresses to more than this (nor than its shape allows).
MAX_EMBEDDED_PROFILE = 16 << 20

DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


@dataclass(frozen=True)
class BlobHeader:
    """Everything a decoder needs before the first layer section arrives."""

    version: int
    dtype: torch.dtype
    level: int
    layers: int
    heads: int
    head_dim: int
    sink_tokens: int
    tokens: int
    start: int  # absolute position of token 0 (RoPE); 0 in version 2 blobs
    profile_id: str
    embedded_profile: bytes | None
    sections: tuple[tuple[int, int], ...]  # (length, crc32) per layer
    modes: tuple[int, ...]  # MODE_CODED or MODE_RAW per layer
    size: int  # header bytes, i.e. offset of layer 0's section

    @property
    def predicted(self) -> bool:
        """Whether its coded sections hold what inter-layer prediction misses (version 7)."""
        return self.version == PREDICTED_VERSION

    @functools.cached_property
    def offsets(self) -> tuple[int, ...]:
        """Offset of each section and of the blob's end, summed once (a hostile blob may
        have 65535 layers)."""
        return tuple(itertools.accumulate((length for length, _ in self.sections), initial=self.size))

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.tokens, self.heads, self.head_dim)

    @property
    def channels(self) -> int:
        return self.heads * self.head_dim

    @property
    def coded_tokens(self) -> int:
        return self.tokens - self.sink_tokens

    @property
    def sink_size(self) -> int:
        """Bytes of one section's verbatim sink tokens (K then V)."""
        return token_bytes(self.sink_tokens, self.channels, self.dtype)

    @property
    def raw_size(self) -> int:
        """Bytes of a raw section: every token of the layer's K and V verbatim."""
        return token_bytes(self.tokens, self.channels, self.dtype)

    def is_raw(self, layer: int) -> bool:
        return self.modes[layer] == MODE_RAW

    def section_offset(self, layer: int) -> int:
        return self.offsets[layer]

    @property
    def total_size(self) -> int:
        return self.offsets[-1]


def token_bytes(tokens: int, channels: int, dtype: torch.dtype) -> int:
    """Bytes of ``tokens`` tokens of K and of V stored verbatim in ``dtype``."""
    return 2 * tokens * channels * (torch.finfo(dtype).bits // 8)


def embedded_profile_limit(layers: int, channels: int) -> int:
    """Most bytes the embedded profile of a blob of this shape may decompress to.

    An embedded profile is identity with one level (FORMAT.md): its arrays take
    16 bytes per layer and channel (mean, shift, table), 24 per layer (steps, kept,
    delta_group) and at most 64 KiB of tables; 8 KiB covers the safetensors and JSON
    headers.
    """
    return min(MAX_EMBEDDED_PROFILE, 16 * layers * channels + 24 * layers + (64 << 10) + (8 << 10))


def crc32(data: bytes | memoryview) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def pack_header(*, dtype: torch.dtype, level: int, layers: int, heads: int, head_dim: int,
                sink_tokens: int, tokens: int, start: int, profile_id: str, embedded_profile: bytes | None,
                sections: list[bytes], modes: list[int], predicted: bool = False) -> bytes:
    flags = FLAG_EMBEDDED_PROFILE if embedded_profile is not None else 0
    embedded = embedded_profile or b""
    version = PREDICTED_VERSION if predicted else FORMAT_VERSION
    parts = [FIXED.pack(MAGIC, version, DTYPE_CODES[dtype], level, flags, layers, heads,
                        head_dim, sink_tokens, tokens, bytes.fromhex(profile_id), len(embedded)),
             START.pack(start)]
    parts += [SECTION_ENTRY.pack(len(s), crc32(s), mode) for s, mode in zip(sections, modes, strict=True)]
    parts.append(embedded)
    body = b"".join(parts)
    return body + CRC.pack(crc32(body))


def header_length(prefix: bytes | memoryview) -> int | None:
    """Total header size once the first FIXED.size bytes are known, else None.

    A streaming reader buffers this many bytes, so an embedded profile longer than a
    blob of this shape can need is refused here, from the first 32 bytes.
    """
    if len(prefix) < FIXED.size:
        return None
    fields = _unpack_fixed(prefix)
    version, layers, heads, head_dim, embedded_len = fields[1], fields[5], fields[6], fields[7], fields[11]
    most = zstd_bound(embedded_profile_limit(layers, heads * head_dim))
    if embedded_len > most:
        raise CorruptBitstream(f"blob header claims a {embedded_len}-byte embedded profile; its shape allows {most}")
    return _table_offset(version) + SECTION_ENTRY.size * layers + embedded_len + CRC.size


def plain_header_size(layers: int) -> int:
    """Bytes of a current-version blob header with no embedded profile, for ``layers`` layers."""
    return _table_offset(FORMAT_VERSION) + SECTION_ENTRY.size * layers + CRC.size


def _table_offset(version: int) -> int:
    """Where the section table starts: after the fixed header (and, from version 3, the start)."""
    return FIXED.size + (START.size if version >= 3 else 0)


def zstd_bound(size: int) -> int:
    """Largest zstd frame of ``size`` content bytes (zstd's ZSTD_COMPRESSBOUND, rounded up)."""
    return size + (size >> 8) + (128 << 10 >> 11) + 64


def _unpack_fixed(data: bytes | memoryview) -> tuple:
    fields = FIXED.unpack_from(data, 0)
    if fields[0] != MAGIC:
        raise CorruptBitstream("not a kvwire blob (bad magic)")
    if fields[1] in RETIRED_VERSIONS:
        raise CorruptBitstream(f"blob format version {fields[1]} is no longer read: {RETIRED_VERSIONS[fields[1]]}")
    if fields[1] not in READABLE_VERSIONS:
        raise CorruptBitstream(f"unsupported blob format version {fields[1]} (this build reads "
                               f"{', '.join(map(str, READABLE_VERSIONS))})")
    return fields


def parse_header(data: bytes | memoryview) -> BlobHeader:
    """Parse and verify the header at the start of ``data`` (the sections may be absent).

    Every size is checked against the format's limits and against what the section
    table says is present before anything is sized from it (FORMAT.md, "Limits").
    """
    data = memoryview(data)
    size = header_length(data)
    if size is None or len(data) < size:
        raise CorruptBitstream(f"blob truncated inside its header ({len(data)} bytes)")
    (_, version, dtype_code, level, flags, layers, heads, head_dim, sinks, tokens,
     profile_id, embedded_len) = _unpack_fixed(data)
    (stored_crc,) = CRC.unpack_from(data, size - CRC.size)
    if crc32(data[: size - CRC.size]) != stored_crc:
        raise CorruptBitstream("blob header checksum mismatch")
    if dtype_code not in CODE_DTYPES or flags & ~_KNOWN_FLAGS:
        raise CorruptBitstream("blob header has an unknown dtype or flag")
    if min(layers, heads, head_dim, tokens) < 1 or sinks > tokens or tokens > MAX_TOKENS:
        raise CorruptBitstream("blob header has an impossible shape")
    channels = heads * head_dim
    if channels > MAX_CHANNELS or tokens * channels > MAX_LAYER_VALUES:
        raise CorruptBitstream(f"blob shape {tokens} tokens x {channels} channels exceeds the format's "
                               f"limits ({MAX_CHANNELS} channels, {MAX_LAYER_VALUES} values per K or V)")
    if bool(flags & FLAG_EMBEDDED_PROFILE) != (embedded_len > 0):
        raise CorruptBitstream("blob header disagrees with itself about the embedded profile")
    start = START.unpack_from(data, FIXED.size)[0] if version >= 3 else 0
    if start + tokens > MAX_POSITION:
        raise CorruptBitstream(f"blob tokens {start}..{start + tokens - 1} pass the last position {MAX_POSITION - 1}")
    table = _table_offset(version)
    table_end = table + SECTION_ENTRY.size * layers
    entries = [SECTION_ENTRY.unpack_from(data, table + SECTION_ENTRY.size * i) for i in range(layers)]
    embedded = bytes(data[table_end: table_end + embedded_len]) if embedded_len else None
    header = BlobHeader(version=version, dtype=CODE_DTYPES[dtype_code], level=level, layers=layers,
                        heads=heads, head_dim=head_dim, sink_tokens=sinks, tokens=tokens, start=start,
                        profile_id=profile_id.hex(), embedded_profile=embedded,
                        sections=tuple((length, crc) for length, crc, _ in entries),
                        modes=tuple(mode for _, _, mode in entries), size=size)
    for layer, (length, _, mode) in enumerate(entries):
        _check_section_length(header, layer, length, mode)
    if level == EXACT_LEVEL and (embedded or any(mode != MODE_RAW for _, _, mode in entries)
                                 or version == PREDICTED_VERSION):
        raise CorruptBitstream("an exact-level blob must have every section raw, no embedded profile and a "
                               "version of 5 or older")
    if version == PREDICTED_VERSION and embedded:
        raise CorruptBitstream(f"a version {PREDICTED_VERSION} (predicted) blob cannot embed its profile")
    return header


def _check_section_length(header: BlobHeader, layer: int, length: int, mode: int) -> None:
    """A raw section is exactly the layer's tokens; a coded one holds its sinks and lane
    count, and no more decoded output per byte than ``MAX_OUTPUT_PER_BYTE``."""
    if mode not in _MODES:
        raise CorruptBitstream(f"layer {layer}'s section has unknown mode {mode}")
    if mode == MODE_RAW and length != header.raw_size:
        raise CorruptBitstream(f"layer {layer}'s raw section is {length} bytes, its shape needs "
                               f"{header.raw_size}")
    if mode == MODE_CODED and length < header.sink_size + _LANE_COUNT:
        raise CorruptBitstream(f"layer {layer}'s section is {length} bytes, shorter than its sink tokens")
    if mode == MODE_CODED and header.raw_size > MAX_OUTPUT_PER_BYTE * length:
        raise CorruptBitstream(f"layer {layer}'s section of {length} bytes claims {header.raw_size} bytes of "
                               f"output, over {MAX_OUTPUT_PER_BYTE} per byte: no encoder output is that "
                               "compressed")


def section(data: bytes | memoryview, header: BlobHeader, layer: int) -> memoryview:
    """Layer ``layer``'s section bytes from a whole blob, length and checksum verified."""
    start = header.section_offset(layer)
    length = header.sections[layer][0]
    view = memoryview(data)[start: start + length]
    if len(view) != length:
        raise CorruptBitstream(f"blob truncated in layer {layer}'s section")
    return verify_section(view, header, layer)


def split_section(section: bytes | memoryview, header: BlobHeader, layer: int) -> tuple[memoryview, memoryview]:
    """(sink token bytes, rest) of a verified layer section (see FORMAT.md): the rest is
    the lane payload of a coded section, the non-sink tokens of a raw one."""
    view = verify_section(section, header, layer)
    return view[:header.sink_size], view[header.sink_size:]


def verify_section(view: bytes | memoryview, header: BlobHeader, layer: int) -> memoryview:
    """Check a received section against the header's length and checksum."""
    length, expected = header.sections[layer]
    view = memoryview(view)
    if len(view) != length:
        raise CorruptBitstream(f"layer {layer}'s section is {len(view)} bytes, header says {length}")
    if crc32(view) != expected:
        raise CorruptBitstream(f"layer {layer}'s section checksum mismatch")
    return view
