"""The receiver's local HTTP/JSON API (aiohttp).

``POST /fetch``                 {"context_id", "slo", "policy", "min_level", "refresh", "wait"}
                                -> the fetch's result (quality, where the KV is, text chunks, report)
``GET  /contexts``              the cached contexts
``GET  /contexts/{id}``         the decoded KV as safetensors (joins a running fetch), or 404
``GET  /contexts/{id}/events``  server-sent events of a fetch's progress (``?wait=S``: wait
                                that long for a fetch to start; ``Last-Event-ID``: resume)
``GET  /healthz``               200 {"status": "ok", "senders": [...], ...} when a sender
                                answers a handshake; 503 with "no_sender" when none does
                                (each sender's error listed), "shutting_down" on the way out
``GET  /metrics``               Prometheus text format

Errors are JSON ``{"error": message, "status": code}``: 400 for a malformed request,
404 for a context no sender has, 503 when no sender can be reached (with the reason)
or the daemon is shutting down, 500 for anything unexpected (logged; the daemon goes on).
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import os
from typing import TYPE_CHECKING, Any

from aiohttp import web

from streamer.receiver.fetcher import Event, FetchError, FetchRequest
from streamer.receiver.metrics import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from streamer.receiver.daemon import Receiver

log = logging.getLogger("kvwire.receiver")

_FETCH_KEYS = {"context_id", "slo", "policy", "min_level", "refresh", "wait"}
#: comment lines on an idle event stream, so a dead subscriber is noticed
_KEEPALIVE_S = 15.0
_READ_BLOCK = 1 << 20

RECEIVER_KEY: web.AppKey["Receiver"] = web.AppKey("receiver")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message, "status": status}, status=status)


def _context_id(value: Any) -> str:
    from streamer.wire.manifest import validate_context_id

    try:
        return validate_context_id(value)
    except ValueError as exc:
        raise FetchError(400, str(exc)) from None


def parse_fetch(body: Any, *, default_slo: float, default_policy: str) -> tuple[FetchRequest, bool]:
    """Validate a POST /fetch body; FetchError(400) naming what is wrong."""
    from streamer.adapt.policies import get_policy

    if not isinstance(body, dict):
        raise FetchError(400, f"the body must be a JSON object, got {type(body).__name__}")
    unknown = set(body) - _FETCH_KEYS
    if unknown:
        raise FetchError(400, f"unknown field(s) {sorted(unknown)}; valid: {sorted(_FETCH_KEYS)}")
    if "context_id" not in body:
        raise FetchError(400, "missing field 'context_id'")
    context_id = _context_id(body["context_id"])
    slo = body.get("slo", default_slo)
    if isinstance(slo, bool) or not isinstance(slo, (int, float)) or not math.isfinite(slo) or slo <= 0:
        raise FetchError(400, f"slo must be a finite number of seconds > 0, got {slo!r}")
    min_level = body.get("min_level")
    if min_level is not None and (isinstance(min_level, bool) or not isinstance(min_level, int) or min_level < 0):
        raise FetchError(400, f"min_level must be an integer >= 0 (0 is the best level), got {min_level!r}")
    # a quality floor without a policy: fetch at exactly that level
    policy = body.get("policy", default_policy if min_level is None else f"fixed:{min_level}")
    if not isinstance(policy, str):
        raise FetchError(400, f"policy must be a string, got {policy!r}")
    try:
        get_policy(policy)
    except ValueError as exc:
        raise FetchError(400, str(exc)) from None
    for flag in ("refresh", "wait"):
        if not isinstance(body.get(flag, False), bool):
            raise FetchError(400, f"{flag} must be true or false, got {body[flag]!r}")
    request = FetchRequest(context_id=context_id, slo=float(slo), policy=policy, min_level=min_level,
                           refresh=body.get("refresh", False))
    return request, body.get("wait", True)


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    receiver = request.app[RECEIVER_KEY]
    try:
        return await handler(request)
    except FetchError as exc:
        receiver.metrics.errors.labels(str(exc.status)).inc()
        return _error(exc.status, exc.message)
    except web.HTTPException as exc:
        if exc.status >= 400:
            receiver.metrics.errors.labels(str(exc.status)).inc()
            return _error(exc.status, exc.reason if exc.text is None else exc.text)
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:
        log.exception("%s %s failed", request.method, request.path)
        receiver.metrics.errors.labels("500").inc()
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")


# ---------------------------------------------------------------------------- handlers
async def post_fetch(request: web.Request) -> web.Response:
    receiver = request.app[RECEIVER_KEY]
    if receiver.closing:
        raise FetchError(503, "the receiver is shutting down")
    try:
        body = await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FetchError(400, f"malformed JSON: {exc}") from None
    fetch, wait = parse_fetch(body, default_slo=receiver.config.slo, default_policy=receiver.config.policy)
    try:
        outcome = await receiver.fetcher.fetch(fetch, wait=wait)
    except FetchError:
        receiver.metrics.requests.labels("error").inc()
        raise
    receiver.metrics.requests.labels(outcome.status).inc()
    return web.json_response(outcome.to_dict(fetch.required_level), status=202 if outcome.status == "running" else 200)


async def list_contexts(request: web.Request) -> web.Response:
    receiver = request.app[RECEIVER_KEY]
    cache = receiver.cache
    return web.json_response({"bytes": cache.total_bytes, "max_bytes": cache.max_bytes,
                              "contexts": [e.describe(token_ids=False) for e in reversed(cache.entries())],
                              "in_flight": sorted(receiver.fetcher.inflight)})


async def get_context(request: web.Request) -> web.StreamResponse:
    receiver = request.app[RECEIVER_KEY]
    cid = _context_id(request.match_info["id"])
    job = receiver.fetcher.inflight.get(cid)
    if job is not None and request.query.get("wait", "1") not in ("0", "false"):
        try:
            await job.result()
        except FetchError:
            pass  # a cached older result, if any, is still served
    entry = receiver.cache.get(cid)
    if entry is None:
        raise FetchError(404, f"context {cid!r} is not in the local cache (POST /fetch first)")
    headers = {"Content-Type": "application/octet-stream",
               "Content-Disposition": f'attachment; filename="{cid}.safetensors"',
               "X-Kvwire-Version": entry.version,
               "X-Kvwire-Quality": json.dumps(entry.quality.to_dict(), separators=(",", ":"))}
    if entry.data is not None:
        return web.Response(body=entry.data, headers=headers)
    assert entry.path is not None
    try:  # open first: an eviction meanwhile unlinks the name, not the open file
        f = await asyncio.to_thread(open, entry.path, "rb")
    except FileNotFoundError:
        raise FetchError(404, f"context {cid!r} was just evicted from the local cache") from None
    try:
        size = os.fstat(f.fileno()).st_size
        response = web.StreamResponse(headers=headers)
        response.content_length = size
        await response.prepare(request)
        while block := await asyncio.to_thread(f.read, _READ_BLOCK):
            await response.write(block)
        await response.write_eof()
        return response
    finally:
        f.close()


def _sse(event: Event) -> bytes:
    data = json.dumps(event.data, separators=(",", ":"))
    return f"id: {event.seq}\nevent: {event.kind}\ndata: {data}\n\n".encode()


async def get_events(request: web.Request) -> web.StreamResponse:
    receiver = request.app[RECEIVER_KEY]
    cid = _context_id(request.match_info["id"])
    try:
        wait = float(request.query.get("wait", "0"))
        after = int(request.headers.get("Last-Event-ID", request.query.get("after", "0")))
    except ValueError:
        raise FetchError(400, "wait must be seconds, Last-Event-ID/after an event number") from None
    if not (math.isfinite(wait) and 0 <= wait <= 3600):
        raise FetchError(400, f"wait must be between 0 and 3600 s, got {wait}")
    job = await receiver.fetcher.wait_for(cid, wait)
    if receiver.closing:
        raise FetchError(503, "the receiver is shutting down")
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    if job is None:
        entry = receiver.cache.peek(cid)
        if entry is None:
            raise FetchError(404, f"no fetch of {cid!r} is running and it is not cached (POST /fetch, "
                                  "or wait for one with ?wait=S)")
        await response.prepare(request)
        await response.write(_sse(Event(0, "done", {"status": "cached", **entry.describe(token_ids=False),
                                                    "report": entry.report})))
        return response
    replay, queue = job.subscribe()
    try:
        await response.prepare(request)
        for event in replay:
            if event.seq > after:
                await response.write(_sse(event))
            if event.terminal:
                return response
        while True:
            try:
                event = await asyncio.wait_for(queue.get(), _KEEPALIVE_S)
            except asyncio.TimeoutError:
                await response.write(b": keepalive\n\n")
                continue
            await response.write(_sse(event))
            if event.terminal:
                return response
    except (ConnectionResetError, ConnectionError):
        return response  # the subscriber went away; the fetch goes on
    finally:
        job.unsubscribe(queue)


async def healthz(request: web.Request) -> web.Response:
    receiver = request.app[RECEIVER_KEY]
    senders = [] if receiver.closing else await receiver.probe_senders()
    reachable = any(s["reachable"] for s in senders)
    status = "shutting_down" if receiver.closing else "ok" if reachable else "no_sender"
    body = {"status": status,
            "servers": [f"{h}:{p}" for h, p in receiver.config.servers], "senders": senders,
            "fetches_in_flight": len(receiver.fetcher.inflight),
            "cache": {"entries": len(receiver.cache), "bytes": receiver.cache.total_bytes,
                      "max_bytes": receiver.cache.max_bytes,
                      "directory": None if receiver.cache.directory is None else str(receiver.cache.directory)},
            "model": receiver.config.model, "device": receiver.config.device}
    return web.json_response(body, status=200 if status == "ok" else 503)


async def metrics(request: web.Request) -> web.Response:
    receiver = request.app[RECEIVER_KEY]
    receiver.metrics.cache_bytes.set(receiver.cache.total_bytes)
    receiver.metrics.cache_entries.set(len(receiver.cache))
    return web.Response(body=receiver.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


def make_app(receiver: "Receiver") -> web.Application:
    app = web.Application(middlewares=[_errors], client_max_size=1 << 20)
    app[RECEIVER_KEY] = receiver
    app.router.add_post("/fetch", post_fetch)
    app.router.add_get("/contexts", list_contexts)
    app.router.add_get("/contexts/{id}", get_context)
    app.router.add_get("/contexts/{id}/events", get_events)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    return app
