"""A store in redis (``redis://[:password@]host:port/db[?prefix=P]``), via redis.asyncio.

Keys (``P`` defaults to ``kvwire``; a distinct prefix lets tenants or tests share a db)::

    P:profile:<profile_id>
    P:ctx:<context_id>:manifest                      the commit point
    P:ctx:<context_id>:<version>:chunk:<i>:<level>
    P:ctx:<context_id>:<version>:text:<i>

Staged keys carry a TTL (``STAGING_TTL_S``), so a put that dies leaves nothing behind
for long. Commit is one optimistic transaction (WATCH the manifest and the staged
keys, MULTI: PERSIST the staged keys, SET the manifest, DEL the previous version's
keys, EXEC), retried if another commit got in first. Senders keep no state of their
own: any number of them can share a store.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, AsyncIterator
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.exceptions import RedisError, WatchError

from streamer.wire.manifest import Manifest, ManifestError, validate_context_id, validate_id
from streamer.store.base import (BytesLike, ChunkNotFound, ContextNotFound, ContextWriter,
                                 ProfileNotFound, Store, StoreError, check_index, check_location,
                                 manifest_items, parse_manifest)

if TYPE_CHECKING:
    import codec

DEFAULT_PREFIX = "kvwire"
#: Lifetime of staged keys: a put must commit within this time.
STAGING_TTL_S = 24 * 3600
# Fail fast when redis is unreachable; the URL's query string can override these
# (e.g. ?socket_timeout=60), as redis-py lets query arguments win.
_CONNECT_TIMEOUT_S = 5.0
_SOCKET_TIMEOUT_S = 30.0


def _redact(url: str) -> str:
    """``url`` without its password, for messages and ``Store.url``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + host))


class RedisStore(Store):
    """A store in one redis database, under a key prefix; see the module docstring."""

    def __init__(self, client: aioredis.Redis, url: str, prefix: str) -> None:
        self._client = client
        self.url = url
        self.prefix = prefix

    @classmethod
    async def open(cls, url: str) -> "RedisStore":
        """Connect and PING; StoreError naming the URL if redis cannot be reached."""
        parts = urlsplit(url)
        query = parse_qsl(parts.query, keep_blank_values=True)
        prefixes = [value for name, value in query if name == "prefix"]
        prefix = validate_id(prefixes[-1] if prefixes else DEFAULT_PREFIX, "redis key prefix")
        client_url = urlunsplit(parts._replace(query=urlencode([q for q in query if q[0] != "prefix"])))
        shown = _redact(url)
        try:
            client = aioredis.from_url(client_url, socket_connect_timeout=_CONNECT_TIMEOUT_S,
                                       socket_timeout=_SOCKET_TIMEOUT_S)
        except ValueError as exc:
            raise ValueError(f"bad redis store URL {shown}: {exc}") from None
        try:
            await client.ping()
        except (RedisError, OSError) as exc:
            await client.aclose()
            raise StoreError(f"cannot reach redis store {shown}: {exc}") from exc
        return cls(client, shown, prefix)

    @contextlib.asynccontextmanager
    async def _errors(self) -> AsyncIterator[None]:
        """Report backend failures as StoreError naming the store."""
        try:
            yield
        except (RedisError, OSError) as exc:
            raise StoreError(f"redis store {self.url}: {type(exc).__name__}: {exc}") from exc

    # ------------------------------------------------------------------- keys
    def _key(self, *parts: object) -> str:
        return ":".join((self.prefix, *map(str, parts)))

    def _manifest_key(self, context_id: str) -> str:
        return self._key("ctx", validate_context_id(context_id), "manifest")

    def chunk_key(self, context_id: str, version: str, chunk: int, level: int) -> str:
        """The key of one blob (exposed for tests and tooling)."""
        check_location(context_id, version)
        return self._key("ctx", context_id, version, "chunk", check_index(chunk, "chunk"),
                         check_index(level, "level"))

    def text_key(self, context_id: str, version: str, chunk: int) -> str:
        """The key of one chunk's text."""
        check_location(context_id, version)
        return self._key("ctx", context_id, version, "text", check_index(chunk, "chunk"))

    def _version_keys(self, manifest: Manifest) -> list[str]:
        blobs, texts = manifest_items(manifest)
        cid, version = manifest.context_id, manifest.version
        return ([self.chunk_key(cid, version, c, level) for c, level in blobs]
                + [self.text_key(cid, version, c) for c in texts])

    def _committed_keys(self, context_id: str, raw: bytes | None) -> list[str]:
        """Keys of the version a stored manifest names; none if it is unreadable
        (then ``gc`` removes them, as they belong to no current version)."""
        if raw is None:
            return []
        try:
            return self._version_keys(parse_manifest(context_id, raw, self.url))
        except (ManifestError, StoreError):
            return []

    # --------------------------------------------------------------- profiles
    async def put_profile(self, profile: "codec.Profile") -> None:
        key = self._key("profile", validate_id(profile.id, "profile id"))
        async with self._errors():
            if not await self._client.exists(key):  # content-hash id: skip re-serializing
                await self._client.set(key, profile.to_bytes(), nx=True)

    async def get_profile_bytes(self, profile_id: str) -> bytes:
        async with self._errors():
            data = await self._client.get(self._key("profile", validate_id(profile_id, "profile id")))
        if data is None:
            raise ProfileNotFound(profile_id, self.url)
        return data

    # --------------------------------------------------------------- contexts
    async def get_manifest(self, context_id: str) -> Manifest:
        async with self._errors():
            data = await self._client.get(self._manifest_key(context_id))
        if data is None:
            raise ContextNotFound(context_id, self.url)
        return parse_manifest(context_id, data, self.url)

    async def get_chunk(self, context_id: str, version: str, chunk: int, level: int) -> bytes:
        key = self.chunk_key(context_id, version, chunk, level)
        async with self._errors():
            data = await self._client.get(key)
        if data is None:
            raise ChunkNotFound(context_id, version, f"chunk {chunk} level {level}", self.url)
        return data

    async def get_text(self, context_id: str, version: str, chunk: int) -> bytes:
        key = self.text_key(context_id, version, chunk)
        async with self._errors():
            data = await self._client.get(key)
        if data is None:
            raise ChunkNotFound(context_id, version, f"text of chunk {chunk}", self.url)
        return data

    def writer(self, context_id: str) -> "RedisContextWriter":
        return RedisContextWriter(self, context_id)

    async def list_contexts(self) -> list[str]:
        head, tail = self._key("ctx", ""), ":manifest"
        async with self._errors():
            keys = [key async for key in self._client.scan_iter(match=f"{head}*{tail}", count=1000)]
        return sorted({key.decode()[len(head):-len(tail)] for key in keys})

    async def delete_context(self, context_id: str) -> None:
        mkey = self._manifest_key(context_id)
        async with self._errors(), self._client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(mkey)
                    raw = await pipe.get(mkey)
                    if raw is None:
                        raise ContextNotFound(context_id, self.url)
                    pipe.multi()
                    pipe.delete(mkey, *self._committed_keys(context_id, raw))
                    await pipe.execute()
                    return
                except WatchError:
                    continue

    async def gc(self) -> int:
        """Delete persistent keys of versions that are not current (TTL'd keys are
        staging, live or crashed, and expire by themselves)."""
        head = self._key("ctx", "")
        by_context: dict[str, list[bytes]] = {}
        async with self._errors():
            async for key in self._client.scan_iter(match=f"{head}*", count=1000):
                context_id, _, rest = key.decode()[len(head):].partition(":")
                if rest != "manifest":
                    by_context.setdefault(context_id, []).append(key)
            removed = 0
            for context_id, keys in by_context.items():
                removed += await self._gc_context(context_id, keys)
        return removed

    async def _gc_context(self, context_id: str, keys: list[bytes]) -> int:
        mkey = self._manifest_key(context_id)
        async with self._client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(mkey)  # a commit meanwhile may make these keys current
                    raw = await pipe.get(mkey)
                    current = None
                    if raw is not None:
                        try:
                            current = parse_manifest(context_id, raw, self.url).version
                        except (ManifestError, StoreError):
                            return 0  # cannot tell the current version: touch nothing
                    head = self._key("ctx", context_id, "")
                    stale = [k for k in keys if k.decode()[len(head):].partition(":")[0] != current]
                    ttls = [await pipe.ttl(k) for k in stale]
                    doomed = [k for k, ttl in zip(stale, ttls) if ttl == -1]
                    pipe.multi()
                    if doomed:
                        pipe.delete(*doomed)
                    await pipe.execute()
                    return len(doomed)
                except WatchError:
                    continue

    async def close(self) -> None:
        async with self._errors():
            await self._client.aclose()


