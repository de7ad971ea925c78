"""kvwire demo's parts that need no model: the sender/proxy child process and the plot."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

import codec
import streamer
from netsim import Trace
from streamer.tools.demo_common import LinkProcess, plot
from streamer_helpers import put_context_now, synthetic_kv


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("demo-store"))
    kv = synthetic_kv(0, 256, 2, 2, 16)
    profile = codec.calibrate([synthetic_kv(1, 512, 2, 2, 16)])
    put_context_now(root, "demo", kv, list(range(256)), profile=profile, chunk_tokens=128)
    return root


def test_link_process_serves_shapes_and_ends(store: str, tmp_path: Path) -> None:
    trace = Trace([0.0, 0.2], [400.0, 50.0], name="drop")
    with LinkProcess(store, None, trace, delay_ms=1.0) as link:
        proc = link._proc

        async def fetch():
            async with streamer.StreamSession("127.0.0.1", link.port, "demo", slo=10.0, policy="fixed:0",
                                              on_layer=lambda *a: None) as session:
                trace_at = link.start_trace()
                assert 0.0 <= time.monotonic() - trace_at < 5.0   # one clock for both processes
                return await session.fetch()

        report = asyncio.run(fetch())
        assert [c.level for c in report.chunks] == [0, 0]
        assert proc.poll() is None
    assert proc.returncode == 0   # stopped when asked, not killed
    plot(report, trace, tmp_path / "plot.png", 5, 0.001)
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_link_process_ends_on_an_error_in_the_parent(store: str) -> None:
    with pytest.raises(ZeroDivisionError):
        with LinkProcess(store, None, Trace.constant(100.0, 1.0), delay_ms=0.0) as link:
            proc = link._proc
            1 / 0
    assert proc.returncode == 0


def test_link_process_start_failure_is_reported() -> None:
    with pytest.raises(RuntimeError, match="failed to start"):
        LinkProcess("redis://127.0.0.1:1/0", None, Trace.constant(100.0, 1.0), delay_ms=0.0)


def test_the_demo_fetch_times_the_profile_download_apart(store: str) -> None:
    """Opening the context (handshake, manifest, the profile) is timed on its own; the
    fetch's bytes are the chunks' only, never the profile's."""
    import argparse

    from streamer.net import session as session_module
    from streamer.tools.demo_common import _fetch

    session_module._profiles.clear()   # a receiver that has not seen this model's profile
    args = argparse.Namespace(context="demo", slo=10.0, policy="fixed:0", recompute_ms_per_token=0.05)
    with LinkProcess(store, None, Trace.constant(100.0, 1.0), delay_ms=1.0) as link:
        fetched = asyncio.run(_fetch(args, link.port, link.start_trace, lambda *a: None, None, False))

    async def manifest():
        async with await streamer.open_store(store) as s:
            m = await s.get_manifest("demo")
            return m, len(await s.get_profile_bytes(m.profile_id))

    m, profile_bytes = asyncio.run(manifest())
    assert profile_bytes > fetched.report.bytes == sum(c.sizes[0] for c in m.chunks)
    assert fetched.open_seconds > 0 and fetched.trace_offset >= 0
