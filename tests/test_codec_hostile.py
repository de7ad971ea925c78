"""Hostile blobs and profiles built by hand from codec/FORMAT.md (issue #15).

Each is rejected with a typed error before the decoder sizes anything from the
field it lies about: a profile whose kept rows exceed its channels (the kernels
would index past their tables), a header claiming 2^21 tokens over a few words of
lanes (the decoder allocated hundreds of MB before noticing), zstd bombs as
embedded profiles, impossible shapes and section modes, an old format version.
What rejecting them costs (seconds, peak RSS) is measured in a subprocess by
``kvwire bench adversarial hostile``, not asserted here.
"""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import codec
from codec import container, layer_codec
from streamer.tools.adversarial import HOSTILE, hand_blob, lane_payload

from agreement import assert_decoders_agree


@pytest.fixture(scope="module")
def small_profile() -> codec.Profile:
    gen = torch.Generator().manual_seed(0)
    return codec.calibrate([torch.randn(1, 2, 64, 1, 2, generator=gen)], sink_tokens=0)


# ------------------------------------------------------------------ finding 1: kept past channels
def test_standalone_profile_with_kept_past_channels_is_corrupt() -> None:
    build, reject = HOSTILE["profile_kept_past_channels"]
    with pytest.raises(codec.CorruptBitstream, match="R <= "):
        reject(build())


def test_embedded_profile_with_kept_past_channels_is_corrupt() -> None:
    """The same profile inside a blob: refused while resolving, before any kernel runs."""
    raw = HOSTILE["profile_kept_past_channels"][0]()
    blob = hand_blob(tokens=40, heads=1, head_dim=2, sections=[lane_payload(2, 4)], profile_id="00" * 8,
                     embedded=zstandard.ZstdCompressor().compress(raw))
    with pytest.raises(codec.CorruptBitstream, match="R <= "):
        codec.decode(blob)


def test_embedded_profile_must_be_identity(small_profile) -> None:
    """FORMAT.md: an embedded profile is identity with one level; a PCA one is refused."""
    one_level = codec.calibrate([torch.randn(1, 2, 64, 1, 2)], targets=(1e-3,), sink_tokens=0)
    blob = hand_blob(tokens=40, heads=1, head_dim=2, sections=[lane_payload(2, 4)], profile_id=one_level.id,
                     embedded=zstandard.ZstdCompressor().compress(one_level.to_bytes()))
    with pytest.raises(codec.CorruptBitstream, match="identity"):
        codec.decode(blob)


# ------------------------------------------------------------------ finding 2: size claims
def test_blob_claiming_many_tokens_over_few_words_is_corrupt(small_profile) -> None:
    """2^21 tokens over 8 words of lanes: the header alone refuses it (more output per
    byte than MAX_OUTPUT_PER_BYTE), by name, for the whole-blob, layer-by-layer and
    section decoders alike, before any lane is read."""
    blob, profile = HOSTILE["blob_claiming_2^21_tokens"][0]()
    assert len(blob) < 4096
    with pytest.raises(codec.CorruptBitstream, match="bytes of output, over 1024 per byte"):
        codec.parse_header(blob)
    with pytest.raises(codec.CorruptBitstream, match="per byte"):
        codec.decode(blob, profile)
    with pytest.raises(codec.CorruptBitstream, match="per byte"):
        list(codec.decode_layers(blob, profile))


@pytest.mark.parametrize("name", ["blob_11kb_claiming_1gib"])
def test_a_small_section_claiming_a_gigabyte_is_refused_at_the_header(name: str) -> None:
    """FORMAT.md's lane minimum lets a table whose likeliest symbol is almost certain carry
    ~48,000 values per word, so an ~11 KB section could pass it and claim 1 GiB of output;
    the header's output-per-byte bound refuses it before anything is read or allocated."""
    build, reject = HOSTILE[name]
    blob, _ = build()
    assert 10_000 < len(blob) < 12_000
    assert container.token_bytes(1 << 14, 1 << 14, torch.float32) * 2 >= 1 << 30
    with pytest.raises(codec.CorruptBitstream, match="per byte"):
        reject((blob, None))


