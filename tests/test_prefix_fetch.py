"""Content-addressed prefixes over real loopback sockets: a real sender answering LOOKUP
from the file store, ``StreamSession(chunks=k)`` fetching a context's first k chunks, and
``open_prefix_session`` (lookup, then a session cut to the match on the same connection).

Also: version 2 peers against version 3 ones both ways (everything else keeps working;
a lookup is refused with a typed error), authentication before LOOKUP, and the sender's
answers when its store fails a lookup (a non-fatal ERROR; the connection goes on).
"""
from __future__ import annotations

import asyncio
import json
import struct

import pytest
import torch

import codec
import streamer
from codec.container import FORMAT_VERSION
from streamer.net.client import ClientConnection, LookupUnsupported
from streamer.net.prefix_fetch import PrefixMismatch, lookup, lookup_prefix, open_prefix_session
from streamer.net.sender import ServerConfig
from streamer.net.session import ChunksOutOfRange, connect
from streamer.store import StoreError
from streamer.store.prefix import MAX_LOOKUP_CHAIN, PrefixIdentity, PrefixMatch, prefix_chain
from streamer.store.put import put_prefix
from streamer.wire import protocol as p
from streamer_helpers import synthetic_kv

LAYERS, HEADS, HEAD_DIM = 3, 2, 16
CHUNK_TOKENS = 64
CHUNKS = 4
TOKENS = CHUNKS * CHUNK_TOKENS
TOKEN = "prefix-fetch-test-token-0123456789"


def _kv(seed: int, tokens: int) -> torch.Tensor:
    return synthetic_kv(seed, tokens, LAYERS, HEADS, HEAD_DIM)


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory):
    """A file store holding one name-addressed context "ctx" and one content-addressed
    prefix of TOKENS tokens, both of CHUNKS chunks."""
    root = str(tmp_path_factory.mktemp("store"))
    profile = codec.calibrate([_kv(1, 1024)])
    identity = PrefixIdentity(model="test-model", tokenizer="test-tokenizer", profile_id=profile.id,
                              chunk_tokens=CHUNK_TOKENS, format_version=FORMAT_VERSION)
    kv = _kv(2, TOKENS)
    token_ids = [(11 * i + 3) % 5000 for i in range(TOKENS)]

    async def put() -> tuple[streamer.Manifest, PrefixMatch]:
        store = await streamer.open_store(root)
        try:
            manifest = await streamer.put_context(store, "ctx", kv, token_ids, profile=profile,
                                                  chunk_tokens=CHUNK_TOKENS)
            match = await put_prefix(store, identity, kv, token_ids, profile, budget_bytes=None)
            return manifest, match
        finally:
            await store.close()

    manifest, match = asyncio.run(put())
    return {"root": root, "kv": kv, "tokens": token_ids, "profile": profile, "identity": identity,
            "manifest": manifest, "match": match}


class Served:
    """A sender on loopback serving the module's store (or ``store``) with ``config``."""

    def __init__(self, root: str, config: ServerConfig | None = None, store=None) -> None:
        self.root, self.config, self.store = root, config or ServerConfig(), store
        self.sender: streamer.Sender | None = None

    async def __aenter__(self) -> "Served":
        if self.store is None:
            self.store = await streamer.open_store(self.root)
        self.sender = await streamer.serve(self.store, config=self.config)
        return self

    async def __aexit__(self, *exc) -> None:
        assert self.sender is not None and self.store is not None
        await self.sender.close()
        await self.store.close()

    @property
    def port(self) -> int:
        assert self.sender is not None
        return self.sender.port


