"""Open a ``RedisStore`` on a Redis Cluster: ``redis+cluster://[:password@]host:port[,host:port...][/P]``.

The hosts are startup nodes (any reachable one is enough: the client learns the
others and the slot map from it); ``P`` is the key prefix (default ``kvwire``); a
cluster has no database numbers. ``rediss+cluster://`` connects with TLS (system CAs).
The keys, the atomic commit and failover handling are ``store.redis``'s: one
implementation for one server and for a cluster.
"""
from __future__ import annotations

from urllib.parse import unquote, urlsplit

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException

from streamer.store.redis import (CONNECT_TIMEOUT_S, DEFAULT_PREFIX, SOCKET_TIMEOUT_S, RedisStore,
                                  redact)

SCHEMES = ("redis+cluster", "rediss+cluster")
#: How long operations retry through a failover. A replica takes over a killed master
#: after about twice the cluster's node timeout (redis' default 15 s; 1 s in tests), so
#: deployments with the default timeout should not expect a put to ride one out.
FAILOVER_S = 10.0


def parse_cluster_url(url: str) -> tuple[list[tuple[str, int]], str | None, str | None, str, bool]:
    """``(nodes, username, password, prefix, tls)``; ValueError naming the redacted URL."""
    shown = redact(url)
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"not a redis cluster URL: {shown}")
    if parts.query or parts.fragment:
        raise ValueError(f"redis cluster URL {shown} takes no query or fragment "
                         "(the key prefix is the path: redis+cluster://host:port/PREFIX)")
    user, at, hosts = parts.netloc.rpartition("@")
    username = password = None
    if at:
        name, colon, secret = user.partition(":")
        username = unquote(name) or None
        password = unquote(secret) if colon else None
    nodes = []
    for item in hosts.split(","):
        try:
            node = urlsplit(f"//{item.strip()}")
            host, port = node.hostname, node.port or 6379
        except ValueError as exc:
            raise ValueError(f"bad node {item!r} in redis cluster URL {shown}: {exc}") from None
        if not host:
            raise ValueError(f"redis cluster URL {shown} names no host in {item!r}")
        nodes.append((host, port))
    prefix = unquote(parts.path.strip("/")) or DEFAULT_PREFIX
    return nodes, username, password, prefix, parts.scheme == "rediss+cluster"


async def open_cluster_store(url: str) -> RedisStore:
    """Connect to the cluster (slot map from the startup nodes); StoreError if it cannot
    be reached, ValueError for a malformed URL or prefix."""
    from streamer.wire.manifest import validate_id

    nodes, username, password, prefix, tls = parse_cluster_url(url)
    validate_id(prefix, "redis key prefix")
    try:
        client = RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in nodes],
                              username=username, password=password, ssl=tls,
                              socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=SOCKET_TIMEOUT_S)
    except RedisClusterException as exc:
        raise ValueError(f"bad redis cluster URL {redact(url)}: {exc}") from None
    return await RedisStore.connected(client, redact(url), prefix, failover_s=FAILOVER_S)
