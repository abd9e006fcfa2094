"""Installs the OpenTelemetry SDK for a toolbus process, or leaves tracing off.

Tracing is on only when the standard OTel variables ask for it:

- `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT`: OTLP over HTTP
  (http/protobuf) through a batching processor. The exporter reads its other OTLP
  variables (headers, timeout, TLS, compression) itself.
- `OTEL_TRACES_EXPORTER=console`: one JSON span per line on stdout, exported as each span
  ends, so a test can follow a trace across processes by reading their output.

`OTEL_TRACES_EXPORTER=none` or `OTEL_SDK_DISABLED=true` keep it off; `OTEL_SERVICE_NAME`
overrides the service name the process passes in. The SDK is imported inside the
functions, so a process with tracing off never loads it.

Library code never sees the SDK: it gets a tracer through `bus.trace.set_tracer`.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

from bus import trace
from schemas.errors import ConfigError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

__all__ = ["install_for_tests", "install_tracing", "shutdown_tracing"]

log = logging.getLogger(__name__)

_SCOPE = "toolbus"
_provider: TracerProvider | None = None
_global_claimed = False


def install_tracing(service_name: str) -> bool:
    """Install the SDK if the environment asks for traces; True if tracing is now on.

    Raises `ConfigError` for settings toolbus cannot honour (an exporter or OTLP protocol
    it does not ship), rather than running silently without the traces someone asked
    for. Calling it again replaces the previous installation."""
    env = os.environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    names = {n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",")}
    names.discard("")
    if "none" in names:
        return False
    unknown = names - {"otlp", "console"}
    if unknown:
        raise ConfigError(
            f"OTEL_TRACES_EXPORTER={env['OTEL_TRACES_EXPORTER']} names exporters toolbus "
            f"does not ship ({', '.join(sorted(unknown))}): use otlp (with "
            f"OTEL_EXPORTER_OTLP_ENDPOINT set), console, or none")
    endpoint = (env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    # An unset OTEL_TRACES_EXPORTER means otlp in OTel, but toolbus exports only when an
    # endpoint is named: a default of localhost:4318 would make every process retry a
    # collector that is usually not there.
    want_otlp = bool(endpoint) and (not names or "otlp" in names)
    want_console = "console" in names
    if not (want_otlp or want_console):
        return False
    if want_otlp:
        _check_otlp_protocol(env)

    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SimpleSpanProcessor,
    )

    # Resource.create lets code override the environment; OTel users expect the reverse
    # for the service name.
    name = env.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    if want_otlp:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if want_console:
        # sys.stdout is read now rather than bound at import (the exporter's default), so
        # a redirect made before installing is honoured; indent=None keeps one span a line.
        console = ConsoleSpanExporter(
            out=sys.stdout, formatter=lambda s: s.to_json(indent=None) + "\n")
        provider.add_span_processor(SimpleSpanProcessor(console))
    _install(provider)
    _claim_global(provider)
    log.debug("tracing on for %s (otlp=%s, console=%s)", name, want_otlp, want_console)
    return True


def install_for_tests(exporter: SpanExporter, *, service_name: str = "toolbus-tests") -> None:
    """Trace into `exporter` (say an `InMemorySpanExporter`), exporting each span as it
    ends. Undo with `shutdown_tracing()`. The OTel global provider is left alone, so this
    can run any number of times in one process."""
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    processor: SpanProcessor = SimpleSpanProcessor(exporter)
    provider.add_span_processor(processor)
    _install(provider)


def shutdown_tracing() -> None:
    """Export what is still queued, stop the exporters and turn tracing off.

    Blocks the calling thread while the queue drains (bounded by the SDK: 30 s for the
    batch processor, plus the OTLP export timeout); from async code run it in a worker
    thread. Safe to call when tracing is off."""
    global _provider
    trace.set_tracer(None)
    provider, _provider = _provider, None
    if provider is not None:
        provider.shutdown()


def _install(provider: TracerProvider) -> None:
    global _provider
    shutdown_tracing()
    _provider = provider
    trace.set_tracer(provider.get_tracer(_SCOPE))


def _claim_global(provider: TracerProvider) -> None:
    """Make `provider` the OTel global too, once per process, so libraries that trace
    through the global (the MCP SDK's client spans and its `_meta` trace propagation)
    land in the same trace. Never done for tests: the global cannot be reset."""
    global _global_claimed
    from opentelemetry import trace as otel_trace

    if _global_claimed or not isinstance(otel_trace.get_tracer_provider(),
                                         otel_trace.ProxyTracerProvider):
        return
    otel_trace.set_tracer_provider(provider)
    _global_claimed = True


def _check_otlp_protocol(env: Mapping[str, str]) -> None:
    for var in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        protocol = env.get(var)
        if protocol:
            if protocol.strip().lower() != "http/protobuf":
                raise ConfigError(
                    f"{var}={protocol} is not supported: toolbus exports OTLP over HTTP "
                    f"(http/protobuf). Unset {var} and point OTEL_EXPORTER_OTLP_ENDPOINT at "
                    f"the collector's HTTP port (usually 4318)")
            return
