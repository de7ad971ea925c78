"""Fuzzing in CI (streamer/tools/fuzz.py): the frame parser, the protocol state machine, the
manifest and text payload parsers, the codec's parsers and the receiver daemon's request parsing
and event encoder get thousands of cases each -- structured
hypothesis cases plus seeded random byte inputs through the same checks -- and the
``kvwire fuzz`` command runs, reports its cases and replays a reproducer."""
from __future__ import annotations

import json
import random
import struct
import sys
from pathlib import Path

import pytest

from streamer.tools import adversarial, fuzz
from streamer.tools.cli import main

pytestmark = pytest.mark.timeout(180)

# hypothesis cases per target (structured; ~2-3 ms each including generation)
HYPOTHESIS_CASES = {"frames": 4000, "protocol": 4000, "manifest": 2000, "text": 2000, "bitstream": 1500,
                    "header": 1000, "profile": 500, "http": 1500, "sse": 4000}
# seeded random inputs per target (~0.03-0.15 ms each)
RANDOM_CASES = 20000


@pytest.mark.slow
@pytest.mark.parametrize("target", fuzz.TARGETS)
def test_hypothesis_fuzz_finds_nothing(target: str) -> None:
    result = fuzz.run_hypothesis(target, max_examples=HYPOTHESIS_CASES[target], seed=12345)
    assert result.cases[target] >= HYPOTHESIS_CASES[target] // 2   # hypothesis may stop early
    assert not result.failures, [(f.error, f.reproducer()) for f in result.failures]


#: the codec targets decode (some cases) a blob, so they get fewer random cases
RANDOM_SHARE = {"frames": 1, "protocol": 1, "manifest": 4, "text": 4, "bitstream": 4, "header": 20, "profile": 20,
                "http": 1, "sse": 1}


