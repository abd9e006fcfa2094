"""MCP as users run it: `toolbus up --manifest deploy/examples/mcp.yaml`, connector
processes started with `toolbus actor mcp --only ID`, and a start-up that cannot reach a
server."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bus.client import ToolbusClient
from bus.connection import Bus
from bus.server import free_port
from schemas.events import TurnCompleted
from tests.conftest import REPO, EventWatch, Proc, of_type, run_toolbus
from tests.mcp_servers import SampleServer


async def arun(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(run_toolbus, *args, **env)


async def test_up_with_the_example_mcp_manifest_lists_and_calls_mcp_tools(
        tmp_path: Path) -> None:
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
