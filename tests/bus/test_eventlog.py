"""Appending to and reading the event log: ids survive the retry paths."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from bus.connection import Bus
from bus.eventlog import Append, EventLog
from bus.headers import Header
from schemas.errors import ConcurrencyError
from schemas.events import RequestRejected, TurnCancelled


def _event(sid: str, i: int) -> Append:
    return Append(RequestRejected(session_id=sid, at=float(i), actor="test", reason="t",
                                  message=f"m{i}"), f"{sid}:ev:{i}")


async def test_a_decision_event_resent_after_a_failed_publish_keeps_its_own_id(
        bus: Bus, sid: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The second publish of a pipelined decision fails as a disconnect would: it is sent
    # again by the retry path, under its own message id (not a neighbour's), exactly once.
    # (A stream without atomic batches: a server before 2.12.)
    monkeypatch.setattr(bus, "atomic", False)
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


@pytest.mark.parametrize("atomic", [True, False], ids=["batch", "event-by-event"])
async def test_a_decision_overtaken_by_a_cancellation_stores_none_of_its_guarded_events(
        bus: Bus, sid: str, atomic: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Only a decision's first event is checked against the session's last; the rest of
    # it may carry `unless_cancelled_after`, so that a `turn.cancelled` stored since the
    # state the decision was taken on keeps them out (a planner's calls, approved and
    # dispatched behind its answer).
    # Batches are used on a cluster: this single server stands in for one.
    monkeypatch.setattr(bus, "atomic", atomic)
    monkeypatch.setattr(bus, "replicated", atomic)
    log = EventLog(bus)
    first = await log.append(_event(sid, 0))
    cancelled = await log.append(Append(TurnCancelled(
        session_id=sid, at=1.0, actor="session", turn_id="t1", request_id="t1",
        reason="superseded", message="a newer event"), f"{sid}:cancel"))
    stale = [_event(sid, 1), *(dataclasses.replace(_event(sid, i), unless_cancelled_after=0)
                               for i in (2, 3))]
    # Taken before the cancellation: its calls are not stored; the answer (unchecked
    # here) neither in a batch (all or nothing), and alone without one.
    with pytest.raises(ConcurrencyError):
        await log.append_decision(stale, expect_last=None)
    stored = [s.event for s in await log.read_session(sid)]
    assert [getattr(e, "message", None) for e in stored] == \
        ["m0", "a newer event"] + ([] if atomic else ["m1"])
    # Taken after it: stored whole, every event but the last saying more follow.
    fresh = [_event(sid, 4), *(dataclasses.replace(
        _event(sid, i), unless_cancelled_after=cancelled.seq) for i in (5, 6))]
    results = await log.append_decision(fresh, expect_last=None)
    assert len(results) == 3 and results[0].seq > first.seq
    msgs = [await bus.js.get_msg("TOOLBUS_EVENTS", r.seq) for r in results]
    assert [(m.headers or {}).get(Header.MORE.value) for m in msgs] == ["2", "1", None]


async def test_a_decision_is_one_atomic_batch_stored_whole_or_not_at_all(
        bus: Bus, sid: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert bus.atomic  # `provision` turned batches on for the events stream
    # Batches are used on a cluster: this single server stands in for one.
    monkeypatch.setattr(bus, "replicated", True)
    log = EventLog(bus)
    seen: list[int] = []
    log.observer = lambda event, result: seen.append(result.seq)
    first = await log.append(_event(sid, 0))
    # One acknowledgement for the three, their sequences consecutive, as read back.
    results = await log.append_decision([_event(sid, i) for i in (1, 2, 3)],
                                        expect_last=first.seq)
    stored = await log.read_session(sid)
    assert [(s.seq, s.event.message) for s in stored[1:]] == [  # type: ignore[union-attr]
        (r.seq, f"m{i}") for r, i in zip(results, (1, 2, 3), strict=True)]
    assert seen == [first.seq, *(r.seq for r in results)]
    assert not any(r.duplicate for r in results)
    # A failed check stores none of the decision.
    with pytest.raises(ConcurrencyError):
        await log.append_decision([_event(sid, i) for i in (4, 5)], expect_last=first.seq)
    assert len(await log.read_session(sid)) == 4
    # Decided again (the same ids), whole or in part: found stored, each with its seq.
    again = await log.append_decision([_event(sid, i) for i in (1, 2, 3)],
                                      expect_last=None)
    assert again == [dataclasses.replace(r, duplicate=True) for r in results]
    partly = await log.append_decision([_event(sid, 3), _event(sid, 6)],
                                       expect_last=results[-1].seq)
    assert partly[0] == dataclasses.replace(results[-1], duplicate=True)
    assert not partly[1].duplicate and partly[1].seq == results[-1].seq + 1


async def test_a_batch_whose_acknowledgement_was_lost_is_found_stored_not_stored_twice(
        bus: Bus, sid: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bus, "replicated", True)
    log = EventLog(bus)
    real = log._pub.wait
    lost = 0

    async def losing(subject: str, sent: Any, timeout: float) -> Any:
        nonlocal lost
        ack = await real(subject, sent, timeout)
        if lost == 0 and ack.count:  # the batch is stored; its ack never arrives
            lost += 1
            raise TimeoutError
        return ack

    log._pub.wait = losing  # type: ignore[method-assign]
    results = await log.append_decision([_event(sid, i) for i in range(3)],
                                        expect_last=None)
    stored = await log.read_session(sid)
    assert lost == 1 and len(stored) == 3
    assert [r.seq for r in results] == [s.seq for s in stored]
    # Under a check, the batch sent again finds the session moved on, as a single event
    # sent again would: the decider reads the log again, and finds its decision there.
    lost = 0
    with pytest.raises(ConcurrencyError):
        await log.append_decision([_event(sid, i) for i in range(3, 5)],
                                  expect_last=stored[-1].seq)
    assert lost == 1 and len(await log.read_session(sid)) == 5


async def test_an_events_stream_without_batches_gets_them_when_provisioned(
        bus: Bus) -> None:
    from bus.streams import EVENTS_STREAM, provision

    info = await bus.js.stream_info(EVENTS_STREAM)
    await bus.js.update_stream(dataclasses.replace(info.config, allow_atomic=False))
    assert not (await bus.js.stream_info(EVENTS_STREAM)).config.allow_atomic
    await provision(bus)
    assert (await bus.js.stream_info(EVENTS_STREAM)).config.allow_atomic and bus.atomic


def test_an_event_nested_deeper_than_the_readers_stack_allows_is_unreadable_not_fatal(
) -> None:
    from bus.eventlog import decode_stored

    deep = b'{"type":"call.succeeded","session_id":"s","at":1,"actor":"executor",' \
        b'"call_id":"t-0","result":' + b"[" * 990 + b"]" * 990 + b"}"

    def at(frames: int) -> Any:
        return at(frames - 1) if frames else decode_stored(7, "toolbus.evt.s.0.x", deep)

    stored = at(200)
    assert stored.event is None and stored.error and "recursion" in stored.error
