"""The device-agnostic half of a decode: entropy-decoded coefficients -> KV, in torch.

A decode has two stages. Stage 1, entropy decode and dequantization, is the rANS lane
kernel on a GPU (``kernels/kvwire_kernels/rans_decode.cu``) and the numba decoder on a CPU; both give
the same float32 coefficients bit for bit. Dequantization stays fused in stage 1: a
delta row's values are differences to the *dequantized* anchor (``codec/rans.py``), so
the step is applied where the values are decoded. Its step comes from the plan that
``codec.layer_codec.parse_lanes`` returns, the call the CPU decoder makes itself, so a
format that moves the step from the profile into each section changes both decoders
at once.

Stage 2 is here, written once for every device: the inverse transform of a group of
layers as one batched GEMM (``codec.transform.centered_inverse`` over K and V of every
layer in the group, coefficients zero-padded to the group's widest kept count), the means, RoPE
back onto the keys of a rotary profile, the clamp to the output dtype, and the write
straight into a caller-provided KV tensor. A predicted blob's layers each take the state
of the one before into their product (``codec.prediction.coded_state``, the CPU
decoder's own function), so they are one product per layer and K/V, in layer order.
It runs on CPU tensors too, which is how it is tested on machines without a GPU
(tests/test_reconstruct.py).

Against the CPU decoder (one product per layer and K/V): the coefficients, means,
RoPE and clamp are the same float32 operations and the products take the same
bfloat16 operands; only the GEMM's summation order differs (one padded batched GEMM,
or cuBLAS, vs oneDNN per matrix), which moves a product by one bfloat16 unit where its
float32 sum lies next to a rounding boundary, and otherwise by nothing.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

import codec
from codec import api, container, layer_codec, prediction, rotary, transform
from codec.container import BlobHeader
from codec.profile import Profile


@dataclass(frozen=True)
class ParsedSection:
    """One layer's section, verified (its CRC checked once) and split."""

    layer: int
    sinks: memoryview                       # the sink tokens' bytes (may be empty)
    lanes: layer_codec.LanePayload | None   # a coded section's parsed lanes
    raw: memoryview | None                  # a raw section's token bytes


def parse_section(header: BlobHeader, profile: Profile, slot: int, layer: int,
                  section: bytes | memoryview) -> ParsedSection:
    """Verify a section's length and CRC (the only check of it on this path) and parse
    its lane table against the token count before anything is sized from it."""
    view = container.verify_section(section, header, layer)
    sinks, rest = view[:header.sink_size], view[header.sink_size:]
    if header.is_raw(layer):
        return ParsedSection(layer, sinks, None, rest)
    lanes = layer_codec.parse_lanes(profile, slot, layer, header.coded_tokens, rest, header.version)
    return ParsedSection(layer, sinks, lanes, None)


#: stage 1: (profile, parsed coded section, coded tokens) -> float32 coefficients
#: [coded tokens, rows], token-major (the CUDA kernel's layout; K's kept rows, then V's)
Coefficients = Callable[[Profile, ParsedSection, int], torch.Tensor]


def cpu_coefficients(profile: Profile, parsed: ParsedSection, coded_tokens: int) -> torch.Tensor:
    """Stage 1 on the CPU: the numba decoder's coefficients (token-major, as the CUDA kernel's)."""
    assert parsed.lanes is not None
    return torch.from_numpy(layer_codec.decode_coefficients(profile, parsed.layer, parsed.lanes, coded_tokens))


@dataclass(frozen=True)
class DeviceTables:
    """A profile's means (float32) and basis (bfloat16, what the inverse transform
    multiplies by) on one device, and a predicting profile's chain: each layer's offset
    and K's and V's matrices and entry factors (``codec.prediction``)."""

    mean: torch.Tensor                # [layers, 2, C]
    #: [layers, 2, stored rows, C]; None: identity transform, or a predicting profile
    #: (its chain matrices hold the basis)
    basis: torch.Tensor | None
    offsets: torch.Tensor | None = None                               # [layers, 2, C]; None: no prediction
    matrices: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None
    entries: Sequence[torch.Tensor | None] | None = None


_tables: "weakref.WeakKeyDictionary[Profile, dict[torch.device, DeviceTables]]" = weakref.WeakKeyDictionary()


