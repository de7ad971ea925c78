"""Public codec entry points: encode, decode, decode_layers, inspect, decode_section.

Blob = header (shape, dtype, level, profile id, per-layer lengths and checksums,
optional embedded profile) + one section per layer. Each section holds the
layer's attention-sink tokens verbatim, then its K and V lanes, so a receiver can
decode layer l as soon as that section has arrived (``decode_section``).
"""
from __future__ import annotations

import weakref
from typing import Iterator

import numpy as np
import torch
import zstandard

from . import backends, container, layer_codec
from .container import BlobHeader
from .errors import CorruptBitstream, ProfileMismatch
from .levels import DEFAULT_LEVEL, DEFAULT_TARGETS
from .profile import DEFAULT_SINK_TOKENS, Profile, embedded_profile, validate_kv

_MAX_EMBEDDED_PROFILE = 64 << 20
_ITEM_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}
_embedded_cache: "weakref.WeakValueDictionary[str, Profile]" = weakref.WeakValueDictionary()


def _sink_bytes(kv_layer: torch.Tensor, sinks: int) -> bytes:
    """The first ``sinks`` tokens of K and V of one layer, bit-exact in their dtype."""
    raw = kv_layer[:, :sinks].contiguous()
    bits = raw.view(_ITEM_VIEW[raw.dtype]).numpy()
    return bits.astype(bits.dtype.newbyteorder("<"), copy=False).tobytes()


def encode(kv: torch.Tensor, level: int = DEFAULT_LEVEL, profile: Profile | None = None, *,
           sink_tokens: int | None = None) -> bytes:
    """Encode kv [layers, 2, tokens, heads, head_dim] (fp16/bf16/fp32) at ``level``.

    Without a profile the blob carries its own (identity transform, fitted on
    ``kv``): self-contained but larger. ``sink_tokens`` overrides how many leading
    tokens are kept verbatim (the profile's default, 4, suits a context's first
    chunk; later chunks of a context have no attention sinks and may pass 0).
    """
    validate_kv(kv)
    kv = kv.detach().cpu()
    layers, _, tokens, heads, head_dim = kv.shape
    if profile is not None:
        profile.check_shape(layers, heads, head_dim)
        profile.check_level(level)
    elif not isinstance(level, int) or not 0 <= level < len(DEFAULT_TARGETS):
        raise ValueError(f"level must be an int in [0, {len(DEFAULT_TARGETS) - 1}], got {level!r}")
    default_sinks = profile.sink_tokens if profile is not None else DEFAULT_SINK_TOKENS
    sinks = default_sinks if sink_tokens is None else sink_tokens
    if not isinstance(sinks, int) or sinks < 0 or sinks > 0xFFFF:
        raise ValueError(f"sink_tokens must be an int in [0, 65535], got {sinks!r}")
    sinks = min(sinks, tokens)
    embedded = None
    slot = level
    if profile is None:
        profile = embedded_profile(kv, level, sinks)
        embedded = zstandard.ZstdCompressor(level=9).compress(profile.to_bytes())
        slot = 0
    body = kv[:, :, sinks:].to(torch.float32).reshape(layers, 2, tokens - sinks, heads * head_dim)
    sections = [
        _sink_bytes(kv[l], sinks) + layer_codec.encode_layer(profile, slot, l, body[l, 0], body[l, 1])
        for l in range(layers)
    ]
    header = container.pack_header(
        dtype=kv.dtype, level=level, layers=layers, heads=heads, head_dim=head_dim,
        sink_tokens=sinks, tokens=tokens, profile_id=profile.id, embedded_profile=embedded,
        sections=sections)
    return header + b"".join(sections)


def parse_header(blob: bytes | memoryview) -> BlobHeader:
    """The verified header of a blob (or of its first ``header_length`` bytes)."""
    return container.parse_header(blob)


header_length = container.header_length


def resolve_profile(header: BlobHeader, profile: Profile | None) -> tuple[Profile, int]:
    """The profile that decodes this blob and the level slot inside it.

    A blob with an embedded profile decodes with that one (any profile passed is
    not needed and ignored); otherwise the caller's profile must be the one whose
    id the blob names.
    """
    if header.embedded_profile is not None:
        cached = _embedded_cache.get(header.profile_id)
        if cached is None:
            try:
                declared = zstandard.frame_content_size(header.embedded_profile)
                if declared > _MAX_EMBEDDED_PROFILE:  # checked first: the claim alone would allocate it
                    raise CorruptBitstream(f"embedded profile claims {declared} bytes")
                raw = zstandard.ZstdDecompressor().decompress(
                    header.embedded_profile, max_output_size=_MAX_EMBEDDED_PROFILE)
            except (zstandard.ZstdError, MemoryError) as exc:
                raise CorruptBitstream(f"embedded profile does not decompress: {exc}") from exc
            cached = Profile.from_bytes(raw)
            if cached.id != header.profile_id or len(cached.targets) != 1:
                raise CorruptBitstream("embedded profile does not match the blob header")
            _embedded_cache[header.profile_id] = cached
        resolved, slot = cached, 0
    else:
        if profile is None:
            raise ProfileMismatch(f"blob was encoded with profile {header.profile_id}; pass that profile to decode it")
        if profile.id != header.profile_id:
            raise ProfileMismatch(f"blob was encoded with profile {header.profile_id}, not {profile.id}")
        if header.level >= len(profile.targets):
            raise CorruptBitstream(f"blob level {header.level} is not in its profile")
        resolved, slot = profile, header.level
    if (resolved.layers, resolved.heads, resolved.head_dim) != (header.layers, header.heads, header.head_dim):
        raise CorruptBitstream("blob shape disagrees with its profile")
    return resolved, slot


