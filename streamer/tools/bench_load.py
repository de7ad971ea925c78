"""``kvwire bench load``: many concurrent receivers against one sender, for a while (issue #8).

A small synthetic context is put into a temporary file store; one sender daemon (with
metrics) runs in a *child process* on loopback, and ``--sessions`` receivers run in this
process (uvloop when installed), each opening a ``StreamSession`` and fetching the whole
context at a fixed level, again and again, until ``--seconds`` are up (or Ctrl-C). A new
session per fetch, so session set-up and tear-down are under load too.

Reported: errors (a fetch that raised, or came back incomplete or with text chunks; must
be zero), throughput (fetches/s, MB/s of chunk bytes), p50/p99 chunk latency
(``ChunkReport.seconds``: request sent -> last byte) and fetch latency, peak RSS (VmHWM)
of the sender and the receiver processes, and RSS growth: both are sampled every
``--sample-seconds``; growth is the last sample over the first one after the warm-up
(a quarter of the run, at most 10 s). ``--soak`` runs until Ctrl-C (or ``--seconds``)
and fails unless the growth stays under ``--max-growth`` (default 20%); the exit code
is non-zero on any error, or on too much growth in ``--soak``.

``--quick``: 16 sessions for 3 s (for tests); ``--json``: print a dict.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import resource
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

CONTEXT = "load-ctx"


@dataclass(frozen=True)
class LoadConfig:
    sessions: int = 256
    seconds: float = 60.0          # math.inf: until Ctrl-C
    soak: bool = False
    sample_seconds: float = 2.0
    max_growth: float = 0.20       # soak: allowed RSS growth after the warm-up
    decode: bool = True            # receivers really decode (else only the plumbing runs)
    layers: int = 2
    heads: int = 4
    head_dim: int = 64
    chunk_tokens: int = 64
    chunks: int = 4
    level: int = 3
    calibration_tokens: int = 512


FULL = LoadConfig()
QUICK = LoadConfig(sessions=16, seconds=3.0, sample_seconds=0.5)

_RESERVOIR = 100_000   # latency samples kept (uniform reservoir): memory stays flat in a soak


# ----------------------------------------------------------------------- memory
def rss_bytes() -> dict[str, int]:
    """This process's resident set now (VmRSS) and its peak (VmHWM), in bytes."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value = line.split(":", 1)
                    out["rss" if key == "VmRSS" else "peak"] = int(value.split()[0]) * 1024
    except OSError:
        pass
    if "peak" not in out:   # ru_maxrss: kB on Linux, bytes on macOS
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out["peak"] = peak if sys.platform == "darwin" else peak * 1024
    out.setdefault("rss", out["peak"])
    return out


# ----------------------------------------------------------------------- context
async def _build(cfg: LoadConfig, root: str) -> dict[str, Any]:
    import torch

    import codec
    from codec.synthetic import synthetic_kv

    from streamer.store.put import put_context
    from streamer.store import open_store

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        shape = (cfg.layers, cfg.heads, cfg.head_dim)
        profile = await asyncio.to_thread(codec.calibrate, [synthetic_kv(*shape, cfg.calibration_tokens, seed=1)])
        tokens = cfg.chunks * cfg.chunk_tokens
        kv = synthetic_kv(*shape, tokens, seed=2).to(torch.float16)
        store = await open_store(root)
        try:
            manifest = await put_context(store, CONTEXT, kv, [(7 * i) % 32000 for i in range(tokens)],
                                         profile=profile, chunk_tokens=cfg.chunk_tokens, levels=(cfg.level,))
        finally:
            await store.close()
    finally:
        torch.set_num_threads(threads)
    return {"chunks": len(manifest.chunks), "tokens": manifest.tokens,
            "context_bytes": sum(c.sizes[cfg.level] for c in manifest.chunks)}


# ------------------------------------------------------------------ sender process
_METRICS = (("sessions_total", "kvwire_sender_sessions_total", {}),
            ("sessions_open", "kvwire_sender_sessions_open", {}),
            ("refused_total", "kvwire_sender_sessions_refused_total", {}),
            ("sent_bytes_total", "kvwire_sender_sent_bytes_total", {}),
            ("text_fallbacks_total", "kvwire_sender_text_fallbacks_total", {}),
            ("chunk_requests", "kvwire_sender_request_seconds_count", {"kind": "chunk"}))


