"""``kvwire fuzz``: long fuzzing runs of the parsers that face untrusted bytes.

Targets (each a function of one ``bytes`` input, so hypothesis and atheris drive the
same code and any failure is reproduced by its bytes alone):

``frames``
    ``frames.FrameBuffer`` + ``frames.decode`` (the frame parser): only
    ``RemoteProtocolError`` may come out.
``protocol``
    ``protocol.Connection.receive_data`` in one of several live states (server before
    and after the handshake, with a context open on the current version and on version
    1, after the handshake on version 2 (no LOOKUP), awaiting auth; client after the
    handshake, with requests outstanding, in the middle of a chunk and of a
    continuation, with LOOKUPs outstanding), fed in pieces:
    only ``RemoteProtocolError``, never one produced by the "internal error" safety
    net, and the connection must then be in ERROR.
``manifest``, ``text``
    The stored manifest and the text fallback payload (token ids) parsers
    (``streamer.tools.fuzz_data`` says what each checks).
``bitstream``, ``header``, ``profile``
    The codec's blob decoder, blob header and section parser, and profile parser
    (``streamer.tools.fuzz_codec`` says what each checks).
``http``, ``sse``
    The receiver daemon's request parsing (raw bytes through aiohttp's parser into
    ``streamer.receiver.requests``) and its server-sent event encoder
    (``streamer.tools.fuzz_http`` says what each checks).

The CI tests (tests/test_fuzz_cli.py) run these through hypothesis for tens of
thousands of cases and replay a corpus; ``kvwire fuzz --minutes N`` loops hypothesis
(``pip install 'kvwire[fuzz]'``) until the time is up, or with ``--engine atheris``
(``pip install atheris``) runs libFuzzer, coverage-guided, on one target with the
codec, wire, store and receiver request modules (and aiohttp's Python request parser)
instrumented, starting from valid inputs of the target (``seed_inputs``), and reports
the cases run and every failure with a reproducer (``--replay HEX``). ``kvwire fuzz --minimize DIR`` keeps only the units of
a corpus that add coverage (libFuzzer's merge), so the CI replay stays short.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import struct
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from streamer.tools import fuzz_codec, fuzz_data, fuzz_http
from streamer.tools.fuzz_codec import FuzzBug

TARGETS = ("frames", "protocol", "manifest", "text", "bitstream", "header", "profile", "http", "sse")


# ------------------------------------------------------------------------ frames
def check_frames(data: bytes) -> None:
    from streamer.wire import frames
    from streamer.wire.events import RemoteProtocolError

    if not data:
        return
    max_frame = frames.MIN_MAX_FRAME << (data[0] % 4)
    buf = frames.FrameBuffer(max_frame)
    body = data[1:]
    step = 1 + (data[0] >> 2) * 7 if len(data) > 1 else 1
    try:
        for i in range(0, max(len(body), 1), step):
            buf.feed(body[i:i + step])
            while buf.next_frame(frames.decode) is not None:
                pass
    except RemoteProtocolError:
        return
    except Exception as exc:
        raise FuzzBug(f"frame parser raised {type(exc).__name__}: {exc}") from exc


# ------------------------------------------------------------------------ protocol
_PID = "0123456789abcdef"
_CHAIN = tuple(hashlib.sha256(bytes([i])).hexdigest() for i in range(4))
_TOKEN = "fuzz-token-0123456789"


def _wired(version: int | None = None):
    """A client and a server after the handshake, on ``version`` (default: the highest)."""
    from streamer.wire.events import Hello, Welcome
    from streamer.wire.protocol import SUPPORTED_VERSIONS, Connection, Role

    versions = SUPPORTED_VERSIONS if version is None else (version,)
    c, s = Connection(Role.CLIENT, versions=versions), Connection(Role.SERVER, versions=versions)
    s.receive_data(c.send(Hello(versions=versions, client="fuzz")))
    c.receive_data(s.send(Welcome(version=max(versions), server="fuzz", max_frame=1 << 20)))
    return c, s


def _opened(version: int | None = None):
    from streamer.wire.events import ManifestData, Open

    c, s = _wired(version)
    s.receive_data(c.send(Open("ctx", None)))
    c.receive_data(s.send(ManifestData(b"M")))
    return c, s


def _server_fresh():
    from streamer.wire.protocol import Connection, Role
    return Connection(Role.SERVER)


def _server_ready():
    return _wired()[1]


def _server_open(version: int | None = None):
    from streamer.wire.events import Request
    c, s = _opened(version)
    s.receive_data(c.send(Request(5, 1)))
    return s


def _server_awaiting_auth():
    from streamer.wire.auth import new_nonce
    from streamer.wire.events import Hello, Welcome
    from streamer.wire.protocol import Connection, Role

    c = Connection(Role.CLIENT, auth_token=_TOKEN)
    s = Connection(Role.SERVER, auth_token=_TOKEN)
    hello = Hello(versions=c.versions, client="fuzz")
    s.receive_data(c.send(hello))
    s.send(Welcome(max(hello.versions), "s", 1 << 20, auth="required", nonce=new_nonce()))
    return s


def _client_ready():
    return _wired()[0]


def _client_requested():
    from streamer.wire.events import Cancel, GetProfile, ProfileData, Request

    c, s = _opened()
    s.receive_data(c.send(GetProfile(_PID)))
    c.receive_data(s.send(ProfileData(_PID, b"p")))
    for r in (Request(1, 0), Request(2, "text"), Request(3, 0)):
        s.receive_data(c.send(r))
    s.receive_data(c.send(Cancel(3)))
    return c


def _client_streaming():
    from streamer.wire.events import ChunkBegin, ChunkPart

    c, s = _opened()
    from streamer.wire.events import Request
    s.receive_data(c.send(Request(1, 0)))
    c.receive_data(s.send(ChunkBegin(1, 0, total_bytes=5, parts=3)))
    c.receive_data(s.send(ChunkPart(1, 0, b"ab")))
    return c


def _client_continuing():
    """A client in the middle of a continuation: chunk 1 at level 2 from layer 3."""
    from streamer.wire.events import ChunkBegin, ChunkPart, Request

    c, s = _opened()
    s.receive_data(c.send(Request(1, 2, first_layer=3)))
    c.receive_data(s.send(ChunkBegin(1, 2, total_bytes=5, parts=3, first_layer=3)))
    c.receive_data(s.send(ChunkPart(1, 0, b"ab")))
    return c


def _client_looking_up():
    """A client with a LOOKUP of two hashes, an OPEN and a LOOKUP of one outstanding."""
    from streamer.wire.events import Lookup, Open

    c, s = _wired()
    for r in (Lookup(_CHAIN[:2]), Open("ctx", None), Lookup(_CHAIN[:1])):
        s.receive_data(c.send(r))
    return c


#: The states an input's first byte picks from (modulo their number); new ones go last,
#: so a corpus unit whose first byte is below the older count keeps its state.
PROTOCOL_STATES: tuple[tuple[str, Callable], ...] = (
    ("server fresh", _server_fresh), ("server awaiting auth", _server_awaiting_auth),
    ("server after handshake", _server_ready), ("server with context", _server_open),
    ("client after handshake", _client_ready), ("client with requests", _client_requested),
    ("client mid chunk", _client_streaming),
    ("server with context, version 1", lambda: _server_open(1)), ("client mid continuation", _client_continuing),
    ("server after handshake, version 2", lambda: _wired(2)[1]), ("client with lookups", _client_looking_up),
)


def check_protocol(data: bytes) -> None:
    from streamer.wire.events import RemoteProtocolError
    from streamer.wire.protocol import State

    if not data:
        return
    name, make = PROTOCOL_STATES[data[0] % len(PROTOCOL_STATES)]
    conn = make()
    body = data[1:]
    # split points from the input itself: piece lengths 1..64 cycling through the bytes
    pieces, i = [], 0
    cuts = body[:8] or b"\x00"
    k = 0
    while i < len(body):
        n = 1 + cuts[k % len(cuts)] % 64
        pieces.append(body[i:i + n])
        i, k = i + n, k + 1
    try:
        for piece in pieces + [b""]:
            conn.receive_data(piece)
    except RemoteProtocolError as exc:
        if "internal error" in str(exc):
            raise FuzzBug(f"[{name}] bug behind the safety net: {exc}; cause: "
                          f"{exc.__cause__!r}") from exc
        if conn.state is not State.ERROR:
            raise FuzzBug(f"[{name}] RemoteProtocolError left the connection in {conn.state}") from exc
    except Exception as exc:
        raise FuzzBug(f"[{name}] receive_data raised {type(exc).__name__}: {exc}") from exc


CHECKS: dict[str, Callable[[bytes], None]] = {
    "frames": check_frames, "protocol": check_protocol, "manifest": fuzz_data.check_manifest,
    "text": fuzz_data.check_text, "bitstream": fuzz_codec.check_bitstream,
    "header": fuzz_codec.check_header, "profile": fuzz_codec.check_profile,
    "http": fuzz_http.check_http, "sse": fuzz_http.check_sse,
}


# ------------------------------------------------------------------------ seeds
def _frame(event) -> bytes:
    from streamer.wire import frames

    _, pieces, _ = frames.encode(event)
    return b"".join(bytes(p) for p in pieces)


def _wire_seeds() -> tuple[list[bytes], list[bytes]]:
    """(frames a server receives, frames a client receives): one valid frame per kind."""
    from streamer.wire.events import (Auth, AuthOk, Cancel, ChunkBegin, ChunkEnd, ChunkPart, Close,
                                      Error, GetProfile, Hello, Lookup, ManifestData, Open, Prefix,
                                      ProfileData, Request, Text, Welcome)

    mac = "ab" * 32
    to_server = [Hello(versions=(1, 2), client="fuzz"), Auth(nonce=mac, mac=mac), Open("ctx", 2.5),
                 GetProfile(_PID), Request(5, 0), Request(6, "text"), Cancel(5), Lookup(_CHAIN), Close()]
    to_client = [Welcome(2, "fuzz", 1 << 20), AuthOk(mac), ManifestData(fuzz_data.seed_manifest()),
                 ProfileData(_PID, b"profile", more=True), ChunkBegin(1, 0, total_bytes=5, parts=2),
                 ChunkPart(1, 0, b"abc"), ChunkPart(1, 1, b"de"), ChunkEnd(1), ChunkEnd(3, cancelled=True),
                 Text(2, fuzz_data.seed_texts()[0]), Error("not_found", "no such context", fatal=False),
                 Prefix("px-" + _CHAIN[1], 2), Prefix(None, 0), Close()]
    return [_frame(e) for e in to_server], [_frame(e) for e in to_client]


def _control(ftype, obj: dict) -> bytes:
    """A control frame of ``obj`` as JSON, whatever it holds (so it can be wrong)."""
    payload = json.dumps(obj).encode()
    return struct.pack("<IHH", len(payload), int(ftype), 0) + payload


def continuation_seeds() -> tuple[list[bytes], list[bytes]]:
    """(frames a server receives, frames a client receives) around protocol version 2's
    ``first_layer``: a valid continuation and its answer, and each way the field can be
    wrong (the default written out, past the largest, not an int, on a text request)."""
    from streamer.wire.events import ChunkBegin, ChunkPart, ChunkEnd, Request
    from streamer.wire.frames import MAX_FIRST_LAYER, FrameType

    request, begin = {"chunk": 7, "level": 1}, {"chunk": 1, "level": 2, "bytes": 5, "parts": 3}
    to_server = [_frame(Request(7, 1, first_layer=2))] + [
        _control(FrameType.REQUEST, {**request, **extra}) for extra in (
            {"first_layer": 0}, {"first_layer": MAX_FIRST_LAYER + 1}, {"first_layer": True},
            {"level": "text", "first_layer": 1})]
    # the rest of "client mid continuation"'s chunk, then answers that cannot be
    to_client = [_frame(e) for e in (ChunkPart(1, 1, b"cd"), ChunkPart(1, 2, b"e"), ChunkEnd(1),
                                     ChunkBegin(1, 2, total_bytes=5, parts=3, first_layer=3))] + [
        _control(FrameType.CHUNK_BEGIN, {**begin, "first_layer": value}) for value in (0, 4, MAX_FIRST_LAYER + 1)]
    return to_server, to_client


def lookup_seeds() -> tuple[list[bytes], list[bytes]]:
    """(frames a server receives, frames a client receives) around protocol version 3's
    LOOKUP / PREFIX: the largest valid lookup and each way one can be wrong (one hash too
    many, none, uppercase or short hex, not a list, not JSON), then "client with
    lookups"'s answers and the ways a PREFIX can be wrong (more chunks than asked, a
    context with no chunks, chunks with no context, one answering nothing)."""
    from streamer.wire.events import Lookup, Prefix
    from streamer.wire.frames import MAX_LOOKUP_CHAIN, FrameType

    longest = [hashlib.sha256(i.to_bytes(2, "little")).hexdigest() for i in range(MAX_LOOKUP_CHAIN + 1)]
    to_server = [_frame(Lookup(longest[:MAX_LOOKUP_CHAIN]))] + [
        _control(FrameType.LOOKUP, {"chain": chain}) for chain in (
            longest, [], [_CHAIN[0].upper()], [_CHAIN[0][:63]], _CHAIN[0], [_CHAIN[0], 7])] + [
        struct.pack("<IHH", 9, int(FrameType.LOOKUP), 0) + b'{"chain":']
    to_client = [_frame(e) for e in (Prefix("px-" + _CHAIN[1], 2), Prefix(None, 0), Prefix("ctx", 1))] + [
        _control(FrameType.PREFIX, obj) for obj in (
            {"context_id": "px", "chunks": 3}, {"context_id": "px", "chunks": 0}, {"context_id": None, "chunks": 1},
            {"context_id": None, "chunks": 0})]
    return to_server, to_client


def seed_inputs(target: str) -> list[bytes]:
    """Valid inputs of ``target`` that a coverage-guided run starts from (so it does not
    have to discover the JSON schemas and checksums byte by byte)."""
    if target in ("frames", "protocol"):
        (to_server, to_client), (more_server, more_client) = _wire_seeds(), continuation_seeds()
        lookup_server, lookup_client = lookup_seeds()
        more_server, more_client = more_server + lookup_server, more_client + lookup_client
        if target == "frames":
            frames = to_server + to_client + more_server + more_client
            # first byte 0: fed a byte at a time; a frame of kilobytes (the largest LOOKUP)
            # 442 bytes at a time, or each of its cases would cost a read per byte
            return ([bytes([0 if len(f) < 4096 else 0xFC]) + f for f in frames]
                    + [b"\x05" + b"".join(to_client), b"\x05" + b"".join(more_client)])
        out = []
        for i, (name, _) in enumerate(PROTOCOL_STATES):
            for stream in ((to_server, more_server) if name.startswith("server") else (to_client, more_client)):
                out += [bytes([i]) + f for f in stream] + [bytes([i]) + b"".join(stream)]
        return out
    if target == "manifest":
        return [b"\x00" + fuzz_data.seed_manifest(), b"\x00" + fuzz_data.seed_manifest(exact=True),
                b"\x00" + fuzz_data.seed_manifest(restart=2), b"\x01"]
    if target == "text":
        return [bytes([flags]) + p for p in fuzz_data.seed_texts() for flags in (0, 7)]
    if target == "http":
        return [bytes([step]) + r for r in fuzz_http.seed_requests() for step in (0, 7)]
    if target == "sse":
        return fuzz_http.seed_events()
    return [b"\x00", b"\x01", b"\x02", b"\x03", b"\x20", bytes([fuzz_codec.LOW_RANK_SEED])]   # fuzz_codec._seed


def write_seeds(target: str, corpus: Path) -> int:
    """Add ``seed_inputs(target)`` to a corpus directory (named by SHA-1, as libFuzzer
    names its units); the number added."""
    corpus.mkdir(parents=True, exist_ok=True)
    added = 0
    for data in seed_inputs(target):
        path = corpus / hashlib.sha1(data).hexdigest()
        if not path.exists():
            path.write_bytes(data)
            added += 1
    return added


# ------------------------------------------------------------------------ hypothesis strategies
def strategy(target: str):
    """A hypothesis strategy of inputs for ``target`` (structured, so it gets deep)."""
    from hypothesis import strategies as st

    from streamer.wire import frames

    keys = sorted({k for schemas in (frames.SCHEMAS, frames.OPTIONAL_KEYS) for schema in schemas.values()
                   for k in schema})
    scalar = st.one_of(st.none(), st.booleans(), st.integers(-2, 2 ** 33), st.floats(allow_nan=False),
                       st.text(max_size=12), st.sampled_from(["text", "kvwire", _PID, "internal", "none",
                                                              "required", "ab" * 32, "px-" + _CHAIN[0]]))
    chain = st.lists(st.sampled_from([*_CHAIN, "AB" * 32, "a" * 63]), min_size=0, max_size=5)
    value = st.one_of(chain, st.recursive(scalar, lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)), max_leaves=5))

    @st.composite
    def frame(draw):
        ftype = draw(st.integers(0, max(frames.FrameType) + 1))
        kind = draw(st.integers(0, 3))
        if kind <= 1 and ftype in {int(t) for t in frames.CONTROL_TYPES}:
            names = draw(st.lists(st.sampled_from(keys), max_size=6, unique=True))
            payload = json.dumps({k: draw(value) for k in names}).encode()
        elif kind == 2:
            payload = struct.pack("<IHH", draw(st.integers(0, 6)), draw(st.integers(0, 4)),
                                  draw(st.sampled_from([0, 0, 1]))) + draw(st.binary(max_size=12))
        else:
            payload = draw(st.binary(max_size=40))
        flags = draw(st.sampled_from([0, 0, 0, 0, 1]))
        length = len(payload) if draw(st.integers(0, 12)) else draw(st.integers(0, 2 ** 32 - 1))
        return struct.pack("<IHH", length, ftype, flags) + payload

    if target in ("frames", "protocol"):
        stream = st.lists(frame(), max_size=8).map(b"".join)
        both = st.one_of(stream, stream, st.binary(max_size=96))
        return st.tuples(st.binary(min_size=1, max_size=1), st.binary(max_size=8), both).map(
            lambda t: t[0] + (t[1] if target == "protocol" else b"") + t[2])
    if target == "manifest":
        edits = st.lists(st.binary(min_size=7, max_size=7), max_size=4).map(lambda e: b"\x01" + b"".join(e))
        return st.one_of(edits, edits, st.binary(max_size=200).map(lambda b: b"\x00" + b))
    if target == "text":
        def damaged(t: tuple[int, bytes, list[tuple[int, int]]]) -> bytes:
            flags, payload, flips = t
            out = bytearray(payload)
            for pos, xor in flips:
                out[pos % len(out)] ^= xor
            return bytes([flags]) + bytes(out)
        return st.tuples(st.integers(0, 7), st.sampled_from(fuzz_data.seed_texts()),
                         st.lists(st.tuples(st.integers(0, 400), st.integers(1, 255)), max_size=3)).map(damaged)
    if target == "bitstream":
        return st.binary(min_size=3, max_size=40)
    if target == "http":
        return _http_strategy()
    if target == "sse":
        return st.binary(min_size=1, max_size=80)
    if target in ("header", "profile"):
        edit = 6 if target == "header" else 7
        return st.tuples(st.binary(min_size=1, max_size=1), st.lists(st.binary(min_size=edit, max_size=edit),
                                                                      max_size=4)).map(lambda t: t[0] + b"".join(t[1]))
    raise ValueError(f"unknown target {target!r}; choose from {', '.join(TARGETS)}")


def _http_strategy():
    """Requests built from the daemon's routes, parameters, headers and fetch fields
    (mostly well framed, so that they reach the daemon's own parsing), pipelined, then
    maybe damaged; the first byte is the piece length."""
    from urllib.parse import quote

    from hypothesis import strategies as st

    from streamer.receiver.requests import FETCH_KEYS

    word = st.one_of(st.sampled_from(["doc-1", "a", "..", "%ff", "%2F", "%00", "a" * 201, "\u00e9", "1e999",
                                      "-1", "0", "1", "true", "nan", "2.5", "99999999999999999999", ""]),
                     st.text(max_size=8))
    safe = st.tuples(word, st.integers(0, 3)).map(lambda t: t[0] if t[1] == 0 else quote(t[0], safe="%"))
    path = st.one_of(st.sampled_from(["/fetch", "/contexts", "/healthz", "/metrics", "/", "*"]),
                     st.tuples(safe, st.sampled_from(["", "/events", "/x"])).map(lambda t: f"/contexts/{t[0]}{t[1]}"))
    query = st.lists(st.tuples(st.sampled_from(["wait", "after", "x", "wait"]), safe), max_size=3).map(
        lambda q: "?" + "&".join(f"{k}={v}" for k, v in q) if q else "")
    header = st.tuples(st.sampled_from(["Last-Event-ID", "Last-Event-ID", "Content-Length", "Transfer-Encoding",
                                        "Content-Encoding", "Connection", "Expect", "X-A"]), safe)
    field = st.one_of(st.none(), st.booleans(), st.integers(-2, 2 ** 70), st.floats(), word)
    body = st.one_of(st.fixed_dictionaries({"context_id": word}, optional={k: field for k in sorted(FETCH_KEYS - {"context_id"})}),
                     st.dictionaries(st.sampled_from(sorted(FETCH_KEYS) + ["x"]), field, max_size=5),
                     word).map(json.dumps)

    @st.composite
    def request(draw) -> bytes:
        method = draw(st.sampled_from(["GET", "GET", "POST", "POST", "HEAD", "PUT"]))
        headers = [("Host", "127.0.0.1:7420")] + draw(st.lists(header, max_size=3))
        data = draw(body).encode("utf-8", "surrogateescape") if method == "POST" else b""
        if data and draw(st.integers(0, 3)) == 0:
            headers.append(("Transfer-Encoding", "chunked"))
            data = f"{len(data):x}\r\n".encode() + data + b"\r\n0\r\n\r\n"
        elif data:
            headers.append(("Content-Length", str(len(data))))
        head = f"{method} {draw(path)}{draw(query)} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
        return head.encode("utf-8", "surrogateescape") + b"\r\n" + data

    def damaged(t: tuple[int, list[bytes], list[tuple[int, int]]]) -> bytes:
        step, pieces, flips = t
        out = bytearray(b"".join(pieces))
        for pos, xor in flips:
            out[pos % len(out)] ^= xor
        return bytes([step]) + bytes(out)

    flips = st.one_of(st.just([]), st.just([]), st.lists(st.tuples(st.integers(0, 400), st.integers(1, 255)),
                                                         max_size=2))
    return st.tuples(st.sampled_from([0, 0, 1, 3, 17]), st.lists(request(), min_size=1, max_size=3),
                     flips).map(damaged)


# ------------------------------------------------------------------------ runners
@dataclass
class Failure:
    target: str
    data: bytes
    error: str

    def reproducer(self) -> str:
        return f"kvwire fuzz --target {self.target} --replay {self.data.hex()}"


@dataclass
class FuzzResult:
    cases: dict[str, int] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)
    seconds: float = 0.0
    engine: str = "hypothesis"


def run_hypothesis(target: str, *, max_examples: int, seed: int | None = None,
                   result: FuzzResult | None = None) -> FuzzResult:
    """One hypothesis run of ``max_examples`` cases; a failure is recorded (shrunk), not raised."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed

    result = result or FuzzResult()
    check = CHECKS[target]
    last_bad: list[bytes] = []

    @settings(max_examples=max_examples, deadline=None, database=None, print_blob=False,
              suppress_health_check=list(HealthCheck))
    @given(strategy(target))
    def run(data: bytes) -> None:
        result.cases[target] = result.cases.get(target, 0) + 1
        try:
            check(data)
        except BaseException:
            last_bad[:] = [data]
            raise

    if seed is not None:
        run = hseed(seed)(run)
    try:
        run()
    except Exception as exc:  # the minimal failing example is the last one that raised
        data = last_bad[0] if last_bad else b""
        result.failures.append(Failure(target, data, f"{type(exc).__name__}: {exc}"))
    return result


def fuzz_for(seconds: float, targets: tuple[str, ...] = TARGETS, *, batch: int = 2000,
             seed: int = 0, log: Callable[[str], None] | None = None) -> FuzzResult:
    """Loop hypothesis batches over ``targets`` (round robin) until ``seconds`` are up."""
    result = FuzzResult()
    start = time.monotonic()
    rng = random.Random(seed)
    while True:
        for target in targets:
            if time.monotonic() - start >= seconds and result.cases:
                result.seconds = time.monotonic() - start
                return result
            before = len(result.failures)
            run_hypothesis(target, max_examples=batch, seed=rng.getrandbits(64), result=result)
            if log is not None:
                log(f"{target}: {result.cases.get(target, 0)} cases, "
                    f"{time.monotonic() - start:.0f} s")
                for failure in result.failures[before:]:
                    log(f"FAILURE in {target}: {failure.error}\n  reproduce: {failure.reproducer()}")


#: modules whose Python code atheris instruments for coverage (the parsers and what they call)
INSTRUMENTED = ("codec", "streamer.wire", "streamer.store.put", "streamer.tools.fuzz_codec",
                "streamer.tools.fuzz_data", "safetensors", "streamer.receiver.requests", "streamer.receiver.sse",
                "streamer.tools.fuzz_http", "aiohttp.http_parser", "urllib.parse")


def _instrument(atheris) -> int:
    """Instrument every loaded function of INSTRUMENTED modules in place; the count.

    numba kernels are compiled already (warm_up) and their Python source is not what
    runs, so ``codec.rans`` is left alone unless NUMBA_DISABLE_JIT=1 makes it plain
    Python (then the decoder's own loops are covered too).
    """
    import gc
    import types

    import numba

    skip = () if numba.config.DISABLE_JIT else ("codec.rans",)
    count = 0
    for obj in gc.get_objects():
        if isinstance(obj, types.FunctionType) and (obj.__module__ or "").startswith(INSTRUMENTED) \
                and not (obj.__module__ or "").startswith(skip):
            atheris.instrument_func(obj)
            count += 1
    return count


def _atheris_check(target: str, atheris) -> Callable[[bytes], None]:  # pragma: no cover - needs atheris
    """``target``'s check, warmed up on its seeds and then instrumented, as libFuzzer runs it."""
    import codec

    check = CHECKS[target]
    codec.warm_up()
    for seed in seed_inputs(target):  # build the seeds (and compile) before coverage starts
        check(seed)
    print(f"atheris: instrumented {_instrument(atheris)} functions", file=sys.stderr)

    def one(data: bytes) -> None:
        try:
            check(data)
        except FuzzBug:
            print(f"reproduce: kvwire fuzz --target {target} --replay {data.hex()}", file=sys.stderr)
            raise

    return one


def fuzz_atheris(seconds: float, target: str, corpus: str | None = None) -> int:  # pragma: no cover - needs atheris
    """Run atheris (libFuzzer, coverage-guided) on one target; the exit code (nonzero on a crash).

    libFuzzer owns the process (it exits when done), so this is meant for the CLI only.
    """
    import atheris

    if corpus:
        print(f"atheris: {write_seeds(target, Path(corpus))} seed inputs added to {corpus}", file=sys.stderr)
    one = _atheris_check(target, atheris)
    argv = [sys.argv[0], f"-max_total_time={max(1, int(seconds))}", "-print_final_stats=1", "-timeout=10"]
    atheris.Setup(argv + ([corpus] if corpus else []), one)
    atheris.Fuzz()
    return 0


#: the environment of ``python -m streamer.tools.fuzz``, the program libFuzzer re-runs for a merge
_TARGET_ENV, _PROGRAM_ENV = "KVWIRE_FUZZ_TARGET", "KVWIRE_FUZZ_PROGRAM"


def _libfuzzer_program() -> None:  # pragma: no cover - needs atheris
    """libFuzzer with its own command line on the target the environment names. A merge
    runs its work in child processes of the program named first on the command line,
    which for ``kvwire fuzz`` is not one that takes libFuzzer's flags: this is."""
    import atheris

    one = _atheris_check(os.environ[_TARGET_ENV], atheris)
    atheris.Setup([os.environ[_PROGRAM_ENV]] + sys.argv[1:], one)
    atheris.Fuzz()


def minimize_corpus(target: str, corpus: Path) -> tuple[int, int]:  # pragma: no cover - needs atheris
    """Keep only the units of ``corpus`` that add coverage of ``target`` (libFuzzer's
    ``-merge=1`` into an empty directory, the coverage as in ``fuzz_atheris``); the unit
    counts before and after. Units are named by their SHA-1, as libFuzzer names them."""
    import subprocess
    import tempfile

    before = sorted(p for p in corpus.iterdir() if p.is_file())
    with tempfile.TemporaryDirectory(prefix="kvwire-merge-") as tmp:
        program = Path(tmp) / "kvwire-libfuzzer"
        program.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m streamer.tools.fuzz "$@"\n')
        program.chmod(0o755)
        merged = Path(tmp) / "merged"
        merged.mkdir()
        env = {**os.environ, _TARGET_ENV: target, _PROGRAM_ENV: str(program)}
        done = subprocess.run([str(program), "-merge=1", "-timeout=10", str(merged), str(corpus)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        kept = sorted(merged.iterdir())
        if done.returncode != 0 or (before and not kept):
            raise RuntimeError(f"libFuzzer's merge of {corpus} failed ({done.returncode}): {done.stderr[-800:]}")
        for path in before:
            path.unlink()
        for path in kept:
            data = path.read_bytes()
            (corpus / hashlib.sha1(data).hexdigest()).write_bytes(data)
    return len(before), len(kept)


def replay(target: str, data: bytes) -> str | None:
    """Run one input; None if it passes, else the error with its traceback."""
    try:
        CHECKS[target](data)
    except FuzzBug:
        return traceback.format_exc()
    return None


# ------------------------------------------------------------------------ CLI
def _handler(args: argparse.Namespace) -> int:
    targets = TARGETS if args.target == "all" else (args.target,)
    if args.replay is not None:
        data = bytes.fromhex(args.replay)
        failed = False
        for target in targets:
            error = replay(target, data)
            print(f"{target}: {'FAIL' if error else 'ok'}")
            if error:
                print(error)
                failed = True
        return 1 if failed else 0
    if args.minimize is not None:
        return _minimize(targets, Path(args.minimize), args.target == "all")
    if args.replay_corpus is not None:
        return _replay_corpus(targets, Path(args.replay_corpus))
    seconds = 60.0 * args.minutes
    if args.engine == "atheris":
        if len(targets) != 1:
            print("kvwire fuzz: --engine atheris runs one --target at a time", file=sys.stderr)
            return 2
        try:
            import atheris  # noqa: F401
        except ImportError:
            print("kvwire fuzz: --engine atheris needs atheris (pip install atheris)", file=sys.stderr)
            return 2
        return fuzz_atheris(seconds, targets[0], args.corpus)
    try:
        import hypothesis  # noqa: F401
    except ImportError:
        print("kvwire fuzz: the hypothesis engine needs hypothesis (pip install 'kvwire[fuzz]')", file=sys.stderr)
        return 2
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.verbose else None
    result = fuzz_for(seconds, targets, batch=args.batch, seed=args.seed, log=log)
    summary = {"engine": "hypothesis", "seconds": round(result.seconds, 1), "cases": result.cases,
               "total_cases": sum(result.cases.values()),
               "failures": [{"target": f.target, "error": f.error, "input_hex": f.data.hex(),
                             "reproduce": f.reproducer()} for f in result.failures]}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"kvwire fuzz: {summary['total_cases']} cases in {summary['seconds']} s "
              + ", ".join(f"{t}={n}" for t, n in result.cases.items()))
        for f in summary["failures"]:
            print(f"FAILURE [{f['target']}] {f['error']}\n  reproduce: {f['reproduce']}")
        if not result.failures:
            print("no failures")
    return 1 if result.failures else 0


def _minimize(targets: tuple[str, ...], corpus: Path, per_target: bool) -> int:
    """``--minimize DIR``: DIR is one target's corpus, or with ``--target all`` a tree of
    them (DIR/<target>, as tests/data/fuzz_corpus).

    A target's corpus holds only units: one holding folders is refused before anything
    runs, as libFuzzer's merge would read the units of every folder below it (another
    target's corpus) and write the ones kept for this target beside them."""
    directories = {target: corpus / target if per_target else corpus for target in targets}
    for target, directory in directories.items():
        nested = sorted(p.name for p in directory.iterdir() if p.is_dir()) if directory.is_dir() else []
        if nested:
            hint = "" if per_target else (f"; pass {corpus / target} for --target {target}, or use "
                                          f"--target all for a tree of corpora")
            print(f"kvwire fuzz: --minimize {directory} holds folders ({', '.join(nested)}), not only "
                  f"the units of {target}'s corpus{hint}", file=sys.stderr)
            return 2
    try:
        import atheris  # noqa: F401
    except ImportError:
        print("kvwire fuzz: --minimize needs atheris (pip install atheris)", file=sys.stderr)
        return 2
    for target, directory in directories.items():
        if not directory.is_dir():
            continue
        start = time.monotonic()
        before, after = minimize_corpus(target, directory)
        print(f"{target}: {before} -> {after} units ({time.monotonic() - start:.0f} s)", flush=True)
    return 0


def _replay_corpus(targets: tuple[str, ...], corpus: Path) -> int:
    """``--replay-corpus DIR``: every unit of DIR/<target>, as the CI replay runs them; the
    units, wall and CPU seconds per target (after one warm-up unit each), and the failures."""
    import codec

    codec.warm_up()
    failed = 0
    for target in targets:
        units = sorted(p for p in (corpus / target).glob("*") if p.is_file())
        if not units:
            continue
        replay(target, units[0].read_bytes())   # the target's seeds and caches built, not timed
        wall, cpu = time.perf_counter(), time.process_time()
        errors = [(p.name, e) for p in units if (e := replay(target, p.read_bytes())) is not None]
        print(f"{target}: {len(units)} units, {time.perf_counter() - wall:.2f} s "
              f"(CPU {time.process_time() - cpu:.2f} s), {len(errors)} failing", flush=True)
        for name, error in errors:
            print(f"FAIL {target}/{name}\n{error}")
        failed += len(errors)
    return 1 if failed else 0


def register(subparsers, bench_subparsers=None) -> None:
    if bench_subparsers is not None:
        from streamer.tools import adversarial

        adversarial.register(bench_subparsers)
    fuzz = subparsers.add_parser("fuzz", help="fuzz the parsers of untrusted bytes (frames, protocol, manifest, text, "
                                              "codec, the receiver's HTTP requests and events)",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    fuzz.add_argument("--minutes", type=float, default=1.0, help="how long to run (default 1)")
    fuzz.add_argument("--target", choices=TARGETS + ("all",), default="all", help="what to fuzz (default all)")
    fuzz.add_argument("--engine", choices=("hypothesis", "atheris"), default="hypothesis",
                      help="hypothesis (default) or atheris (coverage-guided, if installed)")
    fuzz.add_argument("--batch", type=int, default=2000, help="hypothesis examples per batch")
    fuzz.add_argument("--seed", type=int, default=0, help="seed of the batch seeds (default 0)")
    fuzz.add_argument("--replay", metavar="HEX", help="run one input (from a failure report) and exit")
    fuzz.add_argument("--corpus", metavar="DIR", help="atheris: corpus directory to read and grow")
    fuzz.add_argument("--minimize", metavar="DIR",
                      help="keep only the units of a corpus that add coverage (atheris, libFuzzer's -merge=1); "
                           "with --target all, DIR holds one directory per target")
    fuzz.add_argument("--replay-corpus", metavar="DIR",
                      help="run every unit of DIR/<target> (as the CI replay) and report the seconds")
    fuzz.add_argument("--json", action="store_true", help="print the summary as JSON")
    fuzz.add_argument("-v", "--verbose", action="store_true", help="progress on stderr")
    fuzz.set_defaults(handler=_handler)


if __name__ == "__main__":  # pragma: no cover - the program libFuzzer re-runs (see _libfuzzer_program)
    _libfuzzer_program()
