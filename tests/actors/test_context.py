"""What the model reads (issue 13): large results as previews, `recall`, `_transform`,
`context-status`, and tool events injected into a session, against a real local HTTP
server speaking the OpenAI Chat Completions API with scripted replies."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from actors.compressor import Compression, Compressor
from actors.context_tools import ContextExecutor
from actors.llm.types import ModelSettings
from actors.planner import Planner
from actors.session import decide_tool_event
from bus.artifacts import ArtifactStore
from bus.client import ToolbusClient
from bus.connection import Bus
from bus.eventlog import EventLog
from bus.subjects import request_subject
from schemas.events import (
    CallFailed,
    CallSucceeded,
    ResultCompressed,
    ToolEventInjected,
    TurnCancelled,
    TurnCompleted,
    TurnRequested,
)
from schemas.ids import client_request_id, tool_event_id
from schemas.requests import ToolEventInput
from schemas.state import SessionState, fold
from tests.actors.test_planner import ScriptedChat, reply
from tests.conftest import EventWatch, of_type, run_toolbus
from tests.github import COMMITS

TOOLS = ("built-in:", "testing:list_commits", "testing:sleep", "testing:append_line",
         "testing:blob")


@pytest.fixture
async def planner(bus: Bus, system: dict[str, Any], model: ScriptedChat
                  ) -> AsyncIterator[Planner]:
    settings = ModelSettings(provider="openai", model="scripted", api_key="sk-test-key",
                             base_url=f"http://127.0.0.1:{model.port}/v1", max_retries=1)
    compression = Compression()
    p = Planner(bus, system["catalog"], settings, instructions="Be brief.",
                tools=lambda spec: spec.name.startswith(TOOLS), compression=compression)
    compressor = Compressor(bus, compression)
    context = ContextExecutor(bus, compression, instance="context-test", ack_wait_s=5.0)
    await compressor.start()
    await context.start()
    await system["catalog"].wait_for_instance("context-test", timeout=5)
    await p.start()
    yield p
    await p.stop()
    await context.stop()
    await compressor.stop()


def tool_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in body["messages"] if m["role"] == "tool"]


async def test_a_large_result_reaches_the_model_as_a_preview_and_recall_reads_the_rest(
        bus: Bus, client: ToolbusClient, planner: Planner, model: ScriptedChat,
        sid: str, nats_url: str) -> None:
    whole = msgspec.json.encode(COMMITS).decode()
    assert 30_000 <= len(whole) <= 32_000
    model.script = [
        (200, reply(calls=[("c1", "testing__list_commits", {})])),
        (200, reply(calls=[("c2", "built-in__recall", {"key": "_tool_result_1"})])),
        (200, reply(calls=[("c3", "built-in__recall",
                            {"key": "_tool_result_1", "path": "[29].sha"})])),
        (200, reply("The last commit is known.")),
    ]
    end = await client.ask(sid, "What changed lately?", timeout=30)
    assert isinstance(end, TurnCompleted) and end.text == "The last commit is known.", end

    # The model read a preview within the budget, in the seed's shape, never the whole.
    (shown,) = tool_messages(model.received[1])
    preview = shown["content"]
    assert len(preview) <= 800
    assert preview.startswith("[STORED: _tool_result_1 | testing:list_commits]")
    assert "Type: Array(30)" in preview and "commit.message" in preview
    assert "27 more" in preview and 'recall("_tool_result_1")' in preview
    assert COMMITS[29]["sha"] not in json.dumps(model.received[1])
    # recall pages within the budget; the first page starts at item 0.
    page = json.loads(tool_messages(model.received[2])[-1]["content"])
    assert page["key"] == "_tool_result_1" and page["offset"] == 0
    assert page["total"] == 30 and page["items"] == COMMITS[:page["count"]]
    assert len(tool_messages(model.received[2])[-1]["content"]) <= 4000  # recall_budget
    last = json.loads(tool_messages(model.received[3])[-1]["content"])
    assert COMMITS[29]["sha"] in json.dumps(last)

    events = [s.event for s in await EventLog(bus).read_session(sid)]
    (compressed,) = [e for e in events if isinstance(e, ResultCompressed)]
    assert compressed.key == "_tool_result_1" and compressed.chars == len(whole)
    assert compressed.view == preview
    # The whole result stays in its call's event; the compressor added a view only.
    (listed,) = [e for e in events if isinstance(e, CallSucceeded)
                 and e.call_id == compressed.call_id]
    assert listed.result == COMMITS

    # Replay shows the compression and the recalls, and asks no model (the client
    # fixture checks that the replayed state, views and keys included, equals the live).
    asked = len(model.received)
    replay = await asyncio.to_thread(run_toolbus, "replay", sid, "--nats", nats_url)
    assert replay.returncode == 0, replay.stderr
    out = replay.stdout
    assert "result.compressed" in out and "stored as _tool_result_1" in out
    assert out.count("built-in:recall") >= 2
    assert len(model.received) == asked


async def test_recall_pages_reassemble_the_whole_result(
        bus: Bus, client: ToolbusClient, planner: Planner, model: ScriptedChat,
        sid: str) -> None:
    model.script = [(200, reply(calls=[("c1", "testing__list_commits", {})])),
                    (200, reply("Listed."))]
    end = await client.ask(sid, "List commits.", timeout=30)
    assert isinstance(end, TurnCompleted)
    items: list[Any] = []
    offset: int | None = 0
    turn = 1
    while offset is not None and turn < 40:
        turn += 1
        model.script = [(200, reply(calls=[(f"r{turn}", "built-in__recall",
                                            {"key": "_tool_result_1", "offset": offset})])),
                        (200, reply("Read a page."))]
        end = await client.ask(sid, "Read on.", timeout=30)
        assert isinstance(end, TurnCompleted)
        page = json.loads(tool_messages(model.received[-1])[-1]["content"])
        items += page["items"]
        offset = page["next_offset"]
    assert items == COMMITS


async def test_transform_gives_the_model_exactly_the_selected_fields(
        bus: Bus, client: ToolbusClient, planner: Planner, model: ScriptedChat,
        sid: str) -> None:
    selected = "[:3].{sha: sha, msg: commit.message}"
    model.script = [
        (200, reply(calls=[("c1", "testing__list_commits", {"_transform": selected}),
                           ("c2", "testing__list_commits", {"_transform": "[0.sha"})])),
        (200, reply("Three commits.")),
    ]
    end = await client.ask(sid, "The last three commits?", timeout=30)
    assert isinstance(end, TurnCompleted), end
    good, bad = tool_messages(model.received[1])
    assert json.loads(good["content"]) == [
        {"sha": c["sha"], "msg": c["commit"]["message"]} for c in COMMITS[:3]]
    # A bad expression: the standard preview, and the error.
    assert bad["content"].startswith("[STORED: _tool_result_1 | testing:list_commits]")
    assert "_transform failed:" in bad["content"] and "[0.sha" in bad["content"]
    assert 'JMESPath expression "[0.sha" is not valid' in bad["content"]  # not \" escaped
    events = [s.event for s in await EventLog(bus).read_session(sid)]
    views = {e.call_id: e for e in events if isinstance(e, ResultCompressed)}
    assert len(views) == 2
    assert sum(1 for v in views.values() if v.transform_error) == 1
    # The tool ran with its own arguments: `_transform` is not one of them.
    assert all("_transform" not in json.dumps(e.result) for e in events
               if isinstance(e, CallSucceeded))


async def test_a_transform_that_is_empty_is_none_and_one_that_is_not_an_expression_is_refused(
        client: ToolbusClient, planner: Planner, model: ScriptedChat, sid: str) -> None:
    model.script = [
        (200, reply(calls=[("c1", "testing__list_commits", {"_transform": ""}),
                           ("c2", "testing__list_commits", {"_transform": 5}),
                           ("c3", "testing__list_commits", {"_transform": "x" * 1_001})])),
        (200, reply("Done.")),
    ]
    end = await client.ask(sid, "Commits?", timeout=30)
    assert isinstance(end, TurnCompleted), end
    empty, number, long = (o for o in end.outcomes)
    assert empty.status == "succeeded"  # an empty `_transform` is none
    for refused, says in ((number, "must be a JMESPath expression (a string), got int"),
                          (long, "_transform is 1001 characters; at most 1000")):
        assert refused.status == "rejected" and refused.error is not None
        assert refused.error.error_type == "invalid_arguments"
        assert says in refused.error.message
    told = [m["content"] for m in tool_messages(model.received[1])]
    assert "got int" in told[1] and "at most 1000" in told[2]


async def test_context_status_tells_the_turns_budget_and_the_stored_keys(
        client: ToolbusClient, planner: Planner, model: ScriptedChat, sid: str) -> None:
    model.script = [
        (200, reply(calls=[("c1", "testing__list_commits", {})])),
        (200, reply(calls=[("c2", "built-in__context-status", {})])),
        (200, reply("Plenty left.")),
    ]
    end = await client.ask(sid, "How are we doing?", timeout=30)
    assert isinstance(end, TurnCompleted), end
    status = json.loads(tool_messages(model.received[2])[-1]["content"])
    assert status["iterations"] == {"used": 2, "limit": 25, "left": 23}
    assert status["tools_used"] == ["testing:list_commits"]
    assert [k["key"] for k in status["stored_keys"]] == ["_tool_result_1"]
    assert 0 < status["context"]["chars"] < 2000
    assert status["context"]["estimated_tokens"] == -(-status["context"]["chars"] // 4)


async def _inject(bus: Bus, sid: str, body: dict[str, Any]) -> str:
    """A tool event as a program sends it over NATS; its event id."""
    event_id = tool_event_id(sid, body["idempotency_key"])
    await bus.js.publish(request_subject(sid), msgspec.json.encode(body),
                         headers={"Nats-Msg-Id": client_request_id(sid, event_id)})
    return event_id


async def test_an_event_injected_mid_turn_is_seen_from_the_next_turn_on(
        bus: Bus, client: ToolbusClient, planner: Planner, model: ScriptedChat,
        sid: str, nats_url: str) -> None:
    model.script = [(200, reply("First answer."), 1.0), (200, reply("Second answer."))]
    async with EventWatch(bus, sid) as watch:
        first = asyncio.create_task(client.ask(sid, "Hello.", timeout=30))
        await model.asked.wait()  # the first turn's model call is under way
        event_id = await _inject(bus, sid, {
            "tool_id": "injected:bank_statement", "arguments": {"month": "2026-10"},
            "result": {"balance": 42, "note": "ok\u0007\u001b[31m\tdone\n"},
            "idempotency_key": "statement-2026-10"})
        await watch.until(lambda evs: bool(of_type(evs, "tool_event.injected")))
        end = await first
        assert isinstance(end, TurnCompleted) and end.text == "First answer."
        assert "bank_statement" not in json.dumps(model.received[0])
        second = await client.ask(sid, "And now?", timeout=30)
        assert isinstance(second, TurnCompleted) and second.text == "Second answer."
    messages = model.received[1]["messages"]
    call = next(m for m in messages if m.get("tool_calls"))
    assert call["tool_calls"][0]["id"] == event_id
    assert call["tool_calls"][0]["function"]["name"] == "injected__bank_statement"
    (result,) = tool_messages(model.received[1])
    # Control characters stripped; tab and newline kept.
    assert json.loads(result["content"]) == {"balance": 42, "note": "ok[31m\tdone\n"}
    # It sits between the first turn and the second message, as stored.
    roles = [m["role"] for m in messages]
    assert roles == ["system", "user", "assistant", "assistant", "tool", "user"]
    replay = await asyncio.to_thread(run_toolbus, "replay", sid, "--nats", nats_url)
    assert f"tool event {event_id} injected:bank_statement injected" in replay.stdout


async def test_the_same_idempotency_key_twice_stores_one_event(
        bus: Bus, client: ToolbusClient, planner: Planner, sid: str) -> None:
    body = {"tool_id": "crm:note", "result": "called back", "idempotency_key": "note-1"}
    first = await _inject(bus, sid, body)
    again = await _inject(bus, sid, {**body, "result": "something else"})
    assert first == again
    await client.call(sid, [{"tool": "built-in:echo", "arguments": {}}], timeout=10)
    # Past the requests stream's duplicate window too: a new message, the same key.
    await bus.js.publish(request_subject(sid),
                         msgspec.json.encode({**body, "result": "a third"}))
    await client.call(sid, [{"tool": "built-in:echo", "arguments": {}}], timeout=10)
    events = [s.event for s in await EventLog(bus).read_session(sid)]
    (injected,) = [e for e in events if isinstance(e, ToolEventInjected)]
    assert injected.event_id == first and injected.result == "called back"


async def test_trigger_processing_cancels_the_turn_in_flight_and_starts_one(
        bus: Bus, client: ToolbusClient, planner: Planner, model: ScriptedChat,
        sid: str, tmp_path: Path) -> None:
    out = tmp_path / "never.txt"
    model.script = [
        # The sleep runs; the append, with side effects, waits for it: not dispatched yet.
        (200, reply(calls=[("c1", "testing__sleep", {"seconds": 1.0}),
                           ("c2", "testing__append_line",
                            {"path": str(out), "line": "should not run"})])),
        (200, reply("I see the new statement.")),
    ]
    async with EventWatch(bus, sid) as watch:
        first = asyncio.create_task(client.ask(sid, "Sleep, then write.", timeout=30))
        await watch.until(lambda evs: bool(of_type(evs, "call.started")))
        event_id = await _inject(bus, sid, {
            "tool_id": "injected:bank_statement", "result": {"balance": 7},
            "idempotency_key": "urgent-1", "trigger_processing": True})
        end = await first
        assert isinstance(end, TurnCancelled) and end.reason == "superseded"
        assert end.by == event_id
        events = await watch.until(lambda evs: any(
            isinstance(e, TurnCompleted) for e in evs) and any(
            isinstance(e, CallSucceeded) and e.call_id == end.turn_id + "-0" for e in evs))
    # The running call finished and is recorded; the waiting one never ran.
    cancelled = [e for e in events if isinstance(e, CallFailed)]
    assert [(e.call_id, e.error_type) for e in cancelled] == [(f"{end.turn_id}-1",
                                                               "cancelled")]
    assert not out.exists()
    # The new turn saw the event, and was asked once: the cancelled turn asked no more.
    (done,) = [e for e in events if isinstance(e, TurnCompleted)]
    assert done.text == "I see the new statement." and done.turn_id != end.turn_id
    assert len(model.received) == 2
    assert json.loads(tool_messages(model.received[1])[-1]["content"]) == {"balance": 7}
    assert model.received[1]["messages"][-1]["role"] == "tool"


async def test_a_large_injected_result_is_stored_by_reference_and_recalled_by_its_id(
        bus: Bus, client: ToolbusClient, planner: Planner, model: ScriptedChat,
        sid: str) -> None:
    rows = [{"day": i, "memo": "x" * 90} for i in range(900)]  # about 100 kB: by reference
    event_id = await _inject(bus, sid, {"tool_id": "injected:ledger", "result": rows,
                                        "idempotency_key": "ledger-1"})
    model.script = [(200, reply(calls=[("c1", "built-in__recall", {"key": event_id})])),
                    (200, reply("Seen."))]
    end = await client.ask(sid, "What is in the ledger?", timeout=30)
    assert isinstance(end, TurnCompleted), end
    events = [s.event for s in await EventLog(bus).read_session(sid)]
    (injected,) = [e for e in events if isinstance(e, ToolEventInjected)]
    assert injected.event_id == event_id and injected.result is None
    assert injected.result_ref is not None and injected.result_ref.size > 64 * 1024
    assert msgspec.json.decode(await ArtifactStore(bus).read(injected.result_ref)) == rows
    (shown,) = tool_messages(model.received[0])
    assert shown["content"].startswith(f"[STORED: {event_id} | injected:ledger]")
    assert len(shown["content"]) < 1000
    # The structured preview a tool's large result gets, not a prefix of its bytes.
    assert "Type: Array(900)" in shown["content"] and "Schema: day, memo" in shown["content"]
    assert f'recall("{event_id}")' in shown["content"]
    page = json.loads(tool_messages(model.received[1])[-1]["content"])
    assert page["total"] == 900 and page["items"] == rows[:page["count"]]

    # The same key again, another body, past the duplicate window (no message id):
    # nothing is stored, and the first event's data is untouched.
    other = [{"day": i, "memo": "y" * 90} for i in range(900)]
    await bus.js.publish(request_subject(sid), msgspec.json.encode(
        {"tool_id": "injected:ledger", "result": other, "idempotency_key": "ledger-1"}))
    await client.call(sid, [{"tool": "built-in:echo", "arguments": {}}], timeout=10)
    after = [s.event for s in await EventLog(bus).read_session(sid)]
    assert [e for e in after if isinstance(e, ToolEventInjected)] == [injected]
    assert msgspec.json.decode(await ArtifactStore(bus).read(injected.result_ref)) == rows


async def test_an_injected_result_over_the_budget_is_previewed(
        bus: Bus, client: ToolbusClient, planner: Planner, model: ScriptedChat,
        sid: str) -> None:
    event_id = await _inject(bus, sid, {"tool_id": "github:list_commits",
                                        "result": COMMITS, "idempotency_key": "c-1"})
    model.script = [(200, reply("Thirty commits."))]
    end = await client.ask(sid, "What was imported?", timeout=30)
    assert isinstance(end, TurnCompleted), end
    (shown,) = tool_messages(model.received[0])
    assert len(shown["content"]) <= 800
    assert shown["content"].startswith(f"[STORED: {event_id} | github:list_commits]")
    assert "Type: Array(30)" in shown["content"]


async def test_a_long_conversation_reaches_the_model_cut_to_the_history_budget(
        bus: Bus, system: dict[str, Any], client: ToolbusClient, model: ScriptedChat,
        sid: str) -> None:
    """Earlier turns that overflow `max_history_chars` are left out oldest first, and the
    model is told so; `context-status` counts what the model reads."""
    settings = ModelSettings(provider="openai", model="scripted", api_key="sk-test-key",
                             base_url=f"http://127.0.0.1:{model.port}/v1", max_retries=1)
    compression = Compression(history_chars=1000)
    p = Planner(bus, system["catalog"], settings, instructions="Be brief.",
                tools=lambda spec: spec.name.startswith(TOOLS), compression=compression)
    context = ContextExecutor(bus, compression, instance="context-history", ack_wait_s=5.0)
    await context.start()
    await system["catalog"].wait_for_instance("context-history", timeout=5)
    await p.start()
    try:
        for i in range(6):  # exchanges of about 600 characters: one fits the budget
            model.script = [(200, reply(f"answer {i} " + "." * 290))]
            end = await client.ask(sid, f"question {i} " + "." * 290, timeout=30)
            assert isinstance(end, TurnCompleted), end
        model.script = [(200, reply(calls=[("c1", "built-in__context-status", {})])),
                        (200, reply("Done."))]
        end = await client.ask(sid, "question 6", timeout=30)
        assert isinstance(end, TurnCompleted), end
    finally:
        await p.stop()
        await context.stop()
    sent = [(m["role"], m["content"][:10]) for m in model.received[-2]["messages"]
            if m["role"] != "system"]
    assert sent == [("user", "[5 earlier"), ("user", "question 5"), ("assistant", "answer 5 ."),
                    ("user", "question 6")]
    assert "left out to stay within the context budget" in \
        model.received[-2]["messages"][1]["content"]
    # The second turn still read the first whole: nothing is cut before the budget is.
    assert [m["content"][:10] for m in model.received[1]["messages"][1:]] == \
        ["question 0", "answer 0 .", "question 1"]
    status = json.loads(tool_messages(model.received[-1])[-1]["content"])
    assert 600 < status["context"]["chars"] < 1000 + 200


async def test_a_stored_result_too_large_to_read_reaches_the_model_as_its_size(
        monkeypatch: pytest.MonkeyPatch, bus: Bus, client: ToolbusClient, planner: Planner,
        model: ScriptedChat, sid: str) -> None:
    """A tool (or an MCP server) may store up to 256 MiB: decoded whole in the planner's
    process to preview or recall, a result takes several times that in memory and holds
    its event loop. Over the bound (lowered here), the model reads its size and first
    characters, and `recall` says it is too large."""
    import actors.compressor

    monkeypatch.setattr(actors.compressor, "MAX_READ_RESULT_BYTES", 100_000)
    rows = [{"day": i, "memo": "x" * 100} for i in range(900)]  # about 110 KB
    event_id = await _inject(bus, sid, {"tool_id": "injected:ledger", "result": rows,
                                        "idempotency_key": "big-1"})
    model.script = [
        (200, reply(calls=[("c1", "testing__blob", {"size": 400_000, "fill": "z"})])),
        (200, reply(calls=[("c2", "built-in__recall", {"key": event_id})])),
        (200, reply("Too large to read.")),
    ]
    end = await client.ask(sid, "Read the blob and the ledger.", timeout=30)
    assert isinstance(end, TurnCompleted), end
    shown = tool_messages(model.received[1])[-1]
    assert shown["content"].startswith("[NOT READ | testing:blob] the result is 400,002 "
                                       "bytes of JSON, over the 100,000 bytes toolbus reads whole")
    assert shown["content"].endswith("zzzz") and len(shown["content"]) <= 800
    recalled = tool_messages(model.received[2])[-1]["content"]
    assert "too_large" in recalled and f"{event_id}: the result is" in recalled
    events = [s.event for s in await EventLog(bus).read_session(sid)]
    (compressed,) = [e for e in events if isinstance(e, ResultCompressed)]
    assert compressed.key is None and compressed.chars == 400_002


def test_a_tool_event_decided_again_never_cancels_the_turn_it_started() -> None:
    # Found by the planner fuzzer. The decision's first event (`tool_event.injected`)
    # failed its concurrency check (the approval actor wrote meanwhile) while the events
    # pipelined behind it were stored, its `turn.requested` among them; decided again,
    # the event found that turn open and cancelled it, `superseded` by itself: the
    # model never read the event it was triggered by.
    sid = "s-self"
    event = ToolEventInput(tool_id="crm:note", arguments={}, result={"a": 1},
                           idempotency_key="k1", trigger_processing=True)
    first = decide_tool_event(SessionState(session_id=sid), event, now=1.0, request_seq=7,
                              accept_messages=True)
    (started,) = [i.event for i in first if isinstance(i.event, TurnRequested)]
    # Stored: everything but the `tool_event.injected` the check refused.
    state = fold(sid, ((n, i.event) for n, i in enumerate(first, start=1)
                       if not isinstance(i.event, ToolEventInjected)))
    assert started.turn_id in state.open_turns
    again = decide_tool_event(state, event, now=2.0, request_seq=7, accept_messages=True)
    assert not [i for i in again if isinstance(i.event, TurnCancelled)], again
    assert [type(i.event) for i in again] == [ToolEventInjected, TurnRequested]
