"""``kvwire receive``: run the receiver daemon (uvloop; SIGTERM/SIGINT shut it down cleanly)."""
from __future__ import annotations

import argparse
import os
import re

from streamer.net.budget import DEFAULT_BUDGET_BYTES
from streamer.receiver.connections import DEFAULT_MAX_CONNECTIONS
from streamer.receiver.daemon import API_TOKEN_ENV, DEFAULT_CACHE_BYTES, DEFAULT_PORT
from streamer.receiver.fetcher import DEFAULT_MAX_FETCHES_PER_CLIENT
from streamer.tools.serve_fetch import parse_address

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """``4G``, ``512M``, ``1.5g``, ``65536`` (binary units) -> bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 65536, 512M or 4G")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_servers(text: str) -> list[tuple[str, int]]:
    """``host1:port,host2:port`` -> [(host, port), ...]."""
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("--servers needs at least one HOST:PORT")
    return [parse_address(p.strip()) for p in parts]


def api_token(args: argparse.Namespace, env: str = API_TOKEN_ENV) -> bytes | None:
    """The API token from --api-token-file or, without it, ``$<env>`` (default
    ``$KVWIRE_RECEIVER_TOKEN``; read as the sender's token is; never taken as an argument:
    ``ps`` shows those)."""
    from streamer.wire.auth import load_token, normalize_token

    if args.api_token_file is not None:
        return load_token(args.api_token_file)
    value = os.environ.get(env, "").strip()
    return normalize_token(value) if value else None


async def _receive(args: argparse.Namespace) -> int:
    import asyncio
    import contextlib
    import logging
    import signal
    import sys

    from streamer.net.sender import InsecureConfiguration
    from streamer.receiver.daemon import ReceiverConfig, start_receiver

    logging.basicConfig(level=logging.INFO, format="kvwire receive: %(message)s")
    from streamer.tools.serve_fetch import session_config

    session = session_config(args, slo=args.slo, policy=args.policy, device=args.device)
    config = ReceiverConfig(servers=args.servers, cache_dir=args.cache, cache_bytes=args.cache_bytes,
                            model=args.model, shutdown_grace=args.grace, session=session,
                            max_connections=args.max_connections, api_token=api_token(args),
                            allow_insecure=args.insecure_no_auth,
                            max_fetches_per_client=args.max_fetches_per_client,
                            receive_budget=args.receive_budget)
    model_errors: tuple[type[Exception], ...] = ()
    if args.model:
        from streamer.model.hf import ModelLoadError

        # a wrong path, not a model, a damaged file or a missing package: say which
        model_errors = (FileNotFoundError, ModelLoadError, RuntimeError)
        print(f"kvwire receive: loading model {args.model}", flush=True)
    try:
        receiver = await start_receiver(config, *args.listen)
    except InsecureConfiguration as exc:
        print(f"kvwire receive: {exc}", file=sys.stderr)
        return 2
    except model_errors as exc:
        print(f"kvwire receive: cannot load model {args.model}: {exc}", file=sys.stderr)
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    servers = ",".join(f"{h}:{p}" for h, p in config.servers)
    cache = args.cache or "memory"
    print(f"kvwire receive: {receiver.url} <- {servers} (cache {cache}, {config.cache_bytes} bytes, "
          f"device {config.device}{', model ' + args.model if args.model else ''}, "
          f"{'API token required' if config.api_token is not None else 'no API token'})", flush=True)
    await stop.wait()
    print("kvwire receive: shutting down", flush=True)
    await receiver.close()
    return 0


def register(subparsers: argparse._SubParsersAction, bench_subparsers: argparse._SubParsersAction) -> None:
    from streamer.tools.serve_fetch import _runner  # (no aiohttp here: --help stays light)

    # allow_abbrev=False: "--auth-token SECRET" must be an error, not --auth-token-file
    receive = subparsers.add_parser(
        "receive", allow_abbrev=False, help="run a receiver daemon: fetch contexts for local serving processes",
        description="Fetch contexts from sender daemons under an SLO for the serving processes on this "
                    "host, over a local HTTP API: POST /fetch, GET /contexts/ID (safetensors), "
                    "GET /contexts/ID/events (server-sent events), GET /healthz, GET /metrics, GET /livez. "
                    "Concurrent requests share one fetch; finished contexts stay in an LRU cache.")
    receive.add_argument("--listen", type=parse_address, default=("127.0.0.1", DEFAULT_PORT),
                         help=f"HOST:PORT of the HTTP API (default 127.0.0.1:{DEFAULT_PORT}); off loopback "
                              "it needs an API token")
    receive.add_argument("--api-token-file", metavar="FILE",
                         help="file holding the token every API request but GET /livez must carry "
                              f"(Authorization: Bearer TOKEN; default: ${API_TOKEN_ENV}; without one the "
                              "API is open, which only loopback allows)")
    receive.add_argument("--insecure-no-auth", action="store_true",
                         help="allow the API on a non-loopback address without a token")
    receive.add_argument("--max-fetches-per-client", type=int, default=DEFAULT_MAX_FETCHES_PER_CLIENT,
                         help=f"fetches one client may have running that it started (default "
                              f"{DEFAULT_MAX_FETCHES_PER_CLIENT}; with a token all its holders are one "
                              "client, else each peer address); one more is answered 429 with Retry-After")
    receive.add_argument("--servers", type=parse_servers, required=True,
                         help="sender daemons, HOST:PORT[,HOST:PORT...] (over one shared store): "
                              "fetches start on them round-robin, and move to the next if one fails")
    receive.add_argument("--cache", metavar="DIR",
                         help="keep finished contexts as safetensors files in DIR (kept across restarts); "
                              "default: in memory")
    receive.add_argument("--cache-bytes", type=parse_bytes, default=DEFAULT_CACHE_BYTES,
                         help="cache budget, least recently used evicted first (default 4G); no context "
                              "larger than it is fetched")
    receive.add_argument("--receive-budget", type=parse_bytes, default=DEFAULT_BUDGET_BYTES,
                         help="bytes received and not yet delivered, coded or decoded, that all fetches "
                              "together may hold (default 512M): above it, a fetch holding more than its "
                              "share stops reading and none decodes ahead of its consumer")
    receive.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                         help="where to decode (cuda needs kvwire[cuda])")
    receive.add_argument("--model", metavar="PATH",
                         help="recompute chunks that arrive as text with this model (local path, or "
                              "'minilm'); without it their token ids are reported to the caller")
    receive.add_argument("--slo", type=float, default=1.0, help="default deadline of a fetch, s (default 1)")
    receive.add_argument("--policy", default="mpc", help="default policy: mpc, greedy, fixed:N or text")
    from streamer.tools.serve_fetch import _add_auth_option

    _add_auth_option(receive, "shared with the senders")
    receive.add_argument("--tls", action="store_true", help="connect to the senders with TLS (system CAs)")
    receive.add_argument("--tls-ca", metavar="PEM", help="connect with TLS, trusting this CA / certificate")
    receive.add_argument("--tls-server-name", help="host name to verify in the senders' certificates")
    receive.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                         help=f"client connections served at once (default {DEFAULT_MAX_CONNECTIONS}); one "
                              "more is answered 503 with Retry-After, unread, and closed")
    receive.add_argument("--grace", type=float, default=5.0,
                         help="on SIGTERM, seconds running fetches may take to finish (default 5)")
    receive.set_defaults(handler=_runner(_receive))
