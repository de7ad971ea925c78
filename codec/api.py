"""Public codec entry points: encode, decode, decode_layers, inspect, decode_section.

Blob = header (shape, dtype, level, start position, profile id, per-layer lengths,
checksums and modes, optional embedded profile) + one section per layer. Each section holds the
layer's attention-sink tokens verbatim, then its K and V lanes with the steps and
kept rows the encoder chose for this chunk (``codec.control``: closed loop, so a level
holds its MSE/var on any text), or, in a raw section, its other tokens verbatim, so a
receiver can decode layer l as soon as that section has arrived (``decode_section``). Every size read from a blob is
checked against codec/FORMAT.md's "Limits" before anything is allocated from it.
"""
from __future__ import annotations

import functools
import math
import warnings
from typing import Iterator, Sequence

import numpy as np
import torch
import zstandard

from . import backends, container, control, layer_codec, prediction
from .stages import CONVERT, CRC, LANE_TABLE, stage
from .container import BlobHeader
from .errors import CorruptBitstream, ProfileMismatch, ProfileMismatchWarning
from .levels import DEFAULT_LEVEL, DEFAULT_TARGETS
from .profile import DEFAULT_SINK_TOKENS, CodedBody, Profile, embedded_profile, validate_kv, validate_level
from .rotary import MAX_POSITION

#: a layer's K or V whose energy in the components the profile's level drops passes this
#: multiple of its level's target (as MSE/var) does not fit the profile: no step corrects
#: that error, so the layer is stored raw and ``encode`` warns (ProfileMismatchWarning).
#: A profile from another model loses 10x and more (issue #14); a chunk merely louder or
#: quieter than the calibration loses the same share as it and is step-controlled.
MISFIT_FACTOR = 4.0
#: fewer coded tokens than this are neither checked nor step-controlled (the profile's
#: steps apply): their own variance says little (a few tokens of a context's tail may all
#: be alike) and a wrong guess would only cost bytes
MISFIT_MIN_TOKENS = 64

_ITEM_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


def _token_bytes(tokens: torch.Tensor) -> bytes:
    """K then V tokens [2, n, heads, head_dim] of one layer, bit-exact, little-endian."""
    raw = tokens.contiguous()
    bits = raw.view(_ITEM_VIEW[raw.dtype]).numpy()
    return bits.astype(bits.dtype.newbyteorder("<"), copy=False).tobytes()


def _tokens_from_bytes(data: memoryview, dtype: torch.dtype, channels: int) -> torch.Tensor:
    """Inverse of _token_bytes: [2, n, channels] of ``dtype`` (a copy, native byte order)."""
    item = torch.empty(0, dtype=_ITEM_VIEW[dtype]).numpy().dtype.newbyteorder("<")
    bits = np.frombuffer(data, dtype=item).astype(item.newbyteorder("="))
    return torch.from_numpy(bits).view(dtype).reshape(2, -1, channels)


def _layer_section(profile: Profile, slot: int, layer: int, kv_layer: torch.Tensor, body: torch.Tensor,
                   sinks: int, parts: tuple[control.PartControl, control.PartControl] | None,
                   raw: bool = False, coefficients: layer_codec.Coefficients | None = None
                   ) -> tuple[bytes, layer_codec.EncodedLayer | None]:
    """(section bytes, its lanes) of one layer: its sinks and rANS lanes at the controlled
    steps (``parts``; None: the profile's), or (lanes None) the tokens verbatim when the
    lanes would not be smaller (data unlike the calibration), the values do not quantize
    at all, or ``raw`` (the profile does not fit the layer), so a section is never larger
    than the layer in its own dtype. ``coefficients``: the layer's transform shared with
    other levels."""
    raw_size = container.token_bytes(kv_layer.shape[1] - sinks, body.shape[-1], kv_layer.dtype)
    lanes = None
    if not raw:
        steps = control.profile_steps(profile, slot, layer) if parts is None else tuple(p.step for p in parts)
        try:
            lanes = layer_codec.encode_layer(profile, slot, layer, body[0], body[1], steps=steps,
                                             kept=_coded_rows(profile, slot, layer, parts), coefficients=coefficients)
        except layer_codec.NotCodable:
            pass
    sink_bytes = _token_bytes(kv_layer[:, :sinks])
    if lanes is None or len(lanes.payload) >= raw_size or _over_decode_bound(
            len(sink_bytes) + len(lanes.payload), kv_layer.shape[1], body.shape[-1], kv_layer.dtype):
        return _raw_section(kv_layer, sinks), None
    return sink_bytes + lanes.payload, lanes


