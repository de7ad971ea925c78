"""Sender observability: Prometheus counters move with real fetches and are scraped over
HTTP; every connection log line carries a session id; ``--log-json`` lines parse."""
from __future__ import annotations

import asyncio
import json
import logging
import urllib.request

import pytest
import torch

import codec
import streamer
from streamer_helpers import put_context_now, synthetic_kv
from streamer.tools import serve_fetch as commands
from streamer.net.client import ServerError
from streamer.net.sender_metrics import JsonFormatter, SenderMetrics, TextFormatter
from streamer.net.sender import ServerConfig

LAYERS, HEADS, HEAD_DIM, CHUNK_TOKENS, CHUNKS = 2, 4, 32, 64, 4


def _kv(seed: int, tokens: int) -> torch.Tensor:
    return synthetic_kv(seed, tokens, LAYERS, HEADS, HEAD_DIM)


@pytest.fixture(scope="module")
def store_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("metrics-store"))
    profile = codec.calibrate([_kv(1, 1024)])

    put_context_now(root, "ctx", _kv(2, CHUNKS * CHUNK_TOKENS), [i % 3000 for i in range(CHUNKS * CHUNK_TOKENS)],
                    profile=profile, chunk_tokens=CHUNK_TOKENS)
    return root


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def _sample(text: str, name: str, **labels: str) -> float:
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    return 0.0


async def _fetch(port: int, policy: str) -> streamer.FetchReport:
    async with streamer.StreamSession("127.0.0.1", port, "ctx", slo=60.0, policy=policy,
                                      on_layer=lambda *a: None, on_text=lambda *a: None) as session:
        return await session.fetch()


async def test_counters_move_and_are_scraped_over_http(store_root: str) -> None:
    metrics = SenderMetrics()
    store = await streamer.open_store(store_root)
    sender = await streamer.serve(store, config=ServerConfig(metrics=metrics))
    port = metrics.start_http("127.0.0.1", 0)
    try:
        assert sender.metrics is metrics
        level_report = await _fetch(sender.port, "fixed:2")
        text_report = await _fetch(sender.port, "text")
        with pytest.raises(ServerError) as info:
            async with streamer.StreamSession("127.0.0.1", sender.port, "no-such-context"):
                pass
        assert info.value.code == "not_found"
        during = await asyncio.to_thread(_scrape, port)
        await sender.close()   # every session ends: the gauge is back to 0
        text = await asyncio.to_thread(_scrape, port)
    finally:
        metrics.stop_http()
        await sender.close()
        await store.close()

    assert _sample(during, "kvwire_sender_sessions_total") == 3
    assert _sample(during, "kvwire_sender_chunks_total", level="2") == CHUNKS

    assert len(level_report.chunks) == CHUNKS and {c.level for c in level_report.chunks} == {2}
    assert {c.level for c in text_report.chunks} == {"text"}
    assert _sample(text, "kvwire_sender_sessions_total") == 3
    assert _sample(text, "kvwire_sender_sessions_open") == 0
    assert _sample(text, "kvwire_sender_chunks_total", level="2") == CHUNKS
    assert _sample(text, "kvwire_sender_chunks_total", level="text") == CHUNKS
    assert _sample(text, "kvwire_sender_text_fallbacks_total") == CHUNKS
    assert _sample(text, "kvwire_sender_errors_total", code="not_found") == 1
    # every chunk byte went out, plus the frames around them
    assert _sample(text, "kvwire_sender_sent_bytes_total") > level_report.bytes + text_report.bytes
    assert _sample(text, "kvwire_sender_request_seconds_count", kind="chunk") == CHUNKS
    assert _sample(text, "kvwire_sender_request_seconds_count", kind="text") == CHUNKS
    assert _sample(text, "kvwire_sender_request_seconds_count", kind="open") == 3
    assert _sample(text, "kvwire_sender_request_seconds_count", kind="profile") <= 1
    # the Python API reads the same registry
    assert metrics.value("kvwire_sender_chunks_total", level="2") == CHUNKS
    assert metrics.value("kvwire_sender_errors_total", code="not_found") == 1


