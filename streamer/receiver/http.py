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
                                (the senders' state from a probe at most ``PROBE_INTERVAL``,
                                2 s, old: a flood of requests costs each sender one
                                handshake per interval)
``GET  /metrics``               Prometheus text format
``GET  /livez``                 200 ``ok``: the process answers (no sender, no cache, no token)

Authentication: a daemon with an API token (``ReceiverConfig.api_token``, ``kvwire
receive --api-token-file`` / ``$KVWIRE_RECEIVER_TOKEN``; required off loopback) answers
every request but ``/livez`` that lacks ``Authorization: Bearer <token>`` with 401 and
``WWW-Authenticate: Bearer``, before anything else of the request is parsed or read.
Without a token (on loopback) every route is open, as any local process is trusted.

Errors are JSON ``{"error": message, "status": code}``: 400 for a malformed request,
401 for a missing or wrong token, 404 for a context no sender has (or a path that
names no endpoint), 405 for a method the path does not take, 408 for a body that does
not arrive in time, 413 for one too large or a context that decodes to more than the cache
holds, 429 (``Retry-After``) for a fetch that would
start when its client already has ``max_fetches_per_client`` running (joining a running
fetch, or a cache hit, is never refused; with a token all its holders are one client,
without one each peer address is), 503 when no sender can be reached (with the reason)
or the daemon is shutting down, 500 for anything unexpected (logged; the daemon goes on).

Every request goes to one handler, ``dispatch``, so that no route can miss the token
check: aiohttp frames it within ``streamer.receiver.requests``' limits,
``requests.authorize`` checks its token, ``requests.parse_head`` reads its route and
parameters (and ``requests.parse_fetch_body`` a fetch's body), and the route's handler
does the I/O.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import TYPE_CHECKING, Any, Mapping

from aiohttp import web

from streamer.receiver import requests, sse
from streamer.receiver.fetcher import Event, FetchError
from streamer.receiver.metrics import CONTENT_TYPE_LATEST
from streamer.receiver.requests import Head, RequestError

if TYPE_CHECKING:
    from streamer.receiver.daemon import Receiver

log = logging.getLogger("kvwire.receiver")

#: comment lines on an idle event stream, so a dead subscriber is noticed
_KEEPALIVE_S = 15.0
_READ_BLOCK = 1 << 20

RECEIVER_KEY: web.AppKey["Receiver"] = web.AppKey("receiver")


def _error(status: int, message: str, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message, "status": status}, status=status, headers=headers)


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    receiver = request.app[RECEIVER_KEY]
    try:
        return await handler(request)
    except FetchError as exc:
        receiver.metrics.errors.labels(str(exc.status)).inc()
        return _error(exc.status, exc.message, exc.headers)
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
async def post_fetch(request: web.Request, head: Head) -> web.Response:
    receiver = request.app[RECEIVER_KEY]
    if receiver.closing:
        raise FetchError(503, "the receiver is shutting down")
    try:
        async with asyncio.timeout(requests.BODY_TIMEOUT):
            body = await request.read()   # a chunked body is cut at client_max_size (413)
    except TimeoutError:
        raise RequestError(408, f"the body did not arrive within {requests.BODY_TIMEOUT:.0f} s") from None
    fetch, wait = requests.parse_fetch_body(body, default_slo=receiver.config.slo,
                                            default_policy=receiver.config.policy)
    # the token is the only identity the API knows: with one, all its holders are one client
    client = "the holders of the API token" if receiver.config.api_token is not None else f"peer {request.remote}"
    try:
        outcome = await receiver.fetcher.fetch(fetch, wait=wait, client=client)
    except FetchError:
        receiver.metrics.requests.labels("error").inc()
        raise
    receiver.metrics.requests.labels(outcome.status).inc()
    return web.json_response(outcome.to_dict(fetch.required_level), status=202 if outcome.status == "running" else 200)


