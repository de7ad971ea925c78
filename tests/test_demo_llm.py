"""``kvwire demo --model ...`` on a causal LM (streamer/tools/demo_llm.py): the run completes
and its ``--json`` summary has the MiniLM demo's keys plus the LLM's. Timings are not
checked (2 shared cores).

A small random Llama saved to a temporary directory (byte-level tokenizer, no download)
drives the whole path quickly; SmolLM2 (the session fixture ``smollm2``) runs it for real.
"""
from __future__ import annotations

import json

import pytest

from streamer.model import hf
from streamer.tools import demo, demo_llm
from streamer.tools.cli import build_parser, main

#: What the MiniLM demo's --json prints (streamer.tools.demo.run): the LLM demo keeps them all.
MINILM_KEYS = {"slo", "recompute_ms_per_token", "deadline_met", "total_seconds", "last_byte_seconds",
               "first_layer_seconds", "levels", "text_chunks", "bytes", "cosine", "profile_bytes",
               "open_seconds", "quality", "start", "warmup_seconds", "warmup", "tokens", "shape", "profile_id",
               "trace", "trace_offset_seconds", "fetch", "methods", "plot", "seconds"}
LLM_KEYS = {"model", "question", "max_new_tokens", "answer_fetched", "answer_recompute", "answer_fetched_ids",
            "answer_recompute_ids", "answers_identical", "ttft_fetched_seconds", "ttft_recompute_seconds",
            "first_token_after_fetch_seconds", "bytes_fp16", "compression", "perplexity_recompute",
            "perplexity_fetched", "perplexity_change", "top1_agreement", "scored_tokens"}
METHODS = ["full recompute", "raw fp16", "8-bit", "kvwire (mpc)"]


def _check_summary(doc: dict, tokens: int) -> None:
    assert set(doc) == MINILM_KEYS | LLM_KEYS
    assert list(doc["quality"]) == METHODS and [m["method"] for m in doc["methods"]] == METHODS
    assert doc["tokens"] == tokens and doc["shape"][2] == tokens
    assert doc["bytes"] == doc["fetch"]["bytes"] and 0 < doc["bytes"] < doc["bytes_fp16"]
    assert doc["answers_identical"] == (doc["answer_fetched_ids"] == doc["answer_recompute_ids"])
    assert 1 <= doc["scored_tokens"] == len(doc["answer_recompute_ids"]) <= doc["max_new_tokens"]
    assert doc["quality"]["full recompute"]["perplexity_change"] == 0.0
    assert doc["perplexity_fetched"] == doc["quality"]["kvwire (mpc)"]["perplexity"] > 0
    assert doc["ttft_fetched_seconds"] > 0 and doc["ttft_recompute_seconds"] > 0
    assert doc["start"] in ("cold", "warm") and doc["cosine"] is None


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("random-llama")
    model, tokenizer = hf.random_llama(layers=2, hidden=64, heads=4, kv_heads=2, vocab=256,
                                       max_positions=4096, seed=3)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_the_llm_demo_runs_end_to_end_on_a_causal_lm_path(llama_dir, tmp_path, capsys) -> None:
    """`--model` takes a local causal LM path too: the demo dispatches on the model's kind."""
    assert main(["demo", "--model", llama_dir, "--json", "--tokens", "600", "--max-new-tokens", "5",
                 "--slo", "10", "--out-dir", str(tmp_path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    ids = demo_llm.prompt_ids(hf.load_model(llama_dir)[1], hf.read_text([hf.MEASURE_TEXT]), 600,
                              demo_llm.QUESTION)
    _check_summary(doc, len(ids))
    assert doc["deadline_met"] and (tmp_path / "demo_llm_levels.png").stat().st_size > 0


def test_a_prompt_is_the_document_then_the_question(llama_dir) -> None:
    _, tokenizer = hf.load_model(llama_dir)   # no chat template: the plain format
    ids = demo_llm.prompt_ids(tokenizer, "one two three four", 2, "Why?")
    assert tokenizer.decode(ids) == "on\n\nQuestion: Why?\nAnswer:"


def test_a_model_that_is_not_there_exits_2(tmp_path, capsys) -> None:
    assert main(["demo", "--model", str(tmp_path / "missing")]) == 2
    assert "no such local directory" in capsys.readouterr().err


def test_max_new_tokens_must_be_positive(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--max-new-tokens", "0"])
    assert "at least 1" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.timeout(900)   # ~1-4 min on 2 shared cores: past the suite's 300 s default when they are busy
def test_the_llm_demo_on_smollm2(smollm2, tmp_path, capsys) -> None:
    """The real thing, shortened: a 300-token document, a 6-token answer, a loose SLO, and
    a profile calibrated on 1024 tokens and passed as ``--profile`` (the demo's own 2048-token
    calibration is ~40 s of CPU here; the random-Llama test above runs that path)."""
    model, tokenizer = smollm2
    args = build_parser().parse_args(["demo", "--model", "smollm2", "--json", "--tokens", "300",
                                      "--max-new-tokens", "6", "--slo", "30",
                                      "--profile", str(tmp_path / "smollm2.kvprofile"), "--out-dir", str(tmp_path)])
    demo.demo_profile(args, model, tokenizer, 1024, lambda *a, **k: None)   # saved to --profile
    result = demo_llm.run(args, model, tokenizer)
    doc = json.loads(capsys.readouterr().out)
    assert doc == json.loads(json.dumps(result))
    _check_summary(doc, len(demo_llm.prompt_ids(tokenizer, hf.read_text([hf.MEASURE_TEXT]), 300,
                                                demo_llm.QUESTION)))
    assert doc["model"].startswith("SmolLM2") and doc["shape"][0] == 30
