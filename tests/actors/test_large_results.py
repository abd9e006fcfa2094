"""Results of any size: no event over the limit, large results in the object store, turn
ends with references, and every reader resolving them on request."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

from bus.client import ToolbusClient
from bus.connection import Bus
from bus.eventlog import EventLog
from schemas.defaults import MAX_EVENT_BYTES
from schemas.events import TurnCompleted
from tests.conftest import (
    TESTS,
    Proc,
    assert_replay_equals_live,
    run_toolbus,
    toolbus_cmd,
)

KB = 1024


async def _max_event_size(bus: Bus, sid: str) -> int:
    return max(len(s.data) for s in await EventLog(bus).read_session(sid))


async def test_a_turn_of_twenty_results_of_200_kb_completes(
        bus: Bus, client: ToolbusClient, nats_url: str, sid: str) -> None:
    fills = "abcdefghijklmnopqrst"
    calls = [{"tool": "testing:blob", "arguments": {"size": 200 * KB, "fill": fills[i]}}
             for i in range(20)]
    end = await client.call(sid, calls, timeout=60)
    assert isinstance(end, TurnCompleted) and end.ok
    # Each result is in its own event; the turn's end only references them.
    assert [o.result for o in end.outcomes] == [f * 200 * KB for f in fills]
    assert await _max_event_size(bus, sid) <= MAX_EVENT_BYTES
    stored_end = (await client.find_end(sid, end.turn_id))
    assert isinstance(stored_end, TurnCompleted)
    assert all(o.result_seq is not None for o in stored_end.outcomes)

    state = await asyncio.to_thread(run_toolbus, "state", sid, "--nats", nats_url)
    assert state.returncode == 0, state.stderr
    calls_state = json.loads(state.stdout)["calls"]
    assert sorted(len(c["result"]) for c in calls_state.values()) == [200 * KB] * 20
    replay = await asyncio.to_thread(run_toolbus, "replay", sid, "--json", "--full",
                                     "--nats", nats_url)
    assert replay.returncode == 0, replay.stderr
    replayed = json.loads(replay.stdout.splitlines()[-1])["state"]
    assert replayed == json.loads(state.stdout)


async def test_a_result_over_the_event_limit_is_stored_as_a_reference(
        bus: Bus, client: ToolbusClient, nats_url: str, sid: str) -> None:
    size = 3 * MAX_EVENT_BYTES
    end = await client.call(sid, [{"tool": "testing:blob", "arguments": {"size": size}}],
                            timeout=60)
    assert isinstance(end, TurnCompleted) and end.ok
    out = end.outcomes[0]
    assert out.result is None and out.result_ref is not None
    assert out.result_ref.size == size + 2  # the JSON string's quotes
    assert out.result_ref.preview.startswith('"xxxx')
    assert await _max_event_size(bus, sid) <= MAX_EVENT_BYTES

    full = await client.call(sid, [{"tool": "testing:blob", "arguments": {"size": size}}],
                             timeout=60, full=True)
    assert isinstance(full, TurnCompleted) and full.outcomes[0].result == "x" * size

    call = await asyncio.to_thread(run_toolbus, "call", "testing:blob",
                                   json.dumps({"size": size}), "--session", sid,
                                   "--nats", nats_url)
    assert call.returncode == 0, call.stderr
    assert json.loads(call.stdout)["size"] == size + 2 and "--full prints it" in call.stderr
    call_full = await asyncio.to_thread(run_toolbus, "call", "testing:blob",
                                        json.dumps({"size": size}), "--full",
                                        "--session", sid, "--nats", nats_url)
    assert call_full.returncode == 0, call_full.stderr
    assert json.loads(call_full.stdout) == "x" * size
    assert "read from the object store" in call_full.stderr

    replay = await asyncio.to_thread(run_toolbus, "replay", sid, "--nats", nats_url)
    assert "stored as" in replay.stdout and "--full resolves them" in replay.stderr
    state_full = await asyncio.to_thread(run_toolbus, "state", sid, "--full",
                                         "--nats", nats_url)
    results = [c["result"] for c in json.loads(state_full.stdout)["calls"].values()]
    assert results == ["x" * size] * 4 and "resolved 4 result(s)" in state_full.stderr


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


async def test_a_50_mb_result_works_end_to_end_with_bounded_executor_memory(
        bus: Bus, client: ToolbusClient, nats_url: str, sid: str, tmp_path: Path) -> None:
    executor = Proc("actor", "executor", "--nats", nats_url, "--tools",
                    str(TESTS / "proc_toolkit.py"), "--instance", "ex-big",
                    ready="executor actor")
    try:
        await executor.wait_ready()
        size = 50 * 1024 * 1024
        end = await client.call(sid, [{"tool": "proc:blob", "arguments": {"size": size}}],
                                timeout=120)
        assert isinstance(end, TurnCompleted) and end.ok, end
        ref = end.outcomes[0].result_ref
        assert ref is not None and ref.size == size + 2
        peak = _peak_rss_mb(executor.pid)
        print(f"executor peak RSS with a 50 MB result: {peak:.0f} MB")
        assert peak < 200, f"executor peak RSS {peak:.0f} MB"
    finally:
        executor.stop()
    assert await _max_event_size(bus, sid) <= MAX_EVENT_BYTES
    out = tmp_path / "full.json"
    with out.open("w") as f:
        done = await asyncio.to_thread(
            subprocess.run, toolbus_cmd("replay", sid, "--full", "--json", "--nats", nats_url),
            stdout=f, stderr=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    last = out.read_text().splitlines()[-1]
    calls = json.loads(last)["state"]["calls"]
    assert [len(c["result"]) for c in calls.values()] == [size]
    await assert_replay_equals_live(bus, client, sid)
