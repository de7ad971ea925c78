"""kvwire connection state machine, sans-I/O (in the style of h11 / aioquic).

No sockets, no asyncio, no threads, no clocks: feed received bytes to
:meth:`Connection.receive_data` and get events back; hand events to
:meth:`Connection.send` / :meth:`Connection.send_parts` and get bytes to write. An
adapter (asyncio protocol, blocking socket, test) does the I/O. Modules:

* :mod:`streamer.wire.events` -- the event dataclasses and the error types;
* :mod:`streamer.wire.frames` -- wire format (header, JSON schemas, binary layouts) and the
  receive buffer;
* this module -- roles, states, the transition table and the request ledger.

Everything public is re-exported here.

Roles and handshake
-------------------
The CLIENT (receiver of KV) sends HELLO listing versions (a subset of its
``versions``); the SERVER (sender daemon) answers WELCOME with the highest version
both support (none in common: the server's ``receive_data`` raises
``RemoteProtocolError`` saying so; send ``error_frame(exc)``). Nothing else may be sent
before the handshake except CLOSE or a fatal ERROR.

Versions
--------
:data:`SUPPORTED_VERSIONS` are 1, 2 and 3; a connection speaks the one WELCOME chose
(the highest both offer, :attr:`Connection.version`), so a peer that knows only version
1 or 2 keeps working exactly as before. Each version adds one thing and changes
nothing older.

Version 2 adds the *continuation*: REQUEST and
CHUNK_BEGIN may carry ``first_layer`` (JSON key present only when > 0; see
:mod:`streamer.wire.frames`), so a receiver can fetch the rest of a chunk -- its
header and the sections of layers ``first_layer .. layers-1`` -- at a level of its
choice (:attr:`Connection.continuations` says whether the connection may). On a
version 1 connection a ``first_layer`` > 0 is refused: ``send`` raises
``LocalProtocolError``, ``receive_data`` ``RemoteProtocolError``.

Version 3 adds the *lookup* of a content-addressed prefix: LOOKUP{chain} asks which
stored context holds the longest prefix of a hash chain (1 .. ``MAX_LOOKUP_CHAIN`` = 512
lowercase-hex SHA-256s, one per chunk of tokens; ``streamer.store.prefix`` computes
them), and PREFIX{context_id, chunks} answers it: the context holding the chain's first
``chunks`` chunks, or null and 0 when none is stored. LOOKUP is a request like OPEN
(answered in FIFO order, refused before authentication), needs no open context and
closes none; PREFIX may not claim more chunks than the chain it answers has. On a
version 1 or 2 connection LOOKUP is refused (``LocalProtocolError`` /
``RemoteProtocolError``), and PREFIX can answer nothing
(:attr:`Connection.lookups` says whether the connection may look up).

Authentication
--------------
A connection built with ``auth_token`` authenticates its peer with an HMAC
challenge-response (see :mod:`streamer.wire.auth` for the MACs). A server with a token must
send WELCOME{auth: "required", nonce} (the table's ``Kind.AUTH_WELCOME``); the client
answers AUTH{nonce, mac} (build it with :meth:`Connection.auth_event`), the server checks
the MAC in constant time and answers AUTH_OK{mac} (:meth:`Connection.auth_ok_event`),
proving in turn that it knows the token, which the client checks. Only then are both
sides READY. A wrong MAC raises :class:`AuthenticationError` (a ``RemoteProtocolError``
whose ``code`` is ``"auth"``, so ``error_frame()`` sends a fatal ERROR{code: "auth"});
so does any OPEN / GET_PROFILE / LOOKUP / REQUEST / CANCEL received before AUTH_OK: nothing is
served to an unauthenticated client. A client with a token refuses a server that does
not require authentication (it could not prove itself: downgrade protection), and a
client without one refuses a server that requires it -- both with
``AuthenticationError`` raised by ``receive_data`` on the WELCOME.

Frame size limits
-----------------
Control frames carry at most 64 KiB of JSON. Each side rejects, as soon as the header
arrives, a data payload larger than its own ``max_frame``. ``Welcome.max_frame``
(<= the server's ``max_frame``) then caps every payload *sent* by either side for the
rest of the connection; configure clients with ``max_frame`` >= the server's (the
defaults are equal).

Requests and answers
--------------------
OPEN, GET_PROFILE, LOOKUP and REQUEST are *requests*. Both sides keep them in one FIFO
(:attr:`Connection.outstanding`); the server answers strictly in that order, each
request exactly once:

* OPEN        -> MANIFEST, or a non-fatal ERROR;
* GET_PROFILE -> PROFILE with the same id, or a non-fatal ERROR;
* LOOKUP      -> PREFIX (``chunks`` <= the chain's length), or a non-fatal ERROR;
* REQUEST     -> CHUNK_BEGIN (same chunk, level and first_layer), CHUNK_PART
  0..parts-1 in order, CHUNK_END{cancelled: false} with the part bytes summing to
  CHUNK_BEGIN.bytes; or TEXT if the level is ``"text"``; or a non-fatal ERROR (which
  also aborts a chunk in progress); or, for a cancelled request, CHUNK_END{cancelled:
  true} (see below).

The parts of a chunk's answer are the stored blob's bytes (codec/FORMAT.md): its header,
then the sections of layers ``first_layer`` .. ``layers-1`` in order, every byte
unchanged, cut into parts wherever the sender likes. A section decodes from its blob's
header and its own bytes alone, so a continuation's sections decode exactly like the
same sections of a whole answer at that level. A section holds one layer (the codec
groups none), so ``first_layer`` counts layers and sections alike. A text REQUEST has
no layers: its ``first_layer`` must be 0, on any version. The state machine does not
read manifests, so ``first_layer`` < the context's layers is the sender's check, like a
chunk or level out of range: a non-fatal ERROR "bad_request" (see
``Manifest.check_request``).

While a chunk is in progress it is the oldest request, so only its CHUNK_PART /
CHUNK_END, an ERROR or CLOSE may come from the server; the client may keep sending.

A REQUEST needs an open context: the MANIFEST answering the client's latest OPEN has
been received (sending OPEN closes the previous context; an ERROR answering the OPEN
leaves none open). At most one REQUEST per chunk index may be outstanding, so a
chunk index names a request unambiguously (this is what makes CANCEL race-free).

CANCEL rule
-----------
The client may send CANCEL{chunk} only while a non-cancelled REQUEST for that chunk is
outstanding on its side; the request is marked cancelled and stays in the FIFO until
answered. Its answer is, exactly once and in FIFO position:

* if the server sees the CANCEL before it began the answer: CHUNK_END{chunk,
  cancelled: true} with no CHUNK_BEGIN (the server must not begin a cancelled request);
* if the chunk is in progress: either the remaining parts and CHUNK_END{cancelled:
  false}, or CHUNK_END{cancelled: true} at any point after CHUNK_BEGIN;
* if the server had already answered it (the answer crossed the CANCEL on the wire):
  that answer; the server ignores a CANCEL for a chunk it has no request for (the
  event is still returned to the server adapter, which finds nothing to stop);
* a non-fatal ERROR is always an acceptable answer.

CHUNK_END{cancelled: true} for a request the client did not cancel is an error; so is
a second CANCEL of the same request. A server learns whether the request it is
answering was cancelled from :meth:`Connection.head_cancelled`.

ERROR and CLOSE
---------------
A non-fatal ERROR only goes server -> client and answers the oldest request. A fatal
ERROR (either side, any time before CLOSE) ends the connection: sender and receiver go
to CLOSED. CLOSE is graceful: the side that sends it goes to CLOSING and may send
nothing more, but still accepts (and validates) the frames the peer had in flight; the
side that receives it goes to CLOSED and may send nothing more (it just closes the
socket; both sides sending CLOSE at once is fine). Any frame received after a CLOSE or
fatal ERROR from the peer is a ``RemoteProtocolError``. ``receive_data(b"")`` (EOF)
yields :class:`ConnectionClosed` and moves to CLOSED from any state but ERROR; EOF in
the middle of a frame is a ``RemoteProtocolError``.

Errors
------
``send``/``send_parts`` raise ``LocalProtocolError`` for anything illegal and leave the
connection untouched (no bytes were produced, no state changed). ``receive_data``
raises ``RemoteProtocolError`` (never another exception type, whatever the input) and
the connection enters ERROR for good: every later ``receive_data`` raises again,
``send`` raises ``LocalProtocolError``, and :meth:`Connection.error_frame` returns --
once -- a fatal ERROR frame (code ``"protocol"``) to write before closing. The
exception's ``events`` attribute holds the events decoded by the same call before the
bad frame.
"""
from __future__ import annotations

