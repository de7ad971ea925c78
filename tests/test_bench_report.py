"""``kvwire bench report``: rendering from small bench outputs, the header, failures as
sections, the full-scale data file, and the committed docs/MEASURED.md's header.

No real benchmark runs here: the commands are replaced by tiny scripts or outputs made up
in the shape each benchmark's ``--json`` prints."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from streamer.tools import bench_report as br
from streamer.tools.cli import build_parser

CODEC = {
    "config": {"workload": "minilm", "shape": [6, 2, 3072, 12, 32], "chunk_tokens": 1536, "chunks": 2,
               "calibration_tokens": 4096, "calibration_seconds": 12.5, "profile_id": "p", "delta_layers": 0,
               "threads": 2},
    "profile_bytes": 6_000_000,
    "rows": [
        {"method": "raw_fp16", "level": None, "bits_per_element": 16.0, "distortion": 0.0, "ratio_fp16": 1.0},
        {"method": "int8", "level": None, "bits_per_element": 8.02, "distortion": 4.9e-5, "ratio_fp16": 1.99},
        {"method": "cachegen", "level": None, "bits_per_element": 5.3, "distortion": 4e-3, "ratio_fp16": 3.0},
        {"method": "kvwire", "level": 0, "bits_per_element": 4.31, "distortion": 2.5e-4, "ratio_fp16": 3.71,
         "ratio_cachegen": 1.95, "coder_overhead": 0.0169, "encode_mb_s": 50.0, "decode_mb_s": 120.0,
         "cosine": 0.99997},
        {"method": "kvwire", "level": 2, "bits_per_element": 2.40, "distortion": 4.0e-3, "ratio_fp16": 6.66,
         "ratio_cachegen": 2.21, "coder_overhead": 0.0165, "encode_mb_s": 60.0, "decode_mb_s": 137.0,
         "cosine": 0.99939},
    ],
    "transforms": [], "delta": [],
    "targets": [{"target": "coder overhead <= 1% (every level)", "measured": 0.0169, "met": False},
                {"target": "distortion <= 0.005 at <= 2.5 bits/element", "measured": 2.4, "met": True}],
    "all_levels_encode_mb_s": 24.9,
}


def _policy_row(trace_set: str, policy: str, slo: float, violations: float, ratio: float | None) -> dict:
    return {"trace_set": trace_set, "policy": policy, "slo": slo, "fetches": 10, "violation_rate": violations,
            "mean_objective": 0.1, "oracle_objective": 0.08, "objective_ratio": ratio, "text_share": 0.25,
            "mean_kv_distortion": 1e-3, "finish_share_of_slo": 0.8, "ttft_p50": 0.4, "ttft_p95": 0.9,
            "level_switches_per_fetch": 1.1, "cancels_per_fetch": 0.5, "cancels_after_layers_share": 0.6,
            "cancels_to_level_share": 0.1}


POLICIES = {
    "config": {"workload": "Llama-3-8B-shaped KV", "tokens": 8192, "chunk_tokens": 1024, "rtt": 0.005,
               "spacing": 0.5, "slos": [0.5, 1.0], "trace_sets": {"default": ["a", "b"]}, "fetches": 40,
               "sweep_seconds": 3.0, "codec_figures": {"source": "codec_bench_minilm.json"}},
    "results": [_policy_row("default", p, slo, v, r) for slo in (0.5, 1.0)
                for p, v, r in (("mpc", 0.014, 1.091), ("greedy", 0.032, 1.5), ("oracle", 0.006, 1.0),
                                ("mpc-no-continuation", 0.02, 1.2), ("mpc-any-mix", 0.03, 1.3),
                                ("oracle-no-split", 0.006, 1.04))],
    "targets": [{"target": "default SLO 0.5 s: (a) mpc mean objective <= 1.1x the oracle's",
                 "measured": {"mpc": 0.1, "oracle": 0.08, "ratio": 1.091}, "met": True}],
}

STREAM = {
    "config": {"layers": 2, "heads": 4, "head_dim": 64, "chunk_tokens": 256, "level": 1, "chunk_bytes": 40_000,
               "cpus": 2, "loop": "uvloop.Loop"},
    "links": [{"link": "100 Mbit/s", "bytes": 4_000_000, "transfer_seconds": 0.33, "goodput_mbit": 101.0,
               "total_seconds": 0.35, "first_layer_seconds": 0.01, "decode_mbit": 300.0,
               "receiver_cpu_seconds": 0.2, "sender_cpu_seconds": 0.1},
              {"link": "loopback, no-op decode", "bytes": 4_000_000, "transfer_seconds": 0.02,
               "goodput_mbit": 1600.0, "total_seconds": 0.03, "first_layer_seconds": None, "decode_mbit": None,
               "receiver_cpu_seconds": 0.05, "sender_cpu_seconds": 0.02}],
    "concurrency": {"sessions": 64, "completed": 64, "wall_seconds": 1.5, "slowest_mbit": 20.0,
                    "fastest_mbit": 25.0, "fairness": 0.8},
    "targets": [{"target": "64 concurrent sessions against one sender all complete", "measured": 64,
                 "unit": "sessions", "met": True}],
}

NETSIM = {
    "proxy": {"rates": [{"configured_mbit": 10, "achieved_mbit": 9.98, "error_pct": -0.2, "proxy_cpu_s": 0.01,
                         "wall_s": 2.0, "cpu_pct_of_core": 0.5}],
              "rate_change": [{"from_mbit": 100.0, "to_mbit": 400.0, "response_s": 0.012},
                              {"from_mbit": 400.0, "to_mbit": 100.0, "response_s": None}]},
    "netns": {"available": False, "reason": "needs root"},
}

HOSTILE = {"hostile": [
    {"input": "blob_claiming_2^21_tokens", "error": "CorruptBitstream: too many tokens", "seconds": 0.0012,
     "peak_rss_growth_mb": 0.1},
    {"input": "profile_16kb_claiming_1gib_basis", "error": None, "seconds": 0.5, "peak_rss_growth_mb": 1024.0},
]}

DEMO = {"slo": 1.0, "deadline_met": True, "total_seconds": 0.62, "levels": [0, 1, "text"], "start": "warm",
        "warmup": {"compiled": 0, "loaded": 12, "numba_cache": "/x"}, "plot": "/tmp/p.png", "profile_id": "ab12cd34ef",
        "fetch": {"slo": 1.0, "chunks": [{"index": 0, "level": 0, "bytes": 1000}, {"index": 1, "level": "text"}]},
        "answer_fetched_ids": [1, 2, 3], "ttft_fetched_seconds": [0.9, 0.8], "ttft_recompute_seconds": 2.1,
        "methods": [{"method": "raw fp16", "bytes": 9_000_000, "fetch_seconds": 0.4},
                    {"method": "kvwire (mpc)", "bytes": 2_000_000, "fetch_seconds": 0.62, "perplexity": 12.1}],
        "answers": [{"question": "Who?", "answer_fetched": "line one\nline two", "answer_fetched_ids": [5, 6],
                     "identical": False}],
        "baselines": {"raw fp16": {"bytes": 9_000_000, "meets_slo": False}, "8-bit": {"bytes": 4_500_000}}}

TTFT = {"ttft_model": ["GPU KV decode at 100 GB/s: assumed"],
        "ttft": [{"tokens": 8192, "link_gbit": 1.0, "raw fp16": 8.6, "kvwire L1": 1.8, "prefill recompute": 0.38,
                  "speedup": {"raw fp16": 4.78, "prefill recompute": 0.21}}]}

WIRE = {"wire": [
    {"input": "continuation_first_layer_65535", "error": "fatal ERROR protocol: malformed REQUEST frame",
     "seconds": 0.002, "peak_rss_growth_mb": 0.0, "daemon_up": True},
    {"input": "continuation_on_version_1", "error": None, "seconds": 0.003, "peak_rss_growth_mb": 0.0,
     "daemon_up": True}]}

DATA = {"codec": CODEC, "policies": POLICIES, "stream": STREAM, "netsim": NETSIM, "hostile": HOSTILE,
        "wire": WIRE, "demo": DEMO, "ttft": TTFT}


def _head() -> dict:
    return {"date": "2026-12-04 12:00", "commit": "v1 dirty", "load_start": 1.5, "load_end": 2.0, "seconds": 600.0,
            "cpu_seconds": 1100.0,
            "machine": {"cpu": "Test CPU", "cores": 2, "memory": "24.0 GiB", "gpu": "none", "python": "3.11.7",
                        "torch": "2.13.0"}}


def _outcomes(**replace: br.Outcome) -> dict[str, br.Outcome]:
    commands = {s.key: s.command for s in (*br.SECTIONS, br.MODELLED)}
    out = {key: br.Outcome(key, commands[key], 1.0, 0, data) for key, data in DATA.items()}
    out.update(replace)
    return out


def _section(text: str, title: str) -> str:
    """The text of one ``## title`` section (up to the next section of that depth or above)."""
    match = re.search(rf"^#+ {re.escape(title)}\n(.*?)(?=^#{{1,3}} |\Z)", text, flags=re.MULTILINE | re.DOTALL)
    assert match, f"no section {title!r}"
    return match.group(1)


