"""OpenAI Responses against the scripted fake server."""

from __future__ import annotations

import pytest

from actors.llm import Message, ModelSettings, ToolCall, complete
from actors.llm.openai_responses import build
from schemas.errors import ModelError
from tests.actors.llm.conftest import KEY, TOOLS
from tests.llm_servers import Call, FakeProvider, Step, reply, responses_body

CALLS = [Call("call_A1", "weather__get_forecast", {"city": "Paris"}),
         Call("call_B2", "clock__now", {})]
FUNCTIONS = [
    {"type": "function", "name": "weather__get_forecast",
     "description": "The forecast for a city.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                    "required": ["city"]}, "strict": False},
    {"type": "function", "name": "clock__now", "description": "The time now.",
     "parameters": {"type": "object", "properties": {}}, "strict": False},
]


def settings(fake: FakeProvider, **kw: object) -> ModelSettings:
    return ModelSettings(provider="openai-responses", model="gpt-test", api_key=KEY,
                         base_url=fake.base_url("openai-responses"), **kw)  # type: ignore[arg-type]  # test knobs


async def test_two_parallel_function_calls_and_their_outputs_round_trip_in_responses_shape(
        fake: FakeProvider) -> None:
    fake.script(reply("openai-responses", "Checking both.", CALLS),
                reply("openai-responses", "Sunny; 10:00."))
    ask = Message(role="user", text="Weather in Paris, and the time?")
    first = await complete(settings(fake, max_tokens=300), system="Be brief.",
                           messages=[ask], tools=TOOLS)
    assert first.text == "Checking both."
    assert first.tool_calls == [
        ToolCall(id="call_A1", name="weather:get_forecast", arguments={"city": "Paris"},
                 extra={"id": "fc_call_A1"}),
        ToolCall(id="call_B2", name="clock:now", arguments={}, extra={"id": "fc_call_B2"})]
    assert first.finish_reason == "tool_calls"
    assert first.response_id == "resp_test1"

    history = [ask, Message(role="assistant", text=first.text, tool_calls=first.tool_calls),
               Message(role="tool", tool_call_id="call_A1", name="weather:get_forecast",
                       text='{"sky": "sunny"}'),
               Message(role="tool", tool_call_id="call_B2", name="clock:now", text="10:00")]
    second = await complete(settings(fake), system="Be brief.", messages=history, tools=TOOLS)
    assert second.text == "Sunny; 10:00."
    assert second.finish_reason == "stop"

    one, two = fake.requests
    assert (one.method, one.path) == ("POST", "/v1/responses")
    assert one.headers["authorization"] == f"Bearer {KEY}"
    assert one.body == {
        "model": "gpt-test", "instructions": "Be brief.",
        "input": [{"role": "user", "content": "Weather in Paris, and the time?"}],
        "tools": FUNCTIONS, "tool_choice": "auto", "max_output_tokens": 300,
    }
    assert two.body["input"][1:] == [
        {"role": "assistant", "content": "Checking both."},
        {"type": "function_call", "call_id": "call_A1", "name": "weather__get_forecast",
         "arguments": '{"city":"Paris"}', "id": "fc_call_A1"},
        {"type": "function_call", "call_id": "call_B2", "name": "clock__now",
         "arguments": "{}", "id": "fc_call_B2"},
        {"type": "function_call_output", "call_id": "call_A1", "output": '{"sky": "sunny"}'},
        {"type": "function_call_output", "call_id": "call_B2", "output": "10:00"},
    ]


async def test_streamed_answer_hands_each_text_delta_to_on_delta(fake: FakeProvider) -> None:
    fake.script(reply("openai-responses", stream=True, chunks=["Sunny ", "in ", "Paris."]))
    deltas: list[str] = []

    async def on_delta(text: str) -> None:
        deltas.append(text)

    answer = await complete(settings(fake), system=None,
                            messages=[Message(role="user", text="Weather?")], tools=TOOLS,
                            on_delta=on_delta)
    assert deltas == ["Sunny ", "in ", "Paris."]
    assert answer.text == "Sunny in Paris."
    assert answer.finish_reason == "stop"
    assert (answer.usage.input_tokens, answer.usage.output_tokens) == (21, 9)
    assert fake.requests[0].body["stream"] is True


async def test_streamed_function_calls_are_assembled_from_argument_deltas(
        fake: FakeProvider) -> None:
    # Without the final `response.output`, the items built from the events are the reply.
    events = reply("openai-responses", calls=[
        Call("call_1", "weather__get_forecast", {"city": "Paris", "days": [1, 2]}),
        Call("call_2", "clock__now", {})], stream=True).events
    assert events is not None
    name, last = events[-1]
    events[-1] = (name, {**last, "response": {**last["response"], "output": []}})
    events = [e for e in events if e[0] != "response.output_item.done"]
    fake.script(Step(events=events))

    async def on_delta(text: str) -> None:
        raise AssertionError(text)

    answer = await complete(settings(fake), system=None,
                            messages=[Message(role="user", text="?")], tools=TOOLS,
                            on_delta=on_delta)
    assert [(c.id, c.name, c.arguments) for c in answer.tool_calls] == [
        ("call_1", "weather:get_forecast", {"city": "Paris", "days": [1, 2]}),
        ("call_2", "clock:now", {})]
    assert answer.finish_reason == "tool_calls"


async def test_reasoning_items_are_echoed_before_the_function_call_they_led_to(
        fake: FakeProvider) -> None:
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [],
                 "encrypted_content": "opaque"}
    fake.script(Step(body=responses_body(calls=CALLS[:1], reasoning=[reasoning])),
                reply("openai-responses", "Sunny."))
    ask = Message(role="user", text="Weather?")
    first = await complete(settings(fake), system=None, messages=[ask], tools=TOOLS)
    assert first.tool_calls[0].extra == {"id": "fc_call_A1", "reasoning": [reasoning]}
    await complete(settings(fake), system=None, tools=TOOLS, messages=[
        ask, Message(role="assistant", tool_calls=first.tool_calls),
        Message(role="tool", tool_call_id="call_A1", name="weather:get_forecast",
                text="sunny")])
    assert fake.requests[1].body["input"][1:3] == [
        reasoning, {"type": "function_call", "call_id": "call_A1",
                    "name": "weather__get_forecast", "arguments": '{"city":"Paris"}',
                    "id": "fc_call_A1"}]


