"""The store interface: where senders find profiles, manifests, chunk blobs and texts.

A context is written as a new *version* (``ContextWriter``): its chunk blobs and texts
are staged under the version id, then ``commit`` atomically makes the version's
manifest the current one and only then removes the previous version's data. So a
reader always sees either the old or the new version, complete, and a put that dies
midway leaves the previous version readable. A reader holding an old manifest can get
``ChunkNotFound`` once a newer version is committed: it should re-read the manifest.

Committed data never changes in place (a version's items are written once, under the
version id; a profile's id is a hash of its content), so a reader that must not hold
more than a stated size asks for the item's size first (``chunk_size``, ``text_size``,
``profile_size``: a stat or a STRLEN, nothing read) and reads only an item that fits.

Backend failures (I/O errors, an unreachable redis) surface as ``StoreError`` naming
the store; bad arguments (ids, indices) as ``ValueError``.

Content-addressed contexts (``store.prefix``, issue #43) are ordinary contexts named
``px-<hash>`` plus three kinds of bookkeeping every store keeps:

- an *index*: for each hash ``h_i`` of a stored chain, an entry ``h_i -> (context, i)``,
  all of one chain's entries together (a Redis hash per chain root ``h_1``, a file per
  root), so ``lookup_prefix`` reads one place once and answers the longest ``i`` whose
  entry points at a registered context;
- a *registration* per context beside its entries (its version, its chain, its last
  use), written after the context's commit and before its index entries, so an entry
  never points at a half-written context;
- an *LRU ledger*: each content-addressed context's stored bytes and last use, and the
  total. ``evict_prefixes`` removes least-recently-used contexts while the total exceeds
  a byte budget: first its ledger record (one evictor wins), then its data (only the
  version it chose, so a concurrent re-put survives), then its registration and index
  entries. ``put_prefix`` checks after registering that the version it registered is
  still current, and unregisters it if an eviction deleted it meanwhile.

Eviction is LRU by bytes, not a TTL: a budget bounds what the store holds whatever the
write rate, and a prefix in use stays however old it is. Name-addressed contexts are
never in the ledger, so never evicted. An index entry that already points at a
registered context is kept when another context holding the same prefix is indexed
(an existing copy is never replaced); when that context is evicted its entries go with
it, and the next put of a prompt with that prefix indexes it again.
"""
from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from types import TracebackType
from typing import TYPE_CHECKING, Sequence

from streamer.store.prefix import PrefixMatch, PrefixUsage
from streamer.wire.manifest import Manifest, validate_context_id, validate_id

if TYPE_CHECKING:  # the stores never need the codec itself, only a profile's id and bytes
    import codec

#: What blobs and texts may be passed as (anything exposing a contiguous buffer works).
BytesLike = bytes | bytearray | memoryview


class StoreError(Exception):
    """A store operation failed (unreachable backend, inconsistent data, misuse)."""


class ContextNotFound(StoreError):
    """The store has no committed context with this id."""

    def __init__(self, context_id: str, store_url: str) -> None:
        super().__init__(f"context {context_id!r} not found in {store_url}")
        self.context_id = context_id


class ChunkNotFound(StoreError):
    """A chunk blob or text is missing (never stored, or its version was superseded)."""

    def __init__(self, context_id: str, version: str, what: str, store_url: str) -> None:
        super().__init__(f"{what} of context {context_id!r} version {version!r} not found in "
                         f"{store_url} (if the version was superseded, re-read the manifest)")
        self.context_id = context_id
        self.version = version


class ContextExists(StoreError):
    """A commit that must not replace a context found one already committed."""

    def __init__(self, context_id: str, store_url: str) -> None:
        super().__init__(f"context {context_id!r} already exists in {store_url}")
        self.context_id = context_id


class ProfileNotFound(StoreError):
    """The store has no profile with this id."""

    def __init__(self, profile_id: str, store_url: str) -> None:
        super().__init__(f"profile {profile_id!r} not found in {store_url}")
        self.profile_id = profile_id


