"""The tool catalog (`toolbus_catalog`) and the live executor instances
(`toolbus_executors`), both KV buckets watched into memory.

Registration is compare-and-set: a name registered by another source is a
`ToolConflictError`, never a silent overwrite; the same source registering again (a second
executor process, another pool) merges its pools into the entry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Generic, TypeVar

import msgspec
import nats.js.errors
from nats.js.kv import KeyValue

from bus.connection import Bus
from bus.direct import direct_batch
from bus.subjects import CATALOG_BUCKET, EXECUTORS_BUCKET
from bus.tasks import stop_task
from schemas.errors import ToolConflictError
from schemas.ids import catalog_key
from schemas.tools import ExecutorInfo, ToolSpec, decode_spec, encode_spec

log = logging.getLogger("toolbus.bus")

# Entries written before sources were tracked say "local"; they may be taken over.
_LEGACY_SOURCE = "local"
_CAS_ATTEMPTS = 20

T = TypeVar("T")


class WatchedBucket(Generic[T]):
    """A live, in-memory copy of one KV bucket, keyed by KV key."""

    def __init__(self, bus: Bus, bucket: str, decode: Callable[[bytes], T]) -> None:
        self._bus = bus
        self._bucket_name = bucket
        self._decode = decode
        self._kv: KeyValue | None = None
        self.items: dict[str, T] = {}
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._changed = asyncio.Event()

    async def bucket(self) -> KeyValue:
        if self._kv is None:
            self._kv = await self._bus.js.key_value(self._bucket_name)
        return self._kv

    async def start(self, timeout: float) -> None:
        kv = await self.bucket()
        watcher = await kv.watchall()
        self._task = asyncio.create_task(self._watch(watcher), name=f"watch-{self._bucket_name}")
        async with asyncio.timeout(timeout):
            await self._ready.wait()

    async def stop(self) -> None:
        await stop_task(self._task)

    async def wait_until(self, predicate: Callable[[dict[str, T]], bool],
                         timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while True:
                self._changed.clear()
                if predicate(self.items):
                    return
                await self._changed.wait()

    async def _watch(self, watcher: KeyValue.KeyWatcher) -> None:
        try:
            async for entry in watcher:
                if entry is None:  # end of the initial values
                    self._ready.set()
                    continue
                if entry.operation in ("DEL", "PURGE") or not entry.value:
                    self.items.pop(entry.key, None)
                else:
                    try:
                        self.items[entry.key] = self._decode(entry.value)
                    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                        log.warning("%s entry %s is unreadable: %s",
                                    self._bucket_name, entry.key, exc)
                        continue
                self._ready.set()
                self._changed.set()
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()  # type: ignore[no-untyped-call]  # nats-py lacks hints here


_executor_decoder = msgspec.json.Decoder(ExecutorInfo)
_encoder = msgspec.json.Encoder()


class Catalog:
    """Tool specs and live executors (after `start`), plus registration."""

    def __init__(self, bus: Bus) -> None:
        self._bus = bus
        self._specs = WatchedBucket(bus, CATALOG_BUCKET, decode_spec)
        self._executors = WatchedBucket(bus, EXECUTORS_BUCKET, _executor_decoder.decode)

    async def register(self, specs: list[ToolSpec]) -> None:
        """Register specs, or raise `ToolConflictError` before writing any of them if one
        name belongs to another source."""
        kv = await self._specs.bucket()
        for spec in specs:
            await self._check_free(kv, spec)
        for spec in specs:
            await self._register_one(kv, spec)

    async def _current(self, kv: KeyValue, key: str) -> tuple[ToolSpec | None, int | None]:
        try:
            entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError:  # also KeyDeletedError
            return None, None
        if not entry.value:
            return None, entry.revision
        try:
            return decode_spec(entry.value), entry.revision
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("catalog entry %s is unreadable; replacing it", key)
            return None, entry.revision

    async def _check_free(self, kv: KeyValue, spec: ToolSpec) -> None:
        old, _ = await self._current(kv, catalog_key(spec.name))
        if old is not None and old.source not in (spec.source, _LEGACY_SOURCE):
            raise ToolConflictError(spec.name, old.source, spec.source)

    async def _register_one(self, kv: KeyValue, spec: ToolSpec) -> ToolSpec:
        key = catalog_key(spec.name)
        for _ in range(_CAS_ATTEMPTS):
            old, revision = await self._current(kv, key)
            if old is not None and old.source not in (spec.source, _LEGACY_SOURCE):
                raise ToolConflictError(spec.name, old.source, spec.source)
            merged = spec
            if old is not None and old.source == spec.source:
                pools = sorted(set(old.pools) | set(spec.pools))
                merged = msgspec.structs.replace(spec, pools=pools)
                if merged == old:
                    return merged
            data = encode_spec(merged)
            try:
                if revision is None:
                    await kv.create(key, data)
                else:
                    await kv.update(key, data, last=revision)
                return merged
            except nats.js.errors.KeyWrongLastSequenceError:
                continue  # someone registered at the same moment: read again
        raise ToolConflictError(spec.name, "a concurrent registration", spec.source)

    async def unregister(self, names: list[str], source: str) -> None:
        """Remove entries this source registered (a tool an MCP server no longer lists).
        An entry another source owns by now is left alone."""
        kv = await self._specs.bucket()
        for name in names:
            old, revision = await self._current(kv, catalog_key(name))
            if old is not None and old.source == source and revision is not None:
                with contextlib.suppress(nats.js.errors.KeyWrongLastSequenceError):
                    await kv.delete(catalog_key(name), last=revision)

    async def remove(self, name: str) -> bool:
        kv = await self._specs.bucket()
        old, _ = await self._current(kv, catalog_key(name))
        if old is None:
            return False
        await kv.delete(catalog_key(name))
        return True

    # -- executor instances

    async def announce(self, info: ExecutorInfo) -> None:
        kv = await self._executors.bucket()
        await kv.put(info.instance, _encoder.encode(info))

    async def retire(self, instance: str) -> None:
        kv = await self._executors.bucket()
        with contextlib.suppress(nats.js.errors.KeyNotFoundError):
            await kv.delete(instance)

    def instance_tools(self, instance: str) -> frozenset[str] | None:
        info = self._executors.items.get(instance)
        return None if info is None else frozenset(info.tools)

    def pool_serves(self, pool: str, namespace: str) -> bool:
        """Some live executor of `pool` holds tools of `namespace`: it takes their calls."""
        prefix = f"{namespace}:"
        return any(info.pool == pool and any(t.startswith(prefix) for t in info.tools)
                   for info in self._executors.items.values())

    def served(self) -> frozenset[tuple[str, str]]:
        """The (pool, tool name) pairs some live executor takes calls of now: a tool an
        earlier manifest left in the catalog is not one, even when a live executor serves
        others of its namespace."""
        return frozenset((info.pool, tool)
                         for info in self._executors.items.values() for tool in info.tools)

    async def wait_for_instance(self, instance: str, timeout: float = 10.0) -> None:
        """Until a live executor named `instance` is seen (after `start`)."""
        await self._executors.wait_until(lambda items: instance in items, timeout)

    def executors(self) -> list[ExecutorInfo]:
        return sorted(self._executors.items.values(), key=lambda i: i.instance)

    # -- reading

    async def start(self, timeout: float = 10.0) -> None:
        await self._specs.start(timeout)
        await self._executors.start(timeout)

    async def stop(self) -> None:
        await self._specs.stop()
        await self._executors.stop()

    def get(self, name: str) -> ToolSpec | None:
        spec = self._specs.items.get(_key_or_none(name) or "")
        return spec if spec is not None and spec.name == name else None

    def all(self) -> list[ToolSpec]:
        return sorted(self._specs.items.values(), key=lambda s: s.name)

    async def load(self) -> list[ToolSpec]:
        """A one-shot read of every spec, for CLI listing without a watcher."""
        specs = await read_bucket(self._bus, CATALOG_BUCKET, decode_spec)
        return sorted(specs, key=lambda s: s.name)

    async def load_executors(self) -> list[ExecutorInfo]:
        infos = await read_bucket(self._bus, EXECUTORS_BUCKET, _executor_decoder.decode)
        return sorted(infos, key=lambda i: i.instance)

_key_cache: dict[str, str | None] = {}


def _key_or_none(name: str) -> str | None:
    """`ns:tool` -> `ns.tool`, or None for a name that is not one (cached: hot path)."""
    key = _key_cache.get(name)
    if key is None and name not in _key_cache:
        try:
            key = catalog_key(name)
        except ValueError:
            key = None
        if len(_key_cache) < 100_000:
            _key_cache[name] = key
    return key


async def read_bucket(bus: Bus, bucket: str, decode: Callable[[bytes], T]) -> list[T]:
    """Every live value of a KV bucket, read once, by batched direct gets over its
    subjects (each bucket keeps one message per key; a delete leaves an empty one). No
    consumer and no stream info: the read-only roles, in their own NATS account, can do
    it (bus/auth.py). Not `kv.keys()`: that is a watcher whose end-of-data marker can be
    missed when the newest entry is a delete, and then it lists nothing."""
    out: list[T] = []
    start = 1
    async with asyncio.timeout(30):
        while True:
            batch, pending = await direct_batch(bus, f"KV_{bucket}", f"$KV.{bucket}.>",
                                                start, 1024)
            for _, subject, data in batch:
                if not data:  # a delete or purge marker
                    continue
                try:
                    out.append(decode(data))
                except (msgspec.DecodeError, msgspec.ValidationError):
                    log.warning("%s entry %s is unreadable; skipped", bucket,
                                subject.removeprefix(f"$KV.{bucket}."))
            if not batch or pending == 0:
                return out
            start = batch[-1][0] + 1
