"""``kvwire bench report``: the shipped benchmarks in their quick modes, as docs/MEASURED.md.

Each benchmark runs as its own ``kvwire`` command in a subprocess (``python -m
streamer.tools.cli``, in a temporary working directory) with ``--json``; its output is
rendered as compact Markdown tables under the exact command that made it, with its wall
time and what it says about cold or warm code. A benchmark that fails, runs past its
timeout, prints something that is not JSON or JSON of another shape becomes a section
saying so, with the end of its output, and the report goes on.

After the measured sections come the runs too big for this command (a Redis cluster, a
GPU, hours of CPU), read from ``docs/full-scale.json``, which a person updates when they
rerun one: each with its command, date, commit, machine and figures. Last comes what is
modelled rather than measured, labelled with its assumptions.

``--save FILE`` keeps the header and every benchmark's output as JSON; ``--load FILE``
renders such a file again without running anything (the header stays the run's).
"""
from __future__ import annotations

import argparse
import datetime
import functools
import importlib.metadata
import json
import math
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "docs" / "MEASURED.md"
FULL_SCALE = ROOT / "docs" / "full-scale.json"
#: Where a temporary directory stands in a section's command (the demo's output directory).
TMP = "{tmp}"


# ------------------------------------------------------------------------ formatting
def fmt(value: Any, spec: str = "") -> str:
    """One table cell: ``-`` for None, yes/no for booleans, ``spec`` for numbers."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)) and spec:
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        return format(value, spec)
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(fmt(v) for v in value)
    return str(value)


def pct(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{100 * value:.{digits}f}%"


def table(columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A Markdown table; cells already strings are kept, others go through :func:`fmt`."""
    def cell(value: Any) -> str:
        text = value if isinstance(value, str) else fmt(value)
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(map(cell, columns)) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(map(cell, row)) + " |" for row in rows]
    return lines


#: Beyond this many targets only the missed ones are listed, the rest folded away.
MAX_TARGET_LINES = 10


def targets_lines(targets: Sequence[Mapping[str, Any]]) -> list[str]:
    """A benchmark's own targets, each met or MISSED with what it measured."""
    if not targets:
        return []
    met = sum(bool(t.get("met")) for t in targets)
    lines = [f"Targets the benchmark checks: {met} of {len(targets)} met."]
    items = [f"- {'met' if t.get('met') else '**MISSED**'}: {t.get('target')}: "
             f"measured {_measured(t.get('measured'))}" for t in targets]
    if len(targets) <= MAX_TARGET_LINES:
        return lines + items
    missed = [item for item, t in zip(items, targets) if not t.get("met")]
    return lines + missed + ["", "<details><summary>Every target</summary>", ""] + items + ["", "</details>"]


