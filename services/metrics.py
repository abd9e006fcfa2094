"""Installs the OpenTelemetry metrics SDK for a toolbus process, and serves what it
collects in the Prometheus text format.

Metrics are on when something will read them:

- a Prometheus endpoint: `/metrics` on the HTTP gateway (`toolbus up --http-port`), or
  `--metrics-port PORT` (`toolbus up`, `toolbus actor`), or `OTEL_METRICS_EXPORTER=
  prometheus` (on `OTEL_EXPORTER_PROMETHEUS_HOST`:`OTEL_EXPORTER_PROMETHEUS_PORT`,
  default 127.0.0.1:9464, as the OTel SDKs do);
- OTLP over HTTP, when `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT` or
  `OTEL_EXPORTER_OTLP_ENDPOINT` is set and `OTEL_METRICS_EXPORTER` is unset or names
  `otlp` (every `OTEL_METRIC_EXPORT_INTERVAL` ms, 60 s by default).

The Prometheus text is rendered here from a pull `MetricReader`, not with
`opentelemetry-exporter-prometheus`: that exporter registers into prometheus-client's
process-global registry and serves from its own thread, where collection would run the
gauges' callbacks against actor state owned by the event loop; it is also a beta pinned to
one SDK version. Rendering the three instrument kinds toolbus uses is about sixty lines,
and collection runs in the event loop, at scrape time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from actors import metrics
from bus.connection import Bus
from bus.consumer import ConsumerLag, consumer_lags
from bus.subjects import EVENTS_STREAM, REQUESTS_STREAM
from bus.tasks import stop_task
from schemas.errors import ConfigError

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricsData

__all__ = ["CONTENT_TYPE", "LagPoller", "Metrics", "MetricsServer", "install_metrics",
           "render", "serve_metrics"]

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_DEFAULT_PROMETHEUS_PORT = 9464


@dataclass(eq=False)
class Metrics:
    """An installed meter provider; `scrape` is None without a Prometheus reader."""

    provider: MeterProvider
    reader: InMemoryMetricReader | None
    prometheus_env: tuple[str, int] | None  # OTEL_METRICS_EXPORTER=prometheus's address

    def scrape(self) -> str:
        """The current values, in the Prometheus text format (call in the event loop)."""
        if self.reader is None:
            return ""
        data = self.reader.get_metrics_data()
        return render(data) if data is not None else ""

    def shutdown(self) -> None:
        """Export what OTLP still holds and stop (blocking: run it in a worker thread)."""
        metrics.install(None)
        self.provider.shutdown()


def install_metrics(service_name: str, *, prometheus: bool = False,
                    env_endpoint: bool = True) -> Metrics | None:
    """Install the SDK if metrics are asked for (`prometheus`: an endpoint will serve
    them); None when they are off. `ConfigError` for an exporter toolbus does not ship.
    `env_endpoint=False` ignores `OTEL_METRICS_EXPORTER=prometheus` (a worker of `toolbus
    up`, which inherits the variables, must not bind its parent's port)."""
    env = os.environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" and not prometheus:
        return None
    names = {n.strip().lower() for n in env.get("OTEL_METRICS_EXPORTER", "").split(",")}
    names.discard("")
    unknown = names - {"otlp", "prometheus", "none"}
    if unknown:
        raise ConfigError(
            f"OTEL_METRICS_EXPORTER={env['OTEL_METRICS_EXPORTER']} names exporters toolbus "
            f"does not ship ({', '.join(sorted(unknown))}): use otlp (with "
            "OTEL_EXPORTER_OTLP_ENDPOINT set), prometheus, or none")
    endpoint = (env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
                or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    want_otlp = bool(endpoint) and (not names or "otlp" in names) and "none" not in names
    prometheus_env = _prometheus_address(env) if "prometheus" in names and env_endpoint \
        else None
    want_pull = prometheus or prometheus_env is not None
    if not (want_otlp or want_pull):
        return None
    if want_otlp:
        _check_protocol(env)

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import (
        InMemoryMetricReader,
        MetricReader,
        PeriodicExportingMetricReader,
    )
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    readers: list[MetricReader] = []
    reader = InMemoryMetricReader() if want_pull else None
    if reader is not None:
        readers.append(reader)
    if want_otlp:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    name = env.get("OTEL_SERVICE_NAME") or service_name
    provider = MeterProvider(metric_readers=readers,
                             resource=Resource.create({SERVICE_NAME: name}),
                             shutdown_on_exit=False)
    metrics.install(provider)
    log.debug("metrics on for %s (otlp=%s, prometheus=%s)", name, want_otlp, want_pull)
    return Metrics(provider, reader, prometheus_env)


def _prometheus_address(env: Mapping[str, str]) -> tuple[str, int]:
    host = env.get("OTEL_EXPORTER_PROMETHEUS_HOST") or "127.0.0.1"
    text = env.get("OTEL_EXPORTER_PROMETHEUS_PORT") or str(_DEFAULT_PROMETHEUS_PORT)
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise ConfigError(f"OTEL_EXPORTER_PROMETHEUS_PORT={text} is not a TCP port: give 1 "
                          "to 65535")
    return host, port


def _check_protocol(env: Mapping[str, str]) -> None:
    for var in ("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        protocol = env.get(var)
        if protocol:
            if protocol.strip().lower() != "http/protobuf":
                raise ConfigError(
                    f"{var}={protocol} is not supported: toolbus exports OTLP over HTTP "
                    f"(http/protobuf). Unset {var} and point OTEL_EXPORTER_OTLP_ENDPOINT at "
                    "the collector's HTTP port (usually 4318)")
            return


# --- the Prometheus text format ------------------------------------------------------------

_UNITS = {"s": "seconds", "ms": "milliseconds", "By": "bytes"}
_INVALID = re.compile(r"[^a-zA-Z0-9_:]")
_INVALID_LABEL = re.compile(r"[^a-zA-Z0-9_]")


def _metric_name(name: str, unit: str) -> str:
    base = _INVALID.sub("_", name)
    # Annotations in braces (`{call}`) name what is counted, not a unit: dropped, as the
    # OTel-to-Prometheus rules say.
    suffix = _UNITS.get(unit) if unit and not unit.startswith("{") else None
    if suffix and not base.endswith("_" + suffix):
        base += "_" + suffix
    return base


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(attributes: Mapping[str, object] | None, extra: str = "") -> str:
    parts = [f'{_INVALID_LABEL.sub("_", k)}="{_escape(str(v))}"'
             for k, v in sorted((attributes or {}).items())]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


def render(data: MetricsData) -> str:
    """Prometheus text exposition (0.0.4) of cumulative OTel metrics data."""
    from opentelemetry.sdk.metrics.export import Gauge, Histogram, HistogramDataPoint, Sum

    out: list[str] = []
    for resource_metrics in data.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                name = _metric_name(metric.name, metric.unit or "")
                points = metric.data
                if isinstance(points, Sum) and points.is_monotonic:
                    kind, sample = "counter", name + "_total"
                elif isinstance(points, Sum | Gauge):
                    kind, sample = "gauge", name
                elif isinstance(points, Histogram):
                    kind, sample = "histogram", name
                else:
                    continue
                out.append(f"# HELP {sample if kind == 'counter' else name} "
                           f"{_escape(metric.description or '')}")
                out.append(f"# TYPE {sample if kind == 'counter' else name} {kind}")
                for point in points.data_points:
                    attrs = point.attributes
                    if isinstance(point, HistogramDataPoint):
                        running = 0
                        bounds = [*point.explicit_bounds, math.inf]
                        for bound, count in zip(bounds, point.bucket_counts, strict=True):
                            running += count
                            le = f'le="{_number(float(bound))}"'
                            out.append(f"{name}_bucket{_labels(attrs, le)} {running}")
                        out.append(f"{name}_sum{_labels(attrs)} {_number(point.sum)}")
                        out.append(f"{name}_count{_labels(attrs)} {point.count}")
                    else:
                        out.append(f"{sample}{_labels(attrs)} {_number(point.value)}")
    return "\n".join(out) + "\n" if out else ""


# --- a scrape endpoint for processes without the gateway -----------------------------------


class MetricsServer:
    def __init__(self, server: asyncio.Server) -> None:
        self._server = server

    async def stop(self) -> None:
        self._server.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await self._server.wait_closed()


async def serve_metrics(scrape: Callable[[], str], *, host: str, port: int,
                        flag: str = "--metrics-port") -> MetricsServer:
    """`GET /metrics` on `host:port` (plain HTTP/1.1, one request a connection), in this
    event loop, so collection reads actor state on the loop that owns it. `ConfigError`
    if it cannot listen there."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(10):
                head = await reader.readuntil(b"\r\n\r\n")
            line = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            if len(line) != 3:
                status, body = "400 Bad Request", "bad request line\n"
            elif line[0] not in ("GET", "HEAD"):
                status, body = "405 Method Not Allowed", "only GET /metrics\n"
            elif line[1].split("?", 1)[0] != "/metrics":
                status, body = "404 Not Found", "only GET /metrics\n"
            else:
                status, body = "200 OK", scrape()
            data = body.encode()
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: "
                f"{CONTENT_TYPE if status == '200 OK' else 'text/plain'}\r\n"
                f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
                + (b"" if line and line[0] == "HEAD" else data))
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ConnectionError):
            pass
        except Exception:  # a scrape must never take the process down
            log.exception("metrics endpoint failed")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    try:
        server = await asyncio.start_server(handle, host, port, limit=16 * 1024)
    except OSError as exc:
        raise ConfigError(f"the metrics endpoint cannot listen on {host}:{port}: "
                          f"{(exc.strerror or str(exc)).lower()}; pick another {flag}"
                          ) from exc
    return MetricsServer(server)


# --- consumer lag ----------------------------------------------------------------------------


class LagPoller:
    """`toolbus.consumer.lag` of every durable consumer of toolbus's streams, from a
    consumer listing every `LAG_POLL_S` (one request per stream, whatever the message
    rate, and whichever process runs the consumer: executors in worker processes show
    too). Executor consumers get their pool from their filter subject."""

    def __init__(self, bus: Bus, *, interval_s: float = metrics.LAG_POLL_S) -> None:
        self._bus = bus
        self._interval_s = interval_s
        self._values: list[tuple[dict[str, str], float]] = []
        self._task: asyncio.Task[None] | None = None
        self._unwatch: Callable[[], None] | None = None

    async def start(self) -> None:
        await self.poll()
        self._unwatch = metrics.watch("lag", lambda: self._values)
        self._task = asyncio.create_task(self._run(), name="metrics-lag")

    async def stop(self) -> None:
        if self._unwatch is not None:
            self._unwatch()
        # Cancelled again until it ends: once was lost when it landed as a poll's reply
        # came (bus/tasks.py), and `toolbus up` then never finished stopping.
        await stop_task(self._task)

    async def poll(self) -> None:
        values: list[tuple[dict[str, str], float]] = []
        for stream in (EVENTS_STREAM, REQUESTS_STREAM):
            try:
                lags = await consumer_lags(self._bus, stream)
            except Exception as exc:  # a NATS outage: keep the last values
                log.debug("consumer lag of %s not read: %s", stream, exc)
                return
            values.extend((_lag_attributes(lag), float(lag.pending)) for lag in lags)
        self._values = values

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.poll()


def _lag_attributes(lag: ConsumerLag) -> dict[str, str]:
    attrs = {metrics.CONSUMER: lag.name, "messaging.destination.name": lag.stream}
    for subject in lag.filter_subjects:
        # toolbus.evt.<sid>.call.dispatched.<pool>.<namespace> (or ...instance.<name>.<ns>)
        tokens = subject.split(".")
        if "dispatched" in tokens:
            at = tokens.index("dispatched") + 1
            if at < len(tokens) and tokens[at] != "instance":
                attrs[metrics.POOL] = tokens[at]
            break
    return attrs
