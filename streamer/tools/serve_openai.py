"""``kvwire serve-openai``: an OpenAI-compatible completions server (``streamer.llmserver``)
whose prompts' stored prefixes are fetched as KV from sender daemons (uvloop;
SIGTERM/SIGINT shut it down)."""
from __future__ import annotations

import argparse
import os
import sys

from streamer.net.budget import DEFAULT_BUDGET_BYTES
from streamer.tools.receive import api_token, parse_bytes, parse_servers
from streamer.tools.serve_fetch import _add_auth_option, _runner, parse_address

#: the shipped model and the codec profile its KV is encoded with
SHIPPED_MODEL = "smollm2"
SHIPPED_NAME = "smollm2-135m-instruct"


def _api_token(args: argparse.Namespace) -> bytes | None:
    """--api-token-file, else ``$KVWIRE_OPENAI_TOKEN`` (never an argument: ``ps`` shows those)."""
    from streamer.llmserver.protocol import API_TOKEN_ENV

    return api_token(args, API_TOKEN_ENV)


async def _serve(args: argparse.Namespace) -> int:
    import asyncio
    import contextlib
    import logging
    import signal

    import codec

    from streamer.llmserver import EngineConfig, ServeConfig, start_server
    from streamer.llmserver.app import check_exposure
    from streamer.model import hf
    from streamer.net.sender import InsecureConfiguration
    from streamer.tools.demo_llm import PROFILE
    from streamer.tools.serve_fetch import session_config

    logging.basicConfig(level=logging.INFO, format="kvwire serve-openai: %(message)s")
    serve = ServeConfig(api_token=_api_token(args), allow_insecure=args.insecure_no_auth,
                        max_requests=args.max_requests, receive_budget=args.receive_budget)
    try:
        check_exposure(args.listen[0], serve)   # before the model loads
    except InsecureConfiguration as exc:
        print(f"kvwire serve-openai: {exc}", file=sys.stderr)
        return 2
    shipped = args.model.lower() in (SHIPPED_MODEL, SHIPPED_NAME)
    profile_path = args.profile or (PROFILE if shipped else None)
    if profile_path is None:
        print("kvwire serve-openai: --profile is needed for a model other than the shipped SmolLM2 "
              "(the profile its stored KV is encoded with)", file=sys.stderr)
        return 2
    print(f"kvwire serve-openai: loading model {args.model}", flush=True)
    try:
        model, tokenizer = await asyncio.to_thread(hf.load_model, args.model)
    except (FileNotFoundError, hf.ModelLoadError, RuntimeError) as exc:
        print(f"kvwire serve-openai: cannot load model {args.model}: {exc}", file=sys.stderr)
        return 2
    profile = codec.Profile.load(profile_path)
    name = args.served_model_name or (SHIPPED_NAME if shipped else os.path.basename(args.model.rstrip("/")))
    config = EngineConfig(served_name=name, chunk_tokens=args.chunk_tokens, slo=args.slo,
                          max_tokens=args.max_tokens, model_id=args.model_id,
                          write_back=not args.no_write_back, store_budget_bytes=args.store_budget,
                          exact_level=not args.no_exact_level)
    session = session_config(args, slo=args.slo, policy=args.policy)
    store = None
    if args.store:
        from streamer.store import open_store

        store = await open_store(args.store)
    server = await start_server(model, tokenizer, profile, config, session, senders=args.servers or (),
                                store=store, serve=serve, host=args.listen[0], port=args.listen[1])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    senders = ",".join(f"{h}:{p}" for h, p in args.servers or ()) or "none (every prompt prefilled whole)"
    print(f"kvwire serve-openai: {server.url}/v1 serving {name!r} (prefixes from {senders}; "
          f"chunks of {config.chunk_tokens} tokens, SLO {config.slo:g} s, policy {session.policy}; "
          f"write-back {'to ' + args.store if store is not None and config.write_back else 'off'}; "
          f"{'API token required' if serve.api_token is not None else 'no API token'})", flush=True)
    await stop.wait()
    print("kvwire serve-openai: shutting down", flush=True)
    await server.close()
    if store is not None:
        await store.close()
    return 0


