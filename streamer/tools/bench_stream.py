"""``kvwire bench stream``: end-to-end streaming throughput (issue #4).

A Llama-ish synthetic KV (``codec.synthetic.synthetic_kv``, profile calibrated on another
draw) is put into a temporary file store with ``streamer.put_context``; a sender
daemon (``streamer.serve``) and two ``netsim.ShapingProxy`` links (100 Mbit/s and
1 Gbit/s) run in a *child process*, so the receiver's process (this one, on uvloop
when installed) pays only for receiving and decoding. Every fetch uses
``policy="fixed:N"`` so the level, and so the byte count, is known in advance.

Per link it measures:

* goodput: chunk bytes / transfer time, where transfer time runs from the first
  request (the call to ``fetch()``) to the end of the last chunk (its ``on_chunk``);
* total fetch time (``FetchReport.total_seconds``: the last layer delivered),
  against ``1.1 x bytes / rate + one chunk's decode time`` (decode hidden behind
  the transfer);
* the decode rate (compressed bytes / summed decode-thread seconds).

On plain loopback it fetches twice: end to end, and with a no-op section decoder
(every section still goes through the decode executor and ``OrderedDelivery``), which
gives the raw sender-to-receiver rate. Then 64 sessions fetch a small context from
the one sender at once: all must complete, and the slowest session's throughput must
be >= 0.7 x the fastest's. Each fetches 8 chunks (16 without ``--quick``): over one
or two chunks the ratio says which sessions the sender happened to serve first, not how
it shares its rate across them.

``--quick`` shrinks everything (for tests); ``--json`` prints a dict.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

MBIT = 1e6 / 8  # bytes per second in one Mbit/s


@dataclass(frozen=True)
class Config:
    layers: int
    heads: int
    head_dim: int
    chunk_tokens: int
    level: int                    # fixed level of the throughput fetches
    unique_chunks: int            # distinct chunks generated; the context repeats them
    link_seconds: float           # the big context lasts this long at 1 Gbit/s
    slow_link_seconds: float      # the 100 Mbit/s context lasts this long at 100 Mbit/s
    calibration_tokens: int
    rates_mbit: tuple[float, ...]
    sessions: int
    concurrent_chunk_tokens: int
    concurrent_chunks: int
    concurrent_level: int


FULL = Config(layers=8, heads=8, head_dim=128, chunk_tokens=512, level=1, unique_chunks=4,
              link_seconds=1.5, slow_link_seconds=1.5, calibration_tokens=1024,
              rates_mbit=(100.0, 1000.0), sessions=64, concurrent_chunk_tokens=64,
              concurrent_chunks=16, concurrent_level=4)
QUICK = Config(layers=2, heads=4, head_dim=64, chunk_tokens=256, level=1, unique_chunks=2,
               link_seconds=0.25, slow_link_seconds=0.3, calibration_tokens=512,
               rates_mbit=(100.0, 1000.0), sessions=64, concurrent_chunk_tokens=64,
               concurrent_chunks=8, concurrent_level=4)

BIG, SLOW, SMALL = "bench-big", "bench-slow", "bench-small"


# ----------------------------------------------------------------------- context
async def _build(cfg: Config, root: str) -> dict[str, Any]:
    """Calibrate on one draw, put three contexts of another; their manifests and timings."""
    import torch

    import codec
    from codec.synthetic import synthetic_kv

    from streamer.store.put import put_context
    from streamer.store import open_store

    threads = torch.get_num_threads()
    # One intra-op thread while building: the encoder runs a thread per core already,
    # and MKL's eigh with 2 threads next to a busy core took 10 s instead of 0.4 s.
    torch.set_num_threads(1)
    try:
        t0 = time.perf_counter()
        shape = (cfg.layers, cfg.heads, cfg.head_dim)
        calibration = synthetic_kv(*shape, cfg.calibration_tokens, seed=1)
        profile = await asyncio.to_thread(codec.calibrate, [calibration])
        calibrate_s = time.perf_counter() - t0
        unique = synthetic_kv(*shape, cfg.unique_chunks * cfg.chunk_tokens, seed=2).to(torch.float16)
        # size one non-first chunk at the measured level to decide how many chunks we need
        probe = codec.encode(unique[:, :, cfg.chunk_tokens:2 * cfg.chunk_tokens] if cfg.unique_chunks > 1
                             else unique, cfg.level, profile, sink_tokens=0)
        chunk_bytes = len(probe)
        big_chunks = max(cfg.unique_chunks, math.ceil(cfg.link_seconds * 1000 * MBIT / chunk_bytes))
        slow_chunks = max(2, math.ceil(cfg.slow_link_seconds * 100 * MBIT / chunk_bytes))
        reps = math.ceil(big_chunks / cfg.unique_chunks)
        kv = torch.cat([unique] * reps, dim=2)[:, :, :big_chunks * cfg.chunk_tokens].contiguous()
        tokens = kv.shape[2]
        ids = [(7 * i) % 32000 for i in range(tokens)]
        small_tokens = cfg.concurrent_chunks * cfg.concurrent_chunk_tokens
        store = await open_store(root)
        t1 = time.perf_counter()
        try:
            big = await put_context(store, BIG, kv, ids, profile=profile, chunk_tokens=cfg.chunk_tokens,
                                    levels=(cfg.level,))
            slow_tokens = slow_chunks * cfg.chunk_tokens
            slow = await put_context(store, SLOW, kv[:, :, :slow_tokens], ids[:slow_tokens], profile=profile,
                                     chunk_tokens=cfg.chunk_tokens, levels=(cfg.level,))
            small = await put_context(store, SMALL, kv[:, :, :small_tokens], ids[:small_tokens],
                                      profile=profile, chunk_tokens=cfg.concurrent_chunk_tokens,
                                      levels=(cfg.concurrent_level,))
        finally:
            await store.close()
        put_s = time.perf_counter() - t1
    finally:
        torch.set_num_threads(threads)
    return {"manifests": {BIG: big, SLOW: slow, SMALL: small}, "calibrate_seconds": calibrate_s,
            "put_seconds": put_s, "chunk_bytes": chunk_bytes, "torch_threads": threads,
            "fp16_bytes_per_chunk": cfg.layers * 2 * cfg.chunk_tokens * cfg.heads * cfg.head_dim * 2}


# ------------------------------------------------------------------ sender process
def _sender_process(root: str, rates_mbit: tuple[float, ...], conn: Any) -> None:
    """Child process: the sender and one shaping proxy per rate; answers "cpu" / "stop"."""
    async def main() -> None:
        import netsim

        from streamer.net.sender import serve
        from streamer.store import open_store

        store = await open_store(root)
        sender = await serve(store)
        proxies = [netsim.ShapingProxy(upstream=("127.0.0.1", sender.port), trace=rate) for rate in rates_mbit]
        for proxy in proxies:
            await proxy.start()
        conn.send({"sender": sender.port, "proxies": [p.port for p in proxies]})
        loop = asyncio.get_running_loop()
        while True:
            command = await loop.run_in_executor(None, conn.recv)
            if command == "cpu":
                conn.send(time.process_time())
            else:
                break
        for proxy in proxies:
            await proxy.close()
        await sender.close()
        await store.close()
        conn.send("stopped")

    _run_loop(main)


def _run_loop(main: Any) -> Any:
    from streamer.tools.serve_fetch import run_async

    return run_async(main)


class _SenderChild:
    def __init__(self, root: str, rates_mbit: tuple[float, ...]) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # no fork of a process with torch/numba threads
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_sender_process, args=(root, rates_mbit, child), daemon=True,
                                 name="kvwire-bench-sender")
        self._proc.start()
        child.close()
        self.ports: dict[str, Any] = {}

    async def start(self, timeout: float = 120.0) -> None:
        if not await asyncio.to_thread(self._conn.poll, timeout):
            raise RuntimeError("the sender process did not start")
        self.ports = self._conn.recv()

    async def cpu(self) -> float:
        self._conn.send("cpu")
        return await asyncio.to_thread(self._conn.recv)

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._conn.send("stop")
            await asyncio.to_thread(self._conn.poll, 15.0)
        await asyncio.to_thread(self._proc.join, 15.0)
        if self._proc.is_alive():
            self._proc.kill()
            await asyncio.to_thread(self._proc.join, 5.0)


# ------------------------------------------------------------------------ fetching
def _noop_decode(header: Any, profile: Any, layer: int, section: Any) -> tuple[None, None]:
    return None, None


def _ignore(*args: Any) -> None:
    return None


async def _fetch(port: int, context: str, level: int, *, decode: bool = True) -> dict[str, Any]:
    """One fetch at a fixed level; transfer time is fetch() -> the last chunk's end."""
    from streamer.net.session import StreamSession

    ends: list[float] = []

    def on_chunk(report: Any) -> None:
        ends.append(time.monotonic())

    async with StreamSession("127.0.0.1", port, context, slo=600.0, policy=f"fixed:{level}",
                             on_layer=_ignore, on_text=_ignore, on_chunk=on_chunk,
                             connect_timeout=60.0, stall_timeout=30.0) as session:
        if not decode:
            # No public hook for this: _Fetch reads the decoder from the session when fetch()
            # starts, so replacing it here skips only the codec work, not the plumbing.
            session._decode = _noop_decode
        start = time.monotonic()
        cpu = time.process_time()
        report = await session.fetch()
        cpu = time.process_time() - cpu
    transfer = (max(ends) - start) if ends else report.total_seconds
    decode_s = [c.decode_seconds for c in report.chunks]
    total_decode = sum(decode_s)
    return {"chunks": len(report.chunks), "expected_chunks": len(session.manifest.chunks),  # type: ignore[union-attr]
            "levels": sorted({str(c.level) for c in report.chunks}), "bytes": report.bytes,
            "transfer_seconds": transfer, "total_seconds": report.total_seconds,
            "first_layer_seconds": report.first_layer_seconds,
            "goodput_mbit": 8 * report.bytes / transfer / 1e6 if transfer > 0 else None,
            "decode_seconds_total": total_decode,
            "decode_seconds_per_chunk": statistics.mean(decode_s) if decode_s else 0.0,
            "decode_mbit": 8 * report.bytes / total_decode / 1e6 if decode and total_decode > 0 else None,
            "receiver_cpu_seconds": cpu, "reconnects": report.reconnects}


