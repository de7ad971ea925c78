"""A store in a local directory (``file:///abs/path`` or a plain path).

Layout under the root::

    profiles/<profile_id>.safetensors
    contexts/<context_id>/manifest.json                  the commit point
    contexts/<context_id>/.lock                          serializes commits and sweeps
    contexts/<context_id>/<version>/chunk-<i>-L<level>.kvw
    contexts/<context_id>/<version>/text-<i>.zst
    prefixes/.lock                                       serializes prefix bookkeeping
    prefixes/ledger.json                                 the LRU ledger (see store.base)
    prefixes/roots/<h_1>.json                            one chain root's index entries
                                                         and registrations

``ledger.json`` is ``{"contexts": {id: {"bytes", "version", "root", "used"}}}``; a root
file is ``{"entries": {h_i: [i, id]}, "registered": {id: {"version", "chain"}}}``.
Lookups read the root file without a lock (files are replaced by rename) and check the
context's manifest exists; every change of the bookkeeping holds ``prefixes/.lock``.

Every file is written atomically (temp file in the same directory, fsync, rename), so a
reader never sees a partial file. A writer holds an flock on its version directory
while staging; sweeps (after each commit, ``delete_context``, ``gc``) remove only
version directories that are not current and whose lock is free, i.e. whose writer
finished or died, so concurrent puts and crashes are both safe. flock is advisory and
per host: several processes on one machine may share a root, several machines may not.
"""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable, Iterator, Sequence, TypeVar

import aiofiles
import aiofiles.os

from streamer.wire.manifest import (Manifest, ManifestError, check_manifest_size, validate_context_id,
                                    validate_id)
from streamer.store.base import (BytesLike, ChunkNotFound, ContextExists, ContextNotFound, ContextWriter,
                                 ProfileNotFound, Store, StoreError, check_index, check_location,
                                 parse_manifest)
from streamer.store.prefix import PrefixMatch, PrefixUsage, check_chain, is_prefix_context, prefix_context_id

if TYPE_CHECKING:
    import codec

_MANIFEST = "manifest.json"
_PREFIXES = "prefixes"
_LEDGER = "ledger.json"
_LOCK = ".lock"
_TEMP_PREFIX = ".tmp-"
#: A profile temp file this old was left by a crash (profile writes take no lock).
_STALE_TEMP_S = 3600.0
_LOCK_POLL_S = 0.005

T = TypeVar("T")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def _atomic_write(path: Path, data: BytesLike, *, sync_dir: bool = True, durable: bool = True) -> None:
    """Write ``path`` all-or-nothing: temp file, fsync, rename (, fsync the directory).

    ``sync_dir=False`` defers the directory fsync to the caller (staged files are
    made durable together by one fsync of their version directory at commit).
    ``durable=False`` skips both fsyncs (for bookkeeping whose loss costs only accuracy,
    e.g. a last-use time).
    """
    temp = path.with_name(f"{_TEMP_PREFIX}{uuid.uuid4().hex}-{path.name}")
    try:
        async with aiofiles.open(temp, "wb") as f:
            await f.write(data)
            await f.flush()
            if durable:
                await asyncio.to_thread(os.fsync, f.fileno())
        await aiofiles.os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    if sync_dir and durable:
        await asyncio.to_thread(fsync_dir, path.parent)


async def _read(path: Path) -> bytes | None:
    """The file's bytes, or None if it does not exist."""
    try:
        async with aiofiles.open(path, "rb") as f:
            return await f.read()
    except FileNotFoundError:
        return None


async def _size(path: Path) -> int | None:
    """The file's length in bytes (a stat, nothing read), or None if it does not exist."""
    try:
        return (await aiofiles.os.stat(path)).st_size
    except FileNotFoundError:
        return None


def _chunk_name(chunk: int, level: int) -> str:
    return f"chunk-{check_index(chunk, 'chunk')}-L{check_index(level, 'level')}.kvw"