def _raw_section(kv_layer: torch.Tensor, sinks: int) -> bytes:
    """A layer's section in raw mode: its sinks, then its other tokens, verbatim."""
    return _token_bytes(kv_layer[:, :sinks]) + _token_bytes(kv_layer[:, sinks:])


def _over_decode_bound(section_bytes: int, tokens: int, channels: int, dtype: torch.dtype) -> bool:
    """Whether a coded section would claim more output per byte than a decoder accepts
    (``container.MAX_OUTPUT_PER_BYTE``, its defence against hostile blobs): a near-constant
    layer can compress that far, and the encoder must never write what the decoder refuses,
    so such a layer is stored raw."""
    return container.token_bytes(tokens, channels, dtype) > container.MAX_OUTPUT_PER_BYTE * section_bytes


def _coded_rows(profile: Profile, slot: int, layer: int,
                parts: tuple[control.PartControl, control.PartControl] | None) -> tuple[int, int]:
    """The K and V rows a layer's section codes at level ``slot``: the control's, else the profile's."""
    if parts is None:
        return int(profile.kept[slot, layer, 0]), int(profile.kept[slot, layer, 1])
    return parts[0].kept, parts[1].kept


def control_samples(profile: Profile, slots: list[int], body: CodedBody
                    ) -> list[tuple[control.PartSample, control.PartSample]]:
    """Each layer's (K, V) sample for the step control (codec.control) of a chunk at
    levels ``slots``: ``body`` its coded tokens. The variance is the chunk's own, of its
    coded tokens in the KV's own frame (keys with RoPE), outlier tokens capped (``control.OUTLIER_FACTOR``);
    error and variance are both measured on ``control.SAMPLE_TOKENS`` evenly spaced
    tokens, transformed once for the most rows any of the levels' controls needs.

    The sample's products run in torch (its thread pool, as the coded rows' do), the
    rest in numpy, which on tensors this small costs less than torch's pool; numpy
    runs no BLAS here, whose second OpenBLAS thread would spin after each product and
    take a core from the torch and numba threads, slowing the encode.
    """
    rows = control.sample_rows(body.tokens)
    sample = body.rows(rows).numpy()
    own = body.rows(rows, own_frame=True).numpy()
    return [tuple(control.PartSample(profile, layer, kind, sample[layer, kind], own[layer, kind],
                                     max(control.sample_rows_needed(profile, slot, layer, kind) for slot in slots))
                  for kind in range(2)) for layer in range(body.layers)]


def control_chunk(profile: Profile, slot: int, samples: list[tuple[control.PartSample, control.PartSample]]
                  ) -> list[tuple[control.PartControl, control.PartControl]]:
    """Each layer's (K, V) step control at level ``slot`` from ``control_samples``."""
    return [tuple(control.control_part(profile, slot, layer, kind, part) for kind, part in enumerate(parts))
            for layer, parts in enumerate(samples)]


def _misfit_limits(profile: Profile, slot: int) -> list[list[float]]:
    """Each layer K/V's misfit bound: ``MISFIT_FACTOR`` times its target
    (``Profile.section_target``)."""
    return [[MISFIT_FACTOR * target for target in pair] for pair in profile.targets_by_section(slot)]


def _misfits(controls, limits: list[list[float]], raw_layers: frozenset[int] = frozenset()
             ) -> dict[tuple[int, int], float]:
    """{(layer, kind): MSE/var at the profile's steps} of every layer K/V the profile does
    not fit: the components its level drops lose over its limit (``_misfit_limits``; no
    step corrects that), or it has no variance and the profile's steps give any error at
    all (infinitely many times its target, whatever the components dropped: whether those
    lose exactly nothing comes down to float rounding), or, in ``raw_layers`` (coded at the
    target they were no smaller than raw), its steps alone would give over that much."""
    return {(layer, kind): part.at_profile for layer, parts in enumerate(controls)
            for kind, part in enumerate(parts)
            if not part.dropped <= limits[layer][kind] or part.at_profile == math.inf
            or (layer in raw_layers and not part.at_profile <= limits[layer][kind])}


