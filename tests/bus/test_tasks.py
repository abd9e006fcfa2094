"""Stopping background tasks for certain, even one that loses a cancellation."""

from __future__ import annotations

import asyncio
import sys

import pytest

from bus.tasks import apart, stop_task


async def test_a_loop_that_loses_a_cancellation_is_still_stopped() -> None:
    # As a loop around a NATS request does on Python 3.11 when the reply and the cancel
    # land in one turn of the event loop (`wait_for` returns the reply): the first
    # cancellation is swallowed, and the loop would go round forever.
    rounds = 0
    swallowed = False

    async def loop() -> None:
        nonlocal rounds, swallowed
        while True:
            rounds += 1
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed = True  # lost, once

    task = asyncio.create_task(loop())
    await asyncio.sleep(0.03)
    async with asyncio.timeout(5):
        assert await stop_task(task, wait_s=0.05)
    assert task.cancelled() and swallowed
    after = rounds
    await asyncio.sleep(0.05)
    assert rounds == after  # it runs no more


async def test_a_task_that_never_stops_is_given_up_on_within_its_bound() -> None:
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(1)
            except asyncio.CancelledError:
                continue

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    async with asyncio.timeout(5):
        assert not await stop_task(task, wait_s=0.01, attempts=3)
    assert not task.done()  # reported, not waited for forever
    release.set()
    task.cancel()
    await asyncio.wait({task}, timeout=2)
    assert task.done()


async def test_a_finished_or_missing_task_needs_nothing() -> None:
    assert await stop_task(None)
    done = asyncio.create_task(asyncio.sleep(0))
    await done
    assert await stop_task(done)


@pytest.mark.parametrize("how", ["apart", "as nats-py awaits"])
async def test_a_cancellation_landing_as_the_reply_comes_is_not_lost_apart(how: str) -> None:
    """nats-py awaits each reply with `asyncio.wait_for`, which on Python 3.11 returns the
    reply and drops a cancellation landing in the same turn of the loop: `toolbus chat`
    went on waiting for a whole turn after SIGTERM. `apart` lets it through."""
    loop = asyncio.get_running_loop()
    reply: asyncio.Future[bytes] = loop.create_future()
    got: list[bytes] = []

    async def caller() -> None:
        request = asyncio.wait_for(reply, 5)  # nats-py's request, in short
        got.append(await (apart(request) if how == "apart" else request))
        await asyncio.sleep(3600)  # what would go on, had the cancellation been lost

    task = asyncio.create_task(caller())
    await asyncio.sleep(0.01)  # waiting for its reply
    loop.call_soon(reply.set_result, b"ack")  # the reply and the cancel, in one turn
    loop.call_soon(task.cancel)
    await asyncio.sleep(0.01)
    lost = not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    if how == "apart":
        assert not lost and got == []
    else:  # the construction does meet the race (Python 3.12 no longer loses it)
        assert lost == (sys.version_info < (3, 12)) and got == ([b"ack"] if lost else [])
