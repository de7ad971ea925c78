"""The steps every ``kvwire demo`` shares, whichever model it runs: what a person sees
(``Console``: lines and progress bars, nothing but the JSON under ``--json``), the codec's
warm start, the sender and shaping proxy in a child process (``LinkProcess``), the
decoder's and the model's costs measured before the fetch, the context put in a file
store at every level, the fetch under the SLO, the raw fp16 and 8-bit baselines over the
same trace, the summary keys and the plot.

``streamer.tools.demo_llm`` (a causal LM, the default) and ``streamer.tools.demo_minilm``
(all-MiniLM-L6-v2) are built from them; ``streamer.tools.demo`` is the command.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator


class Console:
    """What a demo shows a person: lines on stdout and tqdm progress bars on stderr for
    work that can be counted; with ``quiet`` (``--json``) nothing at all, so stdout holds
    only the JSON summary."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet

    def __call__(self, text: str = "") -> None:
        if not self.quiet:
            print(text, flush=True)

    def bar(self, total: int | None, desc: str, unit: str = "it"):
        """A tqdm bar on stderr (disabled when quiet); close it, or use it as a context manager."""
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=f"   {desc}", unit=unit, disable=self.quiet, leave=False,
                    file=sys.stderr, dynamic_ncols=True)

    @contextlib.contextmanager
    def muted(self) -> Iterator[None]:
        """When quiet, swallow what a library writes to stderr meanwhile (transformers'
        own GGUF progress bar); otherwise let it through."""
        if not self.quiet:
            yield
            return
        with contextlib.redirect_stderr(io.StringIO()):
            yield


def tick(bar) -> Callable[..., None]:
    """A forward hook that advances ``bar`` by one and returns None (a hook's return value
    would replace the module's output)."""

    def hook(*_: object) -> None:
        bar.update()

    return hook


