"""Hostile HTTP requests to the receiver daemon, for ``kvwire bench adversarial``.

Each input is sent over a raw socket to a receiver daemon started in the same process
(no sender reachable: these requests must be refused before one is needed), after the
daemon is warm. The row says the response (status and message: the typed refusal),
the seconds from the first byte sent to the response read, the growth of peak RSS,
and whether the daemon then still answers ``GET /contexts``. ``slowloris`` holds
partial request heads open instead: its seconds are those of an ordinary request
made meanwhile, and its response says when the daemon closed the partial ones.
``connection_flood`` starts ``FLOOD_CONNECTIONS`` clients at once, each asking
``GET /contexts`` and holding its connection: its seconds run to the last answer, and
its response counts the answers (200 for those admitted, 503 for those refused), the
idle admitted connections closed to make room for later ones (each answered client
holds an idle keep-alive connection: past the cap a newcomer takes the place of the
longest idle one) and the daemon's log lines meanwhile. ``malformed_request_flood`` sends ``MALFORMED_REQUESTS`` malformed
requests one after another: its seconds are theirs, and its response counts the log
lines they caused.
"""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import socket
import time
import zlib
from typing import Callable

from streamer.receiver import requests
from streamer.receiver.connections import DEFAULT_MAX_CONNECTIONS

HOST = b"Host: 127.0.0.1\r\n"


def _post(body: bytes, *headers: bytes, length: int | None = None) -> bytes:
    size = len(body) if length is None else length
    return b"POST /fetch HTTP/1.1\r\n" + HOST + b"".join(headers) + b"Content-Length: %d\r\n\r\n" % size + body


