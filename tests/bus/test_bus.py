from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from bus.client import ToolbusClient
from bus.connection import Bus, connect
from bus.direct import direct_batch
from bus.eventlog import Append, EventLog
from bus.server import EmbeddedServer
from bus.subjects import EVENTS_STREAM
from schemas.errors import BusTimeoutError, ConcurrencyError, ConnectError, PortInUseError
from schemas.events import (
    CallOutcome,
    CallStarted,
    CallSucceeded,
    RequestRejected,
    TurnCompleted,
)
from tests.conftest import EventWatch, of_type


def _turn(sid: str, n: int) -> CallStarted:
    # A fact the session actor has nothing to decide about, so the in-process actors of
    # other tests leave these sessions alone.
    return CallStarted(session_id=sid, at=float(n), actor="test", call_id=f"c{n}",
                       turn_id="t", executor="x")


async def test_an_unreachable_server_is_a_prompt_error_naming_the_url() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connection refused
        t0 = time.monotonic()
        with pytest.raises(ConnectError) as info:
            await connect(f"nats://127.0.0.1:{port}", name="t", connect_timeout=1)
    assert f"nats://127.0.0.1:{port}" in str(info.value)
    assert "NATS_URL" in str(info.value)
    assert time.monotonic() - t0 < 5


def test_a_busy_port_is_a_clear_error_that_says_what_to_do(tmp_path, nats_server) -> None:
    with pytest.raises(PortInUseError) as info:
        EmbeddedServer(tmp_path, port=nats_server.port).start()
    msg = str(info.value)
    assert f"port {nats_server.port}" in msg and "--port" in msg and "--nats" in msg


async def test_appends_are_idempotent_by_message_id(bus: Bus, sid: str) -> None:
    log = EventLog(bus)
    first = await log.append(Append(_turn(sid, 1), f"{sid}:x"))
    again = await log.append(Append(_turn(sid, 1), f"{sid}:x"))
    assert again.duplicate and again.seq == first.seq
    assert len(await log.read_session(sid)) == 1


async def test_a_stale_writer_gets_a_concurrency_error(bus: Bus, sid: str) -> None:
    log = EventLog(bus)
    a = await log.append(Append(_turn(sid, 1), f"{sid}:1"), expect_last=0)
    await log.append(Append(_turn(sid, 2), f"{sid}:2"), expect_last=a.seq)
    with pytest.raises(ConcurrencyError):
        await log.append(Append(_turn(sid, 3), f"{sid}:3"), expect_last=a.seq)
    # The check is per session: another session's events do not make this one stale.
    await log.append(Append(_turn(f"{sid}-other", 1), f"{sid}-o:1"))
    events = await log.read_session(sid)
    await log.append(Append(_turn(sid, 4), f"{sid}:4"), expect_last=events[-1].seq)


async def test_reading_a_session_is_ordered_complete_and_leaves_no_consumer(
    bus: Bus, sid: str
) -> None:
    log = EventLog(bus)
    n = 1300  # more than two read batches
    await asyncio.gather(*(
        log.append(Append(CallStarted(session_id=sid, at=float(i), actor="t", call_id=f"c{i}",
                                      turn_id="t", executor="x"), f"{sid}:{i}"))
        for i in range(n)
    ))
    await log.append(Append(_turn(f"{sid}-noise", 1), f"{sid}-noise"))
    before = (await bus.js.stream_info(EVENTS_STREAM)).state.consumer_count
    events = await log.read_session(sid)
    assert len(events) == n
    assert [e.seq for e in events] == sorted(e.seq for e in events)
    assert {e.event.call_id for e in events} == {f"c{i}" for i in range(n)}  # type: ignore[union-attr]
    until = events[9].seq
    assert len(await log.read_session(sid, until=until)) == 10
    assert (await bus.js.stream_info(EVENTS_STREAM)).state.consumer_count == before


async def test_reading_an_unknown_session_is_empty(bus: Bus) -> None:
    assert await EventLog(bus).read_session("never-used") == []


def test_ack_metadata_is_read_from_both_reply_subject_forms() -> None:
    from nats.aio.msg import Msg

    from bus.consumer import ack_metadata

    old = Msg(_client=None, subject="s", reply="$JS.ACK.EV.c1.3.42.7.1700000000000000000.5")
    new = Msg(_client=None, subject="s",
              reply="$JS.ACK._.ACCHASH.EV.c1.2.43.8.1700000000000000001.0.rnd")
    assert ack_metadata(old) == (42, 3, 1700000000000000000)
    assert ack_metadata(new) == (43, 2, 1700000000000000001)
    for m in (old, new):  # the same as nats-py's own parse
        md = m.metadata
        assert ack_metadata(m)[:2] == (md.sequence.stream, md.num_delivered)


