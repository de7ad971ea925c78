"""``kvwire demo`` on a causal LM (streamer/tools/demo_llm.py): the run completes, its
``--json`` summary has the shared keys and the LLM's, the answers from full prefill are
the model's own greedy answers, the KV the answers come from is the decoded KV, and the
shipped SmolLM2 profile fits the model. Timings are not checked (2 shared cores).

A small random Llama saved to a temporary directory (byte-level tokenizer, no download)
drives the whole path quickly; SmolLM2 (the session fixture ``smollm2``) runs it for real.
"""
from __future__ import annotations

import asyncio
import json

import pytest
import torch

import codec
import streamer
from streamer.model import hf, quality
from streamer.tools import demo_llm
from streamer.tools.cli import build_parser, main

#: what every demo's --json holds (streamer.tools.demo_common.fetch_summary)
SHARED_KEYS = {"slo", "recompute_ms_per_token", "deadline_met", "total_seconds", "last_byte_seconds",
               "first_layer_seconds", "levels", "text_chunks", "bytes", "profile_bytes", "open_seconds",
               "start", "warmup_seconds", "warmup", "profile_id", "trace", "trace_offset_seconds", "fetch", "plot"}
LLM_KEYS = {"model", "text", "tokens", "shape", "chunk_tokens", "max_new_tokens", "profile_source", "answers",
            "identical", "questions", "ttft_fetched_seconds", "ttft_full_seconds", "speedup_median",
            "speedup_min", "bytes_fp16", "compression", "baselines", "seconds", "step_seconds"}
ANSWER_KEYS = {"question", "suffix_tokens", "answer_fetched", "answer_full", "answer_fetched_ids", "answer_full_ids",
               "identical", "first_difference", "ttft_fetched_seconds", "question_prefill_seconds",
               "ttft_full_seconds", "speedup"}


def _check_summary(doc: dict, prompt: demo_llm.Prompt, max_new_tokens: int) -> None:
    assert set(doc) == SHARED_KEYS | LLM_KEYS
    tokens = len(prompt.context)
    assert doc["tokens"] == tokens and doc["shape"][2] == tokens
    assert len(doc["levels"]) == -(-tokens // doc["chunk_tokens"]) == len(doc["fetch"]["chunks"])
    assert doc["bytes"] == doc["fetch"]["bytes"] and 0 < doc["bytes"] < doc["bytes_fp16"] == 2 * \
        doc["shape"][0] * 2 * tokens * doc["shape"][3] * doc["shape"][4]
    assert doc["questions"] == len(doc["answers"]) == len(prompt.questions)
    assert doc["identical"] == sum(a["identical"] for a in doc["answers"])
    for a, question, suffix in zip(doc["answers"], prompt.questions, prompt.suffixes):
        assert set(a) == ANSWER_KEYS and a["question"] == question and a["suffix_tokens"] == len(suffix)
        assert a["identical"] == (a["answer_fetched_ids"] == a["answer_full_ids"])
        assert a["identical"] == (a["first_difference"] is None)
        if not a["identical"]:
            d = a["first_difference"]
            assert a["answer_fetched_ids"][:d] == a["answer_full_ids"][:d]
        assert 1 <= len(a["answer_full_ids"]) <= max_new_tokens
        # the fetched way's TTFT is the fetch plus the question's prefill over its KV
        assert a["ttft_fetched_seconds"] == pytest.approx(doc["total_seconds"] + a["question_prefill_seconds"])
        assert a["speedup"] == pytest.approx(a["ttft_full_seconds"] / a["ttft_fetched_seconds"])
    assert doc["ttft_full_seconds"] == [a["ttft_full_seconds"] for a in doc["answers"]]
    fp16 = doc["baselines"]["raw fp16"]
    assert fp16["bytes"] == doc["bytes_fp16"] and fp16["meets_slo"] == (fp16["transfer_seconds"] <= doc["slo"])
    assert doc["start"] in ("cold", "warm")


def _full_prefill_answers_are_generates(model, prompt: demo_llm.Prompt, doc: dict) -> None:
    """Each full-prefill answer is what transformers' own greedy ``generate`` gives on the
    whole prompt (document and question)."""
    for i, a in enumerate(doc["answers"]):
        ids = torch.tensor([prompt.ids(i)])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=doc["max_new_tokens"], pad_token_id=0)
        assert out[0, ids.shape[1]:].tolist() == a["answer_full_ids"]


