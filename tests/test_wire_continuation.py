"""Protocol version 2's continuation: REQUEST and CHUNK_BEGIN name a ``first_layer``.

Driven with bytes only, both sides, both versions: a version 2 connection carries a
continuation and its answer; a version 1 connection (an old peer) is byte-for-byte what
it was and refuses a continuation on either side; a text continuation is refused on any
version; the frame schema bounds the field and gives every event one encoding; the
manifest bounds it by the context's layers.
"""
from __future__ import annotations

import json
import struct

import pytest

from streamer.wire import frames
from streamer.wire.manifest import ChunkInfo, Manifest
from streamer.wire.protocol import (CONTINUATION_VERSION, SUPPORTED_VERSIONS, Cancel, ChunkBegin, ChunkEnd,
                                    ChunkPart, Close, Connection, Error, FrameType, GetProfile, Hello,
                                    LocalProtocolError, ManifestData, Open, Pending, ProfileData,
                                    RemoteProtocolError, Request, Role, State, Text, Welcome)

PID = "0123456789abcdef"


def raw(ftype: FrameType, obj: dict) -> bytes:
    payload = json.dumps(obj).encode()
    return struct.pack("<IHH", len(payload), int(ftype), 0) + payload


def payload(event) -> dict:
    """The JSON object a control event is sent as."""
    _, pieces, _ = frames.encode(event)
    return json.loads(bytes(pieces[0])[frames.HEADER.size:])


class Pair:
    """A client and a server back to back, each speaking ``versions``; the handshake done
    and a context open."""

    def __init__(self, client_versions=SUPPORTED_VERSIONS, server_versions=SUPPORTED_VERSIONS) -> None:
        self.c = Connection(Role.CLIENT, versions=client_versions)
        self.s = Connection(Role.SERVER, versions=server_versions)
        self.wire: list[bytes] = []
        self.c2s(Hello(versions=tuple(client_versions), client="recv"))
        common = max(set(client_versions) & set(server_versions))
        self.s2c(Welcome(version=common, server="send", max_frame=1 << 20))
        self.c2s(Open("ctx", None))
        self.s2c(ManifestData(b"M"))

    def c2s(self, event):
        data = self.c.send(event)
        self.wire.append(data)
        assert self.s.receive_data(data) == [event]

    def s2c(self, event):
        data = self.s.send(event)
        self.wire.append(data)
        assert self.c.receive_data(data) == [event]


def snapshot(conn: Connection):
    return conn.state, conn.outstanding, conn.chunk_in_progress, conn.context_id


# ----------------------------------------------------------------------------- negotiation
@pytest.mark.parametrize("client, server, version", [
    (SUPPORTED_VERSIONS, SUPPORTED_VERSIONS, 3), ((1, 2), SUPPORTED_VERSIONS, 2), ((1,), SUPPORTED_VERSIONS, 1),
    (SUPPORTED_VERSIONS, (1,), 1), (SUPPORTED_VERSIONS, (1, 2), 2)])
def test_both_sides_negotiate_the_highest_common_version(client, server, version) -> None:
    assert SUPPORTED_VERSIONS == (1, 2, 3) and CONTINUATION_VERSION == 2
    pair = Pair(client, server)
    assert pair.c.version == pair.s.version == version
    assert pair.c.continuations is pair.s.continuations is (version >= 2)


def test_no_continuations_before_the_handshake() -> None:
    assert Connection(Role.CLIENT).continuations is False
    assert Connection(Role.SERVER).continuations is False


# ----------------------------------------------------------------------------- frames
def test_first_layer_is_sent_only_when_not_zero() -> None:
    assert payload(Request(3, 1)) == {"chunk": 3, "level": 1}
    assert payload(Request(3, 1, first_layer=2)) == {"chunk": 3, "level": 1, "first_layer": 2}
    assert payload(ChunkBegin(3, 1, 10, 2)) == {"chunk": 3, "level": 1, "bytes": 10, "parts": 2}
    assert payload(ChunkBegin(3, 1, 10, 2, first_layer=frames.MAX_FIRST_LAYER))["first_layer"] == 0xFFFE
    # a whole-chunk REQUEST is the same bytes a version 1 peer sends and expects
    v1 = b'{"chunk":3,"level":1}'
    assert frames.encode(Request(3, 1))[1][0] == struct.pack("<IHH", len(v1), 7, 0) + v1


@pytest.mark.parametrize("event", [Request(1, 0, first_layer=5), Request(0, 7, first_layer=frames.MAX_FIRST_LAYER),
                                   ChunkBegin(1, 0, 99, 3, first_layer=1), ChunkBegin(1, 0, 0, 1)])
def test_first_layer_round_trips_exactly(event) -> None:
    ftype, pieces, _ = frames.encode(event)
    buf = frames.FrameBuffer(1 << 20)
    buf.feed(b"".join(bytes(p) for p in pieces))
    assert buf.next_frame(frames.decode) == event


