"""A fuzzer of the planner: a real planner (as `toolbus up` starts it, with a named agent and
an output schema) against the fake provider of tests/llm_servers.py, whose every reply is
drawn at random from hostile model output, while clients send, resend, cancel and inject.

Used by tests/actors/test_planner_fuzz.py (a short, seeded run in the suite), and runnable
alone for longer runs:

    FUZZ_SESSIONS=40 FUZZ_SEED=7 FUZZ_PROVIDERS=anthropic,openai \\
        python -m pytest tests/actors/test_planner_fuzz.py -q -p no:cacheprovider

What a run checks, for every session it drove and every child session of its agent calls:
each turn ends exactly once, within a bound; each requested call ends exactly once; the
replay of the log equals the live state; the provider never received a conversation its
API refuses (a tool result without its call, a call without its result, ...); no actor
logged an error or a traceback; and `toolbus replay` sends the model nothing.

A reply is drawn from a generator seeded with the run's seed and the request's body, so
the same conversation gets the same reply whatever the timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import random
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from actors.agent_tools import child_session_id
from bus.client import ToolbusClient
from bus.connection import Bus
from bus.eventlog import EventLog
from schemas.errors import ToolbusError
from schemas.events import (
    CallFailed,
    CallRejected,
    CallRequested,
    CallSucceeded,
    Event,
    ModelRequested,
    ModelResponded,
    RequestRejected,
    TurnCancelled,
    TurnCompleted,
    TurnFailed,
    TurnRequested,
)
from schemas.ids import turn_id_for
from schemas.manifest import parse_manifest
from services.config import ActorSettings
from services.runtime import start_planner
from tests.conftest import assert_replay_equals_live
from tests.llm_servers import Event as SseEvent
from tests.llm_servers import FakeProvider, Received, Step, error

AGENT = "fuzzer"
TERMINAL = (CallSucceeded, CallFailed, CallRejected)
ENDS = (TurnCompleted, TurnFailed, TurnCancelled)

# --- what the model says ---------------------------------------------------------------

WEIRD = ["", " ", "\u202eevil\u202c", "a\x00b", "\u200b", "日本語", "emoji 🧨", "\ud7ff",
         "tab\tnew\nline", "\x1b[31mred", "quote\"back\\slash", "x" * 600]


def _weird_text(rng: random.Random) -> str:
    return "".join(rng.choice(WEIRD) for _ in range(rng.randint(1, 3)))


def _nested(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


def _arguments(rng: random.Random, name: str) -> str:
    """The arguments' text as a model might send them for the tool `name`."""
    valid = {
        "built-in__echo": {"text": "hi"},
        "built-in__current_time": {"timezone": rng.choice(["UTC", "Europe/Paris", "Mars/X"])},
        "testing__sleep": {"seconds": rng.choice([0.0, 0.05, 0.3, 1.0])},
        "testing__boom": {"message": "kaboom"},
        "testing__blob": {"size": rng.choice([10, 2000, 5000])},
        "built-in__recall": {"key": rng.choice(["_tool_result_1", "_tool_result_9", ""])},
        "built-in__emit_output": {"answer": "done"},
        f"agent__{AGENT}": {"message": rng.choice(["Say hi.", "Echo x.", ""])},
    }.get(name, {"text": "hi"})
    kind = rng.choices(
        ["valid", "invalid", "missing", "huge", "not_json", "non_object", "deep", "weird",
         "empty", "transform"],
        weights=[30, 6, 4, 2, 5, 5, 3, 5, 3, 2])[0]
    if kind == "valid":
        return json.dumps(valid)
    if kind == "invalid":
        return json.dumps({k: [v, {"no": None}] for k, v in valid.items()})
    if kind == "missing":
        return "{}"
    if kind == "huge":
        return json.dumps({k: "y" * rng.choice([70_000, 300_000]) for k in valid})
    if kind == "not_json":
        return rng.choice(['{"text": "cut', "not json", "{'a': 1}", "{}}", "\x00", "NaN"])
    if kind == "non_object":
        return rng.choice(["[1, 2]", '"text"', "3", "null", "true", "[]"])
    if kind == "deep":
        return _nested(rng.choice([30, 70, 1000]))
    if kind == "weird":
        return json.dumps({k: _weird_text(rng) for k in valid} | {_weird_text(rng): 1})
    if kind == "transform":
        return json.dumps({**valid, "_transform": rng.choice(["text", "[", "length(@)"])})
    return rng.choice(["", "null"])


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # the JSON text (or not JSON) as the model sent it


