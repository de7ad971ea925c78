"""Pure scheduling for the shaping proxy: token bucket, delay line, fault schedule.

Nothing here touches sockets or clocks; every method takes ``now`` (seconds on any
monotonic clock). That keeps the timing logic exactly testable and lets the asyncio
adapter in ``proxy.py`` stay a thin loop of "ask, sleep, write".
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal, Sequence

from netsim.trace import Trace

KiB = 1024


class TokenBucket:
    """Byte credit for one link direction, refilled by integrating its :class:`Trace`.

    Refill is ``trace.bits_between`` over the elapsed interval, so a rate change inside
    the trace is honoured exactly rather than sampled. The bucket starts empty (a fresh
    link has no credit, so short measurements are not inflated by an initial burst) and
    holds at most ``burst`` bytes: ``burst_s`` of the current rate, but never less than
    ``min_burst`` so a late timer wake-up at low rates does not forfeit credit.
    """

    def __init__(self, trace: Trace | None, now: float, *, burst_s: float = 0.02,
                 min_burst: int = 32 * KiB, max_piece: int = 256 * KiB) -> None:
        self._trace = trace
        self._origin = now
        self._last = now
        self._tokens = 0.0
        self._burst_s = burst_s
        self._min_burst = min_burst
        self._max_piece = max_piece

    @property
    def trace(self) -> Trace | None:
        return self._trace

    def set_trace(self, trace: Trace | None, now: float) -> None:
        """Switch traces; the new trace's time 0 is ``now``. Credit earned so far is kept
        (then capped to the new burst) so a switch neither loses nor invents bytes."""
        self._refill(now)
        self._trace = trace
        self._origin = now
        self._tokens = min(self._tokens, self.burst(now))

    def rate(self, now: float) -> float:
        """Current capacity in bytes/s (``inf`` when unshaped)."""
        if self._trace is None:
            return math.inf
        return self._trace.rate_at(now - self._origin) * 1e6 / 8

    def burst(self, now: float) -> float:
        return max(float(self._min_burst), self.rate(now) * self._burst_s)

    def piece(self, now: float) -> int:
        """How many bytes to request at once: half a burst, so one timer wake-up moves
        about ``burst_s / 2`` of traffic (a few hundred wake-ups per second at any rate)
        while a late wake-up still finds room in the bucket."""
        if self._trace is None:
            return self._max_piece
        return int(max(1, min(self._max_piece, self.burst(now) / 2)))

    def take(self, nbytes: int, now: float) -> float:
        """Spend ``nbytes`` and return 0, or spend nothing and return the seconds until
        they would be available (``inf`` if the trace ends at zero capacity).

        A request larger than the burst is granted once the bucket is full and leaves it
        in debt, so no request size can wait forever and the long-run byte count stays
        exact.
        """
        if self._trace is None:
            return 0.0
        self._refill(now)
        need = min(float(nbytes), self.burst(now))
        if self._tokens >= need:
            self._tokens -= nbytes
            return 0.0
        wait = self._trace.time_to_send((need - self._tokens) * 8, now - self._origin)
        # Guard against float rounding reporting "not yet" with a zero wait.
        return max(wait, 1e-6)

    def _refill(self, now: float) -> None:
        if now <= self._last:
            return
        if self._trace is not None:
            earned = self._trace.bits_between(self._last - self._origin, now - self._origin) / 8
            self._tokens = min(self.burst(now), self._tokens + earned)
        self._last = now


class DelayLine:
    """Release times for pieces entering a link with one-way delay and jitter.

    Jitter is uniform in ``[-jitter, +jitter]`` around ``delay`` (clamped at 0), and a
    release never precedes the previous one: a TCP byte stream cannot be reordered.
    Delay is a timestamp, not a sleep, so it adds latency without reducing throughput.
    """

    def __init__(self, delay_s: float, jitter_s: float = 0.0, rng: random.Random | None = None) -> None:
        if delay_s < 0 or jitter_s < 0:
            raise ValueError(f"delay and jitter must be non-negative, got {delay_s}, {jitter_s}")
        self._delay = delay_s
        self._jitter = jitter_s
        self._rng = rng or random.Random(0)
        self._last = -math.inf

    def release_at(self, now: float) -> float:
        d = self._delay
        if self._jitter:
            d = max(0.0, d + self._rng.uniform(-self._jitter, self._jitter))
        self._last = max(now + d, self._last)
        return self._last


@dataclass(frozen=True)
class Stall:
    """Forward nothing from ``at`` seconds (after the connection opened) for ``duration``."""

    at: float
    duration: float

    def __post_init__(self) -> None:
        if self.at < 0 or self.duration < 0:
            raise ValueError(f"stall times must be non-negative, got at={self.at}, duration={self.duration}")


@dataclass(frozen=True)
class Cut:
    """End the connection with a ``reset`` (RST) or a clean ``close`` (FIN), either after
    exactly ``at_byte`` bytes have been forwarded in the direction that carries it, or at
    ``at_s`` seconds after the connection opened."""

    action: Literal["reset", "close"]
    at_s: float | None = None
    at_byte: int | None = None

    def __post_init__(self) -> None:
        if self.action not in ("reset", "close"):
            raise ValueError(f"action must be 'reset' or 'close', got {self.action!r}")
        if (self.at_s is None) == (self.at_byte is None):
            raise ValueError("give exactly one of at_s and at_byte")
        if (self.at_s or 0) < 0 or (self.at_byte or 0) < 0:
            raise ValueError("cut position must be non-negative")


class FaultSchedule:
    """When one direction of one connection must stall or be cut.

    Times are seconds since the connection opened (``elapsed``), byte positions count the
    bytes forwarded in this direction: faults then land at the same point of a transfer
    however long the proxy has been running.
    """

    def __init__(self, stalls: Sequence[Stall] = (), cut: Cut | None = None) -> None:
        self._stalls = sorted(stalls, key=lambda s: s.at)
        self.cut = cut

    def stalled_until(self, elapsed: float) -> float | None:
        """End of the stall covering ``elapsed`` (chaining overlapping stalls), else None."""
        end = None
        t = elapsed
        for s in self._stalls:
            if s.at <= t < s.at + s.duration:
                t = end = s.at + s.duration
        return end

    def bytes_before_cut(self, sent: int) -> int | None:
        """Bytes still allowed before the byte-offset cut; None if there is none."""
        if self.cut is None or self.cut.at_byte is None:
            return None
        return max(self.cut.at_byte - sent, 0)

    def cut_time(self) -> float | None:
        return None if self.cut is None else self.cut.at_s
