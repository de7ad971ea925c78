"""The receiver daemon's cap on concurrent client connections and its throttled log of
malformed requests (#15, round three), over real sockets on loopback: connections past
``max_connections`` get a 503 with ``Retry-After`` without their request being read,
the admitted ones are still served, closed ones free their places; a flood of
malformed requests logs one short line per second, not a traceback each."""
from __future__ import annotations

import asyncio
import json
import logging

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from streamer.net.throttle import Throttle
from streamer.receiver import ReceiverConfig, connections, server_log, start_receiver
from test_streamer_store import closed_port

CAP = 4
HEAD = b"GET /contexts HTTP/1.1\r\nHost: x\r\n"


def _config() -> ReceiverConfig:
    return ReceiverConfig(servers=[("127.0.0.1", closed_port())], trim_seconds=None, max_connections=CAP)


@pytest.fixture
async def receiver():
    receiver = await start_receiver(_config(), "127.0.0.1", 0)
    yield receiver
    await receiver.close()


async def _answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), headers, await reader.readexactly(int(headers["Content-Length"]))


async def _open(port: int, n: int) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    return [await asyncio.open_connection("127.0.0.1", port) for _ in range(n)]


async def _released(receiver, open_now: int) -> None:
    """Wait (no time limit but the test's) until the daemon has seen the closes."""
    while receiver.open_connections != open_now:
        await asyncio.sleep(0.01)


async def _busy(receiver) -> None:
    """Wait (no time limit but the test's) until the daemon has read every connection's
    new bytes, so none counts as idle."""
    while receiver.gate.idle:
        await asyncio.sleep(0.01)


def _sample(receiver, name: str) -> float:
    return receiver.metrics.registry.get_sample_value(name) or 0.0


async def test_connections_past_the_cap_get_503_unread_and_places_are_freed_on_close(receiver) -> None:
    held = await _open(receiver.port, CAP)
    for _, writer in held:
        writer.write(HEAD)   # a partial head: each connection is held, none answered yet
    excess = await _open(receiver.port, 3)
    for reader, writer in excess:
        writer.write(HEAD + b"\r\n")   # a whole request, never read
        status, headers, body = await _answer(reader)
        assert status == 503 and headers["Retry-After"] == str(connections.RETRY_AFTER), headers
        assert headers["Connection"] == "close" and f"at most {CAP} connections" in json.loads(body)["error"]
        assert await reader.read() == b""   # then closed by the daemon
        writer.close()
    assert _sample(receiver, "kvwire_receiver_connections_refused_total") == 3
    assert _sample(receiver, "kvwire_receiver_connections_open") == CAP

    reader, writer = held[0]   # an admitted connection is still served during the flood
    writer.write(b"\r\n")
    status, _, body = await _answer(reader)
    assert status == 200 and "contexts" in json.loads(body)

    for _, writer in held:
        writer.close()
    await _released(receiver, 0)
    again = await _open(receiver.port, CAP)   # every place is free again
    for reader, writer in again:
        writer.write(HEAD + b"\r\n")
        status, _, _ = await _answer(reader)
        assert status == 200
        writer.write(HEAD)   # a next request begun: busy, so its place is not reclaimed
    await _busy(receiver)
    reader, writer = (await _open(receiver.port, 1))[0]
    writer.write(HEAD + b"\r\n")
    assert (await _answer(reader))[0] == 503
    for _, w in again + [(reader, writer)]:
        w.close()
    await _released(receiver, 0)
    reader, writer = (await _open(receiver.port, 1))[0]   # /metrics says the same
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    status, _, body = await _answer(reader)
    writer.close()
    assert status == 200 and b"kvwire_receiver_connections_refused_total 4.0" in body
    assert b"kvwire_receiver_connections_open 1.0" in body   # this one


async def test_refusals_past_max_refusing_are_closed_at_once(receiver, monkeypatch) -> None:
    monkeypatch.setattr(connections, "MAX_REFUSING", 0)
    held = await _open(receiver.port, CAP)
    reader, writer = (await _open(receiver.port, 1))[0]
    try:
        data = await reader.read()
    except ConnectionResetError:   # closing with unread input may reset: allowed past MAX_REFUSING
        data = b""
    assert data == b"" or data.startswith(b"HTTP/1.1 503 ")
    assert not receiver._gate.refusing
    for _, w in held + [(reader, writer)]:
        w.close()


