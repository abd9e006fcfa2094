"""MCP as users run it: `toolbus up --manifest deploy/examples/mcp.yaml`, connector
processes started with `toolbus actor mcp --only ID`, a start-up that cannot reach a
server, one whose stdio server crashes, and Ctrl-C while a server is still connecting."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from bus.client import ToolbusClient
from bus.connection import Bus
from bus.server import free_port
from schemas.events import TurnCompleted
from tests.conftest import REPO, EventWatch, Proc, of_type, run_toolbus, toolbus_cmd
from tests.mcp_servers import SampleServer, process_alive, read_pid


async def arun(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(run_toolbus, *args, **env)


async def test_up_with_the_example_mcp_manifest_lists_and_calls_mcp_tools(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The CLI borrows each role's credentials from the data dir for `--nats` URLs naming
    # this server's address.
    monkeypatch.setenv("TOOLBUS_DATA_DIR", str(tmp_path / "data"))
    cars = await SampleServer().start()
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    up = Proc("up", "--port", str(port), "--data-dir", str(tmp_path / "data"), "--manifest",
              str(REPO / "deploy/examples/mcp.yaml"), ready="stop:",
              env={"CARS_PORT": str(cars.port), "PYTHON": sys.executable})
    try:
        banner = await up.wait_ready()
        assert f"mcp cars (streamable-http http://127.0.0.1:{cars.port}/mcp)" in banner
        assert "mcp fleet (stdio command" in banner and "fleet:search_cars" in banner
        tools = await arun("tools", "--nats", url)
        line = next(x for x in tools.stdout.splitlines() if x.startswith("cars:search_cars"))
        assert "read-only" in line and "source=mcp:cars" in line
        show = json.loads((await arun("tools", "show", "cars:reserve_car", "--nats", url)).stdout)
        assert show["description"].startswith("Reserve a car for a customer.")
        out = await arun("call", "cars:search_cars", '{"max_price": 60}', "--nats", url)
        assert out.returncode == 0, out.stderr
        assert [c["id"] for c in json.loads(out.stdout)["cars"]] == ["c1", "c2"]
        text = await arun("call", "fleet:describe_car", '{"car_id": "c4"}', "--nats", url)
        assert json.loads(text.stdout) == "Tesla Model 3, 5 seats, 95.0/day"
        mcp_list = json.loads((await arun("tools", "export", "--format", "mcp",
                                          "--nats", url)).stdout)
        assert "cars.search_cars" in {t["name"] for t in mcp_list["tools"]}
    finally:
        up.stop()
        cars.stop()


async def test_connector_processes_for_one_server_share_its_calls(
        bus: Bus, client: ToolbusClient, system: dict[str, Any], nats_url: str,
        tmp_path: Path) -> None:
    cars = await SampleServer().start()
    ns = f"mcpshared{uuid.uuid4().hex[:6]}"
    manifest = tmp_path / "m.yaml"
    manifest.write_text(f"mcps:\n  - id: {ns}\n    hostname: http://127.0.0.1\n"
                        f"    port: {cars.port}\n  - id: other{ns}\n    hostname: http://nowhere.invalid\n"
                        f"    port: 1\n")
    procs = [Proc("actor", "mcp", "--manifest", str(manifest), "--only", ns, "--nats",
                  nats_url, "--instance", f"conn-{i}", "--max-in-flight", "2",
                  ready="mcp actor") for i in (1, 2)]
    sid = f"t-{uuid.uuid4().hex[:12]}"
    try:
        for p in procs:
            await p.wait_ready()
        await system["catalog"]._specs.wait_until(lambda items: f"{ns}.fleet_report" in items, 5)
        async with EventWatch(bus, sid) as watch:
            # 8 slow calls, 2 at a time per process: both processes must take some.
            ends = await asyncio.gather(*(client.call(
                sid, [{"tool": f"{ns}:fleet_report",
                       "arguments": {"steps": 2, "step_seconds": 0.2}}],
                request_id=f"r{i}", timeout=30) for i in range(8)))
            events = await watch.until(lambda evs: len(of_type(evs, "turn.completed")) == 8)
        assert all(isinstance(e, TurnCompleted) and e.ok for e in ends)
        executors = {s.executor for s in of_type(events, "call.started")}
        assert executors == {"conn-1", "conn-2"}
    finally:
        for p in procs:
            p.stop()
        cars.stop()


def test_up_fails_clearly_and_in_bounded_time_when_an_mcp_server_is_unreachable(
        tmp_path: Path) -> None:
    dead = free_port()
    manifest = tmp_path / "m.yaml"
    manifest.write_text(f"mcps:\n  - id: ghost\n    hostname: http://127.0.0.1\n"
                        f"    port: {dead}\n    connect_timeout_ms: 2000\n")
    t0 = time.monotonic()
    out = run_toolbus("up", "--port", str(free_port()), "--data-dir", str(tmp_path / "d"),
                      "--manifest", str(manifest), timeout=60)
    assert out.returncode == 3, out.stderr
    assert (f"MCP server ghost is unreachable: tried streamable-http "
            f"http://127.0.0.1:{dead}/mcp") in out.stderr
    assert time.monotonic() - t0 < 30  # the 2 s connect timeout, plus process start-up


def _stdio_manifest(path: Path, *args: str, connect_timeout_s: float = 30) -> Path:
    path.write_text(
        f"mcps:\n  - id: fleet\n    transport: stdio\n    command: {sys.executable}\n"
        f"    args: {json.dumps(['-m', 'tests.mcp_servers', '--transport', 'stdio', *args])}\n"
        f"    cwd: {REPO}\n    connect_timeout_s: {connect_timeout_s}\n")
    return path


@pytest.mark.parametrize(("sig", "workers"), [
    pytest.param(signal.SIGINT, "1", id="ctrl-c-one-process"),
    pytest.param(signal.SIGINT, "2", id="ctrl-c-in-a-worker"),
    pytest.param(signal.SIGTERM, "2", id="sigterm-in-a-worker"),
])
async def test_a_signal_stops_up_within_5_s_while_a_mute_stdio_server_is_connecting(
        tmp_path: Path, sig: signal.Signals, workers: str) -> None:
    """A server that never answers `initialize`, with a 10-minute connect timeout: Ctrl-C
    (or SIGTERM) still stops `toolbus up` at once, and no server process is left behind.
    With `--workers 2` the server is a worker's child."""
    pid_file = tmp_path / "mute.pid"
    manifest = _stdio_manifest(tmp_path / "m.yaml", "--mute", "--pid-file", str(pid_file),
                               connect_timeout_s=600)
    up = subprocess.Popen(  # noqa: ASYNC220  # spawning does not block
        toolbus_cmd("up", "--no-auth", "--port", str(free_port()), "--data-dir",
                    str(tmp_path / "data"), "--workers", workers, "--manifest",
                    str(manifest)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    pid = None
    try:
        pid = await read_pid(pid_file, timeout=30)  # it is connecting now
        up.send_signal(sig)
        code = await asyncio.to_thread(up.wait, 5)  # TimeoutExpired fails the test
        stderr = up.stderr.read() if up.stderr else ""
        assert code == 130, stderr
        assert "toolbus: stopped during start-up (a signal arrived)" in stderr
        assert "Traceback" not in stderr
        assert not process_alive(pid)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)
        for stream in (up.stdout, up.stderr):
            if stream:
                stream.close()
        if pid is not None and process_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_up_reports_a_stdio_server_that_crashes_at_start_up_with_its_exit_code_and_stderr(
        tmp_path: Path) -> None:
    manifest = _stdio_manifest(tmp_path / "m.yaml", "--crash", "3")
    out = run_toolbus("up", "--no-auth", "--port", str(free_port()), "--data-dir",
                      str(tmp_path / "d"), "--workers", "1", "--manifest", str(manifest),
                      timeout=60)
    assert out.returncode == 3, out.stderr
    line = next(x for x in out.stderr.splitlines() if x.startswith("toolbus: MCP server"))
    assert line.startswith("toolbus: MCP server fleet is unreachable: tried stdio command ")
    assert ("the server process exited with code 3 before it answered initialize; its "
            "stderr ended with: fleet-mcp 1.0 starting | error: DATABASE_URL is not set; "
            "cannot load the fleet") in line
    assert "Traceback" not in out.stderr
