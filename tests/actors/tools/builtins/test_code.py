"""`code_execute` in real subprocesses: a fresh folder, an environment with only PATH,
and the timeout, output, memory and CPU limits."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from actors.tools import ToolError
from actors.tools.builtins.code import code_tool
from schemas.manifest import CodeConfig
from tests.actors.tools.builtins.conftest import PATH, run_tool


async def test_code_runs_in_a_fresh_folder_with_only_path_in_its_environment() -> None:
    os.environ["TOOLBUS_TEST_SECRET"] = "hunter2"
    try:
        t = code_tool(CodeConfig(languages=["python", "shell"]), path_env=PATH)
        out = await run_tool(t, {"code": "import os, json\n"
                                     "print(json.dumps({'env': sorted(os.environ), "
                                     "'cwd': os.getcwd(), 'files': os.listdir('.')}))"})
    finally:
        del os.environ["TOOLBUS_TEST_SECRET"]
    seen = json.loads(out["stdout"])
    assert out["ok"] and out["exit_code"] == 0
    assert [k for k in seen["env"] if k != "LC_CTYPE"] == ["PATH"]  # no secret leaks
    assert "toolbus-code-" in seen["cwd"] and seen["files"] == ["main.py"]
    assert not Path(seen["cwd"]).exists()  # removed after the run
    sh = await run_tool(t, {"code": "echo $((6*7)); exit 3", "language": "shell"})
    assert sh["stdout"] == "42\n" and sh["exit_code"] == 3 and sh["ok"] is False


async def test_code_timeout_output_cap_and_memory_limit() -> None:
    t = code_tool(CodeConfig(timeout_ms=500, max_output_bytes=1000, memory_mb=64),
                  path_env=PATH)
    with pytest.raises(ToolError, match="longer than 500 ms") as err:
        await run_tool(t, {"code": "import time\ntime.sleep(30)"})
    assert err.value.error_type == "timeout"
    big = await run_tool(t, {"code": "print('x' * 5000)"})
    assert len(big["stdout"]) == 1000 and big["stdout_cut_bytes"] == 4001
    mem = await run_tool(t, {"code": "b = bytearray(512 * 1024 * 1024)"})
    assert mem["exit_code"] != 0 and "MemoryError" in mem["stderr"]
    with pytest.raises(ValueError, match=r"\$\.language"):
        await run_tool(t, {"code": "echo hi", "language": "shell"})  # not enabled here


async def test_code_cpu_limit_stops_a_busy_loop() -> None:
    t = code_tool(CodeConfig(timeout_ms=20_000, cpu_seconds=1), path_env=PATH)
    out = await run_tool(t, {"code": "while True:\n    pass"})
    assert out["ok"] is False and out["signal"] in ("SIGXCPU", "SIGKILL")
    assert out["duration_ms"] < 20_000  # the CPU limit, not the timeout, ended it
