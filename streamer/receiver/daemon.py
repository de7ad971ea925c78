"""``Receiver``: the receiver daemon's parts wired together, started and stopped.

    receiver = await start_receiver(ReceiverConfig(servers=[("10.0.0.5", 7410)]), "127.0.0.1", 7420)
    ...
    await receiver.close()   # what SIGTERM does

At most ``max_connections`` client connections are served at once; one more takes the
place of the longest idle keep-alive connection, which is closed, or, when none is idle,
is answered 503 (``Retry-After``) without its request being read, and closed
(``streamer.receiver.connections``).

Exposure, the sender's rule (``streamer.net.sender.check_exposure``): the API serves
every cached KV and starts fetches with the receiver's own sender credentials, so off
loopback it needs an ``api_token`` (``InsecureConfiguration`` otherwise, unless
``allow_insecure``); with one, every request but ``GET /livez`` must carry it
(``streamer.receiver.requests.authorize``).

Shutdown: stop accepting connections, answer 503 to requests still arriving on open
ones, give running fetches ``shutdown_grace`` seconds to finish (their results are
cached), cancel the rest (their waiters get 503, their event streams an ``error``
event), wait for cache writes in progress to land, then close the HTTP server.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from streamer.net.budget import DEFAULT_BUDGET_BYTES, set_process_budget
from streamer.net.config import SessionConfig, require_int
from streamer.net.devices import close_devices
from streamer.net.sender import InsecureConfiguration, is_loopback
from streamer.receiver import malloc
from streamer.receiver.cache import ContextCache
from streamer.receiver.connections import DEFAULT_MAX_CONNECTIONS, ConnectionGate, check_descriptors
from streamer.receiver.fetcher import DEFAULT_MAX_FETCHES_PER_CLIENT, Fetcher
from streamer.receiver.http import make_app
from streamer.receiver.metrics import Metrics
from streamer.receiver.requests import server_options
from streamer.receiver.server_log import server_logger
from streamer.wire import auth

log = logging.getLogger("kvwire.receiver")

DEFAULT_PORT = 7420
DEFAULT_CACHE_BYTES = 4 << 30
#: longest a /healthz probe of one sender may take (less if the session's connect_timeout is)
PROBE_TIMEOUT = 2.0
#: /healthz probes the senders at most once per this many seconds, whatever the request rate
PROBE_INTERVAL = 2.0
#: the environment variable ``kvwire receive`` reads the API token from (without --api-token-file)
API_TOKEN_ENV = "KVWIRE_RECEIVER_TOKEN"


@dataclass
class ReceiverConfig:
    #: sender daemons (stateless, over one shared store): fetches start on them round-robin,
    #: each with the others as fallbacks
    servers: list[tuple[str, int]]
    cache_dir: str | None = None
    cache_bytes: int = DEFAULT_CACHE_BYTES
    #: model (local path or "minilm") to recompute chunks that arrive as text
    model: str | None = None
    #: with a model: weigh text chunks at its recompute rate, measured once at start-up
    #: (``streamer.model.recompute_seconds_per_token``) instead of ``session``'s figure
    measure_recompute: bool = True
    shutdown_grace: float = 5.0
    #: client connections served at once (each holds a descriptor); one more gets a 503
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    #: bearer token (str/bytes, >= 16 bytes of printable ASCII: it travels in a header) that
    #: every request but GET /livez must present; needed to listen off loopback
    api_token: auth.Token | None = field(default=None, repr=False)
    #: listen off loopback without an ``api_token`` (the risk accepted)
    allow_insecure: bool = False
    #: fetches one client (with an ``api_token``: all its holders; else a peer address) may
    #: have running that it started (joins not counted); one more is answered 429
    max_fetches_per_client: int = DEFAULT_MAX_FETCHES_PER_CLIENT
    #: bytes received and not yet delivered that all fetches together may hold; above it a
    #: fetch holding more than its share stops reading (``streamer.net.budget``)
    receive_budget: int = DEFAULT_BUDGET_BYTES
    #: glibc malloc tuned at start and trimmed every this many seconds, so that RSS follows
    #: what is in use instead of its high-water mark (see ``streamer.receiver.malloc``);
    #: None: malloc left as it is
    trim_seconds: float | None = malloc.TRIM_SECONDS
    #: how every fetch runs (decode device, timeouts, auth, TLS, limits); its ``slo`` and
    #: ``policy`` are the defaults of POST /fetch
    session: SessionConfig = field(default_factory=SessionConfig)
    #: shorthands: when given, they replace the fields of ``session`` of the same name
    device: str | None = None
    slo: float | None = None
    policy: str | None = None

    def __post_init__(self) -> None:
        overrides = {name: value for name in ("device", "slo", "policy")
                     if (value := getattr(self, name)) is not None}
        if self.session.max_context_bytes is None:   # no context larger than the cache can hold
            overrides["max_context_bytes"] = self.cache_bytes
        self.session = dataclasses.replace(self.session, **overrides)   # validates
        require_int("ReceiverConfig", "max_connections", self.max_connections, 1)
        require_int("ReceiverConfig", "max_fetches_per_client", self.max_fetches_per_client, 1)
        require_int("ReceiverConfig", "receive_budget", self.receive_budget, 1)
        self.api_token = auth.normalize_token(self.api_token)
        if self.api_token is not None and not all(0x21 <= b <= 0x7E for b in self.api_token):
            raise ValueError("api_token must be printable ASCII without spaces: it is sent in an "
                             "Authorization header (e.g. secrets.token_urlsafe(32))")
        if self.trim_seconds is not None and not self.trim_seconds > 0:
            raise ValueError(f"trim_seconds must be > 0 (or None), not {self.trim_seconds!r}")
        self.device, self.slo, self.policy = self.session.device, self.session.slo, self.session.policy


def check_exposure(host: str | None, config: ReceiverConfig) -> str | None:
    """Refuse (InsecureConfiguration) to listen off loopback without an API token, unless
    ``config.allow_insecure``; else what to warn of when the API is reachable from other
    hosts (None on loopback)."""
    if is_loopback(host):
        return None
    where = host or "all interfaces"
    if config.api_token is not None:
        return (f"the HTTP API on {where} is plain HTTP: its bearer token and the KV it serves "
                "cross the network in clear; expose it only on a network you trust")
    if not config.allow_insecure:
        raise InsecureConfiguration(
            f"refusing to serve the receiver API on {where} without an API token: set one "
            f"(kvwire receive --api-token-file FILE or ${API_TOKEN_ENV}; ReceiverConfig(api_token=...)), "
            "listen on 127.0.0.1, or accept the risk with --insecure-no-auth (allow_insecure=True)")
    return (f"the HTTP API on {where} has NO authentication (insecure mode): anyone who can reach it "
            "can read every cached context and start fetches")


class Receiver:
    def __init__(self, config: ReceiverConfig, *, model: Any = None) -> None:
        self.config = config
        self.metrics = Metrics()
        self.cache = ContextCache(config.cache_bytes, config.cache_dir)
        self.fetcher = Fetcher(config.servers, self.cache, self.metrics, config.session, model=model,
                               max_per_client=config.max_fetches_per_client)
        self.closing = False
        #: the last (or running) round of /healthz probes, and when it started
        self._probe: asyncio.Future[list[dict[str, Any]]] | None = None
        self._probed_at = 0.0
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None
        self._gate: ConnectionGate | None = None
        self._malloc: malloc.Tuning | None = None
        self.address: tuple[str, int] = ("", 0)

    @property
    def port(self) -> int:
        return self.address[1]

    @property
    def url(self) -> str:
        host = self.address[0]
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"

    async def start(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> "Receiver":
        """Listen on ``host:port``; InsecureConfiguration off loopback without an API token.
        The process's receive budget (shared by its sessions) is sized from the config."""
        exposed = check_exposure(host, self.config)
        set_process_budget(self.config.receive_budget)
        if exposed is not None:
            log.warning("%s", exposed)
        found = await asyncio.to_thread(self.cache.load)
        if found:
            log.info("cache: %d contexts (%d bytes) in %s", found, self.cache.total_bytes, self.cache.directory)
        self.metrics.cache_bytes.set(self.cache.total_bytes)
        self.metrics.cache_entries.set(len(self.cache))
        self._runner = web.AppRunner(make_app(self), handle_signals=False, access_log=None,
                                     shutdown_timeout=1.0, logger=server_logger(), **server_options())
        await self._runner.setup()
        assert self._runner.server is not None
        check_descriptors(self.config.max_connections)
        # no aiohttp site: the listener's protocol factory is the gate that caps connections
        gate = self._gate = ConnectionGate(self._runner.server, self.config.max_connections,
                                           self.metrics.connections_refused.inc,
                                           self.metrics.connections_reclaimed.inc)
        self.metrics.connections_open.set_function(lambda: gate.open)
        self._listener = await asyncio.get_running_loop().create_server(self._gate, host, port, backlog=128)
        self.address = tuple(self._listener.sockets[0].getsockname()[:2])  # type: ignore[assignment]
        if self.config.trim_seconds is not None:
            self._malloc = malloc.Tuning(os.environ, self.config.trim_seconds)
        return self

    @property
    def gate(self) -> ConnectionGate | None:
        """The listener's connection cap (None before ``start``)."""
        return self._gate

    @property
    def open_connections(self) -> int:
        """Client connections being served now (refused ones not counted)."""
        return self._gate.open if self._gate is not None else 0

    async def probe_senders(self) -> list[dict[str, Any]]:
        """Each sender's state, {"address", "reachable", "handshake_ms" or "error"}, from a
        round of probes at most ``PROBE_INTERVAL`` old: a poller, or a flood, of /healthz
        must not cost every sender a handshake per request. Calls within the interval get
        the last round's result; calls while a round runs wait for it (single-flight)."""
        probe = self._probe
        if probe is None or (probe.done() and time.monotonic() - self._probed_at >= PROBE_INTERVAL):
            self._probed_at = time.monotonic()
            probe = self._probe = asyncio.ensure_future(self._probe_all())
        return await asyncio.shield(probe)   # a caller that goes away leaves the round to the others

    async def _probe_all(self) -> list[dict[str, Any]]:
        """Handshake with every sender at once (authenticated, over TLS, as a fetch would)
        and hang up."""
        return list(await asyncio.gather(*(self._probe_one(host, port) for host, port in self.config.servers)))

    async def _probe_one(self, host: str, port: int) -> dict[str, Any]:
        from streamer.net.client import StreamError
        from streamer.net.session import connect

        cfg = self.config.session
        address = f"{host}:{port}"
        start = time.monotonic()
        try:
            client = await connect(cfg, host, port, timeout=min(cfg.connect_timeout, PROBE_TIMEOUT))
        except (StreamError, OSError) as exc:
            return {"address": address, "reachable": False, "error": str(exc)}
        await client.close()
        return {"address": address, "reachable": True,
                "handshake_ms": round(1000 * (time.monotonic() - start), 1)}

    async def close(self) -> None:
        if self.closing:
            return
        self.closing = True
        if self._listener is not None:
            self._listener.close()  # no new connections
        if self._gate is not None:
            self._gate.close()
        if self._probe is not None:
            self._probe.cancel()
        await self.fetcher.close(self.config.shutdown_grace)
        await asyncio.to_thread(close_devices)   # GPU decode workers finish, devices released
        if self._runner is not None:
            await self._runner.cleanup()
        if self._malloc is not None:
            self._malloc.stop()

    async def __aenter__(self) -> "Receiver":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def load_model(name: str) -> Any:
    """(model, tokenizer) for ``--model`` (a local path, or ``minilm``)."""
    from streamer.model import hf

    return hf.load_model(hf.resolve_model_path(name))


