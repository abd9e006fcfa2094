"""Failures, for all four APIs against the scripted fake server: what is retried, how
long it waits, where it stops, and that the key stays out of every error and log."""

from __future__ import annotations

import logging
import socket
import traceback
from datetime import UTC, datetime

import pytest

from actors.llm import Message, ModelSettings, complete
from actors.llm.retry import Backoff, classify, redact, retry_after
from schemas.errors import ModelError
from tests.actors.llm.conftest import KEY, TOOLS
from tests.llm_servers import Call, FakeProvider, Step, error, reply

PROVIDERS = ["openai", "openai-responses", "anthropic", "gemini"]
ASK = [Message(role="user", text="Weather?")]
# Events each API sends before the first text delta of `reply(..., stream=True)`.
BEFORE_TEXT = {"openai": 1, "openai-responses": 2, "anthropic": 3, "gemini": 0}
# Events at the end of a stream that make it whole: chat's finish_reason chunk (the usage
# chunk and [DONE] after it are optional), `response.completed`, `message_delta` +
# `message_stop`, Gemini's chunk with a finishReason.
CLOSING = {"openai": 3, "openai-responses": 1, "anthropic": 2, "gemini": 1}


def settings(fake: FakeProvider, provider: str, **kw: object) -> ModelSettings:
    return ModelSettings(provider=provider, model="m-test", api_key=KEY,  # type: ignore[arg-type]  # parametrized
                         base_url=fake.base_url(provider), **kw)  # type: ignore[arg-type]  # test knobs


class Deltas(list[str]):
    async def __call__(self, text: str) -> None:
        self.append(text)


def waits(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage().rsplit(" in ", 1)[1] for r in caplog.records
            if r.name == "toolbus.llm" and "attempt" in r.getMessage()]


def assert_no_key(err: BaseException, caplog: pytest.LogCaptureFixture) -> None:
    told = "".join(traceback.format_exception(err))
    assert KEY not in told
    assert "sk-test" not in told
    for record in caplog.records:
        assert KEY not in record.getMessage()
        assert KEY not in (record.exc_text or "")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("provider", PROVIDERS)
async def test_429_with_retry_after_waits_what_the_server_said_then_succeeds(
        fake: FakeProvider, caplog: pytest.LogCaptureFixture, provider: str,
        stream: bool) -> None:
    caplog.set_level(logging.WARNING, "toolbus.llm")
    fake.script(error(provider, 429, "Rate limit reached", headers={"retry-after": "0"}),
                reply(provider, "Sunny.", stream=stream))
    deltas = Deltas()
    answer = await complete(settings(fake, provider), system=None, messages=ASK, tools=TOOLS,
                            on_delta=deltas if stream else None)
    assert answer.text == "Sunny."
    assert answer.extra["attempts"] == 2
    assert len(fake.requests) == 2
    assert fake.requests[0].body == fake.requests[1].body  # the same request again
    assert waits(caplog) == ["0.00 s"]  # the server's 0 s, not a backoff (>= 0.25 s)
    assert "".join(deltas) == ("Sunny." if stream else "")


async def test_a_gemini_429_waits_the_retry_delay_its_body_gives(
        fake: FakeProvider, caplog: pytest.LogCaptureFixture) -> None:
    # Gemini's wait is in the body (google.rpc.RetryInfo), with no retry-after header: it
    # was backed off a few tenths of a second, four times, all refused (its per-minute
    # quotas ask for tens of seconds), and a daily quota's "52758s" was retried too.
    caplog.set_level(logging.WARNING, "toolbus.llm")
    quota = error("gemini", 429, "You exceeded your current quota")
    quota.body["error"]["details"] = [
        {"@type": "type.googleapis.com/google.rpc.QuotaFailure", "violations": []},
        {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "0.125s"}]
    fake.script(quota, reply("gemini", "Sunny."))
    answer = await complete(settings(fake, "gemini"), system=None, messages=ASK, tools=TOOLS)
    assert (answer.text, answer.extra["attempts"]) == ("Sunny.", 2)
    assert waits(caplog) == ["0.12 s"]
    daily = error("gemini", 429, "You exceeded your current quota")
    daily.body["error"]["details"] = [
        {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "52758s"}]
    fake.reset()
    fake.script(daily)
    with pytest.raises(ModelError) as caught:
        await complete(settings(fake, "gemini"), system=None, messages=ASK, tools=TOOLS)
    assert (caught.value.kind, caught.value.attempts) == ("rate_limited", 1)
    assert "wait 5.28e+04 s" in str(caught.value)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("provider", PROVIDERS)
