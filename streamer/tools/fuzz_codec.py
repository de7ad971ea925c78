"""The codec's fuzz targets for ``kvwire fuzz``: functions of one ``bytes`` input that
raise :class:`FuzzBug` when the codec misbehaves on it.

``bitstream``
    ``codec.decode`` / ``codec.decode_layers`` on a valid blob damaged by byte edits,
    truncation or extension, optionally *forged* (section and header CRCs recomputed,
    so the rANS decoder and container checks face the damage alone): only
    ``CodecError``; a decode that succeeds returns the shape and dtype the header says.
``header``
    A valid blob re-assembled by hand from FORMAT.md with some header fields, section
    modes, lane tables or section lengths replaced by the input's values (CRCs always
    valid): only ``CodecError`` from ``decode`` and from ``decode_section`` per layer.
``profile``
    A valid profile with some arrays' elements, shapes or metadata fields replaced by
    the input's values, saved as safetensors and parsed: only ``CorruptBitstream``;
    a profile that parses must encode and decode a small tensor of its shape at one
    of its levels without any error (what a profile lets through reaches the numba
    kernels).
"""
from __future__ import annotations

import functools
import json
import struct
import zlib

import numpy as np

from streamer.tools.adversarial import ENTRY, FIXED, seal, table_offset


class FuzzBug(AssertionError):
    """A target misbehaved on an input (wrong exception type, bad state, wrong shape)."""


_ENTRY = ENTRY.size


@functools.lru_cache(maxsize=1)
def _seed_blobs():
    """(blob, profile) pairs: a profiled delta-coded blob, an fp16 embedded one, a profiled
    level 0 one, an exact-level one (every section raw), a predicted one (format 7), and
    one predicted through low-rank maps (profile version 6)."""
    import torch

    import codec
    from codec.synthetic import chained_kv

    gen = torch.Generator().manual_seed(0)
    profile = codec.calibrate([torch.randn(2, 2, 64, 1, 3, generator=gen)], delta="always")
    kv = torch.randn(2, 2, 24, 1, 3, generator=torch.Generator().manual_seed(1))
    predicting = codec.calibrate([chained_kv(3, 1, 3, 64, 0)], predict=2)
    low_rank = codec.calibrate([chained_kv(3, 2, 3, 64, 0)], predict=2, predict_groups="low-rank")
    return ((codec.encode(kv, 2, profile), profile), (codec.encode(kv.half(), 2), None),
            (codec.encode(kv, 0, profile), profile), (codec.encode_exact(kv.half(), profile), profile),
            (codec.encode(chained_kv(3, 1, 3, 24, 1), 2, predicting), predicting),
            (codec.encode(chained_kv(3, 2, 3, 24, 1), 2, low_rank), low_rank))


#: the first byte that picks the low-rank seeds (blob and profile): one that no kept
#: corpus input began with before they existed, so that every such input keeps its meaning
LOW_RANK_SEED = 0x60


def _seed(data: bytes) -> tuple[bytes, object]:
    """The seed blob ``data`` names: data[0]'s low 2 bits, or with bit 5 the predicted one,
    or, data[0] being LOW_RANK_SEED, the low-rank one (an input's meaning from before a
    seed existed is kept)."""
    seeds = _seed_blobs()
    if not data:
        return seeds[0]
    return seeds[5] if data[0] == LOW_RANK_SEED else seeds[4] if data[0] & 0x20 else seeds[data[0] % 4]