def _sender_process(root: str, sessions: int, level: int, conn: Any) -> None:
    """Child: a sender with metrics; answers "rss", "metrics" and "stop" over the pipe."""
    async def main() -> None:
        from streamer.net.sender import ServerConfig, serve
        from streamer.store import open_store

        store = await open_store(root)
        sender = await serve(store, config=ServerConfig(metrics=True, max_sessions=max(1024, 2 * sessions)))
        metrics = sender.metrics
        assert metrics is not None
        conn.send({"port": sender.port})
        loop = asyncio.get_running_loop()
        while True:
            command = await loop.run_in_executor(None, conn.recv)
            if command == "rss":
                conn.send(rss_bytes())
            elif command == "metrics":
                values = {key: metrics.value(name, **labels) for key, name, labels in _METRICS}
                values["chunks_total"] = metrics.value("kvwire_sender_chunks_total", level=str(level))
                by_code = {s.labels["code"]: s.value for fam in metrics.registry.collect()
                           if fam.name == "kvwire_sender_errors" for s in fam.samples
                           if s.name.endswith("_total")}
                values["errors_by_code"] = by_code
                values["errors_total"] = sum(by_code.values())
                values["sessions_now"] = sender.sessions
                conn.send(values)
            else:
                break
        await sender.close()
        await store.close()
        conn.send("stopped")

    from streamer.tools.serve_fetch import run_async

    run_async(main)


class _SenderChild:
    def __init__(self, root: str, sessions: int, level: int) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")   # never fork a process with torch/numba threads
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_sender_process, args=(root, sessions, level, child), daemon=True,
                                 name="kvwire-bench-load-sender")
        self._proc.start()
        child.close()
        self._lock = asyncio.Lock()
        self.port = 0

    async def start(self, timeout: float = 120.0) -> None:
        if not await asyncio.to_thread(self._conn.poll, timeout):
            raise RuntimeError("the sender process did not start")
        self.port = self._conn.recv()["port"]

    async def ask(self, command: str) -> Any:
        async with self._lock:
            self._conn.send(command)
            return await asyncio.to_thread(self._conn.recv)

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            async with self._lock:
                self._conn.send("stop")
                await asyncio.to_thread(self._conn.poll, 30.0)
        await asyncio.to_thread(self._proc.join, 15.0)
        if self._proc.is_alive():
            self._proc.kill()
            await asyncio.to_thread(self._proc.join, 5.0)


# ------------------------------------------------------------------------ measuring
class _Reservoir:
    """A uniform sample of at most ``size`` values (bounded memory, however long the run)."""

    def __init__(self, size: int = _RESERVOIR, seed: int = 0) -> None:
        self.size, self.seen, self.values = size, 0, []
        self._random = random.Random(seed)

    def add(self, value: float) -> None:
        self.seen += 1
        if len(self.values) < self.size:
            self.values.append(value)
        else:
            slot = self._random.randrange(self.seen)
            if slot < self.size:
                self.values[slot] = value

    def percentiles(self, *qs: float) -> dict[str, float | None]:
        ordered = sorted(self.values)
        out: dict[str, float | None] = {}
        for q in qs:
            key = f"p{q:g}"
            if not ordered:
                out[key] = None
            else:
                out[key] = ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]
        return out


