"""kvwire streaming engine: stores, the sender daemon and the StreamSession receiver.

The layout is the architecture (docs/ARCHITECTURE.md): pure cores in ``wire`` (the
sans-I/O protocol), ``adapt`` (estimator, policies, planner, cancel rule) and ``fetch`` (the
fetch controller, its simulator and the oracle); ``store``
(chunk stores and put); thin asyncio adapters in ``net`` (sender daemon, client,
``StreamSession``, ordered delivery, TLS); the ``receiver`` daemon; ``model`` (transformers
integration); and ``tools`` (the CLI, the demo and every benchmark).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["open_store", "put_context", "serve", "Sender", "ServerConfig", "SessionConfig",
           "StreamSession", "FetchReport", "ChunkReport", "FetchFailed", "TextNotConsumed", "StreamError",
           "ServerError",
           "ConnectionLost", "ContextChanged", "ContextTooLarge", "Manifest", "AuthenticationFailed",
           "InsecureConfiguration"]

_EXPORTS = {
    "open_store": "store", "put_context": "store.put", "serve": "net.sender",
    "Sender": "net.sender", "ServerConfig": "net.sender", "StreamSession": "net.session",
    "FetchFailed": "net.session", "TextNotConsumed": "net.session", "ContextChanged": "net.session",
    "ContextTooLarge": "net.session", "FetchReport": "fetch.report",
    "ChunkReport": "fetch.report", "StreamError": "net.client", "ServerError": "net.client",
    "ConnectionLost": "net.client", "AuthenticationFailed": "net.client",
    "InsecureConfiguration": "net.sender", "Manifest": "wire.manifest",
    "SessionConfig": "net.config",
}


def __getattr__(name: str) -> Any:
    """Import on first use: the CLI must not pay for torch to print --help."""
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'streamer' has no attribute {name!r}")


if TYPE_CHECKING:
    from streamer.net.config import SessionConfig
    from streamer.net.client import AuthenticationFailed, ConnectionLost, ServerError, StreamError
    from streamer.wire.manifest import Manifest
    from streamer.store.put import put_context
    from streamer.fetch.report import ChunkReport, FetchReport
    from streamer.net.sender import InsecureConfiguration, Sender, ServerConfig, serve
    from streamer.net.session import ContextChanged, ContextTooLarge, FetchFailed, StreamSession, TextNotConsumed
    from streamer.store import open_store
