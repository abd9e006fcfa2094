"""Seed 000's agent section in the planner: behaviour policies matched at turn start (by
the session state or by the model), reevaluation in the same turn after a reevaluation
tool succeeds, think steps (`built-in:reason`) and `built-in:emit_output` against the
output schema. A real local HTTP server speaks the OpenAI Chat Completions API with
scripted replies; the tools run on a real executor over NATS. Every session's replay
equals its live state (the `client` fixture checks it) and calls no model."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.executor import Executor
from actors.llm.types import ModelSettings
from actors.planner import EMIT_OUTPUT, Offer, Planner, Rules, decide
from actors.tools import tool
from bus.client import ToolbusClient
from bus.connection import Bus
from bus.eventlog import EventLog
from schemas.events import (
    CallRequested,
    CallSucceeded,
    Event,
    ModelRequested,
    ModelResponded,
    ModelToolCall,
    OutputEmitted,
    OutputRejected,
    PoliciesMatched,
    TurnCompleted,
    TurnFailed,
    TurnReevaluated,
    TurnRequested,
    decode_event,
    encode_event,
)
from schemas.manifest import AgentConfig
from schemas.state import SessionState, TurnState, encode_state, evolve, fold
from tests.actors.test_planner import ScriptedChat, reply
from tests.conftest import REPO, EventWatch, assert_replay_equals_live, settled_state

# --- the CRM of seed 000's example --------------------------------------------------------

AUTH = "crm:authenticate_customer"
BALANCE = "crm:get_balance"


@tool(AUTH, idempotent=True, auto_approve=True)
async def authenticate_customer(pin: str) -> dict[str, Any]:
    """Check the customer's PIN."""
    return {"authenticated": pin == "1234", "customer_id": "c-1"}


@tool(BALANCE, read_only=True)
async def get_balance(customer_id: str) -> dict[str, Any]:
    """The balance of an authenticated customer's account."""
    return {"customer_id": customer_id, "balance": 120, "currency": "EUR"}


@pytest.fixture(scope="module")
async def crm(bus: Bus, system: dict[str, Any]) -> AsyncIterator[Executor]:
    executor = Executor(bus, [authenticate_customer, get_balance], instance="crm-tests",
                        ack_wait_s=5.0)
    await executor.start()
    # The planner and the approval actor share this catalog: both must know the tools.
    await system["catalog"]._specs.wait_until(
        lambda items: {"crm.authenticate_customer", "crm.get_balance"} <= set(items), 5)
    yield executor
    await executor.stop()


def agent(section: dict[str, Any]) -> Rules:
    """Rules from an `agent_config:` section, validated as the manifest loader does."""
    return Rules.of(AgentConfig.model_validate(section))


async def start(bus: Bus, system: dict[str, Any], model: ScriptedChat, rules: Rules
                ) -> Planner:
    settings = ModelSettings(provider="openai", model="scripted", api_key="k",
                             base_url=f"http://127.0.0.1:{model.port}/v1", max_retries=0)
    planner = Planner(bus, system["catalog"], settings, rules=rules,
                      tools=lambda spec: spec.namespace in ("built-in", "crm"))
    await planner.start()
    return planner


async def events_of(bus: Bus, sid: str) -> list[Event]:
    return [s.event for s in await EventLog(bus).read_session(sid) if s.event is not None]


def offered(request: dict[str, Any]) -> set[str]:
    """The tools a model request offered, but the context tools (offered beside a
    policy's tools whenever the catalog has them: another test may have served them)."""
    return {t["function"]["name"] for t in request.get("tools", [])} - {
        "built-in__recall", "built-in__context-status"}


def system_text(request: dict[str, Any]) -> str:
    first = request["messages"][0]
    assert first["role"] == "system"
    return str(first["content"])


async def replay_calls_no_model(bus: Bus, client: ToolbusClient, model: ScriptedChat,
                                sid: str) -> None:
    before = len(model.received)
    await assert_replay_equals_live(bus, client, sid)
    assert len(model.received) == before


AUTH_POLICY = {
    "id": "authenticate_first",
    "when_state": "crm.authenticate_customer.authenticated != `true`",
    "action": "The customer is not authenticated: ask for their PIN and call "
              "crm:authenticate_customer before anything else.",
    "tools": [AUTH],
}
ANSWER_POLICY = {
    "id": "answer_account_questions",
    "when_state": "crm.authenticate_customer.authenticated == `true`",
    "action": "The customer is authenticated: answer questions about their account with "
              "crm:get_balance.",
    "tools": [BALANCE],
}


def bank(reevaluation: str | None) -> Rules:
    auth = dict(AUTH_POLICY)
    section: dict[str, Any] = {"instructions": "You are the bank's assistant.",
                               "policies": [auth, ANSWER_POLICY]}
    if reevaluation == "global":  # seed 000's form
        section["context"] = {"reevaluation_tools": [{"id": AUTH}]}
    elif reevaluation == "policy":
        auth["reevaluate_after"] = [AUTH]
    return agent(section)


# --- policies and reevaluation ------------------------------------------------------------