@dataclass
class Reply:
    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    finish: str = "natural"  # natural | opposite | length | filter | none
    usage: str = "normal"  # normal | missing | negative | huge | text
    stream: bool = True
    break_after: float | None = None  # the stream ends after this fraction of its events


def _draw_calls(rng: random.Random, offered: list[str]) -> list[ToolCall]:
    names = [*offered, "built-in__emit_output", "built-in__reason", f"agent__{AGENT}",
             "built-in__recall", "unknown__tool", "search", "", "a\x00b", "\u202etool",
             "x" * 700, "testing__sleep", "testing__blob", "approvals__write"]
    calls: list[ToolCall] = []
    for _i in range(rng.choices([1, 2, 3, 5], weights=[60, 25, 10, 5])[0]):
        name = rng.choice(offered) if offered and rng.random() < 0.6 else rng.choice(names)
        if name == "approvals__write":  # waits for a human: only as an unknown name
            name = "approvals__writ"
        cid = rng.choices([f"call_{uuid.UUID(int=rng.getrandbits(128)).hex[:10]}",
                           calls[-1].id if calls else "", "", "id with spaces",
                           "\u202eid", "x" * 300],
                          weights=[80, 8, 4, 3, 3, 2])[0]
        calls.append(ToolCall(cid, name, _arguments(rng, name)))
    return calls


def draw_reply(rng: random.Random, offered: list[str]) -> Reply | Step | None:
    """A reply (or an error Step; None: an error of the provider's shape, drawn later)."""
    kind = rng.choices(["text", "calls", "both", "empty", "error"],
                       weights=[32, 35, 15, 6, 12])[0]
    if kind == "error":
        return None
    reply = Reply(stream=rng.random() < 0.7,
                  finish=rng.choices(["natural", "opposite", "length", "filter", "none"],
                                     weights=[80, 8, 4, 4, 4])[0],
                  usage=rng.choices(["normal", "missing", "negative", "huge", "text"],
                                    weights=[70, 10, 7, 7, 6])[0])
    if kind in ("text", "both"):
        reply.text = rng.choice(["Done.", "ok", _weird_text(rng), "z" * 5000])
    if kind in ("calls", "both"):
        reply.calls = _draw_calls(rng, offered)
    if reply.stream and rng.random() < 0.06:
        reply.break_after = rng.random()
    return reply


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def _usage(kind: str) -> tuple[Any, Any] | None:
    return {"normal": (21, 9), "missing": None, "negative": (-5, -1),
            "huge": (10**30, 10**25), "text": ("12", 3.5)}[kind]


def _finish(provider: str, reply: Reply) -> str | None:
    natural = bool(reply.calls)
    table = {
        "openai": ("tool_calls", "stop", "length", "content_filter"),
        "anthropic": ("tool_use", "end_turn", "max_tokens", "refusal"),
        "gemini": ("STOP", "STOP", "MAX_TOKENS", "SAFETY"),
        "openai-responses": ("completed", "completed", "incomplete", "incomplete"),
    }[provider]
    if reply.finish == "none":
        return None
    if reply.finish == "natural":
        return table[0] if natural else table[1]
    if reply.finish == "opposite":
        return table[1] if natural else table[0]
    return table[2] if reply.finish == "length" else table[3]


def build(provider: str, reply: Reply) -> Step:
    events = {"openai": _chat, "openai-responses": _responses, "anthropic": _anthropic,
              "gemini": _gemini}[provider](reply)
    if not reply.stream:
        return Step(body=events[0][1])
    events = events[1:]
    if reply.break_after is not None:
        return Step(events=events, break_after=int(len(events) * reply.break_after))
    return Step(events=events)


def _pieces(text: str, n: int = 3) -> list[str]:
    size = max(1, -(-len(text) // n))
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]


# Each builder returns [(None, whole body), *stream events].

def _chat(r: Reply) -> list[SseEvent]:
    usage = _usage(r.usage)
    usage_body = None if usage is None else {
        "prompt_tokens": usage[0], "completion_tokens": usage[1]}
    message: dict[str, Any] = {"role": "assistant", "content": r.text or None}
    if r.calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.name, "arguments": c.arguments}} for c in r.calls]
    body: dict[str, Any] = {"id": "chatcmpl-f", "object": "chat.completion", "model": "m",
                            "choices": [{"index": 0, "message": message,
                                         "finish_reason": _finish("openai", r)}]}
    if usage_body is not None:
        body["usage"] = usage_body
    base = {"id": "chatcmpl-f", "object": "chat.completion.chunk", "model": "m"}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> SseEvent:
        return None, {**base, "choices": [{"index": 0, "delta": delta,
                                           "finish_reason": finish}]}

    events: list[SseEvent] = [(None, body), chunk({"role": "assistant", "content": ""})]
    events += [chunk({"content": p}) for p in _pieces(r.text) if p]
    for i, c in enumerate(r.calls):
        events.append(chunk({"tool_calls": [{"index": i, "id": c.id, "type": "function",
                                             "function": {"name": c.name,
                                                          "arguments": ""}}]}))
        events += [chunk({"tool_calls": [{"index": i, "function": {"arguments": p}}]})
                   for p in _pieces(c.arguments)]
    events.append(chunk({}, _finish("openai", r)))
    if usage_body is not None:
        events.append((None, {**base, "choices": [], "usage": usage_body}))
    events.append((None, "[DONE]"))
    return events


