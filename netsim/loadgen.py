"""A minimal bulk-TCP load generator (sender and timestamping sink), iperf-style.

The benchmark runs it as separate processes, so the shaper's CPU time is measured alone
and the same tool works inside network namespaces. Blocking sockets with 1 MiB buffers
move several GB/s, far above any rate under test. The sink records a cumulative-bytes
timeline on ``time.monotonic()``; that clock is system-wide on Linux, so the benchmark
can line it up with the moment it changed a rate in another process.

    python -m netsim.loadgen sink --bind 127.0.0.1 --port 0     # prints "PORT n", then JSON
    python -m netsim.loadgen send --to 127.0.0.1:n --bytes 1e8
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import time

CHUNK = 1 << 20


def sink(bind: str, port: int, sample_s: float, timeout_s: float) -> dict:
    """Accept one connection, read to EOF, return byte count, first/last-byte times and a
    ``[[t, cumulative_bytes], ...]`` timeline sampled every ``sample_s``."""
    with socket.create_server((bind, port)) as server:
        server.settimeout(timeout_s)
        print(f"PORT {server.getsockname()[1]}", flush=True)
        conn, _ = server.accept()
    with conn:
        conn.settimeout(timeout_s)
        buf = bytearray(CHUNK)
        total = 0
        first = last = 0.0
        first_bytes = 0
        timeline: list[list[float]] = []
        next_sample = 0.0
        while n := conn.recv_into(buf):
            last = time.monotonic()
            if not total:
                first, first_bytes = last, n
            total += n
            if last >= next_sample:
                timeline.append([last, total])
                next_sample = last + sample_s
        if total:
            timeline.append([last, total])
    span = last - first
    # Bytes of the first read arrived before the clock started: leave them out.
    rate = (total - first_bytes) * 8 / span / 1e6 if span > 0 else 0.0
    return {"bytes": total, "first": first, "last": last, "mbit_per_s": rate, "timeline": timeline}


def send(host: str, port: int, nbytes: int, timeout_s: float) -> dict:
    payload = memoryview(bytes(CHUNK))
    with socket.create_connection((host, port), timeout=timeout_s) as conn:
        start = time.monotonic()
        left = nbytes
        while left > 0:
            n = min(left, CHUNK)
            conn.sendall(payload[:n])
            left -= n
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)  # wait for the sink's close so the caller's timing includes delivery
    return {"bytes": nbytes, "seconds": time.monotonic() - start}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m netsim.loadgen", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("sink", help="receive one connection, print JSON stats")
    s.add_argument("--bind", default="127.0.0.1")
    s.add_argument("--port", type=int, default=0)
    s.add_argument("--sample", type=float, default=0.01, help="timeline sample interval, seconds")
    s.add_argument("--timeout", type=float, default=60.0)
    t = sub.add_parser("send", help="send BYTES zero bytes, then half-close")
    t.add_argument("--to", required=True, metavar="HOST:PORT")
    t.add_argument("--bytes", type=float, required=True, help="accepts 1e8 style")
    t.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    if args.mode == "sink":
        result = sink(args.bind, args.port, args.sample, args.timeout)
    else:
        host, _, port = args.to.rpartition(":")
        result = send(host, int(port), int(args.bytes), args.timeout)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
