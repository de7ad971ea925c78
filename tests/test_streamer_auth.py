"""Authentication (HMAC challenge-response in the handshake), TLS, the "no auth off
loopback" rule, context id validation and token loading.

Sans-I/O first (the state machine alone), then a real sender and StreamSession over
loopback, with a certificate generated at test time for TLS."""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import ssl
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import streamer
from streamer.wire import auth
from streamer.net import tls
from streamer.wire import protocol as p
from streamer.wire.frames import encode
from streamer.net.sender import ServerConfig, is_loopback

from test_streamer_limits import CHUNKS, Raw, _fatal, limits_profile, store_root  # noqa: F401  (fixtures)

TOKEN = "correct horse battery staple 42"
OTHER = "wrong horse battery staple 4242"


# ----------------------------------------------------------------------------- sans-I/O
def _pair(client_token=TOKEN, server_token=TOKEN):
    c = p.Connection(p.Role.CLIENT, auth_token=client_token)
    s = p.Connection(p.Role.SERVER, auth_token=server_token)
    s.receive_data(c.send(p.Hello((1,), "c")))
    required = s.auth_required
    welcome = s.send(p.Welcome(1, "s", 1 << 20, auth=p.AUTH_REQUIRED if required else p.AUTH_NONE,
                               nonce=auth.new_nonce() if required else ""))
    return c, s, welcome


def test_handshake_authenticates_both_sides():
    c, s, welcome = _pair()
    assert s.state is p.State.AWAIT_AUTH
    assert c.receive_data(welcome)[0].auth == "required" and c.state is p.State.SEND_AUTH
    assert s.receive_data(c.send(c.auth_event())) and s.state is p.State.SEND_AUTH_OK
    assert c.receive_data(s.send(s.auth_ok_event())) and c.state is p.State.READY
    assert s.state is p.State.READY and c.authenticated and s.authenticated
    s.receive_data(c.send(p.Open("ctx", None)))     # and now requests flow


def test_handshake_byte_at_a_time():
    c, s, welcome = _pair()
    got = [e for i in range(len(welcome)) for e in c.receive_data(welcome[i:i + 1])]
    assert [type(e) for e in got] == [p.Welcome] and c.state is p.State.SEND_AUTH
    data = c.send(c.auth_event())
    got = [e for i in range(len(data)) for e in s.receive_data(data[i:i + 1])]
    assert [type(e) for e in got] == [p.Auth] and s.state is p.State.SEND_AUTH_OK
    data = s.send(s.auth_ok_event())
    got = [e for i in range(len(data)) for e in c.receive_data(data[i:i + 1])]
    assert [type(e) for e in got] == [p.AuthOk] and c.state is p.State.READY


def test_wrong_token_is_refused_with_code_auth():
    c, s, welcome = _pair(client_token=OTHER)
    c.receive_data(welcome)
    with pytest.raises(p.AuthenticationError, match="authentication failed") as info:
        s.receive_data(c.send(c.auth_event()))
    assert info.value.code == "auth" and isinstance(info.value, p.RemoteProtocolError)
    reply = c.receive_data(s.error_frame())
    assert reply == [p.Error("auth", "authentication failed: wrong token", fatal=True)]
    assert c.state is p.State.CLOSED


@pytest.mark.parametrize("frame", [p.Open("ctx", None), p.GetProfile("0123456789abcdef"),
                                   p.Cancel(1), p.Request(0, 0)])
def test_requests_before_auth_are_refused(frame):
    c, s, welcome = _pair()
    _, pieces, _ = encode(frame)
    with pytest.raises(p.AuthenticationError, match="authentication required") as info:
        s.receive_data(b"".join(pieces))
    assert info.value.code == "auth" and s.outstanding == ()


def test_client_without_token_refuses_a_server_that_requires_one():
    c, s, welcome = _pair(client_token=None)
    with pytest.raises(p.AuthenticationError, match="no auth token"):
        c.receive_data(welcome)


def test_client_with_token_refuses_a_server_without_auth():
    c, s, welcome = _pair(server_token=None)
    with pytest.raises(p.AuthenticationError, match="mutual"):
        c.receive_data(welcome)