@pytest.mark.parametrize("reevaluation", ["global", "policy"])
async def test_authentication_then_the_answer_in_one_turn_with_reevaluation(
        bus: Bus, system: dict[str, Any], crm: Executor, client: ToolbusClient,
        model: ScriptedChat, sid: str, reevaluation: str) -> None:
    model.script = [
        (200, reply(calls=[("c1", "crm__authenticate_customer", {"pin": "1234"})])),
        (200, reply(calls=[("c2", "crm__get_balance", {"customer_id": "c-1"})])),
        (200, reply("Your balance is 120 EUR.")),
    ]
    planner = await start(bus, system, model, bank(reevaluation))
    try:
        end = await client.ask(sid, "What is my balance? My PIN is 1234.", timeout=60)
    finally:
        await planner.stop()
    assert isinstance(end, TurnCompleted), end
    assert end.text == "Your balance is 120 EUR."
    assert [o.tool for o in end.outcomes] == [AUTH, BALANCE]

    # Before authentication: the authentication policy, its tool only.
    first, second, third = model.received
    assert "ask for their PIN" in system_text(first)
    assert "answer questions" not in system_text(first)
    assert offered(first) == {"crm__authenticate_customer"}
    # After it, in the same turn: the policies decided again from the new state.
    assert "answer questions about their account" in system_text(second)
    assert "ask for their PIN" not in system_text(second)
    assert "crm__get_balance" in offered(second)
    user = [m["content"] for m in third["messages"] if m["role"] == "user"]
    assert user == ["What is my balance? My PIN is 1234."]  # asked once

    events = await events_of(bus, sid)
    matched = [e for e in events if isinstance(e, PoliciesMatched)]
    assert [(e.round, e.matched) for e in matched] == [
        (0, ["authenticate_first"]), (1, ["answer_account_questions"])]
    (again,) = [e for e in events if isinstance(e, TurnReevaluated)]
    assert again.tools == [AUTH] and again.round == 1 and not again.capped
    assert again.trigger_call_ids == [end.outcomes[0].call_id]
    assert again.after_iteration == 1
    # The order: the trigger's success, then the reevaluation, then the new match.
    kinds = [type(e).__name__ for e in events]
    assert kinds.index("TurnReevaluated") > kinds.index("CallSucceeded")
    assert kinds.index("TurnReevaluated") < [i for i, e in enumerate(events)
                                             if isinstance(e, PoliciesMatched)][1]
    assert sum(isinstance(e, TurnRequested) for e in events) == 1
    # The authentication's result is in the state object `when_state` reads.
    state = await settled_state(bus, client, sid)
    assert state.data["crm"]["authenticate_customer"]["authenticated"] is True
    assert state.turns[end.turn_id].policies == ["answer_account_questions"]
    await replay_calls_no_model(bus, client, model, sid)


async def test_without_reevaluation_the_same_flow_needs_a_second_turn(
        bus: Bus, system: dict[str, Any], crm: Executor, client: ToolbusClient,
        model: ScriptedChat, sid: str) -> None:
    model.script = [
        (200, reply(calls=[("c1", "crm__authenticate_customer", {"pin": "1234"})])),
        # Still under the authentication policy: the balance tool is not offered.
        (200, reply("You are authenticated. What would you like to know?")),
        (200, reply(calls=[("c2", "crm__get_balance", {"customer_id": "c-1"})])),
        (200, reply("Your balance is 120 EUR.")),
    ]
    planner = await start(bus, system, model, bank(None))
    try:
        first_end = await client.ask(sid, "What is my balance? My PIN is 1234.", timeout=60)
        assert isinstance(first_end, TurnCompleted), first_end
        assert first_end.text == "You are authenticated. What would you like to know?"
        second_end = await client.ask(sid, "My balance, please.", timeout=60)
    finally:
        await planner.stop()
    assert isinstance(second_end, TurnCompleted), second_end
    assert second_end.text == "Your balance is 120 EUR."

    after_auth = model.received[1]
    assert offered(after_auth) == {"crm__authenticate_customer"}
    assert "ask for their PIN" in system_text(after_auth)
    second_turn = model.received[2]
    assert "crm__get_balance" in offered(second_turn)
    assert "answer questions about their account" in system_text(second_turn)

    events = await events_of(bus, sid)
    assert not any(isinstance(e, TurnReevaluated) for e in events)
    assert sum(isinstance(e, TurnRequested) for e in events) == 2
    assert [(e.round, e.matched) for e in events if isinstance(e, PoliciesMatched)] == [
        (0, ["authenticate_first"]), (0, ["answer_account_questions"])]
    await replay_calls_no_model(bus, client, model, sid)


async def test_the_model_judges_when_policies_in_one_structured_call_stored_before_the_match(
        bus: Bus, system: dict[str, Any], client: ToolbusClient, model: ScriptedChat,
        sid: str) -> None:
    rules = agent({"instructions": "You are the bank's assistant.", "policies": [
        {"id": "upset", "when": "The customer is upset or complains.",
         "action": "Apologise before anything else."},
        {"id": "fraud", "when": "The customer reports fraud.",
         "action": "Block the card."},
        {"id": "sign", "action": "Sign as Bank Bot."},
    ]})
    model.script = [
        (200, reply(json.dumps({"applies": ["upset"]}))),
        (200, reply("I am sorry about the wait. -- Bank Bot")),
    ]
    planner = await start(bus, system, model, rules)
    try:
        end = await client.ask(sid, "I have been waiting for an hour!", timeout=60)
    finally:
        await planner.stop()
    assert isinstance(end, TurnCompleted) and end.text == "I am sorry about the wait. -- Bank Bot"

    judge, chat = model.received
    assert "tools" not in judge
    schema = judge["response_format"]["json_schema"]["schema"]
    assert schema["properties"]["applies"]["items"]["enum"] == ["upset", "fraud"]
    assert "The customer reports fraud." in system_text(judge)
    assert "Apologise before anything else." in system_text(chat)
    assert "Sign as Bank Bot." in system_text(chat)
    assert "Block the card." not in system_text(chat)

    events = await events_of(bus, sid)
    asked = [e for e in events if isinstance(e, ModelRequested)]
    assert [(e.iteration, e.purpose) for e in asked] == [(1, "match"), (2, "chat")]
    answered = [e for e in events if isinstance(e, ModelResponded)]
    assert answered[0].output == {"applies": ["upset"]} and answered[0].violations == []
    (matched,) = [e for e in events if isinstance(e, PoliciesMatched)]
    assert matched.matched == ["upset", "sign"] and matched.by_model == ["upset"]
    assert matched.model_iteration == 1
    kinds = [type(e).__name__ for e in events]
    assert kinds.index("PoliciesMatched") > kinds.index("ModelResponded")
    await replay_calls_no_model(bus, client, model, sid)