async def test_500_is_retried_with_backoff_then_succeeds(
        fake: FakeProvider, caplog: pytest.LogCaptureFixture, provider: str,
        stream: bool) -> None:
    caplog.set_level(logging.WARNING, "toolbus.llm")
    fake.script(error(provider, 500, "Internal error"),
                reply(provider, "Sunny.", stream=stream))
    answer = await complete(settings(fake, provider), system=None, messages=ASK, tools=TOOLS,
                            on_delta=Deltas() if stream else None)
    assert answer.text == "Sunny."
    assert answer.extra["attempts"] == 2
    assert len(fake.requests) == 2
    (wait,) = waits(caplog)
    assert 0.25 <= float(wait.split()[0]) <= 0.5  # the first backoff step, jittered


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_401_ends_the_call_with_the_providers_message_and_without_the_key(
        fake: FakeProvider, caplog: pytest.LogCaptureFixture, provider: str) -> None:
    caplog.set_level(logging.DEBUG)
    masked = KEY[:8] + "*" * 20 + KEY[-4:]
    fake.script(error(provider, 401, f"Incorrect API key provided: {KEY} ({masked})"))
    with pytest.raises(ModelError) as caught:
        await complete(settings(fake, provider), system=None, messages=ASK, tools=TOOLS)
    err = caught.value
    assert (err.kind, err.status, err.retryable, err.attempts) == ("auth", 401, False, 1)
    assert "Incorrect API key provided" in err.message
    assert str(err).startswith(f"{provider} answered 401 (auth): Incorrect API key provided")
    assert "check the API key" in str(err)
    assert masked not in str(err)
    assert len(fake.requests) == 1
    assert_no_key(err, caplog)


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_400_ends_the_call_as_a_bad_request(fake: FakeProvider, provider: str) -> None:
    fake.script(error(provider, 400, "tools.0.name: String should match pattern"))
    with pytest.raises(ModelError) as caught:
        await complete(settings(fake, provider), system=None, messages=ASK, tools=TOOLS)
    assert (caught.value.kind, caught.value.retryable) == ("bad_request", False)
    assert "String should match pattern" in str(caught.value)
    assert len(fake.requests) == 1


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_retries_stop_after_max_retries(fake: FakeProvider, provider: str) -> None:
    fake.script(*[error(provider, 503, "Overloaded", headers={"retry-after-ms": "1"})] * 4)
    with pytest.raises(ModelError) as caught:
        await complete(settings(fake, provider, max_retries=2), system=None, messages=ASK,
                       tools=TOOLS)
    err = caught.value
    assert (err.kind, err.status, err.retryable, err.attempts) == ("unavailable", 503, True, 3)
    assert "after 3 attempts" in str(err)
    assert len(fake.requests) == 3


async def test_a_retry_after_beyond_the_budget_ends_the_call_at_once(
        fake: FakeProvider) -> None:
    fake.script(error("anthropic", 429, "Rate limited", headers={"retry-after": "3600"}),
                reply("anthropic", "never asked for"))
    with pytest.raises(ModelError) as caught:
        await complete(settings(fake, "anthropic", retry_budget_s=30), system=None,
                       messages=ASK, tools=TOOLS)
    err = caught.value
    assert (err.kind, err.retryable, err.attempts) == ("rate_limited", True, 1)
    assert "retry budget of 30 s" in str(err)
    assert len(fake.requests) == 1


async def test_x_should_retry_false_is_obeyed(fake: FakeProvider) -> None:
    fake.script(error("openai", 500, "do not retry", headers={"x-should-retry": "false"}),
                reply("openai", "never asked for"))
    with pytest.raises(ModelError) as caught:
        await complete(settings(fake, "openai"), system=None, messages=ASK, tools=TOOLS)
    assert caught.value.retryable is False
    assert len(fake.requests) == 1


