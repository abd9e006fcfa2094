"""Composed mode (seed 001) against a real local HTTP server speaking the OpenAI Chat
Completions API with scripted replies: the model is asked for one JSON object valid
against the composed `{output, calls}` schema (structured output, no `tools`), its calls
go through the same path as native ones, and replay equals live (the `client` fixture
checks it) without a model call."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest

from actors.composed import composed_schema, read_composed
from actors.latent import LatentExecutor, LatentTool, latent_spec
from actors.llm.types import ModelSettings
from actors.planner import EMIT_OUTPUT, Planner, Rules
from actors.tools import ResourceScope
from bus.client import ToolbusClient
from bus.connection import Bus
from bus.eventlog import EventLog
from schemas.errors import ManifestError
from schemas.events import (
    CallDispatched,
    CallSucceeded,
    ModelResponded,
    TurnCompleted,
    TurnFailed,
)
from schemas.manifest import AgentConfig, parse_manifest
from schemas.tools import ToolSpec
from schemas.validation import Validator
from services.config import ActorSettings
from services.runtime import start_planner
from tests.actors.test_planner import ScriptedChat, reply
from tests.conftest import REPO


def _settings(model: ScriptedChat) -> ModelSettings:
    return ModelSettings(provider="openai", model="scripted", api_key="sk-test-key",
                         base_url=f"http://127.0.0.1:{model.port}/v1", max_retries=1)


def _offered(spec: Any) -> bool:
    return bool(spec.name == "built-in:echo")


async def _composed_planner(bus: Bus, system: dict[str, Any], model: ScriptedChat,
                            rules: Rules) -> Planner:
    p = Planner(bus, system["catalog"], _settings(model), rules=rules, tools=_offered)
    await p.start()
    return p


@pytest.fixture
async def composed(bus: Bus, system: dict[str, Any], model: ScriptedChat
                   ) -> AsyncIterator[Planner]:
    p = await _composed_planner(bus, system, model, Rules(instructions="Be brief.",
                                                          mode="composed",
                                                          max_output_retries=1))
    yield p
    await p.stop()


def _answer(output: Any, calls: list[dict[str, Any]] = ()) -> dict[str, Any]:  # type: ignore[assignment]  # a default never mutated
    return reply(json.dumps({"output": output, "calls": list(calls)}))


def test_a_latent_tool_without_a_model_is_refused_clearly() -> None:
    with pytest.raises(ManifestError, match=r"agent_config\.model"):
        parse_manifest("tools:\n  latent:\n    - name: text:summary\n"
                       "      output_schema: {type: object}\n", env={})


def test_the_manifests_mode_reaches_the_planners_rules() -> None:
    assert Rules.of(AgentConfig(mode="composed")).mode == "composed"
    assert Rules.of(AgentConfig()).mode == "native"


async def test_a_composed_turn_asks_for_the_composed_schema_and_no_tools(
        bus: Bus, client: ToolbusClient, composed: Planner, model: ScriptedChat,
        system: dict[str, Any], sid: str, nats_url: str) -> None:
    model.script = [
        (200, _answer(None, [{"_tool": "built-in:echo", "_reasoningForCall": "asked to",
                              "text": "a"}])),
        (200, _answer("Echoed a.")),
    ]
    end = await client.ask(sid, "Echo a.")
    assert isinstance(end, TurnCompleted), end
    assert end.text == "Echoed a."
    assert [(o.tool, o.status) for o in end.outcomes] == [("built-in:echo", "succeeded")]

    # What the server received: structured output with the composed schema, no tools.
    first, second = model.received
    assert "tools" not in first and "tool_choice" not in first
    echo = system["catalog"].get("built-in:echo")
    expected = composed_schema([echo], None, emit_output=EMIT_OUTPUT)
    assert first["response_format"]["type"] == "json_schema"
    assert first["response_format"]["json_schema"]["schema"] == expected
    assert "built-in:echo" in json.dumps(first["response_format"])
    assert first["messages"][0]["role"] == "system"
    assert first["messages"][0]["content"].startswith("Be brief.")
    # The result comes back as text: no tool messages, no native tool calls.
    assert all(m["role"] in ("system", "user", "assistant") for m in second["messages"])
    assert all("tool_calls" not in m for m in second["messages"])
    results = second["messages"][-1]
    assert results["role"] == "user" and results["content"].startswith("Results of your calls")
    assert json.loads(results["content"].split(": ", 1)[1]) == \
        [{"_tool": "built-in:echo", "result": json.dumps({"text": "a"}, separators=(",", ":"))}]

    # Stored as native calls would be: the call went through call.requested.
    events = [s.event for s in await EventLog(bus).read_session(sid)]
    answered = [e for e in events if isinstance(e, ModelResponded)]
    assert answered[0].tool_calls[0].name == "built-in:echo"
    assert answered[0].tool_calls[0].arguments == {"text": "a"}

    # Replay rebuilds the state from the log and calls no model.
    before = len(model.received)
    out = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "services.cli", "replay", sid, "--nats",
                         nats_url], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "Echoed a." in out.stdout
    assert len(model.received) == before


async def test_a_composed_answer_that_breaks_the_schema_goes_back_to_the_model(
        client: ToolbusClient, composed: Planner, model: ScriptedChat, sid: str) -> None:
    model.script = [
        (200, reply("I think the answer is 4.")),
        (200, _answer(None, [{"_tool": "built-in:nope"}])),
        (200, _answer("4")),
    ]
    end = await client.ask(sid, "2+2?")
    assert isinstance(end, TurnFailed) and end.reason == "invalid_composed_output", end
    assert len(model.received) == 2  # max_output_retries=1: two answers in all
    told = model.received[1]["messages"][-1]
    assert told["role"] == "user" and "does not match the schema" in told["content"]
    assert "not JSON" in told["content"]
    # The timeline says why each answer was refused, as the model was told.
    from bus.eventlog import EventLog
    from schemas.events import ModelResponded, summarize

    answers = [s.event for s in await EventLog(client.bus).read_session(sid)
               if isinstance(s.event, ModelResponded)]
    assert len(answers) == 2 and all(a.violations for a in answers)
    for answer in answers:
        line = summarize(answer)
        assert f"refused, {len(answer.violations)} violation(s): " in line, line
        assert answer.violations[0][:40] in line


async def test_a_composed_answer_is_fixed_after_the_violations_are_sent_back(
        client: ToolbusClient, composed: Planner, model: ScriptedChat, sid: str) -> None:
    model.script = [(200, reply("{\"calls\": []}")), (200, _answer("4"))]
    end = await client.ask(sid, "2+2?")
    assert isinstance(end, TurnCompleted) and end.text == "4", end
    assert "output" in model.received[1]["messages"][-1]["content"]


async def test_a_composed_output_is_judged_against_the_output_schema(
        bus: Bus, client: ToolbusClient, system: dict[str, Any], model: ScriptedChat,
        sid: str) -> None:
    schema = {"type": "object", "properties": {"sum": {"type": "integer"}},
              "required": ["sum"]}
    p = await _composed_planner(bus, system, model, Rules(mode="composed",
                                                          output_schema=schema))
    try:
        model.script = [(200, _answer({"sum": 4}))]
        end = await client.ask(sid, "2+2?")
    finally:
        await p.stop()
    assert isinstance(end, TurnCompleted) and end.output == {"sum": 4}, end
    sent = model.received[0]["response_format"]["json_schema"]["schema"]
    assert sent["properties"]["output"]["properties"] == schema["properties"]
    assert "tools" not in model.received[0]


# --- latent tools ---------------------------------------------------------------------

SENTIMENT_OUT = {"type": "object", "properties": {"sentiment": {"type": "string"},
                                                  "confidence": {"type": "number"}},
                 "required": ["sentiment", "confidence"]}


async def test_latent_calls_of_one_executor_share_its_model_connections(
        model: ScriptedChat) -> None:
    # One client per executor, opened with it: a client per call made a new connection
    # (and, to a real provider, a TLS handshake) every call.
    spec = latent_spec("text:sentiment", description="Analyzes text sentiment",
                       parameters={"type": "object"}, output=SENTIMENT_OUT)
    tool = LatentTool(spec, _settings(model))
    answer = {"sentiment": "positive", "confidence": 0.9}
    model.script = [(200, reply(json.dumps(answer))) for _ in range(3)]
    async with ResourceScope([tool]) as scope:
        for _ in range(3):
            assert await tool.run({"text": "fine"}, scope.values) == answer
    assert len(model.peers) == 3 and len(set(model.peers)) == 1, model.peers


async def test_a_latent_tool_is_run_by_the_model_and_stored_with_executor_latent(
        bus: Bus, client: ToolbusClient, system: dict[str, Any], model: ScriptedChat,
        sid: str, nats_url: str) -> None:
    spec = latent_spec("text:sentiment", description="Analyzes text sentiment",
                       parameters={"type": "object", "required": ["text"],
                                   "properties": {"text": {"type": "string"}}},
                       output=SENTIMENT_OUT)
    runner = LatentExecutor(bus, [spec], _settings(model), max_output_retries=1,
                            ack_wait_s=5.0)
    await runner.start()
    # The planner and the approval actor share this catalog: both must know the tool.
    await system["catalog"]._specs.wait_until(lambda items: "text.sentiment" in items, 5)
    p = Planner(bus, system["catalog"], _settings(model),
                tools=lambda s: s.name == "text:sentiment")
    await p.start()
    try:
        model.script = [
            (200, reply(calls=[("c1", "text__sentiment", {"text": "This is the best!"})])),
            (200, reply("no JSON here")),  # the latent call's first answer: asked again
            (200, reply(json.dumps({"sentiment": "positive", "confidence": 0.99}))),
            (200, reply("Positive.")),
        ]
        end = await client.ask(sid, "What is the sentiment of 'This is the best!'?")
    finally:
        await p.stop()
        await runner.stop()
    assert isinstance(end, TurnCompleted) and end.text == "Positive.", end
    assert [(o.tool, o.status) for o in end.outcomes] == [("text:sentiment", "succeeded")]

    # The latent call: structured output with the tool's `_output` schema, no tools, the
    # arguments as the message; the broken answer went back with its violations.
    latent, again = model.received[1], model.received[2]
    assert latent["response_format"]["json_schema"]["schema"] == SENTIMENT_OUT
    assert "tools" not in latent
    assert json.loads(latent["messages"][-1]["content"]) == {"text": "This is the best!"}
    assert "does not match the schema" in again["messages"][-1]["content"]

    events = [s.event for s in await EventLog(bus).read_session(sid)]
    done = next(e for e in events if isinstance(e, CallSucceeded))
    assert done.executor == "latent"
    assert done.result == {"sentiment": "positive", "confidence": 0.99}
    dispatched = next(e for e in events if isinstance(e, CallDispatched))
    assert dispatched.route == "latent.text"
    sent_back = next(m for m in model.received[3]["messages"] if m["role"] == "tool")
    assert json.loads(sent_back["content"])["sentiment"] == "positive"

    # Replay reads the result from the log: no model call.
    before = len(model.received)
    out = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "services.cli", "replay", sid, "--nats",
                         nats_url], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "call.succeeded" in out.stdout
    assert len(model.received) == before


async def test_a_manifests_latent_tool_drives_a_composed_turn_through_start_planner(
        bus: Bus, client: ToolbusClient, system: dict[str, Any], model: ScriptedChat,
        sid: str) -> None:
    manifest = parse_manifest(f"""\