@pytest.mark.parametrize("ftype", [FrameType.REQUEST, FrameType.CHUNK_BEGIN])
@pytest.mark.parametrize("value", [0, -1, frames.MAX_FIRST_LAYER + 1, 2 ** 32, True, 1.0, "1", None, [1]])
def test_decoding_refuses_a_bad_first_layer(ftype: FrameType, value) -> None:
    base = {"chunk": 1, "level": 0} if ftype is FrameType.REQUEST else {"chunk": 1, "level": 0, "bytes": 5, "parts": 1}
    data = raw(ftype, {**base, "first_layer": value})
    buf = frames.FrameBuffer(1 << 20)
    buf.feed(data)
    with pytest.raises(RemoteProtocolError, match="first_layer"):
        buf.next_frame(frames.decode)


@pytest.mark.parametrize("value", [-1, frames.MAX_FIRST_LAYER + 1, True, False, 1.0, 0.0, "1"])
def test_sending_a_bad_first_layer_is_local_misuse(value) -> None:
    pair = Pair()
    before = snapshot(pair.c)
    with pytest.raises(LocalProtocolError, match="first_layer"):
        pair.c.send(Request(1, 0, first_layer=value))
    assert snapshot(pair.c) == before


# ----------------------------------------------------------------------------- version 2
def test_a_continuation_and_its_answer_on_version_2() -> None:
    pair = Pair()
    pair.c2s(Request(1, 2, first_layer=3))
    pair.c2s(Request(2, 0))
    assert pair.c.outstanding == pair.s.outstanding == (Pending(Request(1, 2, first_layer=3)),
                                                        Pending(Request(2, 0)))
    pair.s2c(ChunkBegin(1, 2, total_bytes=7, parts=2, first_layer=3))
    assert pair.c.chunk_in_progress == pair.s.chunk_in_progress
    assert pair.c.chunk_in_progress.first_layer == 3
    pair.s2c(ChunkPart(1, 0, b"hdr"))
    pair.s2c(ChunkPart(1, 1, b"sect"))
    pair.s2c(ChunkEnd(1))
    pair.s2c(ChunkBegin(2, 0, total_bytes=1, parts=1))
    assert pair.c.chunk_in_progress.first_layer == 0
    pair.s2c(ChunkPart(2, 0, b"x"))
    pair.s2c(ChunkEnd(2))
    assert pair.c.outstanding == pair.s.outstanding == ()
    # the same chunk again from another layer once the first answer is done
    pair.c2s(Request(1, 4, first_layer=1))
    pair.s2c(Error("bad_request", "first layer out of range", fatal=False))
    assert pair.c.outstanding == () and pair.c.state is State.READY


def test_a_continuation_is_cancelled_like_any_request() -> None:
    pair = Pair()
    pair.c2s(Request(1, 2, first_layer=3))
    pair.c2s(Cancel(1))
    assert pair.s.head_cancelled(1)
    pair.s2c(ChunkEnd(1, cancelled=True))
    assert pair.c.outstanding == ()


def test_one_request_per_chunk_holds_for_continuations() -> None:
    pair = Pair()
    pair.c2s(Request(1, 0))
    before = snapshot(pair.c)
    with pytest.raises(LocalProtocolError, match="while REQUEST chunk 1 level 0 is outstanding"):
        pair.c.send(Request(1, 2, first_layer=1))
    assert snapshot(pair.c) == before


@pytest.mark.parametrize("asked, answered", [(3, 0), (0, 3), (3, 4)])
def test_chunk_begin_must_repeat_the_requests_first_layer(asked: int, answered: int) -> None:
    pair = Pair()
    pair.c2s(Request(1, 2, first_layer=asked))
    before = snapshot(pair.s)
    with pytest.raises(LocalProtocolError, match="does not answer the oldest request"):
        pair.s.send(ChunkBegin(1, 2, total_bytes=5, parts=1, first_layer=answered))
    assert snapshot(pair.s) == before
    begin = {"chunk": 1, "level": 2, "bytes": 5, "parts": 1, **({"first_layer": answered} if answered else {})}
    with pytest.raises(RemoteProtocolError, match="does not answer the oldest request"):
        pair.c.receive_data(raw(FrameType.CHUNK_BEGIN, begin))
    assert pair.c.state is State.ERROR


def test_text_answers_only_a_whole_text_request() -> None:
    pair = Pair()
    pair.c2s(Request(1, 2, first_layer=1))
    with pytest.raises(LocalProtocolError, match="does not answer"):
        pair.s.send(Text(1, b"tokens"))


