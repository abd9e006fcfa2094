"""Pending approvals in the `toolbus_approvals` bucket: listed by `toolbus approvals`,
swept for timeouts by the approval actor. The event log stays the source of truth; an
entry is only a pointer to an `approval.requested` that has no decision yet."""

from __future__ import annotations

import contextlib

import msgspec
import nats.js.errors

from bus.catalog import WatchedBucket, read_bucket
from bus.connection import Bus
from bus.subjects import APPROVALS_BUCKET
from schemas.policy import PendingApproval

_decoder = msgspec.json.Decoder(PendingApproval)
_encoder = msgspec.json.Encoder()

# How long the marker a decided (or dropped) approval leaves in the bucket lives. A KV
# delete marker is kept forever: one per approval ever decided, each read again by every
# watcher that starts (the approval actor, the gateway, `toolbus approvals`). A purge
# marker with a per-message TTL goes away by itself, and a watcher that starts after it
# never needed it; one that was away longer than this (and resumes from where it was)
# could keep showing the approval as pending, so it is hours, not seconds.
MARKER_TTL_S = 3600.0


def _key(session_id: str, call_id: str) -> str:
    return f"{session_id}.{call_id}"


class ApprovalStore:
    def __init__(self, bus: Bus) -> None:
        self._bus = bus
        self._watched = WatchedBucket(bus, APPROVALS_BUCKET, _decoder.decode)

    async def start(self, timeout: float = 10.0) -> None:
        await self._watched.start(timeout)

    async def stop(self) -> None:
        await self._watched.stop()

    def pending(self) -> list[PendingApproval]:
        return sorted(self._watched.items.values(), key=lambda p: p.requested_at)

    async def put(self, item: PendingApproval) -> None:
        kv = await self._watched.bucket()
        await kv.put(_key(item.session_id, item.call_id), _encoder.encode(item))

    async def delete(self, session_id: str, call_id: str) -> None:
        kv = await self._watched.bucket()
        with contextlib.suppress(nats.js.errors.KeyNotFoundError):
            await kv.purge(_key(session_id, call_id), msg_ttl=MARKER_TTL_S)

    async def load(self) -> list[PendingApproval]:
        """A one-shot read, for the CLI."""
        items = await read_bucket(self._bus, APPROVALS_BUCKET, _decoder.decode)
        return sorted(items, key=lambda p: p.requested_at)
