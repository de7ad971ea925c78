"""Golden blobs: the committed bytes pin the bitstream format (codec/FORMAT.md).

Files in tests/data/:

* ``golden_profile.safetensors``: a "layer" profile calibrated on ``golden_input(phase=1.0)``
* ``golden_blob.bin``: ``golden_input()`` (fp16) encoded at LEVEL (1) with that profile
* ``golden_blob_embedded.bin``: ``golden_input(dtype=bfloat16)`` at level 3, profile=None
* ``golden_decoded.npy``: what golden_blob.bin decodes to (float16 values)
* ``golden_decoded_embedded.npy``: what the embedded blob decodes to (bfloat16 bits as int16)
* ``golden_blob_rotary.bin``: ``rotary_input()`` (golden_input with RoPE on its keys at
  positions ROTARY_START..) at LEVEL, start ROTARY_START, with ``rotary_profile()``
  (the golden profile plus ROTARY: keys coded without RoPE)
* ``golden_decoded_rotary.npy``: what the rotary blob decodes to (float16 values)
* ``golden_blob_pieces.bin``: ``golden_input(tokens=PIECES_TOKENS)`` at PIECES_LEVEL with the
  golden profile: rows long enough to be cut into pieces (FORMAT.md, "Rows and lanes")
* ``golden_blob_v3.bin``: golden_blob.bin as format version 3 wrote it (kept, not
  regenerated: version 5 readers still read version 3; its lanes are whole rows)
* ``golden_blob_v4.bin``: golden_blob.bin as format version 4 wrote it (kept, not
  regenerated: no per-section steps, the profile's), and ``golden_decoded_v4.npy``,
  what it (and the version 3 blob: same values, other lanes) decodes to

The tests check that (a) the committed blobs decode, with the committed profile, to the
committed tensors (to float32 GEMM rounding, as FORMAT.md allows) and to the formula
within the level's distortion, and (b) encoding the formula's input again reproduces the
committed bytes exactly, so any change of the format is deliberate. They also read the
blob with nothing but FORMAT.md (header fields, CRCs, sinks, lane table, profile id).

The profile is loaded, never re-calibrated (calibration runs a float64 eigh whose last
bits may differ across machines, and the kept older-version blobs name its id); it is
calibrated only when missing. To regenerate after a deliberate format change (and bump
the format version):

    KVWIRE_REGEN_GOLDEN=1 python -m pytest -q tests/test_codec_golden.py
    # or: python tests/test_codec_golden.py

then review and commit tests/data/.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import codec

DATA = Path(__file__).parent / "data"
PROFILE_FILE = DATA / "golden_profile.safetensors"
BLOB_FILE = DATA / "golden_blob.bin"
EMBEDDED_FILE = DATA / "golden_blob_embedded.bin"
DECODED_FILE = DATA / "golden_decoded.npy"
DECODED_EMBEDDED_FILE = DATA / "golden_decoded_embedded.npy"
ROTARY_FILE = DATA / "golden_blob_rotary.bin"
PIECES_FILE = DATA / "golden_blob_pieces.bin"
V3_FILE = DATA / "golden_blob_v3.bin"
V4_FILE = DATA / "golden_blob_v4.bin"
DECODED_V4_FILE = DATA / "golden_decoded_v4.npy"
DECODED_ROTARY_FILE = DATA / "golden_decoded_rotary.npy"
REGEN = os.environ.get("KVWIRE_REGEN_GOLDEN") == "1"

SHAPE = (2, 2, 300, 2, 8)  # layers, K/V, tokens, heads, head_dim: several lanes per K/V
#: the level golden_blob.bin (and the kept v3/v4 blobs) were encoded at: fixed with the
#: bytes, whatever codec.DEFAULT_LEVEL is today
LEVEL = 1
EMBEDDED_LEVEL = 3
ROTARY = codec.Rotary(head_dim=8, dim=8, theta=10000.0)
ROTARY_START = 1000
PIECES_TOKENS = 900
PIECES_LEVEL = 2


def golden_input(phase: float = 0.0, tokens: int = SHAPE[2], dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Smooth, cross-correlated KV from a closed formula (no RNG), float64 then rounded."""
    layers, _, _, heads, head_dim = SHAPE
    l, kv, t, h, d = torch.meshgrid(*(torch.arange(n, dtype=torch.float64)
                                      for n in (layers, 2, tokens, heads, head_dim)), indexing="ij")
    c = h * head_dim + d
    base = torch.sin(0.21 * t + 0.9 * l + 1.7 * kv + phase)          # shared by all channels
    wiggle = torch.cos(0.53 * t * (1 + 0.1 * c) + c + 0.3 * phase)  # per-channel detail
    x = (1.0 + 0.3 * c) * base + 0.2 * wiggle + 0.05 * c - 0.5 * kv
    return x.to(dtype)