def _misfit_message(profile: Profile, level: int, misfits: dict[tuple[int, int], float], layers: int) -> str:
    (layer, kind), worst = max(misfits.items(), key=lambda item: item[1])
    target = profile.section_target(level, layer, kind)
    raw_layers = sorted({layer for layer, _ in misfits})
    # a K/V part of zero variance (a constant tensor) makes any error infinitely many times it
    measured = (f"measures {worst:.2g} ({worst / target:.1f}x its target {target:.2g})" if math.isfinite(worst)
                else f"has zero variance, so any error at all is infinitely many times its target {target:.2g}")
    return (f"profile {profile.id} does not fit this KV: at level {level} "
            f"{len(misfits)} of {2 * layers} layer K/V parts cannot be coded to their target MSE/var (the "
            f"components the profile drops lose over {MISFIT_FACTOR:g}x the target, or holding it costs more "
            f"than raw); at the profile's steps the worst, layer {layer} {'KV'[kind]}, {measured}. Was the profile "
            f"calibrated on another model, or on very different data? Layers {raw_layers} are stored "
            f"raw (exact, not compressed).")


def encode(kv: torch.Tensor, level: int | None = None, profile: Profile | None = None, *,
           sink_tokens: int | None = None, start: int = 0) -> bytes:
    """Encode kv [layers, 2, tokens, heads, head_dim] (fp16/bf16/fp32) at ``level``
    (None: the profile's ``default_level``, without a profile ``DEFAULT_LEVEL``).

    Without a profile the blob carries its own (identity transform, fitted on
    ``kv``): self-contained but larger. A layer whose coded section would not be
    smaller than its tokens verbatim is stored verbatim (FORMAT.md, raw sections), so
    the blob is never larger than ``kv`` in its dtype plus the header. NaN or
    infinite values are a ValueError. ``sink_tokens`` overrides how many leading
    tokens are kept verbatim (the profile's default, 4, suits a context's first
    chunk; later chunks of a context have no attention sinks and may pass 0).
    ``start`` is the absolute position of the chunk's first token in its context,
    recorded in the blob: with a profile that carries the model's RoPE
    (``profile.rotary``) keys are rotated back from those positions before the
    transform, and the decoder re-applies RoPE there.

    The level's target distortion is held in closed loop (``codec.control``, from
    ``MISFIT_MIN_TOKENS`` coded tokens on): each layer's K and V get the step (and kept
    rows) that measure within ``control.TOLERANCE`` of the target MSE/var on this
    chunk, the variance being the chunk's own; the section records them (FORMAT.md,
    version 5). A profile that does not fit the data (a layer's K or V loses an MSE/var
    over ``MISFIT_FACTOR`` times the level's target in the components the profile's
    level drops, which no step corrects, or its steps would give that much and coding
    it at the target is no smaller than raw: a profile from another model, or data far
    from its calibration) is detected while encoding: those layers are stored raw (exact) and a
    ``ProfileMismatchWarning`` names them and the measured error.
    :func:`encode_levels` encodes one chunk at several levels for less work.
    """
    if level is None:
        level = DEFAULT_LEVEL if profile is None else profile.default_level
    return _encode_levels(kv, (level,), profile, sink_tokens, start)[0]


def encode_levels(kv: torch.Tensor, levels: Sequence[int], profile: Profile | None = None, *,
                  sink_tokens: int | None = None, start: int = 0) -> list[bytes]:
    """:func:`encode` at each of ``levels``: the same blobs, byte for byte and in that
    order, for less work, as a store holds every level of each chunk. With a profile the
    checks, the position-free keys, the step control's outlier weights, variance and
    sample product, and the coded rows' transform (for the most rows a level keeps) are
    computed once for all levels; without one each level fits its own embedded profile.
    """
    return _encode_levels(kv, levels, profile, sink_tokens, start)


def encode_exact(kv: torch.Tensor, profile: Profile, *, sink_tokens: int | None = None,
                 start: int = 0) -> bytes:
    """``kv`` held exactly: a blob at the exact level (``container.EXACT_LEVEL``), every
    section raw, naming ``profile`` like the chunk's lossy blobs. It decodes to ``kv``'s
    own bits, so a model fed it computes what it computed from its tokens: the level for
    callers that need answers identical to a full prefill, at 16 bits per fp16 element
    (decoding it is a copy). ``sink_tokens`` and ``start`` are recorded as ``encode``
    records them (they change nothing in a raw section)."""
    kv, start, sinks = _checked_chunk(kv, profile, sink_tokens, start)
    layers, _, tokens, heads, head_dim = kv.shape
    sections = [_raw_section(kv[l], sinks) for l in range(layers)]
    header = container.pack_header(
        dtype=kv.dtype, level=container.EXACT_LEVEL, layers=layers, heads=heads, head_dim=head_dim,
        sink_tokens=sinks, tokens=tokens, start=start, profile_id=profile.id, embedded_profile=None,
        sections=sections, modes=[container.MODE_RAW] * layers)
    return header + b"".join(sections)


