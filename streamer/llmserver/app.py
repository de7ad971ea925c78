"""The OpenAI-compatible HTTP API (aiohttp) over an ``Engine``.

``POST /v1/completions``  greedy completions, streamed (server-sent events: ``data: {...}``
                          chunks, then ``data: [DONE]``) or not, in OpenAI's shapes; the
                          usage's ``kvwire`` object says how many prompt tokens came from
                          fetched KV, at which levels, and why none did when none did
``GET  /v1/models``       the served model
``GET  /healthz``         200 {"status": "ok", ...}: the model is loaded and answering; its
                          ``prefix_identity`` is what the prefix hashes cover (``kvwire put
                          --by-tokens --model M --tokenizer T`` stores prefixes it finds)

Errors are OpenAI's error object, ``{"error": {"message", "type", "param", "code"}}``,
with 400 for a request the server cannot serve as asked (``streamer.llmserver.protocol``),
401 for a missing or wrong token, 404 for an unknown model or path, 405, 408 for a body
that does not arrive within ``BODY_TIMEOUT``, 413 for one over ``protocol.MAX_BODY``, 429 when ``max_requests`` requests are being answered
already, 500 for anything unexpected (logged; the server goes on).

Exposure, the daemons' rule: off loopback the API needs a token (``api_token``, which
the openai client sends as its ``api_key``: ``Authorization: Bearer <token>``), or
``InsecureConfiguration``; with one, every request but ``GET /healthz`` must carry it.
The process's receive budget (``streamer.net.budget``), shared by every prefix fetch, is
sized from ``ServeConfig.receive_budget``.

A client that goes away mid-answer cancels its handler (aiohttp's handler
cancellation): the generation stops at its next step and the request's share of its
prefix fetch is released (a fetch nobody waits for is cancelled).
"""
from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from aiohttp import web

from streamer.llmserver.engine import Engine, EngineConfig, PrefixSource, SenderSource
from streamer.llmserver.protocol import (API_TOKEN_ENV, DEFAULT_PORT, MAX_BODY, APIError, completion_body, models_body, parse_body, sse_data,
                                         stream_chunk, usage_body)
from streamer.net.budget import DEFAULT_BUDGET_BYTES, set_process_budget
from streamer.net.sender import InsecureConfiguration, is_loopback
from streamer.wire import auth

if TYPE_CHECKING:
    import codec
    from streamer.net.config import SessionConfig
    from streamer.store import Store

log = logging.getLogger("kvwire.llmserver")

#: seconds a request's body may take to arrive (a slow sender of bodies is answered 408)
BODY_TIMEOUT = 10.0
ENGINE_KEY: web.AppKey[Engine] = web.AppKey("engine")
CONFIG_KEY: web.AppKey["ServeConfig"] = web.AppKey("config")


@dataclass
class ServeConfig:
    """The HTTP side: who may call, and how many requests at once."""

    #: bearer token (>= 16 bytes of printable ASCII) every request but GET /healthz must
    #: present; needed to listen off loopback
    api_token: auth.Token | None = field(default=None, repr=False)
    #: listen off loopback without a token (the risk accepted)
    allow_insecure: bool = False
    #: requests answered at once; one more is refused (429)
    max_requests: int = 64
    #: bytes all prefix fetches together may hold received and not delivered
    receive_budget: int = DEFAULT_BUDGET_BYTES

    def __post_init__(self) -> None:
        self.api_token = auth.normalize_token(self.api_token)
        if self.api_token is not None and not all(0x21 <= b <= 0x7E for b in self.api_token):
            raise ValueError("api_token must be printable ASCII without spaces: it is sent in an "
                             "Authorization header (e.g. secrets.token_urlsafe(32))")
        if type(self.max_requests) is not int or self.max_requests < 1:
            raise ValueError(f"max_requests must be an int >= 1, got {self.max_requests!r}")


def check_exposure(host: str | None, config: ServeConfig) -> str | None:
    """InsecureConfiguration when listening off loopback without a token (unless
    ``allow_insecure``); else what to warn of when the API is reachable from other hosts
    (None on loopback)."""
    if is_loopback(host):
        return None
    where = host or "all interfaces"
    if config.api_token is None and not config.allow_insecure:
        raise InsecureConfiguration(
            f"refusing to serve the completions API on {where} without an API token: set one "
            f"(--api-token-file FILE or ${API_TOKEN_ENV}), listen on 127.0.0.1, or accept the risk "
            "with --insecure-no-auth")
    if config.api_token is not None:
        return f"the completions API on {where} is plain HTTP: its bearer token crosses the network in clear"
    return f"the completions API on {where} has NO authentication (insecure mode)"


def _authorize(request: web.Request, token: bytes | None) -> None:
    from streamer.receiver.fetcher import FetchError
    from streamer.receiver.requests import authorize

    if token is None or request.path == "/healthz":
        return
    try:
        authorize(request.raw_path, request.headers, token)
    except FetchError as exc:
        raise APIError(401, "this API needs its token: Authorization: Bearer <token> (the openai client's "
                            "api_key)" if "Bearer" in exc.message else exc.message,
                       code="invalid_api_key", headers=exc.headers) from None


def _error(exc: APIError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status, headers=exc.headers)


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        _authorize(request, request.app[CONFIG_KEY].api_token)
        return await handler(request)
    except APIError as exc:
        return _error(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status)
        return _error(APIError(exc.status, exc.text or exc.reason, code=code))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:
        log.exception("%s %s failed", request.method, request.path)
        return _error(APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))


_ids = itertools.count(1)


