"""Tools as users deploy them: a tool module in an executor subprocess, and `toolbus up
--manifest` with the example manifest, driven through the CLI."""

from __future__ import annotations

import asyncio
import http.server
import json
import subprocess
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from actors.executor import Executor
from actors.tools import tool
from bus.catalog import Catalog
from bus.connection import Bus
from bus.server import free_port
from schemas.tools import ToolSpec
from tests.conftest import REPO, Proc, run_toolbus


async def arun(*args: str) -> subprocess.CompletedProcess[str]:
    """`run_toolbus` off the event loop, which the in-process actors need meanwhile."""
    return await asyncio.to_thread(run_toolbus, *args)


async def test_a_user_tool_module_runs_in_an_executor_and_is_called_from_the_cli(
        nats_url: str, system: dict[str, Any]) -> None:
    executor = Proc("actor", "executor", "--tools", "tests/sdk_toolkit.py",
                    "--instance", "user-tools", "--nats", nats_url, ready="executor actor")
    try:
        await executor.wait_ready()
        show = await arun("tools", "show", "shipping:quote", "--nats", nats_url)
        assert show.returncode == 0, show.stderr
        schema = json.loads(show.stdout)
        assert schema["_tool"] == "shipping:quote"
        assert schema["description"] == "Quote the price of shipping one parcel."
        assert schema["properties"]["speed"]["enum"] == ["standard", "express"]
        assert schema["required"] == ["address"] and "Address" in schema["$defs"]
        assert schema["_output"]["properties"]["price"]["type"] == "number"
        assert schema["_annotations"]["readOnlyHint"] is True
        assert schema["_source"] == "python:tests.sdk_toolkit"

        args = '{"address": {"street": "1 rue X", "city": "Lyon", "zip": "69001"}}'
        out = await arun("call", "shipping:quote", args, "--nats", nats_url,
                          "--reasoning", "the user asked for a price")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == {"city": "Lyon", "price": 9.0, "express": False}

        bad = await arun("call", "shipping:quote", '{"address": {"zip": "x"}, "speed": 1}',
                          "--nats", nats_url)
        assert bad.returncode == 1
        assert "invalid_arguments" in bad.stderr and "5 violations" in bad.stderr
        for where in ("$.address", "$.address.zip", "$.speed"):
            assert where in bad.stderr

        listed = await arun("tools", "--nats", nats_url)
        line = next(x for x in listed.stdout.splitlines() if x.startswith("shipping:label"))
        assert "approval" in line and "risk=high" in line
        live = await arun("executors", "--nats", nats_url)
        assert "user-tools  pool=default" in live.stdout
    finally:
        executor.stop()


class _Tickets(http.server.BaseHTTPRequestHandler):
    received: list[dict[str, Any]] = []

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Tickets.received.append({"path": self.path, "body": body,
                                  "auth": self.headers.get("Authorization")})
        data = json.dumps({"id": len(_Tickets.received), **body}).encode()
        self.send_response(201)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


async def _pending(url: str) -> str:
    """`toolbus approvals` output once something is pending (bounded)."""
    async with asyncio.timeout(20):
        while True:
            out = await arun("approvals", "--nats", url)
            if out.stdout.strip():
                return out.stdout
            await asyncio.sleep(0.2)  # another process's state: poll the CLI


