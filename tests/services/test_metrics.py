"""Metrics end to end: a real `toolbus up` (embedded nats-server, gateway, scrape port)
serves known calls' counts on its Prometheus endpoints, exactly; `toolbus top --once`
prints them; bad flags and unreachable endpoints fail in one line."""

from __future__ import annotations

import asyncio
import http.server
import signal
import socket
import subprocess
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from bus.connection import connect
from bus.server import free_port
from services.metrics import render
from services.top import merge, parse, quantile
from tests.conftest import REPO, Proc, role_url, run_toolbus, toolbus_cmd

Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


@dataclass
class Up:
    data: Path
    http: str  # the gateway's base URL
    scrape: str  # the --metrics-port endpoint
    token: str  # the client role's bearer token

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.http, timeout=10, trust_env=False,
                                 headers={"Authorization": f"Bearer {self.token}"})


@pytest.fixture(scope="module")
async def up(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Up]:
    data = tmp_path_factory.mktemp("metrics") / "data"
    http_port, metrics_port = free_port(), free_port()
    proc = Proc("up", "--port", str(free_port()), "--data-dir", str(data), "--workers", "1",
                "--http-port", str(http_port), "--metrics-port", str(metrics_port),
                "--tools", "tests/toolkit.py", ready="stop:")
    try:
        await proc.wait_ready()
        token = (data / "auth" / "client.token").read_text().strip()
        yield Up(data, f"http://127.0.0.1:{http_port}",
                 f"http://127.0.0.1:{metrics_port}/metrics", token)
    finally:
        assert proc.stop(signal.SIGINT) == 0


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample of `name` whose labels include `labels` (0 when there is none)."""
    want = set(labels.items())
    return sum(v for ls, v in samples.get(name, {}).items() if want <= set(ls))


async def scrape_until(up: Up, done: Callable[[Samples], bool]) -> Samples:
    """The gateway's /metrics once `done` holds: the count is taken when the writer of a
    turn's end reads its acknowledgement, a moment after a client may see the event."""
    async with up.client() as web, asyncio.timeout(15):
        while True:
            answer = await web.get("/metrics")
            assert answer.status_code == 200, answer.text
            assert answer.headers["content-type"].startswith("text/plain; version=0.0.4")
            samples = parse(answer.text)
            if done(samples):
                return samples
            await asyncio.sleep(0.05)


async def request(up: Up, sid: str, *tools: str) -> None:
    calls = [{"tool": t, "arguments": {"text": "hi"} if t == "built-in:echo"
              else {"message": "boom"}} for t in tools]
    async with up.client() as web:
        sent = await web.post(f"/sessions/{sid}/requests", json={"calls": calls})
        assert sent.status_code == 202, sent.text


def calls(samples: Samples, tool: str, outcome: str) -> float:
    return value(samples, "toolbus_calls_total", gen_ai_tool_name=tool, toolbus_outcome=outcome)


