"""Compressor actor: what the model reads of a large tool result (seed 003).

Consumes: `call.succeeded` (consumer `compressor`).
Emits: `result.compressed` for a call of a planner turn whose result, as text, is longer
than its budget (per agent and per tool: `agent_config.context.compression`), and for any
call made with `_transform`. Over the budget, the model reads a structured preview under a
key `_tool_result_N`, numbered per session in the order stored (so replay finds the same
keys), and `built-in:recall` (actors/context_tools.py) reads the rest; with `_transform`,
it reads the JMESPath expression's value, or, if that fails, the preview and the error.
The result itself stays where the call's end put it: the event, or the object store.
Idempotency: one `result.compressed` per call (`result_compressed_id`); the key is
decided under the session's concurrency check, so two results compressed at once get
two keys.
The planner waits for the compression of a result that needs one before it asks the model
again (`view_due`). A result the compressor cannot handle (the kernel's poison path) still
gets a `result.compressed`, a clipped excerpt, so no turn waits forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from actors import compress
from actors.kernel import Entry, Inbox, Kernel, PoisonError, SessionStates
from bus.artifacts import ArtifactStore
from bus.connection import Bus
from bus.consumer import Delivery
from bus.eventlog import Append, decode_stored
from bus.streams import ConsumerSpec
from bus.subjects import EVENTS_STREAM, session_of, type_filter
from schemas.defaults import ACK_WAIT_S, DECIDE_ATTEMPTS
from schemas.events import CallSucceeded, ResultCompressed, ResultRef
from schemas.ids import is_token, result_compressed_id
from schemas.manifest import DEFAULT_MAX_HISTORY_CHARS, AgentConfig, CompressionConfig
from schemas.requests import strip_controls
from schemas.state import CallState, SessionState

log = logging.getLogger("toolbus.compressor")

ACTOR: Final = "compressor"
RECALL: Final = "built-in:recall"
CONTEXT_STATUS: Final = "built-in:context-status"
# Their results are already cut to the budget: never compressed again.
NEVER_COMPRESSED: Final = frozenset({RECALL, CONTEXT_STATUS})
KEY_PREFIX: Final = "_tool_result_"
_ERROR_CHARS = 300
# The largest stored result read whole to preview, transform or recall (in the planner's
# process): a tool may store up to 256 MiB (MAX_RESULT_BYTES), and a JSON value decoded
# takes several times its size in memory while the decode holds the event loop. A larger
# one reaches the model as its size and first characters, and cannot be recalled.
MAX_READ_RESULT_BYTES = 16 * 1024 * 1024
# Stored results read whole at once, per process (each up to the bound above, decoded):
# by the compressor, recall and the gateway together (`reading_bound`).
READS_AT_ONCE: Final = 2
_READING: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = \
    weakref.WeakKeyDictionary()


def reading_bound() -> asyncio.Semaphore:
    """The one bound on stored results read whole at once in this process (its event
    loop's: a semaphore belongs to one loop)."""
    loop = asyncio.get_running_loop()
    bound = _READING.get(loop)
    if bound is None:
        bound = _READING[loop] = asyncio.Semaphore(READS_AT_ONCE)
    return bound


@dataclass(frozen=True)
class Compression:
    """The budgets: the agent's (`agent_config.context.compression`), or a named agent's;
    and the characters of earlier turns a model call carries at most
    (`agent_config.context.max_history_chars`, None: no limit)."""

    default: CompressionConfig = field(default_factory=CompressionConfig)
    agents: Mapping[str, CompressionConfig] = field(default_factory=dict)
    history_chars: int | None = DEFAULT_MAX_HISTORY_CHARS

    @classmethod
    def of(cls, agent: AgentConfig) -> Compression:
        """The budgets a manifest's `agent_config` sets."""
        return cls(default=agent.context.compression,
                   agents={n: a.compression for n, a in agent.agents.items() if a.compression},
                   history_chars=agent.context.max_history_chars)

    def settings(self, agent: str | None, tool: str) -> tuple[int, int]:
        """(budget in characters, preview items) for `tool`'s results in `agent`'s turns."""
        return self.agents.get(agent or "", self.default).for_tool(tool)

    def recall_budget(self, agent: str | None) -> int:
        """The characters of one page of `built-in:recall` in `agent`'s turns."""
        return self.agents.get(agent or "", self.default).recall_budget


def result_chars(call: CallState) -> int:
    """The length of the call's result as the text the model would read."""
    if call.result_ref is not None:
        return call.result_ref.size
    return len(compress.result_text(call.result))


def view_due(state: SessionState, call: CallState, compression: Compression) -> bool:
    """Whether `call` waits for a `result.compressed`: it succeeded, has none yet, and
    was made with `_transform`, or is a planner turn's call whose result is over budget."""
    if call.status != "succeeded" or call.view is not None or call.tool in NEVER_COMPRESSED:
        return False
    if call.transform is not None:
        return True
    turn = state.turns.get(call.turn_id)
    if turn is None or turn.message is None:
        return False  # a client's explicit call: the client reads the whole result
    budget, _ = compression.settings(call.agent, call.tool)
    return result_chars(call) > budget


def compress_call(state: SessionState, call: CallState, result: Any,
                  compression: Compression, *, now: float) -> Append:
    """The `result.compressed` of `call`, whose whole result is `result`."""
    budget, items = compression.settings(call.agent, call.tool)
    text = compress.result_text(result)
    key = f"{KEY_PREFIX}{len(state.result_keys) + 1}"
    over = len(text) > budget

    def stored() -> str:
        return compress.preview(result, key=key, tool=call.tool, budget=budget, items=items)

    view: str
    used_key: str | None = None
    error: str | None = None
    if call.transform is not None:
        try:
            value = compress.transform(result, call.transform)
        except compress.TransformError as exc:
            # One line of plain text (the expression is the model's or a client's).
            error = " ".join(strip_controls(str(exc)).split())[:_ERROR_CHARS]
            view, used_key = (stored(), key) if over else (text, None)
            view = f"{view}\n_transform failed: {error}"
        else:
            shown = compress.result_text(value)
            if len(shown) <= budget:
                view = shown
            else:
                view, used_key = stored(), key
                view += (f"\n_transform's value has {len(shown)} characters, over the "
                         f"budget of {budget}: select less")
    elif over:
        view, used_key = stored(), key
    else:
        view = text
    event = ResultCompressed(
        session_id=state.session_id, at=now, actor=ACTOR, call_id=call.call_id,
        turn_id=call.turn_id, tool=call.tool, chars=len(text), budget=budget, view=view,
        key=used_key, transform=call.transform, transform_error=error)
    return Append(event, result_compressed_id(state.session_id, call.call_id))


class ResultTooLargeError(Exception):
    """A stored result over `MAX_READ_RESULT_BYTES`: not read."""

    def __init__(self, ref: ResultRef, limit: int) -> None:
        bound = f"{limit // 1024 // 1024} MiB" if limit % (1024 * 1024) == 0 else \
            f"{limit:,} bytes"
        super().__init__(f"the result is {ref.size:,} bytes of JSON, over the {bound} "
                         "toolbus reads whole; ask the tool for less")
        self.ref = ref


async def read_result(artifacts: ArtifactStore, ref: ResultRef,
                      limit: int | None = None) -> Any:
    """A result from the object store, decoded (`ResultTooLargeError` over `limit`,
    default `MAX_READ_RESULT_BYTES`). Hold `reading_bound()` for as long as the value is
    kept."""
    limit = MAX_READ_RESULT_BYTES if limit is None else limit
    if ref.size > limit:
        raise ResultTooLargeError(ref, limit)
    return msgspec.json.decode(await artifacts.read(ref))


async def whole_result(artifacts: ArtifactStore, call: CallState,
                       limit: int | None = None) -> Any:
    """The call's whole result: from its event, or read from the object store."""
    if call.result_ref is None:
        return call.result
    return await read_result(artifacts, call.result_ref, limit)


def unread_call(state: SessionState, call: CallState, exc: ResultTooLargeError,
                compression: Compression, *, now: float) -> Append:
    """The `result.compressed` of `call`, whose stored result is too large to read: its
    size and first characters, with no key (nothing can recall it)."""
    budget, _ = compression.settings(call.agent, call.tool)
    head = f"[NOT READ | {call.tool}] {exc}. It begins: "
    view = head + strip_controls(exc.ref.preview)[:max(0, budget - len(head))]
    event = ResultCompressed(
        session_id=state.session_id, at=now, actor=ACTOR, call_id=call.call_id,
        turn_id=call.turn_id, tool=call.tool, chars=exc.ref.size, budget=budget,
        view=view, key=None, transform=call.transform,
        transform_error=str(exc) if call.transform is not None else None)
    return Append(event, result_compressed_id(state.session_id, call.call_id))


class Compressor:
    def __init__(self, bus: Bus, compression: Compression | None = None, *,
                 ack_wait_s: float = ACK_WAIT_S * 10,
                 known: SessionStates | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self._kernel = Kernel(bus, ACTOR, clock=clock)
        self._states = SessionStates(bus, self._kernel.log)
        # The sessions another actor of this process keeps (the planner's): a call found
        # there is judged without reading its session (see `_small`).
        self._known = known
        self._artifacts = ArtifactStore(bus)
        self._compression = compression or Compression()
        self._clock = clock
        self._kernel.add(Inbox(
            ConsumerSpec(EVENTS_STREAM, "compressor", (type_filter("call.succeeded"),),
                         ack_wait_s=ack_wait_s),
            self._on_succeeded, self._reject, max_in_flight=64, yields=True))

    @property
    def kernel(self) -> Kernel:
        return self._kernel

    def describe(self) -> str:
        c = self._compression.default
        return f"budget {c.budget} characters, {c.preview_items} preview items"

    async def start(self) -> None:
        await self._kernel.start()

    async def stop(self, grace: float = 5.0) -> None:
        await self._kernel.stop(grace)

    async def _on_succeeded(self, delivery: Delivery) -> None:
        sid = session_of(delivery.subject)
        if not is_token(sid):
            await delivery.ack()
            return
        stored = decode_stored(delivery.stream_seq, delivery.subject, delivery.data)
        if not isinstance(stored.event, CallSucceeded):
            raise PoisonError("unreadable_event",
                              f"not a call.succeeded: {stored.error or type(stored.event)}")
        call_id = stored.event.call_id
        if self._small(stored.event):
            await delivery.ack()
            return
        entry = await self._states.current(sid)
        call = entry.state.calls.get(call_id)
        if call is None or not view_due(entry.state, call, self._compression):
            await delivery.ack()
            return
        async with contextlib.AsyncExitStack() as stack:
            if call.result_ref is not None:
                # Held until its view is stored: a stored result, decoded, is several
                # times its size, and only so many are held at once.
                await stack.enter_async_context(reading_bound())
            await self._compress(entry, call)
        await delivery.ack()

    async def _compress(self, entry: Entry, call: CallState) -> None:
        call_id = call.call_id
        unread: ResultTooLargeError | None = None
        try:
            result = await whole_result(self._artifacts, call)
        except ResultTooLargeError as exc:
            result, unread = None, exc

        def due(state: SessionState) -> list[Append]:
            now_call = state.calls.get(call_id)
            if now_call is None or not view_due(state, now_call, self._compression):
                return []
            if unread is not None:
                return [unread_call(state, now_call, unread, self._compression,
                                    now=self._clock())]
            return [compress_call(state, now_call, result, self._compression,
                                  now=self._clock())]

        async with entry.lock:
            if not await self._states.decide_and_write(entry, due, attempts=DECIDE_ATTEMPTS):
                raise PoisonError("conflicts", f"gave up compressing {call_id} after "
                                  f"{DECIDE_ATTEMPTS} conflicting writes")

    def _small(self, event: CallSucceeded) -> bool:
        """Whether the call surely needs no preview: its request (tool, agent, no
        `_transform`) is known in this process, and its result, held in the event, is
        within the budget. Most results are; they then cost no read of the session."""
        if self._known is None or event.result_ref is not None:
            return False
        entry = self._known.peek(event.session_id)
        call = entry.state.calls.get(event.call_id) if entry is not None else None
        if call is None or call.transform is not None:
            return False
        if call.tool in NEVER_COMPRESSED:
            return True
        budget, _ = self._compression.settings(call.agent, call.tool)
        return len(compress.result_text(event.result)) <= budget

    def _reject(self, delivery: Delivery, reason: str, message: str) -> list[Append]:
        """What the model reads when the compressor failed on a result: an excerpt, and
        why (so its turn goes on)."""
        event = decode_stored(delivery.stream_seq, delivery.subject, delivery.data).event
        if not isinstance(event, CallSucceeded):
            return [self._kernel.generic_rejection(delivery, reason, message)]
        entry = self._states.peek(event.session_id)
        call = entry.state.calls.get(event.call_id) if entry is not None else None
        tool = call.tool if call is not None else "?"
        budget, _ = self._compression.settings(call.agent if call else None, tool)
        text = compress.result_text(event.result) if event.result_ref is None else (
            event.result_ref.preview)
        view = (f"{text[:max(budget - 200, 100)]}… (the whole result could not be "
                f"previewed: {message[:150]})")
        return [Append(ResultCompressed(
            session_id=event.session_id, at=self._clock(), actor=ACTOR,
            call_id=event.call_id, turn_id=event.turn_id, tool=tool, chars=len(text),
            budget=budget, view=view, transform_error=message[:_ERROR_CHARS]),
            result_compressed_id(event.session_id, event.call_id))]


__all__ = [
    "ACTOR",
    "CONTEXT_STATUS",
    "MAX_READ_RESULT_BYTES",
    "RECALL",
    "Compression",
    "Compressor",
    "ResultTooLargeError",
    "compress_call",
    "read_result",
    "reading_bound",
    "result_chars",
    "view_due",
    "whole_result",
]
