"""A store in redis, one server or a cluster, via redis.asyncio.

URLs: ``redis://[:password@]host:port/db[?prefix=P]`` (one server; ``rediss://``: TLS) and
``redis+cluster://[:password@]host:port[,host:port...][/P]`` (Redis Cluster; see
``store.redis_cluster``). Both are this one ``RedisStore``, parameterised by its client.

Keys (``P`` defaults to ``kvwire``; a distinct prefix lets tenants or tests share a db)::

    P:profile:<profile_id>
    P:ctx:{<context_id>}:manifest                      the commit point
    P:ctx:{<context_id>}:<version>:chunk:<i>:<level>
    P:ctx:{<context_id>}:<version>:text:<i>

    P:px:{<h_1>}                  hash: a chain root's index entries and registrations
    P:px-lru:{P}                  sorted set: content-addressed context -> last use
    P:px-info:{P}                 hash: context -> "<bytes> <version> <h_1>"
    P:px-bytes:{P}                the ledger's total bytes

``{<context_id>}`` is a Redis Cluster hash tag: every key of a context, whatever its
version, hashes to the same slot, so one Lua script can touch them all atomically (a
cluster runs a script only if all its keys share a slot). Ids never contain braces, so
the tag is exactly the context id. Profiles carry no tag: any sender finds them by key.

Content-addressed prefixes (see ``store.base``): a chain's index lives in one hash per
chain root ``h_1`` (fields ``<h_i>`` -> ``"<i> <context id>"``, ``c:<id>`` -> ``"<version>
<chain as concatenated hex>"`` registering a context, ``u:<id>`` -> its last use), so a
lookup is one script on one slot (``_PX_LOOKUP``): it reads the entries, answers the
longest whose context is registered, and with ``touch`` stamps ``u:<id>``, all in one
round trip. The LRU ledger (three keys sharing the hash tag ``{P}``) orders contexts by
the last use it knows of; eviction takes its oldest, and if the root's ``u:<id>`` is
newer (a lookup touched it) first moves it up (a second chance, so a lookup never has
to write to the ledger's slot), else claims it (``_PX_CLAIM``, atomic: one evictor wins),
deletes its data (at that version) and then drops its registration and entries
(``_PX_FORGET``) and any ledger record a concurrent re-registration of that version
added. A lookup between the delete and the forget can name the context just deleted
(the session opening it gets ContextNotFound); ``put_prefix`` checks the context is
still there after registering it, so nothing keeps naming a deleted version.
Last-use times are the clocks of the hosts that put and look up.

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
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Iterable, Sequence, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.exceptions import (ClusterDownError, ClusterError, ConnectionError, MasterDownError,
                              RedisClusterException, RedisError, SlotNotCoveredError, TimeoutError,
                              TryAgainError)

from streamer.wire.manifest import Manifest, ManifestError, check_manifest_size, validate_context_id, validate_id
from streamer.store.base import (BytesLike, ChunkNotFound, ContextExists, ContextNotFound, ContextWriter,
                                 ProfileNotFound, Store, StoreError, check_index, check_location,
                                 manifest_items, parse_manifest)
from streamer.store.prefix import PrefixMatch, PrefixUsage, check_chain, is_prefix_context, prefix_context_id

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


# Content-addressed prefixes. KEYS[1] of _PX_LOOKUP, _PX_INDEX and _PX_FORGET is a chain
# root's hash; an entry's value is "<chunks> <context id>", a registration "c:<id>".
#: ARGV: touch ("1"/"0"), now, h_1..h_n. Returns {i, id} for the longest registered entry, or nil.
_PX_LOOKUP = """
local values = redis.call('HMGET', KEYS[1], unpack(ARGV, 3))
for i = #values, 1, -1 do
  local v = values[i]
  if v then
    local sep = string.find(v, ' ', 1, true)
    local ctx = string.sub(v, sep + 1)
    if tonumber(string.sub(v, 1, sep - 1)) == i and redis.call('HEXISTS', KEYS[1], 'c:' .. ctx) == 1 then
      if ARGV[1] == '1' then redis.call('HSET', KEYS[1], 'u:' .. ctx, ARGV[2]) end
      return {i, ctx}
    end
  end
