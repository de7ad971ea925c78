"""kvwire framing: event <-> frame bytes, and the incremental receive buffer.

Stateless apart from :class:`FrameBuffer`; knows nothing about connection state (that
is :mod:`streamer.wire.protocol`'s job). Wire format, all little-endian::

    frame   = header payload
    header  = struct "<IHH": payload length (u32), frame type (u16), flags (u16, always 0)

Control frames (HELLO, WELCOME, AUTH, AUTH_OK, OPEN, GET_PROFILE, REQUEST, CHUNK_BEGIN,
CHUNK_END, CANCEL, ERROR, CLOSE, and from protocol version 3 LOOKUP and PREFIX) carry one UTF-8 JSON object of at most ``MAX_CONTROL_PAYLOAD``
bytes, checked key by key against :data:`SCHEMAS` (exact key set, exact JSON types --
``true`` is not an int, ``1`` is not a bool --, ranges) and :data:`OPTIONAL_KEYS`, then
against :data:`CONSTRAINTS` (rules tying keys together). No NaN/Infinity, no duplicate
keys, no BOM. LOOKUP's ``chain`` is 1 .. ``MAX_LOOKUP_CHAIN`` 64-character lowercase-hex
strings (at most ~34 KB of JSON, within the 64 KiB control limit); PREFIX's
``context_id`` is null exactly when its ``chunks`` is 0. Data frames are binary:

    MANIFEST    manifest bytes
    PROFILE     16 ascii lowercase-hex id bytes + profile bytes
    CHUNK_PART  struct "<IHH" chunk (u32), part index (u16), reserved (u16 = 0) + bytes
    TEXT        struct "<I" chunk + zstd token-id bytes

An optional key is absent when its field has its default and, when present, never holds
the default, so every event has exactly one encoding. The only ones are REQUEST's and
CHUNK_BEGIN's ``first_layer`` (protocol version 2; default 0, present: 1 ..
``MAX_FIRST_LAYER``): a version 1 peer, which knows no such key, never sees one, since
the connection refuses a continuation on a version 1 connection (``streamer.wire.protocol``).

Encoding errors raise ``LocalProtocolError``; decoding errors ``RemoteProtocolError``.
"""
from __future__ import annotations

import enum
import json
import math
import re
import struct
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar, Union

from streamer.wire.events import (AUTH_NONE, AUTH_REQUIRED, ERROR_CODES, TEXT_LEVEL, Auth, AuthOk,
                                  Cancel, ChunkBegin, ChunkEnd, ChunkPart, Close, Error, Event,
                                  GetProfile, Hello, LocalProtocolError, Lookup, ManifestData, Open,
                                  Prefix, ProfileData, RemoteProtocolError, Request, Text, Welcome)

__all__ = [
    "FrameType", "HEADER", "PART_HEADER", "TEXT_HEADER", "MAGIC", "MAX_CONTROL_PAYLOAD",
    "DEFAULT_MAX_FRAME", "MIN_MAX_FRAME", "MAX_U32", "MAX_PARTS", "MAX_VERSION",
    "MAX_LEVEL", "MAX_FIRST_LAYER", "MAX_NAME", "MAX_CONTEXT_ID", "MAX_MESSAGE", "MAX_LOOKUP_CHAIN",
    "CONTROL_TYPES", "DATA_TYPES", "EVENT_TYPES", "SCHEMAS", "OPTIONAL_KEYS", "CONSTRAINTS", "encode",
    "decode", "FrameBuffer",
]

HEADER = struct.Struct("<IHH")
PART_HEADER = struct.Struct("<IHH")
TEXT_HEADER = struct.Struct("<I")

MAGIC = "kvwire"
MAX_CONTROL_PAYLOAD = 64 * 1024
DEFAULT_MAX_FRAME = 16 * 1024 * 1024
MIN_MAX_FRAME = MAX_CONTROL_PAYLOAD  # every control frame must always fit
MAX_U32 = 0xFFFF_FFFF
MAX_PARTS = 0x1_0000                 # part index is a u16
MAX_VERSION = 0xFFFF
MAX_LEVEL = 0xFFFF
#: a blob has at most 65535 layers (a u16, codec/FORMAT.md), so its last is 65534
MAX_FIRST_LAYER = 0xFFFE
MAX_TOTAL_BYTES = 1 << 53           # exact in a JSON double
MAX_VERSIONS = 16
MAX_NAME = 256                       # Hello.client / Welcome.server, characters
MAX_CONTEXT_ID = 1024
MAX_MESSAGE = 8192                   # Error.message, characters
#: most hashes one LOOKUP carries (64 hex + 2 quotes + a comma each: ~34 KB of JSON)
MAX_LOOKUP_CHAIN = 512


