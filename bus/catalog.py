"""The tool catalog: specs in the `toolbus_catalog` KV bucket, watched into memory."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec
import nats.js.errors
from nats.js.kv import KeyValue

from bus.connection import Bus
from bus.subjects import CATALOG_BUCKET
from schemas.ids import catalog_key
from schemas.tools import ToolSpec, decode_spec, encode_spec

log = logging.getLogger("toolbus.bus")


class Catalog:
    """A live, in-memory view of the catalog bucket (after `start`), plus registration."""

    def __init__(self, bus: Bus) -> None:
        self._bus = bus
        self._kv: KeyValue | None = None
        self._specs: dict[str, ToolSpec] = {}
        self._watch_task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            self._kv = await self._bus.js.key_value(CATALOG_BUCKET)
        return self._kv

    async def register(self, specs: list[ToolSpec]) -> None:
        kv = await self._bucket()
        for spec in specs:
            await kv.put(catalog_key(spec.name), encode_spec(spec))
            self._specs[spec.name] = spec

    async def start(self, timeout: float = 10.0) -> None:
        kv = await self._bucket()
        watcher = await kv.watchall()
        self._watch_task = asyncio.create_task(self._watch(watcher), name="catalog-watch")
        async with asyncio.timeout(timeout):
            await self._ready.wait()

    async def stop(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task

    async def _watch(self, watcher: KeyValue.KeyWatcher) -> None:
        try:
            async for entry in watcher:
                if entry is None:  # end of the initial values
                    self._ready.set()
                    continue
                if entry.operation in ("DEL", "PURGE") or entry.value is None:
                    name = next((n for n in self._specs if catalog_key(n) == entry.key), None)
                    if name is not None:
                        self._specs.pop(name, None)
                else:
                    try:
                        spec = decode_spec(entry.value)
                    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                        log.warning("catalog entry %s is unreadable: %s", entry.key, exc)
                        continue
                    self._specs[spec.name] = spec
                self._ready.set()
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()  # type: ignore[no-untyped-call]  # nats-py lacks hints here

    def get(self, name: str) -> ToolSpec | None:
        return self._specs.get(name)

    def all(self) -> list[ToolSpec]:
        return sorted(self._specs.values(), key=lambda s: s.name)

    async def load(self) -> list[ToolSpec]:
        """A one-shot read of every spec, for CLI listing without a watcher."""
        kv = await self._bucket()
        try:
            keys = await kv.keys()
        except nats.js.errors.NoKeysError:
            return []
        specs = []
        for key in keys:
            with contextlib.suppress(nats.js.errors.KeyNotFoundError):
                entry = await kv.get(key)
                if entry.value:
                    specs.append(decode_spec(entry.value))
        return sorted(specs, key=lambda s: s.name)
