"""The context tools of seed 003: `built-in:recall` and `built-in:context-status`.

Both read the calling session's own log, so they run in an executor beside the planner
(pool `context`) that knows which session dispatched the call, and go through the path
of every tool: offered to the model, approved (read-only), dispatched, stored as
`call.succeeded`. Replay reads their results from the log like any other.

- `recall(key, path?, offset?, limit?)`: the result the compressor stored under `key`
  (`_tool_result_N`), or a part of it (`path`, a JMESPath expression), a page at a time
  within the budget; `next_offset` says where the next page starts.
- `context-status()`: the turn's iteration budget and use, the tools used and pending, the
  stored keys, and the size of what the model reads, in characters and estimated tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from actors import compress
from actors.compressor import (
    CONTEXT_STATUS,
    RECALL,
    Compression,
    ResultTooLargeError,
    read_result,
    reading_bound,
    whole_result,
)
from actors.executor import Executor, current_dispatch
from actors.kernel import SessionStates
from actors.planner import DEFAULT_MAX_ITERATIONS, message_chars, transcript
from actors.tools import Resource, RunnableTool, ToolError
from bus.artifacts import ArtifactStore
from bus.connection import Bus
from bus.eventlog import EventLog
from schemas.events import CallDispatched
from schemas.state import CallState, InjectedToolEvent, SessionState
from schemas.tools import Annotations, ToolSpec

CONTEXT_POOL: Final = "context"
CONTEXT_EXECUTOR: Final = "context"
CHARS_PER_TOKEN: Final = 4  # the usual rough estimate, for English and JSON

_READ_ONLY = Annotations(readOnlyHint=True, destructiveHint=False, idempotentHint=True,
                         openWorldHint=False)

RECALL_SPEC: Final = ToolSpec(
    name=RECALL, source="built-in", pools=[CONTEXT_POOL], annotations=_READ_ONLY,
    title="recall a stored result",
    description="Read a tool result that was too large to show whole: the preview named it "
                "[STORED: <key> | tool]. Give the key; optionally a JMESPath path to a "
                "part of it (e.g. \"[].sha\" or \"items[3]\"), and offset/limit to page "
                "through a list (items) or a text (characters). The answer says where the "
                "next page starts (next_offset; null at the end).",
    parameters={"type": "object", "additionalProperties": False, "required": ["key"],
                "properties": {
                    "key": {"type": "string",
                            "pattern": "^(_tool_result_[0-9]+|te-[0-9a-f]{1,64})$",
                            "description": "The key from the preview, e.g. _tool_result_1 "
                                           "(or an injected tool event's id, te-...)"},
                    "path": {"type": "string", "minLength": 1, "maxLength": 1000,
                             "description": "A JMESPath expression selecting part of it"},
                    "offset": {"type": "integer", "minimum": 0},
                    "limit": {"type": "integer", "minimum": 1, "maximum": 1000}}})

CONTEXT_STATUS_SPEC: Final = ToolSpec(
    name=CONTEXT_STATUS, source="built-in", pools=[CONTEXT_POOL], annotations=_READ_ONLY,
    title="context status",
    description="How this turn stands: model iterations used and left, the tools used and "
                "still pending, the stored result keys (for recall), and how large the "
                "conversation you read is (characters and estimated tokens).",
    parameters={"type": "object", "additionalProperties": False, "properties": {}})


def recall_page(result: Any, *, key: str, path: str | None,
                offset: int, limit: int | None, budget: int) -> dict[str, Any]:
    try:
        page = compress.recall(result, path=path, offset=offset, limit=limit, budget=budget)
    except compress.TransformError as exc:
        raise ToolError(str(exc), error_type="invalid_path") from exc
    return {"key": key, **page}


def context_status(state: SessionState, turn_id: str, *, max_iterations: int,
                   compression: Compression | None = None) -> dict[str, Any]:
    """The turn's budget and use, from the session's state alone."""
    turn = state.turns.get(turn_id)
    if turn is None:
        raise ToolError(f"turn {turn_id} is not in session {state.session_id}",
                        error_type="unknown_turn")
    calls = [state.calls[c] for c in turn.call_ids if c in state.calls]
    used = sorted({c.tool for c in calls if c.terminal})
    pending = [{"call_id": c.call_id, "tool": c.tool, "status": c.status}
               for c in calls if not c.terminal and c.tool != CONTEXT_STATUS]
    chat = sum(1 for s in turn.steps if s.purpose == "chat")
    size = 0
    if turn.message is not None:
        size = sum(map(message_chars, transcript(state, turn, compression)))
    return {
        "iterations": {"used": chat, "limit": max_iterations,
                       "left": max(max_iterations - chat, 0)},
        "tools_used": used,
        "pending": pending,
        "stored_keys": [{"key": k, "tool": state.calls[c].tool, "call_id": c}
                        for k, c in state.result_keys.items() if c in state.calls],
        "context": {"chars": size, "estimated_tokens": -(-size // CHARS_PER_TOKEN)},
    }


@dataclass(frozen=True, slots=True, eq=False)
class ContextTool:
    spec: ToolSpec
    read: Callable[[CallDispatched, dict[str, Any]], Any]
    injected: dict[str, Resource] = field(default_factory=dict)

    def check_arguments(self, arguments: dict[str, Any]) -> None:
        """The approval actor checked them against the schema."""

    async def run(self, arguments: dict[str, Any], resources: dict[Resource, Any] | None = None,
                  *, progress: Any = None) -> Any:
        d = current_dispatch.get()
        if d is None:
            raise ToolError(f"{self.spec.name} runs only in the planner's context executor",
                            error_type="internal")
        return await self.read(d, arguments)


_UNKNOWN: Final = object()  # no result stored under the key recalled


class ContextExecutor(Executor):
    """The executor of the context tools, in the planner's process (pool `context`)."""

    def __init__(self, bus: Bus, compression: Compression | None = None, *,
                 max_iterations: int = DEFAULT_MAX_ITERATIONS,
                 instance: str = CONTEXT_EXECUTOR, ack_wait_s: float | None = None) -> None:
        self._log = EventLog(bus)
        self._states = SessionStates(bus, self._log)
        self._artifacts = ArtifactStore(bus)
        self._compression = compression or Compression()
        self._max_iterations = max_iterations
        tools: list[RunnableTool] = [ContextTool(RECALL_SPEC, self._recall),
                                     ContextTool(CONTEXT_STATUS_SPEC, self._status)]
        options: dict[str, Any] = {} if ack_wait_s is None else {"ack_wait_s": ack_wait_s}
        super().__init__(bus, tools, instance=instance, pool=CONTEXT_POOL, **options)


    async def _state(self, session_id: str) -> SessionState:
        return (await self._states.current(session_id)).state

    async def _recall(self, d: CallDispatched, arguments: dict[str, Any]) -> Any:
        state = await self._state(d.session_id)
        key = str(arguments.get("key", ""))
        call_id = state.result_keys.get(key)
        injected = next((e for e in state.tool_events if e.event_id == key), None)
        call = state.calls.get(call_id) if call_id is not None else None
        stored = injected.result_ref is not None if injected is not None else (
            call is not None and call.result_ref is not None)
        async with contextlib.AsyncExitStack() as stack:
            if stored:
                # Held until the page is cut: a stored result, decoded, is several times
                # its size, and only so many are held at once.
                await stack.enter_async_context(reading_bound())
            return await self._page(d, arguments, state, key, injected, call)

    async def _page(self, d: CallDispatched, arguments: dict[str, Any], state: SessionState,
                    key: str, injected: InjectedToolEvent | None, call: CallState | None
                    ) -> Any:
        try:
            if injected is not None:
                result = injected.result if injected.result_ref is None else \
                    await read_result(self._artifacts, injected.result_ref)
            elif call is not None:
                result = await whole_result(self._artifacts, call)
            else:
                result = _UNKNOWN
        except ResultTooLargeError as exc:
            raise ToolError(f"{key}: {exc}", error_type="too_large") from None
        if result is _UNKNOWN:
            known = ", ".join(state.result_keys) or "none yet"
            raise ToolError(f"no result is stored as {key!r} in this session; stored: {known}",
                            error_type="unknown_key")
        turn = state.turns.get(d.turn_id)
        budget = self._compression.recall_budget(turn.agent if turn else None)
        path = arguments.get("path")
        limit = arguments.get("limit")
        return recall_page(result, key=key, path=path if isinstance(path, str) else None,
                           offset=int(arguments.get("offset") or 0),
                           limit=int(limit) if isinstance(limit, int) else None, budget=budget)

    async def _status(self, d: CallDispatched, arguments: dict[str, Any]) -> Any:
        state = await self._state(d.session_id)
        return context_status(state, d.turn_id, max_iterations=self._max_iterations,
                              compression=self._compression)


__all__ = ["CONTEXT_EXECUTOR", "CONTEXT_POOL", "CONTEXT_STATUS_SPEC", "RECALL_SPEC",
           "ContextExecutor", "context_status", "recall_page"]
