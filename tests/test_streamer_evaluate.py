"""``kvwire bench policies``: workload, cost models, JSON shape, plots, and (slow) the
simulator against a real fetch through the shaping proxy. No timing thresholds except
the slow validation's generous bound."""
from __future__ import annotations

import argparse
import json
import math

import pytest

from netsim.trace import Trace
from streamer.tools import bench_policies as ev


def test_llama_manifest_sizes_follow_bits_per_element() -> None:
    m = ev.llama_manifest(8192, 1024, ev.CODEC_BENCH.level_bits)
    assert len(m.chunks) == 8 and m.tokens == 8192
    assert (m.layers, m.heads, m.head_dim) == (32, 8, 128)
    for c in m.chunks:
        for size, bits in zip(c.sizes, ev.CODEC_BENCH.level_bits):
            assert size == math.ceil(65536 * c.tokens * bits / 8)
        assert 0 < c.text_bytes < 4 * c.tokens
    assert m.level_distortion == ev.LEVEL_TARGETS


def test_level_targets_are_the_codecs() -> None:
    import codec

    assert ev.LEVEL_TARGETS == tuple(codec.DEFAULT_TARGETS)


def test_cost_models_are_the_stated_formulas() -> None:
    flops = 2 * 8.03e9 * 8192 + 2 * 32 * 4096 * 8192 ** 2
    assert ev.prefill_seconds(8192) == pytest.approx(flops / (989.4e12 * 0.4))
    assert ev.recompute_seconds_per_token(32768) > ev.recompute_seconds_per_token(8192)
    assert ev.first_token_seconds(8192) == pytest.approx((2 * 8.03e9 + 131072 * 8192) / (3.35e12 * 0.7))


def test_ttft_table_speedups_are_ratios_and_follow_the_bits() -> None:
    table = ev.ttft_table(tokens=(32768,), links=(1.0,))
    row = table[0]
    k = row["kvwire L1"]
    for name, speedup in row["speedup"].items():
        assert speedup == pytest.approx(row[name] / k)
    # transfer-dominated at 1 Gbit/s: the speedup is close to the ratio of bits
    assert row["speedup"]["raw fp16"] == pytest.approx(16 / 3.27, rel=0.03)
    targets = ev.ttft_targets(table)
    assert [t["measured"] for t in targets] == [row["speedup"]["raw fp16"], row["speedup"]["int8"]]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvwire")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench").add_subparsers(dest="bench", required=True)
    ev.register(sub, bench)
    return parser


def test_cli_json_and_plots(tmp_path, capsys) -> None:
    traces = tmp_path / "traces"
    traces.mkdir()
    Trace([0.0, 0.5, 1.0], [3000.0, 800.0, 2000.0], name="t").save(traces / "t.csv")
    plots = tmp_path / "plots"
    args = _parser().parse_args(["bench", "policies", "--traces", str(traces), "--slo", "0.5,1",
                                 "--json", "--plots", str(plots), "--spacing", "0.5", "--workers", "1"])
    assert args.handler(args) == 0
    doc = json.loads(capsys.readouterr().out)
    keys = {"policy", "slo", "violation_rate", "mean_distortion", "text_share", "ttft_p50", "ttft_p95"}
    assert doc["results"] and all(keys <= set(r) for r in doc["results"])
    policies = {r["policy"] for r in doc["results"]}
    assert {"greedy", "mpc", "text", "raw-fp16", "int8", "oracle"} | {f"fixed:{i}" for i in range(5)} \
        <= policies
    assert {r["slo"] for r in doc["results"]} == {0.5, 1.0}
    by = {(r["policy"], r["slo"]): r for r in doc["results"]}
    for slo in (0.5, 1.0):
        assert by[("text", slo)]["text_share"] == 1.0
        # the oracle bounds every policy's violation rate (it meets whenever anything can)
        assert all(by[("oracle", slo)]["violation_rate"] <= r["violation_rate"]
                   for (p, s), r in by.items() if s == slo)
    assert doc["ttft"] and doc["targets"]
    for name in ("violations.png", "ttft_vs_bandwidth.png"):
        assert (plots / name).stat().st_size > 1000


def test_bad_slo_is_a_usage_error() -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["bench", "policies", "--slo", "1,-2"])


def test_codec_json_is_read(tmp_path) -> None:
    rows = [{"method": "raw-fp16", "level": None, "bits_per_element": 16.0, "distortion": 0.0,
             "max_abs_error": 0.0},
            {"method": "int8", "level": None, "bits_per_element": 8.0, "distortion": 2e-5,
             "max_abs_error": 0.1}]
    rows += [{"method": "cachegen(q=0.1)", "level": None, "bits_per_element": b, "distortion": d,
              "max_abs_error": 0.1} for b, d in ((8.0, 1e-4), (5.0, 3e-3))]
    rows += [{"method": "kvwire", "level": i, "bits_per_element": b, "distortion": d, "max_abs_error": 0.1,
              "ratio_cachegen": 2.0}
             for i, (b, d) in enumerate(((4.0, 3e-4), (3.0, 1e-3), (2.0, 4e-3)))]
    path = tmp_path / "codec.json"
    path.write_text(json.dumps({"config": {"workload": "x"}, "rows": rows}))
    fig = ev.CodecFigures.from_json(path)
    assert fig.level_bits == (4.0, 3.0, 2.0) and fig.int8_bits == 8.0
    assert 5.0 < fig.cachegen_bits < 8.0


def test_default_codec_figures_are_the_committed_codec_benchmark_output() -> None:
    doc = json.loads(ev.CODEC_JSON.read_text())
    kv = sorted((r for r in doc["rows"] if r["method"] == "kvwire"), key=lambda r: r["level"])
    assert ev.CODEC_BENCH == ev.CodecFigures.from_json(ev.CODEC_JSON)
    assert ev.CODEC_BENCH.level_bits == tuple(r["bits_per_element"] for r in kv)
    assert ev.CODEC_BENCH.level_distortion == tuple(r["distortion"] for r in kv)
    assert ev.CODEC_BENCH.cachegen_bits == pytest.approx(kv[1]["bits_per_element"] * kv[1]["ratio_cachegen"])


@pytest.mark.slow
def test_simulator_predicts_a_real_fetch_through_the_proxy() -> None:
    out = ev.validate(("walk-1g",), chunks=6, layers=4, calibration_tokens=512, mean_mbit=40.0)
    assert len(out) == 1
    v = out[0]
    assert v["real_levels"] == v["predicted_levels"]
    assert abs(v["error"]) < 0.30, v
