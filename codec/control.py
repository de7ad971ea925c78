"""Closed-loop step control: the step and kept rows each section is coded with.

A level is defined by a target distortion D = MSE / variance. Calibration fixes one
step per (layer, K/V) that reaches D on the calibration text, but on other text the
same step gives another distortion, at times several times the target.
The encoder holds the data, so for every section it measures the distortion a step
gives on the chunk's own coefficients (an evenly spaced sample of ``SAMPLE_TOKENS``
tokens) and moves the step, in log-step, until the measured distortion is within
``TOLERANCE`` of the target. The section records the step and the number of kept
rows (FORMAT.md, version 5), so the decoder needs nothing it cannot read.

What "variance" means for one chunk: the sum over channels of the variance of the
chunk's coded tokens around their own mean, in the KV's own frame (keys as the model
holds them, with RoPE): what a user gets comparing the decoded chunk with the
original, chunk by chunk. Not the calibration variance: a chunk quieter than the
calibration text would otherwise get an error large against its own signal. One
robustness rule: a token whose energy around the sample's mean passes
``OUTLIER_FACTOR`` times the median token's counts as if scaled down to that, in both
the variance (taken around the mean of the tokens so weighted) and the error, so a
single huge token (escape-coded, exact to its step) does not make every other token of
the chunk coarser. The error is the
quantizer's rounding of the kept components plus the energy (around the profile's
mean) of the dropped ones; a rotation per token preserves it, so it is measured on the
position-free keys the transform sees.

Kept rows follow reverse water-filling on the chunk's own components: a leading row
is coded when its energy exceeds ``KEEP_THRESHOLD`` times the step's noise, counted
over the profile's stored basis rows (so kept never exceeds what the decoder holds),
at most ``ROW_FACTOR`` times the profile's kept rows plus ``ROW_MARGIN``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

from . import transform
from .levels import KEEP_THRESHOLD
from .profile import Profile

#: relative distortion error the search stops at: a third of the +-15% the levels promise,
#: the rest left to the sample's estimate of the whole chunk
TOLERANCE = 0.05
#: tokens (evenly spaced) the control measures per section: enough for a few % estimate
#: of the error and variance, a small share of the transform a section needs anyway
SAMPLE_TOKENS = 256
#: a token more than this many times the median token's energy counts as if scaled down
#: to it (module docstring): on real KV (hundreds of channels) ordinary tokens' energies
#: lie within a few times the median
OUTLIER_FACTOR = 16.0
#: passes of judging outliers around the mean the previous pass weighted: a huge token
#: shifts the plain mean (and so every token's energy) until it is weighted down
OUTLIER_PASSES = 3
#: rows the control transforms: at most this many times the profile's kept rows (plus
#: ROW_MARGIN); the rest count as dropped. Transforming every stored row cost more than
#: the coarse levels' whole encode
ROW_FACTOR = 2
ROW_MARGIN = 16
#: distortion evaluations per section at most (the first is the profile's step)
MAX_EVALUATIONS = 8
#: the step stays within this factor of the profile's: data 256x off is not coded better
#: by a step 256x off (the misfit check stores such layers raw instead)
MAX_STEP_FACTOR = 256.0
#: the step's float32 range a section may carry (FORMAT.md): normal, and 2^31 steps
#: (an anchor plus a delta, each under 2^30 steps) stay finite
MIN_STEP = 2.0 ** -126
MAX_STEP = 2.0 ** 96


def clamp_step(step: float) -> float:
    """``step`` as the float32 a section may carry: within [MIN_STEP, MAX_STEP]."""
    return float(np.float32(min(max(float(step), MIN_STEP), MAX_STEP)))


def profile_steps(profile: Profile, slot: int, layer: int) -> tuple[float, float]:
    """The profile's K and V steps for a section that is not controlled (a short chunk)."""
    return clamp_step(profile.steps[slot, layer, 0]), clamp_step(profile.steps[slot, layer, 1])


@dataclass(frozen=True)
class PartControl:
    """One (layer, K/V)'s choice: the section's step and kept rows; the MSE/var the
    profile's own step and kept rows give, the part of it the rows the profile's level
    drops account for (what no step can correct: the misfit check), and the MSE/var
    the chosen step and kept rows give (all measured on the sample)."""

    step: float
    kept: int
    at_profile: float
    dropped: float
    achieved: float


