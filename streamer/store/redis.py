"""A store in redis, one server or a cluster, via redis.asyncio.

URLs: ``redis://[:password@]host:port/db[?prefix=P]`` (one server; ``rediss://``: TLS) and
``redis+cluster://[:password@]host:port[,host:port...][/P]`` (Redis Cluster; see
``store.redis_cluster``). Both are this one ``RedisStore``, parameterised by its client.

Keys (``P`` defaults to ``kvwire``; a distinct prefix lets tenants or tests share a db)::

    P:profile:<profile_id>
    P:ctx:{<context_id>}:manifest                      the commit point
    P:ctx:{<context_id>}:<version>:chunk:<i>:<level>
    P:ctx:{<context_id>}:<version>:text:<i>

``{<context_id>}`` is a Redis Cluster hash tag: every key of a context, whatever its
version, hashes to the same slot, so one Lua script can touch them all atomically (a
cluster runs a script only if all its keys share a slot). Ids never contain braces, so
the tag is exactly the context id. Profiles carry no tag: any sender finds them by key.

Staged keys carry a TTL (``STAGING_TTL_S``), so a put that dies leaves nothing behind
for long. Commit is one Lua script on the context's slot (``_COMMIT``): it checks that
the manifest is still the one the writer read (else the writer re-reads and retries)
and that every staged key still exists, then PERSISTs them, SETs the manifest and
deletes the previous version's keys, atomically. Delete and gc are scripts of the same
shape. Senders keep no state of their own: any number of them can share a store.

Failover (cluster): while a killed master's replica takes over, commands fail with
connection or CLUSTERDOWN errors; the store retries them for ``failover_s`` seconds
(redis-py itself follows MOVED/ASK redirections and refreshes the slot map). Every
retried step is idempotent: a commit whose reply was lost finds its own version current.
Replication is asynchronous: a put that was not replicated when its master died is
lost whole (the commit finds its staged keys missing and fails, or the manifest swap
itself is lost), never half.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Iterable, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.exceptions import (ClusterDownError, ClusterError, ConnectionError, MasterDownError,
                              RedisClusterException, RedisError, SlotNotCoveredError, TimeoutError,
                              TryAgainError)

from streamer.wire.manifest import Manifest, ManifestError, check_manifest_size, validate_context_id, validate_id
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
CONNECT_TIMEOUT_S = 5.0
SOCKET_TIMEOUT_S = 30.0
#: Errors a failover, a slot migration (TRYAGAIN; ClusterError: redirections that did not
#: settle) or a restarting server causes, which a later attempt may not meet.
TRANSIENT_ERRORS = (ConnectionError, TimeoutError, ClusterDownError, ClusterError, TryAgainError,
                    SlotNotCoveredError, MasterDownError, OSError)
#: Everything the client raises for a backend failure (the cluster client's own errors,
#: e.g. "no startup node reachable", are not RedisErrors).
BACKEND_ERRORS = (RedisError, RedisClusterException, OSError)
_RETRY_DELAY_S = 0.1

T = TypeVar("T")

# The scripts' KEYS all carry the context's hash tag. ARGV[1] is the SHA-1 of the
# manifest the caller read ("" for none): a script that finds another one changes
# nothing and returns -2, and the caller re-reads.
_SAME_MANIFEST = """
local current = redis.call('GET', KEYS[1])
if (current and redis.sha1hex(current) or '') ~= ARGV[1] then return -2 end
"""
#: KEYS: manifest, the staged keys, the previous version's keys; ARGV: sha, staged count,
#: the new manifest. Returns 1 (committed) or -1 (a staged key expired or was deleted).
_COMMIT = _SAME_MANIFEST + """
local staged = tonumber(ARGV[2])
for i = 2, staged + 1 do
  if redis.call('EXISTS', KEYS[i]) == 0 then return -1 end