def test_a_rotary_blob_claiming_millions_of_tokens_builds_no_angle_table() -> None:
    """The output bound comes before the RoPE angles: a hostile position and token count
    cost no table, kept or not."""
    from codec import rotary as rotary_module

    blob, profile = HOSTILE["rotary_blob_claiming_2^21_tokens_at_2^30"][0]()
    assert profile.rotary is not None
    before = rotary_module._ANGLES.nbytes
    computed = []
    real = rotary_module._angles
    rotary_module._angles = lambda *a: computed.append(a) or real(*a)
    try:
        with pytest.raises(codec.CorruptBitstream, match="per byte"):
            codec.decode(blob, profile)
    finally:
        rotary_module._angles = real
    assert computed == [] and rotary_module._ANGLES.nbytes == before


def test_a_profile_claiming_a_gigabyte_it_does_not_hold_is_corrupt() -> None:
    data = HOSTILE["profile_16kb_claiming_1gib_basis"][0]()
    assert len(data) < 20_000
    with pytest.raises(codec.CorruptBitstream, match="not a kvwire profile"):
        codec.Profile.from_bytes(data)


def test_the_lane_minimum_refuses_lanes_too_short_for_their_tokens(small_profile) -> None:
    """A section within the output-per-byte bound whose lanes hold fewer words than their
    values need (FORMAT.md, "Lane minimum"): refused by name before decoding."""
    plan = layer_codec.plan_layer(small_profile, 0, 0, 4096)
    payload = lane_payload(plan.lanes, 64, kept=plan.kept, steps=tuple(map(float, small_profile.steps[0, 0])))
    blob = hand_blob(tokens=4096, heads=1, head_dim=2, sections=[payload], profile_id=small_profile.id, dtype=3)
    codec.parse_header(blob)   # within the bound
    with pytest.raises(codec.CorruptBitstream, match="too few for 4096 tokens"):
        codec.decode(blob, small_profile)
    header = codec.parse_header(blob)
    with pytest.raises(codec.CorruptBitstream, match="too few"):
        codec.decode_section(header, small_profile, 0, blob[header.size:])


def test_whole_blob_decode_checks_every_section_before_allocating(small_profile, monkeypatch) -> None:
    """A valid layer 0 and a lying layer 1: decode() refuses before sizing its output."""
    kv = torch.randn(2, 2, 40, 1, 2)
    profile = codec.calibrate([kv], sink_tokens=0)
    good = codec.encode(kv, 1, profile)
    header = codec.parse_header(good)
    first = bytes(container.section(good, header, 0))
    plan = layer_codec.plan_layer(profile, 1, 1, 40)
    blob = hand_blob(tokens=40, heads=1, head_dim=2, sections=[first, lane_payload(plan.lanes, 0, kept=plan.kept)],
                     profile_id=profile.id, dtype=3, level=1)
    allocated = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: allocated.append(a) or real_empty(*a, **k))
    with pytest.raises(codec.CorruptBitstream, match="layer 1: lane 0 has 0 words"):
        codec.decode(blob, profile)
    assert allocated == []  # neither the output nor layer 0's coefficients


@pytest.mark.parametrize("name", ["embedded_profile_zstd_bomb", "embedded_profile_unsized_zstd_bomb"])
def test_embedded_profile_bombs_are_corrupt(name: str) -> None:
    build, reject = HOSTILE[name]
    with pytest.raises(codec.CorruptBitstream, match="embedded profile"):
        reject(build())


def test_embedded_profile_longer_than_its_shape_allows_is_refused_from_32_bytes() -> None:
    """A streaming reader learns the header's length from 32 bytes: a P no blob of this
    shape can need is refused there, before it buffers 4 GiB of "header"."""
    blob = hand_blob(tokens=8, heads=1, head_dim=2, sections=[lane_payload(2, 0)], profile_id="00" * 8,
                     embedded=b"x")
    prefix = bytearray(blob[:32])
    struct.pack_into("<I", prefix, 28, 0xFFFFFFFF)
    with pytest.raises(codec.CorruptBitstream, match="4294967295-byte embedded profile"):
        codec.header_length(bytes(prefix))
    assert codec.header_length(blob[:32]) == 32 + 4 + 9 + 1 + 4  # fixed, start, one entry, P, CRC


@pytest.mark.parametrize("heads,head_dim,tokens,word", [
    (0xFFFF, 0xFFFF, 1, "channels"),          # C > 2^16
    (256, 257, 1, "channels"),                 # C = 65792
    (256, 256, 1 << 13, "values per K or V"),  # T * C = 2^29
])
def test_shapes_past_the_limits_are_corrupt(heads: int, head_dim: int, tokens: int, word: str) -> None:
    blob = hand_blob(tokens=tokens, heads=heads, head_dim=head_dim, sections=[lane_payload(1, 0)],
                     profile_id="00" * 8)
    with pytest.raises(codec.CorruptBitstream, match=word):
        codec.parse_header(blob)


