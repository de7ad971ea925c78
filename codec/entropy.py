"""Entropy models: the probability tables the rANS coder codes symbols with.

A *symbol* is the quantized coefficient's high part ``q >> shift`` offset into
``[0, ESCAPE)``; ``ESCAPE`` marks a value sent verbatim (see ``rans.py``). A table
is a vector of ``ALPHABET`` integer frequencies summing to ``PROB_SCALE``; a
frequency of 0 means "not encodable with this table" and forces an escape.

Tables are indexed by a *scale class*: the component's standard deviation in units
of its (shifted) quantization step, on a log grid. Components of any layer, K/V or
quality level with the same class share a table, so a profile needs a few dozen
tables instead of one per channel (the per-channel tables CacheGen ships cost
0.4-1.0 bits per element; see shared/reference.md).
"""
from __future__ import annotations

import numpy as np

PROB_BITS = 12
PROB_SCALE = 1 << PROB_BITS
ALPHABET = 128
ESCAPE = ALPHABET - 1
#: symbol index of the quantized value 0
ZERO_SYMBOL = 63

#: Components are shifted right until their std is at most this many steps, so the
#: alphabet always spans ~8 sigma and the dropped low bits are nearly uniform.
MAX_SCALE = 8.0
#: Scale classes: CLASSES_PER_OCTAVE per doubling of std/step, from MIN_SCALE up.
CLASSES_PER_OCTAVE = 4
MIN_SCALE = 2.0 ** -3
NUM_CLASSES = int(np.ceil(np.log2(MAX_SCALE / MIN_SCALE) * CLASSES_PER_OCTAVE)) + 1


def shift_for_scale(scale: np.ndarray) -> np.ndarray:
    """Bits dropped below the coded symbol so that std/(step*2^shift) <= MAX_SCALE."""
    scale = np.asarray(scale, dtype=np.float64)
    with np.errstate(divide="ignore"):
        shift = np.ceil(np.log2(np.maximum(scale, 1e-30) / MAX_SCALE))
    return np.clip(shift, 0, PROB_BITS).astype(np.uint8)


