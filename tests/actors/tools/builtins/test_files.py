"""`file_read`/`file_write` against real files and symbolic links: every path that
leaves the tool's root is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.tools import ToolError
from actors.tools.builtins.files import file_tools
from schemas.manifest import FilesConfig
from tests.actors.tools.builtins.conftest import run_tool


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    (r / "notes").mkdir(parents=True)
    (r / "notes" / "a.txt").write_text("hello world")
    (tmp_path / "secret.txt").write_text("top secret")
    (r / "escape").symlink_to(tmp_path / "secret.txt")
    (r / "dir_escape").symlink_to(tmp_path)
    (r / "inside").symlink_to(r / "notes" / "a.txt")
    return r


async def test_file_read_and_write_stay_inside_the_root(root: Path) -> None:
    read, write = file_tools(FilesConfig(root=str(root)))
    assert write.spec.annotations.destructiveHint and read.spec.annotations.readOnlyHint
    assert (await run_tool(read, {"path": "notes/a.txt"}))["content"] == "hello world"
    assert (await run_tool(read, {"path": "inside"}))["content"] == "hello world"
    part = await run_tool(read, {"path": "notes/a.txt", "offset": 6, "max_chars": 3})
    assert part["content"] == "wor" and part["truncated"]
    assert (await run_tool(write, {"path": "out/new.md", "content": "x"}))["bytes_written"] == 1
    await run_tool(write, {"path": "out/new.md", "content": "y", "append": True})
    assert (root / "out" / "new.md").read_text() == "xy"


@pytest.mark.parametrize("path, why", [
    ("../secret.txt", "contains '..'"),
    ("notes/../../secret.txt", "contains '..'"),
    ("/etc/passwd", "is absolute"),
    ("escape", "outside the tool's root through a symbolic link"),
    ("dir_escape/secret.txt", "outside the tool's root through a symbolic link"),
])
async def test_file_paths_that_leave_the_root_are_refused(root: Path, path: str,
                                                          why: str) -> None:
    read, write = file_tools(FilesConfig(root=str(root)))
    for t, args in ((read, {"path": path}), (write, {"path": path, "content": "pwned"})):
        with pytest.raises(ToolError, match=why) as err:
            await run_tool(t, args)
        assert err.value.error_type == "path_refused"
    assert (root.parent / "secret.txt").read_text() == "top secret"
