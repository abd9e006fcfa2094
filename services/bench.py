"""`toolbus bench`: end-to-end numbers next to the floor measured in the same run.

Machines here are shared and noisy, so absolute numbers mean little alone: every run
also measures raw JetStream publish+ack and raw core request/reply from the same client,
and reports toolbus as a ratio of those.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from bus.baseline import raw_ops
from bus.client import ToolbusClient
from bus.connection import Bus, connect
from bus.server import EmbeddedServer, free_port
from schemas.events import TurnCompleted
from services.sample_mcp import wait_listening


@dataclass(frozen=True, slots=True)
class Stats:
    name: str
    n: int
    concurrency: int
    seconds: float
    p50_ms: float
    p99_ms: float

    @property
    def per_s(self) -> float:
        return self.n / self.seconds if self.seconds else 0.0


def _row_json(r: Stats) -> dict[str, Any]:
    return {"name": r.name, "n": r.n, "concurrency": r.concurrency,
            "p50_ms": round(r.p50_ms, 3), "p99_ms": round(r.p99_ms, 3),
            "per_s": round(r.per_s, 1)}


def _print_rows(rows: list[Stats]) -> None:
    print(f"{'measure':<30} {'in flight':>9} {'p50 ms':>8} {'p99 ms':>8} {'per s':>9}")
    for r in rows:
        print(f"{r.name:<30} {r.concurrency:>9} {r.p50_ms:>8.3f} {r.p99_ms:>8.3f} "
              f"{r.per_s:>9.0f}")


async def measure(name: str, op: Callable[[int], Awaitable[None]], *, n: int,
                  concurrency: int) -> Stats:
    lat: list[float] = []
    counter = iter(range(n))

    async def worker() -> None:
        for i in counter:
            t = time.perf_counter()
            await op(i)
            lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    lat.sort()
    return Stats(name, n, concurrency, elapsed, statistics.median(lat) * 1e3,
                 lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3)


@contextlib.asynccontextmanager
async def _system(nats_url: str | None, *up_args: str):  # type: ignore[no-untyped-def]
    """A toolbus to measure: the given one, or an embedded server plus `toolbus up` in a
    separate process (as users run it), torn down afterwards."""
    if nats_url:
        yield nats_url
        return
    with tempfile.TemporaryDirectory(prefix="toolbus-bench-") as tmp:
        server = EmbeddedServer(Path(tmp), port=free_port()).start()
        proc = subprocess.Popen(  # noqa: ASYNC220 - once, before anything is measured
            [sys.executable, "-m", "services.cli", "up", "--nats", server.url, *up_args],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
            if not line.startswith("toolbus is up"):
                raise RuntimeError(f"toolbus up did not start: {line!r}")
            yield server.url
        finally:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(15)
            if proc.poll() is None:
                proc.kill()
            server.stop()


async def _baselines(bus: Bus, responder: Bus, *, n: int, concurrency: int) -> list[Stats]:
    async with raw_ops(bus, responder, b'{"text":"hi"}') as (publish, request):
        return [
            await measure("raw JetStream publish+ack", publish, n=n, concurrency=1),
            await measure("raw JetStream publish+ack", publish, n=n, concurrency=concurrency),
            await measure("raw request/reply", request, n=n, concurrency=1),
            await measure("raw request/reply", request, n=n, concurrency=concurrency),
        ]


async def bench_calls(nats_url: str | None, *, n: int = 2000, concurrency: int = 32,
                      json_out: bool = False) -> int:
    async with _system(nats_url) as url:
        bus = await connect(url, name="toolbus-bench")
        responder = await connect(url, name="toolbus-bench-responder")
        client = ToolbusClient(bus)
        run = os.urandom(3).hex()
        failures = 0

        def echo_in(session: Callable[[int], str]) -> Callable[[int], Awaitable[None]]:
            async def op(i: int) -> None:
                nonlocal failures
                end = await client.call(session(i), [{"tool": "built-in:echo",
                                                      "arguments": {"text": "hi", "i": i}}],
                                        timeout=30)
                if not (isinstance(end, TurnCompleted) and end.ok):
                    failures += 1
            return op

        try:
            await measure("warm-up", echo_in(lambda i: f"bench-{run}-warm"), n=200, concurrency=4)
            floor = await _baselines(bus, responder, n=n, concurrency=concurrency)
            seq = await measure("toolbus call built-in:echo", echo_in(lambda i: f"bench-{run}-seq"),
                                n=n, concurrency=1)
            par = await measure("toolbus call built-in:echo",
                                echo_in(lambda i: f"bench-{run}-p{i % concurrency}"),
                                n=n, concurrency=concurrency)
        finally:
            await client.close()
            await responder.close()
            await bus.close()

    rows = [*floor, seq, par]
    js_seq, js_par, rr_seq, _ = floor
    report = {
        "rows": [_row_json(r) for r in rows],
        "ratios": {
            "seq_p50_vs_js_publish": round(seq.p50_ms / js_seq.p50_ms, 2),
            "seq_p50_vs_request_reply": round(seq.p50_ms / rr_seq.p50_ms, 2),
            "throughput_vs_js_publish": round(par.per_s / js_par.per_s, 3),
        },
        "failures": failures,
    }
    if json_out:
        print(msgspec.json.encode(report).decode())
    else:
        _print_rows(rows)
        ratios = report["ratios"]
        assert isinstance(ratios, dict)
        print(f"\nsequential call p50 = {ratios['seq_p50_vs_js_publish']}x one raw JetStream "
              f"publish+ack, {ratios['seq_p50_vs_request_reply']}x one raw request/reply")
        print(f"calls/s with {concurrency} in flight = "
              f"{ratios['throughput_vs_js_publish']:.1%} of raw publishes/s")
        print(f"targets: sequential p50 <= 2 ms ({'met' if seq.p50_ms <= 2 else 'MISSED'}), "
              f">= 1000 calls/s with {concurrency} in flight "
              f"({'met' if par.per_s >= 1000 else 'MISSED'}); failures: {failures}")
    return 0 if failures == 0 else 1


# --- MCP --------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _sample_mcp_server():  # type: ignore[no-untyped-def]
    port = free_port()
    proc = subprocess.Popen(  # noqa: ASYNC220 - once, before anything is measured
        [sys.executable, "-m", "services.sample_mcp", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await wait_listening(port, proc)
        yield port
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        if proc.poll() is None:
            proc.kill()


async def bench_mcp(*, n: int = 1000, concurrency: int = 16, json_out: bool = False) -> int:
    """A tool call through toolbus (request -> session -> connector -> MCP server -> events)
    next to a direct `mcp.Client.call_tool` on the same server, in the same run."""
    import mcp  # only this benchmark needs the client directly

    args = {"car_id": "c1"}
    async with _sample_mcp_server() as port, contextlib.AsyncExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="toolbus-bench-mcp-"))
        manifest = Path(tmp, "manifest.yaml")
        manifest.write_text(  # noqa: ASYNC240 - once, before anything is measured
            f"tools: {{builtins: []}}\nmcps:\n  - id: bench\n"
            f"    hostname: http://127.0.0.1\n    port: {port}\n")
        url = await stack.enter_async_context(_system(None, "--manifest", str(manifest)))
        direct = await stack.enter_async_context(
            mcp.Client(f"http://127.0.0.1:{port}/mcp", cache=None))
        bus = await connect(url, name="toolbus-bench")
        stack.push_async_callback(bus.close)
        client = ToolbusClient(bus)
        stack.push_async_callback(client.close)
        run = os.urandom(3).hex()
        failures = 0

        async def direct_op(i: int) -> None:
            nonlocal failures
            result = await direct.call_tool("describe_car", args)
            failures += result.is_error

        def toolbus_op(session: Callable[[int], str]) -> Callable[[int], Awaitable[None]]:
            async def op(i: int) -> None:
                nonlocal failures
                end = await client.call(session(i), [{"tool": "bench:describe_car",
                                                      "arguments": args}], timeout=30)
                failures += not (isinstance(end, TurnCompleted) and end.ok)
            return op

        await measure("warm-up", direct_op, n=100, concurrency=4)
        await measure("warm-up", toolbus_op(lambda i: f"mcp-{run}-w"), n=100, concurrency=4)
        rows = [
            await measure("direct mcp.Client.call_tool", direct_op, n=n, concurrency=1),
            await measure("toolbus call (MCP tool)", toolbus_op(lambda i: f"mcp-{run}-s"),
                          n=n, concurrency=1),
            await measure("direct mcp.Client.call_tool", direct_op, n=n,
                          concurrency=concurrency),
            await measure("toolbus call (MCP tool)",
                          toolbus_op(lambda i: f"mcp-{run}-p{i % concurrency}"), n=n,
                          concurrency=concurrency),
        ]
    d_seq, t_seq, d_par, t_par = rows
    report = {
        "rows": [_row_json(r) for r in rows],
        "overhead_p50_ms": round(t_seq.p50_ms - d_seq.p50_ms, 3),
        "ratio_p50": round(t_seq.p50_ms / d_seq.p50_ms, 2),
        "throughput_ratio": round(t_par.per_s / d_par.per_s, 3),
        "failures": failures,
    }
    if json_out:
        print(msgspec.json.encode(report).decode())
    else:
        _print_rows(rows)
        print(f"\ntoolbus adds {report['overhead_p50_ms']} ms to a sequential MCP call at p50 "
              f"({report['ratio_p50']}x the direct call); with {concurrency} in flight it "
              f"runs {report['throughput_ratio']:.0%} of the direct calls/s. "
              f"Failures: {failures}")
    return 0 if failures == 0 else 1


# --- validation -------------------------------------------------------------------------

VALIDATION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "kind": {"type": "string", "enum": ["a", "b", "c"]},
        "score": {"type": "number"},
        "active": {"type": "boolean", "default": True},
        "meta": {"type": "object"},
        "url": {"type": "string", "format": "uri"},
        "limit": {"type": "integer", "default": 10},
    },
    "required": ["name", "age", "email"],
    "additionalProperties": False,
}
VALIDATION_VALID: dict[str, Any] = {
    "name": "Ada", "age": 36, "email": "ada@example.com", "tags": ["x", "y"], "kind": "a",
    "score": 0.5, "meta": {"k": 1}, "url": "https://example.com/a",
}
VALIDATION_INVALID: dict[str, Any] = {
    "name": "", "age": -1, "email": "nope", "kind": "z", "extra": 1,
}


def _per_call_us(fn: Callable[[], object], n: int) -> float:
    best = float("inf")
    for _ in range(5):  # best of 5: the least disturbed run on a shared machine
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def bench_validation(*, n: int = 20_000, json_out: bool = False) -> int:
    """Cost of checking one call's arguments against a 10-field schema, next to the cost
    of decoding them from JSON (the floor) and of fastjsonschema (the runner-up)."""
    import fastjsonschema  # dev dependency, only for this comparison

    from schemas.validation import Validator

    validator = Validator(VALIDATION_SCHEMA)
    raw = msgspec.json.encode(VALIDATION_VALID)
    fast = (fastjsonschema.compile(VALIDATION_SCHEMA, use_formats=True)
            if fastjsonschema is not None else None)
    decode = msgspec.json.decode
    valid = VALIDATION_VALID
    _, problems = validator.check(valid)
    assert not problems, problems
    _, problems = validator.check(VALIDATION_INVALID)
    assert len(problems) == 5, problems
    report = {
        "schema_fields": len(VALIDATION_SCHEMA["properties"]),
        "json_decode_us": _per_call_us(lambda: decode(raw), n),
        "toolbus_valid_us": _per_call_us(lambda: validator.check(valid), n),
        "toolbus_invalid_all_violations_us": _per_call_us(
            lambda: validator.check(VALIDATION_INVALID), n // 4),
        "fastjsonschema_valid_us": (_per_call_us(lambda: fast(dict(valid)), n)
                                    if fast is not None else None),
        "target_us": 20.0,
    }
    report["ratio_to_json_decode"] = report["toolbus_valid_us"] / report["json_decode_us"]
    if json_out:
        print(msgspec.json.encode(report).decode())
        return 0
    print(f"validation of a {report['schema_fields']}-field schema, best of 5 x {n} calls:")
    print(f"  baseline: msgspec JSON decode of the arguments  "
          f"{report['json_decode_us']:8.2f} µs")
    print(f"  toolbus (jsonschema-rs + defaults), valid       "
          f"{report['toolbus_valid_us']:8.2f} µs  "
          f"({report['ratio_to_json_decode']:.1f}x decode; target < 20 µs)")
    print(f"  toolbus, invalid, all 5 violations listed       "
          f"{report['toolbus_invalid_all_violations_us']:8.2f} µs")
    if report["fastjsonschema_valid_us"] is not None:
        print(f"  fastjsonschema (first error only), valid        "
              f"{report['fastjsonschema_valid_us']:8.2f} µs")
    return 0 if report["toolbus_valid_us"] < report["target_us"] else 1
