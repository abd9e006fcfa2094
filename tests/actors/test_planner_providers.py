"""Issue 12's acceptance at the planner level, for each of the four APIs (OpenAI Chat
Completions, OpenAI Responses, Anthropic Messages, Gemini generateContent): real planner
turns against the scripted fake provider of tests/llm_servers.py, asserting on what the
server received (the provider's documented request shapes), how each turn ended, and
that a replay of the log asks no model."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from actors.llm.types import ModelSettings, Provider
from actors.planner import Planner
from bus.client import ToolbusClient
from bus.connection import Bus
from bus.eventlog import EventLog
from schemas.events import (
    CallRequested,
    Event,
    ModelRequested,
    ModelResponded,
    TurnCompleted,
    TurnFailed,
)
from tests.conftest import REPO, assert_replay_equals_live
from tests.llm_servers import Call, FakeProvider, Received, Step, error, reply

PROVIDERS: tuple[Provider, ...] = ("openai", "openai-responses", "anthropic", "gemini")

# Looks like a key of every provider at once, so any redaction path would have to find it.
KEY = "sk-test-AIzaSyD0-not-a-real-key-7f3c9a"
INSTRUCTIONS = "Be brief."
ECHO = "built-in__echo"  # built-in:echo as all four APIs spell it
SIG_1, SIG_2 = "CtMBAdHtim9+first/step==", "CtMBAdHtim9+second/step=="


@dataclass(frozen=True)
class Api:
    """What one provider's wire looks like, to the extent the tests read it."""

    provider: Provider
    model: str
    call_prefix: str  # how the provider's call ids look
    history_key: str  # where the conversation is in the request body

    def history(self, received: Received) -> list[Any]:
        items: list[Any] = received.body[self.history_key]
        return items

    def call(self, suffix: str, text: str, signature: str | None = None) -> Call:
        return Call(f"{self.call_prefix}{suffix}", ECHO, {"text": text}, signature=signature)


APIS = {
    "openai": Api("openai", "gpt-test", "call_", "messages"),
    "openai-responses": Api("openai-responses", "gpt-test", "call_", "input"),
    "anthropic": Api("anthropic", "claude-test", "toolu_", "messages"),
    "gemini": Api("gemini", "gemini-test", "fc-", "contents"),
}


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


@pytest.fixture(params=PROVIDERS)
def api(request: pytest.FixtureRequest) -> Api:
    return APIS[request.param]


@pytest.fixture
async def fake() -> AsyncIterator[FakeProvider]:
    async with FakeProvider() as server:
        yield server


def _settings(api: Api, fake: FakeProvider) -> ModelSettings:
    return ModelSettings(provider=api.provider, model=api.model, api_key=KEY,
                         base_url=fake.base_url(api.provider), max_retries=2,
                         retry_budget_s=30.0)


@pytest.fixture
async def planner(bus: Bus, system: dict[str, Any], api: Api, fake: FakeProvider
                  ) -> AsyncIterator[Planner]:
    p = Planner(bus, system["catalog"], _settings(api, fake), instructions=INSTRUCTIONS,
                tools=lambda spec: spec.name.startswith("built-in:"))
    await p.start()
    yield p
    await p.stop()


async def _events(bus: Bus, sid: str) -> list[Event]:
    return [s.event for s in await EventLog(bus).read_session(sid) if s.event is not None]


async def _ask_collecting_deltas(bus: Bus, client: ToolbusClient, sid: str, message: str
                                 ) -> tuple[Any, dict[int, str]]:
    """Ask; the turn's end and the text streamed live for each iteration."""
    streamed: dict[int, str] = {}

    async def on_delta(msg: Any) -> None:
        delta = json.loads(msg.data)
        streamed[delta["iteration"]] = streamed.get(delta["iteration"], "") + delta["text"]

    sub = await bus.nc.subscribe(f"toolbus.live.{sid}.model.delta", cb=on_delta)
    try:
        end = await client.ask(sid, message, timeout=60)
        await bus.nc.flush()  # the deltas were published before the turn ended
    finally:
        await sub.unsubscribe()
    return end, streamed


