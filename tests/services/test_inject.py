"""Injected tool events (seed 000) from the outside: `ToolbusClient.inject` over NATS with
the client role, `POST /sessions/{sid}/tool_events` over real HTTP, and `toolbus inject`,
against the real NATS fixture (and one `toolbus up` for a toolbus without a planner)."""

from __future__ import annotations

import asyncio
import secrets
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bus.client import ToolbusClient
from bus.connection import Bus, connect
from bus.eventlog import Append, EventLog
from bus.server import EmbeddedServer, free_port
from bus.subjects import REQUESTS_PREFIX
from schemas.errors import InvalidRequestError
from schemas.events import ToolEventInjected, TurnFailed, TurnRequested
from schemas.ids import tool_event_id, turn_ended_id, turn_id_for
from schemas.requests import DEFAULT_MAX_REQUEST_BYTES
from services.gateway import ROLES
from services.runtime import start_gateway
from tests.conftest import REPO, Proc, assert_replay_equals_live, run_toolbus, toolbus_cmd

BELL = "\u0007bell\u001b[31m"


@pytest.fixture
async def client_bus(nats_server: EmbeddedServer, system: dict[str, Any]
                     ) -> AsyncIterator[Bus]:
    """A connection with the `client` role: direct gets only, no consumers."""
    b = await connect(nats_server.url_for("client"), name="tests-client-role")
    yield b
    await b.close()


@pytest.fixture
async def outside(client_bus: Bus, bus: Bus) -> AsyncIterator[ToolbusClient]:
    c = ToolbusClient(client_bus)
    yield c
    for session_id in c.watched_sessions:  # the actor's state is what its log replays to
        await assert_replay_equals_live(bus, c, session_id)
    await c.close()


class Web:
    def __init__(self, url: str, tokens: dict[str, str]) -> None:
        self.url = url
        self.tokens = tokens  # role -> its bearer token

    def as_role(self, role: str | None) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {self.tokens[role]}"} if role else {}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=30,
                                 trust_env=False)


@pytest.fixture
async def web(bus: Bus, system: dict[str, Any]) -> AsyncIterator[Web]:
    tokens = {role: secrets.token_urlsafe(32) for role in ROLES}
    port = free_port()
    gateway = await start_gateway(bus, port, tokens={t: r for r, t in tokens.items()})
    try:
        yield Web(f"http://127.0.0.1:{port}", tokens)
    finally:
        await gateway.stop()


class Published:
    """Every message published on a session's request subjects, seen by a core
    subscription: what reached the bus, whatever became of it."""

    def __init__(self, bus: Bus, sid: str) -> None:
        self.bus = bus
        self.subject = f"{REQUESTS_PREFIX}.{sid}"
        self.messages: list[bytes] = []

    async def __aenter__(self) -> Published:
        async def on_msg(msg: Any) -> None:
            self.messages.append(msg.data)

        self._sub = await self.bus.nc.subscribe(self.subject, cb=on_msg)
        await self.bus.nc.flush()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.bus.nc.flush()
        await self._sub.unsubscribe()


async def _injected(bus: Bus, sid: str) -> list[tuple[int, ToolEventInjected]]:
    stored = await EventLog(bus).read_session(sid)
    return [(s.seq, s.event) for s in stored if isinstance(s.event, ToolEventInjected)]


