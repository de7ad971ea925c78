"""Depth-limited software pipeline: start item i+1 before finishing item i, keep order.

The GPU decoder submits a layer section (host-to-device copy on one CUDA stream, kernel
and GEMM on another) and only later waits for it; running ``depth`` submissions ahead
is what lets the copy of the next section overlap the decode of this one. Kept apart
from CUDA so its ordering and error rules are tested on machines without a GPU.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Iterable, Iterator, TypeVar

Item = TypeVar("Item")
Pending = TypeVar("Pending")
Result = TypeVar("Result")


def pipelined(items: Iterable[Item], submit: Callable[[Item], Pending],
              finish: Callable[[Pending], Result], depth: int = 2) -> Iterator[Result]:
    """Yield ``finish(submit(item))`` for each item, in order, with up to ``depth``
    submissions outstanding. An exception from ``submit`` or ``finish`` propagates
    when its item's turn comes; nothing after it is yielded (later submissions are
    simply dropped: their work is wasted, never delivered)."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    inflight: deque[Pending] = deque()
    source = iter(items)
    exhausted = False
    while True:
        while not exhausted and len(inflight) < depth:
            try:
                item = next(source)
            except StopIteration:
                exhausted = True
                break
            inflight.append(submit(item))
        if not inflight:
            return
        yield finish(inflight.popleft())
