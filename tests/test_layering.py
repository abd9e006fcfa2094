"""Imports flow one way (schemas <- bus <- actors <- services) and only bus/ touches NATS."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).parent.parent
ORDER = ["schemas", "bus", "actors", "services"]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", ORDER)
def test_packages_import_only_downward_and_only_bus_imports_nats(package: str) -> None:
    allowed_below = set(ORDER[: ORDER.index(package)])
    forbidden = set(ORDER) - allowed_below - {package}
    for path in sorted((REPO / package).rglob("*.py")):
        found = _imports(path)
        if package != "bus":
            assert "nats" not in found, f"{path.relative_to(REPO)} imports nats"
        wrong = found & forbidden
        assert not wrong, f"{path.relative_to(REPO)} imports {sorted(wrong)} (upward)"


def test_schemas_do_no_io() -> None:
    for path in (REPO / "schemas").rglob("*.py"):
        found = _imports(path)
        assert not found & {"os", "socket", "asyncio", "time", "random", "uuid", "pathlib"}, path


def _module_imports(path: Path) -> set[str]:
    """Every module `path` imports, at any depth (function-level imports too), as dotted
    names: `from services import cli` counts as `services.cli`."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (module -> modules it imports), or None."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return [*path[path.index(module):], module]
        if module in done:
            return None
        for target in sorted(graph[module]):
            found = visit(target, [*path, module])
            if found:
                return found
        done.add(module)
        return None

    for module in sorted(graph):
        found = visit(module, [])
        if found:
            return found
    return None


@pytest.mark.parametrize("package", ORDER)
def test_no_import_cycle_between_the_modules_of_a_package(package: str) -> None:
    paths = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
             for p in sorted((REPO / package).rglob("*.py"))}
    graph = {m: _module_imports(p) & (set(paths) - {m}) for m, p in paths.items()}
    cycle = _cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"


def test_the_cycle_check_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_a_command_that_calls_no_model_does_not_load_aiohttp() -> None:
    # nats-py imports aiohttp when it is installed (for a WebSocket transport toolbus does
    # not use): 0.1 s more for every CLI command to start. bus/ hides it from nats, and the
    # model calls still find it.
    import subprocess
    import sys

    code = ("import sys, bus.connection, services.commands\n"
            "assert 'aiohttp' not in sys.modules, 'aiohttp was loaded'\n"
            "import nats.aio.transport as t\n"
            "assert t.aiohttp is None\n"
            "from actors.llm import ModelClient\n"
            "assert sys.modules['aiohttp'] is not None\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
