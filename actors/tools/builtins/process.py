"""Running a child process for a tool: no shell, no stdin, its own process group (killed
whole on timeout), stdout and stderr read concurrently and capped."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from actors.tools import ToolError


@dataclass(frozen=True, slots=True)
class Finished:
    exit_code: int
    stdout: bytes
    stderr: bytes
    stdout_cut: int  # bytes read past the cap and dropped
    stderr_cut: int


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, int]:
    kept = bytearray()
    cut = 0
    while chunk := await stream.read(65536):
        room = cap - len(kept)
        if room > 0:
            kept += chunk[:room]
        cut += max(0, len(chunk) - max(room, 0))
    return bytes(kept), cut


def close_inherited(keep: Collection[int] = ()) -> None:
    """In a child between fork and exec: mark every open file but stdio and `keep` to
    close on exec. `subprocess` closes them itself, but uvloop's subprocesses inherit
    every inheritable descriptor of the process (a worker's stdout pipe, a log file, the
    terminal), which a tool's child must not write to or read from."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc: every descriptor up to the limit
        fds = list(range(3, os.sysconf("SC_OPEN_MAX")))
    for fd in fds:
        if fd > 2 and fd not in keep:
            with contextlib.suppress(OSError):  # the listing's own, closed by now
                os.set_inheritable(fd, False)


async def run_capped(argv: Sequence[str], *, cwd: str, env: Mapping[str, str],
                     timeout_ms: int, cap: int, what: str,
                     preexec: Callable[[], None] | None = None) -> Finished:
    """Run `argv` to completion, or raise `ToolError(timeout)` naming `what`. The child
    gets stdio and nothing else of this process's open files."""

    def setup() -> None:  # pragma: no cover - runs in the child
        if preexec is not None:
            preexec()
        close_inherited()

    # Only where needed: a Python function between fork and exec is best avoided (other
    # threads), and `subprocess` closes the files itself on the standard event loop.
    uvloop = type(asyncio.get_running_loop()).__module__.startswith("uvloop")
    proc = await asyncio.create_subprocess_exec(
        *argv, cwd=cwd, env=dict(env), stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        start_new_session=True, preexec_fn=setup if uvloop else preexec,
    )
    try:
        return await collect(proc, timeout_ms=timeout_ms, cap=cap, what=what)
    finally:
        if proc.returncode is None:  # timed out or cancelled: kill the whole group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()


async def collect(proc: asyncio.subprocess.Process, *, timeout_ms: int, cap: int,
                  what: str) -> Finished:
    """Wait for `proc`, reading its stdout and stderr at once, each capped at `cap`
    bytes; `ToolError(timeout)` naming `what` after `timeout_ms` (the caller kills it)."""
    assert proc.stdout is not None and proc.stderr is not None
    try:
        async with asyncio.timeout(timeout_ms / 1000):
            (out, out_cut), (err, err_cut) = await asyncio.gather(
                _read_capped(proc.stdout, cap), _read_capped(proc.stderr, cap))
            code = await proc.wait()
    except TimeoutError:
        raise ToolError(f"{what} ran longer than {timeout_ms} ms and was killed",
                        error_type="timeout") from None
    return Finished(code, out, err, out_cut, err_cut)
