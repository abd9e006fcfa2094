"""A session's events as server-sent events, for the HTTP gateway (bus/feed.py follows
the session).

Each stored event is one SSE event: `id` its stream sequence (what a reconnecting
client sends back as `Last-Event-ID`), `event` its type, `data` its JSON as stored, with
C1 controls and bidirectional overrides written as JSON escapes (`curl -N` prints them to
a terminal; the value is the same). A text delta (`model.delta`) has no `id`. A quiet
feed becomes a `: keep-alive` comment, which also tells proxies that the connection is
alive.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Final

import msgspec

from bus.feed import SessionFeed
from schemas.requests import escape_controls

_LINES: Final = re.compile(rb"\r\n|\r|\n")
KEEP_ALIVE: Final = b": keep-alive\n\n"


def frame(event: str, data: bytes, seq: int | None = None) -> bytes:
    """One SSE event. `data` is JSON, one line as toolbus encodes it; a line break in it
    anyway becomes a `data:` line of its own, which readers join back with newlines."""
    head = f"id: {seq}\n" if seq is not None else ""
    if not data.isascii() or b"\x7f" in data:  # else nothing to escape (C0 is already)
        text = data.decode("utf-8", "replace")
        escaped = escape_controls(text)
        if escaped != text:
            data = escaped.encode()
    if b"\n" in data or b"\r" in data:
        body = b"".join(b"data: " + line + b"\n" for line in _LINES.split(data))
    else:  # toolbus's JSON, one line
        body = b"data: " + data + b"\n"
    return f"{head}event: {event}\n".encode() + body + b"\n"


def error_frame(code: str, message: str) -> bytes:
    return frame("error", msgspec.json.encode({"code": code, "error": message}))


async def frames(feed: SessionFeed) -> AsyncIterator[bytes]:
    """The SSE bytes of `feed`, until it ends; an `error` event (`stopping`) when it was
    stopped."""
    async for item in feed.items():
        yield KEEP_ALIVE if item is None else frame(item.type, item.data, item.seq)
    if feed.stopped:
        yield error_frame("stopping", "the gateway is stopping: reconnect later with "
                                      f"Last-Event-ID {feed.last}")


__all__ = ["KEEP_ALIVE", "error_frame", "frame", "frames"]
