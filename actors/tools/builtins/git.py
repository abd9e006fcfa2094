"""`built-in:git_read` and `built-in:git`: git subcommands in one configured repository.

The command runs without a shell (`git <args>`, split like a POSIX shell would), so `|`,
`>` and `$(...)` mean nothing. Options before the subcommand (`-c`, `-C`, `--git-dir`)
are refused: they could run programs or reach another repository. `git_read` takes only
subcommands that read (log, diff, show, status, ...), without `--output`, and is annotated
read-only; `git` takes any subcommand and is registered only when the manifest says
`allow_write: true`. Output is capped at `max_output_bytes` with the count of bytes cut;
a non-zero exit is a failure carrying git's stderr (seed 003's git-cli).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from actors.tools import LocalTool, ToolError, tool
from actors.tools.builtins.process import run_capped
from schemas.errors import ConfigError
from schemas.manifest import GitConfig

READ_ONLY_SUBCOMMANDS = frozenset({
    "status", "log", "show", "diff", "blame", "ls-files", "ls-tree", "rev-parse",
    "rev-list", "describe", "shortlog", "grep", "cat-file", "for-each-ref", "show-ref",
    "merge-base", "name-rev", "count-objects", "version",
})
_WRITING_OPTIONS = ("--output", "-o", "--ext-diff", "--open-files-in-pager")

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
        for arg in argv[1:]:
            if arg.split("=", 1)[0] in _WRITING_OPTIONS:
                raise ToolError(f"{arg} is not allowed in built-in:git_read",
                                error_type="subcommand_not_allowed")
    return argv


async def run_git(repo: Path, argv: list[str], cfg: GitConfig, path_env: str) -> dict[str, Any]:
    done = await run_capped(
        ["git", "--no-pager", "-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null",
         *argv],
        cwd=str(repo), timeout_ms=cfg.timeout_ms, cap=cfg.max_output_bytes,
        what=f"git {argv[0]}",
        env={"PATH": path_env, "GIT_TERMINAL_PROMPT": "0", "GIT_CONFIG_NOSYSTEM": "1",
             "HOME": str(repo), "LC_ALL": "C"})
    if done.exit_code != 0:
        raise ToolError(f"git {argv[0]} exited with {done.exit_code}: "
                        f"{done.stderr.decode('utf-8', errors='replace').strip()[:4000]}",
                        error_type="git_failed")
    result: dict[str, Any] = {"output": done.stdout.decode("utf-8", errors="replace")}
    if done.stdout_cut:
        result["cut_bytes"] = done.stdout_cut
        result["note"] = f"output truncated: {done.stdout_cut} more bytes were cut"
    return result


def git_tools(cfg: GitConfig, *, path_env: str) -> list[LocalTool]:
    repo = Path(cfg.repo).resolve()
    if not (repo / ".git").exists() and not (repo / "HEAD").exists():
        raise ConfigError(f"tools.git.repo: {cfg.repo} is not a git repository")

    @tool("built-in:git_read", read_only=True, idempotent=True, open_world=False,
          timeout_ms=cfg.timeout_ms + 5_000, source="built-in", pool=cfg.pool,
          parameters=_COMMAND_SCHEMA)
    async def git_read(command: str) -> dict[str, Any]:
        """Run a read-only git subcommand (log, diff, show, status, blame, grep, ...) in
        the configured repository. No shell: pipes and redirects are not available."""
        return await run_git(repo, _split(command, read_only=True), cfg, path_env)

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