end
return false
"""
#: ARGV: id, version, now, h_1..h_n. Registers the context and points every entry at it
#: that is absent or points at an unregistered context. Returns 1.
_PX_INDEX = """
local ctx = ARGV[1]
redis.call('HSET', KEYS[1], 'c:' .. ctx, ARGV[2] .. ' ' .. table.concat(ARGV, '', 4), 'u:' .. ctx, ARGV[3])
for i = 4, #ARGV do
  local v = redis.call('HGET', KEYS[1], ARGV[i])
  local other = v and string.sub(v, string.find(v, ' ', 1, true) + 1)
  if not other or other == ctx or redis.call('HEXISTS', KEYS[1], 'c:' .. other) == 0 then
    redis.call('HSET', KEYS[1], ARGV[i], (i - 3) .. ' ' .. ctx)
  end
end
return 1
"""
#: ARGV: id, version. Drops the registration (if at that version) and the entries pointing
#: at it. Returns 1, or 0 if it was not registered at that version.
_PX_FORGET = """
local ctx = ARGV[1]
local rec = redis.call('HGET', KEYS[1], 'c:' .. ctx)
if not rec then return 0 end
local sep = string.find(rec, ' ', 1, true)
if string.sub(rec, 1, sep - 1) ~= ARGV[2] then return 0 end
local chain = string.sub(rec, sep + 1)
for i = 1, #chain / 64 do
  local h = string.sub(chain, (i - 1) * 64 + 1, i * 64)
  if redis.call('HGET', KEYS[1], h) == i .. ' ' .. ctx then redis.call('HDEL', KEYS[1], h) end
end
redis.call('HDEL', KEYS[1], 'c:' .. ctx, 'u:' .. ctx)
return 1
"""
# The ledger's scripts: KEYS = the sorted set, the info hash, the total.
#: ARGV: id, now, bytes, version, root. Records (or re-records) one context. Returns 1.
_PX_ACCOUNT = """
local old = redis.call('HGET', KEYS[2], ARGV[1])
if old then redis.call('DECRBY', KEYS[3], tonumber(string.match(old, '^(%d+)'))) end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3] .. ' ' .. ARGV[4] .. ' ' .. ARGV[5])
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('INCRBY', KEYS[3], ARGV[3])
return 1
"""
#: ARGV: the id to skip ("" for none). Returns {total} and, if there is one, the oldest
#: other context's id, its last use and its info.
_PX_OLDEST = """
local total = tonumber(redis.call('GET', KEYS[3]) or '0')
local head = redis.call('ZRANGE', KEYS[1], 0, 1, 'WITHSCORES')
for i = 1, #head, 2 do
  if head[i] ~= ARGV[1] then
    return {total, head[i], head[i + 1], redis.call('HGET', KEYS[2], head[i]) or ''}
  end
