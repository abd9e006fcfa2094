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
