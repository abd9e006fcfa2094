"""The HTTP gateway, over real HTTP on a free port against the real NATS fixture: tokens
and roles, the Host and Origin checks, JSON-only bodies and their limits, the OpenAPI
document, the ports it cannot listen on; and `toolbus up --http-port` end to end."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from bus.approvals import ApprovalStore
from bus.client import ToolbusClient
from bus.connection import Bus, connect
from bus.server import EmbeddedServer, free_port
from bus.streams import provision
from schemas.errors import ConfigError
from schemas.events import Event
from services import gateway as gateway_module
from services.gateway import ROLES, build_app
from services.runtime import start_gateway
from tests.conftest import EventWatch, Proc, of_type, run_toolbus

DEEP = b"[" * 10_000 + b"]" * 10_000


@dataclass
class Web:
    url: str
    tokens: dict[str, str]  # role -> its bearer token

    def as_role(self, role: str | None, **headers: str) -> httpx.AsyncClient:
        if role is not None:
            headers["Authorization"] = f"Bearer {self.tokens[role]}"
        # trust_env off: no proxy from the environment between the test and the gateway.
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=10,
                                 trust_env=False)


async def _serve(bus: Bus, **options: Any) -> AsyncIterator[Web]:
    tokens = {role: secrets.token_urlsafe(32) for role in ROLES}
    port = free_port()
    gateway = await start_gateway(bus, port, tokens={t: r for r, t in tokens.items()},
                                  **options)
    try:
        yield Web(f"http://127.0.0.1:{port}", tokens)
    finally:
        await gateway.stop()


@pytest.fixture
async def web(bus: Bus, system: dict[str, Any]) -> AsyncIterator[Web]:
    async for w in _serve(bus):
        yield w


async def _pending_call(web: Web, bus: Bus, sid: str) -> str:
    """Request a call the test policy gives to a human; its call id once it waits."""
    async with EventWatch(bus, sid) as watch, web.as_role("client") as c:
        sent = await c.post(f"/sessions/{sid}/requests", json={
            "request_id": "w1", "calls": [{"tool": "approvals:write",
                                           "arguments": {"text": "hi"}}]})
        assert sent.status_code == 202, sent.text
        events = await watch.until(lambda evs: bool(of_type(evs, "approval.requested")))
    call_id: str = of_type(events, "approval.requested")[0].call_id
    return call_id


async def _ended(bus: Bus, sid: str) -> list[Event]:
    """The session's events, once a turn of it has ended."""
    async with EventWatch(bus, sid) as watch:
        return await watch.until(lambda evs: bool(of_type(evs, "turn.completed") or
                                                  of_type(evs, "turn.failed")))


# --- tokens and roles ----------------------------------------------------------------------


async def test_healthz_needs_no_token_and_tells_nothing(web: Web) -> None:
    async with web.as_role(None) as anyone:
        got = await anyone.get("/healthz")
        probed = await anyone.head("/healthz")  # as some load balancers ask
    assert got.status_code == 200 and got.json() == {"ok": True}
    assert probed.status_code == 200 and probed.content == b""


async def test_every_route_but_healthz_refuses_no_token_and_a_wrong_token(
        web: Web) -> None:
    routes = [("POST", "/sessions/s1/requests"), ("GET", "/sessions/s1/state"),
              ("GET", "/approvals"), ("POST", "/approvals/s1/c-0"), ("GET", "/openapi.json")]
    async with web.as_role(None) as anyone:
        for method, path in routes:
            for headers in ({}, {"Authorization": f"Bearer {secrets.token_urlsafe(32)}"},
                            {"Authorization": f"Basic {web.tokens['admin']}"},
                            {"Authorization": f"Bearer {web.tokens['admin'][:-1]}"}):
                got = await anyone.request(method, path, json={"calls": []}, headers=headers)
                assert got.status_code == 401, (method, path, headers, got.text)
                assert got.headers["WWW-Authenticate"].startswith("Bearer")
                assert got.json()["ok"] is False and "token" in got.json()["error"]