async def test_acks_left_for_the_next_write_reach_the_server_on_their_own(
        bus: Bus, sid: str, nats_url: str) -> None:
    # A delivery's ack waits in the connection's buffer for whatever is written next; with
    # nothing else written, it still goes out within a few milliseconds, and the server
    # counts every message acknowledged (none is delivered again).
    from bus.consumer import Delivery, PullLoop
    from bus.streams import ConsumerSpec

    stream = f"TACK_{sid.replace('-', '_')}"
    await bus.js.add_stream(name=stream, subjects=[f"tack.{sid}.>"])
    handled: list[int] = []

    async def handler(delivery: Delivery) -> None:
        handled.append(delivery.num_delivered)
        await delivery.ack()

    # Its own connection: nothing but the pull requests and the acks is written on it.
    own = await connect(nats_url, name="acker")
    loop = PullLoop(own, ConsumerSpec(stream, "acker", (f"tack.{sid}.>",), ack_wait_s=1.0),
                    handler)
    await loop.start()
    try:
        for i in range(5):
            await bus.js.publish(f"tack.{sid}.{i}", b"x")
        async with asyncio.timeout(5):
            while True:
                info = await bus.js.consumer_info(stream, "acker")
                if info.num_ack_pending == 0 and info.num_pending == 0 and len(handled) == 5:
                    break
                await asyncio.sleep(0.01)
        await asyncio.sleep(1.5)  # past the ack wait: nothing is delivered again
        assert handled == [1] * 5
    finally:
        await loop.stop()
        await own.close()
        await bus.js.delete_stream(stream)


async def test_a_request_the_stream_never_acknowledges_is_named_as_such(tmp_path) -> None:
    # Something answers on the requests subject but no stream stores it (a server without
    # toolbus's streams): the client says the stream did not acknowledge, at once, not
    # "no result within 60 s".
    from bus.server import free_port
    from schemas.errors import BusTimeoutError
    server = EmbeddedServer(tmp_path, port=free_port(), auth=False).start()
    try:
        bus = await connect(server.url, name="t")
        client = ToolbusClient(bus)

        async def mute(msg: object) -> None:
            pass

        await bus.nc.subscribe("toolbus.req.>", cb=mute)
        t0 = time.monotonic()
        with pytest.raises(BusTimeoutError, match="did not acknowledge"):
            await client.call("s1", [{"tool": "built-in:echo"}], timeout=60)
        assert time.monotonic() - t0 < 30
        await client.close()
        await bus.close()
    finally:
        server.stop()


async def test_closing_once_the_server_stopped_answering_raises_no_cancellation(
        nats_server: EmbeddedServer) -> None:
    # A server stopped mid-read (SIGSTOP, a wedged host): the drain times out, and nats-py's
    # close then ended, now and then, in the cancellation of its own socket's close waiter,
    # which escaped every command as a traceback instead of "NATS did not answer in time".
    import nats.errors

    async def drain() -> None:
        raise nats.errors.FlushTimeoutError

    b = await connect(nats_server.url_for("client"), name="t")
    real_close = b.nc.close

    async def close_cancelled() -> None:
        await real_close()
        raise asyncio.CancelledError

    b.nc.drain = drain  # type: ignore[method-assign]
    b.nc.close = close_cancelled  # type: ignore[method-assign]
    await b.close()
    assert b.nc.is_closed
    # A cancellation of the closing task itself still goes through.
    b = await connect(nats_server.url_for("client"), name="t")
    real_close = b.nc.close

    async def close_slowly() -> None:
        await asyncio.sleep(30)

    b.nc.drain = drain  # type: ignore[method-assign]
    b.nc.close = close_slowly  # type: ignore[method-assign]
    task = asyncio.ensure_future(b.close())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await real_close()