import dataclasses
import enum
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, Iterable, List, Optional, Tuple, Type, Union

from streamer.wire.events import (AUTH_NONE, AUTH_REQUIRED, ERROR_CODES, TEXT_LEVEL, Auth,
                                  AuthenticationError, AuthOk, Cancel, ChunkBegin, ChunkEnd,
                                  ChunkPart, Close, ConnectionClosed, Error, Event, GetProfile,
                                  Hello, LocalProtocolError, Lookup, ManifestData, Open, Prefix,
                                  ProfileData, ProtocolError, RemoteProtocolError, Request, Text,
                                  Welcome)
from streamer.wire import auth as _auth
from streamer.wire.frames import (DEFAULT_MAX_FRAME, EVENT_TYPES, HEADER, MAX_CONTROL_PAYLOAD,
                                  MAX_LOOKUP_CHAIN, MAX_MESSAGE, MAX_U32, MAX_VERSION, MIN_MAX_FRAME,
                                  FrameBuffer, FrameType, decode, encode)

__all__ = [
    # connection
    "Connection", "Role", "State", "Direction", "Kind", "TRANSITIONS", "Pending",
    "ChunkProgress",
    # events
    "Event", "Hello", "Welcome", "Auth", "AuthOk", "Open", "ManifestData", "GetProfile",
    "ProfileData", "Request", "Lookup", "Prefix", "ChunkBegin", "ChunkPart", "ChunkEnd", "Text",
    "Cancel", "Error", "Close", "ConnectionClosed",
    # errors
    "ProtocolError", "LocalProtocolError", "RemoteProtocolError", "AuthenticationError",
    # constants
    "FrameType", "TEXT_LEVEL", "ERROR_CODES", "AUTH_NONE", "AUTH_REQUIRED", "DEFAULT_MAX_FRAME", "MIN_MAX_FRAME",
    "MAX_CONTROL_PAYLOAD", "HEADER", "SUPPORTED_VERSIONS", "CONTINUATION_VERSION", "LOOKUP_VERSION",
    "MAX_LOOKUP_CHAIN",
]

