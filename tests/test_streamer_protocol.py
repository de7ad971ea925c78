"""streamer.wire.protocol: the sans-I/O kvwire state machine, driven with bytes only (h11 style).

A client and a server Connection are wired back to back (client.send -> server.receive_data
and vice versa); byte streams are re-fed split at every offset and at random offsets;
malformed input must raise RemoteProtocolError and nothing else (fuzzed); local misuse
raises LocalProtocolError and leaves the connection untouched.
"""
from __future__ import annotations

import json
import struct
import time
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamer.wire import frames
from streamer.wire.protocol import (DEFAULT_MAX_FRAME, MAX_CONTROL_PAYLOAD, TRANSITIONS, Cancel,
                                    ChunkBegin, ChunkEnd, ChunkPart, Close, Connection,
                                    ConnectionClosed, Direction, Error, FrameType, GetProfile,
                                    Hello, LocalProtocolError, ManifestData, Open, Pending, ProfileData,
                                    ProtocolError, RemoteProtocolError, Request, Role, State,
                                    SUPPORTED_VERSIONS, Text, Welcome)

PID = "0123456789abcdef"
FUZZ = settings(max_examples=300, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------- helpers
def raw(ftype, payload=b"", *, flags=0, length=None):
    """A frame built by hand (so it can be wrong)."""
    payload = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return struct.pack("<IHH", len(payload) if length is None else length, int(ftype),
                       flags) + payload


def part(chunk, index, data, reserved=0):
    return raw(FrameType.CHUNK_PART, struct.pack("<IHH", chunk, index, reserved) + data)


class Wire:
    """Client and server back to back; records (sender, event, bytes) of every frame."""

    def __init__(self, **kw):
        self.c = Connection(Role.CLIENT, **kw.get("client", {}))
        self.s = Connection(Role.SERVER, **kw.get("server", {}))
        self.log = []

    def c2s(self, event):
        data = self.c.send(event)
        self.log.append(("C", event, data))
        got = self.s.receive_data(data)
        assert got == [event]
        return got[0]

    def s2c(self, event):
        data = self.s.send(event)
        self.log.append(("S", event, data))
        got = self.c.receive_data(data)
        assert got == [event]
        return got[0]

    def handshake(self):
        self.c2s(Hello(versions=(1,), client="test-recv"))
        self.s2c(Welcome(version=1, server="test-send", max_frame=1 << 20))
        return self

    def opened(self):
        self.handshake()
        self.c2s(Open("ctx", None))
        self.s2c(ManifestData(b"M"))
        return self

    def run(self, script):
        for side, event in script:
            (self.c2s if side == "C" else self.s2c)(event)
        return self


SCRIPT = [
    ("C", Hello(versions=(1,), client="recv")),
    ("S", Welcome(version=1, server="send", max_frame=1 << 20)),
    ("C", Open("ctx-1", 0.25)),
    ("C", GetProfile(PID)),
    ("S", ManifestData(b"manifest-bytes")),
    ("S", ProfileData(PID, b"profile")),
    ("C", Request(0, 2)),
    ("C", Request(1, "text")),
    ("C", Request(2, 0)),
    ("C", Request(3, 1)),
    ("C", Request(4, 1)),
    ("S", ChunkBegin(0, 2, total_bytes=10, parts=3)),
    ("S", ChunkPart(0, 0, b"hdr")),
    ("C", Cancel(2)),                                   # not begun: answered w/o BEGIN
    ("C", Cancel(3)),
    ("S", ChunkPart(0, 1, b"abcd")),
    ("S", ChunkPart(0, 2, b"efg")),
    ("S", ChunkEnd(0)),
    ("S", Text(1, b"\x28\xb5\x2f\xfdtokens")),
    ("S", ChunkEnd(2, cancelled=True)),
    ("S", Error("not_found", "chunk 3 is gone", fatal=False)),  # an ERROR answers 3
    ("S", ChunkBegin(4, 1, total_bytes=6, parts=2)),
    ("S", ChunkPart(4, 0, b"xy")),
    ("C", Cancel(4)),                                   # in progress: stopped early
    ("S", ChunkEnd(4, cancelled=True)),
    ("C", Open("ctx-2", None)),
    ("S", ManifestData(b"second")),
    ("C", Request(0, 0)),                               # chunk 0 again, new context
    ("S", Error("unavailable", "busy", fatal=False)),
    ("C", Close()),
]


# ----------------------------------------------------------------------------- happy paths
def test_full_session_back_to_back():
    w = Wire()
    assert (w.c.state, w.s.state) == (State.START, State.AWAIT_HELLO)
    w.run(SCRIPT[:2])
    assert (w.c.state, w.s.state) == (State.READY, State.READY)
    assert w.c.version == w.s.version == 1
    assert w.c.peer_name == "send" and w.s.peer_name == "recv"
    assert w.c.send_limit == w.s.send_limit == 1 << 20
    w.run(SCRIPT[2:4])
    assert [p.kind for p in w.c.outstanding] == [FrameType.OPEN, FrameType.GET_PROFILE]
    assert w.c.context_id is None
    w.run(SCRIPT[4:11])
    assert w.c.context_id == w.s.context_id == "ctx-1"
    assert w.c.outstanding == w.s.outstanding == tuple(
        Pending(Request(i, lvl)) for i, lvl in [(0, 2), (1, "text"), (2, 0), (3, 1), (4, 1)])
    w.run(SCRIPT[11:15])
    assert w.c.chunk_in_progress == w.s.chunk_in_progress
    assert w.c.chunk_in_progress.parts_seen == 1 and w.c.chunk_in_progress.bytes_seen == 3
    assert [p.cancelled for p in w.c.outstanding] == [False, False, True, True, False]
    assert w.c.outstanding == w.s.outstanding
    w.run(SCRIPT[15:-1])
    assert w.c.outstanding == w.s.outstanding == ()
    assert w.c.chunk_in_progress is None and w.c.context_id == "ctx-2"
    w.run(SCRIPT[-1:])
    assert (w.c.state, w.s.state) == (State.CLOSING, State.CLOSED)
    assert w.s.receive_data(b"") == [ConnectionClosed(clean=True)]
    assert w.c.receive_data(b"") == [ConnectionClosed(clean=True)]
    assert w.c.receive_data(b"") == []
    assert (w.c.state, w.s.state) == (State.CLOSED, State.CLOSED)


def test_every_event_round_trips_exactly():
    w = Wire().run(SCRIPT)
    sent = [e for _, e, _ in w.log]
    assert sent == [e for _, e in SCRIPT]


def replay(role, log, cuts=()):
    """Feed the peer's byte stream to a fresh ``role`` connection cut at ``cuts`` (plus
    wherever this side must send something first); return the events received."""
    me = "C" if role is Role.CLIENT else "S"
    stream, sends_at = b"", defaultdict(list)
    for side, event, data in log:
        if side == me:
            sends_at[len(stream)].append(event)
        else:
            stream += data
    conn = Connection(role)
    got, pos = [], 0
    for cut in sorted(set(cuts) | set(sends_at) | {len(stream)}):
        if cut > pos:
            got += conn.receive_data(stream[pos:cut])
            pos = cut
        for event in sends_at.pop(cut, []):
            conn.send(event)
    got += conn.receive_data(b"")
    return got, len(stream)


def expected(role, log):
    peer = "S" if role is Role.CLIENT else "C"
    # clean on both sides: the client sent CLOSE, the server received it
    return [e for side, e, _ in log if side == peer] + [ConnectionClosed(clean=True)]


@pytest.mark.parametrize("role", [Role.CLIENT, Role.SERVER])
def test_split_at_every_offset(role):
    log = Wire().run(SCRIPT).log
    want = expected(role, log)
    _, n = replay(role, log)
    for i in range(n + 1):
        assert replay(role, log, [i])[0] == want, i


@pytest.mark.parametrize("role", [Role.CLIENT, Role.SERVER])
def test_byte_at_a_time(role):
    log = Wire().run(SCRIPT).log
    _, n = replay(role, log)
    assert replay(role, log, range(n))[0] == expected(role, log)


@FUZZ
@given(role=st.sampled_from([Role.CLIENT, Role.SERVER]),
       fractions=st.lists(st.floats(0, 1), max_size=40))
def test_split_at_random_offsets(role, fractions):
    log = Wire().run(SCRIPT).log
    _, n = replay(role, log)
    assert replay(role, log, [int(f * n) for f in fractions])[0] == expected(role, log)


def test_version_negotiation_picks_highest_common():
    w = Wire(client={"versions": (1, 2, 3)}, server={"versions": (4, 3, 2)})
    w.c2s(Hello(versions=(1, 2, 3), client="c"))
    with pytest.raises(LocalProtocolError, match="highest common"):
        w.s.send(Welcome(version=2, server="s", max_frame=1 << 20))
    w.s2c(Welcome(version=3, server="s", max_frame=1 << 20))
    assert w.c.version == w.s.version == 3


def test_version_mismatch_is_reported_clearly():
    c = Connection(Role.CLIENT, versions=(1, 2))
    s = Connection(Role.SERVER, versions=(3,))
    with pytest.raises(RemoteProtocolError, match=r"no common protocol version.*\[1, 2\].*\[3\]"):
        s.receive_data(c.send(Hello(versions=(1, 2), client="c")))
    assert s.state is State.ERROR
    reply = c.receive_data(s.error_frame())
    assert reply[0] == Error("protocol", str(s.error), fatal=True)
    assert c.state is State.CLOSED


def test_cancel_crossing_the_answer_on_the_wire():
    w = Wire().opened()
    w.c2s(Request(7, 0))
    answer = [w.s.send(e) for e in (ChunkBegin(7, 0, 1, 1), ChunkPart(7, 0, b"x"),
                                    ChunkEnd(7))]
    assert w.s.outstanding == ()
    cancel = w.c.send(Cancel(7))           # the client has not seen the answer yet
    assert w.s.receive_data(cancel) == [Cancel(7)]   # nothing to cancel: ignored
    assert w.s.outstanding == () and w.s.state is State.READY
    got = w.c.receive_data(b"".join(answer))
    assert got[-1] == ChunkEnd(7, cancelled=False) and w.c.outstanding == ()
    w.c2s(Request(7, 0))                   # and it may be requested again


def test_in_progress_cancelled_chunk_may_still_complete():
    w = Wire().opened()
    w.c2s(Request(1, 0))
    w.s2c(ChunkBegin(1, 0, 2, 2))
    w.c2s(Cancel(1))
    w.s2c(ChunkPart(1, 0, b"a"))
    w.s2c(ChunkPart(1, 1, b"b"))
    w.s2c(ChunkEnd(1, cancelled=False))
    assert w.c.outstanding == w.s.outstanding == ()


def test_head_cancelled_names_only_the_head_and_ends_with_its_answer():
    """What a server asks before beginning a chunk and between its parts: a CANCEL counts
    for the request being answered (the head) only, and no longer once it is answered,
    however it ended (so a CANCEL that came too late cannot reach the next REQUEST)."""
    w = Wire().opened()
    w.c2s(Request(1, 0))
    w.c2s(Request(2, 0))
    w.c2s(Cancel(2))
    assert not w.s.head_cancelled(1) and not w.s.head_cancelled(2)   # 2 is not the head yet
    w.s2c(ChunkBegin(1, 0, 2, 2))
    w.s2c(ChunkPart(1, 0, b"a"))
    w.s2c(ChunkPart(1, 1, b"b"))
    w.c2s(Cancel(1))                       # while the last part drains: too late to stop
    assert w.s.head_cancelled(1) and not w.s.head_cancelled(2)
    w.s2c(ChunkEnd(1, cancelled=False))
    assert not w.s.head_cancelled(1) and w.s.head_cancelled(2)
    w.c2s(Request(1, 0))                   # requested again: not cancelled
    assert not w.s.head_cancelled(1)
    w.s2c(ChunkEnd(2, cancelled=True))
    assert not w.s.head_cancelled(1)
    w.c2s(Cancel(1))
    assert w.s.head_cancelled(1)
    w.s2c(Error("internal", "disk read failed", fatal=False))   # an ERROR ends it too
    w.c2s(Request(1, 0))
    assert not w.s.head_cancelled(1) and not w.s.head_cancelled(2)
    assert [(p.request, p.cancelled) for p in w.s.outstanding] == [(Request(1, 0), False)]


def test_error_aborts_chunk_in_progress():
    w = Wire().opened()
    w.c2s(Request(1, 0))
    w.c2s(Request(2, 0))
    w.s2c(ChunkBegin(1, 0, 10, 2))
    w.s2c(Error("internal", "disk read failed", fatal=False))
    assert w.c.chunk_in_progress is None
    assert w.c.outstanding == w.s.outstanding == (Pending(Request(2, 0)),)
    w.s2c(ChunkBegin(2, 0, 0, 1))


def test_close_with_frames_in_flight_and_simultaneous_close():
    w = Wire().opened()
    w.c2s(Request(1, 0))
    w.s2c(ChunkBegin(1, 0, 2, 2))
    in_flight = w.s.send(ChunkPart(1, 0, b"a")) + w.s.send(Close())
    w.s.receive_data(w.c.send(Close()))        # crosses the server's CLOSE
    assert w.c.state is State.CLOSING
    assert w.c.receive_data(in_flight) == [ChunkPart(1, 0, b"a"), Close()]
    assert w.c.state is State.CLOSED and w.s.state is State.CLOSED
    with pytest.raises(LocalProtocolError):
        w.s.send(ChunkPart(1, 1, b"b"))


def test_fatal_error_closes_both_sides():
    w = Wire().opened()
    w.s2c(Error("auth", "bye", fatal=True))
    assert w.c.state is State.CLOSED and w.s.state is State.CLOSED
    assert w.c.receive_data(b"") == [ConnectionClosed(clean=True)]
    with pytest.raises(LocalProtocolError):
        w.c.send(Request(0, 0))


def test_fatal_error_allowed_during_handshake():
    w = Wire()
    w.c2s(Hello((1,), "c"))
    w.s2c(Error("auth", "who are you", fatal=True))
    assert w.c.state is State.CLOSED


def test_unclean_eof_keeps_outstanding_visible():
    w = Wire().opened()
    w.c2s(Request(1, 0))
    assert w.c.receive_data(b"") == [ConnectionClosed(clean=False)]
    assert w.c.state is State.CLOSED and w.c.outstanding == (Pending(Request(1, 0)),)


def test_send_parts_does_not_copy_payload():
    w = Wire().opened()
    w.c2s(Request(1, 0))
    w.s2c(ChunkBegin(1, 0, 3 + 1000, 2))
    blob = b"abc"
    pieces = w.s.send_parts(ChunkPart(1, 0, blob))
    assert len(pieces) == 2 and pieces[1] is blob
    assert w.c.receive_data(b"".join(pieces)) == [ChunkPart(1, 0, blob)]
    big = bytearray(1000)
    pieces = w.s.send_parts(ChunkPart(1, 1, memoryview(big)))
    assert isinstance(pieces[1], memoryview) and pieces[1].obj is big
    big[0] = 7                                  # a view, not a copy
    got = w.c.receive_data(b"".join(pieces))
    assert got == [ChunkPart(1, 1, bytes(big))] and type(got[0].data) is bytes
    assert w.c.chunk_in_progress.bytes_seen == 1003


def test_non_byte_memoryview_is_sent_as_raw_bytes():
    w = Wire().opened()
    w.c2s(Request(1, 0))
    w.s2c(ChunkBegin(1, 0, 8, 1))
    mv = memoryview(bytearray(b"\x01\x00\x00\x00\x02\x00\x00\x00")).cast("I")
    got = w.c.receive_data(b"".join(w.s.send_parts(ChunkPart(1, 0, mv))))
    assert got[0].data == b"\x01\x00\x00\x00\x02\x00\x00\x00"
    w.s2c(ChunkEnd(1))


def test_big_frame_in_small_pieces_is_linear():
    w = Wire(client={"max_frame": 8 << 20}, server={"max_frame": 8 << 20})
    w.c2s(Hello((1,), "c"))
    w.s2c(Welcome(1, "s", 8 << 20))
    w.c2s(Open("x", None))
    data = w.s.send(ManifestData(bytes(range(256)) * (6 << 12)))   # 6 MiB
    t0 = time.perf_counter()
    got = []
    for i in range(0, len(data), 1024):            # 6144 pieces of 1 KiB
        got += w.c.receive_data(data[i:i + 1024])
    elapsed = time.perf_counter() - t0
    assert len(got) == 1 and len(got[0].data) == 6 << 20
    assert elapsed < 2.0, f"{elapsed:.2f}s: receive buffer is copying quadratically"


# ----------------------------------------------------------------------------- remote errors
def server_fresh():
    return Connection(Role.SERVER)


def server_ready():
    return Wire().handshake().s


def server_open():
    w = Wire().opened()
    w.c2s(Request(5, 1))
    return w.s


def client_started():
    c = Connection(Role.CLIENT)
    c.send(Hello((1,), "c"))
    return c


def client_ready():
    return Wire().handshake().c


def client_requested():
    """Client with an open context and requests 1 (level 0), 2 (text), 3 (cancelled)."""
    w = Wire().opened()
    w.c2s(GetProfile(PID))
    w.s2c(ProfileData(PID, b"p"))
    for r in (Request(1, 0), Request(2, "text"), Request(3, 0)):
        w.c2s(r)
    w.c2s(Cancel(3))
    return w.c


def client_streaming():
    """Client with chunk 1 in progress: 5 bytes in 3 parts, part 0 (2 bytes) received."""
    c = client_requested()
    c.receive_data(raw(FrameType.CHUNK_BEGIN, {"chunk": 1, "level": 0, "bytes": 5,
                                               "parts": 3}) + part(1, 0, b"ab"))
    return c


def client_after_close():
    w = Wire().handshake()
    w.s2c(Close())
    return w.c


HELLO_OK = {"magic": "kvwire", "versions": [1], "client": "c"}
NO_AUTH = {"auth": "none", "nonce": ""}
BEGIN = FrameType.CHUNK_BEGIN

BAD_INPUT = {
    # framing
    "bad magic": (server_fresh, raw(FrameType.HELLO, {**HELLO_OK, "magic": "kvwirf"})),
    "unknown frame type": (server_ready, raw(99, b"")),
    "frame type zero": (server_ready, raw(0, b"")),
    "nonzero flags": (server_ready, raw(FrameType.CLOSE, {}, flags=1)),
    "oversize data header": (client_requested,
                             raw(FrameType.MANIFEST, length=DEFAULT_MAX_FRAME + 1)),
    "oversize control header": (server_ready,
                                raw(FrameType.OPEN, length=MAX_CONTROL_PAYLOAD + 1)),
    "eof mid header": (server_ready, b"\x01\x00"),
    "eof mid payload": (server_ready, raw(FrameType.OPEN, length=10) + b"{}"),
    # JSON
    "truncated json": (server_fresh, raw(FrameType.HELLO, b'{"magic":')),
    "not utf8": (server_fresh, raw(FrameType.HELLO, b'{"client": "\xff"}')),
    "json array": (server_fresh, raw(FrameType.HELLO, b"[1, 2]")),
    "json NaN": (server_open, raw(FrameType.OPEN, b'{"context_id": "x", "slo": NaN}')),
    "json overflow to inf": (server_open, raw(FrameType.OPEN,
                                              b'{"context_id": "x", "slo": 1e999}')),
    "duplicate key": (server_ready, raw(FrameType.CANCEL, b'{"chunk": 1, "chunk": 2}')),
    "utf8 bom": (server_ready, raw(FrameType.CLOSE, b"\xef\xbb\xbf{}")),
    "deep nesting": (server_ready, raw(FrameType.CLOSE, b"[" * 60000)),
    "huge int": (server_open, raw(FrameType.CANCEL, b'{"chunk": ' + b"9" * 5000 + b"}")),
    "lone surrogate": (server_fresh, raw(FrameType.HELLO,
                                         b'{"magic":"kvwire","versions":[1],"client":"\\ud800"}')),
    # schema
    "missing key": (server_fresh, raw(FrameType.HELLO, {"magic": "kvwire", "versions": [1]})),
    "unknown key": (server_fresh, raw(FrameType.HELLO, {**HELLO_OK, "x": 1})),
    "version zero": (server_fresh, raw(FrameType.HELLO, {**HELLO_OK, "versions": [0]})),
    "no versions": (server_fresh, raw(FrameType.HELLO, {**HELLO_OK, "versions": []})),
    "duplicate versions": (server_fresh, raw(FrameType.HELLO, {**HELLO_OK, "versions": [1, 1]})),
    "chunk as string": (server_open, raw(FrameType.REQUEST, {"chunk": "1", "level": 0})),
    "chunk as bool": (server_open, raw(FrameType.REQUEST, {"chunk": True, "level": 0})),
    "chunk as float": (server_open, raw(FrameType.REQUEST, {"chunk": 1.0, "level": 0})),
    "negative level": (server_open, raw(FrameType.REQUEST, {"chunk": 1, "level": -1})),
    "level TEXT": (server_open, raw(FrameType.REQUEST, {"chunk": 1, "level": "TEXT"})),
    "chunk over u32": (server_open, raw(FrameType.REQUEST, {"chunk": 2 ** 32, "level": 0})),
    "slo string": (server_ready, raw(FrameType.OPEN, {"context_id": "x", "slo": "1"})),
    "empty context id": (server_ready, raw(FrameType.OPEN, {"context_id": "", "slo": None})),
    "upper-case profile id": (server_ready, raw(FrameType.GET_PROFILE,
                                                {"profile_id": PID.upper()})),
    "short profile id": (server_ready, raw(FrameType.GET_PROFILE, {"profile_id": "abc"})),
    "bad error code": (client_requested, raw(FrameType.ERROR, {"code": "oops", "message": "",
                                                               "fatal": False})),
    "fatal as int": (client_requested, raw(FrameType.ERROR, {"code": "internal",
                                                             "message": "", "fatal": 0})),
    "close with keys": (server_ready, raw(FrameType.CLOSE, {"now": True})),
    "zero parts": (client_requested, raw(BEGIN, {"chunk": 1, "level": 0, "bytes": 0,
                                                 "parts": 0})),
    "welcome max_frame too small": (client_started, raw(FrameType.WELCOME, {
        "version": 1, "server": "s", "max_frame": 1024, **NO_AUTH})),
    # handshake / state
    "welcome version not offered": (client_started, raw(FrameType.WELCOME, {
        "version": 2, "server": "s", "max_frame": 1 << 20, **NO_AUTH})),
    "open before handshake": (server_fresh, raw(FrameType.OPEN, {"context_id": "x",
                                                                 "slo": None})),
    "open before welcome sent": (lambda: _server_hello_only(), raw(
        FrameType.OPEN, {"context_id": "x", "slo": None})),
    "frame before hello sent": (lambda: Connection(Role.CLIENT), raw(FrameType.WELCOME, {
        "version": 1, "server": "s", "max_frame": 1 << 20, **NO_AUTH})),
    "second hello": (server_ready, raw(FrameType.HELLO, HELLO_OK)),
    "request before manifest": (server_ready, raw(FrameType.REQUEST, {"chunk": 0,
                                                                      "level": 0})),
    "duplicate request": (server_open, raw(FrameType.REQUEST, {"chunk": 5, "level": 0})),
    "double cancel": (server_open, raw(FrameType.CANCEL, {"chunk": 5}) * 2),
    "non-fatal error from client": (server_open, raw(FrameType.ERROR, {
        "code": "internal", "message": "", "fatal": False})),
    "server-only frame from client": (server_open, raw(FrameType.MANIFEST, b"m")),
    "client-only frame from server": (client_requested, raw(FrameType.REQUEST,
                                                            {"chunk": 9, "level": 0})),
    "frame after close": (client_after_close, raw(FrameType.CLOSE, {})),
    "data after close": (client_after_close, raw(FrameType.MANIFEST, b"m")),
    "frame after fatal error": (client_requested, raw(FrameType.ERROR, {
        "code": "internal", "message": "", "fatal": True}) + raw(FrameType.CLOSE, {})),
    # answers
    "unsolicited manifest": (client_ready, raw(FrameType.MANIFEST, b"m")),
    "unsolicited error": (client_ready, raw(FrameType.ERROR, {
        "code": "internal", "message": "", "fatal": False})),
    "manifest out of fifo order": (client_requested, raw(FrameType.MANIFEST, b"m")),
    "profile id mismatch": (lambda: _client_wants_profile(), raw(
        FrameType.PROFILE, b"fedcba9876543210" + b"p")),
    "profile payload short": (lambda: _client_wants_profile(), raw(FrameType.PROFILE, b"01")),
    "profile id not hex": (lambda: _client_wants_profile(), raw(
        FrameType.PROFILE, b"0123456789abcdeg" + b"p")),
    "begin wrong chunk": (client_requested, raw(BEGIN, {"chunk": 2, "level": 0, "bytes": 1,
                                                        "parts": 1})),
    "begin wrong level": (client_requested, raw(BEGIN, {"chunk": 1, "level": 1, "bytes": 1,
                                                        "parts": 1})),
    "text for kv request": (client_requested, raw(FrameType.TEXT, b"\x01\x00\x00\x00t")),
    "text payload short": (client_requested, raw(FrameType.TEXT, b"\x01\x00")),
    "part before begin": (client_requested, part(1, 0, b"x")),
    "part out of order": (client_streaming, part(1, 2, b"c")),
    "part repeated": (client_streaming, part(1, 0, b"c")),
    "part for wrong chunk": (client_streaming, part(2, 1, b"c")),
    "part reserved nonzero": (client_streaming, part(1, 1, b"c", reserved=1)),
    "part header short": (client_streaming, raw(FrameType.CHUNK_PART, b"\x01\x00\x00")),
    "part bytes overflow": (client_streaming, part(1, 1, b"cdef")),
    "too many parts": (client_streaming, part(1, 1, b"c") + part(1, 2, b"d")
                       + part(1, 3, b"")),
    "end with bytes short": (client_streaming, part(1, 1, b"c") + part(1, 2, b"")
                             + raw(FrameType.CHUNK_END, {"chunk": 1, "cancelled": False})),
    "end with parts missing": (client_streaming, part(1, 1, b"cde") + raw(
        FrameType.CHUNK_END, {"chunk": 1, "cancelled": False})),
    "end for wrong chunk": (client_streaming, raw(FrameType.CHUNK_END, {
        "chunk": 2, "cancelled": True})),
    "begin while in progress": (client_streaming, raw(BEGIN, {"chunk": 1, "level": 0,
                                                              "bytes": 1, "parts": 1})),
    "text while in progress": (client_streaming, raw(FrameType.TEXT, b"\x02\x00\x00\x00t")),
    "end without begin": (client_requested, raw(FrameType.CHUNK_END, {
        "chunk": 1, "cancelled": False})),
    "cancelled end not cancelled": (client_requested, raw(FrameType.CHUNK_END, {
        "chunk": 1, "cancelled": True})),
}


def _server_hello_only():
    s = Connection(Role.SERVER)
    s.receive_data(raw(FrameType.HELLO, HELLO_OK))
    return s


def _client_wants_profile():
    w = Wire().handshake()
    w.c2s(GetProfile(PID))
    return w.c


@pytest.mark.parametrize("name", list(BAD_INPUT))
def test_malformed_input_raises_remote_protocol_error(name):
    make, data = BAD_INPUT[name]
    conn = make()
    with pytest.raises(RemoteProtocolError) as info:
        conn.receive_data(data)
        conn.receive_data(b"")            # the EOF cases
    assert conn.state is State.ERROR and conn.error is info.value
    assert info.value.code == "protocol" and "internal error" not in str(info.value)
    with pytest.raises(RemoteProtocolError):   # stays broken
        conn.receive_data(b"")
    with pytest.raises(LocalProtocolError):
        conn.send(Close())
    frame = conn.error_frame()
    length, ftype, flags = struct.unpack_from("<IHH", frame)
    assert (ftype, flags, length) == (FrameType.ERROR, 0, len(frame) - 8)
    assert frames.decode(FrameType.ERROR, memoryview(frame)[8:]) == Error(
        "protocol", str(info.value), fatal=True)
    with pytest.raises(LocalProtocolError):    # once
        conn.error_frame()


def test_oversize_header_fails_before_payload_arrives():
    c = client_requested()
    with pytest.raises(RemoteProtocolError, match="limit"):
        c.receive_data(struct.pack("<IHH", DEFAULT_MAX_FRAME + 1, FrameType.MANIFEST, 0))


def test_events_before_a_bad_frame_are_kept_on_the_error():
    c = client_requested()
    data = raw(BEGIN, {"chunk": 1, "level": 0, "bytes": 1, "parts": 1}) + part(1, 5, b"x")
    with pytest.raises(RemoteProtocolError, match="out of order") as info:
        c.receive_data(data)
    assert info.value.events == [ChunkBegin(1, 0, 1, 1)]


def test_error_frame_only_in_error_state():
    with pytest.raises(LocalProtocolError):
        Connection(Role.SERVER).error_frame()


def test_error_frame_truncates_long_messages():
    s = Connection(Role.SERVER)
    with pytest.raises(RemoteProtocolError) as info:
        s.receive_data(raw(FrameType.HELLO, {**HELLO_OK, "x" * 60000: 1}))
    frame = s.error_frame()
    assert len(frame) <= 8 + MAX_CONTROL_PAYLOAD
    assert str(info.value).startswith(frames.decode(
        FrameType.ERROR, memoryview(frame)[8:]).message)


# ----------------------------------------------------------------------------- local errors
def _server_open_w():
    w = Wire().opened()
    w.c2s(Request(1, 0))
    w.c2s(Request(2, 0))
    w.c2s(Cancel(2))
    return w


LOCAL_MISUSE = {
    "client open before hello": (lambda: Connection(Role.CLIENT), Open("x", None)),
    "client open before welcome": (client_started, Open("x", None)),
    "client second hello": (client_ready, Hello((1,), "c")),
    "client hello with unsupported version": (lambda: Connection(Role.CLIENT),
                                              Hello((1, max(SUPPORTED_VERSIONS) + 1), "c")),
    "client request before manifest": (client_ready, Request(0, 0)),
    "client duplicate request": (client_requested, Request(1, 1)),
    "client cancel unknown chunk": (client_requested, Cancel(9)),
    "client double cancel": (client_requested, Cancel(3)),
    "client sends server frame": (client_requested, ManifestData(b"m")),
    "client non-fatal error": (client_requested, Error("internal", "x", fatal=False)),
    "client request after close": (lambda: _closing_client(), Request(1, 0)),
    "client close after close": (lambda: _closing_client(), Close()),
    "client bad chunk": (client_requested, Request(-1, 0)),
    "client bool chunk": (client_requested, Request(True, 0)),
    "client bad level": (client_requested, Request(7, "TEXT")),
    "client nan slo": (client_ready, Open("x", float("nan"))),
    "client empty context": (client_ready, Open("", None)),
    "client bad profile id": (client_ready, GetProfile("0123456789ABCDEF")),
    "client bad error code": (client_ready, Error("nope", "", fatal=True)),
    "client oversize control": (client_ready, Open("x" * 70000, None)),
    "not an event": (client_ready, "hello"),
    "server manifest before hello": (server_fresh, ManifestData(b"m")),
    "server manifest before welcome": (_server_hello_only, ManifestData(b"m")),
    "server welcome wrong version": (_server_hello_only, Welcome(2, "s", 1 << 20)),
    "server welcome max_frame above own": (_server_hello_only,
                                           Welcome(1, "s", DEFAULT_MAX_FRAME + 1)),
    "server part before begin": (lambda: _server_open_w().s, ChunkPart(1, 0, b"x")),
    "server begin wrong chunk": (lambda: _server_open_w().s, ChunkBegin(2, 0, 1, 1)),
    "server begin cancelled request": (lambda: _begun_then(ChunkEnd(1)), ChunkBegin(2, 0, 1, 1)),
    "server text for kv": (lambda: _server_open_w().s, Text(1, b"t")),
    "server cancels on its own": (lambda: _server_open_w().s, ChunkEnd(1, cancelled=True)),
    "server end too early": (lambda: _begun_then(), ChunkEnd(1)),
    "server part out of order": (lambda: _begun_then(), ChunkPart(1, 1, b"x")),
    "server part too big": (lambda: _begun_then(), ChunkPart(1, 0, b"xyz")),
    "server part index over u16": (lambda: _begun_then(), ChunkPart(1, 70000, b"x")),
    "server payload over send limit": (lambda: _server_open_w().s, ManifestData(bytes(1 << 20))),
    "server non-byte data": (lambda: _server_open_w().s, ManifestData("text")),
    "server non-contiguous data": (lambda: _server_open_w().s,
                                   ManifestData(memoryview(b"abcdef")[::2])),
    "server request": (lambda: _server_open_w().s, Request(1, 0)),
}


def _closing_client():
    c = client_ready()
    c.send(Close())
    return c


def _begun_then(*events):
    w = _server_open_w()
    w.s.send(ChunkBegin(1, 0, 2, 2))
    if events:
        w.s.send(ChunkPart(1, 0, b"a"))
        w.s.send(ChunkPart(1, 1, b"b"))
        for e in events:
            w.s.send(e)
    return w.s


@pytest.mark.parametrize("name", list(LOCAL_MISUSE))
def test_local_misuse_raises_local_protocol_error(name):
    make, event = LOCAL_MISUSE[name]
    conn = make()
    before = (conn.state, conn.outstanding, conn.chunk_in_progress, conn.context_id)
    with pytest.raises(LocalProtocolError):
        conn.send_parts(event)
    assert (conn.state, conn.outstanding, conn.chunk_in_progress, conn.context_id) == before


def test_local_error_is_not_remote_and_vice_versa():
    assert issubclass(LocalProtocolError, ProtocolError)
    assert issubclass(RemoteProtocolError, ProtocolError)
    assert not issubclass(LocalProtocolError, RemoteProtocolError)


def test_receive_after_eof_is_local_misuse():
    c = client_ready()
    c.receive_data(b"")
    with pytest.raises(LocalProtocolError):
        c.receive_data(b"x")


@pytest.mark.parametrize("kw", [{"max_frame": 1000}, {"max_frame": 2 ** 32},
                                {"versions": ()}, {"versions": (0,)}, {"versions": (1, 1)}])
def test_constructor_validation(kw):
    with pytest.raises(ValueError):
        Connection(Role.CLIENT, **kw)


def test_table_is_the_only_source_of_legality():
    # every key names a real role/state/direction; ERROR is a dead end
    assert not any(state is State.ERROR for _, state, _, _ in TRANSITIONS)
    assert not any(new is State.ERROR for new in TRANSITIONS.values())
    assert (Role.CLIENT, State.READY, Direction.SEND, FrameType.REQUEST) in TRANSITIONS
    assert (Role.SERVER, State.READY, Direction.SEND, FrameType.REQUEST) not in TRANSITIONS


# ----------------------------------------------------------------------------- fuzz
_TOKEN = "fuzz-token-0123456789"


def server_awaiting_auth():
    from streamer.wire.auth import new_nonce
    s = Connection(Role.SERVER, auth_token=_TOKEN)
    s.receive_data(raw(FrameType.HELLO, HELLO_OK))
    s.send(Welcome(1, "s", 1 << 20, auth="required", nonce=new_nonce()))
    return s


def client_awaiting_auth_ok():
    c = Connection(Role.CLIENT, auth_token=_TOKEN)
    c.send(Hello((1,), "c"))
    c.receive_data(raw(FrameType.WELCOME, {"version": 1, "server": "s", "max_frame": 1 << 20,
                                           "auth": "required", "nonce": "ab" * 32}))
    c.send(c.auth_event())
    return c


FUZZ_TARGETS = {
    "server awaiting auth": server_awaiting_auth,
    "client awaiting auth ok": client_awaiting_auth_ok,
    "server after handshake": server_ready,
    "server with context": server_open,
    "client after handshake": client_ready,
    "client with requests": client_requested,
    "client mid chunk": client_streaming,
}


@FUZZ
@given(target=st.sampled_from(sorted(FUZZ_TARGETS)), blobs=st.lists(st.binary(min_size=1, max_size=64),
                                                                      max_size=8))
def test_fuzz_random_bytes_only_raise_protocol_error(target, blobs):
    conn = FUZZ_TARGETS[target]()
    try:
        for blob in blobs + [b""]:
            conn.receive_data(blob)
    except RemoteProtocolError as exc:
        assert conn.state is State.ERROR
        assert "internal error" not in str(exc)   # not a bug caught by the safety net


_KEYS = sorted({k for schema in frames.SCHEMAS.values() for k in schema})
_json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-2, 2 ** 33),
                         st.floats(allow_nan=False), st.text(max_size=20),
                         st.sampled_from(["text", "kvwire", PID, "internal"]))
