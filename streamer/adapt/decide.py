"""One adaptation decision, built from a manifest: shared by StreamSession and the simulator.

Both the live receiver and the socket-free simulator call ``decide`` with what they
observed, so a recorded throughput history gives the same choices in both.
"""
from __future__ import annotations

from typing import Sequence

from streamer.wire.manifest import Manifest
import numpy as np

from streamer.adapt.base import Abandon, link_seconds
from streamer.adapt.decoding import DecodeCost
from streamer.adapt.estimator import DEFAULT_WINDOW, robust_estimate
from streamer.adapt.policies import TEXT, Choice, Observation, PlanInput, Policy
from streamer.adapt.recompute import RecomputeCost

#: Chunks requested beyond the one in progress (text requests are tiny and not counted):
#: one keeps the link busy; more would commit decisions to an estimate the next samples
#: may overturn.
MAX_QUEUED_AHEAD = 1
#: Size the planners see for a level the context was not stored at: never affordable.
UNAVAILABLE_BYTES = 1 << 50
#: Default recompute cost: seconds of prefill per token on the serving GPU. The caller
#: knows its model and hardware and should pass its own figure.
DEFAULT_RECOMPUTE_SECONDS_PER_TOKEN = 1e-4


def time_left(until_deadline: float, outstanding_bytes: float, estimate: float | None, rtt: float) -> float:
    """Seconds the chunks not yet requested have: the deadline, less the bytes still due on
    earlier requests at ``estimate`` (and at least the new request's round trip: its answer
    cannot come sooner). The recompute owed for chunks already sent to text is not taken
    off: it overlaps what follows (``PlanInput.recompute_busy``, ``adapt.overlap``)."""
    due = outstanding_bytes / estimate if estimate else 0.0
    return until_deadline - max(due, rtt)


def plan_input(manifest: Manifest, first_chunk: int, *, time_left: float,
               history: Sequence[Observation], prior_bps: float | None,
               recompute: RecomputeCost, text_penalty: float = 1.0,
               prior_errors: Sequence[float] = (), abandon: Abandon | None = None,
               recompute_busy: float = 0.0, decode_cost: DecodeCost | None = None,
               decode_busy: float = 0.0, previous: Choice | None = None,
               recompute_overlaps: bool = True) -> PlanInput:
    """The policy's view of chunks ``first_chunk..`` of a manifest; each option's decode is
    timed at ``decode_cost`` (``adapt.decoding``; None: not timed), each text chunk at
    ``recompute`` at its position (``recompute_overlaps``: whether it runs beside the
    decoder, ``PlanInput``); ``previous`` is what the chunk before was requested as (None
    for the first)."""
    chunks = manifest.chunks[first_chunk:]
    sizes = [[size if size > 0 else UNAVAILABLE_BYTES for size in c.sizes] for c in chunks]
    # the exact level's raw sections are copied, not decoded: no decode to time
    decode_seconds = () if decode_cost is None else [
        [0.0 if manifest.is_exact(level) else decode_cost.seconds(manifest.layers * (c.end - c.start), size)
         for level, size in enumerate(row)]
        for c, row in zip(chunks, sizes)]
    return PlanInput(
        sizes=sizes,
        text_bytes=[c.text_bytes for c in chunks],
        text_seconds=[recompute.seconds(c.start, c.end - c.start) for c in chunks],
        distortion=list(manifest.level_distortion),
        time_left=time_left, history=list(history), prior_bps=prior_bps, text_penalty=text_penalty,
        prior_errors=tuple(prior_errors), abandon=abandon, recompute_busy=recompute_busy,
        decode_seconds=decode_seconds, decode_busy=decode_busy,
        previous_level=None if previous is None or previous == TEXT else int(previous),
        recompute_overlaps=recompute_overlaps)


def decide(policy: Policy, manifest: Manifest, first_chunk: int, *, time_left: float,
           history: Sequence[Observation], prior_bps: float | None,
           recompute: RecomputeCost, prior_errors: Sequence[float] = (),
           abandon: Abandon | None = None, recompute_busy: float = 0.0,
           until_deadline: float | None = None, decode_cost: DecodeCost | None = None,
           decode_busy: float = 0.0, previous: Choice | None = None,
           recompute_overlaps: bool = True) -> tuple[Choice, str | None]:
    """(choice, reason) for chunk ``first_chunk``; reason is set when the rule, not the policy, chose.

    With no time left nothing can make the deadline any more, and the policy (whose
    objective is quality within it) is not asked: the chunk goes at whatever finishes it
    soonest (:func:`fastest_option`), which is text where recomputing is cheap (a GPU
    host) and a level where it is dear (a CPU host recomputing a long prefix: text would
    make the miss several times worse). ``until_deadline`` (the deadline less now, when
    the caller knows it) lets the reason say whether the deadline has passed or only the
    bytes already requested are predicted to take what is left of it.
    ``previous`` is what chunk ``first_chunk - 1`` was requested as (a planner may hold
    its level: ``adapt.mpc``).
    """
    inp = plan_input(manifest, first_chunk, time_left=time_left, history=history, prior_bps=prior_bps,
                     prior_errors=prior_errors, abandon=abandon, recompute_busy=recompute_busy,
                     recompute=recompute, decode_cost=decode_cost, decode_busy=decode_busy, previous=previous,
                     recompute_overlaps=recompute_overlaps)
    if time_left <= 0:
        if until_deadline is None or until_deadline <= 0:
            why = "deadline passed"
        else:
            why = (f"no time left: the bytes already requested are predicted to take the "
                   f"{until_deadline:.3g} s to the deadline")
        choice = fastest_option(inp)
        return choice, why if choice == TEXT else f"{why}: level {choice} finishes the chunk soonest"
    choice = policy(inp)
    if choice != TEXT and manifest.chunks[first_chunk].sizes[choice] == 0:
        raise ValueError(f"policy chose level {choice}, which chunk {first_chunk} was not stored at")
    return choice, None


def fastest_option(inp: PlanInput) -> Choice:
    """The option of chunk 0 that finishes it soonest at the link's robust estimate: a
    level's transfer or decode, whichever holds the pipeline longer, or text's token ids
    and then its recompute, which waits for the recompute already owed
    (``recompute_busy``). Ties go to the better level. Text when nothing says how fast the
    link is."""
    estimate = robust_estimate(inp.history, DEFAULT_WINDOW, inp.prior_bps, inp.prior_errors)
    if estimate is None:
        return TEXT
    seconds = link_seconds(inp, estimate)[0]
    # (on shared cores the recompute owed holds up every option alike)
    text_starts = max(seconds[-1], inp.recompute_busy) if inp.recompute_overlaps else seconds[-1]
    seconds[-1] = text_starts + inp.text_seconds[0]
    best = int(np.argmin(seconds))
    return TEXT if best == inp.levels else best