@pytest.mark.parametrize("versions", [SUPPORTED_VERSIONS, (1,)])
def test_a_text_continuation_is_refused_on_either_side(versions) -> None:
    pair = Pair(versions, versions)
    before = snapshot(pair.c)
    with pytest.raises(LocalProtocolError, match="text has no layers"):
        pair.c.send(Request(1, "text", first_layer=1))
    assert snapshot(pair.c) == before
    with pytest.raises(RemoteProtocolError, match="text has no layers"):
        pair.s.receive_data(raw(FrameType.REQUEST, {"chunk": 1, "level": "text", "first_layer": 1}))
    assert pair.s.state is State.ERROR
    assert b'"code":"protocol"' in pair.s.error_frame()


def test_a_continuation_needs_an_open_context() -> None:
    c, s = Connection(Role.CLIENT), Connection(Role.SERVER)
    s.receive_data(c.send(Hello(versions=SUPPORTED_VERSIONS, client="c")))
    c.receive_data(s.send(Welcome(version=max(SUPPORTED_VERSIONS), server="s", max_frame=1 << 20)))
    with pytest.raises(LocalProtocolError, match="without an open context"):
        c.send(Request(0, 0, first_layer=1))


# ----------------------------------------------------------------------------- version 1
@pytest.mark.parametrize("old", ["client", "server"])
def test_version_1_refuses_a_continuation_on_both_sides(old: str) -> None:
    pair = Pair((1,), SUPPORTED_VERSIONS) if old == "client" else Pair(SUPPORTED_VERSIONS, (1,))
    assert pair.c.version == pair.s.version == 1
    before = snapshot(pair.c)
    with pytest.raises(LocalProtocolError, match="needs version 2"):
        pair.c.send(Request(1, 0, first_layer=1))
    assert snapshot(pair.c) == before
    pair.c2s(Request(2, 0))   # a whole chunk still goes
    with pytest.raises(LocalProtocolError, match="does not answer"):
        pair.s.send(ChunkBegin(2, 0, total_bytes=1, parts=1, first_layer=1))
    with pytest.raises(RemoteProtocolError, match="needs version 2"):
        pair.s.receive_data(raw(FrameType.REQUEST, {"chunk": 1, "level": 0, "first_layer": 1}))
    assert pair.s.state is State.ERROR


def test_a_version_1_client_refuses_a_chunk_begin_naming_a_first_layer() -> None:
    pair = Pair((1,), (1,))
    pair.c2s(Request(2, 0))
    with pytest.raises(RemoteProtocolError, match="does not answer"):
        pair.c.receive_data(raw(FrameType.CHUNK_BEGIN, {"chunk": 2, "level": 0, "bytes": 1, "parts": 1,
                                                        "first_layer": 1}))


def test_an_old_peer_sees_the_same_bytes_as_before() -> None:
    """A new client and a version 1 server (and the other way round) exchange exactly the
    frames two version 1 peers exchange: no frame carries the new key."""
    script = [("C", GetProfile(PID)), ("S", ProfileData(PID, b"p")), ("C", Request(0, 1)), ("C", Request(1, "text")),
              ("S", ChunkBegin(0, 1, total_bytes=3, parts=2)), ("S", ChunkPart(0, 0, b"h")),
              ("S", ChunkPart(0, 1, b"ab")), ("S", ChunkEnd(0)), ("S", Text(1, b"t")), ("C", Close())]
    streams = []
    for client, server in [((1,), (1,)), (SUPPORTED_VERSIONS, (1,)), ((1,), SUPPORTED_VERSIONS)]:
        pair = Pair(client, server)
        for side, event in script:
            (pair.c2s if side == "C" else pair.s2c)(event)
        streams.append(b"".join(pair.wire[1:]))   # after HELLO, which lists the versions
    assert streams[0] == streams[1] == streams[2]
    assert b"first_layer" not in streams[0]


# ----------------------------------------------------------------------------- the manifest's bounds
def _manifest(layers: int = 4) -> Manifest:
    return Manifest(context_id="ctx", version="v1", layers=layers, heads=1, head_dim=2, dtype="float16", tokens=8,
                    profile_id=PID, level_distortion=(0.001, 0.01),
                    chunks=(ChunkInfo(0, 0, 4, (10, 8), 3, 0), ChunkInfo(1, 4, 8, (10, 0), 3, 0)), created=0.0)


@pytest.mark.parametrize("chunk, level, first_layer", [(0, 0, 0), (1, 1, 3), (1, "text", 0), (0, 1, 1)])
def test_the_manifest_accepts_what_it_has(chunk, level, first_layer) -> None:
    _manifest().check_request(chunk, level, first_layer)


@pytest.mark.parametrize("chunk, level, first_layer, message", [
    (2, 0, 0, "chunk 2 out of range: context has 2 chunks"),
    (0, 2, 0, "level 2 out of range: context has 2 levels"),
    (0, 0, 4, "first layer 4 out of range: context has 4 layers"),
    (0, 0, frames.MAX_FIRST_LAYER, "first layer 65534 out of range"),
    (0, "text", 1, "text has no layers")])
def test_the_manifest_refuses_what_it_has_not(chunk, level, first_layer, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _manifest().check_request(chunk, level, first_layer)
