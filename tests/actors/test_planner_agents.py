"""Agents as tools (issue 12 item 7): a named agent is the tool `agent:<name>`; calling it
runs one turn of that agent in a child session, against the same real NATS and a real
local model server speaking the OpenAI Chat Completions API."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from actors.agent_tools import MAX_AGENT_DEPTH, child_session_id, depth_of
from actors.planner import Offer, Rules, decide
from bus.client import ToolbusClient
from bus.connection import Bus
from bus.eventlog import EventLog
from bus.subjects import approval_subject
from schemas.events import Event, ModelRequested, TurnCompleted, TurnFailed, TurnRequested
from schemas.ids import call_id_for, is_token, turn_id_for
from schemas.manifest import parse_manifest
from schemas.state import SessionState, evolve
from services.config import ActorSettings
from services.runtime import start_planner
from tests.actors.test_planner import ScriptedChat, _as_stream, reply
from tests.conftest import REPO, EventWatch, assert_replay_equals_live, of_type

WRITER = "You write things down, and say what you wrote."


@pytest.fixture
async def planner(bus: Bus, system: dict[str, Any], model: ScriptedChat
                  ) -> AsyncIterator[Any]:
    """The planner as `toolbus up` starts it (services/runtime.py), with one named agent,
    `writer`, whose tool `agent:writer` runs in the planner's process."""
    manifest = parse_manifest(
        "agent_config:\n"
        "  model:\n"
        "    provider: openai\n"
        "    model: scripted\n"
        f"    base_url: http://127.0.0.1:{model.port}/v1\n"
        "    api_key: ${SCRIPTED_KEY}\n"
        "    max_retries: 1\n"
        "  instructions: Be brief.\n"
        "  agents:\n"
        "    writer:\n"
        f"      instructions: {WRITER}\n"
        "      tools: ['approvals:*']\n", env={"SCRIPTED_KEY": "k"})
    actor = await start_planner(bus, ActorSettings(
        manifest=manifest, instance=f"t-{uuid.uuid4().hex[:6]}", ack_wait_s=2.0))
    await system["catalog"]._specs.wait_until(lambda items: "agent.writer" in items, 5)
    yield actor
    await actor.stop()


def _child_of(sid: str, request_id: str, index: int = 0) -> tuple[str, str]:
    call_id = call_id_for(turn_id_for(request_id), index)
    return call_id, child_session_id(sid, call_id, "writer")


async def _hi_said(client: ToolbusClient, model: ScriptedChat, sid: str,
                   request_id: str) -> TurnCompleted:
    """A turn whose model has the writer say hi (an agent call), ended."""
    model.script = [
        (200, reply(calls=[("p1", "agent__writer", {"message": "Say hi."})])),
        (200, reply("hi")),
        (200, reply("The writer said hi.")),
    ]
    end = await client.ask(sid, "Have hi said.", request_id=request_id, timeout=60)
    assert isinstance(end, TurnCompleted) and end.outcomes[0].status == "succeeded", end
    return end