def _measured(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {_measured(v)}" for k, v in value.items())
    if isinstance(value, float):   # enough digits to see which side of a threshold it is on
        return f"{value:.5g}"
    return fmt(value)


# --------------------------------------------------------------------- the sections
def render_codec(data: Mapping[str, Any]) -> list[str]:
    from codec.levels import DEFAULT_LEVEL

    c = data["config"]
    rows = data["rows"]
    cachegen = [r for r in rows if r["method"].startswith("cachegen")]
    lines = [f"{c['workload']} KV, shape {'x'.join(map(str, c['shape']))} (layers, K/V, tokens, heads, "
             f"head dim), {c['chunks']} chunks of {c['chunk_tokens']} tokens; profile "
             f"{data['profile_bytes'] / 1e6:.2f} MB, calibrated on {c['calibration_tokens']} tokens of other "
             f"text in {c['calibration_seconds']} s; {c['threads']} torch threads.", ""]
    body = []
    for r in rows:
        if r["method"].startswith("cachegen"):
            continue
        level = r["level"]
        default = r["method"] == "kvwire" and level == c.get("default_level", DEFAULT_LEVEL)
        name = r["method"] if level is None else f"{r['method']} L{level}" + (" (default)" if default else "")
        overhead = None if r.get("coder_overhead") is None else 100 * r["coder_overhead"]
        body.append([name, fmt(r["bits_per_element"], ".3f"), fmt(r["ratio_fp16"], ".2f"),
                     fmt(r.get("ratio_cachegen"), ".2f"), fmt(r["distortion"], ".2e"),
                     fmt(overhead, ".2f"), fmt(r.get("encode_mb_s"), ".1f"), fmt(r.get("decode_mb_s"), ".1f"),
                     fmt(r.get("cosine"), ".5f")])
    lines += table(["method", "bits/el", "x fp16", "x CacheGen-style", "MSE/var", "coder overhead %",
                    "encode MB/s", "decode MB/s", "embedding cosine"], body)
    lines.append("")
    if data.get("all_levels_encode_mb_s") is not None:
        lines.append(f"All levels at once (`encode_levels`, as `kvwire put` runs it): "
                     f"{data['all_levels_encode_mb_s']:.1f} MB/s of fp16 KV.")
    lines.append(f"x CacheGen-style: a CacheGen-design coder's bits at the same distortion, interpolated on "
                 f"its curve ({len(cachegen)} points) over kvwire's bits. MB/s are of fp16-equivalent KV.")
    for key, title in (("transforms", "Transforms"), ("delta", "Anchor/delta coding")):
        if data.get(key):
            columns = list(data[key][0])
            lines += ["", f"{title}:", ""] + table(columns, [[fmt(r[k]) for k in columns] for r in data[key]])
    lines += [""] + targets_lines(data.get("targets", []))
    return lines


def _policy_rows(results: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str, float], Mapping[str, Any]]:
    return {(r["trace_set"], r["policy"], r["slo"]): r for r in results}


def render_policies(data: Mapping[str, Any]) -> list[str]:
    c = data["config"]
    sets = c["trace_sets"]
    by = _policy_rows(data["results"])
    lines = [f"{c['workload']}, {c['tokens']} tokens in chunks of {c['chunk_tokens']}, RTT "
             f"{c['rtt'] * 1e3:g} ms, SLOs {', '.join(f'{s:g}' for s in c['slos'])} s; trace sets "
             + ", ".join(f"`{s}` ({len(t)} traces)" for s, t in sets.items())
             + f"; a fetch every {c['spacing']:g} s of trace: {c['fetches']} simulated fetches in "
             f"{c['sweep_seconds']:.0f} s. Bits/el from {c['codec_figures']['source']}.", "",
             "mpc (the default policy) against CacheGen's greedy rule and the oracle (the best schedule "
             "knowing the future, a chunk split between two levels by layer included); objective: each "
             "chunk's level distortion target (layer-weighted for a split or continued chunk) plus 1 per "
             "text chunk, mean per fetch; x oracle: over the oracle's mean on the same fetches. "
             "Ablations: mpc whose cancel rule cannot continue a chunk's remaining layers at a lower "
             "level (only text can follow a delivered layer), mpc planning with the any-mix shape (text "
             "between KV chunks timed as it overlaps; off by default), and the oracle without the split.", ""]
    body = []
    for ts in sets:
        for slo in c["slos"]:
            mpc, greedy, oracle, no_continuation, any_mix, no_split = (
                by.get((ts, p, slo)) for p in ("mpc", "greedy", "oracle", "mpc-no-continuation", "mpc-any-mix",
                                               "oracle-no-split"))
            if mpc is None:
                continue

            def get(row: Mapping[str, Any] | None, key: str) -> Any:
                return None if row is None else row.get(key)

            split_gain = (None if no_split is None or oracle is None or not oracle["mean_objective"]
                          else no_split["mean_objective"] / oracle["mean_objective"])

            body.append([ts, f"{slo:g}", pct(get(mpc, "violation_rate")), pct(get(greedy, "violation_rate")),
                         pct(get(oracle, "violation_rate")), fmt(get(mpc, "objective_ratio"), ".3f") + "x",
                         fmt(get(greedy, "objective_ratio"), ".3f") + "x",
                         fmt(get(no_continuation, "objective_ratio"), ".3f") + "x",
                         fmt(get(any_mix, "objective_ratio"), ".3f") + "x", pct(get(any_mix, "violation_rate")),
                         fmt(split_gain, ".3f") + "x",
                         pct(get(mpc, "text_share")),
                         pct(get(oracle, "text_share")), fmt(get(mpc, "level_switches_per_fetch"), ".2f"),
                         fmt(get(mpc, "ttft_p95"), ".3f")])
    lines += table(["trace set", "SLO s", "mpc violations", "greedy", "oracle", "mpc objective / oracle's",
                    "greedy's / oracle's", "mpc without continuation / oracle's", "mpc any-mix / oracle's",
                    "mpc any-mix violations", "oracle without split / with",
                    "mpc text share", "oracle's", "mpc level switches",
                    "mpc TTFT p95 s"], body)
    lines += ["", "<details><summary>Every policy</summary>", ""]
    full = [[r["trace_set"], r["policy"], f"{r['slo']:g}", pct(r["violation_rate"]),
             fmt(r["mean_objective"], ".4f"), fmt(r["objective_ratio"], ".3f"), pct(r["text_share"]),
             fmt(r["mean_kv_distortion"], ".2e"), fmt(r["finish_share_of_slo"], ".2f"),
             fmt(r["ttft_p95"], ".3f"), fmt(r["cancels_per_fetch"], ".2f")]
            for r in sorted(data["results"], key=lambda r: (r["trace_set"], r["slo"]))]
    lines += table(["set", "policy", "SLO s", "violations", "objective", "x oracle", "text share",
                    "KV distortion", "finish / SLO", "TTFT p95 s", "cancels per fetch"], full)
    lines += ["", "</details>", ""] + targets_lines(data.get("targets", []))
    return lines