class FrameType(enum.IntEnum):
    HELLO = 1
    WELCOME = 2
    OPEN = 3
    MANIFEST = 4
    GET_PROFILE = 5
    PROFILE = 6
    REQUEST = 7
    CHUNK_BEGIN = 8
    CHUNK_PART = 9
    CHUNK_END = 10
    TEXT = 11
    CANCEL = 12
    ERROR = 13
    CLOSE = 14
    AUTH = 15
    AUTH_OK = 16
    LOOKUP = 17
    PREFIX = 18


DATA_TYPES = frozenset({FrameType.MANIFEST, FrameType.PROFILE, FrameType.CHUNK_PART,
                        FrameType.TEXT})
CONTROL_TYPES = frozenset(FrameType) - DATA_TYPES

EVENT_TYPES: Dict[type, FrameType] = {
    Hello: FrameType.HELLO, Welcome: FrameType.WELCOME, Open: FrameType.OPEN,
    ManifestData: FrameType.MANIFEST, GetProfile: FrameType.GET_PROFILE,
    ProfileData: FrameType.PROFILE, Request: FrameType.REQUEST,
    ChunkBegin: FrameType.CHUNK_BEGIN, ChunkPart: FrameType.CHUNK_PART,
    ChunkEnd: FrameType.CHUNK_END, Text: FrameType.TEXT, Cancel: FrameType.CANCEL,
    Error: FrameType.ERROR, Close: FrameType.CLOSE, Auth: FrameType.AUTH,
    AuthOk: FrameType.AUTH_OK, Lookup: FrameType.LOOKUP, Prefix: FrameType.PREFIX,
}


# --------------------------------------------------------------------- field checking
class _Invalid(ValueError):
    """A field failed validation; turned into Local/RemoteProtocolError by the caller."""


def _int(lo: int, hi: int) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        if type(v) is not int:
            raise _Invalid(f"expected an integer, got {type(v).__name__}")
        if not lo <= v <= hi:
            raise _Invalid(f"{v} is out of range [{lo}, {hi}]")
        return v
    return check


def _str(lo: int, hi: int) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        if type(v) is not str:
            raise _Invalid(f"expected a string, got {type(v).__name__}")
        if not lo <= len(v) <= hi:
            raise _Invalid(f"string length {len(v)} is out of range [{lo}, {hi}]")
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            raise _Invalid("string is not valid Unicode (lone surrogate)") from None
        return v
    return check


def _bool(v: Any) -> bool:
    if type(v) is not bool:
        raise _Invalid(f"expected a boolean, got {type(v).__name__}")
    return v


def _const(value: str) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        if v != value or type(v) is not str:
            raise _Invalid(f"expected {value!r}, got {v!r:.40}")
        return v
    return check


_version = _int(1, MAX_VERSION)
_u32 = _int(0, MAX_U32)
_level_int = _int(0, MAX_LEVEL)
_first_layer = _int(1, MAX_FIRST_LAYER)   # present only when not the default 0
_HEX16 = re.compile(r"[0-9a-f]{16}")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def _hex64(v: Any) -> str:
    if type(v) is not str or not _HEX64.fullmatch(v):
        raise _Invalid(f"expected 64 lowercase hex characters, got {v!r:.80}")
    return v


def _nonce_or_empty(v: Any) -> str:
    return v if v == "" and type(v) is str else _hex64(v)


def _auth_mode(v: Any) -> str:
    if type(v) is not str or v not in (AUTH_NONE, AUTH_REQUIRED):
        raise _Invalid(f"expected {AUTH_NONE!r} or {AUTH_REQUIRED!r}, got {v!r:.40}")
    return v


def _versions(v: Any) -> Tuple[int, ...]:
    if type(v) not in (list, tuple):
        raise _Invalid(f"expected a list, got {type(v).__name__}")
    if not 1 <= len(v) <= MAX_VERSIONS:
        raise _Invalid(f"expected 1..{MAX_VERSIONS} versions, got {len(v)}")
    out = tuple(_version(x) for x in v)
    if len(set(out)) != len(out):
        raise _Invalid("duplicate versions")
    return out


