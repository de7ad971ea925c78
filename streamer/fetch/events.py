"""The fetch controller's vocabulary: timestamped inputs a driver feeds it, actions it answers with.

Every input carries ``at``, the driver's clock when the thing happened (``time.monotonic()``
for ``StreamSession``, virtual seconds for the simulator): the controller reads no clock,
so one sequence of inputs always gives one sequence of actions, live, simulated or
replayed from a log. Network inputs describe the answers on the current connection only:
after a ``Reconnect`` action a driver feeds nothing of the old connection, then
``Connected`` once a new one is ready.
"""
from __future__ import annotations

from dataclasses import dataclass

from streamer.adapt.base import Choice


# ----------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class Started:
    """``fetch()`` began on a ready connection (its round trip, what opening a connection
    costs, and whether its REQUESTs may name a first layer: protocol version 2): the
    deadline runs from here; the first requests go out."""

    rtt: float
    connect_seconds: float
    at: float
    continuations: bool = False


@dataclass(frozen=True)
class Tick:
    """A timer the controller asked for (``FetchController.timer``) fired, or the driver
    woke for another reason; nothing else happened."""

    at: float


@dataclass(frozen=True)
class Activity:
    """Bytes came off the socket (a part perhaps still incomplete): the link is alive.
    ``partial`` is how many bytes of the frame still arriving are in, so a large part at a
    low rate is seen as it trickles in (the cancel rule judges by it)."""

    at: float
    partial: int = 0


@dataclass(frozen=True)
class AnswerBegan:
    """The sender began answering a REQUEST for ``chunk`` at a level (CHUNK_BEGIN)."""

    chunk: int
    total_bytes: int
    at: float


@dataclass(frozen=True)
class PartArrived:
    """A part of ``chunk``'s answer arrived: ``received`` bytes of it in so far, of which
    ``sections`` whole layer sections have gone to the decoder."""

    chunk: int
    received: int
    sections: int
    at: float


@dataclass(frozen=True)
class AnswerEnded:
    """``chunk``'s answer ended (CHUNK_END): whole, or cut short by our CANCEL."""

    chunk: int
    cancelled: bool
    at: float


@dataclass(frozen=True)
class TextArrived:
    """``chunk``'s token ids arrived and were valid (a TEXT answer, ``nbytes`` long)."""

    chunk: int
    nbytes: int
    at: float


@dataclass(frozen=True)
class SenderError:
    """A non-fatal ERROR frame: the sender could not answer the oldest outstanding request."""

    code: str
    message: str
    at: float


@dataclass(frozen=True)
class ConnectionBroken:
    """The connection is unusable: closed, reset, a fatal ERROR, a protocol violation or
    an answer that contradicts the manifest."""

    reason: str
    at: float


@dataclass(frozen=True)
class Connected:
    """A new connection is ready (after a ``Reconnect``): what it measured, and whether
    it takes continuations (the next sender may speak another protocol version)."""

    rtt: float
    connect_seconds: float
    at: float
    continuations: bool = False


@dataclass(frozen=True)
class ReadingPaused:
    """The driver stopped reading the socket (its buffer limit): silence is not a stall, and
    the time until ReadingResumed is not the link's (``FetchController._hold``)."""

    at: float


@dataclass(frozen=True)
class ReadingResumed:
    at: float


@dataclass(frozen=True)
class Corrupt:
    """A section (or the header) of ``chunk``'s current answer failed its checks, at
    parsing or at decoding. The driver drops the rest of that answer's bytes."""

    chunk: int
    layer: int
    message: str
    at: float


@dataclass(frozen=True)
class SectionHanded:
    """One layer section of ``chunk`` went to the decoder (``nbytes`` coded bytes)."""

    chunk: int
    layer: int
    nbytes: int
    at: float


@dataclass(frozen=True)
class SectionDecoded:
    """The decoder is done with a section handed to it: decoded in ``seconds`` of its own
    time, or dropped or failed (``seconds`` None: nothing measured)."""

    chunk: int
    layer: int
    nbytes: int
    seconds: float | None
    at: float


@dataclass(frozen=True)
class LayerDelivering:
    """The consumer's ``on_layer`` was called for (chunk, layer): from this moment the
    layer counts as delivered, whether or not the call has returned."""

    chunk: int
    layer: int
    at: float


@dataclass(frozen=True)
class RecomputeStarted:
    """The consumer's ``on_text`` was called for ``chunk``."""

    chunk: int
    at: float


@dataclass(frozen=True)
class RecomputeFinished:
    """``on_text`` returned for ``chunk`` after ``seconds`` on ``tokens`` tokens."""

    chunk: int
    tokens: int
    seconds: float
    at: float


@dataclass(frozen=True)
class ChunkDone:
    """Every layer of ``chunk`` was delivered, or its text recomputed: it cannot change."""

    chunk: int
    at: float


Event = (Started | Tick | Activity | AnswerBegan | PartArrived | AnswerEnded | TextArrived | SenderError
         | ConnectionBroken | Connected | ReadingPaused | ReadingResumed | Corrupt | SectionHanded
         | SectionDecoded | LayerDelivering | RecomputeStarted | RecomputeFinished | ChunkDone)


# ----------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class SendRequest:
    """Request ``chunk`` as ``choice`` (a level, or text) from layer ``first_layer``.
    A chunk requested again after some of its layers went out is text (superseding
    them), or a continuation: its layers from the first not delivered, at the same
    level or a lower one (``first_layer`` > 0 on a connection that takes it), or, where
    the connection does not, the whole chunk again at the same level, whose delivered
    layers the delivery skips."""

    chunk: int
    choice: Choice
    first_layer: int = 0


@dataclass(frozen=True)
class SendCancel:
    """Ask the sender to stop ``chunk``'s answer; it is re-requested when that answer ends."""

    chunk: int


@dataclass(frozen=True)
class Reconnect:
    """Drop the connection and open another, then feed ``Connected``. ``abort``: the cancel
    rule drops it on purpose (what it queued would take longer to arrive than a new one
    takes to open), to the same sender; otherwise the next sender in turn."""

    reason: str
    abort: bool = False


@dataclass(frozen=True)
class ChunkFinished:
    """A chunk's answer is in (its report is final unless it is refetched)."""

    chunk: int


@dataclass(frozen=True)
class FailChunk:
    """``chunk`` cannot be delivered (its text stayed corrupt): the consumer raises when
    it reaches it."""

    chunk: int
    message: str


#: ``Fail.kind`` values
TEXT_NOT_CONSUMED = "text_not_consumed"
GAVE_UP = "gave_up"
SERVER_ERROR = "server_error"


@dataclass(frozen=True)
class Fail:
    """The fetch cannot complete: ``kind`` says why (``TEXT_NOT_CONSUMED``: a chunk must
    come as text and the consumer takes none; ``GAVE_UP``: reconnects exhausted;
    ``SERVER_ERROR``: the sender refused a request that has no fallback)."""

    kind: str
    message: str
    code: str | None = None


Action = SendRequest | SendCancel | Reconnect | ChunkFinished | FailChunk | Fail
