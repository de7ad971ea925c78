"""``kvwire bench load``: many concurrent sessions against N sender processes over one store.

Contexts of realistic size (``--store URL``, default a temporary file store; in a shared
store they get fresh ids and are deleted afterwards, their profile stays) are put first: synthetic KV of
8 layers x 8 heads x 64, 2-8 MB each at the best stored level. ``--senders`` sender
daemons (with metrics) run as *child processes* on loopback over that store, stateless;
``--sessions`` receivers run in this process (uvloop when installed), each opening a
``StreamSession`` for a random context under ``--slo`` (default 5 s, policy mpc) again and
again until ``--duration`` is up (or Ctrl-C). A new session per fetch, started on the
senders round-robin with the others as fallbacks.

Every fetch is checked: each decoded layer against a checksum of the stored blob decoded
at the level the session asked (wrong data), each (chunk, layer) and text at most once
(duplicated), every chunk whole as layers or as text (lost), text token ids against the
context's. Reported apart: errors by kind (exceptions, lost, duplicated, wrong data;
must be zero), text fallbacks, SLO misses; fetches completed; chunk latency p50/p99
(``ChunkReport.seconds``, KV chunks) and fetch latency; goodput (chunk bytes of completed
fetches per second); RSS of the senders and the receiver process at start and end, and
their growth after the warm-up (a quarter of the run, at most 10 s); the machine's CPUs
and the contexts' sizes. This process's glibc malloc is tuned and trimmed every
``--trim-seconds`` (default 2; 0: glibc's defaults) as the receiver daemon's is (see
``streamer.receiver.malloc``: without it RSS follows malloc's high-water mark, not what is
in use). ``--soak`` runs until Ctrl-C (or ``--duration``) and fails unless
the growth stays under ``--max-growth`` (default 20%); the exit code is non-zero on any
error, or on too much growth in ``--soak``.

``--quick``: 16 sessions for 3 s on small contexts (for tests); ``--json``: print a dict.
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
import uuid
import zlib
from dataclasses import asdict, dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class LoadConfig:
    sessions: int = 256
    seconds: float = 60.0          # math.inf: until Ctrl-C
    soak: bool = False
    sample_seconds: float = 2.0
    max_growth: float = 0.20       # soak: allowed RSS growth after the warm-up
    decode: bool = True            # receivers really decode (else only the plumbing runs, unchecked)
    store: str | None = None       # None: a temporary file store
    senders: int = 1
    slo: float = 5.0
    policy: str = "mpc"
    layers: int = 8
    heads: int = 8
    head_dim: int = 64
    chunk_tokens: int = 128
    #: one context per entry; at 8x8x64 level 0 takes ~4.3 kB a token: ~2, 4, 6 and 8 MB
    context_tokens: tuple[int, ...] = (480, 960, 1440, 1856)
    levels: tuple[int, ...] = (0, 2, 4)
    calibration_tokens: int = 1024
    #: the receiving process's glibc malloc tuned and trimmed every this many seconds, as
    #: the receiver daemon does (streamer.receiver.malloc); None: glibc's defaults
    trim_seconds: float | None = 2.0
    #: the receiving process's budget for bytes received and not delivered, across its
    #: sessions (streamer.net.budget), as the receiver daemon's --receive-budget
    budget: int = 256 << 20


FULL = LoadConfig()
QUICK = LoadConfig(sessions=16, seconds=3.0, sample_seconds=0.5, layers=2, heads=4, head_dim=64,
                   chunk_tokens=64, context_tokens=(256, 384), calibration_tokens=512)

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


# ----------------------------------------------------------------------- contexts
def layer_checksum(k: Any, v: Any) -> int:
    """CRC-32 of one decoded layer's K and V bytes."""
    import torch

    crc = zlib.crc32(k.contiguous().view(torch.uint8).numpy())
    return zlib.crc32(v.contiguous().view(torch.uint8).numpy(), crc)


@dataclass
class Context:
    """One stored context and what a correct fetch of it delivers."""

    context_id: str
    token_ids: list[int]
    chunk_bounds: list[tuple[int, int]]
    #: (chunk, level, layer) -> checksum of the decoded layer
    checksums: dict[tuple[int, int, int], int] = field(repr=False)
    #: encoded bytes at each stored level
    sizes: dict[int, int] = field(default_factory=dict)

    @property
    def chunks(self) -> int:
        return len(self.chunk_bounds)


