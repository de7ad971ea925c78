"""Text-only policy: always recompute, the "no KV streaming" baseline."""
from __future__ import annotations

from streamer.adapt.base import TEXT, Choice, PlanInput


def text(inp: PlanInput) -> Choice:
    """Always :data:`TEXT`: fetch token ids only and recompute every chunk."""
    return TEXT
