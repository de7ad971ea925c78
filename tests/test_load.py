"""``kvwire bench load --quick --json`` runs end to end in this process (two senders in
children): zero errors and the report's structure; the per-fetch check catches each kind
of bad delivery; no timing or memory thresholds (the machine may be busy)."""
from __future__ import annotations

import json
import math

import pytest

from streamer.tools import bench_load as load
from streamer.tools.cli import build_parser


def test_options() -> None:
    args = build_parser().parse_args(["bench", "load"])
    cfg = load._config(args)
    assert (cfg.sessions, cfg.seconds, cfg.soak, cfg.senders, cfg.slo, cfg.store) == (256, 60.0, False, 1, 5.0, None)
    cfg = load._config(build_parser().parse_args(["bench", "load", "--soak"]))
    assert cfg.soak and math.isinf(cfg.seconds)
    cfg = load._config(build_parser().parse_args(["bench", "load", "--quick", "--sessions", "4", "--duration", "1",
                                                  "--senders", "3", "--store", "redis://h:1/0"]))
    assert (cfg.sessions, cfg.seconds, cfg.senders, cfg.store) == (4, 1.0, 3, "redis://h:1/0")
    assert load._config(build_parser().parse_args(["bench", "load", "--seconds", "2"])).seconds == 2.0
    assert cfg.trim_seconds == 2.0
    assert load._config(build_parser().parse_args(["bench", "load", "--trim-seconds", "0"])).trim_seconds is None
    assert load._config(build_parser().parse_args(["bench", "load", "--trim-seconds", "0.5"])).trim_seconds == 0.5
    for bad in (["--sessions", "0"], ["--senders", "0"], ["--slo", "0"], ["--duration", "-1"],
                ["--trim-seconds", "-1"]):
        with pytest.raises(SystemExit):
            load._config(build_parser().parse_args(["bench", "load", *bad]))


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


def test_check_counts_duplicated_lost_and_wrong_deliveries() -> None:
    """The per-fetch check flags each kind of bad delivery (hand-made, no network)."""
    import torch

    k, v = torch.ones(3, 2, 4, dtype=torch.float16), torch.zeros(3, 2, 4, dtype=torch.float16)
    ctx = load.Context("c", token_ids=list(range(6)), chunk_bounds=[(0, 3), (3, 6)],
                       checksums={(0, 1, 0): load.layer_checksum(k, v), (0, 1, 1): load.layer_checksum(v, k)})

    class Session:
        levels = {0: 1, 1: "text"}

    check = load._Check(ctx, decode=True)
    check.session = Session()
    check.on_layer(0, 0, k, v)
    check.on_layer(0, 1, v, k)
    check.on_text(1, [3, 4, 5])
    assert check.finish(layers=2) == []

    check = load._Check(ctx, decode=True)
    check.session = Session()
    check.on_layer(0, 0, k, v)
    check.on_layer(0, 0, k, v)            # twice
    check.on_layer(0, 1, k, v)            # not the stored layer 1
    check.on_text(1, [3, 4, 99])          # wrong token ids
    assert [kind for kind, _ in check.finish(layers=2)] == ["duplicated", "wrong_data", "wrong_data"]

    check = load._Check(ctx, decode=False)
    check.on_layer(0, 0, None, None)
    assert [kind for kind, _ in check.finish(layers=2)] == ["lost", "lost"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_json_run_with_two_senders(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["bench", "load", "--quick", "--senders", "2", "--json"])
    assert args.handler(args) == 0
    out = json.loads(capsys.readouterr().out)

    assert out["errors"] == 0, out["error_samples"]
    assert out["errors_by_kind"] == dict.fromkeys(load.ERROR_KINDS, 0)
    assert out["ok"] is True
    assert out["config"]["sessions"] == 16 and out["config"]["senders"] == 2
    assert out["fetches"] >= 16
    assert 0 <= out["text_fetches"] <= out["fetches"] and 0 <= out["slo_misses"] <= out["fetches"]
    sizes = {c["context_id"]: c["chunks"] for c in out["contexts"]}
    assert len(sizes) == 2 and all(mb > 0 for mb in out["context_mb"])
    assert out["goodput_mb_per_second"] > 0 and out["fetches_per_second"] > 0
    for key in ("chunk_latency_ms", "fetch_latency_ms"):
        assert 0 < out[key]["p50"] <= out[key]["p99"]
    for who in ("senders", "receiver"):
        assert out["rss"][who]["peak_mb"] > 0 and out["rss"][who]["start_mb"] > 0
        assert set(out["rss"][who]) >= {"start_mb", "baseline_mb", "end_mb", "growth", "max_growth"}
    # this process's malloc runs as the receiver daemon's (tuned and trimmed) on glibc
    from streamer.receiver import malloc
    assert ("trimmed every 2 s" in out["config"]["receiver_malloc"]) == malloc.Malloc.here().available
    assert len(out["samples"]) >= 2
    # both senders served (round-robin), one session per fetch plus the profile warm-up
    m = out["sender_metrics"]
    assert len(m["per_sender_sessions"]) == 2 and min(m["per_sender_sessions"]) >= 8
    assert m["sessions_total"] == out["fetches"] + 1
    # a receiver may close right after its last chunk, before the sender's final drain
    # returned: that chunk then counts as connection_lost on the sender, never as anything else
    assert set(m["errors_by_code"]) <= {"connection_lost"}
    assert {c["check"].split(" ")[0] for c in out["checks"]} >= {"zero", "RSS"}