class Recorder:
    """Every delivery, checked for order and exactly-once as it happens."""

    def __init__(self) -> None:
        self.position = (0, 0)
        self.layers: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.texts: dict[int, list[int]] = {}

    def on_layer(self, chunk: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        assert (chunk, layer) == self.position, f"got {(chunk, layer)}, expected {self.position}"
        self.position = (chunk, layer + 1) if layer + 1 < LAYERS else (chunk + 1, 0)
        self.layers[(chunk, layer)] = (k.clone(), v.clone())

    def on_text(self, chunk: int, token_ids: list[int]) -> None:
        assert self.position[0] == chunk
        self.position = (chunk + 1, 0)
        self.texts[chunk] = list(token_ids)


def _stored_layers(stored, level: int, chunks: int) -> dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]:
    """What decoding the stored blobs of the first ``chunks`` chunks at ``level`` gives."""
    out = {}
    for i, info in enumerate(stored["manifest"].chunks[:chunks]):
        blob = codec.encode(stored["kv"][:, :, info.start:info.end], level, stored["profile"],
                            sink_tokens=None if i == 0 else 0)
        kv = codec.decode(blob, stored["profile"])
        for layer in range(LAYERS):
            out[(i, layer)] = (kv[layer, 0], kv[layer, 1])
    return out


