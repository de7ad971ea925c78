"""``kvwire bench netsim``: how faithfully the two shapers hold and follow a rate.

Proxy: ``loadgen`` sender and sink run as child processes on loopback, the proxy runs in
this process, so this process's CPU time is the proxy's. Kernel: sender and sink run in
two namespaces across a ``tbf``-shaped veth; goodput is compared with the frame-adjusted
rate ``rate * 1448 / 1514`` (tbf counts Ethernet frames, TCP delivers 1448 of every 1514
bytes at MTU 1500). Rate-change response is the delay from a change until a 100 ms
window of received bytes is within 10% of the new rate.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from netsim.proxy import ShapingProxy

PROXY_RATES = (10, 100, 1000)
NETNS_RATES = (50, 500, 2000)
SECONDS_PER_RATE = 2.0
FRAME_FACTOR = 1448 / 1514
WINDOW_S = 0.1
TOLERANCE = 0.10


def follow_time(timeline: Sequence[Sequence[float]], t_change: float, new_mbit: float,
                window_s: float = WINDOW_S, tol: float = TOLERANCE) -> float | None:
    """Seconds from ``t_change`` until a ``window_s`` window of the sink's cumulative
    ``[t, bytes]`` timeline first averages within ``tol`` of ``new_mbit``; None if never."""
    points = [(t, b) for t, b in timeline if t >= t_change]
    for i, (t0, b0) in enumerate(points):
        for t1, b1 in points[i + 1:]:
            if t1 - t0 >= window_s:
                if abs((b1 - b0) * 8 / (t1 - t0) / 1e6 - new_mbit) <= tol * new_mbit:
                    return t0 - t_change
                break
    return None


def _loadgen(*args: str) -> list[str]:
    return [sys.executable, "-m", "netsim.loadgen", *args]


def _env() -> dict[str, str]:
    """Children import netsim from this checkout even when it is not pip-installed."""
    root = str(Path(__file__).resolve().parent.parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}


# --------------------------------------------------------------------- proxy
async def _proxy_run(rate_mbit: float, nbytes: int, changes: Sequence[tuple[float, float]] = ()) -> dict:
    sink = await asyncio.create_subprocess_exec(*_loadgen("sink"), stdout=subprocess.PIPE, env=_env())
    assert sink.stdout is not None
    port = int((await sink.stdout.readline()).split()[1])
    async with ShapingProxy(upstream=("127.0.0.1", port), trace=rate_mbit) as proxy:
        cpu0, wall0 = time.process_time(), time.monotonic()
        sender = await asyncio.create_subprocess_exec(
            *_loadgen("send", "--to", f"127.0.0.1:{proxy.port}", "--bytes", str(nbytes)),
            stdout=subprocess.DEVNULL, env=_env())
        applied = []
        for at, new in changes:
            await asyncio.sleep(max(0.0, wall0 + at - time.monotonic()))
            proxy.set_trace(new)
            applied.append((time.monotonic(), new))
        await sender.wait()
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    result = json.loads(await sink.stdout.read())
    await sink.wait()
    return {"sink": result, "cpu_s": cpu, "wall_s": wall, "changes": applied}


async def _proxy_bench() -> dict:
    rates = []
    for rate in PROXY_RATES:
        run = await _proxy_run(rate, int(rate * 1e6 / 8 * SECONDS_PER_RATE))
        got = run["sink"]["mbit_per_s"]
        rates.append({"configured_mbit": rate, "achieved_mbit": round(got, 2),
                      "error_pct": round((got / rate - 1) * 100, 2), "proxy_cpu_s": round(run["cpu_s"], 3),
                      "wall_s": round(run["wall_s"], 2),
                      "cpu_pct_of_core": round(100 * run["cpu_s"] / run["wall_s"], 1)})
    steps = [(1.0, 400.0), (2.0, 100.0)]
    nbytes = int((100 + 400 + 100) * 1e6 / 8)
    run = await _proxy_run(100, nbytes, steps)
    change = [{"from_mbit": old, "to_mbit": new, "response_s": _round(follow_time(run["sink"]["timeline"], t, new))}
              for (t, new), old in zip(run["changes"], [100.0] + [n for _, n in steps])]
    return {"rates": rates, "rate_change": change}


# --------------------------------------------------------------------- netns
def _netns_run(rate_mbit: float, nbytes: int, changes: Sequence[tuple[float, float]] = ()) -> dict:
    from netsim.netns import netns_link

    with netns_link(rate_mbit) as link:
        sink = link.popen_in("b", _loadgen("sink", "--bind", link.ip_b, "--port", "5201"),
                             stdout=subprocess.PIPE, text=True, env=_env())
        assert sink.stdout is not None
        sink.stdout.readline()
        start = time.monotonic()
        sender = link.popen_in("a", _loadgen("send", "--to", f"{link.ip_b}:5201", "--bytes", str(nbytes)),
                               stdout=subprocess.DEVNULL, env=_env())
        applied = []
        for at, new in changes:
            time.sleep(max(0.0, start + at - time.monotonic()))
            link.set_rate(new)
            applied.append((time.monotonic(), new))
        sender.wait(timeout=60)
        result = json.loads(sink.stdout.readline())
        sink.wait(timeout=10)
    return {"sink": result, "changes": applied}


def _netns_bench() -> dict:
    from netsim.netns import netns_available

    ok, reason = netns_available()
    if not ok:
        return {"available": False, "reason": reason}
    rates = []
    for rate in NETNS_RATES:
        run = _netns_run(rate, int(rate * 1e6 / 8 * SECONDS_PER_RATE))
        got, want = run["sink"]["mbit_per_s"], rate * FRAME_FACTOR
        rates.append({"tbf_mbit": rate, "expected_goodput_mbit": round(want, 2), "goodput_mbit": round(got, 2),
                      "error_pct": round((got / want - 1) * 100, 2)})
    steps = [(1.0, 1000.0), (2.0, 200.0)]
    run = _netns_run(200, int((200 + 1000 + 200) * 1e6 / 8), steps)
    change = [{"from_mbit": old, "to_mbit": new,
               "response_s": _round(follow_time(run["sink"]["timeline"], t, new * FRAME_FACTOR))}
              for (t, new), old in zip(run["changes"], [200.0] + [n for _, n in steps])]
    return {"available": True, "rates": rates, "rate_change": change}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


# --------------------------------------------------------------------- report
def run_bench() -> dict:
    return {"proxy": asyncio.run(_proxy_bench()), "netns": _netns_bench()}


def format_report(res: dict) -> str:
    lines = ["ShapingProxy on loopback (target: within 3% of the configured rate)",
             f"  {'rate Mbit/s':>12} {'achieved':>10} {'error %':>8} {'proxy CPU s':>12} {'CPU % core':>11}"]
    for r in res["proxy"]["rates"]:
        lines.append(f"  {r['configured_mbit']:>12} {r['achieved_mbit']:>10.2f} {r['error_pct']:>8.2f} "
                     f"{r['proxy_cpu_s']:>12.3f} {r['cpu_pct_of_core']:>11.1f}")
    for c in res["proxy"]["rate_change"]:
        lines.append(f"  set_trace {c['from_mbit']:g} -> {c['to_mbit']:g} Mbit/s: "
                     f"followed in {_fmt_s(c['response_s'])}")
    ns = res["netns"]
    lines.append("")
    if not ns["available"]:
        lines.append(f"netns + tc tbf: skipped ({ns['reason']})")
        return "\n".join(lines)
    lines += ["netns + tc tbf over veth (goodput vs rate x 1448/1514, the frame-adjusted rate; target 5%)",
              f"  {'tbf Mbit/s':>12} {'expected':>10} {'goodput':>10} {'error %':>8}"]
    for r in ns["rates"]:
        lines.append(f"  {r['tbf_mbit']:>12} {r['expected_goodput_mbit']:>10.2f} {r['goodput_mbit']:>10.2f} "
                     f"{r['error_pct']:>8.2f}")
    for c in ns["rate_change"]:
        lines.append(f"  tc change {c['from_mbit']:g} -> {c['to_mbit']:g} Mbit/s: followed in "
                     f"{_fmt_s(c['response_s'])} (target < 0.5 s)")
    return "\n".join(lines)


def _fmt_s(x: float | None) -> str:
    return "never" if x is None else f"{x * 1000:.0f} ms"


def main(as_json: bool = False) -> int:
    res = run_bench()
    print(json.dumps(res, indent=2) if as_json else format_report(res))
    return 0
