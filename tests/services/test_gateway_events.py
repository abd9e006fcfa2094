"""A session's events over HTTP, as server-sent events: a message posted with ?stream=1
answers with its turn's events, and GET /sessions/{sid}/events follows a session from a
sequence (Last-Event-ID) on. Real HTTP both ways: the gateway on a free port, the planner
against the scripted fake provider (tests/llm_servers.py)."""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from actors.planner import Planner
from bus.client import ToolbusClient
from bus.connection import Bus, connect
from bus.server import free_port
from schemas.events import RequestRejected
from services import gateway as gateway_module
from services.event_stream import frame
from services.gateway import ROLES
from services.runtime import start_gateway
from tests.llm_servers import Call, FakeProvider, reply
from tests.services.test_gateway import large_session
from tests.services.test_gateway_planner import fake, planner

__all__ = ["fake", "planner"]  # fixtures, shared with the message route's tests

async def _gateway(bus: Bus) -> tuple[Any, dict[str, str]]:
    by_role = {role: secrets.token_urlsafe(32) for role in ROLES}
    port = free_port()
    gw = await start_gateway(bus, port, tokens={t: r for r, t in by_role.items()})
    return gw, {"url": f"http://127.0.0.1:{port}", **by_role}


@pytest.fixture
async def tokens(bus: Bus, system: dict[str, Any]) -> AsyncIterator[dict[str, str]]:
    gw, by_role = await _gateway(bus)
    try:
        yield by_role
    finally:
        await gw.stop()


def _web(tokens: dict[str, str], role: str = "client") -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=tokens["url"], timeout=30, trust_env=False,
                             headers={"Authorization": f"Bearer {tokens[role]}"})


class Sse:
    """One server-sent event as read."""

    def __init__(self, event: str, data: str, id: str | None) -> None:
        self.event, self.id = event, id
        self.data: Any = json.loads(data) if data else None

    def __repr__(self) -> str:
        return f"Sse({self.event!r}, id={self.id})"


async def _events(answer: httpx.Response | AsyncIterator[str], *, until: str | None = None,
                  comments: list[str] | None = None) -> list[Sse]:
    """The events of an SSE answer (or of its lines, read on from where they are), to its
    end, or up to the first of type `until`."""
    out: list[Sse] = []
    event, data, eid = "message", [], None
    lines = answer.aiter_lines() if isinstance(answer, httpx.Response) else answer
    async for line in lines:
        if line == "":
            if data:
                out.append(Sse(event, "\n".join(data), eid))
                if until is not None and event == until:
                    return out
            event, data, eid = "message", [], None
        elif line.startswith(":"):
            if comments is not None:
                comments.append(line)
        else:
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "data":
                data.append(value)
            elif name == "event":
                event = value
            elif name == "id":
                eid = value
    return out


def _script_one_tool_turn(fake: FakeProvider) -> None:
    fake.script(reply("openai", calls=[Call("call_1", "built-in__echo", {"text": "hi"})],
                      stream=True),
                reply("openai", "It said hi.", stream=True, chunks=["It ", "said ", "hi."]))


async def test_a_message_posted_with_stream_answers_with_its_turns_events_to_its_end(
        planner: Planner, fake: FakeProvider, tokens: dict[str, str], sid: str) -> None:
    _script_one_tool_turn(fake)
    async with _web(tokens) as web, asyncio.timeout(30):
        async with web.stream("POST", f"/sessions/{sid}/requests?stream=1",
                              json={"message": "Echo hi, then say what it said."}) as got:
            assert got.status_code == 200, await got.aread()
            assert got.headers["content-type"].startswith("text/event-stream")
            events = await _events(got)  # to the end: the answer ends with the turn
    kinds = [e.event for e in events]
    assert kinds[0] == "request.accepted"
    accepted = events[0].data
    assert accepted["ok"] is True and accepted["duplicate"] is False
    turn_id = accepted["turn_id"]
    assert kinds[-1] == "turn.completed" and events[-1].data["text"] == "It said hi."
    assert events[-1].data["turn_id"] == turn_id
    for kind in ("turn.requested", "model.requested", "model.responded", "call.requested",
                 "call.succeeded"):
        assert kind in kinds, kinds
    deltas = [e.data["text"] for e in events if e.event == "model.delta"]
    assert "".join(deltas) == "It said hi.", events
    # In the order they were published: the answer's deltas before its stored reply
    # (their request may be stored after the first of them: it is stored beside the call).
    at = [i for i, e in enumerate(events) if e.event == "model.delta"]
    answered = [i for i, e in enumerate(events) if e.event == "model.responded"][-1]
    assert max(at) < answered, kinds
    stored = [e for e in events if e.id is not None]
    seqs = [int(e.id) for e in stored if e.id is not None]
    assert seqs == sorted(set(seqs)), "stored events come once each, in the log's order"
    assert all(e.data["type"] == e.event for e in stored)
    assert all(e.id is None for e in events if e.event in ("model.delta",
                                                           "request.accepted"))