def _fetched_kv_is_the_decoded_kv(model, store_url: str, result: demo_llm.LLMDemo) -> None:
    """The KV the answers were generated over is, chunk by chunk, the store's blob at the
    level the fetch chose, decoded (a chunk sent as text: recomputed over the KV before it),
    and the fetched answers are the greedy answers over it."""

    async def read():
        async with await streamer.open_store(store_url) as store:
            manifest = await store.get_manifest("demo")
            profile = codec.Profile.from_bytes(await store.get_profile_bytes(manifest.profile_id))
            blobs = {c.index: await store.get_chunk("demo", manifest.version, c.index, level)
                     for c, level in zip(manifest.chunks, result.summary["levels"]) if level != "text"}
            return manifest, profile, blobs

    manifest, profile, blobs = asyncio.run(read())
    kv = result.fetched_kv
    assert kv.shape[2] == manifest.tokens == len(result.prompt.context)
    for chunk, level in zip(manifest.chunks, result.summary["levels"]):
        piece = kv[:, :, chunk.start:chunk.end]
        if level == "text":
            recomputed = hf.recompute_chunk(model, kv[:, :, :chunk.start] if chunk.start else None,
                                            result.prompt.context[chunk.start:chunk.end])
            torch.testing.assert_close(piece, recomputed)
        else:
            assert torch.equal(piece, codec.decode(blobs[chunk.index], profile).float())
    for i, a in enumerate(result.summary["answers"]):
        assert hf.generate_with_kv(model, None, kv, result.prompt.suffixes[i],
                                   max_new_tokens=result.summary["max_new_tokens"]) == a["answer_fetched_ids"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("random-llama")
    model, tokenizer = hf.random_llama(layers=2, hidden=64, heads=4, kv_heads=2, vocab=256,
                                       max_positions=4096, seed=3)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.slow
def test_the_llm_demo_runs_end_to_end_on_a_causal_lm_path(llama_dir, tmp_path, capsys) -> None:
    """`--model` takes a local causal LM path: the command dispatches on the model's kind,
    prints one JSON document and nothing else under --json."""
    assert main(["demo", "--model", llama_dir, "--json", "--tokens", "600", "--questions", "2",
                 "--max-new-tokens", "5", "--slo", "10", "--out-dir", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert captured.err == ""
    model, tokenizer = hf.load_model(llama_dir)
    prompt = demo_llm.build_prompt(tokenizer, hf.read_text([hf.MEASURE_TEXT]), 600, demo_llm.QUESTIONS[:2])
    _check_summary(doc, prompt, 5)
    assert doc["deadline_met"] and doc["profile_source"] == "calibrated"
    assert (tmp_path / "demo_llm_levels.png").stat().st_size > 0
    _full_prefill_answers_are_generates(model, prompt, doc)


@pytest.mark.slow
def test_the_llm_demo_prints_each_answer_both_ways(llama_dir, tmp_path, capsys) -> None:
    """Without --json: the progress (bars on stderr, ticked by forward hooks that must leave
    the model's outputs alone), each question's two answers and the summary lines."""
    assert main(["demo", "--model", llama_dir, "--tokens", "300", "--questions", "2", "--max-new-tokens", "3",
                 "--slo", "10", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("fetched KV   (TTFT") == 2 and out.count("full prefill (TTFT") == 2
    assert out.count("IDENTICAL") + out.count("DIFFERENT from token") == 2
    for line in ("answers identical to full prefill's on", "time to first token on this CPU", "bytes moved",
                 "raw fp16 over the same trace", "demo took"):
        assert line in out


@pytest.mark.slow
@pytest.mark.parametrize("policy, expect", [("fixed:1", {1}), ("text", {"text"})])
def test_the_fetched_kv_is_the_decoded_kv(llama_dir, tmp_path, capsys, policy, expect) -> None:
    """Every chunk at one level (decoded blobs) or as text (recomputed over the KV before it)."""
    model, tokenizer = hf.load_model(llama_dir)
    args = build_parser().parse_args(["demo", "--model", llama_dir, "--json", "--tokens", "700",
                                      "--question", "Why?", "--max-new-tokens", "4", "--slo", "10",
                                      "--policy", policy, "--out-dir", str(tmp_path)])
    result = demo_llm.run(args, model, tokenizer)
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(result.summary))
    assert result.prompt.questions == ("Why?",) and set(result.summary["levels"]) == expect
    _fetched_kv_is_the_decoded_kv(model, str(tmp_path / "store-llm"), result)


def test_a_prompt_is_the_document_then_each_question(llama_dir) -> None:
    _, tokenizer = hf.load_model(llama_dir)   # no chat template: the plain format
    prompt = demo_llm.build_prompt(tokenizer, "one two three four", 2, ("Why?", "How?"))
    assert tokenizer.decode(prompt.context) == "on\n\n"
    assert [tokenizer.decode(prompt.ids(i)) for i in range(2)] == ["on\n\nQuestion: Why?\nAnswer:",
                                                                   "on\n\nQuestion: How?\nAnswer:"]


def test_first_difference() -> None:
    assert demo_llm.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert demo_llm.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert demo_llm.first_difference([1, 2], [1, 2, 3]) == 2


def test_a_model_that_is_not_there_exits_2(tmp_path, capsys) -> None:
    assert main(["demo", "--model", str(tmp_path / "missing")]) == 2
    assert "no such local directory" in capsys.readouterr().err


@pytest.mark.parametrize("option", [["--max-new-tokens", "0"], ["--questions", "0"],
                                    ["--questions", str(len(demo_llm.QUESTIONS) + 1)], ["--tokens", "0"]])
def test_counts_are_checked(option, capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", *option])
    assert "argument" in capsys.readouterr().err


def test_the_demo_defaults_to_smollm2() -> None:
    args = build_parser().parse_args(["demo"])
    assert args.model == "smollm2" and args.slo is None and args.questions == len(demo_llm.QUESTIONS) >= 5
    assert args.max_new_tokens == demo_llm.MAX_NEW_TOKENS >= 32


def test_the_shipped_profile_loads_and_has_smollm2s_shape() -> None:
    """The profile file the demo ships: small, the codec's own format, SmolLM2's KV shape
    (30 layers x 3 KV heads x 64), RoPE removed, sensitivity weights, and the transform and
    levels ``write_profile`` calibrates with."""
    assert demo_llm.PROFILE.stat().st_size < 4_000_000
    profile = codec.Profile.load(demo_llm.PROFILE)
    assert (profile.layers, profile.heads, profile.head_dim) == (30, 3, 64)
    assert profile.rotary is not None and profile.rotary.head_dim == 64
    assert profile.weights is not None and profile.transform == demo_llm.PROFILE_TRANSFORM
    assert profile.targets == pytest.approx(demo_llm.PROFILE_TARGETS)
    blob = codec.encode(torch.randn(30, 2, 40, 3, 64, dtype=torch.float16), codec.DEFAULT_LEVEL, profile)
    assert codec.decode(blob, profile).shape == (30, 2, 40, 3, 64)


@pytest.mark.model
def test_the_shipped_profile_fits_the_model(smollm2) -> None:
    model, _ = smollm2
    profile = codec.Profile.load(demo_llm.PROFILE)
    profile.check_shape(*hf.kv_shape(model))
    assert profile.rotary == quality.model_rotary(model)


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.timeout(900)   # a few minutes on 2 busy cores: past the suite's 300 s default
def test_the_llm_demo_on_smollm2(smollm2, tmp_path, capsys) -> None:
    """The real thing, shortened: a 300-token document, two questions, 8-token answers, a
    loose SLO, the shipped profile."""
    model, tokenizer = smollm2
    args = build_parser().parse_args(["demo", "--json", "--tokens", "300", "--questions", "2",
                                      "--max-new-tokens", "8", "--slo", "30", "--out-dir", str(tmp_path)])
    result = demo_llm.run(args, model, tokenizer)
    doc = json.loads(capsys.readouterr().out)
    assert doc == json.loads(json.dumps(result.summary))
    prompt = result.prompt
    assert prompt == demo_llm.build_prompt(tokenizer, hf.read_text([hf.MEASURE_TEXT]), 300, demo_llm.QUESTIONS[:2])
    # the chat format: the document in the user's turn, each question ending it
    assert tokenizer.decode(prompt.context).startswith("<|im_start|>system")
    assert tokenizer.decode(prompt.suffixes[0]).endswith("<|im_end|>\n<|im_start|>assistant\n")
    _check_summary(doc, prompt, 8)
    assert doc["model"].startswith("SmolLM2") and doc["shape"][0] == 30 and doc["profile_source"] == "shipped"
    _full_prefill_answers_are_generates(model, prompt, doc)
