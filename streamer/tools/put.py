"""``kvwire put --store URL (--context ID | --by-tokens --model M --tokenizer T) --kv FILE.safetensors --tokens FILE``.

``--context`` names the context; ``--by-tokens`` stores it content-addressed instead
(``store.prefix``: found by any prompt starting with its tokens, evicted least recently
used while the content-addressed contexts exceed ``--prefix-budget`` bytes). The KV tensor ``[layers, 2, tokens, heads, head_dim]`` is read from the safetensors
file's ``"kv"`` entry; the token file holds whitespace/comma-separated ints, or a JSON
list if it ends in ``.json``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from streamer.store import PrefixIdentity, StoreError, open_store
from streamer.store.put import DEFAULT_CHUNK_TOKENS, put_context, put_prefix
from streamer.wire.manifest import Manifest

KV_KEY = "kv"

if TYPE_CHECKING:  # imported on use: registering `kvwire put` must not load torch (~1.5 s)
    import torch


def load_kv(path: str | Path) -> torch.Tensor:
    """The ``"kv"`` tensor of a safetensors file; ValueError naming the keys otherwise."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except SafetensorError as exc:
        raise ValueError(f"{path}: not a safetensors file: {exc}") from None
    if KV_KEY not in tensors:
        raise ValueError(f"{path}: no {KV_KEY!r} tensor; it holds {sorted(tensors)}")
    return tensors[KV_KEY]


def load_token_ids(path: str | Path) -> list[int]:
    """Token ids from a JSON list (``.json``) or whitespace/comma-separated ints."""
    text = Path(path).read_text()
    if str(path).endswith(".json"):
        try:
            ids = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{path}: not JSON: {exc}") from None
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"{path}: expected a JSON list of ints")
        return ids
    try:
        return [int(field) for field in text.replace(",", " ").split()]
    except ValueError as exc:
        raise ValueError(f"{path}: expected whitespace/comma-separated ints: {exc}") from None


def _summary(manifest: Manifest, store_url: str) -> str:
    fp16 = manifest.layers * 2 * manifest.tokens * manifest.heads * manifest.head_dim * 2
    lines = [f"put {manifest.context_id} (version {manifest.version}) into {store_url}: "
             f"{manifest.tokens} tokens in {len(manifest.chunks)} chunks, profile {manifest.profile_id}"]
    for level in range(manifest.levels):
        total = sum(chunk.sizes[level] for chunk in manifest.chunks)
        if total:
            what = "exact" if manifest.is_exact(level) else f"distortion {manifest.level_distortion[level]:.1e}"
            lines.append(f"  level {level} ({what}): {total} bytes, {fp16 / total:.1f}x smaller than fp16")
    lines.append(f"  text fallback: {sum(c.text_bytes for c in manifest.chunks)} bytes")
    return "\n".join(lines)


def _cmd_put(args: argparse.Namespace) -> int:
    import codec
    from codec.container import FORMAT_VERSION

    async def run() -> str:
        async with await open_store(args.store) as store:  # a bad URL fails before the big load
            kv = load_kv(args.kv)
            ids = load_token_ids(args.tokens)
            profile = codec.Profile.load(args.profile) if args.profile else None
            if not args.by_tokens:
                manifest = await put_context(store, args.context, kv, ids, profile=profile,
                                             chunk_tokens=args.chunk_tokens, exact=args.exact)
                return _summary(manifest, store.url)
            if profile is None:
                profile = await asyncio.to_thread(codec.calibrate, [kv])
            identity = PrefixIdentity(model=args.model, tokenizer=args.tokenizer, profile_id=profile.id,
                                      chunk_tokens=args.chunk_tokens,
                                      format_version=FORMAT_VERSION)
            match = await put_prefix(store, identity, kv, ids, profile, budget_bytes=args.prefix_budget,
                                     exact=args.exact)
            usage = await store.prefix_usage()
            return (f"{_summary(await store.get_manifest(match.context_id), store.url)}\n"
                    f"  content-addressed: {match.chunks} chunks; the store's content-addressed contexts: "
                    f"{usage.contexts}, {usage.bytes} bytes")

    if args.by_tokens and not (args.model and args.tokenizer):
        print("kvwire put: error: --by-tokens needs --model and --tokenizer (they are part of every hash)",
              file=sys.stderr)
        return 1
    if not args.by_tokens and (args.model or args.tokenizer or args.prefix_budget is not None):
        print("kvwire put: error: --model, --tokenizer and --prefix-budget go with --by-tokens", file=sys.stderr)
        return 1

    try:
        print(asyncio.run(run()))
    except (ValueError, OSError, StoreError, codec.CodecError) as exc:
        print(f"kvwire put: error: {exc}", file=sys.stderr)
        return 1
    return 0


def register(subparsers: argparse._SubParsersAction, bench_subparsers: argparse._SubParsersAction) -> None:
    """Add ``kvwire put`` (no benchmarks)."""
    p = subparsers.add_parser(
        "put", help="encode a KV cache at every quality level and store it as a context",
        description="Split the KV into chunks, encode each at every level of the profile, store the "
                    "blobs, the token ids (text fallback) and the profile, then commit the manifest.")
    p.add_argument("--store", required=True, metavar="URL",
                   help="file:///abs/path, a plain path, or redis://host:port/db")
    name = p.add_mutually_exclusive_group(required=True)
    name.add_argument("--context", metavar="ID", help="context id: [A-Za-z0-9._-], 1-200 chars")
    name.add_argument("--by-tokens", action="store_true",
                      help="store it content-addressed, under the hash chain of its token chunks")
    p.add_argument("--model", metavar="ID", help="with --by-tokens: the model's identity (name or weights hash)")
    p.add_argument("--tokenizer", metavar="ID", help="with --by-tokens: the tokenizer's identity")
    p.add_argument("--prefix-budget", type=int, metavar="BYTES",
                   help="with --by-tokens: evict least-recently-used content-addressed contexts while "
                        "they hold more than this (default: no eviction)")
    p.add_argument("--kv", required=True, metavar="FILE.safetensors",
                   help=f"safetensors file with the KV [layers, 2, tokens, heads, head_dim] under {KV_KEY!r}")
    p.add_argument("--tokens", required=True, metavar="FILE",
                   help="token ids: whitespace/comma-separated ints, or a JSON list (.json)")
    p.add_argument("--profile", metavar="FILE",
                   help="codec profile (default: calibrate one on this KV)")
    p.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS, metavar="N",
                   help=f"tokens per chunk (default {DEFAULT_CHUNK_TOKENS})")
    p.add_argument("--exact", action="store_true",
                   help="also store the KV exactly, as level 0 (the profile's levels become 1..): a "
                        "receiver whose deadline allows it gets the KV the tokens give, bit for bit")
    p.set_defaults(handler=_cmd_put)
