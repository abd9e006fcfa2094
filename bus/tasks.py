"""Stopping background tasks for certain.

On Python 3.11 a cancellation can be lost: `asyncio.wait_for` (under every nats-py request,
so under each KV put, JetStream publish and API call) returns the result instead of raising
when the awaited reply lands in the same loop iteration as the cancel. A loop that then goes
round again never ends, and a `task.cancel(); await task` waits for it forever (a stop that
hung a test's teardown in CI). Cancelling again until the task is done closes that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

log = logging.getLogger("toolbus.bus")

T = TypeVar("T")


async def apart(aw: Awaitable[T]) -> T:
    """`aw`, run in a task of its own and awaited so that a cancellation of the caller
    (Ctrl-C, SIGTERM, an `asyncio.timeout` expiring) always comes through: inside nats-py
    it could be lost (see above), and the caller went on as if never cancelled, or a
    timeout stopped bounding its block. On that cancellation, `aw` is cancelled too."""
    task = asyncio.ensure_future(aw)
    try:
        await asyncio.wait({task})
    except asyncio.CancelledError:
        task.cancel()
        task.add_done_callback(retrieve)
        raise
    return task.result()


def retrieve(task: asyncio.Future[Any]) -> None:
    """A done callback for a task nobody awaits (left behind on a cancellation, a close
    that is best-effort): its end is retrieved, so no "exception was never retrieved"
    warning comes at exit."""
    if not task.cancelled():
        task.exception()


async def stop_task(task: asyncio.Task[Any] | None, *, wait_s: float = 1.0,
                    attempts: int = 10) -> bool:
    """Cancel `task` and wait for it to end, cancelling again after each `wait_s` while it
    still runs; bounded by `attempts`. True if it ended. Its exception, if any, is dropped
    (logged): the caller is stopping it. A cancellation of the caller is never swallowed."""
    if task is None:
        return True
    for _ in range(attempts):
        if task.done():
            break
        task.cancel()
        await asyncio.wait({task}, timeout=wait_s)
    if not task.done():
        log.warning("task %s did not stop after %d cancellations", task.get_name(), attempts)
        return False
    with contextlib.suppress(asyncio.CancelledError):
        exc = task.exception()
        if exc is not None:
            log.warning("task %s failed while stopping: %s: %s", task.get_name(),
                        type(exc).__name__, exc)
    return True


async def stop_tasks(tasks: Any, *, wait_s: float = 1.0) -> None:
    """`stop_task` for each of `tasks` at once."""
    await asyncio.gather(*(stop_task(t, wait_s=wait_s) for t in list(tasks)))


__all__ = ["apart", "retrieve", "stop_task", "stop_tasks"]
