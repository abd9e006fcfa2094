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
a moment (a lease expired under a process that was only slow, or stopped); the
per-session concurrency check of every append keeps their writes safe, as it keeps racing
writers safe. Their states are another matter: a consumer's message acknowledged by one
is never delivered to the other, whose state of that session then lacks the event for
good. So a member handles a partition's messages only while `holds` it for sure (its
lease written less than `LEASE_TTL_S` ago by its own clock), and giving partitions up
(which waits for the messages in hand) runs beside the renewals, never holding them up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable

import nats.js.errors
from nats.js.kv import KeyValue

from bus.connection import Bus
from bus.direct import direct_batch
from bus.subjects import LEASES_BUCKET
from bus.tasks import stop_task
from schemas.defaults import LEASE_RENEW_S, LEASE_TTL_S

log = logging.getLogger("toolbus.partitions")

OnChange = Callable[[int], Awaitable[None]]


# A lease `create` refused because the key exists. nats-py then reads the key to tell a
# deleted one from a live one, and a lease that expired in between (its TTL) makes that
# read raise KeyNotFoundError instead: it was held a moment ago, and is taken as held
# (free, it is taken next round). Uncaught, it ended the first round, and with it the
# start of a process that came up as another's lease expired (the chaos test).
_HELD = (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.KeyNotFoundError)


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
        # partition -> until when (monotonic) its lease surely holds: when its last
        # write was sent, plus the lease's TTL
        self._sure_until: dict[int, float] = {}
        # Partitions being given up: their messages in hand are still finishing.
        self._releasing: dict[int, asyncio.Task[None]] = {}
        self._task: asyncio.Task[None] | None = None
        # Set, and replaced by a new one, at the end of each round (see `surely_holds`).
        self._round_end = asyncio.Event()

    @property
    def partitions(self) -> int:
        return self._partitions or self._bus.partitions

    def holds(self, part: int) -> bool:
        """Whether this member surely still holds `part`: its lease was written less than
        `LEASE_TTL_S` ago. A process stopped or starved for longer may have lost it to
        another member without knowing yet; a message it handled and acknowledged then
        would be missing from the new owner's state."""
        return time.monotonic() < self._sure_until.get(part, 0.0)

    async def surely_holds(self, part: int, wait: float = LEASE_TTL_S) -> bool:
        """`holds(part)`, or, for a partition this member still owns whose renewal is
        late (a slow round on a loaded machine, the bucket's leader being elected),
        whether it does once the rounds of the next `wait` seconds have renewed it. A
        message handed back unacknowledged comes again only after its ack wait, and was
        handed back again and again for as long as the rounds stayed slow, each time
        counted as a delivery."""
        deadline = time.monotonic() + wait
        while not self.holds(part):
            left = deadline - time.monotonic()
            if part not in self.owned or left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._round_end.wait()
        return True

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
        self._sure_until.clear()
        self._round_end.set()  # `surely_holds` waits no more: nothing is held
        for part in sorted(held):
            await self._on_release(part)
        await asyncio.gather(*self._releasing.values(), return_exceptions=True)
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
            finally:
                ended, self._round_end = self._round_end, asyncio.Event()
                ended.set()

    async def _round(self) -> None:
        kv = self._kv
        assert kv is not None
        # The leases held are renewed first, all at once: one round trip, however many
        # partitions, and before anything else this round does can fail or stall. Each
        # lease surely holds until the TTL after its write was sent (the server stores
        # it no sooner). When `sure_until` was the start of the round, a round slower
        # than the TTL (10 sequential writes to an R3 bucket, on a loaded machine or
        # while the cluster elects) left the partitions renewed last not held "for
        # sure" although the lease never changed hands, and their every event was
        # dropped, again at each redelivery, for as long as that went on.
        renewals = await asyncio.gather(*(self._renew(part, revision) for part, revision
                                          in list(self.owned.items())),
                                        return_exceptions=True)
        failed = next((r for r in renewals if isinstance(r, BaseException)), None)
        if failed is not None:
            raise failed
        await kv.put(f"{self._group}.m.{self._instance}", b"1")
        members = await self._members()
        want = math.ceil(self.partitions / max(members, 1))
        for part in sorted(self.owned, reverse=True)[:max(len(self.owned) - want, 0)]:
            self._release(part, revision=self.owned.pop(part))
        if len(self.owned) >= want:
            return
        # Free partitions, starting from a place of our own, so members spread out.
        start = zlib.crc32(self._instance.encode()) % self.partitions
        for i in range(self.partitions):
            part = (start + i) % self.partitions
            if part in self.owned or part in self._releasing:
                continue
            sent = time.monotonic()
            try:
                revision = await kv.create(self._lease(part), self._instance.encode())
            except _HELD:
                continue  # held by another member
            self.owned[part] = revision
            self._sure_until[part] = sent + LEASE_TTL_S
            await self._on_acquire(part)
            if len(self.owned) >= want:
                return

    async def _renew(self, part: int, revision: int) -> None:
        kv = self._kv
        assert kv is not None
        sent = time.monotonic()
        try:
            self.owned[part] = await kv.update(self._lease(part), self._instance.encode(),
                                               last=revision)
            self._sure_until[part] = sent + LEASE_TTL_S
            return
        except nats.js.errors.KeyWrongLastSequenceError:
            pass
        # The lease expired (the bus was away longer than its TTL: a cluster electing
        # the bucket's leader). If nobody took it meanwhile, it is taken again at once:
        # the partition never changed hands, so its consumers and states go on, instead
        # of being dropped and loaded again.
        sent = time.monotonic()
        try:
            self.owned[part] = await kv.create(self._lease(part), self._instance.encode())
            self._sure_until[part] = sent + LEASE_TTL_S
            log.warning("%s %s: lease of partition %d expired; taken again",
                        self._group, self._instance, part)
            return
        except _HELD:
            pass  # another member holds it now
        log.warning("%s %s: lost partition %d", self._group, self._instance, part)
        self.owned.pop(part, None)
        self._release(part)

    async def _members(self) -> int:
        """The members of the group, read with batched direct gets over their keys (the
        bucket keeps one message per key; a member that left, an empty one). Not
        `kv.keys()`: each call leaves an ephemeral consumer behind for minutes, and at
        one a second per member the stream reached the server's limit of consumers
        (every round then failed, and no partition of a dead member was taken)."""
        members = 0
        start = 1
        while True:
            batch, pending = await direct_batch(
                self._bus, f"KV_{LEASES_BUCKET}", f"$KV.{LEASES_BUCKET}.{self._group}.m.>",
                start, 256)
            members += sum(1 for _, _, data in batch if data)
            if not batch or pending == 0:
                return max(1, members)
            start = batch[-1][0] + 1

    def _release(self, part: int, *, revision: int | None = None) -> None:
        """Give `part` up in the background: its messages in hand may take seconds to
        finish (a model call), and the leases kept must be renewed meanwhile. A lease let
        go (`revision`) is deleted once done, for another member to take at once."""
        self._sure_until.pop(part, None)

        async def release() -> None:
            try:
                await self._on_release(part)
                if revision is not None and self._kv is not None:
                    with contextlib.suppress(Exception):
                        await self._kv.delete(self._lease(part), last=revision)
            except Exception:  # the next round goes on; the lease expires by itself
                log.exception("%s %s: giving partition %d up failed", self._group,
                              self._instance, part)
            finally:
                self._releasing.pop(part, None)

        self._releasing[part] = asyncio.create_task(
            release(), name=f"release:{self._group}.p{part}")


__all__ = ["PartitionOwner"]
