"""The receiver's decode cost: seconds per token of a layer section, as its decoder shows it.

A KV chunk is delivered once its sections are decoded, and the decoder is a pipeline
stage of its own: chunk ``i`` decodes while chunk ``i + 1`` arrives. Where the decoder is
slower than the link (a CPU decoder beside a fast link), a plan timed by the link alone
finishes long after its estimate: the decode backlog grows behind the link, and a text
chunk's recompute, which waits for the chunk before it to be delivered, starts that much
later. ``kvwire demo`` on a 2-core host missed its 1 s SLO that way (at 2c693ff: last
byte in at 0.56 s, decode of the backlog until 0.64 s, then a text chunk's 0.41 s
recompute: 1.05 s). So the planners time a KV option at the slower of its transfer and
its decode (``base.link_seconds``), and the decode still owed comes off their budget
(``base.pipeline_budget``).

The cost is counted per token, the same at every level. Most of a section's decode is per
element (rANS symbols, dequantisation, the inverse transform): on the demo's MiniLM chunks
decoded alone, 27 ms a chunk at level 4 and 48 ms at level 0 for four times the bytes.
What the level changes is dwarfed by what load does: during a fetch on 2 cores the same
sections took 2-4x longer while the link ran at 200 Mbit/s (the receiving loop, the
sender and the proxy share the cores) than while it ran at 25 Mbit/s. A per-byte term
fitted on such sections reads that load as a price of bytes (the sections decoded under
load were the large ones) and steered the plan to the smallest level for no gain; one
figure per token, the mean over the recent sections, follows the load and leaves the
level to the link. With decode the bottleneck, every level then holds the pipeline alike,
and the plans' ties go to the better level.

Pure; the delivery times each section as it is decoded, the session asks here.
"""
from __future__ import annotations

from collections.abc import Sequence

#: How many recent sections the rate is judged by: a few chunks' worth, so it follows the
#: load of the moment and no single slow section decides it.
RECENT_SECTIONS = 24


def seconds_per_token(sections: Sequence[tuple[int, float]]) -> float | None:
    """Seconds a section takes to decode per token of it: the token-weighted mean over the
    last ``RECENT_SECTIONS`` of ``sections`` ((tokens, seconds), oldest first), or None with
    none (sections of no tokens are ignored)."""
    recent = [(tokens, seconds) for tokens, seconds in sections if tokens > 0][-RECENT_SECTIONS:]
    if any(not seconds >= 0 for _, seconds in recent):
        raise ValueError(f"decode seconds must be >= 0, got {recent}")
    if not recent:
        return None
    return sum(seconds for _, seconds in recent) / sum(tokens for tokens, _ in recent)
