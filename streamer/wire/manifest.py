"""The manifest of a stored context: what a receiver needs before fetching any chunk.

A context is stored as chunks of tokens, each encoded at several quality levels, plus
the chunk's token ids (the text fallback: the receiver can recompute the KV instead of
fetching it). The manifest lists every chunk's token range and blob sizes, so a sender
can plan per-chunk quality against a deadline without touching the blobs.

It is JSON (tagged ``"format": "kvwire-manifest", "version": 4``), not pickle: any
language can read it and a malformed one cannot execute anything. Every field is
checked on construction, so a ``Manifest`` that exists is internally consistent
(contiguous chunks covering ``[0, tokens)``, one size per level, ...).

Version 2 adds ``"vocab_size"`` (the model's vocabulary size, or null when the writer
did not give it): a receiver range-checks the text fallback's token ids against it.
Version 1 manifests (no such key) are still read, with ``vocab_size=None``; their
text fallbacks predate the checksummed text format and are refused when fetched.

Version 3 allows an *exact* level: a first ``level_distortion`` of 0 says level 0 holds
each chunk's KV exactly (``codec.encode_exact``) and levels ``1..`` are the profile's
levels ``0..`` (:meth:`Manifest.codec_level`). A version 2 reader refuses such a manifest
by its version instead of misreading level numbers.

Version 4 adds ``"restart"``: the context was coded with a predicting profile (blob
format 7, ``codec.prediction``), whose layers 0, restart, 2*restart, .. are coded alone
and every other layer from the one before it. A continuation must then start at such a
layer (:meth:`Manifest.resume_layer`). A manifest without prediction (restart 1) is
still written as version 3, so receivers that predate prediction keep reading it; one
with prediction is refused by them by its version, before any blob is fetched.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from codec.container import EXACT_LEVEL, plain_header_size
from codec.prediction import restart_layer
from streamer.wire.events import TEXT_LEVEL

MANIFEST_FORMAT = "kvwire-manifest"
MANIFEST_VERSION = 4
#: Manifest format versions this build reads (1: before ``vocab_size``; 2: before the exact
#: level; 3: before ``restart``).
READABLE_VERSIONS = (1, 2, 3, 4)
DTYPES = ("float16", "bfloat16", "float32")

# Ids become file names and redis key parts: no separators (/ :), no leading dot
# (hidden files, "." and ".."), bounded length.
_ID_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}")


class ManifestError(ValueError):
    """A manifest (object or serialized bytes) is malformed."""


#: The largest serialized manifest read or parsed: one frame at the protocol's default
#: ``max_frame`` (a manifest travels in one MANIFEST frame), ~100k chunks.
MAX_MANIFEST_BYTES = 16 * 1024 * 1024


def check_manifest_size(size: int) -> None:
    """ManifestError for a serialized manifest over ``MAX_MANIFEST_BYTES``: checked before
    a stored one is read, so a hostile or damaged store cannot make a reader allocate it."""
    if size > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest is {size} bytes, over the {MAX_MANIFEST_BYTES}-byte limit")


def validate_id(value: object, what: str = "context id") -> str:
    """Return ``value`` if it is a safe id (1-200 of [A-Za-z0-9._-], not starting with '.').

    Context ids, version ids and profile ids all become file names and redis key parts,
    so they share this rule. Raises ValueError naming ``what`` and the offending value.
    """
    if not isinstance(value, str) or not _ID_RE.fullmatch(value):
        raise ValueError(f"invalid {what} {value!r}: must be 1-200 characters of "
                         "[A-Za-z0-9._-], not starting with '.'")
    return value


def validate_context_id(context_id: object) -> str:
    """Return ``context_id`` if it is valid (see ``validate_id``); ValueError otherwise."""
    return validate_id(context_id, "context id")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(value: object, what: str, minimum: int) -> int:
    if not _is_int(value) or value < minimum:
        raise ManifestError(f"{what} must be an int >= {minimum}, got {value!r}")
    return value


def _finite(value: object, what: str, *, positive: bool) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ManifestError(f"{what} must be a finite number, got {value!r}")
    if (value <= 0) if positive else (value < 0):
        raise ManifestError(f"{what} must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def _id(value: object, what: str) -> str:
    try:
        return validate_id(value, what)
    except ValueError as exc:
        raise ManifestError(str(exc)) from None


@dataclass(frozen=True)
class ChunkInfo:
    """One chunk of a stored context: token range ``[start, end)`` and its blob sizes.

    ``sizes[level]`` is the encoded blob's byte size at that quality level, 0 when the
    context was not stored at that level (``put_context(levels=...)``). ``text_bytes``
    is the size of the zstd-compressed token ids. ``sink_tokens`` are the tokens kept
    verbatim in the blobs: attention sinks exist only at a context's start, so only
    chunk 0 may have any.
    """

    index: int
    start: int
    end: int
    sizes: tuple[int, ...]
    text_bytes: int
    sink_tokens: int

    def __post_init__(self) -> None:
        where = f"chunk {self.index!r}"
        _int(self.index, "chunk index", 0)
        _int(self.start, f"{where} start", 0)
        _int(self.end, f"{where} end", self.start + 1)
        if not isinstance(self.sizes, tuple) or not self.sizes:
            raise ManifestError(f"{where} sizes must be a non-empty tuple, got {self.sizes!r}")
        for level, size in enumerate(self.sizes):
            _int(size, f"{where} size at level {level}", 0)
        if not any(self.sizes):
            raise ManifestError(f"{where} is not stored at any level (all sizes are 0)")
        _int(self.text_bytes, f"{where} text_bytes", 1)
        _int(self.sink_tokens, f"{where} sink_tokens", 0)
        if self.sink_tokens > self.end - self.start:
            raise ManifestError(f"{where} has {self.sink_tokens} sink tokens but only "
                                f"{self.end - self.start} tokens")
        if self.index > 0 and self.sink_tokens:
            raise ManifestError(f"{where} has sink tokens; only chunk 0 may")

    @property
    def tokens(self) -> int:
        return self.end - self.start

    def levels(self) -> tuple[int, ...]:
        """The quality levels this chunk is stored at."""
        return tuple(level for level, size in enumerate(self.sizes) if size)


@dataclass(frozen=True)
class Manifest:
    """Everything about one stored version of a context except the blobs themselves.

    ``version`` is the id of the put that wrote it (unique per put): blobs are stored
    under it, so a re-put never overwrites data a reader of the old manifest fetches.
    ``level_distortion`` is the target distortion per level (best first): the profile's,
    after a 0 for the exact level when the context was stored with one (:attr:`exact`).
    ``vocab_size`` is the model's vocabulary size when the writer knew it: every token id
    of the text fallback is below it. ``restart`` is the profile's prediction period
    (``codec.Profile.restart``): 1 when every layer is coded alone.
    """

    context_id: str
    version: str
    layers: int
    heads: int
    head_dim: int
    dtype: str
    tokens: int
    profile_id: str
    level_distortion: tuple[float, ...]
    chunks: tuple[ChunkInfo, ...]
    created: float
    vocab_size: int | None = None
    restart: int = 1

    def __post_init__(self) -> None:
        _id(self.context_id, "context id")
        _id(self.version, "version")
        _id(self.profile_id, "profile id")
        for name in ("layers", "heads", "head_dim", "tokens"):
            _int(getattr(self, name), name, 1)
        if self.dtype not in DTYPES:
            raise ManifestError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not isinstance(self.level_distortion, tuple) or not self.level_distortion:
            raise ManifestError(f"level_distortion must be a non-empty tuple, got {self.level_distortion!r}")
        for level, target in enumerate(self.level_distortion):
            _finite(target, f"level_distortion[{level}]", positive=level > 0)
        if any(a >= b for a, b in zip(self.level_distortion, self.level_distortion[1:])):
            raise ManifestError("level_distortion must be strictly increasing (best quality first), "
                                f"got {self.level_distortion!r}")
        _finite(self.created, "created", positive=False)
        if self.vocab_size is not None:
            _int(self.vocab_size, "vocab_size", 1)
        _int(self.restart, "restart", 1)
        self._check_chunks()

    def _check_chunks(self) -> None:
        if not isinstance(self.chunks, tuple) or not self.chunks:
            raise ManifestError("a manifest needs at least one chunk")
        expected_start = 0
        for position, chunk in enumerate(self.chunks):
            if not isinstance(chunk, ChunkInfo):
                raise ManifestError(f"chunks[{position}] is not a ChunkInfo: {chunk!r}")
            if chunk.index != position:
                raise ManifestError(f"chunks[{position}] has index {chunk.index}")
            if chunk.start != expected_start:
                raise ManifestError(f"chunk {position} starts at token {chunk.start}, expected "
                                    f"{expected_start} (chunks must be contiguous from 0)")
            if len(chunk.sizes) != len(self.level_distortion):
                raise ManifestError(f"chunk {position} has {len(chunk.sizes)} sizes for "
                                    f"{len(self.level_distortion)} levels")
            expected_start = chunk.end
        if expected_start != self.tokens:
            raise ManifestError(f"chunks cover [0, {expected_start}) but the context has {self.tokens} tokens")

    @property
    def levels(self) -> int:
        """Number of quality levels (stored or not): the profile's, and the exact level if any."""
        return len(self.level_distortion)

    @property
    def exact(self) -> bool:
        """Whether level 0 holds the KV exactly (a distortion of 0), the profile's levels after it."""
        return self.level_distortion[0] == 0

    def is_exact(self, level: int) -> bool:
        """Whether manifest level ``level`` is the exact level: its blobs' sections are raw,
        copied by a receiver rather than decoded."""
        return self.exact and level == 0

    def codec_level(self, level: int) -> int:
        """The level a blob stored at manifest level ``level`` says in its header: the
        profile's level, or ``codec.EXACT_LEVEL`` for the exact level."""
        if not 0 <= level < self.levels:
            raise ValueError(f"level {level} out of range: context has {self.levels} levels")
        if not self.exact:
            return level
        return EXACT_LEVEL if self.is_exact(level) else level - 1

    def check_request(self, chunk: int, level: int | str, first_layer: int = 0) -> None:
        """ValueError unless REQUEST(chunk, level, first_layer) names something this
        context has: a chunk in range, ``"text"`` or a level in range, and a first layer
        below ``layers`` (a continuation; text has none). What a sender answers with ERROR
        "bad_request", and a receiver checks before asking."""
        if not 0 <= chunk < len(self.chunks):
            raise ValueError(f"chunk {chunk} out of range: context has {len(self.chunks)} chunks")
        if level != TEXT_LEVEL and not 0 <= level < self.levels:   # type: ignore[operator]
            raise ValueError(f"level {level} out of range: context has {self.levels} levels")
        if level == TEXT_LEVEL and first_layer:
            raise ValueError(f"chunk {chunk} as text from layer {first_layer}: text has no layers")
        if not 0 <= first_layer < self.layers:
            raise ValueError(f"first layer {first_layer} out of range: context has {self.layers} layers")

    def predicted(self, level: int) -> bool:
        """Whether ``level``'s blobs predict each layer from the one before (format 7): a
        profile level of a context with a restart period; never the exact level, whose
        sections are raw."""
        return self.restart > 1 and not self.is_exact(level)

    def resume_layer(self, level: int, delivered: int) -> int:
        """The first layer a request for more of a chunk asks for at ``level`` once
        ``delivered`` of its layers went out: the delivered count itself, or, at a
        :meth:`predicted` level, the layer coded alone at or before it. The layers from
        there to ``delivered`` travel again, to be decoded and not delivered: what a
        continuation of a predicted chunk costs."""
        return restart_layer(delivered, self.restart) if self.predicted(level) else delivered

    def answer_bytes(self, chunk: int, level: int, first_layer: int = 0) -> int:
        """Bytes of the answer to REQUEST(chunk, level, first_layer): the blob's size for a
        whole chunk; for a continuation an estimate, until its CHUNK_BEGIN says: the header
        and ``layers - first_layer`` equal shares of the sections (the manifest keeps no
        per-layer sizes)."""
        size = self.chunks[chunk].sizes[level]
        if not first_layer:
            return size
        header = min(plain_header_size(self.layers), size)
        return header + math.ceil((size - header) * (self.layers - first_layer) / self.layers)

    @property
    def decoded_bytes(self) -> int:
        """Bytes of the whole context's KV once decoded: what a receiver that keeps it holds."""
        itemsize = {"float16": 2, "bfloat16": 2, "float32": 4}[self.dtype]
        return self.layers * 2 * self.tokens * self.heads * self.head_dim * itemsize

    # ------------------------------------------------------------ serialization
    def to_bytes(self) -> bytes:
        """UTF-8 JSON, keys sorted (the same manifest always gives the same bytes).

        ``"version"`` is the manifest format's version; the put's version id is
        ``"context_version"``.
        """
        doc = {
            "format": MANIFEST_FORMAT, "version": MANIFEST_VERSION if self.restart > 1 else 3,
            "context_id": self.context_id, "context_version": self.version,
            "layers": self.layers, "heads": self.heads, "head_dim": self.head_dim,
            "dtype": self.dtype, "tokens": self.tokens, "profile_id": self.profile_id,
            "level_distortion": list(self.level_distortion), "created": self.created,
            "vocab_size": self.vocab_size,
            "chunks": [{"index": c.index, "start": c.start, "end": c.end, "sizes": list(c.sizes),
                        "text_bytes": c.text_bytes, "sink_tokens": c.sink_tokens}
                       for c in self.chunks],
        }
        if self.restart > 1:
            doc["restart"] = self.restart
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> "Manifest":
        """Parse and validate a manifest; anything malformed raises ManifestError."""
        check_manifest_size(len(data))
        try:
            doc = json.loads(bytes(data).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise ManifestError(f"manifest is not UTF-8 JSON: {exc}") from None
        if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
            raise ManifestError(f"not a kvwire manifest (no \"format\": \"{MANIFEST_FORMAT}\" tag)")
        version = doc.get("version")
        if version not in READABLE_VERSIONS or isinstance(version, bool):
            raise ManifestError(f"unsupported manifest version {version!r} "
                                f"(this build reads versions {READABLE_VERSIONS})")
        fields = _exact_keys(doc, _MANIFEST_KEYS | ({"vocab_size"} if version >= 2 else set())
                             | ({"restart"} if version >= 4 else set()), "manifest")
        distortion = _tuple(fields["level_distortion"], "level_distortion")
        if version < 3 and distortion and distortion[0] == 0:
            raise ManifestError(f"a version {version} manifest has no exact level: level_distortion[0] must be > 0")
        chunks = fields["chunks"]
        if not isinstance(chunks, list):
            raise ManifestError(f"chunks must be a list, got {type(chunks).__name__}")
        return cls(
            context_id=fields["context_id"], version=fields["context_version"],
            layers=fields["layers"], heads=fields["heads"], head_dim=fields["head_dim"],
            dtype=fields["dtype"], tokens=fields["tokens"], profile_id=fields["profile_id"],
            level_distortion=distortion,
            chunks=tuple(_chunk_from_json(c, i) for i, c in enumerate(chunks)),
            created=fields["created"], vocab_size=fields.get("vocab_size"),
            restart=fields.get("restart", 1),
        )


_MANIFEST_KEYS = frozenset({"format", "version", "context_id", "context_version", "layers", "heads",
                            "head_dim", "dtype", "tokens", "profile_id", "level_distortion",
                            "created", "chunks"})
_CHUNK_KEYS = frozenset({"index", "start", "end", "sizes", "text_bytes", "sink_tokens"})


def _exact_keys(doc: object, keys: frozenset[str], what: str) -> dict[str, Any]:
    """``doc`` if it is a JSON object with exactly ``keys`` (typos must not pass silently)."""
    if not isinstance(doc, dict):
        raise ManifestError(f"{what} must be a JSON object, got {type(doc).__name__}")
    missing, unknown = keys - doc.keys(), doc.keys() - keys
    if missing or unknown:
        raise ManifestError(f"{what}: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}")
    return doc


def _tuple(value: object, what: str) -> tuple:
    if not isinstance(value, list):
        raise ManifestError(f"{what} must be a list, got {type(value).__name__}")
    return tuple(value)


def _chunk_from_json(doc: object, position: int) -> ChunkInfo:
    fields = _exact_keys(doc, _CHUNK_KEYS, f"chunks[{position}]")
    return ChunkInfo(index=fields["index"], start=fields["start"], end=fields["end"],
                     sizes=_tuple(fields["sizes"], f"chunks[{position}].sizes"),
                     text_bytes=fields["text_bytes"], sink_tokens=fields["sink_tokens"])


__all__ = ["ChunkInfo", "DTYPES", "MANIFEST_FORMAT", "MANIFEST_VERSION", "Manifest", "ManifestError",
           "READABLE_VERSIONS", "validate_context_id", "validate_id"]