async def test_senders_have_separate_registries(store_root: str) -> None:
    store = await streamer.open_store(store_root)
    a = await streamer.serve(store, config=ServerConfig(metrics=True))
    b = await streamer.serve(store, config=ServerConfig(metrics=True))
    plain = await streamer.serve(store)
    try:
        await _fetch(a.port, "fixed:1")
        await _fetch(plain.port, "fixed:1")   # no metrics: behaves the same
    finally:
        for s in (a, b, plain):
            await s.close()
        await store.close()
    assert a.metrics is not None and b.metrics is not None and plain.metrics is None
    assert a.metrics.value("kvwire_sender_chunks_total", level="1") == CHUNKS
    assert b.metrics.value("kvwire_sender_chunks_total", level="1") == 0
    assert b.metrics.value("kvwire_sender_sessions_total") == 0


def test_metrics_config_validation() -> None:
    with pytest.raises(TypeError):
        ServerConfig(metrics="yes")  # type: ignore[arg-type]
    assert ServerConfig(metrics=False).metrics is None


async def test_connection_log_lines_carry_a_session_id(store_root: str,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    store = await streamer.open_store(store_root)
    sender = await streamer.serve(store, config=ServerConfig(metrics=True))
    try:
        with caplog.at_level(logging.DEBUG, logger="kvwire.server"):
            await _fetch(sender.port, "fixed:1")
            with pytest.raises(streamer.StreamError, match="bad_request"):
                async with streamer.StreamSession("127.0.0.1", sender.port, "../etc/passwd",
                                                  max_reconnects=0):
                    pass
            for _ in range(100):
                if sender.sessions == 0:
                    break
                await asyncio.sleep(0.02)
    finally:
        await sender.close()
        await store.close()
    records = [r for r in caplog.records if r.name == "kvwire.server"]
    assert records, "expected session open/close lines at DEBUG"
    sessions = {r.session for r in records}
    assert len(sessions) == 2 and all(isinstance(s, str) and len(s) == 8 for s in sessions)
    assert sender.metrics.value("kvwire_sender_errors_total", code="bad_request") == 1

    line = JsonFormatter().format(records[0])
    parsed = json.loads(line)
    assert parsed["session"] == records[0].session and parsed["logger"] == "kvwire.server"
    assert "\n" not in line
    assert f"[{records[0].session}]" in TextFormatter().format(records[0])
    plain = logging.LogRecord("kvwire.server", logging.INFO, __file__, 1, "no session", None, None)
    assert "session" not in json.loads(JsonFormatter().format(plain))
    assert "[" not in TextFormatter().format(plain).split("kvwire.server", 1)[1]


def test_serve_flags_parse() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    commands.register(sub, sub)
    args = parser.parse_args(["serve", "--store", "/tmp/x", "--metrics-port", "0", "--log-json"])
    assert args.metrics_port == 0 and args.metrics_host == "127.0.0.1" and args.log_json
    args = parser.parse_args(["serve", "--store", "/tmp/x"])
    assert args.metrics_port is None and not args.log_json


async def test_a_peer_that_closes_with_a_request_pending_is_no_handler_failure(
        store_root: str, caplog: pytest.LogCaptureFixture) -> None:
    """A receiver that abandons a chunk closes (or drops) its connection with requests
    still due. The sender then has nothing to answer: that is a lost connection, not a
    bug logged with a traceback (it was: ``server cannot send CHUNK_BEGIN in state CLOSED``)."""
    from streamer.net.client import ClientConnection
    from streamer.wire import protocol as p

    store = await streamer.open_store(store_root)
    sender = await streamer.serve(store, config=ServerConfig(metrics=True))
    try:
        client = await ClientConnection.connect("127.0.0.1", sender.port)
        await client.call(p.Open(context_id="ctx", slo=1.0), p.ManifestData, 5.0)
        with caplog.at_level(logging.INFO, logger="kvwire.server"):
            # the request and the CLOSE in one write: the sender reads both before answering
            client._transport.writelines([*client.conn.send_parts(p.Request(chunk=0, level=0)),
                                          client.conn.send(p.Close())])
            for _ in range(250):
                if sender.sessions == 0:
                    break
                await asyncio.sleep(0.02)
        client.abort()
    finally:
        await sender.close()
        await store.close()
    assert sender.metrics.value("kvwire_sender_errors_total", code="handler_failed") == 0
    assert not [r for r in caplog.records if r.exc_info]
