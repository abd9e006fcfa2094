"""Executor processes sharing one durable consumer, and SIGKILL in the middle of a call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bus.client import ToolbusClient
from bus.connection import Bus
from schemas.events import CallFailed, CallStarted, CallSucceeded, TurnCompleted
from tests.conftest import TESTS, EventWatch, Proc, assert_replay_equals_live, of_type

TOOLS = str(TESTS / "proc_toolkit.py")


@pytest.fixture
async def executors(nats_url: str, system) -> AsyncIterator[dict[str, Proc]]:
    procs = {
        name: Proc("actor", "executor", "--nats", nats_url, "--tools", TOOLS,
                   "--instance", name, "--ack-wait", "1", ready="executor actor")
        for name in ("ex-a", "ex-b")
    }
    try:
        await asyncio.gather(*(p.wait_ready() for p in procs.values()))
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def _has_line(path: Path, prefix: str) -> bool:
    return path.exists() and any(ln.startswith(prefix) for ln in path.read_text().splitlines())


async def _until_file_has(path: Path, prefix: str, timeout: float = 10.0) -> None:
    # A file written by another process signals nothing we can await: poll it, bounded.
    for _ in range(int(timeout / 0.01)):
        if _has_line(path, prefix):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{path} never got a line starting {prefix!r}")


def _terminal(events: list, call_id: str) -> list:
    return [e for e in events if isinstance(e, CallSucceeded | CallFailed)
            and e.call_id == call_id]


async def test_two_executor_processes_share_the_calls(
    bus: Bus, client: ToolbusClient, executors, sid: str
) -> None:
    ends = await asyncio.gather(*(
        client.call(f"{sid}-{i}", [{"tool": "proc:whoami", "arguments": {"hold_s": 0.05}}],
                    timeout=20)
        for i in range(40)
    ))
    pids = {e.outcomes[0].result["pid"] for e in ends if isinstance(e, TurnCompleted)}
    assert pids == {executors["ex-a"].pid, executors["ex-b"].pid}


async def test_sigkill_mid_call_loses_nothing_and_never_repeats_a_side_effect(
    bus: Bus, client: ToolbusClient, executors, sid: str, tmp_path: Path
) -> None:
    effects = tmp_path / "effects.txt"
    held = asyncio.create_task(client.call(sid, [{
        "tool": "proc:append_line",
        "arguments": {"path": str(effects), "line": "held", "hold_s": 30},
    }], request_id="held", timeout=30))
    async with EventWatch(bus, sid) as w:
        events = await w.until(lambda evs: bool(of_type(evs, "call.started")))
    victim = of_type(events, "call.started")[0].executor
    # `call.started` is stored before a non-idempotent tool runs; kill only once the side
    # effect has happened, which is the case this test is about.
    await _until_file_has(effects, "held ")
    # Other work in flight while the victim dies: it must all finish exactly once.
    others = [asyncio.create_task(client.call(f"{sid}-o{i}", [{
        "tool": "proc:append_line", "arguments": {"path": str(effects), "line": f"o{i}"}}],
        timeout=30)) for i in range(10)]
    executors[victim].kill()

    end = await held
    assert isinstance(end, TurnCompleted)
    outcome = end.outcomes[0]
    assert outcome.status == "failed" and outcome.error is not None
    assert outcome.error.error_type == "interrupted"
    for task in others:
        other = await task
        assert isinstance(other, TurnCompleted) and other.ok
    lines = effects.read_text().splitlines()
    assert sum(1 for ln in lines if ln.startswith("held ")) == 1
    assert sorted(ln.split()[0] for ln in lines) == sorted(["held", *(f"o{i}" for i in range(10))])
    events = await w.until(lambda evs: bool(of_type(evs, "turn.completed")))
    assert len(_terminal(events, outcome.call_id)) == 1
    await assert_replay_equals_live(bus, client, sid)


async def test_an_idempotent_call_interrupted_by_sigkill_runs_again_elsewhere(
    bus: Bus, client: ToolbusClient, executors, sid: str, tmp_path: Path
) -> None:
    runs = tmp_path / "runs.txt"
    call = asyncio.create_task(client.call(sid, [{
        "tool": "proc:idempotent_hold",
        "arguments": {"path": str(runs), "line": "run", "hold_s": 2},
    }], timeout=30))
    async with EventWatch(bus, sid) as w:
        events = await w.until(lambda evs: bool(of_type(evs, "call.started")))
    victim = of_type(events, "call.started")[0].executor
    executors[victim].kill()
    end = await call
    assert isinstance(end, TurnCompleted) and end.ok
    survivor = next(n for n in executors if n != victim)
    assert end.outcomes[0].result["pid"] == executors[survivor].pid
    events = await w.until(lambda evs: bool(of_type(evs, "turn.completed")))
    started = [e for e in events if isinstance(e, CallStarted)]
    assert [s.executor for s in started] == [victim, survivor]
    assert [s.attempt for s in started] == [1, 2]
    assert len(_terminal(events, end.outcomes[0].call_id)) == 1
    await assert_replay_equals_live(bus, client, sid)


async def test_a_call_longer_than_ack_wait_is_kept_alive_not_redelivered(
    bus: Bus, client: ToolbusClient, executors, sid: str, tmp_path: Path
) -> None:
    runs = tmp_path / "runs.txt"
    # ack wait is 1 s: without in-progress acks this 3 s call would be redelivered and,
    # being idempotent, run a second time.
    end = await client.call(sid, [{
        "tool": "proc:idempotent_hold",
        "arguments": {"path": str(runs), "line": "long", "hold_s": 3},
    }], timeout=30)
    assert isinstance(end, TurnCompleted) and end.ok
    assert len(runs.read_text().splitlines()) == 1
    async with EventWatch(bus, sid) as w:
        events = await w.until(lambda evs: bool(of_type(evs, "turn.completed")))
    assert len(of_type(events, "call.started")) == 1


async def test_a_dead_executor_is_noticed_within_seconds_at_the_default_ack_wait(
    bus: Bus, client: ToolbusClient, nats_url: str, system, sid: str, tmp_path: Path
) -> None:
    # Default ack wait (3 s) and in-progress beats: a killed executor's calls are re-run
    # on a survivor (idempotent) or end `interrupted` (not) within 10 s of the kill.
    procs = {name: Proc("actor", "executor", "--nats", nats_url, "--tools", TOOLS,
                        "--instance", name, ready="executor actor")
             for name in ("dflt-a", "dflt-b", "dflt-c")}
    try:
        await asyncio.gather(*(p.wait_ready() for p in procs.values()))
        runs, effects = tmp_path / "runs.txt", tmp_path / "effects.txt"
        again = asyncio.create_task(client.call(f"{sid}-again", [{
            "tool": "proc:idempotent_hold",
            "arguments": {"path": str(runs), "line": "again", "hold_s": 3}}], timeout=60))
        once = asyncio.create_task(client.call(f"{sid}-once", [{
            "tool": "proc:append_line",
            "arguments": {"path": str(effects), "line": "once", "hold_s": 60}}], timeout=60))
        await _until_file_has(runs, "again ")
        await _until_file_has(effects, "once ")
        # Kill every executor that holds one of the two calls; one of three survives.
        holders = {int(p.split("=")[1]) for f in (runs, effects)
                   for p in f.read_text().split() if p.startswith("pid=")}
        victims = [p for p in procs.values() if p.pid in holders]
        loop = asyncio.get_running_loop()
        for v in victims:
            v.kill()
        killed_at = loop.time()
        end_again, end_once = await again, await once
        took = loop.time() - killed_at
        # The re-run itself holds 3 s of that.
        print(f"calls of a SIGKILLed executor ended {took:.1f} s after the kill")
        assert took < 10
        assert isinstance(end_again, TurnCompleted) and end_again.ok
        assert end_again.outcomes[0].result["pid"] not in holders
        assert isinstance(end_once, TurnCompleted)
        err = end_once.outcomes[0].error
        assert err is not None and err.error_type == "interrupted"
        assert sum(1 for ln in effects.read_text().splitlines() if ln.startswith("once ")) == 1
    finally:
        for p in procs.values():
            p.stop()