def _slo(v: Any) -> Optional[float]:
    if v is None:
        return None
    if type(v) not in (int, float):
        raise _Invalid(f"expected a number or null, got {type(v).__name__}")
    v = float(v)
    if not math.isfinite(v) or v < 0:
        raise _Invalid(f"slo must be finite and >= 0, got {v}")
    return v


def _profile_id(v: Any) -> str:
    if type(v) is not str or not _HEX16.fullmatch(v):
        raise _Invalid(f"expected 16 lowercase hex characters, got {v!r:.40}")
    return v


def _level(v: Any) -> Union[int, str]:
    if v == TEXT_LEVEL and type(v) is str:
        return v
    if type(v) is not int:
        raise _Invalid(f'expected an integer or "text", got {v!r:.40}')
    return _level_int(v)


def _chain(v: Any) -> Tuple[str, ...]:
    if type(v) not in (list, tuple):
        raise _Invalid(f"expected a list, got {type(v).__name__}")
    if not 1 <= len(v) <= MAX_LOOKUP_CHAIN:
        raise _Invalid(f"expected 1..{MAX_LOOKUP_CHAIN} hashes, got {len(v)}")
    for i, h in enumerate(v):
        try:
            _hex64(h)
        except _Invalid as e:
            raise _Invalid(f"hash {i}: {e}") from None
    return tuple(v)


def _context_or_null(v: Any) -> Optional[str]:
    return None if v is None else _str(1, MAX_CONTEXT_ID)(v)


def _error_code(v: Any) -> str:
    if type(v) is not str or v not in ERROR_CODES:
        raise _Invalid(f"unknown error code {v!r:.40} (expected one of {sorted(ERROR_CODES)})")
    return v


#: Control frame type -> (JSON key -> checker). The key set is exact: a missing or an
#: unknown key is an error.
SCHEMAS: Dict[FrameType, Dict[str, Callable[[Any], Any]]] = {
    FrameType.HELLO: {"magic": _const(MAGIC), "versions": _versions,
                      "client": _str(0, MAX_NAME)},
    FrameType.WELCOME: {"version": _version, "server": _str(0, MAX_NAME),
                        "max_frame": _int(MIN_MAX_FRAME, MAX_U32), "auth": _auth_mode,
                        "nonce": _nonce_or_empty},
    FrameType.AUTH: {"nonce": _hex64, "mac": _hex64},
    FrameType.AUTH_OK: {"mac": _hex64},
    FrameType.OPEN: {"context_id": _str(1, MAX_CONTEXT_ID), "slo": _slo},
    FrameType.GET_PROFILE: {"profile_id": _profile_id},
    FrameType.REQUEST: {"chunk": _u32, "level": _level},
    FrameType.CHUNK_BEGIN: {"chunk": _u32, "level": _level_int,
                            "bytes": _int(0, MAX_TOTAL_BYTES), "parts": _int(1, MAX_PARTS)},
    FrameType.CHUNK_END: {"chunk": _u32, "cancelled": _bool},
    FrameType.CANCEL: {"chunk": _u32},
    FrameType.ERROR: {"code": _error_code, "message": _str(0, MAX_MESSAGE), "fatal": _bool},
    FrameType.CLOSE: {},
    FrameType.LOOKUP: {"chain": _chain},
    FrameType.PREFIX: {"context_id": _context_or_null, "chunks": _int(0, MAX_LOOKUP_CHAIN)},
}

#: Control frame type -> (optional JSON key -> checker). Absent means the field's
#: default; present, the checker refuses the default (one encoding per event).
OPTIONAL_KEYS: Dict[FrameType, Dict[str, Callable[[Any], Any]]] = {
    FrameType.REQUEST: {"first_layer": _first_layer},
    FrameType.CHUNK_BEGIN: {"first_layer": _first_layer},
}


def _prefix_found_iff_chunks(o: Dict[str, Any]) -> None:
    if (o["context_id"] is None) != (o["chunks"] == 0):
        raise _Invalid(f"context_id must be null exactly when chunks is 0, got context_id "
                       f"{o['context_id']!r:.80} with chunks {o['chunks']}")


