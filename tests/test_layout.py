"""The tree is the architecture: no import cycles, and every layer imports only downwards.

Checked statically with ``ast`` over the source: every import statement counts, including
ones deferred into functions (they still run), except those under ``if TYPE_CHECKING:``,
which never run and only name types for annotations.
"""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: each package of ours and its folder (the CUDA decoder lives in kernels/ as kvwire_kernels)
PACKAGES = {"codec": ROOT / "codec", "kvwire_kernels": ROOT / "kernels" / "kvwire_kernels",
            "netsim": ROOT / "netsim", "streamer": ROOT / "streamer"}


def _module_name(path: Path, folder: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(folder.parent).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def _modules() -> dict[str, tuple[Path, bool]]:
    found = {}
    for folder in PACKAGES.values():
        for path in folder.rglob("*.py"):
            name, is_package = _module_name(path, folder)
            found[name] = (path, is_package)
    return found


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """The project modules ``name`` imports (a ``from pkg import sub`` names ``pkg.sub``)."""
    path, is_package = MODULES[name]
    found: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    type_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                 and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
                 for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in MODULES else module
                       for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != name)
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def _cycles() -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(GRAPH[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(GRAPH):
        if node not in index:
            visit(node)
    return components


def _is_tool(name: str) -> bool:
    return name.startswith("streamer.tools") or name.rsplit(".", 1)[-1].startswith("bench")


def test_the_checker_sees_imports() -> None:
    """Guard against a checker that passes because it finds nothing."""
    assert "streamer.wire.protocol" in GRAPH["streamer.net.session"]
    assert "codec.errors" in GRAPH["codec.api"]
    assert "kvwire_kernels.gpu" in GRAPH["kvwire_kernels"]


def test_no_import_cycles() -> None:
    assert _cycles() == []


@pytest.mark.parametrize("package", ["codec", "netsim"])
def test_foundations_import_nothing_of_ours(package: str) -> None:
    outside = {f"{name} -> {dep}" for name, deps in GRAPH.items() if name.split(".")[0] == package
               for dep in deps if dep.split(".")[0] != package}
    assert outside == set()


def test_codec_does_not_import_kernels() -> None:
    assert not any(dep.startswith("kvwire_kernels") for name, deps in GRAPH.items()
                   if name.startswith("codec") for dep in deps)


def test_the_kernels_folder_leaves_the_name_kernels_to_its_owner() -> None:
    """Hugging Face's ``kernels`` distribution (a dependency of transformers from 5.25)
    owns the import name ``kernels``. With a kernels/__init__.py here, running from the
    repository root (``python -m pytest`` puts it on sys.path) shadowed it, and every
    transformers model load failed importing ``kernels.CUDAProperties``."""
    assert not (ROOT / "kernels" / "__init__.py").exists()
    spec = importlib.util.find_spec("kernels")
    assert spec is None or spec.origin is None or ROOT / "kernels" not in Path(spec.origin).parents


def test_the_library_imports_no_tool() -> None:
    offending = {f"{name} -> {dep}" for name, deps in GRAPH.items() if not _is_tool(name)
                 for dep in deps if _is_tool(dep)}
    assert offending == set()


@pytest.mark.parametrize("layer, forbidden", [
    ("streamer.wire", ("streamer.net", "streamer.store", "streamer.adapt", "streamer.receiver",
                       "streamer.model")),
    ("streamer.adapt", ("streamer.net", "streamer.store", "streamer.receiver", "streamer.model")),
    ("streamer.store", ("streamer.net", "streamer.adapt", "streamer.receiver", "streamer.model")),
    ("streamer.net", ("streamer.receiver", "streamer.model")),
])
def test_layers_import_downwards(layer: str, forbidden: tuple[str, ...]) -> None:
    upward = {f"{name} -> {dep}" for name, deps in GRAPH.items() if name.startswith(layer)
              for dep in deps if dep.startswith(forbidden)}
    assert upward == set()
