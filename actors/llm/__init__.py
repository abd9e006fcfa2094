"""The planner's model calls: one function over four provider APIs, over aiohttp.

`complete` builds the request in the provider's own shape (one module per API), sends it
with bounded retries (retry.py), streams text deltas to `on_delta` when one is given, and
returns one `ModelResponse` whatever the API. Every failure is a `ModelError`. The API key
goes into a request header only: not into a URL, an error message or a log line.

A streamed call that breaks after a delta was delivered raises `ModelError(kind=
"partial_stream", retryable=True)` and is not retried here: the planner may make the call
again whole (a model call has no side effects), after marking the deltas it already
published as void.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import msgspec

from actors.llm import anthropic, gemini, openai_chat, openai_responses
from actors.llm.convert import WireMemo
from actors.llm.retry import with_retries
from actors.llm.transport import ModelClient, OnDelta, send
from actors.llm.types import (
    Message,
    ModelResponse,
    ModelSettings,
    ToolCall,
    ToolChoice,
    Usage,
)
from schemas.errors import ConfigError
from schemas.tools import ToolSpec

BUILDERS: Final = {
    "openai": openai_chat.build,
    "openai-responses": openai_responses.build,
    "anthropic": anthropic.build,
    "gemini": gemini.build,
}


async def complete(settings: ModelSettings, *, system: str | None, messages: list[Message],
                   tools: Sequence[ToolSpec], tool_choice: ToolChoice = "auto",
                   response_schema: dict[str, Any] | None = None,
                   on_delta: OnDelta | None = None,
                   client: ModelClient | None = None,
                   memo: WireMemo | None = None) -> ModelResponse:
    """One model call: the reply, or a `ModelError`. Streams when `on_delta` is given.
    Pass a shared `client` to reuse connections (one is made and closed otherwise), and
    the session's `memo` to reuse the wire form of its history (see `WireMemo`)."""
    builder = BUILDERS.get(settings.provider)
    if builder is None:
        raise ConfigError(f"unknown model provider {settings.provider!r}: choose from "
                          f"{', '.join(BUILDERS)}")
    request = builder(settings, system=system, messages=messages, tools=tools,
                      tool_choice=tool_choice, response_schema=response_schema,
                      stream=on_delta is not None, memo=memo)
    own = client is None
    http = client if client is not None else ModelClient()
    try:
        reply, attempts = await with_retries(
            lambda: send(http, request, key=settings.api_key, timeout_s=settings.timeout_s,
                         on_delta=on_delta),
            max_retries=settings.max_retries, budget_s=settings.retry_budget_s)
    finally:
        if own:
            await http.aclose()
    return msgspec.structs.replace(reply, extra={**reply.extra, "attempts": attempts})


__all__ = ["Message", "ModelClient", "ModelResponse", "ModelSettings", "ToolCall", "Usage",
           "WireMemo", "complete"]