#: Control frame type -> a rule over its checked keys together (after SCHEMAS and
#: OPTIONAL_KEYS passed); raises on a violation.
CONSTRAINTS: Dict[FrameType, Callable[[Dict[str, Any]], None]] = {
    FrameType.PREFIX: _prefix_found_iff_chunks,
}


def _check_object(ftype: FrameType, obj: Any) -> Dict[str, Any]:
    if type(obj) is not dict:
        raise _Invalid(f"{ftype.name} payload must be a JSON object, got {type(obj).__name__}")
    schema, optional = SCHEMAS[ftype], OPTIONAL_KEYS.get(ftype, {})
    missing = schema.keys() - obj.keys()
    if missing:
        raise _Invalid(f"{ftype.name} is missing key(s) {sorted(missing)}")
    unknown = obj.keys() - schema.keys() - optional.keys()
    if unknown:
        raise _Invalid(f"{ftype.name} has unknown key(s) {sorted(unknown)!r:.200}")
    out = {}
    for key, check in [*schema.items(), *((k, c) for k, c in optional.items() if k in obj)]:
        try:
            out[key] = check(obj[key])
        except _Invalid as e:
            raise _Invalid(f"{ftype.name}.{key}: {e}") from None
    constraint = CONSTRAINTS.get(ftype)
    if constraint is not None:
        try:
            constraint(out)
        except _Invalid as e:
            raise _Invalid(f"{ftype.name}: {e}") from None
    return out


def _first_layer_key(value: Any) -> Dict[str, Any]:
    """The optional ``first_layer`` key: absent for the default 0 (an int, not False or
    0.0: those are sent, and refused by the checker)."""
    return {} if type(value) is int and value == 0 else {"first_layer": value}


def _to_object(event: Event) -> Dict[str, Any]:
    if isinstance(event, Hello):
        return {"magic": MAGIC, "versions": event.versions, "client": event.client}
    if isinstance(event, Welcome):
        return {"version": event.version, "server": event.server, "max_frame": event.max_frame,
                "auth": event.auth, "nonce": event.nonce}
    if isinstance(event, Auth):
        return {"nonce": event.nonce, "mac": event.mac}
    if isinstance(event, AuthOk):
        return {"mac": event.mac}
    if isinstance(event, Open):
        return {"context_id": event.context_id, "slo": event.slo}
    if isinstance(event, GetProfile):
        return {"profile_id": event.profile_id}
    if isinstance(event, Request):
        return {"chunk": event.chunk, "level": event.level, **_first_layer_key(event.first_layer)}
    if isinstance(event, ChunkBegin):
        return {"chunk": event.chunk, "level": event.level, "bytes": event.total_bytes,
                "parts": event.parts, **_first_layer_key(event.first_layer)}
    if isinstance(event, ChunkEnd):
        return {"chunk": event.chunk, "cancelled": event.cancelled}
    if isinstance(event, Cancel):
        return {"chunk": event.chunk}
    if isinstance(event, Error):
        return {"code": event.code, "message": event.message, "fatal": event.fatal}
    if isinstance(event, Close):
        return {}
    if isinstance(event, Lookup):
        return {"chain": event.chain}
    if isinstance(event, Prefix):
        return {"context_id": event.context_id, "chunks": event.chunks}
    raise AssertionError(type(event))  # pragma: no cover


def _from_object(ftype: FrameType, o: Dict[str, Any]) -> Event:
    if ftype is FrameType.HELLO:
        return Hello(versions=o["versions"], client=o["client"])
    if ftype is FrameType.WELCOME:
        return Welcome(version=o["version"], server=o["server"], max_frame=o["max_frame"],
                       auth=o["auth"], nonce=o["nonce"])
    if ftype is FrameType.AUTH:
        return Auth(nonce=o["nonce"], mac=o["mac"])
    if ftype is FrameType.AUTH_OK:
        return AuthOk(mac=o["mac"])
    if ftype is FrameType.OPEN:
        return Open(context_id=o["context_id"], slo=o["slo"])
    if ftype is FrameType.GET_PROFILE:
        return GetProfile(profile_id=o["profile_id"])
    if ftype is FrameType.REQUEST:
        return Request(chunk=o["chunk"], level=o["level"], first_layer=o.get("first_layer", 0))
    if ftype is FrameType.CHUNK_BEGIN:
        return ChunkBegin(chunk=o["chunk"], level=o["level"], total_bytes=o["bytes"],
                          parts=o["parts"], first_layer=o.get("first_layer", 0))
    if ftype is FrameType.CHUNK_END:
        return ChunkEnd(chunk=o["chunk"], cancelled=o["cancelled"])
    if ftype is FrameType.CANCEL:
        return Cancel(chunk=o["chunk"])
    if ftype is FrameType.ERROR:
        return Error(code=o["code"], message=o["message"], fatal=o["fatal"])
    if ftype is FrameType.CLOSE:
        return Close()
    if ftype is FrameType.LOOKUP:
        return Lookup(chain=o["chain"])
    if ftype is FrameType.PREFIX:
        return Prefix(context_id=o["context_id"], chunks=o["chunks"])
    raise AssertionError(ftype)  # pragma: no cover