def device_tables(profile: Profile, device: torch.device) -> DeviceTables:
    """The profile's tables on ``device``, copied there once per profile and device."""
    per_device = _tables.setdefault(profile, {})
    tables = per_device.get(device)
    if tables is None:
        to = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(device)  # noqa: E731
        predicts = profile.predictor is not None
        tables = DeviceTables(to(profile.mean),
                              None if profile.basis16 is None or predicts else profile.basis16.to(device),
                              profile.chain_offsets.to(device) if predicts else None,
                              [tuple(m.to(device) for m in pair) for pair in profile.chain_matrices]
                              if predicts else None,
                              [None if entry is None else entry.to(device) for entry in profile.chain_entries]
                              if predicts else None)
        per_device[device] = tables
    return tables


def inverse_group(tables: DeviceTables, layers: Sequence[int], kept: Sequence[tuple[int, int]],
                  coefficients: Sequence[torch.Tensor]) -> torch.Tensor:
    """float32 [n, 2, tokens, C]: K and V of ``n`` layers from their token-major
    coefficients, the whole group's inverse transform as one batched GEMM."""
    assert tables.offsets is None, "a predicted blob's layers decode one after another (_chained)"
    n, tokens = len(layers), coefficients[0].shape[0]
    index = torch.tensor(list(layers), dtype=torch.long, device=tables.mean.device)
    mean = tables.mean.index_select(0, index)                            # [n, 2, C]
    channels = mean.shape[-1]
    if tables.basis is None:  # identity: every channel kept, K's rows then V's
        coef = torch.stack(list(coefficients)).view(n, tokens, 2, channels).transpose(1, 2)
        return coef + mean[:, :, None, :]
    widest = max(max(k) for k in kept)
    padded = torch.zeros((n, 2, tokens, widest), dtype=torch.bfloat16, device=mean.device)
    for i, ((kept_k, kept_v), coef) in enumerate(zip(kept, coefficients)):
        padded[i, 0, :, :kept_k] = coef[:, :kept_k]
        padded[i, 1, :, :kept_v] = coef[:, kept_k:kept_k + kept_v]
    basis = tables.basis.index_select(0, index)[:, :, :widest]          # [n, 2, widest, C]
    out = transform.centered_inverse(padded.view(2 * n, tokens, widest), basis.reshape(2 * n, widest, channels),
                                     mean.reshape(2 * n, 1, channels))
    return out.view(n, 2, tokens, channels)


def _tokens(data: memoryview, dtype: torch.dtype, channels: int, device: torch.device) -> torch.Tensor:
    """Verbatim tokens [2, n, C] on ``device``, read as the CPU decoder reads them."""
    return api._tokens_from_bytes(data, dtype, channels).to(device)


def reconstruct(header: BlobHeader, profile: Profile, group: Sequence[ParsedSection],
                coefficients: Sequence[torch.Tensor | None], outs: Sequence[torch.Tensor],
                chain: api.LayerChain | None = None) -> None:
    """Write each layer of ``group`` into its ``outs`` entry, a contiguous [2, tokens, heads,
    head_dim] tensor of the blob's dtype (e.g. ``kv[layer]`` of the caller's whole cache) on
    the device the coefficients are on: a coded layer from its stage 1 coefficients (None
    for a raw section), a raw one verbatim, sink tokens verbatim.

    A predicted blob (format 7) needs ``chain`` (``codec.LayerChain``) and ``group`` in
    layer order, continuing the layers the chain holds: each layer's product takes the
    state of the one before, so its layers are one GEMM each, in turn, not one batched
    GEMM (FORMAT.md, "Inter-layer prediction")."""
    shape = (2, header.tokens, header.heads, header.head_dim)
    for out in outs:
        if out.shape != shape or out.dtype != header.dtype or not out.is_contiguous():
            raise ValueError(f"each out must be a contiguous {header.dtype} tensor of shape {shape}")
    flats = [out.view(2, header.tokens, header.channels) for out in outs]
    sinks, coded = header.sink_tokens, header.coded_tokens
    if header.predicted and chain is None:
        raise ValueError("a predicted blob's layers decode from the layers before them: pass a LayerChain")
    for parsed, flat in zip(group, flats):   # verbatim first: a raw layer is what the next is predicted from
        if parsed.raw is not None:
            flat[:, sinks:] = _tokens(parsed.raw, header.dtype, header.channels, flat.device)
        if sinks:
            flat[:, :sinks] = _tokens(parsed.sinks, header.dtype, header.channels, flat.device)
    coded_layers = [i for i, p in enumerate(group) if p.lanes is not None]
    device = flats[0].device
    tables = device_tables(profile, device)
    if header.predicted:
        values = _chained(header, profile, group, coefficients, flats, tables, chain)
    else:
        values = None if not coded_layers else inverse_group(
            tables, [group[i].layer for i in coded_layers], [group[i].lanes.plan.kept for i in coded_layers],
            [coefficients[i] for i in coded_layers])
    if values is not None:
        rope, n = profile.rotary, len(coded_layers)
        if rope is not None:
            cos, sin = rope.angles(header.start + sinks, coded, device)
            keys = values[:, 0].reshape(n * coded, header.channels)
            values[:, 0] = rotary.rotate(keys, rope, (cos.repeat(n, 1), sin.repeat(n, 1))).view(n, coded, -1)
        transform.clamp_to(values, header.dtype)
        for i, value in zip(coded_layers, values):
            flats[i][:, sinks:] = value


