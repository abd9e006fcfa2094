"""`built-in:git_read` and `built-in:git`: git subcommands in one configured repository.

The command runs without a shell (`git <args>`, split like a POSIX shell would), so `|`,
`>` and `$(...)` mean nothing. Options before the subcommand (`-c`, `-C`, `--git-dir`)
are refused: they could run programs or reach another repository. `git_read` takes only
subcommands that read (log, diff, show, status, ...), and is annotated read-only, so it
runs without a human: it refuses the options that write a file, read one, run a program
or read stdin (git takes abbreviations and clusters of them), and paths leading out of
the repository; and by default it runs in the code tool's sandbox (sandbox.py), seeing
the repository read-only and nothing else, so an option the checks miss reaches nothing.
`git` takes any subcommand, as a plain subprocess, and is registered only when the
manifest says `allow_write: true`. No global or system config is read. Output is capped
at `max_output_bytes` with the count of bytes cut; a non-zero exit is a failure carrying
git's stderr (seed 003's git-cli).
"""

from __future__ import annotations

import os
import shlex
import shutil
import tempfile
from pathlib import Path
from typing import Any

from actors.tools import LocalTool, ToolError, tool
from actors.tools.builtins.process import Finished, run_capped
from actors.tools.builtins.sandbox import checked_sandbox
from schemas.errors import ConfigError
from schemas.manifest import GitConfig

READ_ONLY_SUBCOMMANDS = frozenset({
    "status", "log", "show", "diff", "blame", "ls-files", "ls-tree", "rev-parse",
    "rev-list", "describe", "shortlog", "grep", "cat-file", "for-each-ref", "show-ref",
    "merge-base", "name-rev", "count-objects", "version",
})
# Options of those that write a file, read one from outside the repository, run a
# program or read standard input. git takes any unambiguous abbreviation of a long option
# (`--cont` is `--contents`), so a long option is refused if it abbreviates one of these.
_REFUSED_LONG = (
    "--output", "--ext-diff", "--textconv", "--filters", "--open-files-in-pager",
    "--contents", "--ignore-revs-file", "--no-index", "--pathspec-from-file",
    "--exclude-from", "--exclude-per-directory", "--resolve-git-dir", "--file", "--stdin",
    "--annotate-stdin", "--batch", "--batch-check", "--batch-command", "--show-signature",
)
# Short options of the same kinds, by subcommand (`-O<orderfile>`, `-O<pager>`, `-f
# <file>`, `-S <revs-file>`, `-X <file>`), and the short options that take a value, after
# which the rest of a cluster (`-nSfoo`) is that value.
_REFUSED_SHORT = {"grep": "fO", "blame": "S", "ls-files": "X", "log": "O", "show": "O",
                  "diff": "O", "shortlog": "O"}
_VALUE_SHORT = {"grep": "eABCm", "blame": "L", "log": "SGLn", "show": "SGLn", "diff": "SGL",
                "ls-files": "x"}
# Options that a refused one starts with, and that are safe themselves (an exact name).
_SAFE_LONG = frozenset({"--text", "--filter", "--exclude", "--path"})
# Appended after these subcommands: a diff program or text conversion set in the
# repository's config (which built-in:git may have written) does not run.
_NO_PROGRAMS = {"log": ("--no-ext-diff", "--no-textconv"),
                "show": ("--no-ext-diff", "--no-textconv"),
                "diff": ("--no-ext-diff", "--no-textconv"), "blame": ("--no-textconv",)}
# Nor do signature programs (`%G?` in a format runs them), nor attributes from outside
# the repository; a clean filter its own `.gitattributes` names and its config defines
# still can (on a worktree diff or status): in the sandbox, that sees only the repository.
_GIT_CONFIG = ("-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null",
               "-c", "log.showSignature=false", "-c", "protocol.allow=never",
               "-c", "gpg.program=false", "-c", "gpg.ssh.program=false",
               "-c", "gpg.x509.program=false", "-c", "core.attributesFile=/dev/null")