@contextlib.contextmanager
def layer_progress(model, console: Console, desc: str) -> Iterator[None]:
    """A bar over a forward pass: one tick per transformer layer the model runs (hooks on
    its decoder or encoder layers); no bar for a model whose layers are not found."""
    base = getattr(model, "base_model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        layers = getattr(getattr(base, "encoder", None), "layer", None)
    if layers is None or console.quiet:
        yield
        return
    with console.bar(len(layers), desc, unit="layer") as bar:
        hooks = [layer.register_forward_hook(tick(bar)) for layer in layers]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()


def chunk_line(report) -> None:
    """One fetched chunk as the demo prints it while the fetch runs."""
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
            [sys.executable, "-c", "import sys; from streamer.tools.demo_common import _link_child; "
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


def recompute_seconds_per_token(model, tokenizer, ids: list[int], hf, decode_load: Callable[[], object],
                                alone: bool = True) -> tuple[float | None, float]:
    """Seconds per token the demo's ``on_text`` spends recomputing a chunk, (alone, beside
    the decoder), measured outside the fetch after a short warm-up call (alone: None
    unless ``alone``; only the rate beside the decoder is planned with).

    During the fetch a text chunk is recomputed while the later chunks' sections decode
    on the same cores (that overlap is the point), so the rate the policy plans with is
    measured with ``decode_load`` running in a loop in another thread: a rate measured
    on idle cores would plan text chunks as cheaper than they are when it matters.
    """
    hf.capture_kv(model, tokenizer, ids[:16])
    idle = _slower_of_two(model, tokenizer, ids, hf) if alone else None
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
    return idle, beside


async def _fetch(args, port: int, start_trace: Callable[[], float], on_layer, on_text,
                 verbose: bool, on_open: Callable[[Any], None] | None = None) -> Fetched:
    """Fetch through the proxy at ``port``; the trace starts just before fetch() starts its clock.
    ``on_open(session)`` runs once the context is open (its manifest known), before the trace."""
    import streamer

    opened = time.monotonic()
    async with streamer.StreamSession("127.0.0.1", port, args.context, slo=args.slo,
                                      policy=args.policy, on_layer=on_layer, on_text=on_text,
                                      on_chunk=chunk_line if verbose else None,
                                      recompute_seconds_per_token=args.recompute_ms_per_token / 1e3,
                                      decode_prior=getattr(args, "decode_prior", None)) as session:
        if on_open is not None:
            on_open(session)
        open_seconds = time.monotonic() - opened
        trace_at = start_trace()
        fetch_at = time.monotonic()
        report = await session.fetch()
    return Fetched(report, fetch_at - trace_at, open_seconds)

@dataclass
class WarmStart:
    """Step 0: the codec's numba kernels compiled (cold) or loaded from the cache (warm)."""

    kind: str          # "cold" or "warm"
    #: seconds spent making them ready: in the child that ran ahead (if any), then here
    seconds: float
    compiled: int
    loaded: int
    cache: str
    #: of ``seconds``, those spent in a child process while this one loaded the model
    ahead_seconds: float = 0.0

    def summary(self) -> dict:
        return {"start": self.kind, "warmup_seconds": self.seconds,
                "warmup": {"compiled": self.compiled, "loaded": self.loaded, "numba_cache": self.cache,
                           "ahead_seconds": self.ahead_seconds}}


#: what the child of ``KernelsAhead`` runs: the warm-up, then its result as one JSON line
_AHEAD = ("import json, codec; from codec import warmup; codec.warm_up(); r = warmup.last_result(); "
          "print(json.dumps({'seconds': r.seconds, 'compiled': r.compiled, 'loaded': r.loaded}))")


class KernelsAhead:
    """The codec's kernels made ready in a child process (``codec.warm_up``: compiled into
    numba's on-disk cache on a cold start, loaded from it on a warm one) while this
    process loads the model: on 2 cores a cold start's compilation then overlaps the
    load instead of following it, and ``warm_start`` here only loads the cached kernels."""

    def __init__(self) -> None:
        import subprocess

        self._proc = subprocess.Popen([sys.executable, "-c", _AHEAD], stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL)

    def result(self, timeout: float = 600.0) -> dict | None:
        """Wait for the child: its warm-up's seconds, compiled and loaded counts; None if it failed."""
        import subprocess

        try:
            out, _ = self._proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.close()
            return None
        lines = out.decode(errors="replace").strip().splitlines()
        if self._proc.returncode != 0 or not lines:
            return None
        try:
            return json.loads(lines[-1])
        except ValueError:
            return None

    def close(self) -> None:
        """End the child if it still runs (the command failed before waiting for it)."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()


def warm_start(say: Console, ahead: KernelsAhead | None = None) -> WarmStart:
    """Compile or load the codec's kernels before anything is timed, and say which; with
    ``ahead``, wait for its child first (the kernels are then in numba's cache)."""
    import codec
    from codec import warmup

    child = ahead.result() if ahead is not None else None
    codec.warm_up()
    warm = warmup.last_result()
    assert warm is not None
    compiled = warm.compiled + (child["compiled"] if child else 0)
    ahead_seconds = float(child["seconds"]) if child else 0.0
    start = WarmStart("cold" if compiled else "warm", ahead_seconds + warm.seconds, compiled, warm.loaded,
                      warmup_cache_dir(), ahead_seconds)
    done = (f"compiled ({compiled} specializations missing from the numba cache)" if compiled
            else f"loaded from the numba cache ({warm.loaded} specializations)")
    where = (f" in {ahead_seconds:.1f} s in a child process while the model loaded, then loaded here in "
             f"{warm.seconds:.1f} s" if child else f" in {warm.seconds:.1f} s")
    say(f"0. {start.kind} start: codec kernels {done}{where}, before anything is timed; cache {start.cache}")
    return start


def measure_decode(args: argparse.Namespace, ids: list[int], kv, profile, say: Console) -> bytes:
    """Set ``args.decode_prior`` to the codec's decode of the first chunk of ``kv`` (at the
    profile's default level), timed alone: the session plans its first chunks' decode at it, until
    it has timed a section of its own. Returns that chunk's blob.

    One untimed decode first, then the median of three: a process's first decode pays for
    page-ins, the thread pool and the allocator's growth (ten times a warm one's on a
    fresh venv), and a prior that slow would plan every chunk as text. Alone, not beside the
    recompute: the fetch recomputes only the chunks it sends as text."""
    import statistics

    import codec

    from streamer.adapt import decoding

    blob = codec.encode(kv[:, :, :len(ids)], profile=profile)   # at the profile's default level
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
    say(f"   the codec decodes that chunk (level {profile.default_level}) in {1e3 * median:.0f} ms "
        "alone: the fetch plans its first chunks' decode at that until it has decoded a section")
    return blob


def measure_recompute(args: argparse.Namespace, model, tokenizer, ids: list[int], kv, profile,
                      say: Console, alone: bool = True) -> None:
    """Set ``args.decode_prior`` (``measure_decode``) and ``args.recompute_ms_per_token``
    (unless given) to this model's text cost measured beside the codec decoding a chunk
    of ``kv`` (``recompute_seconds_per_token``; ``alone``: its rate on idle cores too, for
    the record)."""
    import codec

    from streamer.model import hf

    blob = measure_decode(args, ids, kv, profile, say)
    if args.recompute_ms_per_token is not None:
        say(f"   recomputing a chunk from text costs {args.recompute_ms_per_token:.2f} ms/token (given): "
            "the policy weighs text chunks at that")
        return
    idle, beside = recompute_seconds_per_token(model, tokenizer, ids, hf, lambda: codec.decode(blob, profile),
                                               alone)
    args.recompute_ms_per_token = 1e3 * beside
    say(f"   recomputing a chunk from text costs {1e3 * beside:.2f} ms/token with this model while the "
        "codec decodes beside it, as during the fetch" + ("" if idle is None else f" ({1e3 * idle:.2f} alone)")
        + ": the policy weighs text chunks at that, and the session at its on_text calls' rate when slower")


def demo_profile(args: argparse.Namespace, model, tokenizer, calibration_tokens: int, say: Console):
    """The codec profile: loaded from ``--profile`` if that file exists, else calibrated on
    *other* text than the streamed one (and saved to ``--profile`` when given)."""
    import codec

    from streamer.model import hf, quality

    if args.profile and Path(args.profile).exists():
        profile = codec.Profile.load(args.profile)
        say(f"   profile {profile.id} loaded from {args.profile}")
        return profile
    cal_ids = hf.tokenize(tokenizer, hf.read_text(hf.CALIBRATION_TEXTS))[:calibration_tokens]
    say(f"   calibrating a codec profile on {len(cal_ids)} tokens of other text (the model's KV of them, "
        "then the fit: seconds to minutes) ...")
    began = time.monotonic()
    profile = quality.calibrate_profile(model, tokenizer, cal_ids)
    say(f"   profile {profile.id} calibrated in {time.monotonic() - began:.1f} s")
    if args.profile:
        profile.save(args.profile)
    return profile


class _CountingStore:
    """A store as ``put_context`` sees it, whose writers advance ``bar`` by one per chunk
    staged (``put_context`` stages a chunk's text once its blobs are encoded): a progress
    bar over the encoding without a hook in the store's code."""

    def __init__(self, store, bar) -> None:
        self._store, self._bar = store, bar

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def writer(self, context_id: str) -> "_CountingWriter":
        return _CountingWriter(self._store.writer(context_id), self._bar)


class _CountingWriter:
    def __init__(self, writer, bar) -> None:
        self._writer, self._bar = writer, bar

    def __getattr__(self, name: str) -> Any:
        return getattr(self._writer, name)

    async def __aenter__(self) -> "_CountingWriter":
        await self._writer.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> Any:
        return await self._writer.__aexit__(*exc)

    async def put_text(self, chunk: int, data: Any) -> None:
        await self._writer.put_text(chunk, data)
        self._bar.update()


def put_demo_context(args: argparse.Namespace, store_url: str, kv, ids: list[int], profile, model,
                     chunk_tokens: int, say: Console):
    """Step 2: encode the context in chunks at every level into the store (not with
    ``--server``: that sender holds the context already), a bar counting the chunks.
    The manifest, or None."""
    from streamer.model import hf
    from streamer.store.put import put_context

    if args.server:
        return None

    async def put(bar) -> object:
        import streamer

        store = await streamer.open_store(store_url)
        try:
            return await put_context(_CountingStore(store, bar), args.context, kv, ids, profile=profile,
                                     chunk_tokens=chunk_tokens, vocab_size=hf.vocab_size(model))
        finally:
            await store.close()

    began = time.monotonic()
    with say.bar(-(-len(ids) // chunk_tokens), f"encoding at {len(profile.levels)} levels", unit="chunk") as bar:
        manifest = asyncio.run(put(bar))
    sizes = [sum(c.sizes[level] for c in manifest.chunks) for level in range(len(profile.levels))]
    say(f"2. encoded {len(manifest.chunks)} chunks of {chunk_tokens} tokens at {len(sizes)} levels into "
        f"{store_url} in {time.monotonic() - began:.1f} s: "
        + ", ".join(f"L{i} {s / 1e6:.1f} MB" for i, s in enumerate(sizes)))
    return manifest


def stream(args: argparse.Namespace, link: LinkProcess, trace, profile, on_layer, on_text, say: Console,
           on_open: Callable[[Any], None] | None = None) -> Fetched:
    """Steps 3-4: the fetch under the SLO through ``link`` (the sender and the shaping proxy
    in a child process, started by the caller), progress printed unless ``--json``."""
    from streamer.tools.serve_fetch import run_async

    say(f"3. sender on loopback behind the shaping proxy, trace {trace.name or args.trace} "
        f"({trace.rate_at(0):.0f} Mbit/s, dropping to {trace.low:.0f}), one-way delay {args.delay_ms:g} ms")
    say(f"4. StreamSession fetch, SLO {args.slo:g} s, policy {args.policy}; opening the context first "
        f"downloads the {len(profile.to_bytes()) / 1e6:.1f} MB codec profile (once per model; not in the fetch's "
        "bytes or seconds):")
    return run_async(lambda: _fetch(args, link.port, link.start_trace, on_layer, on_text, not args.json, on_open))


def start_link(args: argparse.Namespace, store_url: str, trace) -> LinkProcess:
    """The sender (or ``--server``) behind the shaping proxy, in a child process: started
    before the context is put (the sender reads the store when asked), so its start-up
    overlaps the encoding."""
    return LinkProcess(store_url, args.server, trace, args.delay_ms)


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
    print(f"   not in the fetch: opening the context took {fetched_run.open_seconds:.3f} s before the fetch "
          f"(handshake, manifest and the {result['profile_bytes'] / 1e6:.2f} MB profile at "
          f"{trace.rate_at(0):.0f} Mbit/s; a receiver fetches a model's profile once and caches it)")
    print(f"   kvwire: first layer delivered after {report.first_layer_seconds or 0:.3f} s, last byte in "
          f"after {result['last_byte_seconds']:.3f} s (the rest of the fetch's {report.total_seconds:.3f} s "
          f"is decoding and recomputing text chunks with the model); "
          f"{fp16_seconds / report.total_seconds:.1f}x faster than raw fp16, "
          f"{int8_seconds / report.total_seconds:.1f}x faster than 8-bit")
    print(f"   plot of capacity, throughput and chosen level: {Path(result['plot']).resolve()}")


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

