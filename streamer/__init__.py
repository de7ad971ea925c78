"""kvwire streaming engine: stores, the sender daemon and the StreamSession receiver.

Pure cores (``protocol``, ``policy``, ``estimator``, ``adapt``) with thin asyncio
adapters around them (``server``, ``client``, ``session``, ``delivery``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["open_store", "put_context", "serve", "Sender", "ServerConfig", "StreamSession",
           "FetchReport", "ChunkReport", "FetchFailed", "StreamError", "ServerError",
           "ConnectionLost", "ContextChanged", "Manifest", "AuthenticationFailed",
           "InsecureConfiguration"]

_EXPORTS = {
    "open_store": "stores", "put_context": "put", "serve": "server", "Sender": "server",
    "ServerConfig": "server", "StreamSession": "session", "FetchFailed": "session",
    "ContextChanged": "session", "FetchReport": "report", "ChunkReport": "report",
    "StreamError": "client", "ServerError": "client", "ConnectionLost": "client",
    "AuthenticationFailed": "client", "InsecureConfiguration": "server",
    "Manifest": "manifest",
}


def __getattr__(name: str) -> Any:
    """Import on first use: the CLI must not pay for torch to print --help."""
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'streamer' has no attribute {name!r}")


if TYPE_CHECKING:
    from .client import AuthenticationFailed, ConnectionLost, ServerError, StreamError
    from .manifest import Manifest
    from .put import put_context
    from .report import ChunkReport, FetchReport
    from .server import InsecureConfiguration, Sender, ServerConfig, serve
    from .session import ContextChanged, FetchFailed, StreamSession
    from .stores import open_store