def _fold(events: list[Event]) -> SessionState:
    state = SessionState(session_id="s")
    for seq, event in enumerate(events, start=1):
        evolve(state, event, seq)
    return state


def _trigger_step(iteration: int, call_id: str) -> list[Event]:
    """A chat step that called the reevaluation tool, which succeeded."""
    common: dict[str, Any] = {"session_id": "s", "at": 0.0, "actor": "planner"}
    return [
        ModelRequested(**common, turn_id="t", iteration=iteration, provider="openai",
                       model="m", tools=1, tools_digest=""),
        ModelResponded(**common, turn_id="t", iteration=iteration, text="", tool_calls=[
            ModelToolCall(call_id=call_id, id=call_id, name=AUTH, arguments={"pin": "1"})]),
        CallRequested(**common, turn_id="t", call_id=call_id, tool=AUTH,
                      arguments={"pin": "1"}, output_path="crm.authenticate_customer"),
        CallSucceeded(**common, turn_id="t", call_id=call_id, executor="x",
                      result={"authenticated": False}),
    ]


def test_past_the_limit_a_reevaluation_tool_is_recorded_as_capped_and_nothing_is_decided_again(
        ) -> None:
    rules = agent({"context": {"reevaluation_tools": [{"id": AUTH}]},
                   "limits": {"max_reevaluations": 1}, "policies": [AUTH_POLICY]})
    offer = Offer(provider="openai", model="m")
    common: dict[str, Any] = {"session_id": "s", "at": 0.0, "actor": "planner"}
    history: list[Event] = [
        TurnRequested(**common, turn_id="t", request_id="t", call_ids=[], message="hi"),
        PoliciesMatched(**common, turn_id="t", round=0, matched=["authenticate_first"]),
        *_trigger_step(1, "t-0"),
    ]
    (first,) = decide(_fold(history), offer, now=1.0, rules=rules)
    assert isinstance(first.event, TurnReevaluated) and not first.event.capped
    assert first.event.round == 1 and first.event.limit == 1
    history += [first.event]
    (match,) = decide(_fold(history), offer, now=1.0, rules=rules)
    assert isinstance(match.event, PoliciesMatched) and match.event.round == 1
    history += [match.event, *_trigger_step(2, "t-1")]
    (capped,) = decide(_fold(history), offer, now=1.0, rules=rules)
    assert isinstance(capped.event, TurnReevaluated) and capped.event.capped
    assert capped.event.round == 1 and capped.event.after_iteration == 2
    history += [capped.event]
    # Nothing decided again: the loop goes on under round 1's policies.
    (ask,) = decide(_fold(history), offer, now=1.0, rules=rules)
    assert isinstance(ask.event, ModelRequested) and ask.event.purpose == "chat"
    state = _fold(history)
    assert state.turns["t"].round == 1 and len(state.turns["t"].reevaluations) == 2
    # A stored event is written once: the ids are per round and per iteration.
    assert len({first.msg_id, match.msg_id, capped.msg_id, ask.msg_id}) == 4


# --- built-in:reason and built-in:emit_output -------------------------------------------

INTENT = {"type": "object", "additionalProperties": False, "required": ["intent"],
          "properties": {"intent": {"enum": ["balance", "transfer", "other"]}}}


def classifying_agent() -> Rules:
    """The bank's assistant with one think step: classify what the customer wants."""
    return agent({"instructions": "You are the bank's assistant.",
                  "think": [{"id": "intent", "instruction": "Classify what the customer "
                             "wants.", "output_schema": INTENT}]})


async def test_a_think_step_is_a_structured_call_whose_output_lands_in_the_state(
        bus: Bus, system: dict[str, Any], client: ToolbusClient, model: ScriptedChat,
        sid: str) -> None:
    rules = classifying_agent()
    model.script = [
        (200, reply(json.dumps({"intent": "balanc"}))),  # breaks the schema
        (200, reply(json.dumps({"intent": "balance"}))),
        (200, reply("Let me look up your balance.")),
    ]
    planner = await start(bus, system, model, rules)
    try:
        end = await client.ask(sid, "How much money do I have?", timeout=60)
    finally:
        await planner.stop()
    assert isinstance(end, TurnCompleted) and end.text == "Let me look up your balance."

    first, retry, chat = model.received
    assert first["response_format"]["json_schema"]["schema"] == INTENT
    assert "tools" not in first
    assert "Classify what the customer wants." in system_text(first)
    # The second attempt sees the first answer and why it was refused.
    said = [m["content"] for m in retry["messages"]]
    assert said[-2] == json.dumps({"intent": "balanc"})
    assert "$.intent" in said[-1]
    # The chat step sees the output.
    assert '- intent: {"intent":"balance"}' in system_text(chat)

    events = await events_of(bus, sid)
    thinks = [e for e in events if isinstance(e, ModelResponded) and e.purpose == "think"]
    assert [(e.step, e.output, bool(e.violations)) for e in thinks] == [
        ("intent", {"intent": "balanc"}, True), ("intent", {"intent": "balance"}, False)]
    state = await settled_state(bus, client, sid)
    assert state.step_outputs == {"intent": {"intent": "balance"}}
    await replay_calls_no_model(bus, client, model, sid)