def test_every_section_renders_from_its_json() -> None:
    text = br.render(_head(), _outcomes(), br.load_full_scale())
    titles = re.findall(r"^## (.+)$", text, flags=re.MULTILINE)
    assert titles == ["Codec", "Adaptation", "Streaming", "netsim", "Security: hostile inputs",
                      "Security: hostile continuations", "Demo",
                      "Full-scale runs (not run by this command)", "Modelled, not measured"]
    assert "Not measured" not in text
    for section in (*br.SECTIONS, br.MODELLED):
        assert f"`{section.command}` (1 s)" in text
    codec = _section(text, "Codec")
    assert "| kvwire L2 (default) | 2.400 | 6.66 | 2.21 | 4.00e-03 | 1.65 | 60.0 | 137.0 | 0.99939 |" in codec
    assert "cachegen |" not in codec          # its curve is folded into x CacheGen-style
    assert "1 of 2 met" in codec and "**MISSED**: coder overhead" in codec
    policies = _section(text, "Adaptation")
    assert "| default | 0.5 | 1.4% | 3.2% | 0.6% | 1.091x | 1.500x | 1.200x | 1.300x | 3.0% | 1.000x | 25.0% | 25.0% | 1.10 | 0.900 |" in policies
    assert "40 simulated fetches" in policies
    stream = _section(text, "Streaming")
    assert "| 100 Mbit/s | 4.0 | 0.330 | 101 |" in stream and "64 completed" in stream
    netsim = _section(text, "netsim")
    assert "followed in 12 ms" in netsim and "followed in never" in netsim and "not run (needs root)" in netsim


