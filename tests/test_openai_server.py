"""The OpenAI-compatible completions server (``streamer.llmserver``) against the real
``openai`` client on loopback, serving SmolLM2 offline.

Correctness is the issue's: an answer is right when it equals the answer of the same
request served alone after a full prefill (greedy, ``hf.greedy_generate``). Prefixes are
stored content-addressed (``put_prefix``) in a file store behind a real sender; chunks are
16 tokens and answers a few tokens, so the suite stays fast. Where a prefix is fetched the
server's policy is ``fixed:0``, the best stored level (MSE/var 5e-5 with the shipped
profile), so that every chunk does come as KV (an adaptive policy may send text, which
makes the comparison trivially true). That level is lossy: equality with the full prefill
holds for these prompts (each checked once against generation over the exact and the
level-0 KV), not for every prompt. A 16-token prefix followed by 20 tokens from elsewhere
in the text (``ids[3000:3020]``) parts from the full prefill at its third new token over the
level-0 KV, while the exact KV gives the full prefill's answer.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from typing import Any

import pytest

from streamer.llmserver.protocol import (APIError, TextStream, completion_body, parse_body, parse_completion,
                                         sse_data, stream_chunk)

openai = pytest.importorskip("openai")

CHUNK = 16
MAX_TOKENS = 6
NAME = "smollm2-test"
TOKEN = "t" * 24


# --------------------------------------------------------------------------- pure parsing
def test_a_plain_request_parses_with_openai_defaults() -> None:
    request = parse_completion({"model": "m", "prompt": "hi"}, max_tokens_limit=64)
    assert (request.prompt, request.max_tokens, request.stream, request.slo) == ("hi", 16, False, None)
    ids = parse_completion({"model": "m", "prompt": [[1, 2, 3]], "temperature": 0, "n": 1, "stream": True,
                            "stream_options": {"include_usage": True}, "kvwire": {"slo": 0.25}, "seed": 3},
                           max_tokens_limit=64)
    assert (ids.prompt, ids.include_usage, ids.slo) == ((1, 2, 3), True, 0.25)


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "prompt": "hi", "temperature": 0.7}, "temperature"),
    ({"model": "m", "prompt": "hi", "n": 2}, "n"),
    ({"model": "m", "prompt": "hi", "top_p": 0.5}, "top_p"),
    ({"model": "m", "prompt": "hi", "stop": ["\n"]}, "stop"),
    ({"model": "m", "prompt": "hi", "logprobs": 2}, "logprobs"),
    ({"model": "m", "prompt": "hi", "echo": True}, "echo"),
    ({"model": "m", "prompt": ""}, "prompt"),
    ({"model": "m", "prompt": []}, "prompt"),
    ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
    ({"model": "m", "prompt": [1, -2]}, "prompt"),
    ({"model": "m", "prompt": [1, True]}, "prompt"),
    ({"model": "m", "prompt": 5}, "prompt"),
    ({"model": "m"}, "prompt"),
    ({"prompt": "hi"}, "model"),
    ({"model": "m", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "prompt": "hi", "max_tokens": 65}, "max_tokens"),
    ({"model": "m", "prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
    ({"model": "m", "prompt": "hi", "stream": "yes"}, "stream"),
    ({"model": "m", "prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": "m", "prompt": "hi", "kvwire": {"slo": 0}}, "kvwire"),
    ({"model": "m", "prompt": "hi", "kvwire": {"policy": "text"}}, "kvwire"),
    ({"model": "m", "prompt": "hi", "frobnicate": 1}, "frobnicate"),
])
def test_what_cannot_be_served_as_asked_is_a_400_naming_the_field(body: dict, param: str) -> None:
    with pytest.raises(APIError) as caught:
        parse_completion(body, max_tokens_limit=64)
    assert caught.value.status == 400 and caught.value.param == param
    assert set(caught.value.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("raw, status", [(b"{", 400), (b"\xff", 400), (b"[" * 100_000, 400),
                                         (b"1" * (2 << 20), 413), (b"[]", 400)])
def test_a_malformed_body_is_refused(raw: bytes, status: int) -> None:
    with pytest.raises(APIError) as caught:
        parse_body(raw, max_tokens_limit=64)
    assert caught.value.status == status


def test_streamed_text_never_splits_a_character() -> None:
    """A tokenizer decodes an incomplete UTF-8 sequence as U+FFFD until its last byte
    comes: nothing is sent until then, and the pieces add up to the whole text."""
    pieces = {1: b"a", 2: b"\xc3", 3: b"\xa9", 4: b"b"}

    def decode(ids: list[int]) -> str:
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    stream = TextStream(decode)
    sent = [stream.push(t) for t in (1, 2, 3, 4)]
    assert sent == ["a", "", "\u00e9", "b"] and "".join(sent) + stream.flush() == stream.text == "a\u00e9b"


def test_text_already_sent_is_never_contradicted() -> None:
    """A decoding that rewrites what was sent holds the stream until it agrees again."""
    texts = {(1,): "ab", (1, 2): "Ab c", (1, 2, 3): "ab cd"}
    stream = TextStream(lambda ids: texts[tuple(ids)])
    assert [stream.push(1), stream.push(2), stream.push(3)] == ["ab", "", " cd"]


def test_an_engine_config_is_checked() -> None:
    from streamer.llmserver.engine import EngineConfig

    for bad in ({"chunk_tokens": 0}, {"slo": 0}, {"max_tokens": True}, {"served_name": ""},
                {"store_budget_bytes": -1}):
        with pytest.raises(ValueError):
            EngineConfig(**{"served_name": "m", **bad})


def test_sse_events_are_one_line_of_json_each() -> None:
    chunk = stream_chunk("cmpl-1", 0, "m", "line\r\nbreak \u2028")
    event = sse_data(chunk)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n") and event.count(b"\n") == 2
    assert json.loads(event[6:]) == chunk
    assert sse_data(None) == b"data: [DONE]\n\n"
    assert completion_body("c", 0, "m", "x", "stop", {})["choices"][0]["logprobs"] is None


def test_off_loopback_the_server_needs_a_token() -> None:
    from streamer.llmserver.app import ServeConfig, check_exposure
    from streamer.net.sender import InsecureConfiguration

    assert check_exposure("127.0.0.1", ServeConfig()) is None
    with pytest.raises(InsecureConfiguration):
        check_exposure("0.0.0.0", ServeConfig())
    assert "clear" in check_exposure("0.0.0.0", ServeConfig(api_token=TOKEN))
    assert "NO authentication" in check_exposure("0.0.0.0", ServeConfig(allow_insecure=True))
    with pytest.raises(ValueError):
        ServeConfig(api_token="has a space in it ......")


# --------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def served(smollm2, tmp_path_factory) -> dict[str, Any]:
    """SmolLM2, the shipped profile, the GPL-3 text's token ids, two prefixes stored
    content-addressed (two chunks each) in a file store, and reference answers."""
    import codec

    from streamer.llmserver.engine import EngineConfig, prefix_identity
    from streamer.model import hf
    from streamer.store import open_store
    from streamer.store.put import put_prefix
    from streamer.tools.demo_llm import PROFILE

    model, tokenizer = smollm2
    profile = codec.Profile.load(PROFILE)
    config = EngineConfig(served_name=NAME, chunk_tokens=CHUNK, slo=5.0, max_tokens=64)
    identity = prefix_identity(config, tokenizer, profile)
    ids = hf.tokenize(tokenizer, hf.read_text([hf.MEASURE_TEXT]))
    prefixes = [ids[100:100 + 2 * CHUNK], ids[900:900 + 2 * CHUNK]]
    root = str(tmp_path_factory.mktemp("prefix-store"))

    async def put() -> None:
        store = await open_store(root)
        try:
            for prefix in prefixes:
                await put_prefix(store, identity, hf.capture_kv(model, None, prefix), prefix, profile,
                                 budget_bytes=None, vocab_size=hf.vocab_size(model))
        finally:
            await store.close()

    asyncio.run(put())
    return {"model": model, "tokenizer": tokenizer, "profile": profile, "config": config, "ids": ids,
            "prefixes": prefixes, "root": root, "identity": identity}


def reference(served: dict[str, Any], ids: list[int], max_tokens: int = MAX_TOKENS) -> str:
    """The answer after a full prefill, served alone (the correctness oracle)."""
    from streamer.model import hf

    tokens = hf.greedy_generate(served["model"], served["tokenizer"], ids, max_new_tokens=max_tokens)
    return served["tokenizer"].decode(tokens, skip_special_tokens=True)


class CountingStore:
    """The sender's store, counting OPENs (manifest reads) per context: fetches as the
    sender sees them."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.opens: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def get_manifest(self, context_id: str) -> Any:
        self.opens[context_id] = self.opens.get(context_id, 0) + 1
        return await self._store.get_manifest(context_id)


