"""The completions engine: a causal LM, the stored prefixes of its prompts, greedy decoding.

Per request (``Engine.complete``):

1. the prompt's token ids are hashed into their prefix chain (``streamer.store.prefix``:
   the served model, tokenizer, codec profile and ``chunk_tokens`` in every hash) and the
   prefix source is asked for the longest stored prefix of it, within the request's
   deadline;
2. that prefix is fetched through ``StreamSession`` under what is left of the deadline,
   layers copied into a ``CacheAssembler`` as they arrive and chunks that come as text
   recomputed with the model. Requests for the same (context, chunks) share one fetch
   (single-flight); fetches of different prefixes run at once. A request that goes away
   releases its share, and a fetch nobody waits for any more is cancelled;
3. the rest of the prompt is prefilled over the fetched KV and the answer is generated
   greedily, token by token. When the sender is down, nothing is stored or the fetch
   fails, the whole prompt is prefilled (the usage says why);
4. after a full prefill (no fetched KV at all), the prompt's whole chunks' KV, exact, can
   be written back to the store in the background (``put_prefix``), for this and other
   nodes. KV computed over a fetched (lossy) prefix is never written.

All model compute (prefill, each decoding step, recomputing text chunks) runs on one
worker thread, in order (``ModelRunner``): torch never blocks the event loop, and the
requests' steps interleave, so concurrent answers progress together. A cancelled request
stops at its next step; the step that is running finishes on its own.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncContextManager, Awaitable, Callable, Protocol, Sequence

from streamer.llmserver.protocol import APIError, CompletionRequest, TextStream

if TYPE_CHECKING:
    import torch

    import codec
    from streamer.adapt.decoding import DecodeCost
    from streamer.adapt.recompute import RecomputeCost
    from streamer.fetch.report import FetchReport
    from streamer.net.config import SessionConfig
    from streamer.net.session import StreamSession
    from streamer.store import Store
    from streamer.store.prefix import PrefixIdentity, PrefixMatch

log = logging.getLogger("kvwire.llmserver")

#: the shortest deadline a prefix fetch is started with (what is left of a request's SLO
#: after its lookup may be less; the policy then sends text, which costs a prefill anyway)
MIN_FETCH_SLO = 0.05


class PrefixSource(Protocol):
    """Where stored prefixes are looked up and fetched from (a sender, or several)."""

    async def lookup(self, chain: Sequence[str]) -> "PrefixMatch | None":
        """The longest stored prefix of ``chain``, or None."""

    def session(self, match: "PrefixMatch", config: "SessionConfig") -> AsyncContextManager["StreamSession"]:
        """A session fetching the first ``match.chunks`` chunks of ``match.context_id``, to
        enter (``async with``: open) and ``fetch()``."""


class SenderSource:
    """Prefixes on sender daemons: looked up on the first, fetched from it with the others
    as fallbacks (``StreamSession(servers=...)``)."""

    def __init__(self, servers: Sequence[tuple[str, int]], config: "SessionConfig") -> None:
        if not servers:
            raise ValueError("a sender source needs at least one sender address")
        self.servers = [(h, int(p)) for h, p in servers]
        self.config = config

    async def lookup(self, chain: Sequence[str]) -> "PrefixMatch | None":
        from streamer.net.prefix_fetch import lookup_prefix

        host, port = self.servers[0]
        return await lookup_prefix(host, port, chain, config=self.config)

    def session(self, match: "PrefixMatch", config: "SessionConfig") -> "StreamSession":
        from streamer.net.session import StreamSession

        (host, port), rest = self.servers[0], self.servers[1:]
        return StreamSession(host, port, match.context_id, config=config, servers=rest, chunks=match.chunks)


class ModelRunner:
    """Runs every model computation on one worker thread, in submission order. A caller
    that is cancelled drops its computation if it has not started; one that has runs to
    its end (torch cannot be interrupted) and its result is dropped."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvwire-model")
        #: computations submitted and not finished (set.add/discard are atomic: the worker
        #: thread discards, the loop adds)
        self._running: set[concurrent.futures.Future] = set()

    @property
    def pending(self) -> int:
        return len(self._running)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        future = self._pool.submit(fn, *args)
        self._running.add(future)
        future.add_done_callback(self._running.discard)
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