_json = st.recursive(_json_scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=6)


@st.composite
def _frames(draw):
    ftype = draw(st.integers(0, 15))
    if draw(st.booleans()) and ftype in set(frames.CONTROL_TYPES):
        keys = draw(st.lists(st.sampled_from(_KEYS), max_size=5, unique=True))
        payload = json.dumps({k: draw(_json) for k in keys}).encode()
    elif ftype == FrameType.CHUNK_PART and draw(st.booleans()):
        payload = struct.pack("<IHH", draw(st.integers(0, 6)), draw(st.integers(0, 4)),
                              0) + draw(st.binary(max_size=8))
    else:
        payload = draw(st.binary(max_size=32))
    flags = draw(st.sampled_from([0, 0, 0, 1]))
    length = len(payload) if draw(st.integers(0, 9)) else draw(st.integers(0, 2 ** 32 - 1))
    return struct.pack("<IHH", length, ftype, flags) + payload


@FUZZ
@given(target=st.sampled_from(sorted(FUZZ_TARGETS)), fs=st.lists(_frames(), max_size=10))
def test_fuzz_structured_frames_only_raise_protocol_error(target, fs):
    conn = FUZZ_TARGETS[target]()
    try:
        conn.receive_data(b"".join(fs))
        conn.receive_data(b"")
    except RemoteProtocolError as exc:
        assert conn.state is State.ERROR
        assert "internal error" not in str(exc)
        with pytest.raises(RemoteProtocolError):
            conn.receive_data(b"x")