async def test_a_stream_resumed_with_last_event_id_sends_the_rest_without_gaps_or_repeats(
        planner: Planner, fake: FakeProvider, client: ToolbusClient,
        tokens: dict[str, str], sid: str) -> None:
    _script_one_tool_turn(fake)
    end = await client.ask(sid, "Echo hi, then say what it said.", timeout=30)
    async with _web(tokens) as web, asyncio.timeout(30):
        async with web.stream("GET", f"/sessions/{sid}/events",
                              params={"turn": end.turn_id}) as got:
            assert got.status_code == 200, await got.aread()
            whole = await _events(got)
        assert whole[-1].event == "turn.completed" and whole[0].event == "turn.requested"
        cut = whole[3]
        assert cut.id is not None
        async with web.stream("GET", f"/sessions/{sid}/events",
                              params={"turn": end.turn_id, "after": "0"},
                              headers={"Last-Event-ID": cut.id}) as got:
            rest = await _events(got)
    # The header wins over ?after=, as a reconnecting EventSource sends it.
    assert [(e.event, e.id) for e in rest] == [(e.event, e.id) for e in whole[4:]]


async def test_a_session_followed_live_shows_a_turn_posted_after_it_opened(
        bus: Bus, planner: Planner, fake: FakeProvider, tokens: dict[str, str],
        sid: str) -> None:
    _script_one_tool_turn(fake)
    def watching() -> bool:
        return any(s.subject == f"toolbus.live.{sid}.>" for s in bus.nc._subs.values())

    async with _web(tokens) as web, asyncio.timeout(30):
        async with web.stream("GET", f"/sessions/{sid}/events") as got:
            assert got.status_code == 200 and watching()
            posted = await web.post(f"/sessions/{sid}/requests",
                                    json={"message": "Echo hi, then say what it said."})
            assert posted.status_code == 202, posted.text
            events = await _events(got, until="turn.completed")
        # The reader left: the stream's subscription is gone with it.
        while watching():  # noqa: ASYNC110  # no event exists to wait on
            await asyncio.sleep(0.02)
    assert events[0].event == "turn.requested"
    assert events[-1].data["turn_id"] == posted.json()["turn_id"]


async def test_a_request_streamed_again_is_answered_from_the_log(
        planner: Planner, fake: FakeProvider, tokens: dict[str, str], sid: str) -> None:
    _script_one_tool_turn(fake)
    body = {"request_id": "r-stream-twice", "message": "Echo hi, then say what it said."}
    async with _web(tokens) as web, asyncio.timeout(30):
        async with web.stream("POST", f"/sessions/{sid}/requests?stream=true",
                              json=body) as got:
            first = await _events(got)
        async with web.stream("POST", f"/sessions/{sid}/requests?stream=1",
                              json=body) as got:
            again = await _events(got)
    assert again[0].data["duplicate"] is True
    assert [(e.event, e.id) for e in again[1:]] == \
        [(e.event, e.id) for e in first[1:] if e.id is not None]
    assert len(fake.requests) == 2, "the same turn, not a second one"
    # The same request id for another request: refused, streamed or not, not answered
    # with the turn of the first (it streamed that turn as this request's).
    other = {**body, "message": "Something else."}
    async with _web(tokens) as web, asyncio.timeout(30):
        for query in ("?stream=1", ""):
            refused = await web.post(f"/sessions/{sid}/requests{query}", json=other)
            assert refused.status_code == 409, refused.text
            assert refused.json()["code"] == "request_id_reused"
            assert "was used in session" in refused.json()["error"]
    assert len(fake.requests) == 2


