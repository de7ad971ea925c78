"""Observability of the sender daemon: Prometheus metrics and structured logs.

:class:`SenderMetrics` holds a private ``CollectorRegistry`` (several senders in one
process, e.g. in tests, never share counters); pass one as ``ServerConfig(metrics=...)``
(or ``metrics=True`` for a fresh one) and read it back through ``Sender.metrics``.
``start_http(host, port)`` serves it in Prometheus text format on ``/metrics`` (a
daemon thread, so a scrape never waits on a busy event loop).

Every log line of a connection carries its session id (``record.session``, a short
random hex): :func:`session_logger` makes the adapter, :class:`JsonFormatter` prints
one JSON object per line (``kvwire serve --log-json``) and :class:`TextFormatter`
puts ``[session]`` in the plain format.
"""
from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from typing import Any, Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import generate_latest, start_http_server

__all__ = ["SenderMetrics", "CONTENT_TYPE_LATEST", "JsonFormatter", "TextFormatter",
           "new_session_id", "session_logger", "configure_logging"]

#: request latency buckets (seconds): loopback answers take well under a millisecond,
#: a big chunk on a slow link seconds
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0, 30.0)


class SenderMetrics:
    """Prometheus metrics of one sender (names ``kvwire_sender_*``)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        p = "kvwire_sender"
        self.sessions_open = Gauge(f"{p}_sessions_open", "Connections being served now", registry=r)
        self.sessions = Counter(f"{p}_sessions", "Connections accepted (refused ones excluded)",
                                registry=r)
        self.refused = Counter(f"{p}_sessions_refused", "Connections refused at max_sessions",
                               registry=r)
        self.bytes_sent = Counter(f"{p}_sent_bytes", "Bytes written to receivers (all frames)",
                                  registry=r)
        self.chunks = Counter(f"{p}_chunks", "Chunks sent in full, by level (or text)", ["level"],
                              registry=r)
        self.cancelled = Counter(f"{p}_chunks_cancelled", "Chunk requests ended by a CANCEL",
                                 registry=r)
        self.text_fallbacks = Counter(f"{p}_text_fallbacks", "Chunks sent as text (the receiver "
                                      "recomputes them)", registry=r)
        self.errors = Counter(f"{p}_errors", "Errors, by kind: the ERROR code sent (not_found, "
                              "bad_request, unavailable, internal, timeout, protocol, auth, ...) "
                              "or write_timeout / connection_lost / handler_failed for dropped connections",
                              ["code"], registry=r)
        self.request_seconds = Histogram(
            f"{p}_request_seconds", "Request received -> answer fully written, by kind "
            "(open, profile, lookup, chunk, text)", ["kind"], buckets=_LATENCY_BUCKETS, registry=r)
        self._http: Any = None

    # ---------------------------------------------------------------- reading
    def value(self, name: str, **labels: str) -> float:
        """A sample's current value (0.0 when absent), e.g. ``value("kvwire_sender_chunks_total",
        level="3")``; histograms: ``..._count`` / ``..._sum``."""
        found = self.registry.get_sample_value(name, labels or None)
        return 0.0 if found is None else float(found)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---------------------------------------------------------------- serving
    def start_http(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve ``/metrics`` on ``host:port`` (0: any free port) in a daemon thread; the port."""
        if self._http is not None:
            raise RuntimeError("the metrics endpoint is already running")
        server, thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = (server, thread)
        return int(server.server_address[1])

    @property
    def http_port(self) -> Optional[int]:
        return None if self._http is None else int(self._http[0].server_address[1])

    def stop_http(self) -> None:
        if self._http is not None:
            server, thread = self._http
            self._http = None
            server.shutdown()
            server.server_close()
            thread.join(5.0)


# -------------------------------------------------------------------- logging
def new_session_id() -> str:
    return secrets.token_hex(4)


def session_logger(logger: logging.Logger, session: str, peer: Any = None) -> logging.LoggerAdapter:
    """A logger whose records carry ``session`` (and ``peer``) attributes."""
    return logging.LoggerAdapter(logger, {"session": session, "peer": None if peer is None else str(peer)})


_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, session (when the line
    belongs to a connection), other ``extra`` fields, and the traceback if any."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                    + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    """``time level logger [session] message``; no brackets for lines outside a connection."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(session_tag)s%(message)s")

    def format(self, record: logging.LogRecord) -> str:
        session = getattr(record, "session", None)
        record.session_tag = f"[{session}] " if session else ""
        return super().format(record)


_lock = threading.Lock()


def configure_logging(json_lines: bool = False, level: int = logging.INFO) -> logging.Handler:
    """Install one stderr handler on the ``kvwire`` logger (idempotent per call site)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if json_lines else TextFormatter())
    with _lock:
        logger = logging.getLogger("kvwire")
        for old in [h for h in logger.handlers if getattr(h, "_kvwire_serve", False)]:
            logger.removeHandler(old)
        handler._kvwire_serve = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False
    return handler