class _Stats:
    def __init__(self) -> None:
        self.fetches = 0
        self.errors = 0
        self.error_samples: list[str] = []
        self.bytes = 0
        self.chunks = 0
        self.text_chunks = 0
        self.retries = 0
        self.reconnects = 0
        self.chunk_seconds = _Reservoir(seed=1)
        self.fetch_seconds = _Reservoir(seed=2)

    def error(self, message: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 10:
            self.error_samples.append(message)


def _noop_decode(header: Any, profile: Any, layer: int, section: Any) -> tuple[None, None]:
    return None, None


def _ignore(*args: Any) -> None:
    return None


async def _receiver(port: int, cfg: LoadConfig, expected_chunks: int, stop: asyncio.Event,
                    stats: _Stats) -> None:
    """Fetch the context again and again, a new session each time, until ``stop``."""
    from streamer.net.session import StreamSession

    while not stop.is_set():
        try:
            async with StreamSession("127.0.0.1", port, CONTEXT, slo=600.0, policy=f"fixed:{cfg.level}",
                                     on_layer=_ignore, on_text=_ignore, connect_timeout=30.0,
                                     stall_timeout=30.0) as session:
                if not cfg.decode:
                    session._decode = _noop_decode   # private: skips only the codec work
                report = await session.fetch()
        except Exception as exc:   # counted, not raised: the run goes on
            stats.error(f"{type(exc).__name__}: {exc}")
            continue
        stats.fetches += 1
        stats.fetch_seconds.add(report.total_seconds)
        stats.bytes += report.bytes
        stats.reconnects += report.reconnects
        text = 0
        for chunk in report.chunks:
            stats.chunks += 1
            stats.retries += chunk.retries
            if chunk.level == "text":
                text += 1
            else:
                stats.chunk_seconds.add(chunk.seconds)
        stats.text_chunks += text
        if len(report.chunks) != expected_chunks or text:
            stats.error(f"incomplete fetch: {len(report.chunks)}/{expected_chunks} chunks, {text} as text")


def _growth(samples: list[dict[str, Any]], key: str, warmup: float) -> dict[str, Any]:
    """RSS at the first sample after the warm-up, at the end, and the growth between."""
    after = [s for s in samples if s["t"] >= warmup]
    if len(after) < 2:
        return {"baseline_mb": None, "end_mb": None, "max_mb": None, "growth": None}
    base, end = after[0][key], after[-1][key]
    return {"baseline_mb": base / 1e6, "end_mb": end / 1e6, "max_mb": max(s[key] for s in after) / 1e6,
            "growth": (end - base) / base if base else None}


# ---------------------------------------------------------------------------- run
async def run(cfg: LoadConfig) -> dict[str, Any]:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):   # Ctrl-C ends the run; the report still prints
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    try:
        with tempfile.TemporaryDirectory(prefix="kvwire-bench-load-") as root:
            built = await _build(cfg, root)
            child = _SenderChild(root, cfg.sessions, cfg.level)
            try:
                await child.start()
                return await _measure(cfg, built, child, stop)
            finally:
                await child.stop()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


async def _measure(cfg: LoadConfig, built: dict[str, Any], child: _SenderChild,
                   stop: asyncio.Event) -> dict[str, Any]:
    from streamer.net.session import StreamSession

    # the profile once (receivers cache it per process), so the run measures steady state
    async with StreamSession("127.0.0.1", child.port, CONTEXT, connect_timeout=30.0):
        pass
    stats = _Stats()
    samples: list[dict[str, Any]] = []
    start = time.monotonic()

    async def sample() -> None:
        tx = await child.ask("rss")
        rx = rss_bytes()
        samples.append({"t": time.monotonic() - start, "receiver_rss": rx["rss"], "sender_rss": tx["rss"],
                        "receiver_peak": rx["peak"], "sender_peak": tx["peak"],
                        "fetches": stats.fetches, "errors": stats.errors})

    async def sampler() -> None:
        while not stop.is_set():
            await sample()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), cfg.sample_seconds)

    async def timer() -> None:
        if math.isfinite(cfg.seconds):
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), cfg.seconds)
            stop.set()

    receivers = [asyncio.create_task(_receiver(child.port, cfg, built["chunks"], stop, stats))
                 for _ in range(cfg.sessions)]
    sampling = asyncio.create_task(sampler())
    timing = asyncio.create_task(timer())
    try:
        await stop.wait()
        end_requests = time.monotonic()
        # the fetches under way finish (they were started in time); never hang on one
        done, pending = await asyncio.wait(receivers, timeout=60.0)
        for task in pending:
            task.cancel()
            stats.error("fetch still running 60 s after the end of the run")
        for task in done:
            if task.exception() is not None:
                stats.error(f"receiver task failed: {task.exception()!r}")
    finally:
        for task in (*receivers, sampling, timing):
            task.cancel()
        await asyncio.gather(*receivers, sampling, timing, return_exceptions=True)
    wall = time.monotonic() - start
    await sample()
    sender_metrics = await child.ask("metrics")
    return _result(cfg, built, stats, samples, wall, end_requests - start, sender_metrics)


