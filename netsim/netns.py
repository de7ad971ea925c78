"""Kernel shaping harness: two network namespaces joined by a veth pair, shaped by ``tc``.

The asyncio proxy cannot reproduce real TCP dynamics (congestion control, ACK clocking,
segmentation offload) at multi-Gbit/s; the kernel can. Both ends run as ordinary
processes inside private namespaces, so nothing touches the host's interfaces or
routes, and the addresses (``10.99.0.1`` / ``10.99.0.2``) exist only inside them.

Facts of this kernel that shape the design (see shared/reference.md §3):

* ``tbf`` holds its rate to 0.1% counted in frame bytes, so TCP goodput is about
  ``rate * 1448 / 1514`` at MTU 1500; at 2 Gbit/s it needs a burst >= 256 KB.
* ``tc qdisc change`` follows within ~0.2 s, but a burst below ~68 KB stalls the flow
  for good (segmentation-offload packets never fit), so changes never go below 128 KB.
* ``netem`` is absent: delay and loss raise a clear error pointing at ``ShapingProxy``.

Usage::

    with netns_link(rate_mbit=500) as link:
        server = link.popen_in("b", ["python", "-m", "netsim.loadgen", "sink", ...])
        link.run_in("a", ["python", "-m", "netsim.loadgen", "send", "--to", f"{link.ip_b}:5201", ...])
"""
from __future__ import annotations

import functools
import os
import secrets
import shutil
import subprocess
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Literal, Sequence

from netsim.trace import Trace

Side = Literal["a", "b"]

DEFAULT_BURST = 256 * 1024
MIN_CHANGE_BURST = 128 * 1024
SUBNET = "10.99.0"


class NetnsError(RuntimeError):
    """The harness cannot be built or driven (not root, iproute2 missing, tc refused)."""


@functools.lru_cache(maxsize=1)
def netns_available() -> tuple[bool, str]:
    """Whether namespaces can be built here, and why not: for pytest skip reasons.

    Probes by creating and deleting a throwaway namespace, since root alone is not enough
    inside some containers."""
    if os.name != "posix" or os.geteuid() != 0:
        return False, "needs root (CAP_NET_ADMIN) to create network namespaces"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"'{tool}' not found: install iproute2 (apt-get install iproute2)"
    probe = f"kvwprobe-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return False, f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True, "ok"


