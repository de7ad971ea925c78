"""Shared-secret authentication for kvwire: tokens, nonces and the handshake MACs.

The handshake (driven by :mod:`streamer.wire.protocol`)::

    client                                   server (has a token)
    HELLO                         ->
                                  <-         WELCOME{auth: "required", nonce: Ns}
    AUTH{nonce: Nc, mac: Mc}      ->         checks Mc (constant time)
                                  <-         AUTH_OK{mac: Ms}   or fatal ERROR{code: "auth"}
    checks Ms (constant time)

    Mc = HMAC-SHA256(token, "kvwire-auth-v1 client\\0" || Ns || Nc || version || max_frame)
    Ms = HMAC-SHA256(token, "kvwire-auth-v1 server\\0" || Ns || Nc || version || max_frame)

``Ns`` and ``Nc`` are 32 fresh random bytes each (hex on the wire); version (u16) and
max_frame (u32) are little-endian, binding the negotiated parameters. Distinct labels
keep a client MAC from being replayed as a server MAC. The token never crosses the wire;
a passive observer sees only nonces and MACs, so tokens must be high-entropy (at least
:data:`MIN_TOKEN_BYTES` bytes; ``python -c "import secrets; print(secrets.token_urlsafe(32))"``).

Without TLS, authentication proves who is at the other end at connect time but the
stream itself is neither confidential nor integrity-protected: use TLS on any network
you do not trust.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import struct
import warnings
from typing import Mapping, Optional, Union

__all__ = ["MIN_TOKEN_BYTES", "NONCE_BYTES", "TOKEN_ENV", "Token", "normalize_token",
           "new_nonce", "client_mac", "server_mac", "verify", "load_token"]

#: Shortest accepted token: it is a key an eavesdropper can attack offline.
MIN_TOKEN_BYTES = 16
NONCE_BYTES = 32
#: The environment variable ``kvwire serve`` / ``kvwire fetch`` read the token from.
TOKEN_ENV = "KVWIRE_AUTH_TOKEN"

Token = Union[str, bytes, bytearray]

_CLIENT_LABEL = b"kvwire-auth-v1 client\0"
_SERVER_LABEL = b"kvwire-auth-v1 server\0"


def normalize_token(token: Optional[Token]) -> Optional[bytes]:
    """``token`` as bytes (a str is UTF-8 encoded), or None; ValueError when too short."""
    if token is None:
        return None
    if isinstance(token, str):
        token = token.encode("utf-8")
    if not isinstance(token, (bytes, bytearray)):
        raise TypeError(f"auth token must be str or bytes, got {type(token).__name__}")
    token = bytes(token)
    if len(token) < MIN_TOKEN_BYTES:
        raise ValueError(f"auth token is {len(token)} bytes; at least {MIN_TOKEN_BYTES} "
                         f"are required (e.g. secrets.token_urlsafe(32))")
    return token


def new_nonce() -> str:
    """A fresh challenge: 32 random bytes as 64 lowercase hex characters."""
    return secrets.token_hex(NONCE_BYTES)


def _mac(label: bytes, token: bytes, server_nonce: str, client_nonce: str, version: int,
         max_frame: int) -> str:
    msg = (label + bytes.fromhex(server_nonce) + bytes.fromhex(client_nonce)
           + struct.pack("<HI", version, max_frame))
    return hmac.new(token, msg, hashlib.sha256).hexdigest()


def client_mac(token: bytes, server_nonce: str, client_nonce: str, version: int,
               max_frame: int) -> str:
    """The MAC a client sends in AUTH."""
    return _mac(_CLIENT_LABEL, token, server_nonce, client_nonce, version, max_frame)


def server_mac(token: bytes, server_nonce: str, client_nonce: str, version: int,
               max_frame: int) -> str:
    """The MAC a server sends in AUTH_OK."""
    return _mac(_SERVER_LABEL, token, server_nonce, client_nonce, version, max_frame)


def verify(expected: str, got: str) -> bool:
    """Constant-time comparison of two hex MACs."""
    return hmac.compare_digest(expected.encode("ascii"), got.encode("ascii"))


def load_token(path: Optional[str] = None, env: Optional[Mapping[str, str]] = None,
               ) -> Optional[bytes]:
    """The auth token from ``path`` (surrounding whitespace stripped) or, without a path,
    from ``$KVWIRE_AUTH_TOKEN``; None when neither is set. Warns when the file is
    readable by group or others. Never take a token from a command-line argument:
    those are visible to every user in ``ps``."""
    if path is not None:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            data = f.read()
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            warnings.warn(f"auth token file {path} is accessible by group/others "
                          f"(mode {stat.S_IMODE(mode):o}); chmod 600 it", stacklevel=2)
        token = data.strip()
        if not token:
            raise ValueError(f"auth token file {path} is empty")
        return normalize_token(token)
    value = (os.environ if env is None else env).get(TOKEN_ENV)
    if value is None or not value.strip():
        return None
    return normalize_token(value.strip())
