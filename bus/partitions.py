"""Partition ownership: which process of an actor kind consumes which partitions.

Sessions are spread over N partitions (bus/subjects.py); each partition has its own
durable consumers. Any number of processes of one kind (`group`: the session actor, the
planner) share the partitions through leases in the `toolbus_partitions` bucket:

- each member refreshes `<group>.m.<instance>` every `LEASE_RENEW_S`;
- it wants `ceil(N / members)` partitions: it takes free ones (`<group>.p<N>`, created
  only if absent), renews those it holds (an update checked against its own revision),
  and lets go of extras, so a new member gets its share within two rounds;
- a lease not renewed for `LEASE_TTL_S` expires with the bucket's TTL: the partitions of
  a process that died are taken by the others within seconds, and its unacknowledged
  messages come to them after the consumers' ack wait.

A member consumes a partition only while it holds the lease. Two members can overlap for
a moment (a lease expired under a process that was only slow); the per-session
concurrency check of every append keeps that safe, as it keeps racing writers safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import uuid
import zlib
from collections.abc import Awaitable, Callable

import nats.js.errors
from nats.js.kv import KeyValue

from bus.connection import Bus
from bus.subjects import LEASES_BUCKET
from bus.tasks import stop_task
from schemas.defaults import LEASE_RENEW_S

log = logging.getLogger("toolbus.partitions")

OnChange = Callable[[int], Awaitable[None]]


def member_name() -> str:
    """A name for this process among the members of a group: host, pid and a few random
    characters (two members in one process stay apart)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class PartitionOwner:
    def __init__(self, bus: Bus, group: str, instance: str, *, on_acquire: OnChange,
                 on_release: OnChange, partitions: int | None = None,
                 renew_s: float = LEASE_RENEW_S) -> None:
        self._bus = bus
        self._group = group
        self._instance = instance
        self._partitions = partitions
        self._on_acquire = on_acquire
        self._on_release = on_release
        self._renew_s = renew_s
        self._kv: KeyValue | None = None
        self.owned: dict[int, int] = {}  # partition -> the revision of our lease
        self._task: asyncio.Task[None] | None = None

    @property
    def partitions(self) -> int:
        return self._partitions or self._bus.partitions

    def _lease(self, part: int) -> str:
        return f"{self._group}.p{part}"

    async def start(self) -> None:
        """Join, and take a share of the partitions before returning."""
        self._kv = await self._bus.js.key_value(LEASES_BUCKET)
        await self._round()
        self._task = asyncio.create_task(self._loop(), name=f"leases:{self._group}")

    async def stop(self) -> None:
        """Stop consuming every partition held, then give the leases back at once, so
        another member takes them without waiting for them to expire."""
        await stop_task(self._task)
        held = dict(self.owned)
        self.owned.clear()
        for part in sorted(held):
            await self._on_release(part)
        kv = self._kv
        if kv is None or not self._bus.nc.is_connected:
            return  # the leases expire by themselves
        deletes = [kv.delete(self._lease(p), last=r) for p, r in held.items()]
        deletes.append(kv.delete(f"{self._group}.m.{self._instance}"))
        # Bounded: a server going away must not hold the process's exit.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*deletes, return_exceptions=True), 2.0)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._renew_s)
            try:
                await self._round()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the bus is away: try again next round
                log.warning("%s %s: partition leases: %s: %s", self._group, self._instance,
                            type(exc).__name__, exc)

    async def _round(self) -> None:
        kv = self._kv
        assert kv is not None
        await kv.put(f"{self._group}.m.{self._instance}", b"1")
        members = await self._members()
        want = math.ceil(self.partitions / max(members, 1))
        for part, revision in list(self.owned.items()):
            try:
                self.owned[part] = await kv.update(self._lease(part), self._instance.encode(),
                                                   last=revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                # The lease expired (the bus was away longer than its TTL: a cluster
                # electing the bucket's leader). If nobody took it meanwhile, it is taken
                # again at once: the partition never changed hands, so its consumers and
                # states go on, instead of being dropped and loaded again.
                try:
                    self.owned[part] = await kv.create(self._lease(part),
                                                       self._instance.encode())
                    log.warning("%s %s: lease of partition %d expired; taken again",
                                self._group, self._instance, part)
                    continue
                except nats.js.errors.KeyWrongLastSequenceError:
                    pass  # another member holds it now
                log.warning("%s %s: lost partition %d", self._group, self._instance, part)
                self.owned.pop(part, None)
                await self._on_release(part)
        for part in sorted(self.owned, reverse=True)[:max(len(self.owned) - want, 0)]:
            await self._let_go(part)
        if len(self.owned) >= want:
            return
        # Free partitions, starting from a place of our own, so members spread out.
        start = zlib.crc32(self._instance.encode()) % self.partitions
        for i in range(self.partitions):
            part = (start + i) % self.partitions
            if part in self.owned:
                continue
            try:
                revision = await kv.create(self._lease(part), self._instance.encode())
            except nats.js.errors.KeyWrongLastSequenceError:
                continue  # held by another member
            self.owned[part] = revision
            await self._on_acquire(part)
            if len(self.owned) >= want:
                return

    async def _members(self) -> int:
        kv = self._kv
        assert kv is not None
        prefix = f"{self._group}.m."
        try:
            keys = await kv.keys()  # a few dozen keys: no filter (it logs a warning)
        except nats.js.errors.NoKeysError:
            return 1
        return max(1, sum(1 for k in keys if k.startswith(prefix)))

    async def _let_go(self, part: int) -> None:
        revision = self.owned.pop(part, None)
        await self._on_release(part)
        if revision is not None and self._kv is not None:
            with contextlib.suppress(Exception):
                await self._kv.delete(self._lease(part), last=revision)


__all__ = ["PartitionOwner"]
