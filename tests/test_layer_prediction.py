"""streamer.model.layer_prediction: inter-layer prediction as ``bench quality --ablation``
measures it, on KV whose layers follow from one another."""
from __future__ import annotations

import torch

import codec
from codec.synthetic import synthetic_kv
from streamer.model import layer_prediction

HEADS, HEAD_DIM, LAYERS = 2, 16, 4
ROPE = codec.Rotary(head_dim=HEAD_DIM, dim=HEAD_DIM, theta=10000.0)


def chained_kv(tokens: int, seed: int) -> torch.Tensor:
    """Layer 0 synthetic; each later layer a fixed linear map of the one before (the same
    maps for every draw) plus a little noise of its own."""
    maps = torch.Generator().manual_seed(7)
    base = synthetic_kv(1, HEADS, HEAD_DIM, tokens, seed=seed).float()   # [1, 2, T, H, D]
    noise = torch.Generator().manual_seed(seed + 1)
    values = [layer_prediction.position_free(base, None)[0]]
    for _ in range(1, LAYERS):
        mix = torch.randn(2 * HEADS * HEAD_DIM, 2 * HEADS * HEAD_DIM, generator=maps) / (2 * HEADS * HEAD_DIM) ** 0.5
        values.append(values[-1] @ mix + 0.4 * torch.randn(values[-1].shape, generator=noise))
    return layer_prediction.as_kv(torch.stack(values), HEADS, HEAD_DIM, ROPE)


def test_position_free_and_back_is_the_identity() -> None:
    kv = chained_kv(64, seed=3)
    back = layer_prediction.as_kv(layer_prediction.position_free(kv, ROPE), HEADS, HEAD_DIM, ROPE)
    assert torch.allclose(back, kv, atol=1e-5)


def test_prediction_codes_chained_layers_smaller_at_the_plain_levels_error() -> None:
    samples = [chained_kv(512, seed=s) for s in (10, 11)]
    profile = codec.calibrate(samples, rotary=ROPE)
    predictor = layer_prediction.fit(samples, profile)
    assert predictor.maps[0] is None and all(m is not None for m in predictor.maps[1:])
    kv = chained_kv(512, seed=20)
    for level in (1, 3):
        plain = codec.encode(kv, level, profile)
        plain_error = (codec.decode(plain, profile).float() - kv).pow(2).sum().item()
        decoded, nbytes = layer_prediction.code(predictor, kv, level, ROPE)
        assert decoded.shape == kv.shape
        error = (decoded - kv).pow(2).sum().item()
        # the residual aims at the plain level's absolute error, and it costs fewer bytes
        assert error < 1.25 * plain_error
        assert nbytes < 0.97 * len(plain)


def test_channel_groups_cover_every_channel_once() -> None:
    for grouping in layer_prediction.GROUPINGS:
        groups = layer_prediction.channel_groups(grouping, HEADS, HEAD_DIM)
        assert torch.equal(torch.cat(groups).sort().values, torch.arange(2 * HEADS * HEAD_DIM))
    head = layer_prediction.channel_groups("head", HEADS, HEAD_DIM)
    # a head's group holds its K channels and its V channels
    assert head[1].tolist() == list(range(HEAD_DIM, 2 * HEAD_DIM)) + list(range(3 * HEAD_DIM, 4 * HEAD_DIM))


def test_block_maps_predict_each_group_from_its_own_channels() -> None:
    values = layer_prediction.position_free(chained_kv(256, seed=4), ROPE)
    groups = layer_prediction.channel_groups("head", HEADS, HEAD_DIM)
    layer_map = layer_prediction.fit_maps(values, groups)[1]
    previous = values[0].clone()
    before = layer_map.predict(previous)
    previous[:, groups[0]] += 1.0     # disturb head 0's K and V only
    after = layer_map.predict(previous)
    assert torch.equal(before[:, groups[1]], after[:, groups[1]])
    assert not torch.allclose(before[:, groups[0]], after[:, groups[0]])
    full = layer_prediction.fit_maps(values, layer_prediction.channel_groups("all", HEADS, HEAD_DIM))[1]
    assert layer_map.values < full.values


def test_a_restart_layer_decodes_without_the_layers_before_it() -> None:
    samples = [chained_kv(256, seed=s) for s in (30, 31)]
    profile = codec.calibrate(samples, rotary=ROPE)
    predictor = layer_prediction.fit(samples, profile, restart=2)
    assert [m is None for m in predictor.maps] == [True, False, True, False]
    facts = predictor.facts()
    assert facts["intra_layers"] == 2
    assert facts["map_values"] == sum(m.values for m in predictor.maps if m is not None)
    kv = chained_kv(256, seed=40)
    other = kv.clone()
    other[:2] = chained_kv(256, seed=41)[:2]   # other layers before the restart
    decoded, _ = layer_prediction.code(predictor, kv, 2, ROPE)
    decoded_other, _ = layer_prediction.code(predictor, other, 2, ROPE)
    assert not torch.equal(decoded[1], decoded_other[1])
    assert torch.equal(decoded[2:], decoded_other[2:])
