"""Codec profiles: everything both ends must agree on, fitted once per model.

A profile holds, per (layer, K/V): the channel means, the PCA basis (or none, for
the identity transform), the delta-coding choice, and per quality level the step,
the number of kept components and each component's (shift, table class); plus the
shared rANS tables. Blobs reference it by ``profile.id`` (a hash of its content),
so a profile fetched once serves every context of the model.

Profiles are stored as safetensors (named arrays + a JSON metadata array): a
well-kept, pickle-free format that any language can read.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from . import entropy, prediction, transform
from .allocation import fit_to_budget, validate_weights
from .container import MAX_CHANNELS, MAX_LEVELS, MAX_TABLES, MAX_TOKENS, MAX_U16
from .errors import CorruptBitstream
from .levels import DEFAULT_LEVEL, DEFAULT_TARGETS, design_step, distortion, kept_components
from .rotary import Rotary, rotate

PROFILE_FORMAT = "kvwire-profile"
#: Version 1: no RoPE removal. Version 2 adds ``rotary`` (FORMAT.md, "Profile file"); a
#: profile without one is still written as version 1, so its id does not change.
PROFILE_VERSION = 1
PROFILE_VERSION_ROTARY = 2
#: Version 3 adds ``weights`` (per-section target weights, ``codec.allocation``), with or
#: without ``rotary``; a profile without weights is written as version 1 or 2 as before.
PROFILE_VERSION_WEIGHTS = 3
#: Version 4 adds inter-layer prediction (``predictor`` and ``restart``, FORMAT.md
#: "Inter-layer prediction"), with or without ``rotary`` and ``weights``; a profile
#: without prediction is written as version 1, 2 or 3 as before.
PROFILE_VERSION_PREDICTED = 4
#: Version 5 adds ``default_level`` (the level ``codec.encode`` uses when the caller names
#: none), with or without ``rotary``, ``weights`` and a predictor; a profile whose default
#: is the codec's (``implicit_default_level``) is written as version 1 to 4 as before.
PROFILE_VERSION_DEFAULT_LEVEL = 5
#: Version 6 stores low-rank maps as their factors (``predictor_entry``,
#: ``predictor_exit``, ``predictor_constant`` for ``predictor``: ``codec.prediction.
#: fit_low_rank``), with or without ``rotary``, ``weights`` and ``default_level``; a
#: profile with dense maps is written as version 4 or 5 as before.
PROFILE_VERSION_FACTORED = 6
#: how a predicting calibration may group the channels each map reads
#: (``codec.prediction``): every channel from every channel, K from K and V from V,
#: each KV head from itself, or K from K and V from V through a rank ``LOW_RANK`` map
PREDICT_GROUPS = ("all", "kind", "head", "low-rank")
#: a section's target MSE/var (level target x weight) is capped here: the step design
#: and the control need a target under 1 (a target of 1 drops the whole signal)
MAX_SECTION_TARGET = 0.5
#: the rate-distortion curves that fit the allocation to the uniform bits: tokens, steps
_CURVE_TOKENS = 1024
_CURVE_POINTS = 40
#: Tokens coded in one delta group (anchor + 9 deltas), as in CacheGen.
DELTA_GROUP = 10
#: Attention-sink tokens kept verbatim at the start of a context.
DEFAULT_SINK_TOKENS = 4
#: Relative saving delta coding must show on calibration data to be switched on.
_DELTA_MIN_GAIN = 0.01
_DESIGN_BLOCK = 80  # a multiple of DELTA_GROUP: sample blocks keep groups whole

TRANSFORMS = ("layer", "head", "identity")


@dataclass(frozen=True)
class Level:
    """One rung of the quality ladder."""

    index: int
    target_distortion: float
    #: bits per element measured on the calibration data (side info excluded)
    estimated_bits: float


@dataclass(eq=False)
class Profile:
    """Calibrated codec parameters for one model shape. Arrays are numpy.

    Shapes (L layers, C = heads*head_dim channels, V levels, K kept rows stored):
    mean [L,2,C] f32, basis [L,2,K,C] f32 or None, steps [V,L,2] f32,
    kept [V,L,2] i32, delta_group [L,2] i32, shift/table [V,L,2,2,C] u8
    (axis 3: 0 = direct/anchor values, 1 = delta values), tables [classes, ALPHABET] u16,
    weights [L,2] f32 or None (uniform), predictor [L,2C+1,2C] f16 or None (no
    inter-layer prediction), predictor_factors (entry [L,2,C,r], exit [L,2,r,C]) f16
    or None (dense maps). With a predictor, mean, basis, steps and the tables describe
    the residuals the predicted layers code.
    """

    layers: int
    heads: int
    head_dim: int
    sink_tokens: int
    transform: str
    targets: tuple[float, ...]
    estimated_bits: tuple[float, ...]
    mean: np.ndarray
    basis: np.ndarray | None
    steps: np.ndarray
    kept: np.ndarray
    delta_group: np.ndarray
    shift: np.ndarray
    table: np.ndarray
    tables: np.ndarray
    #: RoPE of the keys, removed before the transform (None: keys are coded as they are)
    rotary: Rotary | None = None
    #: per (layer, K/V) multiple of each level's target MSE/var (``codec.allocation``:
    #: distortion moved to where the model is least sensitive); None: every section
    #: is held to the level's target
    weights: np.ndarray | None = None
    #: each layer's map from the previous layer's decoded values (``codec.prediction``);
    #: None: every layer is coded alone
    predictor: np.ndarray | None = None
    #: with a predictor: layers 0, restart, 2 restart, .. are coded alone
    restart: int = 0
    #: low-rank maps (``codec.prediction.fit_low_rank``): each K and V map's factors,
    #: what the decoders multiply by; ``predictor`` is then their product
    #: (``codec.prediction.expand``). None: the decoders multiply by ``predictor``
    predictor_factors: tuple[np.ndarray, np.ndarray] | None = None
    #: the level ``codec.encode`` uses when the caller names none (None: the codec's,
    #: ``implicit_default_level``); the coarsest level the model's measured quality bars
    #: allow, which depends on the model (``streamer.model.quality.model_default_level``)
    default_level: int | None = None
    _id: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.default_level is None:
            self.default_level = implicit_default_level(len(self.targets))
        self.validate()

    # ----------------------------------------------------------------- identity
    @property
    def channels(self) -> int:
        return self.heads * self.head_dim

    @property
    def levels(self) -> tuple[Level, ...]:
        return tuple(Level(i, t, b) for i, (t, b) in enumerate(zip(self.targets, self.estimated_bits)))

    @property
    def id(self) -> str:
        """16 hex digits of a hash over the profile's content (not its file bytes)."""
        if self._id is None:
            digest = hashlib.blake2b(digest_size=8)
            digest.update(self._metadata_json().encode())
            for name, array in sorted(self._arrays().items()):
                digest.update(name.encode())
                digest.update(np.ascontiguousarray(array).tobytes())
            self._id = digest.hexdigest()
        return self._id

    @cached_property
    def basis64(self) -> np.ndarray | None:
        """``basis`` in float64, converted once: the step control's reference products
        (``codec.control``) take it for every section of every chunk."""
        return None if self.basis is None else self.basis.astype(np.float64)

    @cached_property
    def basis16(self) -> torch.Tensor | None:
        """``basis`` in bfloat16, what the CPU decoder's inverse transform multiplies by
        (``codec.transform.product``), converted once."""
        return None if self.basis is None else torch.from_numpy(self.basis).to(torch.bfloat16)

    def prepare_decoding(self) -> None:
        """Build what every decode multiplies by (``basis16``; a predicting profile's
        ``chain_*`` tables), else made at its first decode: tens of milliseconds that a
        receiver pays when it opens the profile rather than inside a fetch's clock."""
        if self.predictor is None:
            _ = self.basis16
        else:
            _ = self.chain_offsets, self.chain_reach, self.chain_matrices, self.chain_entries

    @cached_property
    def predictor32(self) -> torch.Tensor | None:
        """``predictor`` in float32, what calibration measures the maps with, converted once."""
        return None if self.predictor is None else torch.from_numpy(self.predictor.astype(np.float32))

    @cached_property
    def predictor_by_kind(self) -> np.ndarray | None:
        """``codec.prediction.by_kind`` of ``predictor``: the layers predicted by kind
        with half the work, found once."""
        return None if self.predictor is None else prediction.by_kind(self.predictor)

    @cached_property
    def chain_offsets(self) -> torch.Tensor | None:
        """float32 [L, 2, C]: ``codec.prediction.offsets``, each layer's values less its
        carried state, found once."""
        return None if self.predictor is None else \
            torch.from_numpy(prediction.offsets(self.mean, self.predictor, self.restart))

    @cached_property
    def chain_reach(self) -> np.ndarray | None:
        """int [L]: ``codec.prediction.reach``, the state channels each layer's product takes."""
        return None if self.predictor is None else prediction.reach(self.predictor, self.restart, self.map_rank)

    @property
    def map_rank(self) -> int:
        """The rank of each low-rank map (0: dense maps)."""
        return 0 if self.predictor_factors is None else self.predictor_factors[0].shape[3]

    @cached_property
    def chain_entries(self) -> list[torch.Tensor | None] | None:
        """Per layer, its K and V ``codec.prediction.chain_entry`` (bfloat16 [2, C, rank];
        None for dense maps and at intra layers), built once."""
        if self.predictor is None:
            return None
        return [None if self.predictor_factors is None or prediction.is_intra(layer, self.restart)
                else prediction.chain_entry(self.predictor_factors[0], layer) for layer in range(self.layers)]

    @cached_property
    def chain_matrices(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Per layer, K's and V's ``codec.prediction.chain_matrix`` (bfloat16), what a
        predicting profile's decoders multiply by, built once."""
        if self.predictor is None:
            return None
        exit_ = None if self.predictor_factors is None else self.predictor_factors[1]
        return [tuple(prediction.chain_matrix(self.predictor, self.basis, layer, kind, int(self.chain_reach[layer]),
                                              exit_) for kind in range(2)) for layer in range(self.layers)]

    def section_target(self, slot: int, layer: int, kind: int) -> float:
        """The MSE/var level ``slot`` holds layer ``layer``'s K (kind 0) or V (kind 1) to:
        the level's target times the section's weight (capped at MAX_SECTION_TARGET)."""
        return weighted_target(float(self.targets[slot]),
                               None if self.weights is None else float(self.weights[layer, kind]))

    def targets_by_section(self, slot: int) -> list[list[float]]:
        """``section_target`` of every layer's [K, V] at level ``slot``, layer by layer."""
        return [[self.section_target(slot, layer, kind) for kind in range(2)] for layer in range(self.layers)]

    def __repr__(self) -> str:
        return (f"Profile(id={self.id}, layers={self.layers}, heads={self.heads}, "
                f"head_dim={self.head_dim}, transform={self.transform!r}, levels={len(self.targets)})")

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays: what keeping it costs."""
        return sum(array.nbytes for array in self._arrays().values())

    # ---------------------------------------------------------- serialization
    def _metadata_json(self) -> str:
        meta = {
            "format": PROFILE_FORMAT, "version": PROFILE_VERSION,
            "layers": self.layers, "heads": self.heads, "head_dim": self.head_dim,
            "sink_tokens": self.sink_tokens, "transform": self.transform,
            "targets": list(self.targets), "estimated_bits": list(self.estimated_bits),
        }
        if self.rotary is not None:
            meta.update(version=PROFILE_VERSION_ROTARY, rotary=self.rotary.to_json())
        if self.weights is not None:
            meta.update(version=PROFILE_VERSION_WEIGHTS)
        if self.predictor is not None:
            meta.update(version=PROFILE_VERSION_PREDICTED, restart=self.restart)
        if self.default_level != implicit_default_level(len(self.targets)):
            meta.update(version=PROFILE_VERSION_DEFAULT_LEVEL, default_level=self.default_level)
        if self.predictor_factors is not None:
            meta.update(version=PROFILE_VERSION_FACTORED)
        return json.dumps(meta, sort_keys=True)

    def _arrays(self) -> dict[str, np.ndarray]:
        arrays = {"mean": self.mean, "steps": self.steps, "kept": self.kept,
                  "delta_group": self.delta_group, "shift": self.shift,
                  "table": self.table, "tables": self.tables}
        if self.basis is not None:
            arrays["basis"] = self.basis
        if self.weights is not None:
            arrays["weights"] = self.weights
        if self.predictor_factors is not None:
            arrays["predictor_constant"] = self.predictor[:, -1]
            arrays["predictor_entry"], arrays["predictor_exit"] = self.predictor_factors
        elif self.predictor is not None:
            arrays["predictor"] = self.predictor
        return arrays

    def to_bytes(self) -> bytes:
        from safetensors.numpy import save

        arrays = {k: np.ascontiguousarray(v) for k, v in self._arrays().items()}
        arrays["metadata"] = np.frombuffer(self._metadata_json().encode(), dtype=np.uint8)
        return save(arrays)

    @classmethod
    def from_bytes(cls, data: bytes) -> "Profile":
        """Parse a profile; anything malformed raises CorruptBitstream."""
        from safetensors.numpy import load

        try:
            arrays = load(bytes(data))
            meta = json.loads(arrays.pop("metadata").tobytes().decode())
        except Exception as exc:  # safetensors/json raise many types on garbage
            raise CorruptBitstream(f"not a kvwire profile: {exc}") from exc
        if not isinstance(meta, dict):
            raise CorruptBitstream("not a kvwire profile (metadata is not a JSON object)")
        if meta.get("format") != PROFILE_FORMAT:
            raise CorruptBitstream("not a kvwire profile (format tag missing)")
        version = meta.get("version")
        if version not in (PROFILE_VERSION, PROFILE_VERSION_ROTARY, PROFILE_VERSION_WEIGHTS, PROFILE_VERSION_PREDICTED,
                           PROFILE_VERSION_DEFAULT_LEVEL, PROFILE_VERSION_FACTORED) or isinstance(version, bool):
            raise CorruptBitstream(f"unsupported profile version {version!r}")
        _check_version_fields(version, meta, arrays)
        try:
            rotary = Rotary.from_json(meta["rotary"]) if "rotary" in meta else None
            factors, predictor = None, arrays.get("predictor")
            if "predictor_entry" in arrays:
                factors = (arrays["predictor_entry"], arrays["predictor_exit"])
                predictor = _factored_predictor(meta, arrays["predictor_constant"], *factors)
            return cls(
                layers=int(meta["layers"]), heads=int(meta["heads"]), head_dim=int(meta["head_dim"]),
                sink_tokens=int(meta["sink_tokens"]), transform=str(meta["transform"]),
                targets=tuple(float(t) for t in meta["targets"]),
                estimated_bits=tuple(float(b) for b in meta["estimated_bits"]),
                mean=arrays["mean"], basis=arrays.get("basis"), steps=arrays["steps"],
                kept=arrays["kept"], delta_group=arrays["delta_group"], shift=arrays["shift"],
                table=arrays["table"], tables=arrays["tables"], rotary=rotary,
                weights=arrays.get("weights"), predictor=predictor, predictor_factors=factors,
                restart=int(meta.get("restart", 0)), default_level=meta.get("default_level"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptBitstream(f"malformed kvwire profile: {exc}") from exc

    def save(self, path: str | Path) -> None:
        Path(path).write_bytes(self.to_bytes())

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        return cls.from_bytes(Path(path).read_bytes())

    # ------------------------------------------------------------- validation
    def validate(self) -> None:
        """Check every array's shape, dtype and range; raise ValueError naming the fault."""
        L, C, V = self.layers, self.channels, len(self.targets)
        if min(L, self.heads, self.head_dim) < 1 or V < 1 or self.sink_tokens < 0:
            raise ValueError("profile dimensions must be positive")
        # the blob format's limits (FORMAT.md, "Limits"): a profile outside them could
        # never describe a blob, and the coder's tables are sized from these numbers
        if max(L, self.heads, self.head_dim, self.sink_tokens) > MAX_U16 or C > MAX_CHANNELS \
                or V > MAX_LEVELS:
            raise ValueError(f"profile dimensions exceed the format's limits (layers, heads, head_dim, "
                             f"sink_tokens <= {MAX_U16}, channels <= {MAX_CHANNELS}, levels <= {MAX_LEVELS})")
        if self.transform not in TRANSFORMS:
            raise ValueError(f"unknown transform {self.transform!r}")
        if len(self.estimated_bits) != V:
            raise ValueError("estimated_bits must have one entry per level")
        expect = {
            "mean": ((L, 2, C), np.float32), "steps": ((V, L, 2), np.float32),
            "kept": ((V, L, 2), np.int32), "delta_group": ((L, 2), np.int32),
            "shift": ((V, L, 2, 2, C), np.uint8), "table": ((V, L, 2, 2, C), np.uint8),
        }
        for name, (shape, dtype) in expect.items():
            array = getattr(self, name)
            if not isinstance(array, np.ndarray) or array.shape != shape or array.dtype != dtype:
                got = (getattr(array, "dtype", type(array)), getattr(array, "shape", None))
                raise ValueError(f"profile.{name} must be {np.dtype(dtype)} {shape}, got {got}")
        entropy.validate_tables(self.tables)
        if self.tables.shape[0] > MAX_TABLES:  # the decoder builds a 4096-entry lookup per table
            raise ValueError(f"profile.tables has {self.tables.shape[0]} tables, at most {MAX_TABLES}")
        if self.table.size and int(self.table.max()) >= self.tables.shape[0]:
            raise ValueError("profile.table refers to a missing table")
        if self.shift.size and int(self.shift.max()) > entropy.PROB_BITS:
            raise ValueError("profile.shift exceeds the probability precision")
        if not np.all(np.isfinite(self.steps)) or np.any(self.steps <= 0):
            raise ValueError("profile.steps must be positive and finite")
        if not np.all(np.isfinite(self.mean)):
            raise ValueError("profile.mean must be finite")
        if self.rotary is not None and (not isinstance(self.rotary, Rotary)
                                        or self.rotary.head_dim != self.head_dim):
            raise ValueError(f"profile.rotary must be a Rotary of head_dim {self.head_dim}, got {self.rotary!r}")
        if self.weights is not None:
            validate_weights(self.weights, L)
        if not isinstance(self.default_level, int) or isinstance(self.default_level, bool) \
                or not 0 <= self.default_level < V:
            raise ValueError(f"profile.default_level must be an int in [0, {V}), got {self.default_level!r}")
        self._validate_predictor()
        if np.any(self.delta_group < 0) or np.any(self.delta_group > MAX_TOKENS):
            raise ValueError(f"profile.delta_group must be in [0, {MAX_TOKENS}]")
        if np.any(self.kept < 0):
            raise ValueError("profile.kept must be >= 0")
        if self.basis is None:
            if self.transform != "identity" or np.any(self.kept != C):
                raise ValueError("a profile without a basis must keep every channel")
        else:
            # kept <= basis rows <= channels: the coder's per-row tables (shift, table)
            # have C entries and the inverse transform reads kept basis rows
            if self.basis.dtype != np.float32 or self.basis.ndim != 4 \
                    or self.basis.shape[:2] != (L, 2) or self.basis.shape[3] != C \
                    or self.basis.shape[2] > C:
                raise ValueError(f"profile.basis must be float32 [{L}, 2, R, {C}] with R <= {C}")
            if np.any(self.kept > self.basis.shape[2]):
                raise ValueError("profile.kept exceeds the stored basis rows")
            if not np.all(np.isfinite(self.basis)):
                raise ValueError("profile.basis must be finite")

    def _validate_predictor(self) -> None:
        if self.predictor is None:
            if self.restart != 0:
                raise ValueError("profile.restart is set without a predictor")
            if self.predictor_factors is not None:
                raise ValueError("profile.predictor_factors are set without a predictor")
            return
        L, C = self.layers, self.channels
        if not isinstance(self.predictor, np.ndarray) or self.predictor.dtype != np.float16 \
                or self.predictor.shape != (L, 2 * C + 1, 2 * C):
            raise ValueError(f"profile.predictor must be float16 [{L}, {2 * C + 1}, {2 * C}]")
        if not isinstance(self.restart, int) or not 1 <= self.restart <= MAX_U16:
            raise ValueError(f"profile.restart must be an int in [1, {MAX_U16}], got {self.restart!r}")
        if not np.all(np.isfinite(self.predictor)):
            raise ValueError("profile.predictor must be finite")
        if np.any(self.predictor[::self.restart] != 0):
            raise ValueError("profile.predictor must be zero at the intra-coded layers (0, restart, ..)")
        if self.predictor_factors is not None:
            self._validate_factors()

    def _validate_factors(self) -> None:
        L, C = self.layers, self.channels
        factors = self.predictor_factors
        if not isinstance(factors, tuple) or len(factors) != 2 \
                or not all(isinstance(f, np.ndarray) and f.dtype == np.float16 for f in factors):
            raise ValueError("profile.predictor_factors must be a pair of float16 arrays (entry, exit)")
        entry, exit_ = factors
        _check_factor_shapes(L, C, entry, exit_)
        if not (np.all(np.isfinite(entry)) and np.all(np.isfinite(exit_))):
            raise ValueError("profile.predictor_factors must be finite")
        if np.any(entry[::self.restart] != 0) or np.any(exit_[::self.restart] != 0):
            raise ValueError("profile.predictor_factors must be zero at the intra-coded layers (0, restart, ..)")
        if not np.array_equal(self.predictor, prediction.expand(self.predictor[:, -1], entry, exit_)):
            raise ValueError("profile.predictor must be its factors' product (codec.prediction.expand)")

    @property
    def predicts(self) -> bool:
        """Whether blobs of this profile predict layers from the layers before them (format 7)."""
        return self.predictor is not None

    @property
    def intra_period(self) -> int:
        """Every how many layers one is coded alone: ``restart`` with a predictor, else 1
        (each layer is). What a stored context's manifest records (``Manifest.restart``)."""
        return self.restart if self.predicts else 1

    def check_shape(self, layers: int, heads: int, head_dim: int) -> None:
        if (layers, heads, head_dim) != (self.layers, self.heads, self.head_dim):
            raise ValueError(
                f"KV shape (layers={layers}, heads={heads}, head_dim={head_dim}) does not match "
                f"profile {self.id} (layers={self.layers}, heads={self.heads}, head_dim={self.head_dim})")

    def check_level(self, level: int) -> None:
        validate_level(level, len(self.targets))


def implicit_default_level(levels: int) -> int:
    """The default level of a profile of ``levels`` levels that names none: the codec's
    (``DEFAULT_LEVEL``), or its coarsest level when it has fewer."""
    return min(DEFAULT_LEVEL, levels - 1)


def _check_version_fields(version: int, meta: dict, arrays: dict) -> None:
    """Raise CorruptBitstream unless the optional fields ``meta`` and ``arrays`` carry are
    those of their ``version``: each version adds one (FORMAT.md, "Profile file"), a later
    one may carry an earlier one's, and a profile is written as the lowest version that
    holds what it carries (so one profile has one file and one id)."""
    def must(carries: bool, required: bool, what: str) -> None:
        if carries != required:
            raise CorruptBitstream(f"a version {version} profile must {'not ' * (not required)}carry {what}")

    if version < PROFILE_VERSION_WEIGHTS:
        must("rotary" in meta, version == PROFILE_VERSION_ROTARY, "rotary")
    if version < PROFILE_VERSION_PREDICTED:
        must("weights" in arrays, version == PROFILE_VERSION_WEIGHTS, "weights")
    factor_names = ("predictor_constant", "predictor_entry", "predictor_exit")
    factored = [name in arrays for name in factor_names]
    if any(factored) != all(factored):
        raise CorruptBitstream(f"a profile carries all of {', '.join(factor_names)} or none")
    if all(factored) and "predictor" in arrays:
        raise CorruptBitstream("a profile carries a predictor or its factors, not both")
    predicted = "predictor" in arrays or all(factored)
    if predicted != ("restart" in meta):
        raise CorruptBitstream("a profile carries a predictor and its restart period, or neither")
    if version < PROFILE_VERSION_DEFAULT_LEVEL:
        must(predicted, version == PROFILE_VERSION_PREDICTED, "a predictor and its restart period")
    must(all(factored), version == PROFILE_VERSION_FACTORED, "a factored predictor")
    if version < PROFILE_VERSION_FACTORED:
        must("default_level" in meta, version == PROFILE_VERSION_DEFAULT_LEVEL, "default_level")
    for key in ("restart", "default_level"):
        if key in meta and (not isinstance(meta[key], int) or isinstance(meta[key], bool)):
            raise CorruptBitstream(f"profile {key} must be an integer, got {meta[key]!r}")
    if "default_level" in meta and isinstance(meta.get("targets"), list) \
            and meta["default_level"] == implicit_default_level(len(meta["targets"])):
        raise CorruptBitstream(f"a version {version} profile's default_level differs from the codec's "
                               f"({meta['default_level']}); a profile at the codec's is written as version 1 to 4 (or 6) "
                               f"without it")


def _check_factor_shapes(layers: int, channels: int, entry: np.ndarray, exit_: np.ndarray) -> None:
    """ValueError unless ``entry`` is [L, 2, C, r] and ``exit_`` [L, 2, r, C], 1 <= r <= C."""
    L, C = layers, channels
    rank = entry.shape[-1] if entry.ndim == 4 else 0
    if entry.shape != (L, 2, C, rank) or exit_.shape != (L, 2, rank, C) or not 1 <= rank <= C:
        raise ValueError(f"the predictor's factors must be [{L}, 2, {C}, r] and [{L}, 2, r, {C}] with 1 <= r <= {C}")


def _factored_predictor(meta: dict, constant: np.ndarray, entry: np.ndarray, exit_: np.ndarray) -> np.ndarray:
    """A version 6 profile's dense maps from its stored factors, whose shapes are checked
    against the metadata's first: the product's size is the metadata's to bound."""
    L, C = int(meta["layers"]), int(meta["heads"]) * int(meta["head_dim"])
    _check_factor_shapes(L, C, entry, exit_)
    if constant.shape != (L, 2 * C):
        raise ValueError(f"predictor_constant must be [{L}, {2 * C}]")
    if not all(array.dtype == np.float16 for array in (constant, entry, exit_)):
        raise ValueError("predictor_constant, predictor_entry and predictor_exit must be float16")
    return prediction.expand(constant, entry, exit_)


def weighted_target(target: float, weight: float | None) -> float:
    """A level's target MSE/var as one section is held to it (``weight`` None: uniform)."""
    return target if weight is None else min(target * weight, MAX_SECTION_TARGET)


# --------------------------------------------------------------------------- fitting
def validate_level(level: object, levels: int) -> None:
    """ValueError unless ``level`` is an int (not a bool) in [0, levels)."""
    if not isinstance(level, (int, np.integer)) or isinstance(level, bool) or not 0 <= level < levels:
        raise ValueError(f"level must be an int in [0, {levels - 1}], got {level!r}")


def validate_kv(kv: object) -> torch.Tensor:
    """Return ``kv`` if it is a usable KV tensor; ValueError naming the fault otherwise."""
    if not isinstance(kv, torch.Tensor):
        raise ValueError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"kv must have shape [layers, 2, tokens, heads, head_dim], got {tuple(kv.shape)}")
    if kv.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"kv dtype must be float16, bfloat16 or float32, got {kv.dtype}")
    if kv.numel() == 0:
        raise ValueError(f"kv is empty: shape {tuple(kv.shape)}")
    if kv.shape[0] > 0xFFFF or kv.shape[3] > 0xFFFF or kv.shape[4] > 0xFFFF or kv.shape[2] > MAX_TOKENS:
        raise ValueError(f"kv shape {tuple(kv.shape)} exceeds the format's limits (at most 65535 "
                         f"layers, heads and head_dim, and {MAX_TOKENS} tokens per blob: chunk longer contexts)")
    if not _all_finite(kv):
        raise ValueError("kv contains NaN or infinite values")
    return kv


