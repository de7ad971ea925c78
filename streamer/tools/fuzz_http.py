"""The receiver daemon's fuzz targets for ``kvwire fuzz``: functions of one ``bytes``
input that raise :class:`FuzzBug` when the daemon's request parsing or its event
stream misbehaves.

``http``
    Raw bytes of one connection fed, in pieces, to aiohttp's request parser (the class
    the daemon's server uses, with the daemon's limits: ``requests.server_options``),
    and every request it frames to ``requests.parse_head`` and, for ``POST /fetch``,
    ``requests.parse_fetch_body``, as the daemon's ``dispatch`` does: only aiohttp's
    typed parser errors (the daemon answers 400) and ``RequestError`` with a 4xx status;
    no framed request over a limit (request line, header count and size, body).
    data[0]: piece length (0: all at once, else 1-255 bytes); data[1:]: the bytes.
``sse``
    ``sse.encode`` of an event built from the input (event number, kind, and JSON-like
    data whose strings hold CR, LF, U+2028, NUL, lone surrogates, "data:" lines, and
    floats that are NaN or infinite), parsed back with the WHATWG event-stream rules:
    exactly one event, with the id, kind and data (strict JSON, non-finite floats as
    null) that went in, and no other field; a kind or number that cannot be sent is a
    ``ValueError``.
"""
from __future__ import annotations

import functools
import json
import struct
from typing import Any

from streamer.tools.fuzz_codec import FuzzBug


# ------------------------------------------------------------------------ http
@functools.lru_cache(maxsize=1)
def _loop():
    import asyncio

    return asyncio.new_event_loop()   # never run: aiohttp's parser only needs one to exist


def _parser():
    from aiohttp.base_protocol import BaseProtocol
    from aiohttp.http_parser import HttpRequestParser
    from aiohttp.web_protocol import RequestPayloadError

    from streamer.receiver.requests import server_options

    options = server_options()
    loop = _loop()
    return HttpRequestParser(BaseProtocol(loop), loop, 1 << 16, max_line_size=options["max_line_size"],
                             max_field_size=options["max_field_size"], max_headers=options["max_headers"],
                             payload_exception=RequestPayloadError)


def _check_limits(message) -> None:
    from streamer.receiver import requests

    if len(message.path) > requests.MAX_REQUEST_LINE:
        raise FuzzBug(f"a request target of {len(message.path)} bytes got through")
    if len(message.raw_headers) > requests.MAX_HEADERS:
        raise FuzzBug(f"{len(message.raw_headers)} headers got through")
    for name, value in message.raw_headers:
        if max(len(name), len(value)) > requests.MAX_HEADER_FIELD:
            raise FuzzBug(f"a header name or value of {max(len(name), len(value))} bytes got through")


def _typed(call, *args, **kwargs) -> Any:
    """``call``'s result, or None for a RequestError with a 4xx status (FuzzBug otherwise)."""
    from streamer.receiver.requests import RequestError

    try:
        return call(*args, **kwargs)
    except RequestError as exc:
        if not 400 <= exc.status < 500:
            raise FuzzBug(f"RequestError with status {exc.status}: {exc.message}") from exc
        return None


def _read_body(payload) -> None:
    """What the daemon's ``post_fetch`` parses of a body that has arrived whole."""
    from aiohttp.web_protocol import RequestPayloadError

    from streamer.adapt.policies import DEFAULT_POLICY
    from streamer.receiver import requests

    try:
        body = payload.read_nowait(-1)
    except RequestPayloadError:
        return   # a malformed body: the daemon's read raises it, aiohttp answers 400
    if len(body) <= requests.MAX_BODY:   # else aiohttp's client_max_size: 413 while reading
        _typed(requests.parse_fetch_body, body, default_slo=2.0, default_policy=DEFAULT_POLICY)


def check_http(data: bytes) -> None:
    from aiohttp.http_exceptions import HttpProcessingError

    from streamer.receiver import requests

    if not data:
        return
    parser = _parser()
    body = data[1:]
    step = data[0] or max(len(body), 1)
    waiting = []   # bodies of POST /fetch the daemon is reading
    try:
        for i in range(0, max(len(body), 1), step):
            messages, upgraded, _ = parser.feed_data(body[i:i + step])
            for message, payload in messages:
                _check_limits(message)   # then, as the daemon's dispatch does at the head:
                head = _typed(requests.parse_head, message.method, message.path, message.headers)
                if head is not None and head.route == "fetch":
                    waiting.append(payload)
            for payload in [p for p in waiting if p.is_eof()]:
                waiting.remove(payload)
                _read_body(payload)
            if upgraded:
                return   # the daemon takes no upgrade: aiohttp answers it without a handler
    except HttpProcessingError:
        return
    except FuzzBug:
        raise
    except Exception as exc:
        raise FuzzBug(f"request parsing raised {type(exc).__name__}: {exc}") from exc