async def test_a_delivery_stopped_at_its_bound_goes_on_at_its_next_delivery(
        bus: Bus, system: dict[str, Any], client: ToolbusClient, model: ScriptedChat,
        sid: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import actors.planner

    # One step per delivery: the think step's answer makes the chat call due, which the
    # delivery stops before answering (handed back, the question stored). Its next
    # delivery finds the question unanswered and asks it: nothing delivers the
    # planner's own `model.requested` back to it.
    monkeypatch.setattr(actors.planner, "_STEPS_PER_DELIVERY", 1)
    rules = classifying_agent()
    # The chat call the bound cancelled may have reached the server: answered the same.
    model.script = [(200, reply(json.dumps({"intent": "balance"}))),
                    *[(200, reply("Let me look up your balance."))] * 3]
    planner = await start(bus, system, model, rules)
    try:
        end = await client.ask(sid, "How much money do I have?", timeout=60)
    finally:
        await planner.stop()
    assert isinstance(end, TurnCompleted) and end.text == "Let me look up your balance."
    events = await events_of(bus, sid)
    answers = [(e.iteration, e.purpose) for e in events if isinstance(e, ModelResponded)]
    assert answers == [(1, "think"), (2, "chat")]
    assert (await settled_state(bus, client, sid)).step_outputs == {
        "intent": {"intent": "balance"}}


async def test_a_request_may_give_think_steps_of_its_own(
        bus: Bus, system: dict[str, Any], client: ToolbusClient, model: ScriptedChat,
        sid: str) -> None:
    rules = agent({"instructions": "You are the bank's assistant."})
    model.script = [
        (200, reply(json.dumps({"intent": "balance"}))),
        (200, reply("Let me look up your balance.")),
    ]
    body = {"request_id": "r-think", "message": "How much money do I have?",
            "think": {"id": "intent", "instruction": "Classify what the customer wants.",
                      "output_schema": INTENT}}
    planner = await start(bus, system, model, rules)
    try:
        async with EventWatch(bus, sid) as watch:
            await client.submit(sid, msgspec.json.encode(body), request_id="r-think")
            events = await watch.until(lambda evs: any(
                isinstance(e, TurnCompleted) for e in evs), timeout=30)
    finally:
        await planner.stop()
    (end,) = [e for e in events if isinstance(e, TurnCompleted)]
    assert end.text == "Let me look up your balance."
    think, chat = model.received
    assert think["response_format"]["json_schema"]["schema"] == INTENT
    assert "Classify what the customer wants." in system_text(think)
    assert '- intent: {"intent":"balance"}' in system_text(chat)
    state = await settled_state(bus, client, sid)
    assert state.step_outputs == {"intent": {"intent": "balance"}}
    await replay_calls_no_model(bus, client, model, sid)


@pytest.mark.parametrize(("think", "says"), [
    ({"id": "x", "instruction": "Do.", "output_schema": {"type": "nope"}}, "output_schema"),
    ({"id": "a b", "instruction": "Do.", "output_schema": {}}, "think[0].id"),
    ([], "non-empty list"),
    ({"id": "x", "instruction": "", "output_schema": {}}, "instruction"),
])
def test_a_bad_think_step_in_a_request_is_refused_naming_it(think: Any, says: str) -> None:
    from schemas.errors import InvalidRequestError
    from schemas.requests import parse_request

    with pytest.raises(InvalidRequestError) as info:
        parse_request(msgspec.json.encode({"message": "hi", "think": think}))
    assert says in info.value.message
    with pytest.raises(InvalidRequestError, match="think steps need a message"):
        parse_request(msgspec.json.encode({"calls": [{"tool": "built-in:echo"}],
                                           "think": {"id": "x", "instruction": "Do.",
                                                     "output_schema": {}}}))


async def test_a_think_step_that_never_fits_its_schema_ends_the_turn(
        bus: Bus, system: dict[str, Any], client: ToolbusClient, model: ScriptedChat,
        sid: str) -> None:
    rules = agent({"limits": {"max_argument_retries": 1},
                   "policies": [{"id": "classify", "action": "Answer by intent.",
                                 "think": {"id": "why", "instruction": "Classify.",
                                           "output_schema": INTENT}}]})
    model.script = [(200, reply("not json")), (200, reply(json.dumps({"intent": 3})))]
    planner = await start(bus, system, model, rules)
    try:
        end = await client.ask(sid, "Hm?", timeout=60)
    finally:
        await planner.stop()
    assert isinstance(end, TurnFailed) and end.reason == "invalid_think_output", end
    assert "think step why" in end.message and "$.intent" in end.message
    assert len(model.received) == 2
    await replay_calls_no_model(bus, client, model, sid)


ANSWER = {"type": "object", "additionalProperties": False,
          "required": ["city", "confidence"],
          "properties": {"city": {"type": "string"},
                         "confidence": {"type": "number", "minimum": 0, "maximum": 1}}}


async def test_emit_output_refuses_an_invalid_output_with_every_violation_then_settles_the_turn(
        bus: Bus, system: dict[str, Any], client: ToolbusClient, model: ScriptedChat,
        sid: str, nats_url: str) -> None:
    rules = agent({"instructions": "Answer with a city.", "output_schema": ANSWER})
    model.script = [
        (200, reply(calls=[("o1", "built-in__emit_output", {"city": 7, "confidence": 2})])),
        (200, reply(calls=[("o2", "built-in__emit_output",
                            {"city": "Tokyo", "confidence": 0.9})])),
    ]
    planner = await start(bus, system, model, rules)
    try:
        end = await client.ask(sid, "Which city hosts the Shibuya crossing?", timeout=60)
    finally:
        await planner.stop()
    assert isinstance(end, TurnCompleted), end
    assert end.output == {"city": "Tokyo", "confidence": 0.9}
    assert json.loads(end.text or "") == end.output
    assert end.outcomes == []  # emit_output is the planner's: no call of an executor

    first, second = model.received
    (emit,) = [t["function"] for t in first["tools"]
               if t["function"]["name"] == "built-in__emit_output"]
    assert emit["parameters"] == ANSWER
    assert EMIT_OUTPUT in system_text(first)
    (refusal,) = [m for m in second["messages"] if m["role"] == "tool"]
    assert refusal["tool_call_id"] == "o1"
    assert "2 violations" in refusal["content"]
    assert "$.city" in refusal["content"] and "$.confidence" in refusal["content"]

    events = await events_of(bus, sid)
    assert not any(isinstance(e, CallRequested) for e in events)
    (rejected,) = [e for e in events if isinstance(e, OutputRejected)]
    assert len(rejected.violations) == 2
    (emitted,) = [e for e in events if isinstance(e, OutputEmitted)]
    assert emitted.output == end.output
    kinds = [type(e).__name__ for e in events]
    assert kinds.index("OutputEmitted") < kinds.index("TurnCompleted")
    state = await settled_state(bus, client, sid)
    assert state.turns[end.turn_id].output == end.output
    await replay_calls_no_model(bus, client, model, sid)

    # The timeline names each decision; printing it calls no model.
    before = len(model.received)
    out = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "services.cli", "replay", sid, "--nats",
                         nats_url], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "output.rejected" in out.stdout and "output.emitted" in out.stdout
    assert len(model.received) == before


