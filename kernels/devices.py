"""Which CUDA device a device string names, and whether GPU decode can run here at all.

Pure checks with clear, typed answers, so a session or daemon asking for ``cuda:1`` on
a machine without pycuda, without a GPU or with one GPU fails at start with the reason
(``codec.GpuUnavailable``), and a malformed string with a ValueError.
"""
from __future__ import annotations

import importlib.util

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
