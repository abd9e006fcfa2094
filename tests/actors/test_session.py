"""The session actor against a real server: explicit calls, every kind of bad input,
duplicate requests, and replay equal to the live state."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest

from actors.session import decide, decide_cancel, decide_tool_event
from bus.client import ToolbusClient
from bus.connection import Bus
from bus.eventlog import Append, EventLog
from bus.subjects import request_subject
from schemas.errors import ConcurrencyError, InvalidRequestError
from schemas.events import (
    CallApproved,
    CallFailed,
    CallRejected,
    CallRequested,
    CallSucceeded,
    RequestRejected,
    TurnCancelled,
    TurnCompleted,
    TurnFailed,
    TurnRequested,
)
from schemas.ids import (
    SYSTEM_SESSION,
    call_requested_id,
    call_terminal_id,
    turn_ended_id,
    turn_requested_id,
)
from schemas.requests import ToolEventInput
from schemas.state import evolve, fold
from tests.conftest import EventWatch, assert_replay_equals_live, of_type, settled_state


async def test_an_explicit_call_runs_and_the_turn_carries_its_result(
    bus: Bus, client: ToolbusClient, sid: str
) -> None:
    end = await client.call(sid, [{"tool": "built-in:echo", "arguments": {"text": "hi"}}],
                            timeout=10)
    assert isinstance(end, TurnCompleted) and end.ok
    assert end.outcomes[0].result == {"text": "hi"}
    async with EventWatch(bus, sid) as w:
        events = await w.until(lambda evs: bool(of_type(evs, "turn.completed")))
    tags = [type(e).__struct_config__.tag for e in events]
    assert tags == ["turn.requested", "call.requested", "call.approved", "call.dispatched",
                    "call.started", "call.succeeded", "turn.completed"]
    await assert_replay_equals_live(bus, client, sid)


async def test_a_turn_with_several_calls_completes_with_every_outcome_in_order(
    bus: Bus, client: ToolbusClient, sid: str
) -> None:
    end = await client.call(sid, [
        {"tool": "built-in:echo", "arguments": {"n": 1}},
        {"tool": "testing:boom", "arguments": {"message": "kaput"}},
        {"tool": "built-in:current_time", "arguments": {"timezone": "Europe/Paris"}},
        {"tool": "built-in:echo", "arguments": {"n": 4}, "_reasoningForCall": "to check"},
    ], timeout=10)
    assert isinstance(end, TurnCompleted) and not end.ok
    assert [o.status for o in end.outcomes] == ["succeeded", "failed", "succeeded", "succeeded"]
    assert end.outcomes[1].error is not None and end.outcomes[1].error.message == "kaput"
    assert "+01:00" in end.outcomes[2].result["time"] or "+02:00" in end.outcomes[2].result["time"]
    state = await settled_state(bus, client, sid)
    assert state.calls[end.outcomes[3].call_id].reasoning == "to check"
    await assert_replay_equals_live(bus, client, sid)


async def _publish_raw(bus: Bus, subject: str, data: bytes) -> None:
    await bus.nc.publish(subject, data)
    await bus.nc.flush()


async def _rejection(bus: Bus, sid: str) -> RequestRejected:
    async with EventWatch(bus, sid) as w:
        events = await w.until(lambda evs: bool(of_type(evs, "request.rejected")))
    return of_type(events, "request.rejected")[-1]


async def test_malformed_json_is_a_stored_rejection(bus: Bus, client, sid: str) -> None:
    await _publish_raw(bus, request_subject(sid), b'{"calls": [')
    rej = await _rejection(bus, sid)
    assert rej.reason == "malformed_json" and "not valid JSON" in rej.message
    assert rej.excerpt == '{"calls": ['
    await assert_replay_equals_live(bus, client, sid)


async def test_wrong_types_are_a_stored_rejection_naming_the_field(bus: Bus, client, sid) -> None:
    await _publish_raw(bus, request_subject(sid),
                       b'{"request_id": "r1", "calls": [{"tool": ["x"]}]}')
    rej = await _rejection(bus, sid)
    assert rej.reason == "invalid_request"
    assert rej.message == "calls[0].tool must be a string, got an array"
    assert rej.request_id == "r1"


async def test_an_oversized_payload_is_a_stored_rejection(bus: Bus, client, sid: str) -> None:
    big = msgspec.json.encode({"calls": [{"tool": "built-in:echo",
                                          "arguments": {"blob": "x" * 300_000}}]})
    await _publish_raw(bus, request_subject(sid), big)
    rej = await _rejection(bus, sid)
    assert rej.reason == "payload_too_large" and str(len(big)) in rej.message


async def test_a_client_hears_at_once_of_its_request_refused_as_too_large(
        client: ToolbusClient, sid: str) -> None:
    # Too large to be read, the body cannot name its request id: the rejection takes it
    # from the message id the client published it with, so the caller is not left to
    # wait out its timeout.
    calls = [{"tool": "built-in:echo", "arguments": {"text": "x" * 300_000}}]
    end = await asyncio.wait_for(client.call(sid, calls, request_id="big-1", timeout=60), 20)
    assert isinstance(end, RequestRejected) and end.reason == "payload_too_large", end
    assert end.request_id == "big-1"
    # Sent again (a retry within the dedup window: NATS stores it no second time), it
    # still hears of the refusal at once.
    again = await asyncio.wait_for(client.call(sid, calls, request_id="big-1", timeout=60),
                                   20)
    assert again == end


async def test_toolbus_own_session_takes_no_request(client: ToolbusClient) -> None:
    end = await client.call(SYSTEM_SESSION, [{"tool": "built-in:echo", "arguments": {}}],
                            request_id="mine", timeout=20)
    assert isinstance(end, RequestRejected) and end.reason == "reserved_session", end
    assert end.request_id == "mine" and "toolbus's own session" in end.message


async def test_a_bad_session_id_is_a_stored_rejection_under_the_system_session(
    bus: Bus, client, sid: str
) -> None:
    # One token, as clients may publish (a subject of more tokens is refused by NATS), but
    # not a session id: stored under its partition, rejected under the system session.
    bad_subject = f"toolbus.req.{sid}:bad"
    await _publish_raw(bus, bad_subject, b'{"calls": [{"tool": "built-in:echo"}]}')

    def ours(e: object) -> bool:
        return isinstance(e, RequestRejected) and (e.subject or "").startswith(bad_subject)

    async with EventWatch(bus, SYSTEM_SESSION) as w:
        events = await w.until(lambda evs: any(ours(e) for e in evs))
    rej = next(e for e in events if ours(e))
    assert rej.reason == "invalid_session_id"
    assert f"{sid}:bad" in rej.message and "A-Z a-z 0-9 _ -" in rej.message


async def test_an_unknown_tool_is_a_stored_call_rejection(bus: Bus, client, sid: str) -> None:
    end = await client.call(sid, [{"tool": "nowhere:nothing", "arguments": {}}], timeout=10)
    assert isinstance(end, TurnFailed) and end.reason == "all_calls_rejected"
    assert end.outcomes[0].status == "rejected"
    assert end.outcomes[0].error is not None
    assert "no tool named 'nowhere:nothing'" in end.outcomes[0].error.message
    await assert_replay_equals_live(bus, client, sid)


async def test_arguments_that_are_not_an_object_reject_that_call_only(
    bus: Bus, client: ToolbusClient, sid: str
) -> None:
    end = await client.call(sid, [
        {"tool": "built-in:echo", "arguments": "just a string"},
        {"tool": "built-in:echo", "arguments": {"ok": True}},
        {"tool": "not a tool name", "arguments": {}},
    ], timeout=10)
    assert isinstance(end, TurnCompleted)
    assert [o.status for o in end.outcomes] == ["rejected", "succeeded", "rejected"]
    assert end.outcomes[0].error.error_type == "invalid_arguments"  # type: ignore[union-attr]
    assert "must be a JSON object, got a string" in end.outcomes[0].error.message  # type: ignore[union-attr]
    assert end.outcomes[2].error.error_type == "invalid_tool_name"  # type: ignore[union-attr]
    await assert_replay_equals_live(bus, client, sid)


async def test_the_same_request_id_published_twice_runs_its_calls_once(
    bus: Bus, client: ToolbusClient, sid: str, tmp_path
) -> None:
    target = tmp_path / "side-effect.txt"
    body = msgspec.json.encode({"request_id": "order-42", "calls": [
        {"tool": "testing:append_line", "arguments": {"path": str(target), "line": "once"}}]})
    # A raw client without a message id: the stream cannot deduplicate, the actor must.
    await _publish_raw(bus, request_subject(sid), body)
    await _publish_raw(bus, request_subject(sid), body)
    async with EventWatch(bus, sid) as w:
        events = await w.until(lambda evs: bool(of_type(evs, "turn.completed"))
                               and bool(of_type(evs, "request.rejected")))
    assert len(of_type(events, "turn.requested")) == 1
    assert len(of_type(events, "call.succeeded")) == 1
    dup = of_type(events, "request.rejected")[0]
    assert dup.reason == "duplicate_request" and "order-42" in dup.message
    # And through the client (with a message id): the original result comes back.
    end = await client.call(sid, [{"tool": "testing:append_line",
                                   "arguments": {"path": str(target), "line": "once"}}],
                            request_id="order-42", timeout=10)
    assert isinstance(end, TurnCompleted) and end.outcomes[0].result == {"written": "once"}
    assert target.read_text() == "once\n"
    # The same request id for another request: refused, not answered with the first's end
    # (a user reusing a key got the result of a call they did not make).
    for other in ({"path": str(target), "line": "twice"}, {"path": str(target)}):
        with pytest.raises(InvalidRequestError, match="request id order-42 was used in "
                           f"session {sid} for another request"):
            await client.call(sid, [{"tool": "testing:append_line", "arguments": other}],
                              request_id="order-42", timeout=10)
    with pytest.raises(InvalidRequestError, match="for another request"):
        await client.ask(sid, "Write once.", request_id="order-42", timeout=10)
    assert target.read_text() == "once\n"
    async with EventWatch(bus, sid) as w:
        events = await w.until(lambda evs: len(of_type(evs, "call.succeeded")) >= 1)
    assert len([e for e in events if isinstance(e, CallSucceeded)]) == 1
    await assert_replay_equals_live(bus, client, sid)


async def test_a_turn_stored_without_its_calls_is_restored_when_the_request_returns(
    bus: Bus, client: ToolbusClient, sid: str
) -> None:
    """A crash between the turn and its calls (one batch, not atomic) leaves a turn whose
    calls were never stored. The request is redelivered: the missing calls are stored
    with the same ids and run, instead of the turn hanging forever."""
    import time

    from bus.eventlog import Append, EventLog
    from schemas.events import TurnRequested

    turn = TurnRequested(session_id=sid, at=time.time(), actor="session", turn_id="crash1",
                         request_id="crash1", call_ids=["crash1-0", "crash1-1"])
    await EventLog(bus).append(Append(turn, f"{sid}:crash1:requested"))
    end = await client.call(sid, [{"tool": "built-in:echo", "arguments": {"n": 0}},
                                  {"tool": "built-in:echo", "arguments": {"n": 1}}],
                            request_id="crash1", timeout=10)
    assert isinstance(end, TurnCompleted) and end.ok
    assert [o.result for o in end.outcomes] == [{"n": 0}, {"n": 1}]


async def test_a_decision_cut_short_after_its_approval_is_still_dispatched(
    bus: Bus, client: ToolbusClient, system: dict[str, Any], sid: str
) -> None:
    """The session actor decides on a decision once it is whole (`Toolbus-More` on all
    but its last event). A writer that died half way leaves the last stored event saying
    more follows: the session actor decides anyway after a moment, so the approved call
    is dispatched instead of waiting forever."""
    import time

    from bus.eventlog import Append, EventLog
    from bus.headers import Header
    from schemas.events import CallRequested, TurnRequested
    from schemas.ids import call_requested_id, policy_decision_id, turn_requested_id

    log = EventLog(bus)
    now = time.time()
    turn = TurnRequested(session_id=sid, at=now, actor="session", turn_id="cut1",
                         request_id="cut1", call_ids=["cut1-0"], agent="default")
    call = CallRequested(session_id=sid, at=now, actor="session", call_id="cut1-0",
                         turn_id="cut1", tool="built-in:echo", arguments={"n": 7},
                         agent="default")
    approved = system["approval"].decide_inline(call)
    assert approved is not None
    async with EventWatch(bus, sid) as watch:
        for item, more in ((Append(turn, turn_requested_id(sid, "cut1")), 3),
                           (Append(call, call_requested_id(sid, "cut1-0")), 2),
                           (Append(approved, policy_decision_id(sid, "cut1-0")), 1)):
            await log.append(item, headers={Header.MORE.value: str(more)})
        events = await watch.until(lambda evs: bool(of_type(evs, "turn.completed")),
                                   timeout=15)
    (done,) = [e for e in events if isinstance(e, TurnCompleted)]
    (ran,) = [e for e in events if isinstance(e, CallSucceeded)]
    assert done.ok and ran.call_id == "cut1-0" and ran.result == {"n": 7}


async def test_a_session_with_a_past_not_in_memory_is_read_before_its_request_is_decided(
    bus: Bus, client: ToolbusClient, system: dict[str, Any], sid: str, tmp_path
) -> None:
    """A session the actor does not hold is first taken as new (its first write is checked
    against "no event yet"); one with a past conflicts, is read, and is decided on whole:
    the same request id is still a duplicate, and its side effect runs once."""
    target = tmp_path / "side-effect.txt"
    calls = [{"tool": "testing:append_line", "arguments": {"path": str(target), "line": "x"}}]
    first = await client.call(sid, calls, request_id="order-9", timeout=10)
    assert isinstance(first, TurnCompleted) and first.ok
    states = system["session"].states
    await _evicted(states, sid)  # as after a restart, or evicted from memory
    body = msgspec.json.encode({"request_id": "order-9", "calls": calls})
    # Past the stream's window of message ids (as a resend ten minutes later would be),
    # so nothing but the actor's decision keeps the calls from being stored again.
    from bus.subjects import EVENTS_STREAM

    config = (await bus.js.stream_info(EVENTS_STREAM)).config
    window = config.duplicate_window
    await bus.js.update_stream(_with_window(config, 0.2))
    try:
        await asyncio.sleep(0.3)  # the ids of the first request age out of the window
        await _publish_raw(bus, request_subject(sid), body)
        dup = await _rejection(bus, sid)
    finally:
        await bus.js.update_stream(_with_window(config, window))
    assert dup.reason == "duplicate_request" and "order-9" in dup.message
    log = await EventLog(bus).read_session(sid)
    kinds = [type(e.event).__name__ for e in log]
    assert kinds.count("CallRequested") == kinds.count("CallDispatched") == 1, kinds
    assert target.read_text() == "x\n"
    await _evicted(states, sid)
    second = await client.call(sid, calls, request_id="order-10", timeout=10)
    assert isinstance(second, TurnCompleted) and second.ok
    state = await settled_state(bus, client, sid)
    assert len(state.turns) == 2 and target.read_text() == "x\nx\n"


def _with_window(config: Any, seconds: float) -> Any:
    import dataclasses

    return dataclasses.replace(config, duplicate_window=seconds)


async def _evicted(states: Any, sid: str) -> None:
    """Drop the session from the actor's memory, once no handler is deciding on it."""
    async with asyncio.timeout(5):
        while states.peek(sid) is not None:
            states.forget(lambda s: s != sid)
            await asyncio.sleep(0.01)