def seed_requests() -> list[bytes]:
    """One valid request per route (and a pipelined stream of them)."""
    fetch = json.dumps({"context_id": "doc-1", "slo": 1.5, "policy": "fixed:2", "refresh": False,
                        "wait": True}).encode()
    host = b"Host: 127.0.0.1:7420\r\n"
    out = [b"POST /fetch HTTP/1.1\r\n" + host + b"Content-Type: application/json\r\nContent-Length: "
           + str(len(fetch)).encode() + b"\r\n\r\n" + fetch,
           b"POST /fetch HTTP/1.1\r\n" + host + b"Transfer-Encoding: chunked\r\n\r\n"
           + f"{len(fetch):x}\r\n".encode() + fetch + b"\r\n0\r\n\r\n",
           b"GET /contexts HTTP/1.1\r\n" + host + b"\r\n",
           b"GET /contexts/doc-1?wait=0 HTTP/1.1\r\n" + host + b"\r\n",
           b"GET /contexts/doc%2D1/events?wait=2.5&after=3 HTTP/1.1\r\n" + host + b"Last-Event-ID: 7\r\n\r\n",
           b"GET /healthz HTTP/1.0\r\n\r\n",
           b"HEAD /metrics HTTP/1.1\r\n" + host + b"Connection: close\r\n\r\n"]
    return out + [b"".join(out[:-1])]


# ------------------------------------------------------------------------ sse
#: strings that try to break out of a data line
_HOSTILE_TEXT = ("\r", "\n", "\r\n", "\n\nevent: injected\ndata: {}\n\n", "\rid: 99", "\u2028\u2029", "\x00",
                 "\ud800", "data: 1", ": comment", "\ufeff", "é", "\x85")
_KINDS = ("start", "manifest", "layer", "chunk", "text", "superseded", "done", "error")


class _Reader:
    """Draws values from the input's bytes (zeros once they run out)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out.ljust(n, b"\x00")

    def byte(self) -> int:
        return self.take(1)[0]

    def text(self) -> str:
        n = self.byte() % 12
        raw = self.take(n)
        if raw and raw[0] % 3 == 0:
            return _HOSTILE_TEXT[raw[-1] % len(_HOSTILE_TEXT)] + raw.decode("latin-1")
        return raw.decode("utf-8", "surrogateescape")

    def value(self, depth: int = 0) -> Any:
        op = self.byte() % (8 if depth < 3 else 4)
        if op == 0:
            return self.text()
        if op == 1:
            return struct.unpack("<q", self.take(8))[0]
        if op == 2:
            return struct.unpack("<d", self.take(8))[0]   # NaN and infinities among them
        if op == 3:
            return (None, True, False)[self.byte() % 3]
        if op in (4, 5):
            return [self.value(depth + 1) for _ in range(self.byte() % 4)]
        return {self.text(): self.value(depth + 1) for _ in range(self.byte() % 4)}


def sse_event(data: bytes) -> tuple[int, str, Any]:
    """(number, kind, data) of an event ``data`` describes: data[0] bit 0 picks a kind
    made of input bytes instead of a real one, bit 1 a negative number."""
    reader = _Reader(data[1:] if data else b"")
    flags = data[0] if data else 0
    seq = struct.unpack("<I", reader.take(4))[0] * (-1 if flags & 2 else 1)
    kind = reader.text() if flags & 1 else _KINDS[reader.byte() % len(_KINDS)]
    return seq, kind, {"event": reader.value(1), "message": reader.text()}


def parse_event_stream(stream: bytes) -> list[dict[str, list[str]]]:
    """Events of a ``text/event-stream`` body by the WHATWG parsing rules; each event is
    every field line it had (name -> values, in order), comments dropped."""
    text = stream.decode("utf-8")   # a stream of ASCII here: a decode error is a bug itself
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    events: list[dict[str, list[str]]] = []
    fields: dict[str, list[str]] = {}
    for line in lines[:-1]:   # the text after the last line end is not a line
        if line == "":
            if fields:
                events.append(fields)
            fields = {}
        elif not line.startswith(":"):
            name, colon, value = line.partition(":")
            fields.setdefault(name, []).append(value[1:] if colon and value.startswith(" ") else value)
    return events


def _strict_json(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise FuzzBug(f"the data line holds {name}, which is not JSON")

    return json.loads(text, parse_constant=refuse)


def check_sse(data: bytes) -> None:
    from streamer.receiver import sse

    seq, kind, payload = sse_event(data)
    try:
        stream = sse.encode(seq, kind, payload)
    except ValueError:
        if seq >= 0 and kind in _KINDS:
            raise FuzzBug(f"encode refused a real event ({seq}, {kind!r})") from None
        return
    except Exception as exc:
        raise FuzzBug(f"sse.encode raised {type(exc).__name__}: {exc}") from exc
    try:
        events = parse_event_stream(stream)
    except UnicodeDecodeError as exc:
        raise FuzzBug(f"the event is not UTF-8: {exc}") from exc
    if len(events) != 1:
        raise FuzzBug(f"one event encoded, {len(events)} parsed: {stream[:300]!r}")
    fields = events[0]
    if sorted(fields) != ["data", "event", "id"] or any(len(v) != 1 for v in fields.values()):
        raise FuzzBug(f"fields {fields} in the event, not one id, event and data line")
    if fields["id"] != [str(seq)] or fields["event"] != [kind]:
        raise FuzzBug(f"id/event {fields['id']}/{fields['event']} parsed, {seq}/{kind!r} sent")
    got = _strict_json(fields["data"][0])
    want = json.loads(json.dumps(sse._finite(payload)))   # what JSON can say of it (tuples as lists)
    if got != want:
        raise FuzzBug(f"data {fields['data'][0][:200]!r} parses to something else than was sent")


def seed_events() -> list[bytes]:
    """Inputs for each real kind, one with a made-up kind and one with hostile strings."""
    return [bytes([0, 7, 0, 0, 0, k]) + b"\x06\x02\x00abc\x01" + bytes(8) for k in range(len(_KINDS))] \
        + [b"\x01\x01\x00\x00\x00\x05event", b"\x00\x01\x00\x00\x00\x07\x00\x03\x00\x01\x00"]