tools:
  latent:
    - name: text:summary
      description: Summarizes a text in a few words
      parameters: {{type: object, required: [text], properties: {{text: {{type: string}}}}}}
      output_schema:
        {{type: object, required: [summary], properties: {{summary: {{type: string}}}}}}
agent_config:
  mode: composed
  model: {{provider: openai, model: scripted, base_url: "http://127.0.0.1:{model.port}/v1"}}
""", env={})
    actor = await start_planner(bus, ActorSettings(manifest=manifest, ack_wait_s=5.0))
    try:
        await system["catalog"]._specs.wait_until(lambda items: "text.summary" in items, 5)
        model.script = [
            (200, _answer(None, [{"_tool": "text:summary", "text": "a long story"}])),
            (200, reply(json.dumps({"summary": "a story"}))),
            (200, _answer("It is a story.")),
        ]
        end = await client.ask(sid, "Summarize: a long story")
    finally:
        await actor.stop()
    assert isinstance(end, TurnCompleted) and end.text == "It is a story.", end
    first, latent, _ = model.received
    assert "tools" not in first
    names = [v["properties"]["_tool"]["const"] for v in
             first["response_format"]["json_schema"]["schema"]["properties"]["calls"]
             ["items"]["anyOf"]]
    assert "text:summary" in names
    assert latent["response_format"]["json_schema"]["schema"]["required"] == ["summary"]
    events = [s.event for s in await EventLog(bus).read_session(sid)]
    done = next(e for e in events if isinstance(e, CallSucceeded))
    assert (done.executor, done.result) == ("latent", {"summary": "a story"})


def test_a_composed_output_becomes_an_emit_output_call_under_output_when_wrapped() -> None:
    schema = composed_schema([], {"type": "integer"}, emit_output=EMIT_OUTPUT)
    _, calls, violations = read_composed(
        '```json\n{"output": 4, "calls": []}\n```', Validator(schema), turn_id="t1", base=3,
        emit_output=EMIT_OUTPUT, wrapped=True)
    assert violations == [] and [(c.name, c.arguments) for c in calls] == \
        [(EMIT_OUTPUT, {"output": 4})]
    assert calls[0].call_id == calls[0].id
    _, none, broken = read_composed('{"output": "4", "calls": []}', Validator(schema),
                                    turn_id="t1", base=0, emit_output=EMIT_OUTPUT,
                                    wrapped=True)
    assert none == [] and broken and broken[0].startswith("$.output")


def test_a_composed_answer_nested_too_deeply_is_told_so_not_that_it_is_not_json() -> None:
    schema = composed_schema([], None, emit_output=EMIT_OUTPUT)
    deep = '{"output": ' + "[" * 100 + "]" * 100 + ', "calls": []}'
    _, calls, violations = read_composed(deep, Validator(schema), turn_id="t1", base=0,
                                         emit_output=None, wrapped=False)
    assert calls == [] and violations == ["$: the answer nests deeper than 64 levels"]
    _, _, broken = read_composed('{"output": "cut', Validator(schema), turn_id="t1", base=0,
                                 emit_output=None, wrapped=False)
    assert broken[0].startswith("$: the answer is not JSON")


def test_a_composed_call_keeps_a_tool_parameter_named_with_an_underscore() -> None:
    # Only the composed schema's own keys are taken out of a call: a tool's `_id`
    # parameter stays (it was dropped with them, and the call refused for missing it).
    spec = ToolSpec(name="crm:get", parameters={
        "type": "object", "required": ["_id"], "properties": {"_id": {"type": "string"}}})
    schema = composed_schema([spec], None, emit_output=None)
    _, calls, violations = read_composed(
        '{"output": null, "calls": [{"_tool": "crm:get", "_reasoningForCall": "look", '
        '"_id": "c7"}]}', Validator(schema), turn_id="t1", base=0,
        emit_output=None, wrapped=False)
    assert violations == [] and [(c.name, c.arguments) for c in calls] == \
        [("crm:get", {"_id": "c7"})]
