"""Docs, comments and docstrings say what the code does and why, not how it got there.

History lives in CHANGELOG.md (versions and behaviour changes) and in git; measured
figures live in docs/MEASURED.md with the command that regenerates them. This test scans
the prose a reader meets:

- README.md, CHANGELOG.md, docs/*.md, codec/FORMAT.md, every README.md under netsim/
  and kernels/, and every file under examples/: the whole text;
- every .py file under codec/, streamer/, netsim/, kernels/, tests/ and scripts/: its
  comments and its docstrings (a logical line made only of string literals: module,
  class and function docstrings and bare-string notes), read with the tokenize module,
  so hex values in code (test vectors, digests, ids) are not read at all;
- every .sh file, .ci/run and pyproject.toml: their ``#`` comments; the CUDA/C++ sources
  under kernels/: their ``//`` and ``/* */`` comments.

It fails, naming file:line, on (a) a word of 7 to 40 lowercase hex digits with at least
one letter and one digit (what a commit hash looks like), unless it is in ALLOWED_HEX
or is the commit a line of docs/MEASURED.md records its figures at (PROVENANCE), and
(b) the session-narrative phrases in PHRASES. Where the checkout has git, a hit that
names a commit of this repository says so; with or without git every hit fails, so the
test gives the same verdict on a source tarball as on a clone.
"""
from __future__ import annotations

import io
import re
import shutil
import subprocess
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Hex words that are not commits. Each needs a reason; prefer rewording the prose.
ALLOWED_HEX: dict[str, str] = {}

# docs/MEASURED.md is written by `kvwire bench report`, which records where each figure
# comes from: the checkout it ran at (its "- Commit:" header line) and the commit of each
# full-scale run ("DATE, commit HASH, MACHINE"). That one hash on those two kinds of line
# may name a commit; the rest of the file is held to the rule like every other doc.
PROVENANCE = {"docs/MEASURED.md": re.compile(r"^(?:- Commit: [0-9a-f]{7,40}(?=( dirty)?$)|"
                                             r"\d{4}-\d\d-\d\d, commit [0-9a-f]{7,40}(?=, ))")}

PHRASES = re.compile(r"this session|earlier session|ad hoc", re.IGNORECASE)
HEX_WORD = re.compile(r"(?<![0-9A-Za-z_])[0-9a-f]{7,40}(?![0-9A-Za-z_])")

PY_ROOTS = ("codec", "streamer", "netsim", "kernels", "tests", "scripts")
SKIP_DIRS = {"__pycache__", ".venv", ".git", "data", "fuzz_corpus"}


def _walk(top: Path):
    if not top.exists():
        return
    for path in sorted(top.rglob("*")):
        rel = path.relative_to(ROOT)
        if path.is_file() and not SKIP_DIRS.intersection(rel.parts[:-1]):
            yield path


def _whole_text(path: Path):
    """(line, text) for every line of a prose file."""
    text = path.read_text(encoding="utf-8", errors="replace")
    for number, line in enumerate(text.splitlines(), 1):
        yield number, line


def _py_prose(path: Path):
    """(line, text) for every comment and docstring line of a Python file."""
    source = path.read_text(encoding="utf-8")
    logical: list[tokenize.TokenInfo] = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
        elif tok.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
            if logical and all(t.type == tokenize.STRING for t in logical):
                for string in logical:
                    for offset, line in enumerate(string.string.splitlines()):
                        yield string.start[0] + offset, line
            logical = []
        elif tok.type not in (tokenize.NL, tokenize.INDENT, tokenize.DEDENT,
                              tokenize.ENCODING):
            logical.append(tok)


_HASH_COMMENT = re.compile(r"(?:^|\s)(#.*)$")


def _hash_comments(path: Path):
    """(line, comment) for the ``#`` comments of a shell or TOML file."""
    for number, line in _whole_text(path):
        match = _HASH_COMMENT.search(line)
        if match:
            yield number, match.group(1)


_C_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)


def _c_comments(path: Path):
    """(line, text) for the ``//`` and ``/* */`` comments of a C, C++ or CUDA file."""
    text = path.read_text(encoding="utf-8")
    for match in _C_COMMENT.finditer(text):
        first = text.count("\n", 0, match.start()) + 1
        for offset, line in enumerate(match.group(0).splitlines()):
            yield first + offset, line


