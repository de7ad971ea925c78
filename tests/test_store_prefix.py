"""Content-addressed prefixes: the hash chain (pure), lookups, put_prefix and LRU eviction
against a file store, a real redis and a real Redis Cluster (``store_url``)."""
from __future__ import annotations

import asyncio
import hashlib
import json
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.crc import key_slot

import codec
from codec.container import FORMAT_VERSION
from streamer.store import (MAX_LOOKUP_CHAIN, PREFIX_SCHEME, ContextExists, ContextNotFound, PrefixIdentity,
                            PrefixMatch, Store, open_store, prefix_chain, prefix_context_id)
from streamer.store.put import decode_tokens, put_context, put_prefix, stored_bytes
from streamer.store.redis import RedisStore

CHUNK = 32
IDENTITY = PrefixIdentity(model="HuggingFaceTB/SmolLM2-135M-Instruct", tokenizer="smollm2-tok",
                          profile_id="p0", chunk_tokens=4, format_version=5)


# ------------------------------------------------------------------ the chain
def test_chain_follows_the_documented_encoding() -> None:
    """h_0 and h_i written out by hand from the module docstring."""
    def field(s: str) -> bytes:
        return struct.pack("<I", len(s.encode())) + s.encode()

    identity = (field(IDENTITY.model) + field(IDENTITY.tokenizer) + field(IDENTITY.profile_id)
                + struct.pack("<II", 4, 5))
    assert IDENTITY.to_bytes() == identity
    h = hashlib.sha256(b"kvwire-prefix" + struct.pack("<I", PREFIX_SCHEME) + identity).digest()
    expected = []
    for chunk in ([1, 2, 3, 4], [5, 6, 70000]):
        h = hashlib.sha256(h + struct.pack("<I", len(chunk)) + np.array(chunk, "<u4").tobytes()).digest()
        expected.append(h.hex())
    assert prefix_chain(IDENTITY, [1, 2, 3, 4, 5, 6, 70000]) == expected
    assert prefix_chain(IDENTITY, np.array([1, 2, 3, 4, 5, 6, 70000], np.int64)) == expected
    assert prefix_chain(IDENTITY, torch.tensor([1, 2, 3, 4, 5, 6, 70000])) == expected
    assert prefix_context_id(expected) == "px-" + expected[-1]


tokens = st.lists(st.integers(0, 2 ** 32 - 1), min_size=1, max_size=40)