def _assert_streamed_and_authenticated(api: Api, received: Received) -> None:
    """The request asked for the API's event stream, with the key in its header only."""
    assert received.method == "POST"
    assert received.headers["accept"] == "text/event-stream"
    if api.provider == "gemini":
        assert received.path == f"/v1beta/models/{api.model}:streamGenerateContent"
        assert received.query == {"alt": ["sse"]}  # and never `key=`
        assert received.headers["x-goog-api-key"] == KEY
        return
    assert received.query == {}
    assert received.body["stream"] is True
    if api.provider == "anthropic":
        assert received.path == "/v1/messages"
        assert received.headers["x-api-key"] == KEY
        assert received.headers["anthropic-version"] == "2023-06-01"
        assert "authorization" not in received.headers
        return
    assert received.path == ("/v1/chat/completions" if api.provider == "openai"
                             else "/v1/responses")
    assert received.headers["authorization"] == f"Bearer {KEY}"
    if api.provider == "openai":
        assert received.body["stream_options"] == {"include_usage": True}


def _assert_first_request(api: Api, received: Received, message: str) -> None:
    """System text, the user's message and the tools offered, where each API puts them."""
    body = received.body
    if api.provider == "openai":
        assert body["model"] == api.model
        assert body["messages"] == [{"role": "system", "content": INSTRUCTIONS},
                                    {"role": "user", "content": message}]
        assert all(t["type"] == "function" and set(t["function"]) >= {
            "name", "description", "parameters"} for t in body["tools"])
        names = {t["function"]["name"] for t in body["tools"]}
        assert body["tool_choice"] == "auto"
    elif api.provider == "openai-responses":
        assert body["model"] == api.model
        assert body["instructions"] == INSTRUCTIONS
        assert body["input"] == [{"role": "user", "content": message}]
        assert "previous_response_id" not in body  # stateless: the log is the history
        assert all(t["type"] == "function" and isinstance(t["strict"], bool) and
                   "function" not in t for t in body["tools"])
        names = {t["name"] for t in body["tools"]}
        assert body["tool_choice"] == "auto"
    elif api.provider == "anthropic":
        assert body["model"] == api.model
        assert body["system"] == INSTRUCTIONS
        assert isinstance(body["max_tokens"], int) and body["max_tokens"] > 0
        assert body["messages"] == [{"role": "user",
                                     "content": [{"type": "text", "text": message}]}]
        assert all(set(t) >= {"name", "description", "input_schema"} for t in body["tools"])
        names = {t["name"] for t in body["tools"]}
        assert body["tool_choice"] == {"type": "auto"}
    else:
        assert body["systemInstruction"] == {"parts": [{"text": INSTRUCTIONS}]}
        assert body["contents"] == [{"role": "user", "parts": [{"text": message}]}]
        (declarations,) = body["tools"]
        names = {d["name"] for d in declarations["functionDeclarations"]}
        assert body["toolConfig"] == {"functionCallingConfig": {"mode": "AUTO"}}
    assert ECHO in names and "built-in__current_time" in names
    assert all(n.startswith("built-in__") for n in names)  # only what the planner offers