def _as_bytes_view(data: Any, what: str) -> Union[bytes, memoryview]:
    """Return ``data`` as something ``writelines`` takes without copying it."""
    if type(data) is bytes:
        return data
    if not isinstance(data, (bytearray, memoryview)):
        raise _Invalid(f"{what} must be bytes, bytearray or memoryview, "
                       f"got {type(data).__name__}")
    mv = memoryview(data)
    if not mv.c_contiguous:
        raise _Invalid(f"{what} memoryview must be C-contiguous")
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


# ------------------------------------------------------------------------ encode
def encode(event: Event) -> Tuple[FrameType, List[Union[bytes, memoryview]], int]:
    """Encode ``event`` as ``(type, pieces, payload_length)``; pieces include the header.

    Big binary payloads are passed through as given (``bytes`` or a byte-format
    memoryview), never copied. Raises ``LocalProtocolError`` on an invalid field.
    """
    ftype = EVENT_TYPES.get(type(event))
    if ftype is None:
        raise LocalProtocolError(f"cannot send {event!r:.80}: not a kvwire frame event")
    try:
        if ftype in CONTROL_TYPES:
            obj = _check_object(ftype, _to_object(event))
            payload = json.dumps(obj, ensure_ascii=False, allow_nan=False,
                                 separators=(",", ":")).encode("utf-8")
            if len(payload) > MAX_CONTROL_PAYLOAD:
                raise _Invalid(f"{ftype.name} JSON is {len(payload)} bytes "
                               f"(> {MAX_CONTROL_PAYLOAD})")
            return ftype, [HEADER.pack(len(payload), ftype, 0) + payload], len(payload)
        if ftype is FrameType.MANIFEST:
            prefix = b""
        elif ftype is FrameType.PROFILE:
            prefix = _profile_id(event.profile_id).encode("ascii") + bytes([_bool(event.more)])
        elif ftype is FrameType.CHUNK_PART:
            chunk, part = _u32(event.chunk), _int(0, MAX_PARTS - 1)(event.part)
            prefix = PART_HEADER.pack(chunk, part, 0)
        else:  # TEXT
            prefix = TEXT_HEADER.pack(_u32(event.chunk))
        data = _as_bytes_view(event.data, f"{ftype.name}.data")
    except _Invalid as e:
        raise LocalProtocolError(f"invalid {ftype.name}: {e}") from None
    n = len(prefix) + len(data)
    if n > MAX_U32:
        raise LocalProtocolError(f"{ftype.name} payload of {n} bytes does not fit a u32")
    return ftype, [HEADER.pack(n, ftype, 0) + prefix, data], n


# ------------------------------------------------------------------------ decode
def _reject_constant(name: str) -> Any:
    raise _Invalid(f"JSON constant {name} is not allowed")


