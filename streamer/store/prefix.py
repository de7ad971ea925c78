"""Content-addressed prefixes: a context named by the hash chain of its token chunks.

A prompt's tokens are cut into chunks of ``chunk_tokens`` (the codec's chunks, so chunk i
of the chain is chunk i of the stored context; the last may be partial). Chunk i's hash
covers everything its KV depends on: the model, the tokenizer, the codec profile, the
chunk size, the blob format version (``PrefixIdentity``) and every token up to the end of
chunk i. Two prompts that share their first k chunks share the first k hashes, so a
store can answer "the longest stored prefix of these tokens" from the hashes alone.

Encoding (all integers little-endian; SHA-256 from ``hashlib``, never Python's ``hash``)::

    identity  = str(model) str(tokenizer) str(profile_id) u32(chunk_tokens) u32(format_version)
                where str(s) = u32(len(utf8(s))) utf8(s)
    h_0       = SHA-256(b"kvwire-prefix" u32(PREFIX_SCHEME) identity)
    h_i       = SHA-256(h_{i-1} u32(tokens in chunk i) token ids of chunk i as u32)

``h_{i-1}`` enters as its 32 raw bytes; the chain is ``h_1 .. h_n`` as lowercase hex. The
length prefixes make the encoding injective (no two identities or chunk sequences share
bytes), and chaining makes ``h_i`` commit to every earlier token. The context holding the
whole chain is stored as ``prefix_context_id(chain)`` = ``"px-" + h_n``.
"""
from __future__ import annotations

import hashlib
import re
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    import torch

#: Bump if the hashing above ever changes: old and new chains then never collide.
PREFIX_SCHEME = 1
#: Most hashes one lookup may carry (the wire's and the stores' bound on a lookup's size);
#: a longer prompt looks up its chain's first MAX_LOOKUP_CHAIN hashes (a put indexes all).
MAX_LOOKUP_CHAIN = 512
#: What every content-addressed context id starts with.
PREFIX_CONTEXT_PREFIX = "px-"
_DOMAIN = b"kvwire-prefix"
_U32 = struct.Struct("<I")
_HASH_RE = re.compile(r"[0-9a-f]{64}")
_TOKEN_DTYPE = np.dtype("<u4")


def _u32(value: int) -> bytes:
    return _U32.pack(value)


def _field(value: str) -> bytes:
    data = value.encode("utf-8")
    return _u32(len(data)) + data


