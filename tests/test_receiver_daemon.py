"""The receiver daemon (``kvwire receive``) against real sender daemons over loopback,
driven by a real HTTP client: shared fetches, the local cache (hits without network,
quality-driven refetches, eviction, persistence), server-sent progress events while a
shaped fetch is still running, error statuses, metrics, and shutdown."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import torch
from safetensors.torch import load as load_safetensors

import codec
import netsim
import streamer
from streamer_helpers import synthetic_kv
from test_streamer_store import closed_port
from streamer.net.config import SessionConfig
from streamer.receiver import ReceiverConfig, start_receiver
from streamer.store.file import FileStore

LAYERS, HEADS, HEAD_DIM = 4, 8, 32
CHUNK_TOKENS = 128
CHUNKS = 8
TOKENS = CHUNKS * CHUNK_TOKENS
CONTEXTS = ("a", "b", "c")


def _kv(seed: int, tokens: int) -> torch.Tensor:
    return synthetic_kv(seed, tokens, LAYERS, HEADS, HEAD_DIM)


def _distortion(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return float(((x - y) ** 2).sum() / ((x - x.mean(dim=2, keepdim=True)) ** 2).sum())


@pytest.fixture(scope="module")
def contexts(tmp_path_factory: pytest.TempPathFactory):
    """Three 8-chunk contexts in one file store, put once for the module."""
    root = tmp_path_factory.mktemp("store")
    profile = codec.calibrate([_kv(1, 2048)])
    out = {"root": str(root), "profile": profile, "kv": {}, "tokens": {}, "manifest": {}}

    async def put() -> None:
        store = await streamer.open_store(str(root))
        try:
            for i, cid in enumerate(CONTEXTS):
                kv = _kv(10 + i, TOKENS)
                tokens = [(7 * t + i) % 30000 for t in range(TOKENS)]
                out["kv"][cid], out["tokens"][cid] = kv, tokens
                out["manifest"][cid] = await streamer.put_context(store, cid, kv, tokens, profile=profile,
                                                                  chunk_tokens=CHUNK_TOKENS)
        finally:
            await store.close()

    asyncio.run(put())
    return out


class CountingStore(FileStore):
    """A file store that counts the chunk reads the sender makes (one per REQUEST)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.requests: list[tuple[str, int, int | str]] = []

    async def get_chunk(self, context_id: str, version: str, chunk: int, level: int) -> bytes:
        self.requests.append((context_id, chunk, level))
        return await super().get_chunk(context_id, version, chunk, level)

    async def get_text(self, context_id: str, version: str, chunk: int) -> bytes:
        self.requests.append((context_id, chunk, "text"))
        return await super().get_text(context_id, version, chunk)


@pytest.fixture
async def sender(contexts):
    store = CountingStore(Path(contexts["root"]))
    server = await streamer.serve(store)
    server.counting_store = store
    yield server
    await server.close()
    await store.close()


_FAST_FAIL = {"max_reconnects": 1, "backoff": 0.01, "connect_timeout": 2.0}


@pytest.fixture
async def receive():
    """Factory: start a receiver daemon on a free port; all are closed at the end."""
    started = []

    async def start(servers, **config):
        session = SessionConfig(**{**_FAST_FAIL, **config.pop("session_options", {})})
        receiver = await start_receiver(ReceiverConfig(servers=list(servers), session=session, **config),
                                        "127.0.0.1", 0)
        started.append(receiver)
        return receiver

    yield start
    for receiver in started:
        await receiver.close()


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


async def _post(http: aiohttp.ClientSession, receiver, **body):
    async with http.post(f"{receiver.url}/fetch", json=body) as r:
        return r.status, await r.json()


async def _get_kv(http: aiohttp.ClientSession, receiver, cid: str):
    async with http.get(f"{receiver.url}/contexts/{cid}") as r:
        if r.status != 200:
            return r.status, None
        return r.status, load_safetensors(await r.read())