async def test_a_client_token_submits_and_reads_state_but_cannot_touch_approvals(
        web: Web, bus: Bus, sid: str) -> None:
    call_id = await _pending_call(web, bus, sid)  # submitted with the client token
    async with web.as_role("client") as c:
        state = await c.get(f"/sessions/{sid}/state")
        assert state.status_code == 200 and call_id in state.json()["calls"]
        listed = await c.get("/approvals")
        assert listed.status_code == 403 and "approver or admin" in listed.json()["error"]
        decided = await c.post(f"/approvals/{sid}/{call_id}", json={"decision": "approve"})
        assert decided.status_code == 403
    assert (sid, call_id) in {(p.session_id, p.call_id) for p in await ApprovalStore(bus).load()}


async def test_an_approver_token_lists_and_decides_and_is_recorded_as_the_principal(
        web: Web, bus: Bus, sid: str) -> None:
    call_id = await _pending_call(web, bus, sid)
    async with web.as_role("approver") as a:
        listed = await a.get("/approvals")
        assert listed.status_code == 200
        assert [p["tool"] for p in listed.json()
                if (p["session_id"], p["call_id"]) == (sid, call_id)] == \
            ["approvals:write"]
        url = f"/approvals/{sid}/{call_id}"
        ok = await a.post(url, json={"decision": "approve", "by": "ada", "note": "fine"})
        assert ok.status_code == 200 and ok.json() == {"ok": True, "decision": "approved"}
        again = await a.post(url, json={"decision": "deny", "by": "bob", "reason": "no"})
        assert again.status_code == 409 and "approved by ada" in again.json()["error"]
        assert again.json()["code"] == "conflict"
        bad = await a.post(url, content=b"not json",
                           headers={"Content-Type": "application/json"})
        assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]
        # The actor's refusal of a body, in the code every other route gives.
        odd = await a.post(url, json={"decision": "maybe"})
        assert odd.status_code == 400 and odd.json()["code"] == "invalid_request", odd.json()
        missing = await a.post(f"/approvals/{sid}/nope-0", json={"decision": "approve"})
        assert missing.status_code == 404 and missing.json()["code"] == "not_found"
        wrong_id = await a.post(f"/approvals/{sid}/a.b", json={"decision": "approve"})
        assert wrong_id.status_code == 400 and "call id" in wrong_id.json()["error"]
    granted = of_type(await _ended(bus, sid), "approval.granted")
    assert [(g.by, g.principal) for g in granted] == [("ada", "http-approver")]


# --- what a web page elsewhere can do: nothing ---------------------------------------------


async def test_cross_origin_and_text_plain_posts_approve_and_submit_nothing(
        web: Web, bus: Bus, sid: str) -> None:
    call_id = await _pending_call(web, bus, sid)
    evil = {"Origin": "https://evil.example", "Content-Type": "text/plain"}
    decision = b'{"decision": "approve", "by": "mallory"}'
    request = b'{"request_id": "evil", "calls": [{"tool": "built-in:echo", "arguments": {}}]}'
    refused = []
    # A page's form or fetch: no token of ours, its own Origin, a "simple" content type.
    async with web.as_role(None) as page:
        refused.append(await page.post(f"/approvals/{sid}/{call_id}", content=decision,
                                       headers=evil))
        refused.append(await page.post(f"/sessions/{sid}/requests", content=request,
                                       headers=evil))
    # Even holding a token: a foreign Origin, or a body that is not declared JSON.
    for role, headers in (("admin", evil), ("admin", {"Origin": "null"}),
                          ("admin", {"Content-Type": "text/plain"}),
                          ("admin", {"Sec-Fetch-Site": "cross-site",
                                     "Content-Type": "application/json"})):
        async with web.as_role(role, **headers) as c:
            refused.append(await c.post(f"/approvals/{sid}/{call_id}", content=decision))
            refused.append(await c.post(f"/sessions/{sid}/requests", content=request))
    assert [r.status_code for r in refused] == [403, 403] + [403, 403] * 2 + [415, 415] + \
        [403, 403]
    assert "origin 'https://evil.example' is not allowed" in refused[0].json()["error"]
    assert "Content-Type: application/json" in refused[-3].json()["error"]
    # Nothing was approved: the call still waits, and a real decision is the first one.
    assert (sid, call_id) in {(p.session_id, p.call_id) for p in await ApprovalStore(bus).load()}
    async with web.as_role("approver") as a:
        denied = await a.post(f"/approvals/{sid}/{call_id}",
                              json={"decision": "deny", "by": "ada", "reason": "test"})
    assert denied.status_code == 200 and denied.json()["decision"] == "denied"
    events = await _ended(bus, sid)
    assert not of_type(events, "approval.granted")
    assert [d.by for d in of_type(events, "approval.denied")] == ["ada"]
    # Nothing was submitted: the session saw its one turn, never the page's request.
    assert [t.request_id for t in of_type(events, "turn.requested")] == ["w1"]
    assert not of_type(events, "request.rejected")