class _Proxy:
    """A TCP relay to a NATS server that can cut its clients off for a while."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def open(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        assert self._server is not None
        self._server.close()
        for w in list(self._writers):
            w.close()
        await self._server.wait_closed()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers -= {writer, up_writer}


@contextlib.asynccontextmanager
async def _far_call(nats_url: str, bus: Bus, sid: str, *, timeout: float
                    ) -> AsyncIterator[tuple[_Proxy, asyncio.Task[Any]]]:
    """A client behind a proxy that can cut it off, calling `testing:sleep` (0.5 s): the
    proxy and the call, yielded once the call has started."""
    proxy = _Proxy(int(nats_url.rsplit(":", 1)[1]))
    await proxy.open()
    far = await connect(nats_url.rsplit(":", 1)[0] + f":{proxy.port}", name="far-client")
    client = ToolbusClient(far)
    try:
        async with EventWatch(bus, sid) as watch:
            calling = asyncio.create_task(client.call(
                sid, [{"tool": "testing:sleep", "arguments": {"seconds": 0.5}}],
                timeout=timeout))
            await watch.until(lambda evs: bool(of_type(evs, "call.started")), timeout=10)
        yield proxy, calling
    finally:
        await client.close()
        with contextlib.suppress(Exception):
            await far.close()
        await proxy.cut()


async def test_a_turn_that_ends_while_the_clients_connection_is_away_is_read_from_the_log(
        bus: Bus, system: dict[str, Any], nats_url: str, sid: str) -> None:
    """The end of a turn reaches a waiting client on the live subject, which the server
    does not keep: one that ended while the connection was away is read from the log once
    it is back, instead of the call waiting out its whole timeout."""
    async with _far_call(nats_url, bus, sid, timeout=30) as (proxy, calling), \
            EventWatch(bus, sid) as watch:
        await proxy.cut()
        await watch.until(lambda evs: bool(of_type(evs, "turn.completed")), timeout=10)
        await proxy.open()  # the same port: the client reconnects
        end = await asyncio.wait_for(calling, 10)
        assert isinstance(end, TurnCompleted) and end.ok, end


async def test_a_caller_whose_server_never_comes_back_is_told_so_not_left_waiting(
        bus: Bus, system: dict[str, Any], nats_url: str, sid: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """It waited its whole timeout (300 s for `toolbus chat`) in silence. Told apart from
    a timeout (`toolbus chat` then cancels the turn, which cannot be sent here, and said
    it waited its --timeout)."""
    from schemas.errors import ConnectionLostError

    monkeypatch.setattr("bus.client.GIVE_UP_AWAY_S", 1.0)
    async with _far_call(nats_url, bus, sid, timeout=300) as (proxy, calling):
        await proxy.cut()  # and never opened again
        with pytest.raises(ConnectionLostError, match="lost the connection to NATS"):
            await asyncio.wait_for(calling, 20)


async def test_a_direct_get_whose_reply_never_comes_fails_instead_of_waiting_forever(
        bus: Bus) -> None:
    """A batched direct get taken by a replica that dies before its end-of-batch (a node
    killed) is never answered: it fails within its timeout, as any read does, where it
    waited forever (a session's cold load, `read_head`, hung with it)."""
    stream = "TB_SILENT"  # no such stream: only this subscriber takes its direct gets
    taken: list[bytes] = []

    async def swallow(msg: Any) -> None:
        taken.append(msg.data)  # and never answers

    sub = await bus.nc.subscribe(f"$JS.API.DIRECT.GET.{stream}", cb=swallow)
    try:
        async with asyncio.timeout(5):
            with pytest.raises(BusTimeoutError, match="nothing more of the batch"):
                await direct_batch(bus, stream, "x.>", 1, 10, timeout=0.3)
    finally:
        await sub.unsubscribe()
    assert taken  # the request did go out, and found someone


async def test_a_result_not_found_at_first_is_read_again_not_left_empty(bus: Bus,
                                                                        sid: str) -> None:
    """On a cluster, a direct get that a replica still behind serves finds no message at
    a sequence a stored turn's end references: the outcome came back with its result
    empty (found by a cluster kill test). The client asks again for a while."""
    log = EventLog(bus)
    seq = (await bus.js.stream_info(EVENTS_STREAM)).state.last_seq + 1
    done = CallSucceeded(session_id=sid, at=1.0, actor="executor", call_id="t1-0",
                         turn_id="t1", executor="x", result={"late": True})

    async def stored_late() -> None:
        await asyncio.sleep(0.2)  # the replica catching up
        assert (await log.append(Append(done, f"{sid}:t1-0:late"))).seq == seq

    end = TurnCompleted(session_id=sid, at=2.0, actor="session", turn_id="t1",
                        request_id="t1", ok=True,
                        outcomes=[CallOutcome(call_id="t1-0", tool="built-in:echo",
                                              status="succeeded", result_seq=seq)])
    late = asyncio.create_task(stored_late())
    got = await ToolbusClient(bus)._with_results(end, {}, full=False)
    await late
    assert not isinstance(got, RequestRejected)
    assert got.outcomes[0].result == {"late": True}


async def test_a_feed_outlives_its_connection_going_away_and_coming_back(
        bus: Bus, nats_url: str, sid: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`toolbus replay --follow` (and the gateway's event streams) ended with a read error
    when the server went away for a moment; the feed now waits for the connection, and
    reads from the log what was stored meanwhile (its live copies never came)."""
    from bus.feed import SessionFeed

    monkeypatch.setattr("bus.feed._READ_TIMEOUT_S", 0.5)
    log = EventLog(bus)

    async def reject(i: int) -> None:
        await log.append(Append(RequestRejected(session_id=sid, at=float(i), actor="test",
                                                reason="test", message=f"m{i}"),
                                f"{sid}:feed:{i}"))

    await reject(0)
    proxy = _Proxy(int(nats_url.rsplit(":", 1)[1]))
    await proxy.open()
    far = await connect(nats_url.rsplit(":", 1)[0] + f":{proxy.port}", name="far-feed")
    try:
        async with SessionFeed(far, sid, quiet_s=0.3) as feed:
            got: list[bytes] = []

            async def follow() -> None:  # reading all along, as `replay --follow` does
                async for item in feed.items():
                    if item is not None:
                        got.append(item.data)
                    if len(got) == 3:
                        return

            following = asyncio.create_task(follow())
            async with asyncio.timeout(10):
                while not got:  # noqa: ASYNC110 - the task's own list
                    await asyncio.sleep(0.05)
            await proxy.cut()
            for i in (1, 2):  # stored while the feed's connection is away
                await reject(i)
            await asyncio.sleep(1.5)  # more than a read's timeout: reads have failed
            assert not following.done(), following
            await proxy.open()  # the same port: the client reconnects
            await asyncio.wait_for(following, 20)
            assert [json.loads(d)["message"] for d in got] == ["m0", "m1", "m2"]
    finally:
        with contextlib.suppress(Exception):
            await far.close()
        await proxy.cut()


async def test_closing_a_connection_to_a_server_that_stopped_answering_is_bounded(
        tmp_path) -> None:
    """A server stopped mid-work (SIGSTOP, a wedged host): nats-py's drain waited out its
    flush's 10 s before closing, so `toolbus chat` interrupted then took 17 s to exit (12 s
    and a "bug" message under SIGTERM). Closing is bounded now."""
    import os
    import signal

    from bus.connection import CLOSE_S
    from bus.server import free_port
    server = EmbeddedServer(tmp_path, port=free_port(), auth=False).start()
    assert server.process is not None
    try:
        bus = await connect(server.url, name="t")
        got: list[object] = []

        async def keep(msg: object) -> None:
            got.append(msg)

        await bus.nc.subscribe("t.>", cb=keep)  # a subscription for the drain to drain
        await bus.nc.flush()
        os.kill(server.process.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        await bus.close()
        took = time.monotonic() - t0
        assert took < CLOSE_S + 1, took
        assert bus.nc.is_closed
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        server.stop()


async def test_a_flush_cancelled_before_its_pong_leaves_the_connection_reading(
        nats_server: EmbeddedServer) -> None:
    """A session feed opened and cancelled at once (a gateway reader gone, a Ctrl-C):
    nats-py answered the late PONG into the cancelled flush, and the `InvalidStateError`
    ended the connection's read loop; nothing was delivered on it for 15 s or more."""
    b = await connect(nats_server.url_for("client"), name="t")
    try:
        flushing = asyncio.ensure_future(b.nc.flush(timeout=5))
        await asyncio.sleep(0)  # its PING is on its way
        await asyncio.sleep(0)
        flushing.cancel()
        await asyncio.gather(flushing, return_exceptions=True)
        await asyncio.sleep(0.2)  # its PONG came
        assert b.nc._reading_task is not None and not b.nc._reading_task.done()
        async with asyncio.timeout(5):
            await b.nc.flush(timeout=2)  # answered: the connection still reads
    finally:
        await b.close()


async def test_a_client_watches_at_most_its_bound_of_sessions(nats_url: str, system: Any,
                                                              sid: str) -> None:
    """Past `max_watched_sessions`, each new session's watch drops the oldest idle one,
    with its subscriptions: a client asking in ever new sessions stays bounded."""
    own = await connect(nats_url, name="bounded-client")
    client = ToolbusClient(own, max_watched_sessions=2)
    try:
        subs = []
        for i in range(5):
            end = await client.call(f"{sid}-{i}", [{"tool": "built-in:echo",
                                                    "arguments": {"n": i}}])
            assert end.ok
            subs.append(len(own.nc._subs))
        assert client.watched_sessions == [f"{sid}-3", f"{sid}-4"]
        assert subs[1] > subs[0] and subs[1] == subs[2] == subs[3] == subs[4], subs
    finally:
        await client.close()
        await own.close()