class GatedSource:
    """A ``SenderSource`` whose sessions, once open, wait until ``release`` is set before
    the engine may fetch: concurrent requests all have their lookup answered before any
    fetch can finish, so sharing is deterministic, and a fetch can be caught in flight."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.release = asyncio.Event()
        self.lookups = 0
        self.opened = 0

    async def lookup(self, chain: Any) -> Any:
        match = await self.inner.lookup(chain)
        self.lookups += 1   # counted once answered: its fetch is then started or joined at once
        return match

    @contextlib.asynccontextmanager
    async def session(self, match: Any, config: Any) -> Any:
        async with self.inner.session(match, config) as session:
            self.opened += 1
            await self.release.wait()
            yield session


async def _serve(served: dict[str, Any], *, sender: Any = None, source: Any = None, store: Any = None,
                 policy: str = "fixed:0", **serve: Any) -> Any:
    import dataclasses

    from streamer.llmserver import ServeConfig, start_server
    from streamer.llmserver.engine import SenderSource
    from streamer.net.config import SessionConfig

    session = SessionConfig(slo=5.0, policy=policy, connect_timeout=2.0, max_reconnects=0)
    if source is None and sender is not None:
        source = SenderSource([("127.0.0.1", sender)], session)
    config = dataclasses.replace(served["config"], write_back=store is not None)
    return await start_server(served["model"], served["tokenizer"], served["profile"], config, session,
                              source=source, store=store, serve=ServeConfig(**serve), port=0)


async def _sender(served: dict[str, Any]) -> tuple[Any, CountingStore]:
    import streamer

    store = CountingStore(await streamer.open_store(served["root"]))
    return await streamer.serve(store), store


def _client(server: Any, api_key: str = "unused") -> Any:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=120)


async def _settled(engine: Any) -> None:
    """Wait (bounded) until the engine has nothing running."""
    for _ in range(400):
        if engine.idle:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the engine is still busy: {engine.active} requests, {len(engine.flights)} fetches, "
                         f"{engine.runner.pending} model computations")


@pytest.mark.slow
@pytest.mark.model
async def test_streamed_and_whole_answers_equal_a_full_prefill(served) -> None:
    from streamer.model import hf

    prompt = "The GNU General Public License is a free, copyleft license for"
    expected = reference(served, hf.tokenize(served["tokenizer"], prompt))
    server = await _serve(served)
    try:
        client = _client(server)
        whole = await client.completions.create(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS)
        assert whole.object == "text_completion" and whole.model == NAME and whole.id.startswith("cmpl-")
        assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "length"
        usage = whole.usage
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
            len(hf.tokenize(served["tokenizer"], prompt)), MAX_TOKENS, usage.prompt_tokens + MAX_TOKENS)
        assert usage.kvwire["prefix"] == "none" and usage.kvwire["fetched_tokens"] == 0
        stream = await client.completions.create(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS, stream=True,
                                                 stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
        models = await client.models.list()
        assert [m.id for m in models.data] == [NAME]
        with pytest.raises(openai.BadRequestError, match="greedily"):
            await client.completions.create(model=NAME, prompt=prompt, temperature=0.8)
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="gpt-4", prompt=prompt)
        with pytest.raises(openai.BadRequestError, match="vocabulary"):
            await client.completions.create(model=NAME, prompt=[1, 10 ** 7])
        with pytest.raises(openai.BadRequestError, match="positions"):
            await client.completions.create(model=NAME, prompt=[1] * 8190, max_tokens=8)
        await client.close()
    finally:
        await server.close()


@pytest.mark.slow
@pytest.mark.model
async def test_a_prefix_stored_exactly_answers_as_a_full_prefill_where_a_lossy_level_parts(
        served, tmp_path) -> None:
    """The module's parting prompt: over the profile's best level its answer parts from the
    full prefill's; stored with an exact level (as the server writes prefixes back) and
    fetched at it, the answer is the full prefill's. (The policy takes the exact level where
    the deadline allows, ``test_exact_level``; here it is fixed, as a cautious estimate of
    an unknown link may take the next level instead.)"""
    import codec
    import streamer
    from streamer.model import hf
    from streamer.store.put import put_prefix

    prefix = served["prefixes"][0][:CHUNK]
    prompt = prefix + served["ids"][3000:3020]
    expected = reference(served, prompt)
    kv = hf.capture_kv(served["model"], None, prefix)
    store = await streamer.open_store(str(tmp_path))
    match = await put_prefix(store, served["identity"], kv, prefix, served["profile"], budget_bytes=None,
                             vocab_size=hf.vocab_size(served["model"]), exact=True)
    manifest = await store.get_manifest(match.context_id)
    lossy = codec.decode(await store.get_chunk(match.context_id, manifest.version, 0, 1), served["profile"])
    tokens = hf.generate_with_kv(served["model"], None, lossy, prompt[CHUNK:], max_new_tokens=MAX_TOKENS)
    assert served["tokenizer"].decode(tokens, skip_special_tokens=True) != expected   # the premise
    sender = await streamer.serve(store)
    server = await _serve(served, sender=sender.port, policy="fixed:0")
    try:
        client = _client(server)
        answer = await client.completions.create(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS)
        usage = answer.usage.kvwire
        assert usage["prefix"] == "fetched" and usage["exact_level"] and usage["levels"] == [0], usage
        assert answer.choices[0].text == expected
        await client.close()
    finally:
        await server.close()
        await sender.close()
        await store.close()


@pytest.mark.slow
@pytest.mark.model
async def test_a_stored_prefix_is_fetched_and_the_answer_equals_a_full_prefill(served) -> None:
    sender, counting = await _sender(served)
    server = await _serve(served, sender=sender.port)
    try:
        client = _client(server)
        prompt = served["prefixes"][0] + served["ids"][2000:2007]
        answer = await client.completions.create(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                                                 extra_body={"kvwire": {"slo": 3.0}})
        usage = answer.usage.kvwire
        assert usage["prefix"] == "fetched" and usage["chunks"] == 2, usage
        assert usage["slo"] <= 3.0 < served["config"].slo   # the request's deadline, less its lookup
        assert (usage["fetched_tokens"], usage["recomputed_tokens"], usage["prefilled_tokens"]) == (2 * CHUNK, 0, 7)
        assert usage["levels"] == [0, 0] and not usage["exact_level"]
        assert answer.choices[0].text == reference(served, prompt)
        # a prompt that is exactly the stored prefix: its last token is run again for the logits
        exact = await client.completions.create(model=NAME, prompt=served["prefixes"][1], max_tokens=MAX_TOKENS)
        assert exact.usage.kvwire["fetched_tokens"] == 2 * CHUNK
        assert exact.choices[0].text == reference(served, served["prefixes"][1])
        # one chunk in common with a stored prefix: that chunk alone is fetched
        partial = served["prefixes"][0][:CHUNK] + served["ids"][3000:3007]
        shared = await client.completions.create(model=NAME, prompt=partial, max_tokens=MAX_TOKENS)
        assert (shared.usage.kvwire["chunks"], shared.usage.kvwire["fetched_tokens"]) == (1, CHUNK)
        assert shared.choices[0].text == reference(served, partial)
        assert sum(counting.opens.values()) == 3
        await client.close()
    finally:
        await server.close()
        await sender.close()


@pytest.mark.slow
@pytest.mark.model
async def test_concurrent_requests_share_one_fetch_per_prefix(served) -> None:
    """8 requests over 2 stored prefixes and 2 requests with none: exactly 2 fetches (the
    engine's count and the sender's OPENs agree), every answer correct."""
    from streamer.llmserver.engine import SenderSource
    from streamer.net.config import SessionConfig

    sender, counting = await _sender(served)
    source = GatedSource(SenderSource([("127.0.0.1", sender.port)], SessionConfig()))
    server = await _serve(served, source=source)
    ids = served["ids"]
    prompts = [served["prefixes"][i % 2] + ids[4040 + 5 * i:4043 + 5 * i] for i in range(8)]
    prompts += [ids[5000:5010], ids[5100:5140]]   # no stored prefix
    expected = [reference(served, p) for p in prompts]
    try:
        client = _client(server)
        requests = [asyncio.create_task(client.completions.create(model=NAME, prompt=p, max_tokens=MAX_TOKENS))
                    for p in prompts]
        for _ in range(400):   # every request's lookup is answered
            if source.lookups == len(prompts):
                break
            await asyncio.sleep(0.05)
        assert source.lookups == len(prompts)
        source.release.set()
        answers = await asyncio.gather(*requests)
        assert [a.choices[0].text for a in answers] == expected
        assert [a.usage.kvwire["prefix"] for a in answers[:8]].count("fetched") == 2
        assert [a.usage.kvwire["prefix"] for a in answers[:8]].count("joined") == 6
        assert [a.usage.kvwire["reason"] for a in answers[8:]] == ["no stored prefix"] * 2
        assert (server.engine.fetches, server.engine.joins) == (2, 6)
        assert server.engine.decode_prior is not None   # the next fetch plans at the decoder's measured cost
        assert sorted(counting.opens.values()) == [1, 1] and len(counting.opens) == 2
        # both in flight at once (each began before either could finish: the gate held them)
        (a_start, a_end), (b_start, b_end) = {tuple(a.usage.kvwire["fetch_window"]) for a in answers[:8]}
        assert max(a_start, b_start) < min(a_end, b_end)
        await client.close()
        await _settled(server.engine)
    finally:
        await server.close()
        await sender.close()


@pytest.mark.slow
@pytest.mark.model
async def test_a_sender_that_is_down_leaves_a_full_prefill(served) -> None:
    import socket

    with socket.socket() as probe:   # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = await _serve(served, sender=port)
    try:
        client = _client(server)
        prompt = served["prefixes"][0] + served["ids"][2000:2005]
        answer = await client.completions.create(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS)
        assert answer.choices[0].text == reference(served, prompt)
        usage = answer.usage.kvwire
        assert usage["prefix"] == "failed" and usage["reason"].startswith("lookup") and usage["fetched_tokens"] == 0
        await client.close()
    finally:
        await server.close()


@pytest.mark.slow
@pytest.mark.model
async def test_a_client_that_goes_away_leaks_nothing(served) -> None:
    """Mid-generation: the generation stops. Mid-fetch: the fetch nobody waits for is
    cancelled and its connection to the sender closed."""
    from streamer.llmserver.engine import Engine, SenderSource
    from streamer.net.config import SessionConfig

    sender, _ = await _sender(served)
    source = GatedSource(SenderSource([("127.0.0.1", sender.port)], SessionConfig()))
    source.release.set()
    server = await _serve(served, source=source)
    steps = 0
    gate = threading.Event()
    decode = Engine._decode

    def counted(self: Engine, state: dict) -> dict:
        """Decoding steps, counted; each waits until the test lets it go on, so none
        can finish between the first piece of text going out and the client leaving."""
        nonlocal steps
        steps += 1
        gate.wait(60)
        return decode(self, state)

    server.engine._decode = counted.__get__(server.engine)
    try:
        client = _client(server)
        prompt = served["prefixes"][0] + served["ids"][4040:4043]   # its first new token is text
        stream = await client.completions.create(model=NAME, prompt=prompt, max_tokens=60, stream=True)
        async for _ in stream:
            break
        await stream.close()
        for _ in range(400):   # the handler is cancelled
            if not server.engine.active:
                break
            await asyncio.sleep(0.05)
        gate.set()
        await _settled(server.engine)
        # the step running (or queued) when the client left is the last
        assert steps <= 1, "the generation went on after its client left"
        # now a client that leaves while its prefix is being fetched
        source.release.clear()
        request = asyncio.create_task(client.completions.create(model=NAME, prompt=served["prefixes"][1] + [13],
                                                                max_tokens=4))
        for _ in range(400):   # the fetch's session is open at the sender
            if source.opened == 2:
                break
            await asyncio.sleep(0.05)
        (flight,) = server.engine.flights.values()
        assert sender.sessions >= 1
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        await _settled(server.engine)
        assert flight.task.cancelled()
        for _ in range(100):
            if sender.sessions == 0:
                break
            await asyncio.sleep(0.05)
        assert sender.sessions == 0
        assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("kvwire-")]
        await client.close()
    finally:
        await server.close()
        await sender.close()


@pytest.mark.slow
@pytest.mark.model
async def test_a_full_prefill_is_written_back_and_fetched_next_time(served, tmp_path) -> None:
    import streamer
    from streamer.store.prefix import prefix_chain

    root = str(tmp_path / "store")
    store = await streamer.open_store(root)
    sender = await streamer.serve(store)
    server = await _serve(served, sender=sender.port, store=store)
    prompt = served["ids"][6000:6000 + 2 * CHUNK + 5]
    try:
        client = _client(server)
        first = await client.completions.create(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS)
        assert first.usage.kvwire["reason"] == "no stored prefix"
        await _settled(server.engine)
        assert server.engine.write_backs == 1
        match = await store.lookup_prefix(prefix_chain(served["identity"], prompt))
        assert match is not None and match.chunks == 2   # the whole chunks only
        second = await client.completions.create(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS)
        assert second.usage.kvwire["fetched_tokens"] == 2 * CHUNK
        assert second.choices[0].text == first.choices[0].text == reference(served, prompt)
        await _settled(server.engine)
        assert server.engine.write_backs == 1   # KV over a fetched prefix is never written
        await client.close()
    finally:
        await server.close()
        await sender.close()
        await store.close()


@pytest.mark.slow
@pytest.mark.model
async def test_with_a_token_every_request_but_healthz_needs_it(served) -> None:
    import aiohttp

    server = await _serve(served, api_token=TOKEN)
    try:
        with pytest.raises(openai.AuthenticationError):
            await _client(server, "wrong-key").completions.create(model=NAME, prompt="hi", max_tokens=1)
        with pytest.raises(openai.AuthenticationError):
            await _client(server, "wrong-key").models.list()
        ok = await _client(server, TOKEN).completions.create(model=NAME, prompt="hi", max_tokens=1)
        assert ok.usage.completion_tokens == 1
        async with aiohttp.ClientSession() as http:
            async with http.get(server.url + "/healthz") as r:
                assert r.status == 200 and (await r.json())["model"] == NAME
            async with http.post(server.url + "/v1/completions", data=b"{") as r:
                assert r.status == 401   # the token is checked before the body is read
    finally:
        await server.close()


def test_the_command_refuses_to_listen_off_loopback_without_a_token(capsys, monkeypatch) -> None:
    """Before the model loads: nothing is loaded when the answer is no."""
    from streamer.llmserver.protocol import API_TOKEN_ENV
    from streamer.tools.cli import main

    monkeypatch.delenv(API_TOKEN_ENV, raising=False)
    assert main(["serve-openai", "--listen", "0.0.0.0:0"]) == 2
    assert "without an API token" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.model
async def test_over_max_requests_a_request_is_refused_and_a_huge_body_too(served) -> None:
    import aiohttp

    from streamer.llmserver.engine import SenderSource
    from streamer.net.config import SessionConfig

    sender, _ = await _sender(served)
    source = GatedSource(SenderSource([("127.0.0.1", sender.port)], SessionConfig()))
    server = await _serve(served, source=source, max_requests=1)
    try:
        client = _client(server)
        held = asyncio.create_task(client.completions.create(model=NAME, prompt=served["prefixes"][0] + [13],
                                                             max_tokens=2))
        for _ in range(400):   # the first request holds its fetch open
            if source.opened:
                break
            await asyncio.sleep(0.05)
        with pytest.raises(openai.RateLimitError):
            await client.completions.create(model=NAME, prompt="hi", max_tokens=1)
        async with aiohttp.ClientSession() as http:
            async with http.post(server.url + "/v1/completions", data=b"x" * (2 << 20)) as r:
                assert r.status == 413 and "error" in await r.json()
            async with http.get(server.url + "/v1/nowhere") as r:
                assert r.status == 404 and "error" in await r.json()
        source.release.set()
        assert (await held).usage.kvwire["prefix"] == "fetched"
        await client.close()
    finally:
        await server.close()
        await sender.close()
