"""Fetches shared by every request for the same context (single-flight), their progress
events, and what ends up in the cache.

``Fetcher.fetch(request)`` answers from the cache when the cached quality is good
enough, joins the fetch already running for that context when it is certain to be
good enough (any fetch is, unless the request names a ``min_level`` or a ``fixed:N``
policy: then only a ``fixed:M`` fetch with M <= N is, others are waited out and the
cache is checked again), and otherwise starts one. A fetch is a task of its own: a
requester that goes away does not cancel it, and its result is cached for the next.

A client (``fetch(..., client=KEY)``) may have at most ``max_per_client`` fetches
running that it started; starting one more is refused (429, ``Retry-After``). Joining a
running fetch and a cache hit cost the senders nothing and are not counted; a started
fetch counts until it ends, also past the 202 of ``"wait": false`` and after its
requester went away, since that is how long it occupies the senders.

Each fetch keeps its events (``start``, ``manifest``, ``layer``, ``chunk``, ``text``,
then ``done`` or ``error``) so a late subscriber replays them before following live.
``layer`` events come in (chunk, layer) order, as ``StreamSession`` delivers them, each
with the level it came at (a chunk continued at a lower level mid-chunk has its later
layers at that level; its ``chunk`` event's ``layer_levels`` lists the runs).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Hashable, Mapping, Sequence

from streamer.adapt import decoding
from streamer.receiver.cache import ContextCache, Entry, Quality
from streamer.receiver.metrics import Metrics

if TYPE_CHECKING:
    from streamer.net.config import SessionConfig

log = logging.getLogger("kvwire.receiver")


#: fetches a client may have running at once (``Fetcher.max_per_client``)
DEFAULT_MAX_FETCHES_PER_CLIENT = 8
#: seconds a client past its limit is told to wait (a fetch takes about its SLO)
RETRY_AFTER = 1


class FetchError(Exception):
    """A fetch (or a request for one) failed; ``status`` is the HTTP status to answer,
    ``headers`` go with it (``Retry-After``, ``Allow``, ``WWW-Authenticate``)."""

    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})


@dataclass(frozen=True)
class FetchRequest:
    context_id: str
    slo: float
    policy: str
    #: every chunk must be at this level or better (None: whatever the policy gives)
    min_level: int | None = None
    #: ignore the cache (still joins a fetch already running)
    refresh: bool = False

    @property
    def required_level(self) -> int | None:
        if self.min_level is not None:
            return self.min_level
        return fixed_level(self.policy)


def fixed_level(policy: str) -> int | None:
    if policy.startswith("fixed:"):
        try:
            return int(policy.partition(":")[2])
        except ValueError:
            return None
    return None


def check_fixed_level(policy: str, ladder: int | None, context_id: str) -> None:
    """FetchError(400) when a ``fixed:N`` policy asks for a level the context (stored at
    ``ladder`` levels; None: not known) does not have."""
    level = fixed_level(policy)
    if level is not None and ladder is not None and level >= ladder:
        raise FetchError(400, f"policy {policy!r} asks for level {level}; context {context_id!r} "
                              f"has levels 0-{ladder - 1}")


@dataclass
class Event:
    seq: int
    kind: str
    data: dict[str, Any]

    @property
    def terminal(self) -> bool:
        return self.kind in ("done", "error")


@dataclass
class Outcome:
    """What POST /fetch answers: how it was served and the entry (None while running)."""

    status: str  # "cached", "fetched", "joined" or "running"
    entry: Entry | None
    job: "FetchJob | None" = None
    stored: bool = True

    def to_dict(self, required: int | None) -> dict[str, Any]:
        out: dict[str, Any] = {"status": self.status}
        if self.entry is not None:
            out.update(self.entry.describe())
            out["stored"] = self.stored
            out["quality_met"] = self.entry.quality.satisfies(required)
            out["report"] = self.entry.report
        elif self.job is not None:
            out.update(context_id=self.job.request.context_id, version=self.job.version,
                       events=f"/contexts/{self.job.request.context_id}/events")
        return out


class FetchJob:
    """One fetch of one context, with its event log and subscribers."""

    def __init__(self, fetcher: "Fetcher", request: FetchRequest, client: Hashable | None) -> None:
        self.fetcher = fetcher
        self.request = request
        #: who started it (counted against its ``max_per_client`` until it ends), or None
        self.client = client
        self.events: list[Event] = []
        self._seq = itertools.count(1)
        self._subscribers: set[asyncio.Queue[Event]] = set()
        self.opened = asyncio.Event()   # manifest known, or failed
        self.finished = asyncio.Event()
        self.entry: Entry | None = None
        self.stored = False
        self.error: FetchError | None = None
        self.version: str | None = None
        self.started = time.monotonic()
        self.task: asyncio.Task | None = None

    def guarantees(self, required: int | None) -> bool:
        """True when this fetch's result is certain to be at ``required`` or better."""
        if required is None:
            return True
        level = fixed_level(self.request.policy)  # only a fixed:N policy promises its level
        return level is not None and level <= required

    # ------------------------------------------------------------------ events
    def emit(self, kind: str, **data: Any) -> None:
        event = Event(next(self._seq), kind, data)
        self.events.append(event)
        for queue in self._subscribers:
            queue.put_nowait(event)  # unbounded: a fetch has at most chunks x (layers + 2) + 4 events

    def subscribe(self) -> tuple[list[Event], asyncio.Queue[Event]]:
        """The events so far and a queue of those to come (atomically: none lost or doubled)."""
        queue: asyncio.Queue[Event] = asyncio.Queue()
        self._subscribers.add(queue)
        return list(self.events), queue

    def unsubscribe(self, queue: asyncio.Queue[Event]) -> None:
        self._subscribers.discard(queue)

    # ------------------------------------------------------------------ result
    async def result(self) -> Entry:
        await asyncio.shield(self.finished.wait())
        if self.error is not None:
            raise self.error
        assert self.entry is not None
        return self.entry

    def _fail(self, error: FetchError) -> None:
        self.error = error
        self.emit("error", status=error.status, message=error.message)
        self.opened.set()
        self.finished.set()