def render_stream(data: Mapping[str, Any]) -> list[str]:
    c = data["config"]
    lines = [f"Synthetic KV {c['layers']} layers x {c['heads']} heads x {c['head_dim']}, chunks of "
             f"{c['chunk_tokens']} tokens at level {c['level']} ({c['chunk_bytes'] / 1e6:.2f} MB per chunk); "
             f"sender and shaping proxies in a child process; {c['cpus']} CPUs, receiver loop {c['loop']}.", ""]
    body = [[link["link"], fmt(link["bytes"] / 1e6, ".1f"), fmt(link["transfer_seconds"], ".3f"),
             fmt(link["goodput_mbit"], ".0f"), fmt(link["total_seconds"], ".3f"),
             fmt(link["first_layer_seconds"], ".3f"), fmt(link["decode_mbit"], ".3g"),
             fmt(link["receiver_cpu_seconds"], ".2f"), fmt(link["sender_cpu_seconds"], ".2f")]
            for link in data["links"]]
    lines += table(["link", "MB", "transfer s", "goodput Mbit/s", "total s", "first layer s",
                    "decode Mbit/s", "receiver CPU s", "sender CPU s"], body)
    k = data["concurrency"]
    lines += ["", f"{k['sessions']} sessions at once on loopback: {k['completed']} completed in "
                  f"{k['wall_seconds']:.2f} s; per-session throughput {k['slowest_mbit']:.1f} .. "
                  f"{k['fastest_mbit']:.1f} Mbit/s (slowest / fastest {k['fairness']:.2f}).",
              "Goodput: chunk bytes over first request to last chunk end; total: until the last layer is "
              "decoded and delivered; decode: compressed bytes over decode-thread seconds.", ""]
    return lines + targets_lines(data.get("targets", []))


