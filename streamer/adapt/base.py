"""Types shared by the adaptation policies, and the helpers every policy needs.

A policy is a pure function ``PlanInput -> Choice`` called once per chunk, just
before that chunk is requested: it sees the sizes of every remaining chunk at every
level (each chunk is pre-encoded at all levels, so nothing is guessed there), the
time left to the deadline and the transfers measured so far, and names a level for
the first remaining chunk, or :data:`TEXT` to have the caller recompute that chunk
from its token ids instead of fetching its KV.

Options are laid out as columns ``0 .. L-1`` (the levels, best first) and column
``L`` (text), so planners can treat the text fallback as one more option with its
own time and cost instead of a special case.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

#: The choice that skips the KV of a chunk: the caller recomputes it from token ids.
TEXT = "text"

#: A level index (0 = best quality), or :data:`TEXT`.
Choice = int | str


@dataclass(frozen=True)
class Observation:
    """One finished chunk transfer, measured at the receiver.

    ``busy_seconds`` counts only the time the link was busy delivering the chunk:
    sender-side clocks and idle gaps make a link look slower or faster than it is.
    """

    bytes: int
    busy_seconds: float
    #: the link carried at most this much (a stall judged before a real sample): fit to
    #: decide on within the fetch, not to remember for the next one (``estimator.remember``)
    upper_bound: bool = False

    def __post_init__(self) -> None:
        if self.bytes < 0 or not self.busy_seconds >= 0:
            raise ValueError(f"invalid observation {self}: bytes and busy_seconds must be >= 0")


@dataclass(frozen=True)
class Abandon:
    """The fetch runs the cancel rule (``adapt.cancel``): a KV chunk that proves too slow
    is abandoned for text, at a cost bounded by these (``cancel.abandon_seconds``)."""

    rtt: float
    reconnect_seconds: float

    def __post_init__(self) -> None:
        if not self.rtt >= 0 or not self.reconnect_seconds >= 0:
            raise ValueError(f"invalid {self}: rtt and reconnect_seconds must be >= 0")


@dataclass(frozen=True)
class PlanInput:
    """Everything a policy may look at for one decision.

    Row 0 of ``sizes`` (and entry 0 of the per-chunk sequences) is the chunk being
    decided now; later rows are the chunks after it, which planners look ahead at.
    """

    sizes: Sequence[Sequence[int]]
    text_bytes: Sequence[int]
    text_seconds: Sequence[float]
    distortion: Sequence[float]
    time_left: float
    history: Sequence[Observation]
    prior_bps: float | None = None
    text_penalty: float = 1.0
    #: log prediction errors measured on this peer in earlier fetches, oldest first
    #: (``estimator.log_errors``): what calibrates the estimate before this fetch has any
    prior_errors: Sequence[float] = ()
    #: set when a KV chunk can be abandoned once it proves too slow; None: every request is final
    abandon: Abandon | None = None
    #: seconds of recompute the caller still owes for earlier chunks sent as text: it runs
    #: while row 0 and later chunks stream, and row 0 is delivered only after it
    #: (``adapt.overlap``); ``time_left`` does not have it taken off
    recompute_busy: float = 0.0
    #: seconds the receiver takes to decode each chunk [chunks][levels] (``adapt.decoding``):
    #: a KV option holds the pipeline for the slower of its transfer and its decode
    #: (:func:`link_seconds`); empty: the decoder keeps up with any link
    decode_seconds: Sequence[Sequence[float]] = ()
    #: seconds of decoding still owed for chunks already requested beyond what their bytes
    #: still take to arrive (already off ``time_left``): row 0 decodes only after it
    decode_busy: float = 0.0
    #: the level the chunk before row 0 was requested at in this fetch (None: it was text,
    #: or row 0 is the fetch's first): mpc may hold it against a small step (``adapt.mpc``)
    previous_level: int | None = None
    #: the caller's recompute runs beside the decoder and the link (a GPU recomputing while
    #: a CPU decodes: text overlaps later transfers, ``adapt.overlap``); False where both
    #: share the same cores (a CPU-only host), so each second of recompute is a second the
    #: decoder loses and every plan is timed in series
    recompute_overlaps: bool = True

    def __post_init__(self) -> None:
        # Shape checks only (cheap, O(chunks)): a mismatch here would otherwise
        # surface as a wrong decision deep inside a numpy broadcast.
        chunks, levels = len(self.sizes), len(self.distortion)
        if chunks == 0:
            raise ValueError("PlanInput needs at least one remaining chunk")
        if levels == 0:
            raise ValueError("PlanInput needs at least one level")
        if any(len(row) != levels for row in self.sizes):
            raise ValueError(f"every row of sizes must have {levels} levels (one per distortion)")
        if len(self.text_bytes) != chunks or len(self.text_seconds) != chunks:
            raise ValueError(f"text_bytes and text_seconds need one entry per chunk ({chunks})")
        if self.prior_bps is not None and not self.prior_bps > 0:
            raise ValueError(f"prior_bps must be > 0 or None, got {self.prior_bps}")
        if not self.text_penalty >= 0:
            raise ValueError(f"text_penalty must be >= 0, got {self.text_penalty}")
        if not self.recompute_busy >= 0:
            raise ValueError(f"recompute_busy must be >= 0, got {self.recompute_busy}")
        if not self.decode_busy >= 0:
            raise ValueError(f"decode_busy must be >= 0, got {self.decode_busy}")
        if self.decode_seconds and (len(self.decode_seconds) != chunks
                                    or any(len(row) != levels for row in self.decode_seconds)):
            raise ValueError(f"decode_seconds needs {chunks} rows of {levels} levels, or none")
        if self.previous_level is not None:
            check_level(self.previous_level, levels)

    @property
    def levels(self) -> int:
        """Number of quality levels (the text option is column ``levels``)."""
        return len(self.distortion)


Policy = Callable[[PlanInput], Choice]


def choice_of(column: int, levels: int) -> Choice:
    """The :data:`Choice` named by option column ``column`` (``levels`` means text)."""
    return TEXT if column == levels else int(column)


def option_costs(inp: PlanInput) -> np.ndarray:
    """Cost per option column: each level's distortion, then ``text_penalty``."""
    return np.append(np.asarray(inp.distortion, dtype=np.float64), float(inp.text_penalty))


