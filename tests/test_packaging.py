"""pyproject's requires-python covers the standard library the code uses (issue 15,
finding 10: it said 3.10 while the sender uses asyncio.timeout, 3.11+)."""
from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: standard-library names and the Python version that added them
NEWER_STDLIB = {("asyncio", "timeout"): (3, 11), ("asyncio", "Runner"): (3, 11),
                ("asyncio", "TaskGroup"): (3, 11), ("asyncio", "timeout_at"): (3, 11),
                ("typing", "Self"): (3, 11), ("enum", "StrEnum"): (3, 11)}
PACKAGES = ("codec", "kernels", "netsim", "streamer", "examples")   # folders


def _required() -> tuple[int, int]:
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    match = re.fullmatch(r">=\s*(\d+)\.(\d+)", spec.strip())
    assert match, f"requires-python {spec!r} is not of the form >=X.Y"
    return int(match[1]), int(match[2])


def _uses() -> dict[tuple[str, str], list[str]]:
    found: dict[tuple[str, str], list[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                    key = (node.value.id, node.attr)
                elif isinstance(node, ast.ImportFrom) and node.module:
                    for alias in node.names:
                        if (node.module, alias.name) in NEWER_STDLIB:
                            found.setdefault((node.module, alias.name), []).append(str(path.relative_to(ROOT)))
                    continue
                else:
                    continue
                if key in NEWER_STDLIB:
                    found.setdefault(key, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_requires_python_covers_the_stdlib_the_code_uses() -> None:
    required = _required()
    uses = _uses()
    assert ("asyncio", "timeout") in uses   # the scan sees what it is meant to
    too_new = {f"{m}.{n}": where for (m, n), where in uses.items() if NEWER_STDLIB[m, n] > required}
    assert not too_new, f"requires-python >={required[0]}.{required[1]} but the code uses {too_new}"