def _one_clear_line(out: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in out.stderr, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert lines, "no message at all"
    return lines[-1]


# --- over NATS -----------------------------------------------------------------------------


async def test_the_same_key_twice_over_nats_stores_one_event_and_returns_its_ids(
        outside: ToolbusClient, bus: Bus, sid: str) -> None:
    first = await outside.inject(sid, "injected:conversation_history",
                                 {"messages": [{"from": "customer", "text": "refund?"}]},
                                 arguments={"source": "zendesk", "ticket": "12345"},
                                 idempotency_key="zendesk-12345-import-1")
    again = await outside.inject(sid, "injected:conversation_history", {"other": "body"},
                                 idempotency_key="zendesk-12345-import-1")
    assert first.created and not again.created
    assert (again.event_id, again.seq, again.turn_id) == (first.event_id, first.seq, None)
    assert first.event_id == tool_event_id(sid, "zendesk-12345-import-1")
    [(seq, event)] = await _injected(bus, sid)
    assert seq == first.seq and event.event_id == first.event_id
    assert event.arguments == {"source": "zendesk", "ticket": "12345"}
    assert event.result == {"messages": [{"from": "customer", "text": "refund?"}]}


async def test_concurrent_injections_of_one_key_create_it_exactly_once(
        outside: ToolbusClient, bus: Bus, sid: str) -> None:
    got = await asyncio.gather(*(outside.inject(sid, "injected:crm", {"n": i},
                                                idempotency_key="crm-export-7")
                                 for i in range(5)))
    assert sum(g.created for g in got) == 1
    assert len({(g.event_id, g.seq) for g in got}) == 1
    assert len(await _injected(bus, sid)) == 1


async def test_control_characters_are_stripped_but_tab_and_newline_kept(
        outside: ToolbusClient, bus: Bus, sid: str) -> None:
    got = await outside.inject(sid, "injected:bank_statement",
                               {"text": BELL, "lines": ["a\tb\nc", "\u202eevil"],
                                "n": 3, "\u0000key": None},
                               arguments={"account\u0008": "x\u009by"},
                               idempotency_key="stmt\u0007-1")
    [(_, event)] = await _injected(bus, sid)
    assert event.result == {"text": "bell[31m", "lines": ["a\tb\nc", "evil"], "n": 3,
                            "key": None}
    assert event.arguments == {"account": "xy"}
    # The key is cleaned too, and the id follows the clean key: retrying either way finds it.
    assert event.idempotency_key == "stmt-1" and got.event_id == tool_event_id(sid, "stmt-1")
    retried = await outside.inject(sid, "injected:bank_statement", {},
                                   idempotency_key="stmt-1")
    assert not retried.created and retried.event_id == got.event_id


async def test_trigger_processing_starts_a_turn_named_after_the_event(
        outside: ToolbusClient, bus: Bus, sid: str) -> None:
    # The fixture's session actor accepts planner turns (no planner runs: it stays open).
    got = await outside.inject(sid, "injected:auth", {"authenticated": True},
                               idempotency_key="login-1", trigger_processing=True)
    assert got.created and got.turn_id == turn_id_for(got.event_id)
    stored = [s.event for s in await EventLog(bus).read_session(sid)]
    turns = [e for e in stored if isinstance(e, TurnRequested)]
    assert [(t.turn_id, t.trigger) for t in turns] == [(got.turn_id, got.event_id)]
    again = await outside.inject(sid, "injected:auth", {"authenticated": True},
                                 idempotency_key="login-1", trigger_processing=True)
    assert (again.created, again.turn_id) == (False, got.turn_id)
    # No planner runs here: end the turn, or the next test's planner would plan it.
    await EventLog(bus).append(Append(TurnFailed(
        session_id=sid, at=0.0, actor="test", turn_id=got.turn_id, request_id=got.event_id,
        reason="internal", message="no planner in this test"),
        turn_ended_id(sid, got.turn_id)))


@pytest.mark.parametrize(("tool_id", "arguments", "result", "key", "says"), [
    ("nocolon", {}, 1, "k", "tool_id must be a label written namespace:name"),
    ("a:b:c", {}, 1, "k", "tool_id must be a label"),
    ("a b:c", {}, 1, "k", "tool_id must be a label"),
    ("injected:x", [1], 1, "k", "arguments must be an object, got an array"),
    ("injected:x", {}, "x" * DEFAULT_MAX_REQUEST_BYTES, "k", "the limit is"),
    ("injected:x", {}, 1, "", r"idempotency_key \(required\) must be a non-empty string"),
    ("injected:x", {}, 1, "\u0007", "idempotency_key is only control characters"),
])
async def test_a_bad_tool_event_raises_before_anything_is_published(
        outside: ToolbusClient, bus: Bus, sid: str, tool_id: str, arguments: Any,
        result: Any, key: str, says: str) -> None:
    async with Published(bus, sid) as published:
        with pytest.raises(InvalidRequestError, match=says):
            await outside.inject(sid, tool_id, result, arguments=arguments,
                                 idempotency_key=key)
    assert published.messages == []
    assert await EventLog(bus).read_session(sid) == []


# --- over HTTP -----------------------------------------------------------------------------


def _body(**fields: Any) -> dict[str, Any]:
    return {"tool_id": "injected:conversation_history", "arguments": {"ticket": "12345"},
            "result": {"messages": ["Where is my refund?"]},
            "idempotency_key": "zendesk-12345-import-1", "trigger_processing": False,
            **fields}


async def test_the_same_key_twice_over_http_is_201_then_200_with_the_same_ids(
        web: Web, bus: Bus, sid: str) -> None:
    async with web.as_role("client") as c:
        first = await c.post(f"/sessions/{sid}/tool_events", json=_body())
        again = await c.post(f"/sessions/{sid}/tool_events",
                             json=_body(result="another result, same key"))
    assert first.status_code == 201, first.text
    assert again.status_code == 200, again.text
    ids = {k: first.json()[k] for k in ("session_id", "event_id", "seq", "turn_id")}
    assert ids == {k: again.json()[k] for k in ids}
    assert ids["session_id"] == sid and ids["turn_id"] is None
    assert (first.json()["created"], again.json()["created"]) == (True, False)
    [(seq, event)] = await _injected(bus, sid)
    assert (seq, event.event_id) == (ids["seq"], ids["event_id"])
    assert event.result == {"messages": ["Where is my refund?"]}


async def test_control_characters_are_stripped_over_http(
        web: Web, bus: Bus, sid: str) -> None:
    async with web.as_role("client") as c:
        got = await c.post(f"/sessions/{sid}/tool_events",
                           json=_body(result={"text": BELL, "keep": "a\tb\nc"}))
    assert got.status_code == 201, got.text
    [(_, event)] = await _injected(bus, sid)
    assert event.result == {"text": "bell[31m", "keep": "a\tb\nc"}


async def test_without_a_valid_token_it_is_401_and_nothing_is_stored(
        web: Web, bus: Bus, sid: str) -> None:
    async with Published(bus, sid) as published, web.as_role(None) as anyone:
        for headers in ({}, {"Authorization": f"Bearer {secrets.token_urlsafe(32)}"},
                        {"Authorization": f"Basic {web.tokens['client']}"}):
            got = await anyone.post(f"/sessions/{sid}/tool_events", json=_body(),
                                    headers=headers)
            assert got.status_code == 401, got.text
            assert got.headers["WWW-Authenticate"].startswith("Bearer")
            assert "token" in got.json()["error"]
    assert published.messages == []
    assert await EventLog(bus).read_session(sid) == []


_MALFORMED = [
    (_body(tool_id="nocolon"), 400, "invalid_request", "namespace:name"),
    (_body(tool_id="a:b:c"), 400, "invalid_request", "namespace:name"),
    (_body(tool_id=7), 400, "invalid_request", "got a number"),
    (_body(arguments=["x"]), 400, "invalid_request", "arguments must be an object"),
    (_body(arguments="x"), 400, "invalid_request", "arguments must be an object"),
    (_body(trigger_processing="yes"), 400, "invalid_request", "true or false"),
    (_body(idempotency_key=5), 400, "invalid_request", "idempotency_key (required) must be"),
    (_body(idempotency_key="x" * 300), 400, "invalid_request", "at most 256 characters, got 300"),
    (_body(extra=1), 400, "invalid_request", "unknown field(s) extra"),
    ({k: v for k, v in _body().items() if k != "idempotency_key"}, 400, "invalid_request",
     "idempotency_key (required) must be"),
    ({k: v for k, v in _body().items() if k != "result"}, 400, "invalid_request",
     "result is missing"),
    (["not", "an", "object"], 400, "invalid_request", "must be a JSON object"),
    (_body(result="x" * DEFAULT_MAX_REQUEST_BYTES), 413, "payload_too_large",
     "the limit is"),
]


async def test_malformed_tool_events_are_a_clear_4xx_and_nothing_is_published(
        web: Web, bus: Bus, sid: str) -> None:
    async with Published(bus, sid) as published, web.as_role("client") as c:
        for body, status, code, says in _MALFORMED:
            got = await c.post(f"/sessions/{sid}/tool_events", json=body)
            assert got.status_code == status, (body, got.text)
            answer = got.json()
            assert answer["ok"] is False and answer["code"] == code, answer
            assert says in answer["error"], answer
        for content, headers, status in (
                (b"{not json", {"Content-Type": "application/json"}, 400),
                (b'{"tool_id": "a:b"}', {"Content-Type": "text/plain"}, 415),
                (b'"x' + b"x" * 300_000 + b'"', {"Content-Type": "application/json"}, 413)):
            got = await c.post(f"/sessions/{sid}/tool_events", content=content,
                               headers=headers)
            assert got.status_code == status, got.text
    assert published.messages == []
    assert await EventLog(bus).read_session(sid) == []


async def test_a_bad_session_id_is_a_400(web: Web, bus: Bus) -> None:
    async with web.as_role("client") as c:
        for bad in ("bad%20id", "a.b", "x" * 200):
            got = await c.post(f"/sessions/{bad}/tool_events", json=_body())
            assert got.status_code == 400, (bad, got.text)
            assert "invalid session id" in got.json()["error"]


async def test_openapi_json_documents_the_tool_events_route(web: Web) -> None:
    async with web.as_role("client") as c:
        doc = (await c.get("/openapi.json")).json()
    op = doc["paths"]["/sessions/{sid}/tool_events"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ToolEvent")
    assert {"200", "201", "400", "401", "409", "413", "415"} <= set(op["responses"])
    assert "security" in op
    schemas = doc["components"]["schemas"]
    assert set(schemas["ToolEvent"]["properties"]) == {
        "tool_id", "arguments", "result", "idempotency_key", "trigger_processing"}
    assert set(schemas["ToolEvent"]["required"]) == {"tool_id", "result", "idempotency_key"}
    assert set(schemas["Injected"]["properties"]) == {
        "ok", "session_id", "event_id", "seq", "turn_id", "created"}


# --- toolbus inject ------------------------------------------------------------------------


async def test_toolbus_inject_stores_once_and_replay_shows_it(
        nats_server: EmbeddedServer, system: dict[str, Any], bus: Bus, sid: str) -> None:
    url = nats_server.url_for("client")
    args = ("inject", sid, "injected:bank_statement", "--arguments", '{"month": "2026-10"}',
            "--key", "stmt-2026-10", "--nats", url)
    first = await asyncio.to_thread(run_toolbus, *args, "--result", '{"balance": 12.5}')
    assert first.returncode == 0, first.stderr
    event_id = tool_event_id(sid, "stmt-2026-10")
    assert first.stdout.startswith(f"{event_id} seq ") and "(new)" in first.stdout
    again = await asyncio.to_thread(  # the result from stdin, this time
        lambda: subprocess.run(toolbus_cmd(*args, "--result", "-"), input='{"balance": 0}',
                               capture_output=True, text=True, timeout=60, cwd=REPO))
    assert again.returncode == 0, again.stderr
    assert again.stdout.split(" (")[0] == first.stdout.split(" (")[0]
    assert "already injected with this key" in again.stdout
    [(_, event)] = await _injected(bus, sid)
    assert event.result == {"balance": 12.5} and event.arguments == {"month": "2026-10"}

    replay = await asyncio.to_thread(run_toolbus, "replay", sid, "--nats", url)
    assert replay.returncode == 0, replay.stderr
    [line] = [ln for ln in replay.stdout.splitlines() if "tool_event.injected" in ln]
    assert f"tool event {event_id} injected:bank_statement injected (key 'stmt-2026-10')" \
        in line and '{"balance":12.5}' in line


async def test_toolbus_inject_without_a_key_makes_one_and_prints_it(
        nats_server: EmbeddedServer, system: dict[str, Any], bus: Bus, sid: str) -> None:
    out = await asyncio.to_thread(run_toolbus, "inject", sid, "injected:note", "--result",
                                  '"hello"', "--nats", nats_server.url_for("client"))
    assert out.returncode == 0, out.stderr
    key = out.stderr.split("key: ", 1)[1].split()[0]
    assert f"--key {key}" in out.stderr
    [(_, event)] = await _injected(bus, sid)
    assert event.idempotency_key == key and out.stdout.startswith(event.event_id)


@pytest.mark.parametrize(("args", "says"), [
    (("s1", "injected:x", "--result", "{nope"), "--result is not valid JSON"),
    (("s1", "injected:x", "--result", "1", "--arguments", "[1"),
     "--arguments is not valid JSON"),
    (("s1", "injected:x", "--result", "1", "--arguments", "[1]"),
     "arguments must be an object"),
    (("s1", "injected:x", "--result", '"\\ud800"'),
     "\\ud800 at byte 1 is half of a UTF-16 surrogate pair"),
    (("s1", "nocolon", "--result", "1"), "tool_id must be a label written namespace:name"),
    (("s1", "a:b:c", "--result", "1"), "tool_id must be a label"),
    (("s1", "injected:x", "--result", "1", "--key", ""), "idempotency_key (required) must be"),
    (("no.dots", "injected:x", "--result", "1"), "invalid session id 'no.dots'"),
    (("s1", "injected:x"), "the following arguments are required: --result"),
    (("s1", "injected:x", "--result", "1", "--timeout", "0"),
     "argument --timeout: 0 is not a positive"),
])
def test_toolbus_inject_refuses_bad_input_in_one_line(args: tuple[str, ...], says: str,
                                                      tmp_path: Path) -> None:
    # No server is running on that port: bad input is refused before connecting.
    out = run_toolbus("inject", *args, "--nats", f"nats://127.0.0.1:{free_port()}",
                      "--data-dir", str(tmp_path))
    assert out.returncode == 2, out.stderr
    assert says in _one_clear_line(out)
    assert out.stdout == ""


def test_toolbus_inject_refuses_invalid_json_on_stdin(tmp_path: Path) -> None:
    out = subprocess.run(toolbus_cmd("inject", "s1", "injected:x", "--result", "-", "--key", "k",
                              "--nats", f"nats://127.0.0.1:{free_port()}"),
                         input="not json", capture_output=True, text=True, timeout=60,
                         cwd=REPO)
    assert out.returncode == 2
    assert "--result (read from stdin) is not valid JSON" in _one_clear_line(out)


def test_toolbus_inject_names_a_result_over_the_limit_on_stdin_as_such() -> None:
    big = '"' + "x" * 140_000 + '"'  # valid JSON, too large for a tool event
    out = subprocess.run(toolbus_cmd("inject", "s1", "injected:x", "--result", "-", "--key", "k",
                              "--nats", f"nats://127.0.0.1:{free_port()}"),
                         input=big, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 2
    assert "--result is over 131072 bytes, the limit of a tool event" in _one_clear_line(out)


def test_toolbus_inject_without_a_server_says_how_to_start_one(tmp_path: Path) -> None:
    out = run_toolbus("inject", "s1", "injected:x", "--result", "1", "--key", "k",
                      "--nats", f"nats://127.0.0.1:{free_port()}", "--data-dir", str(tmp_path),
                      timeout=30)
    assert out.returncode == 3, out.stderr
    line = _one_clear_line(out)
    assert "cannot reach NATS at nats://127.0.0.1:" in line and "toolbus up" in line


async def test_without_a_planner_trigger_processing_is_refused_and_the_rest_works(
        tmp_path: Path) -> None:
    port, http_port = free_port(), free_port()
    data = tmp_path / "data"
    up = Proc("up", "--port", str(port), "--data-dir", str(data), "--workers", "1",
              "--http-port", str(http_port), ready="stop:")
    try:
        await up.wait_ready()
        token = (data / "auth" / "client.token").read_text().strip()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=30,
                                     headers={"Authorization": f"Bearer {token}"},
                                     trust_env=False) as web:
            refused = await web.post("/sessions/np1/tool_events",
                                     json=_body(trigger_processing=True))
            assert refused.status_code == 409, refused.text
            assert refused.json()["code"] == "no_planner"
            assert "agent_config.model" in refused.json()["error"]
            # The same key again, even without trigger_processing: the stream drops the
            # copy, so its first answer stands (not a wait until the timeout).
            again = await web.post("/sessions/np1/tool_events", json=_body())
            assert again.status_code == 409, again.text
            assert "retry with a new key" in again.json()["error"]
            stored = await web.post("/sessions/np1/tool_events",
                                    json=_body(idempotency_key="zendesk-12345-import-2"))
            assert stored.status_code == 201, stored.text
        # The CLI finds the client's URL in the data dir.
        cli = await asyncio.to_thread(run_toolbus, "inject", "np1", "injected:x", "--result",
                                      "1", "--key", "cli-1", "--trigger", "--data-dir",
                                      str(data))
        assert cli.returncode == 1, cli.stderr
        assert "tool event refused (no_planner)" in _one_clear_line(cli)
        ok = await asyncio.to_thread(run_toolbus, "inject", "np1", "injected:x", "--result",
                                     "1", "--key", "cli-2", "--data-dir", str(data))
        assert ok.returncode == 0, ok.stderr
        assert "(new)" in ok.stdout
        # A refusal is stored once and its message acknowledged: not written again until
        # the attempts run out, redelivered and logged as a conflict (the backoff of those
        # redeliveries would be over by now).
        await asyncio.sleep(2.5)
    finally:
        assert up.stop() == 0
    assert "kept conflicting" not in up.stderr_after_exit(), up.stderr_tail