def test_forged_server_proof_is_refused():
    c, s, welcome = _pair()
    c.receive_data(welcome)
    s.receive_data(c.send(c.auth_event()))
    forged = encode(p.AuthOk(mac="0" * 64))[1][0]
    with pytest.raises(p.AuthenticationError, match="could not prove"):
        c.receive_data(forged)


def test_replayed_client_mac_does_not_work_on_a_new_nonce():
    c, s, welcome = _pair()
    c.receive_data(welcome)
    old = c.send(c.auth_event())
    c2, s2, welcome2 = _pair()
    with pytest.raises(p.AuthenticationError):
        s2.receive_data(old)


def test_local_misuse_of_auth():
    s = p.Connection(p.Role.SERVER, auth_token=TOKEN)
    s.receive_data(p.Connection(p.Role.CLIENT).send(p.Hello((1,), "c")))
    with pytest.raises(p.LocalProtocolError, match="auth must be"):
        s.send(p.Welcome(1, "s", 1 << 20))
    with pytest.raises(p.LocalProtocolError, match="nonce"):
        s.send(p.Welcome(1, "s", 1 << 20, auth="required", nonce=""))
    with pytest.raises(p.LocalProtocolError):
        s.auth_ok_event()
    c, s, welcome = _pair()
    c.receive_data(welcome)
    with pytest.raises(p.LocalProtocolError, match="auth_event"):
        c.send(p.Auth(nonce="1" * 64, mac="2" * 64))
    with pytest.raises(p.LocalProtocolError):
        c.send(p.Open("x", None))


def test_transitions_are_in_the_table():
    T = p.TRANSITIONS
    assert T[(p.Role.SERVER, p.State.SEND_WELCOME, p.Direction.SEND, p.Kind.AUTH_WELCOME)] \
        is p.State.AWAIT_AUTH
    assert T[(p.Role.SERVER, p.State.AWAIT_AUTH, p.Direction.RECV, p.FrameType.AUTH)] \
        is p.State.SEND_AUTH_OK
    assert (p.Role.SERVER, p.State.AWAIT_AUTH, p.Direction.RECV, p.FrameType.OPEN) not in T
    assert T[(p.Role.CLIENT, p.State.AWAIT_AUTH_OK, p.Direction.RECV, p.FrameType.AUTH_OK)] \
        is p.State.READY


def test_short_tokens_are_rejected():
    with pytest.raises(ValueError, match="at least 16"):
        p.Connection(p.Role.SERVER, auth_token="hunter2")


# ----------------------------------------------------------------------------- token sources
def test_token_from_file_and_env(tmp_path: Path):
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    f.chmod(0o600)
    assert auth.load_token(str(f), env={}) == TOKEN.encode()
    assert auth.load_token(None, env={auth.TOKEN_ENV: TOKEN}) == TOKEN.encode()
    assert auth.load_token(None, env={}) is None
    f.chmod(0o644)
    with pytest.warns(UserWarning, match="chmod 600"):
        auth.load_token(str(f), env={})
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "empty").chmod(0o600)
    with pytest.raises(ValueError, match="empty"):
        auth.load_token(str(tmp_path / "empty"))


