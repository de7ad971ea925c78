"""``kvwire bench codec``'s coder cost: what the lane payloads spend against the ideal bits."""
from __future__ import annotations

import pytest

from codec import api, calibrate, layer_codec
from streamer.tools import bench_codec


@pytest.fixture(scope="module")
def small():
    workload = bench_codec.synthetic_workload("small", 1024)
    return calibrate([workload.calibration]), bench_codec.chunks_of(workload.measured, 512)


@pytest.mark.parametrize("level", [0, 3])
def test_coder_cost_adds_up_to_the_payload(small, level) -> None:
    profile, chunks = small
    row, blobs = bench_codec.measure_kvwire(profile, level, chunks, repeat=1)
    cost = bench_codec.coder_cost(profile, level, chunks, blobs)
    infos = [api.inspect(blob) for blob in blobs]
    assert cost.lanes == sum(info["lanes"] for info in infos) > 0
    assert cost.sections == sum(info["shape"][0] - len(info["sections"]["raw_layers"]) for info in infos)
    heads = 8 * layer_codec.LANE_HEAD.size * cost.sections
    assert cost.ideal_bits + heads + cost.lanes * cost.lane_cost_bits == pytest.approx(cost.payload_bits)
    assert cost.overhead == pytest.approx(cost.payload_bits / cost.ideal_bits - 1)
    # a lane's 48-bit table entry and 16-bit start state, less the < 16 bits of information
    # its final state carries above the 2^16 floor: over 32 bits, at most 48 plus the rounding
    assert 32 < cost.lane_cost_bits < 56


def test_coder_cost_without_coded_sections_is_zero(small) -> None:
    profile, chunks = small
    cost = bench_codec.coder_cost(profile, 0, [], [])
    assert (cost.lanes, cost.sections, cost.overhead, cost.lane_cost_bits) == (0, 0, 0.0, 0.0)
