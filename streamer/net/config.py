"""One configuration object per role, validated in one place (as aioquic's
``QuicConfiguration``): ``SessionConfig`` for a receiving ``StreamSession`` -- shared
by the receiver daemon and the CLI, which thread it through unchanged -- and
``ServerConfig`` (in ``streamer.net.sender``) for the sender daemon; both check their
fields with the ``require_*`` helpers here."""
from __future__ import annotations

import math
import ssl as _ssl
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from streamer.adapt.cancel import cancels_by_default
from streamer.adapt.decide import DEFAULT_RECOMPUTE_SECONDS_PER_TOKEN
from streamer.adapt.decoding import DecodeCost
from streamer.adapt.policies import DEFAULT_POLICY, get_policy
from streamer.wire import auth
from streamer.wire.frames import DEFAULT_MAX_FRAME, MIN_MAX_FRAME

#: Default bound on encoded sections received but not yet delivered (backpressure).
DEFAULT_MAX_BUFFERED_BYTES = 64 * 1024 * 1024


def require_positive(owner: str, name: str, value: object, *, allow_zero: bool = False) -> None:
    """ValueError unless ``value`` is a finite number > 0 (>= 0 with ``allow_zero``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and (value >= 0 if allow_zero else value > 0)
    if not ok:
        raise ValueError(f"{owner}.{name} must be a finite number {'>=' if allow_zero else '>'} 0, "
                         f"got {value!r}")


def require_int(owner: str, name: str, value: object, minimum: int) -> None:
    """ValueError unless ``value`` is an int (not a bool) >= ``minimum``."""
    if type(value) is not int or value < minimum:
        raise ValueError(f"{owner}.{name} must be an int >= {minimum}, got {value!r}")


def require_max_frame(owner: str, value: object) -> None:
    """ValueError unless ``value`` is a frame size limit both ends can honour."""
    if type(value) is not int or not MIN_MAX_FRAME <= value <= 0xFFFF_FFFF:
        raise ValueError(f"{owner}.max_frame must be an int in [{MIN_MAX_FRAME}, 2**32-1], got {value!r}")


@dataclass(frozen=True)
class SessionConfig:
    """How a ``StreamSession`` fetches: deadline, policy, decode device, fault handling,
    security and limits. Invalid values raise ValueError/TypeError at construction."""

    #: deadline in seconds from the start of ``fetch()``
    slo: float = 1.0
    #: adaptation policy name (``streamer.adapt.policies.names()``)
    policy: str = DEFAULT_POLICY
    #: where decoded layers land: "cpu" or "cuda[:N]" (GPU decode needs kvwire[cuda])
    device: str = "cpu"
    #: the caller's cost of recomputing one token from text (plans weigh text against KV)
    recompute_seconds_per_token: float = DEFAULT_RECOMPUTE_SECONDS_PER_TOKEN
    #: and what each token before it adds to that (attention over the cache: dear on a CPU
    #: host, where a chunk late in a long prefix costs several times the first one;
    #: ``streamer.adapt.recompute``, ``streamer.model.hf.recompute_cost`` measures both)
    recompute_context_seconds: float = 0.0
    #: the caller recomputes beside the decoder (a GPU model while the CPU decodes), so
    #: text overlaps the transfers of later chunks; False where both share the same cores
    #: (a CPU-only host): plans are then timed in series (``PlanInput.recompute_overlaps``)
    recompute_overlaps: bool = True
    #: abandon a chunk in flight when finishing it would sink the deadline (CANCEL, or a
    #: fresh connection, then a lower level or text: ``streamer.adapt.cancel``); None: on
    #: for mpc, off for greedy (CacheGen's rule), fixed:N and text, which promise a rule
    cancel: Optional[bool] = None
    #: let the cancel rule continue a chunk some layers of which went out at a lower level
    #: (its remaining layers only; needs a sender speaking protocol version 2), rather
    #: than only give it up for text
    continuations: bool = True
    #: throughput (bytes/s) assumed before the first measurement (None: the last fetch's
    #: estimate for the same sender, if any)
    prior_bps: Optional[float] = None
    #: the decoder's cost assumed before the session has timed a section of its own (e.g.
    #: a chunk decoded before the fetch: ``adapt.decoding.measure_whole``); it
    #: counts as one chunk's sections among the recent ones. None: the first chunks are
    #: planned as if decoding were free until a section has been timed
    decode_prior: Optional[DecodeCost] = None
    #: TCP connect + handshake + OPEN answer, per attempt
    connect_timeout: float = 5.0
    #: no data for this long while a chunk is in flight: reconnect and resume
    stall_timeout: float = 2.0
    #: reconnections per fetch (cycling through the servers) before FetchFailed
    max_reconnects: int = 4
    #: first reconnect backoff, doubled per attempt up to ``max_backoff`` (seconds)
    backoff: float = 0.05
    max_backoff: float = 1.0
    #: shared secret (str/bytes, >= 16 bytes) proving who we are, and who the sender is
    auth_token: Optional[auth.Token] = field(default=None, repr=False)
    #: TLS: an ssl.SSLContext, True for the system CAs, None for plain TCP
    ssl: Union[_ssl.SSLContext, bool, None] = None
    #: TLS server name to verify (default: the host connected to)
    server_hostname: Optional[str] = None
    #: largest frame payload we accept from the sender
    max_frame: int = DEFAULT_MAX_FRAME
    #: encoded sections received but not yet delivered, before reading pauses
    max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES
    #: keep every input and action of the fetch controller in ``StreamSession.log`` (a
    #: replayable trace of the last fetch: ``streamer.fetch.events``)
    record: bool = False
    #: the most a context may decode to (bytes of its whole KV, from its manifest, which the
    #: sender controls): a larger one is ContextTooLarge before anything is fetched; None: no
    #: limit beyond the blob format's (the receiver daemon sets its cache's size)
    max_context_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        owner = "SessionConfig"
        require_positive(owner, "slo", self.slo)
        object.__setattr__(self, "slo", float(self.slo))
        get_policy(self.policy)  # ValueError listing the valid names
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"SessionConfig.device: {exc}") from None
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"SessionConfig.device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        require_positive(owner, "recompute_seconds_per_token", self.recompute_seconds_per_token)
        require_positive(owner, "recompute_context_seconds", self.recompute_context_seconds, allow_zero=True)
        if self.prior_bps is not None:
            require_positive(owner, "prior_bps", self.prior_bps)
        if self.decode_prior is not None and not isinstance(self.decode_prior, DecodeCost):
            raise TypeError(f"{owner}.decode_prior must be a streamer.adapt.decoding.DecodeCost or None, "
                            f"got {self.decode_prior!r}")
        if self.max_context_bytes is not None:
            require_int(owner, "max_context_bytes", self.max_context_bytes, 1)
        for name in ("record", "recompute_overlaps"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{owner}.{name} must be a bool, got {getattr(self, name)!r}")
        if self.cancel is not None and not isinstance(self.cancel, bool):
            raise TypeError(f"{owner}.cancel must be a bool or None, got {self.cancel!r}")
        if not isinstance(self.continuations, bool):
            raise TypeError(f"{owner}.continuations must be a bool, got {self.continuations!r}")
        for name in ("connect_timeout", "stall_timeout", "backoff", "max_backoff"):
            require_positive(owner, name, getattr(self, name))
        require_int(owner, "max_reconnects", self.max_reconnects, 0)
        require_int(owner, "max_buffered_bytes", self.max_buffered_bytes, 1)
        require_max_frame(owner, self.max_frame)
        if self.ssl is not None and not isinstance(self.ssl, (bool, _ssl.SSLContext)):
            raise TypeError(f"SessionConfig.ssl must be an ssl.SSLContext, True or None, "
                            f"got {type(self.ssl).__name__}")
        if self.server_hostname is not None and not isinstance(self.server_hostname, str):
            raise TypeError("SessionConfig.server_hostname must be a str or None")
        object.__setattr__(self, "auth_token", auth.normalize_token(self.auth_token))

    def ssl_context(self) -> Optional[_ssl.SSLContext]:
        """The TLS context connections use (True: the system CAs), or None for plain TCP."""
        return _ssl.create_default_context() if self.ssl is True else (self.ssl or None)

    @property
    def cancels(self) -> bool:
        """Whether the cancel rule runs: ``cancel``, or by default for mpc only."""
        return cancels_by_default(self.policy) if self.cancel is None else self.cancel