def _all_finite(kv: torch.Tensor) -> bool:
    """Whether every value is finite: the least and the largest are (torch's reductions
    propagate NaN), in one pass that allocates nothing, a tenth of ``kv.abs().max()``'s
    time on fp16 KV."""
    return bool(torch.isfinite(torch.stack(torch.aminmax(kv))).all())


def _design_sample(tokens: int, budget: int) -> np.ndarray:
    """Token indices for step design: evenly spaced whole blocks (delta groups stay intact)."""
    if tokens <= budget:
        return np.arange(tokens)
    blocks = max(budget // _DESIGN_BLOCK, 1)
    starts = np.linspace(0, tokens - _DESIGN_BLOCK, blocks).astype(np.int64)
    starts -= starts % DELTA_GROUP
    return (starts[:, None] + np.arange(_DESIGN_BLOCK)[None, :]).reshape(-1)


def _delta_coefficients(coef: np.ndarray) -> np.ndarray:
    """Differences to each group's anchor [C, N - N/G] (anchors themselves left out)."""
    n = coef.shape[1] - coef.shape[1] % DELTA_GROUP
    groups = coef[:, :n].reshape(coef.shape[0], -1, DELTA_GROUP)
    return (groups[:, :, 1:] - groups[:, :, :1]).reshape(coef.shape[0], -1)


def _empirical_bits(values: np.ndarray, step: float, unbiased: bool = False) -> float:
    """Sum over rows of the empirical entropy (bits) of rint(values / step). ``unbiased``
    adds Miller-Madow's (symbols seen - 1) / (2 ln 2) bits per row: the plain estimate
    falls short the more symbols a row has, which would favour finely coded sections when
    comparing bit costs across sections."""
    total = 0.0
    for row in values:
        q = np.rint(row / step).astype(np.int64)
        counts = np.bincount(q - q.min())
        p = counts[counts > 0] / q.size
        total += float(-(p * np.log2(p)).sum()) * q.size + unbiased * (p.size - 1) / (2 * np.log(2))
    return total


def _head_block_pca(cov: torch.Tensor, heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-diagonal basis (PCA within each head), rows sorted by variance."""
    C = heads * head_dim
    basis = torch.zeros(C, C, dtype=torch.float64)
    variances = torch.zeros(C, dtype=torch.float64)
    for h in range(heads):
        sl = slice(h * head_dim, (h + 1) * head_dim)
        b, v = transform.pca_basis(cov[sl, sl])
        basis[sl, sl] = b.T  # columns for now; transposed below
        variances[sl] = v
    basis = basis.T
    order = torch.argsort(variances, descending=True)
    return basis[order].contiguous(), variances[order]


@dataclass
class _Fit:
    """Per (layer, K/V) fitting results before they are packed into arrays."""

    mean: np.ndarray
    basis: np.ndarray | None
    steps: list[float]
    kept: list[int]
    delta: int
    sample_coef: np.ndarray
    variances: np.ndarray
    delta_variances: np.ndarray


@dataclass
class _Basis:
    """One section's transform and design sample: what does not depend on the targets."""

    mean: torch.Tensor
    basis: torch.Tensor | None
    coef: np.ndarray
    variances: np.ndarray


def _section_basis(x: torch.Tensor, heads: int, head_dim: int, how: str, design_tokens: int) -> _Basis:
    if x.shape[0] == 0:  # nothing beyond the sinks: a neutral fit keeps the profile valid
        x = torch.zeros(1, x.shape[1], dtype=torch.float32)
    if how == "identity":
        x64 = x.to(torch.float64)
        mean = x64.mean(dim=0)
        basis = None
        variances = x64.var(dim=0, unbiased=False) if x.shape[0] > 1 else torch.zeros(x.shape[1], dtype=torch.float64)
    else:
        mean, cov = transform.channel_stats(x)
        basis, variances = (transform.pca_basis(cov) if how == "layer"
                            else _head_block_pca(cov, heads, head_dim))
    mean32 = mean.to(torch.float32)
    basis32 = None if basis is None else basis.to(torch.float32)
    sample = x[torch.from_numpy(_design_sample(x.shape[0], design_tokens))]
    return _Basis(mean32, basis32, transform.forward(sample, mean32, basis32).numpy(), variances.numpy())


def _bits_curve(section: _Basis) -> tuple[np.ndarray, np.ndarray]:
    """(log MSE/var, bits per element) of direct coding at a grid of steps, on a token
    sub-sample: a section's rate-distortion curve, read off by ``np.interp`` when the
    allocation is fitted to the uniform split's bits (designing steps for every candidate
    scale would cost a step bisection each)."""
    coef, var = section.coef, section.variances
    total = float(var.sum())
    if total <= 0:
        return np.zeros(1), np.zeros(1)
    allow_drop = section.basis is not None
    sub = coef[:, ::max(coef.shape[1] // _CURVE_TOKENS, 1)]
    log_d, bits = [], []
    for step in float(np.sqrt(var.max())) * np.logspace(-4, 1, _CURVE_POINTS):
        kept = kept_components(var, step) if allow_drop else sub.shape[0]
        log_d.append(np.log(max(distortion(sub, var, step, allow_drop) / total, 1e-30)))
        bits.append(_empirical_bits(sub[:kept], step, unbiased=True) / sub.size)
    # np.interp wants increasing abscissae: distortion rises with the step up to sampling noise
    return np.maximum.accumulate(np.array(log_d)) + 1e-9 * np.arange(len(log_d)), np.array(bits)


def _design_target(target: float, weight: float | None, ratio: float) -> float:
    """The MSE/var, relative to what a section codes, that its steps are designed for:
    ``weighted_target``, times ``ratio`` (the values' variance over the coded residual's,
    1 without prediction: a predicted section is held to the values' error), capped."""
    value = weighted_target(target, weight)
    return value if ratio == 1 else min(value * ratio, MAX_SECTION_TARGET)


def _budget_weights(bases: list[list[_Basis]], targets: Sequence[float], weights: np.ndarray,
                    ratio: np.ndarray) -> np.ndarray:
    """``weights`` scaled (``allocation.fit_to_budget``) so that at no level the sections'
    estimated bits exceed those of the uniform split. Every level, not only the default:
    one weight set serves them all, and the low-rate levels are where the high-rate model
    that ``allocate`` normalises by is furthest off."""
    curves = [[_bits_curve(b) for b in row] for row in bases]

    def bits(w: np.ndarray | None, target: float, level: int) -> float:
        return sum(float(np.interp(np.log(_design_target(target, None if w is None else float(w[l, kv]),
                                                         float(ratio[level, l, kv]))), *curves[l][kv]))
                   for l in range(len(curves)) for kv in range(2))

    uniform = [bits(None, t, v) for v, t in enumerate(targets)]
    return fit_to_budget(weights, lambda w: max(bits(w, t, v) - u for v, (t, u) in enumerate(zip(targets, uniform))))


def _fit_one(section: _Basis, targets: Sequence[float], delta: str) -> _Fit:
    mean32, basis32, coef, var = section.mean, section.basis, section.coef, section.variances
    allow_drop = basis32 is not None
    designed = [design_step(coef, var, t, allow_drop) for t in targets]
    delta_coef = _delta_coefficients(coef)
    delta_var = delta_coef.var(axis=1) if delta_coef.shape[1] else var.copy()
    use_delta = delta == "always"
    if delta == "auto" and delta_coef.shape[1]:
        step, kept = designed[len(designed) // 2]
        direct = _empirical_bits(coef[:kept], step)
        anchors = coef[:kept, ::DELTA_GROUP][:, : delta_coef.shape[1] // (DELTA_GROUP - 1)]
        grouped = _empirical_bits(anchors, step) + _empirical_bits(delta_coef[:kept], step)
        use_delta = grouped < (1 - _DELTA_MIN_GAIN) * direct
    return _Fit(mean=mean32.numpy(), basis=None if basis32 is None else basis32.numpy(),
                steps=[s for s, _ in designed], kept=[k for _, k in designed],
                delta=DELTA_GROUP if use_delta else 0, sample_coef=coef,
                variances=var, delta_variances=delta_var)


def _symbol_histograms(fit: _Fit, level: int, shift: np.ndarray, table: np.ndarray,
                       hist: np.ndarray) -> float:
    """Add the symbols of one (layer, K/V, level) on the design sample to ``hist``.

    Returns the raw bits spent outside the tables (low bits and escape payloads).
    """
    step, kept = fit.steps[level], fit.kept[level]
    coef = fit.sample_coef[:kept]
    kinds = [(coef, 0)]
    if fit.delta:
        n = coef.shape[1] - coef.shape[1] % DELTA_GROUP
        # explicit sizes: a level that keeps no component has an empty sample to reshape
        groups = coef[:, :n].reshape(kept, n // DELTA_GROUP, DELTA_GROUP)
        anchors = np.rint(groups[:, :, :1] / step) * step  # as the decoder rebuilds them
        kinds = [(coef[:, ::DELTA_GROUP], 0),
                 ((groups[:, :, 1:] - anchors).reshape(kept, n // DELTA_GROUP * (DELTA_GROUP - 1)), 1)]
    raw_bits = 0.0
    for values, kind in kinds:
        q = np.rint(values / step).astype(np.int64)
        b = shift[kind, :kept].astype(np.int64)[:, None]
        idx = (q >> b) + entropy.ZERO_SYMBOL
        escaped = (idx < 0) | (idx >= entropy.ESCAPE)
        idx[escaped] = entropy.ESCAPE
        cls = np.broadcast_to(table[kind, :kept].astype(np.int64)[:, None], idx.shape)
        hist += np.bincount((cls * entropy.ALPHABET + idx).ravel(),
                            minlength=hist.size).reshape(hist.shape)
        raw_bits += float((np.broadcast_to(b, q.shape) * ~escaped).sum()) + 36.0 * float(escaped.sum())
    return raw_bits


def _assign_classes(fit: _Fit, level: int, channels: int) -> tuple[np.ndarray, np.ndarray]:
    """(shift, table class) [2, C] for direct/anchor and delta values of one level."""
    step = fit.steps[level]
    shift = np.zeros((2, channels), dtype=np.uint8)
    table = np.zeros((2, channels), dtype=np.uint8)
    for kind, var in enumerate((fit.variances, fit.delta_variances)):
        scale = np.sqrt(np.maximum(var, 0.0)) / step
        shift[kind] = entropy.shift_for_scale(scale)
        table[kind] = entropy.class_for_scale(scale, shift[kind])
    return shift, table


def fit_profile(tokens: Sequence[Sequence[torch.Tensor]], heads: int, head_dim: int, *,
                targets: Sequence[float] = DEFAULT_TARGETS, sink_tokens: int = DEFAULT_SINK_TOKENS,
                transform_kind: str = "layer", delta: str = "auto", design_tokens: int = 4096,
                rotary: Rotary | None = None, weights: np.ndarray | None = None,
                predictor: np.ndarray | None = None, restart: int = 0,
                predictor_factors: tuple[np.ndarray, np.ndarray] | None = None,
                design_ratio: np.ndarray | None = None) -> Profile:
    """Fit a profile to tokens[layer][kv] = tensor [N, C] (sinks already removed; keys
    already rotated back when ``rotary`` is given, which the profile then records). With
    ``weights`` [layers, 2] (scaled as ``calibrate`` says) each section's steps are designed
    for its weighted targets. With a ``predictor`` (``codec.prediction.fit``) ``tokens``
    are the residuals the predicted layers code, and ``design_ratio`` [levels, layers, 2]
    the values' variance over theirs at each level: the steps aim at the values' error."""
    if transform_kind not in TRANSFORMS:
        raise ValueError(f"transform must be one of {TRANSFORMS}, got {transform_kind!r}")
    if delta not in ("auto", "never", "always"):
        raise ValueError(f"delta must be 'auto', 'never' or 'always', got {delta!r}")
    targets = tuple(float(t) for t in targets)
    if not targets or list(targets) != sorted(targets) or len(set(targets)) != len(targets):
        raise ValueError("targets must be strictly increasing distortions (best quality first)")
    L, C, V = len(tokens), heads * head_dim, len(targets)
    if weights is not None:
        weights = np.asarray(weights, dtype=np.float32)
        validate_weights(weights, L)

    ratio = np.ones((V, L, 2)) if design_ratio is None else np.asarray(design_ratio, dtype=np.float64)

    def section_targets(l: int, kv: int) -> list[float]:
        return [_design_target(t, None if weights is None else float(weights[l, kv]), float(ratio[v, l, kv]))
                for v, t in enumerate(targets)]

    bases = [[_section_basis(tokens[l][kv], heads, head_dim, transform_kind, design_tokens)
              for kv in range(2)] for l in range(L)]
    if weights is not None:
        weights = _budget_weights(bases, targets, weights, ratio)
    fits = [[_fit_one(bases[l][kv], section_targets(l, kv), delta) for kv in range(2)] for l in range(L)]
    shift = np.zeros((V, L, 2, 2, C), dtype=np.uint8)
    table = np.zeros((V, L, 2, 2, C), dtype=np.uint8)
    hist = np.zeros((V, entropy.NUM_CLASSES, entropy.ALPHABET), dtype=np.float64)
    raw_bits = np.zeros(V)
    elements = np.zeros(V)
    for l in range(L):
        for kv in range(2):
            fit = fits[l][kv]
            for v in range(V):
                shift[v, l, kv], table[v, l, kv] = _assign_classes(fit, v, C)
                raw_bits[v] += _symbol_histograms(fit, v, shift[v, l, kv], table[v, l, kv], hist[v])
                elements[v] += fit.sample_coef.shape[1] * C
    tables = entropy.build_tables(hist.sum(axis=0))
    cost = entropy.symbol_cost_bits(tables)
    coded = np.where(hist > 0, hist * np.where(np.isfinite(cost), cost, 0.0)[None], 0.0)
    estimated = tuple(float(b) for b in (coded.sum(axis=(1, 2)) + raw_bits) / np.maximum(elements, 1))
    kept = np.array([[[fits[l][kv].kept[v] for kv in range(2)] for l in range(L)] for v in range(V)],
                    dtype=np.int32)
    if transform_kind == "identity":
        basis = None
    else:
        rows = max(int(kept.max()), 1)
        basis = np.stack([np.stack([fits[l][kv].basis[:rows] for kv in range(2)]) for l in range(L)])
    return Profile(
        layers=L, heads=heads, head_dim=head_dim, sink_tokens=int(sink_tokens),
        transform=transform_kind, targets=targets, estimated_bits=estimated,
        mean=np.stack([np.stack([fits[l][kv].mean for kv in range(2)]) for l in range(L)]),
        basis=basis,
        steps=np.array([[[fits[l][kv].steps[v] for kv in range(2)] for l in range(L)] for v in range(V)],
                       dtype=np.float32),
        kept=kept,
        delta_group=np.array([[fits[l][kv].delta for kv in range(2)] for l in range(L)], dtype=np.int32),
        shift=shift, table=table, tables=tables, rotary=rotary, weights=weights,
        predictor=predictor, restart=restart, predictor_factors=predictor_factors,
    )


class CodedBody:
    """A chunk's tokens after the sinks, float32 [C] each, as the transform sees them:
    with ``rotary``, keys rotated back from positions ``start + sink_tokens ..``.

    Made a layer at a time (or a few sampled tokens across layers), never the whole
    chunk at once: a chunk's whole body (47 MB for 1024 tokens of SmolLM2) is over
    glibc's 32 MB ceiling for reusing freed memory, so an encode that held it would take
    it fresh from the kernel every time, a page fault per 4 KB, and those faults, not the
    fp16 -> fp32 conversion, would dominate its cost. A layer's part is freed before the
    next is made and is reused from the heap.
    """

    def __init__(self, kv: torch.Tensor, sink_tokens: int, rotary: Rotary | None, start: int = 0) -> None:
        self._kv = kv[:, :, sink_tokens:]
        self.layers = kv.shape[0]
        self.tokens = self._kv.shape[2]
        self._rotary = rotary
        self._angles = rotary.angles(start + sink_tokens, self.tokens) if rotary is not None and self.tokens else None

    def layer(self, layer: int) -> torch.Tensor:
        """float32 [2, N, C]: layer ``layer``'s keys and values."""
        return self._coded(self._kv[layer], self._angles)

    def rows(self, rows: slice | torch.Tensor, *, own_frame: bool = False) -> torch.Tensor:
        """float32 [layers, 2, len(rows), C]: the tokens ``rows`` of every layer, the same
        values :meth:`layer` gives for them, or with ``own_frame`` as the KV holds them
        (keys with RoPE)."""
        angles = None if self._angles is None or own_frame else (self._angles[0][rows], self._angles[1][rows])
        return self._coded(self._kv[:, :, rows], angles)

    def _coded(self, kv: torch.Tensor, angles: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        if angles is None:
            return kv.to(torch.float32).flatten(-2)
        coded = kv.to(torch.float32, copy=True).flatten(-2)  # its keys rotate in place: never the caller's KV
        coded[..., 0, :, :] = rotate(coded[..., 0, :, :], self._rotary, angles, inverse=True)
        return coded


def split_tokens(kv: torch.Tensor, sink_tokens: int, rotary: Rotary | None = None) -> list[list[torch.Tensor]]:
    """tokens[layer][kv] = float32 [N, C] of the non-sink tokens of ``kv`` (see CodedBody)."""
    body = CodedBody(kv, sink_tokens, rotary)
    return [list(body.layer(layer).unbind(0)) for layer in range(body.layers)]


def embedded_profile(kv: torch.Tensor, level: int, sink_tokens: int) -> Profile:
    """The single-level, identity-transform profile a blob carries when there is none.

    Identity because a PCA basis (C x C floats per layer and K/V) would outweigh
    the saving on any but very long contexts.
    """
    tokens = split_tokens(kv, sink_tokens)
    return fit_profile(tokens, kv.shape[3], kv.shape[4], targets=(DEFAULT_TARGETS[level],),
                       sink_tokens=sink_tokens, transform_kind="identity", delta="auto",
                       design_tokens=1024)


__all__ = ["Profile", "Level", "Rotary", "DEFAULT_LEVEL", "DEFAULT_TARGETS"]


#: room for a profile file's JSON (safetensors' array index and the metadata array: the
#: targets and estimated bits of up to MAX_LEVELS levels, and rotary) beyond its arrays
_PROFILE_JSON_BYTES = 256 << 10


def max_profile_bytes(layers: int, heads: int, head_dim: int, levels: int) -> int:
    """The most bytes a profile file of these dimensions can take (FORMAT.md, "Profile
    file": every array at its largest, the basis square, MAX_TABLES tables): a receiver
    that knows a context's shape refuses a longer one before reading it whole."""
    L, C, V = layers, heads * head_dim, levels
    arrays = (L * 2 * C * 4                  # mean
              + L * 2 * C * C * 4            # basis, R <= C rows
              + 2 * V * L * 2 * 4            # steps, kept
              + L * 2 * 4 * 2                # delta_group, weights
              + 2 * V * L * 2 * 2 * C        # shift, table
              + MAX_TABLES * 128 * 2         # tables
              + max(L * (2 * C + 1) * 2 * C * 2,             # predictor, float16
                    L * 2 * C * 2 + 2 * L * 2 * C * C * 2))  # or its factors, rank <= C
    return arrays + _PROFILE_JSON_BYTES

