"""The wire memo changes nothing a provider receives: for each of the four APIs, a
request built with a session's memo encodes to exactly the bytes of one built without it.

Random conversations (text, calls with thinking, reasoning and signatures, invalid
arguments, runs of results with and without tool names, system messages, empty turns)
grow message by message; a random prefix of them is kept, as the planner keeps a
session's ended turns, and every request is built twice.
"""

from __future__ import annotations

import collections
import random
from typing import Any

import msgspec
import pytest

from actors.llm import BUILDERS, WireMemo, anthropic, gemini, openai_chat, openai_responses
from actors.llm.types import Message, ModelSettings, ToolCall
from schemas.tools import ToolSpec

TOOLS = [ToolSpec(name="crm:lookup", description="Look up a customer.",
                  parameters={"type": "object", "properties": {"id": {"type": "string"}}})]


def _message(rng: random.Random, k: int, calls: list[ToolCall]) -> Message:
    roll = rng.random()
    if roll < 0.25:
        return Message(role="user", text=rng.choice([f"question {k}", ""]))
    if roll < 0.5:
        made = []
        for j in range(rng.choice([0, 1, 2])):
            extra: dict[str, object] = rng.choice([
                {}, {"thinking": [{"type": "thinking", "thinking": "hm", "signature": "s"}]},
                {"reasoning": [{"type": "reasoning", "id": f"r{k}", "summary": []}],
                 "id": f"fc{k}"},
                {"thoughtSignature": f"sig{k}"}, {"invalid_arguments": "{not json"}])
            made.append(ToolCall(id=f"c{k}-{j}", name=rng.choice(["crm:lookup", "odd-name"]),
                                 arguments={"id": str(k)}, extra=extra))
        calls += made
        return Message(role="assistant", text=rng.choice([f"answer {k}", ""]),
                       tool_calls=made)
    if roll < 0.9 and calls:
        call = rng.choice(calls)
        return Message(role="tool", tool_call_id=call.id,
                       name=rng.choice([call.name, None]),
                       text=rng.choice(['{"ok": true}', "plain text", ""]),
                       is_error=rng.random() < 0.2)
    return Message(role="system", text=rng.choice(["be brief", ""]))


ASSEMBLIES = {"openai": openai_chat._Chat, "openai-responses": openai_responses._Input,
              "anthropic": anthropic._Messages, "gemini": gemini._Contents}


