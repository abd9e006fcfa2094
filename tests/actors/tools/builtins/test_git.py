"""`git_read`/`git` against a real git repository: read-only subcommands without a shell,
refused writes and global options, capped output."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from actors.tools import ToolError
from actors.tools.builtins.git import git_tools
from schemas.manifest import GitConfig
from tests.actors.tools.builtins.conftest import PATH, run_tool


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    r = tmp_path / "repo"
    r.mkdir()
    env = {"PATH": PATH, "HOME": str(tmp_path), "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@x",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@x"}
    for cmd in (["init", "-q", "-b", "main"], ["commit", "-q", "--allow-empty", "-m", "first"],
                ["commit", "-q", "--allow-empty", "-m", "second commit"]):
        subprocess.run(["git", *cmd], cwd=r, env=env, check=True)
    (r / "big.txt").write_text("line\n" * 20_000)
    return r


async def test_git_read_runs_read_only_subcommands_without_a_shell(repo: Path) -> None:
    (read,) = git_tools(GitConfig(repo=str(repo)), path_env=PATH)
    assert read.spec.annotations.readOnlyHint
    log = await run_tool(read, {"command": "log --format=%s"})
    assert log["output"].splitlines() == ["second commit", "first"]
    with pytest.raises(ToolError, match="ambiguous argument '\\|'"):
        await run_tool(read, {"command": "log --format=%s | rm -rf /"})  # '|' reaches git as is
    with pytest.raises(ToolError, match="exited with 128") as err:
        await run_tool(read, {"command": "show no-such-rev"})
    assert err.value.error_type == "git_failed"


@pytest.mark.parametrize("command, why", [
    ("commit -m x", "not a read-only subcommand"),
    ("-c core.pager=evil log", "options before the subcommand"),
    ("diff --output=/tmp/x", "not allowed in built-in:git_read"),
])
async def test_git_read_refuses_writes_and_global_options(repo: Path, command: str,
                                                          why: str) -> None:
    (read,) = git_tools(GitConfig(repo=str(repo)), path_env=PATH)
    with pytest.raises(ToolError, match=why):
        await run_tool(read, {"command": command})


async def test_git_output_is_capped_with_the_count_of_cut_bytes(repo: Path) -> None:
    read, write = git_tools(GitConfig(repo=str(repo), allow_write=True, max_output_bytes=32768),
                            path_env=PATH)
    assert not write.spec.annotations.readOnlyHint and write.spec.name == "built-in:git"
    await run_tool(write, {"command": "add big.txt"})
    out = await run_tool(read, {"command": "diff --cached"})
    assert len(out["output"].encode()) == 32768 and out["cut_bytes"] > 60_000
    assert "bytes were cut" in out["note"]
