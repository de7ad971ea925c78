"""Protocol version 3's LOOKUP / PREFIX, driven with bytes only on both sides.

The frames' schemas (a chain of 1..512 lowercase-hex SHA-256s within the 64 KiB control
limit; PREFIX's context id null exactly when it claims no chunks), the requests' FIFO (a
PREFIX answers the oldest request only when it is a LOOKUP, and never claims more chunks
than that LOOKUP asked), the version gate (versions 1 and 2 refuse LOOKUP on either side
and keep working), and authentication (a LOOKUP before AUTH is refused like an OPEN).
"""
from __future__ import annotations

import hashlib
import json
import struct

import pytest

from streamer.wire import frames
from streamer.wire.auth import new_nonce
from streamer.wire.protocol import (LOOKUP_VERSION, MAX_LOOKUP_CHAIN, SUPPORTED_VERSIONS, AuthenticationError,
                                    ChunkBegin, ChunkPart, Connection, Error, FrameType, GetProfile, Hello,
                                    LocalProtocolError, Lookup, ManifestData, Open, Prefix, ProfileData,
                                    RemoteProtocolError, Request, Role, State, Welcome)

PID = "0123456789abcdef"
TOKEN = "lookup-test-token-0123456789"


def chain(n: int) -> tuple[str, ...]:
    return tuple(hashlib.sha256(str(i).encode()).hexdigest() for i in range(n))


def raw(ftype: FrameType, obj) -> bytes:
    payload = json.dumps(obj).encode()
    return struct.pack("<IHH", len(payload), int(ftype), 0) + payload


def decoded(data: bytes):
    buf = frames.FrameBuffer(1 << 20)
    buf.feed(data)
    return buf.next_frame(frames.decode)


class Pair:
    """A client and a server after the handshake, each speaking ``versions``."""

    def __init__(self, client_versions=SUPPORTED_VERSIONS, server_versions=SUPPORTED_VERSIONS) -> None:
        self.c = Connection(Role.CLIENT, versions=client_versions)
        self.s = Connection(Role.SERVER, versions=server_versions)
        self.c2s(Hello(versions=tuple(client_versions), client="recv"))
        self.s2c(Welcome(version=max(set(client_versions) & set(server_versions)), server="send",
                         max_frame=1 << 20))

    def c2s(self, event):
        assert self.s.receive_data(self.c.send(event)) == [event]

    def s2c(self, event):
        assert self.c.receive_data(self.s.send(event)) == [event]


def snapshot(conn: Connection):
    return conn.state, conn.outstanding, conn.chunk_in_progress, conn.context_id


# ----------------------------------------------------------------------------- frames
def test_the_largest_lookup_fits_a_control_frame() -> None:
    assert MAX_LOOKUP_CHAIN == frames.MAX_LOOKUP_CHAIN == 512 and LOOKUP_VERSION == 3
    ftype, pieces, length = frames.encode(Lookup(chain(MAX_LOOKUP_CHAIN)))
    assert ftype is FrameType.LOOKUP
    # 64 hex + 2 quotes per hash, commas between, '{"chain":[]}' around
    assert length == 12 + 66 * MAX_LOOKUP_CHAIN + MAX_LOOKUP_CHAIN - 1 < frames.MAX_CONTROL_PAYLOAD
    assert decoded(bytes(pieces[0])) == Lookup(chain(MAX_LOOKUP_CHAIN))


@pytest.mark.parametrize("event", [Lookup(chain(1)), Lookup(list(chain(7))), Prefix(None, 0),
                                   Prefix("px-" + "ab" * 32, 1), Prefix("doc", MAX_LOOKUP_CHAIN)])
def test_lookup_and_prefix_round_trip_exactly(event) -> None:
    _, pieces, _ = frames.encode(event)
    assert decoded(b"".join(bytes(p) for p in pieces)) == event


