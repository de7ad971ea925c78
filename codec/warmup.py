"""Compile, or load from numba's on-disk cache, every codec kernel before anything is timed.

numba compiles a kernel once per distinct combination of argument types, at its first
call in a process. With ``cache=True`` (set on every kernel in ``rans.py``, ``rotary.py`` and ``control.py``) the machine
code goes to an on-disk cache (``codec/__pycache__``, or ``$NUMBA_CACHE_DIR``) and later
processes load it instead of compiling. Either way the first call in a process pays:
about 3 s per specialization on 2 cores when compiling (a fresh clone, a new deploy,
an edited kernel module), tens of milliseconds when loading. Paid inside a fetch, that is
a stall the throughput estimator reads as a slow link. :func:`warm_up` pays it up front
by encoding and decoding a tiny synthetic tensor through the public API.

The codec fixes every argument type of its kernels, including two that would otherwise
follow the data: a layer plan's ``table``/``shift`` rows are always C-ordered, and a
section's lane words and states are always read-only arrays (``layer_codec``), so each
kernel has exactly one specialization. The output dtype (fp16/bf16/fp32), attention
sinks, escapes and embedded profiles differ only in torch code or in branches of the
same compiled kernel; alignment is not part of numba's array type. ``rans.ideal_bits``
(benchmarks only) is not warmed. The encode kernels are warmed too: producing the blob
to decode needs them, and they are the ones ``put_context`` runs.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time

import torch

from . import container, control, rans, rotary
from .api import decode_section, encode, parse_header
from .levels import DEFAULT_TARGETS
from .calibration import calibrate
from .synthetic import synthetic_kv

log = logging.getLogger("kvwire.codec")

#: the numba kernels of the encode and decode paths, as ``module.name`` (numba's cache
#: index names; ``rans.ideal_bits`` is benchmark-only)
KERNELS = ("rans.quantize_rows", "rans.lane_spans", "rans.encode_lanes", "rans.lane_tasks", "rans.decode_lanes",
           "rans.dequantize_rows", "rotary._rope_rows", "control.weigh_sample")
_MODULES = {"rans": rans, "control": control, "rotary": rotary}

_LAYERS, _HEADS, _HEAD_DIM, _SINKS, _TOKENS = 2, 2, 4, 4, 68


@dataclasses.dataclass(frozen=True)
class WarmupResult:
    """What the warm-up that did the work found."""

    seconds: float
    #: kernel specializations compiled (absent from numba's on-disk cache, or stale)
    compiled: int
    #: kernel specializations loaded from numba's on-disk cache
    loaded: int

    @property
    def cold(self) -> bool:
        """True when the on-disk cache lacked some kernel, i.e. this process compiled it."""
        return self.compiled > 0


_lock = threading.Lock()
_result: WarmupResult | None = None


def warm_up() -> float:
    """Make every codec kernel ready to run; seconds spent in this call.

    The first call in a process compiles (cold cache) or loads (warm cache) the
    kernels; later calls return at once (a concurrent one waits for the first to
    finish, so nothing decodes cold meanwhile). Never raises: a failure is logged and
    the kernels are left to compile on first use, as without a warm-up.
    """
    global _result
    started = time.perf_counter()
    if _result is not None:
        return time.perf_counter() - started
    with _lock:
        if _result is None:
            before = cache_stats()
            try:
                _exercise()
            except Exception:  # a warm-up must not take a daemon or a session down
                log.warning("codec warm-up failed; kernels will compile on first use", exc_info=True)
            after = cache_stats()
            _result = WarmupResult(
                seconds=time.perf_counter() - started,
                compiled=sum(after[k]["compiled"] - before[k]["compiled"] for k in KERNELS),
                loaded=sum(after[k]["loaded"] - before[k]["loaded"] for k in KERNELS))
    return time.perf_counter() - started


def last_result() -> WarmupResult | None:
    """The result of the warm-up that ran in this process, None before one has."""
    return _result


def kernel(name: str):
    """The numba dispatcher :data:`KERNELS` names ``name``."""
    module, attribute = name.split(".")
    return getattr(_MODULES[module], attribute)


def cache_stats() -> dict[str, dict[str, int]]:
    """Per kernel: specializations in memory, compiled (cache misses) and loaded (cache
    hits) in this process so far (all zero when numba's JIT is disabled)."""
    out = {}
    for name in KERNELS:
        dispatcher = kernel(name)
        stats = getattr(dispatcher, "stats", None)
        out[name] = {
            "signatures": len(getattr(dispatcher, "signatures", ())),
            "compiled": sum(stats.cache_misses.values()) if stats is not None else 0,
            "loaded": sum(stats.cache_hits.values()) if stats is not None else 0,
        }
    return out


def _exercise() -> None:
    kv = synthetic_kv(_LAYERS, _HEADS, _HEAD_DIM, _TOKENS, seed=0)
    # an outlier (the escape path), ~4x the data's largest value: one the step control
    # codes; 1e3 made the misfit check store the layer raw (and warn on every start-up)
    kv[0, 0, _SINKS, 0, 0] = 30.0
    # a rotary profile: the decoder re-applies RoPE to keys (rotary._rope_rows)
    profile = calibrate([kv], targets=(DEFAULT_TARGETS[0],), sink_tokens=_SINKS,
                        rotary=rotary.Rotary(head_dim=_HEAD_DIM, dim=_HEAD_DIM, theta=10000.0))
    blob = encode(kv.to(torch.float16), 0, profile)
    header = parse_header(blob)
    for layer in range(header.layers):
        decode_section(header, profile, layer, bytes(container.section(blob, header, layer)))
    # a predicting profile's encoder rebuilds each layer's coefficients from its integers
    # (rans.dequantize_rows)
    encode(kv.to(torch.float16), 0, calibrate([kv], targets=(DEFAULT_TARGETS[0],), sink_tokens=_SINKS,
                                              predict=_LAYERS))