def class_for_scale(scale: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """Scale class of components whose std is ``scale`` steps, after ``shift``."""
    reduced = np.asarray(scale, dtype=np.float64) / np.exp2(shift.astype(np.float64))
    with np.errstate(divide="ignore"):
        pos = np.log2(np.maximum(reduced, 1e-30) / MIN_SCALE) * CLASSES_PER_OCTAVE
    return np.clip(np.rint(pos), 0, NUM_CLASSES - 1).astype(np.uint8)


def class_scale(table_class: int) -> float:
    """Representative std (in steps) of a scale class."""
    return MIN_SCALE * 2.0 ** (table_class / CLASSES_PER_OCTAVE)


def prior_counts(table_class: int) -> np.ndarray:
    """A discretised Laplacian of the class's scale: the shape tables fall back to.

    Laplacian rather than Gaussian because KV coefficients have heavy tails; it only
    matters for classes with few calibration samples, where it is mixed in.
    """
    scale = class_scale(table_class)
    b = scale / np.sqrt(2.0)
    values = np.arange(ALPHABET - 1) - ZERO_SYMBOL
    upper = np.abs(values) + 0.5
    lower = np.maximum(np.abs(values) - 0.5, 0.0)
    mass = np.where(values == 0, 1.0 - np.exp(-0.5 / b),
                    0.5 * (np.exp(-lower / b) - np.exp(-upper / b)))
    return np.append(mass, 0.0)


def normalize_counts(counts: np.ndarray, escape_weight: float) -> np.ndarray:
    """Integer frequencies summing to PROB_SCALE with every seen symbol kept codable.

    Symbols with a count of zero get frequency 0 (they escape). The escape symbol
    always gets at least 1 so that any value can be coded.
    """
    counts = np.asarray(counts, dtype=np.float64).copy()
    counts[ESCAPE] = max(counts[ESCAPE], escape_weight, 1e-12)
    support = counts > 0
    total = counts.sum()
    budget = PROB_SCALE - int(support.sum())  # one guaranteed slot per live symbol
    if budget < 0:
        raise ValueError("alphabet larger than the probability scale")
    extra = np.floor(counts / total * budget).astype(np.int64)
    freq = support.astype(np.int64) + extra
    # hand out the rounding remainder to the largest fractional parts
    remainder = PROB_SCALE - int(freq.sum())
    if remainder:
        frac = counts / total * budget - extra
        frac[~support] = -1.0
        order = np.argsort(-frac, kind="stable")
        freq[order[:remainder]] += 1
    assert freq.sum() == PROB_SCALE
    return freq.astype(np.uint16)


def build_tables(histograms: np.ndarray, prior_weight: float = 64.0) -> np.ndarray:
    """Tables [NUM_CLASSES, ALPHABET] from symbol histograms per scale class.

    The histogram is mixed with the class's Laplacian prior (``prior_weight``
    pseudo-samples), so a class seen rarely in calibration still gets a sane table,
    and the prior's tail is cut where its probability falls below half a slot.
    """
    histograms = np.asarray(histograms, dtype=np.float64)
    if histograms.shape != (NUM_CLASSES, ALPHABET):
        raise ValueError(f"histograms must be [{NUM_CLASSES}, {ALPHABET}]")
    tables = np.empty((NUM_CLASSES, ALPHABET), dtype=np.uint16)
    for c in range(NUM_CLASSES):
        prior = prior_counts(c)
        prior[prior < 0.5 / PROB_SCALE] = 0.0
        counts = histograms[c] + prior_weight * prior
        escape_weight = histograms[c, ESCAPE] + 1e-4 * counts.sum()
        tables[c] = normalize_counts(counts, escape_weight)
    return tables


def cumulative(tables: np.ndarray) -> np.ndarray:
    """Start of each symbol's slot range: cdf[c, s] = sum(freq[c, :s])."""
    cdf = np.zeros_like(tables, dtype=np.uint16)
    cdf[:, 1:] = np.cumsum(tables[:, :-1].astype(np.int64), axis=1)
    return cdf


def slot_lookup(tables: np.ndarray) -> np.ndarray:
    """Symbol of every slot [NUM_CLASSES, PROB_SCALE]: one load per decoded symbol."""
    lut = np.empty((tables.shape[0], PROB_SCALE), dtype=np.uint8)
    symbols = np.arange(tables.shape[1], dtype=np.uint8)
    for c in range(tables.shape[0]):
        lut[c] = np.repeat(symbols, tables[c].astype(np.int64))
    return lut


def packed_coder(tables: np.ndarray) -> np.ndarray:
    """u32 [classes, ALPHABET]: each symbol's frequency (low 16 bits) and cumulative
    frequency (high 16 bits), so a decode step loads both at once."""
    return tables.astype(np.uint32) | (cumulative(tables).astype(np.uint32) << 16)


def validate_tables(tables: np.ndarray) -> None:
    """Raise ValueError unless ``tables`` is a usable set of frequency tables."""
    if tables.ndim != 2 or tables.shape[1] != ALPHABET or tables.dtype != np.uint16:
        raise ValueError(f"tables must be uint16 [n, {ALPHABET}], got {tables.dtype} {tables.shape}")
    sums = tables.astype(np.int64).sum(axis=1)
    if np.any(sums != PROB_SCALE) or np.any(tables[:, ESCAPE] == 0):
        raise ValueError("every table must sum to PROB_SCALE and keep the escape codable")


def symbol_cost_bits(tables: np.ndarray) -> np.ndarray:
    """-log2 p of every (class, symbol); inf where the symbol is not codable."""
    with np.errstate(divide="ignore"):
        return PROB_BITS - np.log2(tables.astype(np.float64))
