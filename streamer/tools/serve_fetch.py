"""Streaming subcommands: ``kvwire serve`` (sender daemon) and ``kvwire fetch`` (one fetch)."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
from typing import Awaitable, Callable

DEFAULT_PORT = 7410
#: ``kvwire fetch``'s text cost without a model to measure (a GPU-class guess; with
#: ``--model`` the model's own rate is measured instead)
DEFAULT_RECOMPUTE_MS_PER_TOKEN = 0.1


def parse_address(text: str, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """HOST:PORT (or HOST, or :PORT) -> (host, port); argparse-friendly errors."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = text, str(default_port)
    host = host.strip("[]") or "127.0.0.1"
    try:
        number = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad port in {text!r}") from None
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"port out of range in {text!r}")
    return host, number


def run_async(main: Callable[[], Awaitable[int]]) -> int:
    """Run on uvloop when installed (the fast receive path), else the default loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())


def _token(args: argparse.Namespace):
    """The auth token from --auth-token-file or $KVWIRE_AUTH_TOKEN (never an argument)."""
    from streamer.wire.auth import load_token

    return load_token(args.auth_token_file)


def _add_auth_option(parser: argparse.ArgumentParser, who: str) -> None:
    parser.add_argument("--auth-token-file", metavar="FILE",
                        help=f"file holding the shared auth token {who} (default: "
                             f"$KVWIRE_AUTH_TOKEN; tokens are never taken on the command line)")


def session_config(args: argparse.Namespace, **fields):
    """The SessionConfig of ``kvwire fetch`` / ``kvwire receive``: the auth token and TLS
    options from ``args`` plus ``fields``; ValueError for an inconsistent combination."""
    from streamer.net.config import SessionConfig

    ssl_context = None
    if args.tls or args.tls_ca:
        from streamer.net.tls import client_context

        ssl_context = client_context(args.tls_ca)
    elif args.tls_server_name:
        raise ValueError("--tls-server-name needs --tls or --tls-ca")
    return SessionConfig(auth_token=_token(args), ssl=ssl_context,
                         server_hostname=args.tls_server_name, **fields)


# ---------------------------------------------------------------------------- serve
def _check_servable(store, url: str) -> None:
    """A file store whose directory does not exist is a typo, not an empty store: refuse
    to start (StoreError) rather than answer "not found" to every receiver. (Redis
    stores are pinged when opened.)"""
    from streamer.store import StoreError
    from streamer.store.file import FileStore

    if isinstance(store, FileStore) and not store.root.is_dir():
        raise StoreError(f"store {url!r}: directory {str(store.root)!r} does not exist "
                         "(kvwire put --store creates it)")


async def _serve(args: argparse.Namespace) -> int:
    from streamer.net.sender_metrics import SenderMetrics, configure_logging
    from streamer.net.sender import ServerConfig, serve
    from streamer.store import open_store

    host, port = args.listen
    configure_logging(json_lines=args.log_json, level=getattr(logging, args.log_level.upper()))
    metrics = SenderMetrics() if args.metrics_port is not None else None
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    ssl_context = None
    if args.tls_cert:
        from streamer.net.tls import server_context

        ssl_context = server_context(args.tls_cert, args.tls_key, client_ca_file=args.tls_client_ca)
    config = ServerConfig(idle_timeout=args.idle_timeout, write_timeout=args.write_timeout,
                          read_timeout=args.read_timeout, max_sessions=args.max_sessions,
                          max_pending_requests=args.max_pending_requests,
                          max_frame=args.max_frame, shutdown_grace=args.grace,
                          auth_token=_token(args), ssl=ssl_context,
                          allow_insecure=args.insecure_no_auth, metrics=metrics)
    store = await open_store(args.store)
    try:
        _check_servable(store, args.store)
        sender = await serve(store, host, port, config)
    except BaseException:
        await store.close()
        raise
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    mode = ("tls" if ssl_context else "plain") + (", auth" if config.auth_token else ", no auth")
    print(f"kvwire serve: {args.store} ({mode}) on {sender.address[0]}:{sender.port}", flush=True)
    if metrics is not None:
        try:
            metrics_port = metrics.start_http(args.metrics_host, args.metrics_port)
        except BaseException:
            await sender.close()
            await store.close()
            raise
        print(f"kvwire serve: metrics on http://{args.metrics_host}:{metrics_port}/metrics", flush=True)
    try:
        await stop.wait()
        print("kvwire serve: shutting down", flush=True)
        await sender.close()
        await store.close()
    finally:
        if metrics is not None:
            metrics.stop_http()
    return 0


# ---------------------------------------------------------------------------- fetch
async def _fetch(args: argparse.Namespace) -> int:
    import torch

    from streamer.fetch.report import ChunkReport
    from streamer.net.session import StreamSession

    servers = args.server
    kv: torch.Tensor | None = None
    text_chunks: dict[int, list[int]] = {}

    def on_chunk(report: ChunkReport) -> None:
        if args.json:
            return
        estimate = "-" if report.estimate_bps is None else f"{report.estimate_bps / 1e6:8.1f}"
        print(f"chunk {report.index:4d}  level {str(report.level):>4}  {report.bytes / 1e6:8.3f} MB  "
              f"{report.throughput_bps / 1e6:9.1f} Mbit/s  est {estimate} Mbit/s  "
              f"slack {report.time_left:7.3f} s" + (f"  ({report.reason})" if report.reason else ""),
              flush=True)

    loaded = await asyncio.to_thread(_load_model, args.model) if args.model else None
    given = args.recompute_ms_per_token
    config = session_config(args, slo=args.slo, policy=args.policy,
                            recompute_seconds_per_token=(DEFAULT_RECOMPUTE_MS_PER_TOKEN if given is None
                                                         else given) / 1e3,
                            max_buffered_bytes=args.max_buffered_mb << 20)
    async with StreamSession(*servers[0], args.context, config=config, servers=servers[1:],
                             on_chunk=on_chunk) as session:
        m = session.manifest
        assert m is not None
        if loaded is not None:
            # text chunks are recomputed with the model and weighed at what that costs here
            # (measured now, on one chunk's prefill: before fetch() starts its clock)
            from streamer.model.hf import CacheAssembler

            assembler = CacheAssembler(loaded, m, recompute_seconds_per_token=None if given is None else given / 1e3)
            await asyncio.to_thread(assembler.attach, session)
            if not args.json:
                print(f"recompute {assembler.recompute_seconds_per_token * 1e3:.2f} ms/token "
                      f"({'given' if given is not None else 'measured on the model here'})", flush=True)
        else:
            if args.out:
                kv = torch.zeros(m.layers, 2, m.tokens, m.heads, m.head_dim, dtype=getattr(torch, m.dtype))

            def on_layer(chunk: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
                if kv is not None:
                    info = m.chunks[chunk]
                    kv[layer, 0, info.start:info.end] = k
                    kv[layer, 1, info.start:info.end] = v

            def on_text(chunk: int, token_ids: list[int]) -> None:
                text_chunks[chunk] = token_ids

            session.set_callbacks(on_layer=on_layer, on_text=on_text)
        report = await session.fetch()
    if loaded is not None and args.out:
        kv = assembler.kv.to(getattr(torch, m.dtype))  # complete: text chunks were recomputed
    if kv is not None:
        _write_fetched(args.out, kv, m, text_chunks)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(f"fetched {report.bytes / 1e6:.2f} MB in {report.total_seconds:.3f} s "
              f"(SLO {report.slo:g} s {'met' if report.deadline_met else 'MISSED'}), "
              f"{report.text_chunks} text chunks, first layer after "
              f"{report.first_layer_seconds if report.first_layer_seconds is None else round(report.first_layer_seconds, 3)} s"
              + (f"; wrote {args.out}" if args.out else ""))
    return 0


def _load_model(name: str):
    """The model of ``kvwire fetch --model`` (a name, a model directory or a GGUF file)."""
    from streamer.model import hf

    return hf.load_model(name)[0]


def _write_fetched(path: str, kv, manifest, text_chunks: dict[int, list[int]]) -> None:
    """safetensors: "kv" (text chunks left as zeros), "text_ranges" [n, 2] token ranges of
    the chunks that came as text, "text_token_ids" their token ids concatenated."""
    import torch
    from safetensors.torch import save_file

    ranges = [[manifest.chunks[c].start, manifest.chunks[c].end] for c in sorted(text_chunks)]
    ids = [t for c in sorted(text_chunks) for t in text_chunks[c]]
    save_file({"kv": kv.contiguous(), "text_ranges": torch.tensor(ranges, dtype=torch.int64).reshape(-1, 2),
               "text_token_ids": torch.tensor(ids, dtype=torch.int64)}, path)


def _runner(fn: Callable[[argparse.Namespace], Awaitable[int]]) -> Callable[[argparse.Namespace], int]:
    def handler(args: argparse.Namespace) -> int:
        try:
            return run_async(lambda: fn(args))
        except KeyboardInterrupt:
            return 130
        except Exception as exc:  # the CLI reports errors, the library raises them
            from streamer.net.client import StreamError
            from streamer.store import StoreError

            if isinstance(exc, (StreamError, StoreError, ValueError, OSError)):
                print(f"kvwire: error: {exc}", file=sys.stderr)
                return 1
            raise
    return handler


def register(subparsers: argparse._SubParsersAction, bench_subparsers: argparse._SubParsersAction) -> None:
    # allow_abbrev=False: "--auth-token SECRET" must be an error, not --auth-token-file
    serve = subparsers.add_parser("serve", help="run a sender daemon over a chunk store", allow_abbrev=False,
                                  description="Serve pre-encoded KV chunks from a store (file path, "
                                              "file:///path or redis://host:port/db) over TCP.")
    serve.add_argument("--store", required=True, help="store URL")
    serve.add_argument("--listen", type=parse_address, default=("127.0.0.1", DEFAULT_PORT),
                       help=f"HOST:PORT to listen on (default 127.0.0.1:{DEFAULT_PORT})")
    serve.add_argument("--idle-timeout", type=float, default=60.0, help="close idle connections after S seconds")
    serve.add_argument("--write-timeout", type=float, default=30.0,
                       help="drop a receiver that accepts no data for S seconds")
    serve.add_argument("--grace", type=float, default=5.0, help="seconds to finish sends on SIGTERM")
    serve.add_argument("--read-timeout", type=float, default=10.0,
                       help="drop a client that has not finished the handshake, or a frame it "
                            "started, within S seconds (slowloris; also the TLS handshake limit)")
    serve.add_argument("--max-sessions", type=int, default=1024,
                       help="connections served at once; more are refused with 'unavailable'")
    serve.add_argument("--max-pending-requests", type=int, default=256,
                       help="requests queued per connection before the sender stops reading it")
    serve.add_argument("--max-frame", type=int, default=16 << 20,
                       help="largest frame payload in bytes (default 16 MiB)")
    _add_auth_option(serve, "receivers must present")
    serve.add_argument("--insecure-no-auth", action="store_true",
                       help="allow listening on a non-loopback address without an auth token")
    serve.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate (chain)")
    serve.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    serve.add_argument("--tls-client-ca", metavar="PEM",
                       help="require client certificates signed by this CA (mutual TLS)")
    serve.add_argument("--metrics-port", type=int, metavar="PORT",
                       help="serve Prometheus metrics on http://METRICS_HOST:PORT/metrics (0: any free port)")
    serve.add_argument("--metrics-host", default="127.0.0.1",
                       help="address of the metrics endpoint (default 127.0.0.1)")
    serve.add_argument("--log-json", action="store_true",
                       help="log one JSON object per line (each connection's lines carry its session id)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                       help="log level (default info)")
    serve.set_defaults(handler=_runner(_serve))

    fetch = subparsers.add_parser("fetch", help="fetch one context under a deadline", allow_abbrev=False,
                                  description="Fetch a context with StreamSession, printing each chunk's "
                                              "level, throughput and slack.")
    fetch.add_argument("--server", type=parse_address, action="append", required=True,
                       help="HOST:PORT of a sender; repeat for fallbacks")
    fetch.add_argument("--context", required=True, help="context id")
    fetch.add_argument("--slo", type=float, default=1.0, help="deadline in seconds (default 1)")
    fetch.add_argument("--policy", default="mpc", help="mpc (default), greedy, fixed:N or text")
    fetch.add_argument("--model", metavar="MODEL",
                       help="recompute chunks that arrive as text with this model ('minilm', 'smollm2', a "
                            "local model directory or a .gguf file): --out then holds the complete KV, and "
                            "the policy weighs text at the model's recompute rate, measured here before the fetch")
    fetch.add_argument("--recompute-ms-per-token", type=float, default=None,
                       help="recompute cost of the text fallback, ms per token (default: measured with "
                            f"--model, else {DEFAULT_RECOMPUTE_MS_PER_TOKEN})")
    fetch.add_argument("--out", help="write the KV to this safetensors file")
    fetch.add_argument("--json", action="store_true", help="print the fetch report as JSON")
    _add_auth_option(fetch, "to authenticate with")
    fetch.add_argument("--tls", action="store_true", help="connect with TLS, trusting the system CAs")
    fetch.add_argument("--tls-ca", metavar="PEM", help="connect with TLS, trusting this CA / certificate")
    fetch.add_argument("--tls-server-name", metavar="NAME",
                       help="host name to verify the certificate against (default: the --server host)")
    fetch.add_argument("--max-buffered-mb", type=int, default=64,
                       help="stop reading while this many MiB of received sections await decoding")
    fetch.set_defaults(handler=_runner(_fetch))