def rotary_input() -> torch.Tensor:
    """golden_input() with RoPE (ROTARY, float64 angles) on its keys at positions ROTARY_START..,
    as a model would cache it: what the rotary profile rotates back to golden_input's keys."""
    from codec.rotary import rotate

    x = golden_input(dtype=torch.float64)
    layers, _, tokens, heads, head_dim = SHAPE
    freqs = torch.arange(ROTARY_START, ROTARY_START + tokens, dtype=torch.float64)[:, None] \
        * ROTARY.inv_freq().double()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    for layer in range(layers):
        keys = x[layer, 0].reshape(tokens, heads * head_dim)
        x[layer, 0] = rotate(keys, ROTARY, (emb.cos(), emb.sin())).reshape(tokens, heads, head_dim)
    return x.to(torch.float16)


def rotary_profile(profile: codec.Profile) -> codec.Profile:
    """The golden profile with ROTARY: the format's RoPE path pinned without re-calibrating."""
    return dataclasses.replace(profile, rotary=ROTARY)


def _regenerate() -> None:
    DATA.mkdir(parents=True, exist_ok=True)
    if not PROFILE_FILE.is_file():
        codec.calibrate([golden_input(phase=1.0, tokens=600, dtype=torch.float32)]).save(PROFILE_FILE)
    profile = codec.Profile.load(PROFILE_FILE)
    blob = codec.encode(golden_input(), LEVEL, profile)
    BLOB_FILE.write_bytes(blob)
    np.save(DECODED_FILE, codec.decode(blob, profile).numpy())
    embedded = codec.encode(golden_input(dtype=torch.bfloat16), EMBEDDED_LEVEL)
    EMBEDDED_FILE.write_bytes(embedded)
    np.save(DECODED_EMBEDDED_FILE, codec.decode(embedded).view(torch.int16).numpy())
    rotary = rotary_profile(profile)
    blob = codec.encode(rotary_input(), LEVEL, rotary, start=ROTARY_START)
    ROTARY_FILE.write_bytes(blob)
    np.save(DECODED_ROTARY_FILE, codec.decode(blob, rotary).numpy())
    PIECES_FILE.write_bytes(codec.encode(golden_input(tokens=PIECES_TOKENS), PIECES_LEVEL, profile))


@pytest.fixture(scope="module")
def golden():
    if REGEN:
        _regenerate()
    missing = [p.name for p in (PROFILE_FILE, BLOB_FILE, EMBEDDED_FILE, DECODED_FILE, DECODED_EMBEDDED_FILE,
                                ROTARY_FILE, DECODED_ROTARY_FILE, PIECES_FILE, V3_FILE, V4_FILE,
                                DECODED_V4_FILE) if not p.is_file()]
    if missing:
        pytest.fail(f"golden files missing: {missing}; regenerate with KVWIRE_REGEN_GOLDEN=1")
    return {
        "profile": codec.Profile.load(PROFILE_FILE),
        "blob": BLOB_FILE.read_bytes(),
        "embedded": EMBEDDED_FILE.read_bytes(),
        "decoded": torch.from_numpy(np.load(DECODED_FILE)).float(),
        "decoded_embedded": torch.from_numpy(np.load(DECODED_EMBEDDED_FILE)).view(torch.bfloat16),
        "rotary": ROTARY_FILE.read_bytes(),
        "decoded_rotary": torch.from_numpy(np.load(DECODED_ROTARY_FILE)).float(),
        "pieces": PIECES_FILE.read_bytes(),
        "v3": V3_FILE.read_bytes(),
        "v4": V4_FILE.read_bytes(),
        "decoded_v4": torch.from_numpy(np.load(DECODED_V4_FILE)).float(),
    }


def _distortion(x: torch.Tensor, y: torch.Tensor, sinks: int) -> float:
    x, y = x[:, :, sinks:].double(), y[:, :, sinks:].double()
    return float(((x - y) ** 2).sum() / ((x - x.mean(dim=2, keepdim=True)) ** 2).sum())