def test_the_cap_holds_on_uvloop() -> None:
    """``kvwire receive`` runs on uvloop, whose transports are not asyncio's classes."""
    uvloop = pytest.importorskip("uvloop")

    async def scenario() -> None:
        receiver = await start_receiver(_config(), "127.0.0.1", 0)
        try:
            held = await _open(receiver.port, CAP)
            reader, writer = (await _open(receiver.port, 1))[0]
            status, headers, _ = await _answer(reader)
            assert status == 503 and headers["Retry-After"] == str(connections.RETRY_AFTER)
            assert await reader.read() == b""
            for _, w in held + [(reader, writer)]:
                w.close()
            await _released(receiver, 0)
            reader, writer = (await _open(receiver.port, 1))[0]
            writer.write(HEAD + b"\r\n")
            assert (await _answer(reader))[0] == 200
            writer.close()
        finally:
            await receiver.close()

    uvloop.run(scenario())


def test_max_connections_is_validated() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_connections"):
            ReceiverConfig(servers=[("h", 1)], max_connections=bad)


def test_the_cli_sets_max_connections() -> None:
    from streamer.tools.cli import build_parser

    args = build_parser().parse_args(["receive", "--servers", "h:1", "--max-connections", "9"])
    assert args.max_connections == 9
    args = build_parser().parse_args(["receive", "--servers", "h:1"])
    assert args.max_connections == connections.DEFAULT_MAX_CONNECTIONS


# ---------------------------------------------------------------------------- logs
class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_throttle_lets_one_line_through_per_interval_and_counts_the_rest() -> None:
    clock = _Clock()
    throttle = Throttle(1.0, clock)
    assert throttle.take() == 0
    assert [throttle.take() for _ in range(5)] == [None] * 5
    clock.now = 0.999
    assert throttle.take() is None
    clock.now = 1.0
    assert throttle.take() == 6 and throttle.take() is None
    with pytest.raises(ValueError):
        Throttle(0)


def test_records_other_than_malformed_requests_pass_unchanged() -> None:
    only = server_log.MalformedRequests(Throttle(1.0, _Clock()))
    try:
        raise RuntimeError("a bug")
    except RuntimeError:
        import sys

        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "Unhandled exception", None, sys.exc_info())
    for _ in range(3):
        assert only.filter(record) and record.exc_info is not None and record.levelno == logging.ERROR


def test_a_malformed_request_logged_below_warning_stays_there() -> None:
    from aiohttp.http_exceptions import BadHttpMethod

    only = server_log.MalformedRequests(Throttle(1.0, _Clock()))
    exc = BadHttpMethod("\x16\x03\x01")   # TLS on the HTTP port: aiohttp logs it at DEBUG
    record = logging.LogRecord("x", logging.DEBUG, __file__, 1, "Error handling request from %s", ("h",),
                               (type(exc), exc, None))
    assert only.filter(record) and record.levelno == logging.DEBUG and record.exc_info is None
    assert record.getMessage().startswith("Error handling request from h: BadHttpMethod: ")


async def test_100_malformed_requests_log_one_short_line_then_the_count(receiver, caplog, monkeypatch) -> None:
    clock = _Clock()   # frozen: the bound is exact, whatever the machine's speed
    only = next(f for f in server_log.server_logger().filters if isinstance(f, server_log.MalformedRequests))
    monkeypatch.setattr(only, "throttle", Throttle(1.0, clock))
    bad = [b"GET /contexts/" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",   # request line too long
           b"GET /contexts HTTP/1.1\r\nHost: x\r\nX-A: " + b"b" * 9000 + b"\r\n\r\n",   # header too long
           b"GET /contexts\x00 HTTP/1.1\r\nHost: x\r\n\r\n",   # a bad request line
           b"POST /fetch HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"]   # a bad chunk
    with caplog.at_level(logging.DEBUG):
        for i in range(100):
            reader, writer = (await _open(receiver.port, 1))[0]
            writer.write(bad[i % len(bad)])
            status, _, _ = await _answer(reader)
            assert status == 400
            writer.close()
        clock.now = 1.0
        reader, writer = (await _open(receiver.port, 1))[0]
        writer.write(bad[0])
        await _answer(reader)
        writer.close()
        await _released(receiver, 0)
    lines = [r for r in caplog.records if r.name == server_log.LOGGER]
    assert len(lines) == 2, [r.getMessage()[:120] for r in lines]
    assert all(r.levelno == logging.WARNING and r.exc_info is None and "\n" not in r.getMessage() for r in lines)
    assert "LineTooLong" in lines[0].getMessage() and "more since" not in lines[0].getMessage()
    assert "99 more since the last line, not logged" in lines[1].getMessage()
    assert len(lines[1].getMessage()) < 400
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def _served(port: int, n: int) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """``n`` keep-alive connections, each answered once and left idle."""
    held = await _open(port, n)
    for reader, writer in held:
        writer.write(HEAD + b"\r\n")
        assert (await _answer(reader))[0] == 200
    return held