async def test_known_calls_are_counted_exactly_once_on_both_endpoints(up: Up) -> None:
    await request(up, "m1", "built-in:echo", "built-in:echo", "testing:boom")
    await request(up, "m2", "testing:boom")
    await request(up, "m3", "built-in:echo")
    await request(up, "m4", "nope:missing")  # rejected by the policy: an unknown tool
    bus = await connect(role_url(up.data, "client"), name="metrics-test")
    try:  # a request that is not JSON: a stored request.rejected
        await bus.nc.publish("toolbus.req.m5", b"{not json")
        await bus.nc.flush()
    finally:
        await bus.close()

    samples = await scrape_until(up, lambda s: value(s, "toolbus_calls_total") >= 6 and
                                 value(s, "toolbus_rejections_total", toolbus_actor="session") >= 1)
    # One call more, through the whole system, before the counts are read again: a call
    # counted twice (a second writer of a turn's end) would have shown by then.
    await request(up, "m6", "built-in:echo")
    samples = await scrape_until(up, lambda s: calls(s, "built-in:echo", "succeeded") >= 4)

    assert calls(samples, "built-in:echo", "succeeded") == 4
    assert calls(samples, "testing:boom", "failed") == 2
    assert calls(samples, "_unknown", "rejected") == 1  # a made-up name is no label value
    assert value(samples, "toolbus_calls_total") == 7
    assert value(samples, "toolbus_rejections_total", toolbus_actor="approval",
                 toolbus_reason="unknown_tool") == 1
    assert value(samples, "toolbus_rejections_total", toolbus_actor="session",
                 toolbus_reason="malformed_json") == 1
    assert value(samples, "toolbus_rejections_total") == 2
    # A histogram: one observation per call that ran, in cumulative buckets.
    echo = {"gen_ai_tool_name": "built-in:echo"}
    assert value(samples, "toolbus_call_duration_seconds_count", **echo) == 4
    assert value(samples, "toolbus_call_duration_seconds_bucket", le="+Inf", **echo) == 4
    assert value(samples, "toolbus_call_duration_seconds_count",
                 gen_ai_tool_name="testing:boom") == 2
    assert value(samples, "toolbus_call_duration_seconds_count",
                 gen_ai_tool_name="_unknown") == 0  # never started: no duration
    assert value(samples, "toolbus_turn_duration_seconds_count") == 5
    assert value(samples, "toolbus_turn_duration_seconds_count",
                 toolbus_turn_status="failed") == 1  # every call of m4 was rejected
    assert value(samples, "toolbus_approvals_waiting") == 0
    assert samples["toolbus_sessions_active"] == {(("toolbus_actor", "session"),): 0}
    lag = samples["toolbus_consumer_lag"]
    consumers = {dict(ls)["messaging_consumer_group_name"]: dict(ls) for ls in lag}
    assert "approval" in consumers
    assert any(name.startswith("session") for name in consumers)
    assert consumers["exec_default_built-in"]["toolbus_pool"] == "default"

    # The scrape port serves the same process's metrics, without a token.
    async with httpx.AsyncClient(timeout=10, trust_env=False) as plain:
        direct = await plain.get(up.scrape)
        assert direct.status_code == 200
        assert calls(parse(direct.text), "testing:boom", "failed") == 2
        assert (await plain.get(up.scrape.replace("/metrics", "/other"))).status_code == 404
        assert (await plain.post(up.scrape)).status_code == 405
        # The gateway's needs one: any role's.
        assert (await plain.get(f"{up.http}/metrics")).status_code == 401


async def test_top_once_prints_the_counts_by_tool_and_the_lag_per_pool(up: Up) -> None:
    await request(up, "t1", "testing:boom")
    await scrape_until(up, lambda s: calls(s, "testing:boom", "failed") >= 1)
    await scrape_until(up, lambda s: value(s, "toolbus_sessions_active") == 0)
    samples = await scrape_until(up, lambda s: True)
    token_file = up.data / "auth" / "client.token"
    done = await asyncio.to_thread(run_toolbus, "top", "--url", f"{up.http}/metrics",
                                   "--token-file", str(token_file), "--once",
                                   "--interval", "0.2")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"toolbus top  {up.http}/metrics")
    assert "sessions active   0" in lines
    assert "approvals waiting 0" in lines
    rows = {line.split()[0]: line.split() for line in lines if line.startswith("testing:")}
    boom = rows["testing:boom"]
    failed = calls(samples, "testing:boom", "failed")
    assert boom[2:5] == ["0", f"{failed:g}", "0"]  # succeeded, failed, rejected
    assert boom[5].endswith("*") and boom[6].endswith("*")  # p50, p99 since the start
    lag = [line.split() for line in lines if line.startswith("default ")]
    assert ["default", "exec_default_testing", "0"] in lag
    # The data dir's client token is the default; two URLs are merged.
    both = await asyncio.to_thread(run_toolbus, "top", "--url", f"{up.http}/metrics",
                                   "--url", up.scrape, "--data-dir", str(up.data), "--once",
                                   "--interval", "0.1")
    assert both.returncode == 0, both.stderr
    merged = {line.split()[0]: line.split() for line in both.stdout.splitlines()
              if line.startswith("testing:boom")}
    assert merged["testing:boom"][3] == f"{2 * failed:g}"  # the same process, twice


@pytest.mark.parametrize(("args", "code", "says"), [
    (["--interval", "0"], 2, "is not a positive number"),
    (["--interval", "soon"], 2, "invalid float value"),
    (["--url", "ftp://127.0.0.1/metrics", "--once"], 2, "is not an http(s) URL"),
    (["--url", "http://127.0.0.1:{port}/metrics", "--once"], 3, "cannot read"),
    (["--token-file", "/nonexistent/token", "--once"], 2, "cannot read --token-file"),
])
def test_top_fails_in_one_line(args: list[str], code: int, says: str) -> None:
    args = [a.replace("{port}", str(free_port())) for a in args]
    done = run_toolbus("top", *args, timeout=30)
    assert done.returncode == code
    assert says in done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout == ""