async def test_a_refused_connection_is_retried_then_reported_unavailable(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = ModelSettings(provider="gemini", model="m", api_key=KEY, max_retries=1,
                      base_url=f"http://127.0.0.1:{port}/v1beta")
    with pytest.raises(ModelError) as caught:
        await complete(s, system=None, messages=ASK, tools=TOOLS)
    err = caught.value
    assert (err.kind, err.status, err.retryable, err.attempts) == ("unavailable", None, True, 2)
    assert f"could not connect to 127.0.0.1:{port}" in str(err), err
    assert len(waits(caplog)) == 1
    assert_no_key(err, caplog)


async def test_a_timeout_is_retried(fake: FakeProvider) -> None:
    fake.script(Step(body={}, delay_s=2.0), reply("openai", "Sunny."))
    answer = await complete(settings(fake, "openai", timeout_s=0.3), system=None,
                            messages=ASK, tools=TOOLS)
    assert (answer.text, answer.extra["attempts"]) == ("Sunny.", 2)


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_stream_broken_after_text_raises_partial_stream_and_is_not_retried(
        fake: FakeProvider, caplog: pytest.LogCaptureFixture, provider: str) -> None:
    caplog.set_level(logging.DEBUG)
    broken = reply(provider, stream=True, chunks=["Sunny ", "in ", "Paris."])
    broken.break_after = BEFORE_TEXT[provider] + 1
    fake.script(broken, reply(provider, "never asked for", stream=True))
    deltas = Deltas()
    with pytest.raises(ModelError) as caught:
        await complete(settings(fake, provider), system=None, messages=ASK, tools=TOOLS,
                       on_delta=deltas)
    err = caught.value
    assert deltas == ["Sunny "]
    assert (err.kind, err.partial, err.retryable, err.attempts) == (
        "partial_stream", True, True, 1)
    assert "the stream broke after text was delivered" in str(err)
    assert len(fake.requests) == 1
    assert_no_key(err, caplog)


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_stream_broken_before_any_text_is_retried_whole(
        fake: FakeProvider, provider: str) -> None:
    broken = reply(provider, stream=True, chunks=["Sunny ", "in ", "Paris."])
    broken.break_after = BEFORE_TEXT[provider]
    fake.script(broken, reply(provider, stream=True, chunks=["Sunny ", "in ", "Paris."]))
    deltas = Deltas()
    answer = await complete(settings(fake, provider, retry_budget_s=5), system=None,
                            messages=ASK, tools=TOOLS, on_delta=deltas)
    assert deltas == ["Sunny ", "in ", "Paris."]  # each delivered once
    assert (answer.text, answer.extra["attempts"]) == ("Sunny in Paris.", 2)


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_stream_that_ends_before_its_last_event_is_not_a_reply(
        fake: FakeProvider, provider: str) -> None:
    calls = [Call("c1", "clock__now", {})]
    cut = reply(provider, calls=calls, stream=True)
    assert cut.events is not None
    cut.events = cut.events[:-CLOSING[provider]]  # ends cleanly, but it is not whole
    fake.script(cut, reply(provider, calls=calls, stream=True))
    answer = await complete(settings(fake, provider, retry_budget_s=5), system=None,
                            messages=ASK, tools=TOOLS, on_delta=Deltas())
    assert [c.name for c in answer.tool_calls] == ["clock:now"]
    assert answer.extra["attempts"] == 2


@pytest.mark.parametrize(("provider", "event"), [
    ("anthropic", ("error", {"type": "error", "error": {"type": "overloaded_error",
                                                        "message": "Overloaded"}})),
    ("openai-responses", ("response.failed", {"type": "response.failed", "response": {
        "id": "r", "status": "failed", "error": {"code": "server_error",
                                                 "message": "The server had an error"}}})),
    ("openai", (None, {"error": {"message": "The server had an error",
                                 "type": "server_error"}})),
    ("gemini", (None, {"error": {"code": 503, "message": "The model is overloaded",
                                 "status": "UNAVAILABLE"}})),
])
async def test_an_error_event_before_any_text_is_retried(
        fake: FakeProvider, provider: str, event: tuple[str | None, object]) -> None:
    fake.script(Step(events=[event]), reply(provider, "Sunny.", stream=True))
    answer = await complete(settings(fake, provider, retry_budget_s=5), system=None,
                            messages=ASK, tools=TOOLS, on_delta=Deltas())
    assert (answer.text, answer.extra["attempts"]) == ("Sunny.", 2)


async def test_an_error_event_after_text_is_a_partial_stream(fake: FakeProvider) -> None:
    events = reply("anthropic", stream=True, chunks=["Sun", "ny"]).events
    assert events is not None
    events.insert(4, ("error", {"type": "error", "error": {"type": "overloaded_error",
                                                           "message": "Overloaded"}}))
    fake.script(Step(events=events))
    with pytest.raises(ModelError) as caught:
        await complete(settings(fake, "anthropic"), system=None, messages=ASK, tools=TOOLS,
                       on_delta=Deltas())
    assert caught.value.kind == "partial_stream"
    assert "Overloaded" in str(caught.value)


async def test_the_key_is_in_the_auth_header_and_nowhere_else_in_the_request(
        fake: FakeProvider) -> None:
    for provider in PROVIDERS:
        fake.script(reply(provider, "ok"))
        await complete(settings(fake, provider), system=None, messages=ASK, tools=TOOLS)
    for request in fake.requests:
        holders = [k for k, v in request.headers.items() if KEY in v]
        assert holders in (["authorization"], ["x-api-key"], ["x-goog-api-key"])
        assert KEY not in request.raw.decode()
        assert KEY not in request.path and not request.query


# --- the rules, as plain functions --------------------------------------------------------


def test_statuses_are_classified_as_the_sdks_do() -> None:
    assert classify(401, {}) == ("auth", False)
    assert classify(403, {}) == ("auth", False)
    assert classify(400, {}) == ("bad_request", False)
    assert classify(404, {}) == ("bad_request", False)
    assert classify(408, {}) == ("unavailable", True)
    assert classify(409, {}) == ("unavailable", True)
    assert classify(429, {}) == ("rate_limited", True)
    assert classify(529, {}) == ("unavailable", True)
    assert classify(400, {"x-should-retry": "true"}) == ("bad_request", True)


def test_retry_after_reads_milliseconds_seconds_and_http_dates() -> None:
    now = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
    assert retry_after({"retry-after-ms": "250", "retry-after": "9"}) == 0.25
    assert retry_after({"retry-after": "2"}) == 2.0
    assert retry_after({"retry-after": "Thu, 01 Jan 2026 12:00:30 GMT"}, now) == 30.0
    assert retry_after({"retry-after": "Thu, 01 Jan 2026 11:00:00 GMT"}, now) == 0.0
    assert retry_after({"retry-after": "soon"}) is None
    assert retry_after({}) is None


def test_a_retry_after_date_past_any_year_is_no_hint_not_a_crash() -> None:
    # parsedate_to_datetime raises OverflowError, neither TypeError nor ValueError, for a
    # year or an offset too large for a C int: it escaped the model call, and the planner
    # failed the turn `internal` instead of retrying the 429.
    for value in ("Mon, 01 Jan 99999999999999999999 00:00:00 GMT",
                  "Mon, 01 Jan 2024 99999999999999999999:00:00 GMT",
                  "Mon, 01 Jan 2024 00:00:00 +99999999999999999999"):
        assert retry_after({"retry-after": value}) is None


def test_backoff_doubles_up_to_its_cap_with_jitter() -> None:
    backoff = Backoff(first_s=0.5, max_s=4.0)
    for retry, top in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (9, 4.0)]:
        assert top / 2 <= backoff.delay(retry) <= top


