"""Following a session (bus/feed.py): stored events read from the log in order, whatever
NATS drops of their live copies; one turn's, ending with its end; and `toolbus replay
--follow`, which prints them as they are stored."""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Any

import pytest

from bus.client import ToolbusClient
from bus.connection import Bus
from bus.feed import SessionFeed
from bus.subjects import request_subject
from schemas.events import RequestRejected
from tests.conftest import REPO, toolbus_cmd

ECHO: dict[str, Any] = {"tool": "built-in:echo", "arguments": {"text": "hi"}}


async def test_events_whose_live_copies_never_came_are_read_from_the_log(
        bus: Bus, client: ToolbusClient, sid: str) -> None:
    # Never subscribed: as if NATS dropped every live copy. The quiet ticks read the log.
    feed = SessionFeed(bus, sid, turn_id="r-lost", quiet_s=0.05)
    end = await client.call(sid, [ECHO], request_id="r-lost", timeout=30)
    got = []
    async with asyncio.timeout(10):
        async for item in feed.items():
            got.append(item)
    stored = await client.log.read_session(sid)
    assert [(i.seq, i.subject, i.data) for i in got if i is not None] == \
        [(e.seq, e.subject, e.data) for e in stored]
    assert got[-1] is not None and got[-1].type == "turn.completed" and feed.ended
    assert end.turn_id == "r-lost"


async def test_a_turn_followed_from_the_client_has_its_events_only_and_ends_with_it(
        client: ToolbusClient, sid: str) -> None:
    await client.call(sid, [ECHO], request_id="r-before", timeout=30)
    async with client.follow(sid, turn_id="r-after") as feed:
        sent = asyncio.create_task(client.call(sid, [ECHO], request_id="r-after",
                                               timeout=30))
        async with asyncio.timeout(30):
            got = [item async for item in feed.items() if item is not None]
        await sent
    stored = await client.log.read_session(sid)
    theirs = [e for e in stored if e.event is not None and (
        getattr(e.event, "turn_id", None) == "r-after" or
        str(getattr(e.event, "call_id", "")).startswith("r-after-"))]
    assert [i.seq for i in got] == [e.seq for e in theirs]
    assert got[0].type == "turn.requested" and got[-1].type == "turn.completed"