def _same_layers(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(
        torch.equal(got[key][0], want[key][0]) and torch.equal(got[key][1], want[key][1]) for key in want)


def _prompt(stored, shared_chunks: int, extra_tokens: int) -> list[int]:
    """The stored prompt's first ``shared_chunks`` chunks, then ``extra_tokens`` others."""
    head = stored["tokens"][:shared_chunks * CHUNK_TOKENS]
    return head + [(7 * i + 4999) % 5000 + 1 for i in range(extra_tokens)]


def test_the_wire_and_the_stores_bound_a_lookup_alike() -> None:
    assert p.MAX_LOOKUP_CHAIN == MAX_LOOKUP_CHAIN


# ----------------------------------------------------------------------------- StreamSession(chunks=k)
@pytest.mark.parametrize("chunks", [1, 2, CHUNKS])
async def test_a_session_of_k_chunks_delivers_exactly_those(stored, chunks: int) -> None:
    rec = Recorder()
    async with Served(stored["root"]) as served:
        async with streamer.StreamSession("127.0.0.1", served.port, "ctx", slo=10.0, policy="fixed:1",
                                          chunks=chunks, on_layer=rec.on_layer, on_text=rec.on_text) as session:
            assert len(session.manifest.chunks) == chunks
            assert session.manifest.tokens == chunks * CHUNK_TOKENS
            report = await session.fetch()
    assert rec.position == (chunks, 0) and not rec.texts
    assert [c.index for c in report.chunks] == list(range(chunks))
    assert report.bytes == sum(c.sizes[1] for c in stored["manifest"].chunks[:chunks])
    assert _same_layers(rec.layers, _stored_layers(stored, 1, chunks))


@pytest.mark.parametrize("chunks", [0, -1, True, 1.0, "2"])
def test_chunks_must_be_a_positive_int(chunks) -> None:
    with pytest.raises(ValueError, match="chunks must be an int >= 1"):
        streamer.StreamSession("127.0.0.1", 1, "ctx", chunks=chunks)


async def test_more_chunks_than_the_context_has_is_refused_on_opening(stored) -> None:
    async with Served(stored["root"]) as served:
        with pytest.raises(ChunksOutOfRange, match=f"first {CHUNKS + 1} chunks of context 'ctx', which has {CHUNKS}"):
            async with streamer.StreamSession("127.0.0.1", served.port, "ctx", slo=5.0, chunks=CHUNKS + 1):
                pass
        await _no_sessions_left(served)   # not retried, and its connection is not left open


# ----------------------------------------------------------------------------- lookups
async def test_lookup_hit_miss_and_partial_prefix(stored) -> None:
    identity = stored["identity"]
    full = prefix_chain(identity, stored["tokens"])
    assert stored["match"] == PrefixMatch(context_id=stored["match"].context_id, chunks=CHUNKS)
    async with Served(stored["root"]) as served:
        async def look(chain):
            return await lookup_prefix("127.0.0.1", served.port, chain)

        assert await look(full) == stored["match"]
        # a longer prompt sharing every stored chunk: matched that far
        assert await look(prefix_chain(identity, _prompt(stored, CHUNKS, 3 * CHUNK_TOKENS))) == stored["match"]
        # sharing the first two chunks, then diverging
        partial = await look(prefix_chain(identity, _prompt(stored, 2, 2 * CHUNK_TOKENS)))
        assert partial == PrefixMatch(context_id=stored["match"].context_id, chunks=2)
        # the first chunk differs: nothing
        assert await look(prefix_chain(identity, _prompt(stored, 0, TOKENS))) is None
        # the same tokens under another identity (another model): nothing
        other = PrefixIdentity(model="another-model", tokenizer=identity.tokenizer, profile_id=identity.profile_id,
                               chunk_tokens=CHUNK_TOKENS, format_version=identity.format_version)
        assert await look(prefix_chain(other, stored["tokens"])) is None


async def test_several_lookups_on_one_connection_answer_in_order(stored) -> None:
    identity = stored["identity"]
    async with Served(stored["root"]) as served:
        client = await connect(streamer.SessionConfig(), "127.0.0.1", served.port)
        try:
            assert client.conn.version == 3 and client.conn.lookups
            for shared in (CHUNKS, 1, 0, 3):
                got = await lookup(client, prefix_chain(identity, _prompt(stored, shared, CHUNK_TOKENS)), 5.0)
                assert (got.chunks if got else 0) == shared
            # a prompt of more chunks than one lookup carries looks up its first MAX_LOOKUP_CHAIN
            long_prompt = _prompt(stored, CHUNKS, (MAX_LOOKUP_CHAIN + 10) * CHUNK_TOKENS)
            assert (await lookup(client, prefix_chain(identity, long_prompt), 5.0)).chunks == CHUNKS
            assert await lookup(client, [], 5.0) is None   # an empty chain matches nothing, unasked
            assert client.reusable
        finally:
            await client.close()


# ----------------------------------------------------------------------------- open_prefix_session
@pytest.mark.parametrize("shared", [1, 2, CHUNKS])
async def test_a_stored_prefix_is_fetched_like_a_context(stored, shared: int) -> None:
    prompt = _prompt(stored, shared, CHUNK_TOKENS // 2)
    rec = Recorder()
    async with Served(stored["root"], ServerConfig(metrics=True)) as served:
        session, match = await open_prefix_session("127.0.0.1", served.port, stored["identity"], prompt,
                                                   config=streamer.SessionConfig(slo=10.0, policy="fixed:0"),
                                                   on_layer=rec.on_layer, on_text=rec.on_text)
        assert match == PrefixMatch(context_id=stored["match"].context_id, chunks=shared)
        assert session is not None and session.chunks == shared
        assert session.manifest.tokens == shared * CHUNK_TOKENS
        async with session:
            report = await session.fetch()
        # the lookup and the fetch shared one connection
        assert served.sender.metrics.value("kvwire_sender_sessions_total") == 1
    assert rec.position == (shared, 0) and not rec.texts
    assert len(report.chunks) == shared
    assert _same_layers(rec.layers, _stored_layers(stored, 0, shared))


async def test_text_chunks_of_a_prefix_carry_the_prompts_tokens(stored) -> None:
    prompt = _prompt(stored, 2, 5)
    rec = Recorder()
    async with Served(stored["root"]) as served:
        session, _ = await open_prefix_session("127.0.0.1", served.port, stored["identity"], prompt, slo=10.0,
                                               policy="text", on_layer=rec.on_layer, on_text=rec.on_text)
        async with session:
            await session.fetch()
    assert rec.texts == {0: prompt[:CHUNK_TOKENS], 1: prompt[CHUNK_TOKENS:2 * CHUNK_TOKENS]}


async def test_no_stored_prefix_opens_no_session(stored) -> None:
    async with Served(stored["root"], ServerConfig(metrics=True)) as served:
        assert await open_prefix_session("127.0.0.1", served.port, stored["identity"],
                                         _prompt(stored, 0, 100)) == (None, None)
        await _no_sessions_left(served)   # the lookup's connection was closed


class _Faulty:
    """The module's file store, but ``lookup_prefix`` answers as ``answer`` says
    (a callable: an exception to raise or a value to return) for the first ``times`` calls."""

    def __init__(self, store, answer, times: int = 1) -> None:
        self._store, self._answer, self._times = store, answer, times

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    async def lookup_prefix(self, chain, *, touch: bool = True):
        if self._times > 0:
            self._times -= 1
            result = self._answer()
            if isinstance(result, BaseException):
                raise result
            return result
        return await self._store.lookup_prefix(chain, touch=touch)


async def test_a_matched_context_that_vanished_is_not_found(stored) -> None:
    store = _Faulty(await streamer.open_store(stored["root"]), lambda: PrefixMatch(context_id="px-" + "0" * 64,
                                                                                   chunks=2))
    async with Served(stored["root"], store=store) as served:
        with pytest.raises(streamer.ServerError, match="not_found"):
            await open_prefix_session("127.0.0.1", served.port, stored["identity"], stored["tokens"])
        await _no_sessions_left(served)   # the lookup's connection went with the session


async def _no_sessions_left(served: Served) -> None:
    """The sender serves no connection within 2 s (a dropped one takes a moment to be seen)."""
    for _ in range(100):
        if served.sender.sessions == 0:
            return
        await asyncio.sleep(0.02)
    assert served.sender.sessions == 0


async def test_a_match_that_is_not_the_prompts_prefix_is_refused(stored) -> None:
    # the index points the prompt at the name-addressed "ctx" with one chunk less than it has
    store = _Faulty(await streamer.open_store(stored["root"]), lambda: PrefixMatch(context_id="ctx", chunks=2))
    prompt = stored["tokens"][:CHUNK_TOKENS + 10]   # two chunks, the second partial
    async with Served(stored["root"], store=store) as served:
        with pytest.raises(PrefixMismatch, match="holds 128 tokens .* not the 74 tokens"):
            await open_prefix_session("127.0.0.1", served.port, stored["identity"], prompt)


@pytest.mark.parametrize("fault, code", [(lambda: StoreError("disk on fire"), "unavailable"),
                                         (lambda: ValueError("chain too long for this store"), "bad_request"),
                                         (lambda: PrefixMatch(context_id="px-" + "a" * 64, chunks=CHUNKS + 1),
                                          "internal"),
                                         (lambda: PrefixMatch(context_id="../etc", chunks=1), "internal")])
async def test_a_failed_lookup_is_a_non_fatal_error(stored, fault, code: str) -> None:
    store = _Faulty(await streamer.open_store(stored["root"]), fault)
    chain = prefix_chain(stored["identity"], stored["tokens"])
    async with Served(stored["root"], store=store) as served:
        client = await connect(streamer.SessionConfig(), "127.0.0.1", served.port)
        try:
            with pytest.raises(streamer.ServerError, match=code) as refused:
                await lookup(client, chain, 5.0)
            assert "disk on fire" not in str(refused.value)   # a store's details stay in the sender's log
            # the same connection answers the next lookup
            assert await lookup(client, chain, 5.0) == stored["match"]
        finally:
            await client.close()


# ----------------------------------------------------------------------------- versions
async def test_a_version_2_client_against_a_version_3_sender(stored) -> None:
    rec = Recorder()
    async with Served(stored["root"]) as served:
        client = await ClientConnection.connect("127.0.0.1", served.port, versions=(1, 2))
        assert client.conn.version == 2 and not client.conn.lookups
        with pytest.raises(LookupUnsupported, match="version 2; lookups need version 3"):
            await lookup(client, prefix_chain(stored["identity"], stored["tokens"]), 5.0)
        assert client.reusable   # nothing was sent
        async with streamer.StreamSession("127.0.0.1", served.port, "ctx", slo=10.0, policy="fixed:1",
                                          connection=client, chunks=2, on_layer=rec.on_layer) as session:
            await session.fetch()
    assert rec.position == (2, 0)
    assert _same_layers(rec.layers, _stored_layers(stored, 1, 2))


async def test_a_version_3_client_against_a_version_2_sender(stored) -> None:
    rec = Recorder()
    async with Served(stored["root"], ServerConfig(versions=(1, 2))) as served:
        async with streamer.StreamSession("127.0.0.1", served.port, "ctx", slo=10.0, policy="fixed:1",
                                          on_layer=rec.on_layer) as session:
            assert session._client.conn.version == 2
            await session.fetch()
        with pytest.raises(LookupUnsupported):
            await open_prefix_session("127.0.0.1", served.port, stored["identity"], stored["tokens"])
    assert rec.position == (CHUNKS, 0)
    assert _same_layers(rec.layers, _stored_layers(stored, 1, CHUNKS))


@pytest.mark.parametrize("versions", [(), (4,), (1, 1), [2, 3]])
def test_server_versions_are_checked(versions) -> None:
    if versions == [2, 3]:
        assert ServerConfig(versions=versions).versions == (2, 3)
        return
    with pytest.raises(ValueError, match="ServerConfig.versions"):
        ServerConfig(versions=versions)


# ----------------------------------------------------------------------------- authentication
async def _hello_then(port: int, frame: bytes) -> list[p.Event]:
    """On a fresh connection, HELLO then ``frame`` at once; every event until the sender
    closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    conn = p.Connection(p.Role.CLIENT, auth_token=TOKEN)
    writer.write(conn.send(p.Hello(versions=p.SUPPORTED_VERSIONS, client="rude")) + frame)
    got: list[p.Event] = []
    try:
        async with asyncio.timeout(10.0):
            while not got or not isinstance(got[-1], p.ConnectionClosed):
                got += conn.receive_data(await reader.read(1 << 16))
    finally:
        writer.transport.abort()
    return got


async def test_authentication_comes_before_any_lookup(stored) -> None:
    chain = prefix_chain(stored["identity"], stored["tokens"])
    async with Served(stored["root"], ServerConfig(auth_token=TOKEN)) as served:
        payload = json.dumps({"chain": chain}).encode()
        events = await _hello_then(served.port, struct.pack("<IHH", len(payload), int(p.FrameType.LOOKUP), 0) + payload)
        errors = [e for e in events if isinstance(e, p.Error)]
        assert errors and errors[0].fatal and errors[0].code == "auth"
        assert "LOOKUP received before AUTH" in errors[0].message
        assert not any(isinstance(e, p.Prefix) for e in events)
        # without a token, or with a wrong one: refused in the handshake
        with pytest.raises(streamer.AuthenticationFailed):
            await lookup_prefix("127.0.0.1", served.port, chain)
        with pytest.raises(streamer.AuthenticationFailed):
            await lookup_prefix("127.0.0.1", served.port, chain,
                                config=streamer.SessionConfig(auth_token="a-wrong-token-0123456789"))
        # with it: answered, and the session on the same connection fetches
        config = streamer.SessionConfig(auth_token=TOKEN, slo=10.0, policy="fixed:2")
        assert await lookup_prefix("127.0.0.1", served.port, chain, config=config) == stored["match"]
        rec = Recorder()
        session, match = await open_prefix_session("127.0.0.1", served.port, stored["identity"], stored["tokens"],
                                                   config=config, on_layer=rec.on_layer)
        async with session:
            await session.fetch()
    assert rec.position == (CHUNKS, 0)


# ----------------------------------------------------------------------------- every store
async def test_a_prefix_is_looked_up_and_fetched_from_every_store(stored, store_url: str) -> None:
    """The same lookup and 2-chunk fetch over a sender on the file store, a real redis and
    a real cluster (``store_url``)."""
    store = await streamer.open_store(store_url)
    await put_prefix(store, stored["identity"], stored["kv"], stored["tokens"], stored["profile"], budget_bytes=None)
    prompt = _prompt(stored, 2, CHUNK_TOKENS)
    rec = Recorder()
    async with Served("", store=store) as served:
        assert await lookup_prefix("127.0.0.1", served.port, prefix_chain(stored["identity"], _prompt(stored, 0, 9))) \
            is None
        session, match = await open_prefix_session("127.0.0.1", served.port, stored["identity"], prompt, slo=10.0,
                                                   policy="fixed:1", on_layer=rec.on_layer)
        assert match == PrefixMatch(context_id=stored["match"].context_id, chunks=2)
        async with session:
            await session.fetch()
    assert rec.position == (2, 0)
    assert _same_layers(rec.layers, _stored_layers(stored, 1, 2))
