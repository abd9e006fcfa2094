"""One trace per call, across the session, approval and executor actors, in one process
and across processes (W3C `traceparent` in NATS headers)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bus import trace
from bus.client import ToolbusClient
from schemas.events import TurnCompleted
from services.telemetry import install_for_tests, shutdown_tracing
from tests.conftest import TESTS, Proc


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    install_for_tests(exporter)
    try:
        yield exporter
    finally:
        shutdown_tracing()


def _trace_id(span: object) -> int:
    return span.context.trace_id  # type: ignore[attr-defined]  # an SDK ReadableSpan


async def test_one_call_is_one_trace_across_the_actors(
        client: ToolbusClient, sid: str, spans: InMemorySpanExporter) -> None:
    with trace.span("agent turn") as root:
        end = await client.call(sid, [{"tool": "built-in:echo", "arguments": {"x": 1}}])
    assert isinstance(end, TurnCompleted) and end.ok
    tid = root.get_span_context().trace_id
    def tool_span_ended() -> bool:
        return any(s.name == "execute_tool built-in:echo" for s in spans.get_finished_spans())

    # The exporter signals nothing to await; its span ends as the executor's append acks.
    async with asyncio.timeout(5):
        while not tool_span_ended():  # noqa: ASYNC110  # no event exists to wait on
            await asyncio.sleep(0.01)
    mine = [s for s in spans.get_finished_spans() if _trace_id(s) == tid]
    names = {s.name for s in mine}
    assert {"approval approval", "execute_tool built-in:echo",
            "executor exec_default_built-in", "decide", "append"} <= names, names
    # The session actor's consumer of the session's partition.
    assert any(n.startswith("session session-requests-p") for n in names), names
    tool = next(s for s in mine if s.name == "execute_tool built-in:echo")
    assert tool.attributes["gen_ai.tool.name"] == "built-in:echo"
    assert tool.attributes["gen_ai.tool.call.id"] == end.outcomes[0].call_id
    assert tool.attributes["gen_ai.operation.name"] == "execute_tool"


async def test_a_call_crossing_processes_stays_in_its_trace(
        client: ToolbusClient, nats_url: str, sid: str, spans: InMemorySpanExporter) -> None:
    executor = Proc("actor", "executor", "--nats", nats_url, "--tools",
                    str(TESTS / "proc_toolkit.py"), "--instance", "traced",
                    ready="executor actor", env={"OTEL_TRACES_EXPORTER": "console"})
    try:
        await executor.wait_ready()
        with trace.span("agent turn") as root:
            end = await client.call(sid, [{"tool": "proc:whoami", "arguments": {}}],
                                    timeout=20)
        assert isinstance(end, TurnCompleted) and end.ok
        assert end.outcomes[0].result["pid"] == executor.pid
    finally:
        os.kill(executor.pid, signal.SIGINT)
        out, _ = await asyncio.to_thread(executor.proc.communicate, timeout=20)
    remote = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    tool = [s for s in remote if s["name"] == "execute_tool proc:whoami"]
    assert tool, out[-2000:]
    want = f"0x{root.get_span_context().trace_id:032x}"
    assert tool[0]["context"]["trace_id"] == want
    # The executor process's consumer span continues the same trace.
    assert any(s["context"]["trace_id"] == want and s["name"].startswith("executor ")
               for s in remote)
