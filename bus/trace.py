"""Trace context on the bus: W3C `traceparent`/`tracestate` in NATS headers, and spans.

This module uses the OpenTelemetry *API* only. Whether spans are recorded and where they go
is decided once per process by `services/telemetry.py`, which installs the SDK and hands a
tracer to `set_tracer`. Until then `enabled()` is False and every function here returns at
its first line: no span objects, no context attach, no header parsing beyond copying the
incoming trace headers forward, so a trace survives a process that does not export.

We keep our own tracer instead of the OTel global provider because the global can be set
only once per process, and tests must be able to install and reset tracing many times.

Span names and attributes follow the OpenTelemetry GenAI semantic conventions (status
"Development"): `execute_tool {gen_ai.tool.name}` with kind INTERNAL for a tool call.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping
from contextlib import AbstractContextManager
from contextvars import Token
from types import TracebackType
from typing import Final, Literal

from opentelemetry import context as otel_context
from opentelemetry.trace import (
    INVALID_SPAN,
    Span,
    SpanKind,
    Status,
    StatusCode,
    Tracer,
    set_span_in_context,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from bus.headers import Header

__all__ = [
    "ERROR_TYPE",
    "GEN_AI_OPERATION_NAME",
    "GEN_AI_PROVIDER_NAME",
    "GEN_AI_REQUEST_MODEL",
    "GEN_AI_SYSTEM",
    "GEN_AI_TOOL_CALL_ID",
    "GEN_AI_TOOL_NAME",
    "OPERATION_CHAT",
    "OPERATION_EXECUTE_TOOL",
    "OPERATION_INVOKE_AGENT",
    "TRACE_HEADERS",
    "AttributeValue",
    "Kind",
    "Span",
    "enabled",
    "headers_for_child",
    "set_tracer",
    "span",
    "tool_span",
]

GEN_AI_OPERATION_NAME: Final = "gen_ai.operation.name"
GEN_AI_TOOL_NAME: Final = "gen_ai.tool.name"
GEN_AI_TOOL_CALL_ID: Final = "gen_ai.tool.call.id"
GEN_AI_REQUEST_MODEL: Final = "gen_ai.request.model"
GEN_AI_PROVIDER_NAME: Final = "gen_ai.provider.name"
# Replaced by `gen_ai.provider.name` in the conventions after v1.36; kept for backends
# that still read the old name.
GEN_AI_SYSTEM: Final = "gen_ai.system"
ERROR_TYPE: Final = "error.type"

OPERATION_EXECUTE_TOOL: Final = "execute_tool"
OPERATION_CHAT: Final = "chat"
OPERATION_INVOKE_AGENT: Final = "invoke_agent"

AttributeValue = str | int | float | bool
Kind = Literal["internal", "consumer", "producer", "client", "server"]

_KINDS: Final[Mapping[str, SpanKind]] = {
    "internal": SpanKind.INTERNAL,
    "consumer": SpanKind.CONSUMER,
    "producer": SpanKind.PRODUCER,
    "client": SpanKind.CLIENT,
    "server": SpanKind.SERVER,
}

# Only W3C trace context travels, whatever OTEL_PROPAGATORS says: the headers are part of
# the bus protocol, and every toolbus process must read what another one wrote.
_W3C: Final = TraceContextTextMapPropagator()
# The propagator owns the field names (`traceparent`, `tracestate`); `Header.TRACEPARENT`
# is one of them, and a test holds the two together.
TRACE_HEADERS: Final[frozenset[str]] = frozenset(_W3C.fields)
# Plain strings, read once: an enum member lookup costs more than the rest of the
# disabled path.
_TRACEPARENT: Final = str(Header.TRACEPARENT)
_TRACEPARENT_FORM = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
_QUALIFIERS: Final = tuple(sorted(TRACE_HEADERS - {_TRACEPARENT}))

# A shared, reusable no-op: `nullcontext` keeps no state, and INVALID_SPAN's methods do
# nothing, so the disabled path allocates nothing.
_DISABLED: Final[AbstractContextManager[Span]] = contextlib.nullcontext(INVALID_SPAN)

_tracer: Tracer | None = None


def set_tracer(tracer: Tracer | None) -> None:
    """Turn tracing on with `tracer`, or off with None. Only `services/telemetry.py` calls
    this, after installing (or before shutting down) the SDK."""
    global _tracer
    _tracer = tracer


def enabled() -> bool:
    return _tracer is not None


def headers_for_child(parent: Mapping[str, str] | None) -> dict[str, str]:
    """The W3C trace headers for a message published now.

    Enabled: the current span's context (so call it inside the span that causes the
    publish). Disabled, or enabled with no current span: `parent`'s trace headers copied
    unchanged, or {} when it has no `traceparent` (a lone `tracestate` means nothing)."""
    if _tracer is not None:
        carrier: dict[str, str] = {}
        _W3C.inject(carrier)
        if carrier:
            return carrier
    if parent is None or (traceparent := parent.get(_TRACEPARENT)) is None:
        return {}
    # Passed on verbatim only when well formed: a client's header is copied onto every
    # event its request causes, so a malformed or oversized one stops here.
    if len(traceparent) != 55 or _TRACEPARENT_FORM.fullmatch(traceparent) is None:
        return {}
    headers = {_TRACEPARENT: traceparent}
    for name in _QUALIFIERS:
        if (value := parent.get(name)) is not None and len(value) <= 512:
            headers[name] = value
    return headers


def span(
    name: str,
    *,
    parent: Mapping[str, str] | None = None,
    attributes: Mapping[str, AttributeValue] | None = None,
    kind: Kind = "internal",
) -> AbstractContextManager[Span]:
    """A span named `name`, current for the `with` block, yielding it for `set_attribute`.

    With `parent` (a message's headers) the span continues the trace in its `traceparent`,
    and starts a new trace when there is none: a consumer must not nest a message under
    whatever happened to be current in its loop. Without `parent` it is a child of the
    current span. If the block raises, the exception is recorded, the status set to ERROR
    with `error.type`, and the exception propagates.

    Disabled, this returns one shared no-op whose span ignores every call. Enter and leave
    it in the same task: the OTel context it attaches is a contextvar."""
    tracer = _tracer
    if tracer is None:
        return _DISABLED
    context = _W3C.extract(parent) if parent is not None else None
    return _OpenSpan(tracer, name, context, _KINDS[kind], attributes)


def tool_span(
    tool_name: str, call_id: str | None, *, parent: Mapping[str, str] | None
) -> AbstractContextManager[Span]:
    """The GenAI `execute_tool {tool_name}` span (kind INTERNAL) for one tool call."""
    if _tracer is None:
        return _DISABLED
    attributes: dict[str, AttributeValue] = {
        GEN_AI_OPERATION_NAME: OPERATION_EXECUTE_TOOL,
        GEN_AI_TOOL_NAME: tool_name,
    }
    if call_id is not None:
        attributes[GEN_AI_TOOL_CALL_ID] = call_id
    return span(f"{OPERATION_EXECUTE_TOOL} {tool_name}", parent=parent, attributes=attributes)


class _OpenSpan(AbstractContextManager[Span]):
    __slots__ = ("_attributes", "_context", "_kind", "_name", "_span", "_token", "_tracer")

    def __init__(
        self,
        tracer: Tracer,
        name: str,
        context: otel_context.Context | None,
        kind: SpanKind,
        attributes: Mapping[str, AttributeValue] | None,
    ) -> None:
        self._tracer = tracer
        self._name = name
        self._context = context
        self._kind = kind
        self._attributes = attributes
        self._span: Span = INVALID_SPAN
        self._token: Token[otel_context.Context] | None = None

    def __enter__(self) -> Span:
        # Failure is recorded in __exit__ instead of by the SDK so that it also sets
        # `error.type`, which the GenAI conventions require on a failed operation.
        span = self._tracer.start_span(
            self._name,
            context=self._context,
            kind=self._kind,
            attributes=self._attributes,
            record_exception=False,
            set_status_on_exception=False,
        )
        self._token = otel_context.attach(set_span_in_context(span))
        self._span = span
        return span

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        span = self._span
        try:
            if exc is not None:
                _record_failure(span, exc)
        finally:
            if self._token is not None:
                otel_context.detach(self._token)
                self._token = None
            span.end()


def _record_failure(span: Span, exc: BaseException) -> None:
    # Cancellation is recorded too: the operation did not complete, and a trace that shows
    # it ending silently would mislead. The caller still sees the exception unchanged.
    cls = type(exc)
    error_type = cls.__qualname__ if cls.__module__ == "builtins" else (
        f"{cls.__module__}.{cls.__qualname__}")
    span.record_exception(exc)
    span.set_attribute(ERROR_TYPE, error_type)
    span.set_status(Status(StatusCode.ERROR, f"{cls.__name__}: {exc}"))