async def test_an_agent_calls_another_agent_as_a_tool_in_a_child_session(
        bus: Bus, client: ToolbusClient, planner: Any, model: ScriptedChat, sid: str,
        nats_url: str) -> None:
    request_id = uuid.uuid4().hex
    call_id, child = _child_of(sid, request_id)
    model.script = [
        (200, reply(calls=[("p1", "agent__writer", {"message": "Write hi."})])),  # parent
        (200, reply(calls=[("w1", "approvals__write", {"text": "hi"})])),         # child
        (200, reply("Wrote hi.")),                                                 # child
        (200, reply("The writer wrote hi.")),                                      # parent
    ]
    async with EventWatch(bus, child) as watch:
        asking = asyncio.create_task(client.ask(sid, "Have hi written.",
                                                request_id=request_id, timeout=60))
        # Approvals apply inside the child: its write waits for a human.
        events = await watch.until(lambda evs: bool(of_type(evs, "approval.requested")), 30)
        waiting = of_type(events, "approval.requested")[0]
        assert waiting.tool == "approvals:write"
        decided = json.loads(await bus.request(
            approval_subject(child, waiting.call_id, "tester"),
            b'{"decision": "approve", "by": "ada"}', timeout=5))
        assert decided["ok"], decided
        end = await asyncio.wait_for(asking, 60)

    assert isinstance(end, TurnCompleted) and end.text == "The writer wrote hi.", end
    (outcome,) = end.outcomes
    assert outcome.status == "succeeded"
    assert outcome.result == {"agent": "writer", "session": child, "answer": "Wrote hi."}

    # The child turn is the writer's: its instructions, its tools, its grants.
    parent_first, child_first, child_second, parent_second = model.received
    assert "agent__writer" in {t["function"]["name"] for t in parent_first["tools"]}
    assert child_first["messages"][0] == {"role": "system", "content": WRITER}
    assert child_first["messages"][1] == {"role": "user", "content": "Write hi."}
    assert {t["function"]["name"] for t in child_first["tools"]} <= {
        "approvals__write", "approvals__write_auto"}
    assert json.loads(next(m for m in child_second["messages"]
                           if m["role"] == "tool")["content"]) == {"wrote": "hi"}
    assert json.loads(next(m for m in parent_second["messages"]
                           if m["role"] == "tool")["content"])["answer"] == "Wrote hi."
    child_events: list[Event] = [s.event for s in await EventLog(bus).read_session(child)
                                 if s.event is not None]
    (requested,) = [e for e in child_events if isinstance(e, TurnRequested)]
    assert requested.agent == "writer" and requested.request_id == f"{sid}:{call_id}"
    assert [e.agent for e in of_type(child_events, "call.requested")] == ["writer"]

    # Replay equals live for the child too (the parent is checked by the fixture), and
    # the parent's replay names the child, which replays on its own; no model is called.
    await assert_replay_equals_live(bus, client, child)
    before = len(model.received)
    for session, expected in ((sid, child), (child, "Wrote hi.")):
        out = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "services.cli", "replay", session,
                             "--nats", nats_url], capture_output=True, text=True, timeout=60,
            cwd=REPO)
        assert out.returncode == 0, out.stderr
        assert expected in out.stdout
    assert len(model.received) == before


async def test_toolbus_chat_shows_a_call_in_an_agents_session_that_waits_for_a_human(
        bus: Bus, planner: Any, model: ScriptedChat, sid: str, nats_url: str) -> None:
    model.script = [
        (200, reply(calls=[("p1", "agent__writer", {"message": "Write hi."})])),  # parent
        (200, reply(calls=[("w1", "approvals__write", {"text": "hi"})])),         # child
        (200, reply("Wrote hi.")),                                                 # child
        (200, reply("The writer wrote hi.")),                                      # parent
    ]
    chat = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "chat", "Have hi written.", "--session", sid,
        "--nats", nats_url, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        cwd=REPO)
    assert chat.stderr is not None
    try:
        async with asyncio.timeout(60):
            while b"waits for a human" not in (line := await chat.stderr.readline()):
                assert line, "chat ended without showing the child's approval"
        shown = line.decode()
        child = shown.split("--session ")[1].split()[0]
        call_id = shown.split("toolbus approve ")[1].split()[0]
        assert shown.startswith(f"  .. approvals:write (agent session {child}) waits")
        decided = json.loads(await bus.request(
            approval_subject(child, call_id, "tester"),
            b'{"decision": "approve", "by": "ada"}', timeout=5))
        assert decided["ok"], decided
        out, _ = await asyncio.wait_for(chat.communicate(), 60)
    finally:
        if chat.returncode is None:
            chat.kill()
            await chat.wait()
    assert chat.returncode == 0 and out == b"The writer wrote hi.\n"


