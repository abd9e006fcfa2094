"""The planner's crash promise under chaos: two real planner processes (`toolbus actor
planner`; in the second test, two whole `toolbus up --nats URL` processes, executors
included) share the sessions while a seeded loop SIGKILLs one of them every 0.2 to 1.5 s
and starts it again: a random one, the writer of a `model.requested` or of a
`model.responded` the moment it is stored, or one still starting. Meanwhile clients drive
sessions of a few turns each (some sent while the turn before still runs), every turn one
or two model iterations of calls to a non-idempotent tool (`testing:append_line`, one
line per call), then an answer, from a local model server answering after a random short
delay.

What it checks, once the kills stop and every turn has ended (bounded waits): each turn
ended exactly once, and completed with the model's answer (a killed planner's turn goes on
elsewhere); each call ended exactly once, succeeded (or, with its executor killed,
`interrupted`); no line of the tool's file was written twice, and a succeeded call's
once (no side effect ran twice); no model question was asked after its `model.responded`
was stored (asking again before is allowed: a model call has no side effects); replay
equals the live state for every session; no process logged an error.

The suite runs a short seeded run of each; longer ones: `CHAOS_SEED=7 CHAOS_SESSIONS=40
CHAOS_TURNS=3 CHAOS_KILLS=20 pytest -n 0 tests/actors/test_planner_chaos.py`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from bus.client import ToolbusClient
from bus.connection import Bus, connect
from bus.eventlog import EventLog, decode_stored
from bus.headers import Header
from bus.server import EmbeddedServer, free_port
from bus.streams import provision
from schemas.errors import BusError
from schemas.events import (
    CallFailed,
    CallRejected,
    CallRequested,
    CallSucceeded,
    Event,
    ModelRequested,
    ModelResponded,
    TurnCancelled,
    TurnCompleted,
    TurnFailed,
    TurnRequested,
)
from tests.actors.test_planner import ScriptedChat, _as_stream, _kill, _planner_process, reply
from tests.conftest import Proc, assert_replay_equals_live

SEED = int(os.environ.get("CHAOS_SEED", "1"))
SESSIONS = int(os.environ.get("CHAOS_SESSIONS", "16"))
TURNS = int(os.environ.get("CHAOS_TURNS", "2"))
KILLS = int(os.environ.get("CHAOS_KILLS", "5"))

ENDS = (TurnCompleted, TurnFailed, TurnCancelled)
TERMINAL = (CallSucceeded, CallFailed, CallRejected)
TOOL = "testing__append_line"
_MESSAGE = re.compile(r"chaos (\S+) (\d+)")

Position = tuple[str, int, int]  # (session, turn number, model iteration)


def plan(seed: int, sid: str, turn: int) -> list[int]:
    """How many calls each of a turn's tool iterations makes (then the answer)."""
    rng = random.Random(f"{seed}:{sid}:{turn}")
    return [rng.choice([1, 2]) for _ in range(rng.choice([1, 1, 2]))]


def position(body: dict[str, Any]) -> Position | None:
    """Which session, turn and iteration a request asks about: the turn's message names
    the first two, and the assistant messages after it count the iterations before."""
    messages = body.get("messages") or []
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if not users:
        return None
    content = messages[users[-1]].get("content")
    if isinstance(content, list):
        content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    found = _MESSAGE.search(str(content))
    if found is None:
        return None
    after = sum(1 for m in messages[users[-1] + 1:] if m.get("role") == "assistant")
    return found[1], int(found[2]), after + 1


