"""Where decoded layers land: the codec's section decoder for a device, with the CUDA
backend (``kernels``) imported only when a session or daemon asks for a CUDA device."""
from __future__ import annotations

import torch

import codec


def section_decoder(device: str | torch.device):
    """``codec.section_decoder(device)``, registering the CUDA backend first if needed;
    codec.GpuUnavailable says what is missing (pycuda, a GPU) when it cannot run here."""
    if torch.device(device).type == "cuda":
        import kernels  # noqa: F401  (registers the CUDA section decoder with codec)
    return codec.section_decoder(device)
