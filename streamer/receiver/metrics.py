"""Prometheus metrics of one receiver daemon (a private registry: several daemons, e.g.
in tests, never share counters)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

__all__ = ["Metrics", "CONTENT_TYPE_LATEST"]


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        p = "kvwire_receiver"
        self.fetches = Counter(f"{p}_fetches", "Fetches from senders, by outcome "
                               "(ok, not_found, unavailable, error, cancelled)", ["outcome"], registry=r)
        self.joins = Counter(f"{p}_fetch_joins", "Requests that joined a fetch already running", registry=r)
        self.requests = Counter(f"{p}_requests", "POST /fetch requests, by how they were served "
                                "(cached, fetched, joined, error)", ["result"], registry=r)
        self.bytes = Counter(f"{p}_received_bytes", "Bytes received from senders (KV blobs and text)", registry=r)
        self.chunks = Counter(f"{p}_chunks", "Chunks received, by level (or text)", ["level"], registry=r)
        self.connections_reused = Counter(f"{p}_connections_reused", "Fetches that reused an idle "
                                          "connection to the primary sender (no new handshake)", registry=r)
        self.recomputed = Counter(f"{p}_recomputed_chunks", "Text chunks recomputed with --model", registry=r)
        self.deadline_missed = Counter(f"{p}_deadline_missed", "Fetches that ended after their SLO", registry=r)
        self.cache_hits = Counter(f"{p}_cache_hits", "Requests served from the local cache", registry=r)
        self.cache_misses = Counter(f"{p}_cache_misses", "Requests the cache could not serve "
                                    "(absent, or cached at a worse quality)", ["reason"], registry=r)
        self.evictions = Counter(f"{p}_cache_evictions", "Entries evicted from the local cache", registry=r)
        self.errors = Counter(f"{p}_errors", "Errors answered, by HTTP status", ["status"], registry=r)
        self.connections_refused = Counter(f"{p}_connections_refused", "Client connections refused "
                                           "at max_connections (503, request not read)", registry=r)
        self.connections_reclaimed = Counter(f"{p}_connections_reclaimed", "Idle keep-alive client "
                                             "connections closed at max_connections to admit a new one",
                                             registry=r)
        self.connections_open = Gauge(f"{p}_connections_open", "Client connections being served", registry=r)
        self.inflight = Gauge(f"{p}_fetches_in_flight", "Fetches running now", registry=r)
        self.cache_bytes = Gauge(f"{p}_cache_bytes", "Bytes held by the local cache", registry=r)
        self.cache_entries = Gauge(f"{p}_cache_entries", "Contexts held by the local cache", registry=r)
        self.fetch_seconds = Histogram(f"{p}_fetch_seconds", "Duration of successful fetches",
                                       buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60), registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
