"""The receiver daemon's request parsing (``streamer.receiver.requests``, sans-I/O) and its
event encoder (``streamer.receiver.sse``): routes and parameters, a typed 4xx for each
malformed part, the size limits, and events whose data cannot start a field or an event."""
from __future__ import annotations

import json

import pytest

from streamer.receiver import requests, sse
from streamer.receiver.requests import Head, RequestError, parse_fetch_body, parse_head
from streamer.tools import fuzz_http
from streamer.tools.fuzz_codec import FuzzBug


def _refused(status: int, words: str, call, *args, **kwargs) -> RequestError:
    with pytest.raises(RequestError) as info:
        call(*args, **kwargs)
    assert info.value.status == status and words in info.value.message, info.value.message
    return info.value


# ---------------------------------------------------------------------------- head
@pytest.mark.parametrize("method, target, headers, want", [
    ("POST", "/fetch", {"Content-Length": "40"}, Head("fetch")),
    ("GET", "/contexts", {}, Head("contexts")),
    ("HEAD", "/healthz", {}, Head("healthz")),
    ("GET", "/metrics", {}, Head("metrics")),
    ("GET", "/contexts/doc-1", {}, Head("context", "doc-1", join=True)),
    ("GET", "/contexts/doc%2D1?wait=0", {}, Head("context", "doc-1", join=False)),
    ("GET", "/contexts/a/events?wait=2.5&after=3", {}, Head("events", "a", wait=2.5, after=3)),
    ("GET", "/contexts/a/events?after=3", {"Last-Event-ID": "9"}, Head("events", "a", after=9)),
])
def test_routes_and_parameters(method, target, headers, want) -> None:
    assert parse_head(method, target, headers) == want


@pytest.mark.parametrize("method, target, headers, status, words", [
    ("GET", "/no/such/route", {}, 404, "no endpoint"),
    ("GET", "/contexts/a/b", {}, 404, "no endpoint"),
    ("GET", "*", {}, 400, "must be a path"),
    ("GET", "/contexts/..", {}, 400, "invalid context id"),
    ("GET", "/contexts/a%2Fb", {}, 400, "invalid context id"),
    ("GET", "/contexts/a%ff", {}, 400, "not UTF-8"),
    ("GET", "/contexts/a\udcff", {}, 400, "not UTF-8"),          # raw 0xff, as surrogateescape gives it
    ("GET", "/contexts/a?wait=%ff", {}, 400, "not UTF-8"),
    ("GET", "/contexts/a?colour=red", {}, 400, "unknown query parameter"),
    ("GET", "/contexts/a?wait=0&wait=1", {}, 400, "given twice"),
    ("GET", "/contexts/a?wait=maybe", {}, 400, "wait must be 0, 1"),
    ("GET", "/contexts/a/events?" + "&".join(["wait=1"] * 9), {}, 400, "more than 8"),
    ("GET", "/contexts/a/events?wait=nan", {}, 400, "between 0 and 3600"),
    ("GET", "/contexts/a/events?wait=1e999", {}, 400, "between 0 and 3600"),
    ("GET", "/contexts/a/events?wait=3601", {}, 400, "between 0 and 3600"),
    ("GET", "/contexts/a/events", {"Last-Event-ID": "-1"}, 400, "Last-Event-ID"),
    ("GET", "/contexts/a/events", {"Last-Event-ID": "9" * 20}, 400, "Last-Event-ID"),
    ("GET", "/contexts/a/events?after=\u0663", {}, 400, "after"),   # a digit, but not an ASCII one
    ("POST", "/fetch", {"Content-Length": str(1 << 40)}, 413, "at most 65536 bytes"),
    ("POST", "/fetch", {"Content-Length": str(requests.MAX_BODY + 1)}, 413, "at most"),
])
def test_a_malformed_head_is_a_typed_4xx(method, target, headers, status, words) -> None:
    _refused(status, words, parse_head, method, target, headers)


def test_a_wrong_method_is_405_with_allow() -> None:
    error = _refused(405, "not allowed", parse_head, "GET", "/fetch", {})
    assert error.allow == ("POST",)
    assert _refused(405, "not allowed", parse_head, "DELETE", "/contexts/a", {}).allow == ("GET", "HEAD")


def test_server_options_carry_the_limits() -> None:
    assert requests.server_options() == {"max_line_size": requests.MAX_REQUEST_LINE,
                                         "max_field_size": requests.MAX_HEADER_FIELD,
                                         "max_headers": requests.MAX_HEADERS,
                                         "keepalive_timeout": requests.HEAD_TIMEOUT}


# ---------------------------------------------------------------------------- body
def _body(data: bytes):
    return parse_fetch_body(data, default_slo=2.0, default_policy="fixed:0")


def test_a_fetch_body_parses() -> None:
    fetch, wait = _body(json.dumps({"context_id": "a", "slo": 1.5, "min_level": 2, "wait": False}).encode())
    assert (fetch.context_id, fetch.slo, fetch.policy, fetch.min_level, wait) == ("a", 1.5, "fixed:2", 2, False)


