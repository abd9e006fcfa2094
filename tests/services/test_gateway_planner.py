"""A message over HTTP: the gateway's requests route starts a planner turn, and the
answer is read back through the state route. Real HTTP both ways: the gateway on a free
port, the planner against the scripted fake provider (tests/llm_servers.py)."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from actors.llm.types import ModelSettings
from actors.planner import Planner
from bus.client import ToolbusClient
from bus.connection import Bus
from bus.server import free_port
from services.gateway import ROLES
from services.runtime import start_gateway
from tests.conftest import EventWatch, assert_replay_equals_live, of_type
from tests.llm_servers import Call, FakeProvider, reply

KEY = "sk-test-gateway-not-a-real-key"


@pytest.fixture
async def fake() -> AsyncIterator[FakeProvider]:
    async with FakeProvider() as server:
        yield server


@pytest.fixture
async def planner(bus: Bus, system: dict[str, Any], fake: FakeProvider
                  ) -> AsyncIterator[Planner]:
    settings = ModelSettings(provider="openai", model="gpt-test", api_key=KEY,
                             base_url=fake.base_url("openai"), max_retries=1)
    p = Planner(bus, system["catalog"], settings,
                tools=lambda spec: spec.name.startswith("built-in:"))
    await p.start()
    yield p
    await p.stop()


@pytest.fixture
async def tokens(bus: Bus, system: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """The gateway on a free port: its URL and a bearer token per role."""
    by_role = {role: secrets.token_urlsafe(32) for role in ROLES}
    port = free_port()
    gateway = await start_gateway(bus, port, tokens={t: r for r, t in by_role.items()})
    try:
        yield {"url": f"http://127.0.0.1:{port}", **by_role}
    finally:
        await gateway.stop()


def _as(tokens: dict[str, Any], role: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=tokens["url"], timeout=10, trust_env=False,
                             headers={"Authorization": f"Bearer {tokens[role]}"})


async def test_a_message_posted_with_a_client_token_starts_a_turn_that_answers(
        bus: Bus, client: ToolbusClient, planner: Planner, fake: FakeProvider,
        tokens: dict[str, Any], sid: str) -> None:
    fake.script(reply("openai", calls=[Call("call_1", "built-in__echo", {"text": "hi"})],
                      stream=True),
                reply("openai", "It said hi.", stream=True))
    async with EventWatch(bus, sid) as watch, _as(tokens, "client") as web:
        sent = await web.post(f"/sessions/{sid}/requests",
                              json={"message": "Echo hi, then tell me what it said."})
        assert sent.status_code == 202, sent.text
        accepted = sent.json()
        assert accepted["ok"] is True and accepted["duplicate"] is False
        turn_id = accepted["turn_id"]
        events = await watch.until(lambda evs: bool(of_type(evs, "turn.completed") or
                                                    of_type(evs, "turn.failed")), 30)
        assert [e.turn_id for e in of_type(events, "turn.completed")] == [turn_id], events
        got = await web.get(f"/sessions/{sid}/state")
    assert got.status_code == 200, got.text
    turn = got.json()["turns"][turn_id]
    assert turn["status"] == "completed"
    assert turn["message"] == "Echo hi, then tell me what it said."
    assert turn["text"] == "It said hi."
    assert [got.json()["calls"][c]["result"] for c in turn["call_ids"]] == [{"text": "hi"}]
    assert fake.requests[0].body["messages"][-1] == {
        "role": "user", "content": "Echo hi, then tell me what it said."}
    await assert_replay_equals_live(bus, client, sid)


async def test_the_openapi_document_describes_a_message_request(
        tokens: dict[str, Any]) -> None:
    async with _as(tokens, "client") as web:
        doc = (await web.get("/openapi.json")).json()
    request = doc["components"]["schemas"]["ToolRequest"]
    # A client generated from the document must be able to send {"message": "..."}.
    assert "message" in request["properties"], request
    assert "calls" not in request.get("required", []), request
