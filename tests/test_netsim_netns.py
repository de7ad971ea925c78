"""The kernel shaping harness. Needs root and iproute2; skipped with the reason otherwise."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import netsim.netns as netns_mod
from netsim.netns import NetnsError, NetnsLink, netns_available, netns_link

ROOT = Path(__file__).resolve().parent.parent
LOADGEN = [sys.executable, "-m", "netsim.loadgen"]


def _snapshot() -> tuple[str, str]:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    return ns, links


def _leftovers(before: tuple[str, str]) -> list[str]:
    after = _snapshot()
    return [line for b, a in zip(before, after) for line in a.splitlines()
            if "kvw" in line and line not in b]


def test_netns_available_explains_itself() -> None:
    ok, reason = netns_available()
    assert isinstance(ok, bool) and reason


def test_clear_error_when_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns_mod, "netns_available", lambda: (False, "needs root (CAP_NET_ADMIN)"))
    with pytest.raises(NetnsError, match="needs root"):
        with netns_link(100):
            pass


@pytest.mark.netns
def test_setup_and_teardown_leave_nothing_behind() -> None:
    before = _snapshot()
    with netns_link(100) as link:
        assert link.ns["a"] in _snapshot()[0]
        done = link.run_in("a", [sys.executable, "-c", "import socket; print(socket.gethostname())"])
        assert done.returncode == 0
    assert _leftovers(before) == []


@pytest.mark.netns
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_teardown_also_when_the_body_raises(exc: type[BaseException]) -> None:
    before = _snapshot()
    proc = None
    with pytest.raises(exc):
        with netns_link(100) as link:
            proc = link.popen_in("b", ["sleep", "30"])
            raise exc("boom")
    assert proc is not None and proc.poll() is not None  # children are stopped too
    assert _leftovers(before) == []


@pytest.mark.netns
def test_parallel_links_do_not_clash() -> None:
    with netns_link(100) as one, netns_link(200) as two:
        assert set(one.ns.values()).isdisjoint(two.ns.values())
        assert set(one.dev.values()).isdisjoint(two.dev.values())
        for link in (one, two):
            link.run_in("a", [sys.executable, "-c",
                              f"import socket; socket.create_connection(('{link.ip_b}', 9), 1)"], check=False)


@pytest.mark.netns
def test_shaped_transfer_lands_near_the_rate() -> None:
    rate = 200
    env = {"PYTHONPATH": str(ROOT)}
    with netns_link(rate) as link:
        sink = link.popen_in("b", [*LOADGEN, "sink", "--bind", link.ip_b, "--port", "5201", "--timeout", "10"],
                             stdout=subprocess.PIPE, text=True, env=env)
        assert sink.stdout is not None
        assert sink.stdout.readline().startswith("PORT")
        link.run_in("a", [*LOADGEN, "send", "--to", f"{link.ip_b}:5201", "--bytes", str(25_000_000)],
                    timeout=20, env=env)
        result = json.loads(sink.stdout.readline())
    assert result["bytes"] == 25_000_000
    assert result["mbit_per_s"] == pytest.approx(rate * 1448 / 1514, rel=0.15)


@pytest.mark.netns
@pytest.mark.parametrize("qdisc", ["tbf", "htb"])
def test_set_rate_changes_the_qdisc(qdisc: str) -> None:
    with netns_link(100, qdisc=qdisc) as link:
        link.set_rate(750, burst_bytes=16 * 1024)
        what = "qdisc" if qdisc == "tbf" else "class"
        shown = subprocess.run(["tc", "-n", link.ns["a"], what, "show", "dev", link.dev["a"]],
                               capture_output=True, text=True).stdout
        assert "750Mbit" in shown
        assert link.burst_bytes >= 128 * 1024  # a small burst on change would stall flows


@pytest.mark.netns
def test_delay_needs_netem_and_says_so() -> None:
    before = _snapshot()
    try:
        with NetnsLink(100, delay_ms=20):
            pytest.skip("this kernel has sch_netem")
    except NetnsError as exc:
        assert "sch_netem" in str(exc) and "ShapingProxy" in str(exc)
    assert _leftovers(before) == []


@pytest.mark.netns
def test_play_follows_a_trace() -> None:
    from netsim.trace import Trace

    with netns_link(100) as link:
        link.play(Trace([0.0, 0.2], [100.0, 300.0]))
        assert link._player is not None
        link._player.join(timeout=3)
        shown = subprocess.run(["tc", "-n", link.ns["a"], "qdisc", "show", "dev", link.dev["a"]],
                               capture_output=True, text=True).stdout
    assert "300Mbit" in shown


@pytest.mark.netns
def test_cli_runs_both_commands(capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from streamer.tools import netsim_cli as cli

    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    cli.register(sub, sub.add_parser("bench").add_subparsers())
    args = parser.parse_args([
        "netsim", "netns", "--rate", "300", "--",
        "sh", "-c", f"{sys.executable} -m netsim.loadgen send --to $KVW_PEER_IP:5201 --bytes 5e6", ":::",
        *LOADGEN, "sink", "--bind", "0.0.0.0", "--port", "5201", "--timeout", "10"])
    assert args.handler(args) == 0
    out = capfd.readouterr().out
    assert '"bytes": 5000000' in out
