"""`toolbus bench`: end-to-end numbers beside the floor measured in the same run.

Machines here are shared and noisy, so absolute numbers mean little alone: every run
also measures its floor (raw JetStream publish+ack and raw core request/reply from the
same client, a direct MCP call, a bare interpreter start), prints each figure beside it
with the ratio, and prints the machine's load and CPU count in the header.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from bus.auth import redact
from bus.baseline import (
    BARE_EVENTS_DELIVERIES,
    BARE_EVENTS_STORED,
    bare_client,
    bare_events_client,
    bare_events_streams,
    bare_stream,
    raw_chain,
    raw_ops,
)
from bus.client import ToolbusClient
from bus.connection import Bus, connect
from bus.eventlog import Append, EventLog
from bus.server import EmbeddedServer, free_port
from bus.streams import provision
from schemas.defaults import LEASE_RENEW_S
from schemas.errors import ConfigError, WorkerError
from schemas.events import (
    CallApproved,
    CallDispatched,
    CallOutcome,
    CallRequested,
    CallStarted,
    CallSucceeded,
    Event,
    TurnCompleted,
    TurnRequested,
    decode_event,
)
from schemas.ids import (
    call_id_for,
    call_requested_id,
    call_started_id,
    call_terminal_id,
    dispatch_id,
    policy_decision_id,
    tool_event_id,
    turn_ended_id,
    turn_requested_id,
)
from schemas.state import fold
from schemas.tools import pool_route
from services.config import usable_cpus
from services.process import die_with_parent

Op = Callable[[int], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Stats:
    name: str
    n: int
    concurrency: int
    seconds: float
    p50_ms: float
    p99_ms: float

    @property
    def per_s(self) -> float:
        return self.n / self.seconds if self.seconds else 0.0

    def figure(self, which: str) -> float:
        return {"p50": self.p50_ms, "p99": self.p99_ms, "per_s": self.per_s}[which]


def _stats(name: str, lat: list[float], *, seconds: float, concurrency: int) -> Stats:
    ordered = sorted(lat)
    return Stats(name, len(lat), concurrency, seconds, statistics.median(ordered) * 1e3,
                 ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3)


@dataclass(frozen=True, slots=True)
class Versus:
    """One figure of a measurement beside a figure of its floor: `value / floor_value`
    (how many times the floor's latency, or what fraction of the floor's rate)."""

    figure: str  # "p50" | "p99" | "per_s" of the measurement
    floor: Stats
    floor_figure: str  # "p50" | "per_s" of the floor
    value: float
    floor_value: float

    @property
    def ratio(self) -> float:
        return self.value / self.floor_value if self.floor_value else float("inf")


@dataclass(slots=True)
class Line:
    """A measurement and the floors it is compared with."""

    stats: Stats
    versus: list[Versus] = field(default_factory=list)

    def beside(self, floor: Stats, *figures: tuple[str, str]) -> Line:
        for mine, theirs in figures:
            self.versus.append(Versus(mine, floor, theirs, self.stats.figure(mine),
                                      floor.figure(theirs)))
        return self

    def ratio(self, figure: str, floor: Stats) -> float:
        return next(v.ratio for v in self.versus if v.figure == figure and v.floor is floor)


# Latency figures are compared with the floor's p50 (its typical cost), rates with rates.
LATENCY = (("p50", "p50"), ("p99", "p50"))
RATE = (("per_s", "per_s"),)


def _line_json(line: Line) -> dict[str, Any]:
    r = line.stats
    return {"name": r.name, "n": r.n, "concurrency": r.concurrency,
            "p50_ms": round(r.p50_ms, 3), "p99_ms": round(r.p99_ms, 3),
            "per_s": round(r.per_s, 1),
            "vs": [{"figure": v.figure, "floor": v.floor.name,
                    "floor_concurrency": v.floor.concurrency, "floor_figure": v.floor_figure,
                    "floor_value": round(v.floor_value, 3), "ratio": round(v.ratio, 3)}
                   for v in line.versus]}


def _floor_text(v: Versus) -> str:
    value = (f"{v.floor_value:.3f} ms" if v.floor_figure != "per_s"
             else f"{v.floor_value:.0f}/s")
    return f"{v.floor.name} [{v.floor.concurrency}] {v.floor_figure} {value}"


def _print_lines(lines: list[Line]) -> None:
    # As wide as the longest name, so that every row's figures line up.
    width = max([34, *(len(line.stats.name) for line in lines)])
    floor_width = max([48, *(len(_floor_text(v)) for line in lines for v in line.versus)])
    head = (f"{'measure':<{width}} {'in flight':>9} {'p50 ms':>8} {'p99 ms':>8} "
            f"{'per s':>8}  {'floor':<{floor_width}} ratio")
    print(head)
    for line in lines:
        r = line.stats
        main = (f"{r.name:<{width}} {r.concurrency:>9} {r.p50_ms:>8.3f} {r.p99_ms:>8.3f} "
                f"{r.per_s:>8.0f}")
        groups: dict[tuple[int, str], list[Versus]] = {}
        for v in line.versus:
            groups.setdefault((id(v.floor), v.floor_figure), []).append(v)
        if not groups:
            print(f"{main}  -")
        for i, items in enumerate(groups.values()):
            ratios = "  ".join(f"{v.figure} {v.ratio:.2f}x" for v in items)
            print(f"{main if i == 0 else ' ' * len(main)}  "
                  f"{_floor_text(items[0]):<{floor_width}} {ratios}")


# --- machine ----------------------------------------------------------------------------


def _machine() -> dict[str, Any]:
    cpus = os.cpu_count() or 0
    usable = usable_cpus()
    return {"loadavg": [round(x, 2) for x in os.getloadavg()], "cpus": cpus,
            "cpus_usable": usable}


# The processes of a benchmark, by what they are (their command line), for `_cpu_seconds`.
_PROCESS_KINDS = (("nats-server", "nats-server"), ("services.cli up", "toolbus up"),
                  (" actor worker", "toolbus workers"),
                  ("services.sample_llm", "model server"),
                  ("services.sample_mcp", "MCP server"),
                  ("services.bare_turn actor", "bare actor"),
                  ("services.bare_turn worker", "bare worker"))


def _cpu_seconds() -> dict[str, float]:
    """CPU time (user + system, s) used so far by this process ("this client") and by its
    descendants, by kind; empty where /proc is not there to read."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    procs: dict[int, tuple[int, str, float]] = {}  # pid -> (parent, command, cpu s)
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue  # gone meanwhile, or not readable
        procs[pid] = (int(fields[1]), command, (int(fields[11]) + int(fields[12])) / tick)
    me = os.getpid()
    out: dict[str, float] = {}
    for pid, (_, command, cpu) in procs.items():
        ancestor, hops = pid, 0
        while ancestor not in (me, 0, 1) and ancestor in procs and hops < 16:
            ancestor, hops = procs[ancestor][0], hops + 1
        if ancestor != me:
            continue
        kind = "this client" if pid == me else next(
            (k for pattern, k in _PROCESS_KINDS if pattern in command), "other")
        out[kind] = out.get(kind, 0.0) + cpu
    return out


def _cpu_per_op(before: dict[str, float], after: dict[str, float], n: int) -> dict[str, float]:
    """CPU ms per operation of each kind of process between two `_cpu_seconds`."""
    # A process that ran but spent less than a /proc tick over the run shows 0, not absent.
    per = {k: max(round((after[k] - before.get(k, 0.0)) * 1000 / n, 2), 0.0) for k in after}
    return {**dict(sorted(per.items())), "all": round(sum(per.values()), 2)}


def _header(what: str, machine: dict[str, Any], settings: str) -> str:
    one, five, fifteen = machine["loadavg"]
    cpus = f"{machine['cpus']} CPUs"
    if machine["cpus_usable"] != machine["cpus"]:
        cpus += f" ({machine['cpus_usable']} usable)"
    return (f"toolbus bench {what}: load {one:.2f} {five:.2f} {fifteen:.2f} (1/5/15 min) "
            f"on {cpus}; {settings}")


