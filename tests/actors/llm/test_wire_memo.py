"""The wire memo changes nothing a provider receives: for each of the four APIs, a
request built with a session's memo encodes to exactly the bytes of one built without it.

Random conversations (text, calls with thinking, reasoning and signatures, invalid
arguments, runs of results with and without tool names, system messages, empty turns)
grow message by message; a random prefix of them is kept, as the planner keeps a
session's ended turns, and every request is built twice.
"""

from __future__ import annotations

import random

import msgspec
import pytest

from actors.llm import BUILDERS, WireMemo
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


@pytest.mark.parametrize("provider", sorted(BUILDERS))
@pytest.mark.parametrize("seed", range(6))
def test_a_request_built_with_the_memo_is_the_same_bytes(provider: str, seed: int) -> None:
    rng = random.Random(seed)
    build = BUILDERS[provider]
    settings = ModelSettings(provider=provider, model="m", api_key="k")
    memo = WireMemo()
    messages: list[Message] = []
    calls: list[ToolCall] = []
    kept = 0
    for k in range(80):
        messages.append(_message(rng, k, calls))
        if rng.random() < 0.3:
            more = rng.randrange(kept, len(messages) + 1)
            memo.keep(messages[kept:more])
            kept = more
        for stream in (False, True):
            plain = build(settings, system="sys", messages=messages, tools=TOOLS,
                          tool_choice="auto", response_schema=None, stream=stream)
            memoized = build(settings, system="sys", messages=messages, tools=TOOLS,
                             tool_choice="auto", response_schema=None, stream=stream,
                             memo=memo)
            assert msgspec.json.encode(memoized.body) == msgspec.json.encode(plain.body), \
                (provider, seed, k)
    # The kept history went out from the memo, converted once.
    assert kept > 20 and memo._assemblies[provider][0] == kept


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