def _text_name(chunk: int) -> str:
    return f"text-{check_index(chunk, 'chunk')}.zst"


def _try_flock(path: Path, flags: int) -> int | None:
    """An fd of ``path`` holding an exclusive flock, or None if another holder has it."""
    fd = os.open(path, flags)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _remove_unlocked_versions(context_dir: Path, keep: str | None) -> int:
    """Remove version directories other than ``keep`` whose writer is gone, and stale
    manifest temp files. Call with the context lock held. Returns the number removed."""
    removed = 0
    for entry in os.scandir(context_dir):
        if entry.name in (_MANIFEST, _LOCK) or entry.name == keep:
            continue
        if entry.name.startswith(_TEMP_PREFIX) and entry.is_file(follow_symlinks=False):
            os.unlink(entry.path)  # only written under the context lock we hold: stale
            removed += 1
        elif entry.is_dir(follow_symlinks=False):
            fd = _try_flock(Path(entry.path), os.O_RDONLY | os.O_DIRECTORY)
            if fd is None:
                continue  # a live writer is staging it
            try:
                shutil.rmtree(entry.path, ignore_errors=True)  # best effort; the next sweep retries
            finally:
                os.close(fd)
            removed += 1
    return removed


class FileStore(Store):
    """A store in a local directory; see the module docstring for the layout."""

    def __init__(self, root: Path) -> None:
        if not root.is_absolute():
            raise ValueError(f"file store root must be absolute, got {str(root)!r}")
        if root.exists() and not root.is_dir():
            raise StoreError(f"file store root {str(root)!r} exists and is not a directory")
        self.root = root
        self.url = root.as_uri()

    # ------------------------------------------------------------------ paths
    def _profile_path(self, profile_id: str) -> Path:
        return self.root / "profiles" / f"{validate_id(profile_id, 'profile id')}.safetensors"

    def _context_dir(self, context_id: str) -> Path:
        return self.root / "contexts" / validate_context_id(context_id)

    def version_dir(self, context_id: str, version: str) -> Path:
        """Where a version's blobs and texts live (exposed for tests and tooling)."""
        check_location(context_id, version)
        return self._context_dir(context_id) / version

    @contextlib.contextmanager
    def _io_errors(self) -> Iterator[None]:
        """Report I/O failures (permissions, full disk, ...) as StoreError naming the store."""
        try:
            yield
        except OSError as exc:
            raise StoreError(f"file store {self.url}: {exc}") from exc

    @contextlib.asynccontextmanager
    async def _context_lock(self, context_id: str) -> AsyncIterator[Path]:
        """Hold the context's lock (polled, so a cancelled waiter never holds it)."""
        context_dir = self._context_dir(context_id)
        path = context_dir / _LOCK
        while True:
            context_dir.mkdir(parents=True, exist_ok=True)
            fd = _try_flock(path, os.O_RDWR | os.O_CREAT)
            if fd is not None:
                try:  # a deleter may have unlinked the file we locked: then retry
                    held, current = os.fstat(fd), os.stat(path)
                    if (held.st_ino, held.st_dev) == (current.st_ino, current.st_dev):
                        break
                except FileNotFoundError:
                    pass
                os.close(fd)
            await asyncio.sleep(_LOCK_POLL_S)
        try:
            yield context_dir
        finally:
            os.close(fd)

    # ---------------------------------------------------------------- profiles
    async def put_profile(self, profile: "codec.Profile") -> None:
        path = self._profile_path(profile.id)
        with self._io_errors():
            if await aiofiles.os.path.exists(path):
                return  # the id is a content hash: same id, same profile
            await aiofiles.os.makedirs(path.parent, exist_ok=True)
            await _atomic_write(path, profile.to_bytes())

    async def get_profile_bytes(self, profile_id: str) -> bytes:
        path = self._profile_path(profile_id)
        with self._io_errors():
            data = await _read(path)
        if data is None:
            raise ProfileNotFound(profile_id, self.url)
        return data

    async def profile_size(self, profile_id: str) -> int:
        path = self._profile_path(profile_id)
        with self._io_errors():
            size = await _size(path)
        if size is None:
            raise ProfileNotFound(profile_id, self.url)
        return size

    # ---------------------------------------------------------------- contexts
    async def get_manifest(self, context_id: str) -> Manifest:
        path = self._context_dir(context_id) / _MANIFEST
        with self._io_errors():
            size = await _size(path)
            if size is not None:
                check_manifest_size(size)   # before reading it: from_bytes checks what was read
            data = None if size is None else await _read(path)
        if data is None:
            raise ContextNotFound(context_id, self.url)
        return parse_manifest(context_id, data, self.url)

    async def get_chunk(self, context_id: str, version: str, chunk: int, level: int) -> bytes:
        return await self._item(_read, context_id, version, _chunk_name(chunk, level), f"chunk {chunk} level {level}")

    async def get_text(self, context_id: str, version: str, chunk: int) -> bytes:
        return await self._item(_read, context_id, version, _text_name(chunk), f"text of chunk {chunk}")

    async def chunk_size(self, context_id: str, version: str, chunk: int, level: int) -> int:
        return await self._item(_size, context_id, version, _chunk_name(chunk, level), f"chunk {chunk} level {level}")

    async def text_size(self, context_id: str, version: str, chunk: int) -> int:
        return await self._item(_size, context_id, version, _text_name(chunk), f"text of chunk {chunk}")

    async def _item(self, access: Callable[[Path], Awaitable[T | None]], context_id: str, version: str,
                    name: str, what: str) -> T:
        """``access`` (read or stat) one file of a version; ChunkNotFound if it is missing."""
        with self._io_errors():
            result = await access(self.version_dir(context_id, version) / name)
        if result is None:
            raise ChunkNotFound(context_id, version, what, self.url)
        return result

    def writer(self, context_id: str) -> "FileContextWriter":
        return FileContextWriter(self, context_id)

    async def list_contexts(self) -> list[str]:
        def scan() -> list[str]:
            try:
                entries = list(os.scandir(self.root / "contexts"))
            except FileNotFoundError:
                return []
            return sorted(e.name for e in entries
                          if not e.name.startswith(".") and os.path.exists(os.path.join(e.path, _MANIFEST)))

        with self._io_errors():
            return await asyncio.to_thread(scan)

    async def delete_context(self, context_id: str, *, version: str | None = None) -> None:
        if version is not None:
            validate_id(version, "version")
        if not await aiofiles.os.path.exists(self._context_dir(context_id) / _MANIFEST):
            raise ContextNotFound(context_id, self.url)  # checked first: don't create its directory
        with self._io_errors():
            data = await self._delete_context(context_id, version)
            if is_prefix_context(context_id):  # its prefix bookkeeping too
                with contextlib.suppress(ManifestError, StoreError):
                    await self._unregister_deleted(context_id, parse_manifest(context_id, data, self.url).version)

    async def _delete_context(self, context_id: str, version: str | None) -> bytes:
        """Delete the context (at ``version`` if given); the manifest deleted."""
        async with self._context_lock(context_id) as context_dir:
            data = await _read(context_dir / _MANIFEST)
            if data is None or (version is not None and parse_manifest(context_id, data, self.url).version != version):
                raise ContextNotFound(context_id, self.url)
            try:
                await aiofiles.os.remove(context_dir / _MANIFEST)
            except FileNotFoundError:
                raise ContextNotFound(context_id, self.url) from None
            await asyncio.to_thread(fsync_dir, context_dir)
            await asyncio.to_thread(self._sweep_locked, context_dir, None)
            return data

    def _sweep_locked(self, context_dir: Path, keep: str | None) -> int:
        """Remove stale versions; with no current version and nothing left staging,
        remove the directory too (unlinking the lock we hold is safe: lockers re-check)."""
        removed = _remove_unlocked_versions(context_dir, keep)
        if keep is None and [e.name for e in os.scandir(context_dir)] == [_LOCK]:
            os.unlink(context_dir / _LOCK)
            with contextlib.suppress(OSError):  # a new writer may have just created its lock
                os.rmdir(context_dir)
        return removed

    async def gc(self) -> int:
        with self._io_errors():
            return await self._gc()

    async def _gc(self) -> int:
        removed = 0
        try:
            names = [e.name for e in os.scandir(self.root / "contexts")
                     if e.is_dir(follow_symlinks=False) and not e.name.startswith(".")]
        except FileNotFoundError:
            names = []
        for context_id in names:
            try:
                validate_context_id(context_id)
            except ValueError:
                continue  # not ours
            async with self._context_lock(context_id) as context_dir:
                data = await _read(context_dir / _MANIFEST)
                try:
                    keep = None if data is None else parse_manifest(context_id, data, self.url).version
                except (ManifestError, StoreError):
                    continue  # cannot tell the current version: touch nothing
                removed += await asyncio.to_thread(self._sweep_locked, context_dir, keep)
        return removed + await asyncio.to_thread(self._remove_stale_profile_temps)

    def _remove_stale_profile_temps(self) -> int:
        removed = 0
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.root / "profiles"):
                if (entry.name.startswith(_TEMP_PREFIX)
                        and time.time() - entry.stat().st_mtime > _STALE_TEMP_S):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                        removed += 1
        return removed

    # --------------------------------------------------------------- prefixes
    def _root_path(self, root: str) -> Path:
        return self.root / _PREFIXES / "roots" / f"{root}.json"

    @contextlib.asynccontextmanager
    async def _prefix_lock(self) -> AsyncIterator[None]:
        """Hold the lock of the prefix bookkeeping (polled, as the context lock)."""
        path = self.root / _PREFIXES / _LOCK
        path.parent.mkdir(parents=True, exist_ok=True)
        while (fd := _try_flock(path, os.O_RDWR | os.O_CREAT)) is None:
            await asyncio.sleep(_LOCK_POLL_S)
        try:
            yield
        finally:
            os.close(fd)

    async def _read_doc(self, path: Path, *sections: str) -> dict[str, dict]:
        """A bookkeeping file (``{section: {...}}``), empty sections if it does not exist."""
        data = await _read(path)
        try:
            doc = {} if data is None else json.loads(data)
            if not isinstance(doc, dict) or not all(isinstance(doc.setdefault(k, {}), dict) for k in sections):
                raise ValueError("not an object of objects")
        except ValueError as exc:
            raise StoreError(f"file store {self.url}: prefix bookkeeping {path} is corrupt: {exc}") from None
        return doc

    async def _write_doc(self, path: Path, doc: dict, *, durable: bool = True) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        await _atomic_write(path, json.dumps(doc, separators=(",", ":")).encode(), durable=durable)

    async def _has_manifest(self, context_id: str) -> bool:
        return await aiofiles.os.path.exists(self._context_dir(context_id) / _MANIFEST)

    async def lookup_prefix(self, chain: Sequence[str], *, touch: bool = True) -> PrefixMatch | None:
        hashes = check_chain(chain)
        if not hashes:
            return None
        with self._io_errors():
            doc = await self._read_doc(self._root_path(hashes[0]), "entries", "registered")
            for chunks in range(len(hashes), 0, -1):
                entry = doc["entries"].get(hashes[chunks - 1])
                if (entry is None or entry[0] != chunks or entry[1] not in doc["registered"]
                        or not await self._has_manifest(entry[1])):
                    continue
                if touch:
                    await self._touch(entry[1])
                return PrefixMatch(entry[1], chunks)
        return None

    async def _touch(self, context_id: str) -> None:
        async with self._prefix_lock():
            path = self.root / _PREFIXES / _LEDGER
            ledger = await self._read_doc(path, "contexts")
            if context_id in ledger["contexts"]:
                ledger["contexts"][context_id]["used"] = time.time()
                await self._write_doc(path, ledger, durable=False)  # a lost touch costs only LRU order

    async def register_prefix(self, chain: Sequence[str], version: str, nbytes: int) -> None:
        context_id = prefix_context_id(chain)
        hashes = check_chain(chain, limit=None)
        validate_id(version, "version")
        check_index(nbytes, "nbytes")
        with self._io_errors():
            async with self._prefix_lock():
                ledger_path = self.root / _PREFIXES / _LEDGER
                ledger = await self._read_doc(ledger_path, "contexts")  # ledger first: see store.base
                ledger["contexts"][context_id] = {"bytes": nbytes, "version": version, "root": hashes[0],
                                                  "used": time.time()}
                await self._write_doc(ledger_path, ledger)
                root_path = self._root_path(hashes[0])
                doc = await self._read_doc(root_path, "entries", "registered")
                doc["registered"][context_id] = {"version": version, "chain": hashes}
                live: dict[str, bool] = {context_id: True}
                for chunks, digest in enumerate(hashes, 1):
                    entry = doc["entries"].get(digest)
                    if entry is not None and entry[1] not in live:
                        live[entry[1]] = entry[1] in doc["registered"] and await self._has_manifest(entry[1])
                    if entry is None or entry[1] == context_id or not live[entry[1]]:
                        doc["entries"][digest] = [chunks, context_id]
                await self._write_doc(root_path, doc)

    async def evict_prefixes(self, budget_bytes: int, *, keep: str | None = None) -> list[str]:
        check_index(budget_bytes, "budget_bytes")
        with self._io_errors():
            async with self._prefix_lock():
                ledger_path = self.root / _PREFIXES / _LEDGER
                ledger = await self._read_doc(ledger_path, "contexts")
                records = ledger["contexts"]
                total = sum(record["bytes"] for record in records.values())
                victims = []
                for _, context_id in sorted((r["used"], c) for c, r in records.items() if c != keep):
                    if total <= budget_bytes:
                        break
                    victims.append((context_id, records.pop(context_id)))
                    total -= victims[-1][1]["bytes"]
                if not victims:
                    return []
                await self._write_doc(ledger_path, ledger)
                for context_id, record in victims:
                    with contextlib.suppress(ContextNotFound):  # deleted by hand, or re-put since
                        await self._delete_context(context_id, record["version"])
                for root in {record["root"] for _, record in victims}:
                    await self._forget(root, [(c, r["version"]) for c, r in victims if r["root"] == root])
        return [context_id for context_id, _ in victims]

    async def unregister_prefix(self, chain: Sequence[str], version: str) -> None:
        context_id = prefix_context_id(chain)
        hashes = check_chain(chain, limit=None)
        validate_id(version, "version")
        with self._io_errors():
            async with self._prefix_lock():
                await self._unregister(context_id, hashes[0], version)

    async def _unregister_deleted(self, context_id: str, version: str) -> None:
        """Unregister a content-addressed context whose ``version`` was just deleted."""
        async with self._prefix_lock():
            ledger = await self._read_doc(self.root / _PREFIXES / _LEDGER, "contexts")
            record = ledger["contexts"].get(context_id)
            if record is not None:
                await self._unregister(context_id, record["root"], version)

    async def _unregister(self, context_id: str, root: str, version: str) -> None:
        """Drop the ledger record, registration and index entries of ``context_id`` at
        ``version``; call with the prefix lock held."""
        ledger_path = self.root / _PREFIXES / _LEDGER
        ledger = await self._read_doc(ledger_path, "contexts")
        if ledger["contexts"].get(context_id, {}).get("version") == version:
            del ledger["contexts"][context_id]
            await self._write_doc(ledger_path, ledger)
        await self._forget(root, [(context_id, version)])

    async def _forget(self, root: str, contexts: list[tuple[str, str]]) -> None:
        """Drop the registrations (at those versions) and index entries of ``contexts``."""
        path = self._root_path(root)
        doc = await self._read_doc(path, "entries", "registered")
        for context_id, version in contexts:
            registration = doc["registered"].get(context_id)
            if registration is None or registration["version"] != version:
                continue
            for chunks, digest in enumerate(registration["chain"], 1):
                if doc["entries"].get(digest) == [chunks, context_id]:
                    del doc["entries"][digest]
            del doc["registered"][context_id]
        await self._write_doc(path, doc)

    async def prefix_usage(self) -> PrefixUsage:
        with self._io_errors():
            ledger = await self._read_doc(self.root / _PREFIXES / _LEDGER, "contexts")
        records = ledger["contexts"].values()
        return PrefixUsage(contexts=len(records), bytes=sum(record["bytes"] for record in records))

    async def close(self) -> None:
        """Nothing to release: files are opened per operation."""


