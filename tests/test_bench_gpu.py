"""The CPU side of ``python -m kvwire_kernels.bench_gpu``: arguments, data, arrival clock, report
files, the pycuda build step's failure path, and the dry run. The GPU part runs only on a
device machine (the figures are not measured in CI)."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

import codec
from kvwire_kernels import bench_gpu


def test_arguments_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUT", "/tmp/out-here")
    args = bench_gpu.build_parser().parse_args(["--kit", ".kit", "--json"])
    assert (args.kit, args.json, args.out, args.chunks, args.dry_run) == (".kit", True, "/tmp/out-here", 2, False)
    assert bench_gpu.build_parser().parse_args(["--dry-run", "--tokens", "512", "1024"]).tokens == [512, 1024]
    assert args.predict == 0 and bench_gpu.build_parser().parse_args(["--predict", "4"]).predict == 4
    with pytest.raises(SystemExit):   # --predict-maps alone would be ignored
        bench_gpu.main(["--dry-run", "--predict-maps", "kind"])


@pytest.mark.parametrize("predict, maps", [(0, "all"), (2, "all"), (2, "kind"), (2, "low-rank")])
def test_prepared_chunks_decode_on_the_cpu(predict: int, maps: str) -> None:
    profile, levels = bench_gpu.prepare((2, 2, 8), tokens=64, chunks=2, levels=[1, 3], predict=predict,
                                        predict_maps=maps)
    assert profile.predicts == bool(predict) and (not predict or bool(profile.predictor_by_kind.all()) == (maps != "all"))
    assert [p.level for p in levels] == [1, 3]
    for prepared in levels:
        assert len(prepared.blobs) == 2 and prepared.fp16_bytes == 2 * 2 * 2 * 2 * 64 * 16
        for blob, header, sections in zip(prepared.blobs, prepared.headers, prepared.sections):
            assert header.sink_tokens == 0 and [l for l, _ in sections] == [0, 1]
            assert header.predicted == bool(predict)
            assert codec.decode(blob, profile).shape == (2, 2, 64, 2, 8)


def test_arrival_clock() -> None:
    assert bench_gpu.arrival_times([125_000_000, 125_000_000], 10.0) == [0.1, 0.2]


def test_report_is_rewritten_as_it_goes(tmp_path: Path) -> None:
    bench_gpu.write_report({"results": [1]}, str(tmp_path))
    bench_gpu.write_report({"results": [1, 2]}, str(tmp_path))
    assert json.loads((tmp_path / bench_gpu.REPORT_NAME).read_text()) == {"results": [1, 2]}
    bench_gpu.write_report({"results": []}, None)   # no $OUT: nothing written


def test_a_failed_pycuda_build_stops_with_its_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        import pycuda  # noqa: F401
        pytest.skip("pycuda is installed here: the build step is skipped")
    except ImportError:
        pass
    kit = tmp_path / "kit"
    kit.mkdir()
    (kit / "install-pycuda.sh").write_text("echo configuring; echo 'no libcuda found' >&2; exit 3\n")
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    with pytest.raises(SystemExit, match=r"pycuda build failed .*exit 3\)[\s\S]*no libcuda found[\s\S]*pycuda"):
        bench_gpu.ensure_pycuda(str(kit), str(tmp_path / "site"))
    assert "no libcuda found" in (tmp_path / "out" / "pycuda_build.log").read_text()
    with pytest.raises(SystemExit, match="--kit"):
        bench_gpu.ensure_pycuda(None, str(tmp_path / "site"))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_dry_run_writes_its_report(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bench_gpu.main(["--dry-run", "--shape", "2", "2", "8", "--tokens", "64", "--calibration-tokens", "128",
                    "--json", "--out", str(tmp_path)])
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((tmp_path / bench_gpu.REPORT_NAME).read_text())
    assert [r["level"] for r in printed["rows"]] == list(range(5)) and all(r["lanes"] > 0 for r in printed["rows"])


def test_a_build_whose_own_check_fails_is_judged_by_the_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The kit's script checks the import from inside the source tree and fails after a good
    install: a pycuda that imports from SITE goes on, with the script's status on stderr."""
    try:
        import pycuda  # noqa: F401
        pytest.skip("pycuda is installed here: the build step is skipped")
    except ImportError:
        pass
    kit, site = tmp_path / "kit", tmp_path / "site"
    kit.mkdir()
    (kit / "install-pycuda.sh").write_text(
        'mkdir -p "$SITE/pycuda"; touch "$SITE/pycuda/__init__.py" "$SITE/pycuda/driver.py"\n'
        "echo \"ModuleNotFoundError: No module named 'pycuda._driver'\" >&2; exit 1\n")
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        bench_gpu.ensure_pycuda(str(kit), str(site))
        assert sys.modules["pycuda"].__file__ == str(site / "pycuda" / "__init__.py")
    finally:
        sys.modules.pop("pycuda", None)
    assert "exited 1, but pycuda.driver imports" in capsys.readouterr().err