async def _metric(http: aiohttp.ClientSession, receiver, sample: str) -> float:
    """The value of one sample (name and labels exactly as exposed), 0 if absent."""
    async with http.get(f"{receiver.url}/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if not line.startswith("#") and line.rsplit(" ", 1)[0] == sample:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _events(http: aiohttp.ClientSession, url: str) -> list[tuple[float, str, dict]]:
    """Read a server-sent event stream to its end: (arrival time, event, data) each."""
    out: list[tuple[float, str, dict]] = []
    async with http.get(url) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        kind, data = None, None
        async for raw in r.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
            elif line == "" and kind is not None:
                out.append((time.monotonic(), kind, data))
                kind, data = None, None
    return out


# ---------------------------------------------------------------------------- fetching
async def test_fetch_reports_quality_and_serves_the_kv(contexts, sender, receive, http) -> None:
    receiver = await receive([("127.0.0.1", sender.port)])
    status, body = await _post(http, receiver, context_id="a", slo=5.0, policy="fixed:1")
    assert status == 200, body
    assert body["status"] == "fetched" and body["stored"] and body["quality_met"]
    assert body["version"] == contexts["manifest"]["a"].version
    assert body["quality"] == {"worst_level": 1, "levels": [1] * CHUNKS, "text_chunks": [],
                               "recomputed": [], "complete": True}
    assert body["kv"]["url"] == "/contexts/a" and body["kv"]["path"] is None
    assert body["kv"]["shape"] == [LAYERS, 2, TOKENS, HEADS, HEAD_DIM] and body["kv"]["dtype"] == "float16"
    assert len(body["report"]["chunks"]) == CHUNKS and body["report"]["bytes"] > 0
    status, tensors = await _get_kv(http, receiver, "a")
    assert status == 200
    assert tensors["kv"].shape == contexts["kv"]["a"].shape and tensors["text_ranges"].shape == (0, 2)
    assert _distortion(contexts["kv"]["a"], tensors["kv"]) < 2 * contexts["profile"].targets[1]


async def test_text_chunks_are_reported_with_their_token_ids(contexts, sender, receive, http) -> None:
    receiver = await receive([("127.0.0.1", sender.port)])
    status, body = await _post(http, receiver, context_id="b", slo=5.0, policy="text")
    assert status == 200, body
    quality = body["quality"]
    assert quality["text_chunks"] == list(range(CHUNKS)) and not quality["complete"]
    assert quality["worst_level"] is None
    tokens = contexts["tokens"]["b"]
    for item in body["text"]:
        assert item["token_ids"] == tokens[item["start"]:item["end"]]
    _, tensors = await _get_kv(http, receiver, "b")
    assert tensors["text_ranges"].tolist() == [[i * CHUNK_TOKENS, (i + 1) * CHUNK_TOKENS] for i in range(CHUNKS)]
    assert tensors["text_token_ids"].tolist() == tokens


async def test_concurrent_requests_share_one_fetch(contexts, sender, receive, http) -> None:
    async with netsim.ShapingProxy(upstream=("127.0.0.1", sender.port), trace=100.0) as proxy:
        receiver = await receive([("127.0.0.1", proxy.port)])
        results = await asyncio.gather(*[_post(http, receiver, context_id="a", slo=5.0, policy="fixed:2")
                                         for _ in range(8)])
    assert all(status == 200 for status, _ in results), results
    kinds = sorted(body["status"] for _, body in results)
    assert kinds.count("fetched") == 1 and set(kinds) <= {"fetched", "joined", "cached"}, kinds
    # one set of chunk transfers on the sender side, whatever the number of requests
    assert sorted(sender.counting_store.requests) == [("a", i, 2) for i in range(CHUNKS)]
    assert len({body["report"]["total_seconds"] for _, body in results}) == 1  # one report for all
    assert await _metric(http, receiver, 'kvwire_receiver_fetches_total{outcome="ok"}') == 1
    assert await _metric(http, receiver, "kvwire_receiver_fetch_joins_total") == kinds.count("joined")


async def test_cache_hit_needs_no_network_and_better_quality_refetches(contexts, sender, receive, http) -> None:
    receiver = await receive([("127.0.0.1", sender.port)])
    status, first = await _post(http, receiver, context_id="a", slo=5.0, policy="fixed:3")
    assert status == 200 and first["quality"]["worst_level"] == 3
    # as good or worse than cached: a hit (an adaptive policy takes what is there)
    for body in ({"policy": "fixed:4"}, {"min_level": 3}, {}, {"policy": "mpc"}):
        status, again = await _post(http, receiver, context_id="a", slo=5.0, **body)
        assert status == 200 and again["status"] == "cached", (body, again)
        assert again["report"] == first["report"]
    transfers = len(sender.counting_store.requests)
    # better than cached: refetched, at the level asked
    status, better = await _post(http, receiver, context_id="a", slo=5.0, min_level=1)
    assert status == 200 and better["status"] == "fetched", better
    assert better["quality"]["worst_level"] == 1 and better["quality_met"]
    assert len(sender.counting_store.requests) == transfers + CHUNKS
    # the sender goes away: the cache still answers, without a byte of network
    await sender.close()
    for body in ({"policy": "fixed:1"}, {"min_level": 2}, {}):
        status, hit = await _post(http, receiver, context_id="a", slo=5.0, **body)
        assert status == 200 and hit["status"] == "cached", hit
    status, tensors = await _get_kv(http, receiver, "a")
    assert status == 200 and _distortion(contexts["kv"]["a"], tensors["kv"]) < 2 * contexts["profile"].targets[1]
    # asking for better than cached now needs the sender: 503 with the reason
    status, error = await _post(http, receiver, context_id="a", slo=5.0, min_level=0)
    assert status == 503 and "sender unavailable" in error["error"], error
    assert await _metric(http, receiver, "kvwire_receiver_cache_hits_total") == 7
    assert await _metric(http, receiver, 'kvwire_receiver_cache_misses_total{reason="quality"}') == 2


async def test_events_arrive_in_order_before_the_fetch_ends(contexts, sender, receive, http) -> None:
    manifest = contexts["manifest"]["c"]
    total = sum(c.sizes[2] for c in manifest.chunks)
    rate_mbit = 8 * total / 0.8 / 1e6  # the fetch takes about 0.8 s
    async with netsim.ShapingProxy(upstream=("127.0.0.1", sender.port), trace=rate_mbit) as proxy:
        receiver = await receive([("127.0.0.1", proxy.port)])
        # the subscriber may come first: ?wait= holds it until the fetch starts
        events_task = asyncio.create_task(_events(http, f"{receiver.url}/contexts/c/events?wait=10"))
        await asyncio.sleep(0.05)
        status, started = await _post(http, receiver, context_id="c", slo=10.0, policy="fixed:2", wait=False)
        assert status == 202 and started["status"] == "running", started
        assert started["events"] == "/contexts/c/events"
        late_task = asyncio.create_task(_events(http, f"{receiver.url}/contexts/c/events"))
        status, result = await _post(http, receiver, context_id="c", slo=10.0, policy="fixed:2")
        finished_at = time.monotonic()
        events, late = await events_task, await late_task
    assert status == 200 and result["status"] == "joined"
    kinds = [kind for _, kind, _ in events]
    assert kinds[:2] == ["start", "manifest"] and kinds[-1] == "done"
    layers = [(d["chunk"], d["layer"]) for _, kind, d in events if kind == "layer"]
    assert layers == [(c, l) for c in range(CHUNKS) for l in range(LAYERS)]
    assert [d["chunk"] for _, kind, d in events if kind == "chunk"] == list(range(CHUNKS))
    assert all(d["level"] == 2 for _, kind, d in events if kind in ("layer", "chunk"))
    first_layer = next(t for t, kind, _ in events if kind == "layer")
    done_at = events[-1][0]
    assert done_at - first_layer > 0.3, "layer 0 must be usable well before the fetch ends"
    assert first_layer < finished_at - 0.3
    assert events[-1][2]["quality"]["worst_level"] == 2
    # a subscriber that came late replays everything, in the same order
    assert [(k, d) for _, k, d in late] == [(k, d) for _, k, d in events]
    # once it is cached: one "done" event
    after = await _events(http, f"{receiver.url}/contexts/c/events")
    assert [k for _, k, _ in after] == ["done"] and after[0][2]["status"] == "cached"


# ---------------------------------------------------------------------------- the cache
async def test_eviction_under_a_small_cache_and_persistence(contexts, sender, receive, http, tmp_path) -> None:
    cache_dir = tmp_path / "cache"
    entry_bytes = LAYERS * 2 * TOKENS * HEADS * HEAD_DIM * 2  # fp16 KV, plus a small header
    receiver = await receive([("127.0.0.1", sender.port)], cache_dir=str(cache_dir),
                             cache_bytes=int(1.5 * entry_bytes))
    for cid in ("a", "b"):
        status, body = await _post(http, receiver, context_id=cid, slo=5.0, policy="fixed:1")
        assert status == 200 and body["stored"], body
        assert body["kv"]["path"] == str(cache_dir / f"{cid}.safetensors")
    assert sorted(p.name for p in cache_dir.iterdir()) == ["b.safetensors"]
    assert (await _get_kv(http, receiver, "a"))[0] == 404
    assert (await _get_kv(http, receiver, "b"))[0] == 200
    assert await _metric(http, receiver, "kvwire_receiver_cache_evictions_total") == 1
    async with http.get(f"{receiver.url}/contexts") as r:
        listing = await r.json()
    assert [c["context_id"] for c in listing["contexts"]] == ["b"] and listing["bytes"] <= listing["max_bytes"]
    await receiver.close()
    # a new daemon on the same directory finds "b" without any sender
    port = sender.port
    await sender.close()
    restarted = await receive([("127.0.0.1", port)], cache_dir=str(cache_dir),
                              cache_bytes=int(1.5 * entry_bytes))
    status, body = await _post(http, restarted, context_id="b", slo=5.0, policy="fixed:1")
    assert status == 200 and body["status"] == "cached", body
    status, tensors = await _get_kv(http, restarted, "b")
    assert status == 200 and _distortion(contexts["kv"]["b"], tensors["kv"]) < 2 * contexts["profile"].targets[1]


async def test_a_context_larger_than_the_cache_is_refused_before_it_is_fetched(contexts, sender, receive,
                                                                               http) -> None:
    """The manifest says what a context decodes to (the sender controls it): one larger than
    the receiver's cache could never be kept, nor served, so it is 413 before any chunk."""
    receiver = await receive([("127.0.0.1", sender.port)], cache_bytes=1000)
    status, body = await _post(http, receiver, context_id="a", slo=5.0, policy="fixed:4")
    assert status == 413 and "over this receiver's limit of 1000" in body["error"], body
    assert (await _get_kv(http, receiver, "a"))[0] == 404


# ---------------------------------------------------------------------------- errors
async def test_bad_requests_get_clear_4xx(contexts, sender, receive, http) -> None:
    receiver = await receive([("127.0.0.1", sender.port)])
    url = f"{receiver.url}/fetch"
    cases = [
        (b"{not json", 400, "malformed JSON"),
        (b"", 400, "malformed JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (json.dumps({"slo": 1.0}).encode(), 400, "context_id"),
        (json.dumps({"context_id": "a", "slo": 0}).encode(), 400, "slo"),
        (json.dumps({"context_id": "a", "slo": -1.5}).encode(), 400, "slo"),
        (json.dumps({"context_id": "a", "slo": "fast"}).encode(), 400, "slo"),
        (json.dumps({"context_id": "a", "policy": "best"}).encode(), 400, "unknown policy"),
        (json.dumps({"context_id": "a", "min_level": -1}).encode(), 400, "min_level"),
        (json.dumps({"context_id": "../etc", "slo": 1}).encode(), 400, "invalid context id"),
        (json.dumps({"context_id": "a", "colour": "red"}).encode(), 400, "unknown field"),
    ]
    for data, want, words in cases:
        async with http.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
            body = await r.json()
            assert r.status == want and words in body["error"], (data, r.status, body)
    # unknown context: 404 with the sender's message
    status, body = await _post(http, receiver, context_id="nope", slo=1.0)
    assert status == 404 and "'nope' not found" in body["error"], body
    async with http.get(f"{receiver.url}/contexts/nope") as r:
        assert r.status == 404
    async with http.get(f"{receiver.url}/contexts/nope/events") as r:
        assert r.status == 404 and "not cached" in (await r.json())["error"]
    async with http.get(f"{receiver.url}/no/such/route") as r:
        assert r.status == 404
    # the daemon is unharmed
    status, body = await _post(http, receiver, context_id="a", slo=5.0, policy="fixed:4")
    assert status == 200
    assert await _metric(http, receiver, 'kvwire_receiver_errors_total{status="400"}') == len(cases)
    assert await _metric(http, receiver, 'kvwire_receiver_fetches_total{outcome="not_found"}') == 1


async def _raw(receiver, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes on a fresh connection; the response's status, headers and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", receiver.port)
    try:
        writer.write(data)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
        body = await asyncio.wait_for(reader.readexactly(int(headers.get("Content-Length", 0))), 10)
        return int(lines[0].split()[1]), headers, body
    finally:
        writer.close()


async def test_hostile_requests_get_typed_4xx_and_the_daemon_stays_up(receive, http) -> None:
    """Malformed and oversized requests (#15): each a 4xx naming the cause, none a 500."""
    receiver = await receive([("127.0.0.1", closed_port())])

    def post(body: bytes, length: int | None = None) -> bytes:
        return (b"POST /fetch HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (len(body) if length is None
                                                                                      else length)) + body

    cases = [
        (post(b"[" * 50000), 400, b"nested too deeply"),                                  # was 500
        (post(b'{"context_id": "a", "min_level": ' + b"9" * 5000 + b"}"), 400, b"malformed JSON"),   # was 500
        (post(b"{", length=1 << 40), 413, b"at most 65536 bytes"),                      # the body is never read
        (b"GET /contexts/a%ff HTTP/1.1\r\nHost: x\r\n\r\n", 400, b"not UTF-8"),
        (b"GET /contexts/a\xff HTTP/1.1\r\nHost: x\r\n\r\n", 400, b"Invalid char in url path"),
        (b"GET /contexts/" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 400, b"8190 bytes"),
        (b"GET /contexts HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 40 + b"\r\n", 400, b"Too many headers"),
        (b"GET /contexts HTTP/1.1\r\nHost: x\r\nX-A: " + b"b" * 9000 + b"\r\n\r\n", 400, b"8190 bytes"),
        (b"DELETE /contexts/a HTTP/1.1\r\nHost: x\r\n\r\n", 405, b"not allowed"),
        (b"GET /contexts/a/events?wait=1e999 HTTP/1.1\r\nHost: x\r\n\r\n", 400, b"between 0 and 3600"),
    ]
    for data, want, words in cases:
        status, headers, body = await _raw(receiver, data)
        assert status == want and words in body, (data[:60], status, body[:200])
        if status == 405:
            assert headers["Allow"] == "GET, HEAD"
    async with http.get(f"{receiver.url}/contexts") as r:   # the daemon is unharmed
        assert r.status == 200
    assert await _metric(http, receiver, 'kvwire_receiver_errors_total{status="500"}') == 0


async def test_a_body_that_does_not_arrive_in_time_is_408(receive, monkeypatch) -> None:
    from streamer.receiver import requests

    monkeypatch.setattr(requests, "BODY_TIMEOUT", 0.3)
    receiver = await receive([("127.0.0.1", closed_port())])
    status, _, body = await _raw(receiver, b"POST /fetch HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    assert status == 408 and b"did not arrive within" in body, body


async def test_a_fixed_level_beyond_the_ladder_is_400_fetched_or_cached(contexts, sender, receive, http) -> None:
    receiver = await receive([("127.0.0.1", sender.port)])
    for body in ({"policy": "fixed:9"}, {"min_level": 9}):   # min_level alone means fixed:9
        status, error = await _post(http, receiver, context_id="b", slo=5.0, **body)
        assert status == 400 and "level 9" in error["error"] and "levels 0-4" in error["error"], error
    status, _ = await _post(http, receiver, context_id="b", slo=5.0, policy="fixed:4")
    assert status == 200
    status, error = await _post(http, receiver, context_id="b", slo=5.0, policy="fixed:9")   # a cache hit
    assert status == 400 and "levels 0-4" in error["error"], error
    status, hit = await _post(http, receiver, context_id="b", slo=5.0, policy="mpc", min_level=9)
    assert status == 200 and hit["status"] == "cached"   # a floor past the ladder is no floor


async def test_unreachable_sender_is_503_with_the_reason(contexts, receive, http) -> None:
    dead = closed_port()   # a port nobody listens on
    receiver = await receive([("127.0.0.1", dead)])
    status, body = await _post(http, receiver, context_id="a", slo=1.0)
    assert status == 503 and "could not reach a sender" in body["error"], body
    async with http.get(f"{receiver.url}/healthz") as r:   # not "ok" when no sender answers
        health = await r.json()
        assert r.status == 503 and health["status"] == "no_sender", health
    [probe] = health["senders"]
    assert probe["address"] == f"127.0.0.1:{dead}" and not probe["reachable"]
    assert "cannot connect" in probe["error"]
    assert await _metric(http, receiver, 'kvwire_receiver_fetches_total{outcome="unavailable"}') == 1


async def test_a_dead_first_sender_falls_back_to_the_next(contexts, sender, receive, http) -> None:
    dead = closed_port()   # a port nobody listens on
    receiver = await receive([("127.0.0.1", dead), ("127.0.0.1", sender.port)])
    status, body = await _post(http, receiver, context_id="a", slo=5.0, policy="fixed:3")
    assert status == 200 and body["quality"]["worst_level"] == 3, body


async def test_healthz_and_metrics(contexts, sender, receive, http) -> None:
    receiver = await receive([("127.0.0.1", sender.port)])
    async with http.get(f"{receiver.url}/healthz") as r:
        health = await r.json()
    assert r.status == 200 and health["status"] == "ok" and health["servers"] == [f"127.0.0.1:{sender.port}"]
    assert [(s["address"], s["reachable"]) for s in health["senders"]] == [(f"127.0.0.1:{sender.port}", True)]
    await _post(http, receiver, context_id="a", slo=5.0, policy="fixed:2")
    await _post(http, receiver, context_id="a", slo=5.0, policy="fixed:2")
    async with http.get(f"{receiver.url}/metrics") as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    for name in ("kvwire_receiver_fetches_total", "kvwire_receiver_received_bytes_total",
                 "kvwire_receiver_cache_hits_total", "kvwire_receiver_cache_misses_total",
                 "kvwire_receiver_cache_evictions_total", "kvwire_receiver_errors_total",
                 "kvwire_receiver_cache_bytes", "kvwire_receiver_fetch_seconds_bucket"):
        assert name in text, name
    expected = sum(c.sizes[2] for c in contexts["manifest"]["a"].chunks)
    assert await _metric(http, receiver, "kvwire_receiver_received_bytes_total") == expected
    assert await _metric(http, receiver, "kvwire_receiver_cache_hits_total") == 1
    assert await _metric(http, receiver, 'kvwire_receiver_chunks_total{level="2"}') == CHUNKS
    assert await _metric(http, receiver, "kvwire_receiver_cache_entries") == 1


async def test_healthz_names_a_sender_that_refuses_the_handshake(contexts, sender, receive, http) -> None:
    """A sender that is up but refuses us (here: we hold a token, it does not authenticate)
    is not a healthy one."""
    dead = closed_port()   # a port nobody listens on
    receiver = await receive([("127.0.0.1", sender.port)], session_options={"auth_token": "t" * 16})
    async with http.get(f"{receiver.url}/healthz") as r:
        health = await r.json()
    assert r.status == 503 and health["status"] == "no_sender"
    assert "authenticat" in health["senders"][0]["error"], health
    receiver = await receive([("127.0.0.1", dead), ("127.0.0.1", sender.port)])
    async with http.get(f"{receiver.url}/healthz") as r:   # one of two answering is enough
        health = await r.json()
    assert r.status == 200 and [s["reachable"] for s in health["senders"]] == [False, True]


# ---------------------------------------------------------------------------- shutdown
async def test_shutdown_cancels_a_running_fetch_and_leaves_the_cache_consistent(
        contexts, sender, receive, http, tmp_path) -> None:
    cache_dir = tmp_path / "cache"
    manifest = contexts["manifest"]["a"]
    rate_mbit = 8 * sum(c.sizes[0] for c in manifest.chunks) / 20.0 / 1e6  # a 20 s fetch
    async with netsim.ShapingProxy(upstream=("127.0.0.1", sender.port)) as proxy:
        receiver = await receive([("127.0.0.1", proxy.port)], cache_dir=str(cache_dir),
                                 shutdown_grace=0.2)
        status, body = await _post(http, receiver, context_id="b", slo=5.0, policy="fixed:4")
        assert status == 200 and body["stored"], body
        proxy.set_trace(rate_mbit, direction="down")
        waiting = asyncio.create_task(_post(http, receiver, context_id="a", slo=60.0, policy="fixed:0"))
        events = asyncio.create_task(_events(http, f"{receiver.url}/contexts/a/events?wait=10"))
        while not receiver.fetcher.inflight:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        await receiver.close()   # cancels the 20 s fetch after the grace: its waiter gets 503
        status, body = await waiting
        stream = await events
    assert status == 503 and "shutting down" in body["error"], body
    assert stream[-1][1] == "error" and stream[-1][2]["status"] == 503
    # only the finished context is on disk, and no temp file
    assert sorted(p.name for p in cache_dir.iterdir()) == ["b.safetensors"]
    with pytest.raises(aiohttp.ClientConnectionError):
        await _post(http, receiver, context_id="b", slo=1.0)


async def test_sigterm_stops_the_cli_daemon_cleanly(contexts, sender, http, tmp_path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "streamer.tools.cli", "receive", "--listen", "127.0.0.1:0",
        "--servers", f"127.0.0.1:{sender.port}", "--cache", str(tmp_path / "cache"), "--cache-bytes", "64M",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env)
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        while "<-" not in line:
            assert line, "the daemon exited before listening"
            line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        url = line.split()[2]
        async with http.post(f"{url}/fetch", json={"context_id": "a", "slo": 5.0, "policy": "fixed:3"}) as r:
            body = await r.json()
            assert r.status == 200 and body["quality"]["worst_level"] == 3, body
        proc.send_signal(signal.SIGTERM)
        rest = (await asyncio.wait_for(proc.stdout.read(), 30)).decode()
        assert await proc.wait() == 0, rest
        assert "shutting down" in rest
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["a.safetensors"]


async def test_shutdown_lets_a_fetch_finish_within_the_grace(contexts, sender, receive, http, tmp_path) -> None:
    cache_dir = tmp_path / "cache"
    rate_mbit = 8 * sum(c.sizes[3] for c in contexts["manifest"]["c"].chunks) / 0.6 / 1e6  # a 0.6 s fetch
    async with netsim.ShapingProxy(upstream=("127.0.0.1", sender.port), trace=rate_mbit) as proxy:
        receiver = await receive([("127.0.0.1", proxy.port)], cache_dir=str(cache_dir), shutdown_grace=10.0)
        waiting = asyncio.create_task(_post(http, receiver, context_id="c", slo=10.0, policy="fixed:3"))
        while not receiver.fetcher.inflight:
            await asyncio.sleep(0.01)
        await receiver.close()
        status, body = await waiting
    assert status == 200 and body["status"] == "fetched" and body["stored"], body
    assert sorted(p.name for p in cache_dir.iterdir()) == ["c.safetensors"]


def test_cli_arguments() -> None:
    import argparse

    from streamer.tools.cli import build_parser
    from streamer.tools.receive import parse_bytes, parse_servers

    assert parse_bytes("65536") == 65536 and parse_bytes("512M") == 512 << 20 and parse_bytes("1.5g") == 3 << 29
    assert parse_bytes("4GiB") == 4 << 30
    assert parse_servers("a:1,b:2") == [("a", 1), ("b", 2)]
    for bad in ("lots", "-1G"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_bytes(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_servers(",")
    args = build_parser().parse_args(["receive", "--servers", "h1:7410,h2", "--cache-bytes", "1G"])
    assert args.servers == [("h1", 7410), ("h2", 7410)] and args.cache_bytes == 1 << 30
    assert args.listen == ("127.0.0.1", 7420) and args.device == "cpu" and callable(args.handler)


async def test_a_device_that_cannot_decode_fails_at_start() -> None:
    try:
        import codec

        codec.section_decoder("cuda")
        pytest.skip("this machine decodes on cuda")
    except Exception:
        pass
    with pytest.raises(ValueError, match="cannot decode"):
        await start_receiver(ReceiverConfig(servers=[("127.0.0.1", 1)], device="cuda"), "127.0.0.1", 0)


async def test_fetches_reuse_the_connection_to_the_sender(contexts, sender, receive, http) -> None:
    receiver = await receive([("127.0.0.1", sender.port)])
    for context_id in ("a", "b"):
        status, body = await _post(http, receiver, context_id=context_id, slo=5.0, policy="fixed:3")
        assert status == 200 and body["status"] == "fetched", body
    assert await _metric(http, receiver, "kvwire_receiver_connections_reused_total") == 1


class DamagingStore(FileStore):
    """Serves chunk 1's level-2 blob with layer 2's section always damaged."""

    async def get_chunk(self, context_id: str, version: str, chunk: int, level: int) -> bytes:
        blob = await super().get_chunk(context_id, version, chunk, level)
        if (chunk, level) != (1, 2):
            return blob
        damaged = bytearray(blob)
        damaged[codec.parse_header(blob).section_offset(2) + 9] ^= 0x40
        return bytes(damaged)


async def test_a_chunk_that_stays_corrupt_after_layers_went_out_is_superseded(contexts, receive, http) -> None:
    """Layers 0-1 of chunk 1 are delivered, layer 2 stays corrupt: the chunk comes as
    text, and the event stream says its delivered layers are void before the text."""
    store = DamagingStore(Path(contexts["root"]))
    server = await streamer.serve(store)
    try:
        receiver = await receive([("127.0.0.1", server.port)])
        events_task = asyncio.create_task(_events(http, f"{receiver.url}/contexts/c/events?wait=10"))
        await asyncio.sleep(0.05)
        status, result = await _post(http, receiver, context_id="c", slo=10.0, policy="fixed:2")
        events = await events_task
    finally:
        await server.close()
        await store.close()
    assert status == 200, result
    kinds = [(kind, d.get("chunk")) for _, kind, d in events if kind in ("layer", "superseded", "text")]
    chunk1 = [kind for kind, chunk in kinds if chunk == 1]
    assert chunk1 == ["layer", "layer", "superseded", "text"], chunk1
    superseded = next(d for _, kind, d in events if kind == "superseded")
    assert superseded == {"chunk": 1, "layers": 2}
    report = next(d for _, kind, d in events if kind == "done")["report"]
    assert report["chunks"][1]["level"] == "text" and report["chunks"][1]["superseded_layers"] == 2


async def test_repeated_fetches_keep_no_per_fetch_state(contexts, sender, receive, http) -> None:
    """A long-running receiver's memory must not grow with the fetches it has made: once
    they are over, no job, session or event log survives, and the idle connections stay
    within their bound (RSS is ``kvwire bench load``'s business: the machine is shared)."""
    import gc

    from streamer.net.session import StreamSession
    from streamer.receiver.fetcher import MAX_IDLE_CONNECTIONS, FetchJob

    receiver = await receive([("127.0.0.1", sender.port)])
    for i in range(12):
        status, body = await _post(http, receiver, context_id=CONTEXTS[i % len(CONTEXTS)], refresh=True)
        assert status == 200 and body["status"] == "fetched", body
    fetcher = receiver.fetcher
    assert fetcher.inflight == {}
    assert all(len(idle) <= MAX_IDLE_CONNECTIONS for idle in fetcher._idle.values())
    gc.collect()
    alive = [o for o in gc.get_objects() if type(o) in (FetchJob, StreamSession)]
    assert alive == []


async def test_each_fetch_plans_its_first_chunks_at_the_decoder_cost_the_last_one_measured(
        contexts, sender, receive, http, monkeypatch) -> None:
    from streamer.adapt import decoding
    from streamer.net import session as session_module

    priors = []
    opened = session_module.StreamSession.__init__

    def recording(self, *args, **kwargs):
        opened(self, *args, **kwargs)
        priors.append(self.config.decode_prior)

    monkeypatch.setattr(session_module.StreamSession, "__init__", recording)
    receiver = await receive([("127.0.0.1", sender.port)])
    for context_id in ("a", "b"):
        status, body = await _post(http, receiver, context_id=context_id, slo=5.0, policy="fixed:3")
        assert status == 200 and body["status"] == "fetched", body
    measured = receiver.fetcher.decode_prior
    assert isinstance(measured, decoding.DecodeCost) and measured.seconds_per_token > 0
    assert priors[0] is None and isinstance(priors[1], decoding.DecodeCost)