class FileContextWriter(ContextWriter):
    """Stages a version in its own directory, holding an flock on it until done."""

    def __init__(self, store: FileStore, context_id: str) -> None:
        super().__init__(context_id)
        self._store = store
        self._dir = store.version_dir(context_id, self.version)
        self._lock_fd: int | None = None
        self._writes: set[asyncio.Task] = set()

    async def _begin(self) -> None:
        # Create and lock the directory under the context lock, so no sweep can see
        # it unlocked in between.
        with self._store._io_errors():
            async with self._store._context_lock(self.context_id):
                self._dir.mkdir()
                self._lock_fd = _try_flock(self._dir, os.O_RDONLY | os.O_DIRECTORY)
        if self._lock_fd is None:  # nobody else knows this fresh random name
            raise StoreError(f"staging directory {self._dir} is unexpectedly locked")

    async def _write_chunk(self, chunk: int, level: int, blob: BytesLike) -> None:
        await self._write(_chunk_name(chunk, level), blob)

    async def _write_text(self, chunk: int, data: BytesLike) -> None:
        await self._write(_text_name(chunk), data)

    async def _write(self, name: str, data: BytesLike) -> None:
        if not self._dir.is_dir():  # clearer than the temp file's ENOENT
            raise StoreError(f"staging directory {self._dir} was removed")
        # A put that fails cancels its other writes, but a write's thread (the rename)
        # runs on: cancelled mid-way, it would land its file after _discard removed the
        # directory. So the write is shielded and _discard waits for it.
        write = asyncio.ensure_future(self._write_file(name, data))
        self._writes.add(write)
        write.add_done_callback(self._writes.discard)
        await asyncio.shield(write)

    async def _write_file(self, name: str, data: BytesLike) -> None:
        with self._store._io_errors():
            await _atomic_write(self._dir / name, data, sync_dir=False)

    async def _commit(self, manifest: Manifest, replace: bool) -> None:
        with self._store._io_errors():
            await self._switch(manifest, replace)

    async def _switch(self, manifest: Manifest, replace: bool) -> None:
        await asyncio.to_thread(fsync_dir, self._dir)  # staged files durable before the switch
        async with self._store._context_lock(self.context_id) as context_dir:
            if not replace and await aiofiles.os.path.exists(context_dir / _MANIFEST):
                raise ContextExists(self.context_id, self._store.url)
            await _atomic_write(context_dir / _MANIFEST, manifest.to_bytes(), sync_dir=False)
            self._committed = True  # the rename is the commit point
            await asyncio.to_thread(fsync_dir, context_dir)
            await asyncio.to_thread(_remove_unlocked_versions, context_dir, self.version)

    async def _discard(self) -> None:
        if self._writes:   # writes still running for cancelled callers (see _write)
            await asyncio.gather(*self._writes, return_exceptions=True)
        await asyncio.to_thread(shutil.rmtree, self._dir, True)  # leftovers: the next sweep

    def _close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
