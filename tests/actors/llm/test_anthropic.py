"""Anthropic Messages against the scripted fake server: what goes over the wire, and what
comes back."""

from __future__ import annotations

from actors.llm import Message, ModelSettings, ToolCall, complete
from actors.llm.anthropic import build
from tests.actors.llm.conftest import KEY, TOOLS
from tests.llm_servers import Call, FakeProvider, Step, anthropic_body, reply

CALLS = [Call("toolu_01A", "weather__get_forecast", {"city": "Paris"}),
         Call("toolu_01B", "clock__now", {})]
INPUT_SCHEMAS = [
    {"name": "weather__get_forecast", "description": "The forecast for a city.",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                      "required": ["city"]}},
    {"name": "clock__now", "description": "The time now.",
     "input_schema": {"type": "object", "properties": {}}},
]


def settings(fake: FakeProvider, **kw: object) -> ModelSettings:
    return ModelSettings(provider="anthropic", model="claude-test", api_key=KEY,
                         base_url=fake.base_url("anthropic"), **kw)  # type: ignore[arg-type]  # test knobs


async def test_two_parallel_tool_calls_and_their_results_round_trip_in_messages_shape(
        fake: FakeProvider) -> None:
    fake.script(reply("anthropic", "Let me check both.", CALLS),
                reply("anthropic", "Sunny in Paris; it is 10:00."))
    ask = Message(role="user", text="Weather in Paris, and the time?")
    first = await complete(settings(fake, temperature=0.2), system="Be brief.",
                           messages=[ask], tools=TOOLS)

    assert first.text == "Let me check both."
    assert first.tool_calls == [
        ToolCall(id="toolu_01A", name="weather:get_forecast", arguments={"city": "Paris"}),
        ToolCall(id="toolu_01B", name="clock:now", arguments={})]
    assert first.finish_reason == "tool_calls"
    assert (first.usage.input_tokens, first.usage.output_tokens) == (21, 9)
    assert first.response_id == "msg_test1"

    history = [ask, Message(role="assistant", text=first.text, tool_calls=first.tool_calls),
               Message(role="tool", tool_call_id="toolu_01A", name="weather:get_forecast",
                       text='{"sky": "sunny"}'),
               Message(role="tool", tool_call_id="toolu_01B", name="clock:now",
                       text="clock unavailable", is_error=True)]
    second = await complete(settings(fake), system="Be brief.", messages=history, tools=TOOLS,
                            tool_choice="required")
    assert second.text == "Sunny in Paris; it is 10:00."
    assert second.finish_reason == "stop"

    one, two = fake.requests
    assert (one.method, one.path) == ("POST", "/v1/messages")
    assert one.headers["x-api-key"] == KEY
    assert one.headers["anthropic-version"] == "2023-06-01"
    assert "authorization" not in one.headers
    assert one.body == {
        "model": "claude-test", "max_tokens": 4096, "system": "Be brief.",
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Weather in Paris, and the time?"}]}],
        "tools": INPUT_SCHEMAS, "tool_choice": {"type": "auto"}, "temperature": 0.2,
    }
    assert two.body["tool_choice"] == {"type": "any"}
    # Both results in ONE user message right after the assistant's tool_use blocks.
    assert two.body["messages"][1:] == [
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me check both."},
            {"type": "tool_use", "id": "toolu_01A", "name": "weather__get_forecast",
             "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_01B", "name": "clock__now", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01A", "is_error": False,
             "content": '{"sky": "sunny"}'},
            {"type": "tool_result", "tool_use_id": "toolu_01B", "is_error": True,
             "content": "clock unavailable"}]},
    ]


async def test_streamed_answer_hands_each_text_delta_to_on_delta(fake: FakeProvider) -> None:
    fake.script(reply("anthropic", stream=True, chunks=["Sunny ", "in ", "Paris."]))
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
    (request,) = fake.requests
    assert request.body["stream"] is True
    assert request.headers["accept"] == "text/event-stream"


async def test_streamed_parallel_tool_calls_are_assembled_from_input_json_deltas(
        fake: FakeProvider) -> None:
    fake.script(reply("anthropic", calls=[
        Call("toolu_1", "weather__get_forecast", {"city": "Paris", "days": [1, 2]}),
        Call("toolu_2", "clock__now", {})], stream=True))
    seen: list[str] = []

    async def on_delta(text: str) -> None:
        seen.append(text)

    answer = await complete(settings(fake), system=None,
                            messages=[Message(role="user", text="?")], tools=TOOLS,
                            on_delta=on_delta)
    assert seen == []
    assert answer.tool_calls == [
        ToolCall(id="toolu_1", name="weather:get_forecast",
                 arguments={"city": "Paris", "days": [1, 2]}),
        ToolCall(id="toolu_2", name="clock:now", arguments={})]
    assert answer.finish_reason == "tool_calls"


async def test_unknown_tool_name_comes_back_raw(fake: FakeProvider) -> None:
    fake.script(reply("anthropic", calls=[Call("toolu_9", "rm_rf", {"path": "/"})]))
    answer = await complete(settings(fake), system=None,
                            messages=[Message(role="user", text="?")], tools=TOOLS)
    assert answer.tool_calls == [ToolCall(id="toolu_9", name="rm_rf", arguments={"path": "/"})]


