"""Trace context on the bus: the disabled no-op path, W3C header hops between spans,
failure recording, the GenAI tool span, and the SDK installation in services/telemetry."""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import INVALID_SPAN, SpanKind, StatusCode, get_current_span

from bus import trace
from bus.headers import Header
from schemas.errors import ConfigError
from services.telemetry import install_for_tests, install_tracing, shutdown_tracing

REPO = Path(__file__).parent.parent.parent
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.fixture(autouse=True)
def _tracing_off_afterwards() -> Iterator[None]:
    yield
    shutdown_tracing()


@pytest.fixture
def spans() -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    install_for_tests(exporter)
    return exporter


def _only(exporter: InMemorySpanExporter, name: str) -> ReadableSpan:
    found = [s for s in exporter.get_finished_spans() if s.name == name]
    assert len(found) == 1, [s.name for s in exporter.get_finished_spans()]
    return found[0]


# --- disabled ----------------------------------------------------------------------------


def test_the_header_enum_names_a_field_the_w3c_propagator_reads() -> None:
    assert Header.TRACEPARENT in trace.TRACE_HEADERS


def test_disabled_span_is_a_shared_no_op_that_attaches_nothing() -> None:
    assert not trace.enabled()
    first = trace.span("a", parent={Header.TRACEPARENT: TRACEPARENT}, kind="consumer")
    assert first is trace.span("b", attributes={"k": 1})
    assert first is trace.tool_span("web_search", "call_1", parent=None)
    with first as s:
        s.set_attribute("k", "v")
        assert not s.is_recording()
        assert get_current_span() is INVALID_SPAN


def test_disabled_span_still_propagates_what_the_block_raises() -> None:
    with pytest.raises(KeyError), trace.span("a"):
        raise KeyError("x")


def test_turning_tracing_off_stops_recording(spans: InMemorySpanExporter) -> None:
    shutdown_tracing()
    with trace.span("after-off"):
        pass
    assert spans.get_finished_spans() == ()


def test_disabled_headers_pass_the_parents_trace_headers_through_unchanged() -> None:
    parent = {Header.TRACEPARENT: TRACEPARENT, "tracestate": "vendor=abc",
              Header.MSG_ID: "m1"}
    assert trace.headers_for_child(parent) == {Header.TRACEPARENT: TRACEPARENT,
                                               "tracestate": "vendor=abc"}
    assert trace.headers_for_child(None) == {}
    assert trace.headers_for_child({Header.MSG_ID: "m1"}) == {}
    # tracestate without a traceparent has nothing to qualify (W3C discards it)
    assert trace.headers_for_child({"tracestate": "vendor=abc"}) == {}


# --- enabled -----------------------------------------------------------------------------


def test_a_child_across_a_header_hop_continues_the_trace(spans: InMemorySpanExporter) -> None:
    with trace.span("A", kind="producer"):
        headers = trace.headers_for_child(None)

    def other_process() -> None:
        assert get_current_span() is INVALID_SPAN
        with trace.span("B", parent=headers, kind="consumer"):
            pass

    contextvars.Context().run(other_process)
    a, b = _only(spans, "A"), _only(spans, "B")
    assert set(headers) == {Header.TRACEPARENT}
    assert b.context.trace_id == a.context.trace_id
    assert b.parent is not None and b.parent.span_id == a.context.span_id
    assert b.parent.is_remote
    assert (a.kind, b.kind) == (SpanKind.PRODUCER, SpanKind.CONSUMER)


def test_a_parent_from_another_process_is_continued_with_its_tracestate(
    spans: InMemorySpanExporter,
) -> None:
    parent = {Header.TRACEPARENT: TRACEPARENT, "tracestate": "vendor=abc"}
    with trace.span("handle", parent=parent):
        forwarded = trace.headers_for_child(parent)
    handled = _only(spans, "handle")
    assert handled.context.trace_id == int(TRACE_ID, 16)
    assert handled.parent is not None and handled.parent.span_id == int(PARENT_ID, 16)
    assert forwarded["tracestate"] == "vendor=abc"
    assert forwarded[Header.TRACEPARENT] != TRACEPARENT  # it names the new span now
    assert TRACE_ID in forwarded[Header.TRACEPARENT]


def test_headers_outside_any_span_pass_the_parent_through_when_enabled(
    spans: InMemorySpanExporter,
) -> None:
    parent: dict[str, str] = {Header.TRACEPARENT: TRACEPARENT}
    assert trace.headers_for_child(parent) == parent
    assert trace.headers_for_child(None) == {}


def test_without_parent_a_span_nests_under_the_current_one(spans: InMemorySpanExporter) -> None:
    with trace.span("outer"), trace.span("inner") as inner:
        inner.set_attribute("step", 2)
    outer, inner_span = _only(spans, "outer"), _only(spans, "inner")
    assert inner_span.parent is not None and inner_span.parent.span_id == outer.context.span_id
    assert inner_span.attributes == {"step": 2}
    assert get_current_span() is INVALID_SPAN


def test_parent_headers_without_a_traceparent_start_a_new_trace(
    spans: InMemorySpanExporter,
) -> None:
    with trace.span("loop"), trace.span("message", parent={Header.MSG_ID: "m1"}):
        pass
    loop, message = _only(spans, "loop"), _only(spans, "message")
    assert message.parent is None
    assert message.context.trace_id != loop.context.trace_id


