"""Core NATS request/reply endpoints served by actors (state queries, approvals)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from bus.connection import Bus
from schemas.errors import BusError, RpcError, ToolbusError

log = logging.getLogger("toolbus.bus")

Handler = Callable[[str, bytes], Awaitable[bytes]]


class Responder:
    """Answers requests on `subject` (queue-grouped, so N processes share them).

    An error is answered `{"ok": false, "code": ..., "error": message}`: a handler's
    `RpcError` with its code, any other `ToolbusError` as `invalid`, anything else is
    logged and answered `internal`, so a client never waits for a reply that is not
    coming. `check_reply` turns such an answer back into an `RpcError`.
    """

    def __init__(self, bus: Bus, subject: str, handler: Handler, *, queue: str) -> None:
        self._bus = bus
        self._subject = subject
        self._handler = handler
        self._queue = queue
        self._sub: Subscription | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._sub = await self._bus.nc.subscribe(self._subject, queue=self._queue, cb=self._on)

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        for task in list(self._tasks):
            task.cancel()

    async def _on(self, msg: Msg) -> None:
        task = asyncio.create_task(self._answer(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, msg: Msg) -> None:
        if not msg.reply.startswith(_REPLY_PREFIXES):
            # No reply subject, or one naming anything but an inbox (an event subject, a
            # catalog key): answering it would publish there with this actor's rights.
            if msg.reply:
                log.warning("request on %s refused: its reply subject %.80s is not an "
                            "inbox", msg.subject, msg.reply)
            return
        try:
            reply = await self._handler(msg.subject, msg.data)
        except RpcError as exc:
            reply = _error(exc.code, exc.message, exc.details)
        except BusError as exc:  # an outage, not a bad request: worth retrying
            reply = _error("unavailable", str(exc))
        except ToolbusError as exc:
            reply = _error("invalid", str(exc))
        except Exception as exc:
            log.exception("request on %s failed", msg.subject)
            reply = _error("internal", f"internal error: {type(exc).__name__}")
        if len(reply) > self._bus.nc.max_payload - 1024:
            reply = _error("too_large", f"the answer is {len(reply)} bytes, over the "
                                        f"server's max payload ({self._bus.nc.max_payload})")
        with contextlib.suppress(Exception):
            await self._bus.nc.publish(msg.reply, reply)


# Where answers may go: a requester's inbox, or the private subject NATS gives a request
# that crossed from another account (bus/auth.py).
_REPLY_PREFIXES = ("_INBOX.", "_INBOX_", "_R_.")  # `_INBOX_<user>.`: bus/auth.py


class _ErrorReply(msgspec.Struct):
    ok: bool = True
    code: str = "internal"
    error: str = ""


_error_decoder = msgspec.json.Decoder(_ErrorReply)


def _error(code: str, message: str, details: dict[str, Any] | None = None) -> bytes:
    return msgspec.json.encode({"ok": False, "code": code, "error": message,
                                **(details or {})})


def check_reply(data: bytes) -> bytes:
    """The reply, or `RpcError(code, message)` if it is an error answer."""
    if data.startswith(b'{"ok":false'):
        answer = _error_decoder.decode(data)
        raise RpcError(answer.code, answer.error)
    return data
