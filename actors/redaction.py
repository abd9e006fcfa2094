"""Secrets kept out of what a tool returns: a server (or a proxy before it) quoting the
request's credentials back, in a body, an error or a log line, would otherwise store them
in an event, for every client and the model to read. Used by the HTTP tool and the MCP
link, each with the forms of its own secrets."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REDACTED = "[redacted]"
# A cut tail shorter than this that begins a secret is left: it tells little of a key,
# and would take the last characters of many bodies.
_MIN_CUT_CHARS = 4


def redact(value: Any, secrets: Sequence[str]) -> Any:
    """`value` (text, or a decoded JSON value) with every secret replaced by `[redacted]`;
    `secrets` longest first, so that a secret holding another is replaced whole."""
    if not secrets:
        return value
    if isinstance(value, str):
        for secret in secrets:
            if secret in value:
                value = value.replace(secret, REDACTED)
        return value
    if isinstance(value, dict):
        return {redact(k, secrets): redact(v, secrets) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v, secrets) for v in value]
    return value


def redact_cut(text: str, secrets: Sequence[str]) -> str:
    """Text cut at a limit, redacted: whole secrets replaced, and a tail the cut left of
    one (4 characters or more that begin it) replaced too."""
    text = redact(text, secrets)
    for secret in secrets:
        for k in range(min(len(secret) - 1, len(text)), _MIN_CUT_CHARS - 1, -1):
            if text.endswith(secret[:k]):
                return text[:-k] + REDACTED
    return text


__all__ = ["REDACTED", "redact", "redact_cut"]