def _no_duplicates(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise _Invalid("duplicate JSON key")
    return out


def decode(ftype: FrameType, payload: memoryview) -> Event:
    """Decode one frame payload (a view the caller owns and releases afterwards).

    Binary ``data`` fields are returned as ``bytes`` (exactly one copy). Raises
    ``RemoteProtocolError`` on any malformed payload -- never another exception type.
    """
    try:
        if ftype in CONTROL_TYPES:
            try:
                text = bytes(payload).decode("utf-8")
                obj = json.loads(text, object_pairs_hook=_no_duplicates,
                                 parse_constant=_reject_constant)
            except _Invalid:
                raise
            except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeError, int limit
                raise _Invalid(f"bad JSON: {e}") from None
            return _from_object(ftype, _check_object(ftype, obj))
        if ftype is FrameType.MANIFEST:
            return ManifestData(data=bytes(payload))
        if ftype is FrameType.PROFILE:
            if len(payload) < 17:
                raise _Invalid(f"payload of {len(payload)} bytes is shorter than the 16-byte id "
                               f"and the continuation byte")
            pid = bytes(payload[:16])
            if not _HEX16.fullmatch(pid.decode("latin-1")):
                raise _Invalid(f"profile id {pid!r} is not 16 lowercase hex characters")
            if payload[16] > 1:
                raise _Invalid(f"profile continuation byte must be 0 or 1, got {payload[16]}")
            return ProfileData(profile_id=pid.decode("ascii"), data=bytes(payload[17:]),
                           more=bool(payload[16]))
        if ftype is FrameType.CHUNK_PART:
            if len(payload) < PART_HEADER.size:
                raise _Invalid(f"payload of {len(payload)} bytes is shorter than its header")
            chunk, part, reserved = PART_HEADER.unpack_from(payload)
            if reserved:
                raise _Invalid(f"reserved field is {reserved:#x}, must be 0")
            return ChunkPart(chunk=chunk, part=part, data=bytes(payload[PART_HEADER.size:]))
        if ftype is FrameType.TEXT:
            if len(payload) < TEXT_HEADER.size:
                raise _Invalid(f"payload of {len(payload)} bytes is shorter than its header")
            (chunk,) = TEXT_HEADER.unpack_from(payload)
            return Text(chunk=chunk, data=bytes(payload[TEXT_HEADER.size:]))
    except _Invalid as e:
        raise RemoteProtocolError(f"malformed {ftype.name} frame: {e}") from None
    raise AssertionError(ftype)  # pragma: no cover


# ------------------------------------------------------------------------ receive buffer
T = TypeVar("T")


class FrameBuffer:
    """Accumulates received bytes and cuts them into frames.

    A ``bytearray`` plus a read offset: consumed bytes are dropped only when they are
    at least half the buffer (and >= ``COMPACT_AT``), so a multi-MB frame arriving in
    64 KiB pieces costs amortised O(n) -- the pending frame is never re-copied per
    piece, and its header is parsed once per piece in O(1). Headers are checked as soon
    as their 8 bytes are in: unknown type, nonzero flags, or a length over the limit
    fail before any of the payload is waited for.
    """

    COMPACT_AT = 64 * 1024

    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()
        self._pos = 0

    def __len__(self) -> int:
        """Bytes received but not yet consumed (a partial frame at most, between calls)."""
        return len(self._buf) - self._pos

    def feed(self, data: Union[bytes, bytearray, memoryview]) -> None:
        if self._pos and (self._pos == len(self._buf) or (
                self._pos >= self.COMPACT_AT and 2 * self._pos >= len(self._buf))):
            del self._buf[:self._pos]
            self._pos = 0
        self._buf += data

    def _header(self) -> Optional[Tuple[int, FrameType]]:
        if len(self._buf) - self._pos < HEADER.size:
            return None
        length, raw_type, flags = HEADER.unpack_from(self._buf, self._pos)
        try:
            ftype = FrameType(raw_type)
        except ValueError:
            raise RemoteProtocolError(f"unknown frame type {raw_type}") from None
        if flags:
            raise RemoteProtocolError(f"{ftype.name} frame has flags {flags:#06x}; "
                                      f"must be 0")
        limit = MAX_CONTROL_PAYLOAD if ftype in CONTROL_TYPES else self.max_frame
        if length > limit:
            raise RemoteProtocolError(f"{ftype.name} frame announces {length} payload bytes "
                                      f"(limit {limit})")
        return length, ftype

    def next_frame(self, handle: Callable[[FrameType, memoryview], T]) -> Optional[T]:
        """If a whole frame is buffered, consume it and return ``handle(type, payload)``.

        ``payload`` is a view into the buffer valid only during the call (it is released
        afterwards; ``handle`` must copy what it keeps). ``None`` when incomplete.
        """
        head = self._header()
        if head is None:
            return None
        length, ftype = head
        start = self._pos + HEADER.size
        end = start + length
        if end > len(self._buf):
            return None
        with memoryview(self._buf) as whole, whole[start:end] as payload:
            result = handle(ftype, payload)
        self._pos = end
        return result
