"""Many stateless senders over one shared store (a real Redis Cluster): three
``kvwire serve`` processes, a receiver ``Fetcher`` given all three. Successive fetches
start on them round-robin; a sender SIGKILLed mid-fetch is left for the next one and
the fetch completes exactly once (every layer delivered once, none lost, the same KV
as a clean fetch); a master of the cluster killed mid-fetch is ridden out too."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import safetensors.torch
import torch

import codec
import streamer
from streamer_helpers import synthetic_kv
from streamer.net.config import SessionConfig
from streamer.receiver.cache import ContextCache
from streamer.receiver.fetcher import Fetcher, FetchRequest
from streamer.receiver.metrics import Metrics

REPO = Path(__file__).resolve().parents[1]
LAYERS, HEADS, HEAD_DIM = 4, 4, 32
CHUNK_TOKENS, CHUNKS = 64, 24
LEVEL = 1
pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(180)]


async def _put(url: str) -> tuple[streamer.Manifest, torch.Tensor]:
    """Put ``ctx``; its manifest and the KV a fetch at LEVEL must give (the stored blobs, decoded)."""
    tokens = CHUNK_TOKENS * CHUNKS
    profile = codec.calibrate([synthetic_kv(1, 1024, LAYERS, HEADS, HEAD_DIM)])
    async with await streamer.open_store(url) as store:
        manifest = await streamer.put_context(store, "ctx", synthetic_kv(2, tokens, LAYERS, HEADS, HEAD_DIM),
                                              [(7 * i) % 30000 for i in range(tokens)], profile=profile,
                                              chunk_tokens=CHUNK_TOKENS)
        chunks = [codec.decode(await store.get_chunk("ctx", manifest.version, i, LEVEL), profile)
                  for i in range(len(manifest.chunks))]
    return manifest, torch.cat(chunks, dim=2)


def _serve(url: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.Popen([sys.executable, "-m", "streamer.tools.cli", "serve", "--store", url,
                             "--listen", "127.0.0.1:0", "--insecure-no-auth"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def senders(redis_cluster_url: str):
    """Three ``kvwire serve`` processes over one cluster store holding ``ctx``."""
    url = f"{redis_cluster_url.rstrip('/')}/multi-{uuid.uuid4().hex[:8]}"
    procs = [_serve(url) for _ in range(3)]   # they start while the context is put: stateless
    try:
        manifest, reference = asyncio.run(_put(url))
        ports = []
        for proc in procs:
            line = proc.stdout.readline()
            assert " on 127.0.0.1:" in line, line + proc.stdout.read()
            ports.append(int(line.rsplit(":", 1)[1]))
        yield {"url": url, "manifest": manifest, "reference": reference, "procs": dict(zip(ports, procs)),
               "ports": ports}
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            proc.wait(timeout=20)
            proc.stdout.close()

        async def drop() -> None:
            async with await streamer.open_store(url) as store:
                await store.delete_context("ctx")
        asyncio.run(drop())


def _fetcher(ports: list[int], slo: float) -> Fetcher:
    return Fetcher([("127.0.0.1", p) for p in ports], ContextCache(1 << 30), Metrics(),
                   SessionConfig(slo=slo, policy=f"fixed:{LEVEL}", stall_timeout=1.0))


class Watch:
    """The events of one fetch, as they happen; ``on_first_chunk`` runs once, at the first."""

    def __init__(self, on_first_chunk=None) -> None:
        self.events: list = []
        self.on_first_chunk = on_first_chunk

    async def follow(self, job) -> None:
        seen, queue = job.subscribe()
        try:
            for event in seen:
                self._see(event)
            while not (self.events and self.events[-1].terminal):
                self._see(await queue.get())
        finally:
            job.unsubscribe(queue)

    def _see(self, event) -> None:
        self.events.append(event)
        if event.kind == "chunk" and self.on_first_chunk is not None:
            hook, self.on_first_chunk = self.on_first_chunk, None
            hook()

    def of(self, kind: str) -> list[dict]:
        return [e.data for e in self.events if e.kind == kind]


async def _fetch(fetcher: Fetcher, watch: Watch) -> tuple[dict, torch.Tensor]:
    outcome = await fetcher.fetch(FetchRequest("ctx", fetcher.session.slo, fetcher.session.policy,
                                               refresh=True), wait=False)
    await watch.follow(outcome.job)
    entry = await outcome.job.result()
    return entry.report, safetensors.torch.load(entry.data)["kv"]


def _check_exactly_once(watch: Watch, manifest: streamer.Manifest) -> None:
    layers = [(e["chunk"], e["layer"]) for e in watch.of("layer")]
    texts = [e["chunk"] for e in watch.of("text")]
    chunks = [e["chunk"] for e in watch.of("chunk")]
    assert len(layers) == len(set(layers)), "a layer was delivered twice"
    assert sorted(chunks) == list(range(len(manifest.chunks))), chunks   # one report per chunk
    for c in range(len(manifest.chunks)):  # every chunk whole: all its layers, or its text
        assert c in texts or {layer for chunk, layer in layers if chunk == c} == set(range(LAYERS)), c


async def test_fetches_go_round_robin_over_the_senders(senders) -> None:
    fetcher = _fetcher(senders["ports"], slo=60.0)
    try:
        used = []
        for _ in range(4):
            watch = Watch()
            report, kv = await _fetch(fetcher, watch)
            _check_exactly_once(watch, senders["manifest"])
            assert [c["level"] for c in report["chunks"]] == [LEVEL] * CHUNKS
            used.append(watch.of("manifest")[0]["sender"])
            assert torch.equal(kv, senders["reference"])   # stateless senders: the same bytes
        assert used == [f"127.0.0.1:{p}" for p in (*senders["ports"], senders["ports"][0])]
    finally:
        await fetcher.close(5.0)


async def test_sender_killed_mid_fetch_the_fetch_completes_once_from_another(senders) -> None:
    manifest, reference = senders["manifest"], senders["reference"]
    fetcher = _fetcher(senders["ports"], slo=2.0)
    first = senders["ports"][0]   # a fresh fetcher starts on the first sender
    watch = Watch(on_first_chunk=lambda: senders["procs"][first].send_signal(signal.SIGKILL))
    try:
        started = time.monotonic()
        report, kv = await _fetch(fetcher, watch)
        seconds = time.monotonic() - started
        assert watch.of("manifest")[0]["sender"] == f"127.0.0.1:{first}"
        assert senders["procs"][first].wait(timeout=10) == -signal.SIGKILL
        assert report["reconnects"] >= 1
        _check_exactly_once(watch, manifest)
        for info, chunk in zip(manifest.chunks, report["chunks"]):   # every KV chunk is exact
            if chunk["level"] != "text":
                assert chunk["level"] == LEVEL
                assert torch.equal(kv[:, :, info.start:info.end], reference[:, :, info.start:info.end])
        print(f"fetch with a sender killed after its first chunk: {seconds:.2f} s, "
              f"{report['reconnects']} reconnects, text chunks "
              f"{sum(c['level'] == 'text' for c in report['chunks'])}")
        # the next fetches skip the dead sender
        for _ in range(3):
            watch = Watch()
            report, kv = await _fetch(fetcher, watch)
            _check_exactly_once(watch, manifest)
            assert watch.of("manifest")[0]["sender"] != f"127.0.0.1:{first}"
            assert torch.equal(kv, reference)
    finally:
        await fetcher.close(5.0)