def _doubt_once(owner: Any, part: int, monkeypatch: Any) -> asyncio.Event:
    """`owner` unsure of `part` once (as when its lease's renewal is late, while a cluster
    elects the bucket's leader): the next message of `part` is handed back; set then."""
    real_holds, real_surely = owner.holds, owner.surely_holds
    handed_back = asyncio.Event()

    def holds(p: int) -> bool:
        return not (p == part and not handed_back.is_set()) and real_holds(p)

    async def surely_holds(p: int, wait: float = 3.0) -> bool:
        if p == part and not handed_back.is_set():
            handed_back.set()
            return False
        return await real_surely(p, wait)

    monkeypatch.setattr(owner, "holds", holds)
    monkeypatch.setattr(owner, "surely_holds", surely_holds)
    return handed_back


def _fact(sid: str, n: int) -> Any:
    from bus.eventlog import Append

    return Append(RequestRejected(session_id=sid, at=time.time(), actor="test",
                                  reason="invalid", message=f"fact {n}"), f"{sid}:fact-{n}")


async def _second_fact_folds_both(bus: Bus, client: ToolbusClient, sid: str,
                                  handed_at: float) -> None:
    """The session's next event, stored now, is folded with the handed-back one before
    it, in order, well before that one's redelivery (its ack wait)."""
    from schemas.defaults import PARTITION_ACK_WAIT_S

    second = await EventLog(bus).append(_fact(sid, 2))
    state = await settled_state(bus, client, sid)
    assert state.last_seq >= second.seq
    await assert_replay_equals_live(bus, client, sid)
    assert time.monotonic() - handed_at < PARTITION_ACK_WAIT_S


