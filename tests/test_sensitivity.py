"""streamer.model.sensitivity: a causal LM's sensitivity to each (layer, K/V)'s KV error,
from Fisher traces, is the KL per token per unit MSE/var that white noise of that MSE/var
in the section actually costs (issue #14 item 3)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from streamer.model import hf
from streamer.model.sensitivity import kv_sensitivity, section_energy

CONTEXT, CONTINUATION, SINKS = 96, 48, 4


@pytest.fixture(scope="module")
def llama():
    return hf.random_llama(layers=2, hidden=64, heads=4, kv_heads=2, vocab=256, max_positions=512, seed=1)


@pytest.fixture(scope="module")
def ids() -> list[int]:
    return torch.randint(0, 256, (400,), generator=torch.Generator().manual_seed(3)).tolist()


def _noise_kl(model, kv: torch.Tensor, continuation: list[int], layer: int, kind: int, mse: float,
              repeats: int) -> float:
    """Mean KL per continuation token of white noise of MSE/var ``mse`` in one section."""
    reference = torch.log_softmax(hf.continuation_logits(model, kv, continuation).double(), -1)
    energy = float(section_energy(kv, SINKS)[layer, kind])
    sigma = (mse * energy / (kv.shape[3] * kv.shape[4])) ** 0.5
    generator = torch.Generator().manual_seed(7)
    total = 0.0
    for _ in range(repeats):
        noisy = kv.clone()
        noisy[layer, kind, SINKS:] += sigma * torch.randn(noisy[layer, kind, SINKS:].shape, generator=generator)
        logp = torch.log_softmax(hf.continuation_logits(model, noisy, continuation).double(), -1)
        total += float((reference.exp() * (reference - logp)).sum(-1).mean())
    return total / repeats


def test_sensitivity_is_the_kl_noise_costs(llama, ids) -> None:
    model, tokenizer = llama
    s = kv_sensitivity(model, tokenizer, ids, context_tokens=CONTEXT, continuation_tokens=CONTINUATION,
                       windows=1, draws=16, sink_tokens=SINKS)
    assert s.shape == (2, 2) and np.all(s > 0)
    kv = hf.capture_kv(model, tokenizer, ids[:CONTEXT])
    mse = 1e-2
    for layer, kind in [(0, 1), (1, 0)]:
        direct = _noise_kl(model, kv, ids[CONTEXT:CONTEXT + CONTINUATION], layer, kind, mse, repeats=4) / mse
        assert 0.6 < direct / s[layer, kind] < 1.6, (layer, kind, direct, s[layer, kind])


def test_sensitivity_is_reproducible_and_fits_short_texts(llama, ids) -> None:
    model, tokenizer = llama
    kwargs = dict(context_tokens=600, continuation_tokens=300, windows=1, draws=1)  # past 512 positions
    np.testing.assert_array_equal(kv_sensitivity(model, tokenizer, ids[:200], **kwargs),
                                  kv_sensitivity(model, tokenizer, ids[:200], **kwargs))
    with pytest.raises(ValueError, match="more than"):
        kv_sensitivity(model, tokenizer, ids[:5], **kwargs)


@pytest.mark.model
def test_an_encoder_has_no_continuation_to_measure() -> None:
    model, tokenizer = hf.load_model(hf.minilm_path())
    with pytest.raises(ValueError, match="encoder"):
        kv_sensitivity(model, tokenizer, list(range(100, 400)))
