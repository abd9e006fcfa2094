"""The executor's containment rules, with an in-process executor on a real server."""

from __future__ import annotations

from datetime import datetime

from bus.client import ToolbusClient
from schemas.events import TurnCompleted


async def _one(client: ToolbusClient, sid: str, tool: str, arguments: dict) -> object:
    end = await client.call(sid, [{"tool": tool, "arguments": arguments}], timeout=15)
    assert isinstance(end, TurnCompleted)
    return end.outcomes[0]


async def test_current_time_is_iso_8601_in_the_requested_zone(client, sid) -> None:
    out = await _one(client, sid, "built-in:current_time", {"timezone": "Asia/Tokyo"})
    parsed = datetime.fromisoformat(out.result["time"])  # type: ignore[attr-defined]
    assert parsed.utcoffset() is not None and parsed.utcoffset().total_seconds() == 9 * 3600
    utc = await _one(client, sid, "built-in:current_time", {})
    assert utc.result["timezone"] == "UTC"  # type: ignore[attr-defined]


async def test_a_bad_time_zone_is_a_clear_call_failure(client, sid) -> None:
    out = await _one(client, sid, "built-in:current_time", {"timezone": "Mars/Olympus"})
    assert out.status == "failed"  # type: ignore[attr-defined]
    assert out.error.error_type == "invalid_timezone"  # type: ignore[attr-defined]
    assert "Mars/Olympus" in out.error.message  # type: ignore[attr-defined]


async def test_a_tool_past_its_timeout_fails_retryable(client, sid) -> None:
    out = await _one(client, sid, "testing:short_timeout", {"seconds": 5})
    assert out.error.error_type == "timeout" and out.error.retryable  # type: ignore[attr-defined]
    assert "0.2 s" in out.error.message  # type: ignore[attr-defined]


async def test_a_raising_tool_is_a_call_failure_and_the_executor_goes_on(client, sid) -> None:
    out = await _one(client, sid, "testing:boom", {"message": "disk on fire"})
    assert out.error.error_type == "RuntimeError"  # type: ignore[attr-defined]
    assert out.error.message == "disk on fire"  # type: ignore[attr-defined]
    after = await _one(client, sid, "built-in:echo", {"still": "alive"})
    assert after.result == {"still": "alive"}  # type: ignore[attr-defined]


async def test_a_tool_error_keeps_its_type_and_retryable_flag(client, sid) -> None:
    out = await _one(client, sid, "testing:refuse", {"reason": "rate limited"})
    assert out.error.error_type == "refused" and out.error.retryable  # type: ignore[attr-defined]


async def test_a_result_that_is_not_json_is_a_call_failure(client, sid) -> None:
    out = await _one(client, sid, "testing:not_json", {})
    assert out.error.error_type == "result_not_serializable"  # type: ignore[attr-defined]


async def test_arguments_the_function_cannot_take_fail_the_call(client, sid) -> None:
    # testing:loose declares a schema looser than its signature: the schema lets the call
    # through, the executor's own check stops it before the function runs.
    out = await _one(client, sid, "testing:loose", {"secs": 1})
    assert out.error.error_type == "invalid_arguments"  # type: ignore[attr-defined]
    assert "seconds" in out.error.message  # type: ignore[attr-defined]
