"""toolbus on a real 3-node JetStream cluster (tests/cluster/conftest.py): R3 streams, the
end-to-end core cases through `toolbus up --nats URL,URL,URL`, and a node SIGKILLed under
load (the events stream's leader, then a follower) losing no call."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from bus.client import ToolbusClient
from bus.connection import Bus, connect
from bus.eventlog import EventLog
from bus.subjects import EVENTS_STREAM
from schemas.errors import ToolbusError
from schemas.events import CallFailed, CallSucceeded, TurnCompleted
from schemas.state import encode_state, fold
from tests.cluster.conftest import Cluster, Node
from tests.conftest import (
    REPO,
    Proc,
    assert_replay_equals_live,
    pending_approval_call,
    run_toolbus,
    toolbus_cmd,
)
from tests.mcp_servers import SampleServer

STREAMS = ("TOOLBUS_EVENTS", "TOOLBUS_REQUESTS", "KV_toolbus_catalog", "KV_toolbus_snapshots",
           "KV_toolbus_approvals", "KV_toolbus_executors", "OBJ_toolbus_artifacts")


@pytest.fixture(scope="module")
async def cars() -> AsyncIterator[SampleServer]:
    server = await SampleServer("streamable-http").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
async def up(cluster: Cluster, cars: SampleServer,
             tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Proc]:
    """`toolbus up --nats URL,URL,URL`: every actor against the cluster, no embedded
    server; the actor's URLs in its environment, as an operator would pass them."""
    manifest = tmp_path_factory.mktemp("manifest") / "manifest.yaml"
    manifest.write_text(f"mcps:\n  - id: cars\n    hostname: http://127.0.0.1\n"
                        f"    port: {cars.port}\n")
    proc = Proc("up", "--workers", "1", "--manifest", str(manifest), "--tools",
                "tests/toolkit.py", ready="stop:", env={"NATS_URL": cluster.url("actor")})
    try:
        banner = await proc.wait_ready()
        assert cluster.passwords["actor"] not in banner
        assert "embedded" not in banner
        # Its log is read all along by Proc (a full pipe would block its writes, and it,
        # when a node's death makes every actor log); the last lines are shown on failure.
        yield proc
    finally:
        if proc.proc.poll() is None:
            proc.proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.proc.wait(20)
        proc.stop()




@pytest.fixture(scope="module")
async def actor_bus(cluster: Cluster) -> AsyncIterator[Bus]:
    bus = await connect(cluster.url("actor"), name="test-cluster-actor")
    yield bus
    await bus.close()


@pytest.fixture(scope="module")
async def client_bus(cluster: Cluster) -> AsyncIterator[Bus]:
    bus = await connect(cluster.url("client"), name="test-cluster-client")
    yield bus
    await bus.close()


