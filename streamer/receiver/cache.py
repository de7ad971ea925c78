"""The receiver's local cache of finished contexts: bounded, least recently used by bytes.

An entry is one fetched context serialized as safetensors, the same layout ``kvwire
fetch --out`` writes: ``kv`` [layers, 2, tokens, heads, head_dim], ``text_ranges`` [n, 2]
(token ranges of the chunks that came as text and were *not* recomputed: zeros in
``kv``, the caller recomputes them) and ``text_token_ids`` (their ids, concatenated).
The file's metadata (``__metadata__["kvwire"]``, JSON) records the context version,
the quality per chunk and the fetch report.

Without a directory entries live in memory (the serialized bytes). With one, each
entry is ``<dir>/<context_id>.safetensors``, written all-or-nothing (temp file, fsync,
rename, fsync the directory) so a crash or a SIGTERM never leaves a partial entry; the
index is rebuilt from the files at start (their mtimes give the LRU order; temp files
left by a crash are removed). Eviction drops the least recently used entries until
the total is within ``max_bytes``; an entry larger than ``max_bytes`` is not kept.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from streamer.store.file import fsync_dir

log = logging.getLogger("kvwire.receiver")

_SUFFIX = ".safetensors"
_TEMP_PREFIX = ".tmp-"
_META_KEY = "kvwire"
_META_FORMAT = "kvwire-receiver-entry/1"


@dataclass
class Quality:
    """What a fetch delivered, chunk by chunk.

    ``levels[i]`` is chunk i's quality level (0 best) or ``"text"``; ``recomputed``
    lists the text chunks the daemon recomputed with its model (exact KV: they count
    as level 0); ``text_chunks`` those left to the caller, whose token ids are
    reported (recomputing them from their ids is exact too, so they do not lower
    ``worst_level``; ``complete`` says whether any are left).
    """

    levels: list[int | str]
    recomputed: list[int] = field(default_factory=list)
    #: how many levels the context is stored at (its manifest's); None in older entries
    ladder: int | None = None

    @property
    def text_chunks(self) -> list[int]:
        done = set(self.recomputed)
        return [i for i, level in enumerate(self.levels) if level == "text" and i not in done]

    @property
    def worst_level(self) -> int | None:
        """Worst (highest) level over the chunks delivered as KV; None if none was."""
        ints = [lv for lv in self.levels if isinstance(lv, int)] + [0] * len(self.recomputed)
        return max(ints) if ints else None

    @property
    def complete(self) -> bool:
        return not self.text_chunks

    def satisfies(self, required: int | None) -> bool:
        """Every chunk at level <= ``required`` (None: any quality will do)."""
        worst = self.worst_level
        return required is None or worst is None or worst <= required

    def to_dict(self) -> dict[str, Any]:
        return {"worst_level": self.worst_level, "levels": list(self.levels),
                "text_chunks": self.text_chunks, "recomputed": list(self.recomputed),
                "complete": self.complete}


@dataclass
class Entry:
    """One cached context. ``data`` (memory) or ``path`` (directory) holds the bytes."""

    context_id: str
    version: str
    quality: Quality
    #: chunks left to the caller as text: {"chunk", "start", "end", "token_ids"}
    text: list[dict[str, Any]]
    report: dict[str, Any]
    shape: list[int]
    dtype: str
    nbytes: int = 0
    data: bytes | None = None
    path: Path | None = None
    created: float = field(default_factory=time.time)

    def metadata(self) -> dict[str, str]:
        body = {"format": _META_FORMAT, "context_id": self.context_id, "version": self.version,
                "levels": self.quality.levels, "recomputed": self.quality.recomputed,
                "ladder": self.quality.ladder,
                "text": self.text, "report": self.report, "shape": self.shape, "dtype": self.dtype,
                "created": self.created}
        return {_META_KEY: json.dumps(body, separators=(",", ":"))}

    @classmethod
    def from_metadata(cls, metadata: dict[str, str] | None, path: Path) -> "Entry":
        body = json.loads((metadata or {})[_META_KEY])
        if body.get("format") != _META_FORMAT:
            raise ValueError(f"not a receiver cache entry: format {body.get('format')!r}")
        return cls(context_id=body["context_id"], version=body["version"],
                   quality=Quality(levels=list(body["levels"]), recomputed=list(body["recomputed"]),
                                   ladder=body.get("ladder")),
                   text=list(body["text"]), report=dict(body["report"]), shape=list(body["shape"]),
                   dtype=str(body["dtype"]), nbytes=path.stat().st_size, path=path,
                   created=float(body.get("created", 0.0)))

    def describe(self, *, token_ids: bool = True) -> dict[str, Any]:
        """JSON-ready summary: version, quality, where the KV is, the text chunks."""
        text = self.text if token_ids else [{k: v for k, v in t.items() if k != "token_ids"} for t in self.text]
        return {"context_id": self.context_id, "version": self.version, "quality": self.quality.to_dict(),
                "kv": {"url": f"/contexts/{self.context_id}", "path": None if self.path is None else str(self.path),
                       "bytes": self.nbytes, "shape": self.shape, "dtype": self.dtype},
                "text": text, "created": self.created}


def _atomic_write(path: Path, data: bytes) -> None:
    temp = path.with_name(f"{_TEMP_PREFIX}{uuid.uuid4().hex}-{path.name}")
    try:
        with open(temp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    fsync_dir(path.parent)


def serialize(entry: Entry, tensors: dict[str, Any]) -> bytes:
    from safetensors.torch import save

    return save({name: t.contiguous() for name, t in tensors.items()}, metadata=entry.metadata())


class ContextCache:
    """LRU by bytes; see the module docstring. Single event loop, not thread-safe."""

    def __init__(self, max_bytes: int, directory: str | Path | None = None,
                 on_evict: Callable[[Entry], None] | None = None) -> None:
        if max_bytes < 0:
            raise ValueError(f"cache size must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self.directory = None if directory is None else Path(directory).expanduser().resolve()
        self._on_evict = on_evict
        self._entries: collections.OrderedDict[str, Entry] = collections.OrderedDict()
        self.total_bytes = 0
        self._pending: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ start
    def load(self) -> int:
        """Create the directory or rebuild the index from it; returns the entries found."""
        if self.directory is None:
            return 0
        from safetensors import safe_open

        self.directory.mkdir(parents=True, exist_ok=True)
        found: list[Entry] = []
        for path in self.directory.iterdir():
            if path.name.startswith(_TEMP_PREFIX):
                with contextlib.suppress(OSError):
                    path.unlink()  # left by a crash mid-write
                continue
            if path.suffix != _SUFFIX or not path.is_file():
                continue
            try:
                with safe_open(str(path), framework="pt") as f:
                    entry = Entry.from_metadata(f.metadata(), path)
                if entry.context_id != path.stem:
                    raise ValueError(f"holds context {entry.context_id!r}")
            except Exception as exc:  # a damaged file must not stop the daemon
                log.warning("cache: dropping unreadable %s: %s", path, exc)
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            found.append(entry)
        found.sort(key=lambda e: e.path.stat().st_mtime if e.path else 0.0)
        for entry in found:
            self._entries[entry.context_id] = entry
            self.total_bytes += entry.nbytes
        self._evict()
        return len(self._entries)

    # ------------------------------------------------------------------ reads
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, context_id: str) -> bool:
        return context_id in self._entries

    def entries(self) -> list[Entry]:
        """Least recently used first."""
        return list(self._entries.values())

    def peek(self, context_id: str) -> Entry | None:
        return self._entries.get(context_id)

    def get(self, context_id: str) -> Entry | None:
        """The entry, marked most recently used."""
        entry = self._entries.get(context_id)
        if entry is not None:
            self._entries.move_to_end(context_id)
            if entry.path is not None:
                with contextlib.suppress(OSError):
                    os.utime(entry.path)  # the LRU order survives a restart
        return entry

    # ------------------------------------------------------------------ writes
    async def put(self, entry: Entry, tensors: dict[str, Any]) -> tuple[bool, list[Entry]]:
        """Serialize and keep ``entry`` (replacing the context's previous one); returns
        (kept, evicted). The write finishes even if the caller is cancelled meanwhile,
        so the directory and the index always agree."""
        task = asyncio.ensure_future(self._put(entry, tensors))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return await asyncio.shield(task)

    async def _put(self, entry: Entry, tensors: dict[str, Any]) -> tuple[bool, list[Entry]]:
        data = await asyncio.to_thread(serialize, entry, tensors)
        entry.nbytes = len(data)
        if entry.nbytes > self.max_bytes:
            log.warning("cache: %s is %d bytes, more than the whole cache (%d): not kept",
                        entry.context_id, entry.nbytes, self.max_bytes)
            return False, []
        if self.directory is not None:
            path = self.directory / f"{entry.context_id}{_SUFFIX}"
            await asyncio.to_thread(_atomic_write, path, data)
            entry.path = path
        else:
            entry.data = data
        old = self._entries.pop(entry.context_id, None)
        if old is not None:
            self.total_bytes -= old.nbytes
            if old.path is not None and old.path != entry.path:
                with contextlib.suppress(OSError):
                    old.path.unlink()
        self._entries[entry.context_id] = entry
        self.total_bytes += entry.nbytes
        return True, self._evict()

    def remove(self, context_id: str) -> bool:
        entry = self._entries.pop(context_id, None)
        if entry is None:
            return False
        self.total_bytes -= entry.nbytes
        if entry.path is not None:
            with contextlib.suppress(OSError):
                entry.path.unlink()
        return True

    def _evict(self) -> list[Entry]:
        evicted = []
        while self.total_bytes > self.max_bytes and self._entries:
            _, entry = self._entries.popitem(last=False)
            self.total_bytes -= entry.nbytes
            if entry.path is not None:
                with contextlib.suppress(OSError):
                    entry.path.unlink()
            evicted.append(entry)
            log.info("cache: evicted %s (%d bytes)", entry.context_id, entry.nbytes)
            if self._on_evict is not None:
                self._on_evict(entry)
        return evicted

    async def flush(self) -> None:
        """Wait for writes in progress (called on shutdown)."""
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)
