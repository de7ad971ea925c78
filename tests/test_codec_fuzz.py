"""Fuzzing the decoder with truncated, bit-flipped and forged blobs and profiles.

The contract (codec/errors.py): a damaged blob raises CorruptBitstream before any
tensor is returned. Checksums make that exact for random damage: every prefix, every
single-bit flip, random multi-bit flips and byte overwrites must raise it. When the
damage is *forged* (section and header CRCs recomputed after the flip), the checksums
no longer help and the rANS decoder and container checks are on their own: then a
decode must raise a CodecError (CorruptBitstream, or ProfileMismatch where the forged
header names another profile) or return a tensor of the shape and dtype the header
declares; never crash, hang, or raise anything else.

All blobs are tiny (a few hundred bytes) so thousands of cases run in a few seconds.
The random cases use fixed seeds: a failure reproduces exactly.
"""
from __future__ import annotations

import random
import struct
import zlib

import pytest
import torch

import codec
from codec import container

FIXED = 32          # FORMAT.md: fixed header size
TABLE = FIXED + 4   # version 3: the u32 start position, then the section table
ENTRY = 9           # (u32 length, u32 crc32, u8 mode) per layer
pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def tiny_profile():
    gen = torch.Generator().manual_seed(0)
    return codec.calibrate([torch.randn(2, 2, 64, 1, 3, generator=gen)], delta="always")


@pytest.fixture(scope="module")
def tiny_kv():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(2, 2, 24, 1, 3, generator=gen)


@pytest.fixture(scope="module")
def profiled_blob(tiny_profile, tiny_kv):
    """(blob, profile): 2 layers, 20 coded tokens, delta coding, ~400 bytes."""
    return codec.encode(tiny_kv, 2, tiny_profile), tiny_profile


@pytest.fixture(scope="module")
def embedded_blob(tiny_kv):
    """(blob, None): fp16 with an embedded profile, ~1.5 kB."""
    return codec.encode(tiny_kv.half(), 2), None


@pytest.fixture(scope="module")
def predicted_blob():
    """(blob, profile): format 7, 3 layers each following from the one before, layer 1
    coded as what its prediction from layer 0 misses (layer 2 restarts), ~500 bytes."""
    from codec.synthetic import chained_kv

    profile = codec.calibrate([chained_kv(3, 1, 3, 64, 0)], predict=2)
    blob = codec.encode(chained_kv(3, 1, 3, 24, 1), 2, profile)
    assert codec.inspect(blob)["format_version"] == container.PREDICTED_VERSION and codec.inspect(blob)["sections"]["raw_layers"] == []
    return blob, profile


@pytest.fixture(scope="module", params=["profiled", "embedded", "predicted"])
def case(request, profiled_blob, embedded_blob, predicted_blob):
    blob, profile = {"profiled": profiled_blob, "embedded": embedded_blob, "predicted": predicted_blob}[request.param]
    # sanity: the undamaged blob decodes, so every failure below is due to the damage
    codec.decode(blob, profile)
    return blob, profile


# ------------------------------------------------------------------ helpers
def _expect_corrupt(data: bytes, profile) -> None:
    with pytest.raises(codec.CorruptBitstream):
        codec.decode(data, profile)


def _expect_corrupt_or_shaped(data: bytes, profile, allow_mismatch: bool = False) -> str:
    """Forged damage: CorruptBitstream (or ProfileMismatch) or a well-formed tensor."""
    allowed = (codec.CorruptBitstream, codec.ProfileMismatch) if allow_mismatch else codec.CorruptBitstream
    try:
        out = codec.decode(data, profile)
    except allowed:
        return "raised"
    header = codec.parse_header(data)
    assert out.shape == header.shape and out.dtype == header.dtype
    # the layer-at-a-time API agrees with decode on accepted blobs
    for layer, k, v in codec.decode_layers(data, profile):
        for got, ref in ((k, out[layer, 0]), (v, out[layer, 1])):
            assert got.shape == ref.shape and got.dtype == ref.dtype
            got, ref = got.float(), ref.float()
            close = torch.isclose(got, ref, rtol=1e-2, atol=1e-6, equal_nan=True) | ~torch.isfinite(ref)
            assert bool(close.all())
    return "decoded"