def _responses(r: Reply) -> list[SseEvent]:
    usage = _usage(r.usage)
    output: list[dict[str, Any]] = []
    if r.text:
        output.append({"type": "message", "id": "msg_f", "status": "completed",
                       "role": "assistant",
                       "content": [{"type": "output_text", "text": r.text,
                                    "annotations": []}]})
    output += [{"type": "function_call", "id": f"fc_{i}", "call_id": c.id, "name": c.name,
                "arguments": c.arguments, "status": "completed"}
               for i, c in enumerate(r.calls)]
    status = _finish("openai-responses", r)
    final: dict[str, Any] = {"id": "resp_f", "object": "response", "status": status,
                             "model": "m", "output": output, "error": None,
                             "incomplete_details": None if status != "incomplete" else {
                                 "reason": "max_output_tokens" if r.finish == "length"
                                 else "content_filter"}}
    if usage is not None:
        final["usage"] = {"input_tokens": usage[0], "output_tokens": usage[1]}
    events: list[SseEvent] = [(None, final), ("response.created", {
        "type": "response.created", "response": {**final, "status": "in_progress",
                                                 "output": []}})]
    for index, item in enumerate(output):
        if item["type"] == "message":
            events.append(("response.output_item.added", {
                "type": "response.output_item.added", "output_index": index,
                "item": {**item, "content": []}}))
            events += [("response.output_text.delta", {
                "type": "response.output_text.delta", "item_id": item["id"],
                "output_index": index, "content_index": 0, "delta": p})
                for p in _pieces(r.text)]
        else:
            events.append(("response.output_item.added", {
                "type": "response.output_item.added", "output_index": index,
                "item": {**item, "arguments": "", "status": "in_progress"}}))
            events += [("response.function_call_arguments.delta", {
                "type": "response.function_call_arguments.delta", "item_id": item["id"],
                "output_index": index, "delta": p}) for p in _pieces(item["arguments"])]
        events.append(("response.output_item.done", {
            "type": "response.output_item.done", "output_index": index, "item": item}))
    kind = "response.completed" if status != "incomplete" else "response.incomplete"
    if status is None:
        final.pop("status")
    events.append((kind, {"type": kind, "response": final}))
    return events


def _anthropic(r: Reply) -> list[SseEvent]:
    usage = _usage(r.usage)
    content: list[dict[str, Any]] = [{"type": "text", "text": r.text}] if r.text else []
    content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": _loads(c.arguments)}
                for c in r.calls]
    body: dict[str, Any] = {"id": "msg_f", "type": "message", "role": "assistant",
                            "model": "m", "content": content,
                            "stop_reason": _finish("anthropic", r), "stop_sequence": None}
    if usage is not None:
        body["usage"] = {"input_tokens": usage[0], "output_tokens": usage[1]}
    start = {**body, "content": [], "stop_reason": None}
    events: list[SseEvent] = [(None, body),
                              ("message_start", {"type": "message_start", "message": start})]
    index = 0
    if r.text:
        events.append(("content_block_start", {"type": "content_block_start", "index": 0,
                                               "content_block": {"type": "text",
                                                                 "text": ""}}))
        events += [("content_block_delta", {"type": "content_block_delta", "index": 0,
                                            "delta": {"type": "text_delta", "text": p}})
                   for p in _pieces(r.text)]
        events.append(("content_block_stop", {"type": "content_block_stop", "index": 0}))
        index = 1
    for c in r.calls:
        events.append(("content_block_start", {
            "type": "content_block_start", "index": index,
            "content_block": {"type": "tool_use", "id": c.id, "name": c.name, "input": {}}}))
        events += [("content_block_delta", {
            "type": "content_block_delta", "index": index,
            "delta": {"type": "input_json_delta", "partial_json": p}})
            for p in _pieces(c.arguments)]
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
        index += 1
    delta: dict[str, Any] = {"type": "message_delta",
                             "delta": {"stop_reason": _finish("anthropic", r),
                                       "stop_sequence": None}}
    if usage is not None:
        delta["usage"] = {"output_tokens": usage[1]}
    events.append(("message_delta", delta))
    events.append(("message_stop", {"type": "message_stop"}))
    return events