class PartSample:
    """The chunk's sample of one (layer, K/V) as every level's control measures it: the
    outlier weights, the variance, and the sample transformed once for the most rows
    any level's control transforms (``rows``)."""

    def __init__(self, profile: Profile, layer: int, kind: int, sample: np.ndarray, own: np.ndarray,
                 rows: int) -> None:
        # writable C-ordered float32 whatever the caller holds (a loaded profile's mean is
        # read-only): one kernel specialization, the one codec.warm_up compiles
        own, sample, mean = (np.require(array, np.float32, ("C", "W"))
                             for array in (own, sample, profile.mean[layer, kind]))
        self.variance, self.typical, centered, self.token_energy = weigh_sample(
            own, sample, mean, OUTLIER_FACTOR, OUTLIER_PASSES)
        self.drop = profile.basis is not None
        # [n, rows] as transform.forward computes the reference: float64, rounded once (not the
        # float32 product the coded rows take: its last bits would move the step chosen here)
        self.coef = transform.project(torch.from_numpy(centered), torch.from_numpy(
            profile.basis64[layer, kind, :rows])).T.numpy() if self.drop else centered
        self.tokens = max(sample.shape[0], 1)
        self.total = float(self.token_energy.sum()) / self.tokens


@njit(cache=True, nogil=True)
def weigh_sample(own: np.ndarray, sample: np.ndarray, mean: np.ndarray, factor: float, passes: int
                 ) -> tuple[float, float, np.ndarray, np.ndarray]:
    """(variance, median token energy, weighted centered sample, its per-token energy) of
    one (layer, K/V)'s sample: ``own`` [n, C] its tokens in the KV's own frame, ``sample``
    [n, C] as the transform sees them, ``mean`` the profile's. Each of ``passes`` passes
    weighs down the tokens whose energy around the last pass's weighted mean exceeds
    ``factor`` times the median's (module docstring); the variance and median energy are
    taken around the final weighted mean, the sample is centered on the profile's mean
    and scaled by each token's sqrt(weight) in float32. One pass over memory per
    statistic: in numpy these took more than the sample's float64 product."""
    n, channels = own.shape
    weights = np.ones(n)
    center = np.zeros(channels)
    energy = np.zeros(n)
    for stage in range(passes + 1 if n else 0):  # the last pass only measures
        center[:] = 0.0
        for t in range(n):
            for c in range(channels):
                center[c] += weights[t] * own[t, c]
        center /= max(weights.sum(), 1e-300)
        for t in range(n):
            total = 0.0
            for c in range(channels):
                d = own[t, c] - center[c]
                total += d * d
            energy[t] = total
        if stage < passes:
            cap = factor * np.median(energy)
            for t in range(n):
                weights[t] = cap / energy[t] if energy[t] > cap else 1.0
    variance = (weights * energy).sum() / max(n, 1)
    typical = np.median(energy) if n else 0.0
    centered = np.empty((n, channels), np.float32)
    token_energy = np.empty(n)
    for t in range(n):
        scale = np.float32(np.sqrt(np.float32(weights[t])))
        total = 0.0
        for c in range(channels):
            value = (sample[t, c] - mean[c]) * scale
            centered[t, c] = value
            total += np.float64(value) * np.float64(value)
        token_energy[t] = total
    return variance, typical, centered, token_energy


class _Part:
    """A sample's first ``rows`` transformed rows (the rest count as dropped); distortion per step."""

    def __init__(self, sample: PartSample, rows: int) -> None:
        self.drop = sample.drop
        self.coef = sample.coef[:, :rows] if self.drop else sample.coef
        self.tokens = sample.tokens
        self.energy = np.square(self.coef, dtype=np.float64).sum(axis=0) / self.tokens  # per row
        self.token_energy = sample.token_energy
        self.beyond = max(sample.total - float(self.energy.sum()), 0.0)  # rows the profile never stores
        self.tail = np.concatenate([np.cumsum(self.energy[::-1])[::-1], [0.0]]) + self.beyond
        self.variance = sample.variance

    def kept_for(self, step: float) -> int:
        if not self.drop:
            return self.coef.shape[1]
        return int(np.count_nonzero(self.energy > KEEP_THRESHOLD * step * step / 12.0))

    def distortion(self, step: float, kept: int) -> float:
        """MSE/var of coding the sample with ``step`` and ``kept`` rows."""
        head = self.coef[:, :kept]
        err = head - np.float32(step) * np.rint(head / np.float32(step))
        return self.relative(float(np.square(err, dtype=np.float64).sum()) / self.tokens + float(self.tail[kept]))

    def dropped_share(self, kept: int, typical: float) -> float:
        """The median token's energy beyond ``kept`` rows over ``typical``, the median
        token's variance share."""
        lost = self.token_energy - np.square(self.coef[:, :kept], dtype=np.float64).sum(axis=1)
        return _share(float(np.median(lost)) if lost.size else 0.0, typical)

    def relative(self, mse: float) -> float:
        return _share(mse, self.variance)