def test_top_reads_an_empty_metrics_page_as_nothing_counted_yet() -> None:
    # A process that just started serves an empty page: not refused as "not metrics".
    class Empty(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Empty)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    try:
        done = run_toolbus("top", "--url", url, "--once", timeout=30)
        # Its output unwritable: a full disk is one line and status 1, stdout closed is
        # refused at once, as for every other command (both were tracebacks).
        unwritable = [subprocess.run(
            ["bash", "-c", " ".join(toolbus_cmd("top", "--url", url, "--once")) + redirect],
            capture_output=True, text=True, timeout=30, cwd=REPO)
            for redirect in (" > /dev/full", " >&-")]
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("toolbus top")
    full, closed = unwritable
    assert full.returncode == 1 and "Traceback" not in full.stderr, full.stderr
    assert full.stderr.startswith("toolbus: cannot write the output: "), full.stderr
    assert closed.returncode == 2 and "Traceback" not in closed.stderr, closed.stderr
    assert closed.stderr.startswith("toolbus: standard output is closed"), closed.stderr


async def test_top_pointed_at_a_page_that_is_not_metrics_says_so(up: Up) -> None:
    done = await asyncio.to_thread(run_toolbus, "top", "--url", f"{up.http}/healthz",
                                   "--once")
    assert done.returncode == 2 and done.stdout == ""
    assert "/healthz is not a metrics page" in done.stderr.strip().splitlines()[-1]
    # The server's URL alone: its /metrics is meant.
    token_file = up.data / "auth" / "client.token"
    bare = await asyncio.to_thread(run_toolbus, "top", "--url", f"{up.http}/",
                                   "--token-file", str(token_file), "--once",
                                   "--interval", "0.2")
    assert bare.returncode == 0, bare.stderr
    assert bare.stdout.startswith(f"toolbus top  {up.http}/metrics")


async def test_top_with_a_wrong_token_says_so(up: Up, tmp_path: Path) -> None:
    wrong = tmp_path / "token"
    wrong.write_text("not-a-token\n")
    done = await asyncio.to_thread(run_toolbus, "top", "--url", f"{up.http}/metrics",
                                   "--token-file", str(wrong), "--once")
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1
    assert "refused the token (401)" in done.stderr


def test_metrics_port_must_be_a_port() -> None:
    done = run_toolbus("up", "--metrics-port", "70000", timeout=30)
    assert done.returncode == 2
    assert "70000 is not a TCP port" in done.stderr
    assert "Traceback" not in done.stderr


def test_quantiles_interpolate_within_the_bucket_as_prometheus_does() -> None:
    buckets = [(0.001, 0.0), (0.002, 50.0), (0.004, 100.0), (float("inf"), 100.0)]
    assert quantile(0.5, buckets) == pytest.approx(0.002)
    assert quantile(0.75, buckets) == pytest.approx(0.003)
    assert quantile(0.5, [(float("inf"), 0.0)]) is None


def test_the_text_format_round_trips_through_the_parser() -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    meter = provider.get_meter("t")
    meter.create_counter("toolbus.calls", unit="{call}").add(
        3, {"gen_ai.tool.name": 'we"ird\\name', "toolbus.outcome": "failed"})
    meter.create_histogram("toolbus.call.duration", unit="s",
                           explicit_bucket_boundaries_advisory=[0.1, 1.0]).record(0.5)
    data = reader.get_metrics_data()
    assert data is not None
    text = render(data)
    provider.shutdown()
    samples = merge([text, text], at=0.0).samples
    assert value(samples, "toolbus_calls_total", gen_ai_tool_name='we"ird\\name') == 6
    assert value(samples, "toolbus_call_duration_seconds_bucket", le="0.1") == 0
    assert value(samples, "toolbus_call_duration_seconds_bucket", le="1") == 2
    assert "# TYPE toolbus_call_duration_seconds histogram" in text


def test_a_metrics_port_in_use_stops_up_with_one_line(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        done = run_toolbus("up", "--port", str(free_port()), "--data-dir", str(tmp_path),
                           "--workers", "1", "--metrics-port", str(port), timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"the metrics endpoint cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "pick another --metrics-port" in done.stderr
    assert "Traceback" not in done.stderr


async def test_top_stops_quietly_when_its_reader_goes_away(up: Up) -> None:
    token_file = up.data / "auth" / "client.token"
    top = Proc("top", "--url", f"{up.http}/metrics", "--token-file", str(token_file),
               "--interval", "0.1", ready="toolbus top")
    await top.wait_ready()
    out = top.proc.stdout
    assert out is not None
    out.close()  # as `| head -1` does: the next refresh writes into a closed pipe
    code = await asyncio.to_thread(top.proc.wait, 20)
    said = await asyncio.to_thread(top.stderr_after_exit)
    assert code == 0, said
    assert said == ""