def test_deeply_nested_json_is_400_not_recursion_error() -> None:
    """Found writing the http target: json.loads raises RecursionError past ~1000 levels,
    which the daemon answered with 500."""
    _refused(400, "nested too deeply", _body, b"[" * 50000)
    _refused(400, "nested too deeply", _body, b"{\"a\":" * 10000)


def test_an_integer_of_5000_digits_is_400_not_value_error() -> None:
    """Found writing the http target: Python refuses to convert integers of over 4300
    digits with a plain ValueError, which the daemon answered with 500."""
    _refused(400, "malformed JSON", _body, b'{"context_id": "a", "min_level": ' + b"9" * 5000 + b"}")


def test_a_body_that_is_not_utf8_or_too_large_is_refused() -> None:
    _refused(400, "malformed JSON", _body, b'{"context_id": "\xff"}')
    _refused(413, "at most", _body, b" " * (requests.MAX_BODY + 1))


# ---------------------------------------------------------------------------- events
def test_an_event_cannot_inject_a_field_or_an_event() -> None:
    message = "boom\r\n\r\nevent: done\ndata: {}\r\rid: 99\u2028\x00\ud800"
    stream = sse.encode(4, "error", {"message": message, "nested": [{"k\n": message}]})
    assert stream.isascii()
    (event,) = fuzz_http.parse_event_stream(stream)
    assert event["id"] == ["4"] and event["event"] == ["error"] and len(event["data"]) == 1
    assert json.loads(event["data"][0]) == {"message": message, "nested": [{"k\n": message}]}


def test_non_finite_floats_are_null_not_nan() -> None:
    """Found by the sse target: json.dumps wrote NaN and Infinity, which no JSON parser
    but Python's accepts."""
    stream = sse.encode(1, "chunk", {"seconds": float("nan"), "rate": [float("inf"), -float("inf"), 1.5]})
    (event,) = fuzz_http.parse_event_stream(stream)
    assert json.loads(event["data"][0], parse_constant=lambda c: pytest.fail(c)) == \
        {"seconds": None, "rate": [None, None, 1.5]}


@pytest.mark.parametrize("seq, kind", [(1, "done\nevent: x"), (1, ""), (1, "Done"), (1, "a" * 33), (-1, "done"),
                                       (True, "done")])
def test_an_event_that_cannot_be_sent_is_a_value_error(seq, kind) -> None:
    with pytest.raises(ValueError):
        sse.encode(seq, kind, {})


def test_keepalive_is_a_comment_not_an_event() -> None:
    assert fuzz_http.parse_event_stream(sse.KEEPALIVE) == []
    assert len(fuzz_http.parse_event_stream(sse.KEEPALIVE + sse.encode(0, "start", {}) + sse.KEEPALIVE)) == 1


# ---------------------------------------------------------------------------- the fuzz targets see bugs
def test_the_http_target_reports_an_untyped_error(monkeypatch) -> None:
    def broken(method: str, target: str, headers) -> Head:
        raise KeyError(target)

    monkeypatch.setattr(requests, "parse_head", broken)
    with pytest.raises(FuzzBug, match="KeyError"):
        fuzz_http.check_http(b"\x00GET /contexts HTTP/1.1\r\nHost: x\r\n\r\n")


def test_the_http_target_reaches_the_fetch_body(monkeypatch) -> None:
    seen = []
    monkeypatch.setattr(requests, "parse_fetch_body", lambda body, **kw: seen.append(body))
    fuzz_http.check_http(b"\x03" + fuzz_http.seed_requests()[1])    # chunked, fed 3 bytes at a time
    assert json.loads(seen[0])["context_id"] == "doc-1"


def test_the_sse_target_catches_the_old_encoder(monkeypatch) -> None:
    """The encoder as it was (json.dumps, NaN allowed) fails the target on a NaN."""
    def old(seq: int, kind: str, data) -> bytes:
        return f"id: {seq}\nevent: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()

    monkeypatch.setattr(sse, "encode", old)
    nan = b"\x00\x01\x00\x00\x00\x00\x02" + bytes.fromhex("000000000000f87f")
    assert fuzz_http.sse_event(nan)[2]["event"] != fuzz_http.sse_event(nan)[2]["event"]   # NaN
    with pytest.raises(FuzzBug, match="NaN"):
        fuzz_http.check_sse(nan)


def test_the_http_target_holds_the_parser_to_the_stated_limits(monkeypatch) -> None:
    """A name and a value each at the limit pass; a parser that lets more headers through
    than requests.MAX_HEADERS states is reported."""
    big = b"\x00GET /contexts HTTP/1.1\r\nHost: x\r\n" + b"N" * 8000 + b": " + b"v" * 8000 + b"\r\n\r\n"
    fuzz_http.check_http(big)
    lax = {**requests.server_options(), "max_headers": 128}
    monkeypatch.setattr(requests, "server_options", lambda: lax)
    monkeypatch.setattr(requests, "MAX_HEADERS", 1)
    with pytest.raises(FuzzBug, match="2 headers got through"):
        fuzz_http.check_http(big)