def _share(mse: float, variance: float) -> float:
    """``mse / variance``, where a part of no variance loses nothing to no error and
    infinitely much to any."""
    if variance > 0:
        return mse / variance
    return 0.0 if mse <= 0 else math.inf


def sample_rows_needed(profile: Profile, slot: int, layer: int, kind: int) -> int:
    """Rows level ``slot``'s control transforms for this (layer, K/V)."""
    return ROW_FACTOR * int(profile.kept[slot, layer, kind]) + ROW_MARGIN


def control_part(profile: Profile, slot: int, layer: int, kind: int, sample: PartSample) -> PartControl:
    """The step and kept rows holding level ``slot``'s target on ``sample`` (its coded
    tokens as the transform sees them, and its variance in the KV's own frame: module
    docstring), transformed for at least ``sample_rows_needed`` rows.

    Secant iterations on log(distortion) against log(step) (kept rows follow the step),
    bracketed once the target is crossed, starting from the profile's step (data like
    the calibration needs no correction: one evaluation); the result is the evaluated
    step closest to the target (in log-distortion). ``dropped`` (the misfit check) is the
    median token's energy in the rows the profile's level drops over the median token's
    variance share: what most tokens lose whatever the step, which one outlier token
    does not move.
    """
    kept0 = int(profile.kept[slot, layer, kind])
    part = _Part(sample, sample_rows_needed(profile, slot, layer, kind))
    target = profile.section_target(slot, layer, kind)  # the level's, times the section's weight
    step0 = clamp_step(profile.steps[slot, layer, kind])
    at_profile = part.distortion(step0, kept0)
    dropped = part.dropped_share(kept0, sample.typical)
    if part.variance <= 0 or not math.isfinite(at_profile):
        return PartControl(step0, kept0, at_profile, dropped, at_profile)
    low, high = math.log(step0 / MAX_STEP_FACTOR), math.log(step0 * MAX_STEP_FACTOR)
    tried: list[tuple[float, float, int]] = []  # (log step, log(distortion / target), kept)

    def evaluate(x: float) -> float:
        step = clamp_step(math.exp(x))
        kept = part.kept_for(step)
        d = part.distortion(step, kept)
        g = math.log(d / target) if d > 0 else -math.inf
        tried.append((math.log(step), g, kept))
        return g

    x, g = math.log(step0), evaluate(math.log(step0))
    below, above = (x, g) if g < 0 else (None, None), (x, g) if g >= 0 else (None, None)
    slope = 2.0  # high-rate quantization: distortion ~ step^2
    while abs(g) > math.log1p(TOLERANCE) and len(tried) < MAX_EVALUATIONS:
        nxt = x - g / slope if math.isfinite(g) else x + math.log(4.0)
        lo = below[0] if below[0] is not None else low
        hi = above[0] if above[0] is not None else high
        if not lo < nxt < hi:
            nxt = 0.5 * (lo + hi)
        if abs(nxt - x) < 1e-6:
            break
        g_next = evaluate(nxt)
        if math.isfinite(g) and math.isfinite(g_next) and nxt != x:
            slope = min(max((g_next - g) / (nxt - x), 0.25), 4.0)
        x, g = nxt, g_next
        if g < 0:
            below = (x, g)
        else:
            above = (x, g)
    best_x, best_g, best_kept = min(tried, key=lambda t: abs(t[1]))
    step = clamp_step(math.exp(best_x))
    return PartControl(step, best_kept, at_profile, dropped, target * math.exp(best_g))


def sample_rows(tokens: int) -> slice:
    """Evenly spaced coded tokens the control measures (all of them up to SAMPLE_TOKENS)."""
    return slice(None, None, max(1, -(-tokens // SAMPLE_TOKENS)))
