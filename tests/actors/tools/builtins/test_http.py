"""The `http` built-in against a real HTTP server on 127.0.0.1: defaults, annotations and
policy, refused methods, paths and addresses, timeouts and the response cap."""

from __future__ import annotations

import pytest

from actors.tools import ToolError
from actors.tools.builtins.http import http_tool
from schemas.manifest import HttpToolConfig
from schemas.policy import Policy, evaluate
from tests.actors.tools.builtins.conftest import run_tool


async def test_http_tool_merges_defaults_and_returns_ok_status_url_data(http_server) -> None:
    t = http_tool(HttpToolConfig(
        name="tickets:create_ticket", description="Open a ticket.", base_url=http_server,
        allowed_methods=["POST", "GET"], default_headers={"X-Api": "k1"},
        default_query={"tenant": "acme"}))
    assert t.spec.name == "tickets:create_ticket" and t.spec.description == "Open a ticket."
    out = await run_tool(t, {"path": "/tickets", "body": {"title": "broken"},
                         "query": {"prio": 2}, "headers": {"X-Trace": "t"}})
    assert out["ok"] and out["status"] == 200
    assert out["url"] == f"{http_server}/tickets?tenant=acme&prio=2"
    data = out["data"]
    assert data["method"] == "POST" and data["body"] == {"title": "broken"}
    assert data["headers"]["x-api"] == "k1" and data["headers"]["x-trace"] == "t"
    missing = await run_tool(t, {"path": "/missing", "method": "GET"})
    assert missing["ok"] is False and missing["status"] == 404
    assert missing["data"] == {"error": "no such ticket"}


async def test_http_tool_annotations_follow_the_allowed_methods() -> None:
    ro = http_tool(HttpToolConfig(name="api:read")).spec
    assert ro.annotations.readOnlyHint and not ro.requires_approval and ro.risk_level == "low"
    assert ro.parameters["properties"]["method"]["enum"] == ["GET", "HEAD"]
    rw = http_tool(HttpToolConfig(name="api:write", allowed_methods=["POST", "DELETE"])).spec
    assert not rw.annotations.readOnlyHint and rw.annotations.destructiveHint
    assert rw.risk_level == "high" and not rw.auto_approve
    auto = http_tool(HttpToolConfig(name="api:auto", allowed_methods=["POST"],
                                    auto_approve=True)).spec
    assert auto.auto_approve
    # What the policy makes of them (seed 002): mutating calls wait for a human unless
    # the tool's config says auto_approve.
    policy = Policy()
    assert evaluate(ro, session_id="s", agent=None, policy=policy).rule == "auto:read_only"
    assert evaluate(rw, session_id="s", agent=None, policy=policy).rule == "policy:mutating"
    assert evaluate(auto, session_id="s", agent=None, policy=policy).rule == \
        "auto:auto_approve"


async def test_http_method_outside_allowed_and_relative_path_without_base_are_rejected(
        http_server) -> None:
    t = http_tool(HttpToolConfig(name="api:read"))
    with pytest.raises(ValueError, match=r'\$\.method: "DELETE" is not one of'):
        await run_tool(t, {"path": f"{http_server}/x", "method": "DELETE"})
    with pytest.raises(ValueError, match=r'\$\.path: "/tickets" does not match'):
        await run_tool(t, {"path": "/tickets"})
    with pytest.raises(ToolError, match="relative path and this tool has no base_url"):
        await t.run({"path": "tickets"}, {t.injected["http"]: None})  # a direct caller


async def test_http_refuses_link_local_and_metadata_addresses_and_unlisted_hosts(
        http_server) -> None:
    t = http_tool(HttpToolConfig(name="api:read"))
    for url in ("http://169.254.169.254/latest/meta-data/", "http://[fe80::1]/",
                "http://metadata.google.internal/computeMetadata/v1/"):
        with pytest.raises(ToolError) as err:
            await run_tool(t, {"path": url})
        assert err.value.error_type == "address_not_allowed", url
    listed = http_tool(HttpToolConfig(name="api:listed", allowed_hosts=["*.example.com"]))
    with pytest.raises(ToolError, match="not in this tool's allowed_hosts") as err:
        await run_tool(listed, {"path": f"{http_server}/x"})
    assert err.value.error_type == "host_not_allowed"
    ok = http_tool(HttpToolConfig(name="api:local", allowed_hosts=["127.0.0.1"]))
    assert (await run_tool(ok, {"path": f"{http_server}/x"}))["ok"]


async def test_http_timeout_and_response_cap(http_server) -> None:
    slow = http_tool(HttpToolConfig(name="api:slow", base_url=http_server, timeout_ms=300))
    with pytest.raises(ToolError, match="did not answer within 300 ms") as err:
        await run_tool(slow, {"path": "/slow"})
    assert err.value.error_type == "timeout" and err.value.retryable
    capped = http_tool(HttpToolConfig(name="api:big", base_url=http_server,
                                      max_response_chars=1000))
    out = await run_tool(capped, {"path": "/big"})
    assert len(out["data"]) == 1000 and out["truncated"] is True
    text = http_tool(HttpToolConfig(name="api:text", base_url=http_server,
                                    response_format="text"))
    assert isinstance((await run_tool(text, {"path": "/x"}))["data"], str)