async def test_a_host_not_in_the_allow_list_is_refused(web: Web, bus: Bus) -> None:
    port = web.url.rsplit(":", 1)[1]
    async with web.as_role("admin") as c:
        for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1.evil.example:{port}",
                     "localhost:x", ""):
            got = await c.get("/approvals", headers={"Host": host})
            assert got.status_code == 400, host
            assert "is not served here" in got.json()["error"]
        for host in (f"localhost:{port}", f"LOCALHOST:{port}", f"[::1]:{port}", "127.0.0.1"):
            assert (await c.get("/approvals", headers={"Host": host})).status_code == 200
    for twice in (b"Host: 127.0.0.1\r\nHost: evil.example", b"Host: 127.0.0.1\r\n"
                  b"Origin: https://ui.example\r\nOrigin: https://evil.example"):
        # httpx will not send two: over a raw connection.
        reader, writer = await asyncio.open_connection("127.0.0.1", int(port))
        writer.write(b"GET /approvals HTTP/1.1\r\n" + twice + b"\r\nAuthorization: Bearer " +
                     web.tokens["admin"].encode() + b"\r\nConnection: close\r\n\r\n")
        async with asyncio.timeout(10):
            answer = await reader.read()
        writer.close()
        assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]  # by h11 or by us
    async for other in _serve(bus, allowed_hosts=["toolbus.internal"]):
        async with other.as_role("admin") as c:
            assert (await c.get("/healthz")).status_code == 400  # 127.0.0.1 no longer
            named = await c.get("/approvals", headers={"Host": "toolbus.internal:80"})
            assert named.status_code == 200


async def test_an_allowed_origin_gets_cors_answers_and_others_still_nothing(
        bus: Bus, system: dict[str, Any]) -> None:
    async for web in _serve(bus, allowed_origins=["https://ui.example"]):
        async with web.as_role(None) as page:
            preflight = await page.options("/approvals", headers={
                "Origin": "https://ui.example", "Access-Control-Request-Method": "GET",
                "Access-Control-Request-Headers": "authorization"})
            assert preflight.status_code == 200
            assert preflight.headers["access-control-allow-origin"] == "https://ui.example"
            other = await page.options("/approvals", headers={
                "Origin": "https://evil.example", "Access-Control-Request-Method": "GET"})
            assert other.status_code == 403
        async with web.as_role("approver", Origin="https://ui.example") as ui:
            got = await ui.get("/approvals")
            assert got.status_code == 200
            assert got.headers["access-control-allow-origin"] == "https://ui.example"


# --- bodies --------------------------------------------------------------------------------


async def test_a_deeply_nested_or_oversized_body_is_a_4xx_and_submits_nothing(
        web: Web, bus: Bus, sid: str) -> None:
    json_type = {"Content-Type": "application/json"}
    async with web.as_role("admin") as c:
        deep = await c.post(f"/sessions/{sid}/requests", content=DEEP, headers=json_type)
        assert deep.status_code == 400
        assert deep.json()["error"] == "body nests deeper than 64 levels"
        deep_decision = await c.post(f"/approvals/{sid}/c-0", content=DEEP, headers=json_type)
        assert deep_decision.status_code == 400
        big = {"request_id": "big", "calls": [{"tool": "built-in:echo",
                                               "arguments": {"text": "x" * 300_000}}]}
        assert (await c.post(f"/sessions/{sid}/requests", json=big)).status_code == 413

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it comes
            yield b'{"calls": [], "pad": "'
            for _ in range(300):
                yield b"x" * 1024
            yield b'"}'

        streamed = await c.post(f"/sessions/{sid}/requests", content=chunks(),
                                headers=json_type)
        assert streamed.status_code == 413
        ok = await c.post(f"/sessions/{sid}/requests", json={
            "request_id": "good", "calls": [{"tool": "built-in:echo",
                                             "arguments": {"text": "hi"}}]})
        assert ok.status_code == 202 and ok.json()["turn_id"] == "good"
    events = await _ended(bus, sid)
    assert [t.request_id for t in of_type(events, "turn.requested")] == ["good"]