async def test_up_with_the_example_manifest_serves_its_tools(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The CLI borrows each role's credentials (client, approver) from the data dir for
    # `--nats` URLs naming this server's address.
    monkeypatch.setenv("TOOLBUS_DATA_DIR", str(tmp_path / "data"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Tickets)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    env = {"TICKETS_URL": f"http://127.0.0.1:{server.server_address[1]}",
           "TICKETS_TOKEN": "s3cret", "TAVILY_API_KEY": ""}
    up = Proc("up", "--port", str(port), "--data-dir", str(tmp_path / "data"), "--manifest",
              str(REPO / "deploy/examples/manifest.yaml"), ready="stop:", env=env)
    try:
        banner = await up.wait_ready()
        assert "(pool sandbox): built-in:code_execute" in banner
        assert "tickets:create_ticket" in banner and "built-in:git_read" in banner

        # A POST is mutating and the tool is not auto_approve: the call waits for a human,
        # who approves it from another process with the CLI.
        call = asyncio.create_task(arun(
            "call", "tickets:create_ticket",
            '{"path": "/tickets", "body": {"title": "printer on fire"}}',
            "--session", "m1", "--nats", url, "--reasoning", "the user said so",
            "--output-path", "last.ticket"))
        pending = await _pending(url)
        assert "tickets:create_ticket" in pending and "policy:mutating" in pending
        call_id = pending.split()[0]
        assert _Tickets.received == []  # nothing ran before the approval
        ok = await arun("approve", call_id, "--note", "looks fine", "--by", "ops", "--nats", url)
        assert ok.returncode == 0 and f"{call_id}: approved" in ok.stderr
        again = await arun("deny", call_id, "--reason", "changed my mind", "--session", "m1",
                           "--nats", url)
        assert again.returncode == 1 and "already decided: approved by ops" in again.stderr
        out = await call
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert result["ok"] and result["status"] == 201 and result["data"]["id"] == 1
        assert _Tickets.received == [{"path": "/tickets", "body": {"title": "printer on fire"},
                                      "auth": "Bearer s3cret"}]
        get = run_toolbus("call", "tickets:create_ticket", '{"path": "/t", "method": "GET"}',
                          "--nats", url)
        assert get.returncode == 1 and "is not one of" in get.stderr and "POST" in get.stderr

        # code_execute runs in the sandbox but is not auto-approved: a human approves it.
        code_call = asyncio.create_task(arun(
            "call", "built-in:code_execute", '{"code": "print(6*7)"}', "--nats", url))
        code_id = (await _pending(url)).split()[0]
        ok = await arun("approve", code_id, "--by", "ops", "--nats", url)
        assert ok.returncode == 0, ok.stderr
        code = await code_call
        assert code.returncode == 0 and json.loads(code.stdout)["stdout"] == "42\n"
        log = run_toolbus("call", "built-in:git_read", '{"command": "log -1 --format=%H"}',
                          "--nats", url)
        assert log.returncode == 0 and len(json.loads(log.stdout)["output"].strip()) == 40
        search = run_toolbus("call", "built-in:web_search", '{"query": "x"}', "--nats", url)
        assert search.returncode == 1 and "set TAVILY_API_KEY" in search.stderr

        for fmt in ("openai", "anthropic", "gemini", "mcp"):
            exported = run_toolbus("tools", "export", "--format", fmt, "--nats", url)
            assert exported.returncode == 0, exported.stderr
            assert "tickets__create_ticket" in exported.stdout or \
                "tickets.create_ticket" in exported.stdout
        replay = run_toolbus("replay", "m1", "--nats", url)
        assert "tickets:create_ticket" in replay.stdout and "turn.completed" in replay.stdout
        assert "reason: the user said so" in replay.stdout
        state = json.loads(run_toolbus("state", "m1", "--nats", url).stdout)
        assert state["data"]["last"]["ticket"]["data"]["id"] == 1
    finally:
        up.stop()
        server.shutdown()
        server.server_close()


def test_a_bad_manifest_stops_up_before_anything_starts(tmp_path: Path) -> None:
    bad = tmp_path / "m.yaml"
    bad.write_text("tools:\n  http:\n    - name: a:b\n      base_url: ${NOPE_NOT_SET}\n")
    out = run_toolbus("up", "--port", str(free_port()), "--data-dir", str(tmp_path / "d"),
                      "--manifest", str(bad))
    assert out.returncode == 2
    assert "tools.http[0].base_url: ${NOPE_NOT_SET} is not set" in out.stderr


async def test_a_composed_export_checks_its_output_schema(
        nats_url: str, system: dict[str, Any], tmp_path: Path) -> None:
    for text, says in (('{"type": "nope"}', "invalid JSON Schema"),
                       ("[1]", "a JSON Schema is an object"), ("{", ""),
                       # valid alone, broken once nested under the composed `output`
                       ('{"$defs": {"x": {"type": "string"}}, "$ref": "#/$defs/x"}',
                        "invalid JSON Schema"),
                       ("[" * 5000 + "]" * 5000, "")):
        schema = tmp_path / "out.json"
        schema.write_text(text)
        bad = await arun("tools", "export", "--format", "composed", "--output-schema",
                         str(schema), "--nats", nats_url)
        assert bad.returncode == 2 and bad.stdout == "", bad.stderr
        assert f"--output-schema {schema}: {says}" in bad.stderr.strip().splitlines()[-1]
    schema.write_text('{"type": "object"}')
    ok = await arun("tools", "export", "--format", "composed", "--output-schema", str(schema),
                    "--nats", nats_url)
    assert ok.returncode == 0 and json.loads(ok.stdout), ok.stderr


async def test_call_takes_an_agent_whose_grants_apply(
        nats_url: str, system: dict[str, Any]) -> None:
    ok = await arun("call", "built-in:echo", '{"a": 1}', "--agent", "restricted",
                    "--nats", nats_url)
    assert ok.returncode == 0 and json.loads(ok.stdout) == {"a": 1}, ok.stderr
    no = await arun("call", "testing:probe", '{"label": "x"}', "--agent", "restricted",
                    "--nats", nats_url)
    assert no.returncode == 1
    assert "testing:probe rejected (policy_denied): agent restricted is not granted " \
        "testing:probe" in no.stderr


async def test_tools_remove_refuses_a_tool_a_live_executor_serves_unless_forced(
        bus: Bus, nats_url: str, system: dict[str, Any]) -> None:
    ns = f"served{uuid.uuid4().hex[:6]}"

    @tool(f"{ns}:ping", read_only=True)
    async def ping() -> str:
        return "pong"

    catalog = Catalog(bus)
    executor = Executor(bus, [ping], instance=f"{ns}-1")
    await executor.start()
    try:
        refused = await arun("tools", "remove", f"{ns}:ping", "--nats", nats_url)
        assert refused.returncode == 1
        assert f"{ns}:ping is served by live executor(s) {ns}-1 (pool default" in \
            refused.stderr
        assert "stop them first, or pass --force" in refused.stderr
        assert f"{ns}:ping" in [s.name for s in await catalog.load()]
        forced = await arun("tools", "remove", f"{ns}:ping", "--force", "--nats", nats_url)
        assert forced.returncode == 0 and f"removed {ns}:ping" in forced.stderr
        assert f"{ns}:ping" not in [s.name for s in await catalog.load()]
    finally:
        await executor.stop()
    # A tool whose executors are gone is removed without --force.
    await catalog.register([ToolSpec(name=f"{ns}:gone", source="python:gone")])
    gone = await arun("tools", "remove", f"{ns}:gone", "--nats", nats_url)
    assert gone.returncode == 0 and f"removed {ns}:gone" in gone.stderr
