"""What the planner hands the provider layer and what it gets back: one shape for all four
APIs. Tool names here are toolbus names (`ns:tool`); each API module maps them to the
provider's names and back (schemas/providers.py)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

Provider = Literal["openai", "openai-responses", "anthropic", "gemini"]
Role = Literal["system", "user", "assistant", "tool"]
ToolChoice = Literal["auto", "required", "none"]


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """One call the model asked for. `name` is the toolbus name, or the provider's raw name
    when it is not one of the catalog (the planner rejects that call). `extra` holds what
    must be sent back verbatim with this call in the next request: Gemini's
    `thoughtSignature`, the Responses item `id` and the reasoning items before it,
    Anthropic's thinking blocks, or arguments that were not a JSON object."""

    id: str
    name: str
    arguments: dict[str, Any]
    extra: dict[str, Any] = {}


class Message(msgspec.Struct, frozen=True, kw_only=True):
    """One turn of the conversation. A tool result is `role="tool"` with the `tool_call_id`
    it answers, the tool `name`, the result as `text` (JSON or plain), and `is_error`.
    Chat Completions and Responses have no error flag: there the model sees only `text`,
    so a failed call's text should say that it failed."""

    role: Role
    text: str = ""
    tool_calls: list[ToolCall] = []
    tool_call_id: str | None = None
    name: str | None = None
    is_error: bool = False


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    input_tokens: int = 0
    output_tokens: int = 0


class ModelResponse(msgspec.Struct, frozen=True, kw_only=True):
    """A complete reply. `finish_reason` is normalized to `stop`, `tool_calls`, `length` or
    `content_filter` where the provider's reason maps to one (its raw reason is in
    `extra["stop_reason"]`); `latency_ms` is the successful attempt's; `extra["attempts"]`
    counts the attempts made."""

    text: str
    tool_calls: list[ToolCall]
    finish_reason: str
    usage: Usage
    model: str
    latency_ms: int
    response_id: str | None = None
    extra: dict[str, Any] = {}


class ModelSettings(msgspec.Struct, frozen=True, kw_only=True):
    """One model endpoint. `api_key` is already resolved from the manifest's `${VAR}`: it
    goes into a request header and nowhere else (`repr` hides it; never encode these
    settings into an event). Retries: at most `max_retries` more attempts, and none that
    would start later than `retry_budget_s` after the first."""

    provider: Provider
    model: str
    base_url: str | None = None
    api_key: str | None = None
    temperature: float | None = None
    max_tokens: int | None = None
    timeout_s: float = 60.0
    max_retries: int = 4
    retry_budget_s: float = 120.0
    extra_headers: dict[str, str] = {}

    def __repr__(self) -> str:
        key = "None" if self.api_key is None else "'***'"
        return (f"ModelSettings(provider={self.provider!r}, model={self.model!r}, "
                f"base_url={self.base_url!r}, api_key={key})")

    __str__ = __repr__


__all__ = ["Message", "ModelResponse", "ModelSettings", "Provider", "Role", "ToolCall",
           "ToolChoice", "Usage"]