def test_a_raising_block_records_the_exception_and_re_raises(
    spans: InMemorySpanExporter,
) -> None:
    with pytest.raises(ConfigError), trace.span("boom", attributes={"k": "v"}):
        raise ConfigError("bad setting")
    boom = _only(spans, "boom")
    assert boom.status.status_code is StatusCode.ERROR
    assert boom.status.description == "ConfigError: bad setting"
    assert boom.attributes is not None
    assert boom.attributes["error.type"] == "schemas.errors.ConfigError"
    assert boom.attributes["k"] == "v"
    [event] = boom.events
    assert event.name == "exception"
    assert event.attributes is not None
    assert event.attributes["exception.type"] == "schemas.errors.ConfigError"
    assert get_current_span() is INVALID_SPAN


def test_a_builtin_exception_type_is_named_without_its_module(
    spans: InMemorySpanExporter,
) -> None:
    with pytest.raises(TimeoutError), trace.span("slow"):
        raise TimeoutError
    attributes = _only(spans, "slow").attributes
    assert attributes is not None and attributes["error.type"] == "TimeoutError"


def test_a_tool_span_follows_the_genai_conventions(spans: InMemorySpanExporter) -> None:
    with trace.tool_span("web_search", "call_1", parent={Header.TRACEPARENT: TRACEPARENT}):
        pass
    tool = _only(spans, "execute_tool web_search")
    assert tool.kind is SpanKind.INTERNAL
    assert tool.context.trace_id == int(TRACE_ID, 16)
    assert dict(tool.attributes or {}) == {
        trace.GEN_AI_OPERATION_NAME: "execute_tool",
        trace.GEN_AI_TOOL_NAME: "web_search",
        trace.GEN_AI_TOOL_CALL_ID: "call_1",
    }


def test_a_tool_span_without_a_call_id_leaves_the_attribute_out(
    spans: InMemorySpanExporter,
) -> None:
    with trace.tool_span("git", None, parent=None):
        pass
    attributes = _only(spans, "execute_tool git").attributes or {}
    assert trace.GEN_AI_TOOL_CALL_ID not in attributes


async def test_concurrent_tasks_keep_their_own_current_span(
    spans: InMemorySpanExporter,
) -> None:
    both_open = asyncio.Barrier(2)

    async def handle(name: str) -> None:
        with trace.span(name):
            await asyncio.wait_for(both_open.wait(), timeout=5)
            with trace.span(f"{name}.child"):
                pass

    await asyncio.gather(handle("one"), handle("two"))
    for name in ("one", "two"):
        child = _only(spans, f"{name}.child")
        assert child.parent is not None
        assert child.parent.span_id == _only(spans, name).context.span_id


# --- installing the SDK ------------------------------------------------------------------


@pytest.fixture
def no_otel_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for var in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(var)
    return monkeypatch


def _env_without_otel(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return env | extra


def test_install_tracing_stays_off_when_nothing_asks_for_traces(
    no_otel_env: pytest.MonkeyPatch,
) -> None:
    assert install_tracing("test") is False
    assert not trace.enabled()
    no_otel_env.setenv("OTEL_TRACES_EXPORTER", "none")
    no_otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    assert install_tracing("test") is False
    assert not trace.enabled()


@pytest.mark.parametrize(("var", "value", "hint"), [
    ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc", "4318"),
    ("OTEL_TRACES_EXPORTER", "zipkin", "console"),
])
def test_install_tracing_refuses_settings_it_cannot_honour(
    no_otel_env: pytest.MonkeyPatch, var: str, value: str, hint: str,
) -> None:
    no_otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    no_otel_env.setenv(var, value)
    with pytest.raises(ConfigError) as info:
        install_tracing("test")
    assert f"{var}={value}" in str(info.value) and hint in str(info.value)
    assert not trace.enabled()


def _run_python(script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60, check=True)


def test_a_process_with_tracing_off_never_imports_the_sdk() -> None:
    done = _run_python("""
        import sys
        from services.telemetry import install_tracing
        from bus import trace
        assert install_tracing("probe") is False
        with trace.span("x"):
            pass
        print(sorted(m for m in sys.modules if m.startswith("opentelemetry.sdk")))
        """, _env_without_otel())
    assert done.stdout.strip() == "[]"


def test_console_export_writes_one_json_span_per_line_continuing_the_parent() -> None:
    done = _run_python(f"""
        from services.telemetry import install_tracing, shutdown_tracing
        from bus import trace
        assert install_tracing("probe")
        with trace.span("hop", parent={{"traceparent": "{TRACEPARENT}"}}, kind="consumer"):
            with trace.tool_span("echo", "call_9", parent=None):
                pass
        shutdown_tracing()
        """, _env_without_otel(OTEL_TRACES_EXPORTER="console"))
    lines = done.stdout.splitlines()
    assert len(lines) == 2
    tool, hop = (json.loads(line) for line in lines)  # children end first
    assert hop["name"] == "hop" and tool["name"] == "execute_tool echo"
    assert hop["context"]["trace_id"] == f"0x{TRACE_ID}"
    assert hop["parent_id"] == f"0x{PARENT_ID}"
    assert tool["parent_id"] == hop["context"]["span_id"]
    assert hop["resource"]["attributes"]["service.name"] == "probe"
