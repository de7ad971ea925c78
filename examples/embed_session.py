"""Embed StreamSession in an asyncio HTTP server (aiohttp): fetch a context's KV under a
deadline per request, decoding layer by layer while the rest is still on the wire.

    kvwire put --store kvstore --context doc1 --kv doc1.safetensors --tokens doc1.ids
    kvwire serve --store kvstore --listen 127.0.0.1:7410 &
    python examples/embed_session.py --sender 127.0.0.1:7410 --port 8080 &
    curl -s -X POST localhost:8080/prefill -d '{"context": "doc1", "slo": 1.0}'

(the README's tour, steps 2, 3 and 5, runs these). A sender off loopback requires
its auth token: ``--auth-token-file FILE``, or ``$KVWIRE_AUTH_TOKEN``.

A real serving process would copy each layer into its paged KV cache in ``on_layer``
(layer 0 can start attention while later layers arrive) and recompute the chunks
``on_text`` hands it; here we just count them.
"""
from __future__ import annotations

import argparse

from aiohttp import web

import streamer
from streamer.tools.serve_fetch import parse_address
from streamer.wire.auth import load_token


def make_app(sender: tuple[str, int], auth_token: bytes | None = None) -> web.Application:
    async def prefill(request: web.Request) -> web.Response:
        body = await request.json()
        layers_received = 0
        text_tokens = 0

        def on_layer(chunk: int, layer: int, k, v) -> None:
            nonlocal layers_received
            layers_received += 1  # e.g. kv_cache.write(chunk, layer, k, v)

        async def on_text(chunk: int, token_ids: list[int]) -> None:
            nonlocal text_tokens
            text_tokens += len(token_ids)  # e.g. await model.prefill(token_ids)

        try:
            async with streamer.StreamSession(*sender, body["context"], slo=float(body.get("slo", 1.0)),
                                              auth_token=auth_token, on_layer=on_layer,
                                              on_text=on_text) as session:
                report = await session.fetch()
        except streamer.ServerError as exc:
            raise web.HTTPNotFound(text=str(exc)) if exc.code == "not_found" else web.HTTPBadGateway(text=str(exc))
        except streamer.StreamError as exc:
            raise web.HTTPServiceUnavailable(text=str(exc))
        return web.json_response({"layers": layers_received, "recomputed_tokens": text_tokens,
                                  "seconds": report.total_seconds, "deadline_met": report.deadline_met,
                                  "levels": [c.level for c in report.chunks]})

    app = web.Application()
    app.router.add_post("/prefill", prefill)
    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--sender", type=parse_address, default=("127.0.0.1", 7410))
    parser.add_argument("--auth-token-file", metavar="FILE",
                        help="file holding the sender's auth token (default: $KVWIRE_AUTH_TOKEN)")
    parser.add_argument("--host", default="127.0.0.1", help="address of this HTTP server (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args()
    web.run_app(make_app(args.sender, load_token(args.auth_token_file)), host=args.host, port=args.port)
