"""Batched direct gets: reading a stream's messages with no consumer, so nothing is left
behind and the read-only roles (bus/auth.py) need no right to create one."""

from __future__ import annotations

import asyncio
import json

import nats.errors
from nats.aio.msg import Msg

from bus.connection import Bus
from bus.headers import Header, Status
from schemas.errors import BusError, BusTimeoutError

_STATUS = Header.STATUS.value
_SEQUENCE = Header.SEQUENCE.value
_SUBJECT = Header.SUBJECT.value
_NUM_PENDING = Header.NUM_PENDING.value
_NO_RESPONDERS = "503"  # nobody serves direct gets for that stream: it does not exist


async def direct_batch(bus: Bus, stream: str, filt: str, start: int, size: int, *,
                       timeout: float = 10.0, max_bytes: int | None = None
                       ) -> tuple[list[tuple[int, str, bytes]], int]:
    """One batched direct get: up to `size` (seq, subject, data) from `start`, and about
    `max_bytes` of them at most (the server sends at least one message, however large),
    and how many more match. A callback subscription, not `next_msg` per message:
    this is what `toolbus replay` and every cold start spend their time in.
    `BusTimeoutError` when nothing of the batch comes for `timeout` seconds (the replica
    that took the request died, or its reply was lost): never a wait forever. A batch
    that keeps coming (large chunks on a slow link) is not cut short."""
    nc = bus.nc
    batch: list[tuple[int, str, bytes]] = []
    loop = asyncio.get_running_loop()
    done: asyncio.Future[int] = loop.create_future()
    last_pending = 0
    quiet: asyncio.Timeout | None = None

    async def on_msg(msg: Msg) -> None:
        nonlocal last_pending
        if quiet is not None:
            quiet.reschedule(loop.time() + timeout)
        hdrs = msg.headers or {}
        status = hdrs.get(_STATUS)
        if status is not None and not msg.data:
            if done.done():
                return
            if status in (Status.END_OF_BATCH, Status.NOT_FOUND):
                done.set_result(last_pending)
            elif status == _NO_RESPONDERS:
                done.set_exception(BusError(
                    f"stream {stream} is not on this server. Is this server toolbus's? "
                    "`toolbus up` (or any actor) creates its streams"))
            else:
                description = " ".join(str(hdrs.get(Header.DESCRIPTION.value, "")).split())
                done.set_exception(BusTimeoutError(
                    f"reading {filt}: server answered {status} {description}".rstrip()))
            return
        batch.append((int(hdrs[_SEQUENCE]), hdrs[_SUBJECT], msg.data))
        last_pending = int(hdrs.get(_NUM_PENDING, "0"))

    reconnects = nc.stats["reconnects"]
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=on_msg, pending_msgs_limit=4 * size)
    try:
        req: dict[str, str | int] = {"seq": start, "next_by_subj": filt, "batch": size}
        if max_bytes is not None:
            req["max_bytes"] = max_bytes
        subject = f"$JS.API.DIRECT.GET.{stream}"
        with bus.fails_if_denied(subject, done):  # a role that may not read this stream
            await nc.publish(subject, json.dumps(req).encode(), reply=inbox)
            try:
                async with asyncio.timeout(timeout) as quiet:
                    pending = await done
            except TimeoutError:
                if not nc.is_connected or nc.stats["reconnects"] != reconnects:
                    # Not a server that went quiet: the connection went away.
                    raise BusTimeoutError(
                        f"reading {filt}: lost the connection to NATS at {bus.url}, and "
                        f"the read did not finish within {timeout:g} s") from None
                raise BusTimeoutError(f"reading {filt}: nothing more of the batch from seq "
                                      f"{start} came for {timeout:g} s") from None
    finally:
        await sub.unsubscribe()
    return batch, pending


async def direct_last(bus: Bus, stream: str, subject: str, *, timeout: float = 5.0
                      ) -> bytes | None:
    """The last message on `subject` of `stream`, None if there is none."""
    try:
        msg = await bus.nc.request(f"$JS.API.DIRECT.GET.{stream}.{subject}", b"",
                                   timeout=timeout)
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as exc:
        raise BusTimeoutError(f"reading {subject}: no answer in {timeout:g} s") from exc
    hdrs = msg.headers or {}
    if hdrs.get(_STATUS) and not msg.data:
        return None
    return bytes(msg.data)