def _section_table(blob: bytes) -> tuple[int, int, int]:
    """(layers, embedded_len, header_size) read straight from the bytes per FORMAT.md."""
    layers = struct.unpack_from("<H", blob, 8)[0]
    embedded = struct.unpack_from("<I", blob, 28)[0]
    return layers, embedded, TABLE + ENTRY * layers + embedded + 4


def _reseal(blob: bytearray, sections: list[bytes] | None = None) -> bytes:
    """Rewrite section lengths/CRCs (if given) and the header CRC: a forged blob."""
    layers, _, size = _section_table(bytes(blob))
    header = bytearray(blob[:size])
    if sections is not None:
        for i, sec in enumerate(sections):
            struct.pack_into("<II", header, TABLE + ENTRY * i, len(sec), zlib.crc32(sec) & 0xFFFFFFFF)
    struct.pack_into("<I", header, size - 4, zlib.crc32(bytes(header[:size - 4])) & 0xFFFFFFFF)
    body = b"".join(sections) if sections is not None else bytes(blob[size:])
    return bytes(header) + body


def _split_sections(blob: bytes) -> tuple[int, list[bytes]]:
    layers, _, size = _section_table(blob)
    out, pos = [], size
    for i in range(layers):
        length = struct.unpack_from("<I", blob, TABLE + ENTRY * i)[0]
        out.append(blob[pos:pos + length])
        pos += length
    assert pos == len(blob)
    return size, out


