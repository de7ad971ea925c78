"""The caller's recompute rate: as configured, corrected by what its recomputes took.

A text chunk costs the caller a prefill, and the planners weigh it at
``recompute_seconds_per_token`` (``PlanInput.text_seconds``, ``recompute_busy``). That
figure is usually measured on an idle machine; during a fetch the caller's compute shares
the host with section decoding and the event loop, so on a small CPU host a recompute takes
markedly longer than idle, and a plan made at the idle rate runs past its estimate. So the
rate a decision uses is the slower of the configured one and the one the caller's last few
``on_text`` calls showed.
Never faster: a caller quicker than it said only makes text look dearer than it is, which
costs a level step, while one slower than it said makes the deadline slip.

Pure; the session records each ``on_text`` call (tokens, seconds) and asks here.
"""
from __future__ import annotations

from collections.abc import Sequence

#: How many recent recomputes the rate is judged by: load changes within a fetch, and
#: one slow call should count without a single outlier deciding forever.
RECENT = 3


def recompute_rate(configured: float, observed: Sequence[tuple[int, float]]) -> float:
    """Seconds per token to plan text chunks at: ``configured``, or the token-weighted
    rate of the last ``RECENT`` ``observed`` recomputes ((tokens, seconds), oldest first)
    when that is slower. Observations of no tokens are ignored."""
    if not configured > 0:
        raise ValueError(f"configured recompute rate must be > 0 s/token, got {configured}")
    recent = [(tokens, seconds) for tokens, seconds in observed if tokens > 0][-RECENT:]
    if any(not seconds >= 0 for _, seconds in recent):
        raise ValueError(f"recompute seconds must be >= 0, got {recent}")
    if not recent:
        return configured
    measured = sum(seconds for _, seconds in recent) / sum(tokens for tokens, _ in recent)
    return max(configured, measured)
