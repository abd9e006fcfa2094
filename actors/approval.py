"""Approval actor.

Consumes: `call.requested` (durable consumer `approval`), and human decisions as requests
on `toolbus.approval.<sid>.<call_id>` (queue group `approval`).
Emits: exactly one policy decision per call, `call.approved`, `approval.requested` or
`call.rejected`, each naming the rule that made it (schemas/policy.py); then, for a call
that asked, the first of `approval.granted` / `approval.denied` (a human, or the timeout).
Idempotency: the policy decision has one message id per call (schemas/ids.py); a
redelivered request whose decision is already in the session's state is skipped. Human decisions are
appended with an expected last sequence of 0 on `toolbus.evt.<sid>.approval.*.<call_id>`,
so the first decision wins, atomically, across any number of approval processes; later
ones are told who decided first.
Nothing is dispatched from here: the session actor dispatches approved calls, under the
parallel and side-effect rules, and fails denied ones. A `call.requested` this actor cannot
handle ends `call.failed` (`internal`) through the kernel.
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

from actors import metrics
from actors.kernel import Inbox, Kernel, PoisonError, SessionStates, outgoing_headers
from bus.approvals import ApprovalStore
from bus.catalog import Catalog
from bus.connection import Bus
from bus.consumer import Delivery
from bus.eventlog import Append, decode_stored
from bus.rpc import Responder
from bus.streams import ConsumerSpec
from bus.subjects import (
    APPROVAL_PREFIX,
    EVENTS_STREAM,
    approval_decision_filter,
    type_filter,
)
from bus.tasks import stop_task
from schemas.defaults import ACK_WAIT_S
from schemas.errors import ConcurrencyError, InvalidIdError, RpcError
from schemas.events import (
    ApprovalDenied,
    ApprovalGranted,
    ApprovalRequested,
    CallApproved,
    CallFailed,
    CallRejected,
    CallRequested,
    Event,
    clip,
)
from schemas.ids import (
    call_terminal_id,
    human_decision_id,
    is_token,
    policy_decision_id,
    split_tool_name,
)
from schemas.policy import HumanDecision, PendingApproval, Policy, evaluate
from schemas.state import CallState
from schemas.tools import instance_route
from schemas.validation import CompiledTools, describe

log = logging.getLogger("toolbus.approval")

ACTOR = "approval"
# How long a `call.requested` waits for the store of its inline decision (see
# `storing_inline`) before deciding it here anyway (deduplicated by the decision's id).
_INLINE_WAIT_S = 5.0
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
                            turn_id=call.turn_id, tool=tool, reason=reason,
                            message=clip(message), rule=rule)

    if call.refused is not None:  # its writer refused it already: stored alike
        return reject(call.refused.reason, call.refused.rule, call.refused.message)
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
        kind = {list: "an array", type(None): "null", str: "a string", bool: "a boolean",
                int: "a number", float: "a number"}.get(type(arguments),
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


def pending_of(call: CallState, session_id: str) -> PendingApproval | None:
    """What `toolbus approvals` lists for a call waiting for a human; None if it is not."""
    if call.status != "awaiting_approval" or call.approval_expires_at is None:
        return None
    return PendingApproval(session_id=session_id, call_id=call.call_id, turn_id=call.turn_id,
                           tool=call.tool, arguments=call.approved_arguments or {},
                           rule=call.rule or "", reason=call.approval_reason or "",
                           risk=call.risk, requested_at=call.approval_requested_at or 0.0,
                           expires_at=call.approval_expires_at)


def decide_human(call: CallState | None, body: HumanDecision, *, session_id: str,
                 call_id: str, now: float, principal: str | None = None
                 ) -> ApprovalGranted | ApprovalDenied:
    """A human's decision on a call, as the event to store; `RpcError` if it cannot be
    taken (unknown call, not waiting, already decided, expired)."""
    if len(body.by) > 128 or len(body.note or "") > 4000 or len(body.reason or "") > 4000:
        raise RpcError("invalid", "by is at most 128 characters; note and reason at most "
                                  "4000")
    if body.decision == "deny" and not body.reason:
        raise RpcError("invalid", "a denial needs a reason (it is what the model will read)")
    if call is None or call.approval_expires_at is None:
        raise RpcError("not_found", f"call {call_id} of session {session_id} is not waiting "
                                    "for approval (unknown, or decided by the policy alone)")
    if call.human_decision is not None:
        raise RpcError("conflict", _already(call), decision=call.human_decision)
    if call.terminal:
        why = f": {call.error.message}" if call.error is not None else ""
        raise RpcError("conflict", f"the call already ended ({call.status}){why}")
    if now >= call.approval_expires_at:
        raise RpcError("conflict", "already decided: the approval timed out")
    if body.decision == "approve":
        return ApprovalGranted(session_id=session_id, at=now, actor=ACTOR, call_id=call_id,
                               turn_id=call.turn_id, by=body.by, note=body.note,
                               principal=principal)
    return ApprovalDenied(session_id=session_id, at=now, actor=ACTOR, call_id=call_id,
                          turn_id=call.turn_id, by=body.by, reason=body.reason or "",
                          principal=principal)


def expire(call: CallState, session_id: str, *, now: float) -> ApprovalDenied:
    waited = (call.approval_expires_at or now) - (call.approval_requested_at or now)
    return ApprovalDenied(session_id=session_id, at=now, actor=ACTOR, call_id=call.call_id,
                          turn_id=call.turn_id, by="toolbus", rule="timeout",
                          reason=f"timeout: no decision within {waited:g} s")


# --- effects ----------------------------------------------------------------------------


class ApprovalActor:
    def __init__(self, bus: Bus, catalog: Catalog, *, policy: Policy,
                 clock: Callable[[], float] = time.time,
                 sweep_interval_s: float = 0.5) -> None:
        self._kernel = Kernel(bus, ACTOR, clock=clock)
        self._states = SessionStates(bus, self._kernel.log, size=1024)
        self._log = self._kernel.log
        self._catalog = catalog
        self._tools = CompiledTools(catalog.get)
        self._policy = policy
        self._clock = clock
        self._store = ApprovalStore(bus)
        self._sweep_interval_s = sweep_interval_s
        self._kernel.add(Inbox(
            ConsumerSpec(EVENTS_STREAM, "approval", (type_filter("call.requested"),),
                         ack_wait_s=ACK_WAIT_S * 10),
            self._on_requested, self._reject, ordered=False, yields=True))
        self._rpc = Responder(bus, f"{APPROVAL_PREFIX}.*.*.*", self._on_decision,
                              queue="approval")
        self._sweeper: asyncio.Task[None] | None = None
        self._unwatch: Callable[[], None] = lambda: None
        # Calls decided inline by the session actor of this process: the consumer acks
        # them without deciding again.
        # (session, call) -> None: decided and stored by an actor of this process; a
        # future: being stored right now (True once stored, False if the store failed).
        self._inline: OrderedDict[tuple[str, str], asyncio.Future[bool] | None] = \
            OrderedDict()

    @property
    def kernel(self) -> Kernel:
        return self._kernel

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
        self._trim()

    def storing_inline(self, keys: list[tuple[str, str]]) -> Callable[[bool], None]:
        """These decisions are being stored now: a `call.requested` delivered meanwhile
        waits for the outcome (the planner's store of a model's calls and their decisions
        is answered about when the consumer gets the call). Call the returned function
        with whether the store succeeded; on False the consumer decides as usual."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        for key in keys:
            self._inline[key] = future
        self._trim()

        def done(stored: bool) -> None:
            if not future.done():
                future.set_result(stored)
            for key in keys:
                if self._inline.get(key) is future:
                    if stored:
                        self._inline[key] = None
                    else:
                        del self._inline[key]

        return done

    def _trim(self) -> None:
        while len(self._inline) > 100_000:
            self._inline.popitem(last=False)

    async def start(self) -> None:
        await self._store.start()
        self._unwatch = metrics.watch("approvals",
                                      lambda: [({}, float(len(self._store.pending())))])
        await self._kernel.start()
        await self._rpc.start()
        self._sweeper = asyncio.create_task(self._sweep(), name="approval-timeouts")

    async def stop(self, grace: float = 5.0) -> None:
        await stop_task(self._sweeper)
        await self._rpc.stop()
        await self._kernel.stop(grace)
        self._unwatch()
        await self._store.stop()

    # -- policy decisions

    async def _on_requested(self, delivery: Delivery) -> None:
        stored = decode_stored(delivery.stream_seq, delivery.subject, delivery.data)
        call = stored.event
        if not isinstance(call, CallRequested):
            raise PoisonError("unreadable_event",
                              f"not a call.requested: {stored.error or type(call).__name__}")
        key = (call.session_id, call.call_id)
        if key in self._inline:
            storing = self._inline[key]
            done = True
            if storing is not None:
                # Not `wait_for`: it costs two more turns of the event loop.
                if not storing.done():
                    await asyncio.wait({storing}, timeout=_INLINE_WAIT_S)
                done = storing.done() and not storing.cancelled() and storing.result()
            self._inline.pop(key, None)
            if done:
                await delivery.ack()  # decided and stored with the call, in this process
                return
        pending: PendingApproval | None = None
        known = None
        if delivery.num_delivered > 1:
            # A redelivery: the decision may be stored already; then only finish what may
            # be missing (the pending approval's listing).
            known = (await self._states.current(call.session_id)).state.calls.get(
                call.call_id)
        if known is None or known.status == "requested":
            decision = decide(call, self._tools, self._policy, now=self._clock(),
                              instances=self._catalog.instance_tools)
            result = await self._log.append(
                Append(decision, policy_decision_id(call.session_id, call.call_id)),
                headers=outgoing_headers())
            if result.duplicate:
                # A decision on this call was stored first (ours before a crash, or the
                # planner refusing a tool it did not offer): list what the log says.
                known = (await self._states.current(call.session_id)).state.calls.get(
                    call.call_id)
                pending = pending_of(known, call.session_id) if known is not None else None
            elif isinstance(decision, ApprovalRequested):
                pending = PendingApproval(
                    session_id=call.session_id, call_id=call.call_id, turn_id=call.turn_id,
                    tool=call.tool, arguments=decision.arguments, rule=decision.rule,
                    reason=decision.reason, risk=decision.risk, requested_at=decision.at,
                    expires_at=decision.expires_at)
        else:
            pending = pending_of(known, call.session_id)
        if pending is not None:
            await self._store.put(pending)
        await delivery.ack()

    def _reject(self, delivery: Delivery, reason: str, message: str) -> list[Append]:
        call = decode_stored(delivery.stream_seq, delivery.subject, delivery.data).event
        if not isinstance(call, CallRequested):
            return [self._kernel.generic_rejection(delivery, reason, message)]
        failed = CallFailed(session_id=call.session_id, at=self._clock(), actor=ACTOR,
                            call_id=call.call_id, turn_id=call.turn_id, error_type="internal",
                            message=message)
        return [Append(failed, call_terminal_id(call.session_id, call.call_id))]

    # -- human decisions and timeouts

    async def _store_decision(self, event: ApprovalGranted | ApprovalDenied) -> CallState:
        """Store a decision if it is the first for its call; returns the call as the log
        has it afterwards (whoever decided first)."""
        sid, call_id = event.session_id, event.call_id
        with contextlib.suppress(ConcurrencyError):  # another decision was first
            await self._log.append(
                Append(event, human_decision_id(sid, call_id), call_id), expect_last=0,
                expect_subject=approval_decision_filter(sid, call_id),
                headers=outgoing_headers())
        await self._store.delete(sid, call_id)
        call = (await self._states.current(sid)).state.calls.get(call_id)
        if call is None:  # it was waiting for this decision: the log cannot have lost it
            raise RpcError("internal", f"call {call_id} of session {sid} vanished from the "
                                       "log while being decided")
        return call

    async def _on_decision(self, subject: str, data: bytes) -> bytes:
        parts = subject[len(APPROVAL_PREFIX) + 1:].split(".")
        if len(parts) != 3 or not all(is_token(p) for p in parts):
            raise RpcError("invalid", f"{subject}: expected "
                                      "toolbus.approval.<session>.<call_id>.<principal>")
        sid, call_id, principal = parts
        try:
            body = msgspec.json.decode(data, type=HumanDecision)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError,
                RecursionError) as exc:
            raise RpcError("invalid", f"bad decision: {exc}; send "
                                      '{"decision": "approve"|"deny", "by": "...", '
                                      '"note": "...", "reason": "..."}') from exc
        call = (await self._states.current(sid)).state.calls.get(call_id)
        now = self._clock()
        if call is not None and call.terminal and call.human_decision is None:
            # Ended without a human (its turn was cancelled): nothing waits any more.
            await self._store.delete(sid, call_id)
        elif call is not None and call.human_decision is None and \
                call.approval_expires_at is not None and now >= call.approval_expires_at:
            call = await self._store_decision(expire(call, sid, now=now))
        event = decide_human(call, body, session_id=sid, call_id=call_id, now=now,
                             principal=principal)
        after = await self._store_decision(event)
        if after.human_decision != _KIND[type(event)] or after.decided_by != event.by:
            raise RpcError("conflict", _already(after), decision=after.human_decision)
        return msgspec.json.encode({"ok": True, "decision": after.human_decision})

    async def _sweep(self) -> None:
        rounds = 0
        cursor = 0  # where the last check for ended calls stopped, so all get their turn
        while True:
            await asyncio.sleep(self._sweep_interval_s)
            now = self._clock()
            rounds += 1
            pending = self._store.pending()
            # Now and then, the calls that ended without a human (their turn cancelled,
            # superseded by a tool event): nothing waits for their decision any more.
            checked: set[int] = set()
            if rounds % _ENDED_CHECK_EVERY == 0 and pending:
                start = cursor % len(pending)
                checked = {(start + k) % len(pending)
                           for k in range(min(_ENDED_CHECK_MAX, len(pending)))}
                cursor = start + len(checked)
            for n, item in enumerate(pending):
                if item.expires_at > now:
                    if n in checked:
                        await self._drop_if_ended(item.session_id, item.call_id)
                    continue
                try:
                    call = (await self._states.current(item.session_id)).state.calls.get(
                        item.call_id)
                    if call is not None and call.human_decision is None and \
                            call.approval_expires_at is not None and not call.terminal:
                        await self._store_decision(expire(call, item.session_id, now=now))
                    else:
                        await self._store.delete(item.session_id, item.call_id)
                except Exception as exc:  # a NATS outage: the next sweep tries again
                    log.warning("approval timeout of %s failed: %s", item.call_id, exc)


    async def _drop_if_ended(self, sid: str, call_id: str) -> None:
        try:
            call = (await self._states.current(sid)).state.calls.get(call_id)
            if call is not None and call.terminal and call.human_decision is None:
                await self._store.delete(sid, call_id)
        except Exception as exc:  # a NATS outage: the next round tries again
            log.debug("checking the approval of %s failed: %s", call_id, exc)


# Every this many sweeps, up to this many waiting approvals are checked for a call that
# ended meanwhile (a read of its session each).
_ENDED_CHECK_EVERY = 2
_ENDED_CHECK_MAX = 64

_KIND: dict[type[Event], str] = {ApprovalGranted: "approved", ApprovalDenied: "denied"}


def _already(call: CallState) -> str:
    if call.human_decision == "approved":
        return f"already decided: approved by {call.decided_by}"
    if call.human_decision == "denied":
        return f"already decided: denied by {call.decided_by} ({call.decision_note})"
    return "already decided"