@dataclass
class FetchedPrefix:
    """A prefix's KV as fetched (shared, read-only, by every request that joined it)."""

    context_id: str
    chunks: int
    kv: "torch.Tensor"
    #: per chunk: the level it came at ("text": recomputed here), and its token count
    levels: list[int | str]
    chunk_tokens: list[int]
    #: the context has an exact level (level 0: the KV as a full prefill computed it)
    exact_level: bool
    report: "FetchReport"
    #: wall-clock (Unix) seconds the fetch started (lookup done) and ended: requests that
    #: share it report the same window, so overlapping fetches show as overlapping windows
    started: float
    ended: float

    @property
    def tokens(self) -> int:
        return int(self.kv.shape[2])

    @property
    def recomputed_tokens(self) -> int:
        return sum(n for level, n in zip(self.levels, self.chunk_tokens) if level == "text")


class _Flight:
    """One prefix fetch and how many requests wait for it."""

    def __init__(self, task: "asyncio.Task[FetchedPrefix]") -> None:
        self.task = task
        self.waiters = 0


@dataclass
class EngineConfig:
    """How the engine serves: its prefix chunking, deadlines and limits."""

    #: the name clients ask for (``model`` of a request, GET /v1/models)
    served_name: str
    #: tokens per stored chunk: part of every prefix hash, so it must equal the store's
    chunk_tokens: int = 256
    #: default deadline (s) of a request's prefix lookup and fetch, from the request's arrival
    slo: float = 1.0
    #: the largest ``max_tokens`` a request may ask for
    max_tokens: int = 1024
    #: the most prompt tokens a request may have (None: the model's positions less max_tokens)
    max_prompt_tokens: int | None = None
    #: identity of the weights in the prefix hashes (default: ``served_name``); nodes that
    #: share a store must agree on it and serve the same weights under it
    model_id: str | None = None
    #: after a full prefill, write the prompt's whole chunks back to the store
    write_back: bool = True
    #: store written-back prefixes with an exact level too (``put_context(exact=True)``): a
    #: request whose deadline allows it then gets the KV a full prefill computes, so its
    #: answer equals a full prefill's; without it every fetched chunk is lossy, and greedy
    #: answers part from a full prefill's wherever a level's error tips a near tie
    exact_level: bool = True
    #: bytes of content-addressed contexts the store keeps (``put_prefix`` evicts beyond it)
    store_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        from streamer.net.config import require_int, require_positive

        if not isinstance(self.served_name, str) or not self.served_name:
            raise ValueError(f"EngineConfig.served_name must be a non-empty string, got {self.served_name!r}")
        require_int("EngineConfig", "chunk_tokens", self.chunk_tokens, 1)
        require_positive("EngineConfig", "slo", self.slo)
        require_int("EngineConfig", "max_tokens", self.max_tokens, 1)
        for name in ("max_prompt_tokens", "store_budget_bytes"):
            if getattr(self, name) is not None:
                require_int("EngineConfig", name, getattr(self, name), 1)


@dataclass
class Outcome:
    """What ``Engine.complete`` returns: the answer and how its prompt's KV was obtained."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    kvwire: dict[str, Any] = field(default_factory=dict)


def tokenizer_identity(tokenizer: Any) -> str:
    """A digest of the tokenizer's vocabulary (token -> id): two nodes agree on it when they
    cut text into the same ids."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return "vocab-sha256:" + hashlib.sha256(json.dumps(vocab, ensure_ascii=True).encode()).hexdigest()[:32]


def prefix_identity(config: EngineConfig, tokenizer: Any, profile: "codec.Profile") -> "PrefixIdentity":
    """What the served model's prefix hashes cover: the weights' identity (``model_id``,
    else the served name), the tokenizer's vocabulary, the codec profile, ``chunk_tokens``
    and the codec's blob format. A node that puts prefixes for this server (or another
    server sharing its store) hashes with the same identity."""
    from codec.container import FORMAT_VERSION

    from streamer.store.prefix import PrefixIdentity

    return PrefixIdentity(model=config.model_id or config.served_name, tokenizer=tokenizer_identity(tokenizer),
                          profile_id=profile.id, chunk_tokens=config.chunk_tokens, format_version=FORMAT_VERSION)


