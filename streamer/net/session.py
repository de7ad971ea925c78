"""StreamSession: fetch one context under a deadline, chunk by chunk, into callbacks.

The session owns the connection (handshake, authentication, TLS, reconnecting across
``servers`` with bounded backoff), the context's manifest and codec profile, and what
the receiver learns across fetches (the link's memory per sender, the decoder's and the
caller's recompute costs). Each ``fetch()`` is one ``streamer.fetch.FetchController``
driven by ``streamer.net.driver.FetchDriver``: the controller decides per chunk a level or
text against the deadline, when to request, when to give a chunk up and when to
reconnect; the driver carries that out on the socket and feeds back what arrives.
Layers are decoded while later chunks arrive and delivered to ``on_layer`` strictly in
order (``net.delivery``); text chunks go to ``on_text``, which recomputes them.

Security and limits: ``auth_token`` authenticates to the sender (and the sender to us)
in the handshake; a refused token raises :class:`AuthenticationFailed` at once (no
retries). ``ssl`` (an ``ssl.SSLContext``, or True for the system CAs) wraps every
connection in TLS. ``max_frame`` caps the frames the sender may send us.
``max_buffered_bytes`` bounds the encoded sections received but not yet delivered:
above it the session stops reading from the socket (TCP backpressure on the sender)
until the consumer catches up, except while the consumer waits for data not yet
received, so a refetch can never deadlock behind the backlog.

``chunks=k`` fetches only the context's first ``k`` chunks: the manifest is cut to them
when the context opens (and again on every reconnect), so the plan, the deliveries and
the report cover those alone (how a stored prefix of a longer prompt is fetched:
``streamer.net.prefix_fetch``).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from typing import Any, Callable, Sequence

import codec

from streamer.adapt import estimator
from streamer.adapt.decoding import RECENT_SECTIONS
from streamer.adapt.estimator import MIN_SAMPLE_BYTES
from streamer.adapt.policies import Choice, Observation
from streamer.adapt.recompute import RECENT
from streamer.fetch.controller import Beliefs, FetchController, FetchSettings
from streamer.fetch.report import ChunkReport, FetchReport
from streamer.net.client import (MAX_PROFILE_BYTES, AuthenticationFailed, ClientConnection, ConnectionLost,
                                 ServerError, StreamError)
from streamer.net.config import SessionConfig
from streamer.net.devices import decode_executor, section_decoder
from streamer.net.delivery import OrderedDelivery
from streamer.net.driver import ContextChanged, ContextTooLarge, FetchDriver, FetchFailed, TextNotConsumed
from streamer.wire import protocol as p
from streamer.wire.manifest import Manifest, ManifestError

_profiles: "collections.OrderedDict[str, codec.Profile]" = collections.OrderedDict()
#: bytes of profiles kept for later sessions (least recently used first out; the one in use
#: stays whatever its size): a Llama-3-8B profile is ~270 MB
PROFILE_CACHE_BYTES = 1 << 30
#: Per sender address: the prior of the next fetch (a reused connection, the receiver
#: daemon and successive sessions of one process all carry it), with when it was measured.
_server_priors: dict[tuple[str, int], tuple[float, estimator.LinkMemory]] = {}
#: A sender's memory is forgotten this long after its last measurement. A fetch that a slow
#: memory plans all as text measures nothing and leaves the memory as it was, so without an
#: age a link that recovered would not be tried again while deadlines stay too tight to probe.
MEMORY_TTL_S = 60.0


def _recall(address: tuple[str, int], now: float) -> estimator.LinkMemory | None:
    """The memory of ``address`` if it is younger than ``MEMORY_TTL_S``."""
    entry = _server_priors.get(address)
    if entry is None or now - entry[0] > MEMORY_TTL_S:
        _server_priors.pop(address, None)
        return None
    return entry[1]


def _remember_profile(profile: codec.Profile) -> None:
    """Keep ``profile`` for later sessions, the most recent first out last, within
    ``PROFILE_CACHE_BYTES`` (the newest stays whatever its size)."""
    _profiles[profile.id] = profile
    _profiles.move_to_end(profile.id)
    while len(_profiles) > 1 and sum(p.nbytes for p in _profiles.values()) > PROFILE_CACHE_BYTES:
        _profiles.popitem(last=False)


async def connect(config: SessionConfig, host: str, port: int, *, timeout: float | None = None,
                  ssl: Any = None) -> ClientConnection:
    """A handshaken connection to one sender as ``config`` says (auth, TLS, frame limit);
    ``ssl``: a context already built from ``config`` (default: build one)."""
    return await ClientConnection.connect(
        host, port, timeout=config.connect_timeout if timeout is None else timeout,
        max_frame=config.max_frame, auth_token=config.auth_token,
        ssl=config.ssl_context() if ssl is None else ssl, server_hostname=config.server_hostname)


class ChunksOutOfRange(StreamError, ValueError):
    """``StreamSession(chunks=k)`` names more chunks than the context has: refused when the
    context opens, before anything is fetched (retrying cannot help)."""


def leading_chunks(manifest: Manifest, chunks: int) -> Manifest:
    """``manifest`` cut to its first ``chunks`` chunks (their tokens, sizes and text):
    what a session fetching only those plans, requests and reports."""
    if not 1 <= chunks <= len(manifest.chunks):
        raise ChunksOutOfRange(f"asked for the first {chunks} chunks of context {manifest.context_id!r}, "
                               f"which has {len(manifest.chunks)}")
    if chunks == len(manifest.chunks):
        return manifest
    return dataclasses.replace(manifest, chunks=manifest.chunks[:chunks], tokens=manifest.chunks[chunks - 1].end)


class StreamSession:
    """Receive one context; see the module docstring. Use as an async context manager."""

    def __init__(self, host: str, port: int, context_id: str, *, config: SessionConfig | None = None,
                 on_layer: Callable[..., Any] | None = None, on_text: Callable[..., Any] | None = None,
                 on_chunk: Callable[[ChunkReport], Any] | None = None,
                 servers: Sequence[tuple[str, int]] = (),
                 connection: ClientConnection | None = None, chunks: int | None = None,
                 **options: Any) -> None:
        """``config`` says how to fetch; keyword ``options`` (any SessionConfig field, e.g.
        ``slo=0.5``) override it, or build one when ``config`` is None. ``servers`` are
        fallbacks after ``host:port``; ``connection`` is an idle connection to reuse;
        ``chunks`` (>= 1) fetches only the context's first ``chunks`` chunks (None: all;
        ChunksOutOfRange on entering when the context has fewer)."""
        if chunks is not None and (type(chunks) is not int or chunks < 1):
            raise ValueError(f"chunks must be an int >= 1 or None, got {chunks!r}")
        #: the leading chunks to fetch (None: all of them)
        self.chunks = chunks
        config = SessionConfig(**options) if config is None else dataclasses.replace(config, **options)
        self.config = config
        self._ssl = config.ssl_context()
        self._given_connection = connection
        self._on_data: Callable[[], None] | None = None   # set by a running fetch
        self.context_id = context_id
        self._on_layer = on_layer
        self._on_text = on_text
        self._on_chunk = on_chunk
        self._decode = section_decoder(config.device)
        self._servers = [(host, int(port))] + [(h, int(pt)) for h, pt in servers]
        self._server_index = 0
        self._client: ClientConnection | None = None
        self.manifest: Manifest | None = None
        self.profile: codec.Profile | None = None
        #: bytes/s of the manifest (and profile) answers, measured when the context opens
        self.handshake_bps: float | None = None
        #: the profile's download as a throughput sample, for the next fetch's history (see
        #: ``_open_context``); taken by that fetch
        self.open_sample: Observation | None = None
        #: seconds the last connect + handshake + open took, less the profile download (a
        #: reconnect finds the profile cached): what dropping a connection costs (the cancel
        #: rule weighs it against draining what the old one queued)
        self.connect_seconds = 0.0
        #: the level (or "text") each chunk was last requested at, as soon as it is requested:
        #: lets a consumer label layers before the chunk's report exists
        self.levels: dict[int, Choice] = {}
        #: (first token, tokens, seconds) of the caller's last on_text calls, across fetches:
        #: its compute outlives a fetch, so the next one plans text at the cost it showed
        #: (adapt.recompute)
        self.recomputes: collections.deque[tuple[int, int, float]] = collections.deque(maxlen=RECENT)
        #: (tokens, bytes, seconds) of the last sections decoded, across fetches: the decoder's
        #: cost, so the next fetch's first plan is timed by it too (adapt.decoding)
        self.decodes: collections.deque[tuple[int, int, float]] = collections.deque(maxlen=RECENT_SECTIONS)
        self._executor = decode_executor()
        #: the current (or last) fetch's delivery, which says what went out (not its driver:
        #: the driver refers to the session, and the cycle would keep the consumers'
        #: callbacks, and what they hold, until the cyclic garbage collector ran)
        self._delivery: OrderedDelivery | None = None
        #: with ``SessionConfig.record``: the last fetch's controller inputs and actions, in
        #: order (``streamer.fetch.events``), replayable in the simulator with what it started
        #: from (``beliefs``: the prior, the profile download's sample, the decoder's cost)
        self.log: list | None = None
        self.beliefs: Beliefs | None = None

    @property
    def slo(self) -> float:
        return self.config.slo

    @property
    def policy_name(self) -> str:
        return self.config.policy

    @property
    def max_buffered_bytes(self) -> int:
        return self.config.max_buffered_bytes

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> "StreamSession":
        if self._client is not None:   # opened already (``prefix_fetch.open_prefix_session``)
            return self
        if self._decode is codec.decode_section:
            # the CPU decoder's numba kernels compile (cold cache) or load now, not in
            # fetch(), whose clock would count the stall as a slow link (once per process)
            await asyncio.to_thread(codec.warm_up)
        if not await self._reuse(self._given_connection):
            await self._connect_any()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection (what leaving ``async with`` does)."""
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    def set_callbacks(self, *, on_layer: Callable[..., Any] | None = None,
                      on_text: Callable[..., Any] | None = None) -> None:
        """Set the consumers after entering, once ``manifest`` tells their shapes."""
        self._on_layer = on_layer
        self._on_text = on_text

    async def _reuse(self, client: ClientConnection | None) -> bool:
        """Open the context on an idle connection handed in by the caller (a pool): no new
        handshake. False, with the connection dropped, if it turns out to be unusable."""
        if client is None:
            return False
        if not client.reusable:
            client.abort()
            return False
        self._client = client
        client.set_on_data(self._on_data)
        client.resume_reading()
        try:
            await self._open_context()
            # not measured on a reused connection: TCP, HELLO, AUTH and OPEN round trips
            self.connect_seconds = 4 * client.rtt
            return True
        except ServerError as exc:
            if exc.code in ("not_found", "bad_request"):
                self._drop_client()
                raise
        except ConnectionLost:
            pass
        except BaseException:   # not retryable (too large, too few chunks, cancelled): no leak
            self._drop_client()
            raise
        self._drop_client()
        return False

    def _drop_client(self) -> None:
        if self._client is not None:
            self._client.abort()
            self._client = None

    def detach_connection(self) -> ClientConnection | None:
        """After ``fetch()``: hand the connection back for reuse (None if it is not reusable);
        the session then leaves it open on exit."""
        client, self._client = self._client, None
        if client is not None and client.reusable:
            client.set_on_data(None)
            return client
        if client is not None:
            client.abort()
        return None

    @property
    def address(self) -> tuple[str, int]:
        return self._servers[self._server_index]

    async def _connect_any(self) -> None:
        """Connect to the servers in turn (with backoff) and open the context."""
        delay = self.config.backoff
        started = time.monotonic()
        last: Exception | None = None
        for attempt in range(self.config.max_reconnects + 1):
            host, port = self._servers[self._server_index]
            try:
                self._client = await connect(self.config, host, port, ssl=self._ssl)
                self._client.set_on_data(self._on_data)
                profile_seconds = await self._open_context()
                self.connect_seconds = time.monotonic() - started - profile_seconds
                return
            except (AuthenticationFailed, ContextTooLarge, ChunksOutOfRange):
                self._drop_client()
                raise  # a wrong token, a context too large here or too short: retrying cannot help
            except ServerError as exc:
                if exc.code in ("not_found", "bad_request"):
                    self._drop_client()
                    raise  # no such context, or an invalid id: retrying elsewhere cannot help
                last = exc
            except ConnectionLost as exc:
                last = exc
            self._drop_client()
            self._server_index = (self._server_index + 1) % len(self._servers)
            await asyncio.sleep(delay)
            delay = min(2 * delay, self.config.max_backoff)
        raise ConnectionLost(f"could not reach a sender for {self.context_id!r}: {last}")

    async def _open_context(self) -> float:
        """Open the context (manifest, then the profile unless cached); returns the seconds
        the profile download took (0 when cached)."""
        client = self._client
        assert client is not None
        timeout = self.config.connect_timeout
        asked = time.monotonic()
        answer = await client.call(p.Open(context_id=self.context_id, slo=self.slo), p.ManifestData, timeout)
        received = len(answer.data)
        manifest = Manifest.from_bytes(answer.data)
        if self.chunks is not None:
            manifest = leading_chunks(manifest, self.chunks)
        limit = self.config.max_context_bytes
        if limit is not None and manifest.decoded_bytes > limit:
            raise ContextTooLarge(f"context {self.context_id!r} decodes to {manifest.decoded_bytes} bytes "
                                  f"({manifest.layers} layers x {manifest.tokens} tokens x {manifest.heads} x "
                                  f"{manifest.head_dim} {manifest.dtype}), over this receiver's limit of "
                                  f"{limit} (SessionConfig.max_context_bytes)")
        if self.manifest is not None and manifest.version != self.manifest.version:
            raise ContextChanged(f"context {self.context_id!r} changed from version "
                                 f"{self.manifest.version} to {manifest.version} during the fetch")
        self.manifest = manifest
        profile = _profiles.get(manifest.profile_id)
        profile_seconds = 0.0
        if profile is None:
            profile_asked = time.monotonic()
            # no larger than a profile of the manifest's shape can be (the sender controls both,
            # but then the context's own limit has bounded the shape)
            most = min(MAX_PROFILE_BYTES, codec.max_profile_bytes(manifest.layers, manifest.heads,
                                                                  manifest.head_dim, manifest.levels))
            data = await client.get_profile(manifest.profile_id, timeout, max_bytes=most)
            profile_seconds = time.monotonic() - profile_asked
            received += len(data)
            if len(data) >= MIN_SAMPLE_BYTES:
                # busy from one round trip after the request, as a chunk's (``_busy_start``)
                self.open_sample = Observation(len(data), max(profile_seconds - client.rtt, 0.0))
            profile = codec.Profile.from_bytes(data)
            if profile.id != manifest.profile_id:
                raise ConnectionLost(f"sender returned profile {profile.id}, wanted {manifest.profile_id}")
            await asyncio.to_thread(profile.prepare_decoding)   # not at the first decode, on fetch()'s clock
        if manifest.restart != profile.intra_period:
            # a continuation asks from the manifest's restart layer; the decoder chains by the profile's
            raise ManifestError(f"context {self.context_id!r}'s manifest says its layers restart prediction "
                                f"every {manifest.restart}, its profile {profile.id} every {profile.intra_period}")
        _remember_profile(profile)
        self.profile = profile
        # round trips included, so a lower bound on the link: the first chunk's prior when
        # neither the caller nor an earlier fetch from this sender gives a better one
        self.handshake_bps = received / max(time.monotonic() - asked, 1e-6)
        return profile_seconds

    # ------------------------------------------------------------------ fetching
    async def fetch(self) -> FetchReport:
        """Fetch every chunk; returns when the last layer or text chunk was delivered."""
        if self.manifest is None or self._client is None:
            raise RuntimeError("use `async with StreamSession(...)` before fetch()")
        self.beliefs = self._beliefs()
        controller = FetchController(self.manifest, self._settings(), context_id=self.context_id,
                                     beliefs=self.beliefs, record=self.config.record)
        driver = FetchDriver(self, controller)
        self._delivery = driver.delivery
        try:
            report = await driver.run()
        finally:
            # a re-open during this fetch (a reconnect that downloaded the profile again)
            # measured this fetch's link, not the next one's
            self.open_sample = None
            self.log = controller.log
            self.recomputes.extend(controller.recomputes)
            self.decodes.extend(controller.decodes)
        memory = controller.memory()
        if memory is not None:
            _server_priors[self.address] = (time.monotonic(), memory)
        return report

    def _settings(self) -> FetchSettings:
        config = self.config
        return FetchSettings(slo=config.slo, policy=config.policy, cancels=config.cancels,
                             recompute_seconds_per_token=config.recompute_seconds_per_token,
                             recompute_context_seconds=config.recompute_context_seconds,
                             recompute_overlaps=config.recompute_overlaps,
                             stall_timeout=config.stall_timeout, max_reconnects=config.max_reconnects,
                             continuations=config.continuations,
                             text_consumable=self._on_text is not None or self._on_layer is None)

    def _beliefs(self) -> Beliefs:
        """What the next fetch starts from: the first decision's rate is the caller's prior,
        else the last fetch's from this sender, else what the handshake measured (a lower
        bound: it includes round trips); the profile just downloaded over this link is the
        first sample (megabytes a moment ago, where a first chunk's first bytes may be a
        shaper's burst)."""
        memory = _recall(self.address, time.monotonic())
        prior = self.config.prior_bps or (memory.rate if memory else self.handshake_bps)
        return Beliefs(prior_bps=prior, prior_errors=memory.errors if memory else (),
                       prior_is_lower_bound=not self.config.prior_bps and not memory,
                       history=(self.open_sample,) if self.open_sample else (),
                       decodes=tuple(self.decodes), recomputes=tuple(self.recomputes),
                       decode_prior=self.config.decode_prior)

    def delivered_layers(self, chunk: int) -> int:
        """Layers of ``chunk`` handed to ``on_layer`` so far in the current (or last) fetch
        (counted from the call): from ``on_text``, non-zero means the text supersedes them."""
        return self._delivery.delivered_layers(chunk) if self._delivery is not None else 0


#: the fetch's errors are raised by its driver; callers import them from here
__all__ = ["ChunksOutOfRange", "ContextChanged", "ContextTooLarge", "FetchFailed", "StreamSession", "TextNotConsumed",
           "connect", "leading_chunks"]