def test_hostile_inputs_say_which_were_rejected() -> None:
    section = _section(br.render(_head(), _outcomes(), None), "Security: hostile inputs")
    assert "1 of 2 hostile inputs rejected" in section
    assert "| blob_claiming_2^21_tokens | CorruptBitstream | too many tokens | 0.0012 | 0.1 |" in section
    assert "| profile_16kb_claiming_1gib_basis | **accepted** |" in section
    wire = _section(br.render(_head(), _outcomes(), None), "Security: hostile continuations")
    assert "1 of 2 hostile inputs rejected" in wire
    assert "| continuation_first_layer_65535 | fatal ERROR protocol | malformed REQUEST frame | 0.0020 | 0.0 |" in wire
    assert "| continuation_on_version_1 | **accepted** |" in wire


def test_demo_renders_whatever_its_json_holds() -> None:
    section = _section(br.render(_head(), _outcomes(), None), "Demo")
    assert "| deadline_met | yes |" in section and "| levels | 0, 1, text |" in section
    assert "| warmup.loaded | 12 |" in section and "| ttft_fetched_seconds | 0.9, 0.8 |" in section
    for hidden in ("plot", "profile_id", "answer_fetched_ids", "fetch.slo"):
        assert f"| {hidden} |" not in section and f"| {hidden}" not in section
    assert "methods:\n\n| method | bytes | fetch_seconds | perplexity |" in section
    assert "| kvwire (mpc) | 2000000 | 0.62 | 12.1 |" in section
    assert "answers:\n\n| question | answer_fetched | identical |\n|---|---|---|\n| Who? | line one line two | no |" in section
    assert "| baselines | bytes | meets_slo |" in section and "| 8-bit | 4500000 | - |" in section
    assert "| index | level | bytes |\n|---|---|---|\n| 0 | 0 | 1000 |\n| 1 | text | - |" in section
    other = _section(br.render(_head(), _outcomes(demo=br.Outcome("demo", "d", 1.0, 0, {"seconds": 3.5})), None),
                     "Demo")
    assert "| seconds | 3.5 |" in other and "methods:" not in other