async def test_an_event_handed_back_while_the_lease_is_in_doubt_is_not_overtaken(
        bus: Bus, client: ToolbusClient, sid: str, system: dict[str, Any],
        monkeypatch: Any) -> None:
    """A session actor unsure it still holds a partition hands the event back
    unacknowledged; it comes again only after its ack wait. The session's next event,
    delivered meanwhile, must not be folded in its place: the live state would lack the
    first one until then, and be decided on so (a cluster test caught a call's
    `call.started` missing)."""
    from bus.subjects import partition

    await client.call(sid, [{"tool": "built-in:echo", "arguments": {"text": "hi"}}],
                      timeout=10)
    await settled_state(bus, client, sid)  # in the session actor's memory
    handed_back = _doubt_once(system["session"]._owner, partition(sid, bus.partitions),
                              monkeypatch)
    await EventLog(bus).append(_fact(sid, 1))
    async with asyncio.timeout(5):
        await handed_back.wait()
    await _second_fact_folds_both(bus, client, sid, time.monotonic())


async def test_an_event_handed_back_while_its_session_is_being_loaded_is_not_overtaken(
        bus: Bus, client: ToolbusClient, sid: str, system: dict[str, Any],
        monkeypatch: Any) -> None:
    """The same, with the session not in memory but being loaded (for the state RPC, a
    request) from a read of the log taken before the handed-back event was stored."""
    from bus.subjects import partition

    await client.call(sid, [{"tool": "built-in:echo", "arguments": {"text": "hi"}}],
                      timeout=10)
    await settled_state(bus, client, sid)
    states = system["session"].states
    async with asyncio.timeout(5):
        while states.peek(sid) is not None:  # out of memory (not while being decided)
            states.forget(lambda s: s != sid)
            await asyncio.sleep(0.01)
    gate = asyncio.Event()
    real_load = states._load

    async def held_load(s: str) -> Any:
        entry = await real_load(s)
        if s == sid:
            await gate.wait()  # read, not yet in memory
        return entry

    monkeypatch.setattr(states, "_load", held_load)
    handed_back = _doubt_once(system["session"]._owner, partition(sid, bus.partitions),
                              monkeypatch)
    loading = asyncio.create_task(states.entry(sid))
    await asyncio.sleep(0.2)  # its read of the log done
    await EventLog(bus).append(_fact(sid, 1))
    async with asyncio.timeout(5):
        await handed_back.wait()
    handed_at = time.monotonic()
    gate.set()
    await loading
    await _second_fact_folds_both(bus, client, sid, handed_at)