def _gemini(r: Reply) -> list[SseEvent]:
    usage = _usage(r.usage)
    parts: list[dict[str, Any]] = [{"text": r.text}] if r.text else []
    parts += [{"functionCall": {"name": c.name, "args": _loads(c.arguments),
                                **({"id": c.id} if c.id else {})}} for c in r.calls]
    finish = _finish("gemini", r)

    def chunk(parts: list[dict[str, Any]], last: bool) -> dict[str, Any]:
        candidate: dict[str, Any] = {"content": {"parts": parts, "role": "model"},
                                     "index": 0}
        if last and finish is not None:
            candidate["finishReason"] = finish
        out: dict[str, Any] = {"candidates": [candidate], "modelVersion": "m"}
        if usage is not None:
            out["usageMetadata"] = {"promptTokenCount": usage[0],
                                    "candidatesTokenCount": usage[1]}
        return out

    events: list[SseEvent] = [(None, chunk(parts, True))]
    pieces = [{"text": p} for p in _pieces(r.text)] if r.text else []
    calls = [p for p in parts if "functionCall" in p]
    events += [(None, chunk([p], False)) for p in pieces]
    if calls:
        events.append((None, chunk(calls, False)))
    events.append((None, chunk([{"text": ""}], True)))
    return events


# --- what the provider would refuse ----------------------------------------------------

def offered_tools(provider: str, body: Any) -> list[str]:
    tools = body.get("tools") or []
    if provider == "openai":
        return [t["function"]["name"] for t in tools]
    if provider == "gemini":
        return [d["name"] for t in tools for d in t.get("functionDeclarations", [])]
    return [t["name"] for t in tools]


ANTHROPIC_ID = re.compile(r"^[a-zA-Z0-9_-]+$")


def malformed(provider: str, body: Any) -> list[str]:
    """What in this request's conversation the provider's API refuses (400)."""
    if not isinstance(body, dict):
        return ["the body is not a JSON object"]
    return {"openai": _chat_faults, "openai-responses": _responses_faults,
            "anthropic": _anthropic_faults, "gemini": _gemini_faults}[provider](body)


def _chat_faults(body: dict[str, Any]) -> list[str]:
    faults: list[str] = []
    messages = body["messages"]
    pending: set[str] | None = None  # ids of the last assistant's calls not yet answered
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "tool":
            if pending is None or m.get("tool_call_id") not in pending:
                faults.append(f"messages[{i}]: a tool message answers no pending call "
                              f"({m.get('tool_call_id')!r})")
            else:
                pending.discard(m["tool_call_id"])
            if not isinstance(m.get("content"), str):
                faults.append(f"messages[{i}]: tool content is not text")
            continue
        if pending:
            faults.append(f"messages[{i}]: calls {sorted(pending)} have no tool message")
        pending = None
        if role == "assistant":
            calls = m.get("tool_calls") or []
            ids = [c.get("id") for c in calls]
            if len(set(ids)) != len(ids) or not all(isinstance(x, str) and x for x in ids):
                faults.append(f"messages[{i}]: tool call ids empty or repeated: {ids}")
            if not calls and m.get("content") is None:  # "" is taken
                faults.append(f"messages[{i}]: an assistant message with neither content "
                              "nor tool_calls")
            for c in calls:
                if not isinstance(c["function"].get("arguments"), str):
                    faults.append(f"messages[{i}]: arguments are not a string")
                if not c["function"].get("name"):
                    faults.append(f"unconfirmed: messages[{i}]: a tool call without a name")
            pending = set(ids) if calls else None
        elif role not in ("system", "user", "developer"):
            faults.append(f"messages[{i}]: role {role!r}")
    if pending:
        faults.append(f"the last calls {sorted(pending)} have no tool message")
    return faults