async def test_core_cases_pass_on_a_three_node_cluster_with_r3_streams(
        cluster: Cluster, up: Proc, actor_bus: Bus, client_bus: Bus) -> None:
    names = {s.config.name for s in await actor_bus.js.streams_info()}
    assert names >= set(STREAMS), names
    for name in sorted(n for n in names if n):  # every stream and bucket toolbus made
        info = await actor_bus.js.stream_info(name)
        assert info.config.num_replicas == 3, name
        assert info.cluster is not None and info.cluster.leader, name
        assert len(info.cluster.replicas or []) == 2, name

    client = ToolbusClient(client_bus)
    sid = f"cl-{uuid.uuid4().hex[:10]}"
    try:
        # Explicit calls, from the CLI with every node's URL, and from a client.
        out = await asyncio.to_thread(run_toolbus, "call", "built-in:echo", '{"text": "hi"}',
                                      "--session", sid, "--nats", cluster.url("client"))
        assert out.returncode == 0 and out.stdout == '{"text":"hi"}\n', out.stderr
        assert cluster.passwords["client"] not in out.stderr
        end = await client.call(sid, [{"tool": "built-in:echo", "arguments": {"n": 1}},
                                      {"tool": "built-in:echo", "arguments": {"n": 2}}],
                                timeout=30)
        assert isinstance(end, TurnCompleted) and end.ok
        assert [o.result for o in end.outcomes] == [{"n": 1}, {"n": 2}]

        # An MCP server's tool, through the connector.
        end = await client.call(sid, [{"tool": "cars:describe_car",
                                       "arguments": {"car_id": "c1"}}], timeout=30)
        assert isinstance(end, TurnCompleted) and end.ok, end

        # A call that waits for a human, approved with `toolbus approve`.
        asid = f"cl-a-{uuid.uuid4().hex[:8]}"
        waiting = subprocess.Popen(  # noqa: ASYNC220 - starting it does not block
            toolbus_cmd("call", "approvals:write", '{"text": "x"}', "--session", asid,
                        "--nats", cluster.url("client")),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        try:
            call_id = await pending_approval_call(cluster.url("approver"), asid)
            approved = await asyncio.to_thread(
                run_toolbus, "approve", call_id, "--session", asid, "--by", "alice",
                "--nats", cluster.url("approver"))
            assert approved.returncode == 0, approved.stderr + run_toolbus(
                "replay", asid, "--nats", cluster.url("client")).stdout
            out_text, err = await asyncio.to_thread(waiting.communicate, timeout=30)
            assert waiting.returncode == 0, err
            assert out_text == '{"wrote":"x"}\n'
        finally:
            if waiting.poll() is None:
                waiting.kill()
                waiting.wait()

        # Replay == live state, in process and through the CLI.
        for s in (sid, asid):
            await assert_replay_equals_live(client_bus, client, s)
        replay = await asyncio.to_thread(run_toolbus, "replay", asid, "--json", "--nats",
                                         cluster.url("client"))
        state = await asyncio.to_thread(run_toolbus, "state", asid, "--nats",
                                        cluster.url("client"))
        assert replay.returncode == 0 and state.returncode == 0, replay.stderr + state.stderr
        assert json.loads(state.stdout) == json.loads(replay.stdout.splitlines()[-1])["state"]
        types = [json.loads(line).get("event", {}).get("type")
                 for line in replay.stdout.splitlines()]
        assert types.count("approval.granted") == 1 and types.count("call.succeeded") == 1
    finally:
        await client.close()


# --- a node killed under load -----------------------------------------------------------

LOAD_WORKERS = 200  # calls in flight at once, each in its own session
RESUME_S = 15.0  # the acceptance bound: calls complete again within this after the kill
STUCK_S = 45.0  # a call that has not ended after this (retries included) never will


class Load:
    """Explicit `built-in:echo` calls kept in flight by `LOAD_WORKERS` loops until
    stopped. A call that times out or fails at the bus is retried with the same request
    id (idempotent: the stream's duplicate window, then the session actor's own check),
    so each request runs once however often it is sent."""

    def __init__(self, client: ToolbusClient, run: str) -> None:
        self.client = client
        self.run = run
        self.started: dict[str, float] = {}  # request id -> first publish (monotonic)
        self.ended: dict[str, float] = {}  # request id -> turn end seen
        self.sessions: dict[str, str] = {}  # request id -> session id
        self.errors: Counter[str] = Counter()
        self.stuck: list[str] = []  # requests that never ended
        self.acked: set[str] = set()  # requests the requests stream acknowledged
        self.progress = asyncio.Event()  # set at each call's end
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        submit = self.client.submit

        async def acked(session_id: str, body: bytes, *, request_id: str) -> Any:
            sub = await submit(session_id, body, request_id=request_id)
            self.acked.add(request_id)  # the requests stream holds it: it must run
            return sub

        self.client.submit = acked  # type: ignore[method-assign]  # observing, not changing
        self._tasks = [asyncio.create_task(self._loop(w)) for w in range(LOAD_WORKERS)]

    async def _loop(self, w: int) -> None:
        sid = f"load-{self.run}-{w}"
        i = 0
        while not self._stop.is_set():
            rid = f"{self.run}-{w}-{i}"
            i += 1
            self.sessions[rid] = sid
            self.started[rid] = time.monotonic()
            try:
                async with asyncio.timeout(STUCK_S):
                    while True:
                        try:
                            end = await self.client.call(
                                sid, [{"tool": "built-in:echo", "arguments": {"rid": rid}}],
                                request_id=rid, timeout=5)
                        except ToolbusError as exc:
                            self.errors[type(exc).__name__] += 1
                            continue
                        assert isinstance(end, TurnCompleted) and end.ok, \
                        f"{type(end).__name__}: {getattr(end, 'message', '')}"
                        assert end.outcomes[0].result == {"rid": rid}
                        self.ended[rid] = time.monotonic()
                        self.progress.set()
                        break
            except TimeoutError:
                self.stuck.append(rid)  # the test fails, naming it and its events
                return

    def completed_after(self, t: float) -> int:
        """Calls first sent after `t` that have ended."""
        return sum(1 for rid, end in self.ended.items() if self.started[rid] > t)

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


async def _events_leader(bus: Bus) -> str:
    info = await bus.js.stream_info(EVENTS_STREAM)
    assert info.cluster is not None and info.cluster.leader
    return info.cluster.leader


async def _until(predicate: Any, timeout: float, what: str) -> None:
    """Poll `predicate` (the cluster's state: nothing to wait on) for `timeout` s."""
    try:
        async with asyncio.timeout(timeout):
            while True:
                if await predicate():
                    return
                await asyncio.sleep(0.1)
    except TimeoutError:
        raise AssertionError(f"{what}: not within {timeout:g} s") from None


async def _caught_up(bus: Bus, cluster: Cluster, node: Node) -> bool:
    """`node` is back: healthy, and a current replica of every toolbus stream."""
    if not await asyncio.to_thread(node.healthy):
        return False
    for name in STREAMS:
        try:
            info = await bus.js.stream_info(name)
        except Exception:  # a stream between leaders answers a moment later
            return False
        c = info.cluster
        if c is None or c.leader is None:
            return False
        if c.leader != node.name and not any(
                r.name == node.name and r.current and not r.offline for r in c.replicas or []):
            return False
    return True


async def _kill_under_load(cluster: Cluster, bus: Bus, load: Load, node: Node) -> float:
    """SIGKILL `node` while calls flow; bounded waits until calls sent after the kill
    complete, then restart it and wait until it is a current replica again. Returns the
    seconds from the kill to the 20th completed call sent after it."""
    async with asyncio.timeout(30):
        while len(load.ended) < 50:
            load.progress.clear()
            await load.progress.wait()
    killed = time.monotonic()
    await asyncio.to_thread(cluster.kill, node)
    async with asyncio.timeout(RESUME_S):
        while load.completed_after(killed) < 20:
            load.progress.clear()
            await load.progress.wait()
    resumed = time.monotonic() - killed
    await asyncio.to_thread(cluster.start, node)
    await _until(lambda: _caught_up(bus, cluster, node), 60, f"{node.name} catching up")
    return resumed


async def test_killing_the_events_leader_then_a_follower_loses_no_call(
        cluster: Cluster, up: Proc, actor_bus: Bus, client_bus: Bus) -> None:
    await _until(lambda: _caught_up(actor_bus, cluster, cluster.nodes[0]), 30, "settled")
    client = ToolbusClient(client_bus, max_watched_sessions=10 * LOAD_WORKERS)
    load = Load(client, uuid.uuid4().hex[:6])
    load.start()
    try:
        leader = cluster.node(await _events_leader(actor_bus))
        resumed_leader = await _kill_under_load(cluster, actor_bus, load, leader)
        new_leader = await _events_leader(actor_bus)
        assert new_leader != leader.name
        follower = next(n for n in cluster.nodes if n.name != new_leader)
        resumed_follower = await _kill_under_load(cluster, actor_bus, load, follower)
    finally:
        try:
            await load.stop()
        except AssertionError:
            print("toolbus up logged, last:", *list(up.errors)[-200:], sep="\n  ")
            raise
    assert up.proc.poll() is None, "toolbus up died with a node"
    print(f"\n{len(load.ended)} calls; resumed {resumed_leader:.2f} s after the leader's "
          f"kill, {resumed_follower:.2f} s after the follower's; retries {dict(load.errors)}")

    # Every acknowledged request ran exactly once: one call, one terminal event, one end.
    log = EventLog(client_bus)
    for rid in load.stuck:
        sid = load.sessions[rid]
        told = [(s.seq, s.subject.split(".", 3)[-1]) for s in await log.read_session(sid)
                if s.event is not None and rid in repr(s.event)]
        state = await asyncio.to_thread(run_toolbus, "state", sid, "--nats",
                                        cluster.url("client"))
        live = json.loads(state.stdout) if state.returncode == 0 else {}
        print(f"stuck {rid} (acknowledged: {rid in load.acked}) in {sid}: {told}; "
              f"live: last_seq {live.get('last_seq')}, "
              f"turn {live.get('turns', {}).get(rid, {}).get('status')}, call "
              f"{live.get('calls', {}).get(f'{rid}-0', {}).get('status')}")
    if load.stuck:
        print("toolbus up logged, last:", *list(up.errors)[-200:], sep="\n  ")
    assert not load.stuck, load.stuck
    for sid in sorted(set(load.sessions.values())):
        events = [s.event for s in await log.read_session(sid) if s.event is not None]
        terminal = Counter(e.call_id for e in events if isinstance(e, CallSucceeded | CallFailed))
        ends = Counter(e.turn_id for e in events if isinstance(e, TurnCompleted))
        rids = [rid for rid, s in load.sessions.items() if s == sid]
        assert len(terminal) == len(rids), (sid, len(terminal), len(rids))
        assert set(terminal.values()) == {1}, [c for c, n in terminal.items() if n != 1]
        assert set(ends.values()) == {1}, [t for t, n in ends.items() if n != 1]
        assert not any(isinstance(e, CallFailed) for e in events)
        try:
            await assert_replay_equals_live(client_bus, client, sid)
        except AssertionError:
            await _explain_divergence(client_bus, client, sid)
            raise
    await client.close()


async def _explain_divergence(bus: Bus, client: ToolbusClient, sid: str) -> None:
    """Print where the session actor's live state and the replay differ."""
    live = msgspec.json.decode(msgspec.json.encode(await client.live_state(sid)))
    stored = await EventLog(bus).read_session(sid)
    replayed = msgspec.json.decode(encode_state(fold(
        sid, ((s.seq, s.event) for s in stored if s.event and s.seq <= live["last_seq"]))))
    for key in live:
        if live[key] != replayed.get(key):
            a, b = live[key], replayed.get(key)
            if isinstance(a, dict) and isinstance(b, dict):
                diff = {k: (a.get(k), b.get(k)) for k in {*a, *b} if a.get(k) != b.get(k)}
                print(f"{sid} {key} differs (live, replay): {str(diff)[:3000]}")
            else:
                print(f"{sid} {key} differs: live {str(a)[:500]} replay {str(b)[:500]}")
