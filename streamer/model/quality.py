"""What each quality level does to the model, not just to the KV (``kvwire bench quality``).

For every codec level (and the raw fp16 / int8 baselines) on real text the model
has not been calibrated on:

* **distortion**: sum((x_hat - x)^2) / sum((x - mean)^2) over the measured KV
  (as in ``kvwire bench codec``), and bits per element (blob bytes, header and
  attention-sink tokens included; the profile is shared per model and left out);
* **attention-output relative error per layer**, with the model's own queries:
  ``softmax(Q K^T * scale) V`` per head (causal for decoders, grouped-query heads
  repeated) with the original vs the decoded K/V, error ||A_hat - A||_F / ||A||_F
  pooled over the measured windows. Each layer's queries are the ones the model
  computed with the original cache, so the figure isolates that layer's KV error
  (it does not compound the error of earlier layers into the queries);
* **end-task proxy**: for an encoder (MiniLM) the cosine between the sentence
  embedding computed over the original and over the decoded K/V (the error does
  compound through the layers here); for a decoder (a causal LM given by path)
  the perplexity of a continuation run after the decoded context KV vs after the
  original one, and the top-1 agreement of their next-token predictions.

The profile is calibrated on ``hf.CALIBRATION_TEXTS``; windows of texts of more than one
kind that ship with the OS or Python (``MEASURE_SOURCES``: the GPL-3 text, legal prose;
Python's language reference, technical docs) are measured, each window named by its text,
and every row reports the spread of its perplexity change and top-1 agreement across
windows as well as the pooled figure (a change of a fraction of a percent is within the
noise of one short window). Besides fp16 and int8, a CacheGen-style baseline
(``codec.baselines.cachegen``) is measured at its entropy-coded size. The table and plot
are in ``streamer.tools.bench_quality``.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

import codec
from codec import allocation as allocation_
from codec import baselines

from streamer.model import ablation as ablation_
from streamer.model import hf, sensitivity


@dataclass
class QualityRow:
    method: str                      # "kvwire", "fp16", "int8"
    level: int | None
    bits_per_element: float
    distortion: float
    attention_error: list[float]     # per layer: ||A_hat - A||_F / ||A||_F
    attention_error_mean: float
    cosine: float | None = None      # encoders: sentence-embedding cosine (mean over windows)
    cosine_min: float | None = None
    perplexity: float | None = None  # decoders: continuation perplexity after the decoded KV
    perplexity_change: float | None = None   # relative to the original KV's perplexity
    top1_agreement: float | None = None      # next-token argmax equal to the original KV's
    rotary: bool | None = None       # kvwire: whether the profile removes RoPE from the keys
    allocation: bool | None = None   # kvwire: whether the profile weights its sections' targets
    predicted: bool | None = None    # kvwire: whether the profile predicts layers from the ones before
    default: bool | None = None      # kvwire: whether the level is its profile's default level
    target_distortion: float | None = None   # kvwire: the level's MSE/var target
    #: kvwire: the ablation (``streamer.model.ablation``) this row measures, None for the plain level
    ablation: str | None = None
    #: per measured window: its text, and (decoders) its perplexity change and top-1 agreement
    windows: list[dict] = field(default_factory=list)


@dataclass
class QualityReport:
    config: dict
    levels: list[dict]               # the profile's levels: target distortion, estimated bits
    reference: dict                  # decoders: perplexity with the original KV
    rows: list[QualityRow] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


# ------------------------------------------------------------------------ calibration
def calibration_samples(model, tokenizer, token_ids: Sequence[int], *,
                        window: int | None = None) -> list[torch.Tensor]:
    """Real KV to calibrate on: one sample for an encoder (``capture_kv``'s windows),
    independent contexts of ``window`` tokens for a decoder (each with its own start)."""
    ids = list(token_ids)
    if not ids:
        raise ValueError("no calibration tokens")
    if not hf.is_decoder(model):
        return [hf.capture_kv(model, tokenizer, ids, window=window)]
    window = window or default_decoder_window(model)
    return [hf.capture_kv(model, tokenizer, piece) for piece in hf.windows(ids, window)
            if len(piece) > 16]


def default_decoder_window(model) -> int:
    return min(getattr(model.config, "max_position_embeddings", None) or 2048, 2048)


#: ``rotary`` choices: the default (ROTARY_DEFAULT), always, never, or both side by side.
ROTARY_MODES = ("auto", "on", "off", "both")
#: Whether profiles remove RoPE by default (models without it are unaffected). On: on
#: SmolLM2 it saves 0.19-0.24 bits/element at every level while lowering MSE/var, ~0.5
#: bits/element at equal MSE/var (``kvwire bench quality --model smollm2 --rotary both``;
#: README, "RoPE-aware keys").
ROTARY_DEFAULT = True


def model_rotary(model, rotary: bool | None = None) -> codec.Rotary | None:
    """The Rotary a profile of ``model`` carries: ``rotary_of(model)`` when ``rotary``
    (None: ROTARY_DEFAULT) is on, else None. ValueError when on and the model has none."""
    on = ROTARY_DEFAULT if rotary is None else rotary
    if not on:
        return None
    found = hf.rotary_of(model)
    if found is None and rotary:
        raise ValueError("the model has no RoPE the codec removes (rotary_of(model) is None)")
    return found


#: ``allocation`` choices, as ROTARY_MODES.
ALLOCATION_MODES = ("auto", "on", "off", "both")
#: Whether ``kvwire calibrate`` and ``bench quality`` weight each (layer, K/V)'s target by
#: the model's measured sensitivity to it (codec.allocation) by default. On: with the
#: weights fitted to the uniform split's bits, a decoder (SmolLM2) keeps more top-1
#: agreement and less perplexity change at the coarse levels for about the same bits, and
#: an encoder (MiniLM: its embedding's sensitivity) takes fewer bits at a higher cosine
#: (``kvwire bench quality --allocation both`` compares the two; README). It costs a few
#: forward and backward passes at calibration.
ALLOCATION_DEFAULT = True


def model_weights(model, tokenizer, token_ids: Sequence[int], allocation: bool | None = None
                  ) -> np.ndarray | None:
    """The per-section target weights a profile of ``model`` carries: sensitivities
    measured on ``token_ids`` (``sensitivity.kv_sensitivity``) allocated by
    ``codec.allocation.allocate`` when ``allocation`` (None: ALLOCATION_DEFAULT) is on,
    else None."""
    on = ALLOCATION_DEFAULT if allocation is None else allocation
    if not on:
        return None
    measured = sensitivity.kv_sensitivity(model, tokenizer, token_ids)
    # a section measured as insensitive (a zero estimate) gets the clamp's largest weight
    floor = float(measured[measured > 0].min()) if np.any(measured > 0) else 1.0
    return allocation_.allocate(np.maximum(measured, floor))


#: Whether a causal LM's profile predicts each layer from the one before by default
#: (``codec.prediction``, blob format 7) with PREDICT_MAPS_DEFAULT maps, only layer 0 coded
#: alone (so a chunk the fetch continues at another level travels again from layer 0,
#: ``Manifest.resume_layer``, a cost the fetch's plan prices). On: on
#: SmolLM2 at the same MSE/var it takes 9% of the bits out of level 3 (2.69 to 2.45
#: bits/el: ``kvwire bench quality --model smollm2 --levels 3 --predict both``), for a CPU
#: decode about 0.8x the plain level's rate (``kvwire bench codec --workload smollm2
#: --predict 0``). Encoders: off (not measured on one).
PREDICT_DEFAULT = True
#: ``codec.PREDICT_GROUPS``: the maps a predicting calibration fits unless told: K from K
#: and V from V through rank-48 factors, half a full map by kind's decode work for about
#: 60% of its gain (``kvwire bench codec --workload smollm2 --predict 30 --predict-maps
#: kind``; README, "Concepts")
PREDICT_MAPS_DEFAULT = "low-rank"
#: ``predict`` choices of ``bench quality``, as ROTARY_MODES.
PREDICT_MODES = ("auto", "on", "off", "both")
#: The default level (``Profile.default_level``) of a causal LM's profile on the codec's
#: ladder: the coarsest level within 0.5% perplexity and 0.98 top-1 agreement of the exact
#: KV on held-out text of every kind measured (SmolLM2, ``kvwire bench quality --model
#: smollm2``), one level coarser than the codec's ``DEFAULT_LEVEL``, which an encoder's
#: embedding needs.
DECODER_DEFAULT_LEVEL = 3


def model_prediction(model, predict: int | None = 0, maps: str | None = None) -> dict:
    """``codec.calibrate``'s prediction arguments for a profile of ``model``: ``predict``
    layers per restart (0: no prediction; None: PREDICT_DEFAULT's choice, for a causal
    LM every layer predicted but the first) with ``maps`` (None: PREDICT_MAPS_DEFAULT)."""
    if predict is None:
        predict = hf.kv_shape(model)[0] if PREDICT_DEFAULT and hf.is_decoder(model) else 0
    if not predict:
        return {}
    return {"predict": predict, "predict_groups": maps or PREDICT_MAPS_DEFAULT}


def model_default_level(model, targets: Sequence[float] = codec.DEFAULT_TARGETS) -> int | None:
    """The default level of a profile of ``model`` with ``targets``: DECODER_DEFAULT_LEVEL
    for a causal LM on the codec's ladder (where it was measured), else None (the codec's)."""
    return DECODER_DEFAULT_LEVEL if hf.is_decoder(model) and tuple(targets) == codec.DEFAULT_TARGETS else None


def calibrate_profile(model, tokenizer, token_ids: Sequence[int], *, window: int | None = None,
                      rotary: bool | None = None, allocation: bool | None = False,
                      predict: int | None = 0, predict_maps: str | None = None,
                      **calibrate_kwargs) -> codec.Profile:
    """A profile fitted on the model's KV of ``token_ids``, with ``model_default_level``
    unless ``calibrate_kwargs`` names one; ``rotary`` as in model_rotary, ``predict`` and
    ``predict_maps`` as in model_prediction, ``allocation`` as in model_weights, but
    prediction and allocation off unless asked for (None: the default choice, as ``kvwire
    calibrate`` asks): they cost model passes or encoder runs a caller on a time budget
    (the demo) may not have."""
    targets = calibrate_kwargs.get("targets", codec.DEFAULT_TARGETS)
    calibrate_kwargs.setdefault("default_level", model_default_level(model, targets))
    return codec.calibrate(calibration_samples(model, tokenizer, token_ids, window=window),
                           rotary=model_rotary(model, rotary),
                           weights=model_weights(model, tokenizer, token_ids, allocation),
                           **model_prediction(model, predict, predict_maps), **calibrate_kwargs)


def profile_levels(profile: codec.Profile) -> list[dict]:
    return [{"level": lv.index, "target_distortion": lv.target_distortion,
             "estimated_bits": lv.estimated_bits, "x_fp16": 16 / lv.estimated_bits if lv.estimated_bits else None}
            for lv in profile.levels]


# ------------------------------------------------------------------------ measuring
@dataclass
class _Window:
    ids: list[int]                    # the context whose KV is transmitted
    continuation: list[int]           # decoders: tokens scored after it
    kv: torch.Tensor
    attention: list[torch.Tensor]     # per layer, with the original K/V
    queries: torch.Tensor
    meta: list[dict]
    embedding: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    source: str = ""                  # the measured text it comes from
    reference_nll: float = 0.0        # decoders: the continuation's NLL after the original KV


class _Accumulator:
    def __init__(self, layers: int) -> None:
        self.bits = 0.0
        self.elements = 0
        self.err2 = 0.0
        self.var = 0.0
        self.att_err2 = [0.0] * layers
        self.att_ref2 = [0.0] * layers
        self.cosines: list[float] = []
        self.nll = 0.0
        self.scored = 0
        self.agree = 0
        self.predicted = 0
        self.windows: list[dict] = []

    def add(self, window: _Window, decoded: torch.Tensor, nbytes: int, model,
            section_targets: torch.Tensor | None = None) -> None:
        """Score one window's decoded KV; ``section_targets`` [layers, 2] is the MSE/var each
        (layer, K/V) section is held to (kvwire), for the window's implied target."""
        x, y = window.kv.double(), decoded.double()
        self.bits += 8.0 * nbytes
        self.elements += x.numel()
        section_var = ((x - x.mean(dim=2, keepdim=True)) ** 2).sum(dim=tuple(range(2, x.dim())))
        err2, var = float(((y - x) ** 2).sum()), float(section_var.sum())
        self.err2 += err2
        self.var += var
        for layer, reference in enumerate(window.attention):
            meta = window.meta[layer]
            out = hf.attention_output(window.queries[layer], decoded[layer, 0], decoded[layer, 1],
                                      scaling=meta["scaling"], causal=meta["causal"])
            self.att_err2[layer] += float(((out - reference) ** 2).sum())
            self.att_ref2[layer] += float((reference ** 2).sum())
        if window.embedding is not None:
            embedding = hf.sentence_embedding(model, window.ids, decoded)
            self.cosines.append(float(window.embedding @ embedding))
        per_window: dict = {"text": window.source, "distortion": err2 / var if var else 0.0}
        if section_targets is not None and var:
            # what the sections' targets add up to on this window, each weighed by its
            # variance: a profile whose weights give the loud sections the larger targets
            # holds its pooled MSE/var above the level's nominal target by design
            per_window["target_distortion"] = float((section_targets.double() * section_var).sum()) / var
        if window.logits is not None:
            logits = hf.continuation_logits(model, decoded, window.continuation)
            nll, count = continuation_nll(logits, window.continuation)
            agree = int((logits.argmax(-1) == window.logits.argmax(-1)).sum())
            self.nll += nll
            self.scored += count
            self.agree += agree
            self.predicted += logits.shape[0]
            if count:
                per_window["perplexity_change"] = math.exp((nll - window.reference_nll) / count) - 1.0
            per_window["top1_agreement"] = agree / logits.shape[0]
        self.windows.append(per_window)

    def row(self, method: str, level: int | None, reference_ppl: float | None) -> QualityRow:
        errors = [math.sqrt(e / r) if r > 0 else 0.0 for e, r in zip(self.att_err2, self.att_ref2)]
        row = QualityRow(method=method, level=level, bits_per_element=self.bits / self.elements,
                         distortion=self.err2 / self.var if self.var else 0.0,
                         attention_error=errors, attention_error_mean=sum(errors) / len(errors),
                         windows=self.windows)
        if self.cosines:
            row.cosine = sum(self.cosines) / len(self.cosines)
            row.cosine_min = min(self.cosines)
        if self.scored:
            row.perplexity = math.exp(self.nll / self.scored)
            if reference_ppl:
                row.perplexity_change = row.perplexity / reference_ppl - 1.0
            row.top1_agreement = self.agree / self.predicted
        return row


