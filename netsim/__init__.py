"""Bandwidth emulation for KV-cache transfers.

Two ways to put a realistic link between a KV sender and receiver on one machine:

* :class:`ShapingProxy` - a user-space asyncio TCP proxy (rate following a trace, delay,
  jitter, stalls, resets). Works anywhere, no privileges.
* :func:`netns_link` - two network namespaces joined by a veth pair shaped by the kernel's
  ``tc`` (needs root and iproute2): real TCP dynamics at multi-Gbit/s.

Both take a :class:`Trace` (capacity over time); ``trace_set()`` holds the committed
synthetic traces (``trace_set("unseen")`` a second, held-out set). Submodules load
lazily so ``import netsim`` stays cheap.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from netsim.trace import Trace

if TYPE_CHECKING:
    from netsim import generators
    from netsim.netns import NetnsLink, netns_available, netns_link
    from netsim.proxy import LinkSpec, ShapingProxy

__all__ = ["Trace", "ShapingProxy", "LinkSpec", "trace_set", "generators",
           "netns_link", "NetnsLink", "netns_available"]

_LAZY = {
    "ShapingProxy": "netsim.proxy",
    "LinkSpec": "netsim.proxy",
    "netns_link": "netsim.netns",
    "NetnsLink": "netsim.netns",
    "netns_available": "netsim.netns",
}

TRACE_DIR = Path(__file__).with_name("traces")
#: The committed trace sets: ``default`` (``netsim/traces/``) and ``unseen``
#: (``netsim/traces_unseen/``: Markov-modulated with deep fades, held out from tuning).
TRACE_SETS = {"default": TRACE_DIR, "unseen": Path(__file__).with_name("traces_unseen")}


def trace_set(name: str = "default") -> dict[str, Trace]:
    """A committed trace set (``netsim/traces/*.csv`` by default) by trace name, in name order."""
    if name not in TRACE_SETS:
        raise ValueError(f"unknown trace set {name!r}; known: {', '.join(TRACE_SETS)}")
    return {p.stem: Trace.load(p) for p in sorted(TRACE_SETS[name].glob("*.csv"))}


def __getattr__(name: str) -> Any:
    if name == "generators":
        return importlib.import_module("netsim.generators")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'netsim' has no attribute {name!r}")