def test_section_modes_and_lengths_are_checked(small_profile) -> None:
    kwargs = dict(tokens=8, heads=1, head_dim=2, profile_id=small_profile.id)
    with pytest.raises(codec.CorruptBitstream, match="unknown mode 2"):
        codec.parse_header(hand_blob(sections=[lane_payload(2, 0)], modes=[2], **kwargs))
    raw = bytes(2 * 8 * 2 * 2)  # K and V, 8 tokens, 2 channels, fp16
    codec.parse_header(hand_blob(sections=[raw], modes=[1], **kwargs))
    with pytest.raises(codec.CorruptBitstream, match="raw section is 30 bytes, its shape needs 64"):
        codec.parse_header(hand_blob(sections=[raw[:30]], modes=[1], **kwargs))
    with pytest.raises(codec.CorruptBitstream, match="shorter than its sink tokens"):
        codec.parse_header(hand_blob(sections=[b"\0" * 10], sinks=4, **kwargs))


@pytest.mark.timeout(60)
def test_many_layers_cost_linear_time(small_profile) -> None:
    """Found by the header fuzzer: section offsets were summed from layer 0 for every
    layer, so walking a 65535-layer blob took ~2e9 steps. They are summed once now."""
    layers = 0xFFFF
    blob = hand_blob(tokens=1, heads=1, head_dim=1, sections=[bytes(4)] * layers, modes=[1] * layers,
                     profile_id="00" * 8)
    header = codec.parse_header(blob)
    assert header.total_size == len(blob)
    for layer in range(layers):
        assert len(container.section(blob, header, layer)) == 4


def test_raw_section_by_hand_decodes_to_its_bytes(small_profile) -> None:
    """FORMAT.md: a raw section is K[0:S] V[0:S] then K[S:T] V[S:T], little-endian."""
    kv = torch.arange(40, dtype=torch.float16).reshape(1, 2, 10, 1, 2)
    sinks = kv[0, :, :3].contiguous().view(torch.int16).numpy().astype("<i2").tobytes()
    rest = kv[0, :, 3:].contiguous().view(torch.int16).numpy().astype("<i2").tobytes()
    blob = hand_blob(tokens=10, heads=1, head_dim=2, sinks=3, sections=[sinks + rest], modes=[1],
                     profile_id=small_profile.id)
    assert torch.equal(codec.decode(blob, small_profile), kv)


def test_old_format_version_is_refused_by_name(small_profile) -> None:
    blob = hand_blob(tokens=8, heads=1, head_dim=2, sections=[lane_payload(2, 0)], profile_id=small_profile.id,
                     version=1)
    with pytest.raises(codec.CorruptBitstream, match="unsupported blob format version 1 .*reads 2, 3, 4, 5"):
        codec.decode(blob, small_profile)


# ------------------------------------------------------------------ version 4-5 lane tables (issue #16)
def _lane_blob(profile, tokens: int, payload: bytes) -> bytes:
    return hand_blob(tokens=tokens, heads=1, head_dim=2, sections=[payload], profile_id=profile.id, dtype=3, level=1)


@pytest.fixture(scope="module")
def delta_profile() -> codec.Profile:
    """Delta group 10 on K and V, so pieces must be multiples of 10."""
    gen = torch.Generator().manual_seed(1)
    return codec.calibrate([torch.randn(1, 2, 64, 1, 2, generator=gen)], sink_tokens=0, delta="always")


@pytest.mark.parametrize("piece,rows_per_lane,tokens,message", [
    (0, 0, 40, "rows_per_lane must be >= 1"),
    (0, 410, 40, "lanes of 410 rows x 40 tokens pass 16383 values"),
    (0, 1, 20000, "lanes of 1 rows x 20000 tokens pass 16383 values"),   # rows too long: must be cut
    (20, 2, 40, "a lane of pieces holds one row"),
    (40, 1, 40, "piece of 40 tokens not in"),                             # a piece must cut
    (16390, 1, 20000, "piece of 16390 tokens not in"),                   # past 16383 values
    (15, 1, 40, "does not start at anchors"),                             # not a multiple of 10
])
def test_impossible_lane_shapes_are_corrupt(delta_profile, piece, rows_per_lane, tokens, message) -> None:
    """FORMAT.md "Rows and lanes": the shape is checked before n_lanes is compared with it.
    (200 words, which no lane shape reads, keep the section within the output per byte.)"""
    blob = _lane_blob(delta_profile, tokens, lane_payload(4, 200, piece, rows_per_lane))
    with pytest.raises(codec.CorruptBitstream, match="impossible lane shape: .*" + message):
        codec.decode(blob, delta_profile)


