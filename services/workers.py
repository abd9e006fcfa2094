"""The worker processes of `toolbus up --workers N`.

The parent process keeps the embedded nats-server, the session and approval actors (the
session actor asks the approval actor inline, so they stay together) and the HTTP gateway.
It starts N-1 children, each `toolbus actor worker`: every executor pool and every MCP
connector of the manifest. Executor pools share durable consumers, so the children split
the calls between them.

- Ready: a child prints what it serves, then a line starting with `WORKER_READY` once its
  tools are in the catalog. The first child starts alone (a bad `--tools` module or an
  unreachable MCP server then reports once, not N-1 times); the others start together.
- Names: child i runs as executor instance `<base>-<i>`, `<base>` being `--instance` or
  `<host>-<parent pid>`; a restarted child keeps its name, so calls addressed to that
  instance (`_instance`) still find it.
- Lifetime: a child asks the kernel for SIGTERM when the parent dies (PR_SET_PDEATHSIG,
  set between fork and exec, and again with `--parent-pid`), so even a SIGKILLed parent
  leaves no orphan, however far the child got in starting. A child that exits while the
  parent runs is restarted, at most `MAX_RESTARTS` times in `RESTART_WINDOW_S`; after that
  the parent stops with a message. Each child has its own process group: Ctrl-C reaches the
  parent only, which stops its session actor first, then the children (SIGTERM: they drain
  the calls they hold), then the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass, field

from actors.executor import default_instance_name
from schemas.errors import WorkerError
from services.config import ActorSettings
from services.process import die_with_parent

WORKER_READY = "toolbus worker ready"
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
STOP_GRACE_S = 15.0
_MAX_LINE = 1 << 20  # a banner line lists every tool of a pool


def worker_command(settings: ActorSettings, *, instance: str, parent_pid: int,
                   verbose: bool = False) -> list[str]:
    """The command line of one worker: the same tools, manifest and pool options. The
    URL, which holds the actor role's password, goes in its environment (`NATS_URL`),
    never on a command line that `ps` shows to every user."""
    cmd = [sys.executable, "-m", "services.cli", *(["-v"] if verbose else []),
           "actor", "worker", "--pool", settings.pool, "--instance", instance,
           "--ack-wait", repr(settings.ack_wait_s),
           "--max-in-flight", str(settings.max_in_flight), "--parent-pid", str(parent_pid)]
    if settings.manifest_path is not None:
        cmd += ["--manifest", str(settings.manifest_path.resolve())]
    for target in settings.tools:
        cmd += ["--tools", target]
    if settings.replicas is not None:
        cmd += ["--replicas", str(settings.replicas)]
    return cmd


@dataclass
class Worker:
    index: int
    instance: str
    proc: asyncio.subprocess.Process | None = None
    lines: list[str] = field(default_factory=list)  # what it serves, from its ready output
    exits: list[float] = field(default_factory=list)  # when it exited, for the restart cap

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None


class Workers:
    """N worker processes, started ready, restarted when they die, stopped in order."""

    def __init__(self, count: int, url: str, settings: ActorSettings, *, parent_pid: int,
                 ready_timeout_s: float = 60.0, verbose: bool = False) -> None:
        base = settings.instance or default_instance_name()
        self.workers = [Worker(i, f"{base}-{i}") for i in range(1, count + 1)]
        self._url = url
        self._settings = settings
        self._parent_pid = parent_pid
        self._ready_timeout_s = ready_timeout_s
        self._verbose = verbose
        self._stopping = False
        self._supervisors: list[asyncio.Task[None]] = []
        self._forwarders: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Start every worker and wait until each is ready, or raise `WorkerError`."""
        if not self.workers:
            return
        await self._spawn(self.workers[0])
        await asyncio.gather(*(self._spawn(w) for w in self.workers[1:]))
        self._supervisors = [asyncio.create_task(self._supervise(w), name=f"worker-{w.index}")
                             for w in self.workers]

    def failure(self) -> WorkerError | None:
        """Why the workers cannot go on (one kept exiting), or None while they run."""
        for task in self._supervisors:
            if task.done() and not task.cancelled():
                exc = task.exception()
                if isinstance(exc, WorkerError):
                    return exc
                if exc is not None:
                    return WorkerError("supervisor", None, f"failed: {exc!r}")
        return None

    async def stop(self, grace: float = STOP_GRACE_S) -> None:
        self._stopping = True
        for task in self._supervisors:
            task.cancel()
        await asyncio.gather(*self._supervisors, return_exceptions=True)
        await asyncio.gather(*(_terminate(w.proc, grace) for w in self.workers
                               if w.proc is not None))
        # Their stdout ends with them; what they printed last is passed on.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*self._forwarders, return_exceptions=True),
                                   5)

    async def _spawn(self, w: Worker) -> None:
        cmd = worker_command(self._settings, instance=w.instance,
                             parent_pid=self._parent_pid, verbose=self._verbose)
        # stderr is the parent's: a worker's errors and logs reach the terminal as is.
        proc = w.proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            start_new_session=True, limit=_MAX_LINE, env={**os.environ, "NATS_URL": self._url},
            # From the fork on, not once it has imported toolbus: a child still starting
            # (a loaded machine) when the parent is killed would be left running.
            preexec_fn=die_with_parent)
        assert proc.stdout is not None
        lines: list[str] = []
        try:
            async with asyncio.timeout(self._ready_timeout_s):
                while True:
                    raw = await proc.stdout.readline()
                    if not raw:
                        code = await proc.wait()
                        why = f"was killed by signal {-code}" if code < 0 else \
                            f"exited with code {code}"
                        raise WorkerError(w.instance, code, f"{why} before it was ready" + (
                            "" if code < 0 else " (its error is above)"))
                    line = raw.decode(errors="replace").rstrip("\n")
                    if line.startswith(WORKER_READY):
                        break
                    lines.append(line)
        except TimeoutError:
            await _terminate(proc, 5)
            raise WorkerError(w.instance, None, f"was not ready within "
                                                f"{self._ready_timeout_s:g} s") from None
        w.lines = lines
        forward = asyncio.create_task(_forward(proc.stdout), name=f"worker-{w.index}-stdout")
        self._forwarders.add(forward)
        forward.add_done_callback(self._forwarders.discard)

    async def _supervise(self, w: Worker) -> None:
        while True:
            assert w.proc is not None
            code = await w.proc.wait()
            if self._stopping:
                return
            now = time.monotonic()
            w.exits = [t for t in w.exits if now - t < RESTART_WINDOW_S] + [now]
            if len(w.exits) > MAX_RESTARTS:
                raise WorkerError(w.instance, code,
                                  f"exited {len(w.exits)} times within "
                                  f"{RESTART_WINDOW_S:g} s (last code {code})")
            print(f"toolbus: worker {w.instance} (pid {w.proc.pid}) exited with code {code}; "
                  "restarting it", file=sys.stderr, flush=True)
            await asyncio.sleep(min(0.25 * 2 ** (len(w.exits) - 1), 5.0))  # back off
            try:
                await self._spawn(w)
            except WorkerError as exc:
                # Died again before it was ready: one more exit of the same worker (a
                # first start that fails stops `toolbus up`; a restart counts, as any).
                print(f"toolbus: {exc}", file=sys.stderr, flush=True)


async def _forward(stream: asyncio.StreamReader) -> None:
    """A worker's stdout after its ready line, passed on. Read to the end even when this
    process's own stdout is gone, so a worker never blocks on a full pipe."""
    while line := await stream.readline():
        with contextlib.suppress(OSError, ValueError):  # a closed or broken stdout
            sys.stdout.write(line.decode(errors="replace"))
            sys.stdout.flush()


async def _terminate(proc: asyncio.subprocess.Process, grace: float) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), grace)
            return
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
    await proc.wait()