class NetnsLink:
    """Two namespaces ``a`` and ``b``, a veth pair between them, egress shaping on both
    ends (a symmetric link). Use as a context manager; :func:`netns_link` is the same.

    ``qdisc`` is ``"tbf"`` (precise, the default) or ``"htb"``. ``rate_mbit`` None leaves
    the link unshaped (~18 Gbit/s here). ``delay_ms``/``loss_pct`` need ``sch_netem``.
    """

    def __init__(self, rate_mbit: float | None = None, *, burst_bytes: int = DEFAULT_BURST,
                 qdisc: Literal["tbf", "htb"] = "tbf", mtu: int = 1500, latency_ms: float = 100.0,
                 delay_ms: float = 0.0, loss_pct: float = 0.0) -> None:
        if qdisc not in ("tbf", "htb"):
            raise ValueError(f"qdisc must be 'tbf' or 'htb', got {qdisc!r}")
        if rate_mbit is not None and rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be positive, got {rate_mbit}")
        tag = secrets.token_hex(4)
        self.ns = {"a": f"kvw-{tag}-a", "b": f"kvw-{tag}-b"}
        self.dev = {"a": f"kvw{tag}a", "b": f"kvw{tag}b"}  # <= 15 chars, the kernel's limit
        self.ip = {"a": f"{SUBNET}.1", "b": f"{SUBNET}.2"}
        self.rate_mbit = rate_mbit
        self.burst_bytes = burst_bytes
        self.qdisc = qdisc
        self.mtu = mtu
        self.latency_ms = latency_ms
        self.delay_ms = delay_ms
        self.loss_pct = loss_pct
        self._procs: list[subprocess.Popen] = []
        self._player: threading.Thread | None = None
        self._stop = threading.Event()
        self._created: list[str] = []

    @property
    def ip_a(self) -> str:
        return self.ip["a"]

    @property
    def ip_b(self) -> str:
        return self.ip["b"]

    # ----------------------------------------------------------------- lifecycle
    def __enter__(self) -> NetnsLink:
        ok, reason = netns_available()
        if not ok:
            raise NetnsError(reason)
        try:
            self._build()
        except BaseException:  # KeyboardInterrupt mid-setup must not leak namespaces
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the trace player and child processes, delete both namespaces. Deleting a
        namespace destroys the veth end inside it, and with it the peer. Idempotent."""
        self._stop.set()
        if self._player is not None:
            self._player.join(timeout=5)
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        errors = []
        for ns in reversed(self._created):
            done = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True)
            if done.returncode != 0 and "No such file" not in done.stderr:
                errors.append(f"ip netns del {ns}: {done.stderr.strip()}")
        # A veth that failed to move into its namespace would still sit in the root one.
        subprocess.run(["ip", "link", "del", self.dev["a"]], capture_output=True)
        self._created.clear()
        if errors:
            raise NetnsError("; ".join(errors))

    def _build(self) -> None:
        for side in ("a", "b"):
            _ip("netns", "add", self.ns[side])
            self._created.append(self.ns[side])
        _ip("link", "add", self.dev["a"], "type", "veth", "peer", "name", self.dev["b"])
        for side in ("a", "b"):
            ns, dev = self.ns[side], self.dev[side]
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{self.ip[side]}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "mtu", str(self.mtu), "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        if self.delay_ms or self.loss_pct:
            self._add_netem()
        if self.rate_mbit is not None:
            for side in ("a", "b"):
                self._shape(side, "add", self.rate_mbit, self.burst_bytes)

    # ----------------------------------------------------------------- shaping
    def set_rate(self, rate_mbit: float, burst_bytes: int | None = None) -> None:
        """Change the rate of both directions now (``tc ... change``); takes effect in
        ~0.1-0.2 s. The burst is kept >= 128 KB: a smaller one can stall a flow for good."""
        if rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be positive, got {rate_mbit}")
        burst = max(burst_bytes or self.burst_bytes, MIN_CHANGE_BURST)
        verb = "change" if self.rate_mbit is not None else "add"
        for side in ("a", "b"):
            self._shape(side, verb, rate_mbit, burst)
        self.rate_mbit = rate_mbit
        self.burst_bytes = burst

    def play(self, trace: Trace) -> None:
        """Follow ``trace`` in a background thread: one ``set_rate`` per sample, at the
        sample's time from now. Stops at the trace's end or when the link closes.
        Zero-rate samples become 0.01 Mbit/s (tc cannot express zero)."""
        if self._player is not None and self._player.is_alive():
            raise NetnsError("a trace is already playing on this link")
        self._stop.clear()
        self._player = threading.Thread(target=self._play, args=(trace,), daemon=True,
                                        name=f"netns-play-{self.ns['a']}")
        self._player.start()

    def _play(self, trace: Trace) -> None:
        start = time.monotonic()
        for t, rate in zip(trace.times, trace.rates):
            if self._stop.wait(max(0.0, start + float(t) - time.monotonic())):
                return
            self.set_rate(max(float(rate), 0.01))

    def _shape(self, side: Side, verb: str, rate_mbit: float, burst: int) -> None:
        ns, dev = self.ns[side], self.dev[side]
        rate = f"{int(rate_mbit * 1e6)}bit"
        if self.qdisc == "tbf":
            parent = ["parent", "1:1", "handle", "10:"] if self._has_netem else ["root", "handle", "10:"]
            _tc(ns, "qdisc", verb, "dev", dev, *parent, "tbf", "rate", rate, "burst", str(burst),
                "latency", f"{self.latency_ms}ms")
            return
        parent = ["parent", "1:1", "handle", "10:"] if self._has_netem else ["root", "handle", "10:"]
        if verb == "add":
            _tc(ns, "qdisc", "add", "dev", dev, *parent, "htb", "default", "1")
        # htb's default burst is ~8% low at 2 Gbit/s: always give it ours.
        _tc(ns, "class", verb, "dev", dev, "parent", "10:", "classid", "10:1", "htb", "rate", rate,
            "ceil", rate, "burst", str(burst), "cburst", str(burst))

    @property
    def _has_netem(self) -> bool:
        return bool(self.delay_ms or self.loss_pct)

    def _add_netem(self) -> None:
        args = []
        if self.delay_ms:
            args += ["delay", f"{self.delay_ms}ms"]
        if self.loss_pct:
            args += ["loss", f"{self.loss_pct}%"]
        for side in ("a", "b"):
            try:
                _tc(self.ns[side], "qdisc", "add", "dev", self.dev[side], "root", "handle", "1:", "netem", *args)
            except NetnsError as exc:
                if "unknown" in str(exc).lower() or "no such file" in str(exc).lower():
                    raise NetnsError(
                        "this kernel lacks sch_netem, so the netns harness cannot add delay or loss; "
                        "use the asyncio netsim.ShapingProxy (delay_ms=, jitter_ms=, stalls) instead"
                    ) from exc
                raise

    # ----------------------------------------------------------------- processes
    def run_in(self, side: Side, argv: Sequence[str], *, check: bool = True, timeout: float = 60.0,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run a command to completion inside namespace ``side``, capturing its output."""
        return subprocess.run(self._exec(side, argv), capture_output=True, text=True, check=check,
                              timeout=timeout, env=self._env(side, env))

    def popen_in(self, side: Side, argv: Sequence[str], *, env: dict[str, str] | None = None,
                 **popen_kwargs: object) -> subprocess.Popen:
        """Start a command inside namespace ``side``; it is terminated when the link closes."""
        proc = subprocess.Popen(self._exec(side, argv), env=self._env(side, env), **popen_kwargs)  # type: ignore[call-overload]
        self._procs.append(proc)
        return proc

    def _exec(self, side: Side, argv: Sequence[str]) -> list[str]:
        if side not in self.ns:
            raise ValueError(f"side must be 'a' or 'b', got {side!r}")
        return ["ip", "netns", "exec", self.ns[side], *argv]

    def _env(self, side: Side, extra: dict[str, str] | None) -> dict[str, str]:
        """The caller's environment plus KVW_SELF_IP / KVW_PEER_IP, so commands can name
        each other without knowing the harness's addressing."""
        peer = "b" if side == "a" else "a"
        return {**os.environ, "KVW_SELF_IP": self.ip[side], "KVW_PEER_IP": self.ip[peer], **(extra or {})}


@contextmanager
def netns_link(rate_mbit: float | None = None, **kwargs: object) -> Iterator[NetnsLink]:
    """``with netns_link(500) as link: ...`` - see :class:`NetnsLink`."""
    with NetnsLink(rate_mbit, **kwargs) as link:  # type: ignore[arg-type]
        yield link


def _ip(*args: str) -> None:
    _check(["ip", *args])


def _tc(ns: str, *args: str) -> None:
    _check(["tc", "-n", ns, *args])


def _check(cmd: list[str]) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise NetnsError(f"'{cmd[0]}' not found: install iproute2 (apt-get install iproute2)") from None
    if done.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)} failed: {done.stderr.strip() or done.stdout.strip()}")