async def list_contexts(request: web.Request, head: Head) -> web.Response:
    receiver = request.app[RECEIVER_KEY]
    cache = receiver.cache
    return web.json_response({"bytes": cache.total_bytes, "max_bytes": cache.max_bytes,
                              "contexts": [e.describe(token_ids=False) for e in reversed(cache.entries())],
                              "in_flight": sorted(receiver.fetcher.inflight)})


async def get_context(request: web.Request, head: Head) -> web.StreamResponse:
    receiver = request.app[RECEIVER_KEY]
    cid = head.context_id
    assert cid is not None
    job = receiver.fetcher.inflight.get(cid)
    if job is not None and head.join:
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
        while request.method != "HEAD" and (block := await asyncio.to_thread(f.read, _READ_BLOCK)):
            await response.write(block)
        await response.write_eof()
        return response
    finally:
        f.close()


def _sse(event: Event) -> bytes:
    return sse.encode(event.seq, event.kind, event.data)


async def get_events(request: web.Request, head: Head) -> web.StreamResponse:
    receiver = request.app[RECEIVER_KEY]
    cid, wait, after = head.context_id, head.wait, head.after
    assert cid is not None
    job = await receiver.fetcher.wait_for(cid, wait)
    if receiver.closing:
        raise FetchError(503, "the receiver is shutting down")
    entry = receiver.cache.peek(cid) if job is None else None
    if job is None and entry is None:
        raise FetchError(404, f"no fetch of {cid!r} is running and it is not cached (POST /fetch, "
                              "or wait for one with ?wait=S)")
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    if request.method == "HEAD":   # the status and headers alone: aiohttp would write a body too
        await response.prepare(request)
        return response
    if job is None:
        assert entry is not None
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
                await response.write(sse.KEEPALIVE)
                continue
            await response.write(_sse(event))
            if event.terminal:
                return response
    except (ConnectionResetError, ConnectionError):
        return response  # the subscriber went away; the fetch goes on
    finally:
        job.unsubscribe(queue)


async def healthz(request: web.Request, head: Head) -> web.Response:
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


async def metrics(request: web.Request, head: Head) -> web.Response:
    receiver = request.app[RECEIVER_KEY]
    receiver.metrics.cache_bytes.set(receiver.cache.total_bytes)
    receiver.metrics.cache_entries.set(len(receiver.cache))
    return web.Response(body=receiver.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def livez(request: web.Request, head: Head) -> web.Response:
    return web.Response(text="ok")


#: a handler for each of ``requests.ROUTES``
HANDLERS = {"fetch": post_fetch, "contexts": list_contexts, "context": get_context, "events": get_events,
            "healthz": healthz, "metrics": metrics, "livez": livez}


async def dispatch(request: web.Request) -> web.StreamResponse:
    """Every request: its token checked, then its head parsed (both sans-I/O, before any
    body is read), then its route's handler."""
    requests.authorize(request.raw_path, request.headers, request.app[RECEIVER_KEY].config.api_token)
    head = requests.parse_head(request.method, request.raw_path, request.headers)
    return await HANDLERS[head.route](request, head)


@web.middleware
async def _idle_tracking(request: web.Request, handler: Any) -> web.StreamResponse:
    """Tell the connection gate when a connection is busy and when it is idle again, so
    that at the cap an idle keep-alive connection gives its place to a new one. The
    answer is written here, not after the return, so that "idle" means nothing of it is
    left to write (aiohttp's own prepare/write_eof are then no-ops)."""
    gate = request.app[RECEIVER_KEY].gate
    assert gate is not None   # requests arrive only through the gate's listener
    gate.request_started(request.protocol)
    response = await handler(request)
    await response.prepare(request)
    await response.write_eof()
    gate.answer_written(request.protocol)
    return response


def make_app(receiver: "Receiver") -> web.Application:
    app = web.Application(middlewares=[_idle_tracking, _errors], client_max_size=requests.MAX_BODY)
    app[RECEIVER_KEY] = receiver
    app.router.add_route("*", "/{path:.*}", dispatch)
    return app