def _responses_faults(body: dict[str, Any]) -> list[str]:
    faults: list[str] = []
    called: dict[str, int] = {}
    answered: set[str] = set()
    for i, item in enumerate(body["input"]):
        kind = item.get("type")
        if kind == "function_call":
            if item["call_id"] in called:
                faults.append(f"input[{i}]: call_id {item['call_id']!r} repeated")
            called[item["call_id"]] = i
            if "id" in item and not str(item["id"]).startswith("fc"):
                faults.append(f"input[{i}]: item id {item['id']!r} does not begin with fc")
            if not item.get("name"):
                faults.append(f"unconfirmed: input[{i}]: a function call without a name")
            if not isinstance(item.get("arguments"), str):
                faults.append(f"input[{i}]: arguments are not a string")
        elif kind == "function_call_output":
            if item["call_id"] not in called:
                faults.append(f"input[{i}]: output for no earlier call "
                              f"({item['call_id']!r})")
            if item["call_id"] in answered:
                faults.append(f"input[{i}]: call {item['call_id']!r} answered twice")
            answered.add(item["call_id"])
    missing = set(called) - answered
    if missing:
        faults.append(f"calls {sorted(missing)} have no function_call_output")
    return faults


def _anthropic_faults(body: dict[str, Any]) -> list[str]:
    faults: list[str] = []
    messages = body["messages"]
    if not messages or messages[0].get("role") != "user":
        faults.append("the first message is not the user's")
    seen_ids: set[str] = set()
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not content:
            faults.append(f"messages[{i}]: empty content")
            continue
        for b in content:
            if b.get("type") == "text" and not b.get("text"):
                faults.append(f"messages[{i}]: an empty text block")
        uses = [b for b in content if b.get("type") == "tool_use"]
        results = [b for b in content if b.get("type") == "tool_result"]
        if m["role"] == "assistant" and i and messages[i - 1].get("role") == "assistant":
            faults.append(f"messages[{i}]: two assistant messages in a row")
        if m["role"] == "assistant" and results:
            faults.append(f"messages[{i}]: tool_result in an assistant message")
        if m["role"] == "user" and uses:
            faults.append(f"messages[{i}]: tool_use in a user message")
        for u in uses:
            if not isinstance(u.get("id"), str) or not ANTHROPIC_ID.match(u["id"]):
                faults.append(f"messages[{i}]: tool_use id {u.get('id')!r} breaks the pattern")
            if u.get("id") in seen_ids:
                faults.append(f"messages[{i}]: tool_use id {u.get('id')!r} repeated")
            seen_ids.add(u.get("id"))
            if not isinstance(u.get("input"), dict):
                faults.append(f"messages[{i}]: tool_use input is not an object")
        if results:
            before = messages[i - 1] if i else {}
            before_content = before.get("content") if isinstance(
                before.get("content"), list) else []
            use_ids = {b.get("id") for b in before_content if b.get("type") == "tool_use"}
            for r in results:
                if r.get("tool_use_id") not in use_ids:
                    faults.append(f"messages[{i}]: tool_result {r.get('tool_use_id')!r} "
                                  "answers no tool_use of the message before")
            first_other = next((k for k, b in enumerate(content)
                                if b.get("type") != "tool_result"), len(content))
            if any(k > first_other for k, b in enumerate(content)
                   if b.get("type") == "tool_result"):
                faults.append(f"messages[{i}]: tool_result after other content")
        if uses:
            after = messages[i + 1] if i + 1 < len(messages) else None
            after_content = after.get("content") if after and isinstance(
                after.get("content"), list) else []
            answered = {b.get("tool_use_id") for b in after_content
                        if b.get("type") == "tool_result"}
            missing = {u.get("id") for u in uses} - answered
            if missing:
                faults.append(f"messages[{i}]: tool_use {sorted(map(str, missing))} without "
                              "a tool_result in the next message")
    return faults


def _gemini_faults(body: dict[str, Any]) -> list[str]:
    faults: list[str] = []
    contents = body["contents"]
    for i, c in enumerate(contents):
        parts = c.get("parts") or []
        if not parts:
            faults.append(f"contents[{i}]: no parts")
        calls = [p["functionCall"] for p in parts if "functionCall" in p]
        responses = [p["functionResponse"] for p in parts if "functionResponse" in p]
        if c.get("role") not in ("user", "model"):
            faults.append(f"contents[{i}]: role {c.get('role')!r}")
        if calls and (i == 0 or contents[i - 1].get("role") != "user"):
            faults.append(f"contents[{i}]: a function call turn not right after a user "
                          "turn or a function response turn")
        for call in calls:
            if not isinstance(call.get("args", {}), dict):
                faults.append(f"contents[{i}]: functionCall args not an object")
            if not call.get("name"):
                faults.append(f"unconfirmed: contents[{i}]: a functionCall without a name")
        for r in responses:
            if not isinstance(r.get("response"), dict):
                faults.append(f"contents[{i}]: functionResponse response not an object")
        if calls:
            after = contents[i + 1] if i + 1 < len(contents) else {}
            answers = [p["functionResponse"] for p in after.get("parts", [])
                       if "functionResponse" in p]
            if len(answers) != len(calls):
                faults.append(f"contents[{i}]: {len(calls)} function calls, "
                              f"{len(answers)} responses next")
            elif [a.get("name") for a in answers] != [x.get("name") for x in calls]:
                faults.append(f"contents[{i}]: responses named otherwise than the calls")
        if responses:
            before = contents[i - 1] if i else {}
            if not any("functionCall" in p for p in before.get("parts", [])):
                faults.append(f"contents[{i}]: function responses after no calls")
    return faults


