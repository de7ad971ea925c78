"""Fixed-level policy: a reference point that ignores the link entirely."""
from __future__ import annotations

from streamer.adapt.base import Choice, PlanInput, Policy, check_level


def fixed(level: int) -> Policy:
    """A policy that always picks ``level``.

    The range can only be checked against an input (the ladder's length is not known
    here), so a level beyond the ladder raises ValueError on the first call.
    """
    if isinstance(level, bool) or not isinstance(level, int) or level < 0:
        raise ValueError(f"fixed level must be an integer >= 0, got {level!r}")

    def policy(inp: PlanInput) -> Choice:
        return check_level(level, inp.levels)

    policy.__name__ = f"fixed_{level}"
    policy.__doc__ = f"Always level {level}."
    return policy