def _checked_chunk(kv: torch.Tensor, profile: Profile | None, sink_tokens: int | None,
                   start: int) -> tuple[torch.Tensor, int, int]:
    """(kv on the CPU, start, sink tokens) of an encoder's arguments, each checked."""
    validate_kv(kv)
    kv = kv.detach().cpu()
    layers, _, tokens, heads, head_dim = kv.shape
    if not isinstance(start, (int, np.integer)) or isinstance(start, bool) or not 0 <= start <= MAX_POSITION - tokens:
        raise ValueError(f"start must be an int >= 0 with start + tokens <= {MAX_POSITION}, got {start!r}")
    if profile is not None:
        profile.check_shape(layers, heads, head_dim)
    default_sinks = profile.sink_tokens if profile is not None else DEFAULT_SINK_TOKENS
    sinks = default_sinks if sink_tokens is None else sink_tokens
    if not isinstance(sinks, int) or sinks < 0 or sinks > 0xFFFF:
        raise ValueError(f"sink_tokens must be an int in [0, 65535], got {sinks!r}")
    return kv, int(start), min(sinks, tokens)


def _encode_levels(kv: torch.Tensor, levels: Sequence[int], profile: Profile | None,
                   sink_tokens: int | None, start: int) -> list[bytes]:
    kv, start, sinks = _checked_chunk(kv, profile, sink_tokens, start)
    levels = list(levels)
    if not levels:
        raise ValueError("levels must name at least one level")
    for level in levels:
        validate_level(level, len(DEFAULT_TARGETS if profile is None else profile.targets))
    if profile is not None and profile.predicts:
        return [_encode_predicted(kv, profile, level, sinks, start) for level in levels]
    if profile is not None:
        return _encode_coded(kv, profile, [(level, level) for level in levels], sinks, start, None)
    blobs = []
    for level in levels:
        own = embedded_profile(kv, level, sinks)
        embedded = zstandard.ZstdCompressor(level=9).compress(own.to_bytes())
        blobs += _encode_coded(kv, own, [(level, 0)], sinks, start, embedded)
    return blobs


def _encode_coded(kv: torch.Tensor, profile: Profile, levels: list[tuple[int, int]], sinks: int, start: int,
                  embedded: bytes | None) -> list[bytes]:
    """The blobs of ``kv`` at each (level, its slot in ``profile``) of ``levels``."""
    layers, _, tokens, heads, head_dim = kv.shape
    slots = [slot for _, slot in levels]
    body = CodedBody(kv, sinks, profile.rotary, start)
    samples = control_samples(profile, slots, body) if body.tokens >= MISFIT_MIN_TOKENS else None
    controls = [None if samples is None else control_chunk(profile, slot, samples) for slot in slots]
    judged = embedded is None and samples is not None
    limits = [_misfit_limits(profile, slot) if judged else [] for slot in slots]
    # before coding: layers whose dropped components alone miss the target, stored raw
    raw = [{layer for layer, _ in _misfits(c, lim)} if judged else set() for c, lim in zip(controls, limits)]
    sections: list[list[bytes]] = [[] for _ in slots]
    modes: list[list[int]] = [[] for _ in slots]
    for l in range(layers):
        parts = [None if c is None else c[l] for c in controls]
        kept = [_coded_rows(profile, slot, l, p) for slot, p, r in zip(slots, parts, raw) if l not in r]
        layer_body = body.layer(l)
        coefficients = layer_codec.layer_coefficients(
            profile, l, *layer_body, (max(k for k, _ in kept), max(v for _, v in kept))) if kept else None
        for i, slot in enumerate(slots):
            section, lanes = _layer_section(profile, slot, l, kv[l], layer_body, sinks, parts[i], raw=l in raw[i],
                                            coefficients=coefficients)
            sections[i].append(section)
            modes[i].append(container.MODE_RAW if lanes is None else container.MODE_CODED)
    blobs = []
    for (level, _), c, lim, layer_sections, layer_modes in zip(levels, controls, limits, sections, modes):
        # after: those again, plus the layers that came out raw (not smaller coded) whose
        # profile steps alone would miss it too (recomputed, not merged, to keep the order
        # _misfit_message breaks ties of the worst part by)
        misfits = _misfits(c, lim, frozenset(
            l for l, mode in enumerate(layer_modes) if mode == container.MODE_RAW)) if judged else {}
        if misfits:  # stacklevel: the caller of encode or encode_levels
            warnings.warn(_misfit_message(profile, level, misfits, layers), ProfileMismatchWarning, stacklevel=4)
        header = container.pack_header(
            dtype=kv.dtype, level=level, layers=layers, heads=heads, head_dim=head_dim,
            sink_tokens=sinks, tokens=tokens, start=start, profile_id=profile.id, embedded_profile=embedded,
            sections=layer_sections, modes=layer_modes)
        blobs.append(header + b"".join(layer_sections))
    return blobs