def prose_lines():
    """(relative path, line, text) for every line of prose the rules apply to."""
    readers = []
    for name in ("README.md", "CHANGELOG.md", "codec/FORMAT.md", "pyproject.toml",
                 ".ci/run"):
        path = ROOT / name
        if path.exists():
            reader = _hash_comments if name in ("pyproject.toml", ".ci/run") else _whole_text
            readers.append((path, reader))
    readers += [(path, _whole_text) for path in sorted((ROOT / "docs").glob("*.md"))]
    readers += [(path, _whole_text) for path in _walk(ROOT / "examples")]
    for top in PY_ROOTS:
        for path in _walk(ROOT / top):
            if path.suffix == ".py":
                readers.append((path, _py_prose))
            elif path.suffix == ".sh":
                readers.append((path, _hash_comments))
            elif path.suffix in (".cu", ".cpp", ".h"):
                readers.append((path, _c_comments))
            elif path.name == "README.md" and top in ("netsim", "kernels"):
                readers.append((path, _whole_text))
            elif path.suffix == ".md" and top == "kernels":
                readers.append((path, _whole_text))
    for path, reader in readers:
        rel = path.relative_to(ROOT).as_posix()
        for number, text in reader(path):
            yield rel, number, text


def hex_candidates(text: str) -> list[str]:
    return [word for word in HEX_WORD.findall(text)
            if re.search(r"[a-f]", word) and re.search(r"[0-9]", word)]


def _commits(words: set[str]) -> set[str]:
    """The words that name a commit of this checkout (none without git)."""
    if not words or not (ROOT / ".git").exists() or shutil.which("git") is None:
        return set()
    ordered = sorted(words)
    out = subprocess.run(
        ["git", "-C", str(ROOT), "cat-file", "--batch-check"],
        input="".join(f"{word}^{{commit}}\n" for word in ordered),
        capture_output=True, text=True, check=False).stdout.splitlines()
    return {word for word, answer in zip(ordered, out)
            if not answer.endswith("missing")}


def find_hits() -> list[str]:
    hex_hits: list[tuple[str, int, str, str]] = []
    phrase_hits: list[str] = []
    for rel, number, text in prose_lines():
        provenance = PROVENANCE.get(rel)
        for word in hex_candidates(provenance.sub("", text.strip()) if provenance else text):
            if word not in ALLOWED_HEX:
                hex_hits.append((rel, number, word, text.strip()))
        for match in PHRASES.finditer(text):
            phrase_hits.append(f"{rel}:{number}: {match.group(0)!r}: {text.strip()}")
    commits = _commits({word for _, _, word, _ in hex_hits})
    hits = [f"{rel}:{number}: {word} ({'a commit' if word in commits else 'hex word'}): "
            f"{text}" for rel, number, word, text in hex_hits]
    return hits + phrase_hits


def test_hex_words_are_recognised():
    assert hex_candidates("fixed at 413eae5, see f57a8cd2012c65cafa586bb3b366e1448c34986a")\
        == ["413eae5", "f57a8cd2012c65cafa586bb3b366e1448c34986a"]
    # too short, no digit, no letter, uppercase, part of a longer word, 64 hex digits
    assert hex_candidates("abc1234 deadbeef 12345678 ABC1234F 0x1234abcd v1234abcd "
                          "x_abcd1234 " + "ab12" * 16) == ["abc1234"]


def test_measured_md_may_name_only_its_provenance_commits():
    def left(line: str) -> list[str]:
        return hex_candidates(PROVENANCE["docs/MEASURED.md"].sub("", line))

    assert left("- Commit: 1234abc dirty") == [] and left("- Commit: 1234abc") == []
    assert left("2026-12-03, commit 1234abc, 2-core CPU machine, no GPU, 943 s.") == []
    assert left("2026-12-03, commit 1234abc, a machine named abcd1234.") == ["abcd1234"]
    assert left("- Commit: 1234abc, see abcd1234") == ["1234abc", "abcd1234"]
    assert left("measured at 1234abc") == ["1234abc"]


def test_prose_is_read_from_comments_and_docstrings(tmp_path):
    source = tmp_path / "m.py"
    source.write_text('"""Doc 1234abc."""\nX = "abcd1234"  # note\n'
                      'def f():\n    """Line one.\n\n    Line three."""\n'
                      '    return {"k": "v"}\n')
    assert list(_py_prose(source)) == [(1, '"""Doc 1234abc."""'), (2, "# note"),
                                      (4, '"""Line one.'), (5, ""),
                                      (6, '    Line three."""')]


def test_no_history_in_docs_comments_and_docstrings():
    hits = find_hits()
    assert not hits, ("history belongs in CHANGELOG.md and git, figures in "
                      "docs/MEASURED.md; found:\n" + "\n".join(hits))