async def _build(cfg: LoadConfig, url: str, run_id: str) -> list[Context]:
    import torch

    import codec
    from codec.synthetic import synthetic_kv

    from streamer.store import open_store
    from streamer.store.put import put_context

    shape = (cfg.layers, cfg.heads, cfg.head_dim)
    profile = await asyncio.to_thread(codec.calibrate, [synthetic_kv(*shape, cfg.calibration_tokens, seed=1)])
    contexts = []
    async with await open_store(url) as store:
        for i, tokens in enumerate(cfg.context_tokens):
            kv = synthetic_kv(*shape, tokens, seed=2 + i).to(torch.float16)
            ids = [(7 * t + i) % 32000 for t in range(tokens)]
            manifest = await put_context(store, f"load-{run_id}-{i}", kv, ids, profile=profile,
                                         chunk_tokens=cfg.chunk_tokens, levels=cfg.levels)
            checksums = {}
            for c in manifest.chunks:
                for level in cfg.levels:
                    blob = await store.get_chunk(manifest.context_id, manifest.version, c.index, level)
                    decoded = await asyncio.to_thread(codec.decode, blob, profile)
                    for layer in range(cfg.layers):
                        checksums[c.index, level, layer] = layer_checksum(decoded[layer, 0], decoded[layer, 1])
            contexts.append(Context(manifest.context_id, ids, [(c.start, c.end) for c in manifest.chunks],
                                    checksums, {level: sum(c.sizes[level] for c in manifest.chunks)
                                                for level in cfg.levels}))
    return contexts


async def _drop(url: str, contexts: list[Context]) -> None:
    from streamer.store import open_store

    async with await open_store(url) as store:
        for ctx in contexts:
            await store.delete_context(ctx.context_id)


# ------------------------------------------------------------------ sender process
_METRICS = (("sessions_total", "kvwire_sender_sessions_total", {}),
            ("sessions_open", "kvwire_sender_sessions_open", {}),
            ("refused_total", "kvwire_sender_sessions_refused_total", {}),
            ("sent_bytes_total", "kvwire_sender_sent_bytes_total", {}),
            ("text_fallbacks_total", "kvwire_sender_text_fallbacks_total", {}),
            ("chunk_requests", "kvwire_sender_request_seconds_count", {"kind": "chunk"}))


def _labelled(metrics: Any, family: str, label: str) -> dict[str, float]:
    """``{label value: count}`` of a labelled counter's ``_total`` samples."""
    return {s.labels[label]: s.value for fam in metrics.registry.collect() if fam.name == family
            for s in fam.samples if s.name.endswith("_total")}


def _sender_process(url: str, sessions: int, conn: Any) -> None:
    """Child: a sender with metrics over ``url``; answers "rss", "metrics" and "stop"."""
    async def main() -> None:
        from streamer.net.sender import ServerConfig, serve
        from streamer.store import open_store

        store = await open_store(url)
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
                values: dict[str, Any] = {key: metrics.value(name, **labels) for key, name, labels in _METRICS}
                values["chunks_by_level"] = _labelled(metrics, "kvwire_sender_chunks", "level")
                values["errors_by_code"] = _labelled(metrics, "kvwire_sender_errors", "code")
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
    def __init__(self, url: str, sessions: int) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")   # never fork a process with torch/numba threads
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_sender_process, args=(url, sessions, child), daemon=True,
                                 name="kvwire-bench-load-sender")
        self._proc.start()
        child.close()
        self._lock = asyncio.Lock()
        self.port = 0

    async def start(self, timeout: float = 120.0) -> None:
        if not await asyncio.to_thread(self._conn.poll, timeout):
            raise RuntimeError("a sender process did not start")
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


def _merge_metrics(each: list[dict[str, Any]]) -> dict[str, Any]:
    """The senders' metrics summed (counters and per-label dicts), and each one's."""
    total: dict[str, Any] = {}
    for values in each:
        for key, value in values.items():
            if isinstance(value, dict):
                merged = total.setdefault(key, {})
                for label, count in value.items():
                    merged[label] = merged.get(label, 0) + count
            else:
                total[key] = total.get(key, 0) + value
    total["per_sender_sessions"] = [v["sessions_total"] for v in each]
    return total


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


