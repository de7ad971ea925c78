"""Cancel and downgrade: whether to abandon the chunk in flight for a cheaper answer.

A chunk is requested at the level the estimate allowed when it was decided; if the
link then drops, the rest of that chunk alone can outlast the deadline, and no later
decision can repair it. Mooncake's rule, made concrete with the planners' cost model
(``base.predicted_seconds``): keep the transfer while finishing it still leaves the
later chunks time for their cheapest answers; otherwise CANCEL it and re-request the
chunk at the best option that makes the deadline, or, when none does, at the fastest
option, provided that finishes sooner than keeping would.

Cancelling is not free: bytes already on their way (the sender's socket buffer and
whatever the path queues) still arrive before the new answer, and the new request
costs a round trip. When those bytes would take longer than opening a new connection
(measured when the session connected), the session aborts the connection instead,
which discards them, and re-requests on a fresh one (``Switch.abort``), as video
players abort a segment download. A lower level is offered only while none of the chunk's layers
has been delivered (a chunk is delivered at one level); text is always possible (it
supersedes delivered layers: the caller recomputes the whole chunk).

Pure: the session calls it on every arrival and on a short timer while a chunk is in
flight; unit tests call it on hand-made situations.
"""
from __future__ import annotations

from dataclasses import dataclass

from streamer.adapt.base import TEXT, Choice, PlanInput, predicted_seconds

#: Bytes assumed already committed to the path when a CANCEL goes out and so still to
#: arrive: the sender keeps at most this much queued in its process and kernel (see
#: ``streamer.net.sender``), plus what the link holds in flight (rate x round trip).
COMMITTED_BYTES = 256 * 1024
#: Switch only when it saves at least this share of the time keeping would take: a
#: marginal gain is not worth the bytes thrown away and the estimate's noise.
MIN_GAIN = 0.25


def cancels_by_default(policy: str) -> bool:
    """Whether a fetch runs the rule when the caller does not say: for mpc, which plans
    against the deadline; greedy stays CacheGen's rule, fixed levels stay fixed."""
    return policy == "mpc"


@dataclass(frozen=True)
class Switch:
    """Abandon the chunk in flight: re-request it as ``choice``; ``abort`` the connection
    (dropping what is queued) rather than send CANCEL."""

    choice: Choice
    abort: bool


@dataclass(frozen=True)
class InFlight:
    """The chunk being received, as the session sees it."""

    level: int
    remaining_bytes: int
    delivered_layers: int


def reconsider(plan: PlanInput, head: InFlight, *, rate: float, rtt: float,
               reconnect_seconds: float) -> Switch | None:
    """What to switch the chunk in flight to, or None to keep it.

    ``plan`` describes the chunk in flight (row 0) and every chunk after it, with
    ``time_left`` the seconds to the deadline net of recompute already owed; ``rate``
    is the robust estimate (bytes/s), partial rate of the chunk in flight included;
    ``reconnect_seconds`` what connecting and opening the context took.
    """
    if not rate > 0:
        return None
    later = sum(_cheapest(plan, chunk, rate) for chunk in range(1, len(plan.sizes)))
    keep = head.remaining_bytes / rate
    if keep + later <= plan.time_left:
        return None
    drain = min(head.remaining_bytes, COMMITTED_BYTES + rate * rtt) / rate
    abort = reconnect_seconds < drain
    restart = (reconnect_seconds if abort else drain) + rtt
    options: list[Choice] = [TEXT]
    if head.delivered_layers == 0:
        options += range(head.level + 1, plan.levels)
    cost = {option: restart + predicted_seconds(plan, option, rate) for option in options}
    fitting = [option for option in options if cost[option] + later <= plan.time_left]
    if fitting:
        choice = min(fitting, key=lambda option: _distortion(plan, option))
    else:
        choice = min(options, key=lambda option: cost[option])
    return Switch(choice, abort) if cost[choice] <= (1 - MIN_GAIN) * keep else None


def _cheapest(plan: PlanInput, chunk: int, rate: float) -> float:
    return min(predicted_seconds(plan, option, rate, chunk)
               for option in [TEXT, *range(plan.levels)])


def _distortion(plan: PlanInput, choice: Choice) -> float:
    return plan.text_penalty if choice == TEXT else plan.distortion[choice]