def test_the_wire_form_is_plain_json() -> None:
    _, pieces, _ = frames.encode(Lookup(chain(2)))
    assert json.loads(bytes(pieces[0])[frames.HEADER.size:]) == {"chain": list(chain(2))}
    _, pieces, _ = frames.encode(Prefix(None, 0))
    assert bytes(pieces[0])[frames.HEADER.size:] == b'{"context_id":null,"chunks":0}'


BAD_CHAINS = {
    "empty": [], "513 hashes": list(chain(MAX_LOOKUP_CHAIN + 1)), "not a list": "ab" * 32,
    "uppercase hex": ["AB" * 32], "63 characters": ["a" * 63], "65 characters": ["a" * 65],
    "not hex": ["g" * 64], "a number": [1], "null": [None], "one bad among good": [*chain(3), "zz"],
}


@pytest.mark.parametrize("case", sorted(BAD_CHAINS))
def test_a_bad_chain_is_refused_on_both_sides(case: str) -> None:
    with pytest.raises(RemoteProtocolError, match="LOOKUP.chain"):
        decoded(raw(FrameType.LOOKUP, {"chain": BAD_CHAINS[case]}))
    pair = Pair()
    before = snapshot(pair.c)
    with pytest.raises(LocalProtocolError, match="LOOKUP.chain"):
        pair.c.send(Lookup(BAD_CHAINS[case]))
    assert snapshot(pair.c) == before


@pytest.mark.parametrize("obj", [{}, {"chain": list(chain(1)), "x": 1}, {"chains": list(chain(1))}, [list(chain(1))]])
def test_a_lookup_with_wrong_keys_is_refused(obj) -> None:
    with pytest.raises(RemoteProtocolError, match="LOOKUP"):
        decoded(raw(FrameType.LOOKUP, obj))


@pytest.mark.parametrize("data", [b'{"chain":["' + b"a" * 64 + b'"],"chain":[]}', b"{", b"\xff", b"null",
                                  b'{"chain":NaN}'])
def test_malformed_lookup_json_is_refused(data: bytes) -> None:
    with pytest.raises(RemoteProtocolError, match="malformed LOOKUP"):
        decoded(struct.pack("<IHH", len(data), FrameType.LOOKUP, 0) + data)


def test_a_lookup_announcing_more_than_the_control_limit_fails_at_its_header() -> None:
    buf = frames.FrameBuffer(1 << 24)
    buf.feed(struct.pack("<IHH", frames.MAX_CONTROL_PAYLOAD + 1, FrameType.LOOKUP, 0))
    with pytest.raises(RemoteProtocolError, match="LOOKUP frame announces 65537 payload bytes"):
        buf.next_frame(frames.decode)


@pytest.mark.parametrize("obj", [{"context_id": None, "chunks": 1}, {"context_id": "doc", "chunks": 0},
                                 {"context_id": "", "chunks": 1}, {"context_id": "doc", "chunks": -1},
                                 {"context_id": "doc", "chunks": MAX_LOOKUP_CHAIN + 1},
                                 {"context_id": "doc", "chunks": True}, {"context_id": "doc", "chunks": 1.0},
                                 {"context_id": 5, "chunks": 1}, {"context_id": "doc"}, {"chunks": 0}])
def test_a_bad_prefix_is_refused_on_both_sides(obj) -> None:
    with pytest.raises(RemoteProtocolError, match="PREFIX"):
        decoded(raw(FrameType.PREFIX, obj))
    if set(obj) == {"context_id", "chunks"}:
        with pytest.raises(LocalProtocolError, match="PREFIX"):
            frames.encode(Prefix(**obj))