def _finish(report: dict[str, Any]) -> None:
    report["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]


def _fsync_text(nats_url: str | None, fsync: str) -> str:
    return f"fsync {fsync} (embedded nats-server)" if not nats_url else \
        f"server {redact(nats_url)} (fsync as configured there)"


# --- measuring --------------------------------------------------------------------------


def _cancelled_quietly() -> None:
    """Raise CancelledError if this task was cancelled and the cancellation was lost
    (inside nats-py's `asyncio.wait_for`, on Python 3.11: bus/tasks.py). Checked between
    operations, outside their timing: Ctrl-C or SIGTERM would otherwise go unnoticed
    until a loop of thousands ended."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def measure(name: str, op: Op, *, n: int, concurrency: int) -> Stats:
    lat: list[float] = []
    counter = iter(range(n))

    async def worker() -> None:
        for i in counter:
            t = time.perf_counter()
            await op(i)
            lat.append(time.perf_counter() - t)
            _cancelled_quietly()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return _stats(name, lat, seconds=time.perf_counter() - t0, concurrency=concurrency)


async def _series(op: Op, n: int) -> list[float]:
    """The latency of each of `n` sequential operations, in order."""
    lat: list[float] = []
    for i in range(n):
        t = time.perf_counter()
        await op(i)
        lat.append(time.perf_counter() - t)
        _cancelled_quietly()
    return lat


@contextlib.asynccontextmanager
async def _server(nats_url: str | None, *, fsync: str) -> AsyncIterator[str]:
    """The given server, or an embedded one in a temporary folder, stopped afterwards."""
    if nats_url:
        yield nats_url
        return
    with tempfile.TemporaryDirectory(prefix="toolbus-bench-") as tmp:
        server = EmbeddedServer(Path(tmp), port=free_port(), fsync=fsync,
                                monitor_port=free_port())
        server.preexec = die_with_parent  # not left running if this process is killed
        server.start()
        _MONITORS[server.url] = server.monitor_port
        try:
            yield server.url
        finally:
            _MONITORS.pop(server.url, None)
            server.stop()


# The monitoring port of each embedded server a benchmark started, by URL.
_MONITORS: dict[str, int | None] = {}


async def _messages(http: Any, url: str) -> tuple[int, int] | None:
    """How many messages the embedded server at `url` has received and sent so far
    (`/varz`: publishes, acks, API requests and replies, deliveries), or None for a server
    this benchmark did not start."""
    port = _MONITORS.get(url)
    if port is None:
        return None
    varz = msgspec.json.decode((await http.get(f"http://127.0.0.1:{port}/varz")).content)
    return int(varz["in_msgs"]), int(varz["out_msgs"])


def _per_op(before: tuple[int, int] | None, after: tuple[int, int] | None,
            n: int) -> dict[str, float]:
    if before is None or after is None:
        return {}
    return {"in": round((after[0] - before[0]) / n, 1),
            "out": round((after[1] - before[1]) / n, 1)}


def _workers_args(workers: int | None) -> tuple[str, ...]:
    return () if workers is None else ("--workers", str(workers))


@contextlib.asynccontextmanager
async def _system(nats_url: str | None, *up_args: str, fsync: str = "batch",
                  env: dict[str, str] | None = None) -> AsyncIterator[str]:
    """A toolbus to measure: the given one, or an embedded server plus `toolbus up` in a
    separate process (as users run it, with `env` added to its environment), torn down
    afterwards."""
    if nats_url:
        yield nats_url
        return
    # Its stderr goes to a file, not a pipe nobody drains, and is shown if it fails.
    async with _server(None, fsync=fsync) as url:
        with tempfile.TemporaryFile() as errors:
            proc = subprocess.Popen(  # noqa: ASYNC220 - once, before anything is measured
                # The URL holds the actor's password: in the environment, not in argv.
                [sys.executable, "-m", "services.cli", "up", *up_args],
                stdout=subprocess.PIPE, stderr=errors, text=True, preexec_fn=die_with_parent,
                env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1", "NATS_URL": url},
            )
            try:
                assert proc.stdout is not None
                line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
                if not line.startswith("toolbus is up"):
                    proc.wait(15)
                    errors.seek(0)
                    tail = errors.read()[-2000:].decode(errors="replace").strip()
                    raise ConfigError(f"the measured `toolbus up` did not start: "
                                      f"{tail or line or 'no output'}")
                yield url
            finally:
                proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(15)
                if proc.poll() is None:
                    proc.kill()


@dataclass(frozen=True, slots=True)
class Floors:
    js: Stats  # raw JetStream publish+ack, one at a time
    rr: Stats  # raw core request/reply, one at a time
    js_par: Stats | None  # raw JetStream publish+ack, `concurrency` in flight


async def _floors(bus: Bus, responder: Bus, *, n: int, concurrency: int | None) -> Floors:
    async with raw_ops(bus, responder, b'{"text":"hi"}') as (publish, request):
        await measure("warm-up", publish, n=min(n, 200), concurrency=1)
        js = await measure("raw JetStream publish+ack", publish, n=n, concurrency=1)
        rr = await measure("raw request/reply", request, n=n, concurrency=1)
        js_par = (await measure("raw JetStream publish+ack", publish, n=n,
                                concurrency=concurrency) if concurrency else None)
    return Floors(js, rr, js_par)


def _floor_lines(f: Floors) -> list[Line]:
    return [Line(f.js), Line(f.rr), *([Line(f.js_par)] if f.js_par else [])]


# --- calls ------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _session_actors(url: str, count: int) -> AsyncIterator[None]:
    """`count` more session-actor processes on `url`, holding their share of the
    partitions (given two lease rounds to settle) until the block ends."""
    procs = []
    try:
        for i in range(count):
            proc = subprocess.Popen(  # noqa: ASYNC220 - before anything is measured
                [sys.executable, "-m", "services.cli", "actor", "session",
                 "--instance", f"bench-{i + 2}"], preexec_fn=die_with_parent,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "NATS_URL": url})
            procs.append(proc)
            assert proc.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
            if "session actor" not in line:
                raise ConfigError(f"a session-actor process did not start: {line or 'no output'}")
        if procs:
            await asyncio.sleep(3 * LEASE_RENEW_S)
        yield
    finally:
        for proc in procs:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(15)
            if proc.poll() is None:
                proc.kill()


async def bench_calls(nats_url: str | None, *, n: int = 2000, concurrency: int = 32,
                      turns: int = 1000, fsync: str = "batch", json_out: bool = False,
                      workers: int | None = None, session_actors: int = 1) -> int:
    """Explicit `built-in:echo` calls end to end (request published -> turn completed and
    seen by the client), one at a time and `concurrency` in flight; then `turns` turns of
    one session, to show a turn costs the same late in a long session as early. With
    `session_actors` > 1, that many session-actor processes share the partitions (the
    one of `toolbus up`, and `toolbus actor session` for each other)."""
    machine = _machine()
    async with _system(nats_url, *_workers_args(workers), fsync=fsync) as url, \
            _session_actors(url, session_actors - 1):
        bus = await connect(url, name="toolbus-bench")
        responder = await connect(url, name="toolbus-bench-responder")
        client = ToolbusClient(bus)
        run = os.urandom(3).hex()
        failures = 0

        def echo_in(session: Callable[[int], str]) -> Op:
            async def op(i: int) -> None:
                nonlocal failures
                end = await client.call(session(i), [{"tool": "built-in:echo",
                                                      "arguments": {"text": "hi", "i": i}}],
                                        timeout=30)
                if not (isinstance(end, TurnCompleted) and end.ok):
                    failures += 1
            return op

        try:
            await measure("warm-up", echo_in(lambda i: f"bench-{run}-warm"), n=200, concurrency=4)
            floors = await _floors(bus, responder, n=n, concurrency=concurrency)
            seq = await measure("toolbus call built-in:echo", echo_in(lambda i: f"bench-{run}-seq"),
                                n=n, concurrency=1)
            par = await measure("toolbus call built-in:echo",
                                echo_in(lambda i: f"bench-{run}-p{i % concurrency}"),
                                n=n, concurrency=concurrency)
            lat = await _series(echo_in(lambda i: f"bench-{run}-long"), turns)
        finally:
            await client.close()
            await responder.close()
            await bus.close()

    window = max(1, min(50, turns // 2))
    early = _stats(f"one session, turns 1..{window}", lat[:window],
                   seconds=sum(lat[:window]), concurrency=1)
    late = _stats(f"one session, turns {turns - window + 1}..{turns}", lat[-window:],
                  seconds=sum(lat[-window:]), concurrency=1)
    assert floors.js_par is not None
    seq_line = Line(seq).beside(floors.js, *LATENCY).beside(floors.rr, *LATENCY)
    par_line = Line(par).beside(floors.js, *RATE).beside(floors.js_par, *RATE)
    late_line = Line(late).beside(early, *LATENCY)
    lines = [*_floor_lines(floors), seq_line, par_line, Line(early), late_line]
    report: dict[str, Any] = {
        "machine": machine, "fsync": fsync if not nats_url else None,
        "session_actors": session_actors,
        "rows": [_line_json(x) for x in lines],
        "ratios": {
            "seq_p50_vs_js_publish": round(seq_line.ratio("p50", floors.js), 2),
            "seq_p99_vs_js_publish": round(seq_line.ratio("p99", floors.js), 2),
            "seq_p50_vs_request_reply": round(seq_line.ratio("p50", floors.rr), 2),
            "seq_p99_vs_request_reply": round(seq_line.ratio("p99", floors.rr), 2),
            "throughput_vs_js_publish_seq": round(par_line.ratio("per_s", floors.js), 3),
            "throughput_vs_js_publish": round(par_line.ratio("per_s", floors.js_par), 3),
            "late_turns_p50_vs_early": round(late_line.ratio("p50", early), 2),
        },
        "failures": failures,
    }
    _finish(report)
    if json_out:
        print(msgspec.json.encode(report).decode())
        return 0 if failures == 0 else 1
    ratios = report["ratios"]
    print(_header("calls", machine, f"{_fsync_text(nats_url, fsync)}; n {n}, "
                                    f"{concurrency} in flight, {turns} turns in one session; "
                                    f"{session_actors} session-actor process(es)"))
    _print_lines(lines)
    print(f"\nsequential call: p50 {seq.p50_ms:.2f} ms = {ratios['seq_p50_vs_js_publish']}x "
          f"one raw JetStream publish+ack, {ratios['seq_p50_vs_request_reply']}x one raw "
          f"request/reply; p99 {seq.p99_ms:.2f} ms = {ratios['seq_p99_vs_js_publish']}x the "
          f"raw publish+ack p50")
    print(f"calls/s with {concurrency} in flight = {ratios['throughput_vs_js_publish_seq']:.1%} "
          f"of raw sequential publishes/s ({ratios['throughput_vs_js_publish']:.1%} of raw "
          f"publishes/s with {concurrency} in flight)")
    print(f"turn p50 late in one session / early = {ratios['late_turns_p50_vs_early']}x "
          f"({late.name[13:]} vs {early.name[13:]}; flat is 1.0x)")
    print(f"targets: sequential p50 <= 2 ms ({'met' if seq.p50_ms <= 2 else 'MISSED'}), "
          f">= 1000 calls/s with {concurrency} in flight "
          f"({'met' if par.per_s >= 1000 else 'MISSED'}); failures: {failures}; "
          f"load at end {' '.join(f'{x:.2f}' for x in machine['loadavg_end'])}")
    return 0 if failures == 0 else 1


# --- MCP --------------------------------------------------------------------------------


async def _until_listening(port: int, proc: subprocess.Popen[bytes], what: str, *,
                           timeout: float = 20.0) -> None:
    """Until the server started as `proc` accepts connections on `port` (bounded); an
    early exit is an error, not a wait."""
    async with asyncio.timeout(timeout):
        while True:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                if proc.poll() is not None:
                    raise ConfigError(f"the {what} exited ({proc.returncode}) before "
                                      f"listening on port {port}") from None
                await asyncio.sleep(0.05)
                continue
            writer.close()
            await writer.wait_closed()
            return


@contextlib.asynccontextmanager
async def _sample_server(module: str, what: str,
                         env: dict[str, str] | None = None) -> AsyncIterator[int]:
    """`python -m services.<module> --port PORT` on a free port, until it listens."""
    port = free_port()
    proc = subprocess.Popen(  # noqa: ASYNC220 - once, before anything is measured
        [sys.executable, "-m", f"services.{module}", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **(env or {})},
        preexec_fn=die_with_parent)
    try:
        await _until_listening(port, proc, what)
        yield port
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        if proc.poll() is None:
            proc.kill()


async def bench_mcp(*, n: int = 1000, concurrency: int = 16, fsync: str = "batch",
                    json_out: bool = False, workers: int | None = None) -> int:
    """A tool call through toolbus (request -> session -> connector -> MCP server -> events)
    beside a direct `mcp.Client.call_tool` on the same server, and the raw bus floors, in
    the same run."""
    import mcp  # only this benchmark needs the client directly

    machine = _machine()
    args = {"car_id": "c1"}
    async with _sample_server("sample_mcp", "sample MCP server") as port, \
            contextlib.AsyncExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="toolbus-bench-mcp-"))
        manifest = Path(tmp, "manifest.yaml")
        manifest.write_text(  # noqa: ASYNC240 - once, before anything is measured
            f"tools: {{builtins: []}}\nmcps:\n  - id: bench\n"
            f"    hostname: http://127.0.0.1\n    port: {port}\n")
        url = await stack.enter_async_context(
            _system(None, "--manifest", str(manifest), *_workers_args(workers), fsync=fsync))
        direct = await stack.enter_async_context(
            mcp.Client(f"http://127.0.0.1:{port}/mcp", cache=None))
        bus = await connect(url, name="toolbus-bench")
        stack.push_async_callback(bus.close)
        responder = await connect(url, name="toolbus-bench-responder")
        stack.push_async_callback(responder.close)
        client = ToolbusClient(bus)
        stack.push_async_callback(client.close)
        run = os.urandom(3).hex()
        failures = 0

        async def direct_op(i: int) -> None:
            nonlocal failures
            result = await direct.call_tool("describe_car", args)
            failures += result.is_error

        def toolbus_op(session: Callable[[int], str]) -> Op:
            async def op(i: int) -> None:
                nonlocal failures
                end = await client.call(session(i), [{"tool": "bench:describe_car",
                                                      "arguments": args}], timeout=30)
                failures += not (isinstance(end, TurnCompleted) and end.ok)
            return op

        await measure("warm-up", direct_op, n=100, concurrency=4)
        await measure("warm-up", toolbus_op(lambda i: f"mcp-{run}-w"), n=100, concurrency=4)
        floors = await _floors(bus, responder, n=n, concurrency=None)
        d_seq = await measure("direct mcp.Client.call_tool", direct_op, n=n, concurrency=1)
        t_seq = await measure("toolbus call (MCP tool)", toolbus_op(lambda i: f"mcp-{run}-s"),
                              n=n, concurrency=1)
        d_par = await measure("direct mcp.Client.call_tool", direct_op, n=n,
                              concurrency=concurrency)
        t_par = await measure("toolbus call (MCP tool)",
                              toolbus_op(lambda i: f"mcp-{run}-p{i % concurrency}"), n=n,
                              concurrency=concurrency)
    t_seq_line = Line(t_seq).beside(d_seq, *LATENCY).beside(floors.js, *LATENCY)
    t_par_line = Line(t_par).beside(d_par, *RATE).beside(floors.js, *RATE)
    lines = [*_floor_lines(floors), Line(d_seq), t_seq_line, Line(d_par), t_par_line]
    overhead = t_seq.p50_ms - d_seq.p50_ms
    report: dict[str, Any] = {
        "machine": machine, "fsync": fsync,
        "rows": [_line_json(x) for x in lines],
        "overhead_p50_ms": round(overhead, 3),
        "overhead_p50_vs_js_publish": round(overhead / floors.js.p50_ms, 2),
        "ratio_p50": round(t_seq_line.ratio("p50", d_seq), 2),
        "ratio_p99": round(t_seq_line.ratio("p99", d_seq), 2),
        "throughput_ratio": round(t_par_line.ratio("per_s", d_par), 3),
        "failures": failures,
    }
    _finish(report)
    if json_out:
        print(msgspec.json.encode(report).decode())
        return 0 if failures == 0 else 1
    print(_header("mcp", machine, f"{_fsync_text(None, fsync)}; n {n}, "
                                  f"{concurrency} in flight"))
    _print_lines(lines)
    print(f"\ntoolbus adds {report['overhead_p50_ms']} ms to a sequential MCP call at p50 "
          f"({report['overhead_p50_vs_js_publish']}x one raw JetStream publish+ack); the call "
          f"costs {report['ratio_p50']}x the direct one at p50, its p99 "
          f"{report['ratio_p99']}x the direct p50. With {concurrency} in flight it runs "
          f"{report['throughput_ratio']:.0%} of the direct calls/s. Failures: {failures}; "
          f"load at end {' '.join(f'{x:.2f}' for x in machine['loadavg_end'])}")
    return 0 if failures == 0 else 1


# --- agent ------------------------------------------------------------------------------

AGENT_GOAL_OVERHEAD_MS = 2.0  # toolbus turn p50 - direct two round trips p50
AGENT_GOAL_FLAT = 0.10  # late turns of a session at most 10% slower than its first (p50)
# The store-then-deliver hops one after another on a turn's path: the request to the
# session actor, `turn.requested` to the planner, the model's calls to the executor, the
# result to the planner, the last events to the client. (`model.requested` is stored
# while the model is called, off the path.)
AGENT_PATH_HOPS = 5
# The hops of the bare turn (bus/baseline.py): the request, the call to the worker, its
# result, the end; the turn's own hand-over from the session actor to the planner is in
# process (the planner plans a turn as it is stored).
AGENT_BARE_HOPS = 4
# Sessions whose history grows in `bench agent`, turn by turn in rounds.
AGENT_LONG_SESSIONS = 5


def _growth_ms_per_100(lat: list[float]) -> float:
    """How much later turns cost than earlier ones, per 100 turns: the Theil-Sen slope
    (the median of the slopes between every two turns, of at most 300 evenly spread), which
    a few slow turns on a noisy machine do not move as they move a 10-turn median."""
    points = list(enumerate(lat))[::max(1, len(lat) // 300)]
    slopes = [(b - a) / (j - i) for k, (i, a) in enumerate(points) for j, b in points[k + 1:]]
    return statistics.median(slopes) * 100 * 1e3 if slopes else 0.0


def _agent_manifest(port: int) -> str:
    # No retries: a failed model call is a failed turn, counted, not a hidden second try.
    return ("tools: {builtins: [echo]}\n"
            "agent_config:\n"
            "  instructions: Echo what the user says, then say what the tool answered.\n"
            "  model:\n"
            "    provider: openai\n"
            "    model: sample\n"
            f"    base_url: http://127.0.0.1:{port}/v1\n"
            "    api_key: ${SAMPLE_LLM_KEY:-}\n"
            "    max_retries: 0\n")


@contextlib.asynccontextmanager
async def _bare_turn(bus: Bus, url: str, model: str, bodies: list[bytes],
                     env: dict[str, str], *, events: bool = False) -> AsyncIterator[Op]:
    """The bare agent turn (bus/baseline.py) between an actor process and a worker process
    started for it (services/bare_turn.py), sending `bodies` to the model at `model`;
    stopped afterwards. With `events`, the bare event-model turn."""
    with tempfile.TemporaryDirectory(prefix="toolbus-bench-bare-") as tmp:
        bodies_file = Path(tmp, "bodies.json")
        bodies_file.write_bytes(  # noqa: ASYNC240 - once, before anything is measured
            b"[" + b",".join(bodies) + b"]")
        streams = bare_events_streams(bus) if events else bare_stream(bus)
        flag = ["--events"] if events else []
        async with streams, contextlib.AsyncExitStack() as procs:
            started: list[tuple[str, subprocess.Popen[str], Any]] = []
            for role, extra in (("worker", flag), ("actor", ["--model", model, "--bodies",
                                                           str(bodies_file), *flag])):
                errors = procs.enter_context(tempfile.TemporaryFile())
                proc = subprocess.Popen(  # noqa: ASYNC220 - once, before anything is measured
                    [sys.executable, "-m", "services.bare_turn", role, *extra],
                    stdout=subprocess.PIPE, stderr=errors, text=True,
                    preexec_fn=die_with_parent,
                    env={**os.environ, **env, "PYTHONUNBUFFERED": "1", "NATS_URL": url})
                procs.callback(_stop, proc)
                started.append((role, proc, errors))
                assert proc.stdout is not None
                line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
                if line.strip() != "ready":
                    proc.wait(15)
                    errors.seek(0)
                    tail = errors.read()[-2000:].decode(errors="replace").strip()
                    raise ConfigError(f"the bare turn's {role} did not start: "
                                      f"{tail or line or 'no output'}")
            async with (bare_events_client if events else bare_client)(bus) as bare_op:
                async def op(i: int) -> None:
                    try:
                        await bare_op(i)
                    except TimeoutError:
                        for role, proc, errors in started:
                            if proc.poll() is not None:  # not NATS's fault: say whose
                                errors.seek(0)
                                tail = errors.read()[-500:].decode(errors="replace").strip()
                                raise WorkerError(
                                    f"bare-turn {role}", proc.returncode,
                                    f"exited (status {proc.returncode}) while the bare "
                                    f"turn was measured{': ' + tail if tail else ''}"
                                ) from None
                        raise

                yield op


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
    if proc.poll() is None:
        proc.kill()


async def bench_agent(*, n: int = 2000, turns: int = 100, fsync: str = "batch",
                      json_out: bool = False, workers: int | None = None) -> int:
    """A one-tool planner turn (model -> `built-in:echo` -> model -> answer) against the
    sample model server (services/sample_llm.py), beside the same two model round trips
    sent directly with httpx (the same bodies, captured by the server), in the same run:
    `n` turns in fresh sessions, then `turns` turns in each of `AGENT_LONG_SESSIONS`
    sessions, whose history grows, each beside a turn in a fresh session."""
    import httpx  # only this benchmark talks to the model server itself

    from actors.llm import ModelClient

    machine = _machine()
    key = os.urandom(8).hex()
    env = {"SAMPLE_LLM_KEY": key}
    window = max(1, min(10, turns // 2))
    async with _sample_server("sample_llm", "sample model server", env) as port, \
            contextlib.AsyncExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="toolbus-bench-agent-"))
        manifest = Path(tmp, "manifest.yaml")
        manifest.write_text(_agent_manifest(port))  # noqa: ASYNC240 - once, before anything is measured
        url = await stack.enter_async_context(
            _system(None, "--manifest", str(manifest), *_workers_args(workers), fsync=fsync,
                    env=env))
        # One pooled client with keep-alive connections, as the planner keeps one.
        http = await stack.enter_async_context(httpx.AsyncClient(timeout=30))
        bus = await connect(url, name="toolbus-bench")
        stack.push_async_callback(bus.close)
        responder = await connect(url, name="toolbus-bench-responder")
        stack.push_async_callback(responder.close)
        client = ToolbusClient(bus)
        stack.push_async_callback(client.close)
        run = os.urandom(3).hex()
        base = f"http://127.0.0.1:{port}"
        headers = {"content-type": "application/json", "authorization": f"Bearer {key}",
                   "accept": "text/event-stream", "cache-control": "no-store"}
        failures = 0

        def turn_in(session: Callable[[int], str]) -> Op:
            async def op(i: int) -> None:
                nonlocal failures
                end = await client.ask(session(i), f"say {i}", timeout=30)
                failures += not (isinstance(end, TurnCompleted) and end.ok
                                 and len(end.outcomes) == 1
                                 and (end.text or "").startswith("The tool answered"))
            return op

        history: list[int] = []  # user messages in the bodies each read took

        async def last_turn_bodies() -> list[bytes]:
            """The two request bodies of the turn just ended, as the planner sent them."""
            got = msgspec.json.decode((await http.get(f"{base}/requests")).content)[-2:]
            roles = [b["messages"][-1]["role"] for b in got]
            if roles != ["user", "tool"]:
                raise RuntimeError(f"the sample model server last received requests ending "
                                   f"with {roles}, not a user message then a tool result")
            history.append(sum(m["role"] == "user" for m in got[-1]["messages"]))
            # Encoded as the planner encodes them (msgspec keeps the key order): the same bytes.
            return [msgspec.json.encode(b) for b in got]

        def direct(bodies: list[bytes]) -> Op:
            async def op(i: int) -> None:
                nonlocal failures
                for body in bodies:
                    r = await http.post(f"{base}/v1/chat/completions", content=body,
                                        headers=headers)
                    failures += r.status_code != 200 or not r.content.endswith(
                        b"data: [DONE]\n\n")
            return op

        # The planner's own client (aiohttp) for the same round trips: how much of the
        # httpx floor is httpx's own CPU, shown beside it.
        model_client = await stack.enter_async_context(ModelClient())

        def direct_aiohttp(bodies: list[bytes]) -> Op:
            async def op(i: int) -> None:
                nonlocal failures
                for body in bodies:
                    async with model_client.session.post(
                            f"{base}/v1/chat/completions", data=body,
                            headers=headers) as r:
                        content = await r.read()
                    failures += r.status != 200 or not content.endswith(b"data: [DONE]\n\n")
            return op

        await measure("warm-up", turn_in(lambda i: f"agent-{run}-w{i}"), n=min(n, 50),
                      concurrency=1)
        first = await last_turn_bodies()
        await measure("warm-up", direct(first), n=min(n, 50), concurrency=1)
        floors = await _floors(bus, responder, n=n, concurrency=None)
        async with raw_chain(bus, responder, AGENT_PATH_HOPS) as chain_op:
            await measure("warm-up", chain_op, n=min(n, 100), concurrency=1)
            chain = await measure(f"raw JetStream chain, {AGENT_PATH_HOPS} hops", chain_op,
                                  n=n, concurrency=1)
        d_fresh = await measure("direct httpx, 2 model round trips", direct(first), n=n,
                                concurrency=1)
        await measure("warm-up", direct_aiohttp(first), n=min(n, 50), concurrency=1)
        d_aiohttp = await measure("direct aiohttp, 2 model round trips",
                                  direct_aiohttp(first), n=n, concurrency=1)
        async with _bare_turn(bus, url, f"{base}/v1/chat/completions", first,
                              env) as bare_op:
            await measure("warm-up", bare_op, n=min(n, 100), concurrency=1)
            bare_cpu_before, bare_msgs_before = _cpu_seconds(), await _messages(http, url)
            bare = await measure(f"bare turn: {AGENT_BARE_HOPS} hops, 2 model round trips",
                                 bare_op, n=n, concurrency=1)
            bare_cpu = _cpu_per_op(bare_cpu_before, _cpu_seconds(), n)
            bare_msgs = _per_op(bare_msgs_before, await _messages(http, url), n)
        async with _bare_turn(bus, url, f"{base}/v1/chat/completions", first, env,
                              events=True) as bare_events_op:
            await measure("warm-up", bare_events_op, n=min(n, 100), concurrency=1)
            cpu_before, msgs_before = _cpu_seconds(), await _messages(http, url)
            bare_events = await measure(
                f"bare event-model turn: {BARE_EVENTS_STORED} events, "
                f"{BARE_EVENTS_DELIVERIES} deliveries", bare_events_op, n=n, concurrency=1)
            bare_events_cpu = _cpu_per_op(cpu_before, _cpu_seconds(), n)
            bare_events_msgs = _per_op(msgs_before, await _messages(http, url), n)
        cpu_before, msgs_before = _cpu_seconds(), await _messages(http, url)
        fresh = await measure("toolbus turn, fresh sessions",
                              turn_in(lambda i: f"agent-{run}-f{i}"), n=n, concurrency=1)
        cpu = _cpu_per_op(cpu_before, _cpu_seconds(), n)
        msgs = _per_op(msgs_before, await _messages(http, url), n)
        # `turns` turns in each of a few sessions, in rounds (turn i of each, then turn
        # i + 1), each followed by a turn in a fresh session: the machine's speed drifts
        # over a run (other tenants), and a turn beside its fresh neighbour shows what
        # history alone costs. Several sessions give each window more turns than one.
        lat: list[list[float]] = [[] for _ in range(AGENT_LONG_SESSIONS)]
        beside: list[list[float]] = [[] for _ in range(AGENT_LONG_SESSIONS)]
        def long_session(k: int) -> Callable[[int], str]:
            return lambda i: f"agent-{run}-long{k}"

        longs = [turn_in(long_session(k)) for k in range(AGENT_LONG_SESSIONS)]
        fresh_turn = turn_in(lambda i: f"agent-{run}-r{i}")
        last: list[bytes] = []
        for i in range(turns):
            for k, long_turn in enumerate(longs):
                t = time.perf_counter()
                await long_turn(i)
                lat[k].append(time.perf_counter() - t)
                if i == turns - 1 and k == len(longs) - 1:
                    last = await last_turn_bodies()
                t = time.perf_counter()
                await fresh_turn(i * len(longs) + k)
                beside[k].append(time.perf_counter() - t)
                _cancelled_quietly()
        d_late = await measure(f"direct httpx, bodies of turn {turns}", direct(last), n=n,
                               concurrency=1)

    early_span, late_span = f"1..{window}", f"{turns - window + 1}..{turns}"
    early_lat = [x for one in lat for x in one[:window]]
    late_lat = [x for one in lat for x in one[-window:]]
    sessions = f"{AGENT_LONG_SESSIONS} sessions"
    early = _stats(f"{sessions}, turns {early_span}", early_lat, seconds=sum(early_lat),
                   concurrency=1)
    late = _stats(f"{sessions}, turns {late_span}", late_lat, seconds=sum(late_lat),
                  concurrency=1)
    fresh_line = Line(fresh).beside(d_fresh, *LATENCY).beside(bare, *LATENCY) \
        .beside(floors.js, *LATENCY)
    early_line = Line(early).beside(d_fresh, *LATENCY)
    late_line = Line(late).beside(early, *LATENCY).beside(d_late, *LATENCY)
    bare_line = Line(bare).beside(d_fresh, *LATENCY)
    bare_events_line = Line(bare_events).beside(d_fresh, *LATENCY)
    lines = [*_floor_lines(floors), Line(chain).beside(floors.js, *LATENCY), Line(d_fresh),
             Line(d_aiohttp), bare_line, bare_events_line, fresh_line, early_line,
             Line(d_late), late_line]
    overhead = fresh.p50_ms - d_fresh.p50_ms
    raw_flat = late_line.ratio("p50", early)
    # The goal's measure: each turn against the fresh-session turn right after it, late
    # against early, so that the machine speeding up or slowing down between the two
    # windows does not count as history.
    relative = [[a / b for a, b in zip(one, ref, strict=True)]
                for one, ref in zip(lat, beside, strict=True)]
    flat = statistics.median(x for one in relative for x in one[-window:]) / \
        statistics.median(x for one in relative for x in one[:window])
    # Per turn number, the median over the sessions, for the slopes.
    by_turn = [statistics.median(one[i] for one in lat) for i in range(turns)]
    relative_by_turn = [statistics.median(one[i] for one in relative) for i in range(turns)]
    fresh_beside = statistics.median(x for one in beside for x in one)
    report: dict[str, Any] = {
        "machine": machine, "fsync": fsync, "n": n, "turns": turns,
        "rows": [_line_json(x) for x in lines],
        "overhead_p50_ms": round(overhead, 3),
        "overhead_p50_vs_js_publish": round(overhead / floors.js.p50_ms, 2),
        # The part of the overhead the bus alone would take on a turn's path (a raw chain
        # of its hops), and the rest: toolbus's own work.
        "path_hops": AGENT_PATH_HOPS,
        "raw_chain_p50_ms": round(chain.p50_ms, 3),
        "overhead_beyond_raw_chain_p50_ms": round(overhead - chain.p50_ms, 3),
        # The bare turn: the same hops between the same kinds of processes and the same
        # model round trips, nothing else; by the goal's measure, and what toolbus adds
        # beyond it.
        "bare_turn_p50_ms": round(bare.p50_ms, 3),
        "bare_overhead_p50_ms": round(bare.p50_ms - d_fresh.p50_ms, 3),
        "overhead_beyond_bare_p50_ms": round(fresh.p50_ms - bare.p50_ms, 3),
        "cpu_per_bare_turn_ms": bare_cpu,
        # The bare event-model turn: the same turn storing the events toolbus stores and
        # delivering them where toolbus's actors consume them, nothing else done: what the
        # event model alone costs by the goal's measure, and what toolbus adds beyond it.
        "bare_events_turn_p50_ms": round(bare_events.p50_ms, 3),
        "bare_events_overhead_p50_ms": round(bare_events.p50_ms - d_fresh.p50_ms, 3),
        "overhead_beyond_bare_events_p50_ms": round(fresh.p50_ms - bare_events.p50_ms, 3),
        "cpu_per_bare_events_turn_ms": bare_events_cpu,
        "messages_per_bare_events_turn": bare_events_msgs,
        # Messages nats-server received and sent per turn, toolbus's and the bare one's
        # (empty on a server this benchmark did not start).
        "messages_per_turn": msgs,
        "messages_per_bare_turn": bare_msgs,
        # Against the same round trips sent with the planner's own HTTP client instead.
        "direct_aiohttp_p50_ms": round(d_aiohttp.p50_ms, 3),
        "overhead_vs_aiohttp_p50_ms": round(fresh.p50_ms - d_aiohttp.p50_ms, 3),
        "ratio_p50": round(fresh_line.ratio("p50", d_fresh), 2),
        "ratio_p99": round(fresh_line.ratio("p99", d_fresh), 2),
        "early_overhead_p50_ms": round(early.p50_ms - d_fresh.p50_ms, 3),
        "late_overhead_p50_ms": round(late.p50_ms - d_late.p50_ms, 3),
        "late_turns_p50_vs_early": round(raw_flat, 2),
        # The same beside fresh-session turns taken in between (the goal's measure).
        "late_vs_early_beside_fresh": round(flat, 2),
        "fresh_beside_p50_ms": round(fresh_beside * 1e3, 3),
        "long_sessions": AGENT_LONG_SESSIONS,
        # The user messages the model read in the first turn and in a long session's last.
        "user_messages_read": history,
        "growth_ms_per_100_turns": round(_growth_ms_per_100(by_turn), 3),
        "growth_ms_per_100_turns_beside_fresh": round(_growth_ms_per_100(
            [r * fresh_beside for r in relative_by_turn]), 3),
        # CPU ms per fresh-session turn of each process (this client, the embedded
        # nats-server, `toolbus up`, its workers, the model server); empty without /proc.
        "cpu_per_turn_ms": cpu,
        "goal": {"overhead_p50_ms": AGENT_GOAL_OVERHEAD_MS,
                 "overhead_met": overhead <= AGENT_GOAL_OVERHEAD_MS,
                 "flat_within": AGENT_GOAL_FLAT,
                 "flat_met": flat <= 1 + AGENT_GOAL_FLAT},
        "failures": failures,
    }
    _finish(report)
    if json_out:
        print(msgspec.json.encode(report).decode())
        return 0 if failures == 0 else 1
    goal = report["goal"]
    print(_header("agent", machine, f"{_fsync_text(None, fsync)}; n {n} turns in fresh "
                                    f"sessions, {turns} turns in each of "
                                    f"{AGENT_LONG_SESSIONS} sessions"))
    _print_lines(lines)
    print(f"\na planner turn (model, built-in:echo, model, answer) costs {fresh.p50_ms:.2f} ms "
          f"at p50, {report['ratio_p50']}x the same two model round trips sent directly "
          f"({d_fresh.p50_ms:.2f} ms); its p99 is {report['ratio_p99']}x the direct p50. "
          f"toolbus adds {report['overhead_p50_ms']} ms at p50 "
          f"({report['overhead_p50_vs_js_publish']}x one raw JetStream publish+ack): "
          f"{chain.p50_ms:.2f} ms is what the bus alone takes for the {AGENT_PATH_HOPS} "
          f"hops one after another on a turn's path (a raw chain, nothing decoded), "
          f"{report['overhead_beyond_raw_chain_p50_ms']} ms is toolbus's own work. "
          f"The planner sends its model calls with aiohttp, which takes "
          f"{d_aiohttp.p50_ms:.2f} ms for the same round trips: against that, toolbus adds "
          f"{report['overhead_vs_aiohttp_p50_ms']} ms.")
    print(f"A bare turn, the same {AGENT_BARE_HOPS} stored hops between the same kinds of "
          f"processes (this client, an actor process, a worker process) and the same two "
          f"model round trips with nothing else done (no state, no checks, no other "
          f"events), takes {bare.p50_ms:.2f} ms: the goal's measure of it (its p50 minus "
          f"the direct httpx round trips) is {report['bare_overhead_p50_ms']} ms, and a "
          f"toolbus turn takes {report['overhead_beyond_bare_p50_ms']} ms more than it.")
    print(f"A bare event-model turn, the same turn storing the {BARE_EVENTS_STORED} events a "
          f"toolbus turn stores and making its {BARE_EVENTS_DELIVERIES} deliveries (each "
          f"event to the session actor; the planner's, approval's, executor's and "
          f"compressor's), with nothing else done, takes {bare_events.p50_ms:.2f} ms: the "
          f"event model alone is {report['bare_events_overhead_p50_ms']} ms by the goal's "
          f"measure, and toolbus's own work {report['overhead_beyond_bare_events_p50_ms']} "
          f"ms beyond it.")
    print(f"{sessions}, {turns} turns each: turns {late_span} p50 / turns {early_span} = "
          f"{report['late_turns_p50_vs_early']}x (flat is 1.0x); toolbus adds "
          f"{report['early_overhead_p50_ms']} ms early, {report['late_overhead_p50_ms']} ms "
          f"late (beside the direct round trips with the same history). Each turn against "
          f"a fresh-session turn taken right after it (the machine's drift cancels): late / "
          f"early = {report['late_vs_early_beside_fresh']}x, and a turn costs "
          f"{report['growth_ms_per_100_turns_beside_fresh']} ms more per 100 turns of "
          f"history (slope; {report['growth_ms_per_100_turns']} ms without the fresh turns).")
    if cpu:
        spread = cpu["all"] / max(machine["cpus_usable"], 1)
        tick = 1000 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)
        print("CPU per fresh-session turn: " + ", ".join(
            f"{k} {v:.2f} ms" for k, v in cpu.items() if k != "all") +
            f"; {cpu['all']:.2f} ms in all, so at least {spread:.2f} ms per turn on "
            f"{machine['cpus_usable']} CPUs even if perfectly spread (/proc counts in "
            f"{tick:g} ms ticks: each figure +-{tick / n:.2g} ms at n {n})")
    if msgs and bare_msgs:
        print(f"Messages through nats-server per turn (received, sent: publishes, acks, "
              f"API requests and replies, deliveries): toolbus {msgs['in']:g}, "
              f"{msgs['out']:g}; the bare turn {bare_msgs['in']:g}, {bare_msgs['out']:g}"
              + (f"; the bare event-model turn {bare_events_msgs['in']:g}, "
                 f"{bare_events_msgs['out']:g}" if bare_events_msgs else ""))
    for what, per in (("bare turn", bare_cpu), ("bare event-model turn", bare_events_cpu)):
        if per:
            print(f"CPU per {what}: " + ", ".join(
                f"{k} {v:.2f} ms" for k, v in per.items() if k != "all" and v) +
                f"; {per['all']:.2f} ms in all")
    print(f"goals: overhead p50 <= {AGENT_GOAL_OVERHEAD_MS:g} ms "
          f"({'met' if goal['overhead_met'] else 'MISSED'}), late turns at most "
          f"{AGENT_GOAL_FLAT:.0%} slower than early, beside fresh turns "
          f"({'met' if goal['flat_met'] else 'MISSED'}); "
          f"failures: {failures}; load at end "
          f"{' '.join(f'{x:.2f}' for x in machine['loadavg_end'])}")
    return 0 if failures == 0 else 1


# --- compress ---------------------------------------------------------------------------

# A new session's first tool event also pays for creating the session, and
# `ToolbusClient.inject` reads the session's earlier tool events before it publishes, so
# its cost grows with them: sessions of 10 injections, a data feed's usual share, keep
# both in the figures without either ruling them.
INJECTS_PER_SESSION = 10
TRANSFORM_EXPRESSION = "[].{sha: sha, msg: commit.message}"


def _timed(name: str, fn: Callable[[], object], *, n: int) -> Stats:
    """`n` calls of `fn` in process, one at a time, each timed, after a warm-up."""
    for _ in range(min(n, 100)):
        fn()
    lat: list[float] = []
    t0 = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        fn()
        lat.append(time.perf_counter() - t)
    return _stats(name, lat, seconds=time.perf_counter() - t0, concurrency=1)


async def bench_compress(*, n: int = 2000, fsync: str = "batch", json_out: bool = False,
                         workers: int | None = None) -> int:
    """Tool result compression and injection (issue 13): the preview of seed 003's
    31,000-character `list_commits` result beside encoding it as JSON (what the model would
    read uncompressed), a recall page beside the same, a JMESPath transform beside a
    precompiled `jmespath.search`; then injecting a small tool event over NATS
    (`ToolbusClient.inject`) and over HTTP (`POST /sessions/{sid}/tool_events` on the
    gateway), each until it is stored, beside the raw bus floors of the same run."""
    import httpx  # only this benchmark talks to the gateway
    import jmespath

    from actors import compress
    from schemas.manifest import CompressionConfig
    from services.sample_data import list_commits

    machine = _machine()
    commits = list_commits()
    chars = len(compress.result_text(commits))
    config = CompressionConfig()
    budget, items, page = config.budget, config.preview_items, config.recall_budget
    shown = compress.preview(commits, key="_tool_result_1", tool="github:list_commits",
                             budget=budget, items=items)
    recalled = compress.recall(commits, offset=items, budget=page)  # the page after the preview
    expression = jmespath.compile(TRANSFORM_EXPRESSION)
    if compress.transform(commits, TRANSFORM_EXPRESSION) != expression.search(commits):
        raise RuntimeError("compress.transform and jmespath.search disagree")

    encode = _timed("compress.result_text (JSON)", lambda: compress.result_text(commits), n=n)
    previewed = _timed(f"compress.preview ({budget} chars)", lambda: compress.preview(
        commits, key="_tool_result_1", tool="github:list_commits", budget=budget,
        items=items), n=n)
    paged = _timed(f"compress.recall ({page} chars)",
                   lambda: compress.recall(commits, offset=items, budget=page), n=n)
    search = _timed("jmespath.search, precompiled", lambda: expression.search(commits), n=n)
    transformed = _timed("compress.transform",
                         lambda: compress.transform(commits, TRANSFORM_EXPRESSION), n=n)

    result = {"balance": 1234.5, "currency": "EUR"}
    failures = 0
    async with contextlib.AsyncExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="toolbus-bench-compress-"))
        http_port = free_port()
        # Its own data dir: the gateway's tokens are written there, not in the user's.
        url = await stack.enter_async_context(_system(
            None, "--data-dir", tmp, "--http-port", str(http_port), *_workers_args(workers),
            fsync=fsync))
        token = Path(tmp, "auth", "client.token").read_text().strip()  # noqa: ASYNC240 - once, before anything is measured
        http = await stack.enter_async_context(httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{http_port}", timeout=30,
            headers={"authorization": f"Bearer {token}"}))
        bus = await connect(url, name="toolbus-bench")
        stack.push_async_callback(bus.close)
        responder = await connect(url, name="toolbus-bench-responder")
        stack.push_async_callback(responder.close)
        client = ToolbusClient(bus)
        stack.push_async_callback(client.close)
        run = os.urandom(3).hex()

        def nats_in(prefix: str) -> Op:
            async def op(i: int) -> None:
                nonlocal failures
                got = await client.inject(f"{prefix}-{i // INJECTS_PER_SESSION}",
                                          "injected:bench", result, idempotency_key=f"k{i}",
                                          timeout=30)
                failures += not got.created
            return op

        def http_in(prefix: str) -> Op:
            async def op(i: int) -> None:
                nonlocal failures
                sid, key = f"{prefix}-{i // INJECTS_PER_SESSION}", f"k{i}"
                r = await http.post(f"/sessions/{sid}/tool_events", json={
                    "tool_id": "injected:bench", "arguments": {}, "result": result,
                    "idempotency_key": key})
                failures += r.status_code != 201 or \
                    r.json().get("event_id") != tool_event_id(sid, key)
            return op

        warm = min(n, 100)
        await measure("warm-up", nats_in(f"inject-{run}-wn"), n=warm, concurrency=1)
        await measure("warm-up", http_in(f"inject-{run}-wh"), n=warm, concurrency=1)
        floors = await _floors(bus, responder, n=n, concurrency=None)
        over_nats = await measure("inject over NATS", nats_in(f"inject-{run}-n"), n=n,
                                  concurrency=1)
        over_http = await measure("inject over HTTP (gateway)", http_in(f"inject-{run}-h"),
                                  n=n, concurrency=1)

    preview_line = Line(previewed).beside(encode, *LATENCY)
    recall_line = Line(paged).beside(encode, *LATENCY)
    transform_line = Line(transformed).beside(search, *LATENCY)
    nats_line = Line(over_nats).beside(floors.js, *LATENCY)
    http_line = Line(over_http).beside(floors.js, *LATENCY).beside(over_nats, *LATENCY)
    lines = [Line(encode), preview_line, recall_line, Line(search), transform_line,
             *_floor_lines(floors), nats_line, http_line]
    report: dict[str, Any] = {
        "machine": machine, "fsync": fsync, "n": n,
        "result": {"chars": chars, "items": len(commits), "preview_chars": len(shown),
                   "preview_budget": budget, "preview_items": items,
                   "recall_chars": len(compress.result_text(recalled)),
                   "recall_budget": page, "recall_items": recalled["count"],
                   "transform": TRANSFORM_EXPRESSION},
        "injects_per_session": INJECTS_PER_SESSION,
        "rows": [_line_json(x) for x in lines],
        "ratios": {
            "preview_p50_vs_result_text": round(preview_line.ratio("p50", encode), 2),
            "recall_p50_vs_result_text": round(recall_line.ratio("p50", encode), 2),
            "transform_p50_vs_jmespath": round(transform_line.ratio("p50", search), 2),
            "inject_nats_p50_vs_js_publish": round(nats_line.ratio("p50", floors.js), 2),
            "inject_http_p50_vs_js_publish": round(http_line.ratio("p50", floors.js), 2),
            "inject_http_p50_vs_nats": round(http_line.ratio("p50", over_nats), 2),
        },
        "failures": failures,
    }
    _finish(report)
    if json_out:
        print(msgspec.json.encode(report).decode())
        return 0 if failures == 0 else 1
    ratios = report["ratios"]
    print(_header("compress", machine, f"{_fsync_text(None, fsync)}; n {n} one at a time; "
                                       f"a {chars:,}-character {len(commits)}-item "
                                       f"list_commits result; {INJECTS_PER_SESSION} "
                                       f"injections a session"))
    _print_lines(lines)
    print(f"\npreview ({len(shown)} of {budget} characters, {items} items): "
          f"{previewed.p50_ms * 1e3:.0f} µs at p50 = {ratios['preview_p50_vs_result_text']}x "
          f"encoding the whole result as JSON ({encode.p50_ms * 1e3:.0f} µs); a recall page "
          f"({recalled['count']} items, {page} characters at most) "
          f"{ratios['recall_p50_vs_result_text']}x")
    print(f"transform {TRANSFORM_EXPRESSION!r}: {transformed.p50_ms * 1e3:.0f} µs at p50 = "
          f"{ratios['transform_p50_vs_jmespath']}x a precompiled jmespath.search")
    print(f"injection until stored: over NATS p50 {over_nats.p50_ms:.2f} ms = "
          f"{ratios['inject_nats_p50_vs_js_publish']}x one raw JetStream publish+ack; over "
          f"HTTP p50 {over_http.p50_ms:.2f} ms = {ratios['inject_http_p50_vs_js_publish']}x "
          f"({ratios['inject_http_p50_vs_nats']}x over NATS); failures: {failures}; load at "
          f"end {' '.join(f'{x:.2f}' for x in machine['loadavg_end'])}")
    return 0 if failures == 0 else 1


# --- replay -----------------------------------------------------------------------------

EVENTS_PER_TURN = 7  # one explicit echo call: the events a real turn stores


def _echo_turn(sid: str, i: int, at: float) -> list[Append]:
    """The events of turn `i` of an explicit `built-in:echo` call, as the actors write them."""
    turn, request = f"r{i}", f"r{i}"
    call = call_id_for(turn, 0)
    tool, arguments = "built-in:echo", {"text": "hi", "i": i}
    route = pool_route("default", "built-in")
    common: dict[str, Any] = {"session_id": sid, "turn_id": turn}
    events: list[tuple[Event, str]] = [
        (TurnRequested(**common, at=at, actor="session", request_id=request, call_ids=[call]),
         turn_requested_id(sid, turn)),
        (CallRequested(**common, at=at, actor="session", call_id=call, tool=tool,
                       arguments=arguments), call_requested_id(sid, call)),
        (CallApproved(**common, at=at, actor="approval", call_id=call, tool=tool,
                      rule="auto:read_only", arguments=arguments, route=route,
                      timeout_ms=5000), policy_decision_id(sid, call)),
        (CallDispatched(**common, at=at, actor="session", call_id=call, tool=tool,
                        arguments=arguments, route=route, timeout_ms=5000),
         dispatch_id(sid, call)),
        (CallStarted(**common, at=at, actor="executor", call_id=call, executor="bench-1"),
         call_started_id(sid, call, 1)),
        (CallSucceeded(**common, at=at, actor="executor", call_id=call, result=arguments,
                       executor="bench-1", duration_ms=0.02), call_terminal_id(sid, call)),
        (TurnCompleted(**common, at=at, actor="session", request_id=request, ok=True,
                       outcomes=[CallOutcome(call_id=call, tool=tool, status="succeeded")]),
         turn_ended_id(sid, turn)),
    ]
    return [Append(event, msg_id, route if isinstance(event, CallDispatched) else None)
            for event, msg_id in events]


async def _store_session(bus: Bus, sid: str, events: int) -> None:
    """`events` events of one session: whole echo turns, the last one maybe in flight."""
    log = EventLog(bus)
    t0 = time.time()
    items = [a for i in range(-(-events // EVENTS_PER_TURN))
             for a in _echo_turn(sid, i, t0 + i * 0.002)][:events]
    for start in range(0, len(items), 500):  # pipelined, acks awaited per batch
        await log.append_decision(items[start:start + 500], expect_last=None)


def _toolbus_command() -> list[str]:
    """The `toolbus` console script next to this interpreter, as users run it."""
    script = shutil.which("toolbus", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "services.cli"]


def _wall_s(cmd: list[str], runs: int, env: dict[str, str] | None = None) -> list[float]:
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=True,
                       timeout=120, env={**os.environ, **(env or {})})
        out.append(time.perf_counter() - t)
    return out


def _ms(values: list[float]) -> dict[str, float]:
    return {"best_ms": round(min(values) * 1e3, 2),
            "median_ms": round(statistics.median(values) * 1e3, 2)}


async def bench_replay(nats_url: str | None, *, events: int = 10_000, runs: int = 7,
                       cli_runs: int = 5, fsync: str = "batch", json_out: bool = False) -> int:
    """Replay of one long session: reading and folding it in process (the path of `toolbus
    replay`), then `toolbus replay SID --json` as a process, and the CLI's start-up."""
    machine = _machine()
    sid = f"bench-replay-{os.urandom(3).hex()}"
    read: list[float] = []
    folded: list[float] = []
    total: list[float] = []
    decode: list[float] = []
    async with _server(nats_url, fsync=fsync) as url:
        bus = await connect(url, name="toolbus-bench")
        try:
            await provision(bus)
            await _store_session(bus, sid, events)
            log = EventLog(bus)
            for _ in range(runs + 1):  # the first run warms up and is not counted
                t0 = time.perf_counter()
                stored = await log.read_session(sid)
                t1 = time.perf_counter()
                state = fold(sid, ((s.seq, s.event) for s in stored))
                t2 = time.perf_counter()
                read.append(t1 - t0)
                folded.append(t2 - t1)
                total.append(t2 - t0)
                t = time.perf_counter()
                for s in stored:
                    decode_event(s.data)
                decode.append(time.perf_counter() - t)
        finally:
            await bus.close()
        if len(stored) != events or len(state.turns) != -(-events // EVENTS_PER_TURN):
            raise RuntimeError(f"replayed {len(stored)} events, {len(state.turns)} turns; "
                               f"stored {events}")
        cli = [*_toolbus_command(), "replay", sid, "--json"]
        replay_cli = await asyncio.to_thread(_wall_s, cli, cli_runs, {"NATS_URL": url})
    import_cli = await asyncio.to_thread(
        _wall_s, [sys.executable, "-c", "import services.cli"], cli_runs)
    bare = await asyncio.to_thread(_wall_s, [sys.executable, "-c", "pass"], cli_runs)
    read, folded, total, decode = read[1:], folded[1:], total[1:], decode[1:]

    figures: dict[str, dict[str, Any]] = {
        "in_process": {**_ms(total), "target_ms": 150.0, "floor": "decode",
                       "ratio": round(min(total) / min(decode), 2)},
        "read": _ms(read),
        "fold": _ms(folded),
        "decode": _ms(decode),
        "cli_replay": {**_ms(replay_cli), "floor": "python_start",
                       "ratio": round(statistics.median(replay_cli) / statistics.median(bare),
                                      2)},
        "cli_import": {**_ms(import_cli), "target_ms": 300.0, "floor": "python_start",
                       "ratio": round(statistics.median(import_cli) / statistics.median(bare),
                                      2)},
        "python_start": _ms(bare),
    }
    report: dict[str, Any] = {"machine": machine, "fsync": fsync if not nats_url else None,
                              "events": events, "runs": runs, "cli_runs": cli_runs,
                              "figures": figures}
    _finish(report)
    if json_out:
        print(msgspec.json.encode(report).decode())
        return 0
    print(_header("replay", machine, f"{_fsync_text(nats_url, fsync)}; one session of "
                                     f"{events} events, best and median of {runs} runs "
                                     f"in process, median of {cli_runs} processes"))
    rows = [
        ("read + fold, in process", "in_process", f"msgspec decode of the {events} events"),
        ("  of which read + decode", "read", None),
        ("  of which fold", "fold", None),
        ("msgspec decode alone", "decode", None),
        ("toolbus replay SID --json", "cli_replay", "python -c pass"),
        ('python -c "import services.cli"', "cli_import", "python -c pass"),
        ("python -c pass", "python_start", None),
    ]
    print(f"{'measure':<34} {'best ms':>8} {'median ms':>10}  {'floor':<50} {'ratio':>7}  "
          f"target")
    for label, key, floor_name in rows:
        f = figures[key]
        if floor_name is None:
            print(f"{label:<34} {f['best_ms']:>8.1f} {f['median_ms']:>10.1f}  -")
            continue
        floor = figures[f["floor"]]
        which = "best_ms" if key == "in_process" else "median_ms"
        floor_text = f"{floor_name} ({which[:-3]} {floor[which]:.1f} ms)"
        target = ""
        if "target_ms" in f:
            ok = f[which] <= f["target_ms"]
            target = f"<= {f['target_ms']:.0f} ms ({'met' if ok else 'MISSED'})"
        print(f"{label:<34} {f['best_ms']:>8.1f} {f['median_ms']:>10.1f}  {floor_text:<50} "
              f"{f['ratio']:>6.2f}x  {target}")
    print(f"load at end {' '.join(f'{x:.2f}' for x in machine['loadavg_end'])}")
    return 0


# --- validation -------------------------------------------------------------------------

VALIDATION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "kind": {"type": "string", "enum": ["a", "b", "c"]},
        "score": {"type": "number"},
        "active": {"type": "boolean", "default": True},
        "meta": {"type": "object"},
        "url": {"type": "string", "format": "uri"},
        "limit": {"type": "integer", "default": 10},
    },
    "required": ["name", "age", "email"],
    "additionalProperties": False,
}
VALIDATION_VALID: dict[str, Any] = {
    "name": "Ada", "age": 36, "email": "ada@example.com", "tags": ["x", "y"], "kind": "a",
    "score": 0.5, "meta": {"k": 1}, "url": "https://example.com/a",
}
VALIDATION_INVALID: dict[str, Any] = {
    "name": "", "age": -1, "email": "nope", "kind": "z", "extra": 1,
}