def _flip(data: bytes, bit: int) -> bytes:
    buf = bytearray(data)
    buf[bit // 8] ^= 1 << (bit % 8)
    return bytes(buf)


def test_reseal_helper_is_faithful(case):
    """The forging helpers reproduce an untouched blob exactly (so they forge correctly)."""
    blob, _ = case
    size, sections = _split_sections(blob)
    assert _reseal(bytearray(blob), sections) == blob
    assert size == codec.header_length(blob[:FIXED])


# ------------------------------------------------------------------ truncation
def test_every_prefix_is_corrupt(case):
    blob, profile = case
    for n in range(len(blob)):
        _expect_corrupt(blob[:n], profile)


def test_every_prefix_decode_layers(profiled_blob):
    """decode_layers on a prefix raises CorruptBitstream at the first missing layer at the latest."""
    blob, profile = profiled_blob
    header = codec.parse_header(blob)
    for n in range(len(blob)):
        prefix = blob[:n]
        if n < header.size:
            with pytest.raises(codec.CorruptBitstream):
                list(codec.decode_layers(prefix, profile))
            continue
        complete = sum(1 for l in range(header.layers)
                       if header.section_offset(l) + header.sections[l][0] <= n)
        got = []
        with pytest.raises(codec.CorruptBitstream):
            for layer, _, _ in codec.decode_layers(prefix, profile):
                got.append(layer)
        assert got == list(range(complete))


def test_random_cuts_and_extensions(case):
    blob, profile = case
    rng = random.Random(1)
    for _ in range(300):
        cut = rng.randrange(len(blob))
        _expect_corrupt(blob[:cut], profile)
        # a cut followed by junk of the right total length is damage too
        _expect_corrupt(blob[:cut] + rng.randbytes(len(blob) - cut - 1) + bytes([blob[-1] ^ 0xFF]), profile)
        _expect_corrupt(blob + rng.randbytes(rng.randrange(1, 64)), profile)


# ------------------------------------------------------------------ bit flips (CRCs intact)
def test_every_single_bit_flip(case):
    blob, profile = case
    for bit in range(8 * len(blob)):
        _expect_corrupt(_flip(blob, bit), profile)


def test_random_multi_bit_flips(case):
    blob, profile = case
    rng = random.Random(2)
    for _ in range(1500):
        data = bytearray(blob)
        for _ in range(rng.randrange(2, 9)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        if bytes(data) != blob:
            _expect_corrupt(bytes(data), profile)


def test_random_byte_overwrites(case):
    blob, profile = case
    rng = random.Random(3)
    for _ in range(1500):
        data = bytearray(blob)
        start = rng.randrange(len(data))
        run = rng.randbytes(rng.randrange(1, 17))
        data[start:start + len(run)] = run
        data = bytes(data[:len(blob)])
        if data != blob:
            _expect_corrupt(data, profile)


def test_section_only_flips_keep_header_valid(case):
    """Damage confined to sections: the header parses, the section CRC catches it."""
    blob, profile = case
    size, _ = _split_sections(blob)
    rng = random.Random(4)
    for _ in range(1000):
        data = bytearray(blob)
        for _ in range(rng.randrange(1, 4)):
            data[rng.randrange(size, len(data))] ^= 1 << rng.randrange(8)
        data = bytes(data)
        if data == blob:
            continue
        codec.parse_header(data)  # header untouched and valid
        _expect_corrupt(data, profile)
        with pytest.raises(codec.CorruptBitstream):
            list(codec.decode_layers(data, profile))


def test_decode_section_rejects_flipped_section(profiled_blob):
    blob, profile = profiled_blob
    header = codec.parse_header(blob)
    for layer in range(header.layers):
        start, length = header.section_offset(layer), header.sections[layer][0]
        section = blob[start:start + length]
        for bit in range(8 * length):
            with pytest.raises(codec.CorruptBitstream):
                codec.decode_section(header, profile, layer, _flip(section, bit))


# ------------------------------------------------------------------ forged damage (CRCs recomputed)
def test_forged_section_bit_flips(case):
    """CRCs recomputed after flipping section bits: the decoder itself must cope."""
    blob, profile = case
    size, sections = _split_sections(blob)
    rng = random.Random(5)
    outcomes = {"raised": 0, "decoded": 0}
    for trial in range(1500):
        layer = rng.randrange(len(sections))
        sec = bytearray(sections[layer])
        for _ in range(rng.randrange(1, 4)):
            sec[rng.randrange(len(sec))] ^= 1 << rng.randrange(8)
        forged = list(sections)
        forged[layer] = bytes(sec)
        data = _reseal(bytearray(blob), forged)
        codec.parse_header(data)  # the forgery passes every checksum
        outcomes[_expect_corrupt_or_shaped(data, profile)] += 1
    # the rANS stream is strict (exact final state, exact word count): most damage is caught
    assert outcomes["raised"] > outcomes["decoded"], outcomes


def test_forged_every_single_bit_in_lane_payload(profiled_blob):
    """Every single-bit flip of layer 0's lane payload, CRC recomputed."""
    blob, profile = profiled_blob
    size, sections = _split_sections(blob)
    header = codec.parse_header(blob)
    sink_len = 2 * header.sink_tokens * header.heads * header.head_dim * 4
    sec = sections[0]
    raised = 0
    for bit in range(8 * sink_len, 8 * len(sec)):
        data = _reseal(bytearray(blob), [_flip(sec, bit)] + sections[1:])
        raised += _expect_corrupt_or_shaped(data, profile) == "raised"
    assert raised > 0.5 * (8 * (len(sec) - sink_len))


def test_forged_sink_flip_decodes_to_the_flipped_value(profiled_blob):
    """Sink bytes are raw: a forged flip there decodes, and changes exactly one element."""
    blob, profile = profiled_blob
    _, sections = _split_sections(blob)
    good = codec.decode(blob, profile)
    data = _reseal(bytearray(blob), [sections[0], _flip(sections[1], 3 * 8 + 6)])
    out = codec.decode(data, profile)
    changed = (out.view(torch.int32) != good.view(torch.int32))
    assert int(changed.sum()) == 1 and bool(changed[1, 0, 0, 0, 0])


def test_forged_section_resizes(case):
    """Sections truncated, extended or swapped, with lengths and CRCs forged to match."""
    blob, profile = case
    size, sections = _split_sections(blob)
    rng = random.Random(6)
    for layer in range(len(sections)):
        sec = sections[layer]
        variants = [sec[:n] for n in range(len(sec))]
        variants += [sec + rng.randbytes(k) for k in (1, 2, 3, 4, 8)]
        variants += [sec[:n] + rng.randbytes(rng.randrange(1, 8)) + sec[n:]
                     for n in rng.sample(range(len(sec)), 40)]
        for variant in variants:
            forged = list(sections)
            forged[layer] = variant
            _expect_corrupt_or_shaped(_reseal(bytearray(blob), forged), profile)
    # two layers' sections swapped: lengths and CRCs follow, the decoder must not crash
    _expect_corrupt_or_shaped(_reseal(bytearray(blob), sections[::-1]), profile)


def test_forged_lane_table(profiled_blob):
    """Lane count, word counts and final states rewritten with valid CRCs."""
    blob, profile = profiled_blob
    size, sections = _split_sections(blob)
    header = codec.parse_header(blob)
    sink_len = 2 * header.sink_tokens * header.heads * header.head_dim * 4
    sec = sections[0]
    lanes = struct.unpack_from("<I", sec, sink_len)[0]
    assert lanes >= 1
    rng = random.Random(7)
    values = [0, 1, 2, 0xFFFF, 0x10000, 0x10001, 0x7FFFFFFF, 0xFFFFFFFF] + \
             [rng.getrandbits(32) for _ in range(40)]
    for slot in range(1 + 2 * lanes):  # n_lanes, word_count[i], final_state[i]
        for value in values:
            forged_sec = bytearray(sec)
            struct.pack_into("<I", forged_sec, sink_len + 4 * slot, value)
            data = _reseal(bytearray(blob), [bytes(forged_sec)] + sections[1:])
            result = _expect_corrupt_or_shaped(data, profile)
            if slot == 0 and value != lanes:
                assert result == "raised"


def test_forged_header_fields(case):
    """Fixed-header and start bytes (after magic/version) rewritten, header CRC recomputed."""
    blob, profile = case
    rng = random.Random(8)
    size = codec.header_length(blob[:FIXED])
    for trial in range(1500):
        data = bytearray(blob)
        for _ in range(rng.randrange(1, 3)):
            pos = rng.randrange(5, TABLE)
            data[pos] = rng.randrange(256) if rng.random() < 0.5 else data[pos] ^ (1 << rng.randrange(8))
        data = bytes(data)
        try:
            new_size = codec.header_length(data[:FIXED])
        except codec.CorruptBitstream:  # a length no blob of that shape can have: refused at once
            _expect_corrupt(data, profile)
            continue
        if new_size != size:
            # the header now claims another length: its CRC cannot be placed; must be corrupt
            _expect_corrupt(data, profile)
            continue
        forged = _reseal(bytearray(data))
        _expect_corrupt_or_shaped(forged, profile, allow_mismatch=True)


def test_forged_embedded_profile(embedded_blob):
    """Bytes of the embedded (zstd) profile rewritten, header CRC recomputed."""
    blob, _ = embedded_blob
    layers, embedded_len, size = _section_table(blob)
    start = TABLE + ENTRY * layers
    rng = random.Random(9)
    for trial in range(400):
        data = bytearray(blob)
        for _ in range(rng.randrange(1, 4)):
            data[start + rng.randrange(embedded_len)] ^= 1 << rng.randrange(8)
        _expect_corrupt_or_shaped(_reseal(data), None)
    # a valid zstd frame of some other profile: refused, it does not match the header id
    import zstandard

    gen = torch.Generator().manual_seed(5)
    other_kv = torch.randn(2, 2, 24, 1, 3, generator=gen).half()
    other = codec.encode(other_kv, 2)
    other_header = codec.parse_header(other)
    frame = other_header.embedded_profile
    zstandard.ZstdDecompressor().decompress(frame)  # a well-formed frame
    header = bytearray(blob[:start]) + frame
    struct.pack_into("<I", header, 28, len(frame))
    forged = _reseal(bytearray(bytes(header) + b"\0\0\0\0" + blob[size:]))
    with pytest.raises(codec.CorruptBitstream, match="does not match"):
        codec.decode(forged)


# ------------------------------------------------------------------ garbage
def test_random_garbage_is_corrupt():
    rng = random.Random(10)
    for _ in range(2000):
        data = rng.randbytes(rng.randrange(0, 400))
        _expect_corrupt(data, None)
        with pytest.raises(codec.CorruptBitstream):
            codec.inspect(data)


def test_garbage_with_valid_magic_is_corrupt(tiny_profile):
    rng = random.Random(11)
    for _ in range(2000):
        data = b"KVWB\x03" + rng.randbytes(rng.randrange(0, 400))
        _expect_corrupt(data, tiny_profile)
        _expect_corrupt(data, None)


def test_garbage_with_valid_header_crc_is_handled(tiny_profile):
    """Random headers with a correct CRC: only CodecError may come out."""
    rng = random.Random(12)
    for _ in range(2000):
        layers = rng.randrange(1, 4)
        embedded = rng.choice([0, 0, rng.randrange(1, 40)])
        fixed = bytearray(b"KVWB\x03" + rng.randbytes(TABLE - 5))
        struct.pack_into("<H", fixed, 8, layers)
        struct.pack_into("<I", fixed, 28, embedded)
        if rng.random() < 0.5:  # make the shape plausible more often
            struct.pack_into("<BBBHHHHI", fixed, 5, rng.randrange(1, 4), rng.randrange(6),
                             rng.randrange(2), layers, rng.randrange(1, 4), rng.randrange(1, 4),
                             rng.randrange(6), rng.randrange(1, 40))
        body = bytes(fixed) + rng.randbytes(ENTRY * layers + embedded)
        header = body + struct.pack("<I", zlib.crc32(body) & 0xFFFFFFFF)
        data = header + rng.randbytes(rng.randrange(0, 200))
        for profile in (None, tiny_profile):
            try:
                codec.decode(data, profile)
            except codec.CodecError:
                pass


# ------------------------------------------------------------------ profiles
def test_profile_from_garbage_is_corrupt():
    rng = random.Random(13)
    for _ in range(1000):
        with pytest.raises(codec.CorruptBitstream):
            codec.Profile.from_bytes(rng.randbytes(rng.randrange(0, 300)))
    for data in (b"", b"{}", b"\0" * 8, b"\x08\0\0\0\0\0\0\0{}      "):
        with pytest.raises(codec.CorruptBitstream):
            codec.Profile.from_bytes(data)


def test_every_profile_prefix_is_corrupt(tiny_profile):
    raw = tiny_profile.to_bytes()
    assert codec.Profile.from_bytes(raw).id == tiny_profile.id
    for n in range(len(raw)):
        with pytest.raises(codec.CorruptBitstream):
            codec.Profile.from_bytes(raw[:n])


def test_profile_bit_flips(tiny_profile, profiled_blob, tiny_kv):
    """A flipped profile either fails to load (CorruptBitstream) or is another profile.

    Another profile has another id, so blobs of the original are refused, not misdecoded.
    """
    blob, _ = profiled_blob
    raw = tiny_profile.to_bytes()
    rng = random.Random(14)
    loaded = 0
    for _ in range(1500):
        bit = rng.randrange(8 * len(raw))
        try:
            damaged = codec.Profile.from_bytes(_flip(raw, bit))
        except codec.CorruptBitstream:
            continue
        loaded += 1
        assert damaged.id != tiny_profile.id, f"bit {bit}: same id for different content"
        with pytest.raises(codec.ProfileMismatch):
            codec.decode(blob, damaged)
        if loaded % 50 == 1:  # a loaded profile is usable (or refuses input cleanly)
            try:
                out = codec.decode(codec.encode(tiny_kv, 0, damaged), damaged)
                assert out.shape == tiny_kv.shape
            except ValueError:
                pass
    assert loaded > 0  # flips in array data load as another (valid) profile
