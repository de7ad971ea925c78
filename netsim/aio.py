"""Run a coroutine on uvloop when it is installed.

The proxy's hot path is event-loop bound; uvloop roughly halves its CPU per byte, which
is what keeps ~1 Gbit/s within one of this machine's two cores.
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

T = TypeVar("T")


def run(main: Awaitable[T]) -> T:
    try:
        import uvloop
    except ImportError:
        loop = asyncio.new_event_loop()
    else:
        loop = uvloop.new_event_loop()
    try:
        return loop.run_until_complete(main)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