def render_netsim(data: Mapping[str, Any]) -> list[str]:
    proxy = data["proxy"]
    lines = ["ShapingProxy on loopback (target: within 3% of the configured rate):", ""]
    lines += table(["rate Mbit/s", "achieved Mbit/s", "error %", "proxy CPU % of a core"],
                   [[fmt(r["configured_mbit"]), fmt(r["achieved_mbit"], ".2f"), fmt(r["error_pct"], "+.2f"),
                     fmt(r["cpu_pct_of_core"], ".1f")] for r in proxy["rates"]])
    lines += ["", "Rate changes: " + "; ".join(
        f"{c['from_mbit']:g} -> {c['to_mbit']:g} Mbit/s followed in {_ms(c['response_s'])}"
        for c in proxy["rate_change"]) + ".", ""]
    ns = data["netns"]
    if not ns.get("available"):
        return lines + [f"netns + tc tbf: not run ({ns.get('reason')})."]
    lines += ["netns + tc tbf over a veth pair (goodput against rate x 1448/1514; target within 5%):", ""]
    lines += table(["tbf Mbit/s", "expected goodput", "goodput", "error %"],
                   [[fmt(r["tbf_mbit"]), fmt(r["expected_goodput_mbit"], ".2f"), fmt(r["goodput_mbit"], ".2f"),
                     fmt(r["error_pct"], "+.2f")] for r in ns["rates"]])
    lines += ["", "tc changes: " + "; ".join(
        f"{c['from_mbit']:g} -> {c['to_mbit']:g} Mbit/s followed in {_ms(c['response_s'])}"
        for c in ns["rate_change"]) + " (target < 0.5 s)."]
    return lines


def _ms(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds * 1000:.0f} ms"


def render_rejections(key: str, data: Mapping[str, Any]) -> list[str]:
    """``kvwire bench adversarial KEY``'s rows: each hostile input, what refused it, how fast."""
    rows = data[key]
    rejected = [r for r in rows if r.get("error")]
    seconds = [r["seconds"] for r in rows if r.get("seconds") is not None]
    growth = [r["peak_rss_growth_mb"] for r in rows if r.get("peak_rss_growth_mb") is not None]
    lines = [f"{len(rejected)} of {len(rows)} hostile inputs rejected"
             + (f"; slowest {max(seconds):.4f} s, largest peak-RSS growth {max(growth):.1f} MB" if seconds else "")
             + ".", ""]
    body = []
    for r in rows:
        error = r.get("error")
        kind, _, message = (error or "").partition(": ")
        body.append([r["input"], kind if error else "**accepted**", _clip(message, 90),
                     fmt(r.get("seconds"), ".4f"), fmt(r.get("peak_rss_growth_mb"), ".1f")])
    return lines + table(["input", "rejected with", "message", "seconds", "peak RSS growth MB"], body)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


#: Demo keys not shown: paths, ids (token ids, the profile's content hash) and the fetch
#: report (its per-chunk rows are shown apart).
_DEMO_SKIP = frozenset({"fetch", "plot", "answer_fetched_ids", "answer_recompute_ids", "profile_id"})


def _scalar(value: Any) -> bool:
    return not isinstance(value, (Mapping, list, tuple))


def _short_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) <= 32 and all(map(_scalar, value))


def _rows_table(title: str, rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """A titled table of records, one column per key holding a scalar in any of them."""
    columns = list(dict.fromkeys(k for r in rows for k, v in r.items() if _scalar(v)))
    return ["", f"{title}:", ""] + table(columns, [[_clip(fmt(r.get(k)), 120) for k in columns] for r in rows])


def render_demo(data: Mapping[str, Any]) -> list[str]:
    """Whatever the demo's JSON holds: its scalar figures (and those one dict deep) in one
    table, then a table per list of records (or dict of records), then the fetch's chunks."""
    summary: list[list[str]] = []
    tables: list[list[str]] = []
    for key, value in data.items():
        if key in _DEMO_SKIP:
            continue
        if _scalar(value) or _short_list(value):
            summary.append([key, _clip(fmt(value), 160)])
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, Mapping) for v in value):
            tables.append(_rows_table(key, value))
        elif isinstance(value, Mapping) and value and all(isinstance(v, Mapping) for v in value.values()):
            tables.append(_rows_table(key, [{key: name, **row} for name, row in value.items()]))
        elif isinstance(value, Mapping):
            summary += [[f"{key}.{k}", _clip(fmt(v), 160)] for k, v in value.items() if _scalar(v) or _short_list(v)]
    fetch = data.get("fetch")
    chunks = fetch.get("chunks") if isinstance(fetch, Mapping) else None
    if isinstance(chunks, list) and chunks and all(isinstance(c, Mapping) for c in chunks):
        tables.append(_rows_table("fetch.chunks (the fetch report, chunk by chunk)", chunks))
    return table(["figure", "value"], summary) + [line for t in tables for line in t]