async def test_at_the_cap_a_new_connection_takes_the_place_of_the_longest_idle_one(receiver) -> None:
    held = await _served(receiver.port, CAP)
    reader, writer = held[1]   # connection 1 asks again: now connection 0 is the longest idle
    writer.write(HEAD + b"\r\n")
    assert (await _answer(reader))[0] == 200

    newcomer = (await _open(receiver.port, 1))[0]
    newcomer[1].write(HEAD + b"\r\n")
    assert (await _answer(newcomer[0]))[0] == 200   # admitted, not refused
    assert await held[0][0].read() == b""   # the longest idle one was closed
    assert _sample(receiver, "kvwire_receiver_connections_reclaimed_total") == 1
    assert _sample(receiver, "kvwire_receiver_connections_refused_total") == 0
    await _released(receiver, CAP)

    for reader, writer in held[1:]:   # the others are still served
        writer.write(HEAD + b"\r\n")
        assert (await _answer(reader))[0] == 200
    for _, w in held + [newcomer]:
        w.close()
    await _released(receiver, 0)


async def test_a_connection_with_a_request_under_way_is_never_reclaimed(receiver) -> None:
    """Busy connections (a partial head, a request in the handler) keep their places: with
    no idle connection at the cap the newcomer is refused; the partial one is then served."""
    held = await _served(receiver.port, CAP)
    for _, writer in held:
        writer.write(HEAD)   # a second request begun on each: none is idle any more
    await _busy(receiver)
    newcomer = (await _open(receiver.port, 1))[0]
    newcomer[1].write(HEAD + b"\r\n")
    assert (await _answer(newcomer[0]))[0] == 503
    for reader, writer in held:
        writer.write(b"\r\n")
        assert (await _answer(reader))[0] == 200
    assert _sample(receiver, "kvwire_receiver_connections_reclaimed_total") == 0
    for _, w in held + [newcomer]:
        w.close()
    await _released(receiver, 0)


class _FakeHandler:
    """Stands in for aiohttp's RequestHandler: records a force_close."""

    def __init__(self) -> None:
        self.closed = False

    def connection_made(self, transport) -> None:
        pass

    def data_received(self, data: bytes) -> None:
        pass

    def connection_lost(self, exc) -> None:
        pass

    def force_close(self) -> None:
        self.closed = True


#: accepts and answers drawn more often than bytes and closes, so the gate is often full
#: with several idle connections, where the choice of which one to close shows
_OPS = st.lists(st.tuples(st.sampled_from(["accept"] * 3 + ["answer"] * 3 + ["send", "lose"]),
                          st.integers(0, 63)), max_size=80)


@settings(max_examples=300, deadline=None)
@given(cap=st.integers(1, 6), ops=_OPS)
@example(cap=2, ops=[("accept", 0), ("accept", 0), ("answer", 0), ("answer", 1), ("accept", 0)])
def test_the_gate_never_exceeds_the_cap_and_reclaims_only_idle_connections(cap: int, ops) -> None:
    """Any order of accepts, answers, client bytes and closes: the places taken never
    exceed the cap; only a connection whose answer is written and which has sent nothing
    since is closed to make room, the longest idle first; a newcomer is refused only when
    every place is taken by a busy connection."""
    gate = connections.ConnectionGate(lambda: _FakeHandler(), cap, on_refuse=lambda: None)
    live: list = []           # admitted connections not yet lost, in accept order
    idle_since: dict = {}     # the model: connection -> when its answer was written (op index)
    for step, (op, pick) in enumerate(ops):
        if op == "accept":
            taken = gate.open - len(gate.reclaimed)
            open_before = [c for c in live if not c.inner.closed]
            proto = gate()
            admitted = isinstance(proto, connections._Counted)
            assert admitted == (taken < cap or bool(idle_since)), "refused with a place or an idle connection free"
            newly_closed = [c for c in open_before if c.inner.closed]
            if admitted and taken >= cap:   # the longest idle connection, and only it, made room
                oldest = min(idle_since, key=idle_since.get)
                assert newly_closed == [oldest] and oldest in gate.reclaimed
                del idle_since[oldest]
            else:
                assert newly_closed == []
            if admitted:
                proto.connection_made(None)
                live.append(proto)
        elif live:
            conn = live[pick % len(live)]
            if op == "answer" and not conn.inner.closed:
                gate.answer_written(conn.inner)
                idle_since[conn] = step
            elif op == "send" and not conn.inner.closed:
                conn.data_received(b"x")
                idle_since.pop(conn, None)
            elif op == "lose":
                conn.connection_lost(None)
                live.remove(conn)
                idle_since.pop(conn, None)
        assert gate.open == len(live)
        assert gate.open - len(gate.reclaimed) <= cap
        assert all(c.inner.closed for c in gate.reclaimed)
        assert set(gate.idle) == set(idle_since)   # idle exactly when the model says so
        assert list(gate.idle) == sorted(gate.idle, key=idle_since.get)   # longest idle first