async def _concurrent(port: int, context: str, level: int, sessions: int) -> dict[str, Any]:
    """``sessions`` sessions connect, then all fetch at once; per-session throughput."""
    from streamer.net.session import StreamSession

    async with contextlib.AsyncExitStack() as stack:
        opened = [await stack.enter_async_context(
            StreamSession("127.0.0.1", port, context, slo=600.0, policy=f"fixed:{level}",
                          on_layer=_ignore, on_text=_ignore, connect_timeout=30.0, stall_timeout=30.0))
            for _ in range(sessions)]

        async def one(session: Any) -> dict[str, Any]:
            ends: list[float] = []
            session._on_chunk = lambda report: ends.append(time.monotonic())
            start = time.monotonic()
            try:
                report = await session.fetch()
            except Exception as exc:  # reported, not raised: the target counts completions
                return {"completed": False, "error": f"{type(exc).__name__}: {exc}"}
            transfer = (max(ends) - start) if ends else report.total_seconds
            return {"completed": len(report.chunks) == len(session.manifest.chunks),
                    "chunks": len(report.chunks), "bytes": report.bytes, "transfer_seconds": transfer,
                    "total_seconds": report.total_seconds,
                    "throughput_mbit": 8 * report.bytes / transfer / 1e6 if transfer > 0 else 0.0}

        start = time.monotonic()
        results = await asyncio.gather(*(one(s) for s in opened))
        wall = time.monotonic() - start
    rates = [r["throughput_mbit"] for r in results if r["completed"]]
    return {"sessions": sessions, "completed": sum(r["completed"] for r in results), "wall_seconds": wall,
            "bytes": sum(r.get("bytes", 0) for r in results),
            "slowest_mbit": min(rates, default=0.0), "fastest_mbit": max(rates, default=0.0),
            "fairness": (min(rates) / max(rates)) if rates and max(rates) > 0 else 0.0,
            "per_session": results}