def _reseal(blob: bytes) -> bytes:
    """Recompute every section CRC and the header CRC (FORMAT.md), keeping the lengths."""
    if len(blob) < FIXED.size + 4:
        return blob
    table = table_offset(blob[4])
    layers = struct.unpack_from("<H", blob, 8)[0]
    embedded = struct.unpack_from("<I", blob, 28)[0]
    size = table + _ENTRY * layers + embedded + 4
    if size > len(blob):
        return blob
    header = bytearray(blob[:size])
    pos = size
    for i in range(layers):
        length = struct.unpack_from("<I", header, table + _ENTRY * i)[0]
        section = blob[pos:pos + length]
        struct.pack_into("<I", header, table + _ENTRY * i + 4, zlib.crc32(section) & 0xFFFFFFFF)
        pos += length
    struct.pack_into("<I", header, size - 4, zlib.crc32(bytes(header[:size - 4])) & 0xFFFFFFFF)
    return bytes(header) + blob[size:]


def mutate_blob(data: bytes) -> tuple[bytes, object]:
    """The damaged blob (and its profile) that ``data`` describes.

    data[0]: seed blob (low 2 bits, or bit 5: ``_seed``), forge CRCs (bit 2), truncate (bit 3),
    extend (bit 4); data[1:3]: u16 truncation point; then (u16 position, u8 xor) edits.
    """
    blob, profile = _seed(data)
    out = bytearray(blob)
    flags = data[0] if data else 0
    edits = data[3:]
    for j in range(0, len(edits) - 2, 3):
        pos = struct.unpack_from("<H", edits, j)[0] % len(out)
        out[pos] ^= edits[j + 2] or 1
    if flags & 0x08 and len(data) >= 3:
        out = out[:struct.unpack_from("<H", data, 1)[0] % (len(out) + 1)]
    if flags & 0x10:
        out += bytes(edits[:32])
    result = bytes(out)
    if flags & 0x04:
        result = _reseal(result)
    return result, profile


def check_bitstream(data: bytes) -> None:
    check_bitstream_blob(*mutate_blob(data))


def check_bitstream_blob(blob: bytes, profile) -> None:
    """decode and decode_layers of ``blob``: only CodecError, or the header's shape."""
    import codec

    try:
        header = codec.parse_header(blob)
        out = codec.decode(blob, profile)
    except codec.CodecError:
        pass
    except Exception as exc:
        raise FuzzBug(f"codec.decode raised {type(exc).__name__}: {exc}") from exc
    else:
        want = (header.layers, 2, header.tokens, header.heads, header.head_dim)
        if tuple(out.shape) != want or out.dtype != header.dtype:
            raise FuzzBug(f"decode returned {tuple(out.shape)} {out.dtype}, header says {want} "
                          f"{header.dtype}")
    try:
        for _ in codec.decode_layers(blob, profile):
            pass
    except codec.CodecError:
        pass
    except Exception as exc:
        raise FuzzBug(f"codec.decode_layers raised {type(exc).__name__}: {exc}") from exc


def _seed_sections(blob: bytes) -> tuple[list[bytes], list[int]]:
    import codec
    from codec import container

    header = codec.parse_header(blob)
    return [bytes(container.section(blob, header, l)) for l in range(header.layers)], list(header.modes)


#: header fields a ``header`` input may replace: name -> (FORMAT.md offset, struct code)
_FIELDS = (("version", 4, "B"), ("dtype", 5, "B"), ("level", 6, "B"), ("layers", 8, "H"), ("heads", 10, "H"),
           ("head_dim", 12, "H"), ("sinks", 14, "H"), ("tokens", 16, "I"), ("start", 32, "I"))