@pytest.mark.parametrize("provider", sorted(BUILDERS))
@pytest.mark.parametrize("seed", range(6))
def test_a_request_built_with_the_memo_is_the_same_bytes(
        provider: str, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    build = BUILDERS[provider]
    settings = ModelSettings(provider=provider, model="m", api_key="k")
    # Every message the memoized builds convert, counted.
    pushed: collections.Counter[int] = collections.Counter()
    counting = False
    cls = ASSEMBLIES[provider]
    real_push = cls.push

    def push(self: Any, m: Message) -> None:
        if counting:
            pushed[id(m)] += 1
        real_push(self, m)

    monkeypatch.setattr(cls, "push", push)
    memo = WireMemo()
    messages: list[Message] = []
    calls: list[ToolCall] = []
    kept = 0
    for k in range(80):
        messages.append(_message(rng, k, calls))
        if rng.random() < 0.3:
            more = rng.randrange(kept, len(messages) + 1)
            memo.keep(messages[kept:more])
            for m in messages[kept:more]:
                pushed[id(m)] = 0  # counted from now on
            kept = more
        for stream in (False, True):
            plain = build(settings, system="sys", messages=messages, tools=TOOLS,
                          tool_choice="auto", response_schema=None, stream=stream)
            counting = True
            memoized = build(settings, system="sys", messages=messages, tools=TOOLS,
                             tool_choice="auto", response_schema=None, stream=stream,
                             memo=memo)
            counting = False
            assert msgspec.json.encode(memoized.body) == msgspec.json.encode(plain.body), \
                (provider, seed, k)
    # Each message was converted once after it was kept (the others again for every
    # request).
    assert kept > 20 and memo._assemblies[provider][0] == kept
    assert [pushed[id(m)] for m in messages[:kept]] == [1] * kept


def test_equal_messages_that_are_not_the_kept_ones_are_built_in_full() -> None:
    # Equal is not enough: 1 == True and key order do not change equality but do change
    # the JSON. A conversation whose start is equal copies of the kept messages is
    # converted whole, and sends what it holds.
    settings = ModelSettings(provider="gemini", model="m", api_key="k")
    kept = [Message(role="user", text="q"),
            Message(role="assistant", tool_calls=[
                ToolCall(id="c1", name="crm:lookup", arguments={"a": 1, "b": 2})])]
    memo = WireMemo()
    memo.keep(kept)
    args = {"system": None, "tools": TOOLS, "tool_choice": "auto", "response_schema": None,
            "stream": False}
    BUILDERS["gemini"](settings, messages=kept, memo=memo, **args)  # remembered
    copies = [kept[0], Message(role="assistant", tool_calls=[
        ToolCall(id="c1", name="crm:lookup", arguments={"b": 2, "a": True})])]
    assert copies == kept  # equal as Python sees it
    body = BUILDERS["gemini"](settings, messages=copies, memo=memo, **args).body
    assert msgspec.json.encode(body) == msgspec.json.encode(
        BUILDERS["gemini"](settings, messages=copies, **args).body)
    assert body["contents"][1]["parts"][0]["functionCall"]["args"] == {"b": 2, "a": True}


def test_a_gemini_result_without_a_name_takes_the_latest_call_before_it() -> None:
    settings = ModelSettings(provider="gemini", model="m", api_key="k")
    memo = WireMemo()

    def call(name: str) -> Message:
        return Message(role="assistant", tool_calls=[ToolCall(id="c1", name=name,
                                                              arguments={})])

    def result() -> Message:
        return Message(role="tool", tool_call_id="c1", text="{}")

    messages = [result(), call("crm:lookup"), result(), call("crm:other"), result()]
    memo.keep(messages[:3])
    for with_memo in (None, memo, memo):
        body = msgspec.json.decode(msgspec.json.encode(BUILDERS["gemini"](
            settings, system=None, messages=messages, tools=[], tool_choice="auto",
            response_schema=None, stream=False, memo=with_memo).body))
        names = [p["functionResponse"]["name"] for c in body["contents"]
                 for p in c["parts"] if "functionResponse" in p]
        assert names == ["", "crm__lookup", "crm__other"]


def test_only_kept_messages_are_remembered() -> None:
    memo = WireMemo()
    settings = ModelSettings(provider="openai", model="m", api_key="k")
    old = [Message(role="user", text="q1"), Message(role="assistant", text="a1")]
    memo.keep(old)
    running = [Message(role="user", text="q2")]
    for _ in range(3):
        BUILDERS["openai"](settings, system=None, messages=[*old, *running], tools=[],
                           tool_choice="auto", response_schema=None, stream=False, memo=memo)
    body = BUILDERS["openai"](settings, system=None, messages=[*old, *running], tools=[],
                              tool_choice="auto", response_schema=None, stream=False,
                              memo=memo).body
    assert [type(m) for m in body["messages"]] == [msgspec.Raw, msgspec.Raw, dict]
    # A conversation that does not start with the kept messages is built in full.
    other = [Message(role="user", text="q0"), *old]
    body = BUILDERS["openai"](settings, system=None, messages=other, tools=[],
                              tool_choice="auto", response_schema=None, stream=False,
                              memo=memo).body
    assert [type(m) for m in body["messages"]] == [dict, dict, dict]
    assert [m["content"] for m in body["messages"]] == ["q0", "q1", "a1"]


def test_one_memo_serves_every_format() -> None:
    memo = WireMemo()
    messages = [Message(role="user", text="q1"),
                Message(role="assistant", text="a1", tool_calls=[
                    ToolCall(id="c1", name="crm:lookup", arguments={"id": "1"})]),
                Message(role="tool", tool_call_id="c1", name="crm:lookup", text='{"n": 1}')]
    memo.keep(messages)
    for _ in range(2):
        for provider, build in sorted(BUILDERS.items()):
            settings = ModelSettings(provider=provider, model="m", api_key="k")
            args = {"system": None, "messages": messages, "tools": TOOLS,
                    "tool_choice": "auto", "response_schema": None, "stream": False}
            assert msgspec.json.encode(build(settings, **args, memo=memo).body) == \
                msgspec.json.encode(build(settings, **args).body), provider
    assert sorted(memo._assemblies) == sorted(BUILDERS)


@pytest.mark.parametrize("provider", sorted(BUILDERS))
def test_the_tools_offered_are_exported_once_per_set_of_specs(provider: str) -> None:
    # A session offers the same tools at every model call: their schemas are converted
    # and encoded once, and a request carries exactly what a fresh export gives.
    from actors.llm import convert
    from schemas.providers import export

    settings = ModelSettings(provider=provider, model="m", api_key="k")
    specs = [ToolSpec(name=f"crm:tool_{i}", description=f"tool {i}",
                      parameters={"type": "object", "properties": {"id": {"type": "string"}},
                                  "required": ["id"]}) for i in range(3)]
    args = {"system": None, "messages": [Message(role="user", text="hi")],
            "tool_choice": "auto", "response_schema": None, "stream": False}
    first = BUILDERS[provider](settings, tools=specs, **args).body["tools"]
    assert isinstance(first, msgspec.Raw)
    assert BUILDERS[provider](settings, tools=list(specs), **args).body["tools"] is first
    # Equal specs that are other objects, or another set, are exported again.
    copies = [msgspec.structs.replace(s) for s in specs]
    assert BUILDERS[provider](settings, tools=copies, **args).body["tools"] is not first
    fewer = BUILDERS[provider](settings, tools=specs[:2], **args).body["tools"]
    assert len(msgspec.json.decode(fewer)) < len(msgspec.json.decode(first)) or \
        provider == "gemini"
    # What a fresh export gives, as each API finishes it.
    fmt = "openai" if provider.startswith("openai") else provider
    fresh, _ = export(specs, fmt)
    finish = {"openai": convert_module_finish("openai_chat", "_strict"),
              "openai-responses": convert_module_finish("openai_responses", "_functions")}
    expected = finish[provider](fresh) if provider in finish else fresh
    assert msgspec.json.decode(first) == expected
    assert len(convert._exports) <= convert._EXPORTS_KEPT


def convert_module_finish(module: str, name: str) -> Any:
    import importlib

    return getattr(importlib.import_module(f"actors.llm.{module}"), name)