async def _warm_profile(port: int) -> dict[str, Any]:
    """Fetch the profile over the wire once, before measuring: a receiver fetches a model's
    profile once (``streamer.net.session`` caches it by id), so the measured fetches do
    not pay for it. Its size and fetch time are reported apart. A failure is an error of
    the benchmark (RuntimeError), never papered over by reading the store directly."""
    from streamer.net.session import StreamSession

    start = time.monotonic()
    try:
        async with StreamSession("127.0.0.1", port, BIG, connect_timeout=10.0, max_reconnects=0) as session:
            size = len(session.profile.to_bytes())  # type: ignore[union-attr]
    except Exception as exc:
        raise RuntimeError(f"could not fetch the profile from the sender: {type(exc).__name__}: {exc}") from exc
    return {"profile_bytes": size, "profile_fetch_seconds": time.monotonic() - start}


# ---------------------------------------------------------------------------- run
async def run(cfg: Config) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvwire-bench-stream-") as root:
        built = await _build(cfg, root)
        manifests = built.pop("manifests")
        child = _SenderChild(root, cfg.rates_mbit)
        try:
            await child.start()
            built.update(await _warm_profile(child.ports["sender"]))
            links: list[dict[str, Any]] = []
            # (name, port, rate or None, context, real decode?)
            plan = [(f"{rate:g} Mbit/s", port, rate, SLOW if rate < 500 else BIG, True)
                    for rate, port in zip(cfg.rates_mbit, child.ports["proxies"])]
            plan += [("loopback", child.ports["sender"], None, BIG, True),
                     ("loopback, no-op decode", child.ports["sender"], None, BIG, False)]
            for name, port, rate, context, decode in plan:
                sender_cpu = await child.cpu()
                result = await _fetch(port, context, cfg.level, decode=decode)
                result["sender_cpu_seconds"] = await child.cpu() - sender_cpu
                result.update(link=name, rate_mbit=rate, context=context, decode=decode)
                links.append(result)
            sender_cpu = await child.cpu()
            concurrency = await _concurrent(child.ports["sender"], SMALL, cfg.concurrent_level, cfg.sessions)
            concurrency["sender_cpu_seconds"] = await child.cpu() - sender_cpu
        finally:
            await child.stop()
    out = {"config": {**asdict(cfg), **built, "contexts": {
               name: {"chunks": len(m.chunks), "tokens": m.tokens,
                      "bytes": sum(c.sizes[cfg.concurrent_level if name == SMALL else cfg.level]
                                   for c in m.chunks)}
               for name, m in manifests.items()},
               "loop": _loop_name(), "cpus": os.cpu_count()},
           "links": links, "concurrency": concurrency}
    out["targets"] = _targets(out)
    return out


