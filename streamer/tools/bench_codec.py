"""``kvwire bench codec``: rate, distortion, coder overhead and speed, against baselines.

Real KV comes from all-MiniLM-L6-v2 on English text shipped by Debian, with the
profile calibrated on *other* text than it is measured on. Every method sees the
same chunks (``--chunk-tokens``), the way the streamer sends a context. Distortion
is sum((x_hat - x)^2) / sum((x - mean)^2), the mean taken per (layer, K/V, channel)
over tokens, in the original domain; bits per element is 8 * bytes / elements with
all side information included except the profile, which is reported apart because
every context of a model shares it.
"""
from __future__ import annotations

import json
import math
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numba
import numpy as np
import torch
from numba import njit, prange

from codec import api, baselines, container, entropy, layer_codec, stages, transform
from codec.calibration import calibrate, calibrate_like
from codec.profile import CodedBody, Profile
from codec.synthetic import synthetic_kv

CACHEGEN_QUALITIES = (0.02, 0.04, 0.07, 0.12, 0.2, 0.35, 0.6, 1.0)


@dataclass
class Row:
    method: str
    level: int | None
    bits_per_element: float
    distortion: float
    max_abs_error: float
    encode_mb_s: float | None = None
    decode_mb_s: float | None = None
    coder_overhead: float | None = None
    lanes: int | None = None                 # rANS lanes over all chunks (coded sections)
    ideal_bits_per_lane: float | None = None
    lane_cost_bits: float | None = None      # CoderCost.lane_cost_bits
    cosine: float | None = None
    ratio_fp16: float = 0.0
    ratio_int8: float = 0.0
    ratio_cachegen: float | None = None


@dataclass
class Report:
    config: dict
    profile_bytes: int
    rows: list[Row] = field(default_factory=list)
    transforms: list[dict] = field(default_factory=list)
    delta: list[dict] = field(default_factory=list)
    targets: list[dict] = field(default_factory=list)
    #: fp16 MB of KV per second encoded at every level at once (``codec.encode_levels``,
    #: what ``kvwire put`` runs): each chunk yields all its levels' blobs in that time
    all_levels_encode_mb_s: float | None = None

    def to_json(self) -> str:
        return json.dumps({**asdict(self)}, indent=2)


# ----------------------------------------------------------------------------- data
@dataclass
class Workload:
    name: str
    calibration: torch.Tensor
    measured: torch.Tensor
    cosine: Callable[[Callable[[torch.Tensor], torch.Tensor]], float] | None = None
    #: the profile the levels are measured with (None: ``calibrate([calibration])``), and
    #: the seconds its fitting took
    profile: Profile | None = None
    calibration_seconds: float = 0.0


def minilm_workload(measure_tokens: int, calibration_tokens: int) -> Workload:
    """Real MiniLM KV: calibrated on Apache/MPL/GFDL texts, measured on the GPL-3 text."""
    from streamer.model import hf

    model, tokenizer = hf.load_model()
    cal_ids = hf.tokenize(tokenizer, hf.read_text(hf.CALIBRATION_TEXTS))[:calibration_tokens]
    ids = hf.tokenize(tokenizer, hf.read_text([hf.MEASURE_TEXT]))[:measure_tokens]
    windows = [ids[start:start + 256] for start in range(0, max(len(ids) - 255, 1), 1024)][:6]

    def cosine(roundtrip: Callable[[torch.Tensor], torch.Tensor]) -> float:
        """Mean embedding cosine when the model attends over round-tripped K/V."""
        values = []
        for window in windows:
            kv = hf.capture_kv(model, tokenizer, window)
            reference = hf.sentence_embedding(model, window)
            values.append(float(reference @ hf.sentence_embedding(model, window, roundtrip(kv))))
        return float(np.mean(values))

    return Workload("minilm", hf.capture_kv(model, tokenizer, cal_ids),
                    hf.capture_kv(model, tokenizer, ids), cosine)


def smollm2_workload(measure_tokens: int, calibration_tokens: int) -> Workload:
    """Real KV of the causal LM SmolLM2-135M (RoPE keys), measured on the GPL-3 text with
    the profile ``kvwire calibrate`` fits by default on other texts (RoPE removed, each
    layer predicted from the one before, default level 3), except that its distortion is
    not allocated (which changes the bits a little and costs model passes); quality in the
    model's own terms is ``bench quality``'s job."""
    from streamer.model import hf, quality

    model, tokenizer = hf.load_model("smollm2")
    cal_ids = hf.tokenize(tokenizer, hf.read_text(hf.CALIBRATION_TEXTS))[:calibration_tokens]
    ids = hf.tokenize(tokenizer, hf.read_text([hf.MEASURE_TEXT]))[:measure_tokens]
    start = time.perf_counter()
    profile = quality.calibrate_profile(model, tokenizer, cal_ids, predict=None)
    return Workload("smollm2", hf.capture_kv(model, tokenizer, cal_ids), hf.capture_kv(model, tokenizer, ids),
                    profile=profile, calibration_seconds=time.perf_counter() - start)