def _encode_predicted(kv: torch.Tensor, profile: Profile, level: int, sinks: int, start: int) -> bytes:
    """The blob (format 7) of ``kv`` at ``level`` of a predicting profile: layer by layer,
    each predicted layer's residual from the previous layer's state *as the decoder will
    decode it* (the state it carries comes from the integers each section codes, as the
    decoder's comes from the section), so that errors do not pile up through the chain.
    The step control holds each section's error against the variance of the layer's
    values, not of the residual: a predicted level loses what the plain one does, in
    fewer bits. Levels do not share work: each has its own chain."""
    layers, _, tokens, heads, head_dim = kv.shape
    body = CodedBody(kv, sinks, profile.rotary, start)
    controlled = body.tokens >= MISFIT_MIN_TOKENS
    rows = control.sample_rows(body.tokens)
    own = body.rows(rows, own_frame=True).numpy() if controlled else None
    limits = _misfit_limits(profile, level)
    sections, modes, controls, raw_layers = [], [], [], set()
    previous: torch.Tensor | None = None
    for layer in range(layers):
        values = body.layer(layer)
        coded = values
        reached = layer_codec.reached(profile, layer, previous)
        if reached is not None:
            coded = values - prediction.guess(reached, profile.chain_matrices[layer], int(profile.chain_reach[layer]),
                                              profile.chain_offsets[layer] - torch.from_numpy(profile.mean[layer]))
        parts = None
        if controlled:
            parts = tuple(control.control_part(profile, level, layer, kind, control.PartSample(
                profile, layer, kind, coded[kind, rows].numpy(), own[layer, kind],
                control.sample_rows_needed(profile, level, layer, kind))) for kind in range(2))
            controls.append(parts)
        misfit = controlled and any(not part.achieved <= limit for part, limit in zip(parts, limits[layer]))
        section, lanes = _layer_section(profile, level, layer, kv[layer], coded, sinks, parts, raw=misfit)
        sections.append(section)
        modes.append(container.MODE_RAW if lanes is None else container.MODE_CODED)
        if lanes is None:
            raw_layers.add(layer)
            previous = prediction.values_state(values, profile.chain_offsets[layer])
        else:
            previous = layer_codec.coded_state(profile, layer, torch.from_numpy(lanes.dequantized()),
                                               lanes.plan.kept, reached)
    misfits = _misfits(controls, limits, frozenset(raw_layers)) if controlled else {}
    if misfits:  # stacklevel: the caller of encode or encode_levels
        warnings.warn(_misfit_message(profile, level, misfits, layers), ProfileMismatchWarning, stacklevel=4)
    header = container.pack_header(
        dtype=kv.dtype, level=level, layers=layers, heads=heads, head_dim=head_dim, sink_tokens=sinks,
        tokens=tokens, start=start, profile_id=profile.id, embedded_profile=None, sections=sections,
        modes=modes, predicted=True)
    return header + b"".join(sections)


def parse_header(blob: bytes | memoryview) -> BlobHeader:
    """The verified header of a blob (or of its first ``header_length`` bytes)."""
    return container.parse_header(blob)


header_length = container.header_length


