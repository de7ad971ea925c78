"""The receiver daemon (``kvwire receive``): a local service on an inference node that
fetches contexts from sender daemons with ``StreamSession`` and hands them to the
serving processes next to it over a small HTTP/JSON API.

* ``cache``   - bounded LRU-by-bytes store of finished contexts (memory, or a directory
  of safetensors files written atomically), each with its quality recorded
* ``fetcher`` - one fetch per context however many requests ask (single-flight), with
  its progress events for server-sent-event subscribers
* ``http``    - the aiohttp application (``/fetch``, ``/contexts/{id}``, ``/events``,
  ``/healthz``, ``/metrics``, ``/livez``), behind the API token when there is one
* ``requests`` - what a request says (route, parameters, fetch body), parsed sans-I/O
  within stated size limits, or a typed 4xx
* ``sse``     - the event stream's encoding (no value can start a field or an event)
* ``connections`` - the cap on concurrent client connections (503 past it, unread)
* ``server_log`` - aiohttp's log of malformed requests, one throttled line each
* ``daemon``  - ``Receiver``: configuration, start, graceful close
* ``malloc``  - glibc malloc tuned and trimmed, so RSS follows what is in use
* ``cli``     - ``kvwire receive``
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["Receiver", "ReceiverConfig", "start_receiver"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from streamer.receiver import daemon

        return getattr(daemon, name)
    raise AttributeError(f"module 'streamer.receiver' has no attribute {name!r}")


if TYPE_CHECKING:
    from streamer.receiver.daemon import Receiver, ReceiverConfig, start_receiver