def synthetic_workload(shape: str, tokens: int) -> Workload:
    dims = {"llama": (32, 8, 128), "small": (2, 3, 16)}[shape]
    return Workload(f"synthetic-{shape}", synthetic_kv(*dims, tokens, seed=1),
                    synthetic_kv(*dims, tokens, seed=2))


# --------------------------------------------------------------------------- metrics
def distortion(x: torch.Tensor, x_hat: torch.Tensor) -> tuple[float, float]:
    """(relative MSE against per-(layer, K/V, channel) variance, max abs error)."""
    x = x.double()
    err = x_hat.double() - x
    denom = ((x - x.mean(dim=2, keepdim=True)) ** 2).sum()
    return float((err ** 2).sum() / denom), float(err.abs().max())


def chunks_of(kv: torch.Tensor, chunk_tokens: int) -> list[torch.Tensor]:
    return [kv[:, :, s:s + chunk_tokens] for s in range(0, kv.shape[2], chunk_tokens)]


def encode_args(chunks: Sequence[torch.Tensor]) -> list[dict]:
    """Each consecutive chunk's ``encode`` keywords as a context's put gives them: sinks
    in the first only, and its start position (where a rotary profile removes RoPE)."""
    starts = np.cumsum([0] + [c.shape[2] for c in chunks[:-1]])
    return [{"sink_tokens": None if i == 0 else 0, "start": int(start)} for i, start in enumerate(starts)]