def resolve_profile(header: BlobHeader, profile: Profile | None) -> tuple[Profile, int]:
    """The profile that decodes this blob and the level slot inside it.

    A blob with an embedded profile decodes with that one: a ``profile`` passed with
    the blob's id (e.g. this function's earlier answer) is taken as it, saving the
    parse; any other is ignored. Otherwise the caller's profile must be the one whose
    id the blob names.
    """
    if header.embedded_profile is not None:
        if profile is not None and profile.id == header.profile_id:
            resolved = profile
        else:
            resolved = _parse_embedded(header.profile_id, header.embedded_profile,
                                       container.embedded_profile_limit(header.layers, header.channels))
        slot = 0
    else:
        if profile is None:
            raise ProfileMismatch(f"blob was encoded with profile {header.profile_id}; pass that profile to decode it")
        if profile.id != header.profile_id:
            raise ProfileMismatch(f"blob was encoded with profile {header.profile_id}, not {profile.id}")
        if header.level >= len(profile.targets) and header.level != container.EXACT_LEVEL:
            raise CorruptBitstream(f"blob level {header.level} is not in its profile")
        resolved, slot = profile, header.level
    if (resolved.layers, resolved.heads, resolved.head_dim) != (header.layers, header.heads, header.head_dim):
        raise CorruptBitstream("blob shape disagrees with its profile")
    if header.level != container.EXACT_LEVEL and header.predicted != resolved.predicts:
        raise CorruptBitstream(f"a version {header.version} blob names profile {resolved.id}, which "
                               f"{'does not predict' if header.predicted else 'predicts'} across layers "
                               f"(a predicting profile writes version {container.PREDICTED_VERSION}, no other)")
    return resolved, slot


@functools.lru_cache(maxsize=4)
def _parse_embedded(profile_id: str, data: bytes, limit: int) -> Profile:
    """Decompress and parse an embedded profile (at most ``limit`` bytes).

    Cached, so a receiver decoding a blob section by section parses it once; a small
    cache, as each entry is bounded by the limit.
    """
    try:
        declared = zstandard.frame_content_size(data)
        if declared > limit:  # checked first: the claim alone would allocate it
            raise CorruptBitstream(f"embedded profile claims {declared} bytes, its blob's shape allows {limit}")
        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=limit)
    except (zstandard.ZstdError, MemoryError) as exc:
        raise CorruptBitstream(f"embedded profile does not decompress within {limit} bytes: {exc}") from exc
    parsed = Profile.from_bytes(raw)
    if parsed.id != profile_id or len(parsed.targets) != 1 or parsed.transform != "identity" \
            or parsed.rotary is not None:
        raise CorruptBitstream("embedded profile does not match the blob header (FORMAT.md: identity, "
                               "one level, no rotary)")
    return parsed


def section_decoder(device: str | torch.device):
    """decode_section for ``device``: the CPU decoder, or the one a backend registered
    (``import kvwire_kernels`` for CUDA; GpuUnavailable otherwise)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return decode_section
    return backends.device_decoder(dev).decode_section


class LayerChain:
    """What decoding a predicted blob (format 7) carries from one layer to the next: the
    last decoded layer's state (K's and V's, bfloat16 [coded tokens, C], ``codec.prediction``),
    from which the next is predicted. ``decode`` and ``decode_layers`` keep their own; a
    caller of ``decode_section`` passes one per blob, to every layer in order from an
    intra-coded layer (``codec.prediction.restart_layer``)."""

    def __init__(self) -> None:
        self.layer: int | None = None
        self.state: prediction.State | None = None

    def previous(self, header: BlobHeader, profile: Profile, layer: int) -> prediction.State | None:
        """The state layer ``layer`` is predicted from (None: it is coded alone);
        ValueError if the chain does not hold the layer before it."""
        if prediction.is_intra(layer, profile.restart):
            return None
        if self.layer != layer - 1 or self.state is None \
                or self.state[0].shape != (header.coded_tokens, header.channels):
            held = "nothing" if self.layer is None else f"layer {self.layer}"
            raise ValueError(f"layer {layer} of a predicted blob decodes from layer {layer - 1}, and the "
                             f"chain holds {held}: decode sections in order from layer "
                             f"{prediction.restart_layer(layer, profile.restart)} with one LayerChain")
        return self.state

    def hold(self, layer: int, state: prediction.State) -> None:
        """Carry ``layer``'s state to the next layer."""
        self.layer, self.state = layer, state