def render_ttft(data: Mapping[str, Any]) -> list[str]:
    lines = ["A cost model, not a measurement. It assumes:", ""]
    lines += [f"- {a}" for a in data["ttft_model"]]
    rows = data["ttft"]
    if rows:
        names = [k for k in rows[0] if k not in ("tokens", "link_gbit", "speedup")]
        lines += ["", "Modelled time to first token, seconds:", ""]
        lines += table(["tokens", "link Gbit/s"] + names,
                       [[fmt(r["tokens"]), fmt(r["link_gbit"])] + [fmt(r[n], ".3f") for n in names] for r in rows])
        reference = next((n for n in names if n.startswith("kvwire")), None)
        if reference:
            others = list(rows[0]["speedup"])
            lines += ["", f"Modelled TTFT of each method over {reference}'s:", ""]
            lines += table(["tokens", "link Gbit/s"] + others,
                           [[fmt(r["tokens"]), fmt(r["link_gbit"])] + [fmt(r["speedup"][n], ".2f") + "x"
                                                                      for n in others] for r in rows])
    return lines


@dataclass(frozen=True)
class Section:
    """One benchmark: its ``kvwire`` arguments, its renderer and what its figures mean."""

    key: str
    title: str
    args: tuple[str, ...]
    render: Callable[[Any], list[str]]
    about: str
    timeout_s: float

    @property
    def command(self) -> str:
        return "kvwire " + " ".join(a.replace(TMP, "$TMP") for a in self.args)


#: The measured sections, in order. Each timeout only guards against a hang: it is several
#: times the command's wall time on a quiet machine, as a shared one runs them 3-4x slower.
SECTIONS: tuple[Section, ...] = (
    Section("codec", "Codec", ("bench", "codec", "--quick", "--json", "--no-plot"), render_codec,
            "Real all-MiniLM-L6-v2 KV of GPL-3 text, the profile calibrated on other texts. Warm: each "
            "speed is the best of 3 timings, so the first call's numba compile (or cache load) is not in "
            "it; each chunk decodes into a buffer of its own, as a receiver decodes into its KV cache. "
            "Bits/el and distortion do not depend on the machine; MB/s do, and move with its load. "
            "`--quick` leaves out the transform and anchor/delta comparisons (see the full-scale runs).",
            3600),
    Section("policies", "Adaptation", ("bench", "policies", "--json"), render_policies,
            "The session's own decision code on a virtual clock over both committed trace sets: a "
            "deterministic simulation, so the machine changes only its wall time. Chunk sizes are "
            "bits/el measured by `kvwire bench codec` (its committed JSON) times a Llama-3-8B-shaped "
            "context; recompute and GPU decode costs are modelled (see Modelled, not measured). "
            "It runs on one process per core (at most 8).",
            3600),
    Section("stream", "Streaming", ("bench", "stream", "--quick", "--json"), render_stream,
            "`--quick` shapes (small synthetic KV). Warm: each session compiles or loads the codec's "
            "kernels before its fetch is timed. Real sockets and a real shaping proxy on this "
            "machine's loopback, so the figures move with its load.", 1200),
    Section("netsim", "netsim", ("bench", "netsim", "--json"), render_netsim,
            "How closely the user-space shaping proxy and the kernel's tbf (network namespaces, "
            "root only) hold and follow a rate.", 1200),
    Section("hostile", "Security: hostile inputs", ("bench", "adversarial", "hostile", "--json"),
            functools.partial(render_rejections, "hostile"),
            "Hand-made hostile blobs and profiles (codec/FORMAT.md's limits), each rejected in a fresh "
            "process after `codec.warm_up()` (warm): the error, the seconds and the growth of peak RSS "
            "while rejecting it.", 1800),
    Section("wire", "Security: hostile continuations", ("bench", "adversarial", "wire", "--json"),
            functools.partial(render_rejections, "wire"),
            "Hostile uses of protocol 2's continuation (a REQUEST's first layer) against a real sender on "
            "loopback, and hostile continuation answers against the receiver's parsing: what refused each, "
            "in how long, with how much peak-RSS growth, and whether the sender stayed up. The repeated "
            "last-layer continuation row measures how much more the sender reads from its store than it "
            "sends (the store reads whole blobs).", 600),
    Section("demo", "Demo", ("demo", "--json", "--out-dir", TMP + "/demo"), render_demo,
            "The whole path end to end on a real model: put, serve, fetch through the shaping proxy "
            "under the SLO. The demo reports whether its start was cold (codec kernels compiled) or "
            "warm (loaded from numba's cache); `$TMP` is a temporary directory.", 3600),
)
#: Run with the measured sections, rendered after the full-scale runs.
MODELLED = Section("ttft", "Time to first token", ("bench", "policies", "--ttft-only", "--json"), render_ttft,
                   "Modelled: only bits/el are measured (`kvwire bench codec`'s committed JSON); every "
                   "other input is an assumption listed below. Compare the GPU decode rate it assumes with "
                   "the one measured under Full-scale runs.", 300)