#: The kinds of error a fetch can end in; each must stay at zero.
ERROR_KINDS = ("exception", "lost", "duplicated", "wrong_data")


class _Stats:
    def __init__(self) -> None:
        self.fetches = 0
        self.errors = dict.fromkeys(ERROR_KINDS, 0)
        self.error_samples: list[str] = []
        self.bytes = 0
        self.chunks = 0
        self.text_chunks = 0
        self.text_fetches = 0
        self.slo_misses = 0
        self.retries = 0
        self.reconnects = 0
        self.chunk_seconds = _Reservoir(seed=1)
        self.fetch_seconds = _Reservoir(seed=2)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def error(self, kind: str, message: str) -> None:
        self.errors[kind] += 1
        if len(self.error_samples) < 10:
            self.error_samples.append(f"{kind}: {message}")


def _noop_decode(header: Any, profile: Any, layer: int, section: Any) -> tuple[None, None]:
    return None, None


class _Check:
    """What one fetch delivered, checked as it arrives against the stored context."""

    def __init__(self, ctx: Context, decode: bool) -> None:
        self.ctx = ctx
        self.decode = decode
        self.session: Any = None
        self.layers: dict[int, set[int]] = {}
        self.texts: set[int] = set()
        self.problems: list[tuple[str, str]] = []

    def on_layer(self, chunk: int, layer: int, k: Any, v: Any) -> None:
        seen = self.layers.setdefault(chunk, set())
        if layer in seen:
            self.problems.append(("duplicated", f"{self.ctx.context_id} chunk {chunk} layer {layer} twice"))
        seen.add(layer)
        if self.decode:
            level = self.session.levels.get(chunk)
            expected = self.ctx.checksums.get((chunk, level, layer))
            if expected is None or layer_checksum(k, v) != expected:
                self.problems.append(("wrong_data", f"{self.ctx.context_id} chunk {chunk} layer {layer} "
                                                    f"level {level}"))

    def on_text(self, chunk: int, token_ids: list[int]) -> None:
        if chunk in self.texts:
            self.problems.append(("duplicated", f"{self.ctx.context_id} chunk {chunk} text twice"))
        self.texts.add(chunk)
        start, end = self.ctx.chunk_bounds[chunk]
        if list(token_ids) != self.ctx.token_ids[start:end]:
            self.problems.append(("wrong_data", f"{self.ctx.context_id} chunk {chunk} token ids"))

    def finish(self, layers: int) -> list[tuple[str, str]]:
        for chunk in range(self.ctx.chunks):
            if chunk not in self.texts and len(self.layers.get(chunk, ())) != layers:
                self.problems.append(("lost", f"{self.ctx.context_id} chunk {chunk}: "
                                              f"{len(self.layers.get(chunk, ()))}/{layers} layers, no text"))
        return self.problems


async def _receiver(index: int, ports: list[int], cfg: LoadConfig, contexts: list[Context],
                    stop: asyncio.Event, stats: _Stats) -> None:
    """Fetch random contexts again and again, a new session each time (starting on the
    senders round-robin), until ``stop``."""
    from streamer.net.session import StreamSession

    rng = random.Random(index)
    turn = index
    while not stop.is_set():
        ctx = rng.choice(contexts)
        order = ports[turn % len(ports):] + ports[:turn % len(ports)]
        turn += 1
        check = _Check(ctx, cfg.decode)
        try:
            async with StreamSession("127.0.0.1", order[0], ctx.context_id, slo=cfg.slo, policy=cfg.policy,
                                     servers=[("127.0.0.1", p) for p in order[1:]],
                                     on_layer=check.on_layer, on_text=check.on_text,
                                     connect_timeout=30.0, stall_timeout=30.0) as session:
                check.session = session
                if not cfg.decode:
                    session._decode = _noop_decode   # private: skips only the codec work
                report = await session.fetch()
        except Exception as exc:   # counted, not raised: the run goes on
            stats.error("exception", f"{type(exc).__name__}: {exc}")
            continue
        problems = check.finish(cfg.layers)
        for kind, message in problems:
            stats.error(kind, message)
        if problems:
            continue
        stats.fetches += 1
        stats.fetch_seconds.add(report.total_seconds)
        stats.bytes += report.bytes
        stats.reconnects += report.reconnects
        stats.slo_misses += not report.deadline_met
        text = 0
        for chunk in report.chunks:
            stats.chunks += 1
            stats.retries += chunk.retries
            if chunk.level == "text":
                text += 1
            else:
                stats.chunk_seconds.add(chunk.seconds)
        stats.text_chunks += text
        stats.text_fetches += bool(text)