class ChaosChat(ScriptedChat):
    """Answers each turn's iterations from `plan` (the same answer however often it is
    asked), after a random short delay, and records when each position was asked."""

    def __init__(self, seed: int, path: Path) -> None:
        super().__init__()
        self.seed = seed
        self.path = path
        self.delays = random.Random(seed)
        self.asked: dict[Position, list[float]] = collections.defaultdict(list)
        self.strays: list[str] = []

    def answer(self, at: Position) -> dict[str, Any]:
        sid, turn, iteration = at
        iterations = plan(self.seed, sid, turn)
        if iteration > len(iterations):
            return reply(f"done {sid} {turn}")
        return reply(calls=[(f"c{iteration}_{i}", TOOL,
                             {"path": str(self.path), "line": f"{sid} {turn} {iteration} {i}"})
                            for i in range(iterations[iteration - 1])])

    async def _complete(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.received.append(body)
        at = position(body)
        if at is None:
            self.strays.append(json.dumps(body)[:500])
            return JSONResponse({"error": {"message": "no chaos message"}}, status_code=400)
        self.asked[at].append(time.monotonic())
        await asyncio.sleep(self.delays.uniform(0, 0.3))  # kills land at varied points
        return Response(_as_stream(self.answer(at)), media_type="text/event-stream")


class Fleet:
    """Two processes made by `make`, each started again as soon as it is killed."""

    def __init__(self, make: Callable[[], Proc]) -> None:
        self.make = make
        self.procs: list[Proc] = []
        self.ready: list[asyncio.Task[str]] = []
        self.killed: list[Proc] = []

    def start(self, slot: int) -> None:
        proc = self.make()
        task = asyncio.create_task(proc.wait_ready(60))
        if slot < len(self.procs):
            self.procs[slot], self.ready[slot] = proc, task
        else:
            self.procs.append(proc)
            self.ready.append(task)

    async def kill(self, slot: int) -> None:
        proc, task = self.procs[slot], self.ready[slot]
        await _kill(proc)
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        self.killed.append(proc)
        self.start(slot)

    async def stop(self) -> None:
        for task in self.ready:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        await asyncio.gather(*(asyncio.to_thread(p.stop) for p in self.procs))

    def errors(self) -> list[str]:
        """What the processes (the killed ones included) logged at ERROR or with a
        traceback, each record whole."""
        found: list[str] = []
        for proc in [*self.killed, *self.procs]:
            records: list[list[str]] = []
            for line in proc.errors:
                if _LOGGED.match(line) or not records:
                    records.append([])
                records[-1].append(line.rstrip())
            found += [f"pid {proc.pid}: " + "\n".join(r if len(r) <= 40 else
                                                      [*r[:5], "...", *r[-30:]])
                      for r in records
                      if " ERROR " in r[0] or any(x.startswith("Traceback") for x in r)]
        return found


class Tripwire:
    """The pid of the process that writes the next stored event of a type (its writer's
    name, `host-pid-random`, is on each event: bus/partitions.member_name)."""

    def __init__(self) -> None:
        self._armed: tuple[str, asyncio.Future[int]] | None = None

    async def on_live(self, msg: Any) -> None:
        if self._armed is None or not msg.subject.endswith(self._armed[0]):
            return
        found = _PID.search((msg.headers or {}).get(Header.WRITER.value, ""))
        if found is not None and not self._armed[1].done():
            self._armed[1].set_result(int(found[1]))

    async def next(self, suffix: str, timeout: float) -> int | None:
        self._armed = (suffix, asyncio.get_running_loop().create_future())
        try:
            async with asyncio.timeout(timeout):
                return await self._armed[1]
        except TimeoutError:
            return None
        finally:
            self._armed = None


_LOGGED = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")  # a log line's start
_PID = re.compile(r"-(\d+)-[0-9a-f]{6}$")


async def chaos(fleet: Fleet, rng: random.Random, kills: int, busy: asyncio.Event,
                run: Run, tripwire: Tripwire) -> None:
    """SIGKILL a ready process every 0.2 to 1.5 s, `kills` times or until the clients are
    done (`busy` cleared): a random one, or the writer of the next `model.requested`
    (its model being asked) or `model.responded` (its answer stored, what it makes due
    maybe not) the moment it is stored, or one still starting."""
    t0 = time.monotonic()
    while len(run.kills) < kills:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(rng.uniform(0.2, 1.5)):
                await _cleared(busy)
        if not busy.is_set():
            break
        ready = [i for i, t in enumerate(fleet.ready) if t.done() and not t.cancelled()
                 and t.exception() is None]
        if not ready:
            # Both starting: wait for one, bounded (a start takes a few seconds).
            await asyncio.wait(fleet.ready, timeout=60, return_when=asyncio.FIRST_COMPLETED)
            continue
        slot = rng.choice(ready)
        how = rng.choice(["at random", "model.requested", "model.responded", "at random",
                          "starting"])
        if how == "starting":  # one restarted, before it says it is ready
            starting = [i for i, t in enumerate(fleet.ready) if not t.done()]
            if not starting:
                continue
            slot = starting[0]
        elif how != "at random":
            pid = await tripwire.next(how, timeout=2)
            writer = [i for i in ready if fleet.procs[i].pid == pid]
            if not writer:
                continue  # none stored meanwhile, or by a process already gone
            slot = writer[0]
        run.kills.append(time.monotonic())
        run.notes.append(f"+{run.kills[-1] - t0:.2f} kill process {slot} "
                         f"(pid {fleet.procs[slot].pid}) {how}")
        await fleet.kill(slot)


async def _cleared(event: asyncio.Event) -> None:
    while event.is_set():  # noqa: ASYNC110 - an Event has no wait-until-cleared
        await asyncio.sleep(0.05)


async def drive(client: ToolbusClient, sid: str, turns: int, start: float,
                rng: random.Random, answers: dict[str, list[Any]]) -> None:
    """One session's client: after `start` seconds, its turns one after another, a
    quarter of them sent while the one before still runs (queued behind it)."""

    async def ask(turn: int) -> None:
        try:
            answers[sid].append(await client.ask(sid, f"chaos {sid} {turn}",
                                                 request_id=f"r{turn}", timeout=60))
        except Exception as exc:  # told in the report, never a hang
            answers[sid].append(f"turn {turn}: {exc!r}")

    await asyncio.sleep(start)
    asking: list[asyncio.Task[None]] = []
    for turn in range(1, turns + 1):
        asking.append(asyncio.create_task(ask(turn)))
        if turn == turns or rng.random() > 0.25:
            await asyncio.gather(*asking)
            asking = []
        await asyncio.sleep(rng.uniform(0, 0.3))


def faults_of(sid: str, events: list[Event], seed: int, turns: int, *,
              interrupted: bool, lines: collections.Counter[str]) -> list[str]:
    """What is wrong in one session's log; `interrupted`: a call may end so (its executor
    was killed), `lines`: how often the tool wrote each line."""
    faults: list[str] = []
    requested = [e for e in events if isinstance(e, TurnRequested)]
    if len(requested) != turns:
        faults.append(f"{sid}: {len(requested)} turns stored, not {turns}")
    for t in requested:
        ends = [e for e in events if isinstance(e, ENDS) and e.turn_id == t.turn_id]
        number = int(t.turn_id[1:])
        if len(ends) != 1:
            faults.append(f"{sid}: turn {t.turn_id} ended {len(ends)} times")
        elif not isinstance(ends[0], TurnCompleted) or \
                ends[0].text != f"done {sid} {number}":
            faults.append(f"{sid}: turn {t.turn_id} ended {ends[0]!r}")
        answered = sorted(e.iteration for e in events
                          if isinstance(e, ModelResponded) and e.turn_id == t.turn_id)
        want = list(range(1, len(plan(seed, sid, number)) + 2))
        if answered != want:
            faults.append(f"{sid}: turn {t.turn_id} answered iterations {answered}, "
                          f"not {want}")
    asked = [(e.turn_id, e.iteration) for e in events if isinstance(e, ModelRequested)]
    if len(set(asked)) != len(asked):
        faults.append(f"{sid}: a model question stored twice")
    calls = [e for e in events if isinstance(e, CallRequested)]
    if len({c.call_id for c in calls}) != len(calls):
        faults.append(f"{sid}: a call was requested twice")
    for c in calls:
        ends = [e for e in events if isinstance(e, TERMINAL) and e.call_id == c.call_id]
        written = lines[c.arguments["line"]]
        if len(ends) != 1:
            faults.append(f"{sid}: call {c.call_id} ended {len(ends)} times: "
                          f"{[type(e).__name__ for e in ends]}")
        elif isinstance(ends[0], CallSucceeded):
            if written != 1:
                faults.append(f"{sid}: call {c.call_id} succeeded, its line written "
                              f"{written} times")
        elif interrupted and isinstance(ends[0], CallFailed) and \
                ends[0].error_type == "interrupted":
            if written > 1:  # its effect is unknown: done once at most
                faults.append(f"{sid}: call {c.call_id} interrupted, its line written "
                              f"{written} times")
        else:
            faults.append(f"{sid}: call {c.call_id} ended {ends[0]!r}")
    return faults


@dataclass
class Run:
    """What a chaos run saw."""

    kills: list[float] = field(default_factory=list)  # when (monotonic)
    asked_again: int = 0  # model requests about a position asked before
    unexplained: int = 0  # of which no kill came between the first and this one
    interrupted: int = 0  # calls ended `interrupted`
    tool_runs: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


async def run_chaos(bus: Bus, client: ToolbusClient, make: Callable[[ChaosChat], Proc],
                    path: Path, *, interrupted: bool) -> Run:
    """Sessions driven while the processes `make` starts are killed; what went wrong."""
    rng = random.Random(SEED)
    path.touch()
    model = await ChaosChat(SEED, path).start()
    sids = [f"chaos-{SEED}-{i}-{rng.getrandbits(24):06x}" for i in range(SESSIONS)]
    answers: dict[str, list[Any]] = collections.defaultdict(list)
    run = Run()
    # When each answer was stored, as this process sees it (the server republishes each
    # stored event): a request that reaches the model after it asked again.
    stored_at: dict[tuple[str, str, int], float] = {}

    async def on_answer(msg: Any) -> None:
        event = decode_stored(0, msg.subject, msg.data).event
        if isinstance(event, ModelResponded):
            stored_at.setdefault((event.session_id, event.turn_id, event.iteration),
                                 time.monotonic())

    sub = await bus.nc.subscribe("toolbus.live.*.model.responded", cb=on_answer)
    tripwire = Tripwire()
    wire = await bus.nc.subscribe("toolbus.live.*.model.*", cb=tripwire.on_live)
    fleet = Fleet(lambda: make(model))
    t0 = time.monotonic()
    try:
        fleet.start(0)
        fleet.start(1)
        await asyncio.gather(*fleet.ready)
        busy = asyncio.Event()
        busy.set()
        window = KILLS * 1.2  # about how long the kills take
        drivers = asyncio.gather(*(
            drive(client, sid, TURNS, rng.uniform(0, window), random.Random(rng.random()),
                  answers) for sid in sids))
        killing = asyncio.create_task(chaos(fleet, random.Random(rng.random()), KILLS,
                                            busy, run, tripwire))
        try:
            async with asyncio.timeout(60 + 10 * TURNS + 2 * KILLS):
                await drivers
        finally:
            busy.clear()
            await killing
        elapsed = time.monotonic() - t0
        # Checked while the processes run (the live state is a session actor's): both,
        # the last restarted too.
        await asyncio.wait(fleet.ready, timeout=60)
        await check(bus, client, sids, answers, model, stored_at, path, run,
                    interrupted=interrupted)
    finally:
        await sub.unsubscribe()
        await wire.unsubscribe()
        await fleet.stop()
        await model.stop()
    run.problems += [f"a process logged: {line}" for line in fleet.errors()]
    hows = collections.Counter(n.split(")", 1)[1].strip() for n in run.notes)
    print(f"seed {SEED}: {SESSIONS} sessions x {TURNS} turns, {len(run.kills)} kills "
          f"({', '.join(f'{n} {h}' for h, n in sorted(hows.items()))}), "
          f"{len(model.received)} model requests ({run.asked_again} asked again, "
          f"{run.unexplained} with no kill since the first), {run.tool_runs} tool runs, "
          f"{run.interrupted} calls interrupted, {elapsed:.1f} s")
    return run


async def check(bus: Bus, client: ToolbusClient, sids: list[str],
                answers: dict[str, list[Any]], model: ChaosChat,
                stored_at: dict[tuple[str, str, int], float], path: Path, run: Run, *,
                interrupted: bool) -> None:
    lines = collections.Counter(path.read_text().splitlines())
    run.problems += [f"the tool ran twice: {line!r}" for line, n in lines.items() if n > 1]
    called: set[str] = set()
    for sid in sids:
        run.problems += [f"{sid}: the client got {a}" for a in answers[sid]
                         if isinstance(a, str)]
        events = [s.event for s in await EventLog(bus).read_session(sid)
                  if s.event is not None]
        called |= {e.arguments["line"] for e in events if isinstance(e, CallRequested)}
        run.interrupted += sum(1 for e in events if isinstance(e, CallFailed)
                               and e.error_type == "interrupted")
        run.problems += faults_of(sid, events, SEED, TURNS, interrupted=interrupted,
                                  lines=lines)
        try:
            await _replay_equals_live(bus, client, sid)
        except AssertionError as exc:
            run.problems.append(f"{sid}: replay differs from the live state: {exc}")
    run.problems += [f"a line no stored call wrote: {line!r}" for line in lines
                     if line not in called]
    # The model rule: asked again only before the answer was stored.
    for (sid, turn_id, iteration), stored in stored_at.items():
        times = model.asked.get((sid, int(turn_id[1:]), iteration), [])
        late = [t for t in times if t > stored]
        if late:
            run.problems.append(f"{sid}: turn {turn_id} iteration {iteration} asked "
                                f"{len(late)} more time(s) after its answer was stored, "
                                f"{late[0] - stored:.3f} s after")
        run.asked_again += max(0, len(times) - 1)
        # (a request sent just before its process was killed may reach the model after)
        run.unexplained += sum(1 for t in times[1:]
                               if not any(times[0] - 0.5 < k < t for k in run.kills))
    run.problems += [f"a request about no chaos turn: {s}" for s in model.strays]
    run.tool_runs = sum(lines.values())


async def _replay_equals_live(bus: Bus, client: ToolbusClient, sid: str) -> None:
    """`assert_replay_equals_live`, asked again (bounded) while no session actor answers
    for the session: its partition's owner was just killed, and its lease not yet taken."""
    async with asyncio.timeout(30):
        while True:
            try:
                return await assert_replay_equals_live(bus, client, sid)
            except BusError:
                await asyncio.sleep(0.5)


def _report(run: Run) -> str:
    return f"seed {SEED} (CHAOS_SEED):\n" + "\n".join(run.problems[:40] + run.notes)


async def test_planners_killed_at_random_moments_lose_no_turn_and_repeat_no_effect(
        bus: Bus, system: dict[str, Any], client: ToolbusClient, nats_url: str,
        tmp_path: Path) -> None:
    """Planner processes killed; the session, approval and executor actors (this
    process's) live on: every call succeeds, once."""
    run = await run_chaos(
        bus, client, lambda model: _planner_process(tmp_path, model, nats_url),
        tmp_path / "effects.log", interrupted=False)
    assert not run.problems, _report(run)


async def test_whole_runtimes_killed_at_random_moments_lose_no_turn_and_repeat_no_effect(
        tmp_path: Path) -> None:
    """`toolbus up --nats URL` processes (every actor, the executor of the tool too)
    killed, on a server of their own: a call whose executor died mid-run ends
    `interrupted`, never runs twice."""
    server = EmbeddedServer(tmp_path / "nats", port=free_port()).start()
    manifest = tmp_path / "up.yaml"
    bus: Bus | None = None
    client: ToolbusClient | None = None
    try:
        bus = await connect(server.url, name="chaos")
        await provision(bus)
        client = ToolbusClient(bus, max_watched_sessions=100_000)

        def make(model: ChaosChat) -> Proc:
            manifest.write_text(
                "policy:\n"
                "  auto_approve: ['testing:*']\n"
                "agent_config:\n"
                "  model:\n"
                "    provider: openai\n"
                "    model: scripted\n"
                f"    base_url: http://127.0.0.1:{model.port}/v1\n"
                "    api_key: ${SCRIPTED_KEY}\n")
            return Proc("up", "--nats", server.url, "--workers", "1", "--manifest",
                        str(manifest), "--tools", "tests/toolkit.py", "--ack-wait", "1",
                        ready="stop:", env={"SCRIPTED_KEY": "k"})

        run = await run_chaos(bus, client, make, tmp_path / "effects.log", interrupted=True)
    finally:
        if client is not None:
            await client.close()
        if bus is not None:
            await bus.close()
        server.stop()
    assert not run.problems, _report(run)