def test_modelled_section_is_labelled_with_its_assumptions() -> None:
    section = _section(br.render(_head(), _outcomes(), None), "Time to first token")
    assert "A cost model, not a measurement" in section and "- GPU KV decode at 100 GB/s: assumed" in section
    assert "| 8192 | 1 | 8.600 | 1.800 | 0.380 |" in section and "| 8192 | 1 | 4.78x | 0.21x |" in section


def test_header_has_date_commit_machine_and_software() -> None:
    fields = br.parse_header(br.render(_head(), _outcomes(), None))
    assert fields["Date (UTC)"] == "2026-12-04 12:00" and fields["Commit"] == "v1 dirty"
    assert fields["Machine"] == "Test CPU, 2 cores, 24.0 GiB memory, GPU: none"
    assert fields["Software"] == "Python 3.11.7, torch 2.13.0"
    assert fields["Wall time"] == "600 s for the whole report, 1100 s of CPU time (user + system, all processes)"
    timed = br.Outcome("netsim", "kvwire bench netsim --other", 30.4, 0, NETSIM, cpu_seconds=12.6)
    assert "`kvwire bench netsim --other` (30 s wall, 13 s CPU)" in br.render(_head(), _outcomes(netsim=timed), None)


def test_machine_description_has_its_fields() -> None:
    m = br.machine()
    assert set(m) == {"cpu", "cores", "memory", "gpu", "python", "torch"}
    assert m["cpu"] and m["gpu"] and m["cores"] >= 1 and m["python"].count(".") == 2
    assert re.fullmatch(r"\d+\.\d GiB|unknown", m["memory"])
    head = br.header()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d", head["date"])
    assert re.fullmatch(r"[0-9a-f]{7,}( dirty)?|unknown \(not a git checkout\)", head["commit"])


@pytest.mark.parametrize("key, title, outcome, says", [
    ("demo", "Demo", br.Outcome("demo", "d", 7.0, 1, None, "exit status 1\nTraceback\nRuntimeError: no model"),
     "the command failed (exit status 1; 7 s)"),
    ("demo", "Demo", br.Outcome("demo", "d", 1200.0, None, None, "stopped after its 1200 s timeout\n"),
     "the command failed (stopped after its 1200 s timeout; 1200 s)"),
    ("codec", "Codec", br.Outcome("codec", "c", 2.0, 0, ["not", "a", "dict"]),
     "its JSON is not in the shape this report reads: TypeError"),
])
def test_a_failed_bench_is_a_failed_section(key: str, title: str, outcome: br.Outcome, says: str) -> None:
    text = br.render(_head(), _outcomes(**{key: outcome}), br.load_full_scale())
    section = _section(text, title)
    assert "**Not measured**" in section and says in section
    assert text.count("**Not measured**") == 1         # the other sections still render
    assert "| kvwire L2 (default) |" in text or key == "codec"
    assert "| kvwire (mpc) |" in text or key == "demo"
    if outcome.error and "RuntimeError" in outcome.error:
        assert "RuntimeError: no model" in section    # the end of its output is shown


def test_a_section_missing_from_a_run_is_not_measured() -> None:
    outcomes = _outcomes()
    del outcomes["netsim"]
    assert "**Not measured**: not run." in _section(br.render(_head(), outcomes, None), "netsim")


def test_json_output_after_other_lines_is_found() -> None:
    assert br.parse_json_output('{"a": 1}') == {"a": 1}
    assert br.parse_json_output('loading model...\nwarning: {x}\n{\n "a": [1, 2]\n}\n') == {"a": [1, 2]}
    with pytest.raises(ValueError):
        br.parse_json_output("no json here\n{broken")


def _script_section(tmp_path: Path, body: str, timeout: float = 30.0) -> br.Section:
    """A section whose benchmark is ``body``: the test's stand-in for ``sys.executable``
    runs tmp_path/bench.py whatever arguments it is given."""
    (tmp_path / "bench.py").write_text(body)
    return br.Section("fake", "Fake", ("ignored",), br.render_demo, "", timeout)