#: Protocol versions this implementation speaks.
SUPPORTED_VERSIONS: Tuple[int, ...] = (1, 2, 3)
#: The first version whose REQUEST may name a ``first_layer`` (a continuation).
CONTINUATION_VERSION = 2
#: The first version with LOOKUP / PREFIX (content-addressed prefixes).
LOOKUP_VERSION = 3


class Role(enum.Enum):
    CLIENT = "client"   # the KV receiver: sends HELLO and requests
    SERVER = "server"   # the sender daemon: answers


class State(enum.Enum):
    START = "START"                  # client: nothing sent yet
    AWAIT_WELCOME = "AWAIT_WELCOME"  # client: HELLO sent
    SEND_AUTH = "SEND_AUTH"          # client: WELCOME{auth: required} received, AUTH due
    AWAIT_AUTH_OK = "AWAIT_AUTH_OK"  # client: AUTH sent
    AWAIT_HELLO = "AWAIT_HELLO"      # server: nothing received yet
    SEND_WELCOME = "SEND_WELCOME"    # server: HELLO received, WELCOME due
    AWAIT_AUTH = "AWAIT_AUTH"        # server: WELCOME{auth: required} sent
    SEND_AUTH_OK = "SEND_AUTH_OK"    # server: valid AUTH received, AUTH_OK due
    READY = "READY"                  # handshake done
    CLOSING = "CLOSING"              # we sent CLOSE; still taking the peer's in-flight frames
    CLOSED = "CLOSED"                # CLOSE / fatal ERROR received or fatal ERROR sent, or EOF
    ERROR = "ERROR"                  # the peer broke the protocol (terminal)


class Direction(enum.Enum):
    SEND = "send"
    RECV = "receive"


class Kind(enum.Enum):
    """Transition triggers that are not a plain frame type."""
    FATAL_ERROR = "fatal ERROR"   # an ERROR frame with fatal=true (FrameType.ERROR = non-fatal)
    AUTH_WELCOME = "WELCOME (auth required)"  # FrameType.WELCOME = WELCOME{auth: none}
    EOF = "EOF"


Trigger = Union[FrameType, Kind]

# ----------------------------------------------------------------------------- the table
_C, _S = Role.CLIENT, Role.SERVER
_SEND, _RECV = Direction.SEND, Direction.RECV
_CLIENT_REQUESTS = (FrameType.OPEN, FrameType.GET_PROFILE, FrameType.REQUEST,
                    FrameType.CANCEL, FrameType.LOOKUP)
_SERVER_ANSWERS = (FrameType.MANIFEST, FrameType.PROFILE, FrameType.CHUNK_BEGIN,
                   FrameType.CHUNK_PART, FrameType.CHUNK_END, FrameType.TEXT,
                   FrameType.ERROR, FrameType.PREFIX)
_LIVE = {_C: (State.START, State.AWAIT_WELCOME, State.SEND_AUTH, State.AWAIT_AUTH_OK,
              State.READY),
         _S: (State.AWAIT_HELLO, State.SEND_WELCOME, State.AWAIT_AUTH, State.SEND_AUTH_OK,
              State.READY)}
#: States in which an authenticating server refuses requests with AuthenticationError.
_UNAUTHENTICATED = (State.AWAIT_AUTH, State.SEND_AUTH_OK)

#: The whole connection-level state machine: (role, state, direction, trigger) -> next
#: state. A (role, state, direction, trigger) that is not a key is illegal. Content
#: rules (FIFO matching, part order, byte counts, open context) are checked by the
#: request ledger in :class:`Connection` once the table has allowed the frame.
TRANSITIONS: Dict[Tuple[Role, State, Direction, Trigger], State] = {
    # handshake
    (_C, State.START, _SEND, FrameType.HELLO): State.AWAIT_WELCOME,
    (_C, State.AWAIT_WELCOME, _RECV, FrameType.WELCOME): State.READY,
    (_S, State.AWAIT_HELLO, _RECV, FrameType.HELLO): State.SEND_WELCOME,
    (_S, State.SEND_WELCOME, _SEND, FrameType.WELCOME): State.READY,
    # authentication (WELCOME{auth: required})
    (_C, State.AWAIT_WELCOME, _RECV, Kind.AUTH_WELCOME): State.SEND_AUTH,
    (_C, State.SEND_AUTH, _SEND, FrameType.AUTH): State.AWAIT_AUTH_OK,
    (_C, State.AWAIT_AUTH_OK, _RECV, FrameType.AUTH_OK): State.READY,
    (_S, State.SEND_WELCOME, _SEND, Kind.AUTH_WELCOME): State.AWAIT_AUTH,
    (_S, State.AWAIT_AUTH, _RECV, FrameType.AUTH): State.SEND_AUTH_OK,
    (_S, State.SEND_AUTH_OK, _SEND, FrameType.AUTH_OK): State.READY,
    # steady state: requests one way, answers (and non-fatal ERRORs) the other
    **{(_C, State.READY, _SEND, t): State.READY for t in _CLIENT_REQUESTS},
    **{(_S, State.READY, _RECV, t): State.READY for t in _CLIENT_REQUESTS},
    **{(_S, State.READY, _SEND, t): State.READY for t in _SERVER_ANSWERS},
    **{(_C, State.READY, _RECV, t): State.READY for t in _SERVER_ANSWERS},
    # after our CLOSE, frames the peer sent before seeing it are still accepted
    **{(_S, State.CLOSING, _RECV, t): State.CLOSING for t in _CLIENT_REQUESTS},
    **{(_C, State.CLOSING, _RECV, t): State.CLOSING for t in _SERVER_ANSWERS},
    # graceful close, either side, any time after the connection is up
    **{(r, s, _SEND, FrameType.CLOSE): State.CLOSING for r in _LIVE for s in _LIVE[r]},
    **{(r, s, _RECV, FrameType.CLOSE): State.CLOSED
       for r in _LIVE for s in _LIVE[r] + (State.CLOSING,)},
    # fatal ERROR, either side
    **{(r, s, _SEND, Kind.FATAL_ERROR): State.CLOSED for r in _LIVE for s in _LIVE[r]},
    **{(r, s, _RECV, Kind.FATAL_ERROR): State.CLOSED
       for r in _LIVE for s in _LIVE[r] + (State.CLOSING,)},
    # end of the byte stream
    **{(r, s, _RECV, Kind.EOF): State.CLOSED
       for r in _LIVE for s in _LIVE[r] + (State.CLOSING, State.CLOSED)},
}


