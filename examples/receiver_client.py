"""A serving process asking its node's receiver daemon (``kvwire receive``) for a context.

    kvwire receive --listen 127.0.0.1:7420 --servers 127.0.0.1:7410 --api-token-file receiver.token &
    python examples/receiver_client.py --token-file receiver.token --context doc1 --slo 1.0

(examples/receiver.md runs exactly these.)

Every request carries ``Authorization: Bearer <token>``, the token read from
``--token-file`` or ``$KVWIRE_RECEIVER_TOKEN`` (a daemon started without one, on
loopback, ignores the header; one with a token answers 401 without it).

It starts the fetch without waiting (``"wait": false``), follows the progress events
so it could start on layer 0 of chunk 0 while later chunks are still on the wire,
then takes the whole KV as safetensors (or, with ``--cache DIR`` on the daemon,
memory-maps the file the answer names). Chunks that came as text are listed with
their token ids: a serving process recomputes those itself (or run the daemon with
``--model``). Many processes on one node may ask for the same context at once: they
share one fetch, and later requests are served from the daemon's cache.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os

import aiohttp


async def events(http: aiohttp.ClientSession, url: str):
    """Yield (event, data) from a server-sent event stream until it ends."""
    async with http.get(url) as response:
        response.raise_for_status()
        kind = None
        async for raw in response.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: ") and kind is not None:
                yield kind, json.loads(line[6:])
                kind = None


def token(path: str | None) -> str | None:
    """The daemon's API token: from ``path``, else ``$KVWIRE_RECEIVER_TOKEN``; None when neither is set."""
    if path is not None:
        with open(path) as f:
            return f.read().strip()
    return os.environ.get("KVWIRE_RECEIVER_TOKEN", "").strip() or None


async def main(args: argparse.Namespace) -> int:
    base = args.receiver.rstrip("/")
    secret = token(args.token_file)
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    async with aiohttp.ClientSession(headers=headers) as http:
        body = {"context_id": args.context, "slo": args.slo, "wait": False}
        if args.min_level is not None:
            body["min_level"] = args.min_level
        async with http.post(f"{base}/fetch", json=body) as r:
            answer = await r.json()
            # 400 bad request, 401 no or wrong token, 404 unknown context, 429 this client has too
            # many fetches running (Retry-After), 503 no sender (with the reason)
            if r.status >= 400:
                print(f"error {r.status}: {answer['error']}")
                return 1
        if answer["status"] == "running":
            async for kind, data in events(http, f"{base}{answer['events']}"):
                if kind == "manifest":
                    print(f"{data['tokens']} tokens in {len(data['chunks'])} chunks, {data['layers']} layers")
                elif kind == "layer" and data["layer"] == 0:
                    # here a serving process could start on this chunk's first layer
                    print(f"chunk {data['chunk']}: layer 0 ready")
                elif kind == "text":
                    print(f"chunk {data['chunk']}: sent as text, recompute tokens {data['start']}-{data['end']}")
                elif kind == "error":
                    print(f"fetch failed ({data['status']}): {data['message']}")
                    return 1
                elif kind == "done":
                    answer = data
        quality = answer["quality"]
        print(f"{args.context}: worst level {quality['worst_level']}, text chunks {quality['text_chunks']}, "
              f"{answer['kv']['bytes'] / 1e6:.1f} MB at {answer['kv']['path'] or base + answer['kv']['url']}")
        async with http.get(f"{base}/contexts/{args.context}") as r:
            r.raise_for_status()
            data = await r.read()
    from safetensors.torch import load

    tensors = load(data)
    print({name: tuple(t.shape) for name, t in tensors.items()})
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--receiver", default="http://127.0.0.1:7420")
    parser.add_argument("--token-file", help="file holding the daemon's API token "
                                             "(default: $KVWIRE_RECEIVER_TOKEN)")
    parser.add_argument("--context", required=True)
    parser.add_argument("--slo", type=float, default=1.0)
    parser.add_argument("--min-level", type=int, help="every chunk at this level or better (0 = best)")
    raise SystemExit(asyncio.run(main(parser.parse_args())))