def test_lane_count_must_follow_from_the_shape(delta_profile) -> None:
    kept = (int(delta_profile.kept[1, 0, 0]), int(delta_profile.kept[1, 0, 1]))
    lanes = sum(kept) * 4  # pieces of 10 tokens over 40
    with pytest.raises(codec.CorruptBitstream, match=f"{lanes + 1} lanes, profile and shape imply {lanes}"):
        codec.decode(_lane_blob(delta_profile, 40, lane_payload(lanes + 1, 0, 10, kept=kept)), delta_profile)
    # the right count, but the table is cut: refused before any array is sized from it
    cut = lane_payload(lanes, 0, 10, kept=kept)[:-3]
    with pytest.raises(codec.CorruptBitstream, match="lane table truncated"):
        codec.decode(_lane_blob(delta_profile, 40, cut), delta_profile)
    with pytest.raises(codec.CorruptBitstream, match="lane table truncated"):
        codec.decode(_lane_blob(delta_profile, 40, struct.pack("<I", lanes)), delta_profile)
    # the right count and shape, word counts adding up to more than the words present
    payload = bytearray(lane_payload(lanes, 3, 10, kept=kept))
    with pytest.raises(codec.CorruptBitstream, match="lane lengths disagree"):
        codec.decode(_lane_blob(delta_profile, 40, bytes(payload[:-2])), delta_profile)


def test_a_blob_of_pieces_decodes_like_one_of_whole_rows(delta_profile) -> None:
    """The same quantized values in another valid lane shape decode to the same tensor:
    the shape is the stream's layout, never its meaning."""
    from codec.profile import split_tokens

    kv = torch.randn(1, 2, 40, 1, 2, generator=torch.Generator().manual_seed(4))
    body = split_tokens(kv, 0)[0]
    plan, q, _ = layer_codec.quantize_layer(delta_profile, 1, 0, body[0], body[1])
    outs = []
    for rows_per_lane, piece in ((1, 0), (2, 0), (1, 10), (1, 30)):
        shaped = plan.with_lanes(rows_per_lane, piece)
        assert shaped.shape_error() is None
        blob = _lane_blob(delta_profile, 40, layer_codec.pack_lanes(delta_profile, shaped, q))
        assert codec.inspect(blob)["lanes"] == shaped.lanes
        outs.append(codec.decode(blob, delta_profile))
    assert all(torch.equal(out, outs[0]) for out in outs[1:])
    assert torch.equal(outs[0], codec.decode(codec.encode(kv, 1, delta_profile), delta_profile))


# ------------------------------------------------------------------ the lane minimum is sound
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tokens=st.integers(1, 300), channels=st.sampled_from([(1, 1), (2, 3), (4, 8)]),
       level=st.integers(0, 4), delta=st.sampled_from(["never", "always"]),
       scale=st.sampled_from([1e-3, 1.0, 50.0]), seed=st.integers(0, 2 ** 16))
def test_lane_minimum_never_refuses_a_valid_stream(tokens, channels, level, delta, scale, seed) -> None:
    """Every lane the encoder writes holds at least the minimum FORMAT.md states."""
    heads, head_dim = channels
    gen = torch.Generator().manual_seed(seed)
    profile = codec.calibrate([torch.randn(2, 2, 80, heads, head_dim, generator=gen)], delta=delta, sink_tokens=0)
    kv = scale * torch.randn(2, 2, tokens, heads, head_dim, generator=gen)
    blob = codec.encode(kv, level, profile)
    header = codec.parse_header(blob)
    for layer in range(header.layers):
        if header.is_raw(layer):
            continue
        lanes = layer_codec.parse_lanes(profile, level, layer, tokens, container.section(blob, header, layer),
                                        header.version)
        counts = np.diff(lanes.lane_start)
        assert (counts >= layer_codec.min_lane_words(profile, lanes.plan)).all()
    codec.decode(blob, profile)


