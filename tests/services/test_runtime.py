"""services/runtime.py in this process: what `toolbus up` reads before it starts actors."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from bus.connection import connect
from bus.server import EmbeddedServer, free_port
from bus.streams import provision
from services import config
from services.cli import _actor_settings, build_parser
from services.runtime import _banner, start_actors, stop_actors
from services.workers import worker_command
from tests.conftest import REPO


async def test_up_reads_the_manifest_once_for_every_actor_it_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ns = f"once{uuid.uuid4().hex[:6]}"
    manifest = tmp_path / "m.yaml"
    manifest.write_text(
        "version: 1\ntools:\n  builtins: [echo]\n"
        f"mcps:\n  - id: {ns}\n    transport: stdio\n    command: {sys.executable}\n"
        f"    args: [-m, services.sample_mcp, --transport, stdio]\n    cwd: {REPO}\n"
        "policy:\n  max_parallel: 2\n  max_calls_per_turn: 7\n")
    reads: list[str] = []
    parse = config.parse_manifest

    def counted(text: str, **kw: Any) -> Any:
        reads.append(kw["path"])
        return parse(text, **kw)

    monkeypatch.setattr(config, "parse_manifest", counted)

    settings = _actor_settings(build_parser().parse_args(
        ["up", "--manifest", str(manifest), "--instance", ns]))
    assert reads == [str(manifest)]
    assert settings.manifest is not None and settings.manifest.policy.max_calls_per_turn == 7

    server = EmbeddedServer(tmp_path / "nats", port=free_port()).start()
    bus = await connect(server.url, name="test-runtime")
    try:
        await provision(bus)
        # What `up` starts in one process: executors of every pool, the MCP connector,
        # approval (the manifest's policy) and session actors.
        actors = await start_actors(bus, ["executors", "mcp", "approval", "session"], settings)
        try:
            banner = _banner(server.url, None, None, settings)(actors)
        finally:
            await stop_actors(actors)
    finally:
        await bus.close()
        server.stop()
    assert f"executor {ns} (pool default): built-in:echo" in banner
    assert f"mcp {ns} (stdio command" in banner and f"{ns}:search_cars" in banner
    # A worker process is given the path, and reads the file once itself.
    cmd = worker_command(server.url, settings, instance=f"{ns}-1", parent_pid=1)
    assert cmd[cmd.index("--manifest") + 1] == str(manifest.resolve())
    assert reads == [str(manifest)]
