"""Approval actor.

Consumes: `call.requested` (durable consumer `approval`), and human decisions as requests
on `toolbus.approval.<sid>.<call_id>` (queue group `approval`).
Emits: exactly one policy decision per call, `call.approved`, `approval.requested` or
`call.rejected`, each naming the rule that made it (schemas/policy.py); then, for a call
that asked, the first of `approval.granted` / `approval.denied` (a human, or the timeout).
Idempotency: the policy decision has the message id `<sid>:<call_id>:policy`; a
redelivered request whose decision is already in the log is skipped. Human decisions are
appended with an expected last sequence of 0 on `toolbus.evt.<sid>.approval.*.<call_id>`,
so the first decision wins, atomically, across any number of approval processes; later
ones are told who decided first.
Nothing is dispatched from here: the session actor dispatches approved calls, under the
parallel and side-effect rules, and fails denied ones. One janitor duty lives here, next
to the timeouts: calls sent with `_instance` to an executor instance that is gone are
ended `call.failed` (`instance_unavailable`), instead of waiting for it forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec

from bus.approvals import ApprovalStore
from bus.catalog import Catalog
from bus.connection import Bus
from bus.consumer import Delivery, PullLoop
from bus.eventlog import Append, EventLog, decode_stored
from bus.rpc import Responder
from bus.streams import ConsumerSpec, instance_backlogs
from bus.subjects import (
    APPROVAL_PREFIX,
    EVENTS_PREFIX,
    EVENTS_STREAM,
    approval_decision_filter,
)
from schemas.errors import ConcurrencyError, InvalidIdError
from schemas.events import (
    ApprovalDenied,
    ApprovalGranted,
    ApprovalRequested,
    CallApproved,
    CallDispatched,
    CallFailed,
    CallRejected,
    CallRequested,
    Event,
)
from schemas.ids import check_session_id, is_token, split_tool_name
from schemas.policy import HumanDecision, PendingApproval, Policy, evaluate
from schemas.tools import instance_route
from schemas.validation import CompiledTools, describe

log = logging.getLogger("toolbus.approval")

ACTOR = "approval"
InstanceLookup = Callable[[str], "frozenset[str] | None"]


def _no_instances(name: str) -> frozenset[str] | None:
    return None


def decide(call: CallRequested, tools: CompiledTools, policy: Policy, *, now: float,
           instances: InstanceLookup = _no_instances) -> CallApproved | ApprovalRequested | \
        CallRejected:
    """The policy decision for one requested call. Pure."""
    sid, tool = call.session_id, call.tool

    def reject(reason: str, rule: str, message: str) -> CallRejected:
        return CallRejected(session_id=sid, at=now, actor=ACTOR, call_id=call.call_id,
                            turn_id=call.turn_id, tool=tool, reason=reason, message=message,
                            rule=rule)

    try:
        split_tool_name(tool)
    except InvalidIdError as exc:
        return reject("invalid_tool_name", "catalog:name", str(exc))
    compiled = tools.get(tool)
    if compiled is None:
        return reject("unknown_tool", "catalog:unknown_tool",
                      f"no tool named {tool!r} is registered; `toolbus tools` lists them")
    spec = compiled.spec
    arguments = call.arguments
    if not isinstance(arguments, dict):
        kind = {list: "an array", type(None): "null"}.get(type(arguments),
                                                            type(arguments).__name__)
        return reject("invalid_arguments", "schema",
                      f"arguments of {tool} must be a JSON object, got {kind}")
    if compiled.args is None:
        return reject("invalid_tool_schema", "schema", compiled.error or "unusable schema")
    arguments, violations = compiled.args.check(arguments)
    if violations:
        return reject("invalid_arguments", "schema",
                      describe(violations, f"arguments of {tool}"))
    if call.delegate is not None and call.delegate not in spec.pools:
        return reject("unknown_pool", "route:pool",
                      f"_delegate {call.delegate!r}: {tool} runs in pool(s) "
                      f"{', '.join(spec.pools)}; start an executor with --pool "
                      f"{call.delegate} that has this tool to use that pool")
    if call.instance is not None:
        held = instances(call.instance)
        if held is None:
            return reject("unknown_instance", "route:instance",
                          f"_instance {call.instance!r}: no live executor has that name; "
                          "`toolbus executors` lists them")
        if tool not in held:
            return reject("unknown_instance", "route:instance",
                          f"_instance {call.instance!r} does not have the tool {tool}")
        route = instance_route(call.instance, spec.namespace)
    else:
        route = spec.route(call.delegate)
    d = evaluate(spec, session_id=sid, agent=call.agent, policy=policy)
    if d.kind == "reject":
        return reject("policy_denied", d.rule, d.message)
    common: dict[str, Any] = dict(session_id=sid, at=now, actor=ACTOR, call_id=call.call_id,
                                  turn_id=call.turn_id, tool=tool, rule=d.rule,
                                  arguments=arguments, route=route, timeout_ms=spec.timeout_ms,
                                  side_effect=d.side_effect, risk=d.risk)
    if d.kind == "ask":
        return ApprovalRequested(**common, reason=d.message,
                                 expires_at=now + policy.approval_timeout_s)
    return CallApproved(**common)


class ApprovalActor:
    def __init__(self, bus: Bus, catalog: Catalog, *, policy: Policy,
                 clock: Callable[[], float] = time.time, sweep_interval_s: float = 0.5,
                 instance_sweep_s: float = 5.0) -> None:
        self._bus = bus
        self._log = EventLog(bus)
        self._catalog = catalog
        self._tools = CompiledTools(catalog.get)
        self._policy = policy
        self._clock = clock
        self._store = ApprovalStore(bus)
        self._sweep_interval_s = sweep_interval_s
        self._instance_sweep_s = instance_sweep_s
        self._requests = PullLoop(
            bus, ConsumerSpec(EVENTS_STREAM, "approval",
                              (f"{EVENTS_PREFIX}.*.call.requested",)),
            self._on_requested, max_in_flight=256)
        self._rpc = Responder(bus, f"{APPROVAL_PREFIX}.*.*", self._on_decision,
                              queue="approval")
        self._sweeper: asyncio.Task[None] | None = None
        # Calls decided inline by the session actor of this process: the consumer acks
        # them without deciding again.
        self._inline: OrderedDict[tuple[str, str], None] = OrderedDict()

    def decide_inline(self, call: CallRequested) -> CallApproved | CallRejected | None:
        """The decision for a call the session actor in this process is accepting, when no
        human is needed (None otherwise: those go through the consumer, which records
        the pending approval)."""
        decision = decide(call, self._tools, self._policy, now=self._clock(),
                          instances=self._catalog.instance_tools)
        return None if isinstance(decision, ApprovalRequested) else decision

    def stored_inline(self, keys: list[tuple[str, str]]) -> None:
        """The session actor stored these (session, call) decisions: the consumer may skip
        them. Only after the store succeeded, so a skipped call is never left undecided."""
        for key in keys:
            self._inline[key] = None
        while len(self._inline) > 100_000:
            self._inline.popitem(last=False)

    async def start(self) -> None:
        await self._store.start()
        await self._requests.start()
        await self._rpc.start()
        self._sweeper = asyncio.create_task(self._sweep(), name="approval-timeouts")

    async def stop(self, grace: float = 5.0) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        await self._rpc.stop()
        await self._requests.stop(grace)
        await self._store.stop()

    # -- policy decisions

    async def _on_requested(self, delivery: Delivery) -> None:
        stored = decode_stored(delivery.stream_seq, delivery.subject, delivery.data)
        call = stored.event
        if not isinstance(call, CallRequested):
            log.error("not a call.requested at seq %d: %s", stored.seq, stored.error)
            await delivery.term()
            return
        key = (call.session_id, call.call_id)
        if key in self._inline:
            del self._inline[key]
            await delivery.ack()  # decided and stored with the request, in this process
            return
        stored_decision = None
        if delivery.num_delivered > 1:
            stored_decision = await self._stored_decision(call)
        if stored_decision is None:
            decision = decide(call, self._tools, self._policy, now=self._clock(),
                              instances=self._catalog.instance_tools)
            await self._log.append(Append(decision,
                                          f"{call.session_id}:{call.call_id}:policy"))
        else:
            decision = stored_decision  # a redelivery: only finish what may be missing
        if isinstance(decision, ApprovalRequested):
            _, decided = await self._approval_history(call.session_id, call.call_id) \
                if stored_decision is not None else (None, None)
            if decided is None:
                await self._store.put(PendingApproval(
                    session_id=call.session_id, call_id=call.call_id, turn_id=call.turn_id,
                    tool=call.tool, arguments=decision.arguments, rule=decision.rule,
                    reason=decision.reason, risk=decision.risk, requested_at=decision.at,
                    expires_at=decision.expires_at))
        await delivery.ack()

    async def _stored_decision(self, call: CallRequested
                               ) -> CallApproved | ApprovalRequested | CallRejected | None:
        for stored in await self._log.read_session(call.session_id):
            ev = stored.event
            if isinstance(ev, CallApproved | ApprovalRequested | CallRejected) and \
                    ev.call_id == call.call_id:
                return ev
        return None

    # -- human decisions and timeouts

    async def _approval_history(self, sid: str, call_id: str
                                ) -> tuple[ApprovalRequested | None, Event | None]:
        requested: ApprovalRequested | None = None
        decided: Event | None = None
        for stored in await self._log.read_session(
                sid, subject_filter=f"{EVENTS_PREFIX}.{sid}.approval.>"):
            ev = stored.event
            if getattr(ev, "call_id", None) != call_id:
                continue
            if isinstance(ev, ApprovalRequested):
                requested = ev
            elif isinstance(ev, ApprovalGranted | ApprovalDenied) and decided is None:
                decided = ev
        return requested, decided

    async def _append_decision(self, event: ApprovalGranted | ApprovalDenied) -> bool:
        """Store a decision if it is the first for its call; False if another was first."""
        sid, call_id = event.session_id, event.call_id
        try:
            result = await self._log.append(
                Append(event, f"{sid}:{call_id}:decision", call_id), expect_last=0,
                expect_subject=approval_decision_filter(sid, call_id))
        except ConcurrencyError:
            return False
        await self._store.delete(sid, call_id)
        if not result.duplicate:
            return True
        # The id was stored already: our own retry, or another decision in the dedup
        # window. The log says which.
        _, first = await self._approval_history(sid, call_id)
        return type(first) is type(event) and getattr(first, "by", None) == event.by

    async def _on_decision(self, subject: str, data: bytes) -> bytes:
        parts = subject[len(APPROVAL_PREFIX) + 1:].split(".")
        if len(parts) != 2 or not all(is_token(p) for p in parts):
            return _reply(False, f"{subject}: expected toolbus.approval.<session>.<call_id>")
        sid, call_id = parts
        check_session_id(sid)
        try:
            body = msgspec.json.decode(data, type=HumanDecision)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return _reply(False, f"bad decision: {exc}; send "
                                 '{"decision": "approve"|"deny", "by": "...", '
                                 '"note": "...", "reason": "..."}')
        if body.decision == "deny" and not body.reason:
            return _reply(False, "a denial needs a reason (it is what the model will read)")
        requested, decided = await self._approval_history(sid, call_id)
        if requested is None:
            return _reply(False, f"call {call_id} of session {sid} is not waiting for "
                                 "approval (unknown, or decided by the policy alone)")
        now = self._clock()
        if decided is None and now >= requested.expires_at:
            await self._expire(requested)
            _, decided = await self._approval_history(sid, call_id)
        if decided is not None:
            return _reply(False, _already(decided), decided=_kind(decided))
        event: ApprovalGranted | ApprovalDenied
        if body.decision == "approve":
            event = ApprovalGranted(session_id=sid, at=now, actor=ACTOR, call_id=call_id,
                                    turn_id=requested.turn_id, by=body.by, note=body.note)
        else:
            event = ApprovalDenied(session_id=sid, at=now, actor=ACTOR, call_id=call_id,
                                   turn_id=requested.turn_id, by=body.by,
                                   reason=body.reason or "")
        if not await self._append_decision(event):
            _, decided = await self._approval_history(sid, call_id)
            return _reply(False, _already(decided), decided=_kind(decided))
        return _reply(True, None, decided=_kind(event))

    async def _expire(self, requested: ApprovalRequested) -> None:
        waited = requested.expires_at - requested.at
        await self._append_decision(ApprovalDenied(
            session_id=requested.session_id, at=self._clock(), actor=ACTOR,
            call_id=requested.call_id, turn_id=requested.turn_id, by="toolbus",
            reason=f"timeout: no decision within {waited:g} s", rule="timeout"))

    async def _sweep(self) -> None:
        last_instances = 0.0
        while True:
            await asyncio.sleep(self._sweep_interval_s)
            now = self._clock()
            if now - last_instances >= self._instance_sweep_s:
                last_instances = now
                try:
                    await self._fail_calls_of_gone_instances()
                except Exception as exc:  # a NATS outage: the next sweep tries again
                    log.warning("sweeping calls of gone executor instances failed: %s", exc)
            for item in self._store.pending():
                if item.expires_at > now:
                    continue
                try:
                    requested, decided = await self._approval_history(item.session_id,
                                                                      item.call_id)
                    if decided is None and requested is not None:
                        await self._expire(requested)
                    else:
                        await self._store.delete(item.session_id, item.call_id)
                except Exception as exc:  # a NATS outage: the next sweep tries again
                    log.warning("approval timeout of %s failed: %s", item.call_id, exc)


    async def _fail_calls_of_gone_instances(self) -> None:
        """A call sent to one executor instance (`_instance`) that is gone would wait for
        it forever: end it `call.failed` (`instance_unavailable`, retryable), or
        `interrupted` if it had started a tool that may not run twice. The terminal id is
        the executor's own, so if the instance returns it finds the call ended."""
        for backlog in await instance_backlogs(self._bus):
            if self._catalog.instance_tools(backlog.instance) is not None:
                continue  # alive: its calls are only queued
            for stored in await self._log.read_session(
                    "", after=backlog.after_seq, subject_filter=backlog.filter_subject):
                d = stored.event
                if not isinstance(d, CallDispatched):
                    continue
                started, ended = await self._log.call_progress(d.session_id, d.call_id)
                if ended:
                    continue
                if started and not self._rerunnable(d.tool):
                    kind, why = "interrupted", "stopped while running it"
                else:
                    kind, why = "instance_unavailable", "is gone before running it"
                failed = CallFailed(
                    session_id=d.session_id, at=self._clock(), actor=ACTOR,
                    call_id=d.call_id, turn_id=d.turn_id, error_type=kind,
                    retryable=kind == "instance_unavailable",
                    message=f"executor instance {backlog.instance} (named by _instance) {why}"
                            f" {d.tool}; call it again without _instance, or start that "
                            "instance first")
                await self._log.append(Append(failed, f"{d.session_id}:{d.call_id}:terminal"))
                log.warning("call %s of session %s: %s", d.call_id, d.session_id, kind)

    def _rerunnable(self, tool: str) -> bool:
        spec = self._catalog.get(tool)
        return spec is not None and spec.rerunnable


def _kind(event: Event | None) -> str | None:
    if isinstance(event, ApprovalGranted):
        return "approved"
    if isinstance(event, ApprovalDenied):
        return "denied"
    return None


def _already(event: Event | None) -> str:
    if isinstance(event, ApprovalGranted):
        return f"already decided: approved by {event.by}"
    if isinstance(event, ApprovalDenied):
        return f"already decided: denied by {event.by} ({event.reason})"
    return "already decided"


def _reply(ok: bool, error: str | None, *, decided: str | None = None) -> bytes:
    out: dict[str, Any] = {"ok": ok}
    if decided is not None:
        out["decision"] = decided
    if error is not None:
        out["error"] = error
    return msgspec.json.encode(out)