def continuation_nll(logits: torch.Tensor, continuation: Sequence[int]) -> tuple[float, int]:
    """Summed negative log-likelihood of continuation[1:] (logits[i] predicts token i + 1)."""
    if len(continuation) < 2:
        return 0.0, 0
    targets = torch.tensor(list(continuation[1:]))
    logp = torch.log_softmax(logits[:-1].double(), dim=-1)
    return float(-logp.gather(1, targets.unsqueeze(1)).sum()), len(targets)


def python_source() -> str:
    """``argparse.py`` from Python's standard library: source code, unlike every text calibrated on."""
    import argparse

    return Path(argparse.__file__).read_text(encoding="utf-8")


def python_reference() -> str:
    """Python's language reference as ``pydoc`` shows it (``pydoc_data.topics``, which ships
    with Python): technical documentation, unlike the license texts calibrated on."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


#: Measured texts by name: (kind, reader). All ship with Debian or with Python.
MEASURE_SOURCES: dict[str, tuple[str, Callable[[], str]]] = {
    "GPL-3": ("legal prose", lambda: hf.read_text([hf.MEASURE_TEXT])),
    "python-reference": ("technical docs", python_reference),
    "python-source": ("source code", python_source),
}
DEFAULT_TEXTS = ("GPL-3", "python-reference")
#: ``--ablation`` measures a third kind of text by default: source code
ABLATION_TEXTS = ("GPL-3", "python-reference", "python-source")


def measure_source(name: str) -> tuple[str, str]:
    """(kind, text) of a ``MEASURE_SOURCES`` name, or of a text file given by its path."""
    if name in MEASURE_SOURCES:
        kind, read = MEASURE_SOURCES[name]
        return kind, read()
    return "file", hf.read_text([Path(name)])


#: Decoders: by default each window is a 1024-token context and a continuation of which
#: 2048 tokens are scored (its first token's prediction belongs to the context, not run
#: again): short continuations leave perplexity changes of a fraction of a percent in the noise.
DECODER_CONTEXT_TOKENS = 1024
DECODER_CONTINUATION_TOKENS = 2049
ENCODER_WINDOW_TOKENS = 512


def measure_windows(token_ids: Sequence[int], count: int, size: int) -> list[list[int]]:
    """``count`` windows of ``size`` tokens spread evenly over the text, the first at its
    start and the last at its end (they overlap only where the text is too short)."""
    ids = list(token_ids)
    if len(ids) < size:
        raise ValueError(f"the measured text has {len(ids)} tokens, fewer than one window of {size}")
    last = len(ids) - size
    starts = sorted({round(i * last / (count - 1)) for i in range(count)}) if count > 1 else [0]
    return [ids[s:s + size] for s in starts]


def _prepare(model, tokenizer, window_ids: list[int], context_tokens: int | None, source: str) -> _Window:
    decoder = hf.is_decoder(model)
    if decoder:
        context_tokens = context_tokens or (len(window_ids) * 3) // 4
        ids, continuation = window_ids[:context_tokens], window_ids[context_tokens:]
    else:
        ids, continuation = window_ids, []
    kv = hf.capture_kv(model, tokenizer, ids)
    queries, meta = hf.queries(model, ids)
    attention = [hf.attention_output(queries[l], kv[l, 0], kv[l, 1], scaling=meta[l]["scaling"],
                                     causal=meta[l]["causal"]) for l in range(kv.shape[0])]
    window = _Window(ids, continuation, kv, attention, queries, meta, source=source)
    if decoder:
        if continuation:
            window.logits = hf.continuation_logits(model, kv, continuation)
            window.reference_nll = continuation_nll(window.logits, continuation)[0]
    else:
        window.embedding = hf.sentence_embedding(model, ids)
    return window


#: The baselines by method name (CacheGen's design at its default bins, costed at its entropy).
_BASELINES = {"fp16": baselines.raw_fp16, "int8": baselines.int8, "cachegen": baselines.cachegen}


def _described(row: QualityRow, profile: codec.Profile | None, level: int | None,
               ablation: str | None = None) -> QualityRow:
    """``row`` with what its profile does (RoPE removal, weights, prediction), its level's
    target, whether that level is the profile's default, and its ablation."""
    row.rotary = None if profile is None else profile.rotary is not None
    row.allocation = None if profile is None else profile.weights is not None
    row.predicted = None if profile is None else profile.predicts
    if profile is not None and level is not None:
        row.target_distortion = profile.targets[level]
        row.default = level == profile.default_level
    row.ablation = ablation
    return row