def _result(cfg: LoadConfig, built: dict[str, Any], stats: _Stats, samples: list[dict[str, Any]],
            wall: float, requested: float, sender_metrics: dict[str, Any]) -> dict[str, Any]:
    warmup = min(10.0, requested / 4)
    rx_growth = _growth(samples, "receiver_rss", warmup)
    tx_growth = _growth(samples, "sender_rss", warmup)
    last = samples[-1]
    chunk_p = stats.chunk_seconds.percentiles(50, 99)
    fetch_p = stats.fetch_seconds.percentiles(50, 99)
    ms = lambda v: None if v is None else v * 1e3   # noqa: E731
    out: dict[str, Any] = {
        "config": {**asdict(cfg), "seconds": cfg.seconds if math.isfinite(cfg.seconds) else None,
                   **built, "loop": _loop_name(), "cpus": os.cpu_count()},
        "wall_seconds": wall, "run_seconds": requested,
        "fetches": stats.fetches, "errors": stats.errors, "error_samples": stats.error_samples,
        "chunks": stats.chunks, "text_chunks": stats.text_chunks, "retries": stats.retries,
        "reconnects": stats.reconnects, "bytes": stats.bytes,
        "fetches_per_second": stats.fetches / wall if wall > 0 else 0.0,
        "mb_per_second": stats.bytes / wall / 1e6 if wall > 0 else 0.0,
        "chunk_latency_ms": {k: ms(v) for k, v in chunk_p.items()},
        "fetch_latency_ms": {k: ms(v) for k, v in fetch_p.items()},
        "latency_samples": len(stats.chunk_seconds.values),
        "rss": {
            "warmup_seconds": warmup,
            "receiver": {"peak_mb": last["receiver_peak"] / 1e6, **rx_growth},
            "sender": {"peak_mb": last["sender_peak"] / 1e6, **tx_growth},
        },
        "sender_metrics": sender_metrics,
        "samples": [{"t": round(s["t"], 2), "receiver_rss_mb": round(s["receiver_rss"] / 1e6, 1),
                     "sender_rss_mb": round(s["sender_rss"] / 1e6, 1), "fetches": s["fetches"],
                     "errors": s["errors"]} for s in samples],
    }
    growths = [g["growth"] for g in (rx_growth, tx_growth)]
    checks = [{"check": "zero errors", "measured": stats.errors, "ok": stats.errors == 0},
              {"check": "at least one fetch per session", "measured": stats.fetches,
               "ok": stats.fetches >= cfg.sessions}]
    growth_ok = all(g is None or g < cfg.max_growth for g in growths)
    checks.append({"check": f"RSS growth after the warm-up < {cfg.max_growth:.0%} (sender and receiver)"
                            + ("" if cfg.soak else " (informative outside --soak)"),
                   "measured": max((g for g in growths if g is not None), default=None),
                   "ok": growth_ok if any(g is not None for g in growths) else None})
    out["checks"] = checks
    out["ok"] = stats.errors == 0 and (growth_ok or not cfg.soak)
    return out


def _loop_name() -> str:
    loop = asyncio.get_running_loop()
    return f"{type(loop).__module__}.{type(loop).__name__}"


# -------------------------------------------------------------------------- output
def render(out: dict[str, Any]) -> str:
    cfg, rss = out["config"], out["rss"]
    fmt = lambda v, spec=".2f": "-" if v is None else format(v, spec)   # noqa: E731
    seconds = "until Ctrl-C" if cfg["seconds"] is None else f"{cfg['seconds']:g} s"
    lines = [
        f"kvwire bench load: {cfg['sessions']} sessions, {seconds}{' (soak)' if cfg['soak'] else ''}; "
        f"context {cfg['chunks']} chunks x {cfg['chunk_tokens']} tokens at level {cfg['level']} "
        f"({cfg['context_bytes'] / 1e3:.1f} kB), {cfg['layers']}x{cfg['heads']}x{cfg['head_dim']}, "
        f"decode {'on' if cfg['decode'] else 'off'}; {cfg['cpus']} CPUs, receiver loop {cfg['loop']}",
        f"ran {out['run_seconds']:.1f} s (wall {out['wall_seconds']:.1f} s): {out['fetches']} fetches, "
        f"{out['errors']} errors, {out['text_chunks']} text chunks, {out['retries']} retries, "
        f"{out['reconnects']} reconnects",
        f"throughput: {out['fetches_per_second']:.1f} fetches/s, {out['mb_per_second']:.2f} MB/s of chunks",
        f"chunk latency: p50 {fmt(out['chunk_latency_ms']['p50'])} ms, p99 {fmt(out['chunk_latency_ms']['p99'])} ms; "
        f"fetch latency: p50 {fmt(out['fetch_latency_ms']['p50'])} ms, p99 {fmt(out['fetch_latency_ms']['p99'])} ms",
    ]
    for who in ("sender", "receiver"):
        r = rss[who]
        growth = "-" if r["growth"] is None else f"{r['growth']:+.1%}"
        lines.append(f"{who} RSS: peak {r['peak_mb']:.1f} MB; after {rss['warmup_seconds']:.1f} s warm-up "
                     f"{fmt(r['baseline_mb'], '.1f')} -> {fmt(r['end_mb'], '.1f')} MB ({growth})")
    m = out["sender_metrics"]
    lines.append(f"sender metrics: {m['sessions_total']:.0f} sessions, {m['chunks_total']:.0f} chunks, "
                 f"{m['sent_bytes_total'] / 1e6:.1f} MB sent, errors {m['errors_by_code'] or 0}")
    for sample in out["error_samples"]:
        lines.append(f"  error: {sample}")
    lines.append("checks:")
    for c in out["checks"]:
        state = "-" if c["ok"] is None else ("ok" if c["ok"] else "FAILED")
        lines.append(f"  [{state}] {c['check']}: {c['measured']}")
    return "\n".join(lines)