# ----------------------------------------------------------------------------- ledger
@dataclass(frozen=True)
class Pending:
    """An outstanding request: the OPEN / GET_PROFILE / LOOKUP / REQUEST event, and whether
    the client has cancelled it (REQUEST only)."""

    request: Union[Open, GetProfile, Lookup, Request]
    cancelled: bool = False

    @property
    def kind(self) -> FrameType:
        return {Open: FrameType.OPEN, GetProfile: FrameType.GET_PROFILE,
                Lookup: FrameType.LOOKUP, Request: FrameType.REQUEST}[type(self.request)]


@dataclass(frozen=True)
class ChunkProgress:
    """The chunk being streamed (between CHUNK_BEGIN and CHUNK_END)."""

    chunk: int
    level: int
    total_bytes: int
    parts: int
    parts_seen: int = 0
    bytes_seen: int = 0
    first_layer: int = 0


def _describe(p: Pending) -> str:
    r = p.request
    if isinstance(r, Open):
        return f"OPEN {r.context_id!r:.60}"
    if isinstance(r, GetProfile):
        return f"GET_PROFILE {r.profile_id}"
    if isinstance(r, Lookup):
        return f"LOOKUP of {len(r.chain)} hashes"
    return (f"REQUEST chunk {r.chunk} level {r.level!r}"
            + (f" from layer {r.first_layer}" if r.first_layer else "")
            + (" (cancelled)" if p.cancelled else ""))