async def test_a_body_that_can_never_be_a_request_is_a_400_naming_why_and_submits_nothing(
        web: Web, bus: Bus, sid: str) -> None:
    bad = [([1, 2], "request must be a JSON object, got an array"),
           ({"calls": 3}, "calls must be a list of calls, got a number"),
           ({}, "a request needs calls (explicit tool calls), message or messages"),
           ({"request_id": "r1"}, "a request needs calls (explicit tool calls), message"),
           ({"message": None}, "message must be a non-empty string, got null"),
           ({"message": "  "}, "message must be a non-empty string"),
           ({"request_id": "r", "colls": []}, "unknown field(s) colls")]
    async with web.as_role("client") as c:
        for body, why in bad:
            got = await c.post(f"/sessions/{sid}/requests", json=body)
            assert got.status_code == 400, (body, got.text)
            assert got.json()["ok"] is False and got.json()["code"] == "invalid_request"
            assert why in got.json()["error"], (body, got.json())
        event = await c.post(f"/sessions/{sid}/requests", json={
            "tool_id": "crm:lookup", "result": {"a": 1}, "idempotency_key": "k1"})
        assert event.status_code == 400 and "/tool_events" in event.json()["error"]
        # toolbus's own session takes no request: refused here, not after a 202.
        own = await c.post("/sessions/_toolbus/requests", json={"message": "x"})
        assert own.status_code == 400 and "toolbus's own session" in own.json()["error"]
        own = await c.post("/sessions/_toolbus/tool_events", json={
            "tool_id": "crm:lookup", "result": {"a": 1}, "idempotency_key": "k1"})
        assert own.status_code == 400 and "toolbus's own session" in own.json()["error"]
        long = await c.post(f"/sessions/{sid}/requests", json={"message": "x" * 70_000})
        assert long.status_code == 413 and long.json()["code"] == "payload_too_large"
        # Under the gateway's 256 KiB but over the session actor's 128 KiB: refused here
        # too, not accepted and then rejected in the session.
        history = [{"role": "user", "content": "y" * 60_000}] * 3
        over = await c.post(f"/sessions/{sid}/requests", json={"messages": history})
        assert over.status_code == 413 and over.json()["code"] == "payload_too_large", over.text
        # A request the session refuses for what only it knows (here: its tool is not in
        # the catalog) is still accepted here, and its refusal is stored in the session.
        sent = await c.post(f"/sessions/{sid}/requests", json={
            "request_id": "unknown", "calls": [{"tool": "nowhere:none", "arguments": {}}]})
        assert sent.status_code == 202, sent.text
    events = await _ended(bus, sid)
    assert [t.request_id for t in of_type(events, "turn.requested")] == ["unknown"]
    assert not of_type(events, "request.rejected")  # the bad bodies never reached the bus
    assert [r.call_id for r in of_type(events, "call.rejected")] == ["unknown-0"]


async def test_state_keeps_full_and_its_headers(web: Web, bus: Bus, sid: str) -> None:
    async with web.as_role("client") as c:
        sent = await c.post(f"/sessions/{sid}/requests", json={
            "request_id": "r1", "calls": [{"tool": "testing:blob",
                                           "arguments": {"size": 300_000}}]})
        assert sent.status_code == 202
        await _ended(bus, sid)
        full = await c.get(f"/sessions/{sid}/state", params={"full": "1"})
        assert full.status_code == 200
        assert full.headers["X-Toolbus-Resolved-References"] == "1"
        assert full.json()["calls"]["r1-0"]["result"] == "x" * 300_000
        # As ?stream= takes it: `True` (Python's str(True)) is true, not silently ignored,
        # and a word it does not know is a 400.
        capital = await c.get(f"/sessions/{sid}/state", params={"full": "True"})
        assert capital.headers.get("X-Toolbus-Resolved-References") == "1"
        odd = await c.get(f"/sessions/{sid}/state", params={"full": "yes"})
        assert odd.status_code == 400 and "?full=" in odd.json()["error"], odd.text
        assert (await c.get("/sessions/bad%20id/state")).status_code == 400
        bad_id = await c.post("/sessions/bad%20id/requests", json={})
        # Every error answer says {ok, error, code}.
        assert bad_id.status_code == 400 and bad_id.json()["code"] == "invalid_request"
        assert bad_id.json()["ok"] is False and "session id" in bad_id.json()["error"]


