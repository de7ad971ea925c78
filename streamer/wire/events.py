"""The kvwire wire vocabulary: one frozen dataclass per message, plus the error types.

Events are plain values: they carry no connection state and do no I/O. Field values are
checked when an event is *sent* (``Connection.send`` raises ``LocalProtocolError``) or
*received* (``Connection.receive_data`` raises ``RemoteProtocolError``), by the same
schema in :mod:`streamer.wire.frames`, so a value that round-trips through the wire is
exactly the value that went in.

Binary payload fields (``data``) accept ``bytes``, ``bytearray`` or a C-contiguous
``memoryview`` when sending; received events always carry ``bytes`` (one copy out of
the receive buffer, never a view into it, so they stay valid forever).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Tuple, Union

__all__ = [
    "TEXT_LEVEL", "ERROR_CODES", "Buffer",
    "ProtocolError", "LocalProtocolError", "RemoteProtocolError", "AuthenticationError",
    "AUTH_NONE", "AUTH_REQUIRED",
    "Event", "Hello", "Welcome", "Auth", "AuthOk", "Open", "ManifestData", "GetProfile",
    "ProfileData", "Request", "Lookup", "Prefix",
    "ChunkBegin", "ChunkPart", "ChunkEnd", "Text", "Cancel", "Error", "Close",
    "ConnectionClosed",
]

#: The pseudo-level of a REQUEST answered by a TEXT frame (token ids, not KV).
TEXT_LEVEL = "text"

#: Allowed values of ``Error.code``.
ERROR_CODES = frozenset(
    {"bad_request", "not_found", "unavailable", "protocol", "internal", "auth", "timeout"})

#: ``Welcome.auth`` values.
AUTH_NONE = "none"
AUTH_REQUIRED = "required"

Buffer = Union[bytes, bytearray, memoryview]
Level = Union[int, Literal["text"]]


# ----------------------------------------------------------------------------- errors
class ProtocolError(Exception):
    """A violation of the kvwire protocol.

    ``code`` is the ERROR-frame code an adapter should report (always ``"protocol"``
    here); ``events`` holds the events that a ``receive_data`` call had already decoded
    from the same input before it hit the violation (empty otherwise), so the adapter
    can still act on them.
    """

    code: str = "protocol"

    def __init__(self, message: str, *, events: Optional[list] = None) -> None:
        super().__init__(message)
        self.message = message
        self.events: list = list(events) if events else []


class LocalProtocolError(ProtocolError):
    """This side tried to do something the protocol forbids (a bug in the caller).

    Raised by ``Connection.send``/``send_parts`` and on misuse of the connection; the
    connection state is left unchanged (nothing was emitted).
    """


class RemoteProtocolError(ProtocolError):
    """The peer sent something the protocol forbids; the connection is now in ERROR."""


class AuthenticationError(RemoteProtocolError):
    """The peer failed authentication (wrong token or MAC, a request before AUTH, or an
    authentication mode this side does not accept). ``error_frame()`` reports it with
    code ``"auth"``."""

    code = "auth"


# ----------------------------------------------------------------------------- events
@dataclass(frozen=True)
class Event:
    """Base class of everything ``receive_data`` returns and ``send`` accepts."""


@dataclass(frozen=True)
class Hello(Event):
    """HELLO (client -> server, frame 1): first frame of a connection.

    ``versions`` are the protocol versions the client offers (a subset of the
    connection's ``versions``); the magic ``"kvwire"`` is added/checked by the codec.
    """

    versions: Tuple[int, ...]
    client: str

    def __post_init__(self) -> None:
        if isinstance(self.versions, list):  # accept a list, store a hashable tuple
            object.__setattr__(self, "versions", tuple(self.versions))


@dataclass(frozen=True)
class Welcome(Event):
    """WELCOME (server -> client, frame 2): the chosen version and the frame limit.

    ``version`` must be the highest version common to both sides. ``max_frame`` is the
    largest frame payload either side may send for the rest of the connection (the
    server must be able to receive it: ``max_frame <= server Connection.max_frame``).
    ``auth`` is ``"required"`` when the server has an auth token (the client must then
    answer with AUTH before anything else), ``"none"`` otherwise; ``nonce`` is the
    server's fresh challenge (64 lowercase hex, 32 random bytes) when auth is required,
    ``""`` otherwise.
    """

    version: int
    server: str
    max_frame: int
    auth: str = AUTH_NONE
    nonce: str = ""


@dataclass(frozen=True)
class Auth(Event):
    """AUTH (client, frame 15): answers WELCOME{auth: required}.

    ``nonce`` is the client's fresh challenge (64 lowercase hex); ``mac`` is
    HMAC-SHA256(token, "kvwire-auth-v1 client" || server nonce || client nonce ||
    version || max_frame), hex. See :mod:`streamer.wire.auth`.
    """

    nonce: str
    mac: str


@dataclass(frozen=True)
class AuthOk(Event):
    """AUTH_OK (server, frame 16): the client is authenticated; the server proves it
    knows the token too: ``mac`` = HMAC-SHA256(token, "kvwire-auth-v1 server" || server
    nonce || client nonce || version || max_frame), hex."""

    mac: str


@dataclass(frozen=True)
class Open(Event):
    """OPEN (client, frame 3): open ``context_id`` for fetching; answered by MANIFEST.

    ``slo`` is an optional latency target in seconds (finite, >= 0).
    """

    context_id: str
    slo: Optional[float] = None


@dataclass(frozen=True)
class ManifestData(Event):
    """MANIFEST (server, frame 4): the context's manifest bytes (opaque here)."""

    data: Buffer


@dataclass(frozen=True)
class GetProfile(Event):
    """GET_PROFILE (client, frame 5): fetch codec profile ``profile_id`` (16 lowercase hex)."""

    profile_id: str


@dataclass(frozen=True)
class ProfileData(Event):
    """PROFILE (server, frame 6): answers GET_PROFILE with the same ``profile_id``.

    A profile larger than one frame (a Llama-sized PCA basis is hundreds of MB) is sent
    as consecutive PROFILE frames, each but the last with ``more=True``; the receiver
    concatenates their ``data``. The request is answered by the frame with ``more=False``.
    """

    profile_id: str
    data: Buffer
    more: bool = False


@dataclass(frozen=True)
class Request(Event):
    """REQUEST (client, frame 7): ask for ``chunk`` at ``level`` (int >= 0 or ``"text"``).

    Needs an open context. At most one request per chunk may be outstanding.
    ``first_layer`` > 0 (protocol version 2, a KV level only) is a *continuation*: only the
    blob's header and the sections of layers ``first_layer .. layers-1`` are wanted (the
    rest of a chunk whose first layers came another way, e.g. at another level). It
    must be below the open context's layer count (the sender checks: ERROR
    "bad_request"). 0, the default, asks for the whole chunk.
    """

    chunk: int
    level: Level
    first_layer: int = 0


@dataclass(frozen=True)
class Lookup(Event):
    """LOOKUP (client, frame 17; protocol version 3): which stored context holds the
    longest prefix of ``chain``? Answered by PREFIX.

    ``chain`` is a content-addressed prefix's hash chain (``streamer.store.prefix``): one
    64-character lowercase-hex SHA-256 per chunk of tokens, each covering all before it;
    1 .. ``MAX_LOOKUP_CHAIN`` (512) of them, so a LOOKUP always fits one control frame.
    """

    chain: Tuple[str, ...]

    def __post_init__(self) -> None:
        if isinstance(self.chain, list):  # accept a list, store a hashable tuple
            object.__setattr__(self, "chain", tuple(self.chain))


@dataclass(frozen=True)
class Prefix(Event):
    """PREFIX (server, frame 18; protocol version 3): answers the oldest LOOKUP.

    ``context_id`` is the stored context holding the first ``chunks`` chunks of the
    lookup's chain (1 .. the chain's length), or None with ``chunks`` 0 when not even its
    first chunk is stored.
    """

    context_id: Optional[str]
    chunks: int


@dataclass(frozen=True)
class ChunkBegin(Event):
    """CHUNK_BEGIN (server, frame 8): starts the answer to the oldest request.

    ``chunk``, ``level`` and ``first_layer`` repeat the request's. ``total_bytes`` (wire
    key ``"bytes"``) is the sum of all part payloads; ``parts`` (>= 1) the number of
    CHUNK_PART frames that follow. Their payloads, concatenated, are the blob's header
    then the sections of layers ``first_layer .. layers-1`` (the whole blob when
    ``first_layer`` is 0); the parts' boundaries carry no meaning (a receiver cuts
    sections by the header's lengths).
    """

    chunk: int
    level: int
    total_bytes: int
    parts: int
    first_layer: int = 0


@dataclass(frozen=True)
class ChunkPart(Event):
    """CHUNK_PART (server, frame 9): part ``part`` of the chunk in progress."""

    chunk: int
    part: int
    data: Buffer


@dataclass(frozen=True)
class ChunkEnd(Event):
    """CHUNK_END (server, frame 10): finishes a chunk, or answers a cancelled request.

    With ``cancelled=False`` all parts and bytes announced by CHUNK_BEGIN must have
    been sent. With ``cancelled=True`` the request must have been cancelled by the
    client; it may follow some parts, or come without any CHUNK_BEGIN.
    """

    chunk: int
    cancelled: bool = False


@dataclass(frozen=True)
class Text(Event):
    """TEXT (server, frame 11): zstd token-id bytes answering a ``"text"`` request."""

    chunk: int
    data: Buffer


@dataclass(frozen=True)
class Cancel(Event):
    """CANCEL (client, frame 12): the client no longer wants ``chunk`` (see protocol docs)."""

    chunk: int


@dataclass(frozen=True)
class Error(Event):
    """ERROR (either side, frame 13).

    ``code`` is one of :data:`ERROR_CODES`. A non-fatal ERROR may only come from the
    server and answers (removes) the oldest outstanding OPEN / GET_PROFILE / LOOKUP / REQUEST,
    aborting it if it is a chunk in progress. A fatal ERROR ends the connection.
    """

    code: str
    message: str
    fatal: bool = False


@dataclass(frozen=True)
class Close(Event):
    """CLOSE (either side, frame 14): graceful close; the sender sends nothing more."""


@dataclass(frozen=True)
class ConnectionClosed(Event):
    """Not a frame: the peer closed the byte stream (``receive_data(b"")``).

    ``clean`` is true when a CLOSE or fatal ERROR was exchanged (in either direction)
    before the EOF; false means the stream just stopped (outstanding requests, if any,
    are lost: see ``Connection.outstanding``).
    """

    clean: bool = True
