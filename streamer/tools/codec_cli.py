"""Codec subcommands: ``kvwire bench codec``."""
from __future__ import annotations

import argparse
import sys

from streamer.tools.calibrate import PREDICT_MAPS


def _bench(args: argparse.Namespace) -> int:
    from streamer.tools import bench_codec as bench

    if args.predict_maps is not None and not args.predict:
        print("kvwire bench codec: --predict-maps chooses the maps of --predict N (N > 0); give both",
              file=sys.stderr)
        return 2
    if args.level is not None and not args.stages:
        print("kvwire bench codec: --level chooses the level --stages measures; give both", file=sys.stderr)
        return 2

    try:
        bench.main(workload=args.workload, tokens=args.tokens, calibration_tokens=args.calibration_tokens,
                   chunk_tokens=args.chunk_tokens, repeat=args.repeat, as_json=args.json,
                   plot_path=None if args.no_plot else args.plot, variants=not args.quick, stages_only=args.stages,
                   predict=args.predict, predict_maps=args.predict_maps, level=args.level)
    except bench.LevelNotInProfile as exc:
        print(f"kvwire bench codec: {exc}", file=sys.stderr)
        return 2
    return 0


def register(subparsers: argparse._SubParsersAction, bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser(
        "codec", help="codec rate/distortion/speed vs raw fp16, int8, zstd and CacheGen-style",
        description="Measure every quality level and baseline on the same chunks of real "
                    "(MiniLM) or synthetic KV; print a table, write a rate-distortion PNG.")
    p.add_argument("--workload", choices=("minilm", "smollm2", "llama", "small"), default="minilm",
                   help="minilm: real KV from all-MiniLM-L6-v2 (default); smollm2: real KV of the causal "
                        "LM SmolLM2-135M (RoPE keys; the profile kvwire calibrate makes for it, each layer "
                        "predicted from the one before, without allocation); llama: synthetic "
                        "Llama-3-8B-shaped KV (32 layers, 8 heads, 128 dims); small: tiny synthetic")
    p.add_argument("--tokens", type=int, default=6144, help="tokens measured (default 6144)")
    p.add_argument("--calibration-tokens", type=int, default=8192,
                   help="tokens of other text the profile is fitted on (minilm, smollm2; default 8192)")
    p.add_argument("--chunk-tokens", type=int, default=1536, help="tokens per encoded chunk (default 1536)")
    p.add_argument("--repeat", type=int, default=3, help="timing repetitions, best kept (default 3)")
    p.add_argument("--quick", action="store_true", help="skip the transform and delta comparisons")
    p.add_argument("--stages", action="store_true",
                   help="only the CPU decode at the profile's default level, stage by stage (entropy "
                        "decode, inverse transform, RoPE, conversion, CRC, the rest), each against its bound "
                        "on this CPU; with --predict N, of the profile calibrated again so")
    p.add_argument("--level", type=int, default=None,
                   help="with --stages: the level measured (default: the profile's default level)")
    p.add_argument("--predict", type=int, default=None, metavar="N",
                   help="also measure every level of the profile calibrated again with inter-layer "
                        "prediction every N layers (blob format 7: layers 0, N, 2N, .. coded alone; rows "
                        "kvwire-predicted/N/MAPS) or, with 0, without it (rows kvwire-plain): bits, distortion, "
                        "encode and decode speed beside the profile's own rows")
    p.add_argument("--predict-maps", choices=PREDICT_MAPS, default=None,
                   help="with --predict N: the maps calibrated (kvwire calibrate --predict-maps; default "
                        "low-rank)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", default="codec_rd.png", help="rate-distortion PNG path (default codec_rd.png)")
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    p.set_defaults(handler=_bench)
