"""Composed mode (seed 001): the model answers with one JSON object instead of calling
tools natively, so models without function calling (small local ones) can drive tools.

The planner asks with structured output only (`response_format` json_schema, no `tools`):
the schema is `schemas.providers.compose_schema` over the tools it would have offered,
`{"output": <answer or null>, "calls": [{"_tool": name, ...arguments}]}`. The answer is
read back into what native function calling gives: `calls` become the `model.responded`
tool calls (so approval and dispatch are those of every call), and `output` becomes the
turn's answer: the text, or, when the agent has an output schema, a
`built-in:emit_output` call that is judged like any other. An answer that is not JSON or
breaks the schema is stored with its violations and goes back to the model, at most
`max_argument_retries` times.

Pure functions: no I/O. The planner (actors/planner.py) calls them from `_answer`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from actors.llm.convert import model_json
from actors.llm.transport import MAX_CALL_ID_CHARS, MAX_CALLS_PER_REPLY
from actors.llm.types import Message
from schemas.defaults import MAX_JSON_DEPTH
from schemas.events import ModelToolCall, clip
from schemas.ids import call_id_for
from schemas.providers import compose_schema
from schemas.tools import ToolSpec
from schemas.validation import Validator

# Without an output schema the answer is text: `output` is a string (or null).
TEXT_OUTPUT: dict[str, Any] = {"type": "string", "description": "your answer to the user"}


def composed_schema(tools: Sequence[ToolSpec], output_schema: dict[str, Any] | None, *,
                    emit_output: str) -> dict[str, Any]:
    """The schema of a composed answer over `tools` (the planner's own
    `emit_output` left out: the `output` field is its place)."""
    return compose_schema([t for t in tools if t.name != emit_output],
                          output_schema if output_schema is not None else TEXT_OUTPUT)


def composed_prompt(system: str | None, schema: dict[str, Any]) -> str:
    """The system prompt with how to answer: providers that ignore `response_format`
    still read it here."""
    how = ("Answer with one JSON object that matches this JSON Schema, and nothing else: "
           f"{msgspec.json.encode(schema).decode()}\n"
           "To use tools, list them in `calls` (each with `_tool` and its arguments) and set "
           "`output` to null; you will be told their results. When you have the answer, give "
           "it in `output` with `calls` empty.")
    return f"{system}\n\n{how}" if system else how


_CALL_KEYS = frozenset({"_tool", "_reasoningForCall"})  # what compose_schema adds


def read_composed(text: str, validator: Validator, *, turn_id: str, base: int,
                  emit_output: str | None, wrapped: bool
                  ) -> tuple[str, list[ModelToolCall], list[str]]:
    """A composed answer as the text, the tool calls (numbered from `base` in the turn)
    and the violations (then no calls: the answer is asked for again). A text `output`
    given with calls is dropped: the model is asked again after the calls anyway.
    `emit_output`: the name of the output tool when the agent has an output schema (the
    output becomes its call; `wrapped`: under `output`, as its schema says)."""
    body = text.strip()
    if body.startswith("```"):  # a fence around the JSON is tolerated
        body = body.split("\n", 1)[1] if "\n" in body else ""
        body = body.rsplit("```", 1)[0].strip()
    try:
        value = model_json(body)
    except msgspec.DecodeError as exc:
        if "deeper" in str(exc):
            return text, [], [f"$: the answer nests deeper than {MAX_JSON_DEPTH} levels"]
        return text, [], [f"$: the answer is not JSON: {clip(text, 200)!r}"]
    if not isinstance(value, dict):
        return text, [], ["$: the answer is not a JSON object"]
    value, found = validator.check(value)
    if found:
        return text, [], [str(v) for v in found]
    if len(value.get("calls") or []) > MAX_CALLS_PER_REPLY:
        # The bound a native reply has (actors/llm/transport.py): a composed answer is
        # text the model writes, and could otherwise list thousands of calls.
        return text, [], [f"$.calls: {len(value['calls'])} calls; at most "
                          f"{MAX_CALLS_PER_REPLY} in one answer"]
    calls: list[ModelToolCall] = []
    raws = value.get("calls") or []
    # What the schema should have ensured, checked again: the schema is only as strict as
    # the tools' own (a tool taking anything makes its variant take anything), and a
    # name that is not a string would make every event of the turn unreadable.
    bad = [f"$.calls[{i}]: a call is an object whose `_tool` is the name of a tool "
           f"offered (a string of at most {MAX_CALL_ID_CHARS} characters)"
           for i, raw in enumerate(raws)
           if not isinstance(raw, dict) or not isinstance(raw.get("_tool"), str)
           or not 0 < len(raw["_tool"]) <= MAX_CALL_ID_CHARS]
    if bad:
        return text, [], bad[:20]
    for raw in raws:
        name = raw["_tool"]
        # The composed schema's own keys out; a tool's parameters stay (`_id` is a name).
        arguments = {k: v for k, v in raw.items() if k not in _CALL_KEYS}
        call_id = call_id_for(turn_id, base + len(calls))
        calls.append(ModelToolCall(call_id=call_id, id=call_id, name=name,
                                   arguments=arguments))
    # The text kept is the answer itself when it is the turn's text; otherwise the JSON
    # as the model wrote it, for the model to read its own calls in the transcript.
    output = value.get("output")
    if output is not None and emit_output is None and not calls:
        return str(output), [], []
    if output is not None and emit_output is not None:
        call_id = call_id_for(turn_id, base + len(calls))
        calls.append(ModelToolCall(call_id=call_id, id=call_id, name=emit_output,
                                   arguments={"output": output} if wrapped else output))
    return body, calls, []


def flatten(messages: list[Message]) -> list[Message]:
    """A native transcript as plain text turns: the model's calls are in its own JSON
    answer already (the assistant text), and their results come back as one user
    message, a JSON list of `{"_tool", "result"}` or `{"_tool", "error"}`."""
    out: list[Message] = []
    results: list[dict[str, Any]] = []

    def close() -> None:
        if results:
            out.append(Message(role="user", text="Results of your calls: "
                               + msgspec.json.encode(results).decode()))
            results.clear()

    for m in messages:
        if m.role == "tool":
            results.append({"_tool": m.name, "error" if m.is_error else "result": m.text})
            continue
        close()
        out.append(Message(role=m.role, text=m.text) if m.role == "assistant" else m)
    close()
    return out


__all__ = ["TEXT_OUTPUT", "composed_prompt", "composed_schema", "flatten", "read_composed"]