async def test_thinking_blocks_are_echoed_first_in_the_replayed_tool_use_turn(
        fake: FakeProvider) -> None:
    thinking = {"type": "thinking", "thinking": "Need the forecast.", "signature": "sig=="}
    fake.script(Step(body=anthropic_body(calls=CALLS[:1], thinking=[thinking])),
                reply("anthropic", "Sunny."))
    ask = Message(role="user", text="Weather?")
    first = await complete(settings(fake), system=None, messages=[ask], tools=TOOLS)
    assert first.tool_calls[0].extra == {"thinking": [thinking]}
    await complete(settings(fake), system=None, tools=TOOLS, messages=[
        ask, Message(role="assistant", tool_calls=first.tool_calls),
        Message(role="tool", tool_call_id="toolu_01A", name="weather:get_forecast",
                text="sunny")])
    assert fake.requests[1].body["messages"][1]["content"] == [
        thinking, {"type": "tool_use", "id": "toolu_01A", "name": "weather__get_forecast",
                   "input": {"city": "Paris"}}]


def test_results_move_ahead_of_user_text_to_keep_tool_result_adjacency() -> None:
    call = ToolCall(id="toolu_1", name="clock:now", arguments={})
    request = build(
        ModelSettings(provider="anthropic", model="m"), system="S", tools=TOOLS,
        tool_choice="auto", response_schema={"type": "object"}, stream=False, messages=[
            Message(role="system", text="Also this."),
            Message(role="user", text="Time?"),
            Message(role="assistant", tool_calls=[call]),
            Message(role="user", text="(and hurry)"),
            Message(role="tool", tool_call_id="toolu_1", name="clock:now", text="10:00"),
            Message(role="user", text="Thanks."),
        ])
    assert request.body["system"] == "S\n\nAlso this."
    assert request.body["output_config"] == {
        "format": {"type": "json_schema", "schema": {"type": "object"}}}
    assert request.body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Time?"}]},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "clock__now", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": False,
             "content": "10:00"},
            {"type": "text", "text": "(and hurry)"},
            {"type": "text", "text": "Thanks."}]},
    ]
    assert "x-api-key" not in request.headers


async def test_streamed_usage_keeps_the_input_tokens_a_null_in_message_delta_leaves_out(
        fake: FakeProvider) -> None:
    # The API's `message_delta` carries `"input_tokens": null` (and nulls for the cache
    # counts): it says nothing of them, so `message_start`'s counts stand (as the SDK
    # reads it). They were overwritten with null and the streamed input counted as 0.
    step = reply("anthropic", "Sunny.", stream=True)
    assert step.events is not None
    name, data = step.events[0]
    data["message"]["usage"] = {"input_tokens": 21, "cache_creation_input_tokens": 4,
                                "cache_read_input_tokens": 100, "output_tokens": 1}
    for i, (name, data) in enumerate(step.events):
        if name == "message_delta":
            step.events[i] = (name, {**data, "usage": {
                "input_tokens": None, "cache_creation_input_tokens": None,
                "cache_read_input_tokens": None, "output_tokens": 9}})
    fake.script(step)

    async def on_delta(text: str) -> None:
        pass

    answer = await complete(settings(fake), system=None,
                            messages=[Message(role="user", text="?")], tools=TOOLS,
                            on_delta=on_delta)
    assert (answer.usage.input_tokens, answer.usage.output_tokens) == (125, 9)


async def test_a_history_with_tool_blocks_declares_their_tools_when_none_are_offered(
        fake: FakeProvider) -> None:
    # The API refuses tool_use or tool_result blocks in a request without `tools`
    # ("Requests which include tool_use or tool_result blocks must define tools"): a think
    # or match step after calls (or after an injected tool event) offers none, and failed
    # with a 400 every time. The tools used are declared, and none may be called.
    fake.script(reply("anthropic", '{"ok": true}'))
    history = [Message(role="user", text="Weather?"),
               Message(role="assistant", tool_calls=[
                   ToolCall(id="toolu_01A", name="weather:get_forecast",
                            arguments={"city": "Paris"}),
                   ToolCall(id="toolu_01B", name="event__feed", arguments={})]),
               Message(role="tool", tool_call_id="toolu_01A", name="weather:get_forecast",
                       text="sunny"),
               Message(role="tool", tool_call_id="toolu_01B", name="event__feed",
                       text="{}")]
    await complete(settings(fake), system=None, messages=history, tools=[],
                   response_schema={"type": "object"})
    body = fake.requests[0].body
    assert body["tools"] == [
        {"name": "weather__get_forecast", "input_schema": {"type": "object"}},
        {"name": "event__feed", "input_schema": {"type": "object"}}]
    assert body["tool_choice"] == {"type": "none"}
    # Without tool blocks, still no tools at all.
    fake.script(reply("anthropic", "hi"))
    await complete(settings(fake), system=None, messages=history[:1], tools=[])
    assert "tools" not in fake.requests[1].body and "tool_choice" not in fake.requests[1].body


def test_the_first_message_is_the_users_even_after_an_injected_tool_event() -> None:
    # "messages: first message must use the "user" role" (400): a tool event injected
    # before the session's first message is rendered as the assistant's call and its
    # result, and every turn of the session failed `model_error`.
    injected = [Message(role="assistant", text="", tool_calls=[
                    ToolCall(id="te-1", name="crm:note", arguments={})]),
                Message(role="tool", tool_call_id="te-1", name="crm:note", text='{"a":1}')]
    for messages in ([*injected, Message(role="user", text="Hi.")], injected):
        request = build(ModelSettings(provider="anthropic", model="claude-x"), system=None,
                        tools=TOOLS, tool_choice="auto", response_schema=None,
                        stream=False, messages=messages)
        sent = request.body["messages"]
        assert sent[0]["role"] == "user" and sent[0]["content"][0]["type"] == "text", sent
        assert sent[1]["content"][0]["type"] == "tool_use"
        assert sent[2]["content"][0] == {"type": "tool_result", "tool_use_id": "te-1",
                                         "is_error": False, "content": '{"a":1}'}