def check_index(value: object, what: str) -> int:
    """``value`` if it is an int >= 0 (chunk index, level); ValueError otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{what} must be an int >= 0, got {value!r}")
    return value


def check_location(context_id: str, version: str) -> None:
    """Validate the ids that address stored data (they become paths and keys)."""
    validate_context_id(context_id)
    validate_id(version, "version")


def parse_manifest(context_id: str, data: bytes, store_url: str) -> Manifest:
    """Parse a stored manifest and check it belongs to ``context_id``."""
    manifest = Manifest.from_bytes(data)
    if manifest.context_id != context_id:
        raise StoreError(f"manifest stored for context {context_id!r} in {store_url} names "
                         f"context {manifest.context_id!r}")
    return manifest


def manifest_items(manifest: Manifest) -> tuple[dict[tuple[int, int], int], dict[int, int]]:
    """(chunk, level) -> blob size and chunk -> text size that a manifest refers to."""
    blobs = {(c.index, level): size for c in manifest.chunks for level, size in enumerate(c.sizes) if size}
    texts = {c.index: c.text_bytes for c in manifest.chunks}
    return blobs, texts


class ContextWriter(ABC):
    """Stages one new version of a context; ``commit`` makes it current.

    Use as ``async with store.writer(context_id) as w``. Leaving the block without a
    commit, or with an exception, discards everything staged. ``commit`` first checks
    that exactly the blobs and texts the manifest names were staged, with its sizes,
    so a committed manifest never points at missing or different data.
    """

    def __init__(self, context_id: str) -> None:
        self.context_id = validate_context_id(context_id)
        #: The id of the version being written; the manifest passed to commit must carry it.
        self.version = uuid.uuid4().hex
        self._blobs: dict[tuple[int, int], int] = {}
        self._texts: dict[int, int] = {}
        self._state = "new"
        #: Set by implementations at their commit point, so a failure after it never discards.
        self._committed = False

    async def __aenter__(self) -> "ContextWriter":
        if self._state != "new":
            raise StoreError("a ContextWriter can be entered only once")
        await self._begin()
        self._state = "open"
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        try:
            if not self._committed:
                try:
                    await self._discard()
                except StoreError:
                    if exc_type is None:  # never mask the error that ended the block
                        raise
        finally:
            self._state = "closed"
            self._close()

    def _check_open(self) -> None:
        if self._state != "open":
            raise StoreError(f"writer for context {self.context_id!r} is not open "
                             f"(state: {'committed' if self._committed else self._state})")

    async def put_chunk(self, chunk: int, level: int, blob: BytesLike) -> None:
        """Stage the encoded blob of ``chunk`` at quality ``level``."""
        self._check_open()
        key = (check_index(chunk, "chunk"), check_index(level, "level"))
        size = memoryview(blob).nbytes  # TypeError before anything is written if not bytes-like
        await self._write_chunk(chunk, level, blob)
        self._blobs[key] = size

    async def put_text(self, chunk: int, data: BytesLike) -> None:
        """Stage the compressed token ids of ``chunk`` (the text fallback)."""
        self._check_open()
        check_index(chunk, "chunk")
        size = memoryview(data).nbytes
        await self._write_text(chunk, data)
        self._texts[chunk] = size

    async def commit(self, manifest: Manifest, *, replace: bool = True) -> None:
        """Make ``manifest`` (and the data staged for it) the context's current version.

        ``replace=False``: raise ContextExists (and commit nothing) if the context already
        has a committed version; the check and the switch are one atomic step."""
        self._check_open()
        if (manifest.context_id, manifest.version) != (self.context_id, self.version):
            raise StoreError(f"manifest is for context {manifest.context_id!r} version "
                             f"{manifest.version!r}; this writer stages {self.context_id!r} "
                             f"version {self.version!r}")
        blobs, texts = manifest_items(manifest)
        _check_staged("blob", blobs, self._blobs)
        _check_staged("text", texts, self._texts)
        await self._commit(manifest, replace)
        self._committed = True
        self._state = "committed"

    # -------------------------------------------------------- implementation hooks
    async def _begin(self) -> None:
        """Prepare staging (e.g. create the version's directory)."""

    @abstractmethod
    async def _write_chunk(self, chunk: int, level: int, blob: BytesLike) -> None: ...

    @abstractmethod
    async def _write_text(self, chunk: int, data: BytesLike) -> None: ...

    @abstractmethod
    async def _commit(self, manifest: Manifest, replace: bool) -> None:
        """Atomically make ``manifest`` current (set ``_committed`` at that point), then
        remove the previous version's data; with ``replace`` false, ContextExists instead
        if a version is current."""

    @abstractmethod
    async def _discard(self) -> None:
        """Remove everything staged (best effort; StoreError if the backend fails)."""

    def _close(self) -> None:
        """Release resources held while staging; called exactly once, last."""


def _check_staged(what: str, expected: dict, staged: dict) -> None:
    if expected == staged:
        return
    missing = sorted(k for k in expected if k not in staged)
    extra = sorted(k for k in staged if k not in expected)
    wrong = sorted(k for k in expected if k in staged and staged[k] != expected[k])
    raise StoreError(f"staged {what}s do not match the manifest: missing {missing[:5]}, "
                     f"not in the manifest {extra[:5]}, wrong size {wrong[:5]}")


class Store(ABC):
    """Profiles, manifests, chunk blobs and texts; safe for concurrent readers and writers.

    Use ``await open_store(url)``; ``async with`` closes it.
    """

    #: Where the store lives, as a URL (credentials redacted).
    url: str

    async def __aenter__(self) -> "Store":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @abstractmethod
    async def put_profile(self, profile: "codec.Profile") -> None:
        """Store ``profile`` under ``profile.id`` (a content hash: idempotent)."""

    @abstractmethod
    async def get_profile_bytes(self, profile_id: str) -> bytes:
        """The serialized profile (``codec.Profile.from_bytes``); ProfileNotFound."""

    @abstractmethod
    async def profile_size(self, profile_id: str) -> int:
        """The stored profile's length in bytes, without reading it; ProfileNotFound."""

    @abstractmethod
    async def get_manifest(self, context_id: str) -> Manifest:
        """The current manifest of a context; ContextNotFound."""

    @abstractmethod
    async def get_chunk(self, context_id: str, version: str, chunk: int, level: int) -> bytes:
        """One encoded blob; ChunkNotFound."""

    @abstractmethod
    async def get_text(self, context_id: str, version: str, chunk: int) -> bytes:
        """One chunk's compressed token ids; ChunkNotFound."""

    @abstractmethod
    async def chunk_size(self, context_id: str, version: str, chunk: int, level: int) -> int:
        """One blob's length in bytes, without reading it; ChunkNotFound."""

    @abstractmethod
    async def text_size(self, context_id: str, version: str, chunk: int) -> int:
        """The length of one chunk's compressed token ids, without reading them; ChunkNotFound."""

    @abstractmethod
    def writer(self, context_id: str) -> ContextWriter:
        """A writer staging a new version of ``context_id``."""

    @abstractmethod
    async def list_contexts(self) -> list[str]:
        """Ids of all committed contexts, sorted."""

    @abstractmethod
    async def delete_context(self, context_id: str, *, version: str | None = None) -> None:
        """Remove a context's manifest and current data; ContextNotFound. With ``version``,
        only if that version is the current one (else ContextNotFound, nothing removed)."""

    @abstractmethod
    async def gc(self) -> int:
        """Remove data of versions no manifest refers to (left by crashed puts).

        Commits already remove the previous version, so this only matters after
        crashes. Returns how many items (directories or keys) were removed.
        """

    # ------------------------------------------- content-addressed prefixes (store.prefix)
    @abstractmethod
    async def lookup_prefix(self, chain: Sequence[str], *, touch: bool = True) -> PrefixMatch | None:
        """The longest ``i`` such that ``chain[:i]`` is stored, as the context holding it
        and ``i``; None if not even ``chain[:1]`` is. One read of the chain's index (one
        round trip on Redis, on the chain's slot on a cluster). ``touch``: the matched
        context counts as used now (LRU). ValueError for more than ``MAX_LOOKUP_CHAIN``
        hashes or one that is not 64 lowercase hex digits; an empty chain matches nothing."""

    @abstractmethod
    async def register_prefix(self, chain: Sequence[str], version: str, nbytes: int) -> None:
        """Account the committed context ``prefix_context_id(chain)`` at ``version`` (its
        ``nbytes`` in the LRU ledger, used now), register it and index ``chain[:1]`` ..
        ``chain[:n]`` to it, keeping entries that point at another registered context.
        Call only after the context's commit (``store.put.put_prefix`` does)."""

    @abstractmethod
    async def unregister_prefix(self, chain: Sequence[str], version: str) -> None:
        """Undo ``register_prefix`` for that version (its ledger record, registration and
        index entries), if it is still registered at that version."""

    @abstractmethod
    async def evict_prefixes(self, budget_bytes: int, *, keep: str | None = None) -> list[str]:
        """Evict least-recently-used content-addressed contexts (ledger record, index
        entries, data) while their total bytes exceed ``budget_bytes``, never ``keep``;
        the ids evicted, oldest first."""

    @abstractmethod
    async def prefix_usage(self) -> PrefixUsage:
        """How many content-addressed contexts the LRU ledger holds, and their bytes."""

    @abstractmethod
    async def close(self) -> None:
        """Release connections; the store is unusable afterwards."""
