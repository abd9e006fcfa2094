"""The benchmark runs end to end (timing is reported, never asserted)."""

from __future__ import annotations

import json

from tests.conftest import run_toolbus


def test_bench_calls_reports_toolbus_next_to_its_raw_baselines() -> None:
    out = run_toolbus("bench", "calls", "--n", "64", "--concurrency", "8", "--json", timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    names = [r["name"] for r in report["rows"]]
    assert names == ["raw JetStream publish+ack"] * 2 + ["raw request/reply"] * 2 + \
        ["toolbus call built-in:echo"] * 2
    assert report["failures"] == 0
    assert set(report["ratios"]) == {"seq_p50_vs_js_publish", "seq_p50_vs_request_reply",
                                     "throughput_vs_js_publish"}


def test_bench_validation_reports_the_cost_per_call_next_to_a_json_decode() -> None:
    out = run_toolbus("bench", "validation", "--json")
    assert out.returncode in (0, 1), out.stderr  # 1 = over the 20 µs target: reported, not asserted
    report = json.loads(out.stdout)
    assert report["schema_fields"] == 10 and report["target_us"] == 20.0
    for key in ("json_decode_us", "toolbus_valid_us", "toolbus_invalid_all_violations_us",
                "fastjsonschema_valid_us", "ratio_to_json_decode"):
        assert report[key] > 0, key


def test_bench_mcp_reports_toolbus_next_to_a_direct_mcp_client() -> None:
    out = run_toolbus("bench", "mcp", "--n", "32", "--concurrency", "4", "--json", timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["name"] for r in report["rows"]] == [
        "direct mcp.Client.call_tool", "toolbus call (MCP tool)"] * 2
    assert report["failures"] == 0
    assert set(report) >= {"overhead_p50_ms", "ratio_p50", "throughput_ratio"}