# --- the model server ------------------------------------------------------------------

class FuzzModel:
    """Answers every request with a reply drawn from (seed, request body, times seen)."""

    def __init__(self, fake: FakeProvider, provider: str, seed: int) -> None:
        self.fake = fake
        self.provider = provider
        self.seed = seed
        self.seen: dict[str, int] = {}
        self.faults: list[tuple[str, list[str], Any]] = []
        self.crashes: list[str] = []
        self.notes: list[str] = []
        fake.respond = self.respond

    def respond(self, received: Received) -> Step:
        try:
            return self._respond(received)
        except Exception as exc:  # the fuzzer's own bug: reported, never a hang
            self.crashes.append(repr(exc))
            return error(self.provider, 400, f"fuzzer crashed: {exc!r}")

    def _respond(self, received: Received) -> Step:
        digest = hashlib.sha256(received.raw).hexdigest()
        times = self.seen.get(digest, 0)
        self.seen[digest] = times + 1
        rng = random.Random(f"{self.seed}:{digest}:{times}")
        body = received.body
        found = malformed(self.provider, body)
        # What no API documents refusing, but some may: told, not failed on.
        self.notes += [f for f in found if f.startswith("unconfirmed")]
        faults = [f for f in found if not f.startswith("unconfirmed")]
        if faults:
            self.faults.append((received.path, faults, body))
        if times >= 2:  # asked again and again: let the turn go on
            return build(self.provider, Reply(text="Fine.", stream=False))
        drawn = draw_reply(rng, offered_tools(self.provider, body or {}))
        if drawn is None:
            status = rng.choice([500, 429, 503, 400])
            return error(self.provider, status, _weird_text(rng)[:200],
                         headers={"retry-after": "0"} if status != 400 else None)
        if isinstance(drawn, Step):
            return drawn
        return build(self.provider, drawn)


# --- the planner under test --------------------------------------------------------------

def manifest_text(provider: str, base_url: str, mode: str = "native") -> str:
    return (
        "agent_config:\n"
        f"  mode: {mode}\n"
        "  model:\n"
        f"    provider: {provider}\n"
        "    model: m\n"
        f"    base_url: {base_url}\n"
        "    api_key: ${FUZZ_KEY}\n"
        "    max_retries: 2\n"
        "    timeout_s: 5\n"
        "  instructions: Be brief.\n"
        "  output_schema:\n"
        "    type: object\n"
        "    properties: {answer: {type: string}}\n"
        "    required: [answer]\n"
        "  limits: {max_iterations: 5, max_agent_calls: 2}\n"
        "  agents:\n"
        f"    {AGENT}:\n"
        "      instructions: Help.\n"
        "      tools: ['built-in:echo']\n")


@contextlib.asynccontextmanager
async def fuzz_planner(bus: Bus, system: dict[str, Any], provider: str, seed: int,
                       mode: str = "native") -> AsyncIterator[FuzzModel]:
    async with FakeProvider() as fake:
        model = FuzzModel(fake, provider, seed)
        manifest = parse_manifest(manifest_text(provider, fake.base_url(provider), mode),
                                  env={"FUZZ_KEY": "fuzz-key-0123456789abcdef"})
        actor = await start_planner(bus, ActorSettings(
            manifest=manifest, instance=f"fz-{uuid.uuid4().hex[:6]}", ack_wait_s=2.0))
        try:
            await system["catalog"]._specs.wait_until(
                lambda items: f"agent.{AGENT}" in items, 5)
            yield model
        finally:
            await actor.stop()


# --- the clients ---------------------------------------------------------------------------

@dataclass
class Session:
    sid: str
    answers: list[Any] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    did: list[str] = field(default_factory=list)