def _growth(samples: list[dict[str, Any]], key: str, warmup: float) -> dict[str, Any]:
    """RSS at the first sample, at the first after the warm-up, at the end (the fetches
    over), its highest after the warm-up; the growth from the warm-up to the end, and to
    that highest (under load: what the fetches in flight hold at the worst moment)."""
    after = [s for s in samples if s["t"] >= warmup]
    start = samples[0][key] / 1e6 if samples else None
    if len(after) < 2:
        return {"start_mb": start, "baseline_mb": None, "end_mb": None, "max_mb": None, "growth": None,
                "max_growth": None}
    base, end, high = after[0][key], after[-1][key], max(s[key] for s in after)
    return {"start_mb": start, "baseline_mb": base / 1e6, "end_mb": end / 1e6, "max_mb": high / 1e6,
            "growth": (end - base) / base if base else None, "max_growth": (high - base) / base if base else None}


# ---------------------------------------------------------------------------- run
async def run(cfg: LoadConfig) -> dict[str, Any]:
    from streamer.receiver import malloc

    # this (receiving) process's malloc as a receiver daemon runs it, from the start
    allocator = malloc.Tuning(os.environ, cfg.trim_seconds) if cfg.trim_seconds is not None else None
    try:
        out = await _run(cfg)
    finally:
        if allocator is not None:
            allocator.stop()
    out["config"]["receiver_malloc"] = allocator.describe() if allocator is not None else "glibc defaults"
    return out


async def _run(cfg: LoadConfig) -> dict[str, Any]:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):   # Ctrl-C ends the run; the report still prints
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    try:
        with contextlib.ExitStack() as stack:
            url = cfg.store or stack.enter_context(tempfile.TemporaryDirectory(prefix="kvwire-bench-load-"))
            contexts: list[Context] = []
            try:
                contexts = await _build(cfg, url, uuid.uuid4().hex[:8])
                children = [_SenderChild(url, cfg.sessions) for _ in range(cfg.senders)]
                try:
                    await asyncio.gather(*(child.start() for child in children))
                    return await _measure(cfg, contexts, children, stop)
                finally:
                    await asyncio.gather(*(child.stop() for child in children))
            finally:
                if cfg.store and contexts:
                    await _drop(url, contexts)
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


async def _measure(cfg: LoadConfig, contexts: list[Context], children: list[_SenderChild],
                   stop: asyncio.Event) -> dict[str, Any]:
    from streamer.net.session import StreamSession

    from streamer.net.budget import set_process_budget

    budget = set_process_budget(cfg.budget)
    # the profile once (receivers cache it per process), so the run measures steady state
    async with StreamSession("127.0.0.1", children[0].port, contexts[0].context_id, connect_timeout=30.0):
        pass
    stats = _Stats()
    samples: list[dict[str, Any]] = []
    start = time.monotonic()

    async def sample() -> None:
        tx = await asyncio.gather(*(child.ask("rss") for child in children))
        rx = rss_bytes()
        samples.append({"t": time.monotonic() - start, "receiver_rss": rx["rss"],
                        "sender_rss": sum(s["rss"] for s in tx), "receiver_peak": rx["peak"],
                        "sender_peak": sum(s["peak"] for s in tx), "fetches": stats.fetches,
                        "errors": stats.error_count, "budget_held": budget.total})

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

    ports = [child.port for child in children]
    await sample()   # at start, before any load
    receivers = [asyncio.create_task(_receiver(i, ports, cfg, contexts, stop, stats))
                 for i in range(cfg.sessions)]
    sampling = asyncio.create_task(sampler())
    timing = asyncio.create_task(timer())
    try:
        await stop.wait()
        end_requests = time.monotonic()
        # the fetches under way finish (they were started in time); never hang on one
        done, pending = await asyncio.wait(receivers, timeout=60.0 + cfg.slo)
        for task in pending:
            task.cancel()
            stats.error("exception", "fetch still running 60 s past its SLO after the end of the run")
        for task in done:
            if task.exception() is not None:
                stats.error("exception", f"receiver task failed: {task.exception()!r}")
    finally:
        for task in (*receivers, sampling, timing):
            task.cancel()
        await asyncio.gather(*receivers, sampling, timing, return_exceptions=True)
    wall = time.monotonic() - start
    await sample()
    sender_metrics = _merge_metrics(await asyncio.gather(*(child.ask("metrics") for child in children)))
    out = _result(cfg, contexts, stats, samples, wall, end_requests - start, sender_metrics)
    out["rss"]["receiver"].update(_against_budget(samples, cfg.budget, budget.peak))
    out["checks"].append({"check": "receiver RSS at every sample <= (RSS before the first session + the "
                                   "receive budget) + 10%",
                          "measured": out["rss"]["receiver"]["worst_over_bound"],
                          "ok": out["rss"]["receiver"]["worst_over_bound"] <= 0.10})
    return out


