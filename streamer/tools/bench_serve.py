"""``kvwire bench serve``: time to first token of the OpenAI-compatible server when a
prompt's first N tokens are stored on a remote sender, against full prefill (issue #43).

SmolLM2-135M-Instruct (offline) serves ``/v1/completions`` in this process
(``streamer.llmserver``); a sender with a file store sits behind a ``netsim`` shaping proxy
in a child process (``demo_common.LinkProcess``), at each rate in turn. The store holds one
content-addressed context: the first ``max(sizes)`` tokens of Debian's GPL-3 text, put with
``put_prefix`` (its KV from one full prefill, exactly as level 0 and at every level of the
shipped SmolLM2 profile as levels 1-5, as the server writes prefixes back). Every prompt
is the first N tokens of that text followed by a question, sent as token ids, so the
server's lookup finds exactly N tokens (N a multiple of the chunk size).

Per N and prompt, three streamed requests, greedy, ``max_tokens`` each:

* full prefill: a server with no prefix source;
* fetched, at each rate: a server whose prefixes come from the sender, each request under
  its own deadline (``kvwire.slo``), the adaptive policy choosing each chunk's level or text.

Time to first token is measured by the client: from sending the request to the first
streamed piece of text (the fetch, injecting its KV, prefilling the question, the first
step). Each server's first request is its *cold* one (a fresh connection to the sender and
the profile fetched once); the rest are *warm*. The outputs' token ids are compared with
full prefill's. The codec's kernels are compiled or loaded, and the model's recompute
rate measured, before any request is timed.

Then the concurrency check at the fastest rate: ``concurrent`` requests at once over two
shared prefixes (GPL-3's and GPL-2's first N tokens, distinct questions): the server must
start exactly two fetches, answer every request correctly (equal to full prefill), and run
the two fetches at the same time (each request's fetch start and end are printed). To
tell the codec's share of a parted answer from the policy's, the same prompts are then
answered directly (no server) with each prefix's exact KV and with every chunk at one
stored level: the exact level must part none; a lossy level parts the answers whose
greedy choice is a near tie that level's error tips.

Targets (issue #43): at 4096 stored tokens and 1000 Mbit/s, time to first token >= 4x
faster than full prefill on this CPU; greedy output identical on >= 8 of 10 prompts;
exactly two fetches for the concurrent requests, no errors, every answer correct, the two
fetches overlapping. ``--quick`` shrinks everything (for tests; its figures are not the
targets').
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

#: questions appended after the stored prefix, one prompt each
QUESTIONS = (
    "What does this license guarantee about the freedom to share and change a program?",
    "What must you do when you convey a copy of the program?",
    "What does the text say about software patents?",
    "Who is a licensee under this License?",
    "What is the source code of a work?",
    "Can you charge a fee for distributing copies?",
    "What happens if you violate the license?",
    "Does the license cover the output of a program?",
    "What are the system libraries of a work?",
    "How should you apply these terms to a new program?",
    "What is a covered work?",
    "Is there any warranty for the program?",
    "What does it mean to propagate a work?",
    "Which version of the license applies if none is specified?",
    "What is an aggregate?",
    "Can the license be terminated?",
)
SECOND_TEXT = Path("/usr/share/common-licenses/GPL-2")
DELAY_MS = 1.0
TARGET_SPEEDUP = 4.0
TARGET_IDENTICAL = 8


@dataclass(frozen=True)
class Config:
    sizes: tuple[int, ...]          # stored prefix tokens per row (multiples of chunk_tokens)
    rates_mbit: tuple[float, ...]
    prompts: int                    # prompts per size
    max_tokens: int
    slo: float                      # each request's deadline for its prefix (s)
    chunk_tokens: int
    concurrent: int                 # requests at once over two shared prefixes
    concurrent_tokens: int          # tokens of each shared prefix


FULL = Config(sizes=(1024, 2048, 4096), rates_mbit=(100.0, 1000.0), prompts=10, max_tokens=64, slo=1.0,
              chunk_tokens=256, concurrent=16, concurrent_tokens=1024)
QUICK = Config(sizes=(256,), rates_mbit=(1000.0,), prompts=2, max_tokens=8, slo=1.0, chunk_tokens=128,
               concurrent=4, concurrent_tokens=256)


@dataclass
class Answer:
    """One streamed request as the client saw it."""

    first_token_seconds: float
    text: str
    usage: dict[str, Any]


async def _complete(session: Any, url: str, prompt: list[int], cfg: Config) -> Answer:
    """One streamed completion (greedy), timed at the client."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": cfg.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "kvwire": {"slo": cfg.slo}}
    began = time.monotonic()
    first: float | None = None
    pieces: list[str] = []
    usage: dict[str, Any] = {}
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"server answered {response.status}: {(await response.text())[:300]}")
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            for choice in event.get("choices") or ():
                if choice.get("text"):
                    first = first if first is not None else time.monotonic() - began
                    pieces.append(choice["text"])
            usage = event.get("usage") or usage
    text = "".join(pieces)
    return Answer(first if first is not None else time.monotonic() - began, text, usage)