class RedisContextWriter(ContextWriter):
    """Stages a version as keys with a TTL; commit persists them with the manifest."""

    def __init__(self, store: RedisStore, context_id: str) -> None:
        super().__init__(context_id)
        self._store = store
        self._client = store._client

    async def _write_chunk(self, chunk: int, level: int, blob: BytesLike) -> None:
        key = self._store.chunk_key(self.context_id, self.version, chunk, level)
        async with self._store._errors():
            await self._client.set(key, blob, ex=STAGING_TTL_S)

    async def _write_text(self, chunk: int, data: BytesLike) -> None:
        key = self._store.text_key(self.context_id, self.version, chunk)
        async with self._store._errors():
            await self._client.set(key, data, ex=STAGING_TTL_S)

    def _staged_keys(self) -> list[str]:
        return ([self._store.chunk_key(self.context_id, self.version, c, level) for c, level in self._blobs]
                + [self._store.text_key(self.context_id, self.version, c) for c in self._texts])

    async def _commit(self, manifest: Manifest) -> None:
        mkey = self._store._manifest_key(self.context_id)
        staged = self._staged_keys()
        async with self._store._errors(), self._client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    # Watching the staged keys too aborts the commit if one expires meanwhile.
                    await pipe.watch(mkey, *staged)
                    if await pipe.exists(*staged) != len(staged):
                        raise StoreError(f"staged data of context {self.context_id!r} version "
                                         f"{self.version!r} expired or was deleted before commit")
                    old = self._store._committed_keys(self.context_id, await pipe.get(mkey))
                    pipe.multi()
                    for key in staged:
                        pipe.persist(key)
                    pipe.set(mkey, manifest.to_bytes())
                    if old:
                        pipe.delete(*old)
                    await pipe.execute()
                    self._committed = True
                    return
                except WatchError:
                    continue

    async def _discard(self) -> None:
        staged = self._staged_keys()
        if staged:
            async with self._store._errors():
                await self._client.delete(*staged)
