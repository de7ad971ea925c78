"""``kvwire bench codec``'s coder cost: what the lane payloads spend against the ideal bits."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import codec
from codec import api, calibrate, container, layer_codec
from streamer.model import quality
from streamer.tools import bench_codec


@pytest.fixture(scope="module")
def small():
    workload = bench_codec.synthetic_workload("small", 1024)
    return calibrate([workload.calibration]), bench_codec.chunks_of(workload.measured, 512)


@pytest.fixture(scope="module")
def small_rotary():
    """The small workload with RoPE on its keys at their positions in the context, and a
    profile that codes keys position-free: chunks after the first start past 0."""
    from codec import Rotary
    from codec.rotary import rotate

    workload = bench_codec.synthetic_workload("small", 1024)
    rotary = Rotary(head_dim=16, dim=16, theta=10000.0)

    def with_rope(kv):
        kv = kv.clone()
        tokens = kv.shape[2]
        for layer in range(kv.shape[0]):
            keys = kv[layer, 0].reshape(tokens, -1)
            kv[layer, 0] = rotate(keys, rotary, rotary.angles(0, tokens)).reshape(kv[layer, 0].shape)
        return kv

    profile = calibrate([with_rope(workload.calibration)], rotary=rotary)
    return profile, bench_codec.chunks_of(with_rope(workload.measured), 512)


@pytest.mark.parametrize("rope", [False, True], ids=["plain", "rotary"])
@pytest.mark.parametrize("level", [0, 3])
def test_coder_cost_adds_up_to_the_payload(small, small_rotary, level, rope) -> None:
    """Also with RoPE: the chunks are coded at their start positions, and the coder cost
    re-quantizes them at the positions their blobs record (at any other the integers, and
    so the ideal bits, are not the payload's)."""
    profile, chunks = small_rotary if rope else small
    row, blobs = bench_codec.measure_kvwire(profile, level, chunks, repeat=1)
    cost = bench_codec.coder_cost(profile, level, chunks, blobs)
    infos = [api.inspect(blob) for blob in blobs]
    assert [api.parse_header(blob).start for blob in blobs] == [0, 512]
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


@pytest.mark.parametrize("rope,predict", [(False, 0), (True, 0), (True, 2)], ids=["plain", "rotary", "predicted"])
def test_stage_table_adds_up_to_the_recorded_decode(small, small_rotary, rope, predict) -> None:
    """``kvwire bench codec --stages``: every stage the decoder marks gets a row, the rows
    (the remainder included) add up to the recorded decode, and the work-bound stages
    carry a bound; RoPE only with a rotary profile. A predicting profile's transform
    FLOPs count its prediction rows."""
    from codec import stages
    from codec.calibration import calibrate_like

    profile, chunks = small_rotary if rope else small
    if predict:
        profile = calibrate_like(profile, [torch.cat(chunks, dim=2)], predict=predict)
        blobs = [api.encode(c.half(), 2, profile) for c in chunks]
        want = 0.0
        for blob in blobs:
            h = api.parse_header(blob)
            for layer in range(h.layers):
                if not h.is_raw(layer):
                    lanes = container.split_section(container.section(blob, h, layer), h, layer)[1]
                    kept = layer_codec.parse_lanes(profile, 2, layer, h.coded_tokens, lanes, h.version).plan.kept
                    want += 2.0 * h.coded_tokens * h.channels * (sum(kept) + 2 * int(profile.chain_reach[layer]))
        assert profile.chain_reach.any() and bench_codec._work(profile, 2, blobs).flops == pytest.approx(want)
    report = bench_codec.measure_stages(profile, 2, chunks, repeat=1)
    names = [row.stage for row in report.rows]
    assert names[:-1] == list(stages.STAGES)
    assert sum(row.seconds for row in report.rows) == pytest.approx(report.config["seconds"])
    assert sum(row.share for row in report.rows) == pytest.approx(1.0)
    by_name = {row.stage: row for row in report.rows}
    for name in (stages.CRC, stages.ENTROPY, stages.TRANSFORM, stages.CONVERT):
        assert by_name[name].seconds > 0 and by_name[name].bound_seconds > 0, name
    assert (by_name[stages.ROPE].seconds > 0) == rope
    assert report.decode_mb_s > 0 and report.encode_mb_s > 0 and report.fresh_output_decode_mb_s > 0
    rendered = bench_codec.render_stages(report)
    assert "inverse transform" in rendered and "into fresh ones" in rendered


def test_stage_marks_cost_nothing_outside_a_recording() -> None:
    from codec import stages

    assert stages.stage(stages.ENTROPY) is stages.stage(stages.CRC)  # one shared no-op context
    with stages.recording() as times:
        with stages.stage(stages.ENTROPY):
            pass
    assert set(times) == {stages.ENTROPY}


def test_predicted_rows_sit_beside_the_plain_ones_at_the_same_error() -> None:
    """``--predict N``: every level again from a predicting profile with the same targets;
    the step control holds each at the plain level's error (within the levels' +-15%)."""
    workload = bench_codec.synthetic_workload("small", 1024)
    report = bench_codec.run(workload, 512, repeat=1, compare_variants=False, predict=2)
    plain = [r for r in report.rows if r.method == "kvwire"]
    predicted = [r for r in report.rows   # kvwire calibrate's maps
                 if r.method == f"kvwire-predicted/2/{quality.PREDICT_MAPS_DEFAULT}"]
    assert report.config["predict"] == 2 and len(predicted) == len(plain) == 5
    for p, q in zip(plain, predicted):
        assert q.level == p.level and q.distortion == pytest.approx(p.distortion, rel=0.15)
        assert q.decode_mb_s > 0 and q.encode_mb_s > 0 and q.ratio_fp16 == pytest.approx(16 / q.bits_per_element)


def test_predicted_rows_name_the_maps_they_were_calibrated_with() -> None:
    workload = bench_codec.synthetic_workload("small", 512)
    report = bench_codec.run(workload, 512, repeat=1, compare_variants=False, predict=2, predict_maps="all")
    assert report.config["predict_maps"] == "all"
    assert len([r for r in report.rows if r.method == "kvwire-predicted/2/all"]) == 5


def test_a_predicting_profiles_plain_twin_and_its_default_level() -> None:
    """``--predict 0`` beside a predicting profile (SmolLM2's): every level of its twin
    without prediction, rows kvwire-plain; the targets are read at the profile's default level."""
    small = bench_codec.synthetic_workload("small", 1024)
    profile = codec.calibrate([small.calibration], predict=2, predict_groups="kind", default_level=3)
    workload = dataclasses.replace(small, profile=profile)
    report = bench_codec.run(workload, 512, repeat=1, compare_variants=False, predict=0)
    assert (report.config["predict"], report.config["predict_maps"]) == (0, None)
    assert (report.config["default_level"], report.config["predicts"]) == (3, True)
    own = [r for r in report.rows if r.method == "kvwire"]
    plain = [r for r in report.rows if r.method == "kvwire-plain"]
    assert len(own) == len(plain) == 5
    encode_target = next(t for t in report.targets if t["target"].startswith("CPU encode"))
    assert "at the default level" in encode_target["target"] and encode_target["measured"] == own[3].encode_mb_s


def test_cases_are_timed_in_rounds_that_visit_every_case(small, monkeypatch) -> None:
    """Speeds compared across rows come from interleaved rounds (the machine's speed
    drifts between minutes), each case's best kept; bits and error from its blobs."""
    profile, chunks = small
    decoded_levels, buffers = [], []
    decode = api.decode

    def recording(blob, p, *, out):
        decoded_levels.append(api.parse_header(blob).level)
        buffers.append(out.data_ptr())
        return decode(blob, p, out=out)

    monkeypatch.setattr(api, "decode", recording)
    cases = [bench_codec.Case("a", profile, 0), bench_codec.Case("b", profile, 3)]
    measured = bench_codec.measure_cases(cases, chunks, repeat=2)
    n = len(chunks)
    assert decoded_levels == [0] * n + [3] * n + [0] * n + [3] * n
    assert len(set(buffers)) == n and buffers == buffers[:n] * 4   # a chunk's buffer, reused: the decode timed
    for case, (row, blobs) in zip(cases, measured):
        alone, _ = bench_codec.measure_kvwire(profile, case.level, chunks, repeat=1, name=case.name)
        assert (row.method, row.level) == (case.name, case.level) and row.decode_mb_s > 0 < row.encode_mb_s
        assert row.bits_per_element == alone.bits_per_element == 8 * sum(map(len, blobs)) / sum(c.numel() for c in chunks)
        assert row.distortion == alone.distortion