async def test_incomplete_response_reports_length(fake: FakeProvider) -> None:
    body = responses_body("Sunny in")
    body.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
    fake.script(Step(body=body))
    answer = await complete(settings(fake), system=None,
                            messages=[Message(role="user", text="?")], tools=[])
    assert (answer.text, answer.finish_reason) == ("Sunny in", "length")


def test_json_schema_output_and_tool_choice_go_in_their_fields() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"],
              "additionalProperties": False}
    request = build(ModelSettings(provider="openai-responses", model="m"), system=None,
                    messages=[Message(role="user", text="hi")], tools=TOOLS,
                    tool_choice="required", response_schema=schema, stream=False)
    assert request.url == "https://api.openai.com/v1/responses"
    assert request.body["tool_choice"] == "required"
    assert request.body["text"] == {"format": {"type": "json_schema", "name": "response",
                                               "schema": schema, "strict": True}}
    assert "authorization" not in request.headers


async def test_a_streamed_error_event_nesting_its_fields_under_error_says_what_failed(
        fake: FakeProvider) -> None:
    # What the live API sends (the reference shows the fields flat, read too): the
    # provider's message was lost ("error event"), and an invalid request was tried again
    # as if the server had failed.
    fake.script(Step(events=[("error", {"type": "error", "sequence_number": 2, "error": {
        "type": "invalid_request_error", "code": "context_length_exceeded",
        "message": "Your input exceeds the context window of this model.",
        "param": "input"}})]))

    async def on_delta(text: str) -> None:
        pass

    with pytest.raises(ModelError) as caught:
        await complete(settings(fake), system=None, messages=[Message(role="user", text="?")],
                       tools=TOOLS, on_delta=on_delta)
    assert caught.value.kind == "bad_request"
    assert caught.value.attempts == 1
    assert "exceeds the context window" in str(caught.value)