def _expected_round(api: Api, text: str, calls: list[Call]) -> list[Any]:
    """An assistant turn with `calls` (each an echo) and their results, as the API
    documents the history of a tool round trip."""
    results = [c.arguments for c in calls]  # echo returns its arguments
    if api.provider == "openai":
        turn: dict[str, Any] = {"role": "assistant", "tool_calls": [
            {"id": c.id, "type": "function",
             "function": {"name": ECHO, "arguments": _json(c.arguments)}} for c in calls]}
        if text:
            turn["content"] = text
        return [turn] + [{"role": "tool", "tool_call_id": c.id, "content": _json(r)}
                         for c, r in zip(calls, results, strict=True)]
    if api.provider == "openai-responses":
        items: list[Any] = [{"role": "assistant", "content": text}] if text else []
        items += [{"type": "function_call", "id": f"fc_{c.id}", "call_id": c.id,
                   "name": ECHO, "arguments": _json(c.arguments)} for c in calls]
        return items + [{"type": "function_call_output", "call_id": c.id, "output": _json(r)}
                        for c, r in zip(calls, results, strict=True)]
    if api.provider == "anthropic":
        blocks: list[Any] = [{"type": "text", "text": text}] if text else []
        blocks += [{"type": "tool_use", "id": c.id, "name": ECHO, "input": c.arguments}
                   for c in calls]
        # ONE user message right after the assistant's, holding every result.
        return [{"role": "assistant", "content": blocks},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": c.id, "is_error": False,
                     "content": _json(r)} for c, r in zip(calls, results, strict=True)]}]
    parts: list[Any] = [{"text": text}] if text else []
    for c in calls:
        part: dict[str, Any] = {"functionCall": {"name": ECHO, "args": c.arguments,
                                                 "id": c.id}}
        if c.signature:
            part["thoughtSignature"] = c.signature
        parts.append(part)
    return [{"role": "model", "parts": parts},
            {"role": "user", "parts": [
                {"functionResponse": {"name": ECHO, "id": c.id, "response": {"output": r}}}
                for c, r in zip(calls, results, strict=True)]}]


# --- a multi-iteration turn ----------------------------------------------------------------


async def test_a_turn_with_two_parallel_calls_then_another_then_a_streamed_answer(
        bus: Bus, client: ToolbusClient, planner: Planner, api: Api, fake: FakeProvider,
        sid: str) -> None:
    first = [api.call("a", "a", SIG_1), api.call("b", "b")]  # Gemini signs the first only
    second = [api.call("c", "c", SIG_2)]
    answer = "Echoed a, b and c."
    fake.script(reply(api.provider, "Echoing both.", first, stream=True),
                reply(api.provider, calls=second, stream=True),
                reply(api.provider, chunks=["Echoed a, ", "b and ", "c."], stream=True))
    message = "Echo a and b, then c."
    end, streamed = await _ask_collecting_deltas(bus, client, sid, message)

    assert isinstance(end, TurnCompleted), end
    assert end.text == answer
    assert [(o.call_id, o.status) for o in end.outcomes] == [
        (f"{end.turn_id}-{i}", "succeeded") for i in range(3)]
    assert streamed == {1: "Echoing both.", 3: answer}  # as the stream delivered it

    # What the server received: three streamed requests, each the whole conversation.
    one, two, three = fake.requests
    for received in fake.requests:
        _assert_streamed_and_authenticated(api, received)
    _assert_first_request(api, one, message)
    asked = api.history(one)
    round_1 = _expected_round(api, "Echoing both.", first)
    assert api.history(two) == asked + round_1
    assert api.history(three) == asked + round_1 + _expected_round(api, "", second)
    assert one.body.get("tools") == two.body.get("tools") == three.body.get("tools")

    # Each round trip is a stored pair; the model's calls are requested as explicit ones.
    events = await _events(bus, sid)
    assert [e.iteration for e in events if isinstance(e, ModelRequested)] == [1, 2, 3]
    responded = [e for e in events if isinstance(e, ModelResponded)]
    assert [e.iteration for e in responded] == [1, 2, 3]
    assert [[(c.id, c.name, c.arguments) for c in e.tool_calls] for e in responded] == [
        [(c.id, "built-in:echo", c.arguments) for c in first],
        [(c.id, "built-in:echo", c.arguments) for c in second], []]
    assert [(e.tool, e.arguments) for e in events if isinstance(e, CallRequested)] == [
        ("built-in:echo", {"text": t}) for t in "abc"]
    assert all(KEY not in repr(e) for e in events)
    await assert_replay_equals_live(bus, client, sid)


# --- retries and errors --------------------------------------------------------------------