# --- the new events ---------------------------------------------------------------------

_common = {"session_id": st.just("s"), "at": st.floats(0, 1e9), "actor": st.just("planner")}
_ids = st.text("abc", min_size=1, max_size=3)


def _nested(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    # A named function: hypothesis reads an extend's source to see it recurse, and
    # could not read this one's as a lambda (a deprecation warning, an error here).
    return st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                          max_size=3)


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                     _nested, max_leaves=6)
planner_events = st.one_of(
    st.builds(TurnRequested, **_common, turn_id=st.just("t"), request_id=st.just("t"),
              call_ids=st.just([]), message=st.just("hi")),
    st.builds(ModelRequested, **_common, turn_id=st.just("t"), iteration=st.integers(1, 4),
              provider=st.just("openai"), model=st.just("m"), tools=st.integers(0, 3),
              tools_digest=st.just(""), purpose=st.sampled_from(["chat", "match", "think"]),
              step=st.none() | _ids, round=st.integers(0, 3)),
    st.builds(ModelResponded, **_common, turn_id=st.just("t"), iteration=st.integers(1, 4),
              text=st.text(max_size=5), purpose=st.sampled_from(["chat", "match", "think"]),
              step=st.none() | _ids, round=st.integers(0, 3), output=_json,
              violations=st.lists(st.text(max_size=5), max_size=2)),
    st.builds(PoliciesMatched, **_common, turn_id=st.just("t"), round=st.integers(0, 3),
              matched=st.lists(_ids, max_size=3), by_model=st.lists(_ids, max_size=2),
              model_iteration=st.none() | st.integers(1, 4),
              notes=st.lists(st.text(max_size=5), max_size=2)),
    st.builds(TurnReevaluated, **_common, turn_id=st.just("t"), round=st.integers(0, 3),
              after_iteration=st.integers(1, 4), trigger_call_ids=st.lists(_ids, max_size=2),
              tools=st.lists(_ids, max_size=2), limit=st.integers(0, 3),
              capped=st.booleans()),
    st.builds(OutputEmitted, **_common, turn_id=st.just("t"), call_id=_ids, output=_json),
    st.builds(OutputRejected, **_common, turn_id=st.just("t"), call_id=_ids,
              message=st.text(max_size=5), violations=st.lists(st.text(max_size=5),
                                                               max_size=2)),
    st.builds(TurnCompleted, **_common, turn_id=st.just("t"), request_id=st.just("t"),
              ok=st.just(True), outcomes=st.just([]), text=st.none() | st.text(max_size=5),
              output=_json),
)


@given(planner_events)
def test_every_planner_event_round_trips_through_encode_and_decode(event: Event) -> None:
    assert decode_event(encode_event(event)) == event