def test_cli_takes_no_token_argument():
    from streamer.tools.cli import build_parser

    for command in (["serve", "--store", "x"], ["fetch", "--server", "h:1", "--context", "c"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(command + ["--auth-token", TOKEN])


# ----------------------------------------------------------------------------- exposure rule
def test_loopback_detection():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback(None)
    assert not is_loopback("example.com") and not is_loopback("10.1.2.3")


async def test_non_loopback_without_auth_refuses_to_start(store_root):
    store = await streamer.open_store(store_root)
    try:
        with pytest.raises(streamer.InsecureConfiguration, match="without authentication"):
            await streamer.serve(store, "0.0.0.0", 0)
        for kwargs in ({"auth_token": TOKEN}, {"allow_insecure": True}):
            sender = await streamer.serve(store, "0.0.0.0", 0, **kwargs)
            await sender.close()
    finally:
        await store.close()


def test_cli_serve_refuses_non_loopback_without_token(store_root, capsys, monkeypatch):
    from streamer.tools.cli import main

    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    assert main(["serve", "--store", store_root, "--listen", "0.0.0.0:0"]) == 1
    assert "--insecure-no-auth" in capsys.readouterr().err


# ----------------------------------------------------------------------------- end to end
class Sending:
    def __init__(self, root, **kw):
        self.root, self.kw = root, kw

    async def __aenter__(self):
        self.store = await streamer.open_store(self.root)
        self.sender = await streamer.serve(self.store, **self.kw)
        return self.sender

    async def __aexit__(self, *exc):
        await self.sender.close()
        await self.store.close()


async def test_fetch_with_the_right_token(store_root):
    async with Sending(store_root, auth_token=TOKEN) as sender:
        async with streamer.StreamSession("127.0.0.1", sender.port, "ctx", slo=10.0,
                                          policy="fixed:3", auth_token=TOKEN) as session:
            report = await session.fetch()
    assert len(report.chunks) == CHUNKS


@pytest.mark.parametrize("client_token,match", [
    (OTHER, "authentication .* failed: authentication failed: wrong token"),
    (None, "authentication .* failed: .*no auth token"),
])
async def test_wrong_or_missing_token_is_refused(store_root, client_token, match):
    async with Sending(store_root, auth_token=TOKEN) as sender:
        with pytest.raises(streamer.AuthenticationFailed, match=match):
            async with streamer.StreamSession("127.0.0.1", sender.port, "ctx",
                                              auth_token=client_token, max_reconnects=3):
                pytest.fail("entered without authenticating")
    assert issubclass(streamer.AuthenticationFailed, streamer.StreamError)


async def test_token_on_the_receiver_only_is_refused(store_root):
    async with Sending(store_root) as sender:
        with pytest.raises(streamer.AuthenticationFailed, match="mutual"):
            async with streamer.StreamSession("127.0.0.1", sender.port, "ctx", auth_token=TOKEN):
                pass


@pytest.mark.parametrize("pipelined", [False, True])
async def test_unauthenticated_client_gets_no_manifest(store_root, pipelined):
    """A raw client skipping AUTH: fatal ERROR "auth", nothing else, connection closed."""
    async with Sending(store_root, auth_token=TOKEN) as sender:
        raw = Raw(*await asyncio.open_connection("127.0.0.1", sender.port))
        raw.conn = p.Connection(p.Role.CLIENT, auth_token=TOKEN)
        raw.send(p.Hello((1,), "raw"))
        if not pipelined:
            assert isinstance((await raw.events(1))[0], p.Welcome)
        raw.writer.write(encode(p.Open("ctx", None))[1][0])   # no AUTH first
        events, _ = await raw.until_closed(5.0)
        # pipelined, the OPEN may arrive with the HELLO (no WELCOME sent then) or after it
        kinds = [type(e) for e in events if not isinstance(e, (p.Welcome, p.ConnectionClosed))]
        assert kinds == [p.Error]
        assert _fatal(events).code == "auth"
        assert sender.sessions == 0


async def test_context_ids_are_validated_before_the_store_sees_them(store_root):
    class Spy:
        seen: list = []

        async def get_manifest(self, context_id):
            self.seen.append(context_id)
            raise AssertionError("must not be reached")

        async def close(self):
            pass

    sender = await streamer.serve(Spy())
    try:
        raw = await Raw.open(sender.port)
        await raw.handshake()
        for bad in ("../../etc/passwd", "a/b", "ctx:*", ".hidden", "x" * 300):
            raw.send(p.Open(bad, None))
            (error,) = await raw.events(1)
            assert error == p.Error("bad_request", error.message, fatal=False)
            assert "invalid context id" in error.message
        assert Spy.seen == []
        raw.close()
    finally:
        await sender.close()


# ----------------------------------------------------------------------------- TLS
@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate for localhost / 127.0.0.1, made now."""
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    try:
        _cryptography_cert(cert, key)
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor openssl is available")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                        "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out",
                        str(cert), "-days", "2", "-subj", "/CN=localhost", "-addext",
                        "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                       check=True, capture_output=True)
    return str(cert), str(key)


def _cryptography_cert(cert_path: Path, key_path: Path) -> None:
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))


async def test_fetch_over_tls_with_auth(store_root, certificate):
    cert, key = certificate
    async with Sending(store_root, auth_token=TOKEN, ssl=tls.server_context(cert, key)) as sender:
        async with streamer.StreamSession("127.0.0.1", sender.port, "ctx", slo=10.0,
                                          policy="fixed:2", auth_token=TOKEN,
                                          ssl=tls.client_context(cert)) as session:
            report = await session.fetch()
            assert session._client._transport.get_extra_info("ssl_object") is not None
    assert len(report.chunks) == CHUNKS


async def test_tls_rejects_an_untrusted_certificate_and_plaintext(store_root, certificate):
    cert, key = certificate
    async with Sending(store_root, ssl=tls.server_context(cert, key)) as sender:
        with pytest.raises(streamer.ConnectionLost, match="certificate verify failed"):
            async with streamer.StreamSession("127.0.0.1", sender.port, "ctx",
                                              ssl=tls.client_context(), max_reconnects=0):
                pass
        with pytest.raises(streamer.ConnectionLost, match="certificate|hostname|match"):
            async with streamer.StreamSession("127.0.0.1", sender.port, "ctx", max_reconnects=0,
                                              ssl=tls.client_context(cert),
                                              server_hostname="not-this-host.example"):
                pass
        with pytest.raises(streamer.ConnectionLost):   # plaintext to a TLS port: fails fast
            async with streamer.StreamSession("127.0.0.1", sender.port, "ctx", max_reconnects=0,
                                              connect_timeout=3.0):
                pass


async def test_tls_handshake_is_bounded_by_read_timeout(store_root, certificate):
    cert, key = certificate
    config = ServerConfig(read_timeout=0.3, ssl=tls.server_context(cert, key))
    async with Sending(store_root, config=config) as sender:
        reader, writer = await asyncio.open_connection("127.0.0.1", sender.port)
        async with asyncio.timeout(3.0):   # silent TCP client: dropped, not kept forever
            try:
                assert await reader.read() == b""
            except ConnectionError:
                pass
        writer.close()


@pytest.mark.slow
def test_cli_serve_and_fetch_with_tls_and_token(store_root, certificate, tmp_path):
    cert, key = certificate
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    env = dict(os.environ, PYTHONUNBUFFERED="1", KVWIRE_AUTH_TOKEN=TOKEN)
    proc = subprocess.Popen([sys.executable, "-m", "streamer.tools.cli", "serve", "--store", store_root,
                             "--listen", "127.0.0.1:0", "--tls-cert", cert, "--tls-key", key],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "(tls, auth)" in line, line
        port = int(line.rsplit(":", 1)[1])
        fetch = [sys.executable, "-m", "streamer.tools.cli", "fetch", "--server", f"localhost:{port}",
                 "--context", "ctx", "--slo", "5", "--json", "--tls-ca", cert]
        env.pop("KVWIRE_AUTH_TOKEN")
        ok = subprocess.run(fetch + ["--auth-token-file", str(token_file)], capture_output=True,
                            text=True, timeout=120, env=env)
        assert ok.returncode == 0, ok.stderr
        refused = subprocess.run(fetch, capture_output=True, text=True, timeout=120, env=env)
        assert refused.returncode == 1 and "authentication" in refused.stderr, refused.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


async def _fail_auth_once(port: int) -> None:
    """One connection that offers the wrong token, read until the sender hangs up."""
    client = p.Connection(p.Role.CLIENT, auth_token=OTHER)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(client.send(p.Hello((1,), "c")))
    events: list = []
    while not any(isinstance(e, p.Welcome) for e in events):
        events += client.receive_data(await reader.read(1 << 16))
    writer.write(client.send(client.auth_event()))
    await reader.read()
    writer.close()


async def test_repeated_auth_failures_log_one_line_per_second_with_the_count(store_root, caplog):
    """A client looping over wrong tokens must not write one warning per try: the first
    is logged, then at most one line per second that counts the ones left out."""
    from streamer.net import sender as sender_module
    from streamer.net.throttle import Throttle

    now = [0.0]
    async with Sending(store_root, auth_token=TOKEN) as sender:
        sender._fault_logs = sender_module._PeerFaultLogs(auth=Throttle(clock=lambda: now[0]))
        with caplog.at_level("WARNING", logger="kvwire"):
            for _ in range(20):
                await _fail_auth_once(sender.port)
            now[0] = 1.5   # a second and a half later, one more
            await _fail_auth_once(sender.port)
    lines = [r.getMessage() for r in caplog.records if "authentication failed" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "more since the last line" not in lines[0] and lines[1].endswith("; 19 more since the last line")