def _best_time(fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    best, result = math.inf, None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


@dataclass(frozen=True)
class CoderCost:
    """What the coded sections' lane payloads spend against the ideal bits of their values."""

    ideal_bits: float    # information content of the coded values under the profile's tables
    payload_bits: float  # lane payloads: section heads, lane tables (u32 state, u16 count), words
    lanes: int
    sections: int

    @property
    def overhead(self) -> float:
        """Payload bits over ideal bits, minus one (what ``coder_overhead`` reports)."""
        return self.payload_bits / self.ideal_bits - 1.0 if self.ideal_bits else 0.0

    @property
    def lane_cost_bits(self) -> float:
        """Bits one lane costs beyond its values' ideal bits, section heads set apart: its
        48-bit table entry and its rANS stream's 16-bit start state and flush, less the
        information its final state carries (the coder's precision loss adds the rest)."""
        heads = 8 * layer_codec.LANE_HEAD.size * self.sections
        return (self.payload_bits - heads - self.ideal_bits) / self.lanes if self.lanes else 0.0


def coder_cost(profile: Profile, level: int, chunks: Sequence[torch.Tensor],
               blobs: Sequence[bytes]) -> CoderCost:
    """Lane payload bits (final states and lane tables included) against the ideal bits of
    the values each coded section holds (at the steps and kept rows it records)."""
    ideal = real = 0.0
    lanes = sections = 0
    for chunk, blob in zip(chunks, blobs):
        header = api.parse_header(blob)
        body = CodedBody(chunk, header.sink_tokens, profile.rotary, header.start)
        for layer in range(header.layers):
            if header.is_raw(layer):
                continue
            payload = container.split_section(container.section(blob, header, layer), header, layer)[1]
            coded = layer_codec.parse_lanes(profile, level, layer, header.coded_tokens, payload, header.version).plan
            plan, q, _ = layer_codec.quantize_layer(profile, level, layer, *body.layer(layer),
                                                    coded.steps, coded.kept)
            ideal += layer_codec.ideal_layer_bits(profile, plan, q)
            real += 8 * len(payload)
            lanes += coded.lanes
            sections += 1
    return CoderCost(ideal, real, lanes, sections)


@dataclass(frozen=True)
class Case:
    """One way of coding the chunks that the benchmark measures: a row of its table."""

    name: str
    profile: Profile
    level: int


def measure_cases(cases: Sequence[Case], chunks: Sequence[torch.Tensor], repeat: int
                  ) -> list[tuple[Row, list[bytes]]]:
    """Each case's bits, error and encode and decode speed, with its blobs. Timed in
    ``repeat`` rounds, each timing every case once, best per case: this machine's speed
    drifts by tens of percent from one minute to the next, and cases timed back to back
    would carry a slow minute into their comparison."""
    half = [c.to(torch.float16) for c in chunks]
    args = encode_args(half)
    x = torch.cat(half, dim=2)
    outs = caller_buffers(half)
    encode_s, decode_s = [math.inf] * len(cases), [math.inf] * len(cases)
    blobs: list[list[bytes]] = [[] for _ in cases]
    errors: list[tuple[float, float] | None] = [None] * len(cases)
    for _ in range(repeat):
        for i, case in enumerate(cases):
            start = time.perf_counter()
            blobs[i] = [api.encode(c, case.level, case.profile, **a) for c, a in zip(half, args)]
            encode_s[i] = min(encode_s[i], time.perf_counter() - start)
            start = time.perf_counter()
            decoded = [api.decode(b, case.profile, out=o) for b, o in zip(blobs[i], outs)]
            decode_s[i] = min(decode_s[i], time.perf_counter() - start)
            if errors[i] is None:
                errors[i] = distortion(x, torch.cat(decoded, dim=2))
    fp16_mb = x.numel() * 2 / 1e6
    return [(Row(case.name, case.level, 8 * sum(map(len, coded)) / x.numel(), *error,
                 encode_mb_s=fp16_mb / enc, decode_mb_s=fp16_mb / dec), coded)
            for case, coded, error, enc, dec in zip(cases, blobs, errors, encode_s, decode_s)]


def caller_buffers(chunks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A buffer per chunk, written once, that each decode of it writes into: the decode
    as a receiver runs it, into a KV cache it holds, so the decoder is timed rather than
    the kernel's first touch of fresh pages (``codec.decode``'s ``out``;
    :func:`measure_stages` times both)."""
    return [torch.zeros_like(c) for c in chunks]


def measure_kvwire(profile: Profile, level: int, chunks: Sequence[torch.Tensor], repeat: int,
                   name: str = "kvwire") -> tuple[Row, list[bytes]]:
    """One case of :func:`measure_cases`."""
    return measure_cases([Case(name, profile, level)], chunks, repeat)[0]


def measure_all_levels(profile: Profile, chunks: Sequence[torch.Tensor], repeat: int) -> float:
    """fp16 MB/s of ``chunks`` encoded at every level of ``profile`` in one ``encode_levels`` call each."""
    half = [c.to(torch.float16) for c in chunks]
    levels = range(len(profile.levels))
    seconds, _ = _best_time(lambda: [api.encode_levels(c, levels, profile, **args)
                                     for c, args in zip(half, encode_args(half))], repeat)
    return sum(c.numel() for c in half) * 2 / 1e6 / seconds


def measure_baseline(fn: Callable[[torch.Tensor], baselines.Encoded], chunks: Sequence[torch.Tensor],
                     level: int | None = None) -> Row:
    half = [c.to(torch.float16) for c in chunks]
    encoded = [fn(c) for c in half]
    x = torch.cat(half, dim=2)
    mse, max_err = distortion(x, torch.cat([e.reconstruction for e in encoded], dim=2))
    return Row(encoded[0].name.split("(")[0] if fn is not baselines.cachegen else encoded[0].name,
               level, 8 * sum(e.nbytes for e in encoded) / x.numel(), mse, max_err)


def interpolate_bits(curve: Sequence[Row], target: float) -> float | None:
    """Bits the curve needs at distortion ``target`` (log-log interpolation), None if outside."""
    points = sorted((r.distortion, r.bits_per_element) for r in curve if r.distortion > 0)
    for (d0, b0), (d1, b1) in zip(points, points[1:]):
        if d0 <= target <= d1:
            w = (math.log(target) - math.log(d0)) / (math.log(d1) - math.log(d0)) if d1 > d0 else 0.0
            return math.exp(math.log(b0) + w * (math.log(b1) - math.log(b0)))
    return None


# ------------------------------------------------------------------------------ run
def run(workload: Workload, chunk_tokens: int, repeat: int, compare_variants: bool = True,
        predict: int | None = None, predict_maps: str | None = None) -> Report:
    torch.manual_seed(0)
    start = time.perf_counter()
    profile = workload.profile or calibrate([workload.calibration])
    calibration_s = workload.calibration_seconds if workload.profile else time.perf_counter() - start
    chunks = chunks_of(workload.measured, chunk_tokens)
    x = workload.measured
    report = Report(config={"workload": workload.name, "shape": list(x.shape), "chunk_tokens": chunk_tokens,
                            "chunks": len(chunks), "calibration_tokens": workload.calibration.shape[2],
                            "calibration_seconds": round(calibration_s, 2), "profile_id": profile.id,
                            "delta_layers": int((profile.delta_group > 0).sum()),
                            "default_level": profile.default_level, "predicts": profile.predicts,
                            "threads": torch.get_num_threads()},
                    profile_bytes=len(profile.to_bytes()))
    fp16 = measure_baseline(baselines.raw_fp16, chunks)
    int8 = measure_baseline(baselines.int8, chunks)
    zstd = measure_baseline(baselines.zstd_fp16, chunks)
    cachegen = [measure_baseline(lambda c, q=q: baselines.cachegen(c, q), chunks) for q in CACHEGEN_QUALITIES]
    rows: list[Row] = [fp16, int8, zstd, *cachegen]
    cases = [Case("kvwire", profile, level) for level in range(len(profile.levels))]
    if predict is not None:
        maps = _maps(predict, predict_maps)
        cases += _twin_cases(workload, profile, predict, maps)
        report.config["predict"], report.config["predict_maps"] = predict, maps
    for case, (row, blobs) in zip(cases, measure_cases(cases, chunks, repeat)):
        if case.profile is profile:   # the profile's own rows: their coder cost and the workload's cosine
            level = case.level
            cost = coder_cost(profile, level, chunks, blobs)
            row.coder_overhead, row.lanes, row.lane_cost_bits = cost.overhead, cost.lanes, cost.lane_cost_bits
            row.ideal_bits_per_lane = cost.ideal_bits / cost.lanes if cost.lanes else None
            if workload.cosine is not None:
                row.cosine = workload.cosine(lambda kv, level=level: api.decode(api.encode(kv, level, profile), profile))
        rows.append(row)
    for row in rows:
        row.ratio_fp16 = fp16.bits_per_element / row.bits_per_element
        row.ratio_int8 = int8.bits_per_element / row.bits_per_element
        if row.method == "kvwire":
            cg = interpolate_bits(cachegen, row.distortion)
            row.ratio_cachegen = None if cg is None else cg / row.bits_per_element
    report.rows = rows
    report.all_levels_encode_mb_s = measure_all_levels(profile, chunks, repeat)
    if compare_variants:   # of plain profiles: a predicting one's twin without prediction
        plain = _twin(workload, profile, 0, None) if profile.predicts else profile
        report.transforms = _compare_transforms(workload, chunks, plain)
        report.delta = _compare_delta(workload, chunks, plain)
    report.targets = _targets(report, workload.cosine is not None)
    return report


def _maps(restart: int, maps: str | None) -> str | None:
    """The maps a twin predicting every ``restart`` layers fits (None: it does not predict):
    ``maps``, else the calibration default, as ``kvwire calibrate`` resolves them (a given
    period needs no model)."""
    from streamer.model.quality import model_prediction

    return model_prediction(None, restart, maps).get("predict_groups")


def _twin(workload: Workload, profile: Profile, restart: int, maps: str | None) -> Profile:
    """``profile``'s targets, weights, RoPE and default level calibrated again on the
    calibration KV with inter-layer prediction every ``restart`` layers (blob format 7,
    ``maps`` its ``predict_groups``, as :func:`_maps` resolves them), or without
    (``restart`` 0), so what it measures sits beside the profile's own rows at the same
    targets."""
    return calibrate_like(profile, [workload.calibration], predict=restart, predict_groups=maps or "all")


def _twin_cases(workload: Workload, profile: Profile, restart: int, maps: str | None) -> list[Case]:
    """Every level again from :func:`_twin`, with the decode and encode speed the
    prediction costs (or saves) on this CPU: rows ``kvwire-predicted/N/MAPS`` or
    ``kvwire-plain``."""
    twin = _twin(workload, profile, restart, maps)
    name = f"kvwire-predicted/{restart}/{maps}" if restart else "kvwire-plain"
    return [Case(name, twin, level) for level in range(len(twin.levels))]


def _compare_transforms(workload: Workload, chunks, profile: Profile) -> list[dict]:
    """Rate, distortion and inverse-transform cost of PCA across heads, per head, none."""
    out = []
    for kind in ("layer", "head", "identity"):
        p = profile if kind == "layer" else calibrate([workload.calibration], transform=kind, rotary=profile.rotary)
        for level in (1, 2, 3):
            row, _ = measure_kvwire(p, level, chunks, 1)
            kept = float(p.kept[level].mean())
            macs = {"layer": kept, "head": min(kept, p.head_dim), "identity": 0.0}[kind]
            out.append({"transform": kind, "level": level, "bits_per_element": row.bits_per_element,
                        "distortion": row.distortion, "inverse_macs_per_element": macs})
    return out


def _compare_delta(workload: Workload, chunks, profile: Profile) -> list[dict]:
    """CacheGen's anchor/delta coding forced on versus the calibrated (auto) choice."""
    forced = calibrate([workload.calibration], delta="always", rotary=profile.rotary)
    out = []
    for name, p in (("auto", profile), ("delta-always", forced)):
        row, _ = measure_kvwire(p, profile.default_level, chunks, 1)
        out.append({"delta": name, "level": profile.default_level, "bits_per_element": row.bits_per_element,
                    "distortion": row.distortion,
                    "delta_layers": int((p.delta_group > 0).sum())})
    return out


def _targets(report: Report, real: bool) -> list[dict]:
    kv = [r for r in report.rows if r.method == "kvwire"]
    targets = [{"target": "coder overhead <= 1% (every level)",
                "measured": max(r.coder_overhead for r in kv), "met": max(r.coder_overhead for r in kv) <= 0.01}]
    for max_d, max_bits in ((1.2e-3, 3.5), (5e-3, 2.5), (1.5e-2, 1.7)):
        fits = [r.bits_per_element for r in kv if r.distortion <= max_d]
        best = min(fits) if fits else None
        targets.append({"target": f"distortion <= {max_d:g} at <= {max_bits} bits/element",
                        "measured": best, "met": best is not None and best <= max_bits})
    ratios = [r.ratio_cachegen for r in kv]
    worst = min((r for r in ratios if r is not None), default=None)
    targets.append({"target": ">= 1.6x fewer bits than CacheGen-style at equal distortion (every level)",
                    "measured": worst, "met": worst is not None and None not in ratios and worst >= 1.6})
    level = report.config["default_level"]
    default = kv[level]
    if real:
        targets.append({"target": f"embedding cosine >= 0.999 at the default level ({level})",
                        "measured": default.cosine, "met": default.cosine >= 0.999})
    targets.append({"target": f"CPU decode >= 300 MB/s fp16-equivalent at the default level "
                              f"({report.config['threads']} threads)",
                    "measured": default.decode_mb_s, "met": default.decode_mb_s >= 300})
    targets.append({"target": "CPU encode >= 100 MB/s fp16-equivalent at the default level",
                    "measured": default.encode_mb_s, "met": default.encode_mb_s >= 100})
    return targets


# --------------------------------------------------------------------------- stages
@dataclass
class StageRow:
    """One stage of the CPU decode: its wall seconds over the chunks, its share of the
    decode, and the seconds this CPU needs at least for its work (``bound_seconds``;
    None where there is no meaningful bound), measured as ``bound`` says."""

    stage: str
    seconds: float
    share: float
    bound_seconds: float | None = None
    bound: str = ""


@dataclass
class StageReport:
    config: dict
    decode_mb_s: float   # fp16 MB of KV per second, the decode not recorded (best of the repeats)
    encode_mb_s: float
    rows: list[StageRow] = field(default_factory=list)
    #: the same decode into fresh tensors (``codec.decode`` without ``out``): its first
    #: writes fault the pages in
    fresh_output_decode_mb_s: float | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


@dataclass(frozen=True)
class _Work:
    """What the coded sections of the blobs ask of each stage."""

    flops: float = 0.0         # inverse transform: 2 * N * (predicted rows (twice if factored) + kept) * C per K/V
    shape: tuple[int, int, int] = (1, 1, 1)  # (N, rows, C) of the largest product
    steps: float = 0.0         # coder steps: a symbol per value, one more per value with low bits
    crc_bytes: float = 0.0
    rope_bytes: float = 0.0    # float32 keys read and written
    convert_bytes: float = 0.0  # float32 read, the blob's dtype written


def _work(profile: Profile, level: int, blobs: Sequence[bytes]) -> _Work:
    flops = steps = crc = rope = convert = 0.0
    shape = (1, 1, 1)
    for blob in blobs:
        header = api.parse_header(blob)
        crc += header.total_size - header.size
        convert += (4 + header.dtype.itemsize) * header.layers * 2 * header.tokens * header.channels
        for layer in range(header.layers):
            if header.is_raw(layer):
                continue
            payload = container.split_section(container.section(blob, header, layer), header, layer)[1]
            plan = layer_codec.parse_lanes(profile, level, layer, header.coded_tokens, payload, header.version).plan
            n, c = header.coded_tokens, header.channels
            # a predicting profile's layers are all products (codec.prediction.coded_state),
            # a low-rank map's with the state by its entry factor first (C x reach, per kind)
            reach = 0 if profile.predictor is None else int(profile.chain_reach[layer])
            entry = 2 * reach if profile.predictor_factors is not None else 0
            if profile.basis is not None or profile.predictor is not None:
                flops += 2.0 * n * (sum(plan.kept) + 2 * reach + entry) * c
            shape = max(shape, (n, max(plan.kept) + reach, c), key=lambda s: s[0] * s[1] * s[2])
            steps += n * float((1 + (plan.shift[:, 0] > 0)).sum())
            rope += 8.0 * n * c if profile.rotary is not None else 0.0
    return _Work(flops, shape, steps, crc, rope, convert)


@njit(cache=True, nogil=True, inline="always")
def _tight_step(x, lut, coder, words, pos):
    """One rANS decode step (FORMAT.md's widths: 12-bit slots, one 16-bit refill at most)."""
    slot = x & 4095
    packed = np.int64(coder[np.int64(lut[slot])])
    x = (packed & 0xFFFF) * (x >> 12) + slot - (packed >> 16)
    word = np.int64(words[pos])
    if x < 65536:
        x = (x << 16) | word
        pos += 1
    return x, pos


@njit(cache=True, nogil=True, parallel=True)
def _tight_rans(words, lut, coder, groups, steps):
    """The rANS decode step and nothing else (no dequantization, escapes, low bits,
    status or bounds on the words), four lanes in lockstep per task as the decoder runs
    them: the coder's ceiling on this CPU. Returns the final states' sum so that no step
    is optimized away."""
    total = np.zeros(groups, np.int64)
    span = words.shape[0] // (4 * groups)
    for g in prange(groups):
        pa, pb, pc, pd = 4 * g * span, (4 * g + 1) * span, (4 * g + 2) * span, (4 * g + 3) * span
        xa = xb = xc = xd = np.int64(1 << 16) + g
        for _ in range(steps):
            xa, pa = _tight_step(xa, lut, coder, words, pa)
            xb, pb = _tight_step(xb, lut, coder, words, pb)
            xc, pc = _tight_step(xc, lut, coder, words, pc)
            xd, pd = _tight_step(xd, lut, coder, words, pd)
        total[g] = xa + xb + xc + xd
    return total.sum()


def _coder_steps_per_s(profile: Profile, repeat: int) -> float:
    """Decode steps per second of ``_tight_rans`` on random words with the profile's
    busiest table (the class most rows of its default level use), on numba's threads."""
    classes = np.bincount(profile.table[profile.default_level].ravel(), minlength=len(profile.tables))
    table = profile.tables[int(classes.argmax())][None]
    lut, coder = entropy.slot_lookup(table)[0], entropy.packed_coder(table)[0]
    groups, steps = 16 * numba.get_num_threads(), 100_000
    words = np.random.default_rng(0).integers(0, 1 << 16, groups * 4 * steps, dtype=np.uint16)
    _tight_rans(words, lut, coder, groups, 10)  # compiled or loaded before the clock starts
    seconds, _ = _best_time(lambda: _tight_rans(words, lut, coder, groups, steps), repeat)
    return 4.0 * groups * steps / seconds


def _gemm_flops_per_s(shape: tuple[int, int, int], repeat: int) -> float:
    """FLOP/s of the inverse transform's largest product, [N, kept] float32 by [kept, C]
    bfloat16 (``codec.transform.product``: its operand's rounding included, in hardware
    where the CPU multiplies bfloat16), alone on torch's threads."""
    n, kept, c = shape
    a, b = torch.randn(n, kept), torch.randn(kept, c).to(torch.bfloat16)
    seconds, _ = _best_time(lambda: [transform.product(a, b) for _ in range(10)], repeat)
    return 10 * 2.0 * n * kept * c / seconds


def _copy_bytes_per_s(elements: int, repeat: int) -> float:
    """Bytes read and written per second by a float32 copy of ``elements`` values."""
    src, dst = torch.randn(elements), torch.empty(elements)
    seconds, _ = _best_time(lambda: [dst.copy_(src) for _ in range(10)], repeat)
    return 10 * 8.0 * elements / seconds


def _crc_bytes_per_s(repeat: int) -> float:
    data = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    seconds, _ = _best_time(lambda: [zlib.crc32(data) for _ in range(10)], repeat)
    return 10.0 * len(data) / seconds


#: seconds a bound waits before it is timed: torch's and numba's thread pools each keep
#: their idle workers spinning for a while after a parallel region, and a rate timed while
#: the other pool's workers spin measures the contention, not the CPU
POOL_SETTLE_S = 0.2


def _quiet(measure: Callable[[], float]) -> float:
    """``measure()`` once the thread pools have gone idle (POOL_SETTLE_S)."""
    time.sleep(POOL_SETTLE_S)
    return measure()


def measure_stages(profile: Profile, level: int, chunks: Sequence[torch.Tensor], repeat: int) -> StageReport:
    """The CPU decode of ``chunks`` at ``level``, stage by stage (``codec.stages``), each
    against its bound on this CPU: the inverse transform's FLOPs (a predicting profile's
    prediction rows included) at its product's rate of the same shape, the coder's steps at ``_tight_rans``'s rate, CRC bytes at zlib's
    rate on a hot buffer, RoPE and the conversion's bytes at a float32 copy's rate."""
    half = [c.to(torch.float16) for c in chunks]
    t_enc, blobs = _best_time(lambda: [api.encode(c, level, profile, **args)
                                       for c, args in zip(half, encode_args(half))], 1)
    fp16_mb = sum(c.numel() for c in half) * 2 / 1e6
    outs = caller_buffers(half)
    t_dec, t_fresh = math.inf, math.inf
    for _ in range(repeat):   # in turns: this machine's speed drifts from minute to minute
        t_dec = min(t_dec, _best_time(lambda: [api.decode(b, profile, out=o) for b, o in zip(blobs, outs)], 1)[0])
        t_fresh = min(t_fresh, _best_time(lambda: [api.decode(b, profile) for b in blobs], 1)[0])
    runs = []
    for _ in range(repeat):
        with stages.recording() as times:
            total, _ = _best_time(lambda: [api.decode(b, profile, out=o) for b, o in zip(blobs, outs)], 1)
        runs.append((total, dict(times)))
    total, times = min(runs, key=lambda run: run[0])
    work = _work(profile, level, blobs)
    elements = work.shape[0] * work.shape[2]
    copy_rate = _quiet(lambda: _copy_bytes_per_s(elements, repeat))
    gemm_rate = _quiet(lambda: _gemm_flops_per_s(work.shape, repeat))
    coder_rate = _quiet(lambda: _coder_steps_per_s(profile, repeat))
    crc_rate = _quiet(lambda: _crc_bytes_per_s(repeat))
    bounds = {
        stages.CRC: (work.crc_bytes / crc_rate, f"{work.crc_bytes / 1e6:.0f} MB at zlib's {crc_rate / 1e9:.1f} GB/s"),
        stages.LANE_TABLE: (None, "-"),
        stages.ENTROPY: (work.steps / coder_rate, f"{work.steps / 1e6:.0f} M steps at a tight loop's "
                                                  f"{coder_rate / 1e6:.0f} M/s"),
        stages.TRANSFORM: (work.flops / gemm_rate, f"{work.flops / 1e9:.1f} GFLOP at the bf16 product's "
                                                  f"{gemm_rate / 1e9:.0f} GFLOP/s"),
        stages.ROPE: (work.rope_bytes / copy_rate, f"{work.rope_bytes / 1e6:.0f} MB at a copy's "
                                                  f"{copy_rate / 1e9:.1f} GB/s"),
        stages.CONVERT: (work.convert_bytes / copy_rate, f"{work.convert_bytes / 1e6:.0f} MB at a copy's "
                                                        f"{copy_rate / 1e9:.1f} GB/s"),
    }
    rows = [StageRow(name, times.get(name, 0.0), times.get(name, 0.0) / total, *bounds[name])
            for name in stages.STAGES]
    rest = total - sum(row.seconds for row in rows)
    rows.append(StageRow("python, allocation, glue", rest, rest / total, 0.0, "nothing to wait for"))
    config = {"level": level, "chunks": len(chunks), "shape": list(chunks[0].shape), "seconds": total,
              "torch_threads": torch.get_num_threads(), "numba_threads": numba.get_num_threads()}
    return StageReport(config, fp16_mb / t_dec, fp16_mb / t_enc, rows, fp16_mb / t_fresh)


def render_stages(report: StageReport) -> str:
    c = report.config
    lines = [f"CPU decode by stage: level {c['level']}, {c['chunks']} chunks {c['shape']}, "
             f"torch {c['torch_threads']} / numba {c['numba_threads']} threads; decode "
             f"{report.decode_mb_s:.0f} MB/s fp16-equivalent into the caller's buffers, "
             f"{_fmt(report.fresh_output_decode_mb_s, '.0f')} into fresh ones "
             f"(encode {report.encode_mb_s:.0f} MB/s)",
             f"{'stage':<30}{'seconds':>9}{'share':>8}{'bound s':>9}{'x bound':>9}  bound measured as"]
    for r in report.rows:
        over = None if not r.bound_seconds else r.seconds / r.bound_seconds
        lines.append(f"{r.stage:<30}{r.seconds:>9.4f}{100 * r.share:>7.1f}%{_fmt(r.bound_seconds, '.4f'):>9}"
                     f"{_fmt(over, '.2f'):>9}  {r.bound}")
    lines.append(f"{'total (stages recorded)':<30}{c['seconds']:>9.4f}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- output
def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render(report: Report) -> str:
    c = report.config
    lines = [f"kvwire bench codec: {c['workload']} KV {c['shape']}, {c['chunks']} chunks of "
             f"{c['chunk_tokens']} tokens, profile {c['profile_id']} ({report.profile_bytes / 1e6:.2f} MB, "
             f"calibrated on {c['calibration_tokens']} other tokens in {c['calibration_seconds']} s)",
             "",
             f"{'method':<18}{'lvl':>4}{'bits/el':>9}{'x fp16':>8}{'x int8':>8}{'x CG':>7}{'MSE/var':>10}"
             f"{'max|err|':>10}{'ovh %':>8}{'enc MB/s':>10}{'dec MB/s':>10}{'cosine':>9}"]
    for r in report.rows:
        lines.append(f"{r.method:<18}{_fmt(r.level, 'd'):>4}{r.bits_per_element:>9.3f}{r.ratio_fp16:>8.2f}"
                     f"{r.ratio_int8:>8.2f}{_fmt(r.ratio_cachegen, '.2f'):>7}{r.distortion:>10.2e}"
                     f"{r.max_abs_error:>10.3g}{_fmt(None if r.coder_overhead is None else 100 * r.coder_overhead, '.2f'):>8}"
                     f"{_fmt(r.encode_mb_s, '.0f'):>10}{_fmt(r.decode_mb_s, '.0f'):>10}{_fmt(r.cosine, '.5f'):>9}")
    lines.append("x CG: CacheGen-style bits at the same distortion (log-log interpolated on its curve) / kvwire bits.")
    if report.all_levels_encode_mb_s is not None:
        lines.append(f"all {sum(r.method == 'kvwire' for r in report.rows)} levels at once (encode_levels, as "
                     f"kvwire put): {report.all_levels_encode_mb_s:.0f} MB/s of fp16 KV")
    lanes = [r for r in report.rows if r.lanes]
    if lanes:
        lines += ["", "coder overhead = lanes x bits each costs / ideal bits (section heads aside; FORMAT.md lane table):"]
        lines += [f"  level {r.level}: {r.lanes} lanes x {r.lane_cost_bits:.1f} bits over "
                  f"{r.ideal_bits_per_lane:.0f} ideal bits per lane" for r in lanes]
    if report.transforms:
        lines += ["", "transform (where the decorrelation is fitted):"]
        for t in report.transforms:
            lines.append(f"  {t['transform']:<9} level {t['level']}: {t['bits_per_element']:.3f} bits/el at "
                         f"MSE/var {t['distortion']:.2e}, inverse {t['inverse_macs_per_element']:.0f} MACs/element")
    if report.delta:
        lines += ["", "anchor/delta coding (CacheGen's token groups of 10):"]
        for d in report.delta:
            lines.append(f"  {d['delta']:<13} {d['bits_per_element']:.3f} bits/el at MSE/var {d['distortion']:.2e} "
                         f"({d['delta_layers']} of the layer x K/V streams delta-coded)")
    lines += ["", "targets:"]
    for t in report.targets:
        measured = t["measured"]
        shown = "-" if measured is None else f"{measured:.4g}"
        lines.append(f"  [{'met' if t['met'] else 'MISSED'}] {t['target']}: measured {shown}")
    return "\n".join(lines)


def plot(report: Report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list[Row]] = {}
    for r in report.rows:
        series.setdefault(r.method.split("(")[0], []).append(r)
    for name, rows in series.items():
        pts = sorted((r.bits_per_element, r.distortion) for r in rows if r.distortion > 0)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=name, linestyle="-" if len(pts) > 1 else "none")
    for kind in ("head", "identity"):
        pts = [(t["bits_per_element"], t["distortion"]) for t in report.transforms if t["transform"] == kind]
        if pts:
            ax.plot(*zip(*pts), marker="x", linestyle=":", label=f"kvwire ({kind} transform)")
    ax.set_xlabel("bits per element (side info included)")
    ax.set_ylabel("distortion (MSE / variance)")
    ax.set_yscale("log")
    ax.set_title(f"rate-distortion, {report.config['workload']} KV")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


class LevelNotInProfile(ValueError):
    """--stages --level names a level the measured profile does not have."""


def main(workload: str = "minilm", tokens: int = 6144, calibration_tokens: int = 8192,
         chunk_tokens: int = 1536, repeat: int = 3, as_json: bool = False,
         plot_path: str | None = "codec_rd.png", variants: bool = True, stages_only: bool = False,
         predict: int | None = None, predict_maps: str | None = None, level: int | None = None
         ) -> Report | StageReport:
    if workload == "minilm":
        wl = minilm_workload(tokens, calibration_tokens)
    elif workload == "smollm2":
        wl = smollm2_workload(tokens, calibration_tokens)
    else:
        wl = synthetic_workload(workload, tokens)
    if stages_only:
        profile = wl.profile or calibrate([wl.calibration])
        if predict is not None:
            profile = _twin(wl, profile, predict, _maps(predict, predict_maps))
        level = profile.default_level if level is None else level
        if not 0 <= level < len(profile.levels):
            raise LevelNotInProfile(f"level {level} is not in the profile (levels 0-{len(profile.levels) - 1})")
        staged = measure_stages(profile, level, chunks_of(wl.measured, chunk_tokens), repeat)
        print(staged.to_json() if as_json else render_stages(staged))
        return staged
    report = run(wl, chunk_tokens, repeat, compare_variants=variants, predict=predict, predict_maps=predict_maps)
    print(report.to_json() if as_json else render(report))
    if plot_path:
        plot(report, Path(plot_path))
        if not as_json:
            print(f"\nrate-distortion plot written to {Path(plot_path).resolve()}")
    return report