@pytest.mark.parametrize("failure", ["429 with retry-after", "500"])
async def test_a_429_or_a_500_is_retried_and_the_turn_completes(
        bus: Bus, client: ToolbusClient, planner: Planner, api: Api, fake: FakeProvider,
        sid: str, failure: str) -> None:
    if failure == "500":
        failed = error(api.provider, 500, "The server had an error processing your request.")
    else:
        failed = error(api.provider, 429, "Rate limit reached for requests",
                       headers={"retry-after": "0"})
    fake.script(failed, reply(api.provider, "Still here.", stream=True))
    end, streamed = await _ask_collecting_deltas(bus, client, sid, "Are you there?")

    assert isinstance(end, TurnCompleted), end
    assert end.text == "Still here." and streamed == {1: "Still here."}
    # One iteration, two attempts of the same request.
    assert len(fake.requests) == 2
    assert fake.requests[0].body == fake.requests[1].body
    assert fake.requests[0].path == fake.requests[1].path
    events = await _events(bus, sid)
    assert [e.iteration for e in events if isinstance(e, ModelRequested)] == [1]
    assert [e.iteration for e in events if isinstance(e, ModelResponded)] == [1]
    await assert_replay_equals_live(bus, client, sid)


PROVIDER_401 = {
    "openai": f"Incorrect API key provided: {KEY}. You can find your API key at "
              "https://platform.openai.com/account/api-keys.",
    "openai-responses": f"Incorrect API key provided: {KEY}. You can find your API key at "
                        "https://platform.openai.com/account/api-keys.",
    "anthropic": "invalid x-api-key",
    "gemini": "API key not valid. Please pass a valid API key.",
}


async def test_a_401_ends_the_turn_with_the_providers_message_and_never_the_key(
        bus: Bus, client: ToolbusClient, planner: Planner, api: Api, fake: FakeProvider,
        sid: str) -> None:
    said = PROVIDER_401[api.provider]
    fake.script(error(api.provider, 401, said),
                reply(api.provider, "must never be asked for"))
    end = await client.ask(sid, "Hello?", timeout=60)

    assert isinstance(end, TurnFailed), end
    assert end.reason == "model_error"
    assert end.message.startswith(f"{api.provider} answered 401 (auth): "), end.message
    assert said.split(KEY)[0].strip() in end.message  # the provider's own words
    assert "check the API key" in end.message
    assert KEY not in end.message
    assert len(fake.requests) == 1  # a 401 is not retried
    events = await _events(bus, sid)
    assert not any(isinstance(e, ModelResponded) for e in events)
    assert all(KEY not in repr(e) for e in events)
    await assert_replay_equals_live(bus, client, sid)


# --- replay ----------------------------------------------------------------------------------


@pytest.mark.parametrize("api", [APIS["anthropic"]], ids=["anthropic"])
async def test_toolbus_replay_of_a_planner_session_calls_no_model(
        bus: Bus, client: ToolbusClient, planner: Planner, api: Api, fake: FakeProvider,
        sid: str, nats_url: str) -> None:
    fake.script(reply(api.provider, calls=[api.call("a", "a"), api.call("b", "b")],
                      stream=True),
                reply(api.provider, "Both echoed.", stream=True))
    end = await client.ask(sid, "Echo a and b.", timeout=60)
    assert isinstance(end, TurnCompleted) and end.text == "Both echoed.", end
    await assert_replay_equals_live(bus, client, sid)

    before = len(fake.requests)
    fake.script(reply(api.provider, "a replay must never read this", stream=True))
    out = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "services.cli", "replay", sid, "--nats",
                         nats_url], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "model.responded" in out.stdout and "Both echoed." in out.stdout
    assert len(fake.requests) == before == 2
    assert len(fake.steps) == 1  # the step scripted for a model call is still there


# --- what goes back to the model -----------------------------------------------------------


