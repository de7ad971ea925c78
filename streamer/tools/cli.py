"""The ``kvwire`` command line.

Each package owns its subcommands in a ``cli`` module exposing ``register(subparsers)``;
this file only wires them together, so a package's CLI lives next to the code it drives
and importing one subcommand never drags in the dependencies of another.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# Modules that contribute subcommands, in help order. Each has register(subparsers).
_COMMAND_MODULES = ("streamer.tools.demo", "streamer.tools.codec_cli",
                    "streamer.tools.put", "streamer.tools.serve_fetch", "streamer.tools.receive",
                    "streamer.tools.serve_openai",
                    "streamer.tools.calibrate", "streamer.tools.bench_stream", "streamer.tools.bench_load",
                    "streamer.tools.bench_policies", "streamer.tools.bench_serve", "streamer.tools.netsim_cli", "streamer.tools.fuzz",
                    "streamer.tools.bench_report")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvwire",
        description="Move LLM KV caches over the network faster than recomputing them.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    bench = subparsers.add_parser("bench", help="benchmarks (codec, ...)")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name in _COMMAND_MODULES:
        module = importlib.import_module(name)
        module.register(subparsers, bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
