"""The stored-data fuzz targets for ``kvwire fuzz``: the manifest and the text fallback
payload, functions of one ``bytes`` input that raise :class:`FuzzBug` on misbehaviour.

``manifest``
    ``Manifest.from_bytes`` on the input's bytes (data[0] even), or on a valid manifest
    whose JSON fields are replaced by the input's values (odd: so the validation of
    each field is reached, not just the JSON decoder): only ``ManifestError``; a
    manifest that parses must serialize back to a manifest equal to it.
``text``
    ``decode_tokens`` on the input as a text payload (FORMAT: ``streamer.store.put``),
    with its CRC recomputed when data[0] bit 0 is set (so the zstd frame and the token
    count face the damage alone), the expected token count and a vocabulary size given
    or not (bits 1 and 2): only ``ValueError`` (a zstd bomb must not become
    ``MemoryError``); ids that decode are as many as expected and below the vocabulary.
"""
from __future__ import annotations

import functools
import json
import struct
import zlib

from streamer.tools.fuzz_codec import FuzzBug


# ------------------------------------------------------------------------ manifest
@functools.lru_cache(maxsize=4)
def seed_manifest(exact: bool = False, restart: int = 1) -> bytes:
    """A valid 3-chunk manifest (sinks in chunk 0, one level not stored) as bytes; ``exact``:
    its level 0 is the exact level; ``restart`` over 1: its levels predict each layer from
    the one before (version 4)."""
    from streamer.wire.manifest import ChunkInfo, Manifest

    chunks = (ChunkInfo(0, 0, 16, (900, 400, 0), 60, 4), ChunkInfo(1, 16, 32, (880, 390, 0), 58, 0),
              ChunkInfo(2, 32, 40, (450, 200, 90), 31, 0))
    return Manifest("ctx-0", "v1", layers=2, heads=2, head_dim=8, dtype="float16", tokens=40,
                    profile_id="0123456789abcdef", level_distortion=(0.0 if exact else 1e-3, 1e-2, 5e-2), chunks=chunks,
                    created=1.5e9, vocab_size=32000, restart=restart).to_bytes()


#: top-level manifest keys an edit may replace (chunk keys are addressed per chunk)
_MANIFEST_KEYS = ("format", "version", "context_id", "context_version", "layers", "heads", "head_dim",
                  "dtype", "tokens", "profile_id", "level_distortion", "created", "vocab_size", "chunks")
_CHUNK_KEYS = ("index", "start", "end", "sizes", "text_bytes", "sink_tokens")


def _json_value(kind: int, value: int) -> object:
    """A JSON value of one of 8 kinds derived from ``value`` (ints at the edges too)."""
    return (value, -value, value / 7.0, str(value), [value % 5] * (value % 4), None, bool(value & 1),
            {"k": value})[kind % 8]


def manifest_bytes(data: bytes) -> bytes:
    """The manifest bytes ``data`` describes.

    data[0] even: data[1:] as they are. Odd: the seed manifest with 7-byte edits (u8
    what, u8 kind, u8 chunk, u32 value): what % 22 < 14 replaces top-level key
    _MANIFEST_KEYS[what], < 20 replaces key _CHUNK_KEYS of chunk ``chunk % 4`` (4:
    appended, a copy of the last), 20 deletes a top-level key, 21 duplicates the last
    chunk; the value is _json_value(kind, value).
    """
    if not data or data[0] % 2 == 0:
        return bytes(data[1:])
    doc = json.loads(seed_manifest())
    for j in range(1, len(data) - 6, 7):
        what, kind, chunk, value = struct.unpack_from("<BBBI", data, j)
        what %= len(_MANIFEST_KEYS) + len(_CHUNK_KEYS) + 2
        new = _json_value(kind, value)
        chunks = doc.get("chunks") if isinstance(doc.get("chunks"), list) else None
        if what < len(_MANIFEST_KEYS):
            doc[_MANIFEST_KEYS[what]] = new
        elif what < len(_MANIFEST_KEYS) + len(_CHUNK_KEYS) and chunks:
            target = chunks[chunk % len(chunks)]
            if isinstance(target, dict):
                target[_CHUNK_KEYS[what - len(_MANIFEST_KEYS)]] = new
        elif what == len(_MANIFEST_KEYS) + len(_CHUNK_KEYS):
            doc.pop(_MANIFEST_KEYS[chunk % len(_MANIFEST_KEYS)], None)
        elif chunks:
            chunks.append(json.loads(json.dumps(chunks[-1])))
    return json.dumps(doc).encode()


def check_manifest(data: bytes) -> None:
    from streamer.wire.manifest import Manifest, ManifestError

    raw = manifest_bytes(data)
    try:
        manifest = Manifest.from_bytes(raw)
    except ManifestError:
        return
    except Exception as exc:
        raise FuzzBug(f"Manifest.from_bytes raised {type(exc).__name__}: {exc}") from exc
    try:
        again = Manifest.from_bytes(manifest.to_bytes())
    except Exception as exc:
        raise FuzzBug(f"a parsed manifest does not survive its own round trip: "
                      f"{type(exc).__name__}: {exc}") from exc
    if again != manifest:
        raise FuzzBug("a parsed manifest changes in its round trip")


# ------------------------------------------------------------------------ text
SEED_VOCAB = 1000


@functools.lru_cache(maxsize=1)
def seed_texts() -> tuple[bytes, ...]:
    """Valid text payloads: 12 ids, 0 ids, 300 repeating ids (a long zstd match)."""
    from streamer.store.put import encode_tokens

    return (encode_tokens([5, 17, 999, 0, 3, 3, 3, 42, 7, 1, 2, 998]), encode_tokens([]),
            encode_tokens([i % 37 for i in range(300)]))


def text_payload(data: bytes) -> bytes:
    """The payload ``data`` describes: data[1:], with a fresh CRC-32 appended in place of
    its last 4 bytes when data[0] bit 0 is set (FORMAT: ``streamer.store.put``)."""
    body = bytes(data[1:])
    if data and data[0] & 1 and len(body) >= 4:
        body = body[:-4] + struct.pack("<I", zlib.crc32(body[:-4]))
    return body


def check_text(data: bytes) -> None:
    from streamer.store.put import _TEXT_HEADER, decode_tokens

    if not data:
        return
    payload = text_payload(data)
    claimed = _TEXT_HEADER.unpack_from(payload)[2] if len(payload) >= _TEXT_HEADER.size else 0
    # bit 1: the chunk's token count is the one claimed (else: no expectation); bit 2: a vocabulary
    expected = claimed if data[0] & 2 else None
    vocab = SEED_VOCAB if data[0] & 4 else None
    try:
        ids = decode_tokens(payload, expected_tokens=expected, vocab_size=vocab)
    except ValueError:
        return
    except Exception as exc:
        raise FuzzBug(f"decode_tokens raised {type(exc).__name__}: {exc}") from exc
    if len(ids) != claimed:
        raise FuzzBug(f"decode_tokens returned {len(ids)} ids, the payload claims {claimed}")
    if vocab is not None and any(i >= vocab for i in ids):
        raise FuzzBug(f"decode_tokens returned an id >= the vocabulary of {vocab}")