# ------------------------------------------------------------------ (a) decoding
def test_golden_blob_decodes(golden):
    profile, blob = golden["profile"], golden["blob"]
    out = codec.decode(blob, profile)
    x = golden_input()
    assert out.shape == SHAPE and out.dtype == torch.float16
    torch.testing.assert_close(out.float(), golden["decoded"], rtol=2e-3, atol=2e-3)
    # FORMAT.md: decoders agree to float32 rounding of the GEMM, then round to fp16
    assert float((out.float() - golden["decoded"]).abs().max()) <= 2 * float(golden["decoded"].abs().max()) * 2 ** -10
    assert torch.equal(out[:, :, :4], x[:, :, :4])
    assert _distortion(x, out, 4) <= 1.6 * profile.targets[LEVEL]


def test_golden_rotary_blob_decodes(golden):
    """Keys coded without RoPE get it back at the recorded positions (FORMAT.md, "Rotary keys")."""
    profile = rotary_profile(golden["profile"])
    out = codec.decode(golden["rotary"], profile)
    assert codec.parse_header(golden["rotary"]).start == ROTARY_START
    torch.testing.assert_close(out.float(), golden["decoded_rotary"], rtol=2e-3, atol=2e-3)
    x = rotary_input()
    assert torch.equal(out[:, :, :4], x[:, :, :4])
    assert _distortion(x, out, 4) <= 1.6 * profile.targets[LEVEL]


def test_golden_pieces_blob_decodes(golden):
    """Rows cut into pieces decode, token by token, to what whole-row lanes give: the
    first 300 tokens of the long blob are the golden blob's tokens (same formula)."""
    profile = golden["profile"]
    out = codec.decode(golden["pieces"], profile)
    x = golden_input(tokens=PIECES_TOKENS)
    assert out.shape == (2, 2, PIECES_TOKENS, 2, 8)
    assert _distortion(x, out, 4) <= 1.6 * profile.targets[PIECES_LEVEL]
    short = codec.decode(codec.encode(golden_input(), PIECES_LEVEL, profile), profile)
    assert float((out[:, :, :SHAPE[2]].float() - short.float()).abs().max()) <= 2 * float(short.float().abs().max()) * 2 ** -10


@pytest.mark.parametrize("version", [3, 4])
def test_golden_older_blobs_still_decode(golden, version):
    """FORMAT.md "Versioning": version 3 lanes (whole rows, u32 counts) and version 4 lanes
    (the profile's steps and kept rows) are still read, to what version 4 decoded them to."""
    blob = golden[f"v{version}"]
    assert codec.parse_header(blob).version == version
    out = codec.decode(blob, golden["profile"])
    torch.testing.assert_close(out.float(), golden["decoded_v4"], rtol=2e-3, atol=2e-3)


def test_golden_v4_sections_dequantize_with_the_profiles_steps(golden):
    """A version 4 section has no step of its own: the plan every decoder (CPU and GPU)
    dequantizes with is the profile's level's steps and kept rows, as version 4 wrote it."""
    from codec import container, layer_codec

    profile, blob = golden["profile"], golden["v4"]
    header = codec.parse_header(blob)
    for layer in range(header.layers):
        payload = container.split_section(container.section(blob, header, layer), header, layer)[1]
        plan = layer_codec.parse_lanes(profile, header.level, layer, header.coded_tokens, payload, 4).plan
        assert plan.steps == tuple(float(profile.steps[header.level, layer, kv]) for kv in range(2))
        assert plan.kept == tuple(int(profile.kept[header.level, layer, kv]) for kv in range(2))


def test_golden_embedded_blob_decodes(golden):
    out = codec.decode(golden["embedded"])
    x = golden_input(dtype=torch.bfloat16)
    assert out.shape == SHAPE and out.dtype == torch.bfloat16
    # identity transform: no GEMM, so every decoder gets the same floats (FORMAT.md)
    assert torch.equal(out, golden["decoded_embedded"])
    assert torch.equal(out[:, :, :4], x[:, :, :4])
    assert _distortion(x, out, 4) <= 1.15 * codec.DEFAULT_TARGETS[EMBEDDED_LEVEL]


