"""Which CUDA device a device string names, whether GPU decode can run here at all, and
the process's one registry of what runs on each device.

Pure checks with clear, typed answers, so a session or daemon asking for ``cuda:1`` on
a machine without pycuda, without a GPU or with one GPU fails at start with the reason
(``codec.GpuUnavailable``), and a malformed string with a ValueError.

The registry (:func:`shared`, :func:`close_all`) keeps one object of each kind per
device index (``kvwire_kernels.gpu``'s decoder, which retains the device's primary context,
and ``kvwire_kernels.stream``'s stream decoder running on it), so ``cuda`` and ``cuda:0`` share
one context and ``cuda:1`` gets device 1's; the daemon's shutdown closes them all.
"""
from __future__ import annotations

import importlib.util
import threading
from typing import Callable, Protocol, TypeVar

import torch

from codec.errors import GpuUnavailable


def device_index(device: str | torch.device) -> int:
    """N of ``cuda:N`` (0 for a bare ``cuda``); ValueError for anything but a CUDA device."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"not a device: {device!r} ({exc})") from None
    if parsed.type != "cuda":
        raise ValueError(f"GPU decode runs on a CUDA device ('cuda' or 'cuda:N'), not {str(parsed)!r}")
    return 0 if parsed.index is None else parsed.index


def availability() -> tuple[bool, str]:
    """(True, "") when GPU decode can run here, else (False, what is missing)."""
    if importlib.util.find_spec("pycuda") is None:
        return False, "pycuda is not installed (pip install 'kvwire[cuda]')"
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device (a CPU-only torch build, or no GPU/driver)"
    return True, ""


def require(device: str | torch.device) -> int:
    """The device index of ``device`` once GPU decode can run on it; GpuUnavailable
    saying what is missing otherwise (ValueError for a malformed device)."""
    index = device_index(device)
    ok, reason = availability()
    if not ok:
        raise GpuUnavailable(f"device={str(device)!r} needs GPU decode: {reason}")
    count = torch.cuda.device_count()
    if index >= count:
        raise GpuUnavailable(f"device={str(device)!r}: there are {count} CUDA devices here")
    return index


class Closable(Protocol):
    def close(self) -> None: ...


T = TypeVar("T", bound=Closable)

_lock = threading.RLock()   # re-entrant: building a stream decoder builds its device's decoder
_opened: dict[int, dict[str, Closable]] = {}   # device index -> kind -> object, in build order


def shared(device: str | torch.device, kind: str, build: Callable[[int], T]) -> T:
    """The process-wide ``kind`` object of ``device``, built as ``build(index)`` on first
    use (ValueError for a malformed device; whatever ``build`` raises, e.g.
    GpuUnavailable, registers nothing)."""
    index = device_index(device)
    with _lock:
        objects = _opened.get(index, {})
        if kind not in objects:
            built = build(index)
            _opened.setdefault(index, {})[kind] = built   # after any object ``build`` itself registered
        return _opened[index][kind]   # type: ignore[return-value]


def close_all() -> None:
    """Close every registered object, on each device the newest first (a stream decoder
    before the decoder it runs on), and forget them: a later :func:`shared` builds anew."""
    with _lock:
        opened = list(_opened.values())
        _opened.clear()
    for objects in opened:
        for obj in reversed(list(objects.values())):
            obj.close()