# ----------------------------------------------------------------------------- requests
def test_lookups_are_answered_in_fifo_order_with_the_other_requests() -> None:
    pair = Pair()
    assert pair.c.lookups and pair.s.lookups
    pair.c2s(Open("doc", None))
    pair.c2s(Lookup(chain(3)))
    pair.c2s(GetProfile(PID))
    pair.c2s(Lookup(chain(1)))
    assert [p.kind for p in pair.c.outstanding] == [FrameType.OPEN, FrameType.LOOKUP, FrameType.GET_PROFILE,
                                                    FrameType.LOOKUP]
    # a PREFIX cannot jump the OPEN ahead of it
    with pytest.raises(LocalProtocolError, match="does not answer the oldest request, OPEN"):
        pair.s.send(Prefix("doc", 2))
    pair.s2c(ManifestData(b"M"))
    assert pair.c.context_id == "doc"
    pair.s2c(Prefix("doc", 3))
    with pytest.raises(LocalProtocolError, match="PROFILE .* does not answer the oldest request, GET_PROFILE"):
        pair.s.send(ProfileData("fedcba9876543210", b"p"))
    pair.s2c(ProfileData(PID, b"p"))
    pair.s2c(Error("unavailable", "store down"))   # a non-fatal ERROR answers a LOOKUP
    assert not pair.c.outstanding and not pair.s.outstanding
    assert pair.c.context_id == "doc"   # a LOOKUP neither needs nor closes a context
    pair.c2s(Request(0, 0))


def test_a_prefix_cannot_claim_more_chunks_than_the_lookup_asked() -> None:
    pair = Pair()
    pair.c2s(Lookup(chain(2)))
    before = snapshot(pair.s)
    with pytest.raises(LocalProtocolError, match="claims 3 chunks of a LOOKUP of 2 hashes"):
        pair.s.send(Prefix("doc", 3))
    assert snapshot(pair.s) == before
    forged = raw(FrameType.PREFIX, {"context_id": "doc", "chunks": 3})
    with pytest.raises(RemoteProtocolError, match="claims 3 chunks of a LOOKUP of 2 hashes"):
        pair.c.receive_data(forged)
    assert pair.c.state is State.ERROR


@pytest.mark.parametrize("outstanding", [[], [Open("doc", None)], [GetProfile(PID)]])
def test_an_unexpected_prefix_is_a_protocol_error(outstanding) -> None:
    pair = Pair()
    for event in outstanding:
        pair.c2s(event)
    with pytest.raises(RemoteProtocolError, match="PREFIX"):
        pair.c.receive_data(raw(FrameType.PREFIX, {"context_id": None, "chunks": 0}))
    assert pair.c.state is State.ERROR
    assert b'"code":"protocol"' in pair.c.error_frame()


def test_a_prefix_cannot_interrupt_a_chunk() -> None:
    pair = Pair()
    pair.c2s(Open("doc", None))
    pair.s2c(ManifestData(b"M"))
    pair.c2s(Request(0, 0))
    pair.c2s(Lookup(chain(1)))   # the client may keep sending while a chunk streams
    pair.s2c(ChunkBegin(0, 0, total_bytes=2, parts=2))
    pair.s2c(ChunkPart(0, 0, b"a"))
    with pytest.raises(LocalProtocolError, match="while chunk 0 is in progress"):
        pair.s.send(Prefix(None, 0))


def test_a_lookup_is_a_request_the_server_queues_like_open() -> None:
    pair = Pair()
    pair.c2s(Lookup(chain(4)))
    (pending,) = pair.s.outstanding
    assert pending.request == Lookup(chain(4)) and pending.kind is FrameType.LOOKUP and not pending.cancelled


# ----------------------------------------------------------------------------- versions
@pytest.mark.parametrize("client, server", [((1, 2), SUPPORTED_VERSIONS), (SUPPORTED_VERSIONS, (1, 2)),
                                            ((1,), SUPPORTED_VERSIONS), (SUPPORTED_VERSIONS, (1,))])
def test_older_versions_refuse_lookup_on_both_sides_and_keep_working(client, server) -> None:
    pair = Pair(client, server)
    assert pair.c.version == pair.s.version < LOOKUP_VERSION
    assert not pair.c.lookups and not pair.s.lookups
    before = snapshot(pair.c)
    with pytest.raises(LocalProtocolError, match="lookups need version 3"):
        pair.c.send(Lookup(chain(1)))
    assert snapshot(pair.c) == before
    pair.c2s(Open("doc", None))   # the rest of the protocol is unchanged
    pair.s2c(ManifestData(b"M"))
    # a LOOKUP forced onto the wire is the peer's violation
    with pytest.raises(RemoteProtocolError, match="lookups need version 3"):
        pair.s.receive_data(raw(FrameType.LOOKUP, {"chain": list(chain(1))}))
    assert pair.s.state is State.ERROR