def run(model, tokenizer, *, profile: codec.Profile | None = None, calibration_tokens: int = 8192,
        windows: int = 6, window_tokens: int | None = None, context_tokens: int | None = None,
        levels: Sequence[int] | None = None, baselines_too: bool = True,
        calibration_text: Sequence[Path] = hf.CALIBRATION_TEXTS,
        texts: Sequence[str] | None = None, model_name: str = "",
        rotary: str = "auto", allocation: str = "auto", predict: str = "auto",
        ablations: Sequence[str] = ()) -> QualityReport:
    """Measure every level of ``profile`` (calibrated here when None) on ``windows`` windows
    of each of ``texts`` (``MEASURE_SOURCES`` names or text files; default DEFAULT_TEXTS).

    ``window_tokens`` defaults to 512 for an encoder; for a decoder to ``context_tokens``
    (default 1024) plus a 2048-token scored continuation. ``rotary`` (when calibrating):
    "auto" follows ROTARY_DEFAULT, "on"/"off" force RoPE removal from the keys, "both"
    measures a profile of each kind side by side. ``allocation`` likewise for per-section
    target weights (ALLOCATION_DEFAULT; with "both", each rotary choice with and without),
    and ``predict`` for inter-layer prediction (``model_prediction``: "auto" its default
    choice, "on" every layer but the first predicted; with "both", each of the others
    without and with). A calibrated profile's default level is ``model_default_level``.
    ``ablations`` (``streamer.model.ablation.ABLATIONS`` names) adds after each kvwire row
    one row per ablation of that level; their default texts are ABLATION_TEXTS.
    """
    if rotary not in ROTARY_MODES:
        raise ValueError(f"rotary must be one of {ROTARY_MODES}, got {rotary!r}")
    if allocation not in ALLOCATION_MODES:
        raise ValueError(f"allocation must be one of {ALLOCATION_MODES}, got {allocation!r}")
    if predict not in PREDICT_MODES:
        raise ValueError(f"predict must be one of {PREDICT_MODES}, got {predict!r}")
    decoder = hf.is_decoder(model)
    started = time.perf_counter()
    calibration_seconds = 0.0
    chosen = ablation_.resolve(ablations) if ablations else []
    samples: list[torch.Tensor] = []
    if profile is None or any(a.needs_calibration for a in chosen):
        cal_ids = hf.tokenize(tokenizer, hf.read_text(calibration_text))[:calibration_tokens]
        samples = calibration_samples(model, tokenizer, cal_ids)
    if profile is None:
        choices = {"auto": (None,), "on": (True,), "off": (False,), "both": (False, True)}
        weights = [model_weights(model, tokenizer, cal_ids, on) for on in choices[allocation]]
        every_layer = hf.kv_shape(model)[0]
        predicting = [model_prediction(model, {None: None, True: every_layer, False: 0}[on])
                      for on in choices[predict]]
        profiles = [codec.calibrate(samples, rotary=model_rotary(model, on), weights=w, **p,
                                    default_level=model_default_level(model))
                    for on in choices[rotary] for w in weights for p in predicting]
        calibration_seconds = time.perf_counter() - started
    else:
        profiles = [profile]
    profile = profiles[0]
    if decoder and window_tokens is None:
        context_tokens = context_tokens or DECODER_CONTEXT_TOKENS
        window_tokens = context_tokens + DECODER_CONTINUATION_TOKENS
    window_tokens = window_tokens or ENCODER_WINDOW_TOKENS
    sources = {name: measure_source(name) for name in (texts or (ABLATION_TEXTS if chosen else DEFAULT_TEXTS))}
    prepared = [_prepare(model, tokenizer, w, context_tokens, name)
                for name, (_, text) in sources.items()
                for w in measure_windows(hf.tokenize(tokenizer, text), windows, window_tokens)]
    layers = prepared[0].kv.shape[0]
    reference_ppl = None
    reference: dict = {}
    if decoder:
        nll = scored = 0
        for w in prepared:
            if w.logits is not None:
                a, b = continuation_nll(w.logits, w.continuation)
                nll, scored = nll + a, scored + b
        reference_ppl = math.exp(nll / scored) if scored else None
        reference = {"perplexity": reference_ppl, "scored_tokens": scored}
    report = QualityReport(
        config={"model": model_name or type(model).__name__, "kind": "decoder" if decoder else "encoder",
                "kv_shape": list(prepared[0].kv.shape[:1]) + list(prepared[0].kv.shape[3:]),
                "profile_id": profile.id, "calibration_tokens": calibration_tokens,
                "calibration_seconds": round(calibration_seconds, 2), "windows": len(prepared),
                "window_tokens": window_tokens,
                "context_tokens": len(prepared[0].ids) if decoder else None,
                "profile_ids": [p.id for p in profiles], "rotary": rotary, "allocation": allocation,
                "predict": predict, "default_levels": [p.default_level for p in profiles],
                "weights": [None if p.weights is None else p.weights.tolist() for p in profiles],
                "calibration_text": [str(p) for p in calibration_text],
                "texts": [{"name": name, "kind": kind, "windows": sum(w.source == name for w in prepared)}
                          for name, (kind, _) in sources.items()],
                "scored_tokens_per_window": len(prepared[0].continuation) - 1 if decoder else None,
                "ablations": {a.name: {"kind": a.kind, "description": a.description} for a in chosen}},
        levels=profile_levels(profile), reference=reference)
    methods: list[tuple[str, int | None, codec.Profile | None]] = []
    if baselines_too:
        methods += [("fp16", None, None), ("int8", None, None), ("cachegen", None, None)]
    methods += [("kvwire", lv, p) for p in profiles
                for lv in (range(len(p.targets)) if levels is None else levels)]
    appliers: dict[tuple[str, str], ablation_.Fitted] = {}   # fitted once per profile
    for method, level, prof in methods:
        acc = _Accumulator(layers)
        targets = None if prof is None or level is None else torch.tensor(prof.targets_by_section(level))
        plain: list[ablation_.Window] = []
        for w in prepared:
            if method == "kvwire":
                blob = codec.encode(w.kv, level, prof)  # each window's context starts at position 0
                decoded, nbytes = codec.decode(blob, prof).float(), len(blob)
                plain.append(ablation_.Window(w.kv, w.queries, [m["scaling"] for m in w.meta], decoded, nbytes))
            else:
                encoded = _BASELINES[method](w.kv)
                decoded, nbytes = encoded.reconstruction, encoded.nbytes
            acc.add(w, decoded, nbytes, model, targets)
        report.rows.append(_described(acc.row(method, level, reference_ppl), prof, level))
        for chosen_one in (chosen if method == "kvwire" else ()):
            acc = _Accumulator(layers)
            key = (chosen_one.name, prof.id)
            if key not in appliers:
                appliers[key] = chosen_one.applier(samples, prof)
                if appliers[key].facts:
                    report.config["ablations"][chosen_one.name].setdefault("fitted", {})[prof.id] = appliers[key].facts
            for w, base in zip(prepared, plain):
                decoded, nbytes = appliers[key].apply(base, prof, level)
                acc.add(w, decoded, nbytes, model, targets)
            report.rows.append(_described(acc.row(method, level, reference_ppl), prof, level, chosen_one.name))
    report.config["seconds"] = round(time.perf_counter() - started, 2)
    return report