def decode_section(header: BlobHeader, profile: Profile | None, layer: int,
                   section: bytes | memoryview, out: torch.Tensor | None = None,
                   chain: LayerChain | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [tokens, heads, head_dim] of one layer from its section bytes alone, or,
    in a predicted blob (format 7), from its section and ``chain``: the layers before it
    back to an intra-coded one, decoded with the same chain (which this call advances).

    The section is verified against the header's length and checksum, and its lane
    table against the token count, before anything is allocated. ``out`` ([2, tokens,
    heads, head_dim] of the blob's dtype, contiguous) receives the result in place,
    saving a copy when assembling a whole cache.
    """
    if not 0 <= layer < header.layers:
        raise ValueError(f"layer {layer} out of range [0, {header.layers})")
    resolved, slot = resolve_profile(header, profile)
    if header.predicted and chain is None and not prediction.is_intra(layer, resolved.restart):
        raise ValueError(f"layer {layer} of a predicted blob decodes from the layer before it: pass the "
                         f"LayerChain its earlier layers were decoded with")
    checked = _check_section(header, resolved, slot, layer, section)
    shape = (2, header.tokens, header.heads, header.head_dim)
    if out is None:
        out = torch.empty(shape, dtype=header.dtype)
    elif out.shape != shape or out.dtype != header.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {header.dtype} tensor of shape {shape}")
    _decode_checked(header, resolved, layer, checked, out, chain if header.predicted else None)
    return out[0], out[1]


_Checked = tuple[memoryview, "memoryview | layer_codec.LanePayload"]


def _check_section(header: BlobHeader, profile: Profile, slot: int, layer: int,
                   section: bytes | memoryview) -> _Checked:
    """(sink bytes, raw token bytes or parsed lanes) of a section, every length verified."""
    with stage(CRC):
        sink_bytes, rest = container.split_section(section, header, layer)
    if header.is_raw(layer):
        return sink_bytes, rest
    with stage(LANE_TABLE):
        return sink_bytes, layer_codec.parse_lanes(profile, slot, layer, header.coded_tokens, rest, header.version)


def _decode_checked(header: BlobHeader, profile: Profile, layer: int, checked: _Checked,
                    out: torch.Tensor, chain: LayerChain | None = None) -> None:
    """Decode a verified section into ``out``; with a ``chain`` (a predicted blob), from
    the layer it holds, and leave this layer's values in it."""
    sink_bytes, rest = checked
    sinks = header.sink_tokens
    flat = out.view(2, header.tokens, header.channels)
    previous = None if chain is None else chain.previous(header, profile, layer)
    state = None
    if isinstance(rest, layer_codec.LanePayload):
        state = layer_codec.decode_layer(profile, layer, rest, flat[:, sinks:], header.start + sinks, previous)
    with stage(CONVERT):
        if not isinstance(rest, layer_codec.LanePayload):
            flat[:, sinks:] = _tokens_from_bytes(rest, header.dtype, header.channels)
            if chain is not None:   # a raw section holds the layer itself: predict from it exactly
                state = prediction.raw_state(flat[:, sinks:], profile.rotary, header.start + sinks,
                                             profile.chain_offsets[layer])
        if sinks:
            flat[:, :sinks] = _tokens_from_bytes(sink_bytes, header.dtype, header.channels)
    if chain is not None:
        chain.hold(layer, state)


def _section_slices(blob: bytes | memoryview, header: BlobHeader) -> Iterator[tuple[int, memoryview]]:
    """(layer, section bytes) of a blob as slices, unverified: the decoder they go to
    checks each one's length and CRC itself, once (issue #16), so checking here too
    would compute every CRC twice. A truncated blob gives a short slice, refused then."""
    view, at = memoryview(blob), header.offsets
    return ((layer, view[at[layer]:at[layer + 1]]) for layer in range(header.layers))


def _device_layers(blob: bytes | memoryview, header: BlobHeader, profile: Profile | None,
                   device: torch.device) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(layer, k, v) from the device's decoder, which verifies each section as it arrives."""
    return backends.device_decoder(device).decode_layers(header, profile, _section_slices(blob, header))


def decode_layers(blob: bytes | memoryview, profile: Profile | None = None,
                  device: str | torch.device = "cpu") -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Yield (layer, k, v) in layer order; each k, v is [tokens, heads, head_dim] on ``device``."""
    decode_one = section_decoder(device)
    header = container.parse_header(blob)
    resolved, _ = resolve_profile(header, profile)  # fail before yielding anything; parse once
    if decode_one is not decode_section:
        yield from _device_layers(blob, header, resolved, torch.device(device))
        return
    chain = LayerChain()
    for layer, section in _section_slices(blob, header):
        k, v = decode_section(header, resolved, layer, section, chain=chain)   # verifies the section
        yield layer, k, v


def decode(blob: bytes | memoryview, profile: Profile | None = None,
           device: str | torch.device = "cpu", *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode a whole blob to [layers, 2, tokens, heads, head_dim] in its original dtype.

    Every section is verified (length, checksum, lane table against the token count)
    before the output is allocated, so a hostile header cannot size it alone; on the CPU
    also before ``out`` is written, so a corrupt blob leaves it as it was (a device's
    decoder verifies each section as it arrives).

    ``out``: a contiguous tensor of the blob's shape and dtype on ``device`` to decode
    into (returned), such as a slice of the caller's KV cache. Memory the process has
    not touched yet costs the kernel a page fault per 4 KiB on its first write, and a
    fresh output as large as a 1536-token SmolLM2 chunk's (35 MB) is new memory each
    time; a reused buffer does not pay that (``kvwire bench codec --stages`` measures
    both ways).
    """
    decode_one = section_decoder(device)
    header = container.parse_header(blob)
    if len(blob) != header.total_size:
        raise CorruptBitstream(f"blob is {len(blob)} bytes, its header says {header.total_size}")
    resolved, slot = resolve_profile(header, profile)
    if out is not None:
        _check_out(out, header, torch.device(device))
    if decode_one is not decode_section:
        if out is None:
            out = torch.empty(header.shape, dtype=header.dtype, device=device)
        for layer, k, v in _device_layers(blob, header, resolved, torch.device(device)):
            out[layer, 0], out[layer, 1] = k, v
        return out
    checked = [_check_section(header, resolved, slot, layer, section)   # verifies each section
               for layer, section in _section_slices(blob, header)]
    if out is None:
        out = torch.empty(header.shape, dtype=header.dtype)
    chain = LayerChain() if header.predicted else None
    for layer, parts in enumerate(checked):
        _decode_checked(header, resolved, layer, parts, out[layer], chain)
    return out


def _check_out(out: object, header: BlobHeader, device: torch.device) -> None:
    """ValueError unless ``out`` can hold the blob's decode as ``decode`` writes it."""
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"out must be a torch.Tensor, got {type(out).__name__}")
    elsewhere = out.device.type != device.type or device.index not in (None, out.device.index)
    if tuple(out.shape) != header.shape or out.dtype != header.dtype or elsewhere or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {header.dtype} tensor of shape {list(header.shape)} on "
                         f"{device}, got {out.dtype} {list(out.shape)} on {out.device}"
                         f"{'' if out.is_contiguous() else ', not contiguous'}")


