"""What aiohttp's HTTP server logs about malformed requests, cut to one throttled line.

aiohttp logs every request its parser refuses (a bad request line, a header over the
limits, a broken chunked body: an ``HttpProcessingError``, answered 400) at ERROR with
a full traceback, so any local client could flood the daemon's log with malformed
requests. The daemon gives aiohttp the logger ``LOGGER``, whose ``MalformedRequests``
filter turns each such record into one line at WARNING (or below) without a traceback,
at most one per second (``streamer.net.throttle``), saying how many were not logged
since the last; every other record (an unexpected failure keeps its traceback) passes
unchanged.
The throttle is the process's: daemons in one process share it.
"""
from __future__ import annotations

import logging

from aiohttp.http_exceptions import HttpProcessingError

from streamer.net.throttle import Throttle

LOGGER = "kvwire.receiver.http"
#: characters of the parser's reason kept in the line (it may quote the request)
MAX_REASON = 160


class MalformedRequests(logging.Filter):
    def __init__(self, throttle: Throttle | None = None) -> None:
        super().__init__()
        self.throttle = throttle or Throttle()

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        missed = self.throttle.take()
        if missed is None:
            return False
        reason = " ".join(str(exc.message).split())[:MAX_REASON]   # one line, whatever the client sent
        note = f" ({missed} more since the last line, not logged)" if missed else ""
        record.msg, record.args = f"{record.getMessage()}: {type(exc).__name__}: {reason}{note}", None
        record.exc_info, record.exc_text = None, None
        if record.levelno > logging.WARNING:   # (aiohttp logs a first request's bad method at DEBUG)
            record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        return True


def server_logger() -> logging.Logger:
    """The logger for aiohttp's request handlers (``AppRunner(logger=...)``), its
    ``MalformedRequests`` filter added on the first call."""
    logger = logging.getLogger(LOGGER)
    if not any(isinstance(f, MalformedRequests) for f in logger.filters):
        logger.addFilter(MalformedRequests())
    return logger
