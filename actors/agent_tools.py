"""Agents as tools: each named agent of `agent_config.agents` is the tool `agent:<name>`.

Consumes: `call.dispatched` for `agent:*` (route `agents.agent`), through an executor
(actors/executor.py) running in the planner's process, so the executor's rules hold:
`call.started`, exactly one terminal event, in-progress acks while the child runs.
Emits: through the executor, `call.succeeded` with `{"agent", "session", "answer"}` (the
child's `text`, or its `output` when the agent has an output schema) or `call.failed`
(`agent_failed`, `agent_rejected`, `agent_depth`), naming the child session.
Effect: a request `{"message", "agent": <name>, "request_id": "<parent sid>:<call id>"}`
on `toolbus.req.<child>`, then a wait for that turn's end. The child is a session of its
own, `<name>--<depth>-<digest>`, derived from the parent session and the call id; the
child's turn runs as the agent `<name>`, so the policy's grants and approvals for that
agent apply to every call it makes, and the planner plans it with the agent's
instructions, model and tool patterns (`AgentProfile`).
Idempotency: the child session and request id are deterministic, so a redelivered
dispatch (an executor that died mid-call) re-attaches to the same child turn: the
session actor stores the request once and the client finds the turn's end. That is why
the tool is marked idempotent: running it again never starts a second child turn.
Replay: the parent's `call.succeeded` names the child session; `toolbus replay <child>`
replays the child. Nesting is bounded (`MAX_AGENT_DEPTH`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from actors.executor import Executor, current_delivery, current_dispatch
from actors.llm.types import ModelSettings
from actors.planner import AgentProfile, Rules
from actors.tools import Resource, RunnableTool, ToolError
from bus.client import ToolbusClient
from bus.connection import Bus
from bus.tasks import retrieve
from schemas.errors import BusTimeoutError, ToolbusError
from schemas.events import (
    CallDispatched,
    Event,
    RequestRejected,
    TurnCancelled,
    TurnCompleted,
    TurnFailed,
)
from schemas.ids import child_session_id, depth_of, turn_id_for
from schemas.manifest import AGENT_TOOL_NAMESPACE, AgentConfig, AgentDef, ModelConfig
from schemas.tools import Annotations, ToolSpec

AGENT_POOL: Final = "agents"
AGENT_SOURCE: Final = "agent"
# A child turn may wait for humans (approvals) inside it: the call waits that long too.
AGENT_TIMEOUT_MS: Final = 1_800_000
# An agent call stops waiting this long before its timeout, to cancel the child turn.
_STOP_MARGIN_S: Final = 3.0
# Agents calling agents: the depth of nesting at which a call is refused.
MAX_AGENT_DEPTH: Final = 4

# The dispatch being run, for the tool (a tool sees only its arguments otherwise).


def model_settings(m: ModelConfig) -> ModelSettings:
    return ModelSettings(provider=m.provider, model=m.model, base_url=m.base_url,
                         api_key=m.api_key, temperature=m.temperature,
                         max_tokens=m.max_tokens, timeout_s=m.timeout_s,
                         max_retries=m.max_retries)


def offered_by(patterns: Iterable[str]) -> Callable[[ToolSpec], bool]:
    """The catalog tools an agent's `tools` patterns name (none when it names none)."""
    globs = tuple(patterns)
    return lambda spec: any(fnmatch.fnmatchcase(spec.name, g) for g in globs)


def agent_profiles(config: AgentConfig, *, default: ModelSettings | None = None
                   ) -> dict[str, AgentProfile]:
    """A profile per named agent; `model` defaults to `agent_config.model`."""
    out: dict[str, AgentProfile] = {}
    for name, agent in config.agents.items():
        if agent.model is not None:
            settings = model_settings(agent.model)
        elif default is not None:
            settings = default
        else:
            assert config.model is not None  # the manifest checks it
            settings = model_settings(config.model)
        rules = Rules(instructions=agent.instructions, output_schema=agent.output_schema,
                      max_output_retries=config.limits.max_argument_retries,
                      max_agent_calls=config.limits.max_agent_calls,
                      mode=agent.mode or config.mode)
        out[name] = AgentProfile(rules=rules, settings=settings,
                                 tools=offered_by(agent.tools))
    return out