def header_blob(data: bytes) -> tuple[bytes, object]:
    """The hand-assembled blob (and its profile) that ``data`` describes.

    data[0]: seed blob (``_seed``); then 6-byte edits (u8 what, u8 layer, u32 value): what % 13 <
    9 replaces a header field (_FIELDS, the start position included), 9 a section's
    mode, 10 cuts a section to ``value`` bytes, 11 pads it with ``value % 4096`` zero
    bytes, 12 overwrites a u32 of its lane table (n_lanes, the lane shape, states, word
    counts) at index ``layer``.
    Section lengths and every CRC are then recomputed (FORMAT.md), so only the
    fields' meaning is wrong.
    """
    blob, profile = _seed(data)
    sections, modes = _seed_sections(blob)
    fixed = bytearray(blob[:table_offset(blob[4])])
    embedded_len = struct.unpack_from("<I", blob, 28)[0]
    table_end = len(fixed) + ENTRY.size * len(sections)
    embedded = blob[table_end: table_end + embedded_len]
    sink_len = 2 * struct.unpack_from("<H", blob, 14)[0] * struct.unpack_from("<H", blob, 10)[0] \
        * struct.unpack_from("<H", blob, 12)[0] * (4 if blob[5] == 3 else 2)
    for j in range(1, len(data) - 5, 6):
        what, index, value = struct.unpack_from("<BBI", data, j)
        what %= len(_FIELDS) + 4
        layer = index % len(sections)
        if what < len(_FIELDS):
            _, offset, code = _FIELDS[what]
            if offset + struct.calcsize(code) <= len(fixed):  # a version 2 seed has no start
                struct.pack_into("<" + code, fixed, offset, value & ((1 << 8 * struct.calcsize(code)) - 1))
        elif what == len(_FIELDS):
            modes[layer] = value % 3
        elif what == len(_FIELDS) + 1:
            sections[layer] = sections[layer][: value % (len(sections[layer]) + 1)]
        elif what == len(_FIELDS) + 2:
            sections[layer] = sections[layer] + bytes(value % 4096)
        else:
            at = sink_len + 4 * (index % 16)
            if at + 4 <= len(sections[layer]):
                sec = bytearray(sections[layer])
                struct.pack_into("<I", sec, at, value)
                sections[layer] = bytes(sec)
    layers = struct.unpack_from("<H", fixed, 8)[0]
    if layers <= 64:  # as many sections as the header says (more: a truncated section table)
        sections = (sections * (layers // len(sections) + 1))[:layers]
        modes = (modes * (layers // len(modes) + 1))[:layers]
    return seal(bytes(fixed), sections, modes, embedded), profile


def check_header(data: bytes) -> None:
    import codec
    from codec import container, prediction

    blob, profile = header_blob(data)
    try:
        header = codec.parse_header(blob)
    except codec.CodecError:
        return
    except Exception as exc:
        raise FuzzBug(f"codec.parse_header raised {type(exc).__name__}: {exc}") from exc
    chain = codec.LayerChain()   # a predicted blob's layers decode in order, each from the one before
    for layer in range(header.layers):
        if header.predicted and chain.layer != layer - 1 and profile is not None and profile.predicts \
                and not prediction.is_intra(layer, profile.restart):
            continue   # the layer before it was refused: it cannot be decoded until the next intra layer
        try:
            k, v = codec.decode_section(header, profile, layer, container.section(blob, header, layer), chain=chain)
        except codec.CodecError:
            continue
        except Exception as exc:
            raise FuzzBug(f"codec.decode_section raised {type(exc).__name__}: {exc}") from exc
        if k.shape != (header.tokens, header.heads, header.head_dim) or k.dtype != header.dtype:
            raise FuzzBug(f"decode_section returned {tuple(k.shape)} {k.dtype} for {header.shape} {header.dtype}")
    check_bitstream_blob(blob, profile)


#: profile arrays a ``profile`` input may edit, and the metadata fields it may replace
_ARRAYS = ("mean", "basis", "steps", "kept", "delta_group", "shift", "table", "tables", "weights", "predictor")
#: those of a profile whose maps are factored (version 6), which stores them for the predictor
_FACTORED_ARRAYS = _ARRAYS[:-1] + ("predictor_constant", "predictor_entry", "predictor_exit")
_META = ("layers", "heads", "head_dim", "sink_tokens", "targets", "estimated_bits", "transform", "rotary",
         "restart", "default_level")


def profile_bytes(data: bytes) -> bytes:
    """The edited profile file that ``data`` describes.

    data[0]: seed profile (LOW_RANK_SEED: the low-rank one; else the other seed blobs' and
    an identity one, data[0] modulo their number); then 7-byte edits (u8 what, u16 index,
    u32 value), with N the seed's array names (_ARRAYS, or _FACTORED_ARRAYS for the
    low-rank one) and A = len(N): what % (2A + 4) < A sets element ``index`` of array
    N[what] to ``value`` (cast to its dtype; floats from the u32's low bits), < 2A drops
    or repeats the array's last row on axis ``index % ndim``, else replaces metadata
    field _META[index % len(_META)] by a number, a list or a string derived from ``value``.
    """
    from safetensors.numpy import save

    seeds = [p for _, p in _seed_blobs() if p is not None]
    profiles = seeds[:-1] + [_identity_profile()]
    profile = seeds[-1] if data[:1] == bytes([LOW_RANK_SEED]) else profiles[data[0] % len(profiles)] if data \
        else profiles[0]
    names = _FACTORED_ARRAYS if profile.predictor_factors is not None else _ARRAYS
    arrays = {name: np.array(array) for name, array in profile._arrays().items()}
    meta = json.loads(profile._metadata_json())
    for j in range(1, len(data) - 6, 7):
        what, index, value = struct.unpack_from("<BHI", data, j)
        what %= 2 * len(names) + 4
        if what < 2 * len(names):
            name = names[what % len(names)]
            if name not in arrays:
                continue
            array = arrays[name]
            if what < len(names) and array.size:
                flat = array.reshape(-1)
                cast = (np.array([value], np.uint32).view(np.float32)[0] if array.dtype == np.float32 else
                        np.array([value & 0xFFFF], np.uint16).view(np.float16)[0] if array.dtype == np.float16
                        else value)
                flat[index % flat.size] = np.array(cast).astype(array.dtype, casting="unsafe")
            elif what >= len(names) and array.ndim:
                axis = index % array.ndim
                if array.shape[axis] == 0:
                    continue
                arrays[name] = (np.delete(array, -1, axis=axis) if value % 2
                                else np.concatenate([array, np.take(array, [-1], axis=axis)], axis=axis))
        else:
            key = _META[index % len(_META)]
            meta[key] = (value % 70000 if value % 3 == 0 else [value % 7 / 1e3] * (value % 9)
                         if value % 3 == 1 else str(value))
    arrays["metadata"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    return save({k: np.ascontiguousarray(v) for k, v in arrays.items()})


@functools.lru_cache(maxsize=1)
def _identity_profile():
    import torch

    import codec

    # with RoPE removal and its own default level, so the rotary metadata (profile version
    # 2) and the default level (version 5) are fuzzed too
    return codec.calibrate([torch.randn(1, 2, 30, 2, 2, generator=torch.Generator().manual_seed(2))],
                           transform="identity", targets=(1e-3, 1e-2),
                           rotary=codec.Rotary(head_dim=2, dim=2, theta=10000.0), default_level=0)


def check_profile(data: bytes) -> None:
    import torch

    import codec

    raw = profile_bytes(data)
    try:
        profile = codec.Profile.from_bytes(raw)
    except codec.CorruptBitstream:
        return
    except Exception as exc:
        raise FuzzBug(f"Profile.from_bytes raised {type(exc).__name__}: {exc}") from exc
    if profile.layers * profile.channels > 1 << 12:   # a valid but large profile: nothing to find
        return
    kv = torch.randn(profile.layers, 2, 12, profile.heads, profile.head_dim,
                     generator=torch.Generator().manual_seed(len(data))).half()
    level = len(data) % len(profile.targets)   # one level per input keeps a case to milliseconds
    try:
        out = codec.decode(codec.encode(kv, level, profile), profile)
    except Exception as exc:
        raise FuzzBug(f"a profile that parsed fails its own round trip: {type(exc).__name__}: {exc}") from exc
    if out.shape != kv.shape or out.dtype != kv.dtype:
        raise FuzzBug(f"profile round trip returned {tuple(out.shape)} {out.dtype}")
