#!/usr/bin/env python3
"""The demo's fetch with its decode prior scaled: does a prior far off still meet the SLO?

    python scripts/demo-priors.py [--scales 1 10 0.1] [--runs 2]

Runs ``kvwire demo --model minilm`` (its 200 -> 25 -> 200 Mbit/s trace, 1 s SLO) in this process,
the model loaded once, with the decode prior it measures before the fetch multiplied by
each scale, and prints one line per run: scale, total seconds, SLO met, levels. A check to
run by hand on a machine, not a unit test: its figures are timings.
"""
from __future__ import annotations

import argparse
import json

from streamer.adapt import decoding
from streamer.model import hf
from streamer.tools import cli, demo_common, demo_minilm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scales", type=float, nargs="+", default=[1.0, 10.0, 0.1])
    parser.add_argument("--runs", type=int, default=2)
    options = parser.parse_args()
    loaded = hf.load_model(None)
    measure = demo_common.measure_decode
    rows = []
    for scale in options.scales:
        def scaled(args, *rest, scale=scale):
            blob = measure(args, *rest)
            prior = args.decode_prior
            args.decode_prior = decoding.DecodeCost(prior.seconds_per_token * scale, prior.bytes_per_token)
            return blob
        demo_common.measure_decode = scaled
        for _ in range(options.runs):
            args = cli.build_parser().parse_args(["demo", "--model", "minilm", "--json"])
            result = demo_minilm.run(args, loaded)
            rows.append({"scale": scale, "total_seconds": result["total_seconds"],
                         "deadline_met": result["deadline_met"], "levels": result["levels"]})
            print(json.dumps(rows[-1]), flush=True)
    demo_common.measure_decode = measure


if __name__ == "__main__":
    main()
