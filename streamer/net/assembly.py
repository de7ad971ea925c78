"""One answer's bytes cut into the blob header and its layer sections, as the parts land.

Sections are cut by the header's lengths, not by part boundaries (a section may span
parts), and handed on as soon as each is whole, so decoding starts while the rest of
the chunk arrives. The header must describe the blob the manifest promises (profile,
shape, tokens, the level asked for, and the blob's size), and its sections from the
first layer asked for must add up to the answer's bytes: a stored blob of another
context or level is corruption, whatever its checksums say. A continuation (protocol
version 2, ``first_layer`` > 0) is the header and the sections of layers
``first_layer`` on: cut the same way, its sections are the very bytes of the same
sections of a whole answer. Pure: bytes in, sections out.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import codec

from streamer.adapt.base import Choice
from streamer.wire.manifest import Manifest

#: Bytes already cut are dropped from the buffer once more than this accumulated (all of
#: it as soon as nothing uncut remains).
_COMPACT_BYTES = 1 << 20


@dataclass
class Assembly:
    """The answer of one REQUEST for ``chunk`` at ``level`` from ``first_layer``.

    ``expected`` is the answer's length: the blob's size in the manifest for a whole
    chunk; for a continuation its CHUNK_BEGIN's bytes, which may not exceed the blob's
    size (ValueError otherwise, before anything is buffered).
    """

    manifest: Manifest
    chunk: int
    level: Choice
    expected: int
    first_layer: int = 0
    received: int = 0
    header: codec.BlobHeader | None = None
    sections: int = 0              # the next layer to cut: first_layer before any
    discarded: bool = False        # a check failed: the rest of this answer is ignored
    _buffer: bytearray = field(default_factory=bytearray)
    _consumed: int = 0

    def __post_init__(self) -> None:
        self.manifest.check_request(self.chunk, self.level, self.first_layer)
        if self.first_layer and self.expected > self.manifest.chunks[self.chunk].sizes[self.level]:   # type: ignore[index]
            raise ValueError(f"a continuation of chunk {self.chunk} at level {self.level} of {self.expected} bytes: "
                             f"the whole blob has {self.manifest.chunks[self.chunk].sizes[self.level]}")   # type: ignore[index]
        self.sections = self.first_layer

    @property
    def buffered(self) -> int:
        """Bytes this answer holds in memory: those not yet cut into sections, and those
        cut and not yet compacted away (the session's backpressure counts them)."""
        return len(self._buffer)

    def add(self, data: bytes) -> list[tuple[int, bytes]]:
        """Take one part's bytes; the (layer, section bytes) now whole. CorruptBitstream
        (and the answer discarded) when the header is bad."""
        self.received += len(data)
        if self.discarded:
            return []
        self._buffer += data
        if self.header is None and not self._parse_header():
            return []
        header, out = self.header, []
        assert header is not None
        while self.sections < header.layers:
            length = header.sections[self.sections][0]
            if len(self._buffer) - self._consumed < length:
                break
            with memoryview(self._buffer) as view:   # one copy, not a slice and a copy
                out.append((self.sections, bytes(view[self._consumed:self._consumed + length])))
            self._consumed += length
            self.sections += 1
        if self._consumed == len(self._buffer):
            # everything cut: let the buffer go (a whole chunk's bytes would otherwise stay
            # held, outside the budget, for as long as the fetch runs)
            self._buffer, self._consumed = bytearray(), 0
        elif self._consumed > _COMPACT_BYTES:
            del self._buffer[:self._consumed]
            self._consumed = 0
        return out

    def discard(self) -> None:
        """Ignore the rest of this answer (it is refetched whole)."""
        self.discarded = True
        self._buffer, self._consumed = bytearray(), 0

    def _parse_header(self) -> bool:
        try:
            size = codec.header_length(self._buffer)
            if size is not None and size > self.expected:
                raise codec.CorruptBitstream(f"chunk header claims {size} bytes, the chunk has {self.expected}")
            if size is None or len(self._buffer) < size:
                return False
            header = codec.parse_header(self._buffer)
            self._check(header)
        except codec.CorruptBitstream:
            self.discard()
            raise
        self.header, self._consumed = header, header.size
        return True

    def _check(self, header: codec.BlobHeader) -> None:
        m = self.manifest
        if header.profile_id != m.profile_id or (header.layers, header.heads, header.head_dim) != \
                (m.layers, m.heads, m.head_dim):
            raise codec.CorruptBitstream("chunk header disagrees with the manifest")
        level = m.codec_level(self.level)   # type: ignore[arg-type]
        if header.tokens != m.chunks[self.chunk].tokens or header.level != level:
            raise codec.CorruptBitstream(
                f"chunk header says {header.tokens} tokens at codec level {header.level}; the manifest "
                f"says {m.chunks[self.chunk].tokens} tokens and we asked for level {self.level} "
                f"(codec level {level})")
        stated = m.chunks[self.chunk].sizes[self.level]   # type: ignore[index]
        answer = header.size + header.total_size - header.section_offset(self.first_layer)
        if header.total_size != stated or answer != self.expected:
            raise codec.CorruptBitstream(
                f"chunk header says a {header.total_size}-byte blob, {answer} bytes from layer "
                f"{self.first_layer}; the manifest says {stated} bytes and the answer has {self.expected}")