def test_no_lookups_before_the_handshake() -> None:
    assert Connection(Role.CLIENT).lookups is False
    assert Connection(Role.SERVER).lookups is False
    with pytest.raises(LocalProtocolError, match="cannot send LOOKUP in state START"):
        Connection(Role.CLIENT).send(Lookup(chain(1)))


# ----------------------------------------------------------------------------- authentication
@pytest.mark.parametrize("when", ["with the HELLO", "before AUTH"])
def test_a_lookup_before_authentication_is_refused(when: str) -> None:
    c = Connection(Role.CLIENT, auth_token=TOKEN)
    s = Connection(Role.SERVER, auth_token=TOKEN)
    lookup = raw(FrameType.LOOKUP, {"chain": list(chain(1))})
    if when == "before AUTH":
        s.receive_data(c.send(Hello(versions=SUPPORTED_VERSIONS, client="c")))
        c.receive_data(s.send(Welcome(version=3, server="s", max_frame=1 << 20, auth="required",
                                      nonce=new_nonce())))
        assert c.state is State.SEND_AUTH
        with pytest.raises(LocalProtocolError, match="cannot send LOOKUP in state SEND_AUTH"):
            c.send(Lookup(chain(1)))
    else:
        lookup = c.send(Hello(versions=SUPPORTED_VERSIONS, client="c")) + lookup
    with pytest.raises(AuthenticationError, match="LOOKUP received before AUTH"):
        s.receive_data(lookup)
    assert s.state is State.ERROR
    assert b'"code":"auth"' in s.error_frame()


def test_an_authenticated_client_looks_up() -> None:
    c = Connection(Role.CLIENT, auth_token=TOKEN)
    s = Connection(Role.SERVER, auth_token=TOKEN)
    s.receive_data(c.send(Hello(versions=SUPPORTED_VERSIONS, client="c")))
    c.receive_data(s.send(Welcome(version=3, server="s", max_frame=1 << 20, auth="required", nonce=new_nonce())))
    s.receive_data(c.send(c.auth_event()))
    c.receive_data(s.send(s.auth_ok_event()))
    assert s.receive_data(c.send(Lookup(chain(2)))) == [Lookup(chain(2))]
    assert c.receive_data(s.send(Prefix("doc", 1))) == [Prefix("doc", 1)]


# ----------------------------------------------------------------------------- fuzz states
def test_the_fuzz_states_for_lookups_are_live() -> None:
    """``kvwire fuzz --target protocol`` reaches the lookup rules: its "client with lookups"
    takes a valid PREFIX and refuses one claiming more chunks than asked, its version 3
    server takes the largest LOOKUP, its version 2 server refuses any."""
    from streamer.tools import fuzz

    states = dict(fuzz.PROTOCOL_STATES)
    client = states["client with lookups"]()
    assert client.receive_data(frames.encode(Prefix("px-" + "ab" * 32, 2))[1][0]) == [Prefix("px-" + "ab" * 32, 2)]
    with pytest.raises(RemoteProtocolError, match="does not answer the oldest request, OPEN"):
        client.receive_data(raw(FrameType.PREFIX, {"context_id": None, "chunks": 0}))
    with pytest.raises(RemoteProtocolError, match="claims 3 chunks of a LOOKUP of 2 hashes"):
        states["client with lookups"]().receive_data(raw(FrameType.PREFIX, {"context_id": "px", "chunks": 3}))
    biggest = Lookup(chain(MAX_LOOKUP_CHAIN))
    assert states["server after handshake"]().receive_data(frames.encode(biggest)[1][0]) == [biggest]
    with pytest.raises(RemoteProtocolError, match="lookups need version 3"):
        states["server after handshake, version 2"]().receive_data(frames.encode(biggest)[1][0])