async def test_state_full_puts_back_no_more_than_the_context_tools_read(
        monkeypatch: pytest.MonkeyPatch, web: Web, bus: Bus, sid: str) -> None:
    """`?full=1` decodes stored results in toolbus up's process, for any client: up to
    the bound the compressor and recall keep (lowered here), the rest left as
    references and counted, not every result of the session (each up to 256 MiB)."""
    import actors.compressor

    monkeypatch.setattr(actors.compressor, "MAX_READ_RESULT_BYTES", 400_000)
    async with web.as_role("client") as c:
        sent = await c.post(f"/sessions/{sid}/requests", json={
            "request_id": "r1", "calls": [{"tool": "testing:blob",
                                           "arguments": {"size": 300_000}}] * 2})
        assert sent.status_code == 202
        await _ended(bus, sid)
        full = await c.get(f"/sessions/{sid}/state", params={"full": "1"})
        assert full.status_code == 200
        assert full.headers["X-Toolbus-Resolved-References"] == "1"
        assert full.headers["X-Toolbus-Unresolved-References"] == "1"
        calls = full.json()["calls"]
        assert calls["r1-0"]["result"] == "x" * 300_000
        assert calls["r1-1"]["result"] is None
        assert calls["r1-1"]["result_ref"]["size"] == 300_002


async def large_session(client: ToolbusClient, sid: str, events: int) -> None:
    """`events` stored events of ~126 KB each (tool events, as any client may inject)."""
    bound = asyncio.Semaphore(8)

    async def one(i: int) -> None:
        async with bound:
            await client.inject(sid, "crm:export", "r" * 63_000,
                                arguments={"pad": "a" * 63_000}, idempotency_key=f"k{i}")

    await asyncio.gather(*(one(i) for i in range(events)))


async def test_states_too_large_for_a_reply_asked_at_once_are_all_answered(
        nats_url: str, system: dict[str, Any], client: ToolbusClient, sid: str) -> None:
    # 10 MB of state, over one reply: each asker's state was folded from the log at once,
    # 20 of them 200 MB through the gateway's one connection; NATS cut it off as a slow
    # consumer (every stream and call of every client ended) and every asker got a 503.
    await large_session(client, sid, 80)
    web_bus = await connect(nats_url, name="tests-gateway")
    try:
        async for web in _serve(web_bus):
            async with web.as_role("client") as c:
                c.timeout = httpx.Timeout(60)
                got = await asyncio.gather(*(c.get(f"/sessions/{sid}/state")
                                             for _ in range(20)))
        assert [g.status_code for g in got] == [200] * 20, {g.text[:200] for g in got}
        assert {g.headers["X-Toolbus-State-Source"] for g in got} == {"log"}
        assert all(len(g.json()["tool_events"]) == 80 for g in got)
        assert web_bus.nc.stats["reconnects"] == 0, "the server cut the gateway off"
    finally:
        await web_bus.close()


# --- the OpenAPI document ------------------------------------------------------------------


