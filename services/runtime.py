"""Running actors in this process: `toolbus up` and `toolbus actor KIND`."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import signal
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, Protocol

from actors.builtin import BUILTINS
from actors.executor import Executor
from actors.session import SessionActor
from actors.tool import LocalTool, load_tools
from bus.catalog import Catalog
from bus.connection import Bus, connect
from bus.server import EmbeddedServer
from bus.streams import provision
from schemas.errors import ConfigError
from services.config import ActorSettings

log = logging.getLogger("toolbus")

ACTOR_KINDS = ("session", "executor")


class Actor(Protocol):
    async def start(self) -> None: ...
    async def stop(self, grace: float = ...) -> None: ...


def collect_tools(settings: ActorSettings) -> list[LocalTool]:
    tools = list(BUILTINS)
    for target in settings.tools:
        tools.extend(load_tools(target))
    return tools


async def start_actors(bus: Bus, kinds: Sequence[str], settings: ActorSettings) -> list[Actor]:
    """Start the actors of `kinds`, executors first so their tools are in the catalog
    before the session actor admits calls."""
    unknown = [k for k in kinds if k not in ACTOR_KINDS]
    if unknown:
        raise ConfigError(
            f"unknown actor kind {unknown[0]!r}: choose from {', '.join(ACTOR_KINDS)}"
        )
    started: list[Actor] = []
    if "executor" in kinds:
        executor = Executor(bus, collect_tools(settings), instance=settings.instance,
                            pool=settings.pool, ack_wait_s=settings.ack_wait_s,
                            max_in_flight=settings.max_in_flight)
        await executor.start()
        started.append(executor)
    if "session" in kinds:
        catalog = Catalog(bus)
        await catalog.start()
        session = SessionActor(bus, catalog)
        await session.start()
        started.append(_WithCatalog(session, catalog))
    return started


class _WithCatalog:
    def __init__(self, actor: SessionActor, catalog: Catalog) -> None:
        self.actor = actor
        self.catalog = catalog

    async def start(self) -> None:
        await self.actor.start()

    async def stop(self, grace: float = 5.0) -> None:
        await self.actor.stop(grace)
        await self.catalog.stop()


async def stop_actors(actors: Sequence[Actor], grace: float = 10.0) -> None:
    # Reverse order: the session actor stops taking requests before executors drain.
    for actor in reversed(actors):
        try:
            await actor.stop(grace)
        except Exception:
            log.exception("stopping %s failed", type(actor).__name__)


def _stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)


async def run_actors(url: str, kinds: Sequence[str], settings: ActorSettings,
                     *, server: EmbeddedServer | None = None, banner: str | None = None) -> int:
    bus = await connect(url, name=f"toolbus-{'+'.join(kinds)}")
    stop = asyncio.Event()
    _stop_on_signals(stop)
    exit_code = 0
    actors: list[Actor] = []
    try:
        await provision(bus)
        actors = await start_actors(bus, kinds, settings)
        if banner:
            print(banner, flush=True)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=0.5)
            if server is not None and server.process is not None:
                code = server.process.poll()
                if code is not None:
                    print(f"toolbus: the embedded nats-server exited (code {code}); "
                          "stopping. Run `toolbus up` again on the same --data-dir to "
                          "resume: every stored event is kept.", file=sys.stderr, flush=True)
                    exit_code = 1
                    break
    finally:
        await stop_actors(actors)
        await bus.close()
    return exit_code


def _run(coro: Coroutine[Any, Any, int]) -> int:
    from services.cli import _run as run

    return run(coro)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    # Linux: the server gets SIGTERM if toolbus dies without cleaning up (e.g. SIGKILL).
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def up(*, nats_url: str | None, data_dir: Path, port: int, settings: ActorSettings) -> int:
    kinds = list(ACTOR_KINDS)
    if nats_url:
        banner = _banner(nats_url, None, None)
        return _run(run_actors(nats_url, kinds, settings, banner=banner))
    server = EmbeddedServer(data_dir, port=port)
    server.preexec = _die_with_parent if sys.platform.startswith("linux") else None
    server.start()
    try:
        assert server.process is not None
        banner = _banner(server.url, data_dir, server.process.pid)
        return _run(run_actors(server.url, kinds, settings, server=server, banner=banner))
    finally:
        server.stop()


def _banner(url: str, data_dir: Path | None, pid: int | None) -> str:
    where = f"embedded nats-server (pid {pid}) on {url}, data in {data_dir}" if pid else url
    return (
        f"toolbus is up: {where}\n"
        f"  actors: session, executor ({', '.join(b.spec.name for b in BUILTINS)})\n"
        f"  try:    toolbus call built-in:echo '{{\"text\": \"hi\"}}' --session demo"
        + (f" --nats {url}" if url != "nats://127.0.0.1:4222" else "")
        + "\n  stop:   Ctrl-C"
    )