def _section_lanes(blob: bytes | memoryview, header: BlobHeader, layer: int) -> int | None:
    """The lane count a section's lane table states (0 for a raw section; None when its
    first bytes are not in ``blob``): n_lanes is the first u32 after the sinks in every
    version. Not checked against the section's CRC: inspect reports, decode verifies."""
    if header.is_raw(layer):
        return 0
    at = header.section_offset(layer) + header.sink_size
    if len(blob) < at + 4 or header.sections[layer][0] < header.sink_size + 4:
        return None
    return int.from_bytes(bytes(blob[at:at + 4]), "little")


def inspect(blob: bytes | memoryview) -> dict:
    """Shape, dtype, level, profile id, the byte size of every section of a blob, and its
    independent rANS lanes (``lanes``: the total, None while a coded section is missing;
    ``sections["lanes"]``: per layer)."""
    header = container.parse_header(blob)
    layers = [length for length, _ in header.sections]
    elements = header.layers * 2 * header.tokens * header.heads * header.head_dim
    lanes = [_section_lanes(blob, header, layer) for layer in range(header.layers)]
    return {
        "format_version": header.version,
        "shape": list(header.shape),
        "dtype": str(header.dtype).removeprefix("torch."),
        "level": header.level,
        "profile_id": header.profile_id,
        "embedded_profile": header.embedded_profile is not None,
        "sink_tokens": header.sink_tokens,
        "start": header.start,
        "total_bytes": header.total_size,
        "bits_per_element": 8.0 * header.total_size / elements,
        "lanes": None if None in lanes else sum(lanes),
        "sections": {
            "header": header.size - len(header.embedded_profile or b""),
            "embedded_profile": len(header.embedded_profile or b""),
            "layers": layers,
            "raw_layers": [layer for layer in range(header.layers) if header.is_raw(layer)],
            "lanes": lanes,
        },
        "complete": len(blob) >= header.total_size,
    }