end
for i = 2, staged + 1 do redis.call('PERSIST', KEYS[i]) end
redis.call('SET', KEYS[1], ARGV[3])
for i = staged + 2, #KEYS do redis.call('DEL', KEYS[i]) end
return 1
"""
#: KEYS: manifest, the current version's keys. Returns 1.
_DELETE = _SAME_MANIFEST + """
for i = 1, #KEYS do redis.call('DEL', KEYS[i]) end
return 1
"""
#: KEYS: manifest, keys of versions that are not current. Deletes the persistent ones
#: (TTL'd keys are staging, live or crashed, and expire by themselves); returns how many.
_GC = _SAME_MANIFEST + """
local removed = 0
for i = 2, #KEYS do
  if redis.call('TTL', KEYS[i]) == -1 then removed = removed + redis.call('DEL', KEYS[i]) end
end
return removed
"""

#: KEYS: one key. Its length (STRLEN, nothing read), or -1 if it does not exist
#: (STRLEN alone says 0 for a missing key).
_SIZE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
return redis.call('STRLEN', KEYS[1])
"""


def _sha1(data: bytes | None) -> str:
    import hashlib

    return "" if data is None else hashlib.sha1(data).hexdigest()


def redact(url: str) -> str:
    """``url`` without its password, for messages and ``Store.url``."""
    parts = urlsplit(url)
    user, at, hosts = parts.netloc.rpartition("@")
    if not at or ":" not in user:
        return url
    name = user.partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{name}:***@{hosts}"))


