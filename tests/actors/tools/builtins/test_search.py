"""`web_search` against a local server speaking Tavily's search API: a missing key fails
at once, a wrong key is refused, an error page quoting the key never shows it."""

from __future__ import annotations

import pytest

from actors.tools import ToolError
from actors.tools.builtins.search import search_tool
from schemas.manifest import WebSearchConfig
from tests.actors.tools.builtins.conftest import run_tool


async def test_web_search_without_a_key_fails_at_once_naming_the_variable() -> None:
    t = search_tool(WebSearchConfig(base_url="http://127.0.0.1:9"), api_key=None)
    with pytest.raises(ToolError, match="set TAVILY_API_KEY") as err:
        await run_tool(t, {"query": "x"})
    assert err.value.error_type == "not_configured" and not err.value.retryable


async def test_web_search_speaks_tavilys_api(http_server) -> None:
    t = search_tool(WebSearchConfig(base_url=http_server), api_key="tvly-test")
    out = await run_tool(t, {"query": "toolbus", "max_results": 2})
    assert out["answer"] == "42" and [r["title"] for r in out["results"]] == ["r0", "r1"]
    assert out["results"][0] == {"title": "r0", "url": "https://e.com/0", "content": "toolbus"}
    bad = search_tool(WebSearchConfig(base_url=http_server), api_key="wrong")
    with pytest.raises(ToolError, match="refused the API key") as err:
        await run_tool(bad, {"query": "x"})
    assert err.value.error_type == "auth_failed"


async def test_an_error_page_quoting_the_key_never_shows_it(http_server) -> None:
    t = search_tool(WebSearchConfig(base_url=http_server), api_key="tvly-test")
    with pytest.raises(ToolError, match="answered HTTP 502") as err:
        await run_tool(t, {"query": "fail"})
    assert "tvly-test" not in err.value.message
    assert "Authorization: Bearer [redacted]" in err.value.message
