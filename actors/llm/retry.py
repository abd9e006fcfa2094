"""When a failed model call is tried again, and how long to wait.

Retried: connection errors and timeouts, 408, 409, 429 and 5xx, as the OpenAI and
Anthropic SDKs and Temporal's model activity do; an `x-should-retry` header overrides
that either way. The wait is the server's (`retry-after-ms`, then `retry-after` in seconds
or as an HTTP date, then a `google.rpc.RetryInfo` in the error body, where Gemini gives
it), else exponential backoff with jitter. Bounded twice: at most
`max_retries` more attempts, and no attempt starts after `budget_s` from the first (a
`retry-after` longer than what is left ends the call at once instead of sleeping).

Not retried here: 400/401/403 and other 4xx (the same request fails the same way), and a
stream that broke after text was delivered (`partial_stream`): its deltas are already out,
so only the caller can decide to make the whole call again.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import random
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Final, TypeVar

import msgspec

from schemas.errors import ModelError
from schemas.requests import INVISIBLE, strip_controls

log = logging.getLogger("toolbus.llm")

T = TypeVar("T")

RETRY_STATUSES: Final = frozenset({408, 409, 429})
MESSAGE_LIMIT: Final = 500  # characters of a provider's error message kept


class Backoff(msgspec.Struct, frozen=True, kw_only=True):
    """Exponential backoff with jitter: `first_s * 2**(n-1)`, capped at `max_s`, then
    scaled by a random factor in [0.5, 1] so that clients that failed together spread."""

    first_s: float = 0.5
    max_s: float = 8.0

    def delay(self, retry: int) -> float:
        base: float = min(self.max_s, self.first_s * 2.0 ** (retry - 1))
        return base * (0.5 + random.random() / 2)


DEFAULT_BACKOFF: Final = Backoff()


def classify(status: int, headers: Mapping[str, str]) -> tuple[str, bool]:
    """(kind, retryable) of an HTTP error status."""
    if status in (401, 403):
        kind, retryable = "auth", False
    elif status == 429:
        kind, retryable = "rate_limited", True
    elif status in RETRY_STATUSES or status >= 500:
        kind, retryable = "unavailable", True
    else:
        kind, retryable = "bad_request", False
    should = headers.get("x-should-retry", "").strip().lower()
    if should in ("true", "false"):
        retryable = should == "true"
    return kind, retryable


def retry_after(headers: Mapping[str, str], now: datetime | None = None) -> float | None:
    """The server's wait hint in seconds, or None."""
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, OverflowError):  # a year or offset past any C int
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


# Shapes of API keys that providers echo, whole or masked, in their error messages.
# The masked one is a word with four asterisks in it, tried only from a word's start:
# tried from every character, a long word without them cost the square of its length.
_KEYLIKE: Final = re.compile(
    r"sk-[A-Za-z0-9_\-*.]{6,}"  # OpenAI, Anthropic (sk-ant-...), and compatible servers
    r"|AIza[0-9A-Za-z_\-]{10,}"  # Google
    r"|(?<!\S)\S*?\*{4,}\S*"  # a masked key: "sk-proj-****...abcd"
)


def redact(text: str, key: str | None) -> str:
    """`text` without the key, nor anything shaped like one. Invisible characters go
    first: a key with one inside would otherwise pass here, and be whole again once
    `clip` strips them."""
    text = INVISIBLE.sub("", str(strip_controls(text)))
    if key:
        # Also as a library quotes it in its errors, escaped: b'Bearer sk-a\\nb'.
        for form in {key, str(strip_controls(key)), repr(key)[1:-1],
                     repr(key.encode(errors="replace"))[2:-1]}:
            if form:
                text = text.replace(form, "[redacted]")
        text = _without_pieces_of(text, str(strip_controls(key)))
    return _KEYLIKE.sub("[redacted]", text)


_KEY_PIECE: Final = 8  # characters of a key that are enough to be taken for part of it