_COMMAND_SCHEMA = {
    "type": "object",
    "properties": {"command": {
        "type": "string", "minLength": 1,
        "description": "the git subcommand and its flags, without the leading `git`, "
                       "e.g. \"log --oneline -10\"",
    }},
    "required": ["command"],
    "additionalProperties": False,
}


def _refused(arg: str, why: str) -> ToolError:
    return ToolError(f"{arg} is not allowed in built-in:git_read: {why}",
                     error_type="subcommand_not_allowed")


def _check_read_only(sub: str, args: list[str]) -> None:
    """Refuse what could write, read outside the repository, or run a program. Every
    argument that reads as an option is checked as one wherever it stands: after `--`
    too, since `--` may be an option's value (`grep -e -- -O...`), and git reads on."""
    value_next = False
    for arg in args:
        if arg == "--":
            value_next = False
            continue
        if value_next:  # the value of the option before it (`-e /usr`): no path, but
            value_next = False  # one that reads as an option is checked as one
            if not arg.startswith("-"):
                continue
        if arg.startswith("--"):
            name = arg.split("=", 1)[0]
            # git takes an exact name before an abbreviation: `--text` is not `--textconv`.
            if name not in _SAFE_LONG and len(name) > 2 and \
                    any(full.startswith(name) for full in _REFUSED_LONG):
                raise _refused(arg, "it writes a file, reads one from outside the "
                                    "repository, runs a program or reads stdin")
            continue
        if arg.startswith("-") and len(arg) > 1:
            for i, letter in enumerate(arg[1:]):
                if letter in _REFUSED_SHORT.get(sub, ""):
                    raise _refused(arg, f"-{letter} reads or writes a file, or runs a program")
                if letter in _VALUE_SHORT.get(sub, ""):
                    value_next = i == len(arg) - 2  # the value is the next argument
                    break
            continue
        if arg.startswith("/") or ".." in arg.split("/"):
            raise _refused(arg, "paths outside the repository (absolute, or with ..) "
                                "are not readable")


def _split(command: str, *, read_only: bool) -> list[str]:
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        raise ToolError(f"cannot split the command: {exc}", error_type="invalid_command") from exc
    if argv and argv[0] == "git":
        argv = argv[1:]
    if not argv:
        raise ToolError("no subcommand given", error_type="invalid_command")
    if argv[0].startswith("-"):
        raise ToolError(f"options before the subcommand ({argv[0]}) are not allowed; "
                        "start with the subcommand, e.g. \"log -5\"",
                        error_type="invalid_command")
    if read_only:
        if argv[0] not in READ_ONLY_SUBCOMMANDS:
            raise ToolError(f"git {argv[0]} is not a read-only subcommand; built-in:git_read "
                            f"runs {', '.join(sorted(READ_ONLY_SUBCOMMANDS))}",
                            error_type="subcommand_not_allowed")
        _check_read_only(argv[0], argv[1:])
        argv = [argv[0], *_NO_PROGRAMS.get(argv[0], ()), *argv[1:]]
    return argv


def _failed(argv: list[str], done: Finished) -> ToolError:
    return ToolError(f"git {argv[0]} exited with {done.exit_code}: "
                     f"{done.stderr.decode('utf-8', errors='replace').strip()[:4000]}",
                     error_type="git_failed")


def _result(argv: list[str], done: Finished) -> dict[str, Any]:
    if done.exit_code != 0:
        raise _failed(argv, done)
    result: dict[str, Any] = {"output": done.stdout.decode("utf-8", errors="replace")}
    if done.stdout_cut:
        result["cut_bytes"] = done.stdout_cut
        result["note"] = f"output truncated: {done.stdout_cut} more bytes were cut"
    return result


def _env(path_env: str, home: str) -> dict[str, str]:
    # No global or system config: HOME is not the repository, whose files (a committed
    # `.gitconfig`) could otherwise configure programs to run.
    return {"PATH": path_env, "GIT_TERMINAL_PROMPT": "0", "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_ATTR_NOSYSTEM": "1", "HOME": home,
            "LC_ALL": "C"}