def check_device(device: str) -> None:
    """Fail at start, not on the first fetch, when ``device`` cannot decode."""
    from streamer.net.devices import section_decoder

    try:
        section_decoder(device)
    except ValueError:
        raise
    except Exception as exc:  # e.g. codec.GpuUnavailable: no GPU or no pycuda
        raise ValueError(f"device {device!r} cannot decode: {exc}") from exc


def warm_up_decoder(device: str) -> float:
    """Compile (cold numba cache) or load the codec's CPU kernels at start, not in the first
    fetch; seconds spent. A no-op for a CUDA device, whose decoder runs none of them."""
    import torch

    from codec import warmup

    if torch.device(device).type != "cpu":
        return 0.0
    seconds = warmup.warm_up()
    result = warmup.last_result()
    if result is not None and seconds > 0.1:
        log.info("codec kernels %s in %.1f s", "compiled (cold numba cache)" if result.cold
                 else "loaded from the numba cache", seconds)
    return seconds


async def start_receiver(config: ReceiverConfig, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *,
                         model: Any = None) -> Receiver:
    """Start a receiver daemon (port 0: any free port). ``model``: an already loaded
    (model, tokenizer); otherwise ``config.model`` is loaded. InsecureConfiguration (a
    ValueError) off loopback without ``config.api_token``, before anything is loaded."""
    check_exposure(host, config)
    await asyncio.to_thread(check_device, config.device)
    await asyncio.to_thread(warm_up_decoder, config.device)
    if model is None and config.model:
        model = await asyncio.to_thread(load_model, config.model)
    if model is not None and config.measure_recompute:
        from streamer.model import recompute_seconds_per_token

        rate = await asyncio.to_thread(recompute_seconds_per_token, model[0])
        log.info("recomputing text with the model costs %.3f ms/token here: the policy weighs text at that",
                 rate * 1e3)
        config = dataclasses.replace(config, session=dataclasses.replace(
            config.session, recompute_seconds_per_token=rate))
    return await Receiver(config, model=model).start(host, port)