async def test_openapi_json_documents_every_route_with_its_schemas(web: Web) -> None:
    async with web.as_role("client") as c:
        got = await c.get("/openapi.json")
    assert got.status_code == 200
    doc = got.json()
    assert {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops} == {
        ("POST", "/sessions/{sid}/requests"), ("GET", "/sessions/{sid}/state"),
        ("GET", "/sessions/{sid}/events"),
        ("POST", "/sessions/{sid}/tool_events"),
        ("GET", "/approvals"), ("POST", "/approvals/{sid}/{call_id}"),
        ("GET", "/openapi.json"), ("GET", "/metrics"), ("GET", "/healthz")}
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    for path, ops in doc["paths"].items():
        for op in ops.values():
            assert ("security" in op) == (path != "/healthz"), path

    def refs(node: Any) -> set[str]:
        if isinstance(node, dict):
            own = {node["$ref"]} if isinstance(node.get("$ref"), str) else set()
            return own.union(*(refs(v) for v in node.values()))
        if isinstance(node, list):
            return set().union(*(refs(v) for v in node))
        return set()

    schemas = doc["components"]["schemas"]
    assert all(r.removeprefix("#/components/schemas/") in schemas for r in refs(doc))
    submit = doc["paths"]["/sessions/{sid}/requests"]["post"]
    assert submit["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ToolRequest")
    assert set(schemas["ToolRequest"]["properties"]) == {"request_id", "agent", "calls",
                                                         "message", "messages"}
    assert "_reasoningForCall" in schemas["Call"]["properties"]
    assert set(schemas["Accepted"]["properties"]) == {"ok", "request_id", "turn_id",
                                                      "duplicate"}
    assert schemas["HumanDecision"]["properties"]["decision"]["enum"] == ["approve", "deny"]
    assert "calls" in schemas["SessionState"]["properties"]
    assert "expires_at" in schemas["PendingApproval"]["properties"]


# --- configuration errors ------------------------------------------------------------------


async def test_a_busy_port_is_a_one_line_config_error(bus: Bus) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError) as caught:
            await start_gateway(bus, port, tokens={secrets.token_urlsafe(32): "admin"})
    message = str(caught.value)
    assert message.startswith(f"the HTTP gateway cannot listen on 127.0.0.1:{port}: ")
    assert "in use" in message and "\n" not in message


async def test_a_port_out_of_range_is_a_config_error_and_a_usage_error(bus: Bus) -> None:
    for port in (0, 99999, -1):
        with pytest.raises(ConfigError, match=r"cannot listen on 127\.0\.0\.1:-?\d+: a port "
                                              r"is 1 to 65535$"):
            await start_gateway(bus, port, tokens={secrets.token_urlsafe(32): "admin"})
    parsed = await asyncio.to_thread(run_toolbus, "up", "--http-port", "99999")
    assert parsed.returncode == 2
    assert "argument --http-port: 99999 is not a TCP port: give 1 to 65535" in parsed.stderr
    assert "Traceback" not in parsed.stderr


async def test_unusable_tokens_or_roles_are_config_errors(bus: Bus) -> None:
    for tokens, expected in (({}, "at least one bearer token"),
                             ({"short": "client"}, "at least 16 printable ASCII"),
                             ({"x" * 20 + " y": "client"}, "no spaces"),
                             ({secrets.token_urlsafe(32): "actor"}, "unknown HTTP gateway role")):
        with pytest.raises(ConfigError, match=expected):
            build_app(bus, tokens=tokens)


# --- end to end: toolbus up --http-port ----------------------------------------------------


