"""streamer.model.ablation: the pieces ``kvwire bench quality --ablation`` is built from."""
from __future__ import annotations

import pytest
import torch

import codec
from streamer.model import ablation


def _kv(layers: int = 3, tokens: int = 200, heads: int = 2, head_dim: int = 8, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(heads * head_dim, heads * head_dim, generator=g)
    x = torch.randn(layers, 2, tokens, heads * head_dim, generator=g) @ mix
    return x.reshape(layers, 2, tokens, heads, head_dim)


@pytest.fixture(scope="module")
def profile():
    return codec.calibrate([_kv(seed=s) for s in (1, 2)], targets=(1e-3, 1e-2, 3e-2))


def test_restore_puts_back_only_the_part_asked_for():
    kv, decoded = _kv(), torch.zeros(3, 2, 200, 2, 8)
    keys = ablation.restore(decoded, kv, kind=0)
    assert torch.equal(keys[:, 0], kv[:, 0]) and not keys[:, 1].any()
    layer = ablation.restore(decoded, kv, layers=slice(1, 2))
    assert torch.equal(layer[1], kv[1]) and not layer[0].any() and not layer[2].any()
    picked = torch.tensor([3, 150])
    tokens = ablation.restore(decoded, kv, tokens=picked)
    others = torch.ones(200, dtype=torch.bool)
    others[picked] = False
    assert torch.equal(tokens[:, :, picked], kv[:, :, picked]) and not tokens[:, :, others].any()
    values_first = ablation.restore(decoded, kv, kind=1, tokens=slice(0, 5))
    assert torch.equal(values_first[:, 1, :5], kv[:, 1, :5])
    assert not values_first[:, 0].any() and not values_first[:, 1, 5:].any()
    assert not decoded.any()   # the input is left alone


def test_encode_split_codes_each_range_as_its_own_blob(profile):
    kv = _kv(seed=3)
    whole, nbytes = ablation.encode_split(kv, profile, [(200, 1, None)])
    blob = codec.encode(kv, 1, profile)
    assert nbytes == len(blob) and torch.equal(whole, codec.decode(blob, profile).float())
    split, split_bytes = ablation.encode_split(kv, profile, [(150, 2, None), (200, 0, 0)])
    tail = codec.encode(kv[:, :, 150:].contiguous(), 0, profile, sink_tokens=0, start=150)
    head = codec.encode(kv[:, :, :150].contiguous(), 2, profile)
    assert split_bytes == len(head) + len(tail)
    assert torch.equal(split[:, :, 150:], codec.decode(tail, profile).float())
    # the finer tail is closer to the original than the coarse head
    assert (split[:, :, 150:] - kv[:, :, 150:]).square().mean() < (split[:, :, 4:150] - kv[:, :, 4:150]).square().mean()
    with pytest.raises(ValueError):
        ablation.encode_split(kv, profile, [(150, 1, None)])
    with pytest.raises(ValueError):
        ablation.encode_split(kv, profile, [(150, 1, None), (120, 1, 0), (200, 1, 0)])


def test_attention_received_sums_every_querys_attention_and_finds_the_attended_key():
    layers, tokens, heads, kv_heads, dim = 2, 12, 4, 2, 8
    g = torch.Generator().manual_seed(5)
    keys = 0.1 * torch.randn(layers, tokens, kv_heads, dim, generator=g)
    queries = 0.1 * torch.randn(layers, tokens, heads, dim, generator=g)
    keys[:, 7] = 0.0
    keys[:, 7, :, 0] = 4.0          # key 7 matches every query that points along channel 0
    queries[:, 7:, :, 0] = 4.0
    received = ablation.attention_received(queries, keys, [dim ** -0.5] * layers)
    # each query's causal softmax sums to one: the total is layers x heads x tokens
    assert received.sum().item() == pytest.approx(layers * heads * tokens)
    assert int(received[1:].argmax()) + 1 == 7
    window = ablation.Window(torch.stack([torch.stack([keys[l], keys[l]]) for l in range(layers)]), queries,
                             [dim ** -0.5] * layers, torch.zeros(1), 0)
    picked = ablation.high_attention_tokens(window, 2, skip=3)
    assert 7 in picked.tolist() and all(i >= 3 for i in picked.tolist())


def test_group_size_and_resolve():
    assert ablation.group_size(1024, 128) == 128 and ablation.group_size(64, 128) == 16
    assert ablation.group_size(2, 16) == 1
    assert [a.name for a in ablation.resolve(None)] == list(ablation.ABLATIONS)
    assert [a.name for a in ablation.resolve(["exact-V", "sinks-0"])] == ["exact-V", "sinks-0"]
    assert {a.kind for a in ablation.ABLATIONS.values()} == {"codec", "oracle"}
    with pytest.raises(ValueError, match="unknown ablation"):
        ablation.resolve(["exact-everything"])
