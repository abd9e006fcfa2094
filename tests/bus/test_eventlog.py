"""Appending to and reading the event log: ids survive the retry paths."""

from __future__ import annotations

from typing import Any

from bus.connection import Bus
from bus.eventlog import Append, EventLog
from schemas.events import RequestRejected


def _event(sid: str, i: int) -> Append:
    return Append(RequestRejected(session_id=sid, at=float(i), actor="test", reason="t",
                                  message=f"m{i}"), f"{sid}:ev:{i}")


async def test_a_decision_event_resent_after_a_failed_publish_keeps_its_own_id(
        bus: Bus, sid: str) -> None:
    # The second publish of a pipelined decision fails as a disconnect would: it is sent
    # again by the retry path, under its own message id (not a neighbour's), exactly once.
    log = EventLog(bus)
    real = log._pub.send
    failed: list[str] = []
    calls = 0

    async def flaky(subject: str, payload: bytes, headers: dict[str, str]) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:
            failed.append(headers["Nats-Msg-Id"])
            raise TimeoutError
        return await real(subject, payload, headers)

    log._pub.send = flaky  # type: ignore[method-assign]
    results = await log.append_decision([_event(sid, i) for i in range(3)], expect_last=0,
                                        headers={"traceparent": "00-" + "1" * 32 + "-"
                                                 + "2" * 16 + "-01"})
    assert failed == [f"{sid}:ev:1"] and not any(r.duplicate for r in results)
    stored = await log.read_session(sid)
    assert [s.event.message for s in stored] == ["m0", "m2", "m1"]  # type: ignore[union-attr]
    again = await EventLog(bus).append_decision([_event(sid, i) for i in range(3)],
                                                expect_last=None)
    assert all(r.duplicate for r in again)  # every id was stored under its own name


async def test_a_decision_overtaken_by_a_cancellation_stores_none_of_its_guarded_events(
        bus: Bus, sid: str) -> None:
    # Only a decision's first event is checked against the session's last; the rest of
    # it may carry `unless_cancelled_after`, so that a `turn.cancelled` stored since the
    # state the decision was taken on keeps them out (a planner's calls, approved and
    # dispatched behind its answer).
    import dataclasses

    import pytest

    from bus.headers import Header
    from schemas.errors import ConcurrencyError
    from schemas.events import TurnCancelled

    log = EventLog(bus)
    first = await log.append(_event(sid, 0))
    cancelled = await log.append(Append(TurnCancelled(
        session_id=sid, at=1.0, actor="session", turn_id="t1", request_id="t1",
        reason="superseded", message="a newer event"), f"{sid}:cancel"))
    stale = [_event(sid, 1), *(dataclasses.replace(_event(sid, i), unless_cancelled_after=0)
                               for i in (2, 3))]
    # Taken before the cancellation: the answer (unchecked here) is stored, its calls not.
    with pytest.raises(ConcurrencyError):
        await log.append_decision(stale, expect_last=None)
    stored = [s.event for s in await log.read_session(sid)]
    assert [getattr(e, "message", None) for e in stored] == ["m0", "a newer event", "m1"]
    # Taken after it: stored whole, every event but the last saying more follow.
    fresh = [_event(sid, 4), *(dataclasses.replace(
        _event(sid, i), unless_cancelled_after=cancelled.seq) for i in (5, 6))]
    results = await log.append_decision(fresh, expect_last=None)
    assert len(results) == 3 and results[0].seq > first.seq
    msgs = [await bus.js.get_msg("TOOLBUS_EVENTS", r.seq) for r in results]
    assert [(m.headers or {}).get(Header.MORE.value) for m in msgs] == ["2", "1", None]


def test_an_event_nested_deeper_than_the_readers_stack_allows_is_unreadable_not_fatal(
) -> None:
    from bus.eventlog import decode_stored

    deep = b'{"type":"call.succeeded","session_id":"s","at":1,"actor":"executor",' \
        b'"call_id":"t-0","result":' + b"[" * 990 + b"]" * 990 + b"}"

    def at(frames: int) -> Any:
        return at(frames - 1) if frames else decode_stored(7, "toolbus.evt.s.0.x", deep)

    stored = at(200)
    assert stored.event is None and stored.error and "recursion" in stored.error