def test_redact_removes_the_key_and_key_shaped_strings() -> None:
    text = ("bad key sk-proj-abcdefghijklmnop, or sk-ant-api03-XYZXYZXYZ, "
            "AIzaSyA1234567890abcdefgh, masked sk-****************wxyz, mine hunter2")
    clean = redact(text, "hunter2")
    for leak in ("abcdefghijklmnop", "XYZXYZ", "AIzaSy", "wxyz", "hunter2"):
        assert leak not in clean
    assert clean.startswith("bad key [redacted]")


async def test_an_error_event_quoting_a_plain_key_does_not_repeat_it(
        fake: FakeProvider, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    plain = "hunter2-local-server"  # no known key shape: only the exact match can catch it
    fake.script(Step(events=[("error", {"type": "error", "error": {
        "type": "authentication_error", "message": f"key {plain} is revoked"}})]))
    with pytest.raises(ModelError) as caught:
        await complete(ModelSettings(provider="anthropic", model="m", api_key=plain,
                                     base_url=fake.base_url("anthropic")),
                       system=None, messages=ASK, tools=TOOLS, on_delta=Deltas())
    assert caught.value.kind == "auth"
    assert "key [redacted] is revoked" in str(caught.value)
    assert plain not in "".join(traceback.format_exception(caught.value))
    assert all(plain not in r.getMessage() for r in caplog.records)


async def test_a_reply_in_the_wrong_shape_is_unavailable_not_a_crash(
        fake: FakeProvider) -> None:
    fake.script(*[Step(body={"choices": [{"message": "not an object"}]})] * 2)
    with pytest.raises(ModelError) as caught:
        await complete(settings(fake, "openai", max_retries=1, retry_budget_s=5), system=None,
                       messages=ASK, tools=TOOLS)
    assert (caught.value.kind, caught.value.attempts) == ("unavailable", 2)
    assert "does not have the API's shape" in str(caught.value)


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_redirect_is_not_followed_and_the_error_says_where_it_points(
        fake: FakeProvider, provider: str, caplog: pytest.LogCaptureFixture) -> None:
    # Followed, the key would go to whatever host the redirect names (a private address
    # included). Not followed, the error said "answered 307: (empty body)".
    elsewhere = "http://169.254.169.254/v1/chat"
    fake.script(Step(status=307, headers={"location": elsewhere}))
    with pytest.raises(ModelError) as caught:
        await complete(settings(fake, provider, max_retries=2), system=None, messages=ASK,
                       tools=TOOLS)
    err = caught.value
    assert err.status == 307 and err.kind == "bad_request" and not err.retryable
    assert f"redirects to {elsewhere}" in err.message and "base_url" in err.message
    assert len(fake.requests) == 1
    assert_no_key(err, caplog)
