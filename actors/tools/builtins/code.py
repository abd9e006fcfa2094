"""`built-in:code_execute`: run a Python (or shell) snippet in a subprocess.

Each run gets a fresh temporary folder as its working directory, an environment holding
only PATH (no secret of the executor leaks), CPU-time, address-space and file-size limits,
its own process group (killed whole on timeout), and stdout/stderr capped at
`max_output_bytes` each, with the count of bytes cut. A non-zero exit code is a result
(`ok: false`), not a failure: the model needs the traceback. A timeout is a failure.

This is process isolation, not a sandbox: the code can read what the executor's user can
read and reach the network. Run the tool in a pool of its own (`pool: sandbox`) on
machines where that is acceptable.
"""

from __future__ import annotations

import resource
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from actors.tools import LocalTool, ToolError, tool
from actors.tools.builtins.process import run_capped
from schemas.manifest import CodeConfig


def _limits(cpu_s: int, mem_mb: int) -> Any:
    def apply() -> None:  # pragma: no cover - runs in the child
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        mem = mem_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, 64 << 20))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def code_tool(cfg: CodeConfig, *, path_env: str) -> LocalTool:
    languages = list(cfg.languages)

    @tool("built-in:code_execute", open_world=True, destructive=False, risk_level="high",
          timeout_ms=cfg.timeout_ms + 5_000, source="built-in", pool=cfg.pool,
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
        """Run a short program in a fresh temporary folder and return its exit code,
        stdout and stderr (each capped)."""
        if language not in languages:
            raise ToolError(f"language {language} is not enabled", error_type="invalid_arguments")
        with tempfile.TemporaryDirectory(prefix="toolbus-code-") as tmp:
            if language == "python":
                script = Path(tmp, "main.py")
                argv = [sys.executable, "-I", "-B", str(script)]
            else:
                script = Path(tmp, "main.sh")
                argv = ["/bin/sh", str(script)]
            script.write_text(code)
            t0 = time.perf_counter()
            done = await run_capped(argv, cwd=tmp, env={"PATH": path_env},
                                    timeout_ms=cfg.timeout_ms, cap=cfg.max_output_bytes,
                                    what="the program",
                                    preexec=_limits(cfg.cpu_seconds, cfg.memory_mb))
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
