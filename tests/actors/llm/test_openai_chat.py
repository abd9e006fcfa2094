"""OpenAI Chat Completions against the scripted fake server."""

from __future__ import annotations

import msgspec

from actors.llm import Message, ModelSettings, ToolCall, complete
from actors.llm.openai_chat import build
from tests.actors.llm.conftest import KEY, TOOLS
from tests.llm_servers import Call, FakeProvider, Step, chat_body, chat_events, reply

CALLS = [Call("call_A1", "weather__get_forecast", {"city": "Paris"}),
         Call("call_B2", "clock__now", {})]
FUNCTIONS = [
    {"type": "function", "function": {
        "name": "weather__get_forecast", "description": "The forecast for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "clock__now", "description": "The time now.",
        "parameters": {"type": "object", "properties": {}}}},
]


def settings(fake: FakeProvider, **kw: object) -> ModelSettings:
    return ModelSettings(provider="openai", model="gpt-test", api_key=KEY,
                         base_url=fake.base_url("openai"), **kw)  # type: ignore[arg-type]  # test knobs


async def test_two_parallel_tool_calls_and_their_results_round_trip_in_chat_shape(
        fake: FakeProvider) -> None:
    fake.script(reply("openai", calls=CALLS), reply("openai", "Sunny; 10:00."))
    ask = Message(role="user", text="Weather in Paris, and the time?")
    first = await complete(settings(fake, max_tokens=300), system="Be brief.",
                           messages=[ask], tools=TOOLS)
    assert first.text == ""
    assert first.tool_calls == [
        ToolCall(id="call_A1", name="weather:get_forecast", arguments={"city": "Paris"}),
        ToolCall(id="call_B2", name="clock:now", arguments={})]
    assert first.finish_reason == "tool_calls"
    assert first.model == "gpt-test"

    history = [ask, Message(role="assistant", tool_calls=first.tool_calls),
               Message(role="tool", tool_call_id="call_A1", name="weather:get_forecast",
                       text='{"sky": "sunny"}'),
               Message(role="tool", tool_call_id="call_B2", name="clock:now", text="10:00")]
    second = await complete(settings(fake), system="Be brief.", messages=history, tools=TOOLS)
    assert second.text == "Sunny; 10:00."
    assert second.finish_reason == "stop"

    one, two = fake.requests
    assert (one.method, one.path) == ("POST", "/v1/chat/completions")
    assert one.headers["authorization"] == f"Bearer {KEY}"
    assert one.body == {
        "model": "gpt-test",
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Weather in Paris, and the time?"}],
        "tools": FUNCTIONS, "tool_choice": "auto",
        "max_tokens": 300,  # not OpenAI's own URL: the compatible servers' spelling
    }
    assert two.body["messages"][2:] == [
        {"role": "assistant", "tool_calls": [
            {"id": "call_A1", "type": "function",
             "function": {"name": "weather__get_forecast", "arguments": '{"city":"Paris"}'}},
            {"id": "call_B2", "type": "function",
             "function": {"name": "clock__now", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_A1", "content": '{"sky": "sunny"}'},
        {"role": "tool", "tool_call_id": "call_B2", "content": "10:00"},
    ]


async def test_streamed_answer_hands_each_text_delta_to_on_delta(fake: FakeProvider) -> None:
    fake.script(reply("openai", stream=True, chunks=["Sunny ", "in ", "Paris."]))
    deltas: list[str] = []

    async def on_delta(text: str) -> None:
        deltas.append(text)

    answer = await complete(settings(fake), system=None,
                            messages=[Message(role="user", text="Weather?")], tools=[],
                            on_delta=on_delta)
    assert deltas == ["Sunny ", "in ", "Paris."]
    assert answer.text == "Sunny in Paris."
    assert (answer.usage.input_tokens, answer.usage.output_tokens) == (21, 9)
    (request,) = fake.requests
    assert request.body == {"model": "gpt-test", "messages": [
        {"role": "user", "content": "Weather?"}], "stream": True,
        "stream_options": {"include_usage": True}}


async def test_streamed_parallel_tool_calls_are_assembled_by_index(fake: FakeProvider) -> None:
    fake.script(reply("openai", "Checking.", calls=[
        Call("call_1", "weather__get_forecast", {"city": "Paris", "days": [1, 2]}),
        Call("call_2", "clock__now", {"tz": "UTC"})], stream=True))
    seen: list[str] = []

    async def on_delta(text: str) -> None:
        seen.append(text)

    answer = await complete(settings(fake), system=None,
                            messages=[Message(role="user", text="?")], tools=TOOLS,
                            on_delta=on_delta)
    assert "".join(seen) == "Checking."
    assert answer.tool_calls == [
        ToolCall(id="call_1", name="weather:get_forecast",
                 arguments={"city": "Paris", "days": [1, 2]}),
        ToolCall(id="call_2", name="clock:now", arguments={"tz": "UTC"})]
    assert answer.finish_reason == "tool_calls"


async def test_interleaved_fragments_of_two_calls_land_on_their_own_index(
        fake: FakeProvider) -> None:
    base = {"id": "c", "object": "chat.completion.chunk", "model": "m"}

    def chunk(delta: dict[str, object], finish: str | None = None) -> tuple[None, object]:
        return None, {**base, "choices": [{"index": 0, "delta": delta,
                                           "finish_reason": finish}]}

    def frag(index: int, arguments: str, **head: str) -> dict[str, object]:
        function = {"arguments": arguments, **({"name": head["name"]} if "name" in head
                                               else {})}
        return {"tool_calls": [{"index": index, **({"id": head["id"]} if "id" in head
                                                   else {}), "function": function}]}

    fake.script(Step(events=[
        chunk(frag(0, "", id="call_1", name="clock__now")),
        chunk(frag(1, '{"ci', id="call_2", name="weather__get_forecast")),
        chunk(frag(0, "{}")),
        chunk(frag(1, 'ty":"Oslo"}')),
        chunk({}, "tool_calls"),
        (None, "[DONE]")]))
    answer = await complete(settings(fake), system=None, messages=[
        Message(role="user", text="?")], tools=TOOLS, on_delta=_ignore)
    assert [(c.id, c.name, c.arguments) for c in answer.tool_calls] == [
        ("call_1", "clock:now", {}), ("call_2", "weather:get_forecast", {"city": "Oslo"})]


async def _ignore(text: str) -> None:
    return None


async def test_arguments_that_are_not_json_are_kept_verbatim_and_echoed(
        fake: FakeProvider) -> None:
    body = chat_body(calls=[Call("call_X", "clock__now", {})])
    body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] = '{"tz": '
    fake.script(Step(body=body), reply("openai", "ok"))
    first = await complete(settings(fake), system=None,
                           messages=[Message(role="user", text="?")], tools=TOOLS)
    assert first.tool_calls == [ToolCall(id="call_X", name="clock:now", arguments={},
                                         extra={"invalid_arguments": '{"tz": '})]
    await complete(settings(fake), system=None, tools=TOOLS, messages=[
        Message(role="user", text="?"), Message(role="assistant", tool_calls=first.tool_calls),
        Message(role="tool", tool_call_id="call_X", name="clock:now", text="bad arguments",
                is_error=True)])
    echoed = fake.requests[1].body["messages"][1]["tool_calls"][0]["function"]["arguments"]
    assert echoed == '{"tz": '


async def test_calls_without_ids_from_a_compatible_server_get_stable_ids(
        fake: FakeProvider) -> None:
    events = chat_events(calls=[Call("", "clock__now", {})])
    fake.script(Step(events=events), Step(events=events))
    a = await complete(settings(fake), system=None, messages=[Message(role="user", text="?")],
                       tools=TOOLS, on_delta=_ignore)
    b = await complete(settings(fake), system=None, messages=[Message(role="user", text="?")],
                       tools=TOOLS, on_delta=_ignore)
    assert a.tool_calls[0].id.startswith("call_")
    assert a.tool_calls[0].id == b.tool_calls[0].id


def test_openai_itself_gets_max_completion_tokens_strict_tools_and_a_json_schema() -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string"}},
              "required": ["answer"], "additionalProperties": False}
    strict_tool = TOOLS[0].__class__(name="t:strict", parameters=schema)
    request = build(ModelSettings(provider="openai", model="gpt-x", max_tokens=50, api_key=KEY),
                    system=None, messages=[Message(role="user", text="hi")],
                    tools=[strict_tool], tool_choice="none", response_schema=schema,
                    stream=False)
    assert request.url == "https://api.openai.com/v1/chat/completions"
    assert request.body["max_completion_tokens"] == 50
    body = msgspec.json.decode(msgspec.json.encode(request.body))  # as sent
    assert body["tools"][0]["function"]["strict"] is True
    assert request.body["tool_choice"] == "none"
    assert request.body["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "response", "schema": schema, "strict": True}}