def test_run_section_collects_json_failures_and_timeouts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'bench.py'}\n")
    fake.chmod(0o755)
    monkeypatch.setattr(br.sys, "executable", str(fake))
    ok = br.run_section(_script_section(tmp_path, "print('starting')\nprint('{\"x\": 1}')\n"), tmp_path)
    assert ok.data == {"x": 1} and ok.returncode == 0 and ok.error is None
    assert ok.cpu_seconds is not None and ok.cpu_seconds >= 0
    failed = br.run_section(_script_section(tmp_path, "import sys\nprint('boom', file=sys.stderr)\nsys.exit(3)\n"),
                            tmp_path)
    assert failed.data is None and failed.returncode == 3 and failed.error.startswith("exit status 3")
    assert "boom" in failed.error
    garbled = br.run_section(_script_section(tmp_path, "print('not json')\n"), tmp_path)
    assert garbled.data is None and "no JSON document" in garbled.error
    slow = br.run_section(_script_section(tmp_path, "import time\ntime.sleep(30)\n", timeout=0.5), tmp_path)
    assert slow.data is None and slow.returncode is None and "timeout" in slow.error


def test_full_scale_file_loads_and_renders() -> None:
    doc = br.load_full_scale()
    names = [run["name"] for run in doc["runs"]]
    assert any(n.startswith("Load") for n in names) and any("GPU" in n for n in names)
    assert any("2048 scored tokens" in n for n in names) and any(n.startswith("Ablation") for n in names)
    text = "\n".join(br.render_full_scale(doc))
    for run in doc["runs"]:
        assert f"### {run['name']}\n\n`{run['command']}`\n\n{run['date']}, commit " in text
        assert run["machine"] in text and run["shows"] in text
        for t in run["tables"]:
            assert "| " + " | ".join(t["columns"]) + " |" in text
            assert all(len(row) == len(t["columns"]) for row in t["rows"])
            for row in t["rows"]:
                assert "| " + " | ".join(row) + " |" in text
    assert "kvwire bench load --store redis+cluster://" in text


def test_a_broken_full_scale_file_is_reported_not_raised(tmp_path: Path) -> None:
    bad = tmp_path / "full.json"
    bad.write_text(json.dumps({"runs": [{"name": "x", "command": "y"}]}))
    doc, error = br._full_scale(bad)
    assert doc is None and "has no 'date'" in error
    text = br.render(_head(), _outcomes(), doc, error)
    assert "**Not shown**" in _section(text, "Full-scale runs (not run by this command)")


def test_save_and_load_render_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    saved = tmp_path / "run.json"
    monkeypatch.setattr(br, "run_all", lambda: (_head(), _outcomes()))
    args = build_parser().parse_args(["bench", "report", "--out", str(tmp_path / "a.md"), "--save", str(saved)])
    assert args.handler(args) == 0
    args = build_parser().parse_args(["bench", "report", "--out", str(tmp_path / "b.md"), "--load", str(saved)])
    assert args.handler(args) == 0
    assert (tmp_path / "a.md").read_text() == (tmp_path / "b.md").read_text()
    assert "| kvwire L2 (default) |" in (tmp_path / "b.md").read_text()


def test_committed_measured_md_has_its_header() -> None:
    """A hand-edited docs/MEASURED.md without the generated header fails here."""
    text = (br.ROOT / "docs" / "MEASURED.md").read_text()
    assert text.startswith("# Measured\n") and "Generated by `kvwire bench report`" in text
    fields = br.parse_header(text)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d", fields.get("Date (UTC)", ""))
    assert re.fullmatch(r"[0-9a-f]{7,}( dirty)?", fields.get("Commit", ""))
    assert re.search(r".+, \d+ cores, .+ memory, GPU: .+", fields.get("Machine", ""))
    assert fields.get("Software", "").startswith("Python ")
    for section in br.SECTIONS:
        assert f"## {section.title}\n\n`{section.command}`" in text


def test_many_targets_list_the_missed_and_fold_the_rest() -> None:
    targets = [{"target": f"t{i}", "measured": 0.5, "met": i != 3} for i in range(br.MAX_TARGET_LINES + 2)]
    lines = br.targets_lines(targets)
    assert lines[0] == f"Targets the benchmark checks: {len(targets) - 1} of {len(targets)} met."
    assert lines[1] == "- **MISSED**: t3: measured 0.5" and lines[2] == ""
    assert lines[3] == "<details><summary>Every target</summary>" and "- met: t0: measured 0.5" in lines
    few = br.targets_lines(targets[:2])
    assert few == ["Targets the benchmark checks: 2 of 2 met.", "- met: t0: measured 0.5", "- met: t1: measured 0.5"]