end
return {total}
"""
#: ARGV: id, version. Removes the context from the ledger if it is there at that version
#: (returns 1: this caller evicts it); a set member without info is dropped (returns 0).
_PX_CLAIM = """
local rec = redis.call('HGET', KEYS[2], ARGV[1])
if not rec then redis.call('ZREM', KEYS[1], ARGV[1]) return 0 end
local bytes, version = string.match(rec, '^(%d+) (%S+)')
if version ~= ARGV[2] then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('DECRBY', KEYS[3], bytes)
return 1
"""
#: ARGV: id, last use. Moves a context up the LRU order (only if it is still recorded).
_PX_RAISE = """
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1]) end
return 1
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
        return int(await self._eval(script, keys, *args))

    async def _eval(self, script: str, keys: list[str], *args: Any) -> Any:
        """The reply of ``script`` (every key on one slot), retried as ``_call`` does."""
        return await self._call(lambda: self._client.eval(script, len(keys), *keys, *args))

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

    async def delete_context(self, context_id: str, *, version: str | None = None) -> None:
        raw = await self._delete(context_id, version)
        if raw is not None and is_prefix_context(context_id):  # its prefix bookkeeping too
            with contextlib.suppress(ManifestError, StoreError):
                deleted = parse_manifest(context_id, raw, self.url).version
                info = self._ledger_keys()[1]
                record = await self._call(lambda: self._client.hget(info, context_id))
                fields = record.decode().split(" ") if record else []
                if len(fields) == 3 and fields[1] == deleted:
                    await self._unregister(context_id, fields[2], deleted)

    async def _delete(self, context_id: str, version: str | None) -> bytes | None:
        """Delete the context (at ``version`` if given); the manifest deleted, or None if
        an earlier attempt whose reply was lost deleted it."""
        mkey = self._manifest_key(context_id)
        if version is not None:
            validate_id(version, "version")
        tried = False
        while True:
            raw = await self._get_raw_manifest(context_id)
            if raw is None:
                if tried:  # an earlier attempt deleted it, though its reply was lost
                    return None
                raise ContextNotFound(context_id, self.url)
            if version is not None and parse_manifest(context_id, raw, self.url).version != version:
                raise ContextNotFound(context_id, self.url)
            tried = True
            keys = [mkey, *self._committed_keys(context_id, raw)]
            if await self._script(_DELETE, keys, _sha1(raw)) == 1:
                return raw

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

    # --------------------------------------------------------------- prefixes
    def _root_key(self, root: str) -> str:
        return self._key("px", f"{{{root}}}")

    def _ledger_keys(self) -> list[str]:
        """The LRU ledger's sorted set, info hash and total, sharing the hash tag ``{P}``."""
        return [self._key(name, f"{{{self.prefix}}}") for name in ("px-lru", "px-info", "px-bytes")]

    async def lookup_prefix(self, chain: Sequence[str], *, touch: bool = True) -> PrefixMatch | None:
        hashes = check_chain(chain)
        if not hashes:
            return None
        reply = await self._eval(_PX_LOOKUP, [self._root_key(hashes[0])], "1" if touch else "0",
                                 repr(time.time()), *hashes)
        if not reply:
            return None
        chunks, context_id = reply
        return PrefixMatch(context_id.decode(), int(chunks))

    async def register_prefix(self, chain: Sequence[str], version: str, nbytes: int) -> None:
        context_id = prefix_context_id(chain)
        hashes = check_chain(chain, limit=None)
        validate_id(version, "version")
        check_index(nbytes, "nbytes")
        now = repr(time.time())
        # the ledger first: a context is accounted (so evictable) before anything finds it
        await self._eval(_PX_ACCOUNT, self._ledger_keys(), context_id, now, nbytes, version, hashes[0])
        await self._eval(_PX_INDEX, [self._root_key(hashes[0])], context_id, version, now, *hashes)

    async def evict_prefixes(self, budget_bytes: int, *, keep: str | None = None) -> list[str]:
        check_index(budget_bytes, "budget_bytes")
        ledger = self._ledger_keys()
        evicted: list[str] = []
        while True:
            reply = await self._eval(_PX_OLDEST, ledger, keep or "")
            if int(reply[0]) <= budget_bytes or len(reply) == 1:
                return evicted
            context_id, score, info = reply[1].decode(), float(reply[2]), reply[3].decode()
            _, version, root = (info.split(" ") + ["", "", ""])[:3]
            used = None
            if root:
                key = self._root_key(root)
                used = await self._call(lambda: self._client.hget(key, f"u:{context_id}"))
            if used is not None and float(used) > score:  # looked up since: a second chance
                await self._eval(_PX_RAISE, ledger, context_id, used)
                continue
            if await self._eval(_PX_CLAIM, ledger, context_id, version) != 1:
                continue  # another evictor or a re-put got there first
            with contextlib.suppress(ContextNotFound):  # deleted by hand, or re-put since
                await self._delete(context_id, version)
            # the data is gone: now drop whatever names this version, including what a
            # put_prefix that read the manifest before the delete registered meanwhile
            await self._unregister(context_id, root, version)
            evicted.append(context_id)

    async def unregister_prefix(self, chain: Sequence[str], version: str) -> None:
        hashes = check_chain(chain, limit=None)
        await self._unregister(prefix_context_id(hashes), hashes[0], validate_id(version, "version"))

    async def _unregister(self, context_id: str, root: str, version: str) -> None:
        await self._eval(_PX_FORGET, [self._root_key(root)], context_id, version)
        await self._eval(_PX_CLAIM, self._ledger_keys(), context_id, version)

    async def prefix_usage(self) -> PrefixUsage:
        lru, _, total = self._ledger_keys()
        contexts = await self._call(lambda: self._client.zcard(lru))
        nbytes = await self._call(lambda: self._client.get(total))
        return PrefixUsage(contexts=int(contexts), bytes=int(nbytes or 0))

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

    async def _commit(self, manifest: Manifest, replace: bool) -> None:
        store = self._store
        mkey = store._manifest_key(self.context_id)
        staged = self._staged_keys()
        data = manifest.to_bytes()
        while True:
            raw = await store._get_raw_manifest(self.context_id)
            if raw == data:  # an earlier attempt committed, though its reply was lost
                break
            if raw is not None and not replace:  # the script's SHA check makes this atomic
                raise ContextExists(self.context_id, store.url)
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
