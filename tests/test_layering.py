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