@given(st.lists(planner_events, max_size=25), st.integers(0, 25))
def test_replay_of_planner_events_rebuilds_the_state_folded_live_in_any_split(
        events: list[Event], cut: int) -> None:
    history = list(enumerate(events, start=1))
    live = fold("s", history[:cut])
    for seq, event in history[cut:]:
        evolve(live, event, seq)
    assert encode_state(live) == encode_state(fold("s", history))


def test_model_events_written_before_these_fields_still_decode() -> None:
    old = msgspec.json.encode({"type": "model.responded", "session_id": "s", "at": 1.0,
                               "actor": "planner", "turn_id": "t", "iteration": 1,
                               "text": "hi"})
    event = decode_event(old)
    assert isinstance(event, ModelResponded)
    assert (event.purpose, event.output, event.violations) == ("chat", None, [])
    done = decode_event(msgspec.json.encode({
        "type": "turn.completed", "session_id": "s", "at": 1.0, "actor": "planner",
        "turn_id": "t", "request_id": "t", "ok": True, "outcomes": []}))
    assert isinstance(done, TurnCompleted) and done.output is None


# --- the whole state machine, simulated -------------------------------------------------

STEPS = {
    "auth_ok": (AUTH, {"pin": "1234"}),
    "auth_bad": (AUTH, {"pin": "0000"}),
    "balance": (BALANCE, {"customer_id": "c-1"}),
    "emit_bad": (EMIT_OUTPUT, {"city": 1}),
    "emit_ok": (EMIT_OUTPUT, {"city": "Tokyo", "confidence": 0.5}),
}


@given(script=st.lists(st.sampled_from([*STEPS, "text"]), max_size=8),
       upset=st.booleans(), limit=st.integers(0, 2), parallel=st.booleans())
def test_a_simulated_turn_always_ends_and_writes_each_fact_once(
        script: list[str], upset: bool, limit: int, parallel: bool) -> None:
    rules = agent({
        "context": {"reevaluation_tools": [{"id": AUTH}]},
        "limits": {"max_reevaluations": limit}, "output_schema": ANSWER,
        "think": [{"id": "intent", "instruction": "Classify.", "output_schema": INTENT}],
        "policies": [AUTH_POLICY, ANSWER_POLICY,
                     {"id": "upset", "when": "The customer is upset.", "action": "Apologise."}]})
    offer = Offer(provider="openai", model="m")
    common: dict[str, Any] = {"session_id": "s", "at": 0.0, "actor": "planner"}
    state = _fold([TurnRequested(**common, turn_id="t", request_id="t", call_ids=[],
                                 message="hi")])
    seq = state.last_seq
    written: set[str] = set()
    requests: dict[int, ModelRequested] = {}
    replies = iter(script)

    def store(event: Event) -> None:
        nonlocal seq
        seq += 1
        evolve(state, event, seq)

    for _ in range(200):
        turn = state.turns["t"]
        if turn.status != "running":
            break
        due = decide(state, offer, now=0.0, rules=rules, max_iterations=6)
        assert due == decide(state, offer, now=0.0, rules=rules, max_iterations=6)
        for item in due:
            assert item.msg_id not in written, item
            written.add(item.msg_id)
            store(item.event)
            if isinstance(item.event, ModelRequested):
                requests[item.event.iteration] = item.event
        if due:
            continue
        if turn.model_requested > len(turn.steps):  # the model answers
            asked = turn.model_requested
            purpose = requests[asked].purpose
            if purpose == "match":
                store(ModelResponded(**common, turn_id="t", iteration=asked, text="",
                                     purpose="match", round=turn.round,
                                     output={"applies": ["upset"] if upset else []}))
            elif purpose == "think":
                store(ModelResponded(**common, turn_id="t", iteration=asked, text="",
                                     purpose="think", step="intent",
                                     output={"intent": "other"}))
            else:
                name = next(replies, "text")
                calls = [] if name == "text" else [STEPS[name]]
                if parallel and calls:
                    calls.append(STEPS["balance"])
                store(ModelResponded(**common, turn_id="t", iteration=asked, text="ok",
                                     tool_calls=[ModelToolCall(
                                         call_id=f"t-{asked}-{i}", id=f"p{asked}-{i}",
                                         name=tool, arguments=args)
                                         for i, (tool, args) in enumerate(calls)]))
            continue
        open_calls = [c for c in state.calls.values() if not c.terminal]
        assert open_calls, "nothing due, nothing asked, nothing running: the turn is stuck"
        for call in open_calls:  # the tools run
            result = {"authenticated": call.arguments.get("pin") == "1234"} \
                if call.tool == AUTH else {"balance": 1}
            store(CallSucceeded(**common, turn_id="t", call_id=call.call_id, executor="x",
                                result=result))
    turn = state.turns["t"]
    assert turn.status != "running"
    assert sum(1 for r in turn.reevaluations if not r.capped) <= limit
    assert turn.round <= limit
    if turn.status == "completed" and turn.output is not None:
        assert turn.output == STEPS["emit_ok"][1]
    assert state.step_outputs == {"intent": {"intent": "other"}}