async def drive(client: ToolbusClient, sid: str, rng: random.Random) -> Session:
    """One session's client: a message, then at random moments the same request again, a
    cancel, an injected tool event (which may start a turn), a second message."""
    s = Session(sid)
    first = f"r1-{rng.getrandbits(32):x}"

    loop = asyncio.get_running_loop()
    t0 = loop.time()

    async def later(delay: float, what: Any) -> Any:
        await asyncio.sleep(delay)
        return await what()

    def note(what: str) -> None:
        s.did.append(f"+{loop.time() - t0:.2f} {what}")

    async def ask(request_id: str, text: str) -> None:
        note(f"ask {request_id}")
        try:
            s.answers.append(await client.ask(sid, text, request_id=request_id, timeout=45))
            note(f"answered {request_id}: {type(s.answers[-1]).__name__}")
        except ToolbusError as exc:
            s.errors.append(f"ask {request_id}: {exc!r}")

    async def cancel() -> None:
        note("cancel")
        with contextlib.suppress(ToolbusError):  # nothing to cancel is an answer too
            got = await client.cancel(sid, turn_id_for(first), timeout=30)
            note(f"cancel answered {type(got).__name__}")

    async def inject(trigger: bool, key: str, large: bool, stop: bool) -> None:
        note(f"inject {key} {trigger}")
        note_text = "n" * 70_000 if large else _weird_text(rng)  # large: by reference
        try:
            got = await client.inject(sid, "crm:note", {"note": note_text},
                                      idempotency_key=key, trigger_processing=trigger)
        except ToolbusError as exc:
            s.errors.append(f"inject {key}: {exc!r}")
            return
        if stop and got.turn_id is not None:  # the turn it started, cancelled at once
            note(f"cancel {got.turn_id}")
            with contextlib.suppress(ToolbusError):
                await client.cancel(sid, got.turn_id, timeout=30)

    said = rng.choice(["Hello.", "Use your tools.", _weird_text(rng)])
    tasks = [ask(first, said)]
    if rng.random() < 0.3:  # the same request again: answered with the same turn's end
        tasks.append(later(rng.uniform(0, 0.4), lambda: ask(first, said)))
    if rng.random() < 0.25:
        tasks.append(later(rng.uniform(0, 0.8), cancel))
    if rng.random() < 0.3:
        key = f"k{rng.getrandbits(16)}"
        trigger = rng.random() < 0.6
        large = rng.random() < 0.15
        stop = rng.random() < 0.2
        tasks.append(later(rng.uniform(0, 0.8), lambda: inject(trigger, key, large, stop)))
        if rng.random() < 0.3:  # the same key again (a retry), with another body
            tasks.append(later(rng.uniform(0, 0.8),
                               lambda: inject(trigger, key, False, False)))
    if rng.random() < 0.35:
        tasks.append(later(rng.uniform(0, 0.5), lambda: ask(f"r2-{rng.getrandbits(32):x}",
                                                             "And then?")))
    await asyncio.gather(*tasks)
    return s


# --- the checks ------------------------------------------------------------------------------

async def events_of(bus: Bus, sid: str) -> list[Event]:
    return [s.event for s in await EventLog(bus).read_session(sid) if s.event is not None]


def _faults_of_log(sid: str, events: list[Event]) -> tuple[list[str], list[str]]:
    """What is wrong in one session's log, and its open turns or calls (not yet ended)."""
    faults: list[str] = []
    open_: list[str] = []
    turns = [e.turn_id for e in events if isinstance(e, TurnRequested)]
    for turn_id in turns:
        ends = [e for e in events if isinstance(e, ENDS) and e.turn_id == turn_id]
        if not ends:
            open_.append(f"{sid}: turn {turn_id} has not ended")
        elif len(ends) > 1:
            faults.append(f"{sid}: turn {turn_id} ended {len(ends)} times: "
                          f"{[type(e).__name__ for e in ends]}")
    requested = [e.call_id for e in events if isinstance(e, CallRequested)]
    if len(set(requested)) != len(requested):
        faults.append(f"{sid}: a call was requested twice")
    for call_id in requested:
        ends = [e for e in events if isinstance(e, TERMINAL) and e.call_id == call_id]
        if not ends:
            open_.append(f"{sid}: call {call_id} has not ended")
        elif len(ends) > 1:
            faults.append(f"{sid}: call {call_id} ended {len(ends)} times: "
                          f"{[type(e).__name__ for e in ends]}")
    asked = {(e.turn_id, e.iteration) for e in events if isinstance(e, ModelRequested)}
    answered = [(e.turn_id, e.iteration) for e in events if isinstance(e, ModelResponded)]
    if len(set(answered)) != len(answered):
        faults.append(f"{sid}: a model question answered twice")
    if set(answered) - asked:
        faults.append(f"{sid}: an answer to no question")
    return faults, open_


