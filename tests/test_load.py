"""``kvwire bench load --quick --json`` runs end to end in this process (the sender in a
child): zero errors and the report's structure; no timing or memory thresholds (the
machine may be busy)."""
from __future__ import annotations

import json
import math

import pytest

from streamer.tools import bench_load as load
from streamer.tools.cli import build_parser


def test_options() -> None:
    args = build_parser().parse_args(["bench", "load"])
    cfg = load._config(args)
    assert (cfg.sessions, cfg.seconds, cfg.soak) == (256, 60.0, False)
    cfg = load._config(build_parser().parse_args(["bench", "load", "--soak"]))
    assert cfg.soak and math.isinf(cfg.seconds)
    cfg = load._config(build_parser().parse_args(["bench", "load", "--quick", "--sessions", "4", "--seconds", "1"]))
    assert (cfg.sessions, cfg.seconds) == (4, 1.0)
    with pytest.raises(SystemExit):
        load._config(build_parser().parse_args(["bench", "load", "--sessions", "0"]))


def test_reservoir_is_bounded_and_percentiles() -> None:
    r = load._Reservoir(size=100)
    for i in range(10_000):
        r.add(float(i))
    assert len(r.values) == 100 and r.seen == 10_000
    r = load._Reservoir()
    for i in range(1, 101):
        r.add(float(i))
    assert r.percentiles(50, 99) == {"p50": 50.0, "p99": 99.0}
    assert load._Reservoir().percentiles(50) == {"p50": None}


def test_rss_bytes() -> None:
    rss = load.rss_bytes()
    assert 0 < rss["rss"] <= rss["peak"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_quick_json_run(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["bench", "load", "--quick", "--json"])
    assert args.handler(args) == 0
    out = json.loads(capsys.readouterr().out)

    assert out["errors"] == 0, out["error_samples"]
    assert out["ok"] is True
    assert out["config"]["sessions"] == 16
    assert out["fetches"] >= 16 and out["text_chunks"] == 0
    assert out["chunks"] == out["fetches"] * out["config"]["chunks"]
    assert out["bytes"] == out["fetches"] * out["config"]["context_bytes"]
    assert out["fetches_per_second"] > 0 and out["mb_per_second"] > 0
    for key in ("chunk_latency_ms", "fetch_latency_ms"):
        assert 0 < out[key]["p50"] <= out[key]["p99"]
    for who in ("sender", "receiver"):
        assert out["rss"][who]["peak_mb"] > 0
        assert set(out["rss"][who]) >= {"baseline_mb", "end_mb", "growth"}
    assert len(out["samples"]) >= 2
    # the sender's own metrics agree: one session per fetch (plus the profile warm-up)
    m = out["sender_metrics"]
    assert m["sessions_total"] == out["fetches"] + 1
    # a receiver may close right after its last chunk, before the sender's final drain
    # returned: that chunk then counts as connection_lost on the sender, never as anything else
    lost = m["errors_by_code"].get("connection_lost", 0)
    assert set(m["errors_by_code"]) <= {"connection_lost"}
    assert out["chunks"] - lost <= m["chunks_total"] <= out["chunks"]
    assert {c["check"].split(" ")[0] for c in out["checks"]} >= {"zero", "RSS"}
