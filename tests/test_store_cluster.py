"""The store on Redis Cluster: URLs, the key layout (one slot per context), sharing
between senders, and faults on a private real cluster (a master killed mid-put, a slot
migrated mid-put). The generic store tests run on the cluster too (``store_url``)."""
from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import torch
from redis.crc import key_slot

from streamer.store import ChunkNotFound, StoreError, open_store
from streamer.store.redis import RedisStore
from streamer.store.redis_cluster import parse_cluster_url
from test_streamer_store import Version, assert_changes_shared, assert_readable, closed_port, put_version

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "redis-cluster.sh"


# ------------------------------------------------------------------------ URLs
def test_cluster_url_forms() -> None:
    assert parse_cluster_url("redis+cluster://127.0.0.1:7000,h2:7001,[::1]:7002/tenant") == \
        ([("127.0.0.1", 7000), ("h2", 7001), ("::1", 7002)], None, None, "tenant", False)
    assert parse_cluster_url("rediss+cluster://u:p%40ss@h") == ([("h", 6379)], "u", "p@ss", "kvwire", True)
    assert parse_cluster_url("redis+cluster://:secret@h:1/")[1:4] == (None, "secret", "kvwire")


@pytest.mark.parametrize("url, message", [
    ("redis+cluster://h:1/p?prefix=x", "takes no query"),
    ("redis+cluster://h:1,,h:2/p", "names no host"),
    ("redis+cluster://h:99999/p", "bad node 'h:99999'"),
    ("redis+cluster://h:1/a:b", "invalid redis key prefix"),
    ("redis+cluster://:hunter2@h:1/a/b", "invalid redis key prefix"),
])
async def test_bad_cluster_urls_are_value_errors(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        await open_store(url)
    assert "hunter2" not in str(info.value)


async def test_unreachable_cluster_fails_fast_naming_the_url() -> None:
    started = time.monotonic()
    with pytest.raises(StoreError, match=r"cannot reach redis store redis\+cluster://:\*\*\*@127") as info:
        await open_store(f"redis+cluster://:hunter2@127.0.0.1:{closed_port()}/p")
    assert "hunter2" not in str(info.value)
    assert time.monotonic() - started < 30


# ------------------------------------------------------------------ key layout
def test_every_key_of_a_context_shares_one_slot() -> None:
    store = RedisStore(client=None, url="redis+cluster://x", prefix="kv")  # keys only: no I/O
    version = Version("chat.7", "0123abcd", seed=1, chunks=5, levels=3).manifest
    keys = [store._manifest_key("chat.7"), *store._version_keys(version),
            store.chunk_key("chat.7", "another-version", 0, 0)]
    assert len(keys) == 1 + 5 * 3 + 5 + 1
    assert {key_slot(k.encode()) for k in keys} == {key_slot(b"chat.7")}
    assert store._manifest_key("chat.7") == "kv:ctx:{chat.7}:manifest"
    # contexts spread over the slots (and so over the masters)
    assert len({key_slot(store._manifest_key(f"c{i}").encode()) for i in range(100)}) > 90


@pytest.mark.redis
async def test_senders_on_different_nodes_share_contexts_and_profiles(redis_cluster_store_url: str,
                                                                      codec_profile) -> None:
    """Two stores whose clients start from different nodes see one store."""
    nodes, _, _, prefix, _ = parse_cluster_url(redis_cluster_store_url)
    a_url, b_url = (f"redis+cluster://{host}:{port}/{prefix}" for host, port in (nodes[0], nodes[-1]))
    async with await open_store(a_url) as a, await open_store(b_url) as b:
        await a.put_profile(codec_profile)
        assert await b.get_profile_bytes(codec_profile.id) == codec_profile.to_bytes()
        versions = {f"ctx-{i}": await put_version(a, f"ctx-{i}", seed=i) for i in range(6)}
        assert await b.list_contexts() == sorted(versions)
        for version in versions.values():
            await assert_readable(b, version)
        await assert_changes_shared(b, a, "ctx-0", seed=99)


# ------------------------------------------------------- a private cluster for faults
@dataclass
class Cluster:
    """A cluster of our own (scripts/redis-cluster.sh), which the fault tests may break."""

    base: int

    @property
    def ports(self) -> list[int]:
        return list(range(self.base, self.base + 6))

    def url(self, prefix: str) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports) + f"/{prefix}"

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=5, socket_connect_timeout=1)

    def live_ports(self) -> list[int]:
        live = []
        for port in self.ports:
            with contextlib.suppress(redis.RedisError), self.node(port) as r:
                r.ping()
                live.append(port)
        return live

    def master_of(self, key: str) -> int:
        """The port of the master serving ``key``'s slot."""
        slot = key_slot(key.encode())
        with self.node(self.live_ports()[0]) as r:
            for start, end, master, *_ in r.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return int(master[1])
        raise AssertionError(f"slot {slot} is not served")

    def wait_replicated(self) -> None:
        """Until every replica has every write of its master (replication is asynchronous)."""
        for port in self.live_ports():
            with self.node(port) as r:
                info = r.info("replication")
                if info["role"] != "master":
                    continue
                for _ in range(1000):
                    info = r.info("replication")
                    replicas = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
                    if replicas and all(s["offset"] >= info["master_repl_offset"] for s in replicas):
                        break
                    time.sleep(0.01)
                else:
                    raise AssertionError(f"replicas of {port} never caught up: {info}")

    def kill(self, port: int) -> None:
        pidfile = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvwire-redis-cluster-{self.base}" / f"redis-{port}.pid"
        os.kill(int(pidfile.read_text()), signal.SIGKILL)

    def restart(self, port: int) -> None:
        subprocess.run([str(SCRIPT), "restart-node", str(port), str(self.base)], check=True, timeout=30)
        self.wait_ok()

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node says cluster_state:ok."""
        deadline = time.monotonic() + timeout
        while True:
            states = []
            for port in self.live_ports():
                with self.node(port) as r:
                    states.append(r.execute_command("CLUSTER", "INFO").decode())
            if states and all("cluster_state:ok" in s for s in states):
                return
            assert time.monotonic() < deadline, states
            time.sleep(0.05)


def _free_base() -> int:
    for _ in range(50):
        base = random.randrange(20000, 29000)
        try:
            socks = []
            for port in [*range(base, base + 6), *range(base + 10000, base + 10006)]:
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no free port range for a private cluster")


@pytest.fixture(scope="module")
def cluster():
    import shutil

    if not (shutil.which("redis-server") and shutil.which("redis-cli")):
        pytest.skip("redis-server / redis-cli not on PATH: cannot start a private cluster")
    base = _free_base()
    subprocess.run([str(SCRIPT), "start", str(base)], check=True, capture_output=True, timeout=60)
    try:
        yield Cluster(base)
    finally:
        subprocess.run([str(SCRIPT), "stop", str(base)], check=False, capture_output=True, timeout=60)


# ---------------------------------------------------------------------- faults
@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_master_killed_during_puts_and_reads(cluster: Cluster) -> None:
    """Puts ride out the failover (each commits whole); what was committed (and replicated)
    survives; readers see whole versions throughout; the last puts are all current."""
    url = cluster.url("kill-puts")
    contexts = [f"c{i}" for i in range(8)]
    async with await open_store(url) as store:
        victim = cluster.master_of(store._manifest_key("c0"))
        on_victim = [c for c in contexts if cluster.master_of(store._manifest_key(c)) == victim]
        static = {c: await put_version(store, f"static-{c}", seed=i) for i, c in enumerate(contexts)}
        versions: dict[str, Version] = {}
        last: dict[str, Version] = {}
        for i, c in enumerate(contexts):
            last[c] = versions_put = await put_version(store, c, seed=100 + i)
            versions[versions_put.manifest.version] = versions_put
        cluster.wait_replicated()
        killed = asyncio.Event()
        puts_after_kill = 0
        reads = 0

        async def writer(c: str) -> None:
            nonlocal puts_after_kill
            for seed in range(1000, 1000 + 40):
                async with store.writer(c) as w:
                    version = Version(c, w.version, seed)
                    versions[w.version] = version
                    await version.stage(w)
                    await w.commit(version.manifest)
                last[c] = version
                if killed.is_set():
                    puts_after_kill += 1
                    if puts_after_kill > 3 * len(contexts):
                        return

        async def reader() -> None:
            nonlocal reads
            while puts_after_kill <= 3 * len(contexts):
                c = random.choice(contexts)
                manifest = await store.get_manifest(c)
                expected = versions[manifest.version]
                try:
                    for (i, level), blob in expected.blobs.items():
                        assert await store.get_chunk(c, manifest.version, i, level) == blob
                        reads += 1
                except ChunkNotFound:
                    assert (await store.get_manifest(c)).version != manifest.version
                await asyncio.sleep(0)

        async def killer() -> None:
            await asyncio.sleep(0.2)   # puts and reads under way
            cluster.kill(victim)
            killed.set()

        try:
            await asyncio.wait_for(asyncio.gather(*(writer(c) for c in contexts), reader(), reader(),
                                                  killer()), timeout=60)
            assert on_victim and reads > 0 and puts_after_kill > 3 * len(contexts)
            assert cluster.master_of(store._manifest_key("c0")) != victim   # a replica took over
            for c in contexts:
                await assert_readable(store, static[c])   # committed before the kill: survived
                await assert_readable(store, last[c])     # the last put of each is current, whole
        finally:
            cluster.restart(victim)   # it rejoins as a replica: the cluster is whole again


@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.timeout(60)
async def test_slot_migrating_mid_put_is_followed_not_corrupting(cluster: Cluster) -> None:
    """The context's slot moves to another master between staging and commit: the
    client follows ASK/MOVED (and TRYAGAIN while the keys are split), the put commits
    whole on the new owner."""
    url = cluster.url("migrate")
    async with await open_store(url) as store:
        old = await put_version(store, "moving", seed=1)
        mkey = store._manifest_key("moving")
        slot = key_slot(mkey.encode())
        src = cluster.master_of(mkey)
        masters = {cluster.master_of(store._manifest_key(f"m{i}")) for i in range(200)}
        dst = min(masters - {src})
        with cluster.node(src) as s, cluster.node(dst) as d:
            src_id = s.execute_command("CLUSTER", "MYID").decode()
            dst_id = d.execute_command("CLUSTER", "MYID").decode()

            def migrate(limit: int) -> None:
                keys = s.execute_command("CLUSTER", "GETKEYSINSLOT", slot, limit)
                if keys:
                    s.execute_command("MIGRATE", "127.0.0.1", dst, "", 0, 5000, "KEYS", *keys)

            def finish() -> None:
                migrate(100_000)
                for port in masters:
                    with cluster.node(port) as r:
                        r.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)

            async with store.writer("moving") as w:
                new = Version("moving", w.version, seed=2)
                staged = list(new.blobs.items())
                for (i, level), blob in staged[:3]:
                    await w.put_chunk(i, level, blob)          # on src
                d.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
                s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
                migrate(4)                                    # the keys are now split
                for (i, level), blob in staged[3:]:
                    await w.put_chunk(i, level, blob)          # new keys: ASK -> dst
                for i, text in new.texts.items():
                    await w.put_text(i, text)
                commit = asyncio.create_task(w.commit(new.manifest))   # TRYAGAIN until whole
                await asyncio.sleep(0.3)
                await asyncio.to_thread(finish)
                await commit
        assert cluster.master_of(mkey) == dst
        await assert_readable(store, new)                       # MOVED followed for reads
        with pytest.raises(ChunkNotFound):
            await store.get_chunk("moving", old.manifest.version, 0, 0)
        assert await store.gc() == 0


@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_master_killed_mid_fetch_the_fetch_completes_exactly_once(cluster: Cluster) -> None:
    """The master holding a context dies after the first chunk went out: the sender's
    reads wait out the failover, the fetch completes, every layer in order and once,
    each chunk the exact stored blob or (past the deadline) its text."""
    import codec
    from streamer.net.sender import serve
    from streamer.net.session import StreamSession
    from streamer.store.put import put_context
    from streamer_helpers import synthetic_kv

    layers, heads, head_dim, chunk_tokens, chunks, level = 2, 4, 32, 64, 16, 1
    profile = codec.calibrate([synthetic_kv(1, 1024, layers, heads, head_dim)])
    kv = synthetic_kv(2, chunks * chunk_tokens, layers, heads, head_dim)
    async with await open_store(cluster.url("kill-fetch")) as store:
        manifest = await put_context(store, "ctx", kv, list(range(kv.shape[2])), profile=profile,
                                     chunk_tokens=chunk_tokens)
        reference = [codec.decode(await store.get_chunk("ctx", manifest.version, i, level), profile)
                     for i in range(chunks)]
        cluster.wait_replicated()
        victim = cluster.master_of(store._manifest_key("ctx"))
        delivered: list[tuple[int, int]] = []
        texts: list[int] = []

        def on_layer(chunk: int, layer: int, k, v) -> None:
            assert (chunk, layer) not in delivered
            assert torch.equal(k, reference[chunk][layer, 0]) and torch.equal(v, reference[chunk][layer, 1])
            delivered.append((chunk, layer))

        def on_chunk(report) -> None:
            if report.index == 0:
                cluster.kill(victim)

        sender = await serve(store)
        try:
            async with StreamSession("127.0.0.1", sender.port, "ctx", slo=10.0, policy=f"fixed:{level}",
                                     on_layer=on_layer, on_text=lambda c, ids: texts.append(c),
                                     on_chunk=on_chunk) as session:
                report = await session.fetch()
        finally:
            await sender.close()
            cluster.restart(victim)
    assert [c.index for c in report.chunks] == list(range(chunks))
    assert len(texts) == len(set(texts))
    for c in report.chunks:
        if c.level == "text":
            assert c.index in texts
        else:
            assert c.level == level and [x for x in delivered if x[0] == c.index] == \
                [(c.index, layer) for layer in range(layers)]
    assert cluster.master_of(f"kill-fetch:ctx:{{ctx}}:manifest") != victim
