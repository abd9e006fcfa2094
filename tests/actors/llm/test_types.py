"""The provider layer's data: what the planner stores, and what it must never show."""

from __future__ import annotations

import msgspec
import pytest

from actors.llm import Message, ModelResponse, ModelSettings, ToolCall, Usage, complete
from schemas.errors import ConfigError, ModelError, ToolbusError
from tests.actors.llm.conftest import KEY


def test_settings_never_show_the_key() -> None:
    settings = ModelSettings(provider="anthropic", model="claude-test", api_key=KEY)
    for shown in (repr(settings), str(settings), f"{settings}", repr([settings])):
        assert KEY not in shown
        assert "api_key='***'" in shown


def test_messages_and_replies_round_trip_through_json() -> None:
    call = ToolCall(id="c1", name="ns:tool", arguments={"a": [1, 2]},
                    extra={"thoughtSignature": "sig"})
    messages = [Message(role="user", text="hi"), Message(role="assistant", tool_calls=[call]),
                Message(role="tool", tool_call_id="c1", name="ns:tool", text="{}",
                        is_error=True)]
    encoded = msgspec.json.encode(messages)
    assert msgspec.json.decode(encoded, type=list[Message]) == messages
    reply = ModelResponse(text="", tool_calls=[call], finish_reason="tool_calls",
                          usage=Usage(input_tokens=3, output_tokens=4), model="m",
                          latency_ms=12, response_id="r1", extra={"attempts": 1})
    assert msgspec.json.decode(msgspec.json.encode(reply), type=ModelResponse) == reply


def test_model_error_is_a_toolbus_error_that_says_what_to_do() -> None:
    err = ModelError("auth", "invalid x-api-key.", provider="anthropic", status=401)
    assert isinstance(err, ToolbusError)
    assert str(err) == ("anthropic answered 401 (auth): invalid x-api-key. Check the API "
                        "key the manifest gives this model (its ${VAR})".replace(
                            "Check", "check"))
    later = err.after(3, "no more")
    assert (later.attempts, later.kind, later.status) == (3, "auth", 401)
    assert "after 3 attempts" in str(later) and "no more" in str(later)
    assert not err.partial
    assert ModelError("partial_stream", "x", provider="p", retryable=True).partial


async def test_an_unknown_provider_is_a_config_error() -> None:
    settings = ModelSettings(provider="mistral", model="m")  # type: ignore[arg-type]  # on purpose
    with pytest.raises(ConfigError, match="unknown model provider 'mistral'"):
        await complete(settings, system=None, messages=[], tools=[])