async def test_replay_follow_prints_the_timeline_then_each_event_as_it_is_stored(
        nats_url: str, client: ToolbusClient, sid: str) -> None:
    await client.call(sid, [ECHO], request_id="r-first", timeout=30)
    proc = await asyncio.create_subprocess_exec(
        *toolbus_cmd("replay", sid, "--follow", "--json", "--nats", nats_url), cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None

    async def until_turn_ends(turn_id: str) -> list[dict[str, Any]]:
        lines = []
        while True:
            line = json.loads(await proc.stdout.readline())  # type: ignore[union-attr]
            lines.append(line)
            if line["event"]["type"] == "turn.completed" and \
                    line["event"]["turn_id"] == turn_id:
                return lines

    try:
        async with asyncio.timeout(60):
            first = await until_turn_ends("r-first")
            await client.call(sid, [ECHO], request_id="r-second", timeout=30)
            second = await until_turn_ends("r-second")
    finally:
        proc.send_signal(signal.SIGINT)
        async with asyncio.timeout(30):
            code = await proc.wait()
            stderr = (await proc.stderr.read()).decode()
    stored = await client.log.read_session(sid)
    assert [(line["seq"], line["subject"]) for line in first + second] == \
        [(e.seq, e.subject) for e in stored][:len(first) + len(second)]
    assert code == 130 and "Traceback" not in stderr, stderr


async def test_a_request_sent_again_does_not_end_the_turn_followed(
        bus: Bus, client: ToolbusClient, sid: str) -> None:
    body = {"request_id": "r-again", "calls": [{"tool": "testing:sleep",
                                                 "arguments": {"seconds": 1}}]}
    got = []
    async with client.follow(sid, turn_id="r-again") as feed:
        sent = asyncio.create_task(client.call(sid, body["calls"], request_id="r-again",
                                               timeout=30))
        async with asyncio.timeout(30):
            async for item in feed.items():
                if item is None:
                    continue
                got.append(item)
                if item.type == "call.started":
                    # Sent again past NATS's duplicate window (as under another message
                    # id): the session refuses it as a duplicate, and the turn goes on.
                    await bus.js.publish(request_subject(sid), json.dumps(body).encode())
        await sent
    kinds = [i.type for i in got]
    assert "request.rejected" not in kinds, kinds  # a refusal of no turn of its own
    assert kinds[0] == "turn.requested" and kinds[-1] == "turn.completed", kinds
    stored = await client.log.read_session(sid)
    assert [e.event.reason for e in stored if isinstance(e.event, RequestRejected)] == \
        ["duplicate_request"]


async def test_a_request_sent_again_after_its_turn_is_followed_from_the_log(
        bus: Bus, client: ToolbusClient, sid: str) -> None:
    body = {"request_id": "r-done", "calls": [ECHO]}
    await client.call(sid, body["calls"], request_id="r-done", timeout=30)
    before = await client.log.read_session(sid)
    # Followed from now on, as `POST ?stream=1` of the same request does: the request,
    # sent again past NATS's duplicate window, is only refused as a duplicate; the feed
    # then reads the turn from the log.
    async with client.follow(sid, after=before[-1].seq, turn_id="r-done") as feed:
        await bus.js.publish(request_subject(sid), json.dumps(body).encode())
        async with asyncio.timeout(30):
            got = [item async for item in feed.items() if item is not None]
    assert [i.seq for i in got] == [e.seq for e in before]
    assert got[-1].type == "turn.completed" and feed.ended


async def test_a_turn_followed_in_a_busy_session_still_says_it_is_alive(
        client: ToolbusClient, sid: str) -> None:
    # Another turn stores events all along: the feed hears of them, but gives none.
    slow = [{"tool": "testing:sleep", "arguments": {"seconds": 2}}]
    await client.call(sid, [ECHO], timeout=30)  # warm: the busy turns come without pause
    said_alive = False
    async with SessionFeed(client.bus, sid, turn_id="r-slow", quiet_s=0.5) as feed:
        sent = asyncio.create_task(client.call(sid, slow, request_id="r-slow", timeout=30))

        async def busy() -> None:
            while not sent.done():
                await client.call(sid, [ECHO], timeout=30)

        others = asyncio.create_task(busy())
        async with asyncio.timeout(30):
            async for item in feed.items():
                said_alive = said_alive or item is None
        await sent
        await others
    assert feed.ended and said_alive, "a keep-alive while the turn followed was quiet"


async def test_a_feed_after_no_stream_sequence_is_refused_at_once(
        client: ToolbusClient, sid: str) -> None:
    for after in (-1, 2**64 - 1):
        with pytest.raises(ValueError, match="a stream sequence is 0 to"):
            client.follow(sid, after=after)


async def test_a_delta_heard_before_an_event_comes_before_it_though_the_log_has_both(
        bus: Bus, client: ToolbusClient, sid: str) -> None:
    delta = json.dumps({"type": "model.delta", "turn_id": "t0", "iteration": 1,
                        "text": "early"}).encode()
    async with SessionFeed(bus, sid) as feed:
        # Heard live before the turn's events; by the time the feed first reads the log,
        # the log has the whole turn.
        await bus.nc.publish(f"toolbus.live.{sid}.model.delta", delta)
        await client.call(sid, [ECHO], request_id="r-order", timeout=30)
        got = []
        async with asyncio.timeout(10):
            async for item in feed.items():
                if item is not None:
                    got.append(item)
                if item is not None and item.type == "turn.completed":
                    break
    assert got[0].type == "model.delta" and got[0].data == delta, got
    assert [i.seq for i in got[1:]] == [e.seq for e in await client.log.read_session(sid)]
