"""Wall time of the CPU decoder's stages, for ``kvwire bench codec --stages``.

The decode path marks its stages with :func:`stage`; while a :func:`recording` is open
in the calling thread, each stage's seconds add up in it, and otherwise a mark costs a
function call. Stages run one after another in the decoding thread (each may use every
core inside it), so their seconds add up to the decode's wall time, less what runs
between them (Python glue, allocation: what the bench reports as the remainder).
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from typing import Iterator

#: the stages the decoder marks, in pipeline order
CRC = "crc"
LANE_TABLE = "lane table"
ENTROPY = "entropy decode + dequantize"
TRANSFORM = "inverse transform"
ROPE = "rope"
CONVERT = "clamp, convert, copy"
STAGES = (CRC, LANE_TABLE, ENTROPY, TRANSFORM, ROPE, CONVERT)

_local = threading.local()
_IDLE = contextlib.nullcontext()


class _Timer:
    __slots__ = ("times", "name", "start")

    def __init__(self, times: dict[str, float], name: str) -> None:
        self.times, self.name = times, name

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.times[self.name] += time.perf_counter() - self.start


def stage(name: str) -> contextlib.AbstractContextManager:
    """A context that adds its wall time to ``name`` in the open recording, if any."""
    times = getattr(_local, "times", None)
    return _IDLE if times is None else _Timer(times, name)


@contextlib.contextmanager
def recording() -> Iterator[dict[str, float]]:
    """Record the stages the calling thread runs inside the block: {stage: seconds}."""
    times: dict[str, float] = defaultdict(float)
    outer = getattr(_local, "times", None)
    _local.times = times
    try:
        yield times
    finally:
        _local.times = outer