async def test_a_failed_call_goes_back_to_the_model_marked_as_an_error(
        bus: Bus, client: ToolbusClient, planner: Planner, api: Api, fake: FakeProvider,
        sid: str) -> None:
    ok = api.call("ok", "fine")
    bad = Call(f"{api.call_prefix}bad", "built-in__current_time", {"timezone": "Mars/Olympus"})
    fake.script(reply(api.provider, calls=[ok, bad], stream=True),
                reply(api.provider, "Mars has no time zone.", stream=True))
    end = await client.ask(sid, "Echo fine and tell the time on Mars.", timeout=60)
    assert isinstance(end, TurnCompleted) and end.text == "Mars has no time zone.", end
    assert [o.status for o in end.outcomes] == ["succeeded", "failed"]

    tail = api.history(fake.requests[1])
    why = "unknown time zone 'Mars/Olympus'"
    if api.provider == "openai":
        (ok_result, bad_result) = tail[-2:]
        assert ok_result == {"role": "tool", "tool_call_id": ok.id, "content": '{"text":"fine"}'}
        assert bad_result["role"] == "tool" and bad_result["tool_call_id"] == bad.id
        # No error flag in this API: the text says the call failed.
        assert bad_result["content"].startswith("invalid_timezone: ") and \
            why in bad_result["content"]
    elif api.provider == "openai-responses":
        (ok_result, bad_result) = tail[-2:]
        assert ok_result == {"type": "function_call_output", "call_id": ok.id,
                             "output": '{"text":"fine"}'}
        assert bad_result["type"] == "function_call_output" and bad_result["call_id"] == bad.id
        assert bad_result["output"].startswith("invalid_timezone: ") and \
            why in bad_result["output"]
    elif api.provider == "anthropic":
        results = tail[-1]
        assert results["role"] == "user" and tail[-2]["role"] == "assistant"
        ok_block, bad_block = results["content"]
        assert ok_block == {"type": "tool_result", "tool_use_id": ok.id, "is_error": False,
                            "content": '{"text":"fine"}'}
        assert bad_block["type"] == "tool_result" and bad_block["tool_use_id"] == bad.id
        assert bad_block["is_error"] is True and why in bad_block["content"]
    else:
        results = tail[-1]
        assert results["role"] == "user" and tail[-2]["role"] == "model"
        ok_part, bad_part = (p["functionResponse"] for p in results["parts"])
        assert ok_part == {"name": ECHO, "id": ok.id, "response": {"output": {"text": "fine"}}}
        assert (bad_part["name"], bad_part["id"]) == ("built-in__current_time", bad.id)
        assert list(bad_part["response"]) == ["error"] and why in bad_part["response"]["error"]
    await assert_replay_equals_live(bus, client, sid)


async def test_a_second_turn_sends_the_first_turns_message_and_answer(
        bus: Bus, client: ToolbusClient, planner: Planner, api: Api, fake: FakeProvider,
        sid: str) -> None:
    fake.script(error(api.provider, 401, "not this time"),
                reply(api.provider, "Hello.", stream=True),
                reply(api.provider, "You said hi.", stream=True))
    failed = await client.ask(sid, "Lost message.", timeout=60)
    assert isinstance(failed, TurnFailed), failed
    first = await client.ask(sid, "Hi.", timeout=60)
    assert isinstance(first, TurnCompleted) and first.text == "Hello.", first
    second = await client.ask(sid, "What did I say?", timeout=60)
    assert isinstance(second, TurnCompleted) and second.text == "You said hi.", second

    history = api.history(fake.requests[2])
    said = ("Hi.", "Hello.", "What did I say?")  # the failed turn is not part of it
    if api.provider == "openai":
        assert history[1:] == [{"role": "user", "content": said[0]},
                               {"role": "assistant", "content": said[1]},
                               {"role": "user", "content": said[2]}]
    elif api.provider == "openai-responses":
        assert history == [{"role": "user", "content": said[0]},
                           {"role": "assistant", "content": said[1]},
                           {"role": "user", "content": said[2]}]
    elif api.provider == "anthropic":
        assert history == [{"role": "user", "content": [{"type": "text", "text": said[0]}]},
                           {"role": "assistant",
                            "content": [{"type": "text", "text": said[1]}]},
                           {"role": "user", "content": [{"type": "text", "text": said[2]}]}]
    else:
        assert history == [{"role": "user", "parts": [{"text": said[0]}]},
                           {"role": "model", "parts": [{"text": said[1]}]},
                           {"role": "user", "parts": [{"text": said[2]}]}]
    await assert_replay_equals_live(bus, client, sid)


@pytest.mark.parametrize("api", [APIS["openai"], APIS["openai-responses"]],
                         ids=["openai", "openai-responses"])
