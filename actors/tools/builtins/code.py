"""`built-in:code_execute`: run a Python (or shell) snippet in a bubblewrap sandbox.

`isolation: sandbox` (the default; see `actors.tools.builtins.sandbox`): a root of its own
with read-only system folders and the base Python, a size-capped /tmp as working folder
and only writable place, no network unless `network: true`, nothing of the executor's
files, environment or processes in sight, at most `max_processes` processes, and every
process gone when the call ends. If the sandbox cannot start on this machine, building the
tool raises `ConfigError` (so the executor does not start) naming the reason and the
`isolation: process` escape hatch.

`isolation: process`: a plain subprocess in a fresh temporary folder with only PATH in its
environment; it can read what the executor's user can read and reach the network.

Both: CPU-time, address-space and file-size limits, its own process group (killed whole on
timeout), stdout/stderr capped at `max_output_bytes` each, with the count of bytes cut. A
non-zero exit code is a result (`ok: false`), not a failure: the model needs the
traceback. A timeout is a failure.
"""

from __future__ import annotations

import dataclasses
import resource
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from actors.tools import LocalTool, ToolError, tool
from actors.tools.builtins.process import Finished, run_capped
from actors.tools.builtins.sandbox import TMP_BYTES, TMP_FILES, Sandbox, checked_sandbox
from schemas.manifest import CodeConfig

_MAX_FILE_BYTES = 64 << 20


def _limits(cpu_s: int, mem_mb: int) -> Any:
    def apply() -> None:  # pragma: no cover - runs in the child
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        mem = mem_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (_MAX_FILE_BYTES, _MAX_FILE_BYTES))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def _sandbox(cfg: CodeConfig) -> Sandbox:
    return checked_sandbox("tools.code", "built-in:code_execute", network=cfg.network,
                           max_processes=cfg.max_processes,
                           instead=" to run the code as a plain subprocess that sees the "
                                   "executor's files and network")


def code_tool(cfg: CodeConfig, *, path_env: str) -> LocalTool:
    """The tool; with `isolation: sandbox`, first checks that a sandbox starts here."""
    languages = list(cfg.languages)
    box = _sandbox(cfg) if cfg.isolation == "sandbox" else None
    limits = _limits(cfg.cpu_seconds, cfg.memory_mb)

    async def run(code: str, language: str) -> Finished:
        name = "main.py" if language == "python" else "main.sh"
        if box is not None:
            argv = ([box.python, "-I", "-B", name] if language == "python"
                    else ["/bin/sh", name])
            done = await box.run(argv, script=code.encode(), script_name=name,
                                 timeout_ms=cfg.timeout_ms, cap=cfg.max_output_bytes,
                                 what="the program", preexec=limits)
            # bwrap reports a death by signal n as exit 128 + n, as shells do.
            if 128 < done.exit_code < 128 + signal.NSIG:
                done = dataclasses.replace(done, exit_code=128 - done.exit_code)
            return done
        with tempfile.TemporaryDirectory(prefix="toolbus-code-") as tmp:
            script = Path(tmp, name)
            script.write_text(code)  # noqa: ASYNC240 - a small file in a fresh local folder
            argv = ([sys.executable, "-I", "-B", str(script)] if language == "python"
                    else ["/bin/sh", str(script)])
            return await run_capped(argv, cwd=tmp, env={"PATH": path_env},
                                    timeout_ms=cfg.timeout_ms, cap=cfg.max_output_bytes,
                                    what="the program", preexec=limits)

    if box is None:
        where = ("a fresh temporary folder, as a plain subprocess (no sandbox: it can reach "
                 "the network)")
    else:
        where = (f"a sandbox: a fresh /tmp as working folder and only writable place "
                 f"({TMP_BYTES >> 20} MB, {TMP_FILES} files), Python's standard library, "
                 f"{'network access' if cfg.network else 'no network'}, at most "
                 f"{cfg.max_processes} processes")

    @tool("built-in:code_execute", open_world=True, destructive=False, risk_level="high",
          timeout_ms=cfg.timeout_ms + 5_000, source="built-in", pool=cfg.pool,
          description=f"Run a short program in {where}, and return its exit code, stdout "
                      f"and stderr (each capped at {cfg.max_output_bytes} bytes).",
          parameters={
              "type": "object",
              "properties": {
                  "code": {"type": "string", "minLength": 1,
                           "description": "the program; print what you want to see"},
                  "language": {"type": "string", "enum": languages, "default": languages[0]},
              },
              "required": ["code"],
              "additionalProperties": False,
          })
    async def code_execute(code: str, language: Literal["python", "shell"] = "python"
                           ) -> dict[str, Any]:
        if language not in languages:
            raise ToolError(f"language {language} is not enabled", error_type="invalid_arguments")
        t0 = time.perf_counter()
        done = await run(code, language)
        code_ = done.exit_code
        result: dict[str, Any] = {
            "ok": code_ == 0, "exit_code": code_,
            "stdout": done.stdout.decode("utf-8", errors="replace"),
            "stderr": done.stderr.decode("utf-8", errors="replace"),
            "duration_ms": round((time.perf_counter() - t0) * 1000, 1),
        }
        if code_ < 0:
            result["signal"] = signal.Signals(-code_).name
        if done.stdout_cut:
            result["stdout_cut_bytes"] = done.stdout_cut
        if done.stderr_cut:
            result["stderr_cut_bytes"] = done.stderr_cut
        return result

    return code_execute
