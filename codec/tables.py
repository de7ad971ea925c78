"""A profile's entropy tables in the forms the coder, the quantizer and the step control
use, built once per profile (the profile holds the integer frequencies only)."""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from . import entropy, rans
from .profile import Profile


@dataclass(frozen=True)
class CoderTables:
    freq: np.ndarray
    cdf: np.ndarray
    lut: np.ndarray
    coder: np.ndarray       # u32 [classes, ALPHABET]: freq | cdf << 16, what the CPU decoder loads
    cost: np.ndarray        # f64 [classes, ALPHABET]: entropy.symbol_cost_bits
    value_bits: np.ndarray  # f64 [classes, PROB_BITS + 1]: rans.min_value_bits


_coder_tables: "weakref.WeakKeyDictionary[Profile, CoderTables]" = weakref.WeakKeyDictionary()


def coder_tables(profile: Profile) -> CoderTables:
    """Frequency, cumulative and slot tables of a profile (built once per profile)."""
    tables = _coder_tables.get(profile)
    if tables is None:
        tables = CoderTables(freq=profile.tables, cdf=entropy.cumulative(profile.tables),
                             lut=entropy.slot_lookup(profile.tables),
                             coder=entropy.packed_coder(profile.tables),
                             cost=entropy.symbol_cost_bits(profile.tables),
                             value_bits=rans.min_value_bits(profile.tables))
        _coder_tables[profile] = tables
    return tables
