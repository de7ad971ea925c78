"""``Throttle``: at most one log line per interval for an event a peer can repeat at will.

A daemon that logs every malformed request or refused connection lets any client fill
its disk and bury what matters; with a throttle it logs the first occurrence, then at
most one line per ``interval`` seconds that says how many went unlogged in between.

    refusals.log(log, logging.WARNING, "refusing %s", peer, counted="more refused")
    # -> "refusing 10.0.0.7", then a second later "refusing 10.0.0.9; 41 more refused since the last line"

Pure: the clock is injected (``time.monotonic`` by default), so tests need no sleeps.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

#: seconds between two lines of one throttled event
INTERVAL = 1.0


class Throttle:
    def __init__(self, interval: float = INTERVAL, clock: Callable[[], float] = time.monotonic) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be > 0 s, got {interval!r}")
        self.interval = interval
        self.clock = clock
        #: occurrences not logged since the last line
        self.missed = 0
        self._next: float | None = None

    def take(self) -> int | None:
        """One occurrence: the number not logged since the last line when a line is due
        now (the caller logs it), else None (the caller logs nothing)."""
        now = self.clock()
        if self._next is not None and now < self._next:
            self.missed += 1
            return None
        missed, self.missed, self._next = self.missed, 0, now + self.interval
        return missed

    def log(self, logger: logging.Logger | logging.LoggerAdapter, level: int, msg: str, *args: object,
            counted: str = "more") -> None:
        """One occurrence: ``msg % args`` when a line is due, ending "; N <counted> since the
        last line" when N occurrences went unlogged; else nothing."""
        if (missed := self.take()) is not None:
            suffix = f"; {missed} {counted} since the last line" if missed else ""
            logger.log(level, msg + "%s", *args, suffix)
