"""``kvwire bench stream --quick --json`` runs end to end: structure and completion only,
no timing thresholds (the machine may be busy)."""
from __future__ import annotations

import json

import pytest

from streamer.tools import bench_stream as bench
from streamer.tools.cli import build_parser


def test_register_adds_bench_stream() -> None:
    args = build_parser().parse_args(["bench", "stream", "--quick", "--json"])
    assert args.quick and args.json and args.handler is bench._cmd_bench


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_json_run_completes(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["bench", "stream", "--quick", "--json"])
    assert args.handler(args) == 0
    out = json.loads(capsys.readouterr().out)

    assert set(out) >= {"config", "links", "concurrency", "targets"}
    names = [link["link"] for link in out["links"]]
    assert names == ["100 Mbit/s", "1000 Mbit/s", "loopback", "loopback, no-op decode"]
    level = out["config"]["level"]
    for link in out["links"]:
        context = out["config"]["contexts"][link["context"]]
        assert link["chunks"] == link["expected_chunks"] == context["chunks"]
        assert link["bytes"] == context["bytes"] > 0
        assert link["levels"] == [str(level)]
        assert link["reconnects"] == 0
        assert link["transfer_seconds"] > 0 and link["total_seconds"] > 0
        assert link["goodput_mbit"] > 0
    assert out["links"][0]["rate_mbit"] == 100.0 and out["links"][2]["rate_mbit"] is None
    assert out["links"][3]["decode"] is False and out["links"][3]["decode_mbit"] is None

    conc = out["concurrency"]
    assert conc["sessions"] == 64 == len(conc["per_session"])
    assert conc["completed"] == conc["sessions"]
    small = out["config"]["contexts"]["bench-small"]
    for session in conc["per_session"]:
        assert session["completed"], session
        assert session["chunks"] == small["chunks"] and session["bytes"] == small["bytes"]
    assert conc["bytes"] == 64 * small["bytes"]

    for target in out["targets"]:
        assert set(target) >= {"target", "measured", "unit", "met"} and isinstance(target["met"], bool)
    assert len(out["targets"]) == 2 * 2 + 2 + 2