def register(subparsers: argparse._SubParsersAction, bench_subparsers: argparse._SubParsersAction) -> None:
    from streamer.llmserver.protocol import API_TOKEN_ENV, DEFAULT_PORT

    # allow_abbrev=False: "--auth-token SECRET" must be an error, not --auth-token-file
    parser = subparsers.add_parser(
        "serve-openai", allow_abbrev=False,
        help="run an OpenAI-compatible completions server that fetches stored prompt prefixes as KV",
        description="Serve POST /v1/completions (streamed or not, greedy), GET /v1/models and GET /healthz "
                    "for a causal LM (default: the shipped SmolLM2-135M-Instruct). Each prompt's longest "
                    "stored prefix (content-addressed by its tokens) is fetched from the senders under the "
                    "request's deadline, the rest prefilled; requests for one prefix share one fetch.")
    parser.add_argument("--listen", type=parse_address, default=("127.0.0.1", DEFAULT_PORT),
                        help=f"HOST:PORT of the API (default 127.0.0.1:{DEFAULT_PORT}); off loopback it needs "
                             "an API token")
    parser.add_argument("--model", default=SHIPPED_MODEL,
                        help="local model directory or GGUF file, or 'smollm2' (the default: the shipped "
                             "SmolLM2-135M-Instruct)")
    parser.add_argument("--profile", metavar="FILE",
                        help="codec profile the stored KV is encoded with (default for SmolLM2: the shipped one)")
    parser.add_argument("--served-model-name", help="the name clients ask for (default: smollm2-135m-instruct "
                                                    "for the shipped model, else the path's last part)")
    parser.add_argument("--model-id", help="identity of the weights in the prefix hashes (default: the served "
                                           "name); every node sharing a store must agree on it")
    parser.add_argument("--servers", type=parse_servers,
                        help="sender daemons holding stored prefixes, HOST:PORT[,HOST:PORT...]; without them "
                             "every prompt is prefilled whole")
    parser.add_argument("--store", metavar="URL",
                        help="store to write the exact KV of fully prefilled prompts back to (the senders' "
                             "store, so other nodes find it)")
    parser.add_argument("--no-write-back", action="store_true", help="never write KV back to --store")
    parser.add_argument("--no-exact-level", action="store_true",
                        help="write KV back at the profile's lossy levels only, not also exactly (a "
                             "fetched prefix's answers may then part from a full prefill's)")
    parser.add_argument("--store-budget", type=parse_bytes,
                        help="bytes of content-addressed contexts the store keeps (least recently used "
                             "evicted beyond it; default: no limit)")
    parser.add_argument("--chunk-tokens", type=int, default=256,
                        help="tokens per stored chunk (default 256); part of every prefix hash, so it must "
                             "equal the stored prefixes'")
    parser.add_argument("--slo", type=float, default=1.0,
                        help="default deadline of a request's prefix lookup and fetch, s (default 1; a request "
                             "may set its own: \"kvwire\": {\"slo\": S})")
    parser.add_argument("--policy", default="mpc", help="fetch policy: mpc (default), greedy, fixed:N or text")
    parser.add_argument("--max-tokens", type=int, default=1024, help="largest max_tokens a request may ask for")
    parser.add_argument("--max-requests", type=int, default=64,
                        help="requests answered at once (default 64); one more is answered 429")
    parser.add_argument("--receive-budget", type=parse_bytes, default=DEFAULT_BUDGET_BYTES,
                        help="bytes received and not yet delivered that all prefix fetches together may hold "
                             "(default 512M)")
    parser.add_argument("--api-token-file", metavar="FILE",
                        help=f"file holding the token every request but GET /healthz must carry (the openai "
                             f"client's api_key; default: ${API_TOKEN_ENV}); without one the API is open, "
                             "which only loopback allows")
    parser.add_argument("--insecure-no-auth", action="store_true",
                        help="allow the API on a non-loopback address without a token")
    _add_auth_option(parser, "shared with the senders")
    parser.add_argument("--tls", action="store_true", help="connect to the senders with TLS (system CAs)")
    parser.add_argument("--tls-ca", metavar="PEM", help="connect with TLS, trusting this CA / certificate")
    parser.add_argument("--tls-server-name", help="host name to verify in the senders' certificates")
    parser.set_defaults(handler=_runner(_serve))
