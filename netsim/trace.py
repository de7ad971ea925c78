"""Link-capacity traces: a piecewise-constant rate over time.

A trace is a list of ``(seconds, mbit_per_s)`` samples, the convention of the FCC
broadband and Norway HSDPA traces used in adaptive-bitrate research, so those files load
as they are. Sample *i* holds from ``t_i`` until ``t_{i+1}``; the first rate also covers
any time before the first sample, and **the last rate holds forever after the end**.
Holding (rather than looping) keeps ``rate_at``, ``bits_between`` and ``time_to_send``
exact and monotonic for any time, so a shaper that outlives its trace simply keeps the
final rate instead of jumping back to the start.

Everything the token bucket and the simulator need is an exact integral of this step
function (no sampling), so rates and byte counts agree to floating-point precision.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np

_BITS_PER_MBIT = 1e6


class Trace:
    """An immutable piecewise-constant link capacity in Mbit/s.

    ``duration`` is the time of the last sample: the span the samples describe. A trace
    built from a uniformly sampled series therefore ends at the last sample's start, and
    ``mean`` is the time-weighted mean over ``[0, duration]``.
    """

    __slots__ = ("times", "rates", "name", "_cum_mbit")

    def __init__(self, times: Sequence[float] | np.ndarray, rates: Sequence[float] | np.ndarray,
                 name: str = "") -> None:
        t = np.array(times, dtype=float)  # a private copy, frozen below
        r = np.array(rates, dtype=float)
        _validate(t, r)
        t.setflags(write=False)
        r.setflags(write=False)
        self.times = t
        self.rates = r
        self.name = name
        # Cumulative Mbit delivered from time 0 up to each sample time; the integrals
        # below are a binary search plus one multiply.
        lead = t[0] * r[0]
        cum = np.concatenate(([lead], lead + np.cumsum(r[:-1] * np.diff(t))))
        cum.setflags(write=False)
        self._cum_mbit = cum

    # ----------------------------------------------------------------- construction
    @classmethod
    def constant(cls, mbit_per_s: float, seconds: float, name: str = "") -> Trace:
        """Two samples, so ``duration == seconds`` and the rate holds after it."""
        if seconds <= 0:
            raise ValueError(f"seconds must be positive, got {seconds}")
        return cls([0.0, float(seconds)], [mbit_per_s, mbit_per_s], name=name or f"constant-{mbit_per_s:g}")

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read ``seconds, mbit_per_s`` rows (comma or whitespace separated).

        Blank lines and ``#`` comments are skipped and a single non-numeric first row is
        taken as a header; any other unparsable row is an error naming its line, since a
        silently dropped row would shift the whole capacity curve.
        """
        path = Path(path)
        times: list[float] = []
        rates: list[float] = []
        seen_row = False
        for lineno, raw in enumerate(path.read_text().splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            fields = line.replace(",", " ").split()
            first_row = not seen_row
            seen_row = True
            if len(fields) < 2:
                if first_row and not _numeric(fields[0]):
                    continue
                raise ValueError(f"{path}:{lineno}: expected 'seconds, mbit_per_s', "
                                 f"got {raw.strip()!r} (missing value)")
            if len(fields) > 2:
                raise ValueError(f"{path}:{lineno}: expected 2 columns, got {len(fields)}: {raw.strip()!r}")
            if not (_numeric(fields[0]) and _numeric(fields[1])):
                if first_row:
                    continue  # header row
                raise ValueError(f"{path}:{lineno}: non-numeric value in {raw.strip()!r}")
            times.append(float(fields[0]))
            rates.append(float(fields[1]))
        if not times:
            raise ValueError(f"{path}: trace has no samples")
        try:
            return cls(times, rates, name=path.stem)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    def to_csv(self) -> str:
        """CSV text that :meth:`load` reads back exactly (``repr`` round-trips floats)."""
        lines = [f"# kvwire link trace {self.name}".rstrip(), "seconds,mbit_per_s"]
        lines += [f"{float(t)!r},{float(r)!r}" for t, r in zip(self.times, self.rates)]
        return "\n".join(lines) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_csv())

    # ----------------------------------------------------------------- queries
    @property
    def duration(self) -> float:
        return float(self.times[-1])

    @property
    def mean(self) -> float:
        """Time-weighted mean Mbit/s over ``[0, duration]``."""
        if self.duration == 0:
            return float(self.rates[0])
        return float(self._cum_mbit[-1] / self.duration)

    @property
    def low(self) -> float:
        return float(self.rates.min())

    @property
    def high(self) -> float:
        return float(self.rates.max())

    def percentile(self, q: float) -> float:
        """Time-weighted percentile: the rate the link is at or below ``q``% of the time."""
        if not 0 <= q <= 100:
            raise ValueError(f"percentile must be in [0, 100], got {q}")
        if len(self.times) == 1:
            return float(self.rates[0])
        weights = np.diff(self.times)
        order = np.argsort(self.rates[:-1], kind="stable")
        cum = np.cumsum(weights[order])
        idx = int(np.searchsorted(cum, q / 100 * cum[-1], side="left"))
        return float(self.rates[:-1][order][min(idx, len(order) - 1)])

    def rate_at(self, t: float) -> float:
        """Mbit/s at time ``t``: the last sample at or before ``t`` (held past the end)."""
        i = int(np.searchsorted(self.times, t, side="right")) - 1
        return float(self.rates[max(i, 0)])

    def bits_between(self, t0: float, t1: float) -> float:
        """Exact bits the link carries in ``[t0, t1]``."""
        if t1 < t0:
            raise ValueError(f"t1 ({t1}) is before t0 ({t0})")
        return (self._mbit_until(t1) - self._mbit_until(t0)) * _BITS_PER_MBIT

    def time_to_send(self, bits: float, start: float) -> float:
        """Seconds from ``start`` until the link has carried ``bits``; ``inf`` if never.

        The inverse of :meth:`bits_between`: ``bits_between(s, s + time_to_send(b, s)) == b``.
        """
        if bits <= 0:
            return 0.0
        target = self._mbit_until(start) + bits / _BITS_PER_MBIT
        cum = self._cum_mbit
        if target > cum[-1]:
            last = float(self.rates[-1])
            if last <= 0:
                return math.inf
            end = float(self.times[-1]) + (target - float(cum[-1])) / last
        else:
            j = int(np.searchsorted(cum, target, side="left"))
            if j == 0:
                end = target / float(self.rates[0])
            else:
                end = float(self.times[j - 1]) + (target - float(cum[j - 1])) / float(self.rates[j - 1])
        return max(end - start, 0.0)

    # ----------------------------------------------------------------- transforms
    def rescaled(self, *, mean: float | None = None, low: float | None = None, high: float | None = None) -> Trace:
        """Same shape at another scale: multiply to a new ``mean``, or map ``[min, max]``
        affinely onto ``[low, high]``. Video-scale traces become KV-scale this way."""
        if mean is not None:
            if low is not None or high is not None:
                raise ValueError("give either mean= or low=/high=, not both")
            if mean < 0:
                raise ValueError(f"mean must be non-negative, got {mean}")
            if self.mean == 0:
                raise ValueError("cannot rescale an all-zero trace to a mean")
            return Trace(self.times, self.rates * (mean / self.mean), name=self.name)
        if low is None or high is None:
            raise ValueError("rescaled() needs mean= or both low= and high=")
        if not 0 <= low <= high:
            raise ValueError(f"need 0 <= low <= high, got low={low}, high={high}")
        lo, hi = self.low, self.high
        if hi == lo:
            raise ValueError("a flat trace has no range to map onto [low, high]; use mean=")
        return Trace(self.times, low + (self.rates - lo) * ((high - low) / (hi - lo)), name=self.name)

    # ----------------------------------------------------------------- internals
    def _mbit_until(self, t: float) -> float:
        if t < 0:
            raise ValueError(f"time must be non-negative, got {t}")
        i = int(np.searchsorted(self.times, t, side="right")) - 1
        if i < 0:
            return t * float(self.rates[0])
        return float(self._cum_mbit[i]) + float(self.rates[i]) * (t - float(self.times[i]))

    def __len__(self) -> int:
        return len(self.times)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trace):
            return NotImplemented
        return np.array_equal(self.times, other.times) and np.array_equal(self.rates, other.rates)

    __hash__ = None  # type: ignore[assignment]  # equal by value, yet holds arrays

    def __repr__(self) -> str:
        return (f"Trace({self.name!r}, {len(self)} samples, {self.duration:g} s, "
                f"mean {self.mean:.1f} Mbit/s, {self.low:.1f}-{self.high:.1f})")


def _numeric(field: str) -> bool:
    try:
        float(field)
    except ValueError:
        return False
    return True


def _validate(t: np.ndarray, r: np.ndarray) -> None:
    if t.ndim != 1 or r.ndim != 1:
        raise ValueError("times and rates must be one-dimensional")
    if len(t) == 0:
        raise ValueError("trace has no samples")
    if len(t) != len(r):
        raise ValueError(f"{len(t)} times but {len(r)} rates")
    if not (np.all(np.isfinite(t)) and np.all(np.isfinite(r))):
        raise ValueError("times and rates must be finite numbers")
    if t[0] < 0:
        raise ValueError(f"times must be non-negative, first is {t[0]}")
    bad = np.nonzero(np.diff(t) <= 0)[0]
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"times must strictly increase: sample {i + 1} at {t[i + 1]} s follows {t[i]} s")
    neg = np.nonzero(r < 0)[0]
    if len(neg):
        i = int(neg[0])
        raise ValueError(f"rates must be non-negative: sample {i} at {t[i]} s is {r[i]} Mbit/s")