def _per_call_us(fn: Callable[[], object], n: int) -> float:
    best = float("inf")
    for _ in range(5):  # best of 5: the least disturbed run on a shared machine
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def bench_validation(*, n: int = 20_000, json_out: bool = False) -> int:
    """Cost of checking one call's arguments against a 10-field schema, next to the cost
    of decoding them from JSON (the floor) and of fastjsonschema (the runner-up)."""
    from schemas.validation import Validator

    fast: Callable[[dict[str, Any]], Any] | None
    try:  # a dev dependency, only for this comparison: the row is left out without it
        import fastjsonschema
        fast = fastjsonschema.compile(VALIDATION_SCHEMA, use_formats=True)
    except ImportError:
        fast = None

    validator = Validator(VALIDATION_SCHEMA)
    raw = msgspec.json.encode(VALIDATION_VALID)
    decode = msgspec.json.decode
    valid = VALIDATION_VALID
    _, problems = validator.check(valid)
    assert not problems, problems
    _, problems = validator.check(VALIDATION_INVALID)
    assert len(problems) == 5, problems
    machine = _machine()
    report: dict[str, Any] = {
        "machine": machine,
        "schema_fields": len(VALIDATION_SCHEMA["properties"]),
        "n": n,
        "json_decode_us": _per_call_us(lambda: decode(raw), n),
        "toolbus_valid_us": _per_call_us(lambda: validator.check(valid), n),
        "toolbus_invalid_all_violations_us": _per_call_us(
            lambda: validator.check(VALIDATION_INVALID), n // 4),
        "fastjsonschema_valid_us": (_per_call_us(lambda: fast(dict(valid)), n)
                                    if fast is not None else None),
        "target_us": 20.0,
    }
    report["ratio_to_json_decode"] = report["toolbus_valid_us"] / report["json_decode_us"]
    _finish(report)
    if json_out:
        print(msgspec.json.encode(report).decode())
        return 0
    print(_header("validation", machine, "in process"))
    print(f"validation of a {report['schema_fields']}-field schema, best of 5 x {n} calls:")
    print(f"  baseline: msgspec JSON decode of the arguments  "
          f"{report['json_decode_us']:8.2f} µs")
    print(f"  toolbus (jsonschema-rs + defaults), valid       "
          f"{report['toolbus_valid_us']:8.2f} µs  "
          f"({report['ratio_to_json_decode']:.1f}x decode; target < 20 µs)")
    print(f"  toolbus, invalid, all 5 violations listed       "
          f"{report['toolbus_invalid_all_violations_us']:8.2f} µs")
    if report["fastjsonschema_valid_us"] is not None:
        print(f"  fastjsonschema (first error only), valid        "
              f"{report['fastjsonschema_valid_us']:8.2f} µs")
    else:
        print("  fastjsonschema: not installed (pip install -e '.[dev]' adds it); row left out")
    return 0 if report["toolbus_valid_us"] < report["target_us"] else 1
