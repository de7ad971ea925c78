"""The receiver daemon's API token, exposure rule, cached /healthz probe and per-client
fetch limit (issue 39, item 1), on real sockets against real sender daemons: every
route but /livez answers 401 without the token (the route list comes from
``requests.ROUTES``, so a new route cannot be left out), the daemon refuses to listen
off loopback without one (Python and ``kvwire receive``), a /healthz flood costs each
sender one handshake per interval, and a client past its running fetches gets 429."""
from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

import codec
import streamer
from streamer_helpers import put_context_now, synthetic_kv
from test_streamer_store import closed_port
from streamer.net.config import SessionConfig
from streamer.net.sender import InsecureConfiguration, ServerConfig
from streamer.receiver import ReceiverConfig, daemon, http as receiver_http, requests, start_receiver
from streamer.receiver.daemon import Receiver, check_exposure
from streamer.store.file import FileStore

TOKEN = "receiver-api-token-0123456789"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
CONTEXTS = ("c0", "c1", "c2")
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def store_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Three small two-chunk contexts in one file store."""
    root = str(tmp_path_factory.mktemp("store"))
    profile = codec.calibrate([synthetic_kv(1, 512, 2, 4, 32)])
    for i, cid in enumerate(CONTEXTS):
        put_context_now(root, cid, synthetic_kv(10 + i, 256, 2, 4, 32), list(range(256)), profile=profile,
                        chunk_tokens=128)
    return root


class GatedStore(FileStore):
    """A file store whose chunk reads wait for ``gate``: fetches stay running until it opens."""

    def __init__(self, root: str) -> None:
        super().__init__(Path(root))
        self.gate = asyncio.Event()

    async def get_chunk(self, context_id: str, version: str, chunk: int, level: int) -> bytes:
        await self.gate.wait()
        return await super().get_chunk(context_id, version, chunk, level)


@pytest.fixture
async def senders(store_root):
    """Factory: a sender over the contexts (its chunk reads gated), counting its connections."""
    started = []

    async def start():
        store = GatedStore(store_root)
        store.gate.set()
        sender = await streamer.serve(store, config=ServerConfig(metrics=True))
        started.append((sender, store))
        return sender, store

    yield start
    for sender, store in started:
        store.gate.set()
        await sender.close()
        await store.close()


def handshakes(sender) -> float:
    return sender.metrics.value("kvwire_sender_sessions_total")


@pytest.fixture
async def receive():
    """Factory: a receiver daemon on 127.0.0.1, an ephemeral port; all closed at the end."""
    started = []

    async def start(ports, **config):
        session = SessionConfig(max_reconnects=1, backoff=0.01, connect_timeout=2.0)
        receiver = await start_receiver(ReceiverConfig(servers=[("127.0.0.1", p) for p in ports],
                                                       session=session, trim_seconds=None, **config),
                                        "127.0.0.1", 0)
        started.append(receiver)
        return receiver

    yield start
    for receiver in started:
        await receiver.close()


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


# ---------------------------------------------------------------------------- the token
#: a request target for each route that takes a context id (the others: "/" + the route)
_TARGETS = {"context": "/contexts/c0", "events": "/contexts/c0/events"}
_FETCH = {"context_id": "c0", "slo": 5.0, "policy": "fixed:1"}


def _requests() -> list[tuple[str, str, str]]:
    """(route, method, target) for every method of every route, ``POST /fetch`` first (the
    others then find c0 fetched)."""
    assert set(requests.ROUTES) == set(receiver_http.HANDLERS)
    out = []
    for route, (methods, _) in requests.ROUTES.items():
        target = _TARGETS.get(route, "/" + route)
        for method in methods:
            assert requests.parse_head(method, target, {}).route == route, (method, target)
            out.append((route, method, target))
    return sorted(out, key=lambda r: r[0] != "fetch")


async def _ask(http: aiohttp.ClientSession, receiver, method: str, target: str, headers: dict) -> tuple:
    body = _FETCH if method == "POST" else None
    async with http.request(method, receiver.url + target, json=body, headers=headers) as r:
        return r.status, r.headers, await r.read()


async def test_every_route_but_livez_needs_the_token(senders, receive, http) -> None:
    sender, _ = await senders()
    receiver = await receive([sender.port], api_token=TOKEN)
    wrong = [{}, {"Authorization": "Bearer " + TOKEN[:-1]}, {"Authorization": "Bearer " + TOKEN + "x"},
             {"Authorization": f"Basic {TOKEN}"}, {"Authorization": TOKEN}, {"Authorization": "Bearer"},
             {"Authorization": "Bearer \u00e9" + TOKEN[1:]}]
    for route, method, target in _requests():
        for headers in wrong:
            status, answer, body = await _ask(http, receiver, method, target, headers)
            if route == requests.PUBLIC_ROUTE:
                assert status == 200 and body == (b"" if method == "HEAD" else b"ok"), (target, body)
                continue
            assert status == 401, (method, target, headers, status, body)
            assert answer["WWW-Authenticate"].startswith('Bearer realm="kvwire"')
            if method != "HEAD":
                assert answer["Content-Type"].startswith("application/json")
                assert body.startswith(b'{"error": ') and b'"status": 401' in body, body
    assert handshakes(sender) == 0   # nothing refused reached a sender: no fetch, no probe
    for route, method, target in _requests():
        for scheme in ("Bearer", "bearer"):   # the scheme is case-insensitive (RFC 9110 11.1)
            status, _, body = await _ask(http, receiver, method, target, {"Authorization": f"{scheme} {TOKEN}"})
            assert status == 200, (method, target, status, body)
    assert await _metric(http, receiver, 'kvwire_receiver_errors_total{status="401"}') > 0


async def _metric(http: aiohttp.ClientSession, receiver, sample: str) -> float:
    async with http.get(f"{receiver.url}/metrics", headers=BEARER) as r:
        for line in (await r.text()).splitlines():
            if not line.startswith("#") and line.rsplit(" ", 1)[0] == sample:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _raw(receiver, data: bytes) -> tuple[int, bytes]:
    """Send raw bytes on a fresh connection; the response's status and head."""
    reader, writer = await asyncio.open_connection("127.0.0.1", receiver.port)
    try:
        writer.write(data)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
        return int(head.split()[1]), head
    finally:
        writer.close()


