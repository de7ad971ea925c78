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


async def test_the_profile_is_fetched_over_the_wire_or_the_bench_fails(tmp_path) -> None:
    """bench stream warms the session's profile cache over the wire and says how big the
    profile was and how long it took; a sender that cannot give it is an error, never a
    silent read of the store."""
    import codec
    import streamer
    from streamer.net import session as session_module
    from streamer_helpers import synthetic_kv
    from test_streamer_store import closed_port

    profile = codec.calibrate([synthetic_kv(1, 512, 2, 2, 16)])
    async with await streamer.open_store(str(tmp_path)) as store:
        await streamer.put_context(store, bench.BIG, synthetic_kv(0, 128, 2, 2, 16), list(range(128)),
                                   profile=profile, chunk_tokens=64)
    session_module._profiles.clear()
    with pytest.raises(RuntimeError, match="could not fetch the profile from the sender"):
        await bench._warm_profile(closed_port())
    assert profile.id not in session_module._profiles
    async with await streamer.open_store(str(tmp_path)) as store:
        sender = await streamer.serve(store)
        try:
            warmed = await bench._warm_profile(sender.port)
        finally:
            await sender.close()
    assert warmed["profile_bytes"] == len(profile.to_bytes()) and warmed["profile_fetch_seconds"] > 0
    assert profile.id in session_module._profiles


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

    assert out["config"]["profile_bytes"] > 0 and "profile_over_wire" not in out["config"]
    for target in out["targets"]:
        assert set(target) >= {"target", "measured", "unit", "met"} and isinstance(target["met"], bool)
    assert len(out["targets"]) == 2 * 2 + 2 + 2