# ------------------------------------------------------------------------ running
@dataclass
class Outcome:
    """What one benchmark's command did: its JSON output, or why there is none."""

    key: str
    command: str
    seconds: float
    returncode: int | None          # None: stopped at its timeout
    data: Any = None
    error: str | None = None
    #: user + system CPU seconds of the command and the processes it waited for: on a
    #: shared machine a steadier measure of its cost than the wall time
    cpu_seconds: float | None = None


def parse_json_output(text: str) -> Any:
    """The JSON document a ``--json`` command printed: all of stdout, or, where something
    printed lines before it, the document that starts a line and runs to the end."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    offset = 0
    for line in text.splitlines(keepends=True):
        if line.lstrip().startswith(("{", "[")):
            try:
                return json.loads(text[offset:])
            except ValueError:
                pass
        offset += len(line)
    raise ValueError("no JSON document in the output")


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_section(section: Section, workdir: Path) -> Outcome:
    """Run one benchmark's command in ``workdir``; never raises for the benchmark's failures."""
    args = [a.replace(TMP, str(workdir)) for a in section.args]
    start, cpu = time.monotonic(), _children_cpu()
    try:
        done = subprocess.run([sys.executable, "-m", "streamer.tools.cli", *args], cwd=workdir,
                              capture_output=True, text=True, timeout=section.timeout_s)
    except subprocess.TimeoutExpired as exc:
        output = exc.stderr or b""
        text = output.decode(errors="replace") if isinstance(output, bytes) else output
        return Outcome(section.key, section.command, time.monotonic() - start, None,
                       error=f"stopped after its {section.timeout_s:g} s timeout\n{_tail(text)}")
    seconds, cpu = time.monotonic() - start, _children_cpu() - cpu
    if done.returncode != 0:
        return Outcome(section.key, section.command, seconds, done.returncode,
                       error=f"exit status {done.returncode}\n{_tail(done.stderr or done.stdout)}",
                       cpu_seconds=cpu)
    try:
        data = parse_json_output(done.stdout)
    except ValueError as exc:
        return Outcome(section.key, section.command, seconds, 0,
                       error=f"{exc}\n{_tail(done.stdout + done.stderr)}", cpu_seconds=cpu)
    return Outcome(section.key, section.command, seconds, 0, data=data, cpu_seconds=cpu)


# ------------------------------------------------------------------------- header
def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def commit() -> str:
    """``git rev-parse --short HEAD``, plus ``dirty`` when the tree has changes or
    untracked files (either can change what ran)."""
    head = _git("rev-parse", "--short", "HEAD")
    if head is None:
        return "unknown (not a git checkout)"
    status = _git("status", "--porcelain")
    return f"{head} dirty" if status else head


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2 ** 20
    except OSError:
        pass
    return None


def _gpu() -> str:
    """``nvidia-smi``'s name and memory of each GPU, or ``none``."""
    if shutil.which("nvidia-smi") is None:
        return "none"
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "none (nvidia-smi did not answer)"
    gpus = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    return "; ".join(gpus) if done.returncode == 0 and gpus else "none (nvidia-smi found no GPU)"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine() -> dict[str, Any]:
    """The machine the figures come from."""
    memory = _memory_gib()
    return {"cpu": _cpu_model(), "cores": os.cpu_count(),
            "memory": "unknown" if memory is None else f"{memory:.1f} GiB",
            "gpu": _gpu(), "python": platform.python_version(), "torch": _version("torch")}