def _prompts(tokenizer: Any, document: list[int], tokens: int, questions: Sequence[str]) -> list[list[int]]:
    from streamer.model import hf

    return [document[:tokens] + hf.tokenize(tokenizer, f"\n\nQuestion: {q}\nAnswer:") for q in questions]


async def _put(store_url: str, model: Any, tokenizer: Any, profile: Any, identity: Any,
               ids: list[int]) -> tuple[str, Any]:
    """Store ``ids``' KV (one full prefill) as a content-addressed prefix: its context id
    and the exact KV."""
    import streamer
    from streamer.model import hf
    from streamer.store.put import put_prefix

    kv = await asyncio.to_thread(hf.capture_kv, model, tokenizer, ids)
    store = await streamer.open_store(store_url)
    try:
        match = await put_prefix(store, identity, kv, ids, profile, budget_bytes=None,
                                 vocab_size=hf.vocab_size(model), exact=True)
    finally:
        await store.close()
    return match.context_id, kv


async def _stored_kv(store_url: str, context_id: str, profile: Any, chunks: int) -> list[Any]:
    """The first ``chunks`` chunks of a stored context decoded at each level in turn, one
    KV tensor per level (best first): what a fetch delivers when every chunk comes at
    that level."""
    import torch

    import codec
    import streamer

    store = await streamer.open_store(store_url)
    try:
        manifest = await store.get_manifest(context_id)
        blobs = [[await store.get_chunk(context_id, manifest.version, c, level) for c in range(chunks)]
                 for level in range(manifest.levels)]
    finally:
        await store.close()
    return [torch.cat([codec.decode(b, profile) for b in level], dim=2) for level in blobs]


def _answers_by_level(model: Any, prompts: list[list[int]], tokens: int, prefixes: list[list[Any]],
                      max_tokens: int) -> list[dict[str, Any]]:
    """Which of the concurrent prompts (alternating between ``prefixes``: each one's KV at
    every stored level) answer as full prefill does when every chunk of their prefix comes
    at one level, generated directly (no server, no policy, greedy): it tells the codec's
    share of parted answers from the policy's. The exact level (level 0) must part none
    (only the prefill's split differs)."""
    from streamer.model import hf

    rows: list[dict[str, Any]] = []
    full = [hf.greedy_generate(model, None, p, max_tokens) for p in prompts]
    for level in range(len(prefixes[0])):
        parted = []
        for i, (prompt, reference) in enumerate(zip(prompts, full)):
            kv = prefixes[i % len(prefixes)][level]
            if hf.generate_with_kv(model, None, kv, prompt[tokens:], max_new_tokens=max_tokens) != reference:
                parted.append(i)
        rows.append({"level": level, "correct": len(prompts) - len(parted), "parted": parted})
    return rows


def _summary(values: Sequence[float]) -> dict[str, float]:
    return {"cold": values[0], "warm": statistics.median(values[1:]) if len(values) > 1 else values[0]}


def _engine_config(cfg: Config) -> Any:
    """What every server of the bench serves with (its prefix identity is the store's)."""
    from streamer.llmserver.engine import EngineConfig

    return EngineConfig(served_name="smollm2", chunk_tokens=cfg.chunk_tokens, slo=cfg.slo,
                        max_tokens=max(cfg.max_tokens, 1), write_back=False)


