"""Command-line mistakes fail at start with a message naming them (issue 15, finding 9)."""
from __future__ import annotations

from pathlib import Path

import pytest

from streamer.tools.cli import main


@pytest.mark.parametrize("form", ["path", "url"])
def test_serve_refuses_a_store_directory_that_does_not_exist(tmp_path: Path, form: str, capsys) -> None:
    missing = tmp_path / "no-such-store"
    store = str(missing) if form == "path" else missing.as_uri()
    assert main(["serve", "--store", store, "--listen", "127.0.0.1:0"]) == 1
    err = capsys.readouterr().err
    assert f"directory {str(missing)!r} does not exist" in err and "kvwire put --store creates it" in err
    assert not missing.exists()


def test_receive_refuses_a_model_path_that_is_not_a_model(tmp_path: Path, capsys) -> None:
    not_a_model = tmp_path / "notes.txt"
    not_a_model.write_text("hello")
    assert main(["receive", "--servers", "127.0.0.1:9", "--listen", "127.0.0.1:0",
                 "--model", str(not_a_model)]) == 2
    err = capsys.readouterr().err
    assert f"cannot load model {not_a_model}" in err and "not a GGUF file" in err


@pytest.mark.parametrize("command, says", [
    (["calibrate", "--model", "smollm2", "--predict", "0"], "--predict-maps chooses the maps of a prediction"),
    (["calibrate", "--model", "minilm"], "an encoder's profile predicts only when --predict N asks"),
    (["bench", "codec", "--workload", "small"], "--predict-maps chooses the maps of --predict N (N > 0)"),
    (["bench", "codec", "--workload", "small", "--predict", "0"], "--predict-maps chooses the maps of --predict N"),
])
def test_predict_maps_without_a_prediction_is_refused(command: list[str], says: str, tmp_path: Path,
                                                      capsys) -> None:
    """--predict-maps only chooses a prediction's maps: where none is made it would be
    silently ignored."""
    output = tmp_path / "unused.kvp"
    extra = ["-o", str(output)] if command[0] == "calibrate" else []
    assert main([*command, *extra, "--predict-maps", "kind"]) == 2
    assert says in capsys.readouterr().err
    assert not output.exists()


def test_bench_codec_level_without_stages_is_refused(capsys) -> None:
    """--level chooses the level --stages measures: alone it would be silently ignored."""
    assert main(["bench", "codec", "--workload", "small", "--level", "3"]) == 2
    assert "--level chooses the level --stages measures; give both" in capsys.readouterr().err
    assert main(["bench", "codec", "--workload", "small", "--stages", "--level", "9"]) == 2
    assert "kvwire bench codec: level 9 is not in the profile (levels 0-4)" in capsys.readouterr().err


def test_the_commands_offer_the_codecs_map_groups() -> None:
    """The CLI spells the choices out (registering imports no torch); they must stay the codec's."""
    from codec.prediction import LOW_RANK
    from codec.profile import PREDICT_GROUPS
    from streamer.tools.calibrate import _MAPS_READ, PREDICT_MAPS
    assert PREDICT_MAPS == PREDICT_GROUPS
    assert _MAPS_READ["low-rank"].endswith(f"rank {LOW_RANK}")   # the summary line's words