def _token(data: Path, role: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {(data / 'auth' / f'{role}.token').read_text().strip()}"}


async def test_a_call_is_requested_and_approved_over_http(tmp_path: Path) -> None:
    port, http_port = free_port(), free_port()
    data = tmp_path / "data"
    up = Proc("up", "--port", str(port), "--data-dir", str(data),
              "--http-port", str(http_port), "--tools", "tests/sdk_toolkit.py", ready="stop:")
    try:
        banner = await up.wait_ready()
        assert f"http:   http://127.0.0.1:{http_port}" in banner
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}",
                                     headers=_token(data, "approver"), trust_env=False) as web:
            assert (await web.get("/healthz")).json() == {"ok": True}
            assert (await web.get("/approvals", headers={"Authorization": ""})
                    ).status_code == 401
            sent = await web.post("/sessions/web1/requests", json={
                "request_id": "label-1",
                "calls": [{"tool": "shipping:label", "arguments": {"order_id": 3}}]})
            assert sent.status_code == 202 and sent.json()["turn_id"] == "label-1"
            async with asyncio.timeout(10):  # the approval actor records it
                # Another process's state: poll it.
                while not (pending := (await web.get("/approvals")).json()):  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            assert pending[0]["tool"] == "shipping:label"
            assert pending[0]["rule"] == "tool:requires_approval"
            assert pending[0]["arguments"] == {"order_id": 3, "copies": 1}
            url = f"/approvals/web1/{pending[0]['call_id']}"
            ok = await web.post(url, json={"decision": "approve", "by": "web", "note": "ok"})
            assert ok.status_code == 200 and ok.json() == {"ok": True, "decision": "approved"}
            again = await web.post(url, json={"decision": "deny", "by": "x", "reason": "no"})
            assert again.status_code == 409 and "approved by web" in again.json()["error"]
            bad = await web.post(url, content=b"not json",
                                 headers={"Content-Type": "application/json"})
            assert bad.status_code == 400
            missing = await web.post("/approvals/web1/nope-0", json={"decision": "approve"})
            assert missing.status_code == 404
            async with asyncio.timeout(10):
                while True:
                    state = (await web.get("/sessions/web1/state")).json()
                    if state["turns"]["label-1"]["status"] == "completed":
                        break
                    await asyncio.sleep(0.05)  # another process: poll it
            call = state["calls"][pending[0]["call_id"]]
            assert call["result"] == {"order_id": 3, "copies": 1}
            assert call["decided_by"] == "web" and call["decision_note"] == "ok"
            assert (await web.post("/sessions/bad%20id/requests", json={})).status_code == 400
    finally:
        assert up.stop() == 0


async def test_state_over_http_resolves_references_and_survives_a_huge_state(
        tmp_path: Path) -> None:
    port, http_port = free_port(), free_port()
    data = tmp_path / "data"
    up = Proc("up", "--port", str(port), "--data-dir", str(data), "--workers",
              "1", "--http-port", str(http_port), "--tools", "tests/toolkit.py", ready="stop:")
    try:
        await up.wait_ready()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=30,
                                     headers=_token(data, "client"), trust_env=False) as web:
            calls = [{"tool": "testing:blob", "arguments": {"size": 300_000}}] + [
                {"tool": "testing:blob", "arguments": {"size": 225_000}}] * 20
            sent = await web.post("/sessions/big1/requests",
                                  json={"request_id": "r1", "calls": calls})
            assert sent.status_code == 202
            async with asyncio.timeout(30):
                while True:
                    got = await web.get("/sessions/big1/state")
                    assert got.status_code == 200, got.text
                    if got.json()["turns"].get("r1", {}).get("status") == "completed":
                        break
                    await asyncio.sleep(0.1)  # another process: poll it
            # 4.5 MB of inline results: over one state reply, so folded from the log.
            assert got.headers["X-Toolbus-State-Source"] == "log"
            first = got.json()["calls"]["r1-0"]
            assert first["result"] is None and first["result_ref"]["size"] == 300_002
            full = await web.get("/sessions/big1/state?full=1")
            assert full.headers["X-Toolbus-Resolved-References"] == "1"
            assert full.json()["calls"]["r1-0"]["result"] == "x" * 300_000
    finally:
        assert up.stop() == 0


async def test_a_busy_http_port_ends_toolbus_up_with_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        http_port = taken.getsockname()[1]
        done = await asyncio.to_thread(
            run_toolbus, "up", "--port", str(free_port()), "--data-dir", str(tmp_path / "d"),
            "--workers", "1", "--http-port", str(http_port))
    assert done.returncode != 0
    assert f"the HTTP gateway cannot listen on 127.0.0.1:{http_port}: address already in " \
           "use" in done.stderr
    assert "Traceback" not in done.stderr


# --- slow and idle connections ---------------------------------------------------------------


