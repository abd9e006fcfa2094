"""`built-in:web_search`: web search through a provider's API (Tavily's request shape).

Without an API key the tool is still registered, so the model learns it exists, and every
call fails at once with `not_configured`, naming the variable to set (seed 003).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal

import httpx

from actors.tools import LocalTool, Resource, ToolError, tool, uses
from schemas.manifest import WebSearchConfig

KEY_VARIABLES = {"tavily": "TAVILY_API_KEY"}


def search_tool(cfg: WebSearchConfig, *, api_key: str | None) -> LocalTool:
    variable = KEY_VARIABLES[cfg.provider]

    async def client() -> AsyncIterator[httpx.AsyncClient]:
        async with httpx.AsyncClient(base_url=cfg.base_url, timeout=cfg.timeout_ms / 1000,
                                     trust_env=False) as c:
            yield c

    http = Resource(client, name="web_search client")

    @tool("built-in:web_search", read_only=True, idempotent=True, open_world=True,
          timeout_ms=cfg.timeout_ms + 2_000, source="built-in", pool=cfg.pool)
    async def web_search(query: str, max_results: int = cfg.max_results,
                         search_depth: Literal["basic", "advanced"] = "basic",
                         *, client: httpx.AsyncClient = uses(http)) -> dict[str, Any]:
        """Search the web and return the top results (title, url, content).

        Args:
            query: what to search for, in plain words.
            max_results: how many results, 1 to 20.
            search_depth: basic is fast; advanced reads more of each page.
        """
        if not api_key:
            raise ToolError(f"web_search is not configured: set {variable} in the "
                            "executor's environment (or tools.web_search.api_key in the "
                            "manifest) and restart the executor", error_type="not_configured")
        try:
            response = await client.post(
                "/search", headers={"Authorization": f"Bearer {api_key}"},
                json={"query": query, "max_results": max(1, min(max_results, 20)),
                      "search_depth": search_depth, "include_answer": True})
        except httpx.TimeoutException as exc:
            raise ToolError(f"{cfg.provider} did not answer within {cfg.timeout_ms} ms",
                            error_type="timeout", retryable=True) from exc
        except httpx.TransportError as exc:
            raise ToolError(f"cannot reach {cfg.provider}: {exc!r}", error_type="http_error",
                            retryable=True) from exc
        if response.status_code in (401, 403):
            raise ToolError(f"{cfg.provider} refused the API key (HTTP {response.status_code}); "
                            f"check {variable}", error_type="auth_failed")
        if response.status_code == 429:
            raise ToolError(f"{cfg.provider} rate limit reached", error_type="rate_limited",
                            retryable=True)
        if not response.is_success:
            # A proxy's or gateway's error page may quote the request's Authorization.
            page = response.text.replace(api_key, "[redacted]")
            raise ToolError(f"{cfg.provider} answered HTTP {response.status_code}: "
                            f"{page[:500]}", error_type="http_error",
                            retryable=response.status_code >= 500)
        body = response.json()
        results = [{"title": r.get("title", ""), "url": r.get("url", ""),
                    "content": r.get("content", "")} for r in body.get("results", [])]
        out: dict[str, Any] = {"query": query, "results": results}
        if body.get("answer"):
            out["answer"] = body["answer"]
        return out

    return web_search
