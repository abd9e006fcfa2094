"""Gemini generateContent against the scripted fake server."""

from __future__ import annotations

import itertools

from actors.llm import Message, ModelSettings, ToolCall, complete
from actors.llm.gemini import build
from tests.actors.llm.conftest import KEY, TOOLS
from tests.llm_servers import Call, FakeProvider, Step, gemini_body, gemini_events, reply

SIGNATURE = "CtMBAdHtim9+opaque/signature=="
CALLS = [Call("fc-1", "weather__get_forecast", {"city": "Paris"}, signature=SIGNATURE),
         Call("fc-2", "clock__now", {})]
DECLARATIONS = [{"functionDeclarations": [
    {"name": "weather__get_forecast", "description": "The forecast for a city.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                    "required": ["city"]}},
    {"name": "clock__now", "description": "The time now."},
]}]


def settings(fake: FakeProvider, **kw: object) -> ModelSettings:
    return ModelSettings(provider="gemini", model="gemini-test", api_key=KEY,
                         base_url=fake.base_url("gemini"), **kw)  # type: ignore[arg-type]  # test knobs


async def test_two_parallel_function_calls_and_responses_round_trip_in_gemini_shape(
        fake: FakeProvider) -> None:
    fake.script(reply("gemini", calls=CALLS), reply("gemini", "Sunny; 10:00."))
    ask = Message(role="user", text="Weather in Paris, and the time?")
    first = await complete(settings(fake, temperature=0.0, max_tokens=256),
                           system="Be brief.", messages=[ask], tools=TOOLS)
    assert first.tool_calls == [
        ToolCall(id="fc-1", name="weather:get_forecast", arguments={"city": "Paris"},
                 extra={"thoughtSignature": SIGNATURE}),
        ToolCall(id="fc-2", name="clock:now", arguments={})]
    # Gemini says STOP even with calls.
    assert first.finish_reason == "tool_calls"
    assert first.response_id == "gemini-resp-1"

    history = [ask, Message(role="assistant", tool_calls=first.tool_calls),
               Message(role="tool", tool_call_id="fc-1", name="weather:get_forecast",
                       text='{"sky": "sunny"}'),
               Message(role="tool", tool_call_id="fc-2", name="clock:now",
                       text="clock unavailable", is_error=True)]
    second = await complete(settings(fake), system="Be brief.", messages=history, tools=TOOLS)
    assert second.text == "Sunny; 10:00."
    assert second.finish_reason == "stop"

    one, two = fake.requests
    assert (one.method, one.path) == ("POST", "/v1beta/models/gemini-test:generateContent")
    assert one.headers["x-goog-api-key"] == KEY
    assert one.query == {}  # the key is never in the URL
    assert one.body == {
        "contents": [{"role": "user", "parts": [{"text": "Weather in Paris, and the time?"}]}],
        "systemInstruction": {"parts": [{"text": "Be brief."}]},
        "tools": DECLARATIONS,
        "toolConfig": {"functionCallingConfig": {"mode": "AUTO"}},
        "generationConfig": {"temperature": 0.0, "maxOutputTokens": 256},
    }
    assert two.body["contents"][1:] == [
        {"role": "model", "parts": [
            {"functionCall": {"name": "weather__get_forecast", "args": {"city": "Paris"},
                              "id": "fc-1"}, "thoughtSignature": SIGNATURE},
            {"functionCall": {"name": "clock__now", "args": {}, "id": "fc-2"}}]},
        {"role": "user", "parts": [
            {"functionResponse": {"name": "weather__get_forecast", "id": "fc-1",
                                  "response": {"output": {"sky": "sunny"}}}},
            {"functionResponse": {"name": "clock__now", "id": "fc-2",
                                  "response": {"error": "clock unavailable"}}}]},
    ]


async def test_streamed_answer_hands_each_text_delta_to_on_delta(fake: FakeProvider) -> None:
    fake.script(reply("gemini", stream=True, chunks=["Sunny ", "in ", "Paris."]))
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
    assert request.path == "/v1beta/models/gemini-test:streamGenerateContent"
    assert request.query == {"alt": ["sse"]}


async def test_calls_without_ids_get_stable_ids_that_are_echoed_in_call_and_response(
        fake: FakeProvider) -> None:
    events = gemini_events(calls=[Call("", "weather__get_forecast", {"city": "Oslo"}),
                                  Call("", "clock__now", {})], with_ids=False)
    fake.script(Step(events=events), Step(events=events), reply("gemini", "ok"))

    async def on_delta(text: str) -> None:
        return None

    ask = Message(role="user", text="?")
    a = await complete(settings(fake), system=None, messages=[ask], tools=TOOLS,
                       on_delta=on_delta)
    b = await complete(settings(fake), system=None, messages=[ask], tools=TOOLS,
                       on_delta=on_delta)
    assert [c.id for c in a.tool_calls] == [c.id for c in b.tool_calls]
    assert len({c.id for c in a.tool_calls}) == 2
    assert [c.name for c in a.tool_calls] == ["weather:get_forecast", "clock:now"]
    first, second = a.tool_calls
    await complete(settings(fake), system=None, tools=TOOLS, messages=[
        ask, Message(role="assistant", tool_calls=a.tool_calls),
        Message(role="tool", tool_call_id=first.id, text="cold"),  # name found by id
        Message(role="tool", tool_call_id=second.id, name="clock:now", text="10:00")])
    model, results = fake.requests[2].body["contents"][1:]
    # No signature came with these calls: the first gets Gemini's documented placeholder.
    assert model["parts"][0] == {
        "functionCall": {"name": "weather__get_forecast", "args": {"city": "Oslo"},
                         "id": first.id},
        "thoughtSignature": "skip_thought_signature_validator"}
    assert "thoughtSignature" not in model["parts"][1]
    assert [p["functionResponse"]["id"] for p in results["parts"]] == [first.id, second.id]
    assert results["parts"][0]["functionResponse"]["name"] == "weather__get_forecast"


async def test_thought_summaries_are_not_answer_text(fake: FakeProvider) -> None:
    body = gemini_body("The answer.")
    body["candidates"][0]["content"]["parts"].insert(0, {"text": "thinking...",
                                                         "thought": True})
    fake.script(Step(body=body))
    answer = await complete(settings(fake), system=None,
                            messages=[Message(role="user", text="?")], tools=[])
    assert answer.text == "The answer."


def test_user_text_after_function_responses_is_a_content_of_its_own() -> None:
    call = ToolCall(id="c1", name="clock:now", arguments={})
    request = build(
        ModelSettings(provider="gemini", model="models/gemini-x"), system=None, tools=TOOLS,
        tool_choice="required", response_schema={"type": "object"}, stream=False, messages=[
            Message(role="user", text="Time?"),
            Message(role="assistant", text="Checking.", tool_calls=[call]),
            Message(role="tool", tool_call_id="c1", name="clock:now", text="10:00"),
            Message(role="user", text="Thanks."),
        ])
    assert request.url == ("https://generativelanguage.googleapis.com/v1beta/models/"
                           "gemini-x:generateContent")
    assert request.body["toolConfig"] == {"functionCallingConfig": {"mode": "ANY"}}
    assert request.body["generationConfig"] == {"responseMimeType": "application/json",
                                                "responseJsonSchema": {"type": "object"}}
    assert [c["role"] for c in request.body["contents"]] == ["user", "model", "user", "user"]
    assert request.body["contents"][1]["parts"][0] == {"text": "Checking."}
    assert request.body["contents"][2]["parts"] == [{"functionResponse": {
        "name": "clock__now", "id": "c1", "response": {"output": "10:00"}}}]


async def test_a_streamed_chunk_with_null_prompt_feedback_reads_as_without_one(
        fake: FakeProvider) -> None:
    # As in a whole reply: a proxy that writes every unset field as null sent
    # `promptFeedback: null` in each chunk, and every streamed reply was refused as not
    # in the API's shape (the turn ended `model_error` after its retries).
    events = [(name, {**data, "promptFeedback": None})
              for name, data in gemini_events(["Sunny ", "in Paris."])]
    fake.script(Step(events=events))
    deltas: list[str] = []

    async def on_delta(text: str) -> None:
        deltas.append(text)

    answer = await complete(settings(fake, max_retries=0), system=None,
                            messages=[Message(role="user", text="Weather?")], tools=TOOLS,
                            on_delta=on_delta)
    assert answer.text == "".join(deltas) == "Sunny in Paris."
    assert answer.finish_reason == "stop"


async def test_an_empty_reply_for_a_malformed_function_call_is_asked_again(
        fake: FakeProvider) -> None:
    # Gemini's MALFORMED_FUNCTION_CALL comes with no content: the turn completed with an
    # empty answer. Another attempt usually gets the call right.
    fake.script(Step(body={"candidates": [{"finishReason": "MALFORMED_FUNCTION_CALL",
                                           "index": 0}], "responseId": "r1"}),
                reply("gemini", calls=[CALLS[1]]))
    answer = await complete(settings(fake, max_retries=1), system=None,
                            messages=[Message(role="user", text="Time?")], tools=TOOLS)
    assert [c.name for c in answer.tool_calls] == ["clock:now"]
    assert answer.extra["attempts"] == 2


def _injected(call_id: str) -> list[Message]:
    """A tool event injected into a session, as the planner renders it (a call and its
    result the model never asked for)."""
    return [Message(role="assistant", text="", tool_calls=[
                ToolCall(id=call_id, name="crm:note", arguments={})]),
            Message(role="tool", tool_call_id=call_id, name="crm:note", text='{"a":1}')]


def test_a_function_call_comes_after_a_user_turn_even_an_injected_one() -> None:
    # Gemini refuses a function call turn that does not come right after a user turn or
    # a function response turn (400 INVALID_ARGUMENT): a tool event injected before the
    # session's first message, or after an answer, made every later turn of the session
    # fail `model_error`.
    for messages in (
            [*_injected("te-1"), Message(role="user", text="Hi.")],
            [Message(role="user", text="Hi."), Message(role="assistant", text="Hello."),
             *_injected("te-2"), Message(role="user", text="And now?")],
            [*_injected("te-1"), *_injected("te-2")]):
        request = build(ModelSettings(provider="gemini", model="gemini-x"), system=None,
                        tools=TOOLS, tool_choice="auto", response_schema=None,
                        stream=False, messages=messages)
        contents = request.body["contents"]
        assert contents[0]["role"] == "user", contents
        for before, content in itertools.pairwise(contents):
            if content["role"] == "model":
                assert before["role"] == "user", contents
        # Nothing of the conversation is lost.
        calls = [p for c in contents for p in c["parts"] if "functionCall" in p]
        assert len(calls) == sum(1 for m in messages if m.tool_calls)