def _loop_name() -> str:
    loop = asyncio.get_running_loop()
    return f"{type(loop).__module__}.{type(loop).__name__}"


def _targets(out: dict[str, Any]) -> list[dict[str, Any]]:
    targets: list[dict[str, Any]] = []
    for link in out["links"]:
        rate = link["rate_mbit"]
        if rate is not None:
            goodput = link["goodput_mbit"] or 0.0
            targets.append({"target": f"{link['link']}: goodput >= 95% of the shaped rate",
                            "measured": goodput / rate, "unit": "x rate", "met": goodput >= 0.95 * rate})
            bound = 1.1 * link["bytes"] / (rate * MBIT) + link["decode_seconds_per_chunk"]
            targets.append({"target": f"{link['link']}: total <= 1.1 x bytes/rate + one chunk's decode "
                                      f"({bound:.2f} s)",
                            "measured": link["total_seconds"], "unit": "s",
                            "met": link["total_seconds"] <= bound})
        else:
            rate_gb = link["bytes"] / link["transfer_seconds"] / 1e9
            end_to_end = link["bytes"] / link["total_seconds"] / 1e9
            what = "raw transfer (no-op decode)" if not link["decode"] else "end to end (real decode)"
            targets.append({"target": f"loopback {what}: >= 1 GB/s of chunk bytes sender -> receiver",
                            "measured": rate_gb, "unit": "GB/s", "met": rate_gb >= 1.0,
                            "end_to_end_gb_s": end_to_end})
    c = out["concurrency"]
    targets.append({"target": f"{c['sessions']} concurrent sessions against one sender all complete",
                    "measured": c["completed"], "unit": "sessions", "met": c["completed"] == c["sessions"]})
    targets.append({"target": "slowest / fastest session throughput >= 0.7",
                    "measured": c["fairness"], "unit": "", "met": c["fairness"] >= 0.7})
    return targets


