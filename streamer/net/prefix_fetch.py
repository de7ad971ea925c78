"""Fetch the longest stored prefix of a prompt: a LOOKUP, then a session cut to the match.

A content-addressed prefix (``streamer.store.prefix``) is found by the hash chain of the
prompt's token chunks, not by a name. :func:`open_prefix_session` computes the chain,
asks the sender which stored context holds its longest prefix (one LOOKUP round trip,
protocol version 3), and on a match opens a :class:`StreamSession` on the same connection
limited to the matched chunks (``StreamSession(chunks=k)``): the caller fetches it like
any other session, with the same callbacks, and recomputes only the tokens after it.

A lookup carries at most ``MAX_LOOKUP_CHAIN`` hashes; a longer prompt looks up its first
``MAX_LOOKUP_CHAIN`` chunks (a prefix longer than that is matched that far). Every
failure is a ``StreamError`` (``ConnectionLost`` for a sender that is down,
``LookupUnsupported`` for one older than version 3, ``ServerError`` "not_found" for a
match whose context vanished before it opened), so a caller that serves the prompt
anyway catches that one type and prefills in full.
"""
from __future__ import annotations

from typing import Any, Sequence

from streamer.net.client import ClientConnection, StreamError
from streamer.net.config import SessionConfig
from streamer.net.session import StreamSession, connect
from streamer.store.prefix import MAX_LOOKUP_CHAIN, PrefixIdentity, PrefixMatch, prefix_chain
from streamer.wire.manifest import Manifest


class PrefixMismatch(StreamError):
    """The context a sender matched is not the prefix the chain describes (its tokens or
    its codec profile differ): the store's index is inconsistent; nothing was fetched."""


async def lookup(client: ClientConnection, chain: Sequence[str], timeout: float) -> PrefixMatch | None:
    """The longest stored prefix of ``chain`` (its first ``MAX_LOOKUP_CHAIN`` hashes) on an
    idle handshaken connection; None when not even the first chunk is stored (or the
    chain is empty: nothing is sent)."""
    hashes = list(chain)[:MAX_LOOKUP_CHAIN]
    if not hashes:
        return None
    answer = await client.lookup(hashes, timeout)
    if answer.context_id is None:
        return None
    return PrefixMatch(context_id=answer.context_id, chunks=answer.chunks)


async def lookup_prefix(host: str, port: int, chain: Sequence[str], *,
                        config: SessionConfig | None = None) -> PrefixMatch | None:
    """Connect to ``host:port`` as ``config`` says (auth, TLS), look ``chain`` up, close."""
    config = config or SessionConfig()
    client = await connect(config, host, port)
    try:
        return await lookup(client, chain, config.connect_timeout)
    finally:
        await client.close()


async def open_prefix_session(host: str, port: int, identity: PrefixIdentity, token_ids: Sequence[int], *,
                              config: SessionConfig | None = None,
                              **session_options: Any) -> tuple[StreamSession | None, PrefixMatch | None]:
    """Look up the longest stored prefix of ``token_ids`` (chunked and hashed as
    ``identity`` says) and open a session fetching exactly its chunks, on the lookup's
    connection: ``(session, match)``, or ``(None, None)`` when no prefix is stored.

    The session is open (manifest and profile in; ``session.manifest`` covers the match's
    ``match.chunks`` chunks, ``session.manifest.tokens`` tokens of the prompt): call
    ``fetch()`` in ``async with session:``, which closes it. ``session_options`` are
    StreamSession's keywords (``on_layer``, ``on_text``, ``slo``, ``servers`` ...).
    PrefixMismatch when the matched context is not that prefix of these tokens."""
    config = config or SessionConfig()
    chain = prefix_chain(identity, token_ids)
    client = await connect(config, host, port)
    try:
        match = await lookup(client, chain, config.connect_timeout)
    except BaseException:
        client.abort()
        raise
    if match is None:
        await client.close()
        return None, None
    session = StreamSession(host, port, match.context_id, config=config, connection=client, chunks=match.chunks,
                            **session_options)
    await session.__aenter__()   # on failure the session has dropped the connection
    manifest = session.manifest
    assert manifest is not None
    try:
        check_match(manifest, match, identity, len(token_ids))
    except PrefixMismatch:
        await session.close()
        raise
    return session, match


def check_match(manifest: Manifest, match: PrefixMatch, identity: PrefixIdentity, prompt_tokens: int) -> None:
    """PrefixMismatch unless ``manifest`` (of the opened, cut session) holds the matched
    chunks of a ``prompt_tokens``-token prompt at the identity's profile."""
    tokens = min(match.chunks * identity.chunk_tokens, prompt_tokens)
    if manifest.tokens != tokens or manifest.profile_id != identity.profile_id:
        raise PrefixMismatch(f"matched {match.chunks} chunks in context {match.context_id!r}, which holds "
                             f"{manifest.tokens} tokens at profile {manifest.profile_id}, not the {tokens} "
                             f"tokens at profile {identity.profile_id} of the prompt's prefix")


__all__ = ["PrefixMismatch", "check_match", "lookup", "lookup_prefix", "open_prefix_session"]