# --- one client, several callers waiting for the same turn (found by the planner fuzzer) ----


async def test_a_cancel_from_the_same_client_answers_the_caller_waiting_for_the_turn(
    bus: Bus, client: ToolbusClient, sid: str
) -> None:
    # The cancel took the caller's place among the turn's waiters: the caller heard
    # nothing until its timeout, then blamed a missing server.
    calls = [{"tool": "testing:sleep", "arguments": {"seconds": 5}}]
    waiting = asyncio.create_task(client.call(sid, calls, request_id="r-slow", timeout=20))
    async with EventWatch(bus, sid) as w:
        await w.until(lambda evs: bool(of_type(evs, "call.started")))
    stopped = await client.cancel(sid, "r-slow", timeout=10)
    assert isinstance(stopped, TurnCancelled), stopped
    async with asyncio.timeout(5):
        end = await waiting
    assert end == stopped


async def test_the_same_request_waited_for_twice_by_one_client_answers_both(
    bus: Bus, client: ToolbusClient, sid: str
) -> None:
    calls = [{"tool": "testing:sleep", "arguments": {"seconds": 0.5}}]
    first = asyncio.create_task(client.call(sid, calls, request_id="r-twice", timeout=20))
    async with EventWatch(bus, sid) as w:
        await w.until(lambda evs: bool(of_type(evs, "turn.requested")))
    async with asyncio.timeout(10):
        again = await client.call(sid, calls, request_id="r-twice", timeout=20)
        end = await first
    assert isinstance(end, TurnCompleted) and end.outcomes[0].status == "succeeded", end
    assert again == end
    await assert_replay_equals_live(bus, client, sid)