def _check_int(value: object, what: str, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value < 2 ** 32:
        raise ValueError(f"{what} must be an int in [{minimum}, 2**32), got {value!r}")
    return value


@dataclass(frozen=True)
class PrefixIdentity:
    """What a chunk's KV depends on besides its tokens; part of every hash of a chain."""

    #: model identity, e.g. "HuggingFaceTB/SmolLM2-135M-Instruct" or a hash of its weights
    model: str
    #: tokenizer identity (its name or a hash of its vocabulary)
    tokenizer: str
    #: id of the codec profile the blobs are encoded with
    profile_id: str
    #: tokens per chunk (>= 1): the stored context's chunk size too
    chunk_tokens: int
    #: the codec's blob format version (``codec.container.FORMAT_VERSION``)
    format_version: int

    def __post_init__(self) -> None:
        for name in ("model", "tokenizer", "profile_id"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        _check_int(self.chunk_tokens, "chunk_tokens", 1)
        _check_int(self.format_version, "format_version", 0)

    def to_bytes(self) -> bytes:
        """The canonical encoding hashed into ``h_0`` (see the module docstring)."""
        return (_field(self.model) + _field(self.tokenizer) + _field(self.profile_id)
                + _u32(self.chunk_tokens) + _u32(self.format_version))


def _token_array(token_ids: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    ids = np.asarray(token_ids)  # lists, numpy arrays and CPU torch tensors alike
    if ids.ndim != 1:
        raise ValueError(f"token_ids must be a flat sequence of ids, got shape {ids.shape}")
    if ids.size == 0:
        raise ValueError("token_ids is empty: a prefix holds at least one token")
    if ids.dtype.kind not in "iu":
        raise ValueError(f"token_ids must be integers, got dtype {ids.dtype}")
    if int(ids.min()) < 0:
        raise ValueError(f"token id {int(ids.min())} is negative; ids must be in [0, 2**32)")
    if int(ids.max()) >= 2 ** 32:
        raise ValueError(f"token id {int(ids.max())} does not fit 32 bits; ids must be in [0, 2**32)")
    return ids.astype(_TOKEN_DTYPE)


def prefix_chain(identity: PrefixIdentity, token_ids: Sequence[int] | np.ndarray | torch.Tensor) -> list[str]:
    """One lowercase-hex SHA-256 per chunk of ``identity.chunk_tokens`` tokens (the last
    may be partial): ``h_1 .. h_n`` as the module docstring defines them. ValueError for
    an empty, non-flat or non-integer ``token_ids`` or an id outside [0, 2**32)."""
    if not isinstance(identity, PrefixIdentity):
        raise ValueError(f"identity must be a PrefixIdentity, got {type(identity).__name__}")
    ids = _token_array(token_ids)
    step = identity.chunk_tokens
    previous = hashlib.sha256(_DOMAIN + _u32(PREFIX_SCHEME) + identity.to_bytes()).digest()
    chain = []
    for start in range(0, len(ids), step):
        chunk = ids[start:start + step]
        digest = hashlib.sha256(previous + _u32(len(chunk)) + chunk.tobytes())
        previous = digest.digest()
        chain.append(digest.hexdigest())
    return chain


def check_chain(chain: Sequence[str], limit: int | None = MAX_LOOKUP_CHAIN) -> list[str]:
    """``chain`` as a list if every item is 64 lowercase hex digits and there are at most
    ``limit`` of them (None: no bound); ValueError naming the fault otherwise."""
    if isinstance(chain, (str, bytes)):
        raise ValueError("chain must be a sequence of hex hashes, not one string")
    hashes = list(chain)
    if limit is not None and len(hashes) > limit:
        raise ValueError(f"chain holds {len(hashes)} hashes, more than the {limit} one lookup may carry")
    for i, value in enumerate(hashes):
        if not isinstance(value, str) or not _HASH_RE.fullmatch(value):
            raise ValueError(f"chain[{i}] is not a SHA-256 as 64 lowercase hex digits: {value!r:.80}")
    return hashes


def prefix_context_id(chain: Sequence[str]) -> str:
    """The id of the context holding the whole ``chain``: ``"px-" + chain[-1]`` (a valid
    context id). ValueError for an empty chain or a malformed hash."""
    hashes = check_chain(chain, limit=None)
    if not hashes:
        raise ValueError("chain is empty: a prefix holds at least one chunk")
    return PREFIX_CONTEXT_PREFIX + hashes[-1]


def is_prefix_context(context_id: str) -> bool:
    """Whether ``context_id`` names a content-addressed context (``px-`` + one hash)."""
    return (context_id.startswith(PREFIX_CONTEXT_PREFIX)
            and _HASH_RE.fullmatch(context_id[len(PREFIX_CONTEXT_PREFIX):]) is not None)


@dataclass(frozen=True)
class PrefixMatch:
    """The longest stored prefix of a chain: which context holds it, and how many of the
    chain's leading chunks it holds."""

    #: the stored context holding the prefix (its first ``chunks`` chunks are the prefix)
    context_id: str
    #: how many leading chunks of the caller's chain it holds (>= 1)
    chunks: int

    def __post_init__(self) -> None:
        if not isinstance(self.context_id, str) or not self.context_id:
            raise ValueError(f"context_id must be a non-empty string, got {self.context_id!r}")
        if not isinstance(self.chunks, int) or isinstance(self.chunks, bool) or self.chunks < 1:
            raise ValueError(f"chunks must be an int >= 1, got {self.chunks!r}")


@dataclass(frozen=True)
class PrefixUsage:
    """What the content-addressed contexts of a store hold (the eviction budget's measure)."""

    #: how many content-addressed contexts are accounted
    contexts: int
    #: their stored bytes: every blob at every level plus the texts
    bytes: int