def main(cfg: LoadConfig, as_json: bool = False) -> dict[str, Any]:
    from streamer.tools.serve_fetch import run_async

    out = run_async(lambda: run(cfg))
    print(json.dumps(out, indent=2) if as_json else render(out), flush=True)
    return out


def _config(args: argparse.Namespace) -> LoadConfig:
    cfg = QUICK if args.quick else FULL
    seconds = args.seconds if args.seconds is not None else (math.inf if args.soak else cfg.seconds)
    changes: dict[str, Any] = {"seconds": seconds, "soak": args.soak, "decode": not args.no_decode}
    if args.sessions is not None:
        changes["sessions"] = args.sessions
    if args.sample_seconds is not None:
        changes["sample_seconds"] = args.sample_seconds
    if args.max_growth is not None:
        changes["max_growth"] = args.max_growth
    if changes.get("sessions", cfg.sessions) < 1:
        raise SystemExit("kvwire bench load: --sessions must be >= 1")
    if not seconds > 0:
        raise SystemExit("kvwire bench load: --seconds must be > 0")
    return replace(cfg, **changes)


def _cmd_load(args: argparse.Namespace) -> int:
    out = main(_config(args), as_json=args.json)
    return 0 if out["ok"] else 1


def register(subparsers: argparse._SubParsersAction, bench_subparsers: argparse._SubParsersAction) -> None:
    """Add ``kvwire bench load``."""
    b = bench_subparsers.add_parser(
        "load", help="load and soak: many concurrent sessions against one sender",
        description="Serve a small context from a sender process on loopback and fetch it from "
                    "many concurrent receivers, repeatedly, for a while: errors, throughput, chunk "
                    "latency, peak RSS and RSS growth of sender and receivers.")
    b.add_argument("--sessions", type=int, help="concurrent receivers (default 256; --quick 16)")
    b.add_argument("--seconds", type=float, help="run length (default 60; --quick 3; --soak: until Ctrl-C)")
    b.add_argument("--soak", action="store_true",
                   help="run until Ctrl-C (or --seconds) and fail if RSS grows more than --max-growth")
    b.add_argument("--max-growth", type=float, help="allowed RSS growth after the warm-up (default 0.2)")
    b.add_argument("--sample-seconds", type=float, help="RSS sampling period (default 2; --quick 0.5)")
    b.add_argument("--no-decode", action="store_true", help="receivers skip the codec work")
    b.add_argument("--quick", action="store_true", help="16 sessions for 3 s (for tests)")
    b.add_argument("--json", action="store_true", help="print machine-readable JSON")
    b.set_defaults(handler=_cmd_load)


if __name__ == "__main__":  # python -m streamer.tools.bench_load [options]
    _parser = argparse.ArgumentParser(prog="python -m streamer.tools.bench_load")
    _sub = _parser.add_subparsers(dest="bench", required=True)
    register(_sub, _sub)
    _args = _parser.parse_args(["load", *sys.argv[1:]])
    sys.exit(_args.handler(_args))
