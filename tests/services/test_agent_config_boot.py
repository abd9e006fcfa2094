"""Seed 000's boot check: once every declared MCP server has listed its tools, each tool
the agent section names must exist, or start-up fails naming it. Against the real sample
server (services/sample_mcp.py), in this process and through `toolbus up`."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from actors.executor import Executor
from actors.mcp_connector import McpConnector
from bus.catalog import Catalog
from bus.connection import Bus
from bus.server import free_port
from schemas.errors import ConfigError
from services import config
from services.config import ActorSettings
from services.runtime import start_actors, stop_actors
from tests.conftest import run_toolbus
from tests.mcp_servers import SampleServer

KEY = "crm-test-key"


def seed_manifest(path: Path, ns: str, port: int, *reevaluation: str,
                  policies: str = "", head: str = "") -> Path:
    """Seed 000's form, with the sample server as `crm` (renamed: the catalog is shared),
    after `head` (toolbus's own sections)."""
    ids = "".join(f"      - id: {i}\n" for i in reevaluation)
    path.write_text(f"""\
{head}agent_config:
  mcps:
    - id: {ns}
      hostname: http://127.0.0.1
      port: {port}
      transport: streamable-http
      api_key: ${{CRM_MCP_KEY}}
  context:
    reevaluation_tools:
{ids}{policies}""")
    return path


@pytest.fixture
async def crm() -> AsyncIterator[SampleServer]:
    # It answers 401 unless `Authorization: Bearer crm-test-key`.
    server = await SampleServer("streamable-http", "--api-key", KEY).start()
    yield server
    server.stop()


@pytest.fixture
def ns() -> str:
    return f"crm{uuid.uuid4().hex[:8]}"


async def test_boot_accepts_reevaluation_tools_the_declared_server_lists(
        bus: Bus, crm: SampleServer, ns: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRM_MCP_KEY", KEY)
    path = seed_manifest(tmp_path / "m.yaml", ns, crm.port, f"{ns}:search_cars",
                         f"{ns}:reserve_car")
    settings = ActorSettings(manifest=config.load_manifest(path), manifest_path=path)
    actors = await start_actors(bus, ["mcp"], settings)
    try:
        connector = next(a for a in actors if isinstance(a, McpConnector))
        # The key from ${CRM_MCP_KEY} went as a bearer: the server listed its tools.
        assert f"{ns}:search_cars" in connector.tools
    finally:
        await stop_actors(actors)


async def test_boot_fails_naming_an_unknown_reevaluation_tool_and_what_the_server_has(
        bus: Bus, crm: SampleServer, ns: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRM_MCP_KEY", KEY)
    path = seed_manifest(tmp_path / "m.yaml", ns, crm.port, f"{ns}:search_cars",
                         f"{ns}:authenticate_customer")
    settings = ActorSettings(manifest=config.load_manifest(path), manifest_path=path)
    with pytest.raises(ConfigError) as info:
        await start_actors(bus, ["mcp"], settings)
    message = str(info.value)
    assert message.startswith(
        f"manifest {path}: agent_config.context.reevaluation_tools[1].id: "
        f"{ns}:authenticate_customer is not a tool of MCP server {ns}, which has ")
    assert message.endswith(f"{ns}:search_cars") and "\n" not in message
    # What it started is stopped again: its executor is no longer announced.
    live = await Catalog(bus).load_executors()
    assert not any(name.startswith(f"{ns}:") for e in live for name in e.tools)


async def test_policies_may_name_local_tools_and_an_unknown_one_fails_the_boot(
        bus: Bus, crm: SampleServer, ns: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRM_MCP_KEY", KEY)
    # Tools served by the planner, not by this worker: a latent tool, the context tools.
    latent = ("tools:\n  latent:\n    - {name: text:sentiment, description: The mood.,\n"
              "       parameters: {type: object, properties: {text: {type: string}}},\n"
              "       output_schema: {type: object, properties: {label: {type: string}}}}\n")
    policy = ("  model: {provider: openai, model: m, base_url: 'http://127.0.0.1:9/v1'}\n"
              f"  policies:\n    - id: book\n      action: Book the car.\n"
              f"      tools: [{ns}:reserve_car, built-in:current_time, built-in:emit_output,\n"
              f"              text:sentiment, built-in:recall]\n"
              f"      reevaluate_after: [built-in:echo, {ns}:reserve_car]\n")
    good = seed_manifest(tmp_path / "good.yaml", ns, crm.port, f"{ns}:search_cars",
                         policies=policy, head=latent)
    settings = ActorSettings(manifest=config.load_manifest(good), manifest_path=good,
                             instance=f"{ns}-x")
    actors = await start_actors(bus, ["executors", "mcp"], settings)
    try:
        assert any(isinstance(a, Executor) for a in actors)
    finally:
        await stop_actors(actors)
    bad = seed_manifest(tmp_path / "bad.yaml", ns, crm.port, f"{ns}:search_cars",
                        policies=policy.replace("built-in:echo", "built-in:ech0"), head=latent)
    settings = ActorSettings(manifest=config.load_manifest(bad), manifest_path=bad,
                             instance=f"{ns}-y")
    with pytest.raises(ConfigError) as info:
        await start_actors(bus, ["executors", "mcp"], settings)
    assert str(info.value) == (
        f"manifest {bad}: agent_config.policies[0].reevaluate_after[0]: built-in:ech0 is not "
        "a tool of namespace built-in (did you mean built-in:echo?), which has "
        "built-in:context-status, built-in:current_time, built-in:echo, built-in:recall")


@pytest.mark.parametrize("workers", ["1", "2"])
def test_toolbus_up_fails_at_boot_with_a_line_naming_the_unknown_tool(
        crm: SampleServer, ns: str, tmp_path: Path, workers: str) -> None:
    path = seed_manifest(tmp_path / "m.yaml", ns, crm.port, f"{ns}:authenticate_customer")
    out = run_toolbus("up", "--port", str(free_port()), "--data-dir", str(tmp_path / "d"),
                      "--manifest", str(path), "--workers", workers, timeout=90,
                      CRM_MCP_KEY=KEY)
    assert out.returncode == 2, out.stderr
    line = (f"toolbus: manifest {path}: agent_config.context.reevaluation_tools[0].id: "
            f"{ns}:authenticate_customer is not a tool of MCP server {ns}, which has ")
    assert any(x.startswith(line) and f"{ns}:search_cars" in x
               for x in out.stderr.splitlines()), out.stderr
    assert "Traceback" not in out.stderr


async def test_an_agent_section_without_a_model_is_said_at_boot(
        bus: Bus, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "m.yaml"
    path.write_text("agent_config:\n  instructions: Be brief.\n")
    settings = ActorSettings(manifest=config.load_manifest(path), manifest_path=path)
    actors = await start_actors(bus, ["planner", "session"], settings)
    try:
        assert [type(a).__name__ for a in actors] == ["SessionActor"]  # no planner
        assert any("agent_config has no model: no planner runs" in r.getMessage()
                   for r in caplog.records)
    finally:
        await stop_actors(actors)