def test_lane_minimum_is_close_on_calibrated_data(codec_make_kv) -> None:
    """Not a vacuous bound: on data like the calibration it is a real part of the size."""
    profile = codec.calibrate([codec_make_kv(1, tokens=2000)], sink_tokens=0)
    blob = codec.encode(codec_make_kv(2, tokens=2000), 1, profile)
    header = codec.parse_header(blob)
    lanes = layer_codec.parse_lanes(profile, 1, 0, header.coded_tokens, container.section(blob, header, 0),
                                    header.version)
    assert lanes.plan.pieces > 1  # 2000 tokens: rows are cut into pieces
    least = layer_codec.min_lane_words(profile, lanes.plan).sum()
    assert least > 0.4 * np.diff(lanes.lane_start).sum()  # ~0.65 (FORMAT.md)


# ------------------------------------------------------------------ finding 11: parse once
def test_embedded_profile_is_parsed_once_per_decode(monkeypatch) -> None:
    kv = torch.randn(8, 2, 30, 2, 4, generator=torch.Generator().manual_seed(3))
    blob = codec.encode(kv, 2)
    parses = []
    real = codec.Profile.from_bytes.__func__
    monkeypatch.setattr(codec.Profile, "from_bytes",
                        classmethod(lambda cls, data: parses.append(1) or real(cls, data)))
    for run in (lambda: codec.decode(blob), lambda: list(codec.decode_layers(blob))):
        codec.api._parse_embedded.cache_clear()
        parses.clear()
        run()
        assert len(parses) == 1
    header = codec.parse_header(blob)
    for layer in range(header.layers):  # section by section, as a receiver streams it
        codec.decode_section(header, None, layer, container.section(blob, header, layer))
    assert len(parses) == 1


def test_hand_blob_agrees_with_the_encoder(small_profile) -> None:
    """The tests' FORMAT.md builder writes the encoder's bytes (so it tests the format)."""
    kv = torch.randn(1, 2, 12, 1, 2, generator=torch.Generator().manual_seed(5))
    blob = codec.encode(kv, 0, small_profile)
    header = codec.parse_header(blob)
    sections = [bytes(container.section(blob, header, l)) for l in range(header.layers)]
    again = hand_blob(tokens=12, heads=1, head_dim=2, sections=sections, modes=list(header.modes),
                      profile_id=small_profile.id, dtype=3, sinks=0)
    assert again == blob
    assert struct.unpack_from("<B", blob, 4)[0] == container.FORMAT_VERSION == 5
    moved = codec.encode(kv, 0, small_profile, start=7)
    assert hand_blob(tokens=12, heads=1, head_dim=2, sections=sections, modes=list(header.modes),
                     profile_id=small_profile.id, dtype=3, sinks=0, start=7) == moved


def test_version_2_and_3_blobs_still_read() -> None:
    """FORMAT.md "Versioning": the committed version 3 golden blob (lanes of whole rows,
    u32 counts) decodes; as version 2 (no start field) it reads at start 0, the same."""
    data = Path(__file__).parent / "data"
    profile = codec.Profile.load(data / "golden_profile.safetensors")
    v3 = (data / "golden_blob_v3.bin").read_bytes()
    header = codec.parse_header(v3)
    assert header.version == 3
    expected = torch.from_numpy(np.load(data / "golden_decoded_v4.npy"))  # v3 and v4: the same values
    out = codec.decode(v3, profile)
    assert_decoders_agree(out, expected, profile)
    sections = [bytes(container.section(v3, header, l)) for l in range(header.layers)]
    v2 = hand_blob(tokens=header.tokens, heads=header.heads, head_dim=header.head_dim, sections=sections,
                   modes=list(header.modes), profile_id=profile.id, level=header.level, sinks=header.sink_tokens,
                   version=2)
    assert codec.parse_header(v2).start == 0
    assert torch.equal(codec.decode(v2, profile), out)
    assert codec.inspect(v3)["sections"]["lanes"] == [3, 3]  # ceil(kept / 14) for K and V


def test_an_exact_level_blob_with_a_coded_section_is_refused_at_the_header() -> None:
    """The exact level's sections are copied, never decoded: a blob that claims the level
    with a coded section (lanes no profile level describes) is corrupt before any lane is read."""
    build, reject = HOSTILE["exact_level_blob_with_a_coded_section"]
    blob, profile = build()
    assert blob[6] == codec.EXACT_LEVEL   # FORMAT.md: the fixed header's level byte
    with pytest.raises(codec.CorruptBitstream, match="exact-level blob must have every section raw"):
        reject((blob, profile))