async def test_a_call_rejected_while_its_turn_is_superseded_ends_once(
    bus: Bus, system: dict[str, Any], sid: str
) -> None:
    # Found by the planner fuzzer: a tool event with trigger_processing, decided on a
    # state from before the approval actor rejected a call of the turn in flight, stored
    # the call's `call.failed` (`cancelled`) behind its first event, whose concurrency
    # check failed: the call ended twice. A call the approval actor has not decided is
    # no longer failed by a cancellation; it is once decided (`orphans_due`).
    log = EventLog(bus)
    turn_id, call_id = "t1", "t1-0"
    await log.append(Append(TurnRequested(session_id=sid, at=1.0, actor="test",
                                          turn_id=turn_id, request_id=turn_id,
                                          call_ids=[], message="Do it."),
                            turn_requested_id(sid, turn_id)))
    await log.append(Append(CallRequested(session_id=sid, at=1.0, actor="test",
                                          call_id=call_id, turn_id=turn_id,
                                          tool="nosuch:tool", arguments={}),
                            call_requested_id(sid, call_id)))
    async with EventWatch(bus, sid) as w:  # the approval actor knows no such tool
        await w.until(lambda evs: bool(of_type(evs, "call.rejected")))
    stored = await log.read_session(sid)
    stale = fold(sid, ((s.seq, s.event) for s in stored
                       if s.event and not isinstance(s.event, CallRejected)))
    assert stale.calls[call_id].status == "requested"
    items = decide_tool_event(stale, ToolEventInput(
        tool_id="crm:note", arguments={}, result={}, idempotency_key="k",
        trigger_processing=True), now=2.0, request_seq=1, accept_messages=True)
    with pytest.raises(ConcurrencyError):
        await log.append_decision(items, expect_last=stale.last_seq)
    ends = [s.event for s in await log.read_session(sid)
            if isinstance(s.event, CallRejected | CallFailed | CallSucceeded)]
    assert [type(e) for e in ends] == [CallRejected]
    # No planner turn is left open, for the planner of a later test to plan.
    state = fold(sid, ((s.seq, s.event) for s in await log.read_session(sid)))
    for open_id in state.open_turns:
        await log.append(Append(TurnCancelled(
            session_id=sid, at=3.0, actor="test", turn_id=open_id, request_id=open_id,
            reason="cancelled", message="the test is over"), turn_ended_id(sid, open_id)))