class RedisStore(Store):
    """A store in redis under a key prefix, on a single-server or a cluster client; see
    the module docstring."""

    def __init__(self, client: "aioredis.Redis | aioredis.RedisCluster", url: str, prefix: str, *,
                 failover_s: float = 0.0) -> None:
        self._client = client
        self.url = url
        self.prefix = validate_id(prefix, "redis key prefix")
        #: how long transient errors (a failover) are retried before they become StoreError
        self.failover_s = failover_s

    @classmethod
    async def open(cls, url: str) -> "RedisStore":
        """A single server: connect and PING; StoreError naming the URL if unreachable."""
        parts = urlsplit(url)
        query = parse_qsl(parts.query, keep_blank_values=True)
        prefixes = [value for name, value in query if name == "prefix"]
        prefix = validate_id(prefixes[-1] if prefixes else DEFAULT_PREFIX, "redis key prefix")
        client_url = urlunsplit(parts._replace(query=urlencode([q for q in query if q[0] != "prefix"])))
        shown = redact(url)
        try:
            client = aioredis.from_url(client_url, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                       socket_timeout=SOCKET_TIMEOUT_S)
        except ValueError as exc:
            raise ValueError(f"bad redis store URL {shown}: {exc}") from None
        return await cls.connected(client, shown, prefix)

    @classmethod
    async def connected(cls, client: Any, url: str, prefix: str, *, failover_s: float = 0.0) -> "RedisStore":
        """The store on ``client`` once it answers a PING (closed, and StoreError, if not)."""
        try:
            await client.ping()
        except BACKEND_ERRORS as exc:
            await client.aclose()
            raise StoreError(f"cannot reach redis store {url}: {exc}") from exc
        return cls(client, url, prefix, failover_s=failover_s)

    @contextlib.asynccontextmanager
    async def _errors(self) -> AsyncIterator[None]:
        """Report backend failures as StoreError naming the store."""
        try:
            yield
        except BACKEND_ERRORS as exc:
            raise StoreError(f"redis store {self.url}: {type(exc).__name__}: {exc}") from exc

    async def _call(self, operation: Callable[[], Awaitable[T]]) -> T:
        """Run ``operation`` (idempotent), retrying transient errors for ``failover_s``;
        backend failures as StoreError."""
        deadline = time.monotonic() + self.failover_s
        async with self._errors():
            while True:
                try:
                    return await operation()
                except TRANSIENT_ERRORS:
                    if time.monotonic() >= deadline:
                        raise
                await asyncio.sleep(_RETRY_DELAY_S)

    async def _script(self, script: str, keys: list[str], *args: Any) -> int:
        return int(await self._call(lambda: self._client.eval(script, len(keys), *keys, *args)))

    async def _scan(self, pattern: str) -> list[bytes]:
        """Every key matching ``pattern`` (on every master of a cluster)."""
        return await self._call(lambda: self._collect(pattern))

    async def _collect(self, pattern: str) -> list[bytes]:
        return [key async for key in self._client.scan_iter(match=pattern, count=1000)]

    # ------------------------------------------------------------------- keys
    def _key(self, *parts: object) -> str:
        return ":".join((self.prefix, *map(str, parts)))

    def _context_key(self, context_id: str, *parts: object) -> str:
        return self._key("ctx", f"{{{context_id}}}", *parts)

    def _manifest_key(self, context_id: str) -> str:
        return self._context_key(validate_context_id(context_id), "manifest")

    def chunk_key(self, context_id: str, version: str, chunk: int, level: int) -> str:
        """The key of one blob (exposed for tests and tooling)."""
        check_location(context_id, version)
        return self._context_key(context_id, version, "chunk", check_index(chunk, "chunk"),
                                 check_index(level, "level"))

    def text_key(self, context_id: str, version: str, chunk: int) -> str:
        """The key of one chunk's text."""
        check_location(context_id, version)
        return self._context_key(context_id, version, "text", check_index(chunk, "chunk"))

    def version_pattern(self, context_id: str, version: str) -> str:
        """A SCAN pattern for every key of one version (for tests and tooling)."""
        check_location(context_id, version)
        return self._context_key(context_id, version, "*")

    def _keys(self, context_id: str, version: str, blobs: Iterable[tuple[int, int]],
              texts: Iterable[int]) -> list[str]:
        """The keys of one version's blobs ((chunk, level) pairs) and texts (chunks)."""
        return ([self.chunk_key(context_id, version, c, level) for c, level in blobs]
                + [self.text_key(context_id, version, c) for c in texts])

    def _version_keys(self, manifest: Manifest) -> list[str]:
        return self._keys(manifest.context_id, manifest.version, *manifest_items(manifest))

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
        if not await self._call(lambda: self._client.exists(key)):  # content-hash id: skip re-serializing
            data = profile.to_bytes()
            await self._call(lambda: self._client.set(key, data, nx=True))

    async def get_profile_bytes(self, profile_id: str) -> bytes:
        key = self._key("profile", validate_id(profile_id, "profile id"))
        data = await self._call(lambda: self._client.get(key))
        if data is None:
            raise ProfileNotFound(profile_id, self.url)
        return data

    async def profile_size(self, profile_id: str) -> int:
        size = await self._size(self._key("profile", validate_id(profile_id, "profile id")))
        if size is None:
            raise ProfileNotFound(profile_id, self.url)
        return size

    async def _size(self, key: str) -> int | None:
        """The length of the string at ``key``, or None if there is none."""
        size = await self._script(_SIZE, [key])
        return None if size < 0 else size

    # --------------------------------------------------------------- contexts
    async def _get_raw_manifest(self, context_id: str) -> bytes | None:
        key = self._manifest_key(context_id)
        return await self._call(lambda: self._client.get(key))

    async def get_manifest(self, context_id: str) -> Manifest:
        size = await self._size(self._manifest_key(context_id))
        if size is not None:
            check_manifest_size(size)   # before reading it: from_bytes checks what was read
        data = await self._get_raw_manifest(context_id)
        if data is None:
            raise ContextNotFound(context_id, self.url)
        return parse_manifest(context_id, data, self.url)

    async def get_chunk(self, context_id: str, version: str, chunk: int, level: int) -> bytes:
        key = self.chunk_key(context_id, version, chunk, level)
        data = await self._call(lambda: self._client.get(key))
        if data is None:
            raise ChunkNotFound(context_id, version, f"chunk {chunk} level {level}", self.url)
        return data

    async def get_text(self, context_id: str, version: str, chunk: int) -> bytes:
        key = self.text_key(context_id, version, chunk)
        data = await self._call(lambda: self._client.get(key))
        if data is None:
            raise ChunkNotFound(context_id, version, f"text of chunk {chunk}", self.url)
        return data

    async def chunk_size(self, context_id: str, version: str, chunk: int, level: int) -> int:
        size = await self._size(self.chunk_key(context_id, version, chunk, level))
        if size is None:
            raise ChunkNotFound(context_id, version, f"chunk {chunk} level {level}", self.url)
        return size

    async def text_size(self, context_id: str, version: str, chunk: int) -> int:
        size = await self._size(self.text_key(context_id, version, chunk))
        if size is None:
            raise ChunkNotFound(context_id, version, f"text of chunk {chunk}", self.url)
        return size

    def writer(self, context_id: str) -> "RedisContextWriter":
        return RedisContextWriter(self, context_id)

    async def list_contexts(self) -> list[str]:
        head, tail = self._key("ctx", "{"), "}:manifest"
        keys = await self._scan(f"{head}*{tail}")
        return sorted({key.decode()[len(head):-len(tail)] for key in keys})

    async def delete_context(self, context_id: str) -> None:
        mkey = self._manifest_key(context_id)
        tried = False
        while True:
            raw = await self._get_raw_manifest(context_id)
            if raw is None:
                if tried:  # an earlier attempt deleted it, though its reply was lost
                    return
                raise ContextNotFound(context_id, self.url)
            tried = True
            keys = [mkey, *self._committed_keys(context_id, raw)]
            if await self._script(_DELETE, keys, _sha1(raw)) == 1:
                return

    async def gc(self) -> int:
        """Delete persistent keys of versions that are not current (TTL'd keys are
        staging, live or crashed, and expire by themselves)."""
        head = self._key("ctx", "{")
        by_context: dict[str, list[str]] = {}
        for key in await self._scan(f"{head}*"):
            context_id, _, rest = key.decode()[len(head):].partition("}:")
            if rest != "manifest":
                by_context.setdefault(context_id, []).append(key.decode())
        removed = 0
        for context_id, keys in by_context.items():
            removed += await self._gc_context(context_id, keys)
        return removed

    async def _gc_context(self, context_id: str, keys: list[str]) -> int:
        head = self._context_key(context_id, "")
        while True:
            raw = await self._get_raw_manifest(context_id)
            current = None
            if raw is not None:
                try:
                    current = parse_manifest(context_id, raw, self.url).version
                except (ManifestError, StoreError):
                    return 0  # cannot tell the current version: touch nothing
            stale = [k for k in keys if k[len(head):].partition(":")[0] != current]
            removed = await self._script(_GC, [self._manifest_key(context_id), *stale], _sha1(raw))
            if removed >= 0:  # else a commit got in meanwhile: it may have made some current
                return removed

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
        await self._store._call(lambda: self._client.set(key, blob, ex=STAGING_TTL_S))

    async def _write_text(self, chunk: int, data: BytesLike) -> None:
        key = self._store.text_key(self.context_id, self.version, chunk)
        await self._store._call(lambda: self._client.set(key, data, ex=STAGING_TTL_S))

    def _staged_keys(self) -> list[str]:
        return self._store._keys(self.context_id, self.version, self._blobs, self._texts)

    async def _commit(self, manifest: Manifest) -> None:
        store = self._store
        mkey = store._manifest_key(self.context_id)
        staged = self._staged_keys()
        data = manifest.to_bytes()
        while True:
            raw = await store._get_raw_manifest(self.context_id)
            if raw == data:  # an earlier attempt committed, though its reply was lost
                break
            old = store._committed_keys(self.context_id, raw)
            result = await store._script(_COMMIT, [mkey, *staged, *old], _sha1(raw), len(staged), data)
            if result == -1:
                raise StoreError(f"staged data of context {self.context_id!r} version "
                                 f"{self.version!r} expired or was lost before commit")
            if result == 1:
                break
            # -2: another commit got in first; re-read the manifest and try again
        self._committed = True

    async def _discard(self) -> None:
        staged = self._staged_keys()
        if staged:
            await self._store._call(lambda: self._client.delete(*staged))