class Engine:
    """See the module docstring. ``source``: where prefixes are fetched from (None: every
    request is a full prefill); ``store``: where full prefills are written back (None: not)."""

    def __init__(self, model: Any, tokenizer: Any, profile: "codec.Profile", config: EngineConfig,
                 session_config: "SessionConfig", *, source: PrefixSource | None = None,
                 store: "Store | None" = None) -> None:
        from streamer.model import hf

        self.model, self.tokenizer, self.profile = model, tokenizer, profile
        self.config = config
        self.session_config = session_config
        self.source = source
        self.store = store
        layers, heads, head_dim = hf.kv_shape(model)
        profile.check_shape(layers, heads, head_dim)
        self.vocab_size = hf.vocab_size(model)
        self.positions = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
        self.eos = hf.eos_ids(model)
        #: the model computes off the CPU, so recomputing text does not slow the CPU decoder
        self._on_device = next(model.parameters()).device.type != "cpu"
        self.identity = prefix_identity(config, tokenizer, profile)
        self.runner = ModelRunner()
        self.flights: dict[tuple[str, int], _Flight] = {}
        #: requests being answered now
        self.active = 0
        #: prefix fetches started, requests that joined one, and write-backs done
        self.fetches = 0
        self.joins = 0
        self.write_backs = 0
        self._writes: dict[str, asyncio.Task[None]] = {}
        self._recompute: "RecomputeCost | None" = None
        #: the decoder's cost as the last fetch measured it: the next fetch's first chunks are
        #: planned at it (``SessionConfig.decode_prior``), as the receiver daemon does
        self.decode_prior: "DecodeCost | None" = None

    # ------------------------------------------------------------------ set-up
    async def warm_up(self) -> None:
        """Measure the model's recompute cost, per token and per token of context before it
        (the policy weighs text chunks at it: ``hf.recompute_cost``), and make the codec's
        kernels ready, before the first request is timed."""
        from codec import warmup

        from streamer.model import hf

        await asyncio.to_thread(warmup.warm_up)
        self._recompute = await self.runner.run(hf.recompute_cost, self.model, self.config.chunk_tokens)

    # ------------------------------------------------------------------ requests
    def prompt_ids(self, request: CompletionRequest) -> list[int]:
        """The request's prompt as token ids, checked against the vocabulary and the
        model's positions; APIError(400) otherwise."""
        from streamer.model import hf

        if isinstance(request.prompt, str):
            ids = hf.tokenize(self.tokenizer, request.prompt)
            if not ids:
                raise APIError(400, "the prompt has no tokens", param="prompt")
        else:
            ids = list(request.prompt)
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise APIError(400, f"token id {bad} is out of the vocabulary (0-{self.vocab_size - 1})",
                               param="prompt")
        limit = self.config.max_prompt_tokens or self.positions - request.max_tokens
        if len(ids) > limit or len(ids) + request.max_tokens > self.positions:
            raise APIError(400, f"the prompt has {len(ids)} tokens and max_tokens is {request.max_tokens}: "
                                f"at most {min(limit, self.positions - request.max_tokens)} prompt tokens fit "
                                f"(the model has {self.positions} positions)", param="prompt",
                           code="context_length_exceeded")
        return ids

    async def complete(self, request: CompletionRequest, ids: list[int],
                       on_text: Callable[[str], Awaitable[None]] | None = None) -> Outcome:
        """Answer ``request`` (prompt ``ids``, from ``prompt_ids``); each new piece of text
        goes to ``on_text`` as it is generated (streaming). Cancelling the caller stops the
        generation at its next step and releases the request's share of its fetch."""
        arrived = time.monotonic()
        slo = request.slo if request.slo is not None else self.config.slo
        self.active += 1
        try:
            prefix, usage = await self._prefix(ids, slo, arrived)
            text = TextStream(lambda t: self.tokenizer.decode(t, skip_special_tokens=True))
            finish = "length"
            state = await self.runner.run(self._prefill, prefix, ids)
            usage["first_token_seconds"] = round(time.monotonic() - arrived, 6)
            if prefix is None and self.store is not None and self.config.write_back:
                self._write_back(ids, state.pop("prompt_kv", None))
            for step in range(request.max_tokens):
                token = state["token"]
                if token in self.eos:
                    finish = "stop"
                    break
                piece = text.push(token)
                if piece and on_text is not None:
                    await on_text(piece)
                if step + 1 < request.max_tokens:
                    state = await self.runner.run(self._decode, state)
            rest = text.flush()
            if rest and on_text is not None:
                await on_text(rest)
            return Outcome(text.text, text.ids, finish, len(ids), usage)
        finally:
            self.active -= 1

    # ------------------------------------------------------------------ the prefix
    async def _prefix(self, ids: list[int], slo: float, arrived: float) -> tuple[FetchedPrefix | None, dict]:
        """The longest stored prefix of ``ids``, fetched (or joined), and the usage's kvwire
        object; (None, why) when the prompt is prefilled whole."""
        usage: dict[str, Any] = {"fetched_tokens": 0, "recomputed_tokens": 0, "prefilled_tokens": len(ids),
                                 "levels": [], "prefix": "none"}
        if self.source is None:
            usage["reason"] = "no prefix source"
            return None, usage
        from streamer.net.client import StreamError
        from streamer.net.session import FetchFailed
        from streamer.store.prefix import MAX_LOOKUP_CHAIN, prefix_chain

        chain = prefix_chain(self.identity, ids)[:MAX_LOOKUP_CHAIN]
        try:
            async with asyncio.timeout(max(slo - (time.monotonic() - arrived), MIN_FETCH_SLO)):
                match = await self.source.lookup(chain)
        except (StreamError, OSError, TimeoutError, ValueError) as exc:
            usage.update(prefix="failed", reason=f"lookup: {type(exc).__name__}: {exc}"[:300])
            return None, usage
        if match is None:
            usage["reason"] = "no stored prefix"
            return None, usage
        usage.update(context_id=match.context_id, chunks=match.chunks)
        left = max(slo - (time.monotonic() - arrived), MIN_FETCH_SLO)
        try:
            prefix, joined = await self._shared_fetch(match, left, len(ids))
        except (StreamError, FetchFailed, OSError, TimeoutError, ValueError) as exc:
            usage.update(prefix="failed", reason=f"fetch: {type(exc).__name__}: {exc}"[:300])
            return None, usage
        except Exception as exc:   # a fault of ours: logged, and the request is still answered
            log.exception("fetching the prefix %s failed", match.context_id)
            usage.update(prefix="failed", reason=f"fetch: internal error: {type(exc).__name__}: {exc}"[:300])
            return None, usage
        if prefix.tokens > len(ids):   # the chain matched, so this is a store's or sender's fault
            usage.update(prefix="failed", reason=f"the stored prefix has {prefix.tokens} tokens, the prompt "
                                                 f"{len(ids)}")
            return None, usage
        usage.update(prefix="joined" if joined else "fetched", fetched_tokens=prefix.tokens - prefix.recomputed_tokens,
                     recomputed_tokens=prefix.recomputed_tokens, prefilled_tokens=len(ids) - prefix.tokens,
                     levels=list(prefix.levels), exact_level=prefix.exact_level,
                     fetch_seconds=round(prefix.ended - prefix.started, 6),
                     fetch_window=[round(prefix.started, 6), round(prefix.ended, 6)],
                     deadline_met=prefix.report.deadline_met, slo=prefix.report.slo)
        return prefix, usage

    async def _shared_fetch(self, match: "PrefixMatch", slo: float, prompt_tokens: int) -> tuple[FetchedPrefix, bool]:
        """The fetch of ``match``: the one running for it, else a new one for a prompt of
        ``prompt_tokens`` tokens; (prefix, joined). Requests that share the match share the
        prefix's tokens (its hashes commit to them), whatever follows."""
        key = (match.context_id, match.chunks)
        flight = self.flights.get(key)
        joined = flight is not None
        if flight is None:
            task = asyncio.create_task(self._fetch(match, slo, prompt_tokens), name=f"kvwire-prefix-{match.context_id}")
            flight = self.flights[key] = _Flight(task)
            task.add_done_callback(lambda _: self._land(key, flight))
            self.fetches += 1
        else:
            self.joins += 1
        flight.waiters += 1
        try:
            return await asyncio.shield(flight.task), joined
        finally:
            flight.waiters -= 1
            if flight.waiters == 0 and not flight.task.done():
                flight.task.cancel()   # nobody waits for it any more

    def _land(self, key: tuple[str, int], flight: _Flight) -> None:
        if self.flights.get(key) is flight:
            del self.flights[key]
        if not flight.task.cancelled() and flight.task.exception() is not None and flight.waiters == 0:
            log.debug("prefix fetch %s failed with nobody waiting: %s", key, flight.task.exception())

    async def _fetch(self, match: "PrefixMatch", slo: float, prompt_tokens: int) -> FetchedPrefix:
        """Fetch ``match`` into a ``CacheAssembler``: PrefixMismatch when the opened context
        is not the prefix the match says (its tokens or its profile differ)."""
        from streamer.adapt import decoding
        from streamer.model.hf import CacheAssembler
        from streamer.net.prefix_fetch import check_match

        assert self.source is not None
        # a model on the CPU recomputes text on the cores that decode KV: nothing overlaps
        config = dataclasses.replace(self.session_config, slo=slo,
                                     recompute_overlaps=self.session_config.recompute_overlaps and self._on_device,
                                     decode_prior=self.decode_prior or self.session_config.decode_prior)
        if self._recompute is not None:
            config = dataclasses.replace(config, recompute_seconds_per_token=self._recompute.per_token,
                                         recompute_context_seconds=self._recompute.per_context_token)
        started = time.time()
        async with self.source.session(match, config) as session:
            manifest = session.manifest
            assert manifest is not None
            check_match(manifest, match, self.identity, prompt_tokens)
            assembler = CacheAssembler(self.model, manifest, recompute_seconds_per_token=config.recompute_seconds_per_token)

            async def on_text(chunk: int, token_ids: list[int]) -> None:
                # on the model's thread, where no loop runs: the assembler recomputes at once
                await self.runner.run(assembler.on_text, chunk, token_ids)

            session.set_callbacks(on_layer=assembler.on_layer, on_text=on_text)
            report = await session.fetch()
            self.decode_prior = decoding.measure(session.decodes) or self.decode_prior
        return FetchedPrefix(match.context_id, match.chunks, assembler.kv, [c.level for c in report.chunks],
                             [c.end - c.start for c in manifest.chunks], manifest.exact, report, started,
                             time.time())

    # ------------------------------------------------------------------ the model (worker thread)
    def _prefill(self, prefix: FetchedPrefix | None, ids: list[int]) -> dict[str, Any]:
        """The prompt's KV and first token: the part after the prefix prefilled over the
        prefix's KV (at least the last prompt token, whose logits give the first token)."""
        import torch

        from streamer.model import hf

        with torch.no_grad():
            cache, start = None, 0
            if prefix is not None:
                start = min(prefix.tokens, len(ids) - 1)
                if start:
                    cache = hf.kv_to_cache(prefix.kv[:, :, :start], model=self.model)
            out = hf.decoder_forward(self.model, ids[start:], cache, logits=True)
            cache = hf.out_cache(out)
            state: dict[str, Any] = {"cache": cache, "token": int(out.logits[0, -1].argmax())}
            if prefix is None and self.store is not None and self.config.write_back:
                state["prompt_kv"] = hf.cache_to_kv(cache)
        return state

    def _decode(self, state: dict[str, Any]) -> dict[str, Any]:
        import torch

        from streamer.model import hf

        with torch.no_grad():
            out = hf.decoder_forward(self.model, [state["token"]], state["cache"], logits=True)
        return {"cache": hf.out_cache(out), "token": int(out.logits[0, -1].argmax())}

    # ------------------------------------------------------------------ write-back
    def _write_back(self, ids: list[int], kv: "torch.Tensor | None") -> None:
        """Store the exact KV of the prompt's whole chunks, in the background, once per chain."""
        from streamer.store.prefix import prefix_chain, prefix_context_id

        whole = len(ids) // self.config.chunk_tokens * self.config.chunk_tokens
        if kv is None or not whole:
            return
        key = prefix_context_id(prefix_chain(self.identity, ids[:whole]))
        if key in self._writes:
            return
        task = asyncio.create_task(self._put(kv[:, :, :whole].clone(), ids[:whole]), name=f"kvwire-write-{key}")
        self._writes[key] = task
        task.add_done_callback(lambda _: self._writes.pop(key, None))

    async def _put(self, kv: "torch.Tensor", ids: list[int]) -> None:
        from streamer.store.put import put_prefix

        assert self.store is not None
        try:
            await put_prefix(self.store, self.identity, kv, ids, self.profile,
                             budget_bytes=self.config.store_budget_bytes, vocab_size=self.vocab_size,
                             exact=self.config.exact_level)
            self.write_backs += 1
        except Exception:   # a failed write-back costs the next request a prefill, nothing more
            log.exception("writing back the KV of a %d-token prefix failed", len(ids))

    # ------------------------------------------------------------------ shutdown
    @property
    def idle(self) -> bool:
        """No request, fetch, write-back or model computation is running."""
        return not (self.active or self.flights or self._writes or self.runner.pending)

    async def close(self) -> None:
        """Cancel running fetches, let write-backs finish, stop the model's thread."""
        for flight in list(self.flights.values()):
            flight.task.cancel()
        tasks = [f.task for f in self.flights.values()] + list(self._writes.values())
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.to_thread(self.runner.close)
