"""TLS contexts for the sender daemon and the receiver (standard :mod:`ssl` module).

TLS 1.2 at least; certificate and host name verification on the receiver always on
(a private CA or a self-signed certificate is given with ``ca_file``). The daemon may
also require client certificates (``client_ca_file``): mutual TLS then counts as
authentication for the "no auth off loopback" rule.
"""
from __future__ import annotations

import ssl
from typing import Optional

__all__ = ["server_context", "client_context"]


def server_context(cert_file: str, key_file: Optional[str] = None, *,
                   client_ca_file: Optional[str] = None) -> ssl.SSLContext:
    """A server-side context presenting ``cert_file`` (PEM chain) with ``key_file``
    (PEM; None when the key is inside ``cert_file``). With ``client_ca_file``, clients
    must present a certificate signed by that CA."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert_file, key_file)
    if client_ca_file is not None:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cafile=client_ca_file)
    return ctx


def client_context(ca_file: Optional[str] = None, *, cert_file: Optional[str] = None,
                   key_file: Optional[str] = None) -> ssl.SSLContext:
    """A verifying client context: trusts ``ca_file`` (PEM) or, without it, the system's
    CAs; ``cert_file``/``key_file``: a client certificate for mutual TLS."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert_file is not None:
        ctx.load_cert_chain(cert_file, key_file)
    return ctx