def test_golden_layers_and_sections(golden):
    profile, blob = golden["profile"], golden["blob"]
    whole = codec.decode(blob, profile)
    header = codec.parse_header(blob[:codec.header_length(blob[:32])])
    for layer, k, v in codec.decode_layers(blob, profile):
        start = header.section_offset(layer)
        k2, v2 = codec.decode_section(header, profile, layer, blob[start:start + header.sections[layer][0]])
        for a, b in ((k, whole[layer, 0]), (v, whole[layer, 1]), (k2, k), (v2, v)):
            torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=4e-3 * float(b.float().abs().max()))


def test_golden_inspect(golden):
    info = codec.inspect(golden["blob"])
    assert info["shape"] == list(SHAPE)
    assert info["dtype"] == "float16"
    assert info["level"] == LEVEL
    assert info["profile_id"] == golden["profile"].id
    assert info["embedded_profile"] is False
    assert info["total_bytes"] == len(golden["blob"])
    info = codec.inspect(golden["embedded"])
    assert info["dtype"] == "bfloat16" and info["level"] == EMBEDDED_LEVEL and info["embedded_profile"]


# ------------------------------------------------------------------ (b) encoding
def test_golden_profile_reencodes_bit_exact(golden):
    """Re-encoding the formula's input with the committed profile gives the committed bytes."""
    blob = codec.encode(golden_input(), LEVEL, golden["profile"])
    assert len(blob) == len(golden["blob"])
    assert blob == golden["blob"], "bitstream changed: bump the format version and regenerate tests/data"


def test_golden_rotary_reencodes_bit_exact(golden):
    blob = codec.encode(rotary_input(), LEVEL, rotary_profile(golden["profile"]), start=ROTARY_START)
    assert blob == golden["rotary"], "bitstream (or the RoPE removal) changed"


def test_golden_pieces_reencodes_bit_exact(golden):
    blob = codec.encode(golden_input(tokens=PIECES_TOKENS), PIECES_LEVEL, golden["profile"])
    assert blob == golden["pieces"], "bitstream (or the encoder's lane shape) changed"


def test_golden_embedded_reencodes_bit_exact(golden):
    blob = codec.encode(golden_input(dtype=torch.bfloat16), EMBEDDED_LEVEL)
    assert blob == golden["embedded"], "bitstream (or embedded profile fitting) changed"


def test_golden_profile_file_is_stable(golden):
    """The committed profile serializes back to the same content (and id)."""
    profile = golden["profile"]
    again = codec.Profile.from_bytes(profile.to_bytes())
    assert again.id == profile.id
    assert profile.to_bytes() == again.to_bytes()
    assert profile.layers == SHAPE[0] and profile.heads == SHAPE[3] and profile.head_dim == SHAPE[4]


# ------------------------------------------------------------------ FORMAT.md conformance
def _lane_table(section: bytes, sink_len: int, rows: int, coded: int, groups: tuple[int, int]
                ) -> tuple[int, int, int, tuple[float, float]]:
    """(n_lanes, rows_per_lane, pieces, steps) of a version 5 coded section, by FORMAT.md
    alone (``rows``: the profile's stored basis rows, the most a section may keep)."""
    n_lanes, piece, per_lane, step_k, step_v, kept_k, kept_v = struct.unpack_from("<IHHffHH", section, sink_len)
    kept = (kept_k, kept_v)
    assert all(2.0 ** -126 <= step <= 2.0 ** 96 for step in (step_k, step_v))
    assert max(kept) <= rows
    assert per_lane >= 1
    if piece == 0:
        assert per_lane * coded <= 16383
        pieces = 1
    else:
        assert per_lane == 1 and 1 <= piece < coded and piece <= 16383
        assert all(piece % g == 0 for g, k in zip(groups, kept) if g and k)
        pieces = math.ceil(coded / piece)
    assert n_lanes == (math.ceil(kept[0] / per_lane) + math.ceil(kept[1] / per_lane)) * pieces
    states = struct.unpack_from(f"<{n_lanes}I", section, sink_len + 20)
    counts = struct.unpack_from(f"<{n_lanes}H", section, sink_len + 20 + 4 * n_lanes)
    assert all(2 ** 16 <= s < 2 ** 32 for s in states)
    assert sink_len + 20 + 6 * n_lanes + 2 * sum(counts) == len(section)
    return n_lanes, per_lane, pieces, (step_k, step_v)


