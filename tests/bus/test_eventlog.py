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