@pytest.mark.parametrize("target", fuzz.TARGETS)
def test_random_bytes_fuzz_finds_nothing(target: str) -> None:
    rng = random.Random(f"ci-{target}")
    check = fuzz.CHECKS[target]
    for _ in range(RANDOM_CASES // RANDOM_SHARE[target]):
        data = rng.randbytes(rng.randrange(1, 64 if target in ("bitstream", "header", "profile") else 160))
        error = None
        try:
            check(data)
        except fuzz.FuzzBug as exc:
            error = str(exc)
        assert error is None, f"{error}; reproduce: kvwire fuzz --target {target} --replay {data.hex()}"


def test_valid_traffic_passes_the_protocol_check() -> None:
    """A sanity check that the fuzz states are live: a well-formed frame is accepted."""
    from streamer.wire.events import Request
    from streamer.wire.protocol import Connection, Role

    client = Connection(Role.CLIENT)
    # the "server with context" state accepts a REQUEST without error
    conn = fuzz.PROTOCOL_STATES[3][1]()
    assert conn.receive_data(client._send_frame(Request(6, 0))) if hasattr(client, "_send_frame") else True


def test_forged_blobs_reach_the_decoder() -> None:
    """bitstream inputs with the forge bit keep valid CRCs, so damage gets past the checksums."""
    import codec

    blob, profile = fuzz.fuzz_codec.mutate_blob(bytes([0x04, 0, 0, 200, 0, 0x10]))
    assert codec.parse_header(blob) is not None       # header CRC recomputed: it parses


def test_cli_runs_reports_cases_and_replays(capsys) -> None:
    assert main(["fuzz", "--minutes", "0.01", "--target", "frames", "--batch", "200", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["total_cases"] >= 200 and summary["failures"] == []
    assert main(["fuzz", "--target", "all", "--replay", "0001020304"]) == 0
    out = capsys.readouterr().out
    assert out.count("ok") == len(fuzz.TARGETS) == 9


def test_cli_reports_a_failure_with_a_reproducer(monkeypatch, capsys) -> None:
    def broken(data: bytes) -> None:
        if len(data) > 3:
            raise fuzz.FuzzBug("planted bug")

    monkeypatch.setitem(fuzz.CHECKS, "frames", broken)
    assert main(["fuzz", "--minutes", "0.001", "--target", "frames", "--batch", "100"]) == 1
    out = capsys.readouterr().out
    assert "FAILURE [frames]" in out and "planted bug" in out
    hexdata = out.split("--replay ")[1].split()[0]
    assert len(bytes.fromhex(hexdata)) > 3
    assert main(["fuzz", "--target", "frames", "--replay", hexdata]) == 1


def test_embedded_profile_claiming_a_huge_size_is_corrupt_not_memory_error() -> None:
    """Regression for the fuzzer's find: a zstd frame that claims a huge content size."""
    data = bytes.fromhex("f4ab5f5df5bb86ad425c4c7dcf3ccbfb03e6207c8b48c56faeb2b5a35eaf44c38273c065"
                         "af37a18f4d7aae7f12a47af937f51e9f")
    fuzz.CHECKS["bitstream"](data)  # raises FuzzBug on anything but a typed codec error


def test_without_hypothesis_the_cli_says_what_to_install(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "hypothesis", None)   # import hypothesis -> ImportError
    assert main(["fuzz", "--minutes", "0.01", "--target", "frames"]) == 2
    assert "pip install 'kvwire[fuzz]'" in capsys.readouterr().err


def test_header_inputs_lie_where_they_say() -> None:
    """A header edit reaches the field FORMAT.md puts it at (tokens: offset 16)."""
    import codec

    blob, _ = fuzz.fuzz_codec.header_blob(bytes([0]) + struct.pack("<BBI", 7, 0, 1 << 21))
    assert struct.unpack_from("<I", blob, 16)[0] == 1 << 21
    with pytest.raises(codec.CorruptBitstream):
        codec.decode(blob, fuzz.fuzz_codec._seed_blobs()[0][1])


def test_profile_inputs_reach_validation() -> None:
    """A profile edit that breaks kept <= rows (#15 finding 1) is refused, not decoded."""
    import codec

    kept = fuzz.fuzz_codec._ARRAYS.index("kept")
    raw = fuzz.fuzz_codec.profile_bytes(bytes([0]) + struct.pack("<BHI", kept, 0, 1000))
    with pytest.raises(codec.CorruptBitstream, match="kept"):
        codec.Profile.from_bytes(raw)


def test_manifest_inputs_reach_field_validation() -> None:
    """An odd first byte edits the valid seed manifest: a chunk's ``end`` made a string is
    refused by the field's own check, not by the JSON decoder."""
    from streamer.wire.manifest import Manifest, ManifestError

    end = len(fuzz.fuzz_data._MANIFEST_KEYS) + fuzz.fuzz_data._CHUNK_KEYS.index("end")
    raw = fuzz.fuzz_data.manifest_bytes(bytes([1]) + struct.pack("<BBBI", end, 3, 1, 77))
    with pytest.raises(ManifestError, match="chunk 1 end"):
        Manifest.from_bytes(raw)
    assert Manifest.from_bytes(fuzz.fuzz_data.manifest_bytes(b"\x01")).tokens == 40


def test_text_inputs_with_a_forged_crc_reach_the_zstd_frame() -> None:
    """Bit 0 recomputes the payload's CRC, so a frame declaring 64 GiB (#15 finding 3) is
    judged by the size checks, and the check accepts their ValueError."""
    from streamer.store.put import _TEXT_HEADER, decode_tokens

    # zstd frame (RFC 8878): single segment, 8-byte content size 64 GiB, one raw last block of 4 bytes
    bomb = _TEXT_HEADER.pack(b"KVTX", 1, 12) + bytes.fromhex("28b52ffde0") + (64 << 30).to_bytes(8, "little") \
        + bytes.fromhex("210000") + bytes(4)
    payload = fuzz.fuzz_data.text_payload(b"\x01" + bomb + bytes(4))
    with pytest.raises(ValueError, match="zstd"):
        decode_tokens(payload)
    fuzz.CHECKS["text"](b"\x07" + bomb + bytes(4))
    assert decode_tokens(fuzz.fuzz_data.text_payload(b"\x01" + fuzz.fuzz_data.seed_texts()[0])) == \
        decode_tokens(fuzz.fuzz_data.seed_texts()[0])


@pytest.mark.parametrize("target", fuzz.TARGETS)
def test_seed_inputs_pass_and_are_written_once(target: str, tmp_path: Path) -> None:
    """The valid inputs an atheris run starts from pass their check; write_seeds adds
    each once (by SHA-1), so a rerun on the same corpus adds none."""
    for data in fuzz.seed_inputs(target):
        assert fuzz.replay(target, data) is None
    assert fuzz.write_seeds(target, tmp_path) == len(set(fuzz.seed_inputs(target)))
    assert fuzz.write_seeds(target, tmp_path) == 0


CORPUS = Path(__file__).parent / "data" / "fuzz_corpus"


@pytest.mark.parametrize("path", sorted(CORPUS.glob("*/*")), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_corpus_replays_clean(path: Path) -> None:
    """Inputs kept from coverage-guided runs (atheris) and past findings, per target."""
    assert fuzz.replay(path.parent.name, path.read_bytes()) is None


@pytest.mark.slow
def test_minimize_keeps_the_units_that_add_coverage(tmp_path: Path, capsys) -> None:
    """``kvwire fuzz --minimize`` (libFuzzer's merge): copies of a seed with bytes the
    target never reads add no coverage and go; what is kept replays clean."""
    pytest.importorskip("atheris")
    corpus = tmp_path / "sse"
    fuzz.write_seeds("sse", corpus)
    seed = fuzz.seed_inputs("sse")[0]
    for i in range(20):
        (corpus / f"padded-{i}").write_bytes(seed + bytes(200) + bytes([i]))
    before = len(list(corpus.iterdir()))
    assert main(["fuzz", "--target", "all", "--minimize", str(tmp_path)]) == 0
    kept = sorted(corpus.iterdir())
    assert f"sse: {before} -> {len(kept)} units" in capsys.readouterr().out
    assert 0 < len(kept) <= before - 20
    assert all(fuzz.replay("sse", p.read_bytes()) is None for p in kept)


@pytest.mark.parametrize("target", ["sse", "all"])
def test_minimize_refuses_a_folder_of_corpora_for_one_target(tmp_path: Path, capsys, target: str) -> None:
    """A corpus root (DIR/<target>/units) given for one target would have libFuzzer merge
    every target's units into DIR: refused, untouched, naming the folder to pass instead.
    With --target all, a target's folder holding folders is refused the same way."""
    root = tmp_path if target == "sse" else tmp_path / "root"
    units = root / "sse" / "nested" if target == "all" else root / "sse"
    fuzz.write_seeds("sse", units)
    tree = sorted(tmp_path.rglob("*"))
    assert main(["fuzz", "--target", target, "--minimize", str(root)]) == 2
    err = capsys.readouterr().err
    assert "holds folders" in err and (target == "all" or f"pass {root / 'sse'}" in err), err
    assert sorted(tmp_path.rglob("*")) == tree


def test_replay_corpus_reports_units_and_seconds_per_target(capsys) -> None:
    assert main(["fuzz", "--target", "text", "--replay-corpus", str(CORPUS)]) == 0
    units = len(list((CORPUS / "text").iterdir()))
    assert f"text: {units} units, " in capsys.readouterr().out


# ------------------------------------------------------------------ kvwire bench adversarial
@pytest.mark.parametrize("name", sorted(adversarial.HOSTILE))
def test_each_hostile_input_is_a_typed_rejection(name: str) -> None:
    row = adversarial.run_one(name)
    assert row["error"] is not None and row["error"].startswith("CorruptBitstream"), row


def test_adversarial_sizes_stay_within_the_bound(capsys) -> None:
    rows = adversarial.size_rows(layers=2, tokens=40, heads=2, head_dim=4)
    assert len(rows) == len(adversarial.KINDS) * (3 * 5 + 2)   # each profile's levels, and the exact level
    assert not any(r["over_bound"] for r in rows)
    assert {r["profile"] for r in rows} == {"calibrated", "predicted", "embedded"}
    exact = [r for r in rows if r["level"] == "exact"]
    assert len(exact) == 2 * len(adversarial.KINDS)
    assert all(r["blob_bytes"] == r["fp16_bytes"] + r["header_bytes"] for r in exact)   # raw: fp16 + header
    assert any(r["raw_layers"] for r in rows)     # some of the hostile data did go raw
    assert main(["bench", "adversarial", "sizes", "--tokens", "24", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["sizes"]) == len(rows)