# ----------------------------------------------------------------------------- connection
class Connection:
    """One end of a kvwire connection. See the module docstring for the rules.

    ``role``: :attr:`Role.CLIENT` (sends HELLO and requests) or :attr:`Role.SERVER`.
    ``max_frame``: the largest data payload this side accepts (64 KiB .. 2**32-1).
    ``versions``: protocol versions this side speaks.
    ``auth_token``: shared secret (str or bytes, >= 16 bytes); server: require clients to
    authenticate; client: authenticate, and require the server to (see module docs).
    """

    def __init__(self, role: Role, *, max_frame: int = DEFAULT_MAX_FRAME,
                 versions: Iterable[int] = SUPPORTED_VERSIONS,
                 auth_token: Optional[_auth.Token] = None) -> None:
        if not isinstance(role, Role):
            raise TypeError(f"role must be a Role, got {role!r}")
        if type(max_frame) is not int or not MIN_MAX_FRAME <= max_frame <= MAX_U32:
            raise ValueError(f"max_frame must be an int in [{MIN_MAX_FRAME}, {MAX_U32}]")
        versions = tuple(versions)
        if not versions or any(type(v) is not int or not 1 <= v <= MAX_VERSION
                               for v in versions) or len(set(versions)) != len(versions):
            raise ValueError(f"versions must be distinct ints in [1, {MAX_VERSION}]: {versions}")
        self.role = role
        self.max_frame = max_frame
        self.versions = versions
        self._token = _auth.normalize_token(auth_token)
        self._server_nonce: Optional[str] = None
        self._client_nonce: Optional[str] = None
        self._welcome: Optional[Welcome] = None
        self._authenticated = False
        self._state = State.START if role is Role.CLIENT else State.AWAIT_HELLO
        self._rx = FrameBuffer(max_frame)
        self._queue: Deque[Pending] = deque()
        self._progress: Optional[ChunkProgress] = None
        self._context: Optional[str] = None
        self._offered: Tuple[int, ...] = ()      # client: versions in our HELLO
        self._chosen: Optional[int] = None       # server: highest common version
        self._version: Optional[int] = None      # after the handshake
        self._send_limit = MAX_CONTROL_PAYLOAD   # Welcome.max_frame once known
        self._peer_name: Optional[str] = None
        self._error: Optional[RemoteProtocolError] = None
        self._error_frame_sent = False
        self._eof = False

    # ------------------------------------------------------------------ read-only views
    @property
    def state(self) -> State:
        return self._state

    @property
    def outstanding(self) -> Tuple[Pending, ...]:
        """Requests sent (client) / received (server) and not yet answered, oldest first."""
        return tuple(self._queue)

    def head_cancelled(self, chunk: int) -> bool:
        """Whether the oldest outstanding request is a REQUEST for ``chunk`` that the
        client cancelled: a server answering ``chunk`` asks this before beginning it
        and between its parts. The mark lives on the request in the ledger, so it ends
        with that request's answer and can never reach a later REQUEST for the same
        chunk (a CANCEL that crossed the answer finds no request and marks nothing)."""
        head = self._queue[0] if self._queue else None
        return (head is not None and head.cancelled and isinstance(head.request, Request)
                and head.request.chunk == chunk)

    @property
    def chunk_in_progress(self) -> Optional[ChunkProgress]:
        return self._progress

    @property
    def context_id(self) -> Optional[str]:
        """The open context (MANIFEST for the latest OPEN done), or None."""
        return self._context

    @property
    def version(self) -> Optional[int]:
        """The negotiated protocol version once WELCOME is sent/received."""
        return self._version

    @property
    def continuations(self) -> bool:
        """Whether REQUEST may name a ``first_layer`` here: the negotiated version is at
        least :data:`CONTINUATION_VERSION` (False before the handshake)."""
        return self._version is not None and self._version >= CONTINUATION_VERSION

    @property
    def lookups(self) -> bool:
        """Whether LOOKUP may be sent here: the negotiated version is at least
        :data:`LOOKUP_VERSION` (False before the handshake)."""
        return self._version is not None and self._version >= LOOKUP_VERSION

    @property
    def send_limit(self) -> int:
        """Largest payload this side may send now (Welcome.max_frame after the handshake)."""
        return self._send_limit

    @property
    def peer_name(self) -> Optional[str]:
        """``Hello.client`` (server side) or ``Welcome.server`` (client side)."""
        return self._peer_name

    @property
    def auth_required(self) -> bool:
        """Whether this side has a token (and so authenticates its peer)."""
        return self._token is not None

    @property
    def authenticated(self) -> bool:
        """True once the peer proved it knows the token (AUTH_OK sent / checked)."""
        return self._authenticated

    @property
    def receiving_frame(self) -> int:
        """Bytes of an incomplete frame buffered (0 between frames): an adapter's cue to
        start a read deadline (slowloris protection)."""
        return len(self._rx)

    def auth_event(self, nonce: Optional[str] = None) -> Auth:
        """Client, state SEND_AUTH: the AUTH event answering the server's challenge
        (``nonce``: the client's challenge; default: a fresh random one). Changes nothing;
        ``send`` it."""
        if self.role is not Role.CLIENT or self._state is not State.SEND_AUTH:
            raise LocalProtocolError(f"auth_event() needs a client in SEND_AUTH, "
                                     f"not {self.role.value} in {self._state.name}")
        assert self._token is not None and self._welcome is not None
        nonce = _auth.new_nonce() if nonce is None else nonce
        w = self._welcome
        return Auth(nonce=nonce, mac=_auth.client_mac(self._token, w.nonce, nonce,
                                                      w.version, w.max_frame))

    def auth_ok_event(self) -> AuthOk:
        """Server, state SEND_AUTH_OK: the AUTH_OK event (with the server's proof)."""
        if self.role is not Role.SERVER or self._state is not State.SEND_AUTH_OK:
            raise LocalProtocolError(f"auth_ok_event() needs a server in SEND_AUTH_OK, "
                                     f"not {self.role.value} in {self._state.name}")
        assert self._token is not None and self._welcome is not None
        w = self._welcome
        return AuthOk(mac=_auth.server_mac(self._token, w.nonce, self._client_nonce or "",
                                           w.version, w.max_frame))

    @property
    def error(self) -> Optional[RemoteProtocolError]:
        """The violation that put the connection in ERROR, if any."""
        return self._error

    # ------------------------------------------------------------------ sending
    def send(self, event: Event) -> bytes:
        """Frame ``event`` as one ``bytes`` (copies a data payload; see ``send_parts``)."""
        return b"".join(self.send_parts(event))

    def send_parts(self, event: Event) -> List[Union[bytes, memoryview]]:
        """Frame ``event`` as pieces for ``transport.writelines``, without copying the
        binary payload: ``[header (+ small prefix), data]`` for data frames (``data`` is
        the caller's object, or a byte-format view of it: keep it unchanged until
        written), ``[frame]`` for control frames."""
        if self._state is State.ERROR:
            raise LocalProtocolError(
                f"connection is in ERROR ({self._error}); only error_frame() may be sent")
        ftype, pieces, length = encode(event)   # field validation -> LocalProtocolError
        self._process(event, ftype, Direction.SEND, length)
        return pieces

    def error_frame(self, exc: Optional[ProtocolError] = None) -> bytes:
        """A fatal ERROR frame reporting ``exc`` (default: the violation that put the
        connection in ERROR). Allowed once, and only in state ERROR."""
        if self._state is not State.ERROR:
            raise LocalProtocolError(f"error_frame() needs state ERROR, not {self._state.name}"
                                     f"; use send(Error(..., fatal=True))")
        if self._error_frame_sent:
            raise LocalProtocolError("error_frame() was already called")
        exc = exc if exc is not None else self._error
        code = getattr(exc, "code", "protocol")
        message = str(exc)[:MAX_MESSAGE]
        # a message with many multi-byte characters could still overflow 64 KiB of JSON
        while True:
            try:
                _, pieces, _ = encode(Error(code if code in ERROR_CODES else "protocol",
                                            message, fatal=True))
                break
            except LocalProtocolError:
                message = message[: len(message) // 2]
        self._error_frame_sent = True
        return pieces[0]

    # ------------------------------------------------------------------ receiving
    def receive_data(self, data: Union[bytes, bytearray, memoryview]) -> List[Event]:
        """Feed received bytes; return the events of every complete frame, in order.

        ``b""`` means EOF: returns ``[ConnectionClosed(clean)]`` (once; later EOFs
        return ``[]``). Raises ``RemoteProtocolError`` on any violation (see the module
        docstring); feeding data after EOF raises ``LocalProtocolError``.
        """
        if self._state is State.ERROR:
            raise RemoteProtocolError(f"connection is in ERROR: {self._error}")
        if self._eof:
            if len(data):
                raise LocalProtocolError("receive_data() after EOF")
            return []
        events: List[Event] = []
        try:
            if not len(data):
                return self._receive_eof()
            self._rx.feed(data)
            while True:
                event = self._rx.next_frame(self._handle_frame)
                if event is None:
                    return events
                events.append(event)
        except RemoteProtocolError as exc:
            self._state = State.ERROR
            self._error = exc
            exc.events = events
            raise
        except Exception as exc:  # defence in depth: a bug must not escape as another type
            err = RemoteProtocolError(f"internal error while decoding: {exc!r}", events=events)
            self._state, self._error = State.ERROR, err
            raise err from exc

    def _receive_eof(self) -> List[Event]:
        if len(self._rx):
            raise RemoteProtocolError(
                f"EOF in the middle of a frame ({len(self._rx)} bytes buffered)")
        clean = self._state in (State.CLOSING, State.CLOSED)
        self._transition(Kind.EOF, Direction.RECV)
        self._eof = True
        self._state = State.CLOSED
        return [ConnectionClosed(clean=clean)]

    def _handle_frame(self, ftype: FrameType, payload: memoryview) -> Event:
        if self._state is State.CLOSED:   # cheap early exit; the table says the same
            raise RemoteProtocolError(f"{ftype.name} frame received after the connection "
                                      f"was closed (CLOSE, fatal ERROR)")
        event = decode(ftype, payload)
        self._process(event, ftype, Direction.RECV)
        return event

    # ------------------------------------------------------------------ the machine
    def _transition(self, trigger: Trigger, direction: Direction) -> State:
        try:
            return TRANSITIONS[(self.role, self._state, direction, trigger)]
        except KeyError:
            name = trigger.name if isinstance(trigger, FrameType) else trigger.value
            if (direction is Direction.RECV and self.role is Role.SERVER
                    and trigger is not FrameType.CLOSE and trigger is not Kind.FATAL_ERROR
                    and (self._state in _UNAUTHENTICATED or self.auth_required and self._state in (
                        State.AWAIT_HELLO, State.SEND_WELCOME))):
                raise AuthenticationError(f"authentication required: {name} received before "
                                          f"AUTH was accepted") from None
            exc = LocalProtocolError if direction is Direction.SEND else RemoteProtocolError
            verb = "send" if direction is Direction.SEND else "receive"
            raise exc(f"{self.role.value} cannot {verb} {name} in state "
                      f"{self._state.name}") from None

    def _process(self, event: Event, ftype: FrameType, direction: Direction,
                 length: int = 0) -> None:
        """Check ``event`` against the table, the frame limit (sending) and the ledger,
        then commit. Nothing is mutated unless every check passes."""
        trigger: Trigger = ftype
        if isinstance(event, Error) and event.fatal:
            trigger = Kind.FATAL_ERROR
        elif isinstance(event, Welcome) and event.auth == AUTH_REQUIRED:
            trigger = Kind.AUTH_WELCOME
        new_state = self._transition(trigger, direction)
        if length > self._send_limit:
            raise LocalProtocolError(f"{ftype.name} payload of {length} bytes exceeds the "
                                     f"frame limit {self._send_limit}")
        fail = LocalProtocolError if direction is Direction.SEND else RemoteProtocolError
        commit = self._check(event, direction, fail)
        if commit is not None:
            commit()
        self._state = new_state

    # Each _check_<frame type> validates without mutating and returns a closure that commits.
    def _check(self, event: Event, direction: Direction, fail: Type[ProtocolError]):
        frame_type = EVENT_TYPES.get(type(event))
        if frame_type is None:
            return None
        method = getattr(self, "_check_" + frame_type.name.lower().replace("_", ""), None)
        return method(event, direction, fail) if method is not None else None

    def _check_hello(self, ev: Hello, d: Direction, fail):
        if d is Direction.SEND:   # client
            extra = set(ev.versions) - set(self.versions)
            if extra:
                raise fail(f"HELLO offers versions {sorted(extra)} this connection does "
                           f"not support {list(self.versions)}")
            return lambda: setattr(self, "_offered", ev.versions)
        common = set(ev.versions) & set(self.versions)
        if not common:
            raise fail(f"no common protocol version: client offers {list(ev.versions)}, "
                       f"server supports {list(self.versions)}")

        def commit() -> None:
            self._chosen, self._peer_name = max(common), ev.client
        return commit

    def _check_welcome(self, ev: Welcome, d: Direction, fail):
        required = ev.auth == AUTH_REQUIRED
        if required != (ev.nonce != ""):
            raise fail(f"WELCOME auth {ev.auth!r} needs "
                       f"{'a nonce' if required else 'an empty nonce'}")
        if d is Direction.SEND:   # server
            if ev.version != self._chosen:
                raise fail(f"WELCOME must choose version {self._chosen} (the highest common "
                           f"one), not {ev.version}")
            if ev.max_frame > self.max_frame:
                raise fail(f"WELCOME.max_frame {ev.max_frame} exceeds this connection's "
                           f"max_frame {self.max_frame}")
            if required != self.auth_required:
                raise fail(f"WELCOME auth must be "
                           f"{AUTH_REQUIRED if self.auth_required else AUTH_NONE!r} on a "
                           f"connection {'with' if self.auth_required else 'without'} a token")
        else:
            if ev.version not in self._offered:
                raise fail(f"server chose version {ev.version}, which the client did not "
                           f"offer ({list(self._offered)})")
            if required and not self.auth_required:
                raise AuthenticationError("the sender requires authentication and no auth "
                                          "token is configured")
            if self.auth_required and not required:
                raise AuthenticationError("the sender does not authenticate (auth: none) but "
                                          "this receiver has a token and requires mutual "
                                          "authentication")

        def commit() -> None:
            self._version, self._send_limit = ev.version, ev.max_frame
            self._welcome = ev
            if d is Direction.RECV:
                self._peer_name = ev.server
        return commit

    def _check_auth(self, ev: Auth, d: Direction, fail):
        w = self._welcome
        assert w is not None and self._token is not None  # the table only allows it then
        expected = _auth.client_mac(self._token, w.nonce, ev.nonce, w.version, w.max_frame)
        if ev.nonce == w.nonce:
            raise (fail if d is Direction.SEND else AuthenticationError)(
                "AUTH nonce repeats the server's nonce")
        if not _auth.verify(expected, ev.mac):
            if d is Direction.SEND:
                raise fail("AUTH mac is not the MAC of this connection's token; "
                           "build the event with auth_event()")
            raise AuthenticationError("authentication failed: wrong token")

        def commit() -> None:
            self._client_nonce = ev.nonce
        return commit

    def _check_authok(self, ev: AuthOk, d: Direction, fail):
        w = self._welcome
        assert w is not None and self._token is not None and self._client_nonce is not None
        expected = _auth.server_mac(self._token, w.nonce, self._client_nonce, w.version,
                                    w.max_frame)
        if not _auth.verify(expected, ev.mac):
            if d is Direction.SEND:
                raise fail("AUTH_OK mac is wrong; build the event with auth_ok_event()")
            raise AuthenticationError("authentication failed: the sender could not prove "
                                      "it knows the token")
        return lambda: setattr(self, "_authenticated", True)

    def _check_open(self, ev: Open, d, fail):
        def commit() -> None:
            self._queue.append(Pending(ev))
            self._context = None
        return commit

    def _check_getprofile(self, ev: GetProfile, d, fail):
        return lambda: self._queue.append(Pending(ev))

    def _check_lookup(self, ev: Lookup, d, fail):
        if not self.lookups:
            raise fail(f"LOOKUP on a version {self._version} connection: lookups need version "
                       f"{LOOKUP_VERSION}")
        return lambda: self._queue.append(Pending(ev))

    def _check_request(self, ev: Request, d, fail):
        if self._context is None:
            raise fail(f"REQUEST for chunk {ev.chunk} without an open context "
                       f"(MANIFEST for the latest OPEN not yet received)")
        for p in self._queue:
            if isinstance(p.request, Request) and p.request.chunk == ev.chunk:
                raise fail(f"REQUEST for chunk {ev.chunk} while {_describe(p)} is outstanding")
        if ev.first_layer:
            if ev.level == TEXT_LEVEL:
                raise fail(f"REQUEST for chunk {ev.chunk} as text from layer {ev.first_layer}: "
                           f"text has no layers (first_layer must be 0)")
            if not self.continuations:
                raise fail(f"REQUEST for chunk {ev.chunk} from layer {ev.first_layer} on a "
                           f"version {self._version} connection: first_layer needs version "
                           f"{CONTINUATION_VERSION}")
        return lambda: self._queue.append(Pending(ev))

    def _check_cancel(self, ev: Cancel, d, fail):
        for i, p in enumerate(self._queue):
            if isinstance(p.request, Request) and p.request.chunk == ev.chunk:
                if p.cancelled:
                    raise fail(f"CANCEL for chunk {ev.chunk}, which is already cancelled")

                def commit(i: int = i, p: Pending = p) -> None:
                    self._queue[i] = dataclasses.replace(p, cancelled=True)
                return commit
        if d is Direction.SEND:
            raise fail(f"CANCEL for chunk {ev.chunk}, which has no outstanding REQUEST")
        return None  # server: the answer crossed the CANCEL on the wire; nothing to do

    def _head(self, what: str, fail) -> Pending:
        if not self._queue:
            raise fail(f"{what} with no outstanding request")
        return self._queue[0]

    def _no_progress(self, what: str, fail) -> None:
        if self._progress is not None:
            raise fail(f"{what} while chunk {self._progress.chunk} is in progress "
                       f"(part {self._progress.parts_seen}/{self._progress.parts})")

    def _check_manifest(self, ev: ManifestData, d, fail):
        head = self._head("MANIFEST", fail)
        if not isinstance(head.request, Open):
            raise fail(f"MANIFEST does not answer the oldest request, {_describe(head)}")

        def commit() -> None:
            self._queue.popleft()
            if not any(isinstance(p.request, Open) for p in self._queue):
                self._context = head.request.context_id
        return commit

    def _check_profile(self, ev: ProfileData, d, fail):
        head = self._head("PROFILE", fail)
        if not (isinstance(head.request, GetProfile)
                and head.request.profile_id == ev.profile_id):
            raise fail(f"PROFILE {ev.profile_id} does not answer the oldest request, "
                       f"{_describe(head)}")
        if ev.more:  # a continued profile: the request stays the head until the last piece
            return lambda: None
        return self._queue.popleft

    def _check_prefix(self, ev: Prefix, d, fail):
        self._no_progress("PREFIX", fail)
        head = self._head("PREFIX", fail)
        if not isinstance(head.request, Lookup):
            raise fail(f"PREFIX does not answer the oldest request, {_describe(head)}")
        if ev.chunks > len(head.request.chain):
            raise fail(f"PREFIX claims {ev.chunks} chunks of a LOOKUP of "
                       f"{len(head.request.chain)} hashes")
        return self._queue.popleft

    def _answerable(self, what: str, chunk: int, level, first_layer: int, d, fail) -> Pending:
        self._no_progress(what, fail)
        head = self._head(what, fail)
        r = head.request
        if not (isinstance(r, Request) and r.chunk == chunk and r.level == level
                and r.first_layer == first_layer):
            begins = f" from layer {first_layer}" if first_layer else ""
            raise fail(f"{what} for chunk {chunk} level {level!r}{begins} does not answer the "
                       f"oldest request, {_describe(head)}")
        if head.cancelled and d is Direction.SEND:
            raise fail(f"{what}: chunk {chunk} was cancelled before it began; answer it "
                       f"with ChunkEnd(cancelled=True)")
        return head

    def _check_chunkbegin(self, ev: ChunkBegin, d, fail):
        self._answerable("CHUNK_BEGIN", ev.chunk, ev.level, ev.first_layer, d, fail)
        return lambda: setattr(self, "_progress", ChunkProgress(
            ev.chunk, ev.level, ev.total_bytes, ev.parts, first_layer=ev.first_layer))

    def _check_text(self, ev: Text, d, fail):
        self._answerable("TEXT", ev.chunk, TEXT_LEVEL, 0, d, fail)
        return self._queue.popleft

    def _check_chunkpart(self, ev: ChunkPart, d, fail):
        pr = self._progress
        if pr is None:
            raise fail(f"CHUNK_PART for chunk {ev.chunk} with no chunk in progress "
                       f"(no CHUNK_BEGIN)")
        if ev.chunk != pr.chunk:
            raise fail(f"CHUNK_PART for chunk {ev.chunk} while chunk {pr.chunk} is in progress")
        if pr.parts_seen >= pr.parts:
            raise fail(f"CHUNK_PART {ev.part} of chunk {ev.chunk}: all {pr.parts} parts "
                       f"already received")
        if ev.part != pr.parts_seen:
            raise fail(f"CHUNK_PART {ev.part} of chunk {ev.chunk} out of order "
                       f"(expected part {pr.parts_seen})")
        n = memoryview(ev.data).nbytes if d is Direction.SEND else len(ev.data)
        if pr.bytes_seen + n > pr.total_bytes:
            raise fail(f"CHUNK_PART {ev.part} of chunk {ev.chunk} brings the chunk to "
                       f"{pr.bytes_seen + n} bytes, more than the {pr.total_bytes} announced")
        return lambda: setattr(self, "_progress", dataclasses.replace(
            pr, parts_seen=pr.parts_seen + 1, bytes_seen=pr.bytes_seen + n))

    def _check_chunkend(self, ev: ChunkEnd, d, fail):
        pr = self._progress
        head = self._head("CHUNK_END", fail)
        r = head.request
        if not (isinstance(r, Request) and r.chunk == ev.chunk):
            raise fail(f"CHUNK_END for chunk {ev.chunk} does not answer the oldest request, "
                       f"{_describe(head)}")
        if ev.cancelled:
            if not head.cancelled:
                raise fail(f"CHUNK_END cancelled=true for chunk {ev.chunk}, which the client "
                           f"did not cancel")
        elif pr is None:
            raise fail(f"CHUNK_END for chunk {ev.chunk} without CHUNK_BEGIN")
        elif pr.parts_seen != pr.parts or pr.bytes_seen != pr.total_bytes:
            raise fail(f"CHUNK_END for chunk {ev.chunk} after {pr.parts_seen}/{pr.parts} parts "
                       f"and {pr.bytes_seen}/{pr.total_bytes} bytes")
        return self._finish_head

    def _finish_head(self) -> None:
        self._queue.popleft()
        self._progress = None

    def _check_error(self, ev: Error, d, fail):
        if ev.fatal:
            return None
        # the table only lets a non-fatal ERROR go server -> client
        self._head("non-fatal ERROR", fail)
        return self._finish_head

    def __repr__(self) -> str:
        return (f"<Connection {self.role.value} {self._state.name} "
                f"outstanding={len(self._queue)} in_progress={self._progress}>")