def section_decoder(device: str | torch.device):
    """decode_section for ``device``: the CPU decoder, or the one a backend registered
    (``import kernels`` for CUDA; GpuUnavailable otherwise)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return decode_section
    return backends.device_decoder(dev).decode_section


def decode_section(header: BlobHeader, profile: Profile | None, layer: int,
                   section: bytes | memoryview, out: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [tokens, heads, head_dim] of one layer from its section bytes alone.

    The section is verified against the header's length and checksum first.
    ``out`` ([2, tokens, heads, head_dim] of the blob's dtype, contiguous) receives
    the result in place, saving a copy when assembling a whole cache.
    """
    if not 0 <= layer < header.layers:
        raise ValueError(f"layer {layer} out of range [0, {header.layers})")
    resolved, slot = resolve_profile(header, profile)
    sink_bytes, lanes = container.split_section(section, header, layer)
    sinks, tokens = header.sink_tokens, header.tokens
    channels = header.heads * header.head_dim
    shape = (2, tokens, header.heads, header.head_dim)
    if out is None:
        out = torch.empty(shape, dtype=header.dtype)
    elif out.shape != shape or out.dtype != header.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {header.dtype} tensor of shape {shape}")
    flat = out.view(2, tokens, channels)
    layer_codec.decode_layer(resolved, slot, layer, lanes, flat[:, sinks:])
    if sinks:
        item_dtype = torch.empty(0, dtype=_ITEM_VIEW[header.dtype]).numpy().dtype.newbyteorder("<")
        bits = np.frombuffer(sink_bytes, dtype=item_dtype).astype(item_dtype.newbyteorder("="))
        flat[:, :sinks] = torch.from_numpy(bits).view(header.dtype).reshape(2, sinks, channels)
    return out[0], out[1]


def _device_layers(blob: bytes | memoryview, header: BlobHeader, profile: Profile | None,
                   device: torch.device) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    sections = ((layer, container.section(blob, header, layer)) for layer in range(header.layers))
    return backends.device_decoder(device).decode_layers(header, profile, sections)


def decode_layers(blob: bytes | memoryview, profile: Profile | None = None,
                  device: str | torch.device = "cpu") -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Yield (layer, k, v) in layer order; each k, v is [tokens, heads, head_dim] on ``device``."""
    decode_one = section_decoder(device)
    header = container.parse_header(blob)
    resolve_profile(header, profile)  # fail before yielding anything
    if decode_one is not decode_section:
        yield from _device_layers(blob, header, profile, torch.device(device))
        return
    for layer in range(header.layers):
        k, v = decode_section(header, profile, layer, container.section(blob, header, layer))
        yield layer, k, v


def decode(blob: bytes | memoryview, profile: Profile | None = None,
           device: str | torch.device = "cpu") -> torch.Tensor:
    """Decode a whole blob to [layers, 2, tokens, heads, head_dim] in its original dtype."""
    decode_one = section_decoder(device)
    header = container.parse_header(blob)
    if len(blob) != header.total_size:
        raise CorruptBitstream(f"blob is {len(blob)} bytes, its header says {header.total_size}")
    resolve_profile(header, profile)
    out = torch.empty(header.shape, dtype=header.dtype, device=device)
    if decode_one is not decode_section:
        for layer, k, v in _device_layers(blob, header, profile, torch.device(device)):
            out[layer, 0], out[layer, 1] = k, v
        return out
    for layer in range(header.layers):
        decode_section(header, profile, layer, container.section(blob, header, layer), out=out[layer])
    return out


def inspect(blob: bytes | memoryview) -> dict:
    """Shape, dtype, level, profile id and the byte size of every section of a blob."""
    header = container.parse_header(blob)
    layers = [length for length, _ in header.sections]
    elements = header.layers * 2 * header.tokens * header.heads * header.head_dim
    return {
        "format_version": header.version,
        "shape": list(header.shape),
        "dtype": str(header.dtype).removeprefix("torch."),
        "level": header.level,
        "profile_id": header.profile_id,
        "embedded_profile": header.embedded_profile is not None,
        "sink_tokens": header.sink_tokens,
        "total_bytes": header.total_size,
        "bits_per_element": 8.0 * header.total_size / elements,
        "sections": {
            "header": header.size - len(header.embedded_profile or b""),
            "embedded_profile": len(header.embedded_profile or b""),
            "layers": layers,
        },
        "complete": len(blob) >= header.total_size,
    }
