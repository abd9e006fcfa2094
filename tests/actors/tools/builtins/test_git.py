"""`git_read`/`git` against a real git repository: read-only subcommands without a shell,
refused writes, global options and options that read outside files or run programs, the
sandbox that contains git_read whatever an option does, capped output."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from actors.tools import ToolError
from actors.tools.builtins.git import _SandboxedGit, git_tools
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


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True)


def _sign_head(repo: Path) -> None:
    """HEAD made a signed commit (its signature made up)."""
    body = subprocess.run(["git", "cat-file", "commit", "HEAD"], cwd=repo, check=True,
                          capture_output=True).stdout.decode()
    head, _, message = body.partition("\n\n")
    signed = (f"{head}\ngpgsig -----BEGIN PGP SIGNATURE-----\n \n iQEz\n "
              f"-----END PGP SIGNATURE-----\n\n{message}")
    made = subprocess.run(["git", "hash-object", "-t", "commit", "-w", "--stdin"], cwd=repo,
                          input=signed.encode(), check=True, capture_output=True)
    _git(repo, "update-ref", "HEAD", made.stdout.decode().strip())


async def test_git_read_runs_read_only_subcommands_without_a_shell(repo: Path) -> None:
    (read,) = git_tools(GitConfig(repo=str(repo)), path_env=PATH)
    assert read.spec.annotations.readOnlyHint
    log = await run_tool(read, {"command": "log --format=%s"})
    assert log["output"].splitlines() == ["second commit", "first"]
    with pytest.raises(ToolError, match="ambiguous argument '\\|'"):
        await run_tool(read, {"command": "log --format=%s | rm -rf x"})  # '|' reaches git as is
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


@pytest.mark.parametrize("command, why", [
    # A program run through a shell (git grep's pager), in any spelling.
    ('grep "-Oid > /tmp/x; true" -e a', "-O reads or writes a file, or runs a program"),
    ("grep -iOtrue -e a", "-O reads or writes"),
    ("grep --open-files-in-p=true -e a", "runs a program"),
    ("diff --ext-diff", "runs a program"),
    ("cat-file --filters HEAD:big.txt", "runs a program"),
    # Files outside the repository, read.
    ("blame --contents /etc/hostname big.txt", "reads one from outside"),
    ("blame --cont=secret big.txt", "reads one from outside"),  # an abbreviation
    ("blame --ignore-revs-f secret big.txt", "reads one from outside"),
    ("blame -S secret big.txt", "-S reads or writes"),
    ("grep -if secret", "-f reads or writes"),
    ("ls-files -X secret", "-X reads or writes"),
    ("ls-files --exclude-from=secret", "reads one from outside"),
    ("log --pathspec-from-file=secret", "reads one from outside"),
    ("diff --no-ind a b", "reads one from outside"),
    ("diff /etc/hostname /dev/null", "paths outside the repository"),  # implied --no-index
    ("show HEAD -- ../../etc/passwd", "paths outside the repository"),
    # Files written.
    ("diff --outp=/tmp/x", "writes a file"),
    ("log -p -O/tmp/order", "-O reads or writes"),
    ("shortlog -n --output=notes HEAD", "writes a file"),  # -n takes no value there
    ("log -n --output=notes", "writes a file"),  # nor is an option ever a value
    ("grep -e -- '-Otouch pwned'", "-O reads or writes"),  # `--` as -e's value
    ("grep -ie -- -Ocat", "-O reads or writes"),
    ("ls-files -x -- -X/etc/passwd -o -i", "-X reads or writes"),
    ("show HEAD -- --output=x", "writes a file"),  # an option after `--` is checked
])
async def test_git_read_refuses_options_that_reach_outside_the_repository(
        repo: Path, command: str, why: str) -> None:
    (read,) = git_tools(GitConfig(repo=str(repo)), path_env=PATH)
    with pytest.raises(ToolError, match=why) as err:
        await run_tool(read, {"command": command})
    assert err.value.error_type == "subcommand_not_allowed"


async def test_git_read_takes_values_that_only_look_like_paths_or_options(repo: Path) -> None:
    (read,) = git_tools(GitConfig(repo=str(repo)), path_env=PATH)
    (repo / "notes.txt").write_text("see /usr/lib and -O\n")
    _git(repo, "add", "notes.txt")
    found = await run_tool(read, {"command": "grep -e /usr --cached"})
    assert found["output"] == "notes.txt:see /usr/lib and -O\n"
    assert (await run_tool(read, {"command": "log -SOME --oneline"}))["output"] == ""
    ranged = await run_tool(read, {"command": "log --format=%s HEAD~1..HEAD"})
    assert ranged["output"] == "second commit\n"
    # Exact names that a refused option starts with are themselves fine.
    for command in ("diff --text HEAD~1", "rev-list --objects --filter=blob:none HEAD",
                    "log --all --exclude=refs/stash --oneline", "ls-files --exclude=*.o -o"):
        await run_tool(read, {"command": command})


@pytest.mark.parametrize("isolation", ["sandbox", "process"])
async def test_git_read_ignores_programs_set_in_the_repository_config(
        repo: Path, tmp_path: Path, isolation: str) -> None:
    # What an approved built-in:git (`git config diff.external ...`) or a committed
    # `.gitconfig` (git read it as the global config when HOME was the repository) sets.
    ran = tmp_path / "ran"
    evil = tmp_path / "evil.sh"
    evil.write_text(f"#!/bin/sh\ntouch {ran}\n")
    evil.chmod(0o755)
    (repo / ".gitconfig").write_text(f"[diff]\n\texternal = {evil}\n")
    _git(repo, "config", "diff.external", str(evil))
    _git(repo, "config", "core.pager", str(evil))
    _git(repo, "config", "diff.evil.textconv", str(evil))
    _git(repo, "config", "gpg.program", str(evil))
    (repo / ".gitattributes").write_text("*.txt diff=evil\n")
    _git(repo, "add", ".gitattributes")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@x", "commit", "-q", "-m", "attrs")
    _sign_head(repo)  # reading a signature runs gpg.program
    (read,) = git_tools(GitConfig(repo=str(repo), isolation=isolation), path_env=PATH)
    (repo / "big.txt").write_text("changed\n")
    _git(repo, "add", "big.txt")
    (repo / "big.txt").write_text("changed again\n")
    out = await run_tool(read, {"command": "diff"})
    assert "+changed again" in out["output"]
    await run_tool(read, {"command": "log -p -1"})
    await run_tool(read, {"command": "blame big.txt"})  # blame applies textconv itself
    await run_tool(read, {"command": "log --format=%G?%GS -1"})  # runs gpg.program
    assert not ran.exists()


async def test_the_sandbox_contains_git_whatever_an_option_does(repo: Path,
                                                                tmp_path: Path) -> None:
    # Past the argument checks (an option they do not know): the program git runs sees no
    # file of the host outside the repository, and writes none.
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2\n")
    box = _SandboxedGit(repo.resolve(), GitConfig(repo=str(repo)), PATH)
    with pytest.raises(ToolError) as err:
        await box.run(["blame", "--contents", str(secret), "big.txt"])
    assert "hunter2" not in str(err.value)
    pwned = tmp_path / "pwned"
    _git(repo, "add", "big.txt")
    out = await box.run(["grep", f"-Oecho ran; cat {secret} > {pwned}; cat {secret}; true",
                         "-e", "line", "--", "big.txt"])
    assert out["output"] == "ran\n"  # it ran, and saw no secret
    assert not pwned.exists()
    with pytest.raises(ToolError, match="exited with"):
        await box.run(["grep", "-Otouch big.txt.new", "-e", "line", "--", "big.txt"])
    assert not (repo / "big.txt.new").exists()  # the repository is read-only in there


async def test_git_read_in_a_sandbox_needs_a_repository_it_can_read(tmp_path: Path) -> None:
    from schemas.errors import ConfigError
    with pytest.raises(ConfigError, match="is not a git repository"):
        git_tools(GitConfig(repo=str(tmp_path)), path_env=PATH)


async def test_git_output_is_capped_with_the_count_of_cut_bytes(repo: Path) -> None:
    read, write = git_tools(GitConfig(repo=str(repo), allow_write=True, max_output_bytes=32768),
                            path_env=PATH)
    assert not write.spec.annotations.readOnlyHint and write.spec.name == "built-in:git"
    await run_tool(write, {"command": "add big.txt"})
    out = await run_tool(read, {"command": "diff --cached"})
    assert len(out["output"].encode()) == 32768 and out["cut_bytes"] > 60_000
    assert "bytes were cut" in out["note"]
