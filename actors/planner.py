"""Planner actor: the agent loop, event-sourced.

Consumes: `turn.requested`, the calls' terminal events (`call.succeeded`, `call.failed`,
`call.rejected`), `result.compressed` (what the model reads of a large result: it waits
for those due), `tool_event.injected` (seen from the next turn on: a turn reads the
history as of its `turn.requested`) and `turn.cancelled`, one session at a time: what
others write. Its own events (`model.*`, `policies.matched`, `turn.reevaluated`,
`output.*`) are folded as it writes them (or read back at once when something came
between), never delivered back to it: four deliveries less per one-tool turn, in this
process and in nats-server.
Emits: `model.requested` (concurrency-checked, like every decision), `model.responded`
(a fact: the model's answer), `call.requested` for the calls the model asked for (the
approval and session actors take them from there, as for explicit calls), the agent
section's decisions (`policies.matched`, `turn.reevaluated`, `output.emitted` /
`output.rejected`), and the end of the turn: `turn.completed` with the answer, or
`turn.failed` (a model error, the iteration limit, a think step that never fit its
schema).

Level-triggered, as the session actor: after each event, `decide` answers "what is due?"
from the state alone. The handler that stores a `model.requested` calls the model, holding
the message it is handling (in-progress acks) until the answer is stored: a planner
killed before `model.responded` leaves that message to be redelivered, and whoever
handles the session next finds the question unanswered and asks again (a model call has
no side effects; `_recover`); killed after it, the answer is in the log and nothing asks
again. Replay reads the answers from the log and never calls a
model. Idempotency: every event has a deterministic id (schemas/ids.py), per turn and
model iteration, reevaluation round or call.

A turn of an agent with behaviour policies (seed 000), in order:
1. `policies.matched` (round 0): `when_state:` policies are judged here, over the
   session's state object; `when:` policies by the model, in one structured round trip
   (`model.requested`/`model.responded` with `purpose: match`) stored before the match.
2. Think steps (`built-in:reason`): the agent's `think:` list, then each matched policy's
   `think:`, one structured round trip each (`purpose: think`); an output that breaks its
   schema is asked for again with the violations, at most `max_output_retries` times.
3. The agent loop (`purpose: chat`): the system prompt is the instructions plus the
   matched policies' actions and the think outputs; the tools offered are the union of
   the matched policies' `tools` (and the reevaluation tools) when any names tools, else
   every tool the planner may offer; plus `built-in:emit_output` with an output schema.
   With `mode: composed` the step asks for one JSON object valid against seed 001's
   composed schema instead of native tool calls, and reads it back into the same
   `model.responded` (actors/composed.py); an answer that breaks it is asked for again.
4. When every call of a model iteration has ended and one of them, a success, is a global
   reevaluation tool or in an active policy's `reevaluate_after`: `turn.reevaluated`,
   then 1 and 2 again for the new round, and the loop goes on in the same turn. After
   `max_reevaluations` a trigger is stored as `turn.reevaluated` with `capped` and nothing
   is decided again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import re
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import jmespath
import msgspec

from actors import compress
from actors.composed import composed_prompt, composed_schema, flatten, read_composed
from actors.compressor import CONTEXT_STATUS, RECALL, Compression, view_due
from actors.kernel import Entry, Inbox, Kernel, SessionStates
from actors.llm import ModelClient, WireMemo, complete
from actors.llm.convert import TOO_DEEP, model_json, stable_id
from actors.llm.types import Message, ModelResponse, ModelSettings, ToolCall
from actors.session import InlineApproval, InlineApprover, due_in_turn
from bus.catalog import Catalog
from bus.connection import Bus
from bus.consumer import Delivery, PullLoop
from bus.eventlog import Append, decode_stored
from bus.partitions import PartitionOwner, member_name
from bus.streams import ConsumerSpec, consumer_state, delete_consumers, ensure_consumer
from bus.subjects import (
    EVENTS_STREAM,
    LIVE_PREFIX,
    event_filter,
    partition,
    session_of,
    type_filter,
)
from bus.tasks import stop_task
from schemas.defaults import (
    DECIDE_ATTEMPTS,
    MAX_EVENT_BYTES,
    MAX_JSON_DEPTH,
    PARTITION_ACK_WAIT_S,
    SESSION_CACHE_SIZE,
)
from schemas.errors import (
    BusError,
    ConcurrencyError,
    ConfigError,
    EventTooLargeError,
    ModelError,
)
from schemas.events import (
    CallApproved,
    CallFailed,
    CallRejected,
    CallRequested,
    CallSucceeded,
    Event,
    ModelPurpose,
    ModelRequested,
    ModelResponded,
    ModelToolCall,
    OutputEmitted,
    OutputRejected,
    PoliciesMatched,
    Refusal,
    ResultCompressed,
    ThinkRequest,
    TurnCancelled,
    TurnCompleted,
    TurnFailed,
    TurnReevaluated,
    TurnRequested,
    clip,
    encode_event,
)
from schemas.ids import (
    call_id_for,
    call_requested_id,
    depth_of,
    is_token,
    model_requested_id,
    model_responded_id,
    output_verdict_id,
    policies_matched_id,
    policy_decision_id,
    turn_ended_id,
    turn_reevaluated_id,
)
from schemas.manifest import AGENT_TOOL_NAMESPACE, AgentConfig, AgentPolicy, ThinkStep
from schemas.policy import DEFAULT_AGENT, Policy, evaluate
from schemas.requests import DEFAULT_MAX_CALLS, MAX_TRANSFORM_CHARS
from schemas.state import (
    CallState,
    InjectedToolEvent,
    ModelStep,
    SessionState,
    TurnState,
    evolve,
    turn_outcomes,
)
from schemas.tools import ToolSpec
from schemas.validation import Validator, validator_for

log = logging.getLogger("toolbus.planner")

ACTOR = "planner"
DEFAULT_MAX_ITERATIONS = 25
DEFAULT_MAX_REEVALUATIONS = 3
DEFAULT_MAX_OUTPUT_RETRIES = 2
DEFAULT_MAX_AGENT_CALLS = 8
EMIT_OUTPUT = "built-in:emit_output"
REASON = "built-in:reason"
# Decisions and model calls one delivery makes at most (a guard against a runaway turn,
# far above what a turn's limits allow); past them it is handed back, and its next
# delivery goes on (`_recover` asks what was left unanswered).
_STEPS_PER_DELIVERY = 4096
_PERMITS_KEPT = 4096  # (tool, agent, session) policy verdicts remembered at most
# The events the planner decides on (each partition's consumer filters these).
_CONSUMED = ("turn.requested", "call.succeeded", "call.failed", "call.rejected",
             "result.compressed", "turn.cancelled",
             "tool_event.injected.*")  # one subject per injected event's id
# A consumer an earlier planner made also delivers the planner's own events, some of which
# that version left its turns waiting for: it keeps its filter until nothing stored is
# left undelivered, at least this long after the partition is taken (longer than a
# planner giving the partition up takes to finish what it holds).
_NARROW_AFTER_S = 10.0
_NO_COMPRESSION = Compression()  # the defaults, when no compressor runs
_WHOLE_CALL_ATTEMPTS = 2  # a stream that broke after some text is asked again once
# The largest structured output (`built-in:emit_output`) taken, as JSON: the turn's end
# holds it with the outcomes of the turn's calls, in one event.
MAX_OUTPUT_BYTES = 128 * 1024
# The most text one live delta message carries (at most 4 bytes a character in UTF-8).
_DELTA_CHARS = 64 * 1024
# How long a turn planned as it is stored (`early_turn`) waits for the store's outcome.
_EARLY_WAIT_S = 60.0


class _Deltas(Protocol):
    async def __call__(self, text: str, *, reset: bool = False) -> None: ...


@dataclass(frozen=True, slots=True)
class Offer:
    """What the model may be offered: the provider and model named in `model.requested`,
    the tools the planner may offer (`tools`, the catalog filtered), and the whole
    catalog by name (`catalog`: a policy's `tools` are looked up there)."""

    provider: str
    model: str
    tools: tuple[ToolSpec, ...] = ()
    catalog: Mapping[str, ToolSpec] = field(default_factory=dict)
    # Whether the policy lets `agent` call the tool `name` at all (in this session): one it
    # would refuse is not offered.
    permits: Callable[[str, str | None], bool] = lambda name, agent: True


@dataclass(frozen=True, eq=False)
class Rules:
    """What the agent section asks of the planner besides the loop (seed 000): the
    instructions, the behaviour policies, the reevaluation tools, the think steps and the
    output schema, with their schemas and JMESPath expressions compiled once."""

    instructions: str | None = None
    policies: tuple[AgentPolicy, ...] = ()
    reevaluation_tools: frozenset[str] = frozenset()
    think: tuple[ThinkStep, ...] = ()
    output_schema: dict[str, Any] | None = None
    max_reevaluations: int = DEFAULT_MAX_REEVALUATIONS
    # A think step's output that breaks its schema is asked for again this many times.
    max_output_retries: int = DEFAULT_MAX_OUTPUT_RETRIES
    # Agent calls a turn may make at depth 0; halved at each level of nesting (`agent_calls`).
    max_agent_calls: int = DEFAULT_MAX_AGENT_CALLS
    # native: the provider's function calling; composed: one JSON answer (actors/composed.py)
    mode: str = "native"
    _conditions: dict[str, Any] = field(init=False, repr=False)
    _steps: dict[str, tuple[ThinkStep, Validator]] = field(init=False, repr=False)
    _emit: tuple[ToolSpec, Validator] | None = field(init=False, repr=False)
    _writes: frozenset[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        conditions = {p.id: jmespath.compile(p.when_state) for p in self.policies
                      if p.when_state is not None}
        steps = [*self.think, *(p.think for p in self.policies if p.think is not None)]
        emit = None
        if self.output_schema is not None:
            spec = emit_output_spec(self.output_schema)
            emit = (spec, Validator(spec.parameters))
        object.__setattr__(self, "_conditions", conditions)
        object.__setattr__(self, "_steps", {t.id: (t, Validator(t.output_schema))
                                            for t in steps})
        object.__setattr__(self, "_emit", emit)
        object.__setattr__(self, "_writes", self.reevaluation_tools | {
            t for p in self.policies for t in (*p.tools, *p.reevaluate_after)})

    @classmethod
    def of(cls, agent: AgentConfig, *, instructions: str | None = None) -> Rules:
        return cls(instructions=instructions or agent.instructions or None,
                   policies=tuple(agent.policies),
                   reevaluation_tools=frozenset(r.id for r in agent.context.reevaluation_tools),
                   think=tuple(agent.think), output_schema=agent.output_schema,
                   max_reevaluations=agent.limits.max_reevaluations,
                   max_output_retries=agent.limits.max_argument_retries,
                   max_agent_calls=agent.limits.max_agent_calls, mode=agent.mode)

    def agent_calls(self, session_id: str) -> int:
        """The agent calls a turn of `session_id` may make: `max_agent_calls` in a session
        a client started, half as many (at least one, if any) at each level of nesting."""
        if self.max_agent_calls == 0:
            return 0
        return max(1, self.max_agent_calls >> depth_of(session_id))

    @property
    def emit(self) -> ToolSpec | None:
        """`built-in:emit_output`, when the agent has an output schema."""
        return None if self._emit is None else self._emit[0]

    def step(self, step_id: str) -> tuple[ThinkStep, Validator] | None:
        return self._steps.get(step_id)

    def output_tools(self) -> frozenset[str]:
        """The tools the agent section names (reevaluation tools, policies' `tools` and
        `reevaluate_after`): what they return is what policies are about, so their results
        land in the state object `when_state` reads (see `output_path_for`)."""
        return self._writes

    def holds(self, policy: AgentPolicy, document: Any) -> tuple[bool, str | None]:
        """Whether `policy.when_state` holds over `document` (JMESPath truthiness), and
        why not when it could not be evaluated. Evaluated as `_transform` is, within a
        bound of steps and size: an expression can build a value exponentially larger
        than the state (`[@,@]|[]`, again and again), in the planner's event loop."""
        assert policy.when_state is not None  # compiled in `_conditions` at boot
        try:
            value = compress.transform(document, policy.when_state)
        except compress.TransformError as exc:
            # Not only JMESPath's own errors: its comparisons and functions raise
            # TypeError / ValueError on values of an unexpected type (`"150" > 100`), and
            # the state holds whatever the tools returned.
            why = exc.reason.removeprefix("failed: ").removesuffix("; select less")
            return False, (f"{policy.id}: when_state failed ({clip(why, 300)}); taken as "
                           "not applying")
        return _truthy(value), None

    def judge_output(self, call: ModelToolCall) -> tuple[Any, list[str]]:
        """An emit_output call's output, and every way it breaks the output schema."""
        assert self._emit is not None
        _, validator = self._emit
        invalid = call.extra.get("invalid_arguments")
        if invalid is not None or not isinstance(call.arguments, dict):
            return None, [f"$: the arguments are not a JSON object: {clip(str(invalid), 200)}"]
        arguments, violations = validator.check(call.arguments)
        if violations:
            return None, [str(v) for v in violations]
        output = arguments["output"] if _wrapped(self.output_schema) else arguments
        size = len(_encode(output))
        if size > MAX_OUTPUT_BYTES:  # told, so that it can give a shorter one
            return None, [f"$: the output is {size:,} bytes as JSON; at most "
                          f"{MAX_OUTPUT_BYTES:,} (it is stored with the turn's end)"]
        return output, []


DEFAULT_RULES = Rules()


@dataclass(frozen=True, slots=True)
class AgentProfile:
    """How a turn of a named agent (`agent_config.agents`, the turn's `agent`) is
    planned: its rules, its model, and which catalog tools it is offered
    (actors/agent_tools.py builds them)."""

    rules: Rules
    settings: ModelSettings
    tools: Callable[[ToolSpec], bool]


def _truthy(value: Any) -> bool:
    """JMESPath's truth: false, null, and an empty string, list or object are false; 0
    is true."""
    if value is None or value is False:
        return False
    return not (isinstance(value, str | list | dict) and not value)


def _wrapped(schema: dict[str, Any] | None) -> bool:
    """Whether an output schema describes something other than an object."""
    if schema is None:
        return False
    kind = schema.get("type")
    return kind != "object" and not (kind is None and "properties" in schema)


def emit_output_spec(schema: dict[str, Any]) -> ToolSpec:
    """`built-in:emit_output` as the model sees it: the output schema as its parameters,
    or, when the output is not an object (tool arguments must be), under `output`."""
    params = {"type": "object", "properties": {"output": schema}, "required": ["output"],
              "additionalProperties": False} if _wrapped(schema) else schema
    return ToolSpec(name=EMIT_OUTPUT, source="planner", parameters=params,
                    description="Give the result of this turn. Its arguments must match "
                                "this schema; once accepted, the turn is over.")


def output_path_for(tool: str) -> str:
    """Where a successful result of a tool the agent section names lands in the state
    object, for `when_state` to read: under its namespace, then its name
    (`crm:authenticate_customer` -> `crm.authenticate_customer`); the latest result
    wins."""
    return tool.replace(":", ".", 1)


def state_document(state: SessionState) -> dict[str, Any]:
    """What `when_state` is evaluated over: the session's state object (`state.data`,
    where results with an output path land), with the think outputs under
    `step_outputs`."""
    return {**state.data, "step_outputs": state.step_outputs}


# --- pure decisions -------------------------------------------------------------------


def decide(state: SessionState, offer: Offer, *, now: float,
           max_iterations: int = DEFAULT_MAX_ITERATIONS,
           max_tokens: int | None = None, rules: Rules = DEFAULT_RULES,
           agents: Mapping[str, tuple[Offer, Rules]] | None = None,
           compression: Compression | None = None,
           unknown_agent: Callable[[str | None], str | None] = lambda agent: None,
           max_calls: int = DEFAULT_MAX_CALLS) -> list[Append]:
    """What is due in the session's planner turns: match the policies, run a think step,
    ask the model, request the calls it asked for, judge its output, reevaluate, or end
    the turn. A turn of a named agent (`agents`, by the turn's `agent`) is planned with
    that agent's offer and rules (actors/agent_tools.py). With `compression` (a compressor
    runs), the model is asked again only once each result over its budget, or made with
    `_transform`, has its `result.compressed`. A turn whose agent `unknown_agent` says
    (why) is unknown ends at once, before any model call. A reply whose calls would take
    the turn past `max_calls` (the policy's `max_calls_per_turn`) ends it.

    One planner turn of a session runs at a time, in the order they were requested: a
    message sent while the model is still answering the one before waits for that turn's
    end (its model then reads the earlier answer, as in any conversation), instead of
    being answered beside it by a model that never sees the other's answer."""
    out: list[Append] = []
    planning = False
    for turn_id in state.open_turns:
        turn = state.turns[turn_id]
        if turn.message is not None and not turn.steps and turn.model_requested == 0:
            why = unknown_agent(turn.agent)
            if why is not None:
                out.append(_fail(state, turn, "unknown_agent", why, now))
                continue
        if turn.message is not None and not planning:
            planning = True  # the later ones wait for it
            o, r = (agents or {}).get(turn.agent or "", (offer, rules))
            out += _due(state, turn, o, r, now=now, max_iterations=max_iterations,
                        max_tokens=max_tokens, compression=compression, max_calls=max_calls)
    return out


def _due(state: SessionState, turn: TurnState, offer: Offer, rules: Rules, *, now: float,
         max_iterations: int, max_tokens: int | None,
         compression: Compression | None = None,
         max_calls: int = DEFAULT_MAX_CALLS) -> list[Append]:
    sid = state.session_id
    if turn.model_requested > len(turn.steps):
        return []  # the model is being asked
    used = sum(s.input_tokens + s.output_tokens for s in turn.steps)
    if max_tokens is not None and used > max_tokens:
        return [_fail(state, turn, "max_tokens", f"the turn used {used} tokens over "
                      f"{len(turn.steps)} model calls; the limit is {max_tokens} per turn",
                      now)]
    chat = [s for s in turn.steps if s.purpose == "chat"]
    if chat:
        last = chat[-1]
        if last.violations:  # a composed answer that broke its schema
            return _answer_again(state, turn, offer, rules, chat, now)
        if not last.tool_calls:
            return [_complete(state, turn, last.text, None, now)]
        offered = {t.name for t in offered_tools(rules, offer, turn)}
        waiting = _calls_due(state, turn, last, rules, now, offered, compression,
                             max_calls)
        if waiting is not None:
            return waiting
        if turn.output_call_id is not None:
            output = turn.output
            return [_complete(state, turn, _encode(output).decode(), output, now)]
        again = _reevaluation_due(state, turn, last, rules, now)
        if again:
            return again
    # Before the next chat step: what applies in this round, then the think steps due.
    if rules.policies and turn.matched_round < turn.round:
        return _match(state, turn, offer, rules, now)
    think = _think_due(state, turn, offer, rules, now)
    if think is not None:
        return think
    refused = _argument_refusals(state, turn)
    if refused is not None and refused[1] > rules.max_output_retries:
        tool, times = refused
        return [_fail(state, turn, "invalid_arguments",
                      f"the model sent {tool} invalid arguments {times} times in this turn; "
                      f"each time every violation went back to it (the limit is "
                      f"{rules.max_output_retries} retries: agent_config.limits."
                      "max_argument_retries)", now)]
    if len(chat) >= max_iterations:
        return [_fail(state, turn, "max_iterations",
                      f"the model asked for tools {len(chat)} times without answering; the "
                      f"limit is {max_iterations} iterations per turn", now)]
    tools = offered_tools(rules, offer, turn)
    return [_ask(sid, turn, offer, now, tools=tools)]


def _argument_refusals(state: SessionState, turn: TurnState) -> tuple[str, int] | None:
    """The tool whose calls this turn were refused most often for their arguments, and
    how often (None if none was)."""
    counts: dict[str, int] = {}
    for call_id in turn.call_ids:
        call = state.calls.get(call_id)
        if call is not None and call.status == "rejected" and call.error is not None and \
                call.error.error_type == "invalid_arguments":
            counts[call.tool] = counts.get(call.tool, 0) + 1
    if not counts:
        return None
    tool = max(counts, key=lambda t: counts[t])
    return tool, counts[tool]


def _calls_due(state: SessionState, turn: TurnState, last: ModelStep, rules: Rules,
               now: float, offered: set[str] | None = None,
               compression: Compression | None = None,
               max_calls: int = DEFAULT_MAX_CALLS) -> list[Append] | None:
    """The model's calls of `last`: those not requested yet, the emit_output verdicts
    not stored yet, or [] to wait for calls still running. None: all have ended.

    A call of a tool the model was not offered (outside the policies that apply, or the
    agent's tools: a model can be talked into naming any tool) is stored refused by the
    planner itself, under the id the approval actor's decision would take, so it never
    runs; the model reads why.

    Calls that would take the turn past `max_calls` end it (`too_many_calls`) with none
    of them requested, as a request with too many is refused whole: a model asking for a
    hundred writes would ask a human a hundred times, and the turn's end, which lists
    every call, must fit in one event."""
    sid = state.session_id
    out: list[Append] = []
    emits = [c for c in last.tool_calls if rules.emit is not None and c.name == EMIT_OUTPUT]
    real = [c for c in last.tool_calls if c not in emits]
    writes = rules.output_tools()
    new = sum(1 for c in real if c.call_id not in state.calls)
    if new and len(turn.call_ids) + new > max_calls:
        return [_fail(state, turn, "too_many_calls",
                      f"the model asked for {new} calls in its last reply, "
                      f"{len(turn.call_ids) + new} in this turn; the limit is {max_calls} "
                      "calls per turn (policy.max_calls_per_turn), so none of them ran",
                      now)]
    agents_left = rules.agent_calls(sid) - _agent_calls(state, turn)
    for c in real:
        if c.call_id not in state.calls:
            arguments, transform, bad_transform = split_transform(c.arguments)
            refused: Refusal | None = None
            if bad_transform is not None:
                refused = Refusal(reason="invalid_arguments", rule="planner:transform",
                                  message=bad_transform)
            elif offered is not None and c.name not in offered:
                listed = ", ".join(sorted(offered)[:40]) or "none"
                refused = Refusal(reason="tool_not_offered", rule="planner:offered",
                                  message=clip(f"{c.name} is not one of the tools offered "
                                               f"to you in this turn; call one of: {listed}"))
            elif (unusable := _unusable_arguments(c)) is not None:
                refused = Refusal(reason="invalid_arguments", rule="planner:arguments",
                                  message=unusable)
            elif c.name.startswith(f"{AGENT_TOOL_NAMESPACE}:"):
                if agents_left <= 0:
                    refused = Refusal(reason="agent_budget", rule=AGENT_BUDGET_RULE,
                                      message=_agent_budget_spent(rules, sid))
                agents_left -= 1
            # The refusal rides on the request too: an approval actor deciding the call
            # before the rejection is stored (in another process) refuses it alike.
            out.append(Append(CallRequested(
                session_id=sid, at=now, actor=ACTOR, call_id=c.call_id, turn_id=turn.turn_id,
                tool=c.name, arguments=arguments, agent=turn.agent, transform=transform,
                output_path=output_path_for(c.name) if c.name in writes else None,
                refused=refused),
                call_requested_id(sid, c.call_id)))
            if refused is not None:
                out.append(Append(CallRejected(
                    session_id=sid, at=now, actor=ACTOR, call_id=c.call_id,
                    turn_id=turn.turn_id, tool=c.name, reason=refused.reason,
                    rule=refused.rule, message=refused.message),
                    policy_decision_id(sid, c.call_id)))
    judged = {v.call_id for v in turn.verdicts}
    emitted = turn.output_call_id is not None
    for c in emits:
        if c.call_id in judged:
            continue
        if emitted:
            violations = ["$: an output was already accepted for this turn"]
            output: Any = None
        else:
            output, violations = rules.judge_output(c)
        if violations:
            message = describe_output(violations)
            out.append(Append(OutputRejected(session_id=sid, at=now, actor=ACTOR,
                                             turn_id=turn.turn_id, call_id=c.call_id,
                                             message=clip(message), violations=violations),
                              output_verdict_id(sid, c.call_id)))
        else:
            emitted = True
            out.append(Append(OutputEmitted(session_id=sid, at=now, actor=ACTOR,
                                            turn_id=turn.turn_id, call_id=c.call_id,
                                            output=output),
                              output_verdict_id(sid, c.call_id)))
    if out:
        return out
    if not all(state.calls[c.call_id].terminal for c in real):
        return []  # the calls are running (or waiting for a human)
    if compression is not None and any(
            view_due(state, state.calls[c.call_id], compression) for c in real):
        return []  # the compressor is writing what the model reads of a result
    return None


AGENT_BUDGET_RULE = "planner:agent_calls"


def _agent_calls(state: SessionState, turn: TurnState) -> int:
    """The agent calls of `turn` requested so far and not refused (for the budget, their
    arguments, a policy) nor denied by a human: the budget is the child turns that ran,
    and a call refused for its arguments goes back to the model to be made again."""
    n = 0
    for call_id in turn.call_ids:
        call = state.calls.get(call_id)
        if call is not None and call.tool.startswith(f"{AGENT_TOOL_NAMESPACE}:") and \
                call.status != "rejected" and call.human_decision != "denied":
            n += 1
    return n


def _agent_budget_spent(rules: Rules, sid: str) -> str:
    allowed = rules.agent_calls(sid)
    depth = depth_of(sid)
    where = (f"in this session, {depth} level(s) of agents calling agents deep (half as "
             "many at each level)" if depth else "in a turn")
    return (f"this turn has made the {allowed} agent call(s) allowed {where} "
            "(agent_config.limits.max_agent_calls); do the rest yourself or answer with "
            "what you have")


def split_transform(arguments: Any) -> tuple[Any, str | None, str | None]:
    """The arguments without `_transform`, the JMESPath expression it held (seed 003: the
    model narrows a result before reading it), and what is wrong with it, if anything (the
    call is then refused, the model told why). An empty one is no transform."""
    if not isinstance(arguments, dict) or "_transform" not in arguments:
        return arguments, None, None
    rest = {k: v for k, v in arguments.items() if k != "_transform"}
    expression = arguments["_transform"]
    if expression is None or (isinstance(expression, str) and not expression.strip()):
        return rest, None, None
    if not isinstance(expression, str):
        return rest, None, ("_transform must be a JMESPath expression (a string), got "
                            f"{type(expression).__name__}")
    if len(expression) > MAX_TRANSFORM_CHARS:
        return rest, None, (f"_transform is {len(expression)} characters; at most "
                            f"{MAX_TRANSFORM_CHARS} are taken")
    return rest, expression, None


def _answer_again(state: SessionState, turn: TurnState, offer: Offer, rules: Rules,
                  chat: list[ModelStep], now: float) -> list[Append]:
    """After a composed answer that broke its schema: ask again, or end the turn when the
    last `max_output_retries` + 1 answers all did."""
    rejected = 0
    for s in reversed(chat):
        if not s.violations:
            break
        rejected += 1
    if rejected > rules.max_output_retries:
        return [_fail(state, turn, "invalid_composed_output",
                      f"the model answered {rejected} times without matching the composed "
                      f"schema; last: {'; '.join(chat[-1].violations)}", now)]
    return [_ask(state.session_id, turn, offer, now, tools=offered_tools(rules, offer, turn))]


def describe_output(violations: list[str]) -> str:
    n = len(violations)
    return (f"the output does not match the output schema: {n} violation"
            f"{'s' if n != 1 else ''}: {'; '.join(violations)}. Call {EMIT_OUTPUT} again "
            "with an output that matches it.")


def _reevaluation_due(state: SessionState, turn: TurnState, last: ModelStep, rules: Rules,
                      now: float) -> list[Append]:
    """`turn.reevaluated` when a successful call of `last` is a reevaluation tool (global,
    or in an active policy's `reevaluate_after`) and the agent has policies to decide
    again; capped past the turn's limit."""
    if not rules.policies or any(r.after_iteration == last.iteration
                                 for r in turn.reevaluations):
        return []
    triggers = rules.reevaluation_tools | {t for p in active_policies(rules, turn)
                                           for t in p.reevaluate_after}
    fired = [c for c in last.tool_calls if c.name in triggers
             and (call := state.calls.get(c.call_id)) is not None
             and call.status == "succeeded"]
    if not fired:
        return []
    done = sum(1 for r in turn.reevaluations if not r.capped)
    capped = done >= rules.max_reevaluations
    sid = state.session_id
    return [Append(TurnReevaluated(session_id=sid, at=now, actor=ACTOR, turn_id=turn.turn_id,
                                   round=turn.round + (0 if capped else 1),
                                   after_iteration=last.iteration,
                                   trigger_call_ids=[c.call_id for c in fired],
                                   tools=[c.name for c in fired],
                                   limit=rules.max_reevaluations, capped=capped),
                   turn_reevaluated_id(sid, turn.turn_id, last.iteration))]


def _match(state: SessionState, turn: TurnState, offer: Offer, rules: Rules,
           now: float) -> list[Append]:
    """`policies.matched` for the turn's round, once the model has judged the `when:`
    policies (asked here first, if any)."""
    sid = state.session_id
    spoken = [p.id for p in rules.policies if p.when is not None]
    by_model: list[str] = []
    notes: list[str] = []
    iteration: int | None = None
    if spoken:
        judged = next((s for s in reversed(turn.steps)
                       if s.purpose == "match" and s.round == turn.round), None)
        if judged is None:
            return [_ask(sid, turn, offer, now, purpose="match", round_=turn.round)]
        iteration = judged.iteration
        applies = judged.output.get("applies") if isinstance(judged.output, dict) else None
        if not isinstance(applies, list):
            notes.append("the model's judgement named no list of policies; no when: "
                         "policy applies")
            applies = []
        by_model = [i for i in spoken if i in applies]
        unknown = [str(i) for i in applies if i not in spoken]
        if unknown:
            notes.append(f"the model named {', '.join(unknown)}, not a when: policy; ignored")
    document = state_document(state)
    matched: list[str] = []
    for p in rules.policies:
        if p.when is not None:
            applies_now = p.id in by_model
        elif p.when_state is not None:
            applies_now, why = rules.holds(p, document)
            if why is not None:
                notes.append(why)
        else:
            applies_now = True  # no condition: always
        if applies_now:
            matched.append(p.id)
    missed = any(p.when_state is not None and p.id not in matched for p in rules.policies)
    if missed and (stored := _stored_by_reference(state)):
        notes.append(clip(f"when_state reads {{\"$ref\": key}} at {', '.join(stored)}: a "
                          "result too large to go in an event is stored by reference, and no "
                          "condition reads inside it; have the tool return less", 1000))
    return [Append(PoliciesMatched(session_id=sid, at=now, actor=ACTOR, turn_id=turn.turn_id,
                                   round=turn.round, matched=matched, by_model=by_model,
                                   model_iteration=iteration, notes=notes),
                   policies_matched_id(sid, turn.turn_id, turn.round))]


def _stored_by_reference(state: SessionState, most: int = 3) -> list[str]:
    """The paths of the state object (up to `most`) that hold a result stored by
    reference (`{"$ref": key}`, its call's), not the result."""
    found: set[str] = set()
    for call in state.calls.values():
        ref, path = call.result_ref, call.output_path
        if ref is not None and path and call.status == "succeeded" and \
                _at_path(state.data, path) == {"$ref": ref.key}:
            found.add(clip(path, 200))
    return sorted(found)[:most]


def _at_path(data: Any, path: str) -> Any:
    for key in path.split("."):
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def _think_due(state: SessionState, turn: TurnState, offer: Offer, rules: Rules,
               now: float) -> list[Append] | None:
    """The next think step of the turn without a valid output: the agent's, then those of
    the policies that apply. A step whose outputs kept breaking its schema ends the
    turn."""
    due: list[ThinkStep | ThinkRequest] = [
        *rules.think, *(p.think for p in active_policies(rules, turn) if p.think),
        *turn.think]
    for step in due:
        tries = [s for s in turn.steps if s.purpose == "think" and s.step == step.id]
        if tries and not tries[-1].violations:
            continue
        if len(tries) > rules.max_output_retries:
            return [_fail(state, turn, "invalid_think_output",
                          f"think step {step.id} ({REASON}) answered {len(tries)} times "
                          f"without matching its output schema; last: "
                          f"{'; '.join(tries[-1].violations)}", now)]
        return [_ask(state.session_id, turn, offer, now, purpose="think", step=step.id)]
    return None


def _complete(state: SessionState, turn: TurnState, text: str, output: Any,
              now: float) -> Append:
    """The turn's end with its answer. One over what an event holds (its outcomes and a
    long answer together) keeps a structured output whole and leaves its text (the same
    output as JSON) out, or clips a text answer, saying where the whole of it is (the
    last `model.responded`); an output too large even alone ends the turn
    `answer_too_large`."""
    sid = state.session_id
    event = TurnCompleted(session_id=sid, at=now, actor=ACTOR, turn_id=turn.turn_id,
                          request_id=turn.request_id, ok=True,
                          outcomes=turn_outcomes(state, turn), text=text, output=output)
    size = len(encode_event(event))
    if size <= MAX_EVENT_BYTES:  # the usual turn: encoded once here
        return Append(event, turn_ended_id(sid, turn.turn_id))
    if output is not None:
        event = msgspec.structs.replace(event, text="")
    else:
        marker = " [clipped: the whole answer is the turn's last model.responded]"
        room = MAX_EVENT_BYTES - len(encode_event(msgspec.structs.replace(event, text="")))
        for budget in (room - len(marker) - 64, (room - len(marker)) // 2,
                       (room - len(marker)) // 6):
            cut = text.encode()[:max(budget, 0)].decode(errors="ignore") + marker
            event = msgspec.structs.replace(event, text=cut)
            if len(encode_event(event)) <= MAX_EVENT_BYTES:
                break
    size = len(encode_event(event))
    if size > MAX_EVENT_BYTES:
        return _fail(state, turn, "answer_too_large",
                     f"the turn's end with its answer and the outcomes of its "
                     f"{len(event.outcomes)} calls is {size:,} bytes, over the "
                     f"{MAX_EVENT_BYTES:,} an event holds", now)
    return Append(event, turn_ended_id(sid, turn.turn_id))


def _fail(state: SessionState, turn: TurnState, reason: str, message: str,
          now: float) -> Append:
    sid = state.session_id
    return Append(TurnFailed(session_id=sid, at=now, actor=ACTOR, turn_id=turn.turn_id,
                             request_id=turn.request_id, reason=reason, message=clip(message),
                             outcomes=turn_outcomes(state, turn)),
                  turn_ended_id(sid, turn.turn_id))


def _ask(sid: str, turn: TurnState, offer: Offer, now: float, *,
         tools: Sequence[ToolSpec] = (), purpose: ModelPurpose = "chat",
         step: str | None = None, round_: int = 0) -> Append:
    iteration = len(turn.steps) + 1
    return Append(ModelRequested(session_id=sid, at=now, actor=ACTOR, turn_id=turn.turn_id,
                                 iteration=iteration, provider=offer.provider,
                                 model=offer.model, tools=len(tools),
                                 tools_digest=tools_digest(tools), purpose=purpose,
                                 step=step, round=round_),
                  model_requested_id(sid, turn.turn_id, iteration))


# --- what the model is given ------------------------------------------------------------


def active_policies(rules: Rules, turn: TurnState) -> list[AgentPolicy]:
    """The policies the turn's latest `policies.matched` found to apply, in manifest
    order."""
    ids = set(turn.policies)
    return [p for p in rules.policies if p.id in ids]


def offered_tools(rules: Rules, offer: Offer, turn: TurnState) -> list[ToolSpec]:
    """The tools of the next chat step: when a policy that applies names tools, the union
    of those, the global reevaluation tools and the context tools (a preview of a large
    result says to recall it), those found in the catalog; otherwise every tool the
    planner may offer. Of these, those the policy lets the turn's agent call. Plus
    `built-in:emit_output` with an output schema."""
    named = [t for p in active_policies(rules, turn) for t in p.tools]
    if named:
        names = dict.fromkeys([*named, *sorted(rules.reevaluation_tools), RECALL,
                               CONTEXT_STATUS])
        specs = [offer.catalog[n] for n in names if n in offer.catalog]
    else:
        specs = [s for s in offer.tools if s.name != EMIT_OUTPUT]
    specs = [s for s in specs if offer.permits(s.name, turn.agent)]
    if rules.emit is not None:
        specs.append(rules.emit)
    return specs


def _think_outputs(turn: TurnState) -> dict[str, Any]:
    return {s.step: s.output for s in turn.steps
            if s.purpose == "think" and s.step is not None and not s.violations}


def system_prompt(rules: Rules, turn: TurnState) -> str | None:
    """The instructions, then what the policies that apply say to do, then this turn's
    think outputs, then how to give a structured result."""
    parts = [rules.instructions] if rules.instructions else []
    active = active_policies(rules, turn)
    if active:
        parts.append("These policies apply now; follow them:\n"
                     + "\n".join(f"- {p.id}: {p.action}" for p in active))
    outputs = _think_outputs(turn)
    if outputs:
        parts.append(f"What your reasoning steps ({REASON}) concluded:\n"
                     + "\n".join(f"- {k}: {_encode(v).decode()}" for k, v in outputs.items()))
    if rules.emit is not None:
        parts.append(f"Give the result of this turn by calling {EMIT_OUTPUT}; its arguments "
                     "must match its schema.")
    return "\n\n".join(parts) or None


def match_schema(rules: Rules) -> dict[str, Any]:
    ids = [p.id for p in rules.policies if p.when is not None]
    return {"type": "object", "additionalProperties": False, "required": ["applies"],
            "properties": {"applies": {"type": "array",
                                       "items": {"type": "string", "enum": ids}}}}


def match_prompt(rules: Rules) -> str:
    listed = "\n".join(f"- {p.id}: {p.when}" for p in rules.policies if p.when is not None)
    return ("Decide which of these policies apply to the conversation as it stands now. "
            "Each line is a policy id and the condition under which it applies:\n"
            f"{listed}\n\nAnswer with a JSON object, {{\"applies\": [...]}}, listing the ids "
            "of the policies whose condition holds (an empty list when none does).")


def _with_turn_unique_ids(turn: TurnState, calls: list[ModelToolCall]
                          ) -> list[ModelToolCall]:
    """`calls` with provider ids that no earlier call of the turn has: they go back to
    the provider with the results, and a conversation with two calls of one id is refused
    (Anthropic's 400) or answered wrongly. A server that numbers each reply's calls from 1,
    or gives none (the transport makes one up from the reply, perhaps the same), would
    repeat them; such an id is replaced by one made from the turn's own call id."""
    used = {c.id for step in turn.steps for c in step.tool_calls}
    # The Responses API's item ids (`fc_...`) go back too, and are optional when sent:
    # one an earlier call of the turn has is left out.
    items = {c.extra.get("id") for step in turn.steps for c in step.tool_calls}
    out = []
    for call in calls:
        if call.id in used:
            call = msgspec.structs.replace(call, id=stable_id("call", call.call_id, call.id))
        item = call.extra.get("id")
        if isinstance(item, str) and item in items:
            call = msgspec.structs.replace(
                call, extra={k: v for k, v in call.extra.items() if k != "id"})
        used.add(call.id)
        items.add(item)
        out.append(call)
    return out


def _request_step(turn: TurnState, step_id: str | None
                  ) -> tuple[ThinkRequest, Validator] | None:
    """A think step the turn's request gave, with its schema compiled."""
    for step in turn.think:
        if step.id == step_id:
            return step, validator_for(step.output_schema)
    return None


def think_prompt(rules: Rules, turn: TurnState, step: ThinkStep | ThinkRequest) -> str:
    base = system_prompt(rules, turn)
    schema = _encode(step.output_schema).decode()
    return ((f"{base}\n\n" if base else "")
            + f"Think step {step.id} ({REASON}): {step.instruction}\n"
            f"Answer with one JSON value that matches this JSON Schema: {schema}")


def think_messages(state: SessionState, turn: TurnState, step_id: str,
                   compression: Compression | None = None,
                   history: HistoryCache | None = None) -> list[Message]:
    """The conversation, then each earlier answer to this step that broke its schema,
    with the violations, so the next answer can fix them all."""
    out = transcript(state, turn, compression, history)
    for s in turn.steps:
        if s.purpose == "think" and s.step == step_id and s.violations:
            out.append(Message(role="assistant", text=s.text))
            out.append(Message(role="user", text="That answer does not match the schema: "
                               f"{'; '.join(s.violations)}. Answer again."))
    return out


def parse_structured(text: str, validator: Validator | None) -> tuple[Any, list[str]]:
    """A structured reply's JSON value (a ```json fence around it is tolerated) and every
    way it breaks the schema."""
    body = text.strip()
    if body.startswith("```"):
        body = body.split("\n", 1)[1] if "\n" in body else ""
        body = body.rsplit("```", 1)[0].strip()
    try:
        value = model_json(body)
    except msgspec.DecodeError:
        return None, [f"$: the answer is not JSON: {clip(text, 200)!r}"]
    if validator is None:
        return value, []
    if isinstance(value, dict):
        value, violations = validator.check(value)
    else:
        violations = validator.violations(value)
    return value, [str(v) for v in violations]


def transcript(state: SessionState, turn: TurnState,
               compression: Compression | None = None,
               history: HistoryCache | None = None) -> list[Message]:
    """The conversation the model sees for `turn`: earlier planner turns of the session
    (the message and the answer), then this turn's message, and each of its chat steps
    with the results of the calls it asked for (an emit_output call's result is its
    verdict). With `history`, what came before the turn is rendered once per session and
    extended as turns end, instead of again for every model call."""
    if history is not None:
        out = history.before(state, turn, compression)
    else:
        out = _render_before(_items_before(state, 0, turn.seq), turn, compression)
    assert turn.message is not None
    out += [Message(role=m.role, text=m.content) for m in turn.history]
    if turn.message:  # a turn a tool event started has none: the event is the news
        out.append(Message(role="user", text=turn.message))
    verdicts = {v.call_id: v for v in turn.verdicts}
    for step in turn.steps:
        if step.purpose != "chat":
            continue
        out.append(Message(role="assistant", text=step.text, tool_calls=[
            ToolCall(id=c.id, name=c.name,
                     arguments=c.arguments if isinstance(c.arguments, dict) else {},
                     extra=c.extra) for c in step.tool_calls]))
        if step.violations:  # a composed answer that broke its schema
            out.append(Message(role="user", text="That answer does not match the schema: "
                               f"{'; '.join(step.violations)}. Answer again."))
        for c in step.tool_calls:
            verdict = verdicts.get(c.call_id)
            if verdict is not None:
                text, is_error = (("the output was accepted", False) if verdict.ok
                                  else (verdict.message, True))
            else:
                text, is_error = _result_text(state.calls.get(c.call_id))
            out.append(Message(role="tool", tool_call_id=c.id, name=c.name, text=text,
                               is_error=is_error))
    return out


_HistoryItem = TurnState | InjectedToolEvent


def _items_before(state: SessionState, start: int, end: int) -> list[_HistoryItem]:
    """Earlier turns and injected tool events stored at sequences start <= seq < end, in
    the order stored. Both are kept in that order (turns by their `turn.requested`), so
    only the newest are looked at."""
    turns: list[_HistoryItem] = []
    for other in reversed(state.turns.values()):
        if other.seq < start:
            break
        if other.seq < end:
            turns.append(other)
    events: list[_HistoryItem] = []
    for event in reversed(state.tool_events):
        if event.seq < start:
            break
        if event.seq < end:
            events.append(event)
    items = turns[::-1]
    if events:
        items += events[::-1]
        items.sort(key=lambda item: item.seq)
    return items


def _render_one(item: _HistoryItem, turn: TurnState,
                compression: Compression | None) -> list[Message]:
    if isinstance(item, InjectedToolEvent):
        budget, items = (compression or _NO_COMPRESSION).settings(turn.agent, item.tool_id)
        return injected_messages(item, budget=budget, items=items)
    out: list[Message] = []
    if item.message is not None and item.status in ("completed", "cancelled"):
        # A cancelled turn's question stays (the event that superseded it follows); its
        # partial work does not.
        if item.message:
            out.append(Message(role="user", text=item.message))
        if item.text:
            out.append(Message(role="assistant", text=item.text))
    return out


def _render_before(items: list[_HistoryItem], turn: TurnState,
                   compression: Compression | None) -> list[Message]:
    window = _Window((compression or _NO_COMPRESSION).history_chars)
    for item in items:
        window.add(_render_one(item, turn, compression))
    return window.view()


# Once the earlier turns overflow the history budget, the oldest are left out until the
# rest fill this share of it: the cut then stays put for many turns, so what the model
# reads starts the same way from one call to the next (and a provider's prompt cache,
# which matches on that start, keeps working).
_HISTORY_REFILL = 0.75


def message_chars(message: Message) -> int:
    """A message's size as the history budget counts it: its text and its calls."""
    return len(message.text) + sum(len(c.name) + len(_encode(c.arguments))
                                   for c in message.tool_calls)


class _Window:
    """The earlier exchanges of a session the model reads (an exchange: an ended turn's
    question and answer, or an injected tool event), oldest first: all of them while they
    fit the budget; once they do not, the oldest are left out until the rest fit
    `_HISTORY_REFILL` of it, and a first message says how many are missing. A function
    of the exchanges in order alone: extended one by one (the cache), or all at once (a
    fresh rendering, another process), it leaves out the same ones."""

    __slots__ = ("_budget", "_groups", "_sizes", "chars", "left_out", "note")

    def __init__(self, budget: int | None) -> None:
        self._budget = budget
        self._groups: deque[list[Message]] = deque()
        self._sizes: deque[int] = deque()
        self.chars = 0
        self.left_out = 0  # exchanges left out that had anything to read
        self.note: Message | None = None

    @property
    def budget(self) -> int | None:
        return self._budget

    def add(self, group: list[Message]) -> bool:
        """Read `group` after the others; True if older ones were left out for it."""
        size = sum(map(message_chars, group))
        self._groups.append(group)
        self._sizes.append(size)
        self.chars += size
        budget = self._budget
        if budget is None or self.chars <= budget:
            return False
        floor = int(budget * _HISTORY_REFILL)
        # The newest exchange stays while it fits the budget alone (it may be over the
        # refill share): the model reads at least what was said last.
        while self._sizes and self.chars > floor and \
                (len(self._sizes) > 1 or self.chars > budget):
            dropped = self._sizes.popleft()
            self._groups.popleft()
            self.chars -= dropped
            self.left_out += dropped > 0
        if self.left_out:
            self.note = Message(role="user", text=(
                f"[{self.left_out} earlier exchange{'s' if self.left_out != 1 else ''} of "
                "this conversation left out to stay within the context budget; the most "
                "recent ones follow.]"))
        return True

    def view(self) -> list[Message]:
        out = [self.note] if self.note is not None else []
        for group in self._groups:
            out += group
        return out

    def copy(self) -> _Window:
        other = _Window(self._budget)
        other._groups = self._groups.copy()
        other._sizes = self._sizes.copy()
        other.chars, other.left_out, other.note = self.chars, self.left_out, self.note
        return other


@dataclass(slots=True)
class _Rendered:
    agent: str | None
    upto: int  # everything stored before this sequence is in `window`, and final
    window: _Window
    wire: WireMemo = field(default_factory=WireMemo)  # the wire forms of its view, as sent


class HistoryCache:
    """What the model reads of a session's past, per session: the rendering of every turn
    and injected event stored before some sequence, kept while all of them are over (an
    ended turn never changes), and extended with the ones that ended since. A turn still
    running is rendered each time and not kept. Keyed by session and the asking turn's
    agent (an injected result's budget depends on it); bounded like the session cache.
    What is rendered goes through the history budget (`_Window`)."""

    def __init__(self, size: int = SESSION_CACHE_SIZE) -> None:
        self._entries: OrderedDict[str, _Rendered] = OrderedDict()
        self._size = size

    def before(self, state: SessionState, turn: TurnState,
               compression: Compression | None) -> list[Message]:
        sid = state.session_id
        budget = (compression or _NO_COMPRESSION).history_chars
        existing = self._entries.get(sid)
        kept = existing
        if kept is None or kept.agent != turn.agent or kept.upto > turn.seq or \
                kept.window.budget != budget:
            # Another agent's, ahead of this turn, or under another budget.
            kept = _Rendered(turn.agent, 0, _Window(budget))
        upto = kept.upto
        final: list[list[Message]] = []
        tail: list[list[Message]] = []
        running = False
        for item in _items_before(state, kept.upto, turn.seq):
            running = running or (isinstance(item, TurnState) and item.status == "running")
            if running:
                tail.append(_render_one(item, turn, compression))  # may still change
            else:
                final.append(_render_one(item, turn, compression))
                upto = item.seq + 1
        if not running:
            upto = turn.seq  # everything stored before the turn is rendered, and final
        older = kept is not existing and existing is not None and existing.agent == turn.agent
        moved = False
        for group in final:
            moved = kept.window.add(group) or moved
        if not older:  # else an older turn's view: the one kept goes further
            if moved:  # what is read starts elsewhere now: its wire forms anew
                kept.wire = WireMemo()
                kept.wire.keep(kept.window.view())
            else:
                for group in final:
                    kept.wire.keep(group)
            kept.upto = upto
            self._entries[sid] = kept
            self._entries.move_to_end(sid)
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)
        if not tail:
            return kept.window.view()
        window = kept.window.copy()
        for group in tail:
            window.add(group)
        return window.view()

    def wire(self, sid: str) -> WireMemo | None:
        """The wire forms of the history `before` last gave for `sid`, to pass to
        `complete` with it (only its kept messages are in it: any other is converted)."""
        kept = self._entries.get(sid)
        return kept.wire if kept is not None else None


_encode = msgspec.json.Encoder().encode


def injected_messages(event: InjectedToolEvent, *, budget: int = compress.DEFAULT_BUDGET,
                      items: int = compress.DEFAULT_ITEMS) -> list[Message]:
    """An injected tool event as the model reads it: a call of `tool_id` (in a name every
    API takes) and its result; over the budget, a preview under the event's id, which
    `built-in:recall` takes as a key."""
    name = re.sub(r"[^A-Za-z0-9_-]", "_", event.tool_id.replace(":", "__"))[:64]
    if event.result_ref is not None:
        ref = event.result_ref
        if ref.preview.startswith(f"[STORED: {event.event_id} ") and len(ref.preview) <= budget:
            text = ref.preview  # structured when it was injected (actors/session.py)
        else:
            begins = ref.preview[:max(budget - 200, 100)]
            text = (f"[STORED: {event.event_id} | {event.tool_id}]\nA result of "
                    f"{ref.size:,} bytes; it begins: {begins}\nUse "
                    f"recall(\"{event.event_id}\") to read it")
    else:
        text = compress.result_text(event.result)
        if len(text) > budget:
            text = compress.preview(event.result, key=event.event_id, tool=event.tool_id,
                                    budget=budget, items=items)
    arguments = event.arguments if isinstance(event.arguments, dict) else {}
    return [Message(role="assistant", text="", tool_calls=[
                ToolCall(id=event.event_id, name=name, arguments=arguments)]),
            Message(role="tool", tool_call_id=event.event_id, name=name, text=text)]


def _result_text(call: CallState | None) -> tuple[str, bool]:
    """What the model reads of a call's end: the result as JSON, or every word of why it
    failed (a rejection lists each argument violation, so the model can fix them)."""
    if call is None:
        return "the call was not recorded", True
    if call.status == "succeeded":
        if call.view is not None:  # compressed or transformed (actors/compressor.py)
            return call.view, False
        if call.result_ref is not None:
            ref = call.result_ref
            return (f"(a result of {ref.size} bytes, stored as {ref.key}; it begins: "
                    f"{ref.preview})"), False
        return _encode(call.result).decode(), False
    error = call.error
    if error is None:
        return f"the call ended {call.status}", True
    return f"{error.error_type}: {error.message}", True


def _planning(state: SessionState) -> bool:
    """Whether a planner turn of the session is open (a new one would wait for it)."""
    return any(state.turns[t].message is not None for t in state.open_turns)


def _unseen_by(state: SessionState, event: Event | None) -> bool:
    """Whether `event` (delivered to the planner, and folded) names a turn `state` does
    not hold, or a call of a planner turn it holds none of: the state is behind the log.
    An explicit call is never the planner's to know (the session actor requests it)."""
    if not isinstance(event, CallSucceeded | CallFailed | CallRejected | ResultCompressed |
                      TurnCancelled):
        return False
    turn = state.turns.get(event.turn_id)
    if turn is None:
        return True
    return not isinstance(event, TurnCancelled) and turn.message is not None and \
        event.call_id not in state.calls


def _unusable_arguments(call: ModelToolCall) -> str | None:
    """Why the arguments the model sent for `call` are no JSON at all, or nest too deeply
    to keep, said so that it can send them again right; None if they were JSON (one that
    is not an object is refused by the approval actor, which names its kind)."""
    raw = call.extra.get("invalid_arguments")
    if not isinstance(raw, str):
        return None
    if raw == TOO_DEEP:
        why = f"nest deeper than {MAX_JSON_DEPTH} levels"
    else:
        try:
            model_json(raw)
            return None
        except msgspec.DecodeError as exc:
            why = (f"nest deeper than {MAX_JSON_DEPTH} levels" if "deeper" in str(exc)
                   else f"are not valid JSON ({exc})")
    return clip(f"arguments of {call.name} {why}: send them again as one JSON object, "
                f"no deeper than {MAX_JSON_DEPTH} levels")


def _as_sent(call: ToolCall) -> Any:
    """The arguments as the model sent them. Text that is not JSON, or JSON that is not an
    object, goes on as it is, for the approval actor to refuse (`invalid_arguments`) and
    the model to read why; never as `{}`, which would run the tool with no arguments."""
    raw = call.extra.get("invalid_arguments")
    if not isinstance(raw, str):
        return call.arguments
    try:
        return model_json(raw)
    except msgspec.DecodeError:  # also nested too deeply to store and read back
        return raw


def tools_digest(specs: Sequence[ToolSpec]) -> str:
    names = ",".join(sorted(s.name for s in specs))
    return hashlib.sha256(names.encode()).hexdigest()[:16]


# --- effects ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Ask:
    """One model call to make: for `asked`, what to send, and how to read the reply."""

    asked: ModelRequested
    turn: TurnState
    rules: Rules
    settings: ModelSettings
    system: str | None = None
    messages: list[Message] = field(default_factory=list)
    tools: list[ToolSpec] = field(default_factory=list)
    schema: dict[str, Any] | None = None
    validator: Validator | None = None
    publish: _Deltas | None = None
    base: int = 0
    failure: str | None = None  # the turn cannot go on: why
    wire: WireMemo | None = None  # the session's history as sent before


_Started = tuple[_Ask, "asyncio.Task[ModelResponse | ModelError | None]"]


def _nothing(stored: bool) -> None:
    pass


_CANCELLED: Any = object()  # a model call stopped because its turn was cancelled
_CANCELLED_SUFFIX = ".turn.cancelled"


async def _reply_of(task: asyncio.Task[ModelResponse | ModelError | None]
                    ) -> ModelResponse | ModelError | None:
    """The call's reply, or `_CANCELLED` if its turn's cancellation stopped it (this
    task's own cancellation still raises)."""
    try:
        return await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
        return _CANCELLED  # type: ignore[no-any-return]


async def _cancel(tasks: Sequence[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


def with_answer(state: SessionState, answer: ModelResponded) -> SessionState:
    """`state` as it will be once `answer` is stored right after it: a copy sharing all
    that the answer leaves alone (its turn's steps and the step outputs are copied)."""
    turn = state.turns.get(answer.turn_id)
    if turn is None:
        return state
    copy = msgspec.structs.replace(
        state, turns={**state.turns, turn.turn_id: msgspec.structs.replace(
            turn, steps=list(turn.steps))}, step_outputs=dict(state.step_outputs))
    return evolve(copy, answer, state.last_seq + 1)


def with_turn(state: SessionState, requested: TurnRequested) -> SessionState:
    """`state` as it will be once `requested` is stored right after it: a copy sharing
    all that a new turn leaves alone."""
    copy = msgspec.structs.replace(state, turns=dict(state.turns),
                                   open_turns=list(state.open_turns))
    return evolve(copy, requested, state.last_seq + 1)


def settle_calls(state: SessionState, items: list[Append], approver: InlineApprover, *,
                 max_parallel: int, now: float) -> list[Append]:
    """`items` (decided on `state`) with the approval actor's decisions on the calls they
    request, when no human is needed, and the dispatches those make due: the events and
    ids the approval and session actors would write one hop later each (see the session
    actor's `accept_request`). Only when every earlier call of the turn has ended, so the
    parallel and side-effect rules see the new calls alone; otherwise `items` as they are."""
    requested = [i.event for i in items if isinstance(i.event, CallRequested)]
    if not requested:
        return items
    turn = state.turns.get(requested[0].turn_id)
    if turn is None or any(r.turn_id != turn.turn_id for r in requested) or not all(
            state.calls[c].terminal for c in turn.call_ids if c in state.calls):
        return items
    sid = state.session_id
    decided = {i.event.call_id for i in items if isinstance(i.event, CallRejected)}
    out = list(items)
    for call in requested:
        if call.call_id not in decided:
            decision = approver(call)
            if decision is not None:
                out.append(Append(decision, policy_decision_id(sid, call.call_id)))
    scratch = SessionState(session_id=sid)
    scratch.turns[turn.turn_id] = TurnState(turn_id=turn.turn_id, request_id=turn.request_id,
                                            call_ids=[], message=turn.message)
    for seq, item in enumerate(out, start=1):
        if isinstance(item.event, CallRequested | CallApproved | CallRejected):
            evolve(scratch, item.event, seq)
    return out + due_in_turn(scratch, scratch.turns[turn.turn_id], max_parallel, now)


class Planner:
    def __init__(self, bus: Bus, catalog: Catalog, settings: ModelSettings, *,
                 instructions: str | None = None,
                 rules: Rules | None = None,
                 tools: Callable[[ToolSpec], bool] | None = None,
                 agents: Mapping[str, AgentProfile] | None = None,
                 max_iterations: int = DEFAULT_MAX_ITERATIONS,
                 max_tokens: int | None = None,
                 compression: Compression | None = None,
                 ack_wait_s: float = PARTITION_ACK_WAIT_S,
                 instance: str | None = None,
                 approval: InlineApproval | None = None,
                 max_parallel: int = 3,
                 max_calls: int = DEFAULT_MAX_CALLS,
                 policy: Policy | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        """`policy`: the execution policy; a tool it would refuse the turn's agent is
        not offered to the model. `max_calls`: calls per turn (`max_calls_per_turn`), as
        the session actor allows a request."""
        self._bus = bus
        self._policy = policy
        # The model calls under way, by session: task -> its turn.
        self._in_flight: dict[str, dict[asyncio.Task[Any], str]] = {}
        # Turns whose `turn.cancelled` arrived but is not folded yet, by session.
        self._cancelling: dict[str, set[str]] = {}
        self._permitted: dict[tuple[str, str | None, str], tuple[ToolSpec, bool]] = {}
        # With the approval actor in this process, the model's calls are approved and
        # dispatched as they are stored (`settle_calls`); the events are the same.
        self._approval = approval
        self._approver: InlineApprover | None = approval.decide_inline if approval else None
        self._max_parallel = max_parallel
        self._max_calls = max_calls
        self._history = HistoryCache()  # what the model reads of each session's past
        self._kernel = Kernel(bus, ACTOR, clock=clock)
        self._states = SessionStates(bus, self._kernel.log)
        self._catalog = catalog
        self._settings = settings
        rules = rules or DEFAULT_RULES
        if instructions is not None and instructions != rules.instructions:
            rules = dataclasses.replace(rules, instructions=instructions)
        self._rules = rules
        self._offered = tools or (lambda spec: True)
        self._agents = dict(agents or {})
        self._max_iterations = max_iterations
        self._max_tokens = max_tokens
        self._compression = compression
        self._ack_wait_s = ack_wait_s
        self._clock = clock
        self._http: ModelClient | None = None
        # Each partition of sessions through its own consumer, while this process holds
        # it (bus/partitions.py): any number of planner processes share the sessions.
        self.instance = instance or member_name()
        self._owner = PartitionOwner(bus, ACTOR, self.instance, on_acquire=self._take,
                                     on_release=self._give_up)
        self._partition_loops: dict[int, PullLoop] = {}
        self._kernel.log.writer = self.instance
        # Turns started as the session actor of this process stores them (`early_turn`),
        # by partition.
        self._early: dict[asyncio.Task[None], int] = {}
        self._early_of: dict[str, asyncio.Task[None]] = {}  # by session
        # Sessions whose questions a handler here left unanswered (stopped at its bound,
        # or by an error): their next handling asks them (`_recover`).
        self._left: set[str] = set()
        self._narrowing: dict[int, asyncio.Task[None]] = {}
        self._stopping = False
        self.early_turns = 0  # how many (stats and tests)

    @property
    def kernel(self) -> Kernel:
        return self._kernel

    @property
    def states(self) -> SessionStates:
        """The sessions this planner keeps folded (read-only for others)."""
        return self._states

    def describe(self) -> str:
        s = self._settings
        return f"{s.provider} {s.model}" + (f" at {s.base_url}" if s.base_url else "")

    async def start(self) -> None:
        self._http = ModelClient()
        await self._kernel.start()
        await delete_consumers(self._bus, EVENTS_STREAM, ("planner",))  # before partitions
        await self._owner.start()

    async def stop(self, grace: float = 5.0) -> None:
        # A turn whose early planning is stopped here is not asked again by its delivery's
        # handler while this process stops (a model request sent for nothing): that
        # delivery is left unacknowledged, for the next owner of its partition.
        self._stopping = True
        for task in [*self._early, *self._narrowing.values()]:
            await stop_task(task)  # a turn goes on at its delivery, elsewhere
        await self._owner.stop()
        await self._kernel.stop(grace)
        if self._http is not None:
            await self._http.aclose()

    @property
    def partitions(self) -> list[int]:
        """The partitions this process plans now."""
        return sorted(self._partition_loops)

    async def _take(self, part: int) -> None:
        # A session of this partition still in memory is from an earlier turn at it (kept
        # then because it was being decided): it lacks what the owner since decided.
        self._states.forget_partition(part)
        durable = f"planner-p{part}"
        subjects = tuple(type_filter(t, part) for t in _CONSUMED)
        found = await consumer_state(self._bus, EVENTS_STREAM, durable)
        wide = found is not None and set(found.filter_subjects) != set(subjects)
        self._partition_loops[part] = await self._kernel.attach(Inbox(
            ConsumerSpec(EVENTS_STREAM, durable,
                         found.filter_subjects if found is not None and wide else subjects,
                         ack_wait_s=self._ack_wait_s),
            self._on_event, self._reject, max_in_flight=256, arrived=self._arrived))
        if wide:
            task = asyncio.create_task(self._narrow(part, ConsumerSpec(
                EVENTS_STREAM, durable, subjects, ack_wait_s=self._ack_wait_s)))
            self._narrowing[part] = task
            task.add_done_callback(lambda _: self._narrowing.pop(part, None))

    async def _narrow(self, part: int, spec: ConsumerSpec) -> None:
        """Narrow an earlier planner's consumer of `part` to `_CONSUMED` once nothing it
        stored is left undelivered (see `_NARROW_AFTER_S`): what was, this planner handles
        as a wake-up of its session (`_on_event`)."""
        await asyncio.sleep(_NARROW_AFTER_S)
        while part in self._partition_loops:
            try:
                found = await consumer_state(self._bus, EVENTS_STREAM, spec.durable)
                if found is not None and not found.pending:
                    await ensure_consumer(self._bus, spec)
                    log.info("planner: %s now filters the events others write only",
                             spec.durable)
                    return
            except Exception as exc:  # the bus is away: tried again
                log.debug("planner: narrowing %s: %s", spec.durable, exc)
            await asyncio.sleep(1.0)

    async def _give_up(self, part: int) -> None:
        loop = self._partition_loops.pop(part, None)
        await stop_task(self._narrowing.pop(part, None))
        for task in [t for t, p in self._early.items() if p == part]:
            await stop_task(task)  # its delivery goes to the partition's next owner
        n = self._bus.partitions
        self._left -= {s for s in self._left if partition(s, n) == part}
        if loop is not None:
            await self._kernel.detach(loop)
        self._states.forget_partition(part)
        n = self._bus.partitions
        for sid in [s for s in self._cancelling if partition(s, n) == part]:
            del self._cancelling[sid]

    def _offer(self, sid: str, agent: str | None = None) -> Offer:
        specs = self._catalog.all()
        profile = self._agents.get(agent or "")
        settings, offered = ((self._settings, self._offered) if profile is None
                             else (profile.settings, profile.tools))
        catalog = {s.name: s for s in specs}
        # Only what a live executor takes: a tool left in the catalog by an earlier
        # manifest (or a server gone) would be called and wait out its whole timeout.
        served = self._catalog.served()
        return Offer(provider=settings.provider, model=settings.model,
                     tools=tuple(s for s in specs if offered(s)
                                 and (s.default_pool, s.name) in served),
                     catalog=catalog, permits=self._permits(sid, catalog))

    def _permits(self, sid: str, catalog: Mapping[str, ToolSpec]
                 ) -> Callable[[str, str | None], bool]:
        """Whether the policy lets an agent call a tool of `catalog` in session `sid`,
        remembered by tool, agent and (when the policy grants by session) session."""
        policy = self._policy
        if policy is None:
            return lambda name, agent: True
        where = sid if policy.sessions else ""
        known = self._permitted

        def permits(name: str, agent: str | None) -> bool:
            spec = catalog.get(name)
            if spec is None:
                return False
            found = known.get((name, agent, where))
            if found is not None and found[0] is spec:
                return found[1]
            if len(known) > _PERMITS_KEPT:
                known.clear()
            ok = evaluate(spec, session_id=sid, agent=agent, policy=policy).kind != "reject"
            known[(name, agent, where)] = (spec, ok)
            return ok

        return permits

    def _profile(self, agent: str | None) -> tuple[Rules, ModelSettings]:
        """The rules and model of a turn of `agent`: a named agent's, or the planner's."""
        profile = self._agents.get(agent or "")
        return (self._rules, self._settings) if profile is None else \
            (profile.rules, profile.settings)

    def _reject(self, delivery: Delivery, reason: str, message: str) -> list[Append]:
        entry = self._states.peek(session_of(delivery.subject))
        if entry is None:
            return [self._kernel.generic_rejection(delivery, reason, message)]
        now = self._clock()
        return [Append(TurnFailed(session_id=entry.state.session_id, at=now, actor=ACTOR,
                                  turn_id=t.turn_id, request_id=t.request_id,
                                  reason="internal", message=message,
                                  outcomes=turn_outcomes(entry.state, t)),
                       turn_ended_id(entry.state.session_id, t.turn_id))
                for t in entry.state.turns.values()
                if t.status == "running" and t.message is not None] or \
            [self._kernel.generic_rejection(delivery, reason, message)]

    async def _on_event(self, delivery: Delivery) -> None:
        sid = session_of(delivery.subject)
        if not is_token(sid):
            await delivery.ack()
            return
        if self._stopping:
            return  # nothing new asked while this process stops: for the next owner
        part = partition(sid, self._bus.partitions)
        if not self._owner.holds(part) and not await self._owner.surely_holds(part):
            # Maybe another planner's now (this process was stopped or starved past its
            # lease): left unacknowledged, it goes to the owner, whose state must fold it
            # (the session's next events are not folded in its place meanwhile).
            self._states.handed_back(sid, delivery.stream_seq)
            return
        early = self._early_of.get(sid)
        if early is not None:
            # The turn being planned as it is stored: its session is that task's to read
            # (a new one is not in memory until it is stored), whatever the wait.
            await asyncio.wait({early}, timeout=_EARLY_WAIT_S)  # never cancels it
            if part not in self._partition_loops or self._stopping:
                return  # given up meanwhile: the next owner has it, unacknowledged
        entry = await self._states.entry(sid, at_least=delivery.stream_seq)
        async with entry.lock:
            stored = decode_stored(delivery.stream_seq, delivery.subject, delivery.data)
            if entry.behind:  # an earlier event was handed back unfolded: read past it
                await self._states.read_past_handed_back(entry)
            new = delivery.stream_seq > entry.state.last_seq
            if new and isinstance(stored.event, TurnRequested) and \
                    stored.event.message is not None and _planning(entry.state):
                # Queued behind a planner turn this state holds as running: one that ended
                # by another's hand (the session actor, this process's kernel on a poison
                # message, a planner that held the partition before) is not delivered
                # here, and the new turn would wait for it forever. Read up to it.
                await self._states.reread(entry)
                if entry.state.last_seq < stored.seq:  # a replica behind: this one at least
                    self._states.fold(entry, stored.seq, stored.event)
            elif new:
                self._states.fold(entry, stored.seq, stored.event)
                if _unseen_by(entry.state, stored.event):
                    # About a planner call (or a turn) this state never saw: another
                    # planner wrote the session's events meanwhile (one that held its
                    # partition, stopped past its lease, then went on), which nothing
                    # delivers here. Folded on this state, the result was dropped and
                    # the turn waited forever; read from the log, it goes on.
                    log.info("planner: session %s: a %s names what this process never "
                             "saw; reading the session again", sid,
                             delivery.subject.split(".", 4)[-1])
                    await self._states.rebuild(entry)
            elif delivery.num_delivered > 1 or entry.missed(delivery.stream_seq):
                # Delivered behind what is folded: one never seen (see the session
                # actor); fold the log again.
                await self._states.rebuild(entry)
            if isinstance(stored.event, TurnCancelled):  # folded now: see `_arrived`
                self._folded_cancel(sid, stored.event.turn_id)
            await self._caught_up(entry)
            # A question left unanswered is asked again only where its asker cannot be
            # asking still: a redelivery (the handler that held this died, or handed it
            # back), a session this process left so, or a `model.requested` itself (an
            # earlier planner's consumer). Another live process may be asking it.
            started: list[_Started] = []
            if delivery.num_delivered > 1 or sid in self._left or \
                    isinstance(stored.event, ModelRequested):
                self._left.discard(sid)
                started = await self._recover(entry)
            if started or new or delivery.num_delivered > 1 or \
                    entry.decided_at != entry.state.last_seq:
                if await self._settle(entry, started):
                    # Calls left at the bound: handed back, and asked at its next delivery.
                    await delivery.nak(delay=0.05)
                    return
            # Else folded before a decision that found nothing due, and the state has not
            # changed since (a redelivery, say): nothing can be.
        await delivery.ack()

    def early_turn(self, state: SessionState, event: TurnRequested
                   ) -> Callable[[int | None], None] | None:
        """A planner turn the session actor of this process is storing right after
        `state`: planned now, its model called while `turn.requested` is stored, instead
        of once the stream delivers it here (a round trip of the bus, and this process's
        event loop, later). Returns what to call with the event's stream sequence once
        stored (None if it was not), or None when the turn is left to its delivery: a
        session this planner does not hold folded up to `state`, a partition it does not
        hold, a cluster (where a read can be behind). The delivery still comes and is
        kept unacknowledged while this runs: if the process dies, it is redelivered."""
        sid = event.session_id
        if event.message is None or self._kernel.log.replicated or self._http is None:
            return None
        part = partition(sid, self._bus.partitions)
        if part not in self._partition_loops or not self._owner.holds(part):
            return None
        entry = self._states.peek(sid)
        provisional = None
        if entry is None:
            if state.last_seq != 0:
                return None  # not in memory: read when delivered, as ever
            entry = provisional = self._states.assume_new(sid)
            if entry is None:
                return None
        elif entry.lock.locked() or not entry.is_caught_up or entry.behind or \
                entry.state.last_seq != state.last_seq:
            return None
        stored: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self._early_turn(entry, event, state.last_seq, stored,
                                                    provisional is not None))
        self._early[task] = part
        self._early_of[sid] = task

        def forget(t: asyncio.Task[None]) -> None:
            self._early.pop(t, None)
            if self._early_of.get(sid) is t:
                del self._early_of[sid]

        task.add_done_callback(forget)
        if provisional is not None:  # even if cancelled before it ran
            task.add_done_callback(lambda _: self._states.abandon(provisional))

        def done(seq: int | None) -> None:
            if not stored.done():
                stored.set_result(seq)

        return done

    async def _early_turn(self, entry: Entry, event: TurnRequested, after: int,
                          stored: asyncio.Future[int | None], provisional: bool) -> None:
        sid = event.session_id
        tasks: list[asyncio.Task[ModelResponse | ModelError | None]] = []
        try:
            async with entry.lock:
                if entry.state.last_seq != after:
                    return
                # Decided on the state as it will be once the turn is stored (a copy),
                # the model called now. A session taken as new (none in memory) may have
                # a past after all, which its first write then proves by conflicting:
                # its question is asked once that write is in, not on an empty
                # conversation to be dropped (a paid request) when it conflicts.
                new_session = provisional
                planned = with_turn(entry.state, event)
                items = self._decide(planned)
                if not items:
                    return  # nothing due yet (it waits for the session's turn before it)
                asks = self._asks(planned, items)
                tasks = [] if new_session else [self._start_call(a) for a in asks]
                async with asyncio.timeout(_EARLY_WAIT_S):
                    seq = await stored
                if seq is None or entry.state.last_seq != after:
                    return  # not stored (or something else was folded): its delivery
                self._states.fold(entry, seq, event)
                if provisional:
                    self._states.adopt(entry)
                    provisional = False
                    if self._states.peek(sid) is not entry:
                        return  # its delivery came first and read the session itself
                if [i.msg_id for i in self._decide(entry.state)] != \
                        [i.msg_id for i in items]:
                    return  # it decides otherwise once stored: left to the delivery
                if new_session:  # new indeed
                    tasks = [self._start_call(a) for a in asks]
                self.early_turns += 1
                try:
                    started = await self._store(entry, items, asks, tasks)
                except ConcurrencyError:
                    await self._states.reread(entry)
                    started = []
                tasks = []  # `_store` owns them now
                # Stopped at its bound, the turn goes on at the delivery (`_recover`).
                await self._settle(entry, started)
        except Exception as exc:  # its delivery decides again, or fails it as the kernel does
            self._left.add(sid)  # a question it stored may be unanswered
            log.warning("planner: session %s: planning turn %s as it was stored failed: "
                        "%s; its delivery plans it", sid, event.turn_id, exc)
        finally:
            await _cancel(tasks)

    async def _caught_up(self, entry: Entry) -> None:
        """Read back now what this process wrote that did not land right after the state
        (another event came between): nothing delivers the planner's own events back to
        it (call with the lock)."""
        if not entry.is_caught_up:
            await self._states.reread(entry)

    async def _recover(self, entry: Entry, *, only_ours: bool = False) -> list[_Started]:
        """The model calls of questions stored and never answered, started again: their
        planner died before the answer (this delivery is the one it held, redelivered),
        or a delivery stopped at `_STEPS_PER_DELIVERY`. Never a call still running
        here: each handler waits for its own calls, and this one holds the lock. Their
        `model.requested` are read from the log (it is not delivered here). With
        `only_ours`, only those this process wrote."""
        state = entry.state
        waiting = [t for t in (state.turns[i] for i in state.open_turns)
                   if t.message is not None and t.model_requested > len(t.steps)]
        if not waiting:
            return []
        sid = state.session_id
        log_ = self._kernel.log
        # Mostly the session's last question (from the stream's leader), else its turns'.
        last = await log_.last_of_type(sid, "model.requested")
        asked = [last[0].event] if last is not None and isinstance(last[0].event,
                                                                   ModelRequested) else []
        if only_ours:
            if len(waiting) > 1 or last is None or last[1] != self.instance:
                return []  # another's to ask (or its redelivery's, here)
        elif len(waiting) > 1 or not asked or asked[0].turn_id != waiting[0].turn_id or \
                asked[0].iteration != waiting[0].model_requested:
            asked += [s.event for s in await log_.read_session(
                          sid, after=min(t.seq for t in waiting) - 1,
                          subject_filter=event_filter(sid, "model.requested"))
                      if isinstance(s.event, ModelRequested)]
        started: list[_Started] = []
        for turn in waiting:
            found = [e for e in asked if e.turn_id == turn.turn_id
                     and e.iteration == turn.model_requested]
            if not found and only_ours:
                return []
            if not found:
                await _cancel([task for _, task in started])
                # Passing: delivered again after a backoff, and failed clearly at the end.
                raise BusError(f"session {sid}: the model.requested of turn {turn.turn_id} "
                               f"(iteration {turn.model_requested}) could not be read back")
            ask = self._prepare(state, found[-1])
            if ask is not None:
                log.info("planner: session %s: turn %s asks the model again (iteration %d "
                         "was never answered)", sid, turn.turn_id, turn.model_requested)
                started.append((ask, self._start_call(ask)))
        return started

    def _decide(self, state: SessionState) -> list[Append]:
        sid = state.session_id
        offer = self._offer(sid)
        agents = {name: (self._offer(sid, name), p.rules) for name, p in self._agents.items()}
        return decide(state, offer, now=self._clock(), max_iterations=self._max_iterations,
                      max_tokens=self._max_tokens, rules=self._rules, agents=agents,
                      compression=self._compression, unknown_agent=self._unknown_agent,
                      max_calls=self._max_calls)

    def _unknown_agent(self, agent: str | None) -> str | None:
        """Why a turn's `agent` names nobody (a misspelt `--agent`), or None. With no named
        agents and no grants by agent, any name is a label and none is unknown."""
        policy = self._policy
        granted = policy.agents if policy is not None else {}
        default = policy.default_agent if policy is not None else DEFAULT_AGENT
        if agent is None or agent == default or agent in self._agents or agent in granted \
                or not (self._agents or granted):
            return None
        named = ", ".join(sorted(self._agents)) or "none"
        grants = ", ".join(sorted(granted)) or "none"
        return (f"agent {agent!r} is neither a named agent of agent_config.agents ({named}) "
                f"nor an agent the policy grants tools to (policy.agents: {grants}); check "
                "its spelling")

    async def _settle(self, entry: Entry, started: list[_Started]) -> bool:
        """Decide and write until nothing is due, answering each `model.requested` in
        this handler (killed meanwhile, the delivery it holds is redelivered and asks
        again). The model is called while its `model.requested` is being stored (a call
        has no side effects: if the store loses a race, the answer is dropped), and its
        answer is stored together with what it makes due. True when it stopped at
        `_STEPS_PER_DELIVERY`, maybe with questions stored and not answered."""
        pending: list[_Started] = []
        try:
            for _ in range(_STEPS_PER_DELIVERY):
                if not started:
                    decided = await self._decide_and_ask(entry)
                    if decided is None:
                        # Nothing due, but maybe a question of this process's own left
                        # unanswered: stored by a write whose acknowledgement was lost
                        # (its retry then conflicted with itself), or by a decision a
                        # conflict cut short. Nobody else would ask it.
                        decided = await self._recover(entry, only_ours=True)
                        if not decided:
                            return False
                    started = decided
                    if not started:
                        continue  # stored, asking nothing: what it makes due comes next
                pending, started = started, []
                while pending:
                    ask, task = pending[0]
                    reply = await _reply_of(task)
                    if reply is not _CANCELLED:  # else its turn was cancelled meanwhile
                        started += await self._finish(entry, ask, reply)
                    pending.pop(0)
            return True
        finally:
            left = [task for _, task in [*pending, *started]]
            if left:  # asked again at the session's next handling (`_recover`)
                self._left.add(entry.state.session_id)
                await _cancel(left)

    async def _decide_and_ask(self, entry: Entry) -> list[_Started] | None:
        """One decision written (re-read and re-decided on a conflict); the model calls it
        asks for, started as it is stored: [(ask, task)], empty when it asks none (decide
        again: its own events are not delivered back to trigger that). None when nothing
        is due, or nothing new (every event of the decision was stored already)."""
        for _ in range(DECIDE_ATTEMPTS):
            await self._caught_up(entry)
            items = self._decide(entry.state)
            if not items:
                entry.decided_at = entry.state.last_seq
                return None
            before = entry.state.last_seq
            try:
                started = await self._store(entry, items, self._asks(entry.state, items))
            except ConcurrencyError:
                await self._states.reread(entry)
                continue
            return started if started or entry.state.last_seq != before else None
        log.warning("planner: session %s: gave up deciding after %d conflicts",
                    entry.state.session_id, DECIDE_ATTEMPTS)
        return None

    def _asks(self, state: SessionState, items: Sequence[Append]) -> list[_Ask]:
        """The model calls among `items` to make (see `_prepare`)."""
        return [a for a in (self._prepare(state, i.event) for i in items
                            if isinstance(i.event, ModelRequested)) if a is not None]

    def _prepare(self, state: SessionState, asked: Any) -> _Ask | None:
        """What to send for `asked` (its turn running and the iteration unanswered), or
        None; the state may or may not hold `asked` itself yet."""
        if not isinstance(asked, ModelRequested):
            return None
        turn = state.turns.get(asked.turn_id)
        if turn is None or turn.status != "running" or len(turn.steps) >= asked.iteration:
            return None
        sid = state.session_id
        if turn.turn_id in self._cancelling.get(sid, ()):
            return None  # cancelled: its `turn.cancelled` is on its way
        rules, settings = self._profile(turn.agent)
        schema: dict[str, Any] | None = None
        validator: Validator | None = None
        tools: list[ToolSpec] = []
        publish: _Deltas | None = None
        if asked.purpose == "match":
            system: str | None = match_prompt(rules)
            messages = transcript(state, turn, self._compression, self._history)
            schema = match_schema(rules)
            validator = validator_for(schema)
        elif asked.purpose == "think":
            try:
                found = rules.step(asked.step or "") or _request_step(turn, asked.step)
            except ConfigError as exc:  # stored before such a schema was refused at once
                return _Ask(asked, turn, rules, settings, failure=(
                    f"think step {asked.step!r}: its output_schema cannot be used: {exc}"))
            if found is None:
                return _Ask(asked, turn, rules, settings, failure=(
                    f"this planner has no think step {asked.step!r}: is its manifest the "
                    "one that started the turn?"))
            step, validator = found
            system = think_prompt(rules, turn, step)
            messages = think_messages(state, turn, step.id, self._compression,
                                      self._history)
            schema = step.output_schema
        else:
            system = system_prompt(rules, turn)
            messages = transcript(state, turn, self._compression, self._history)
            tools = offered_tools(rules, self._offer(sid, turn.agent), turn)
            publish = self._delta_publisher(sid, asked)
            if rules.mode == "composed":
                schema = composed_schema(tools, rules.output_schema, emit_output=EMIT_OUTPUT)
                validator = validator_for(schema)
                system = composed_prompt(system, schema)
                messages = flatten(messages)
                tools, publish = [], None  # deltas would show raw JSON
        # Call ids number every call the model asked for in the turn, the planner's own
        # (emit_output, never in `call_ids`) included, so none is given twice.
        base = max(len(turn.call_ids), sum(len(s.tool_calls) for s in turn.steps))
        return _Ask(asked, turn, rules, settings, system=system, messages=messages,
                    tools=tools, schema=schema, validator=validator, publish=publish,
                    base=base, wire=self._history.wire(sid))

    def _start_call(self, ask: _Ask) -> asyncio.Task[ModelResponse | ModelError | None]:
        """`_call` as a task, which a `turn.cancelled` of its turn cancels (`_cancelled`):
        a turn superseded while its model thinks (retrying a slow provider, perhaps for
        minutes) must not hold up the turn that replaced it."""
        task = asyncio.create_task(self._call(ask))
        sid, turn_id = ask.asked.session_id, ask.asked.turn_id
        calls = self._in_flight.setdefault(sid, {})
        calls[task] = turn_id

        def done(_: object) -> None:
            calls.pop(task, None)
            if not calls and self._in_flight.get(sid) is calls:
                del self._in_flight[sid]

        task.add_done_callback(done)
        return task

    def _arrived(self, delivery: Delivery) -> None:
        """A `turn.cancelled` arrived: stop the model calls of that turn now, before its
        delivery waits for the session's one being handled (which may be waiting for
        those very calls)."""
        if not delivery.subject.endswith(_CANCELLED_SUFFIX):
            return
        sid = session_of(delivery.subject)
        event = decode_stored(delivery.stream_seq, delivery.subject, delivery.data).event
        if not isinstance(event, TurnCancelled):
            return
        # Until the cancellation is folded, its turn asks the model nothing more (its
        # `model.requested`, delivered before it, would).
        self._cancelling.setdefault(sid, set()).add(event.turn_id)
        for task, turn_id in list(self._in_flight.get(sid, {}).items()):
            if turn_id == event.turn_id:
                task.cancel()

    def _folded_cancel(self, sid: str, turn_id: str) -> None:
        waiting = self._cancelling.get(sid)
        if waiting is not None:
            waiting.discard(turn_id)
            if not waiting:
                del self._cancelling[sid]

    async def _call(self, ask: _Ask) -> ModelResponse | ModelError | None:
        """The model's reply to `ask`, or the `ModelError` that ended it (returned); None
        when there is nothing to call (`ask.failure`). The message being handled is kept
        from redelivery meanwhile by its pull loop (in-progress acks of every message a
        session's handler holds or has waiting)."""
        if ask.failure is not None:
            return None
        for attempt in range(1, _WHOLE_CALL_ATTEMPTS + 1):
            try:
                return await complete(ask.settings, system=ask.system,
                                      messages=ask.messages, tools=ask.tools,
                                      response_schema=ask.schema, on_delta=ask.publish,
                                      client=self._http, memo=ask.wire)
            except ModelError as exc:
                if not exc.partial or attempt == _WHOLE_CALL_ATTEMPTS:
                    return exc
                # The stream broke after some text: the call is made again whole, and
                # watchers are told to drop what they showed of this iteration.
                log.warning("planner: session %s: %s; asking again",
                            ask.asked.session_id, exc)
                if ask.publish is not None:
                    await ask.publish("", reset=True)
        raise AssertionError("unreachable")

    async def _finish(self, entry: Entry, ask: _Ask, reply: ModelResponse | ModelError | None
                      ) -> list[_Started]:
        """Store the model's answer (or end the turn with its error) together with what it
        makes due, and start the model calls that asks for."""
        asked, rules = ask.asked, ask.rules
        state = entry.state
        turn = state.turns.get(asked.turn_id)
        if turn is None or turn.status != "running" or len(turn.steps) >= asked.iteration:
            return []  # answered or ended while the model was thinking
        if ask.failure is not None or reply is None:
            await self._fail_turn(entry, turn, "internal", ask.failure or "no reply")
            return []
        if isinstance(reply, ModelError):
            await self._fail_turn(entry, turn, "model_error", str(reply))
            return []
        sid = state.session_id
        output: Any = None
        violations: list[str] = []
        calls: list[ModelToolCall] = []
        text = reply.text
        if asked.purpose == "chat" and rules.mode == "composed":
            assert ask.validator is not None
            text, calls, violations = read_composed(
                reply.text, ask.validator, turn_id=turn.turn_id, base=ask.base,
                emit_output=EMIT_OUTPUT if rules.emit is not None else None,
                wrapped=_wrapped(rules.output_schema))
        elif asked.purpose == "chat":
            calls = _with_turn_unique_ids(turn, [
                ModelToolCall(call_id=call_id_for(turn.turn_id, ask.base + i), id=c.id,
                              name=c.name, arguments=_as_sent(c), extra=c.extra)
                for i, c in enumerate(reply.tool_calls)])
        else:
            output, violations = parse_structured(reply.text, ask.validator)
        answer = ModelResponded(
            session_id=sid, at=self._clock(), actor=ACTOR, turn_id=turn.turn_id,
            iteration=asked.iteration, text=text, tool_calls=calls,
            finish_reason=reply.finish_reason, input_tokens=reply.usage.input_tokens,
            output_tokens=reply.usage.output_tokens, latency_ms=float(reply.latency_ms),
            response_id=reply.response_id, purpose=asked.purpose, step=asked.step,
            round=asked.round, output=output, violations=violations)
        # A fact: stored even if the check fails, and never after what follows from it.
        item = Append(answer, model_responded_id(sid, turn.turn_id, asked.iteration),
                      fact=True)
        # What the answer makes due, decided on the state as it will be once the answer
        # is stored (a copy: this state changes only when the store succeeds), and stored
        # with it: one round trip instead of two, and the calls it dispatches no hop
        # through the approval and session actors.
        follow: list[Append] = []
        asks: list[_Ask] = []
        if entry.is_caught_up:
            after = with_answer(state, answer)
            follow = self._decide(after)
            if self._approver is not None:
                follow = settle_calls(after, follow, self._approver,
                                      max_parallel=self._max_parallel, now=self._clock())
            if any(isinstance(i.event, CallRequested) for i in follow):
                # Stored behind the answer, which alone is checked: should a cancellation
                # (`trigger_processing`) be stored first, none of these calls may be.
                follow = [dataclasses.replace(i, unless_cancelled_after=state.last_cancelled_seq)
                          for i in follow]
            asks = self._asks(after, follow)
        try:
            # Checked, so that it is folded now only if nothing was stored meanwhile (a
            # tool event injected during the model call must not be skipped over).
            return await self._store(entry, [item, *follow], asks)
        except EventTooLargeError as exc:
            # A reply under the transport's limit can still be too large for an event
            # (a long text, many or large calls): nothing of it was stored (each event is
            # size-checked before any is sent). A model error, as any unusable reply.
            await self._fail_turn(entry, turn, "model_error",
                                  f"the model's reply is too large to store ({exc.size} "
                                  f"bytes as an event; the limit is {exc.limit}): bound its "
                                  "length with agent_config.model.max_tokens")
            return []
        except ConcurrencyError:
            # Something was stored during the call (a tool event): the answer is kept
            # (stored already, ahead of what was pipelined behind it, on a single
            # server), and what it makes due decided again on the log as it is.
            await self._kernel.log.append(item)
            await self._states.reread(entry)
            return []

    async def _store(self, entry: Entry, items: list[Append], asks: list[_Ask],
                     started: Sequence[asyncio.Task[ModelResponse | ModelError | None]] = ()
                     ) -> list[_Started]:
        """Write a decision (checked; `ConcurrencyError` on a conflict) with the model calls
        it asks for started beside the store, and the approval actor told what is being
        decided inline; the calls are cancelled if the store fails. A decision that did
        not land right after this state (another session's event came between) is read
        back before its answers are stored."""
        tasks = list(started) or [self._start_call(a) for a in asks]
        stored = self._storing_inline(items)
        try:
            if tasks and not started:
                # The model calls go out before the store: the model's round trip is the
                # longer of the two.
                await asyncio.sleep(0)
            results = await self._states.write(entry, items)
        except BaseException:
            stored(False)
            await _cancel(tasks)
            raise
        stored(True)
        if results[0].duplicate:
            # Stored already: another planner decided the same (two of them held the
            # partition for a moment). Its calls are its own to make and answer.
            await _cancel(tasks)
            await self._states.reread(entry)
            return []
        try:
            await self._caught_up(entry)
        except BaseException:
            await _cancel(tasks)
            raise
        return list(zip(asks, tasks, strict=True))

    def _storing_inline(self, items: Sequence[Append]) -> Callable[[bool], None]:
        """Tell the approval actor of this process which decisions are being stored, so
        that it waits for the store instead of deciding the calls again; call the result
        with whether the store succeeded."""
        keys = [(i.event.session_id, i.event.call_id) for i in items
                if isinstance(i.event, CallApproved | CallRejected)]
        if self._approval is None or not keys:
            return _nothing
        return self._approval.storing_inline(keys)

    async def _fail_turn(self, entry: Entry, turn: TurnState, reason: str,
                         message: str) -> None:
        sid = entry.state.session_id
        failed = TurnFailed(session_id=sid, at=self._clock(), actor=ACTOR,
                            turn_id=turn.turn_id, request_id=turn.request_id, reason=reason,
                            message=clip(message), outcomes=turn_outcomes(entry.state, turn))
        item = Append(failed, turn_ended_id(sid, turn.turn_id))
        try:
            await self._states.write(entry, [item])
        except ConcurrencyError:
            await self._kernel.log.append(item)
            await self._states.reread(entry)
        else:
            await self._caught_up(entry)

    def _delta_publisher(self, sid: str, asked: ModelRequested) -> _Deltas:
        """Text deltas, live and not stored: `toolbus.live.<sid>.model.delta`; `reset`
        says to drop the text shown so far of this iteration (it is asked again)."""
        subject = f"{LIVE_PREFIX}.{sid}.model.delta"
        nc = self._bus.nc

        async def publish(text: str, *, reset: bool = False) -> None:
            # A delta is shown, not stored: one too large for a message (a model can send
            # megabytes in one) goes in pieces, and one that cannot be published is lost
            # to the watchers only, never the end of the model call (which would be taken
            # for a bus error, and the whole question asked again).
            pieces = [text[i:i + _DELTA_CHARS] for i in range(0, len(text), _DELTA_CHARS)]
            for i, piece in enumerate(pieces or [""]):
                body = _encode({"type": "model.delta", "turn_id": asked.turn_id,
                                "iteration": asked.iteration, "text": piece,
                                **({"reset": True} if reset and i == 0 else {})})
                try:
                    await nc.publish(subject, body)
                except Exception as exc:
                    log.debug("planner: session %s: a text delta was not published: %s",
                              sid, exc)
                    return

        return publish


__all__ = ["ACTOR", "EMIT_OUTPUT", "REASON", "Offer", "Planner", "Rules", "decide",
           "offered_tools", "system_prompt", "transcript"]