async def test_a_misspelt_agent_ends_the_turn_naming_the_agents_there_are(
        client: ToolbusClient, planner: Any, model: ScriptedChat, sid: str) -> None:
    before = len(model.received)
    end = await client.ask(sid, "Write hi.", agent="writr", timeout=30)
    assert isinstance(end, TurnFailed) and end.reason == "unknown_agent", end
    assert "agent 'writr' is neither a named agent of agent_config.agents (writer)" in \
        end.message
    assert len(model.received) == before  # no model was asked
    model.script = [(200, reply("Hello."))]
    named = await client.ask(sid, "Say hello.", agent="writer", timeout=30)
    assert isinstance(named, TurnCompleted) and named.text == "Hello.", named


async def test_a_child_turn_that_fails_fails_the_call_naming_the_child(
        client: ToolbusClient, planner: Any, model: ScriptedChat, sid: str) -> None:
    request_id = uuid.uuid4().hex
    _, child = _child_of(sid, request_id)
    model.script = [
        (200, reply(calls=[("p1", "agent__writer", {"message": "Write hi."})])),
        (401, {"error": {"message": "Incorrect API key provided"}}),  # the child's model
        (200, reply("The writer could not.")),
    ]
    end = await client.ask(sid, "Have hi written.", request_id=request_id, timeout=60)
    assert isinstance(end, TurnCompleted) and end.text == "The writer could not.", end
    (outcome,) = end.outcomes
    assert outcome.status == "failed" and outcome.error is not None
    assert outcome.error.error_type == "agent_failed"
    assert "model_error" in outcome.error.message and child in outcome.error.message


async def test_a_redelivered_agent_call_reattaches_to_the_same_child_turn(
        bus: Bus, client: ToolbusClient, planner: Any, model: ScriptedChat, sid: str) -> None:
    from actors.agent_tools import AgentTool, agent_tool_spec
    from actors.executor import current_dispatch
    from schemas.events import CallDispatched
    from schemas.manifest import AgentDef

    request_id = uuid.uuid4().hex
    _, child = _child_of(sid, request_id)
    await _hi_said(client, model, sid, request_id)
    asked = len(model.received)
    # What an executor that died mid-call would do on the redelivery: run it again.
    (dispatched,) = [s.event for s in await EventLog(bus).read_session(sid)
                     if isinstance(s.event, CallDispatched)]
    tool = AgentTool(agent_tool_spec("writer", AgentDef(instructions=WRITER)), "writer", bus)
    token = current_dispatch.set(dispatched)
    try:
        again = await tool.run({"message": "Say hi."})
    finally:
        current_dispatch.reset(token)
    assert again == {"agent": "writer", "session": child, "answer": "hi"}
    assert len(model.received) == asked  # no second child turn, no model call
    child_events = [s.event for s in await EventLog(bus).read_session(child)]
    assert sum(isinstance(e, TurnRequested) for e in child_events) == 1


def test_child_sessions_are_deterministic_tokens_and_count_their_depth() -> None:
    parent = "s" * 128
    child = child_session_id(parent, "t-0", "w" * 128)
    assert is_token(child) and child == child_session_id(parent, "t-0", "w" * 128)
    assert child != child_session_id(parent, "t-1", "w" * 128)
    assert depth_of(parent) == 0 and depth_of(child) == 1
    deep = parent
    for _ in range(MAX_AGENT_DEPTH + 1):
        deep = child_session_id(deep, "t-0", "writer")
    assert depth_of(deep) == MAX_AGENT_DEPTH + 1


def test_a_turn_of_a_named_agent_is_planned_with_its_model_and_rules() -> None:
    state = SessionState(session_id="s")
    evolve(state, TurnRequested(session_id="s", at=0, actor="session", turn_id="t",
                                request_id="t", call_ids=[], message="hi", agent="writer"), 1)
    offer = Offer(provider="openai", model="main")
    writer = (Offer(provider="anthropic", model="small"), Rules(instructions=WRITER))
    (asked,) = decide(state, offer, now=1.0, agents={"writer": writer})
    assert isinstance(asked.event, ModelRequested)
    assert (asked.event.provider, asked.event.model) == ("anthropic", "small")
    (plain,) = decide(state, offer, now=1.0, agents={"other": writer})
    assert isinstance(plain.event, ModelRequested) and plain.event.model == "main"


