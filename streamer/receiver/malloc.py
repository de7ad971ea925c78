"""Keep a long-running receiver's resident memory near what it uses: glibc malloc settings
at start and a periodic ``malloc_trim``.

Why: with glibc's defaults a busy receiver's RSS rises well past its warm-up level though
nothing leaks: the Python heap stays flat and the bytes malloc has handed out return to
their level once the fetches are over, but most of the RSS is memory malloc holds free,
which ``malloc_trim(0)`` gives back. glibc keeps freed memory: its mmap threshold rises
after the first large block is freed, so decoded layers and frame buffers of 128-256 KB
land in the heap instead of in mappings returned at ``free``, and every fetch decodes on
a thread of its own, so up to 8 arenas per core each keep their own high-water mark.
Tuned and trimmed, RSS stays near its warm-up level between bursts; under load it still
follows what the fetches in flight hold (decoded layers waiting for their consumer).
``kvwire bench load`` reports the receiver's RSS over a soak.

``tune`` fixes the mmap threshold at 128 KiB (a fixed value also turns the dynamic one
off) and caps the arenas at 2; ``trim_periodically`` hands what is still free back to the
kernel every few seconds, on a worker thread: it walks the free lists, each arena locked
meanwhile, which took tens of ms with a few hundred MB of holes, and the event loop's
arrival timestamps feed the throughput estimate (ctypes releases the GIL for the call). A
setting the user already chose through the environment (``MALLOC_ARENA_MAX``,
``MALLOC_MMAP_THRESHOLD_``, ``GLIBC_TUNABLES``) is left as it is. Off glibc (musl, macOS)
everything here does nothing.
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
from typing import Any, Mapping

log = logging.getLogger("kvwire.receiver")

#: mallopt parameters (glibc's malloc.h)
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

ARENA_MAX = 2
MMAP_THRESHOLD = 128 * 1024
#: seconds between two trims in a daemon
TRIM_SECONDS = 2.0

#: mallopt parameter -> (its name, the environment variable and the GLIBC_TUNABLES key
#: through which a user may already have set it, the value set here)
_SETTINGS = {
    M_ARENA_MAX: ("arena_max", "MALLOC_ARENA_MAX", "glibc.malloc.arena_max", ARENA_MAX),
    M_MMAP_THRESHOLD: ("mmap_threshold", "MALLOC_MMAP_THRESHOLD_", "glibc.malloc.mmap_threshold",
                       MMAP_THRESHOLD),
}


def settings(environ: Mapping[str, str]) -> dict[int, int]:
    """The mallopt parameters to set, {parameter: value}: those the environment leaves unset."""
    tunables = {item.partition("=")[0] for item in environ.get("GLIBC_TUNABLES", "").replace(":", " ").split()}
    return {param: value for param, (_, var, tunable, value) in _SETTINGS.items()
            if var not in environ and tunable not in tunables}


def _glibc() -> Any:
    """The C library when it is glibc (has mallopt and malloc_trim), else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt, libc.malloc_trim   # noqa: B018 - AttributeError off glibc
    except (OSError, AttributeError):
        return None
    return libc


class Malloc:
    """glibc's allocator controls through ``libc`` (None: not glibc, all no-ops);
    ``Malloc.here()`` for this process's."""

    def __init__(self, libc: Any) -> None:
        self._libc = libc

    @classmethod
    def here(cls) -> "Malloc":
        return cls(_glibc())

    @property
    def available(self) -> bool:
        return self._libc is not None

    def tune(self, environ: Mapping[str, str]) -> dict[str, int]:
        """Apply ``settings(environ)``; {name: value} of those glibc accepted."""
        if self._libc is None:
            return {}
        applied = {}
        for param, value in settings(environ).items():
            if self._libc.mallopt(param, value) == 1:
                applied[_SETTINGS[param][0]] = value
        return applied

    def trim(self) -> bool:
        """Give free heap memory back to the kernel; True when some was."""
        return self._libc is not None and bool(self._libc.malloc_trim(0))


async def trim_periodically(malloc: Malloc, seconds: float = TRIM_SECONDS) -> None:
    """Trim every ``seconds``, off the event loop's thread, until cancelled (returns at
    once off glibc)."""
    if not malloc.available:
        return
    while True:
        await asyncio.sleep(seconds)
        await asyncio.to_thread(malloc.trim)


class Tuning:
    """This process's allocator tuned and its periodic trim running (needs a running loop);
    ``stop`` ends the trim (the settings stay: they are the process's)."""

    def __init__(self, environ: Mapping[str, str], seconds: float = TRIM_SECONDS,
                 malloc: Malloc | None = None) -> None:
        malloc = malloc if malloc is not None else Malloc.here()
        self.seconds = seconds
        self.applied = malloc.tune(environ)
        self._task = asyncio.create_task(trim_periodically(malloc, seconds), name="kvwire-malloc-trim") \
            if malloc.available else None
        if self._task is not None:
            log.info("malloc: %s", self.describe())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def describe(self) -> str:
        if self._task is None:
            return "not glibc: left as it is"
        settings = ", ".join(f"{k}={v}" for k, v in self.applied.items()) or "settings from the environment"
        return f"{settings}, trimmed every {self.seconds:g} s"