async def test_arguments_that_are_not_json_are_refused_and_never_run_the_tool(
        bus: Bus, client: ToolbusClient, planner: Planner, api: Api, fake: FakeProvider,
        sid: str) -> None:
    # A model cut off mid-call (max tokens) sends the arguments' JSON unfinished.
    broken = '{"text": "delete everything'
    step = reply(api.provider, calls=[api.call("x", "placeholder")], stream=True)
    assert step.events is not None
    for _, data in step.events:
        _replace_arguments(data, {"text": "placeholder"}, broken)
    fake.script(step, reply(api.provider, "I sent broken arguments.", stream=True))
    end = await client.ask(sid, "Echo something.", timeout=60)

    assert isinstance(end, TurnCompleted), end
    assert [(o.status, o.error.error_type if o.error else None) for o in end.outcomes] == \
        [("rejected", "invalid_arguments")], end.outcomes
    events = await _events(bus, sid)
    assert not [e for e in events if type(e).__struct_config__.tag in
                ("call.started", "call.succeeded")]  # the tool never ran
    # The model sees its own arguments as it sent them, and why the call was refused.
    history = api.history(fake.requests[1])
    if api.provider == "openai":
        assert history[-2]["tool_calls"][0]["function"]["arguments"] == broken
        told = history[-1]["content"]
    else:
        assert history[-2]["arguments"] == broken
        told = history[-1]["output"]
    # Why, as the model can act on it (it read "must be a JSON object, got str").
    assert "arguments of built-in:echo are not valid JSON" in told, told
    await assert_replay_equals_live(bus, client, sid)


@pytest.mark.parametrize("api", [APIS["openai"]], ids=["openai"])
@pytest.mark.parametrize("depth", [100, 940, 5000])
async def test_arguments_nested_too_deeply_are_refused_and_the_turn_goes_on(
        bus: Bus, client: ToolbusClient, planner: Planner, api: Api, fake: FakeProvider,
        sid: str, depth: int) -> None:
    # Deeper than a client's request may nest (64): decoded for the approval actor, or
    # stored in the `model.responded`, they raised RecursionError in the planner (which
    # failed the turn `internal`), or could not be read back.
    arguments = "[" * depth + "]" * depth
    fake.script(Step(body={"id": "chatcmpl-deep", "model": api.model, "choices": [{
        "index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": None, "tool_calls": [{
                "id": "call_deep", "type": "function",
                "function": {"name": ECHO, "arguments": arguments}}]}}]}),
        reply(api.provider, "I sent broken arguments."))
    end = await client.ask(sid, "Echo something.", timeout=60)

    assert isinstance(end, TurnCompleted), end
    assert [(o.status, o.error.error_type if o.error else None) for o in end.outcomes] == \
        [("rejected", "invalid_arguments")], end.outcomes
    history = api.history(fake.requests[1])
    assert history[-2]["tool_calls"][0]["function"]["arguments"] == arguments
    assert "arguments of built-in:echo nest deeper than 64 levels" in \
        history[-1]["content"], history[-1]
    await assert_replay_equals_live(bus, client, sid)


def _replace_arguments(node: Any, old: dict[str, Any], new: str) -> None:
    """Put `new` where a scripted reply carries the arguments `old`: whole (`arguments`,
    in either JSON spelling), or streamed in fragments (the first fragment becomes `new`,
    the others empty)."""
    spelled = (_json(old), json.dumps(old))
    if isinstance(node, list):
        for item in node:
            _replace_arguments(item, old, new)
    elif isinstance(node, dict):
        for key, value in node.items():
            if key in ("arguments", "delta") and isinstance(value, str) and value and \
                    any(value in s for s in spelled):
                node[key] = new if any(s.startswith(value) for s in spelled) else ""
            else:
                _replace_arguments(value, old, new)