def test_a_call_decided_after_its_turn_was_cancelled_is_failed_then() -> None:
    # Found by the planner fuzzer: a cancellation whose first event failed its check
    # stored the `turn.cancelled` pipelined behind it; decided again, the turn had ended,
    # and its call, approved meanwhile, was never ended. A cancelled turn's calls that
    # have not ended are kept (`orphans`) and failed once decided.
    sid = "s-orphan"
    turn = TurnRequested(session_id=sid, at=1.0, actor="test", turn_id="t1",
                         request_id="t1", call_ids=[], message="Do it.")
    requested = CallRequested(session_id=sid, at=1.0, actor="test", call_id="t1-0",
                              turn_id="t1", tool="testing:probe", arguments={})
    state = fold(sid, [(1, turn), (2, requested)])
    items = decide_cancel(state, "t1", "stop-1", reason=None, now=2.0, subject="s",
                          request_seq=9)
    # Not decided yet: only the turn's end, first.
    assert [type(i.event) for i in items] == [TurnCancelled]
    state = fold(sid, [(1, turn), (2, requested), (3, items[0].event)])
    assert state.orphans == ["t1-0"] and decide(state, now=3.0) == []
    approved = CallApproved(session_id=sid, at=3.0, actor="approval", call_id="t1-0",
                            turn_id="t1", tool="testing:probe", rule="auto",
                            arguments={}, route="default")
    state = evolve(state, approved, 4)
    (failed,) = decide(state, now=4.0)
    assert isinstance(failed.event, CallFailed) and failed.event.error_type == "cancelled"
    assert failed.msg_id == call_terminal_id(sid, "t1-0")  # the executor's, the timeout's
    state = evolve(state, failed.event, 5)
    assert state.orphans == [] and decide(state, now=5.0) == []