def _against_budget(samples: list[dict[str, Any]], limit: int, held_peak: int) -> dict[str, Any]:
    """The receiver's RSS at every sample against its RSS before the first session plus
    the receive budget: how far over that bound the worst sample went (a share of it;
    negative: under), and the most the sessions held of the budget."""
    before = samples[0]["receiver_rss"]
    bound = before + limit
    worst = max(s["receiver_rss"] for s in samples)
    return {"before_first_session_mb": before / 1e6, "budget_mb": limit / 1e6, "bound_mb": bound / 1e6,
            "worst_sample_mb": worst / 1e6, "worst_over_bound": (worst - bound) / bound,
            "budget_held_peak_mb": held_peak / 1e6}


def _result(cfg: LoadConfig, contexts: list[Context], stats: _Stats, samples: list[dict[str, Any]],
            wall: float, requested: float, sender_metrics: dict[str, Any]) -> dict[str, Any]:
    warmup = min(10.0, requested / 4)
    rx_growth = _growth(samples, "receiver_rss", warmup)
    tx_growth = _growth(samples, "sender_rss", warmup)
    last = samples[-1]
    chunk_p = stats.chunk_seconds.percentiles(50, 99)
    fetch_p = stats.fetch_seconds.percentiles(50, 99)
    ms = lambda v: None if v is None else v * 1e3   # noqa: E731
    best = min(cfg.levels)
    out: dict[str, Any] = {
        "config": {**asdict(cfg), "seconds": cfg.seconds if math.isfinite(cfg.seconds) else None,
                   "store": cfg.store or "temporary file store", "loop": _loop_name(), "cpus": os.cpu_count()},
        "contexts": [{"context_id": c.context_id, "tokens": len(c.token_ids), "chunks": c.chunks,
                      "bytes_by_level": c.sizes} for c in contexts],
        "context_mb": [c.sizes[best] / 1e6 for c in contexts],
        "wall_seconds": wall, "run_seconds": requested,
        "fetches": stats.fetches, "errors": stats.error_count, "errors_by_kind": stats.errors,
        "error_samples": stats.error_samples,
        "chunks": stats.chunks, "text_chunks": stats.text_chunks, "text_fetches": stats.text_fetches,
        "slo_misses": stats.slo_misses, "retries": stats.retries, "reconnects": stats.reconnects,
        "bytes": stats.bytes,
        "fetches_per_second": stats.fetches / wall if wall > 0 else 0.0,
        "goodput_mb_per_second": stats.bytes / wall / 1e6 if wall > 0 else 0.0,
        "chunk_latency_ms": {k: ms(v) for k, v in chunk_p.items()},
        "fetch_latency_ms": {k: ms(v) for k, v in fetch_p.items()},
        "latency_samples": len(stats.chunk_seconds.values),
        "rss": {
            "warmup_seconds": warmup,
            "receiver": {"peak_mb": last["receiver_peak"] / 1e6, **rx_growth},
            "senders": {"peak_mb": last["sender_peak"] / 1e6, **tx_growth},
        },
        "sender_metrics": sender_metrics,
        "samples": [{"t": round(s["t"], 2), "receiver_rss_mb": round(s["receiver_rss"] / 1e6, 1),
                     "senders_rss_mb": round(s["sender_rss"] / 1e6, 1), "fetches": s["fetches"],
                     "errors": s["errors"], "budget_held_mb": round(s["budget_held"] / 1e6, 1)}
                    for s in samples],
    }
    growths = [g["growth"] for g in (rx_growth, tx_growth)]
    checks = [{"check": "zero errors (exceptions, lost, duplicated, wrong data)", "measured": stats.error_count,
               "ok": stats.error_count == 0},
              {"check": "at least one fetch per session", "measured": stats.fetches,
               "ok": stats.fetches >= cfg.sessions}]
    growth_ok = all(g is None or g < cfg.max_growth for g in growths)
    checks.append({"check": f"RSS growth after the warm-up < {cfg.max_growth:.0%} (senders and receiver)"
                            + ("" if cfg.soak else " (informative outside --soak)"),
                   "measured": max((g for g in growths if g is not None), default=None),
                   "ok": growth_ok if any(g is not None for g in growths) else None})
    out["checks"] = checks
    out["ok"] = stats.error_count == 0 and (growth_ok or not cfg.soak)
    return out