def test_when_state_follows_jmespath_truth_and_an_expression_that_fails_counts_as_not_applying(
        ) -> None:
    rules = agent({"policies": [
        {"id": "zero", "when_state": "visits", "action": "0 is true in JMESPath."},
        {"id": "empty", "when_state": "cart", "action": "An empty list is false."},
        {"id": "broken", "when_state": "length(missing) > `1`", "action": "Raises."},
        {"id": "thought", "when_state": "step_outputs.intent.intent == 'balance'",
         "action": "Think outputs are readable."},
    ]})
    state = _fold([TurnRequested(session_id="s", at=0.0, actor="session", turn_id="t",
                                 request_id="t", call_ids=[], message="hi")])
    state.data.update({"visits": 0, "cart": []})
    state.step_outputs["intent"] = {"intent": "balance"}
    (matched,) = decide(state, Offer(provider="openai", model="m"), now=0.0, rules=rules)
    assert isinstance(matched.event, PoliciesMatched)
    assert matched.event.matched == ["zero", "thought"]
    (note,) = matched.event.notes
    assert note.startswith("broken: when_state failed")


def test_a_when_state_that_would_build_an_exponential_value_is_stopped_and_noted() -> None:
    # Each `[@,@]|[]` doubles the list: 26 of them took 38 s of the planner's event loop
    # (every session waited), 30 would take 8 GB. Bounded as `_transform` is.
    rules = agent({"policies": [
        {"id": "bomb", "when_state": "length(a" + "|[@,@]|[]" * 40 + ") > `0`",
         "action": "Never."},
        {"id": "plain", "when_state": "length(a) > `0`", "action": "Always."}]})
    state = _fold([TurnRequested(session_id="s", at=0.0, actor="session", turn_id="t",
                                 request_id="t", call_ids=[], message="hi")])
    state.data.update({"a": [1]})
    (matched,) = decide(state, Offer(provider="openai", model="m"), now=0.0, rules=rules)
    assert isinstance(matched.event, PoliciesMatched)
    assert matched.event.matched == ["plain"]
    (note,) = matched.event.notes
    assert note.startswith("bomb: when_state failed") and "steps" in note


def test_a_condition_on_a_result_stored_by_reference_says_so_when_it_does_not_hold(
        ) -> None:
    # A result over what an event holds lands in the state as {"$ref": key}: a policy on
    # it never applied, and nothing said why. A result that merely holds a "$ref" (a
    # JSON Schema) is not one.
    from schemas.events import CallRequested, CallSucceeded, ResultRef
    rules = agent({"policies": [
        {"id": "read", "when_state": "files.read.size > `0`", "action": "A file was read."},
        {"id": "schema", "when_state": "files.schema.size > `0`", "action": "Never."}]})
    common = {"session_id": "s", "at": 0.0, "actor": "x", "turn_id": "t"}
    events: list[Event] = [TurnRequested(**common, request_id="t", call_ids=[],
                                         message="hi")]
    for i, (path, result, ref) in enumerate([
            ("files.read", None, ResultRef(key="s/t-0/1", size=300_000, sha256="0")),
            ("files.schema", {"$ref": "#/definitions/a"}, None)]):
        events += [CallRequested(**common, call_id=f"t-{i}", tool="files:read",
                                 arguments={}, output_path=path),
                   CallSucceeded(**common, call_id=f"t-{i}", executor="e", result=result,
                                 result_ref=ref)]
    state = _fold(events)
    assert state.data["files"]["read"] == {"$ref": "s/t-0/1"}
    (matched,) = decide(state, Offer(provider="openai", model="m"), now=0.0, rules=rules)
    assert isinstance(matched.event, PoliciesMatched) and matched.event.matched == []
    (note,) = matched.event.notes
    assert note.startswith('when_state reads {"$ref": key} at files.read: a result too '
                           "large to go in an event is stored by reference"), note
    rules = agent({"policies": [{"id": "schema", "when_state": "files.schema.size > `0`",
                                 "action": "Never."}]})
    state.data["files"]["read"] = {"size": 9}  # a later result took its place: no note
    (matched,) = decide(state, Offer(provider="openai", model="m"), now=0.0, rules=rules)
    assert isinstance(matched.event, PoliciesMatched) and matched.event.notes == []


def test_an_output_schema_that_is_not_an_object_is_emitted_under_output() -> None:
    rules = agent({"output_schema": {"type": "array", "items": {"type": "string"}}})
    assert rules.emit is not None
    assert rules.emit.parameters["required"] == ["output"]
    good = ModelToolCall(call_id="t-0", id="a", name=EMIT_OUTPUT,
                         arguments={"output": ["a", "b"]})
    assert rules.judge_output(good) == (["a", "b"], [])
    bad = ModelToolCall(call_id="t-1", id="b", name=EMIT_OUTPUT, arguments={"output": [1]})
    output, violations = rules.judge_output(bad)
    assert output is None and violations == ['$.output[0]: 1 is not of type "string"']
    unparsed = ModelToolCall(call_id="t-2", id="c", name=EMIT_OUTPUT, arguments='{"out',
                             extra={"invalid_arguments": '{"out'})
    assert "not a JSON object" in rules.judge_output(unparsed)[1][0]


