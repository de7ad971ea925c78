"""Adaptation policies: which quality level (or text recompute) for the next chunk.

Policies are pure functions ``PlanInput -> Choice`` shared by the live stream
session and the socket-free simulator. Select one by name with :func:`get_policy`:

* ``mpc`` (default) - robust throughput estimate, exact deadline plan over all chunks
* ``greedy`` - CacheGen's rule: last throughput, equal time split per chunk
* ``fixed:N`` - always level N
* ``text`` - always recompute from token ids
"""
from __future__ import annotations

from streamer.adapt.base import TEXT, Choice, Observation, PlanInput, Policy, predicted_seconds
from streamer.adapt.fixed import fixed
from streamer.adapt.greedy import greedy
from streamer.adapt.mpc import mpc, mpc_plan
from streamer.adapt.text import text

DEFAULT_POLICY = "mpc"

#: Policy names and one-line help; ``fixed:N`` is parsed by :func:`get_policy`.
_DESCRIPTIONS: dict[str, str] = {
    "mpc": "robust throughput estimate + exact deadline plan over all remaining chunks",
    "greedy": "CacheGen's rule: last throughput, equal share of the time left per chunk",
    "fixed:N": "always quality level N (0 = best)",
    "text": "always recompute from token ids (no KV transfer)",
}
_NAMED: dict[str, Policy] = {"mpc": mpc, "greedy": greedy, "text": text}


def names() -> tuple[str, ...]:
    """Valid policy names, ``fixed:N`` standing for any level N."""
    return tuple(_DESCRIPTIONS)


def _unknown(name: str) -> ValueError:
    return ValueError(f"unknown policy {name!r}; valid: {', '.join(names())}")


def _fixed_level(name: str) -> int:
    """N from ``fixed:N``, or a ValueError saying what was expected."""
    _, _, arg = name.partition(":")
    try:
        level = int(arg)
    except ValueError:
        raise ValueError(f"policy {name!r}: expected fixed:N with an integer level N >= 0") \
            from None
    if level < 0:
        raise ValueError(f"policy {name!r}: level must be >= 0")
    return level


def get_policy(name: str) -> Policy:
    """The policy called ``name``; ValueError listing the valid names otherwise."""
    if name in _NAMED:
        return _NAMED[name]
    if name.startswith("fixed:"):
        return fixed(_fixed_level(name))
    raise _unknown(name)


def describe(name: str) -> str:
    """One-line help for policy ``name`` (for CLI ``--help`` text)."""
    if name.startswith("fixed:"):
        return f"always quality level {_fixed_level(name)} (0 = best)"
    if name not in _DESCRIPTIONS:
        raise _unknown(name)
    return _DESCRIPTIONS[name]


__all__ = ["DEFAULT_POLICY", "TEXT", "Choice", "Observation", "PlanInput", "Policy", "describe",
           "fixed", "get_policy", "greedy", "mpc", "mpc_plan", "names", "predicted_seconds",
           "text"]