@settings(max_examples=100, deadline=None)
@given(ids=tokens, cut=st.integers(1, 40), chunk=st.integers(1, 9))
def test_a_prefix_of_the_tokens_has_a_prefix_of_the_chain(ids: list[int], cut: int, chunk: int) -> None:
    identity = PrefixIdentity("m", "t", "p", chunk, 5)
    cut = min(cut, len(ids))
    whole, part = prefix_chain(identity, ids), prefix_chain(identity, ids[:cut])
    assert len(whole) == -(-len(ids) // chunk) and len(part) == -(-cut // chunk)
    full = cut // chunk                      # the chunks the cut leaves whole
    assert part[:full] == whole[:full]
    if cut % chunk and cut < len(ids):       # a partial last chunk is a different chunk
        assert part[-1] != whole[len(part) - 1]
    assert len(set(whole)) == len(whole)


@settings(max_examples=100, deadline=None)
@given(ids=tokens, chunk=st.integers(1, 9), data=st.data())
def test_changing_a_token_changes_every_later_hash(ids: list[int], chunk: int, data: st.DataObject) -> None:
    identity = PrefixIdentity("m", "t", "p", chunk, 5)
    at = data.draw(st.integers(0, len(ids) - 1))
    changed = ids[:at] + [(ids[at] + data.draw(st.integers(1, 2 ** 32 - 1))) % 2 ** 32] + ids[at + 1:]
    before, after = prefix_chain(identity, ids), prefix_chain(identity, changed)
    first = at // chunk
    assert before[:first] == after[:first]
    assert all(a != b for a, b in zip(before[first:], after[first:]))


@settings(max_examples=50, deadline=None)
@given(ids=tokens, field=st.sampled_from(["model", "tokenizer", "profile_id", "chunk_tokens", "format_version"]))
def test_changing_the_identity_changes_every_hash(ids: list[int], field: str) -> None:
    base = PrefixIdentity("m", "t", "p", 3, 5)
    value = getattr(base, field)
    other = PrefixIdentity(**{**base.__dict__, field: value + 1 if isinstance(value, int) else value + "x"})
    before, after = prefix_chain(base, ids), prefix_chain(other, ids)
    assert not set(before) & set(after)


def test_length_prefixes_keep_identities_apart() -> None:
    """Fields that concatenate to the same string still hash apart."""
    assert prefix_chain(PrefixIdentity("ab", "c", "p", 2, 5), [1]) != \
        prefix_chain(PrefixIdentity("a", "bc", "p", 2, 5), [1])


@pytest.mark.parametrize("ids, message", [
    ([], "empty"),
    ([1, -1], "negative"),
    ([2 ** 32], "does not fit 32 bits"),
    ([[1, 2]], "flat sequence"),
    ([0.5], "must be integers"),
])
def test_bad_token_ids_are_value_errors(ids, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        prefix_chain(IDENTITY, ids)


@pytest.mark.parametrize("change, message", [
    ({"chunk_tokens": 0}, "chunk_tokens"), ({"chunk_tokens": True}, "chunk_tokens"),
    ({"format_version": -1}, "format_version"), ({"model": ""}, "model"), ({"tokenizer": None}, "tokenizer"),
])
def test_bad_identities_are_value_errors(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PrefixIdentity(**{**IDENTITY.__dict__, **change})


def test_bad_chains_are_value_errors() -> None:
    with pytest.raises(ValueError, match="empty"):
        prefix_context_id([])
    with pytest.raises(ValueError, match="64 lowercase hex"):
        prefix_context_id(["AB" * 32])
    with pytest.raises(ValueError, match="not one string"):
        prefix_context_id("ab" * 32)
    with pytest.raises(ValueError, match="chunks must be an int >= 1"):
        PrefixMatch("px-a", 0)


# ------------------------------------------------------------------ the stores
@pytest.fixture(scope="module")
def profile(codec_make_kv) -> codec.Profile:
    return codec.calibrate([codec_make_kv(4, layers=2, tokens=200, heads=2, head_dim=8)])


@pytest.fixture(scope="module")
def identity(profile: codec.Profile) -> PrefixIdentity:
    return PrefixIdentity("tiny-model", "tiny-tokenizer", profile.id, CHUNK, FORMAT_VERSION)


@pytest.fixture(scope="module")
def make_kv(codec_make_kv):
    def make(tokens: int, seed: int = 3) -> torch.Tensor:
        return codec_make_kv(seed, layers=2, tokens=tokens, heads=2, head_dim=8)
    return make


def prompt(seed: int, tokens: int = 100, shared: list[int] | None = None) -> list[int]:
    head = list(shared or [])
    return head + np.random.default_rng(seed).integers(0, 50_000, tokens - len(head)).tolist()


async def test_longest_prefix_wins_with_shared_and_diverging_prompts(store: Store, identity, profile,
                                                                     make_kv) -> None:
    a = prompt(1)                                    # 100 tokens: chunks of 32, 32, 32, 4
    b = prompt(2, 90, shared=a[:64])                 # the first two chunks shared, then not
    chain_a, chain_b = prefix_chain(identity, a), prefix_chain(identity, b)
    assert await store.lookup_prefix(chain_a) is None

    match = await put_prefix(store, identity, make_kv(100), a, profile, budget_bytes=None, vocab_size=50_000)
    assert match == PrefixMatch(prefix_context_id(chain_a), 4)
    assert await store.lookup_prefix(chain_a) == match
    assert await store.lookup_prefix(chain_b) == PrefixMatch(match.context_id, 2)
    assert await store.lookup_prefix(chain_a[:3]) == PrefixMatch(match.context_id, 3)
    # more tokens: the partial last chunk grows into another chunk, so three chunks match
    assert await store.lookup_prefix(prefix_chain(identity, a + [5, 6])) == PrefixMatch(match.context_id, 3)
    assert await store.lookup_prefix(prefix_chain(identity, prompt(3))) is None
    # another identity shares nothing
    other = PrefixIdentity("another-model", identity.tokenizer, identity.profile_id, CHUNK, FORMAT_VERSION)
    assert await store.lookup_prefix(prefix_chain(other, a)) is None

    manifest = await store.get_manifest(match.context_id)   # an ordinary context, chunked like the chain
    assert [(c.start, c.end) for c in manifest.chunks] == [(0, 32), (32, 64), (64, 96), (96, 100)]
    assert decode_tokens(await store.get_text(match.context_id, manifest.version, 3)) == a[96:]
    assert manifest.vocab_size == 50_000

    match_b = await put_prefix(store, identity, make_kv(90, seed=5), b, profile, budget_bytes=None)
    assert await store.lookup_prefix(chain_b) == PrefixMatch(prefix_context_id(chain_b), 3)
    assert match_b == PrefixMatch(prefix_context_id(chain_b), 3)
    # the entries a already held are kept: an existing copy is never replaced
    assert await store.lookup_prefix(chain_b[:2]) == PrefixMatch(match.context_id, 2)
    assert await store.lookup_prefix(chain_a) == match
    usage = await store.prefix_usage()
    assert usage.contexts == 2
    assert usage.bytes == stored_bytes(manifest) + stored_bytes(await store.get_manifest(match_b.context_id))


async def test_an_exact_copy_is_never_replaced(store: Store, identity, profile, make_kv) -> None:
    ids = prompt(7, 70)
    first = await put_prefix(store, identity, make_kv(70), ids, profile, budget_bytes=None)
    version = (await store.get_manifest(first.context_id)).version
    again = await put_prefix(store, identity, make_kv(70, seed=9), ids, profile, budget_bytes=None)
    assert again == first and (await store.get_manifest(first.context_id)).version == version
    assert (await store.prefix_usage()).contexts == 1
    with pytest.raises(ContextExists):   # the commit that would replace it refuses, atomically
        await put_context(store, first.context_id, make_kv(70), ids, profile=profile, chunk_tokens=CHUNK,
                          replace=False)
    assert (await store.get_manifest(first.context_id)).version == version


async def test_concurrent_puts_of_one_prompt_store_one_context(store: Store, identity, profile, make_kv) -> None:
    ids = prompt(8, 80)
    matches = await asyncio.gather(*(put_prefix(store, identity, make_kv(80), ids, profile, budget_bytes=None)
                                     for _ in range(4)))
    assert len(set(matches)) == 1
    assert await store.list_contexts() == [matches[0].context_id]
    assert (await store.prefix_usage()).contexts == 1
    assert await store.lookup_prefix(prefix_chain(identity, ids)) == matches[0]


async def test_lookups_are_bounded_and_checked(store: Store) -> None:
    assert await store.lookup_prefix([]) is None
    assert await store.lookup_prefix(["ab" * 32] * MAX_LOOKUP_CHAIN) is None
    with pytest.raises(ValueError, match="more than the 512"):
        await store.lookup_prefix(["ab" * 32] * (MAX_LOOKUP_CHAIN + 1))
    with pytest.raises(ValueError, match="64 lowercase hex"):
        await store.lookup_prefix(["xyz"])


async def test_put_prefix_checks_the_identity_against_the_profile(store: Store, identity, profile, make_kv,
                                                                  codec_profile) -> None:
    with pytest.raises(ValueError, match="not the identity's profile"):
        await put_prefix(store, identity, make_kv(40), prompt(1, 40), codec_profile, budget_bytes=None)
    stale = PrefixIdentity(identity.model, identity.tokenizer, profile.id, CHUNK, FORMAT_VERSION - 1)
    with pytest.raises(ValueError, match="format_version"):
        await put_prefix(store, stale, make_kv(40), prompt(1, 40), profile, budget_bytes=None)
    with pytest.raises(ValueError, match="budget_bytes"):
        await put_prefix(store, identity, make_kv(40), prompt(1, 40), profile, budget_bytes=-1)
    assert await store.list_contexts() == []


async def sizes_of(store: Store, matches: list[PrefixMatch]) -> list[int]:
    return [stored_bytes(await store.get_manifest(m.context_id)) for m in matches]


async def test_eviction_is_lru_by_bytes(store: Store, identity, profile, make_kv) -> None:
    """A, B, C put in that order, A looked up; D's put over a budget holding three of the
    four evicts B (the least recently used), keeps the touched A and the named context."""
    named = await put_context(store, "doc", make_kv(60), prompt(20, 60), profile=profile, chunk_tokens=CHUNK)
    prompts = [prompt(30 + i, 60 + 8 * i) for i in range(4)]
    a, b, c = [await put_prefix(store, identity, make_kv(len(p)), p, profile, budget_bytes=None)
               for p in prompts[:3]]
    assert await store.lookup_prefix(prefix_chain(identity, prompts[0])) == a   # touch A
    size_a, size_c = await sizes_of(store, [a, c])
    d = await put_prefix(store, identity, make_kv(len(prompts[3])), prompts[3], profile, budget_bytes=None)
    (size_d,) = await sizes_of(store, [d])
    budget = size_a + size_c + size_d   # room for A, C and D, not for B too
    assert await store.evict_prefixes(budget, keep=d.context_id) == [b.context_id]
    assert sorted(await store.list_contexts()) == sorted(["doc", a.context_id, c.context_id, d.context_id])
    assert (await store.get_manifest("doc")).version == named.version
    assert await store.lookup_prefix(prefix_chain(identity, prompts[1])) is None
    assert await store.lookup_prefix(prefix_chain(identity, prompts[0])) == a
    usage = await store.prefix_usage()
    assert (usage.contexts, usage.bytes) == (3, budget)


async def test_put_prefix_evicts_under_its_budget(store: Store, identity, profile, make_kv) -> None:
    """Through put_prefix: a lookup without touch refreshes nothing, and a budget smaller
    than one context leaves only the context just put; name-addressed ones stay."""
    await put_context(store, "doc", make_kv(60), prompt(20, 60), profile=profile, chunk_tokens=CHUNK)
    prompts = [prompt(40 + i, 64) for i in range(4)]
    first = await put_prefix(store, identity, make_kv(64), prompts[0], profile, budget_bytes=None)
    second = await put_prefix(store, identity, make_kv(64), prompts[1], profile, budget_bytes=None)
    assert await store.lookup_prefix(prefix_chain(identity, prompts[0]), touch=False) == first
    (size,) = await sizes_of(store, [first])
    third = await put_prefix(store, identity, make_kv(64), prompts[2], profile, budget_bytes=2 * size + size // 2)
    assert sorted(await store.list_contexts()) == sorted(["doc", second.context_id, third.context_id])
    last = await put_prefix(store, identity, make_kv(64), prompts[3], profile, budget_bytes=0)
    assert sorted(await store.list_contexts()) == sorted(["doc", last.context_id])
    assert (await store.prefix_usage()).contexts == 1
    for p in prompts[:3]:
        assert await store.lookup_prefix(prefix_chain(identity, p)) is None


async def test_evicting_a_shared_prefix_leaves_other_contexts_whole(store: Store, identity, profile,
                                                                    make_kv) -> None:
    """B shares A's first two chunks but its entries for them point at A; evicting A
    removes those entries only, and B's own chunks still match (and B reads whole)."""
    a = prompt(50, 96)
    b = prompt(51, 96, shared=a[:64])
    match_a = await put_prefix(store, identity, make_kv(96), a, profile, budget_bytes=None)
    match_b = await put_prefix(store, identity, make_kv(96), b, profile, budget_bytes=None)
    assert await store.lookup_prefix(prefix_chain(identity, b)) == match_b   # B used after A
    assert await store.evict_prefixes(1, keep=match_b.context_id) == [match_a.context_id]
    with pytest.raises(ContextNotFound):
        await store.get_manifest(match_a.context_id)
    assert await store.lookup_prefix(prefix_chain(identity, b)) == match_b
    assert await store.lookup_prefix(prefix_chain(identity, a)) is None
    # a new put of a prompt with the shared prefix indexes it again
    c = prompt(52, 70, shared=a[:64])
    match_c = await put_prefix(store, identity, make_kv(70), c, profile, budget_bytes=None)
    assert await store.lookup_prefix(prefix_chain(identity, a)) == PrefixMatch(match_c.context_id, 2)


async def test_delete_context_with_a_version_deletes_only_that_version(store: Store, identity, profile,
                                                                       make_kv) -> None:
    """What eviction relies on so that a re-put since it chose a version survives."""
    ids = prompt(60, 40)
    match = await put_prefix(store, identity, make_kv(40), ids, profile, budget_bytes=None)
    old = (await store.get_manifest(match.context_id)).version
    with pytest.raises(ContextNotFound):
        await store.delete_context(match.context_id, version="not-the-current-one")
    await store.delete_context(match.context_id, version=old)
    with pytest.raises(ContextNotFound):
        await store.get_manifest(match.context_id)


async def test_concurrent_puts_under_a_budget_stay_consistent(store: Store, identity, profile, make_kv) -> None:
    """Eight puts at once, each evicting to a budget of about three contexts: no error, the
    ledger holds exactly the stored content-addressed contexts, and a lookup returns
    nothing or a context that exists."""
    prompts = [prompt(70 + i, 64) for i in range(8)]
    size = (await sizes_of(store, [await put_prefix(store, identity, make_kv(64), prompts[0], profile,
                                                    budget_bytes=None)]))[0]
    await asyncio.gather(*(put_prefix(store, identity, make_kv(64), p, profile, budget_bytes=3 * size)
                           for p in prompts))
    stored = [c for c in await store.list_contexts() if c.startswith("px-")]
    usage = await store.prefix_usage()
    assert usage.contexts == len(stored) >= 1
    assert usage.bytes == sum(await sizes_of(store, [PrefixMatch(c, 1) for c in stored]))
    for p in prompts:
        match = await store.lookup_prefix(prefix_chain(identity, p))
        assert match is None or match.context_id in stored


# --------------------------------------------------------- redis key layout
def test_a_chains_index_is_one_key_and_the_ledger_one_slot() -> None:
    store = RedisStore(client=None, url="redis+cluster://x", prefix="kv")  # keys only: no I/O
    chain = prefix_chain(IDENTITY, list(range(40)))
    assert store._root_key(chain[0]) == f"kv:px:{{{chain[0]}}}"
    assert key_slot(store._root_key(chain[0]).encode()) == key_slot(chain[0].encode())
    assert len({key_slot(k.encode()) for k in store._ledger_keys()}) == 1


@pytest.mark.redis
@pytest.mark.parametrize("url_fixture", ["redis_store_url", "redis_cluster_store_url"])
async def test_a_redis_lookup_is_one_round_trip(url_fixture: str, request, identity, profile, make_kv) -> None:
    async with await open_store(request.getfixturevalue(url_fixture)) as store:
        ids = prompt(80, 100)
        match = await put_prefix(store, identity, make_kv(100), ids, profile, budget_bytes=None)
        calls = []
        call = store._call

        async def counted(operation):
            calls.append(operation)
            return await call(operation)

        store._call = counted
        chain = prefix_chain(identity, ids + list(range(200)))
        assert await store.lookup_prefix(chain) == PrefixMatch(match.context_id, 3)
        assert await store.lookup_prefix(chain, touch=False) == PrefixMatch(match.context_id, 3)
        assert len(calls) == 2


async def test_a_put_racing_an_eviction_ends_registered_and_stored(store: Store, identity, profile, make_kv,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """An eviction that deletes the context between put_prefix's read of the manifest and
    its registration: the put notices, unregisters the dead version and stores it again."""
    ids = prompt(90, 64)
    first = await put_prefix(store, identity, make_kv(64), ids, profile, budget_bytes=None)
    old = (await store.get_manifest(first.context_id)).version
    register = store.register_prefix
    raced = []

    async def evict_first(chain, version, nbytes) -> None:
        if not raced:
            raced.append(await store.evict_prefixes(0))
        await register(chain, version, nbytes)

    monkeypatch.setattr(store, "register_prefix", evict_first)
    assert await put_prefix(store, identity, make_kv(64), ids, profile, budget_bytes=None) == first
    assert raced == [[first.context_id]]
    manifest = await store.get_manifest(first.context_id)
    assert manifest.version != old
    assert await store.lookup_prefix(prefix_chain(identity, ids)) == first
    usage = await store.prefix_usage()
    assert (usage.contexts, usage.bytes) == (1, stored_bytes(manifest))


async def test_unregister_prefix_drops_only_that_version(store: Store, identity, profile, make_kv) -> None:
    ids = prompt(91, 64)
    match = await put_prefix(store, identity, make_kv(64), ids, profile, budget_bytes=None)
    chain = prefix_chain(identity, ids)
    await store.unregister_prefix(chain, "another-version")
    assert await store.lookup_prefix(chain) == match
    await store.unregister_prefix(chain, (await store.get_manifest(match.context_id)).version)
    assert await store.lookup_prefix(chain) is None
    assert (await store.prefix_usage()).contexts == 0
    assert await store.list_contexts() == [match.context_id]   # the data is the caller's to delete


async def test_deleting_a_prefix_context_by_hand_unregisters_it(store: Store, identity, profile, make_kv) -> None:
    ids = prompt(92, 64)
    match = await put_prefix(store, identity, make_kv(64), ids, profile, budget_bytes=None)
    await store.delete_context(match.context_id)
    assert await store.lookup_prefix(prefix_chain(identity, ids)) is None
    assert (await store.prefix_usage()).contexts == 0
    assert await put_prefix(store, identity, make_kv(64), ids, profile, budget_bytes=None) == match
    assert await store.lookup_prefix(prefix_chain(identity, ids)) == match


# ------------------------------------------------------------------------ CLI
async def test_cli_put_by_tokens(store_url: str, tmp_path, profile, make_kv, capsys) -> None:
    import argparse

    from safetensors.torch import save_file

    from streamer.tools import put as put_cli

    parser = argparse.ArgumentParser(prog="kvwire")
    sub = parser.add_subparsers(dest="command", required=True)
    put_cli.register(sub, sub.add_parser("bench").add_subparsers(dest="bench"))

    def run(argv: list[str]) -> int:
        args = parser.parse_args(argv)
        return args.handler(args)

    profile_path = tmp_path / "tiny.kvprofile"
    profile.save(profile_path)
    prompts = [prompt(100 + i, 64) for i in range(3)]
    common = ["put", "--store", store_url, "--profile", str(profile_path), "--chunk-tokens", str(CHUNK)]
    for i, ids in enumerate(prompts):
        save_file({"kv": make_kv(64, seed=i)}, str(tmp_path / f"kv{i}.safetensors"))
        (tmp_path / f"ids{i}.json").write_text(json.dumps(ids))
        argv = common + ["--by-tokens", "--model", "tiny-model", "--tokenizer", "tiny-tokenizer",
                         "--kv", str(tmp_path / f"kv{i}.safetensors"), "--tokens", str(tmp_path / f"ids{i}.json")]
        if i == 2:
            argv += ["--prefix-budget", "0"]
        assert await asyncio.to_thread(run, argv) == 0
        assert "content-addressed: 2 chunks" in capsys.readouterr().out
    identity = PrefixIdentity("tiny-model", "tiny-tokenizer", profile.id, CHUNK, FORMAT_VERSION)
    async with await open_store(store_url) as store:
        assert await store.lookup_prefix(prefix_chain(identity, prompts[0])) is None   # evicted
        last = await store.lookup_prefix(prefix_chain(identity, prompts[2]))
        assert last == PrefixMatch(prefix_context_id(prefix_chain(identity, prompts[2])), 2)
        assert await store.list_contexts() == [last.context_id]
    files = ["--kv", str(tmp_path / "kv0.safetensors"), "--tokens", str(tmp_path / "ids0.json")]
    assert await asyncio.to_thread(run, common + ["--by-tokens"] + files) == 1
    assert "--by-tokens needs --model and --tokenizer" in capsys.readouterr().err
    assert await asyncio.to_thread(run, common + ["--context", "doc", "--prefix-budget", "5"] + files) == 1
    assert "go with --by-tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run(common + ["--context", "doc", "--by-tokens"] + files)
