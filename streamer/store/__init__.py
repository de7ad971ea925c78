"""Stores for contexts and profiles, opened by URL: ``await open_store(url)``.

``file:///abs/path`` or a plain path: a local directory (``store.file``).
``redis://host:port/db`` (or ``rediss://``, TLS): a redis database shared by any
number of senders (``store.redis``; needs the ``kvwire[redis]`` extra).
``redis+cluster://host:port[,host:port...][/prefix]`` (or ``rediss+cluster://``): a Redis
Cluster (``store.redis_cluster``; the same store on a cluster client).

Contexts are named by their writer (``put_context``) or by the hash chain of their
tokens (``store.prefix``, ``put_prefix``): the latter are found by ``lookup_prefix`` and
evicted least-recently-used under a byte budget (``store.base`` describes the layout).
"""
from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

from streamer.store.base import (ChunkNotFound, ContextExists, ContextNotFound, ContextWriter,
                                 ProfileNotFound, Store, StoreError)
from streamer.store.prefix import (MAX_LOOKUP_CHAIN, PREFIX_SCHEME, PrefixIdentity, PrefixMatch, PrefixUsage,
                                   prefix_chain, prefix_context_id)


async def open_store(url: str) -> Store:
    """Open the store at ``url``; ValueError for an unsupported scheme, StoreError if
    the backend cannot be reached."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"store URL must be a non-empty string, got {url!r}")
    if "://" not in url:
        from streamer.store.file import FileStore

        return FileStore(Path(url).expanduser().resolve())
    parts = urlsplit(url)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"file store URL {url!r} names host {parts.netloc!r}; "
                             "use file:///abs/path (local directories only)")
        from streamer.store.file import FileStore

        return FileStore(Path(unquote(parts.path)))
    if parts.scheme in ("redis", "rediss", "redis+cluster", "rediss+cluster"):
        try:
            from streamer.store.redis import RedisStore
            from streamer.store.redis_cluster import open_cluster_store
        except ImportError as exc:
            raise StoreError(f"{parts.scheme}:// stores need the redis package "
                             f"(pip install 'kvwire[redis]'): {exc}") from exc
        if parts.scheme.endswith("+cluster"):
            return await open_cluster_store(url)
        return await RedisStore.open(url)
    raise ValueError(f"unsupported store URL scheme {parts.scheme!r} in {url!r}; supported: "
                     "file:///abs/path (or a plain path), redis://host:port/db, rediss://host:port/db, "
                     "redis+cluster://host:port[,host:port...][/prefix]")


__all__ = ["MAX_LOOKUP_CHAIN", "PREFIX_SCHEME", "ChunkNotFound", "ContextExists", "ContextNotFound",
           "ContextWriter", "PrefixIdentity", "PrefixMatch", "PrefixUsage", "ProfileNotFound", "Store",
           "StoreError", "open_store", "prefix_chain", "prefix_context_id"]