def test_blob_layout_matches_format_md(golden):
    """Read the golden blobs with nothing but FORMAT.md."""
    profile = golden["profile"]
    shapes = []
    for name in ("blob", "pieces"):
        blob = golden[name]
        (magic, version, dtype, level, flags, layers, heads, head_dim, sinks, tokens, pid,
         embedded_len) = struct.unpack_from("<4sBBBBHHHHI8sI", blob, 0)
        assert magic == b"KVWB" and version == 5
        (start,) = struct.unpack_from("<I", blob, 32)
        assert start == 0
        assert dtype == 1  # float16
        assert flags == 0 and embedded_len == 0
        assert (layers, heads, head_dim) == (SHAPE[0], SHAPE[3], SHAPE[4])
        assert sinks == 4
        assert pid.hex() == profile.id
        header_len = 32 + 4 + 9 * layers + embedded_len + 4
        assert codec.header_length(blob[:32]) == header_len
        (crc,) = struct.unpack_from("<I", blob, header_len - 4)
        assert crc == zlib.crc32(blob[:header_len - 4])
        x = golden_input(tokens=tokens)
        channels = heads * head_dim
        pos = header_len
        lanes = []
        for l in range(layers):
            length, section_crc, mode = struct.unpack_from("<IIB", blob, 36 + 9 * l)
            section = blob[pos:pos + length]
            assert zlib.crc32(section) == section_crc
            assert mode == 0  # rANS lanes
            # sinks: K[0:S] then V[0:S], raw little-endian fp16
            sink_len = 2 * sinks * channels * 2
            expected_sinks = x[l, :, :sinks].contiguous().view(torch.int16).numpy().astype("<i2").tobytes()
            assert section[:sink_len] == expected_sinks
            groups = tuple(int(profile.delta_group[l, kv]) for kv in range(2))
            n_lanes, per_lane, pieces, steps = _lane_table(section, sink_len, profile.basis.shape[2],
                                                           tokens - sinks, groups)
            # closed-loop steps: near the profile's on data like its calibration, not equal
            assert all(0.25 < step / float(profile.steps[level, l, kv]) < 4 for kv, step in enumerate(steps))
            shapes.append((name, per_lane, pieces))
            lanes.append(n_lanes)
            pos += length
        assert pos == len(blob)
        assert codec.inspect(blob)["sections"]["lanes"] == lanes
    # the goldens exercise lanes of several whole rows and rows cut into pieces
    assert any(name == "blob" and per_lane > 1 for name, per_lane, _ in shapes), shapes
    assert all(name == "blob" or pieces > 1 for name, _, pieces in shapes), shapes


def test_embedded_blob_layout_matches_format_md(golden):
    import zstandard

    blob = golden["embedded"]
    flags, layers = struct.unpack_from("<BH", blob, 7)
    (embedded_len,) = struct.unpack_from("<I", blob, 28)
    assert flags == 1 and embedded_len > 0
    start = 36 + 9 * layers
    raw = zstandard.ZstdDecompressor().decompress(blob[start:start + embedded_len])
    profile = codec.Profile.from_bytes(raw)
    # "An embedded profile is an identity profile with exactly one level."
    assert profile.transform == "identity" and profile.basis is None
    assert len(profile.levels) == 1
    assert profile.levels[0].target_distortion == codec.DEFAULT_TARGETS[EMBEDDED_LEVEL]
    assert blob[20:28].hex() == profile.id


def test_profile_id_matches_format_md(golden):
    """BLAKE2b-64 over the metadata JSON (sorted keys), then name + raw bytes of each array by name."""
    from safetensors.numpy import load

    arrays = load(PROFILE_FILE.read_bytes())
    meta = arrays.pop("metadata").tobytes().decode()
    assert json.loads(meta)["format"] == "kvwire-profile"
    digest = hashlib.blake2b(digest_size=8)
    digest.update(json.dumps(json.loads(meta), sort_keys=True).encode())
    for name in sorted(arrays):
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(arrays[name]).astype(arrays[name].dtype.newbyteorder("<")).tobytes())
    assert digest.hexdigest() == golden["profile"].id
    expected = {"mean": np.float32, "basis": np.float32, "steps": np.float32, "kept": np.int32,
                "delta_group": np.int32, "shift": np.uint8, "table": np.uint8, "tables": np.uint16}
    assert set(arrays) == set(expected)
    for name, dtype in expected.items():
        assert arrays[name].dtype == dtype, name
    assert (arrays["tables"].astype(np.int64).sum(axis=1) == 4096).all()
    assert (arrays["tables"][:, 127] > 0).all()


if __name__ == "__main__":
    _regenerate()
    print(f"regenerated golden files in {DATA}")