async def _serve(model: Any, tokenizer: Any, profile: Any, cfg: Config, senders: Sequence[tuple[str, int]]):
    from streamer.llmserver.app import start_server
    from streamer.net.config import SessionConfig

    return await start_server(model, tokenizer, profile, _engine_config(cfg), SessionConfig(),
                              senders=senders, port=0)


async def _row_requests(url: str, prompts: list[list[int]], cfg: Config) -> list[Answer]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        return [await _complete(session, url, prompt, cfg) for prompt in prompts]


async def run(cfg: Config, say: Any = print, loaded: tuple[Any, Any] | None = None) -> dict[str, Any]:
    """The bench; ``loaded``: SmolLM2's (model, tokenizer) when the caller holds them."""
    import torch

    import codec
    from streamer.llmserver.engine import prefix_identity
    from streamer.model import hf
    from streamer.tools.demo_common import LinkProcess
    from streamer.tools.demo_llm import PROFILE
    from netsim import generators

    model, tokenizer = loaded or await asyncio.to_thread(hf.load_model, hf.smollm2_path())
    profile = codec.Profile.load(PROFILE)
    document = hf.tokenize(tokenizer, hf.read_text([hf.MEASURE_TEXT]))
    second = hf.tokenize(tokenizer, hf.read_text([SECOND_TEXT]))
    stored = max(max(cfg.sizes), cfg.concurrent_tokens)
    if len(document) < stored or len(second) < cfg.concurrent_tokens or any(n % cfg.chunk_tokens for n in cfg.sizes):
        raise ValueError(f"sizes must be multiples of {cfg.chunk_tokens} within the texts' tokens "
                         f"({len(document)} and {len(second)})")
    identity = prefix_identity(_engine_config(cfg), tokenizer, profile)
    out: dict[str, Any] = {"config": asdict(cfg), "machine": platform.node(), "rows": [], "concurrent": None}
    with tempfile.TemporaryDirectory(prefix="kvwire-bench-serve-") as root:
        store_url = f"file://{root}"
        say(f"putting {stored}-token prefixes of two texts exactly and at {len(profile.levels)} levels ...")
        shared_prefixes = []   # (context id, exact KV of the tokens the concurrent prompts share)
        for ids in (document[:stored], second[:cfg.concurrent_tokens]):
            context_id, kv = await _put(store_url, model, tokenizer, profile, identity, ids)
            shared_prefixes.append((context_id, kv[:, :, :cfg.concurrent_tokens].clone()))
        prompts = {n: _prompts(tokenizer, document, n, QUESTIONS[:cfg.prompts]) for n in cfg.sizes}
        full_server = await _serve(model, tokenizer, profile, cfg, ())
        try:
            full = {n: await _row_requests(full_server.url, prompts[n], cfg) for n in cfg.sizes}
            say("full prefill: " + ", ".join(f"{n} tokens {statistics.median(a.first_token_seconds for a in full[n]):.2f} s"
                                             for n in cfg.sizes))
            shared = [_prompts(tokenizer, text, cfg.concurrent_tokens, QUESTIONS[i::2][:cfg.concurrent // 2])
                      for i, text in enumerate((document, second))]
            mixed = [p for pair in zip(*shared) for p in pair]
            reference = await _row_requests(full_server.url, mixed, cfg)
        finally:
            await full_server.close()
        for rate in cfg.rates_mbit:
            with LinkProcess(store_url, None, generators.constant(rate, 3600.0, step=60.0, name=f"{rate:g}"), DELAY_MS) as link:
                server = await _serve(model, tokenizer, profile, cfg, [("127.0.0.1", link.port)])
                try:
                    for n in cfg.sizes:
                        fetched = await _row_requests(server.url, prompts[n], cfg)
                        out["rows"].append(_row(n, rate, full[n], fetched))
                        row = out["rows"][-1]
                        say(f"{n} tokens at {rate:g} Mbit/s: first token {row['fetched_seconds']['warm']:.3f} s vs "
                            f"{row['full_seconds']['warm']:.3f} s full ({row['speedup']['warm']:.1f}x warm, "
                            f"{row['speedup']['cold']:.1f}x cold); identical {row['identical']}/{len(fetched)}")
                    if rate == max(cfg.rates_mbit):
                        out["concurrent"] = await _concurrent(server, mixed, reference, cfg)
                finally:
                    await server.close()
        if out["concurrent"] is not None:
            chunks = cfg.concurrent_tokens // cfg.chunk_tokens
            prefixes = [await _stored_kv(store_url, context_id, profile, chunks) for context_id, _ in shared_prefixes]
            for (context_id, kv), levels in zip(shared_prefixes, prefixes):
                if not torch.equal(levels[0].view(torch.int16), kv.view(torch.int16)):
                    raise AssertionError(f"the exact level of {context_id} decodes to other bits than its prefill's KV")
            out["concurrent"]["by_level"] = await asyncio.to_thread(
                _answers_by_level, model, mixed, cfg.concurrent_tokens, prefixes, cfg.max_tokens)
    out["targets"] = _targets(out, cfg)
    return out


def _row(tokens: int, rate: float, full: list[Answer], fetched: list[Answer]) -> dict[str, Any]:
    full_s = _summary([a.first_token_seconds for a in full])
    fetched_s = _summary([a.first_token_seconds for a in fetched])
    return {"tokens": tokens, "rate_mbit": rate, "full_seconds": full_s, "fetched_seconds": fetched_s,
            "speedup": {k: full_s[k] / fetched_s[k] for k in full_s},
            "identical": sum(f.text == a.text for f, a in zip(full, fetched)),
            "prompts": [{"identical": f.text == a.text, "full_seconds": f.first_token_seconds,
                         "fetched_seconds": a.first_token_seconds, "levels": a.usage.get("kvwire", {}).get("levels"),
                         "prefix": a.usage.get("kvwire", {}).get("prefix"),
                         "fetched_tokens": a.usage.get("kvwire", {}).get("fetched_tokens")}
                        for f, a in zip(full, fetched)]}


async def _concurrent(server: Any, prompts: list[list[int]], reference: list[Answer], cfg: Config) -> dict[str, Any]:
    import aiohttp

    engine = server.engine
    before = engine.fetches
    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(*(_complete(session, server.url, p, cfg) for p in prompts),
                                       return_exceptions=True)
    errors = [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]
    answers = [r for r in results if isinstance(r, Answer)]
    requests = []
    for i, result in enumerate(results):
        if isinstance(result, Answer):
            kv = result.usage.get("kvwire", {})
            window = kv.get("fetch_window") or (None, None)
            requests.append({"prefix": i % 2, "how": kv.get("prefix"), "fetch_started": window[0],
                             "fetch_ended": window[1], "levels": kv.get("levels"),
                             "correct": result.text == reference[i].text})
    spans = {}
    for r in requests:
        if r["fetch_started"] is not None:
            spans.setdefault(r["prefix"], (r["fetch_started"], r["fetch_ended"]))
    overlap = (len(spans) == 2 and max(s for s, _ in spans.values()) < min(e for _, e in spans.values()))
    return {"requests": len(prompts), "fetches": engine.fetches - before, "errors": errors,
            "correct": sum(r["correct"] for r in requests), "answered": len(answers),
            "fetches_overlap": overlap, "per_request": requests}


def _targets(out: dict[str, Any], cfg: Config) -> list[dict[str, Any]]:
    rows = [r for r in out["rows"] if r["tokens"] == max(cfg.sizes) and r["rate_mbit"] == max(cfg.rates_mbit)]
    targets = []
    if rows:
        row = rows[0]
        targets.append({"target": f"{row['tokens']} stored tokens at {row['rate_mbit']:g} Mbit/s: first token "
                                  f">= {TARGET_SPEEDUP:g}x faster than full prefill (warm)",
                        "measured": round(row["speedup"]["warm"], 2), "met": row["speedup"]["warm"] >= TARGET_SPEEDUP})
        need = min(TARGET_IDENTICAL, len(row["prompts"]))
        targets.append({"target": f"greedy output identical to full prefill on >= {need} of {len(row['prompts'])}",
                        "measured": row["identical"], "met": row["identical"] >= need})
    conc = out["concurrent"]
    if conc is not None:
        ok = (conc["fetches"] == 2 and not conc["errors"] and conc["correct"] == conc["requests"]
              and conc["fetches_overlap"])
        targets.append({"target": f"{conc['requests']} concurrent requests over 2 prefixes: 2 fetches, no errors, "
                                  "all correct, fetches overlapping",
                        "measured": f"{conc['fetches']} fetches, {len(conc['errors'])} errors, "
                                    f"{conc['correct']}/{conc['requests']} correct, overlap {conc['fetches_overlap']}",
                        "met": ok})
    return targets


def render(out: dict[str, Any]) -> str:
    lines = ["| stored tokens | Mbit/s | full prefill s (cold / warm) | fetched s (cold / warm) | speedup (cold / warm) "
             "| identical |", "|---|---|---|---|---|---|"]
    for r in out["rows"]:
        lines.append(f"| {r['tokens']} | {r['rate_mbit']:g} | {r['full_seconds']['cold']:.3f} / "
                     f"{r['full_seconds']['warm']:.3f} | {r['fetched_seconds']['cold']:.3f} / "
                     f"{r['fetched_seconds']['warm']:.3f} | {r['speedup']['cold']:.1f}x / {r['speedup']['warm']:.1f}x "
                     f"| {r['identical']}/{len(r['prompts'])} |")
    conc = out["concurrent"]
    if conc is not None:
        lines.append("")
        lines.append(f"concurrent: {conc['requests']} requests, {conc['fetches']} fetches, errors {len(conc['errors'])}, "
                     f"correct {conc['correct']}/{conc['requests']}, fetches overlap: {conc['fetches_overlap']}")
        starts = [r["fetch_started"] for r in conc["per_request"] if r["fetch_started"] is not None]
        base = min(starts, default=0.0)
        lines.append("  (fetch windows in seconds from the first fetch's start)")
        for i, r in enumerate(conc["per_request"]):
            lines.append(f"  request {i:2d} prefix {r['prefix']} {r['how'] or '-':8s} fetch "
                         f"{_clock(r['fetch_started'], base)} .. {_clock(r['fetch_ended'], base)} "
                         f"levels {r['levels']} correct {r['correct']}")
        if conc.get("by_level"):
            lines.append("  the same prompts, every chunk of each prefix at one level (no server, no policy):")
            for row in conc["by_level"]:
                name = f"level {row['level']}" + (" (exact)" if row["level"] == 0 else "")
                lines.append(f"    {name:16s} correct {row['correct']}/{conc['requests']}"
                             + (f", parted: requests {row['parted']}" if row["parted"] else ""))
    lines.append("")
    for t in out["targets"]:
        lines.append(f"[{'met' if t['met'] else 'MISSED'}] {t['target']}: {t['measured']}")
    return "\n".join(lines)


def _clock(value: float | None, base: float) -> str:
    return "   -   " if value is None else f"{value - base:7.3f}"


def main(quick: bool = False, as_json: bool = False) -> dict[str, Any]:
    from streamer.tools.serve_fetch import run_async

    cfg = QUICK if quick else FULL
    out = run_async(lambda: run(cfg, say=(lambda *a: None) if as_json else print))
    print(json.dumps(out, indent=2) if as_json else render(out))
    return out


def _cmd_bench(args: argparse.Namespace) -> int:
    main(quick=args.quick, as_json=args.json)
    return 0


def register(subparsers: argparse._SubParsersAction, bench_subparsers: argparse._SubParsersAction) -> None:
    """Add ``kvwire bench serve``."""
    b = bench_subparsers.add_parser(
        "serve", help="OpenAI-compatible server: time to first token with stored prefixes vs full prefill",
        description="Serve SmolLM2 through /v1/completions with prefixes fetched from a shaped sender; "
                    "compare time to first token and greedy outputs with full prefill; 16 concurrent "
                    "requests over 2 shared prefixes. Prints measured vs target.")
    b.add_argument("--json", action="store_true", help="print machine-readable JSON")
    b.add_argument("--quick", action="store_true", help="small and fast (for tests; not the targets' sizes)")
    b.set_defaults(handler=_cmd_bench)
