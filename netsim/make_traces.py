"""Regenerate the committed trace set ``netsim/traces/`` and its README table.

Run ``python -m netsim.make_traces`` after changing a recipe; seeds are fixed, so an
unchanged recipe rewrites identical files (``--check`` verifies that without writing,
which CI can use to catch hand-edited traces).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

from netsim import generators as g
from netsim.trace import Trace

TRACE_DIR = Path(__file__).with_name("traces")

# name -> recipe. The name's prefix (before the first '-') is the trace's kind.
RECIPES: dict[str, Callable[[], Trace]] = {
    "constant-100m": lambda: g.constant(100, 10, step=0.5),
    "constant-1g": lambda: g.constant(1000, 10, step=0.5),
    "constant-10g": lambda: g.constant(10000, 10, step=0.5),
    "steps-1g-drop": lambda: g.steps([1000, 200, 1000], hold=5, step=0.1),
    "steps-5g-staircase": lambda: g.steps([5000, 2500, 1000, 500, 1000, 2500, 5000], hold=3, step=0.2),
    "steps-10g-cliff": lambda: g.steps([10000, 100, 10000, 1000], hold=4, step=0.1),
    "steps-500m-flap": lambda: g.steps([500, 150] * 6, hold=1.5, step=0.1),
    "onoff-1g": lambda: g.on_off(1000, 0, 20, mean_on=3, mean_off=0.5, step=0.1, seed=11),
    "onoff-2g-deep": lambda: g.on_off(2000, 100, 20, mean_on=2, mean_off=1, step=0.1, seed=12),
    "onoff-10g": lambda: g.on_off(10000, 500, 15, mean_on=2.5, mean_off=0.4, step=0.1, seed=13),
    "onoff-300m-bursty": lambda: g.on_off(300, 100, 12, mean_on=0.6, mean_off=0.4, step=0.1, seed=14),
    "walk-200m": lambda: g.random_walk(200, 100, 400, 20, volatility=0.4, step=0.2, seed=21),
    "walk-1g": lambda: g.random_walk(1000, 300, 2000, 25, volatility=0.5, step=0.2, seed=22),
    "walk-5g": lambda: g.random_walk(5000, 1000, 10000, 20, volatility=0.6, step=0.25, seed=23),
    "walk-800m-calm": lambda: g.random_walk(800, 500, 1200, 30, volatility=0.15, step=0.5, seed=24),
    "markov-wifi-600m": lambda: g.markov([600, 300, 120], 20, mean_dwell=2.0, noise=0.1, step=0.1, seed=31),
    "markov-dc-10g": lambda: g.markov([10000, 6000, 2000], 15, mean_dwell=1.5, noise=0.03, step=0.1, seed=32),
    "markov-wan-1g": lambda: g.markov([1000, 500, 200, 100], 25, mean_dwell=2.5, noise=0.08, step=0.25, seed=33),
    "markov-5g-cell": lambda: g.markov([3000, 1200, 400, 150], 20, mean_dwell=1.0, noise=0.15, step=0.1, seed=34),
    "markov-2g-shared": lambda: g.markov([2000, 1000], 20, mean_dwell=0.8, noise=0.05, step=0.2, seed=35),
}


def kind_of(name: str) -> str:
    return name.split("-", 1)[0]


def build() -> dict[str, Trace]:
    traces = {}
    for name, recipe in RECIPES.items():
        trace = recipe()
        trace.name = name
        traces[name] = trace
    return traces


def readme(traces: dict[str, Trace]) -> str:
    rows = [
        "# Link-capacity traces",
        "",
        "Synthetic traces at KV-transfer scale, written by `python -m netsim.make_traces`",
        "(fixed seeds: re-running reproduces these files exactly). Each CSV has two columns,",
        "`seconds, mbit_per_s`; each rate holds until the next sample and the last rate holds",
        "after the end. Load them with `netsim.trace_set()` or `netsim.Trace.load(path)`.",
        "Statistics are time-weighted; rates in Mbit/s.",
        "",
        "| trace | kind | duration s | step s | mean | min | p10 | max |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, t in traces.items():
        step = float(t.times[1] - t.times[0])
        rows.append(f"| {name} | {kind_of(name)} | {t.duration:g} | {step:g} | {t.mean:.0f} | "
                    f"{t.low:.0f} | {t.percentile(10):.0f} | {t.high:.0f} |")
    return "\n".join(rows) + "\n"


def rendered(traces: dict[str, Trace]) -> dict[Path, str]:
    """Every file the set consists of, with its exact text."""
    files: dict[Path, str] = {}
    for name, trace in traces.items():
        files[TRACE_DIR / f"{name}.csv"] = trace.to_csv()
    files[TRACE_DIR / "README.md"] = readme(traces)
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed files differ")
    args = parser.parse_args(argv)
    TRACE_DIR.mkdir(exist_ok=True)
    files = rendered(build())
    if args.check:
        stale = [str(p) for p, text in files.items() if not p.exists() or p.read_text() != text]
        for p in stale:
            print(f"stale: {p}", file=sys.stderr)
        return 1 if stale else 0
    for path, text in files.items():
        path.write_text(text)
    print(f"wrote {len(files)} files to {TRACE_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