def agent_tool_spec(name: str, agent: AgentDef) -> ToolSpec:
    """`agent:<name>` as the catalog holds it. Not read-only (the child's calls may
    write), but with no effect of its own: each call the child makes is judged by the
    policy on its own, so the agent call itself runs without a human (`auto_approve`);
    a policy's deny, allowlist and grants still apply to it."""
    return ToolSpec(
        name=f"{AGENT_TOOL_NAMESPACE}:{name}",
        description=f"Ask the agent {name} to do something; it answers with its result. "
                    f"The agent: {agent.instructions}",
        parameters={"type": "object", "additionalProperties": False, "required": ["message"],
                    "properties": {"message": {
                        "type": "string", "minLength": 1,
                        "description": "What to ask the agent, with everything it needs to "
                                       "know: it does not see this conversation."}}},
        annotations=Annotations(readOnlyHint=False, destructiveHint=False,
                                idempotentHint=True, openWorldHint=False),
        timeout_ms=AGENT_TIMEOUT_MS, source=AGENT_SOURCE, pools=[AGENT_POOL],
        auto_approve=True, title=f"agent {name}")


def child_request_id(parent: str, call_id: str) -> str:
    """The child turn's request id: names the parent call it runs for."""
    return f"{parent}:{call_id}"


@dataclass(frozen=True, slots=True, eq=False)
class AgentTool:
    """`agent:<name>`: one turn of the agent in its child session."""

    spec: ToolSpec
    agent: str
    bus: Bus

    @property
    def injected(self) -> dict[str, Resource]:
        return {}

    def check_arguments(self, arguments: dict[str, Any]) -> None:
        message = arguments.get("message")
        if not isinstance(message, str) or not message.strip() or set(arguments) != {"message"}:
            raise TypeError("takes one argument, message, a non-empty string")

    async def run(self, arguments: dict[str, Any], resources: dict[Resource, Any] | None = None,
                  *, progress: Callable[[], None] | None = None) -> Any:
        d = current_dispatch.get()
        if d is None:
            raise ToolError(f"{self.spec.name} runs only in the planner's agent executor",
                            error_type="internal")
        child = child_session_id(d.session_id, d.call_id, self.agent)
        if depth_of(child) > MAX_AGENT_DEPTH:
            raise ToolError(f"{self.spec.name}: agents already call agents {MAX_AGENT_DEPTH} "
                            f"deep in session {d.session_id}; answer without it",
                            error_type="agent_depth")
        client = ToolbusClient(self.bus, max_watched_sessions=2)  # the child's, the parent's
        timeout_s = (d.timeout_ms or self.spec.timeout_ms) / 1000
        delivery = current_delivery.get()
        try:
            # Waiting, it holds none of the executor's slots: the child's own agent calls
            # need them (with every slot held by a waiting parent, none could start).
            request_id = child_request_id(d.session_id, d.call_id)
            with delivery.waiting() if delivery is not None else contextlib.nullcontext():
                async with client.turn_end(d.session_id, d.turn_id) as parent_ended:
                    # Ended a little before the executor's own timeout, to stop the child
                    # turn: left running, it would go on (a call of it approved an hour
                    # later would run) for a parent that gave up on it.
                    asking = asyncio.ensure_future(client.ask(
                        child, arguments["message"], agent=self.agent,
                        request_id=request_id, timeout=timeout_s - _stop_margin(timeout_s)))
                    asking.add_done_callback(retrieve)  # if left behind by a stop
                    try:
                        await asyncio.wait({asking, parent_ended},
                                           return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        while not asking.done():
                            # Again after a second if the cancel was lost inside nats-py
                            # (landing as the child request's ack came: bus/tasks.py).
                            asking.cancel()
                            await asyncio.wait({asking}, timeout=1.0)  # raises nothing
                    if asking.cancelled():
                        # The turn that asked for it ended (cancelled): so does the child's
                        # (and its own agents' after it), not left calling tools for
                        # nobody.
                        return await self._stop_child(client, child, request_id, d)
                    end: Event = asking.result()
        except BusTimeoutError as exc:
            stopped: Event | None = None
            with contextlib.suppress(ToolbusError):
                stopped = await client.cancel(
                    child, turn_id_for(request_id), timeout=_stop_margin(timeout_s) * 0.8,
                    reason=f"call {d.call_id} of session {d.session_id}, which asked for "
                           "this turn, timed out")
            if isinstance(stopped, TurnCompleted):  # it answered just in time
                return answer_of(self.agent, child, stopped)
            what = ("its turn was stopped" if isinstance(stopped, TurnCancelled) else
                    "and its turn could not be stopped: it may go on")
            raise ToolError(f"agent {self.agent} (session {child}) did not answer in time; "
                            f"{what}: {exc}", error_type="timeout", retryable=True) from exc
        finally:
            await client.close()
        return answer_of(self.agent, child, end)

    async def _stop_child(self, client: ToolbusClient, child: str, request_id: str,
                          d: CallDispatched) -> dict[str, Any]:
        stopped: Event | None = None
        with contextlib.suppress(ToolbusError):
            # Ended already (a redelivered call finds its child's turn over): its end.
            stopped = await client.find_end(child, turn_id_for(request_id))
        if stopped is not None:
            return answer_of(self.agent, child, stopped)
        with contextlib.suppress(ToolbusError):
            stopped = await client.cancel(
                child, turn_id_for(request_id), timeout=_STOP_MARGIN_S * 2,
                reason=f"turn {d.turn_id} of session {d.session_id}, which asked for this "
                       "turn, was cancelled")
        if isinstance(stopped, TurnCompleted):  # it answered just before
            return answer_of(self.agent, child, stopped)
        what = ("its turn was stopped" if isinstance(stopped, TurnCancelled) else
                "and its turn could not be stopped: it may go on")
        raise ToolError(f"agent {self.agent} (session {child}): the turn that asked for it "
                        f"was cancelled, {what}", error_type="agent_cancelled")


def _stop_margin(timeout_s: float) -> float:
    return min(_STOP_MARGIN_S, timeout_s / 4)


def answer_of(agent: str, child: str, end: Event) -> dict[str, Any]:
    """The call's result from the child turn's end, or the `ToolError` it failed with."""
    if isinstance(end, TurnCompleted):
        return {"agent": agent, "session": child,
                "answer": end.output if end.output is not None else end.text}
    if isinstance(end, TurnFailed):
        raise ToolError(f"agent {agent} failed ({end.reason}): {end.message} "
                        f"[session {child}; `toolbus replay {child}`]",
                        error_type="agent_failed")
    if isinstance(end, TurnCancelled):
        raise ToolError(f"agent {agent}'s turn was cancelled ({end.reason}): {end.message} "
                        f"[session {child}]", error_type="agent_cancelled")
    if isinstance(end, RequestRejected):
        raise ToolError(f"agent {agent} refused the request ({end.reason}): {end.message} "
                        f"[session {child}]", error_type="agent_rejected")
    raise ToolError(f"agent {agent}: unexpected end {type(end).__name__} [session {child}]",
                    error_type="internal")


class AgentExecutor(Executor):
    """The executor of the `agent:*` tools, in the planner's process (pool `agents`)."""

    def __init__(self, bus: Bus, agents: Mapping[str, AgentDef], *,
                 instance: str | None = None, ack_wait_s: float | None = None) -> None:
        tools: list[RunnableTool] = [AgentTool(agent_tool_spec(n, a), n, bus)
                                     for n, a in agents.items()]
        options: dict[str, Any] = {} if ack_wait_s is None else {"ack_wait_s": ack_wait_s}
        # No bound on calls waiting for their child turns: each is a coroutine and a
        # subscription, and a bound could be filled by waiting parents (see `run`).
        super().__init__(bus, tools, instance=instance, pool=AGENT_POOL, max_ack_pending=-1,
                         **options)



__all__ = ["AGENT_POOL", "AgentExecutor", "AgentProfile", "AgentTool", "agent_profiles",
           "agent_tool_spec", "child_session_id", "depth_of"]
