"""Quality ladder: from a target distortion to a quantization step and kept components.

A level is defined by its target distortion D = sum(err^2) / sum((x - mean)^2). For
an orthonormal transform with one uniform step per (layer, K/V), reverse
water-filling says: quantize every component whose variance exceeds the step's
noise (step^2 / 12, times a measured margin) and drop the rest (they reconstruct as
the mean). The step is
found by bisection against the *measured* rounding error on sample coefficients,
not the high-rate formula, which overestimates the error of narrow components.
"""
from __future__ import annotations

import numpy as np

#: Target distortions (MSE / variance) of the default ladder, best quality first. Each
#: sits 10-25% under a round figure (1.2e-3, 5e-3, 1.5e-2, ...) because text unseen at
#: calibration lands a little above the calibrated distortion.
DEFAULT_TARGETS = (2.5e-4, 1e-3, 4e-3, 1.2e-2, 3.2e-2)
#: Index of the level ``codec.encode`` uses when neither the caller nor the profile names
#: one (``Profile.default_level``): the coarsest level of this ladder at which an encoder's
#: embedding keeps a cosine of 0.999 (MiniLM; ``kvwire bench codec``). A causal LM loses no
#: measurable quality one level coarser, so the profiles ``kvwire calibrate`` fits for one
#: name level 3 (``streamer.model.quality.model_default_level``).
DEFAULT_LEVEL = 2

_BISECTION_STEPS = 40


#: A component is coded only if its variance exceeds this many times the step's
#: noise (step^2 / 12). Water-filling says 1; on real KV 3 gives the same rate at the
#: same distortion (narrow components cost bits for little error reduction) while
#: coding 6-16% fewer rows, which shrinks the decoder's inverse-transform GEMM.
KEEP_THRESHOLD = 3.0


def kept_components(variances: np.ndarray, step: float) -> int:
    """Number of leading components (sorted by decreasing variance) worth coding."""
    return int(np.count_nonzero(variances > KEEP_THRESHOLD * step * step / 12.0))


def distortion(coef: np.ndarray, variances: np.ndarray, step: float, allow_drop: bool) -> float:
    """Total squared error per token when quantizing ``coef`` [C, N] with ``step``."""
    kept = kept_components(variances, step) if allow_drop else coef.shape[0]
    head = coef[:kept]
    rounded = head / step   # head - rint(head / step) * step in float32, in place: calibration
    np.rint(rounded, out=rounded)  # evaluates this thousands of times on [C, N] samples
    rounded *= step
    np.subtract(head, rounded, out=rounded)
    err = rounded.astype(np.float64)  # float32 squares underflow for tiny KV
    np.multiply(err, err, out=err)
    return float(np.mean(np.sum(err, axis=0))) + float(variances[kept:].sum())


def design_step(coef: np.ndarray, variances: np.ndarray, target: float,
                allow_drop: bool) -> tuple[float, int]:
    """Step and number of kept components reaching ``target`` relative distortion.

    ``coef`` [C, N] are sample coefficients (components sorted by decreasing
    variance when ``allow_drop``), ``variances`` [C] their variances. Returns the
    largest step whose distortion does not exceed the target (to bisection precision).
    """
    if not 0 < target < 1:
        raise ValueError(f"target distortion must be in (0, 1), got {target}")
    coef = np.asarray(coef, dtype=np.float32)
    variances = np.asarray(variances, dtype=np.float64)
    total = float(variances.sum())
    if total <= 0 or coef.shape[1] == 0:
        return 1.0, 0 if allow_drop else coef.shape[0]
    goal = target * total
    scale = float(np.sqrt(variances.max()))
    lo, hi = np.log(scale * 1e-7), np.log(scale * 1e3)
    for _ in range(_BISECTION_STEPS):
        if np.float32(np.exp(lo)) == np.float32(np.exp(hi)):
            break   # every later bracket rounds to this same step: the result is settled
        mid = 0.5 * (lo + hi)
        if distortion(coef, variances, float(np.exp(mid)), allow_drop) <= goal:
            lo = mid
        else:
            hi = mid
    step = float(np.float32(np.exp(lo)))
    kept = kept_components(variances, step) if allow_drop else coef.shape[0]
    return step, kept