async def test_slow_or_idle_connections_are_dropped_and_capped(
        bus: Bus, system: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(gateway_module, "HEAD_TIMEOUT_S", 0.5)
    monkeypatch.setattr(gateway_module, "BODY_TIMEOUT_S", 0.5)
    monkeypatch.setattr(gateway_module, "MAX_CONNECTIONS", 8)
    async for web in _serve(bus):
        port = int(web.url.rsplit(":", 1)[1])

        async def opened(head: bytes, port: int = port
                         ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head)
            await writer.drain()
            return reader, writer

        # A head that never ends, and a connection that sends nothing: closed.
        for head in (b"POST /sessions/s1/requests HTTP/1.1\r\nHost: 127.0.0.1\r\n", b""):
            reader, writer = await opened(head)
            async with asyncio.timeout(5):
                assert await reader.read() == b""
            await _close(writer)
        # A body that stalls: 408, and nothing was submitted.
        reader, writer = await opened(
            b"POST /sessions/s1/requests HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Authorization: Bearer " + web.tokens["client"].encode() + b"\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"calls\"")
        async with asyncio.timeout(5):
            answer = await reader.read()
        assert answer.startswith(b"HTTP/1.1 408"), answer
        await _close(writer)
        # A body cut short by the client: no error logged.
        caplog.clear()
        reader, writer = await opened(
            b"POST /sessions/s1/requests HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Authorization: Bearer " + web.tokens["client"].encode() + b"\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        await _close(writer)
        await asyncio.sleep(0.3)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        # More connections than the cap: the extra ones are closed at once, and once
        # they are gone the gateway answers again.
        held = [await opened(b"") for _ in range(8)]
        reader, writer = await opened(b"")
        async with asyncio.timeout(2):
            assert await reader.read() == b""
        await _close(writer)
        for _, w in held:
            await _close(w)
        await asyncio.sleep(0.2)
        async with web.as_role("client") as c:
            assert (await c.get("/healthz")).status_code == 200
        # A connection kept alive after an answer gets the same time for its next head.
        reader, writer = await opened(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        async with asyncio.timeout(5):
            first = await reader.readuntil(b"\r\n\r\n")
            assert first.startswith(b"HTTP/1.1 200")
            writer.write(b"GET /healthz HTTP/1.1\r\n")  # and never the rest
            rest = await reader.read()
        assert b"HTTP/1.1" not in rest  # the rest of the first answer at most
        await _close(writer)


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


# --- NATS away ----------------------------------------------------------------------------


async def test_a_nats_outage_is_a_503_on_every_route_without_a_traceback_and_then_passes(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A stream opened while NATS did not answer raised nats-py's own errors (a flush
    # timeout): answered 503 by the handler for `Exception`, which Starlette re-raises,
    # so the server logged a traceback (`Exception in ASGI application`) for each.
    server = EmbeddedServer(tmp_path, port=free_port()).start()
    assert server.process is not None
    stopped = False
    # The server's own log: it does not propagate to root, and uvicorn's config, read as
    # the gateway starts, drops its handlers.
    uvicorn_errors = logging.getLogger("uvicorn.error")
    try:
        bus = await connect(server.url_for("actor"), name="tests-gateway")
        await provision(bus)
        async for web in _serve(bus):
            uvicorn_errors.addHandler(caplog.handler)
            async with web.as_role("admin") as c:
                c.timeout = httpx.Timeout(60)
                assert (await c.get("/approvals")).status_code == 200
                os.kill(server.process.pid, signal.SIGSTOP)
                stopped = True
                caplog.clear()
                got = await asyncio.gather(
                    c.get("/sessions/s1/events"),
                    c.post("/sessions/s1/requests?stream=1", json={"message": "hi"}),
                    c.post("/sessions/s1/requests", json={"calls": [
                        {"tool": "built-in:echo", "arguments": {"text": "hi"}}]}),
                    c.get("/sessions/s1/state"), c.get("/approvals"),
                    c.post("/approvals/s1/c-0", json={"decision": "approve"}))
                os.kill(server.process.pid, signal.SIGCONT)
                stopped = False
                assert [g.status_code for g in got] == [503] * len(got), \
                    [g.text for g in got]
                assert all(g.json()["code"] == "unavailable" for g in got)
                assert not [r.getMessage() for r in caplog.records
                            if r.levelno >= logging.ERROR or r.exc_info]
            # NATS back: the gateway serves again (on a new connection: those kept alive
            # were closed by the gateway after 10 s idle).
            async with asyncio.timeout(30), web.as_role("admin") as again:
                # The reconnection is the gateway's: poll it.
                while (await again.get("/approvals")).status_code != 200:  # noqa: ASYNC110
                    await asyncio.sleep(0.1)
        await bus.close()
    finally:
        uvicorn_errors.removeHandler(caplog.handler)
        if stopped:
            os.kill(server.process.pid, signal.SIGCONT)
        server.stop()