@pytest.mark.parametrize("api", [APIS["gemini"]], ids=["gemini"])
async def test_a_tool_the_catalog_lacks_goes_back_to_the_model_as_an_error(
        bus: Bus, client: ToolbusClient, planner: Planner, api: Api, fake: FakeProvider,
        sid: str) -> None:
    invented = [Call("fc-1", "search", {"q": "news"}), Call("fc-2", "web__fetch", {})]
    fake.script(reply(api.provider, calls=invented, stream=True),
                reply(api.provider, "I have no such tools.", stream=True))
    end = await client.ask(sid, "Search the news.", timeout=60)
    assert isinstance(end, TurnCompleted) and end.text == "I have no such tools.", end
    assert [o.status for o in end.outcomes] == ["rejected", "rejected"]
    parts = [p["functionResponse"] for p in api.history(fake.requests[1])[-1]["parts"]]
    # Echoed under the names the model used, each with why it failed.
    assert [(p["name"], p["id"]) for p in parts] == [("search", "fc-1"), ("web__fetch", "fc-2")]
    assert all(list(p["response"]) == ["error"] for p in parts)
    await assert_replay_equals_live(bus, client, sid)


@pytest.mark.parametrize("api", [APIS["gemini"], APIS["openai"]], ids=["gemini", "openai"])
async def test_a_blocked_prompt_fails_the_turn_saying_so_and_a_refusal_is_the_answer(
        bus: Bus, client: ToolbusClient, planner: Planner, api: Api, fake: FakeProvider,
        sid: str) -> None:
    # Both ended `turn.completed` with an empty answer: nothing said why.
    if api.provider == "gemini":
        fake.script(Step(body={"promptFeedback": {"blockReason": "PROHIBITED_CONTENT"},
                               "usageMetadata": {"promptTokenCount": 8}}))
    else:
        fake.script(Step(body={"id": "c", "object": "chat.completion", "model": api.model,
                               "choices": [{"index": 0, "finish_reason": "stop", "message": {
                                   "role": "assistant", "content": None,
                                   "refusal": "I can't help with that."}}]}))
    end = await client.ask(sid, "Something it will not do.", timeout=60)
    if api.provider == "gemini":
        assert isinstance(end, TurnFailed) and end.reason == "model_error", end
        assert "content filter stopped it (PROHIBITED_CONTENT)" in end.message, end.message
    else:
        assert isinstance(end, TurnCompleted) and end.text == "I can't help with that.", end
    assert len(fake.requests) == 1  # the same request would end the same way
    await assert_replay_equals_live(bus, client, sid)


# --- injected tool events (found by the planner fuzzer) -----------------------------------


@pytest.mark.parametrize("api", [APIS["anthropic"], APIS["gemini"]],
                         ids=["anthropic", "gemini"])
async def test_a_tool_event_injected_before_the_first_message_reaches_the_model_validly(
        bus: Bus, client: ToolbusClient, planner: Planner, api: Api, fake: FakeProvider,
        sid: str) -> None:
    # Rendered as the assistant's call and its result, the event made the conversation
    # start with the assistant (Anthropic: "first message must use the user role"), or a
    # function call follow the model's answer (Gemini: "function call turn comes
    # immediately after a user turn"): every later turn of the session failed.
    await client.inject(sid, "crm:note", {"vip": True}, idempotency_key="k1")
    fake.script(reply(api.provider, "Noted.", stream=True),
                reply(api.provider, "Noted again.", stream=True))
    first = await client.ask(sid, "Who is this?", timeout=60)
    assert isinstance(first, TurnCompleted) and first.text == "Noted.", first
    await client.inject(sid, "crm:note", {"vip": False}, idempotency_key="k2")
    second = await client.ask(sid, "And now?", timeout=60)
    assert isinstance(second, TurnCompleted) and second.text == "Noted again.", second

    for received in fake.requests:
        history = api.history(received)
        roles = [m["role"] for m in history]
        assert roles[0] == "user", history
        for before, role in itertools.pairwise(roles):
            assert not (before == role == ("assistant" if api.provider == "anthropic"
                                           else "model")), history
    # The second request: the first turn, then the second event, then the message.
    history = api.history(fake.requests[1])
    said = json.dumps(history)
    assert said.count("vip") == 2
    assert said.index("vip") < said.index("Noted.") < said.rindex("vip")
    await assert_replay_equals_live(bus, client, sid)