def _loop_name() -> str:
    loop = asyncio.get_running_loop()
    return f"{type(loop).__module__}.{type(loop).__name__}"


# -------------------------------------------------------------------------- output
def render(out: dict[str, Any]) -> str:
    cfg, rss = out["config"], out["rss"]
    fmt = lambda v, spec=".2f": "-" if v is None else format(v, spec)   # noqa: E731
    seconds = "until Ctrl-C" if cfg["seconds"] is None else f"{cfg['seconds']:g} s"
    sizes = ", ".join(f"{mb:.1f}" for mb in out["context_mb"])
    lines = [
        f"kvwire bench load: {cfg['sessions']} sessions, {cfg['senders']} sender(s), {seconds}"
        f"{' (soak)' if cfg['soak'] else ''}; store {cfg['store']}; policy {cfg['policy']}, SLO {cfg['slo']:g} s",
        f"contexts: {len(out['contexts'])} of {sizes} MB at level {min(cfg['levels'])} (levels "
        f"{','.join(map(str, cfg['levels']))} stored), {cfg['layers']}x{cfg['heads']}x{cfg['head_dim']}, "
        f"{cfg['chunk_tokens']} tokens a chunk; decode {'on (checked)' if cfg['decode'] else 'off'}",
        f"machine: {cfg['cpus']} CPUs (receivers and senders share them); receiver loop {cfg['loop']}, "
        f"malloc {cfg['receiver_malloc']}",
        f"ran {out['run_seconds']:.1f} s (wall {out['wall_seconds']:.1f} s): {out['fetches']} fetches completed, "
        f"{out['errors']} errors {out['errors_by_kind']}",
        f"text fallbacks: {out['text_chunks']} chunks in {out['text_fetches']} fetches; SLO misses: "
        f"{out['slo_misses']}; {out['retries']} retries, {out['reconnects']} reconnects",
        f"goodput: {out['goodput_mb_per_second']:.2f} MB/s of chunks, {out['fetches_per_second']:.2f} fetches/s",
        f"chunk latency: p50 {fmt(out['chunk_latency_ms']['p50'])} ms, p99 {fmt(out['chunk_latency_ms']['p99'])} ms; "
        f"fetch latency: p50 {fmt(out['fetch_latency_ms']['p50'])} ms, p99 {fmt(out['fetch_latency_ms']['p99'])} ms",
    ]
    r = rss["receiver"]
    lines.append(f"receiver RSS against its budget: before the first session {r['before_first_session_mb']:.1f} MB "
                 f"+ budget {r['budget_mb']:.0f} MB = {r['bound_mb']:.1f} MB; worst sample {r['worst_sample_mb']:.1f} "
                 f"MB ({r['worst_over_bound']:+.1%} of that); sessions held at most {r['budget_held_peak_mb']:.1f} MB")
    for who in ("senders", "receiver"):
        r = rss[who]
        growth, high = ("-" if r[k] is None else f"{r[k]:+.1%}" for k in ("growth", "max_growth"))
        lines.append(f"{who} RSS: start {fmt(r['start_mb'], '.1f')} MB, end {fmt(r['end_mb'], '.1f')} MB, "
                     f"peak {r['peak_mb']:.1f} MB; after {rss['warmup_seconds']:.1f} s warm-up "
                     f"{fmt(r['baseline_mb'], '.1f')} -> {fmt(r['end_mb'], '.1f')} MB ({growth}), "
                     f"highest {fmt(r['max_mb'], '.1f')} MB ({high})")
    m = out["sender_metrics"]
    lines.append(f"sender metrics: {m['sessions_total']:.0f} sessions {m['per_sender_sessions']}, chunks by "
                 f"level {m['chunks_by_level']}, {m['sent_bytes_total'] / 1e6:.1f} MB sent, "
                 f"errors {m['errors_by_code'] or 0}")
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
    for name in ("sessions", "sample_seconds", "max_growth", "store", "senders", "slo", "policy", "budget"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if args.trim_seconds is not None:
        changes["trim_seconds"] = args.trim_seconds or None
    cfg = replace(cfg, **changes)
    if cfg.sessions < 1:
        raise SystemExit("kvwire bench load: --sessions must be >= 1")
    if cfg.senders < 1:
        raise SystemExit("kvwire bench load: --senders must be >= 1")
    if not seconds > 0:
        raise SystemExit("kvwire bench load: --duration must be > 0")
    if not cfg.slo > 0:
        raise SystemExit("kvwire bench load: --slo must be > 0")
    if cfg.trim_seconds is not None and not cfg.trim_seconds > 0:
        raise SystemExit("kvwire bench load: --trim-seconds must be >= 0")
    return cfg


def _cmd_load(args: argparse.Namespace) -> int:
    out = main(_config(args), as_json=args.json)
    return 0 if out["ok"] else 1


def register(subparsers: argparse._SubParsersAction, bench_subparsers: argparse._SubParsersAction) -> None:
    """Add ``kvwire bench load``."""
    from streamer.tools.receive import parse_bytes

    b = bench_subparsers.add_parser(
        "load", help="load and soak: many concurrent sessions against N senders over one store",
        description="Put 2-8 MB contexts into a store, serve them from N sender processes on "
                    "loopback and fetch them from many concurrent receivers under an SLO, for a "
                    "while: errors by kind (every layer checked), text fallbacks, SLO misses, "
                    "goodput, chunk latency, RSS of senders and receivers.")
    b.add_argument("--store", help="store URL (file path, redis://, redis+cluster://; default: a "
                                   "temporary file store); the contexts put there are deleted afterwards (their "
                                   "profile stays: profiles are shared by content hash)")
    b.add_argument("--senders", type=int, help="sender processes over the store (default 1)")
    b.add_argument("--sessions", type=int, help="concurrent receivers (default 256; --quick 16)")
    b.add_argument("--duration", "--seconds", dest="seconds", type=float,
                   help="run length in s (default 60; --quick 3; --soak: until Ctrl-C)")
    b.add_argument("--slo", type=float, help="deadline of each fetch, s (default 5)")
    b.add_argument("--policy", help="receivers' policy (default mpc)")
    b.add_argument("--soak", action="store_true",
                   help="run until Ctrl-C (or --duration) and fail if RSS grows more than --max-growth")
    b.add_argument("--max-growth", type=float, help="allowed RSS growth after the warm-up (default 0.2)")
    b.add_argument("--sample-seconds", type=float, help="RSS sampling period (default 2; --quick 0.5)")
    b.add_argument("--trim-seconds", type=float,
                   help="this process's malloc tuned and trimmed every this many s, as the receiver "
                        "daemon does (default 2; 0: glibc's defaults, untrimmed)")
    b.add_argument("--no-decode", action="store_true", help="receivers skip the codec work (and its check)")
    b.add_argument("--budget", type=parse_bytes,
                   help="the receiving process's budget for bytes received and not delivered (default 256M)")
    b.add_argument("--quick", action="store_true", help="16 sessions for 3 s on small contexts (for tests)")
    b.add_argument("--json", action="store_true", help="print machine-readable JSON")
    b.set_defaults(handler=_cmd_load)


if __name__ == "__main__":  # python -m streamer.tools.bench_load [options]
    _parser = argparse.ArgumentParser(prog="python -m streamer.tools.bench_load")
    _sub = _parser.add_subparsers(dest="bench", required=True)
    register(_sub, _sub)
    _args = _parser.parse_args(["load", *sys.argv[1:]])
    sys.exit(_args.handler(_args))