async def test_a_quiet_stream_sends_keep_alive_comments(
        bus: Bus, system: dict[str, Any], tokens: dict[str, str], sid: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("bus.feed.QUIET_S", 0.05)
    gw, short = await _gateway(bus)
    try:
        comments: list[str] = []
        async with _web(short) as web, asyncio.timeout(10):
            async with web.stream("GET", f"/sessions/{sid}/events") as got:
                assert got.status_code == 200
                async for line in got.aiter_lines():
                    if line.startswith(":"):
                        comments.append(line)
                    if len(comments) == 2:
                        break
    finally:
        await gw.stop()
    assert comments == [": keep-alive", ": keep-alive"]


@pytest.mark.parametrize(("path", "headers", "message"), [
    ("/sessions/s1/events?after=-1", {}, "after"),
    ("/sessions/s1/events?after=abc", {}, "after"),
    ("/sessions/s1/events?turn=a.b", {}, "turn id"),
    ("/sessions/s%2A/events", {}, "session"),
    ("/sessions/s1/events", {"Last-Event-ID": "12x"}, "Last-Event-ID"),
    ("/sessions/s1/events", {"Last-Event-ID": "9" * 40}, "Last-Event-ID"),
    # Past what NATS reads after: it would answer nothing, and the stream end with an
    # `unavailable` error naming the same id to reconnect with.
    ("/sessions/s1/events?after=18446744073709551615", {}, "after"),
    ("/sessions/s1/events", {"Last-Event-ID": str(2**64 - 1)}, "Last-Event-ID"),
])
async def test_a_bad_event_stream_request_is_refused_with_what_is_wrong(
        tokens: dict[str, str], path: str, headers: dict[str, str], message: str) -> None:
    async with _web(tokens) as web:
        got = await web.get(path, headers=headers)
    assert got.status_code == 400, got.text
    assert message in got.json()["error"], got.json()
    assert ".py" not in got.json()["error"], "no source file or line of the gateway"


async def test_a_bad_stream_flag_is_refused_and_nothing_is_submitted(
        bus: Bus, tokens: dict[str, str], sid: str, client: ToolbusClient) -> None:
    async with _web(tokens) as web:
        got = await web.post(f"/sessions/{sid}/requests?stream=yes",
                             json={"message": "hello"})
    assert got.status_code == 400, got.text
    assert "stream" in got.json()["error"]
    assert await client.log.read_session(sid) == []


async def test_event_streams_need_a_token(tokens: dict[str, str], sid: str) -> None:
    async with httpx.AsyncClient(base_url=tokens["url"], trust_env=False) as web:
        got = await web.get(f"/sessions/{sid}/events")
    assert got.status_code == 401


async def test_event_streams_over_the_limit_are_refused_until_one_closes(
        bus: Bus, system: dict[str, Any], sid: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gateway_module, "MAX_STREAMS", 1)
    gw, tokens = await _gateway(bus)
    try:
        async with _web(tokens) as web, asyncio.timeout(10):
            async with web.stream("GET", f"/sessions/{sid}/events") as first:
                assert first.status_code == 200
                over = await web.get(f"/sessions/{sid}/events")
                assert over.status_code == 503, over.text
                assert "event streams are open" in over.json()["error"]
            # The first closed: its place is free again.
            while True:
                async with web.stream("GET", f"/sessions/{sid}/events") as again:
                    if again.status_code == 200:
                        break
                await asyncio.sleep(0.02)
    finally:
        await gw.stop()


async def test_a_stopping_gateway_ends_its_streams_with_a_last_event_id_to_resume_from(
        bus: Bus, system: dict[str, Any], client: ToolbusClient, sid: str) -> None:
    await client.call(sid, [{"tool": "built-in:echo", "arguments": {"text": "hi"}}],
                      timeout=30)
    last = (await client.log.read_session(sid))[-1].seq
    gw, tokens = await _gateway(bus)
    async with _web(tokens) as web, asyncio.timeout(10):
        async with web.stream("GET", f"/sessions/{sid}/events") as got:
            lines = got.aiter_lines()
            await _events(lines, until="turn.completed")
            stopping = asyncio.create_task(gw.stop())
            events = await _events(lines)  # the answer ends: the stream was ended
            await stopping
    assert [e.event for e in events] == ["error"]
    assert events[0].data["code"] == "stopping"
    assert f"Last-Event-ID {last}" in events[0].data["error"]


async def test_a_stopping_gateway_drops_a_stream_whose_reader_stopped_reading(
        bus: Bus, system: dict[str, Any], client: ToolbusClient, sid: str,
        caplog: pytest.LogCaptureFixture) -> None:
    # A few MB of events, more than the socket buffers hold: the answer stalls.
    for i in range(12):
        await client.call(sid, [{"tool": "built-in:echo", "arguments": {
            "text": "x" * 100_000}}], request_id=f"r-big-{i}", timeout=30)
    gw, tokens = await _gateway(bus)
    port = int(tokens["url"].rsplit(":", 1)[1])
    # A reader that asks, then never reads (a laptop gone to sleep, a stuck proxy).
    reader = socket.socket()
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    reader.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(reader, ("127.0.0.1", port))
        reader.send(f"GET /sessions/{sid}/events HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    f"Authorization: Bearer {tokens['client']}\r\n\r\n".encode())
        async with asyncio.timeout(20):
            while not any(c.flow.write_paused  # noqa: ASYNC110  # no event to wait on
                          for c in gw.server.server_state.connections):
                await asyncio.sleep(0.02)
        await gw.stop()
    finally:
        reader.close()
    # The server's task ended by itself, not cancelled: no answer was left mid-way (which
    # uvicorn logs as "Exception in ASGI application", with a traceback, when cancelled).
    assert gw.task.done() and not gw.task.cancelled()
    assert gw.server.config.app.state.streams.open_now == 0
    assert "Exception in ASGI application" not in caplog.text


async def test_a_cancel_request_over_http_is_accepted_but_not_streamed(
        planner: Planner, client: ToolbusClient, tokens: dict[str, str], sid: str) -> None:
    async with _web(tokens) as web:
        streamed = await web.post(f"/sessions/{sid}/requests?stream=1",
                                  json={"cancel": "t-none"})
        assert streamed.status_code == 400 and "follow the turn" in streamed.json()["error"]
        sent = await web.post(f"/sessions/{sid}/requests",
                              json={"cancel": "t-none", "request_id": "c-http"})
        assert sent.status_code == 202, sent.text
    async with asyncio.timeout(15):
        while not (stored := await client.log.read_session(sid)):  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    (refused,) = [e.event for e in stored]
    assert isinstance(refused, RequestRejected) and refused.reason == "unknown_turn"
    assert refused.request_id == "c-http"


def test_an_event_s_data_carries_no_raw_terminal_control() -> None:
    # `curl -N` prints the stream: a C1 control (U+009B is CSI) or a bidirectional
    # override in a tool's result must reach the terminal as a JSON escape, same value.
    value = {"result": "a\u009b2Jb\u202ec\U000e0041\x7f é"}
    got = frame("call.succeeded", json.dumps(value, ensure_ascii=False).encode(), 7)
    head, data = got.decode().split("data: ", 1)
    assert head == "id: 7\nevent: call.succeeded\n" and data.endswith("\n\n")
    assert not any(c in data for c in "\u009b\u202e\U000e0041\x7f")
    assert json.loads(data) == value
    plain = json.dumps({"text": "é 😀"}, ensure_ascii=False).encode()
    assert frame("model.delta", plain) == b"event: model.delta\ndata: " + plain + b"\n\n"


async def test_many_streams_of_a_session_of_large_events_keep_the_gateways_connection(
        nats_url: str, system: dict[str, Any], client: ToolbusClient, sid: str) -> None:
    # Each stream read the log by pages of 256 events, whatever their size, all at once
    # over the gateway's one connection: 40 readers of 64 events of 126 KB asked NATS for
    # 320 MB at once, NATS cut the gateway off as a slow consumer (over its 64 MB pending),
    # and every stream of every client ended with an `error`.
    await large_session(client, sid, 64)
    web_bus = await connect(nats_url, name="tests-gateway")
    gw, tokens = await _gateway(web_bus)
    try:
        async with _web(tokens) as web, asyncio.timeout(60):

            async def read_all() -> list[str]:
                ids: list[str] = []
                async with web.stream("GET", f"/sessions/{sid}/events") as got:
                    assert got.status_code == 200, await got.aread()
                    async for line in got.aiter_lines():
                        assert not line.startswith("event: error"), line
                        if line.startswith("id:"):
                            ids.append(line)
                            if len(ids) == 64:
                                return ids
                return ids

            read = await asyncio.gather(*(read_all() for _ in range(40)))
        assert all(len(ids) == 64 for ids in read)
        assert web_bus.nc.stats["reconnects"] == 0, "the server cut the gateway off"
    finally:
        await gw.stop()
        await web_bus.close()
