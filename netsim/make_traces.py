"""Regenerate the committed trace sets and their README tables.

Two sets: ``netsim/traces/`` (``default``: the shapes the policies were developed on)
and ``netsim/traces_unseen/`` (``unseen``: Markov-modulated traces with heavy-tailed
dwells and deep fades, committed with their seeds before any policy was tuned against
them, to measure how the adaptation generalises; do not tune on it).

Run ``python -m netsim.make_traces`` after changing a recipe (``--set`` picks one set;
default both); seeds are fixed, so an unchanged recipe rewrites identical files
(``--check`` verifies that without writing, which CI can use to catch hand-edited
traces).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable

from netsim import generators as g
from netsim.trace import Trace

TRACE_DIR = Path(__file__).with_name("traces")
UNSEEN_DIR = Path(__file__).with_name("traces_unseen")

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


#: The unseen set: ``generators.markov_modulated`` keyword arguments per trace (states
#: log-uniform over 50 Mbit/s - 10 Gbit/s, Pareto dwells, fades to 1-5% for 20-200 ms).
#: Fixed seeds, committed before tuning: changing a recipe makes it a different set.
UNSEEN_RECIPES: dict[str, dict[str, Any]] = {
    "mmf-01": dict(seconds=18, states=4, min_dwell=0.3, tail=1.5, noise=0.10, fade_rate=0.5, seed=1001),
    "mmf-02": dict(seconds=16, states=6, min_dwell=0.2, tail=1.3, noise=0.10, fade_rate=0.8, seed=1002),
    "mmf-03": dict(seconds=20, states=3, min_dwell=0.5, tail=1.8, noise=0.05, fade_rate=0.3, seed=1003),
    "mmf-04": dict(seconds=15, states=8, min_dwell=0.1, tail=1.2, noise=0.15, fade_rate=1.0, seed=1004),
    "mmf-05": dict(seconds=18, states=5, min_dwell=0.25, tail=1.5, noise=0.20, fade_rate=0.5, seed=1005),
    "mmf-06": dict(seconds=17, states=10, min_dwell=0.15, tail=1.4, noise=0.10, fade_rate=0.6, seed=1006),
    "mmf-07": dict(seconds=20, states=4, min_dwell=0.4, tail=1.2, noise=0.05, fade_rate=0.2, seed=1007),
    "mmf-08": dict(seconds=16, states=6, min_dwell=0.2, tail=2.0, noise=0.10, fade_rate=1.2, seed=1008),
    "mmf-09": dict(seconds=19, states=5, min_dwell=0.3, tail=1.6, noise=0.15, fade_rate=0.4, seed=1009),
    "mmf-10": dict(seconds=15, states=3, min_dwell=0.2, tail=1.3, noise=0.10, fade_rate=0.7, seed=1010),
    "mmf-11": dict(seconds=18, states=7, min_dwell=0.5, tail=1.5, noise=0.05, fade_rate=0.5, seed=1011),
    "mmf-12": dict(seconds=20, states=8, min_dwell=0.25, tail=1.8, noise=0.20, fade_rate=0.3, seed=1012),
    "mmf-13": dict(seconds=17, states=4, min_dwell=0.1, tail=1.4, noise=0.10, fade_rate=0.9, seed=1013),
    "mmf-14": dict(seconds=16, states=6, min_dwell=0.4, tail=1.3, noise=0.15, fade_rate=0.6, seed=1014),
    "mmf-15": dict(seconds=19, states=5, min_dwell=0.15, tail=2.0, noise=0.05, fade_rate=0.4, seed=1015),
    "mmf-16": dict(seconds=18, states=9, min_dwell=0.3, tail=1.6, noise=0.10, fade_rate=0.8, seed=1016),
}


def kind_of(name: str) -> str:
    return name.split("-", 1)[0]


@dataclass(frozen=True)
class TraceSet:
    """One committed set: where it lives, how each trace is made, its README."""

    name: str
    directory: Path
    recipes: dict[str, Callable[[], Trace]]
    readme: Callable[[dict[str, Trace]], str]


def _unseen_recipe(kwargs: dict[str, Any]) -> Callable[[], Trace]:
    return lambda: g.markov_modulated(**kwargs)


def build(recipes: dict[str, Callable[[], Trace]] | None = None) -> dict[str, Trace]:
    traces = {}
    for name, recipe in (RECIPES if recipes is None else recipes).items():
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


def unseen_readme(traces: dict[str, Trace]) -> str:
    rows = [
        "# Unseen link-capacity traces",
        "",
        "A second, held-out set, written by `python -m netsim.make_traces --set unseen`",
        "(fixed seeds: re-running reproduces these files exactly) and committed before any",
        "policy was tuned against it: measure on it, do not tune on it. Each trace is",
        "`netsim.generators.markov_modulated`: capacity states drawn log-uniformly over",
        "50 Mbit/s - 10 Gbit/s, Pareto (heavy-tailed) dwell times with minimum `dwell`",
        "seconds and tail index `tail`, a random transition matrix, lognormal jitter",
        "(`noise`, per 0.1 s) within a state, and short deep fades (a Poisson process of",
        "`fades/s`; each lasts 20-200 ms at 1-5% of the current rate). Samples are the",
        "change points at 1 ms resolution (not a uniform grid). Same CSV format as",
        "`netsim/traces/`; load them with `netsim.trace_set(\"unseen\")`.",
        "Statistics are time-weighted; rates in Mbit/s.",
        "",
        "| trace | seed | states | dwell s | tail | noise | fades/s | duration s | samples | fades "
        "| mean | min | p10 | max |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, t in traces.items():
        kw = UNSEEN_RECIPES[name]
        parts = g.markov_modulated_parts(**kw)
        rows.append(f"| {name} | {kw['seed']} | {kw['states']} | {kw['min_dwell']:g} | {kw['tail']:g} | "
                    f"{kw['noise']:g} | {kw['fade_rate']:g} | {t.duration:g} | {len(t)} | "
                    f"{len(parts.fades)} | {t.mean:.0f} | {t.low:.1f} | {t.percentile(10):.0f} | "
                    f"{t.high:.0f} |")
    return "\n".join(rows) + "\n"


SETS: dict[str, TraceSet] = {
    "default": TraceSet("default", TRACE_DIR, RECIPES, readme),
    "unseen": TraceSet("unseen", UNSEEN_DIR,
                       {name: _unseen_recipe(kw) for name, kw in UNSEEN_RECIPES.items()}, unseen_readme),
}


def rendered(traces: dict[str, Trace], trace_set: str = "default") -> dict[Path, str]:
    """Every file the set consists of, with its exact text."""
    ts = SETS[trace_set]
    files: dict[Path, str] = {}
    for name, trace in traces.items():
        files[ts.directory / f"{name}.csv"] = trace.to_csv()
    files[ts.directory / "README.md"] = ts.readme(traces)
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed files differ")
    parser.add_argument("--set", choices=(*SETS, "all"), default="all",
                        help="which trace set (default: all)")
    args = parser.parse_args(argv)
    names = list(SETS) if args.set == "all" else [args.set]
    stale: list[str] = []
    for name in names:
        ts = SETS[name]
        files = rendered(build(ts.recipes), name)
        if args.check:
            stale += [str(p) for p, text in files.items() if not p.exists() or p.read_text() != text]
            continue
        ts.directory.mkdir(exist_ok=True)
        for path, text in files.items():
            path.write_text(text)
        print(f"wrote {len(files)} files to {ts.directory}")
    for p in stale:
        print(f"stale: {p}", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