async def test_without_the_token_nothing_but_the_401_is_parsed_or_read(receive) -> None:
    receiver = await receive([closed_port()], api_token=TOKEN)
    # a body that never comes: the 401 does not wait for it (BODY_TIMEOUT is 10 s)
    status, head = await _raw(receiver, b"POST /fetch HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
    assert status == 401 and b"WWW-Authenticate: Bearer" in head
    for target in (b"/no/such/route", b"/contexts/..", b"/contexts/a?colour=red", b"/livez/", b"/%6civez"):
        status, _ = await _raw(receiver, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 401, target   # not a 400 or 404 that would describe the API
    status, _ = await _raw(receiver, b"GET /livez?x=1 HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 400   # /livez is parsed like any route, only without the token
    status, _ = await _raw(receiver, b"POST /livez HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    assert status == 405


async def test_without_a_token_on_loopback_every_route_is_open(senders, receive, http, tmp_path) -> None:
    sender, _ = await senders()
    receiver = await receive([sender.port], cache_dir=str(tmp_path))   # (a streamed GET /contexts/ID)
    for _, method, target in _requests():
        status, _, body = await _ask(http, receiver, method, target, {})
        assert status == 200, (method, target, body)
        assert method != "HEAD" or body == b"", (target, body[:80])   # the streamed routes too


# ---------------------------------------------------------------------------- exposure
async def test_a_non_loopback_address_without_a_token_is_refused() -> None:
    config = ReceiverConfig(servers=[("127.0.0.1", 1)], trim_seconds=None)
    for host in ("0.0.0.0", "::", "10.1.2.3", "", None):
        with pytest.raises(InsecureConfiguration, match="--api-token-file FILE or \\$KVWIRE_RECEIVER_TOKEN"):
            await start_receiver(config, host, 0)
        with pytest.raises(ValueError, match="without an API token"):   # InsecureConfiguration is one
            await Receiver(config).start(host, 0)
    for host in ("127.0.0.1", "::1", "localhost"):
        assert check_exposure(host, config) is None
    # with a token, or the risk accepted: allowed, with a warning each
    tokened = ReceiverConfig(servers=[("127.0.0.1", 1)], api_token=TOKEN)
    assert "in clear" in check_exposure("0.0.0.0", tokened)
    insecure = ReceiverConfig(servers=[("127.0.0.1", 1)], allow_insecure=True)
    assert "NO authentication" in check_exposure("0.0.0.0", insecure)


async def test_the_exposure_warning_is_logged_at_start(caplog) -> None:
    config = ReceiverConfig(servers=[("127.0.0.1", 1)], trim_seconds=None, api_token=TOKEN)
    with caplog.at_level(logging.WARNING, logger="kvwire.receiver"):
        receiver = await Receiver(config).start("0.0.0.0", 0)
        await receiver.close()
    assert any("plain HTTP" in r.getMessage() for r in caplog.records)


def test_the_token_config() -> None:
    config = ReceiverConfig(servers=[("h", 1)], api_token=TOKEN)
    assert config.api_token == TOKEN.encode() and TOKEN not in repr(config)
    assert ReceiverConfig(servers=[("h", 1)], api_token=TOKEN.encode()).api_token == TOKEN.encode()
    with pytest.raises(ValueError, match="at least 16"):
        ReceiverConfig(servers=[("h", 1)], api_token="short")
    for bad in ("has a space in it!!", "caf\u00e9-0123456789abcdef", "tab\t0123456789abcdef"):
        with pytest.raises(ValueError, match="printable ASCII"):
            ReceiverConfig(servers=[("h", 1)], api_token=bad)
    with pytest.raises(ValueError, match="max_fetches_per_client"):
        ReceiverConfig(servers=[("h", 1)], max_fetches_per_client=0)


def test_cli_refuses_a_non_loopback_address_without_a_token_in_one_line() -> None:
    env = {k: v for k, v in os.environ.items() if k != daemon.API_TOKEN_ENV}
    done = subprocess.run([sys.executable, "-m", "streamer.tools.cli", "receive", "--listen", "0.0.0.0:0",
                           "--servers", "127.0.0.1:9"], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2, done
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("kvwire receive: refusing") and "--api-token-file" in lines[0]
    assert "--insecure-no-auth" in lines[0] and done.stdout == ""


def test_cli_reads_the_token_from_a_file_or_the_environment(tmp_path, monkeypatch) -> None:
    from streamer.tools.cli import build_parser
    from streamer.tools.receive import api_token

    def parse(*extra: str):
        return build_parser().parse_args(["receive", "--servers", "h:1", *extra])

    monkeypatch.delenv(daemon.API_TOKEN_ENV, raising=False)
    args = parse()
    assert api_token(args) is None and not args.insecure_no_auth and args.max_fetches_per_client == 8
    monkeypatch.setenv(daemon.API_TOKEN_ENV, f" {TOKEN}\n")
    assert api_token(parse()) == TOKEN.encode()
    path = tmp_path / "token"
    path.write_text("from-the-file-0123456789\n")
    path.chmod(0o600)
    assert api_token(parse("--api-token-file", str(path))) == b"from-the-file-0123456789"   # the file wins
    monkeypatch.setenv(daemon.API_TOKEN_ENV, "short")
    with pytest.raises(ValueError, match="at least 16"):
        api_token(parse())
    args = parse("--insecure-no-auth", "--max-fetches-per-client", "3")
    assert args.insecure_no_auth and args.max_fetches_per_client == 3


# ---------------------------------------------------------------------------- /healthz
async def test_a_healthz_flood_costs_each_sender_one_handshake_per_interval(
        senders, receive, http, monkeypatch) -> None:
    (a, _), (b, _) = await senders(), await senders()
    receiver = await receive([a.port, b.port], api_token=TOKEN)
    monkeypatch.setattr(daemon, "PROBE_INTERVAL", 60.0)

    async def healthz(headers: dict) -> int:
        async with http.get(f"{receiver.url}/healthz", headers=headers) as r:
            await r.read()
            return r.status

    assert set(await asyncio.gather(*(healthz({}) for _ in range(100)))) == {401}
    assert (handshakes(a), handshakes(b)) == (0, 0)
    # 1000 at once: the first starts the probe, those during it share it, the rest get its result
    assert set(await asyncio.gather(*(healthz(BEARER) for _ in range(1000)))) == {200}
    assert (handshakes(a), handshakes(b)) == (1, 1)
    # once the interval has passed, the next request starts a new round, and only it
    monkeypatch.setattr(daemon, "PROBE_INTERVAL", 0.2)
    await asyncio.sleep(0.25)
    assert await healthz(BEARER) == 200
    monkeypatch.setattr(daemon, "PROBE_INTERVAL", 60.0)
    assert set(await asyncio.gather(*(healthz(BEARER) for _ in range(50)))) == {200}
    assert (handshakes(a), handshakes(b)) == (2, 2)
    async with http.get(f"{receiver.url}/healthz", headers=BEARER) as r:
        health = await r.json()
    assert health["status"] == "ok" and [s["reachable"] for s in health["senders"]] == [True, True]


# ---------------------------------------------------------------------------- the fetch limit
async def _start_fetch(receiver, cid: str, headers: dict, source: str = "127.0.0.1", **body) -> tuple:
    """POST /fetch with ``"wait": false`` from the address ``source``: (status, headers, answer)."""
    connector = aiohttp.TCPConnector(local_addr=(source, 0))
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as http:
        async with http.post(f"{receiver.url}/fetch", json={"context_id": cid, "slo": 10.0, "wait": False, **body},
                             headers=headers) as r:
            return r.status, r.headers, await r.json()


async def test_a_client_past_its_running_fetches_gets_429(senders, receive) -> None:
    sender, store = await senders()
    store.gate.clear()   # every fetch stays running until the gate opens
    receiver = await receive([sender.port], max_fetches_per_client=2)
    assert (await _start_fetch(receiver, "c0", {}))[0] == 202
    assert (await _start_fetch(receiver, "c1", {}))[0] == 202
    status, headers, answer = await _start_fetch(receiver, "c2", {})
    assert status == 429 and headers["Retry-After"] == "1", answer
    assert answer["status"] == 429 and "2 fetches started by peer 127.0.0.1" in answer["error"]
    assert "max_fetches_per_client" in answer["error"]
    # joining a running fetch costs the senders nothing: never refused
    status, _, answer = await _start_fetch(receiver, "c0", {})
    assert status == 202 and answer["status"] == "running", answer
    # another peer address is another client
    status, _, answer = await _start_fetch(receiver, "c2", {}, source="127.0.0.2")
    assert status == 202, answer
    store.gate.set()   # the fetches end, and with them their places
    while receiver.fetcher.inflight:
        await asyncio.sleep(0.01)
    assert receiver.fetcher.per_client == {}
    status, _, answer = await _start_fetch(receiver, "c0", {}, refresh=True)
    assert status == 202, answer


async def test_with_a_token_all_its_holders_are_one_client(senders, receive) -> None:
    sender, store = await senders()
    store.gate.clear()
    receiver = await receive([sender.port], api_token=TOKEN, max_fetches_per_client=1)
    assert (await _start_fetch(receiver, "c0", BEARER))[0] == 202
    status, _, answer = await _start_fetch(receiver, "c1", BEARER, source="127.0.0.2")
    assert status == 429 and "the holders of the API token" in answer["error"], answer
    store.gate.set()


# ---------------------------------------------------------------------------- the example
async def test_the_example_client_sends_the_token(senders, receive, tmp_path) -> None:
    sender, _ = await senders()
    receiver = await receive([sender.port], api_token=TOKEN)
    env = {k: v for k, v in os.environ.items() if k != daemon.API_TOKEN_ENV}

    async def run(*extra: str) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(REPO / "examples" / "receiver_client.py"), "--receiver", receiver.url,
            "--context", "c1", "--slo", "5", *extra, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        return proc.returncode, out.decode()

    code, out = await run()
    assert code == 1 and "error 401" in out, out
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    code, out = await run("--token-file", str(path))
    assert code == 0 and "c1: worst level" in out and "'kv'" in out, out
