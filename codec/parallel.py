"""Launching numba's parallel kernels from many threads without taking the process down.

numba runs ``prange`` loops on a threading layer chosen at the first parallel launch:
``tbb`` or ``omp`` where installed (both take launches from several Python threads at
once), else ``workqueue``, which *aborts the process* when two threads launch at the
same time ("Concurrent access has been detected"). A receiver decodes several
sessions on several threads, so every codec kernel goes through :func:`launch`: it
serializes launches while the layer is unknown (the first one) or is ``workqueue``,
and adds nothing but a flag check under ``tbb`` or ``omp``.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import numba

log = logging.getLogger("kvwire.codec")

#: the layers that take concurrent launches (numba docs, "The Threading Layers")
THREADSAFE_LAYERS = ("tbb", "omp")

_lock = threading.Lock()
_serialize: bool | None = None  # None until a launch has shown which layer runs


def launch(kernel: Callable[..., Any], *args: Any) -> Any:
    """``kernel(*args)``, one launch at a time unless the threading layer is thread-safe."""
    if _serialize is False:
        return kernel(*args)
    with _lock:
        result = kernel(*args)
        _learn_layer()
        return result


def threading_layer() -> str:
    """The layer numba runs the kernels on ("none" with NUMBA_DISABLE_JIT, "unknown"
    before the first parallel launch)."""
    if numba.config.DISABLE_JIT:
        return "none"
    try:
        return numba.threading_layer()
    except ValueError:  # numba: "Threading layer is not initialized."
        return "unknown"


def serialized() -> bool:
    """True while kernel launches are serialized (before the first, or under workqueue)."""
    return _serialize is not False


def _learn_layer() -> None:
    global _serialize
    if _serialize is not None:
        return
    layer = threading_layer()
    _serialize = layer not in THREADSAFE_LAYERS + ("none",)
    if _serialize:
        log.warning("numba runs on the %r threading layer, which is not thread-safe: codec kernels "
                    "will run one at a time (pip install tbb for concurrent decodes)", layer)