def describe(m: Mapping[str, Any]) -> str:
    return f"{m['cpu']}, {m['cores']} cores, {m['memory']} memory, GPU: {m['gpu']}"


HEADER_FIELDS = ("Date (UTC)", "Commit", "Machine", "Software")


def header() -> dict[str, Any]:
    now = datetime.datetime.now(datetime.timezone.utc)
    return {"date": now.strftime("%Y-%m-%d %H:%M"), "commit": commit(), "machine": machine(),
            "load_start": os.getloadavg()[0]}


def parse_header(text: str) -> dict[str, str]:
    """The ``- Field: value`` lines of MEASURED.md's header (before its first section)."""
    head = text.split("\n## ", 1)[0]
    return dict(re.findall(r"^- ([A-Za-z ()]+): (.+)$", head, flags=re.MULTILINE))


# ------------------------------------------------------------------------ rendering
def failed_section(outcome: Outcome | None, reason: str | None = None) -> list[str]:
    if outcome is None:
        return ["**Not measured**: not run."]
    why = reason or outcome.error or "unknown"
    first, _, rest = why.partition("\n")
    lines = [f"**Not measured**: the command failed ({first}; {outcome.seconds:.0f} s)."]
    if rest.strip():
        lines += ["", "```", rest.strip(), "```"]
    return lines


def _cost(outcome: Outcome | None) -> str:
    """`` (W s)``, or `` (W s wall, C s CPU)`` where the CPU time was measured."""
    if outcome is None:
        return ""
    if outcome.cpu_seconds is None:
        return f" ({outcome.seconds:.0f} s)"
    return f" ({outcome.seconds:.0f} s wall, {outcome.cpu_seconds:.0f} s CPU)"


def render_section(section: Section, outcome: Outcome | None, level: str = "##") -> list[str]:
    command = section.command if outcome is None else outcome.command   # what ran, even in a --load
    lines = [f"{level} {section.title}", "", f"`{command}`" + _cost(outcome), "", section.about, ""]
    if outcome is None or outcome.data is None:
        return lines + failed_section(outcome) + [""]
    try:
        body = section.render(outcome.data)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        body = failed_section(outcome, f"its JSON is not in the shape this report reads: "
                                       f"{type(exc).__name__}: {exc}")
    return lines + body + [""]


def load_full_scale(path: Path = FULL_SCALE) -> dict[str, Any]:
    doc = json.loads(Path(path).read_text())
    for run in doc["runs"]:
        for key in ("name", "command", "date", "machine", "shows", "tables"):
            if key not in run:
                raise ValueError(f"{path}: run {run.get('name')!r} has no {key!r}")
    return doc


def render_full_scale(doc: Mapping[str, Any]) -> list[str]:
    lines = ["## Full-scale runs (not run by this command)", "", doc.get("about", ""), ""]
    for run in doc["runs"]:
        lines += [f"### {run['name']}", "", f"`{run['command']}`", "",
                  f"{run['date']}, commit {run.get('commit') or 'not recorded'}, {run['machine']}"
                  + (f", {run['wall_seconds']:g} s" if run.get("wall_seconds") is not None else "") + ".", ""]
        if run.get("setup"):
            lines += [run["setup"], ""]
        for t in run["tables"]:
            if t.get("title"):
                lines += [t["title"], ""]
            lines += table(t["columns"], t["rows"]) + [""]
        if run.get("notes"):
            lines += [f"- {note}" for note in run["notes"]] + [""]
        lines += [f"**What it shows:** {run['shows']}", ""]
    return lines