def _chained(header: BlobHeader, profile: Profile, group: Sequence[ParsedSection],
             coefficients: Sequence[torch.Tensor | None], flats: Sequence[torch.Tensor], tables: DeviceTables,
             chain: api.LayerChain) -> torch.Tensor | None:
    """float32 [coded layers, 2, tokens, C]: the position-free values of ``group``'s coded
    layers of a predicted blob, each layer in turn from the state of the one before
    (``codec.prediction.coded_state``, the CPU decoder's product), the last state left
    in ``chain`` (a raw section's from its own tokens, already in ``flats``)."""
    sinks, values = header.sink_tokens, []
    for parsed, flat, coef in zip(group, flats, coefficients):
        previous = chain.previous(header, profile, parsed.layer)
        offset = tables.offsets[parsed.layer]
        if parsed.lanes is None:
            state = prediction.raw_state(flat[:, sinks:], profile.rotary, header.start + sinks, offset)
        else:
            kept_k, kept_v = parsed.lanes.plan.kept
            reach = int(profile.chain_reach[parsed.layer])
            state = prediction.layer_state((coef[:, :kept_k], coef[:, kept_k:kept_k + kept_v]),
                                           tables.matrices[parsed.layer], reach,
                                           prediction.reached(previous, reach, tables.entries[parsed.layer]))
            values.append(state.float().add_(offset[:, None, :]))
        chain.hold(parsed.layer, state)
    return torch.stack(values) if values else None


def decode_into(blob: bytes | memoryview, profile: Profile | None, out: torch.Tensor, group_layers: int = 4,
                coefficients: Coefficients = cpu_coefficients) -> None:
    """Decode a whole blob into ``out`` [layers, 2, tokens, heads, head_dim] group by group
    of ``group_layers`` layers: stage 1 by ``coefficients`` (the CPU decoder by default),
    stage 2 by :func:`reconstruct`."""
    header = codec.parse_header(blob)
    if out.shape != header.shape:
        raise ValueError(f"out must have the blob's shape {tuple(header.shape)}")
    resolved, slot = codec.resolve_profile(header, profile)
    chain = api.LayerChain() if header.predicted else None
    for first in range(0, header.layers, group_layers):
        group = [parse_section(header, resolved, slot, layer, _section_bytes(blob, header, layer))
                 for layer in range(first, min(first + group_layers, header.layers))]
        coefs = [None if p.lanes is None else coefficients(resolved, p, header.coded_tokens).to(out.device)
                 for p in group]
        reconstruct(header, resolved, group, coefs, [out[p.layer] for p in group], chain)


def _section_bytes(blob: bytes | memoryview, header: BlobHeader, layer: int) -> memoryview:
    """A layer's section bytes, unverified (parse_section checks them, once)."""
    start = header.section_offset(layer)
    return memoryview(blob)[start:start + header.sections[layer][0]]