def link_seconds(inp: PlanInput, estimate: float) -> np.ndarray:
    """Seconds [chunks, levels + 1] each option of every remaining chunk holds the
    transfer pipeline at ``estimate`` bytes/s: a level's bytes, or its decode where that
    is slower (chunk ``i`` decodes while chunk ``i + 1`` arrives: ``adapt.decoding``), or
    text's token ids (its recompute runs on the caller's compute: ``adapt.overlap``)."""
    if not estimate > 0:
        raise ValueError(f"estimate must be > 0 bytes/s, got {estimate}")
    sizes = np.asarray(inp.sizes, dtype=np.float64) / estimate
    if inp.decode_seconds:
        sizes = np.maximum(sizes, np.asarray(inp.decode_seconds, dtype=np.float64))
    text = np.asarray(inp.text_bytes, dtype=np.float64) / estimate
    return np.concatenate((sizes, text[:, None]), axis=1)


def pipeline_budget(inp: PlanInput) -> float:
    """``time_left`` less what the decoder adds beyond the pipeline :func:`link_seconds`
    times: the decode still owed for chunks already requested. (After the last byte only
    the last section's decode is left, a layer's share of a chunk's: the sections of a
    chunk pipeline too, and the planners' margin covers it.)"""
    return inp.time_left - inp.decode_busy


def option_seconds(inp: PlanInput, estimate: float) -> np.ndarray:
    """Predicted seconds [chunks, levels + 1] of every option of every remaining chunk,
    counted in series: :func:`link_seconds`, with text's recompute added to its token
    ids (an upper bound: recompute may overlap later transfers, ``adapt.overlap``)."""
    seconds = link_seconds(inp, estimate)
    seconds[:, -1] += np.asarray(inp.text_seconds, dtype=np.float64)
    return seconds


def predicted_seconds(inp: PlanInput, choice: Choice, estimate: float, chunk: int = 0) -> float:
    """Predicted seconds for ``choice`` on remaining chunk ``chunk`` at ``estimate`` bytes/s,
    in series (:func:`option_seconds`), for callers that log predictions or cancel a
    transfer predicted to miss the deadline."""
    if not estimate > 0:
        raise ValueError(f"estimate must be > 0 bytes/s, got {estimate}")
    if choice == TEXT:
        return inp.text_bytes[chunk] / estimate + float(inp.text_seconds[chunk])
    seconds = inp.sizes[chunk][check_level(choice, inp.levels)] / estimate
    return max(seconds, float(inp.decode_seconds[chunk][choice])) if inp.decode_seconds else seconds


def check_level(level: Choice, levels: int) -> int:
    """``level`` as an index, or a ValueError naming the valid range."""
    if isinstance(level, bool) or not isinstance(level, (int, np.integer)) \
            or not 0 <= level < levels:
        raise ValueError(f"level {level!r} out of range: this input has levels 0..{levels - 1}")
    return int(level)


def probe_level(inp: PlanInput) -> int:
    """The level with the fewest bytes for chunk 0 (ties: the better level).

    Used when nothing is known about the link (no history, no prior). The first
    chunk is the probe that produces the estimate every later decision rests on, and
    with no estimate no choice can be checked against the deadline; sending the
    smallest encoding bounds what an unexpectedly slow link can cost to one small
    chunk, and its measured rate then drives the rest of the fetch.
    """
    return int(np.argmin(np.asarray(inp.sizes[0])))