def render(head: Mapping[str, Any], outcomes: Mapping[str, Outcome], full_scale: Mapping[str, Any] | None,
           full_scale_error: str | None = None) -> str:
    """The whole of MEASURED.md."""
    m = head["machine"]
    lines = ["# Measured", "",
             "Generated by `kvwire bench report` (streamer/tools/bench_report.py): every shipped benchmark "
             "in its quick mode, each under the command that made it. Do not edit by hand: rerun it. "
             "A figure here is measured on the machine below unless its section says modelled.", "",
             f"- Date (UTC): {head['date']}",
             f"- Commit: {head['commit']}",
             f"- Machine: {describe(m)}",
             f"- Software: Python {m['python']}, torch {m['torch']}",
             f"- Load: {head['load_start']:.1f} (1-minute load average at the start) to "
             f"{fmt(head.get('load_end'), '.1f')} at the end; the benchmarks ran one after another",
             f"- Wall time: {fmt(head.get('seconds'), '.0f')} s for the whole report, "
             f"{fmt(head.get('cpu_seconds'), '.0f')} s of CPU time (user + system, all processes)", ""]
    for section in SECTIONS:
        lines += render_section(section, outcomes.get(section.key))
    if full_scale is not None:
        lines += render_full_scale(full_scale)
    else:
        lines += ["## Full-scale runs (not run by this command)", "",
                  f"**Not shown**: {full_scale_error or 'no data file'}.", ""]
    lines += ["## Modelled, not measured", ""]
    lines += render_section(MODELLED, outcomes.get(MODELLED.key), level="###")
    return "\n".join(lines).rstrip() + "\n"


# --------------------------------------------------------------------------- main
def run_all(sections: Sequence[Section] = (*SECTIONS, MODELLED)) -> tuple[dict[str, Any], dict[str, Outcome]]:
    """Every section's command, one after another; the header with the run's wall time."""
    head = header()
    start = time.monotonic()
    outcomes: dict[str, Outcome] = {}
    with tempfile.TemporaryDirectory(prefix="kvwire-report-") as tmp:
        for section in sections:
            print(f"kvwire bench report: {section.command} ...", file=sys.stderr, flush=True)
            workdir = Path(tmp) / section.key
            workdir.mkdir()
            outcome = run_section(section, workdir)
            state = "ok" if outcome.data is not None else f"FAILED ({outcome.error.splitlines()[0]})"
            print(f"  {state} in {outcome.seconds:.0f} s", file=sys.stderr, flush=True)
            outcomes[section.key] = outcome
    head["seconds"] = time.monotonic() - start
    head["cpu_seconds"] = sum(o.cpu_seconds or 0.0 for o in outcomes.values())
    head["load_end"] = os.getloadavg()[0]
    return head, outcomes


def _full_scale(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    try:
        return load_full_scale(path), None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"{path} could not be read: {type(exc).__name__}: {exc}"


def main(args: argparse.Namespace) -> int:
    if args.load:
        saved = json.loads(Path(args.load).read_text())
        head, outcomes = saved["header"], {k: Outcome(**v) for k, v in saved["outcomes"].items()}
    else:
        head, outcomes = run_all()
        if args.save:
            Path(args.save).write_text(json.dumps(
                {"header": head, "outcomes": {k: asdict(v) for k, v in outcomes.items()}}, indent=1))
    full, error = _full_scale(Path(args.full_scale))
    out = Path(args.out)
    out.write_text(render(head, outcomes, full, error))
    failed = [k for k, o in outcomes.items() if o.data is None]
    print(f"wrote {out} ({len(outcomes) - len(failed)} of {len(outcomes)} benchmarks measured"
          + (f"; failed: {', '.join(failed)}" if failed else "") + ")", file=sys.stderr)
    return 0


def register(subparsers: argparse._SubParsersAction, bench_subparsers: argparse._SubParsersAction) -> None:
    """Add ``kvwire bench report``."""
    p = bench_subparsers.add_parser(
        "report", help="run the benchmarks in their quick modes and write docs/MEASURED.md",
        description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(DEFAULT_OUT), help=f"Markdown file to write (default {DEFAULT_OUT})")
    p.add_argument("--full-scale", default=str(FULL_SCALE),
                   help=f"figures of the full-scale runs (default {FULL_SCALE})")
    p.add_argument("--save", metavar="FILE", help="also write the header and every benchmark's output as JSON")
    p.add_argument("--load", metavar="FILE", help="render a --save file again instead of running the benchmarks")
    p.set_defaults(handler=main)
