"""An OpenAI-compatible completions server whose prompts' stored prefixes arrive as KV.

``protocol`` (pure: request parsing, response shapes), ``engine`` (the model, prefix
lookup and fetch through ``StreamSession``, prefill, greedy generation, write-back) and
``app`` (the aiohttp API, ``start_server``). ``kvwire serve-openai`` runs it; from Python::

    server = await start_server(model, tokenizer, profile, EngineConfig(served_name="smollm2"),
                                SessionConfig(slo=1.0), senders=[("10.0.0.5", 7410)])
    ...   # openai.OpenAI(base_url=server.url + "/v1", api_key=...)
    await server.close()

Names are imported on first use, so that ``kvwire --help`` does not load aiohttp or torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["Engine", "EngineConfig", "PrefixSource", "SenderSource", "ServeConfig", "Server", "start_server"]

_EXPORTS = {"Engine": "engine", "EngineConfig": "engine", "PrefixSource": "engine", "SenderSource": "engine",
            "ServeConfig": "app", "Server": "app", "start_server": "app"}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'streamer.llmserver' has no attribute {name!r}")


if TYPE_CHECKING:
    from streamer.llmserver.app import ServeConfig, Server, start_server
    from streamer.llmserver.engine import Engine, EngineConfig, PrefixSource, SenderSource
