"""The caller's recompute cost: as configured, corrected by what its recomputes took.

A text chunk costs the caller a prefill, and the planners weigh it at a
:class:`RecomputeCost` (``PlanInput.text_seconds``, ``recompute_busy``). Two terms:
seconds per token (the model's weights: MLPs and projections), and seconds per pair of a
recomputed token and a token before it (attention over the cache). The second is what a
per-token rate alone misses: chunk ``i`` of a prefix attends to every chunk before it, so
on a small CPU host the last 256-token chunk of a 4K prefix takes several times as long
as the first, and a rate measured on one chunk over an empty cache makes text look
several times cheaper than it is. A receiver on a GPU may leave the second term at 0.

The configured figures are usually measured on an idle machine; during a fetch the
caller's compute shares the host with section decoding and the event loop, so on a small
CPU host a recompute takes markedly longer than idle, and a plan made at the idle cost
runs past its estimate. So the cost a decision uses is the configured one scaled up by
how much slower than it the caller's last few ``on_text`` calls were. Never scaled down:
a caller quicker than it said only makes text look dearer than it is, which costs a level
step, while one slower than it said makes the deadline slip.

Pure; the session records each ``on_text`` call (start, tokens, seconds) and asks here.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

#: How many recent recomputes the cost is judged by: load changes within a fetch, and
#: one slow call should count without a single outlier deciding forever.
RECENT = 3


@dataclass(frozen=True)
class RecomputeCost:
    """Seconds a caller takes to recompute ``tokens`` tokens at positions ``start..``:
    ``per_token`` each, plus ``per_context_token`` for each token before it that it
    attends to (see the module docstring)."""

    per_token: float
    per_context_token: float = 0.0

    def __post_init__(self) -> None:
        if not (self.per_token > 0 and math.isfinite(self.per_token)):
            raise ValueError(f"recompute cost per token must be > 0 s, got {self.per_token}")
        if not (self.per_context_token >= 0 and math.isfinite(self.per_context_token)):
            raise ValueError(f"recompute cost per context token must be >= 0 s, got {self.per_context_token}")

    def seconds(self, start: int, tokens: int) -> float:
        """Seconds to recompute tokens ``start..start + tokens - 1``: each attends to the
        ones before it, ``tokens * start + tokens * (tokens - 1) / 2`` pairs in all."""
        pairs = tokens * start + tokens * (tokens - 1) / 2
        return tokens * self.per_token + pairs * self.per_context_token

    def scaled(self, factor: float) -> "RecomputeCost":
        return RecomputeCost(self.per_token * factor, self.per_context_token * factor)


def recompute_cost(configured: RecomputeCost, observed: Sequence[tuple[int, int, float]]) -> RecomputeCost:
    """The cost to plan text chunks at: ``configured``, scaled up by the ratio of the
    seconds the last ``RECENT`` ``observed`` recomputes ((start, tokens, seconds), oldest
    first) took to what ``configured`` predicted for them, when they were slower.
    Observations of no tokens are ignored."""
    recent = [(start, tokens, seconds) for start, tokens, seconds in observed if tokens > 0][-RECENT:]
    if any(not seconds >= 0 for _, _, seconds in recent):
        raise ValueError(f"recompute seconds must be >= 0, got {recent}")
    if not recent:
        return configured
    factor = (sum(seconds for _, _, seconds in recent)
              / sum(configured.seconds(start, tokens) for start, tokens, _ in recent))
    return configured.scaled(factor) if factor > 1 else configured
