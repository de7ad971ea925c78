"""A flood of connections past the sender daemon's ``max_sessions`` (#15, round three),
over real sockets on loopback: each is refused with its fatal ERROR, counted, and
logged one line per second at most (not one each); refused connections do not linger
past ``MAX_REFUSING`` at once; the sender still serves once places are free."""
from __future__ import annotations

import asyncio
import logging

import pytest

import streamer
from streamer.net import sender as sender_module
from streamer.net.sender import ServerConfig
from streamer.net.throttle import Throttle

FLOOD = 50


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def sender(tmp_path):
    store = await streamer.open_store(str(tmp_path))
    sender = await streamer.serve(store, config=ServerConfig(max_sessions=2, metrics=True))
    yield sender
    await sender.close()
    await store.close()


async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def _refused(port: int) -> bytes:
    reader, writer = await _connect(port)
    try:
        return await reader.read()   # the ERROR, then the sender's close
    except ConnectionResetError:
        return b""
    finally:
        writer.close()


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.01)


async def test_a_flood_past_max_sessions_is_refused_counted_and_logged_once_per_second(sender, caplog,
                                                                                     monkeypatch) -> None:
    clock = _Clock()   # frozen: the bound on log lines is exact, whatever the machine's speed
    monkeypatch.setattr(sender, "_refusal_log", Throttle(1.0, clock))
    held = [await _connect(sender.port) for _ in range(2)]
    await _until(lambda: sender.sessions == 2)
    with caplog.at_level(logging.INFO, logger="kvwire.server"):
        answers = await asyncio.gather(*(_refused(sender.port) for _ in range(FLOOD)))
        clock.now = 1.0
        await _refused(sender.port)
    assert all(b"unavailable" in a and b"capacity" in a for a in answers)
    lines = [r.getMessage() for r in caplog.records if "refusing" in r.getMessage()]
    assert len(lines) == 2, lines
    assert lines[1].endswith(f"; {FLOOD - 1} more refused since the last line")
    assert sender.metrics.refused._value.get() == FLOOD + 1
    await _until(lambda: sender._refusing == 0)
    for _, writer in held:
        writer.close()
    await _until(lambda: sender.sessions == 0)
    reader, writer = await _connect(sender.port)   # a place is free again: no ERROR, the handshake waits
    await _until(lambda: sender.sessions == 1)
    writer.close()


async def test_refusals_past_max_refusing_are_closed_at_once(sender, monkeypatch) -> None:
    monkeypatch.setattr(sender_module, "MAX_REFUSING", 0)
    held = [await _connect(sender.port) for _ in range(2)]
    await _until(lambda: sender.sessions == 2)
    reader, writer = await _connect(sender.port)   # sends nothing and never closes: closed by the sender
    try:
        data = await reader.read()
    except ConnectionResetError:
        data = b""
    assert data == b"" or b"unavailable" in data
    assert sender._refusing == 0   # a lingering refusal would still wait for this peer to close
    for _, w in held + [(reader, writer)]:
        w.close()