#: Idle connections kept per sender for reuse by later fetches.
MAX_IDLE_CONNECTIONS = 4


class Fetcher:
    """Single-flight fetches into ``cache``; see the module docstring.

    Several senders (stateless, over one shared store) share the load: successive
    fetches start on them round-robin, and each fetch has the others, in turn, as
    fallbacks, which ``StreamSession`` moves to on a failed connect or a lost
    connection, resuming where it was (no layer delivered twice).
    """

    def __init__(self, servers: Sequence[tuple[str, int]], cache: ContextCache, metrics: Metrics,
                 session: SessionConfig, *, model: Any = None,
                 max_per_client: int = DEFAULT_MAX_FETCHES_PER_CLIENT) -> None:
        if not servers:
            raise ValueError("the receiver needs at least one sender address")
        self.max_per_client = max_per_client
        #: running fetches by the client that started them (no entry at zero)
        self.per_client: dict[Hashable, int] = {}
        self.servers = [(h, int(p)) for h, p in servers]
        self.cache = cache
        self.metrics = metrics
        self.session = session
        self.model = model  # (model, tokenizer) to recompute text chunks, or None
        self.inflight: dict[str, FetchJob] = {}
        self.closing = False
        self._changed = asyncio.Event()
        #: idle, already authenticated connections per sender, reused by the next fetches
        #: it starts (a new OPEN on the same connection) instead of a new handshake
        self._idle: dict[tuple[str, int], list[Any]] = {}
        self._turn = itertools.count()
        #: the decoder's cost as the last fetch measured it, the next session's
        #: ``decode_prior`` (else the configured one): each fetch's first chunks are planned
        #: at it, as each sender's link memory plans them at the link's rate
        self.decode_prior: decoding.DecodeCost | None = None

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # ------------------------------------------------------------------ requests
    async def fetch(self, request: FetchRequest, *, wait: bool = True, client: Hashable | None = None) -> Outcome:
        """Serve ``request`` from the cache, a running fetch or a new one; FetchError on
        failure, 429 when a new one is needed and ``client`` (None: not limited) has
        ``max_per_client`` running already."""
        required = request.required_level
        cid = request.context_id
        for attempt in range(4):
            if self.closing:
                raise FetchError(503, "the receiver is shutting down")
            entry = None if request.refresh else self.cache.get(cid)
            if entry is not None:
                check_fixed_level(request.policy, entry.quality.ladder, cid)
            if entry is not None and entry.quality.satisfies(required):
                self.metrics.cache_hits.inc()
                return Outcome("cached", entry)
            job = self.inflight.get(cid)
            if job is None:
                self.metrics.cache_misses.labels("refresh" if request.refresh else
                                                 "quality" if entry is not None else "absent").inc()
                job, status = self._start(request, client), "fetched"
            elif job.guarantees(required) or attempt == 3:
                self.metrics.joins.inc()
                status = "joined"
            else:  # the running fetch may come out worse than asked: let it end, then look again
                await asyncio.shield(job.finished.wait())
                continue
            if not wait:
                await asyncio.shield(job.opened.wait())
                if job.error is not None:
                    raise job.error
                if job.finished.is_set():
                    return Outcome(status, job.entry, job, job.stored)
                return Outcome("running", None, job)
            entry = await job.result()
            return Outcome(status, entry, job, job.stored)
        raise AssertionError("unreachable")

    async def wait_for(self, context_id: str, timeout: float) -> FetchJob | None:
        """The running fetch of ``context_id``; waits up to ``timeout`` s for one to start
        (returns None at once if the context is cached, or on timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.inflight.get(context_id)
            if job is not None or context_id in self.cache or self.closing:
                return job
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                return None

    # ------------------------------------------------------------------ fetching
    def _start(self, request: FetchRequest, client: Hashable | None) -> FetchJob:
        if client is not None:
            running = self.per_client.get(client, 0)
            if running >= self.max_per_client:
                raise FetchError(429, f"{running} fetches started by {client} are running, the most allowed "
                                      "at once (max_fetches_per_client); retry when one has ended",
                                 {"Retry-After": str(RETRY_AFTER)})
            self.per_client[client] = running + 1
        job = FetchJob(self, request, client)
        self.inflight[request.context_id] = job
        self.metrics.inflight.inc()
        job.task = asyncio.create_task(self._run(job), name=f"kvwire-receive-{request.context_id}")
        self._notify()
        return job

    async def _run(self, job: FetchJob) -> None:
        from streamer.net.client import ServerError, StreamError
        from streamer.net.session import ContextChanged, ContextTooLarge

        req = job.request
        outcome = "error"
        try:
            job.emit("start", context_id=req.context_id, slo=req.slo, policy=req.policy,
                     min_level=req.min_level)
            for attempt in range(2):
                try:
                    await self._fetch_into(job)
                    break
                except ContextChanged as exc:
                    if attempt:
                        raise
                    log.info("fetch %s: %s; starting over", req.context_id, exc)
                    job.emit("restart", reason=str(exc))
            outcome = "ok"
        except asyncio.CancelledError:
            outcome = "cancelled"
            job._fail(FetchError(503, "fetch cancelled: the receiver is shutting down"))
            raise
        except FetchError as exc:
            outcome = {404: "not_found", 503: "unavailable"}.get(exc.status, "error")
            job._fail(exc)
        except ServerError as exc:
            if exc.code == "not_found":
                outcome = "not_found"
                job._fail(FetchError(404, exc.message))
            elif exc.code == "bad_request":
                job._fail(FetchError(400, f"sender: {exc}"))
            else:
                outcome = "unavailable"
                job._fail(FetchError(503, f"sender error: {exc}"))
        except ContextTooLarge as exc:   # the manifest's size is over what this receiver keeps
            job._fail(FetchError(413, str(exc)))
        except (StreamError, OSError, asyncio.TimeoutError) as exc:
            outcome = "unavailable"
            job._fail(FetchError(503, f"sender unavailable: {exc or type(exc).__name__}"))
        except Exception as exc:  # a bug or a decode failure must not take the daemon down
            log.exception("fetch %s failed", req.context_id)
            job._fail(FetchError(500, f"internal error: {type(exc).__name__}: {exc}"))
        finally:
            self.metrics.fetches.labels(outcome).inc()
            self.metrics.inflight.dec()
            if self.inflight.get(req.context_id) is job:
                del self.inflight[req.context_id]
            if job.client is not None:
                if (left := self.per_client.pop(job.client) - 1) > 0:
                    self.per_client[job.client] = left
            job.finished.set()
            job.opened.set()
            self._notify()

    async def _fetch_into(self, job: FetchJob) -> None:
        import torch

        from streamer.net.session import FetchFailed, StreamSession

        req = job.request
        text: dict[int, list[int]] = {}
        recomputed: list[int] = []
        levels: dict[int, int | str] = {}
        servers = self._rotation()
        host, port = servers[0]
        idle = self._idle.get((host, port))
        pooled = idle.pop() if idle else None
        if pooled is not None:
            self.metrics.connections_reused.inc()
        async with StreamSession(host, port, req.context_id, config=self.session, slo=req.slo,
                                 policy=req.policy, servers=servers[1:],
                                 on_chunk=lambda r: self._on_chunk(job, levels, r), connection=pooled,
                                 decode_prior=self.decode_prior or self.session.decode_prior) as session:
            m = session.manifest
            assert m is not None
            check_fixed_level(req.policy, m.levels, req.context_id)
            job.version = m.version
            job.emit("manifest", sender="%s:%d" % session.address, version=m.version, layers=m.layers, heads=m.heads, head_dim=m.head_dim,
                     tokens=m.tokens, dtype=m.dtype, profile_id=m.profile_id,
                     chunks=[[c.start, c.end] for c in m.chunks])
            job.opened.set()
            assembler = self._assembler(job, m)
            kv = assembler.kv if assembler is not None else \
                torch.zeros(m.layers, 2, m.tokens, m.heads, m.head_dim, dtype=getattr(torch, m.dtype))

            def on_layer(chunk: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
                if assembler is not None:
                    assembler.on_layer(chunk, layer, k, v)
                else:
                    info = m.chunks[chunk]
                    kv[layer, 0, info.start:info.end] = k
                    kv[layer, 1, info.start:info.end] = v
                job.emit("layer", chunk=chunk, layer=layer, level=session.levels.get(chunk))

            async def on_text(chunk: int, token_ids: list[int]) -> None:
                info = m.chunks[chunk]
                superseded = session.delivered_layers(chunk)
                if superseded:   # its layers went out, then it switched to text: void them
                    job.emit("superseded", chunk=chunk, layers=superseded)
                if assembler is not None:
                    await assembler.on_text(chunk, token_ids)
                    recomputed.append(chunk)
                    self.metrics.recomputed.inc()
                    job.emit("text", chunk=chunk, start=info.start, end=info.end, recomputed=True)
                else:
                    text[chunk] = list(token_ids)
                    job.emit("text", chunk=chunk, start=info.start, end=info.end, recomputed=False,
                             token_ids=list(token_ids))

            session.set_callbacks(on_layer=on_layer, on_text=on_text)
            try:
                report = await session.fetch()
            except FetchFailed as exc:
                self.metrics.bytes.inc(exc.report.bytes)
                raise
            self.decode_prior = decoding.measure(session.decodes) or self.decode_prior
            client = session.detach_connection()
            if client is not None:
                idle = self._idle.setdefault(client.address, [])
                if len(idle) < MAX_IDLE_CONNECTIONS and not self.closing:
                    idle.append(client)
                else:
                    await client.close()
        self.metrics.bytes.inc(report.bytes)
        self.metrics.fetch_seconds.observe(report.total_seconds)
        if not report.deadline_met:
            self.metrics.deadline_missed.inc()
        quality = Quality(levels=[c.level for c in report.chunks], recomputed=sorted(recomputed), ladder=m.levels)
        chunks = sorted(text)
        entry = Entry(context_id=req.context_id, version=m.version, quality=quality,
                      text=[{"chunk": c, "start": m.chunks[c].start, "end": m.chunks[c].end,
                             "token_ids": text[c]} for c in chunks],
                      report=_json_safe(report.to_dict()), shape=list(kv.shape), dtype=str(kv.dtype).removeprefix("torch."))
        ranges = [[m.chunks[c].start, m.chunks[c].end] for c in chunks]
        ids = [t for c in chunks for t in text[c]]
        tensors = {"kv": kv, "text_ranges": torch.tensor(ranges, dtype=torch.int64).reshape(-1, 2),
                   "text_token_ids": torch.tensor(ids, dtype=torch.int64)}
        stored, evicted = await self.cache.put(entry, tensors)
        self.metrics.evictions.inc(len(evicted))
        self.metrics.cache_bytes.set(self.cache.total_bytes)
        self.metrics.cache_entries.set(len(self.cache))
        job.entry, job.stored = entry, stored
        job.emit("done", stored=stored, **entry.describe(token_ids=False), report=entry.report)

    def _rotation(self) -> list[tuple[str, int]]:
        """The senders, starting with the next one in round-robin order."""
        start = next(self._turn) % len(self.servers)
        return self.servers[start:] + self.servers[:start]

    def _on_chunk(self, job: FetchJob, levels: dict[int, int | str], report: Any) -> None:
        levels[report.index] = report.level
        self.metrics.chunks.labels(str(report.level)).inc()
        job.emit("chunk", chunk=report.index, level=report.level, bytes=report.bytes,
                 seconds=round(report.seconds, 6), throughput_bps=round(report.throughput_bps, 1),
                 reason=report.reason, layer_levels=[list(run) for run in report.layer_levels])

    def _assembler(self, job: FetchJob, manifest: Any) -> Any:
        if self.model is None:
            return None
        from streamer.model.hf import CacheAssembler

        try:
            return CacheAssembler(self.model[0], manifest)
        except ValueError as exc:  # a context of another model: hand its text chunks over as ids
            log.warning("fetch %s: not recomputing text chunks: %s", job.request.context_id, exc)
            job.emit("warning", message=f"text chunks are not recomputed: {exc}")
            return None

    # ------------------------------------------------------------------ shutdown
    async def close(self, grace: float) -> None:
        """Refuse new requests; let running fetches finish for ``grace`` s, cancel the
        rest; wait for cache writes to land."""
        self.closing = True
        self._notify()
        tasks = [job.task for job in self.inflight.values() if job.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=grace)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await self.cache.flush()
        idle, self._idle = self._idle, {}
        for client in (c for clients in idle.values() for c in clients):
            await client.close()


def _json_safe(value: Any) -> Any:
    """Replace non-finite floats (JSON has none) by None, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value