def test_a_snapshot_from_before_orphans_is_not_taken_for_a_current_one() -> None:
    # a995e56 stored version 10 snapshots with `last_rejected_seq` and no `orphans`;
    # bb6cc58 gave 10 to `orphans`. Such a snapshot, read as current, lost a cancelled
    # turn's undecided call: approved afterwards, it was never ended (the state folded
    # from the log fails it).
    from bus.snapshots import _decoder, encode_snapshot
    sid = "s-orphan-snap"
    turn = TurnRequested(session_id=sid, at=1.0, actor="test", turn_id="t1",
                         request_id="t1", call_ids=[], message="Do it.")
    requested = CallRequested(session_id=sid, at=1.0, actor="test", call_id="t1-0",
                              turn_id="t1", tool="testing:probe", arguments={})
    cancelled = decide_cancel(fold(sid, [(1, turn), (2, requested)]), "t1", "stop-1",
                              reason=None, now=2.0, subject="s", request_seq=9)[0].event
    state = fold(sid, [(1, turn), (2, requested), (3, cancelled)])
    assert state.orphans == ["t1-0"]
    old = msgspec.json.decode(encode_snapshot(state))
    del old["state"]["orphans"]
    old["state"]["last_rejected_seq"] = 0
    old["version"] = 10  # as a995e56 wrote it
    snap = _decoder.decode(msgspec.json.encode(old))
    from schemas.state import STATE_VERSION
    assert snap.version != STATE_VERSION  # ignored: the session is folded from the log
