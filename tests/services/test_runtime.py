"""services/runtime.py in this process: what `toolbus up` reads before it starts actors."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from actors.executor import Executor, default_instance_name
from actors.mcp_connector import McpConnector
from bus.catalog import Catalog
from bus.connection import Bus, connect
from bus.server import EmbeddedServer, free_port
from bus.streams import provision
from services import config
from services.commands import _actor_settings, build_parser
from services.config import ActorSettings
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
    import schemas.manifest
    reads: list[str] = []
    parse = schemas.manifest.parse_manifest

    def counted(text: str, **kw: Any) -> Any:
        reads.append(kw["path"])
        return parse(text, **kw)

    # services.config imports it when it reads a manifest (not at start: every command
    # would pay for the manifest's models).
    monkeypatch.setattr(schemas.manifest, "parse_manifest", counted)

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
    cmd = worker_command(settings, instance=f"{ns}-1", parent_pid=1)
    assert cmd[cmd.index("--manifest") + 1] == str(manifest.resolve())
    assert reads == [str(manifest)]
    # The URL holds a password: never on a command line.
    assert not any("@" in part for part in cmd)


async def test_every_executor_of_one_process_gets_its_own_instance_name(
        bus: Bus, tmp_path: Path) -> None:
    ns = f"names{uuid.uuid4().hex[:6]}"
    manifest = tmp_path / "m.yaml"
    manifest.write_text(
        f"version: 1\npools:\n  {ns}: {{}}\ntools:\n  builtins: [echo]\n  http:\n"
        f"    - {{name: '{ns}:fetch', base_url: 'http://127.0.0.1:9', pool: {ns}}}\n"
        f"mcps:\n  - id: {ns}\n    transport: stdio\n    command: {sys.executable}\n"
        f"    args: [-m, services.sample_mcp, --transport, stdio]\n    cwd: {REPO}\n")
    base = default_instance_name()
    # `toolbus up` (and each worker): every pool's executor and the MCP connector's.
    for given, named in ((None, base), (f"{ns}-x", f"{ns}-x")):
        settings = ActorSettings(manifest=config.load_manifest(manifest), instance=given)
        actors = await start_actors(bus, ["executors", "mcp"], settings)
        try:
            connector = next(a for a in actors if isinstance(a, McpConnector))
            executors = [a for a in actors if isinstance(a, Executor)]
            names = {e.instance: e.pool for e in [*executors, *connector.executors.values()]}
            assert names == {f"{named}-default": "default", f"{named}-{ns}": ns,
                             f"{named}-mcp": "default"}
            live = {i.instance: i for i in await Catalog(bus).load_executors()}
            assert {n: live[n].pool for n in names} == names
            assert f"{ns}:search_cars" in live[f"{named}-mcp"].tools
            assert live[f"{named}-default"].tools == ["built-in:echo"]
        finally:
            await stop_actors(actors)


async def test_a_stdio_mcp_server_gets_none_of_toolbus_s_environment(
        bus: Bus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not the actor's NATS credentials, not a provider key: only the SDK's few defaults
    and what its manifest entry gives it."""
    monkeypatch.setenv("NATS_URL", "nats://actor:hunter2@127.0.0.1:4222")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    monkeypatch.setenv("GIVEN", "to-the-server")
    seen = tmp_path / "env.txt"
    manifest = tmp_path / "m.yaml"
    manifest.write_text(
        "mcps:\n"
        f"  - id: envprobe{uuid.uuid4().hex[:6]}\n"
        "    transport: stdio\n"
        "    command: /bin/sh\n"
        f"    args: [-c, 'env > {seen}; exit 3']\n"
        "    env: {MINE: \"${GIVEN}\"}\n"
        "    connect_timeout_s: 5\n")
    settings = ActorSettings(manifest=config.load_manifest(manifest))
    with pytest.raises(Exception, match="exited with code 3"):
        await start_actors(bus, ["mcp"], settings)
    env = dict(line.split("=", 1) for line in seen.read_text().splitlines() if "=" in line)
    assert env["MINE"] == "to-the-server"
    assert "NATS_URL" not in env and "OPENAI_API_KEY" not in env and "GIVEN" not in env
    assert "hunter2" not in seen.read_text() and "sk-secret" not in seen.read_text()