def _completion_id() -> str:
    return f"cmpl-{secrets.token_hex(8)}{next(_ids):x}"


async def completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    config = request.app[CONFIG_KEY]
    try:
        async with asyncio.timeout(BODY_TIMEOUT):
            body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise APIError(413, f"the body may be at most {MAX_BODY} bytes", code="request_too_large") from None
    except TimeoutError:
        raise APIError(408, f"the body did not arrive within {BODY_TIMEOUT:.0f} s") from None
    parsed = parse_body(body, max_tokens_limit=engine.config.max_tokens)
    if parsed.model != engine.config.served_name:
        raise APIError(404, f"the model {parsed.model!r} is not served here (GET /v1/models): "
                            f"{engine.config.served_name!r} is", param="model", code="model_not_found")
    if engine.active >= config.max_requests:
        raise APIError(429, f"{engine.active} requests are being answered, the most at once (max_requests)",
                       type="rate_limit_error", headers={"Retry-After": "1"})
    ids = engine.prompt_ids(parsed)
    completion_id, created, name = _completion_id(), int(time.time()), engine.config.served_name
    if not parsed.stream:
        outcome = await engine.complete(parsed, ids)
        usage = usage_body(outcome.prompt_tokens, len(outcome.token_ids), outcome.kvwire)
        return web.json_response(completion_body(completion_id, created, name, outcome.text,
                                                 outcome.finish_reason, usage))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    await response.prepare(request)

    async def send(piece: str) -> None:
        await response.write(sse_data(stream_chunk(completion_id, created, name, piece)))

    try:
        outcome = await engine.complete(parsed, ids, send)
    except APIError as exc:   # the status went out already: the error is the stream's last event
        await response.write(sse_data(exc.body()))
        return response
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:
        log.exception("a streamed completion failed")
        error = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        await response.write(sse_data(error.body()))
        return response
    await response.write(sse_data(stream_chunk(completion_id, created, name, "", outcome.finish_reason)))
    if parsed.include_usage:
        usage = usage_body(outcome.prompt_tokens, len(outcome.token_ids), outcome.kvwire)
        await response.write(sse_data(stream_chunk(completion_id, created, name, None, usage=usage)))
    await response.write(sse_data(None))
    await response.write_eof()
    return response


async def models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return web.json_response(models_body([engine.config.served_name], request.app[STARTED_KEY]))


async def healthz(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    identity = engine.identity
    return web.json_response({"status": "ok", "model": engine.config.served_name, "requests": engine.active,
                              "fetches_in_flight": len(engine.flights),
                              "prefix_source": engine.source is not None,
                              "write_back": engine.store is not None and engine.config.write_back,
                              # what `kvwire put --by-tokens` needs to store prefixes this server finds
                              "prefix_identity": {"model": identity.model, "tokenizer": identity.tokenizer,
                                                  "profile_id": identity.profile_id,
                                                  "chunk_tokens": identity.chunk_tokens,
                                                  "format_version": identity.format_version}})


STARTED_KEY: web.AppKey[int] = web.AppKey("started")


def make_app(engine: Engine, config: ServeConfig) -> web.Application:
    app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY)
    app[ENGINE_KEY] = engine
    app[CONFIG_KEY] = config
    app[STARTED_KEY] = int(time.time())
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/healthz", healthz)
    return app


class Server:
    """A running completions server: ``url``, ``close()``."""

    def __init__(self, engine: Engine, config: ServeConfig) -> None:
        self.engine = engine
        self.config = config
        self._runner: web.AppRunner | None = None
        self.address: tuple[str, int] = ("", 0)

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    async def start(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> "Server":
        """Listen on ``host:port`` (0: any free port); InsecureConfiguration off loopback
        without a token."""
        exposed = check_exposure(host, self.config)
        if exposed is not None:
            log.warning("%s", exposed)
        set_process_budget(self.config.receive_budget)
        self._runner = web.AppRunner(make_app(self.engine, self.config), handle_signals=False, access_log=None,
                                     handler_cancellation=True, shutdown_timeout=1.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        self.address = tuple(self._runner.addresses[0][:2])  # type: ignore[assignment]
        return self

    async def close(self) -> None:
        """Stop listening, cancel requests still running, then stop the engine."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.engine.close()

    async def __aenter__(self) -> "Server":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def start_server(model: Any, tokenizer: Any, profile: "codec.Profile", config: EngineConfig,
                       session: "SessionConfig", *, senders: Sequence[tuple[str, int]] = (),
                       source: PrefixSource | None = None, store: "Store | None" = None,
                       serve: ServeConfig | None = None, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                       warm_up: bool = True) -> Server:
    """Start a completions server (port 0: any free port). Prefixes come from ``source``,
    else from ``senders`` (none: every prompt is prefilled whole); full prefills are written
    back to ``store`` (None: not). ``warm_up`` measures the model's recompute rate and
    readies the codec before the first request. InsecureConfiguration off loopback
    without ``serve.api_token``, before anything else.

    What is alive once the engine is ready (the model, torch's and transformers' objects:
    about half a million) is moved out of the cyclic garbage collector's scans
    (``gc.freeze``), as long-running Python servers do: each full collection walked all
    of it, a pause of a tenth of a second or more landing in some request's time to
    first token."""
    serve = serve or ServeConfig()
    check_exposure(host, serve)
    if source is None and senders:
        source = SenderSource(senders, session)
    engine = Engine(model, tokenizer, profile, config, session, source=source, store=store)
    if warm_up:
        await engine.warm_up()
    gc.collect()
    gc.freeze()
    return await Server(engine, serve).start(host, port)
