"""streamer.model.sensitivity: a model's sensitivity to each (layer, K/V)'s KV error is
what white noise of that MSE/var in the section actually costs: for a causal LM the KL per
continuation token (Fisher traces), for an encoder (MiniLM) 1 - cosine of the sentence
embedding (Jacobian traces) (issue #14 item 3)."""
from __future__ import annotations

from typing import Callable

import numpy as np
import pytest
import torch

from streamer.model import hf, quality
from streamer.model.sensitivity import kv_sensitivity, section_energy

CONTEXT, CONTINUATION, SINKS = 96, 48, 4


@pytest.fixture(scope="module")
def llama():
    return hf.random_llama(layers=2, hidden=64, heads=4, kv_heads=2, vocab=256, max_positions=512, seed=1)


@pytest.fixture(scope="module")
def ids() -> list[int]:
    return torch.randint(0, 256, (400,), generator=torch.Generator().manual_seed(3)).tolist()


def _noise_cost(kv: torch.Tensor, layer: int, kind: int, mse: float, repeats: int, seed: int,
                cost: Callable[[torch.Tensor], float]) -> float:
    """Mean ``cost(noisy kv)`` over ``repeats`` draws of white noise of MSE/var ``mse`` in one
    section (the coded tokens, after the sinks)."""
    energy = float(section_energy(kv, SINKS)[layer, kind])
    sigma = (mse * energy / (kv.shape[3] * kv.shape[4])) ** 0.5
    generator = torch.Generator().manual_seed(seed)
    total = 0.0
    for _ in range(repeats):
        noisy = kv.clone()
        noisy[layer, kind, SINKS:] += sigma * torch.randn(noisy[layer, kind, SINKS:].shape, generator=generator)
        total += cost(noisy)
    return total / repeats


def _noise_kl(model, kv: torch.Tensor, continuation: list[int], layer: int, kind: int, mse: float,
              repeats: int) -> float:
    """Mean KL per continuation token of white noise of MSE/var ``mse`` in one section."""
    reference = torch.log_softmax(hf.continuation_logits(model, kv, continuation).double(), -1)

    def kl(noisy: torch.Tensor) -> float:
        logp = torch.log_softmax(hf.continuation_logits(model, noisy, continuation).double(), -1)
        return float((reference.exp() * (reference - logp)).sum(-1).mean())

    return _noise_cost(kv, layer, kind, mse, repeats, 7, kl)


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
    with pytest.raises(ValueError, match="two tokens after"):
        kv_sensitivity(model, tokenizer, ids[:5], **kwargs)


def _noise_one_minus_cosine(model, kv: torch.Tensor, ids: list[int], layer: int, kind: int, mse: float,
                            repeats: int) -> float:
    """Mean 1 - cos of the sentence embedding under white noise of MSE/var ``mse`` in one section."""
    reference = hf.sentence_embedding(model, ids, kv).double()
    return _noise_cost(kv, layer, kind, mse, repeats, 11,
                       lambda noisy: 1.0 - float(reference @ hf.sentence_embedding(model, ids, noisy).double()))


@pytest.mark.model
def test_encoder_sensitivity_is_the_one_minus_cosine_noise_costs(minilm_kv) -> None:
    """On MiniLM the sections' sensitivities span two orders of magnitude; the most and the
    least sensitive one each predict what noise there costs, and so their ratio."""
    model, tokenizer, ids = minilm_kv["model"], minilm_kv["tokenizer"], minilm_kv["measure_ids"]
    s = kv_sensitivity(model, tokenizer, ids, windows=1, draws=8, sink_tokens=SINKS)
    assert s.shape == (6, 2) and np.all(s > 0)
    high, low = np.unravel_index(s.argmax(), s.shape), np.unravel_index(s.argmin(), s.shape)
    assert s[high] > 10 * s[low]
    mse = 1e-2  # 1 - cos of at most a few 1e-4: the second-order model holds
    direct = {section: _noise_one_minus_cosine(model, minilm_kv["measure_kv"], ids, *section, mse, repeats=4) / mse
              for section in (high, low)}
    for section, measured in direct.items():
        assert 0.6 < measured / s[section] < 1.6, (section, measured, s[section])
    assert 0.5 < (direct[high] / direct[low]) / (s[high] / s[low]) < 2.0


@pytest.mark.model
def test_encoder_sensitivity_is_seeded_and_fits_short_texts(minilm_kv) -> None:
    model, tokenizer, ids = minilm_kv["model"], minilm_kv["tokenizer"], minilm_kv["calib_ids"]
    kwargs = dict(windows=1, draws=1, sink_tokens=SINKS)
    # a window past the model's 512 positions and the text: one window of the 100 tokens there are
    short = kv_sensitivity(model, tokenizer, ids[:100], context_tokens=1000, seed=5, **kwargs)
    np.testing.assert_array_equal(short, kv_sensitivity(model, tokenizer, ids[:100], context_tokens=1000,
                                                        seed=5, **kwargs))
    assert not np.array_equal(short, kv_sensitivity(model, tokenizer, ids[:100], seed=6, **kwargs))
    with pytest.raises(ValueError, match="two tokens after"):
        kv_sensitivity(model, tokenizer, ids[:SINKS + 1], **kwargs)
    assert np.all(kv_sensitivity(model, tokenizer, ids[:SINKS + 2], **kwargs) > 0)


@pytest.mark.model
def test_encoder_weights_favour_its_sensitive_sections(minilm_kv) -> None:
    """``model_weights`` allocates an encoder too: the more sensitive a section, the smaller
    its target weight, at geometric mean 1."""
    model, tokenizer, ids = minilm_kv["model"], minilm_kv["tokenizer"], minilm_kv["calib_ids"][:1024]
    weights = quality.model_weights(model, tokenizer, ids, allocation=True)
    s = kv_sensitivity(model, tokenizer, ids)
    assert weights.shape == (6, 2) and weights.max() > weights.min()
    assert np.all(np.diff(weights.ravel()[np.argsort(s.ravel())]) <= 0)
    assert abs(float(np.log(weights.astype(np.float64)).mean())) < 1e-5