# -------------------------------------------------------------------------- output
def render(out: dict[str, Any]) -> str:
    cfg = out["config"]
    ctx = cfg["contexts"]
    lines = [f"kvwire bench stream: synthetic KV {cfg['layers']} layers x {cfg['heads']} heads x "
             f"{cfg['head_dim']}, chunks of {cfg['chunk_tokens']} tokens at level {cfg['level']} "
             f"({cfg['chunk_bytes'] / 1e6:.2f} MB/chunk, {cfg['fp16_bytes_per_chunk'] / 1e6:.1f} MB fp16); "
             f"{cfg['cpus']} CPUs, torch {cfg['torch_threads']} threads, receiver loop {cfg['loop']}",
             f"contexts: {BIG} {ctx[BIG]['chunks']} chunks {ctx[BIG]['bytes'] / 1e6:.1f} MB, "
             f"{SLOW} {ctx[SLOW]['chunks']} chunks {ctx[SLOW]['bytes'] / 1e6:.1f} MB, "
             f"{SMALL} {ctx[SMALL]['chunks']} chunks of {cfg['concurrent_chunk_tokens']} tokens at level "
             f"{cfg['concurrent_level']} ({ctx[SMALL]['bytes'] / 1e3:.0f} kB); calibrate "
             f"{cfg['calibrate_seconds']:.1f} s, put {cfg['put_seconds']:.1f} s",
             f"profile {cfg['profile_bytes'] / 1e6:.1f} MB, fetched over loopback in "
             f"{cfg['profile_fetch_seconds']:.2f} s before the measured fetches (a receiver caches it "
             "per model): not in the figures below",
             "",
             f"{'link':<24}{'MB':>8}{'transfer s':>11}{'goodput':>14}{'total s':>9}{'1st layer':>10}"
             f"{'decode s':>9}{'decode rate':>16}{'rx cpu s':>9}{'tx cpu s':>9}"]
    for l in out["links"]:
        decode_rate = "-" if l["decode_mbit"] is None else f"{l['decode_mbit']:.0f} Mbit/s"
        first = "-" if l["first_layer_seconds"] is None else f"{l['first_layer_seconds']:.3f}"
        lines.append(f"{l['link']:<24}{l['bytes'] / 1e6:>8.1f}{l['transfer_seconds']:>11.3f}"
                     f"{l['goodput_mbit']:>9.0f} Mb/s{l['total_seconds']:>9.3f}{first:>10}"
                     f"{l['decode_seconds_total']:>9.2f}{decode_rate:>16}{l['receiver_cpu_seconds']:>9.2f}"
                     f"{l['sender_cpu_seconds']:>9.2f}")
    c = out["concurrency"]
    lines += ["", f"{c['sessions']} sessions at once on loopback: {c['completed']} completed in "
                  f"{c['wall_seconds']:.2f} s, {c['bytes'] / 1e6:.1f} MB; per-session throughput "
                  f"{c['slowest_mbit']:.1f} .. {c['fastest_mbit']:.1f} Mbit/s; sender cpu "
                  f"{c['sender_cpu_seconds']:.2f} s",
              "goodput: chunk bytes / (first request -> last chunk end); total: until the last layer "
              "is decoded and delivered; decode rate: compressed bytes / decode-thread seconds.",
              "", "targets:"]
    for t in out["targets"]:
        measured = t["measured"]
        shown = f"{measured:.4g}" if isinstance(measured, float) else str(measured)
        extra = f" (end to end {t['end_to_end_gb_s']:.3f} GB/s)" if "end_to_end_gb_s" in t else ""
        lines.append(f"  [{'met' if t['met'] else 'MISSED'}] {t['target']}: measured {shown} "
                     f"{t['unit']}{extra}".rstrip())
    return "\n".join(lines)


def main(quick: bool = False, as_json: bool = False, profile_path: str | None = None) -> dict[str, Any]:
    cfg = QUICK if quick else FULL
    profiler = cProfile.Profile() if profile_path else None

    async def go() -> dict[str, Any]:
        if profiler is not None:
            profiler.enable()
        try:
            return await run(cfg)
        finally:
            if profiler is not None:
                profiler.disable()

    out = _run_loop(go)
    if profiler is not None:
        profiler.dump_stats(profile_path)
    print(json.dumps(out, indent=2) if as_json else render(out))
    return out


def _cmd_bench(args: argparse.Namespace) -> int:
    main(quick=args.quick, as_json=args.json, profile_path=args.cprofile)
    return 0


def register(subparsers: argparse._SubParsersAction, bench_subparsers: argparse._SubParsersAction) -> None:
    """Add ``kvwire bench stream``."""
    b = bench_subparsers.add_parser(
        "stream", help="streaming throughput: shaped links, loopback, 64 concurrent sessions",
        description="Put a synthetic Llama-ish context, serve it from a sender process, and fetch it "
                    "through 100 Mbit/s and 1 Gbit/s shaping proxies and on plain loopback; then 64 "
                    "concurrent sessions. Prints measured vs target.")
    b.add_argument("--json", action="store_true", help="print machine-readable JSON")
    b.add_argument("--quick", action="store_true", help="small and fast (about 30 s; for tests)")
    b.add_argument("--cprofile", metavar="FILE", help="write a cProfile of the receiver process's main thread")
    b.set_defaults(handler=_cmd_bench)


if __name__ == "__main__":  # python -m streamer.tools.bench_stream stream [--quick] [--json]
    _parser = argparse.ArgumentParser(prog="python -m streamer.tools.bench_stream")
    _sub = _parser.add_subparsers(dest="bench", required=True)
    register(_sub, _sub)
    _args = _parser.parse_args()
    sys.exit(_args.handler(_args))
