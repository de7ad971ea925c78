"""Typed errors of the codec, so callers can tell bad bytes from a wrong profile."""
from __future__ import annotations


class CodecError(Exception):
    """Base class of every error the codec raises on a blob or a profile."""


class CorruptBitstream(CodecError):
    """The blob is truncated, damaged, or not a kvwire blob at all.

    Raised before any tensor is returned: a corrupt blob never decodes to a wrong tensor.
    """


class ProfileMismatch(CodecError):
    """The blob was encoded against a different profile than the one supplied (or none)."""


class ProfileMismatchWarning(UserWarning):
    """The profile does not fit the KV being encoded: quantizing a layer with it measured
    a distortion far above the level's target (a profile from another model, or data
    unlike its calibration). Those layers are stored raw, so the blob stays exact and no
    larger than the tensor; the warning says which layers and by how much. A warning,
    not an error, because the blob is still correct; ``warnings.simplefilter("error",
    ProfileMismatchWarning)`` makes it fatal for callers that would rather stop."""


class GpuUnavailable(CodecError, RuntimeError):
    """No usable decoder for a GPU device: the message says what is missing (no backend
    registered -- ``import kvwire_kernels`` -- no pycuda, or no CUDA device)."""
