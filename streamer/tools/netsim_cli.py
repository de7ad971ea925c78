"""``kvwire netsim ...`` and ``kvwire bench netsim``.

Heavy modules (the proxy, the netns harness, the benchmark) are imported inside the
handlers, so building the ``kvwire`` parser stays cheap.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import sys
import time
from pathlib import Path

from netsim.shaping import Cut, Stall
from netsim.trace import Trace


def register(subparsers: argparse._SubParsersAction, bench_subparsers: argparse._SubParsersAction) -> None:
    netsim = subparsers.add_parser("netsim", help="bandwidth emulation: shaping proxy, netns harness, traces")
    sub = netsim.add_subparsers(dest="netsim_command", metavar="SUBCOMMAND", required=True)

    p = sub.add_parser("proxy", help="run a shaping TCP proxy until Ctrl-C",
                       description="Forward --listen to --upstream through a shaped link (both directions).")
    p.add_argument("--listen", type=_hostport, default=("127.0.0.1", 0), metavar="HOST:PORT")
    p.add_argument("--upstream", type=_hostport, required=True, metavar="HOST:PORT")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--trace", help="trace CSV path or a name from `kvwire netsim traces`")
    rate.add_argument("--rate", type=float, metavar="MBIT", help="constant rate in Mbit/s")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per direction")
    p.add_argument("--jitter-ms", type=float, default=0.0, help="uniform +- jitter on the delay")
    p.add_argument("--stall", action="append", default=[], type=_stall, metavar="AT:DUR",
                   help="pause forwarding AT seconds into each connection for DUR seconds (repeatable)")
    cut = p.add_mutually_exclusive_group()
    cut.add_argument("--reset-at-s", type=float, metavar="S", help="RST each connection after S seconds")
    cut.add_argument("--reset-at-byte", type=int, metavar="N", help="RST after N bytes in the fault direction")
    cut.add_argument("--close-at-s", type=float, metavar="S", help="close (FIN) each connection after S seconds")
    cut.add_argument("--close-at-byte", type=int, metavar="N", help="close after N bytes in the fault direction")
    p.add_argument("--fault-direction", choices=("up", "down"), default="down",
                   help="direction carrying stalls and byte cuts (down = upstream->client)")
    p.add_argument("--duration", type=float, help="stop after this many seconds")
    p.set_defaults(handler=_cmd_proxy)

    n = sub.add_parser("netns", help="run CMD_A and CMD_B in two namespaces over a tc-shaped veth (root)",
                       description="Run CMD_B in namespace b (started first, e.g. a server), then CMD_A in "
                                   "namespace a; both see $KVW_SELF_IP and $KVW_PEER_IP. Example: "
                                   "kvwire netsim netns --rate 500 -- sh -c 'python -m netsim.loadgen send "
                                   "--to $KVW_PEER_IP:5201 --bytes 1e8' ::: python -m netsim.loadgen sink "
                                   "--bind 0.0.0.0 --port 5201")
    n.add_argument("--rate", type=float, metavar="MBIT", help="link rate (unshaped if omitted)")
    n.add_argument("--trace", help="follow this trace (CSV path or trace-set name) from the start of CMD_A")
    n.add_argument("--qdisc", choices=("tbf", "htb"), default="tbf")
    n.add_argument("--burst", type=int, default=256 * 1024, help="bytes (>= 256 KB for multi-Gbit/s)")
    n.add_argument("--settle", type=float, default=0.3, help="seconds between starting CMD_B and CMD_A")
    n.add_argument("commands", nargs=argparse.REMAINDER, metavar="-- CMD_A [::: CMD_B]")
    n.set_defaults(handler=_cmd_netns)

    t = sub.add_parser("traces", help="list the committed trace set with statistics")
    t.set_defaults(handler=_cmd_traces)

    b = bench_subparsers.add_parser("netsim", help="shaper accuracy: proxy rates, tbf goodput, rate changes")
    b.add_argument("--json", action="store_true", help="print machine-readable JSON")
    b.set_defaults(handler=_cmd_bench)


# --------------------------------------------------------------------- handlers
def _cmd_proxy(args: argparse.Namespace) -> int:
    from netsim.proxy import LinkSpec, ShapingProxy

    if args.trace:
        trace = _load_trace(args.trace)
    else:
        trace = Trace.constant(args.rate, 1.0) if args.rate is not None else None
    base = LinkSpec(trace=trace, delay_ms=args.delay_ms, jitter_ms=args.jitter_ms)
    cut = None
    for action, unit in (("reset", "s"), ("reset", "byte"), ("close", "s"), ("close", "byte")):
        value = getattr(args, f"{action}_at_{unit}")
        if value is not None:
            cut = Cut(action, at_s=value) if unit == "s" else Cut(action, at_byte=value)
    faulty = dataclasses.replace(base, stalls=tuple(args.stall), cut=cut)
    specs = {"up": base, "down": base, args.fault_direction: faulty}

    async def serve() -> None:
        async with ShapingProxy(upstream=args.upstream, up=specs["up"], down=specs["down"],
                                listen=args.listen) as proxy:
            host, port = proxy.address
            print(f"shaping {host}:{port} -> {args.upstream[0]}:{args.upstream[1]} "
                  f"(trace {base.trace!r}, delay {args.delay_ms} ms)", flush=True)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            try:
                await asyncio.wait_for(stop.wait(), timeout=args.duration)
            except asyncio.TimeoutError:
                pass
            s = proxy.stats
            print(f"{s.connections} connections, {s.up_bytes} bytes up, {s.down_bytes} bytes down")

    asyncio.run(serve())
    return 0


def _cmd_netns(args: argparse.Namespace) -> int:
    from netsim.netns import NetnsError, netns_link

    cmds = args.commands[1:] if args.commands[:1] == ["--"] else args.commands
    if not cmds:
        print("netns: give a command: -- CMD_A [::: CMD_B]", file=sys.stderr)
        return 2
    cmd_a, cmd_b = (cmds[:cmds.index(":::")], cmds[cmds.index(":::") + 1:]) if ":::" in cmds else (cmds, [])
    trace = _load_trace(args.trace) if args.trace else None
    rate = args.rate if args.rate is not None else (max(trace.rate_at(0), 0.01) if trace else None)
    try:
        with netns_link(rate, qdisc=args.qdisc, burst_bytes=args.burst) as link:
            print(f"namespaces {link.ns['a']} ({link.ip_a}) <-> {link.ns['b']} ({link.ip_b}), "
                  f"rate {rate if rate is not None else 'unshaped'} Mbit/s", file=sys.stderr, flush=True)
            if cmd_b:
                link.popen_in("b", cmd_b)
                time.sleep(args.settle)
            if trace is not None:
                link.play(trace)
            proc = link.popen_in("a", cmd_a)
            return proc.wait()
    except NetnsError as exc:
        print(f"netns: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _cmd_traces(args: argparse.Namespace) -> int:
    from netsim import trace_set

    print(f"{'trace':<22} {'duration s':>10} {'mean':>8} {'min':>8} {'p10':>8} {'max':>8}   (Mbit/s)")
    for name, t in trace_set().items():
        print(f"{name:<22} {t.duration:>10g} {t.mean:>8.0f} {t.low:>8.0f} {t.percentile(10):>8.0f} {t.high:>8.0f}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from streamer.tools import bench_netsim as bench

    return bench.main(as_json=args.json)


# --------------------------------------------------------------------- parsing
def _load_trace(spec: str) -> Trace:
    """A CSV path, or the name of a committed trace."""
    if Path(spec).exists():
        return Trace.load(spec)
    from netsim import trace_set

    traces = trace_set()
    if spec not in traces:
        raise SystemExit(f"no trace file or trace-set name {spec!r}; see `kvwire netsim traces`")
    return traces[spec]


def _hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host or "127.0.0.1", int(port)


def _stall(text: str) -> Stall:
    at, sep, dur = text.partition(":")
    try:
        return Stall(float(at), float(dur))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected AT:DURATION seconds, got {text!r}") from None

