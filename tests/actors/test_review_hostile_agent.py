"""Review: a hostile model and a careless manifest against the agent half (composed mode,
latent tools, think steps, agents as tools), on real NATS and a real scripted model
server."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from actors.planner import Planner, Rules
from bus.client import ToolbusClient
from bus.connection import Bus
from schemas.events import TurnCompleted, TurnFailed
from tests.actors.test_planner import ScriptedChat, reply
from tests.actors.test_planner_latent import _composed_planner, _settings

NESTED = "[" * 5000 + "]" * 5000


@pytest.fixture
async def composed(bus: Bus, system: dict[str, Any], model: ScriptedChat
                   ) -> AsyncIterator[Planner]:
    p = await _composed_planner(bus, system, model, Rules(mode="composed",
                                                          max_output_retries=1))
    yield p
    await p.stop()


async def test_a_composed_answer_nested_too_deeply_goes_back_to_the_model(
        bus: Bus, client: ToolbusClient, composed: Planner, model: ScriptedChat,
        sid: str) -> None:
    model.script = [
        (200, reply(json.dumps({"output": None, "calls": []})[:-1] + f', "x": {NESTED}}}')),
        (200, reply(json.dumps({"output": "4", "calls": []}))),
    ]
    end = await client.ask(sid, "2+2?", timeout=30)
    # An answer that is not usable JSON is a violation sent back to the model, as any
    # other; never an internal failure of the planner.
    assert isinstance(end, TurnCompleted) and end.text == "4", end


async def test_a_think_output_nested_too_deeply_goes_back_to_the_model(
        bus: Bus, client: ToolbusClient, system: dict[str, Any], model: ScriptedChat,
        sid: str) -> None:
    from schemas.manifest import ThinkStep

    step = ThinkStep(id="plan", instruction="Plan.", output_schema={"type": "object"})
    p = await _composed_planner(bus, system, model, Rules(think=(step,),
                                                          max_output_retries=1))
    try:
        model.script = [(200, reply(NESTED)), (200, reply("{}")), (200, reply("done"))]
        end = await client.ask(sid, "Go.", timeout=30)
    finally:
        await p.stop()
    assert isinstance(end, TurnCompleted) and end.text == "done", end


DEEP_ARGS = {"a": json.loads("[" * 300 + "]" * 300)}  # decodes, but deeper than validators go


async def test_emit_output_nested_too_deeply_is_refused_back_to_the_model(
        bus: Bus, client: ToolbusClient, system: dict[str, Any], model: ScriptedChat,
        sid: str) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    p = await _composed_planner(bus, system, model, Rules(output_schema=schema))
    try:
        model.script = [
            (200, reply(calls=[("e1", "built-in__emit_output", DEEP_ARGS)])),
            (200, reply(calls=[("e2", "built-in__emit_output", {"a": 1})])),
        ]
        end = await client.ask(sid, "Go.", timeout=30)
    finally:
        await p.stop()
    assert isinstance(end, TurnCompleted) and end.output == {"a": 1}, end


async def test_native_arguments_nested_too_deeply_are_refused_with_inline_approval(
        bus: Bus, client: ToolbusClient, system: dict[str, Any], model: ScriptedChat,
        sid: str) -> None:
    from actors.llm.types import ModelSettings

    settings = ModelSettings(provider="openai", model="scripted", api_key="sk-test-key",
                             base_url=f"http://127.0.0.1:{model.port}/v1", max_retries=1)
    # As `toolbus up` runs it: the approval actor in the planner's process.
    p = Planner(bus, system["catalog"], settings,
                tools=lambda s: s.name == "built-in:current_time", approval=system["approval"])
    await p.start()
    try:
        model.script = [
            (200, reply(calls=[("c1", "built-in__current_time",
                                {"timezone": DEEP_ARGS["a"]})])),
            (200, reply("gave up")),
        ]
        end = await client.ask(sid, "Go.", timeout=30)
    finally:
        await p.stop()
    assert isinstance(end, TurnCompleted) and end.text == "gave up", end
    (outcome,) = end.outcomes
    assert outcome.status == "rejected" and outcome.error is not None, outcome
    assert outcome.error.error_type == "invalid_arguments", outcome


@pytest.mark.parametrize("depth", [990, 5000])
async def test_native_arguments_nested_too_deeply_are_refused_and_the_session_goes_on(
        bus: Bus, client: ToolbusClient, system: dict[str, Any], model: ScriptedChat,
        sid: str, depth: int) -> None:
    from actors.llm.types import ModelSettings

    settings = ModelSettings(provider="openai", model="scripted", api_key="sk-test-key",
                             base_url=f"http://127.0.0.1:{model.port}/v1", max_retries=1)
    p = Planner(bus, system["catalog"], settings, tools=lambda s: s.name == "built-in:echo")
    await p.start()
    deep = reply(calls=[("c1", "built-in__echo", {})])
    deep["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] = \
        '{"a": ' + "[" * depth + "]" * depth + "}"
    try:
        model.script = [
            (200, deep),
            (200, reply("done")),
        ]
        end = await client.ask(sid, "Go.", timeout=30)
        model.script = [(200, reply("again"))]
        again = await client.ask(sid, "Again.", timeout=30)
    finally:
        await p.stop()
    assert isinstance(end, TurnCompleted) and end.text == "done", end
    (outcome,) = end.outcomes  # refused, the model told: never run, never stored deep
    assert outcome.status == "rejected" and outcome.error is not None, outcome
    assert outcome.error.error_type == "invalid_arguments", outcome
    assert isinstance(again, TurnCompleted) and again.text == "again", again
    # The `client` fixture then checks that the replay equals the live state.


async def test_a_reply_too_large_for_an_event_ends_the_turn_as_a_model_error(
        bus: Bus, client: ToolbusClient, system: dict[str, Any], model: ScriptedChat,
        sid: str) -> None:
    from actors.llm.types import ModelSettings

    settings = ModelSettings(provider="openai", model="scripted", api_key="sk-test-key",
                             base_url=f"http://127.0.0.1:{model.port}/v1", max_retries=1)
    p = Planner(bus, system["catalog"], settings, tools=lambda s: s.name == "built-in:echo")
    await p.start()
    try:
        # Under the transport's 16 MiB, over the 256 KiB an event may hold.
        model.script = [(200, reply("x" * 400_000))]
        end = await client.ask(sid, "Go.", timeout=30)
    finally:
        await p.stop()
    assert isinstance(end, TurnFailed) and end.reason == "model_error", end
    assert "too large" in end.message


@pytest.mark.parametrize("data", [
    {"crm": {"get_account": {"balance": "150"}}},       # a number sent as text
    {"crm": {"get_account": {"balance": {"v": 1}}}},     # an object
    {"crm": {"get_account": {"balance": [1, "a"]}}},     # a list
])
def test_when_state_over_a_result_of_an_unexpected_type_counts_as_not_applying(
        data: dict[str, Any]) -> None:
    from actors.planner import Offer, decide
    from schemas.events import PoliciesMatched, TurnRequested
    from tests.actors.test_planner_policies import _fold, agent

    rules = agent({"policies": [
        {"id": "rich", "when_state": "crm.get_account.balance > `100`",
         "action": "Offer the premium card."},
        {"id": "always", "action": "Be polite."},
    ]})
    state = _fold([TurnRequested(session_id="s", at=0.0, actor="session", turn_id="t",
                                 request_id="t", call_ids=[], message="hi")])
    state.data.update(data)
    (matched,) = decide(state, Offer(provider="openai", model="m"), now=0.0, rules=rules)
    assert isinstance(matched.event, PoliciesMatched)
    assert matched.event.matched == ["always"]
    assert all(n.startswith("rich: when_state failed") for n in matched.event.notes)


async def test_a_composed_answer_may_not_ask_for_more_calls_than_a_native_reply(
        bus: Bus, client: ToolbusClient, composed: Planner, model: ScriptedChat,
        sid: str) -> None:
    from actors.llm.transport import MAX_CALLS_PER_REPLY

    many = [{"_tool": "built-in:echo", "text": str(i)} for i in range(MAX_CALLS_PER_REPLY + 72)]
    model.script = [
        (200, reply(json.dumps({"output": None, "calls": many}))),
        (200, reply(json.dumps({"output": "ok", "calls": []}))),
    ]
    end = await client.ask(sid, "Go.", timeout=60)
    assert isinstance(end, TurnCompleted) and end.text == "ok", end
    assert end.outcomes == [], f"{len(end.outcomes)} calls ran from one composed answer"
    assert "calls" in model.received[1]["messages"][-1]["content"]


@pytest.mark.parametrize("calls", [[{"_tool": 5}], ["x"], [{}], [{"_tool": {"a": 1}}],
                                   [{"_tool": "x" * 600}]])
async def test_a_composed_answer_with_calls_and_no_tool_offered_goes_back_to_the_model(
        bus: Bus, client: ToolbusClient, system: dict[str, Any], model: ScriptedChat,
        sid: str, calls: list[Any]) -> None:
    from bus.eventlog import EventLog

    # No tool offered (an agent granted nothing, no executor live): the composed schema
    # then allows no call at all. A call there, whatever its shape, is a violation sent
    # back; it was read as a call named 5, and every event of the turn stored unreadable.
    p = Planner(bus, system["catalog"], _settings(model),
                rules=Rules(mode="composed", max_output_retries=1), tools=lambda spec: False)
    await p.start()
    try:
        model.script = [(200, reply(json.dumps({"output": None, "calls": calls}))),
                        (200, reply(json.dumps({"output": "ok", "calls": []})))]
        end = await client.ask(sid, "Go.", timeout=30)
    finally:
        await p.stop()
    assert isinstance(end, TurnCompleted) and end.text == "ok" and end.outcomes == [], end
    assert "calls" in model.received[1]["messages"][-1]["content"]
    stored = await EventLog(bus).read_session(sid)
    assert all(s.event is not None for s in stored), [s.error for s in stored]


def test_read_composed_refuses_calls_that_are_not_named_objects_whatever_the_schema(
) -> None:
    from actors.composed import read_composed
    from schemas.validation import Validator

    # A schema as loose as a tool's own can be (a variant taking anything): the reader
    # still takes only objects named by a string.
    loose = Validator({"type": "object"})
    for calls in ([{"_tool": 5}], ["x"], [{}], [{"_tool": ""}], [{"_tool": "y" * 513}]):
        text = json.dumps({"output": None, "calls": calls})
        _, got, violations = read_composed(text, loose, turn_id="t1", base=0,
                                           emit_output=None, wrapped=False)
        assert got == [] and violations and violations[0].startswith("$.calls[0]"), calls


async def test_an_output_too_large_for_the_turns_end_goes_back_to_the_model(
        bus: Bus, client: ToolbusClient, system: dict[str, Any], model: ScriptedChat,
        sid: str) -> None:
    from actors.planner import MAX_OUTPUT_BYTES

    # Valid against the schema and small enough for the model's reply, but the turn's end
    # holds it with the outcomes: it was accepted, and the turn then failed `internal`.
    schema = {"type": "object", "properties": {"s": {"type": "string"}}}
    p = await _composed_planner(bus, system, model, Rules(output_schema=schema))
    try:
        model.script = [
            (200, reply(calls=[("e1", "built-in__emit_output",
                                {"s": "x" * (MAX_OUTPUT_BYTES + 10_000)})])),
            (200, reply(calls=[("e2", "built-in__emit_output", {"s": "short"})])),
        ]
        end = await client.ask(sid, "Go.", timeout=30)
    finally:
        await p.stop()
    assert isinstance(end, TurnCompleted) and end.output == {"s": "short"}, end
    (refusal,) = [m for m in model.received[1]["messages"] if m["role"] == "tool"]
    assert "bytes as JSON; at most" in refusal["content"]


def _turn_with_outcomes(n: int, message_chars: int) -> tuple[Any, Any]:
    from schemas.events import CallFailed, CallRequested, TurnRequested
    from schemas.state import SessionState, evolve

    state = SessionState(session_id="s1")
    calls = [f"t1-{i}" for i in range(n)]
    events: list[Any] = [TurnRequested(session_id="s1", at=0.0, actor="session",
                                       turn_id="t1", request_id="r1", call_ids=calls,
                                       message="go")]
    for c in calls:
        events += [CallRequested(session_id="s1", at=0.0, actor="planner", call_id=c,
                                 turn_id="t1", tool="x:" + "y" * 500, arguments={}),
                   CallFailed(session_id="s1", at=0.0, actor="executor", call_id=c,
                              turn_id="t1", error_type="boom", message="m" * message_chars)]
    for seq, event in enumerate(events, start=1):
        evolve(state, event, seq)
    return state, state.turns["t1"]


def test_a_turns_end_over_an_events_size_keeps_its_output_clips_its_text_or_fails() -> None:
    from actors.planner import _complete
    from schemas.defaults import MAX_EVENT_BYTES
    from schemas.events import TurnFailed, encode_event

    state, turn = _turn_with_outcomes(64, 1000)
    # A structured output whose JSON text would not fit beside it: the text is left out.
    output = {"s": "o" * 120_000}
    end = _complete(state, turn, json.dumps(output), output, 1.0).event
    assert isinstance(end, TurnCompleted) and end.output == output and end.text == ""
    assert len(encode_event(end)) <= MAX_EVENT_BYTES
    # A text answer: clipped to fit, saying so and where the whole of it is.
    end = _complete(state, turn, "é" * 200_000, None, 1.0).event
    assert isinstance(end, TurnCompleted) and len(encode_event(end)) <= MAX_EVENT_BYTES
    assert end.text.startswith("é" * 1000) and end.text.endswith("model.responded]")
    # An output too large even alone: the turn fails, saying why.
    big = {"s": "o" * MAX_EVENT_BYTES}
    failed = _complete(state, turn, json.dumps(big), big, 1.0).event
    assert isinstance(failed, TurnFailed) and failed.reason == "answer_too_large"
    assert "an event holds" in failed.message
    # Under the limit, nothing changes.
    small, small_turn = _turn_with_outcomes(1, 10)
    end = _complete(small, small_turn, '{"s": "o"}', {"s": "o"}, 1.0).event
    assert isinstance(end, TurnCompleted) and end.text == '{"s": "o"}'