async def run_git(repo: Path, argv: list[str], cfg: GitConfig, path_env: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="toolbus-git-") as home:
        done = await run_capped(["git", "--no-pager", *_GIT_CONFIG, *argv], cwd=str(repo),
                                timeout_ms=cfg.timeout_ms, cap=cfg.max_output_bytes,
                                what=f"git {argv[0]}", env=_env(path_env, home))
    return _result(argv, done)


class _SandboxedGit:
    """git_read in the code tool's sandbox (sandbox.py): the repository read-only at its
    own path, the system's folders, a fresh /tmp, no network, none of the executor's
    files. Whatever an option does there, it can reach nothing else."""

    def __init__(self, repo: Path, cfg: GitConfig, path_env: str) -> None:
        self.repo, self.cfg = repo, cfg
        git = shutil.which("git", path=path_env)
        if git is None:
            raise ConfigError(f"tools.git: no git on PATH ({path_env})")
        git = os.path.realpath(git)
        self.git = git
        self.box = checked_sandbox("tools.git", "built-in:git_read", network=False,
                                   max_processes=16)
        # git and its helpers, when they live outside the folders every sandbox has.
        self.read_only = [str(repo), *(d for d in {os.path.dirname(git)}
                                       if not d.startswith(("/usr/", "/bin", "/lib")))]
        self.env = _env("/usr/local/bin:/usr/bin:/bin:" + os.path.dirname(git), "/tmp")

    def _argv(self, argv: list[str]) -> list[str]:
        # The sandbox's user may not own the repository: trust it anyway, it is read-only.
        return [self.git, "--no-pager", "-c", "safe.directory=*", *_GIT_CONFIG, *argv]

    async def run(self, argv: list[str]) -> dict[str, Any]:
        return _result(argv, await self.box.run(
            self._argv(argv), script=b"", script_name="git", timeout_ms=self.cfg.timeout_ms,
            cap=self.cfg.max_output_bytes, what=f"git {argv[0]}",
            read_only=self.read_only, chdir=str(self.repo), env=self.env))

    def check(self) -> None:
        """At boot: git runs in the sandbox and its user can read the repository."""
        problem = self.box.check(self._argv(["rev-parse", "--is-inside-git-dir"]),
                                 expect=b"false\n", read_only=self.read_only,
                                 chdir=str(self.repo), env=self.env)
        if problem is not None:
            raise ConfigError(
                f"tools.git: git cannot read {self.repo} inside its sandbox ({problem}); "
                f"when the executor runs as root the sandbox's user is another one: make "
                f"the repository readable by others, or set `isolation: process` under "
                f"tools.git")


def git_tools(cfg: GitConfig, *, path_env: str) -> list[LocalTool]:
    repo = Path(cfg.repo).resolve()
    if not (repo / ".git").exists() and not (repo / "HEAD").exists():
        raise ConfigError(f"tools.git.repo: {cfg.repo} is not a git repository")

    box = _SandboxedGit(repo, cfg, path_env) if cfg.isolation == "sandbox" else None
    if box is not None:
        box.check()

    @tool("built-in:git_read", read_only=True, idempotent=True, open_world=False,
          timeout_ms=cfg.timeout_ms + 5_000, source="built-in", pool=cfg.pool,
          parameters=_COMMAND_SCHEMA)
    async def git_read(command: str) -> dict[str, Any]:
        """Run a read-only git subcommand (log, diff, show, status, blame, grep, ...) in
        the configured repository. No shell: pipes and redirects are not available."""
        argv = _split(command, read_only=True)
        if box is not None:
            return await box.run(argv)
        return await run_git(repo, argv, cfg, path_env)

    tools = [git_read]
    if cfg.allow_write:
        @tool("built-in:git", destructive=True, open_world=True, risk_level="high",
              timeout_ms=cfg.timeout_ms + 5_000, source="built-in", pool=cfg.pool,
              parameters=_COMMAND_SCHEMA)
        async def git(command: str) -> dict[str, Any]:
            """Run any git subcommand (commit, checkout, branch, ...) in the configured
            repository. No shell: pipes and redirects are not available."""
            return await run_git(repo, _split(command, read_only=False), cfg, path_env)

        tools.append(git)
    return tools