def test_a_named_agent_may_have_a_mode_of_its_own() -> None:
    from actors.agent_tools import agent_profiles

    config = parse_manifest(
        "agent_config:\n"
        "  model: {provider: openai, model: big}\n"
        "  agents:\n"
        "    small: {instructions: Be small., mode: composed,\n"
        "            model: {provider: openai, model: tiny}}\n"
        "    same: {instructions: Be the same.}\n", env={}).agent_config
    profiles = agent_profiles(config)
    assert profiles["small"].rules.mode == "composed"
    assert profiles["same"].rules.mode == config.mode == "native"


# --- an agent that calls itself (found by a review) -------------------------------------


class _FnChat(ScriptedChat):
    """Answers each request with `fn(request)`: concurrent sessions need no script order."""

    def __init__(self, fn: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        super().__init__()
        self.fn = fn

    async def _complete(self, request: Request) -> Response:
        data = json.loads(await request.body())
        self.received.append(data)
        body = self.fn(data)
        if data.get("stream"):
            return Response(_as_stream(body), media_type="text/event-stream")
        return JSONResponse(body)


def _recurse(data: dict[str, Any]) -> dict[str, Any]:
    """A model talked into calling `agent:delegate` again whenever it may."""
    last = data["messages"][-1]
    tools = {t["function"]["name"] for t in data.get("tools", [])}
    if last["role"] == "tool":
        return reply(f"done: {last['content'][:80]}")
    if "agent__delegate" in tools:
        return reply(calls=[(f"c{uuid.uuid4().hex[:6]}", "agent__delegate",
                             {"message": "Ask yourself again."})])
    return reply("no tools")


@contextlib.asynccontextmanager
async def _delegating(bus: Bus, system: dict[str, Any],
                      fn: Callable[[dict[str, Any]], dict[str, Any]], limits: str = ""
                      ) -> AsyncIterator[_FnChat]:
    """A planner whose named agent `delegate` is offered `agent:*`, itself included (a
    careless manifest), as is the default agent; its model answers with `fn`."""
    server = await _FnChat(fn).start()
    manifest = parse_manifest(
        "agent_config:\n"
        "  model:\n"
        "    provider: openai\n"
        "    model: scripted\n"
        f"    base_url: http://127.0.0.1:{server.port}/v1\n"
        "    api_key: ${SCRIPTED_KEY}\n"
        "    max_retries: 1\n"
        f"{limits}"
        "  agents:\n"
        "    delegate:\n"
        "      instructions: Delegate.\n"
        "      tools: ['agent:*']\n", env={"SCRIPTED_KEY": "k"})
    actor = await start_planner(bus, ActorSettings(
        manifest=manifest, instance=f"t-{uuid.uuid4().hex[:6]}", ack_wait_s=2.0))
    try:
        await system["catalog"]._specs.wait_until(lambda items: "agent.delegate" in items, 5)
        yield server
    finally:
        await actor.stop()
        await server.stop()


@pytest.fixture
async def recursive(bus: Bus, system: dict[str, Any]) -> AsyncIterator[_FnChat]:
    async with _delegating(bus, system, _recurse) as server:
        yield server


async def test_an_agent_calling_itself_stops_at_the_depth_limit(
        client: ToolbusClient, recursive: _FnChat, sid: str) -> None:
    end = await client.ask(sid, "Go.", timeout=60)
    assert isinstance(end, TurnCompleted), end
    # The turn and each child turn down to the limit: a call, then an answer each.
    assert len(recursive.received) == 2 * (MAX_AGENT_DEPTH + 1)
    refused = [r for r in recursive.received if r["messages"][-1]["role"] == "tool"
               and "agents already call agents" in r["messages"][-1]["content"]]
    assert refused  # the deepest level's call, answered without running (and quoted above)


async def test_agent_calls_waiting_for_their_children_hold_none_of_the_executors_slots(
        monkeypatch: pytest.MonkeyPatch, client: ToolbusClient, sid: str,
        bus: Bus, system: dict[str, Any]) -> None:
    """Each level's agent call waits for its child turn, whose own agent call needs the
    same executor: with 2 slots, held by waiting parents, no child call could start, and
    every level waited `AGENT_TIMEOUT_MS` (30 min). Three sessions at once, 4 deep."""
    from actors.executor import Executor

    assert Executor.__init__.__kwdefaults__ is not None
    monkeypatch.setitem(Executor.__init__.__kwdefaults__, "max_in_flight", 2)
    async with _delegating(bus, system, _recurse) as server:
        ends = await asyncio.gather(*(client.ask(f"{sid}-{i}", "Go.", timeout=60)
                                      for i in range(3)))
        assert all(isinstance(e, TurnCompleted) for e in ends), ends
        assert len(server.received) == 3 * 2 * (MAX_AGENT_DEPTH + 1)


async def test_an_agent_call_that_times_out_stops_its_child_turn(
        bus: Bus, system: dict[str, Any], client: ToolbusClient, model: ScriptedChat,
        sid: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from bus.approvals import ApprovalStore
    from schemas.events import TurnCancelled

    # Under the suite's approval timeout (3 s), which would end the child's wait first.
    monkeypatch.setattr("actors.agent_tools.AGENT_TIMEOUT_MS", 2_600)
    manifest = parse_manifest(
        "agent_config:\n"
        "  model: {provider: openai, model: scripted, api_key: '${SCRIPTED_KEY}',\n"
        f"          base_url: 'http://127.0.0.1:{model.port}/v1', max_retries: 1}}\n"
        "  agents:\n"
        "    slowpoke: {instructions: Write slowly., tools: ['approvals:*']}\n",
        env={"SCRIPTED_KEY": "k"})
    actor = await start_planner(bus, ActorSettings(
        manifest=manifest, instance=f"t-{uuid.uuid4().hex[:6]}", ack_wait_s=2.0))
    try:
        await system["catalog"]._specs.wait_until(lambda i: "agent.slowpoke" in i, 5)
        request_id = uuid.uuid4().hex
        call_id = call_id_for(turn_id_for(request_id), 0)
        child = child_session_id(sid, call_id, "slowpoke")
        model.script = [
            (200, reply(calls=[("p1", "agent__slowpoke", {"message": "Write hi."})])),
            (200, reply(calls=[("w1", "approvals__write", {"text": "hi"})])),  # child
            (200, reply("The writer took too long.")),                        # parent
        ]
        # Nobody approves the child's write: the parent's call times out.
        end = await client.ask(sid, "Have hi written.", request_id=request_id, timeout=60)
        assert isinstance(end, TurnCompleted), end
        (outcome,) = end.outcomes
        assert outcome.status == "failed" and outcome.error is not None
        assert outcome.error.error_type == "timeout"
        assert "its turn was stopped" in outcome.error.message
        # The child turn is over: its waiting write will never run, nor be asked about.
        state = await client.fold_session(child)
        (turn,) = state.turns.values()
        assert turn.status == "cancelled", turn
        (write,) = state.calls.values()
        assert write.status == "failed" and write.error is not None
        assert write.error.error_type == "cancelled"
        async with asyncio.timeout(15):
            while any(a.session_id == child  # noqa: ASYNC110 - a KV, polled
                      for a in await ApprovalStore(bus).load()):
                await asyncio.sleep(0.1)
        events = [e.event for e in await EventLog(bus).read_session(child)]
        assert any(isinstance(e, TurnCancelled) for e in events)
    finally:
        await actor.stop()


@contextlib.asynccontextmanager
async def _child_waiting_for_a_human(bus: Bus, client: ToolbusClient, model: ScriptedChat,
                                     sid: str) -> AsyncIterator[tuple[str, str]]:
    """A turn whose agent call's child turn waits for a human (its `approvals:write`):
    yields the turn's request id and the child session, once the child waits; the turn
    is left asked (cancelled, if still running, afterwards)."""
    from bus.approvals import ApprovalStore

    request_id = uuid.uuid4().hex
    _, child = _child_of(sid, request_id)
    model.script = [
        (200, reply(calls=[("p1", "agent__writer", {"message": "Write hi."})])),
        (200, reply(calls=[("w1", "approvals__write", {"text": "hi"})])),  # the child's
    ]
    asking = asyncio.create_task(client.ask(sid, "Have hi written.", request_id=request_id,
                                            timeout=60))
    try:
        async with asyncio.timeout(20):
            while not any(a.session_id == child  # noqa: ASYNC110 - a KV, polled
                          for a in await ApprovalStore(bus).load()):
                await asyncio.sleep(0.05)
        yield request_id, child
    finally:
        asking.cancel()
        await asyncio.wait({asking})
        model.script.clear()
        with contextlib.suppress(Exception):
            await client.cancel(sid, turn_id_for(request_id), reason="test over", timeout=10)


async def test_cancelling_a_turn_stops_the_child_turn_of_its_running_agent_call(
        bus: Bus, client: ToolbusClient, planner: Any, model: ScriptedChat,
        sid: str) -> None:
    from schemas.events import TurnCancelled

    # The user cancels the turn while its agent's child turn waits for a human: the
    # child's turn is cancelled too, not left to run its calls (one approved later would
    # run) for a turn nobody waits for any more.
    async with _child_waiting_for_a_human(bus, client, model, sid) as (request_id, child):
        cancelled = await client.cancel(sid, turn_id_for(request_id), reason="changed my mind")
        assert isinstance(cancelled, TurnCancelled), cancelled
        async with asyncio.timeout(20):
            while True:
                state = await client.fold_session(child)
                (turn,) = state.turns.values()
                if turn.status != "running":
                    break
                await asyncio.sleep(0.05)
        assert turn.status == "cancelled", turn
        (write,) = state.calls.values()
        assert write.status == "failed" and write.error is not None
        assert write.error.error_type == "cancelled"
        (ended,) = [e.event for e in await EventLog(bus).read_session(child)
                    if isinstance(e.event, TurnCancelled)]
        assert f"turn {turn_id_for(request_id)} of session {sid}" in (ended.message or "")


async def test_a_resubmitted_request_of_the_turn_does_not_stop_its_agents_child_turn(
        bus: Bus, client: ToolbusClient, planner: Any, model: ScriptedChat,
        sid: str) -> None:
    from bus.subjects import request_subject
    from schemas.events import RequestRejected

    # A client sending the turn's request again (past the message-id window) gets a
    # `duplicate_request` refusal under the turn's request id: not the turn's end, so the
    # child turn of its agent call goes on.
    async with _child_waiting_for_a_human(bus, client, model, sid) as (request_id, child):
        await bus.js.publish(request_subject(sid), json.dumps(
            {"request_id": request_id, "message": "Have hi written."}).encode(),
            headers={"Nats-Msg-Id": f"again-{uuid.uuid4().hex}"})
        async with asyncio.timeout(10):
            while not any(isinstance(e.event, RequestRejected)  # noqa: ASYNC110
                          and e.event.reason == "duplicate_request"
                          for e in await EventLog(bus).read_session(sid)):
                await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # time for a wrong cancellation to be stored
        (turn,) = (await client.fold_session(child)).turns.values()
        assert turn.status == "running", turn


# --- a budget of agent calls (a security review: 64 calls a turn, 4 levels deep) --------


def _fan_out(data: dict[str, Any]) -> dict[str, Any]:
    """A model talked into calling `agent:delegate` three times at once whenever it may."""
    last = data["messages"][-1]
    tools = {t["function"]["name"] for t in data.get("tools", [])}
    if last["role"] == "tool" or "agent__delegate" not in tools:
        return reply("done")
    return reply(calls=[(f"c{uuid.uuid4().hex[:6]}", "agent__delegate",
                         {"message": "Ask yourself again."}) for _ in range(3)])


def test_agent_calls_past_the_turns_budget_are_refused_to_the_model() -> None:
    from actors.planner import AGENT_BUDGET_RULE, _agent_calls
    from schemas.events import CallRejected, CallRequested, ModelResponded, ModelToolCall

    rules = Rules(max_agent_calls=8)
    from actors.agent_tools import agent_tool_spec
    from schemas.manifest import AgentDef

    offer = Offer(provider="openai", model="main",
                  tools=(agent_tool_spec("delegate", AgentDef(instructions="Delegate.")),))
    for sid, allowed in (("s", 8), (child_session_id("s", "t-0", "d"), 4),
                         ("d--3-0123456789abcdef0123", 1), ("d--5-0123456789abcdef0123", 1)):
        state = SessionState(session_id=sid)
        evolve(state, TurnRequested(session_id=sid, at=0, actor="session", turn_id="t",
                                    request_id="t", call_ids=[], message="go"), 1)
        evolve(state, ModelRequested(session_id=sid, at=0, actor="planner", turn_id="t",
                                     iteration=1, provider="openai", model="main",
                                     tools=1, tools_digest="d"), 2)
        calls = [ModelToolCall(call_id=call_id_for("t", i), id=f"c{i}",
                               name="agent:delegate", arguments={"message": "go"})
                 for i in range(10)]
        evolve(state, ModelResponded(session_id=sid, at=0, actor="planner", turn_id="t",
                                     iteration=1, text="", tool_calls=calls), 3)
        out = decide(state, offer, now=1.0, rules=rules)
        requested = [i.event for i in out if isinstance(i.event, CallRequested)]
        refused = [i.event for i in out if isinstance(i.event, CallRejected)]
        assert len(requested) == 10, sid  # every call is stored, each refusal with it
        assert [r.call_id for r in refused] == [c.call_id for c in calls[allowed:]], sid
        assert {(r.reason, r.rule) for r in refused} == {("agent_budget", AGENT_BUDGET_RULE)}
        assert f"the {allowed} agent call(s) allowed" in refused[0].message
        # Stored, those refused do not count: the budget is what ran, not what was asked.
        for seq, item in enumerate(out, start=4):
            evolve(state, item.event, seq)
        assert rules.agent_calls(sid) == allowed
        assert _agent_calls(state, state.turns["t"]) == allowed
    assert Rules(max_agent_calls=0).agent_calls("s") == 0


async def test_a_model_fanning_out_agents_calling_agents_runs_a_bounded_tree(
        bus: Bus, system: dict[str, Any], client: ToolbusClient, sid: str) -> None:
    """Three agent calls in every reply, at every level: with `max_agent_calls: 2`, two
    run at the top, one in each child turn (half, at least one), to the depth limit."""
    async with _delegating(bus, system, _fan_out,
                           "  limits: {max_agent_calls: 2}\n") as server:
        end = await client.ask(sid, "Go.", timeout=120)
        assert isinstance(end, TurnCompleted), end
    # Child turns: 2 at depth 1, then one each at depths 2, 3 and 4 (whose own call is
    # refused by the depth limit): 8, each asking the model twice, as the top turn does.
    asked = [r for r in server.received if r["messages"][-1]["role"] != "tool"]
    assert len(asked) == 1 + 8
    assert len(server.received) == 2 * (1 + 8)
    budget = [m for r in server.received for m in r["messages"]
              if m["role"] == "tool" and "agent call(s) allowed" in (m["content"] or "")]
    # Refused: 1 of the top turn's 3, 2 of each child turn's (the one left at depth 4 is
    # refused by the depth limit).
    assert len(budget) == 1 + 2 * 8
    depth = [m for r in server.received for m in r["messages"]
             if m["role"] == "tool" and "agents already call agents" in (m["content"] or "")]
    assert len(depth) == 2


def test_an_agent_call_refused_for_its_arguments_leaves_the_budget_for_its_retry() -> None:
    """A call the approval actor refused for its arguments goes back to the model to be
    made again (`max_argument_retries`); it ran no child turn, so it spends none of the
    budget: at depth 3 (one agent call) the corrected call runs, not refused."""
    from actors.agent_tools import agent_tool_spec
    from actors.planner import _agent_calls
    from schemas.events import CallRejected, CallRequested, ModelResponded, ModelToolCall
    from schemas.manifest import AgentDef

    sid = "d--3-0123456789abcdef0123"
    rules = Rules(max_agent_calls=8)
    assert rules.agent_calls(sid) == 1
    offer = Offer(provider="openai", model="main",
                  tools=(agent_tool_spec("delegate", AgentDef(instructions="Delegate.")),))
    state = SessionState(session_id=sid)
    seq = 0

    def fold(event: Event) -> None:
        nonlocal seq
        seq += 1
        evolve(state, event, seq)

    fold(TurnRequested(session_id=sid, at=0, actor="session", turn_id="t", request_id="t",
                       call_ids=[], message="go"))
    for iteration, arguments in ((1, {"nope": 1}), (2, {"message": "go"})):
        fold(ModelRequested(session_id=sid, at=0, actor="planner", turn_id="t",
                            iteration=iteration, provider="openai", model="main", tools=1,
                            tools_digest="d"))
        call = ModelToolCall(call_id=call_id_for("t", iteration), id=f"c{iteration}",
                             name="agent:delegate", arguments=arguments)
        fold(ModelResponded(session_id=sid, at=0, actor="planner", turn_id="t",
                            iteration=iteration, text="", tool_calls=[call]))
        out = decide(state, offer, now=1.0, rules=rules)
        assert [type(i.event) for i in out] == [CallRequested], out  # not refused
        fold(out[0].event)
        if iteration == 1:  # the approval actor refuses it for its arguments
            fold(CallRejected(session_id=sid, at=1, actor="approval", call_id=call.call_id,
                              turn_id="t", tool="agent:delegate", reason="invalid_arguments",
                              rule="schema", message="$.message: required"))
            assert _agent_calls(state, state.turns["t"]) == 0
    assert _agent_calls(state, state.turns["t"]) == 1  # the one that runs
    # Denied by a human (it ends `failed`, never dispatched): no child turn ran either.
    state.calls[call_id_for("t", 2)].human_decision = "denied"
    assert _agent_calls(state, state.turns["t"]) == 0


async def test_a_request_sent_again_after_its_model_made_calls_gets_the_turns_end(
        client: ToolbusClient, planner: Any, model: ScriptedChat, sid: str) -> None:
    # The model's calls join the turn (schemas/state.py): they are not another request's.
    # Sent again (a retry, `toolbus chat`'s resend, an agent call re-attaching to its
    # child turn), it was refused as "used for another request".
    request_id = uuid.uuid4().hex
    end = await _hi_said(client, model, sid, request_id)
    again = await client.ask(sid, "Have hi said.", request_id=request_id, timeout=60)
    assert isinstance(again, TurnCompleted) and again.turn_id == end.turn_id
    assert again.text == end.text
    from schemas.errors import InvalidRequestError
    with pytest.raises(InvalidRequestError, match="for another request"):
        await client.ask(sid, "Have bye said.", request_id=request_id, timeout=60)


async def test_an_agent_call_run_again_reattaches_to_a_child_turn_that_made_calls(
        bus: Bus, client: ToolbusClient, planner: Any, model: ScriptedChat,
        sid: str) -> None:
    # A redelivered agent call asks its child session again under the same request id
    # (actors/agent_tools.py): the child's own calls were taken for another request's.
    from actors.agent_tools import child_request_id
    from schemas.errors import BusTimeoutError

    async with _child_waiting_for_a_human(bus, client, model, sid) as (request_id, child):
        call_id, _ = _child_of(sid, request_id)
        with pytest.raises(BusTimeoutError, match="was accepted but had not ended"):
            await client.ask(child, "Write hi.", agent="writer",
                             request_id=child_request_id(sid, call_id), timeout=2)