def test_arguments_that_are_no_json_object_are_refused_saying_why() -> None:
    """The model read "must be a JSON object, got str" for text that is not JSON, and for
    arguments nested too deeply (a Gemini object, or JSON text), which it cannot fix."""
    from actors.llm.convert import TOO_DEEP, parse_arguments
    from actors.planner import _unusable_arguments

    def why(raw: Any) -> str | None:
        arguments, extra = parse_arguments(raw)
        return _unusable_arguments(ModelToolCall(call_id="t-0", id="a", name="ns:tool",
                                                 arguments=arguments, extra=extra))

    deep: Any = []
    for _ in range(100):
        deep = [deep]
    assert parse_arguments({"x": deep})[1] == {"invalid_arguments": TOO_DEEP}
    for raw in ({"x": deep}, json.dumps({"x": deep})):  # an object, or JSON text
        assert why(raw) == ("arguments of ns:tool nest deeper than 64 levels: send them "
                            "again as one JSON object, no deeper than 64 levels")
    told = why('{"text": "cut off')
    assert told is not None and told.startswith("arguments of ns:tool are not valid JSON (")
    assert why({"text": "fine"}) is None
    assert why('"a string"') is None  # JSON: the approval actor names its kind


# --- what is offered -----------------------------------------------------------------------


def _spec(name: str) -> Any:
    from schemas.tools import ToolSpec
    return ToolSpec(name=name, source="test", parameters={"type": "object"})


def test_a_policy_that_narrows_the_tools_still_offers_the_context_tools() -> None:
    from actors.context_tools import CONTEXT_STATUS_SPEC, RECALL_SPEC
    from actors.planner import offered_tools
    specs = [_spec(AUTH), _spec(BALANCE), RECALL_SPEC, CONTEXT_STATUS_SPEC]
    offer = Offer(provider="openai", model="m", tools=tuple(specs),
                  catalog={s.name: s for s in specs})
    turn = TurnState(turn_id="t", request_id="r", call_ids=[], policies=["authenticate_first"])
    names = [s.name for s in offered_tools(bank(None), offer, turn)]
    # A large result's preview tells the model to recall it: recall stays callable.
    assert names == [AUTH, RECALL_SPEC.name, CONTEXT_STATUS_SPEC.name]


def test_tools_the_policy_refuses_the_turns_agent_are_not_offered() -> None:
    from actors.planner import offered_tools
    from schemas.policy import Policy, evaluate
    policy = Policy(agents={"default": ("crm:*",), "teller": (BALANCE,)},
                    deny=("crm:delete_*",))
    specs = [_spec(AUTH), _spec(BALANCE), _spec("crm:delete_customer"), _spec("web:fetch")]
    catalog = {s.name: s for s in specs}

    def permits(name: str, agent: str | None) -> bool:
        return evaluate(catalog[name], session_id="s", agent=agent,
                        policy=policy).kind != "reject"

    offer = Offer(provider="openai", model="m", tools=tuple(specs), catalog=catalog,
                  permits=permits)
    as_default = TurnState(turn_id="t", request_id="r", call_ids=[])
    assert [s.name for s in offered_tools(Rules(), offer, as_default)] == [AUTH, BALANCE]
    teller = TurnState(turn_id="t", request_id="r", call_ids=[], agent="teller")
    assert [s.name for s in offered_tools(Rules(), offer, teller)] == [BALANCE]
    nobody = TurnState(turn_id="t", request_id="r", call_ids=[], agent="ghost")
    assert offered_tools(Rules(), offer, nobody) == []


async def test_the_planner_offers_only_what_the_manifest_policy_grants(
        bus: Bus, system: dict[str, Any], client: ToolbusClient, model: ScriptedChat,
        sid: str) -> None:
    from schemas.policy import Policy
    settings = ModelSettings(provider="openai", model="scripted", api_key="sk-test-key",
                             base_url=f"http://127.0.0.1:{model.port}/v1", max_retries=1)
    planner = Planner(bus, system["catalog"], settings,
                      policy=Policy(agents={"default": ("built-in:current_time",)}))
    await planner.start()
    try:
        model.script = [(200, reply("It is late."))]
        end = await client.ask(sid, "What time is it?")
        assert isinstance(end, TurnCompleted), end
        assert offered(model.received[0]) == {"built-in__current_time"}
    finally:
        await planner.stop()


async def test_a_stored_think_schema_too_costly_to_check_fails_its_turn_cleanly(
        bus: Bus, system: dict[str, Any], model: ScriptedChat, sid: str,
        caplog: pytest.LogCaptureFixture) -> None:
    from bus.eventlog import Append
    from schemas.events import ThinkRequest, TurnFailed, TurnRequested
    from schemas.ids import turn_requested_id

    # Stored before such a schema was refused at intake: the planner meets it when it
    # compiles the step, and ended the turn `internal` with a traceback in its log.
    costly = {"$defs": {f"a{i}": {"oneOf": [{"$ref": f"#/$defs/a{i + 1}"}, {
        "$ref": f"#/$defs/a{i + 1}", "minimum": i}]} for i in range(30)} | {
        "a30": {"type": "integer"}}, "$ref": "#/$defs/a0"}
    planner = await start(bus, system, model, agent({}))
    try:
        async with EventWatch(bus, sid) as watch:
            await EventLog(bus).append(Append(TurnRequested(
                session_id=sid, at=1.0, actor="session", turn_id="t-old", request_id="t-old",
                call_ids=[], message="hi", think=[ThinkRequest(
                    id="x", instruction="Classify.", output_schema=costly)]),
                turn_requested_id(sid, "t-old")))
            events = await watch.until(lambda evs: any(
                isinstance(e, TurnFailed) for e in evs), timeout=30)
    finally:
        await planner.stop()
    (failed,) = [e for e in events if isinstance(e, TurnFailed)]
    assert "think step 'x': its output_schema cannot be used" in failed.message, failed
    assert "too costly" in failed.message
    assert model.received == [] and "Traceback" not in caplog.text
