"""What every toolbus process shares: exit codes, the event loop runner, and how a child
process ties its life to its parent's. Imports nothing else of services/, so the CLI, the
runtime and the worker supervisor all import it without a cycle."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import faulthandler
import gc
import os
import signal
import sys
import threading
from collections.abc import Coroutine
from typing import Any

EXIT_OK, EXIT_CALL_FAILED, EXIT_USAGE, EXIT_BUS = 0, 1, 2, 3

_PR_SET_PDEATHSIG = 1


_interrupts = 0


def _on_sigint(signum: int, frame: Any) -> None:
    global _interrupts
    _interrupts += 1
    signal.default_int_handler(signum, frame)  # KeyboardInterrupt, as ever


def note_interrupts() -> None:
    """Count Ctrl-Cs while the process starts (`interrupted`), as well as raising
    KeyboardInterrupt: one landing inside a compiled extension (pydantic-core building
    a schema at import) can come out as another error, and would print its traceback."""
    signal.signal(signal.SIGINT, _on_sigint)


def interrupted() -> bool:
    return _interrupts > 0


def started() -> None:
    """Hand Ctrl-C back to Python's own handler, which asyncio's runner needs to see to
    install its own (it cancels the main task instead of raising anywhere)."""
    if signal.getsignal(signal.SIGINT) is _on_sigint:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def run(coro: Coroutine[Any, Any, int]) -> int:
    """Run on uvloop where it exists: it roughly halves the cost of each bus hop."""
    # What start-up built (modules, settings) lives as long as the process: kept out of
    # the collector, so that its full passes do not walk it again and again.
    gc.freeze()
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def tcp_port(text: str) -> int:
    """An argparse type: a TCP port, 1 to 65535 (an int would take 99999, and the socket
    then listen on 99999 - 65536)."""
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port: give 1 to 65535")
    return value


tcp_port.__name__ = "port"  # argparse names the type in its error messages


def fill_std_fds() -> set[str]:
    """Give /dev/null to a standard stream the process was started without (`>&-`): the
    first socket opened would otherwise take its number, the output meant for the
    terminal would go to the bus, and uvloop aborts the process when it closes it.
    Returns the names of those streams (`"stdout"`, ...)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.set_inheritable(os.open(os.devnull, os.O_RDWR), True)  # the lowest: fd
    closed = set()
    for name, mode in (("stdin", "r"), ("stdout", "w"), ("stderr", "w")):
        if getattr(sys, name) is None:  # Python found the descriptor closed at start
            setattr(sys, name, open(os.devnull, mode))
            closed.add(name)
    return closed


class Diagnostics:
    """A standard stream that never stops a command: a line that cannot be written (a
    full disk, `2>/dev/full`, a closed pipe) is dropped. Standard error, where a command
    says how the work goes (the work, a call or a turn and its output on stdout, goes on
    without it), and a server's stdout (its start-up banner)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def write(self, text: str) -> int:
        try:
            return int(self._inner.write(text))
        except (OSError, ValueError):
            return len(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._inner.flush()

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, ...
        return getattr(self._inner, name)


EXIT_TERMINATED = 128 + signal.SIGTERM


def say(text: str) -> None:
    """`text` on stderr, if it can be written: on an interrupt's way out, a closed pipe
    (`2>&1 | head`) must not stop what comes after (cancelling a turn, the exit status)."""
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # a closed pipe or file
        pass


async def terminable(coro: Coroutine[Any, Any, int], *, grace_s: float) -> int:
    """`coro`, cancelled by SIGTERM as by Ctrl-C, so that the processes and files it
    started are stopped and removed by its own `finally` blocks instead of left behind
    (`timeout`, a CI job's end and `kill` send SIGTERM). Then 143, as a shell reports it.
    SIGHUP (its terminal closed: the window, a dropped ssh session) does the same, exit
    129, unless the process ignores it (`nohup`): killed by it, a chat left its turn
    running unseen, holding the session's next turns back.

    A process told to stop must stop: if it has not exited `grace_s` after the first
    signal (its cleanup waits on something that never comes), it says what it was
    waiting for and exits without finishing."""
    task = asyncio.ensure_future(coro)
    loop = asyncio.get_running_loop()
    termed: int | None = None  # the signal that stopped it

    def on_term(signum: int) -> None:
        nonlocal termed
        if termed is None:
            timer = threading.Timer(grace_s, _stuck, args=(loop, grace_s, signum))
            timer.daemon = True
            timer.start()
            termed = signum
        task.cancel()

    signals = [signal.SIGTERM]
    if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signals.append(signal.SIGHUP)
    try:
        for signum in signals:
            loop.add_signal_handler(signum, on_term, signum)
    except (NotImplementedError, RuntimeError):  # no signal handlers here (Windows)
        return await task
    try:
        return await task
    except asyncio.CancelledError:
        if termed is not None and task.cancelled():
            # A turn of the loop for the tasks its cleanup cancelled (nats-py's
            # subscriptions) to end, before the loop goes.
            for _ in range(3):
                await asyncio.sleep(0)
            say("toolbus: terminated" if termed == signal.SIGTERM else "toolbus: hung up")
            return 128 + termed
        raise
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)


def _stuck(loop: asyncio.AbstractEventLoop, grace_s: float,
           signum: int = signal.SIGTERM) -> None:
    """On a timer's thread, `grace_s` after SIGTERM (or SIGHUP): what the process still
    waits for (its tasks' stacks, from the loop's thread; the threads' stacks if the loop
    itself is blocked), then exit 128 + the signal, whatever stderr is (a closed pipe
    included)."""
    try:
        print(f"toolbus: still stopping {grace_s:g} s after {signal.Signals(signum).name}; "
              "exiting now, without finishing (a bug: what it was waiting for follows)",
              file=sys.stderr, flush=True)
        shown = threading.Event()

        def show_tasks() -> None:
            try:
                for task in asyncio.all_tasks(loop):
                    print(f"task {task.get_name()}, awaiting:", file=sys.stderr)
                    for where in _awaiting(task.get_coro()):
                        print(f"  {where}", file=sys.stderr)
            finally:
                shown.set()

        with contextlib.suppress(RuntimeError):  # the loop is closed: the threads tell
            loop.call_soon_threadsafe(show_tasks)
        if not shown.wait(2.0):
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
    finally:  # whatever failed above (stderr a closed pipe): the exit must come
        os._exit(128 + signum)


def _awaiting(coro: Any) -> list[str]:
    """Where a coroutine waits, outermost first: each frame down its chain of awaits
    (a task's own stack shows the outermost alone)."""
    wheres: list[str] = []
    while coro is not None and len(wheres) < 40:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            break
        wheres.append(f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return wheres


def die_with_parent() -> None:
    """Linux: get SIGTERM when the parent dies, even by SIGKILL, instead of lingering.

    Either in the child before exec (a `preexec_fn`), or first thing in a child process
    (then check with `parent_is` that the parent did not die before this call)."""
    if _prctl is not None:
        with contextlib.suppress(Exception):  # best effort
            _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _find_prctl() -> Any:
    """libc's prctl, looked up once here: in a `preexec_fn`, between fork and exec, the
    child then only calls it (no loading of libraries there)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not every libc has it
        return None


_prctl = _find_prctl()


def parent_is(pid: int) -> bool:
    return os.getppid() == pid