async def timeline(bus: Bus, sid: str) -> str:
    stored = await EventLog(bus).read_session(sid)
    start = stored[0].event.at if stored and stored[0].event else 0.0
    return "; ".join(
        f"{s.seq} {type(s.event).__struct_config__.tag} +{s.event.at - start:.2f}"
        f"{' ' + str(getattr(s.event, 'turn_id', ''))}"
        f"{' ' + str(getattr(s.event, 'call_id', ''))}"
        f"{' ' + str(getattr(s.event, 'reason', ''))}"
        f"{' ' + str(getattr(getattr(s.event, 'error', None), 'error_type', ''))}"
        f"{' ' + str(getattr(s.event, 'actor', ''))}" for s in stored if s.event)


def children(sid: str, events: list[Event]) -> list[str]:
    return [child_session_id(sid, e.call_id, AGENT) for e in events
            if isinstance(e, CallRequested) and e.tool == f"agent:{AGENT}"
            and any(isinstance(x, CallSucceeded | CallFailed) and x.call_id == e.call_id
                    and getattr(x, "executor", "") != "" for x in events)]


async def settle(bus: Bus, roots: list[str], bound: float = 60.0
                 ) -> tuple[list[str], list[str], list[str]]:
    """Wait (bounded) until every turn and call of the sessions and their children has
    ended; the sessions, the faults, and what is still open at the bound."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound
    while True:
        sessions: list[str] = []
        faults: list[str] = []
        still: list[str] = []
        todo = list(roots)
        while todo:
            sid = todo.pop()
            if sid in sessions:
                continue
            sessions.append(sid)
            events = await events_of(bus, sid)
            f, o = _faults_of_log(sid, events)
            faults += f
            still += o
            todo += children(sid, events)
        if not still or loop.time() > deadline:
            return sessions, faults, still
        await asyncio.sleep(0.2)


class Errors(logging.Handler):
    """Every record at ERROR or above, or with a traceback, logged meanwhile."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("uvicorn"):
            return  # the fake provider's, about the streams it breaks on purpose
        if record.levelno >= logging.ERROR or record.exc_info:
            self.records.append(record)

    def lines(self) -> list[str]:
        return [f"{r.name}: {r.getMessage()}"
                + (f"\n{logging.Formatter().formatException(r.exc_info)}" if r.exc_info
                   else "") for r in self.records]


@contextlib.contextmanager
def logged_errors() -> Iterator[Errors]:
    handler = Errors()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)


@dataclass
class Report:
    sessions: list[str]
    faults: list[str]
    still_open: list[str]
    malformed: list[tuple[str, list[str], Any]]
    logged: list[str]
    client_errors: list[str]
    crashes: list[str]
    notes: list[str]

    def problems(self) -> list[str]:
        out = list(self.faults) + [f"still open after the bound: {x}" for x in self.still_open]
        out += [f"malformed request to {p}: {f}\n{json.dumps(b)[:3000]}"
                for p, f, b in self.malformed]
        out += [f"logged: {x}" for x in self.logged]
        out += [f"client: {x}" for x in self.client_errors]
        out += [f"fuzzer: {x}" for x in self.crashes]
        return out


async def fuzz(bus: Bus, client: ToolbusClient, model: FuzzModel, *, sessions: int,
               seed: int, errors: Errors) -> Report:
    rng = random.Random(seed)
    sids = [f"fz-{model.provider}-{seed}-{i}-{uuid.uuid4().hex[:6]}" for i in range(sessions)]
    driven = await asyncio.gather(*(drive(client, sid, random.Random(rng.getrandbits(64)))
                                    for sid in sids))
    all_sessions, faults, still = await settle(bus, sids)
    for sid in all_sessions:
        try:
            await assert_replay_equals_live(bus, client, sid)
        except AssertionError as exc:
            faults.append(f"{sid}: replay differs from the live state: {exc}")
    client_errors = [e for s in driven for e in s.errors]
    for sid in sorted({f.split(":")[0] for f in faults + still}):
        client_errors.append(f"{sid}'s log: {await timeline(bus, sid)}")
    for s in driven:
        if s.errors:
            client_errors.append(f"{s.sid}'s client: {s.did}")
            client_errors.append(f"{s.sid}'s log: {await timeline(bus, s.sid)}")
    for s in driven:
        for answer in s.answers:
            if not isinstance(answer, (*ENDS, RequestRejected)):
                client_errors.append(f"{s.sid}: answered {answer!r}")
    return Report(all_sessions, faults, still, model.faults, errors.lines(), client_errors,
                  model.crashes, sorted(set(model.notes)))