def _without_pieces_of(text: str, key: str) -> str:
    """`text` without any run of `_KEY_PIECE` or more characters of `key`: a server
    echoing the key split (a space in it, a line break) or cut would otherwise show most
    of it. Every such run is covered by the occurrences of the key's windows of that
    length, found with `str.find` (a 2 MB body costs milliseconds)."""
    if len(key) < 12:
        return text
    spans: list[tuple[int, int]] = []
    # Each distinct piece once (a key repeating itself would search a body once per
    # repeat); only pieces that look random (a digit, or both cases): a placeholder key
    # (`sk-no-key-required`) would otherwise take words out of every error ("required").
    for window in dict.fromkeys(key[i:i + _KEY_PIECE]
                                for i in range(len(key) - _KEY_PIECE + 1)):
        if not (any(c.isdigit() for c in window) or
                (any(c.islower() for c in window) and any(c.isupper() for c in window))):
            continue
        at = text.find(window)
        while at != -1:
            spans.append((at, at + _KEY_PIECE))
            at = text.find(window, at + 1)
    merged: list[list[int]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    out: list[str] = []
    last = 0
    for a, b in merged:
        out += [text[last:a], "[redacted]"]
        last = b
    out.append(text[last:])
    return "".join(out)


def clip(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """A provider's text for an error message or a log line: on one line, without control
    or invisible format characters, at most `limit` characters."""
    text = " ".join(str(strip_controls(text)).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def provider_message(body: bytes) -> str:
    """The error message of an error body, in any of the four APIs' shapes:
    `{"error": {"message", "type"}}` (OpenAI, Anthropic), `{"error": {"message",
    "status"}}` (Gemini, sometimes wrapped in a list), or plain text."""
    try:
        data: Any = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):
        return body.decode(errors="replace").strip() or "(empty body)"
    if isinstance(data, list) and data:
        data = data[0]
    if not isinstance(data, dict):
        return str(data)
    error = data.get("error", data)
    if isinstance(error, str):
        return error
    if isinstance(error, dict):
        message = error.get("message") or error.get("detail") or ""
        label = error.get("type") or error.get("status") or error.get("code")
        if message and label and str(label) not in str(message):
            return f"{message} ({label})"
        if message:
            return str(message)
    return msgspec.json.encode(data).decode()


def http_error(provider: str, status: int, headers: Mapping[str, str], body: bytes,
               key: str | None) -> ModelError:
    kind, retryable = classify(status, headers)
    location = headers.get("location")
    if 300 <= status < 400 and location:
        # Never followed: the key would go with the request to whatever host it names.
        where = clip(redact(location, key), 200)
        message = (f"the model server redirects to {where}: set the model's base_url to "
                   "where it points (redirects are not followed, so that the key goes "
                   "nowhere else)")
    else:
        message = provider_message(body)
    wait = retry_after(headers)
    if wait is None:
        wait = retry_delay(body)
    return ModelError(kind, clip(redact(message, key)), provider=provider,
                      status=status, retryable=retryable, retry_after_s=wait)


_DURATION: Final = re.compile(r"(\d{1,12}(?:\.\d{1,9})?)s")


def retry_delay(body: bytes) -> float | None:
    """The wait an error body asks for, in seconds, or None: Gemini gives it there, not in
    a header (`{"error": {"details": [{"@type": "...google.rpc.RetryInfo", "retryDelay":
    "37s"}]}}`)."""
    if b"RetryInfo" not in body:
        return None
    try:
        data: Any = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):
        return None
    if isinstance(data, list) and data:
        data = data[0]
    error = data.get("error") if isinstance(data, dict) else None
    details = error.get("details") if isinstance(error, dict) else None
    for detail in details if isinstance(details, list) else []:
        if isinstance(detail, dict) and str(detail.get("@type", "")).endswith(
                "google.rpc.RetryInfo"):
            found = _DURATION.fullmatch(str(detail.get("retryDelay", "")))
            if found:
                return float(found[1])
    return None


async def with_retries(attempt: Callable[[], Awaitable[T]], *, max_retries: int,
                       budget_s: float, backoff: Backoff = DEFAULT_BACKOFF,
                       ) -> tuple[T, int]:
    """Run `attempt` until it succeeds or a failure is final; (result, attempts made).
    The last failure is raised as is, told with the number of attempts."""
    start = time.monotonic()
    made = 0
    while True:
        made += 1
        try:
            return await attempt(), made
        except ModelError as err:
            if not err.retryable or err.partial or made > max_retries:
                raise err.after(made) from err.__cause__
            wait = err.retry_after_s if err.retry_after_s is not None else backoff.delay(made)
            left = budget_s - (time.monotonic() - start)
            if wait > left:
                raise err.after(made, f"the next attempt would start after the retry "
                                      f"budget of {budget_s:g} s (wait {wait:.3g} s)",
                                ) from err.__cause__
            log.warning("%s: model call failed (%s, status %s: %s); attempt %d of %d in "
                        "%.2f s", err.provider, err.kind, err.status, err.message, made + 1,
                        max_retries + 1, wait)
            await asyncio.sleep(wait)