def _gzip_zeros(size: int) -> bytes:
    """A gzip stream of ``size`` zero bytes, compressed piece by piece (~1000:1)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = bytes(1 << 20)
    return b"".join(packer.compress(block) for _ in range(size >> 20)) + packer.flush()


def _chunked(total: int) -> bytes:
    piece = b"%x\r\n" % (1 << 16) + b" " * (1 << 16) + b"\r\n"
    return (b"POST /fetch HTTP/1.1\r\n" + HOST + b"Transfer-Encoding: chunked\r\n\r\n"
            + piece * (total >> 16) + b"0\r\n\r\n")


#: name -> the request's bytes (built before the measurement starts)
REQUESTS: dict[str, Callable[[], bytes]] = {
    "http_request_line_1MiB": lambda: b"GET /contexts/" + b"a" * (1 << 20) + b" HTTP/1.1\r\n" + HOST + b"\r\n",
    "http_header_1MiB": lambda: b"GET /contexts HTTP/1.1\r\n" + HOST + b"X-A: " + b"b" * (1 << 20) + b"\r\n\r\n",
    "http_10000_headers": lambda: b"GET /contexts HTTP/1.1\r\n" + HOST + b"X-A: b\r\n" * 10000 + b"\r\n",
    "http_content_length_2^40": lambda: _post(b'{"context_id": "a"}', length=1 << 40),
    "http_chunked_body_16MiB": lambda: _chunked(16 << 20),
    "http_gzip_body_32MiB_of_zeros": lambda: _post(_gzip_zeros(32 << 20), b"Content-Encoding: gzip\r\n"),
    "http_json_nested_60000_deep": lambda: _post(b"[" * 60000),
    "http_json_integer_of_5000_digits": lambda: _post(b'{"context_id": "a", "min_level": ' + b"9" * 5000 + b"}"),
    "http_path_invalid_utf8": lambda: b"GET /contexts/a\xff\xfe HTTP/1.1\r\n" + HOST + b"\r\n",
    "http_path_invalid_utf8_percent_encoded": lambda: b"GET /contexts/a%ff%fe HTTP/1.1\r\n" + HOST + b"\r\n",
}
#: partial request heads held open, and the byte trickled into each every 0.1 s
SLOWLORIS_CONNECTIONS = 100
#: connections opened at once by connection_flood: four times the daemon's default cap
FLOOD_CONNECTIONS = 4 * DEFAULT_MAX_CONNECTIONS
#: the longest a flood client waits for its answer (a bound for the bench, not a limit of the daemon)
FLOOD_ANSWER_TIMEOUT = 60.0
#: requests sent by malformed_request_flood (each a request line over the limit)
MALFORMED_REQUESTS = 5000


async def _response(reader: asyncio.StreamReader) -> str:
    """'HTTP <status>: <message>' of the response on ``reader`` (the JSON error, or aiohttp's text)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = next((int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:")), 0)
    body = (await reader.readexactly(length)).decode("utf-8", "replace")
    try:
        body = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        pass
    return f"HTTP {lines[0].split()[1]}: {' '.join(body.split())[:160]}"


async def _send(port: int, data: bytes) -> str:
    """Send ``data`` (the daemon may answer and close before all of it is sent) and read the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.transport.set_write_buffer_limits(1 << 16)
    try:
        for i in range(0, len(data), 1 << 16):
            if reader.at_eof() or writer.is_closing():
                break
            writer.write(data[i:i + (1 << 16)])
            try:
                await writer.drain()
            except ConnectionError:
                break
        return await _response(reader)
    finally:
        writer.close()


async def _ordinary(port: int) -> float:
    """Seconds a GET /contexts takes; ConnectionError unless it is a 200."""
    start = time.perf_counter()
    answer = await _send(port, b"GET /contexts HTTP/1.1\r\n" + HOST + b"Connection: close\r\n\r\n")
    if not answer.startswith("HTTP 200"):
        raise ConnectionError(f"GET /contexts answered {answer}")
    return time.perf_counter() - start


async def _slowloris(port: int) -> tuple[str, float]:
    """Hold SLOWLORIS_CONNECTIONS partial heads open, trickling; (what the daemon did, the
    seconds of an ordinary request made meanwhile)."""
    opened = [await asyncio.open_connection("127.0.0.1", port) for _ in range(SLOWLORIS_CONNECTIONS)]
    start = time.monotonic()
    for _, writer in opened:
        writer.write(b"GET /contexts HTTP/1.1\r\n" + HOST + b"X-A: b")
    await asyncio.sleep(0.5)
    seconds = await _ordinary(port)
    closed = 0
    while time.monotonic() - start < requests.HEAD_TIMEOUT + 10 and closed < len(opened):
        await asyncio.sleep(0.1)
        closed = 0
        for reader, writer in opened:
            if reader.at_eof() or writer.is_closing():
                closed += 1
            else:
                writer.write(b"b")   # one byte more of the header, never its end
    for _, writer in opened:
        writer.close()
    return (f"{closed} of {len(opened)} partial heads closed by the daemon after "
            f"{time.monotonic() - start:.1f} s (HEAD_TIMEOUT {requests.HEAD_TIMEOUT:.0f} s)"), seconds


class _LogLines(logging.Handler):
    """Counts the records of the daemon's loggers (kvwire.*, aiohttp.*) while installed."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.count = 0
        self.tracebacks = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        self.tracebacks += record.exc_info is not None

    def __enter__(self) -> "_LogLines":
        for name in ("kvwire", "aiohttp"):
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        for name in ("kvwire", "aiohttp"):
            logging.getLogger(name).removeHandler(self)


async def _flood_client(port: int) -> tuple[str, asyncio.StreamWriter | None]:
    """One flood connection asking GET /contexts: (the answer's status, or why there is
    none; the connection, left open so that an admitted one keeps its place)."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as exc:
        return f"no connection ({type(exc).__name__})", None
    writer.write(b"GET /contexts HTTP/1.1\r\n" + HOST + b"\r\n")
    try:
        return (await asyncio.wait_for(_response(reader), FLOOD_ANSWER_TIMEOUT)).split(":")[0], writer
    except ConnectionResetError:
        return "reset", writer
    except asyncio.IncompleteReadError:
        return "closed without an answer", writer
    except TimeoutError:
        return f"no answer in {FLOOD_ANSWER_TIMEOUT:.0f} s", writer


async def _flood(receiver) -> tuple[str, float]:
    """FLOOD_CONNECTIONS clients at once, each asking GET /contexts and holding its
    connection; (what they got and the daemon's log lines, the seconds to the last answer)."""
    while receiver.open_connections:   # the warm-up request's close is seen first
        await asyncio.sleep(0.01)
    with _LogLines() as lines:
        start = time.perf_counter()
        clients = await asyncio.gather(*(_flood_client(receiver.port) for _ in range(FLOOD_CONNECTIONS)))
        seconds = time.perf_counter() - start
        for _, writer in clients:
            if writer is not None:
                writer.close()
        while receiver.open_connections:   # the daemon sees the closes
            await asyncio.sleep(0.01)
    got = collections.Counter(answer for answer, _ in clients)
    answers = ", ".join(f"{n} x {what}" for what, n in sorted(got.items()))
    reclaimed = receiver.metrics.registry.get_sample_value("kvwire_receiver_connections_reclaimed_total")
    return (f"{FLOOD_CONNECTIONS} clients at once (max_connections {receiver.config.max_connections}): "
            f"{answers}; {reclaimed:.0f} idle ones closed for newcomers; all released on close; "
            f"{lines.count} log lines "
            f"({lines.tracebacks} with a traceback)"), seconds


async def _malformed(port: int) -> tuple[str, float]:
    """Send MALFORMED_REQUESTS malformed requests in turn; (their answers and the log
    lines they caused, their seconds)."""
    data = b"GET /contexts/" + b"a" * (16 << 10) + b" HTTP/1.1\r\n" + HOST + b"\r\n"   # line too long
    statuses: collections.Counter[str] = collections.Counter()
    with _LogLines() as lines:
        start = time.perf_counter()
        for _ in range(MALFORMED_REQUESTS):
            statuses[(await _send(port, data)).split(":")[0]] += 1
        seconds = time.perf_counter() - start
    answers = ", ".join(f"{n} x {status}" for status, n in sorted(statuses.items()))
    return f"{answers}; {lines.count} log lines ({lines.tracebacks} with a traceback)", seconds


async def _measure(name: str, reset: Callable[[], None], peak: Callable[[], int]) -> dict:
    from streamer.receiver import ReceiverConfig, start_receiver

    with socket.socket() as sock:   # a port nobody listens on: no sender is reachable
        sock.bind(("127.0.0.1", 0))
        dead = sock.getsockname()[1]
    receiver = await start_receiver(ReceiverConfig(servers=[("127.0.0.1", dead)], trim_seconds=None),
                                    "127.0.0.1", 0)
    try:
        await _ordinary(receiver.port)   # warm: the first request's imports are not the input's cost
        data = REQUESTS[name]() if name in REQUESTS else b""
        reset()
        before = peak()
        if name == "slowloris":
            error, seconds = await _slowloris(receiver.port)
        elif name == "connection_flood":
            error, seconds = await _flood(receiver)
        elif name == "malformed_request_flood":
            error, seconds = await _malformed(receiver.port)
        else:
            start = time.perf_counter()
            error = await _send(receiver.port, data)
            seconds = time.perf_counter() - start
        growth = (peak() - before) / 1024
        try:
            await _ordinary(receiver.port)
            up = True
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            up = False
    finally:
        await receiver.close()
    return {"input": name, "error": error, "seconds": round(seconds, 4), "peak_rss_growth_mb": round(growth, 1),
            "daemon_up": up}


NAMES = tuple(REQUESTS) + ("slowloris", "connection_flood", "malformed_request_flood")


def run_one(name: str, reset: Callable[[], None], peak: Callable[[], int]) -> dict:
    """Send one hostile request to a fresh daemon here (meant for a fresh process);
    ``reset`` and ``peak`` reset and read the process's peak RSS (KiB)."""
    return asyncio.run(_measure(name, reset, peak))
