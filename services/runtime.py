"""Running actors in this process: `toolbus up` and `toolbus actor KIND`."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from actors.approval import ApprovalActor
from actors.compressor import CONTEXT_STATUS, RECALL
from actors.executor import Executor, default_instance_name
from actors.janitor import Janitor
from actors.mcp_connector import McpConnector
from actors.session import SessionActor
from actors.tools import LocalTool, load_tools
from actors.tools.builtins import BUILTINS, manifest_tools
from bus.auth import Credentials, redact
from bus.catalog import Catalog
from bus.connection import Bus, connect
from bus.server import EmbeddedServer
from bus.streams import provision
from schemas.errors import (
    AuthError,
    BusError,
    BusTimeoutError,
    ConfigError,
    ConnectError,
    WorkerError,
)
from schemas.ids import split_tool_name
from schemas.manifest import McpServerConfig, PolicyConfig, unknown_tool_refs
from schemas.policy import Policy
from services.config import (
    ActorSettings,
    default_data_dir,
    max_workers,
    subprocess_path,
    tool_secrets,
    usable_cpus,
)
from services.metrics import LagPoller, MetricsServer, install_metrics, serve_metrics
from services.process import EXIT_BUS, die_with_parent, parent_is, run, say
from services.telemetry import install_tracing, shutdown_tracing
from services.workers import WORKER_READY, Workers

log = logging.getLogger("toolbus")

_GC_GEN0 = 5_000  # allocations between young collections (CPython's default is 700)

ACTOR_KINDS = ("session", "approval", "executor", "mcp", "planner")
_T = TypeVar("_T")


class Actor(Protocol):
    async def start(self) -> None: ...
    async def stop(self, grace: float = ...) -> None: ...


def mcp_servers(settings: ActorSettings) -> list[McpServerConfig]:
    """The manifest's MCP servers, narrowed to `--only` ids (each must exist)."""
    if settings.manifest is None:
        return []
    servers = settings.manifest.mcps
    if not settings.only:
        return list(servers)
    known = {s.id for s in servers}
    missing = [i for i in settings.only if i not in known]
    if missing:
        raise ConfigError(f"--only {', '.join(missing)}: the manifest declares MCP servers "
                          f"{', '.join(sorted(known)) or '(none)'}")
    return [s for s in servers if s.id in settings.only]


def collect_tools(settings: ActorSettings) -> dict[str, list[LocalTool]]:
    """The tools to serve, by pool. Without a manifest: the built-ins and `--tools`
    modules, all in `settings.pool`. With one: each manifest tool in its declared pool,
    and `--tools` modules in `settings.pool`."""
    extra = [t for target in settings.tools for t in load_tools(target)]
    if settings.manifest is None:
        return {settings.pool: [*BUILTINS, *extra]}
    by_pool: dict[str, list[LocalTool]] = {}
    for t in manifest_tools(settings.manifest, path_env=subprocess_path(), secrets=tool_secrets()):
        by_pool.setdefault(t.spec.pools[0], []).append(t)
    by_pool.setdefault(settings.pool, []).extend(extra)
    return by_pool


async def start_actors(bus: Bus, kinds: Sequence[str], settings: ActorSettings) -> list[Actor]:
    """Start the actors of `kinds`, executors first so their tools are in the catalog
    before the session actor admits calls."""
    unknown = [k for k in kinds if k not in (*ACTOR_KINDS, "executors")]
    if unknown:
        raise ConfigError(
            f"unknown actor kind {unknown[0]!r}: choose from {', '.join(ACTOR_KINDS)}"
        )
    started: list[Actor] = []
    served: dict[str, set[str]] = {}  # namespaces served whole here, for check_tool_refs
    if "executor" in kinds or "executors" in kinds:
        by_pool = collect_tools(settings)
        if "executors" in kinds:
            _add_served(served, [t.spec.name for tools in by_pool.values() for t in tools])
        # `toolbus actor executor` serves its own pool; `toolbus up` every pool.
        pools = ([p for p in sorted(by_pool) if by_pool[p]] if "executors" in kinds
                 else [settings.pool])
        for pool in pools:
            tools = by_pool.get(pool, [])
            if not tools:
                having = sorted(p for p, ts in by_pool.items() if ts)
                raise ConfigError(f"pool {pool} has no tools to serve; the manifest puts "
                                  f"tools in: {', '.join(having) or 'no pool'}")
            instance = settings.instance if len(pools) == 1 else (
                f"{settings.instance}-{pool}" if settings.instance else None)
            executor = Executor(bus, tools, instance=instance, pool=pool,
                                ack_wait_s=settings.ack_wait_s,
                                max_in_flight=settings.max_in_flight)
            try:
                await executor.start()
            except BaseException:
                await stop_actors(started)
                raise
            started.append(executor)
    if "mcp" in kinds:
        servers = mcp_servers(settings)
        if servers:
            # Named apart from the local executors of this process (`<base>-mcp`, or
            # `<base>-mcp-<pool>`): one name is one presence entry and one `_instance` route.
            name = settings.instance
            if "executor" in kinds or "executors" in kinds:
                name = f"{settings.instance or default_instance_name()}-mcp"
            # A stdio server gets the SDK's few default variables (HOME, PATH, USER, ...)
            # and its own `env:`, never this process's environment and its secrets.
            connector = McpConnector(bus, servers, env={}, instance=name,
                                     ack_wait_s=settings.ack_wait_s,
                                     max_in_flight=settings.max_in_flight)
            try:
                await connector.start()
            except BaseException:
                await stop_actors(started)
                raise
            started.append(connector)
            _add_served(served, connector.tools)
            for sid in connector.links:  # a server that lists no tools is served too
                served.setdefault(sid, set())
        elif "executors" not in kinds:  # `toolbus actor mcp` with nothing to do
            raise ConfigError("no MCP servers to connect to: give --manifest with mcps:")
    if settings.manifest is not None:
        # Served by the planner, wherever it runs (this process or another: a worker of
        # `toolbus up` checks the manifest without one): the latent tools the manifest
        # declares, and the context tools.
        _add_served(served, [t.name for t in settings.manifest.tools.latent])
        _add_served(served, [RECALL, CONTEXT_STATUS])
    if "executors" in kinds or "mcp" in kinds:
        try:
            check_tool_refs(settings, served, complete="executors" in kinds
                            and "mcp" in kinds and not settings.only)
        except BaseException:
            await stop_actors(started)
            raise
    policy, max_calls = manifest_policy(settings)
    approval: ApprovalActor | None = None
    if "approval" in kinds:
        catalog = Catalog(bus)
        await catalog.start()
        approval = ApprovalActor(bus, catalog, policy=policy)
        await approval.start()
        janitor = Janitor(bus, catalog)
        await janitor.start()
        started.append(_WithCatalog(approval, catalog, janitor))
    model = settings.manifest.agent_config.model if settings.manifest else None
    if "planner" in kinds and model is not None:
        try:
            # With the approval actor here too, the model's calls are approved and
            # dispatched as the planner stores them (no hop through two actors).
            started.append(await start_planner(bus, settings, approval=approval,
                                               policy=policy, max_calls=max_calls))
        except BaseException:
            await stop_actors(started)
            raise
    elif "planner" in kinds and "session" not in kinds:  # `toolbus actor planner`
        raise ConfigError("no model for the planner: give --manifest with agent_config.model")
    elif "planner" in kinds and settings.manifest is not None and \
            settings.manifest.agent_config.model_dump(exclude_defaults=True):
        # An agent section written out, but nothing to plan with: said, not left to the
        # first message's `no_planner`.
        log.warning("the manifest's agent_config has no model: no planner runs, and a "
                    "message is refused (no_planner); add agent_config.model "
                    "{provider, model, ...} to talk to an agent")
    if "session" in kinds:
        # With the approval actor in this process, the session actor asks it inline and
        # saves a bus hop per call; the events are the same.
        session = SessionActor(bus, max_parallel=policy.max_parallel, max_calls=max_calls,
                               approval=approval, default_agent=policy.default_agent,
                               accept_messages=model is not None,
                               instance=_member_name(settings.instance, "session"))
        for group in started:
            if isinstance(group, _PlannerWithCatalog):
                # A session new to the planner is copied from the session actor's state,
                # which just stored its turn, instead of read from the bus again.
                group.planner.states.peer = session.states
                # And a turn it plans is handed to it as the session actor stores it.
                session.early_turn = group.planner.early_turn
        await session.start()
        started.append(session)
    return started


def _member_name(instance: str | None, kind: str) -> str | None:
    """The name this process goes by among the processes sharing the partitions: its
    `--instance` (with the kind), or a name made of the host and the pid."""
    return f"{instance}-{kind}" if instance else None


async def start_planner(bus: Bus, settings: ActorSettings, *,
                        approval: ApprovalActor | None = None,
                        policy: Policy | None = None,
                        max_calls: int | None = None) -> Actor:
    """The planner of the manifest's `agent_config`, with its own view of the catalog;
    `policy` (default: the manifest's) bounds what it offers the model, `max_calls`
    (default: the manifest's `max_calls_per_turn`) how many calls a turn makes."""
    from actors.agent_tools import AgentExecutor, agent_profiles
    from actors.compressor import Compression, Compressor
    from actors.context_tools import ContextExecutor
    from actors.latent import LatentExecutor, latent_spec
    from actors.llm.types import ModelSettings
    from actors.planner import Planner, Rules

    assert settings.manifest is not None and settings.manifest.agent_config.model is not None
    if policy is None or max_calls is None:
        read_policy, read_max_calls = manifest_policy(settings)
        policy = read_policy if policy is None else policy
        max_calls = read_max_calls if max_calls is None else max_calls
    agent = settings.manifest.agent_config
    m = agent.model
    assert m is not None
    model = ModelSettings(provider=m.provider, model=m.model, base_url=m.base_url,
                          api_key=m.api_key, temperature=m.temperature,
                          max_tokens=m.max_tokens, timeout_s=m.timeout_s,
                          max_retries=m.max_retries)
    compression = Compression.of(agent)
    catalog = Catalog(bus)
    await catalog.start()
    planner = Planner(bus, catalog, model, rules=Rules.of(agent), compression=compression,
                      agents=agent_profiles(agent, default=model),
                      max_iterations=agent.limits.max_iterations,
                      max_tokens=agent.limits.max_tokens_per_turn,
                      instance=_member_name(settings.instance, "planner"),
                      approval=approval, max_parallel=policy.max_parallel,
                      max_calls=max_calls, policy=policy)
    # The named agents' tools (`agent:<name>`) run here, beside the planner that plans
    # their child turns; named apart from this process's other executors.
    runner = AgentExecutor(bus, agent.agents,
                           instance=f"{settings.instance or default_instance_name()}-agents",
                           ack_wait_s=settings.ack_wait_s) if agent.agents else None
    # Latent tools (`tools.latent:`) run here too, the planner's model as implementation;
    # their calls are stored with the executor `latent`.
    specs = [latent_spec(t.name, description=t.description, parameters=t.parameters,
                         output=t.output_schema) for t in settings.manifest.tools.latent]
    latent = LatentExecutor(bus, specs, model,
                            max_output_retries=agent.limits.max_argument_retries,
                            ack_wait_s=settings.ack_wait_s) if specs else None
    # The compressor (large results -> previews) and the context tools (recall,
    # context-status) read the session the planner plans, with its budgets.
    helpers: list[Any] = [h for h in (runner, latent) if h is not None]
    helpers += [Compressor(bus, compression, ack_wait_s=settings.ack_wait_s,
                           known=planner.states),
                ContextExecutor(bus, compression, max_iterations=agent.limits.max_iterations,
                                instance=f"{settings.instance or default_instance_name()}"
                                         "-context", ack_wait_s=settings.ack_wait_s)]
    actor = _PlannerWithCatalog(planner, catalog, helpers)
    await actor.start()
    return actor


class _PlannerWithCatalog:
    def __init__(self, planner: Any, catalog: Catalog, helpers: Sequence[Any] = ()) -> None:
        self.planner = planner
        self.catalog = catalog
        # Beside the planner: the executors of `agent:<name>` and of the latent tools, if
        # any; the compressor; the context tools' executor.
        self.helpers = list(helpers)

    async def start(self) -> None:
        """The helpers first, and their tools seen in the planner's catalog: a question
        the planner asks again at its start (a turn left by a stopped process) offers the
        tools its stored `model.requested` counted, not only those live yet. What started
        is stopped again if a later start fails."""
        started: list[Any] = []
        try:
            for helper in self.helpers:
                await helper.start()
                started.append(helper)
            for helper in self.helpers:
                if isinstance(helper, Executor):
                    try:
                        await self.catalog.wait_for_instance(helper.instance)
                    except TimeoutError as exc:
                        raise BusTimeoutError(
                            f"the planner's executor {helper.instance} did not show in "
                            "the catalog (toolbus_executors) within 10 s of its start: "
                            "is the server slow or its KV bucket unavailable?") from exc
            await self.planner.start()
        except BaseException:
            for done in reversed(started):
                await done.stop()
            await self.catalog.stop()
            raise

    async def stop(self, grace: float = 5.0) -> None:
        # The planner first: while the helpers' running calls finish (an agent's child
        # turn among them), it starts no new model request.
        await self.planner.stop(grace)
        for helper in reversed(self.helpers):
            await helper.stop(grace)
        await self.catalog.stop()


def _add_served(served: dict[str, set[str]], names: Sequence[str]) -> None:
    for name in names:
        served.setdefault(split_tool_name(name)[0], set()).add(name)


def check_tool_refs(settings: ActorSettings, served: Mapping[str, set[str]], *,
                    complete: bool) -> None:
    """Seed 000's boot check: every tool the agent section names (reevaluation tools,
    policies' tools and reevaluate_after) exists, once the servers have listed theirs.
    `ConfigError` naming the key path, the id and what the namespace has."""
    if settings.manifest is None:
        return
    problems = unknown_tool_refs(settings.manifest, served, complete=complete)
    if problems:
        where = f"manifest {settings.manifest_path}" if settings.manifest_path else "manifest"
        raise ConfigError(f"{where}: {'; '.join(problems)}")


def manifest_policy(settings: ActorSettings) -> tuple[Policy, int]:
    """The manifest's policy (the defaults without one) and its cap on calls per turn."""
    config = settings.manifest.policy if settings.manifest else PolicyConfig()
    return config.to_policy(), config.max_calls_per_turn


class _WithCatalog:
    """The approval actor and the janitor, which share the catalog."""

    def __init__(self, actor: ApprovalActor, catalog: Catalog, janitor: Janitor) -> None:
        self.actor = actor
        self.catalog = catalog
        self.janitor = janitor

    async def start(self) -> None:
        await self.actor.start()
        await self.janitor.start()

    async def stop(self, grace: float = 5.0) -> None:
        await self.janitor.stop(grace)
        await self.actor.stop(grace)
        await self.catalog.stop()


_STOP_GRACE_S = 10.0  # what the calls running at a stop get to finish


async def stop_actors(actors: Sequence[Actor], grace: float = _STOP_GRACE_S) -> None:
    # Reverse order: the session actor stops taking requests before executors drain.
    for actor in reversed(actors):
        try:
            await actor.stop(grace)
        except Exception:
            log.exception("stopping %s failed", type(actor).__name__)


class _Interrupted(Exception):
    """SIGINT or SIGTERM arrived during start-up."""


_EXIT_INTERRUPTED = 130  # as the CLI's KeyboardInterrupt: 128 + SIGINT


async def _unless_stopped(stop: asyncio.Event, aw: Awaitable[_T]) -> _T:
    """`aw`, unless `stop` is set first: a signal during start-up, which an MCP server
    that does not answer can make long. Then `aw` is cancelled, its own clean-up runs (it
    stops what it started, MCP server processes included, within seconds), and
    `_Interrupted` is raised."""
    task = asyncio.ensure_future(aw)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        while not task.done():
            task.cancel()
            # Again if a cancellation was swallowed (Python 3.11's `wait_for` can).
            await asyncio.wait({task}, timeout=3.0)
    if task.cancelled():
        raise _Interrupted
    return task.result()


def _stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)


async def run_actors(url: str, kinds: Sequence[str], settings: ActorSettings,
                     *, server: EmbeddedServer | None = None,
                     workers: Workers | None = None,
                     banner: str | Callable[[list[Actor]], str] | None = None,
                     gateway_tokens: Mapping[str, str] | None = None,
                     metrics_port: int | None = None,
                     metrics_host: str = "127.0.0.1", worker: bool = False) -> int:
    # Spans are exported only when the OTEL_* variables ask for it (services/telemetry.py).
    tracing = install_tracing(f"toolbus-{'+'.join(kinds)}")
    # Metrics, when something will read them: a scrape endpoint or OTLP (services/metrics.py).
    meter = install_metrics(f"toolbus-{'+'.join(kinds)}",
                            prometheus=settings.http_port is not None or metrics_port is not None,
                            env_endpoint=not worker)
    bus = await connect(url, name=f"toolbus-{'+'.join(kinds)}")
    stop = asyncio.Event()
    _stop_on_signals(stop)
    exit_code = 0
    actors: list[Actor] = []
    gateway: _Gateway | None = None
    web_bus: Bus | None = None
    scrape: MetricsServer | None = None
    lag: LagPoller | None = None
    try:
        if meter is not None:
            address = (metrics_host, metrics_port) if metrics_port is not None else \
                meter.prometheus_env
            if address is not None:
                scrape = await serve_metrics(
                    meter.scrape, host=address[0], port=address[1],
                    flag="--metrics-port" if metrics_port is not None
                    else "OTEL_EXPORTER_PROMETHEUS_PORT")
        await provision(bus, replicas=settings.replicas, partitions=settings.partitions)
        if workers is not None:
            # Their executors register the tools before the session actor admits calls.
            await _unless_stopped(stop, workers.start())
        actors = await _unless_stopped(stop, start_actors(bus, kinds, settings))
        if settings.http_port is not None:
            # A connection of its own: what its readers pull (event streams, states) is
            # sent on it, and a slow one of them cannot get the actors' cut off by the
            # server as a slow consumer.
            web_bus = await connect(url, name="toolbus-gateway")
            gateway = await start_gateway(web_bus, settings.http_port,
                                          tokens=gateway_tokens or {},
                                          metrics=meter.scrape if meter is not None else None)
        if meter is not None:
            lag = LagPoller(bus)
            await lag.start()
        # Everything loaded so far (modules, schemas, catalogs) lives as long as the
        # process: moved out of the collector's sight, so its passes over the young
        # objects of each call stay short (fewer and shorter pauses in the p99).
        gc.collect()
        gc.freeze()
        gc.set_threshold(_GC_GEN0, *gc.get_threshold()[1:])
        if banner:
            print(banner if isinstance(banner, str) else banner(actors), flush=True)
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
            failure = workers.failure() if workers is not None else None
            if failure is not None:
                print(f"toolbus: {failure}; stopping.", file=sys.stderr, flush=True)
                exit_code = 1
                break
    except _Interrupted:
        print("toolbus: stopped during start-up (a signal arrived)", file=sys.stderr,
              flush=True)
        exit_code = _EXIT_INTERRUPTED
    finally:
        if stop.is_set() and actors and not worker:
            say(f"toolbus: stopping; calls still running get up to {_STOP_GRACE_S:g} s "
                "to finish")
        if scrape is not None:
            await scrape.stop()
        if lag is not None:
            await lag.stop()
        if gateway is not None:
            await gateway.stop()
        if web_bus is not None:
            await web_bus.close()
        await stop_actors(actors)
        if workers is not None:  # after the session actor: it dispatches no more calls
            await workers.stop()
        await bus.close()
        if tracing:
            await asyncio.to_thread(shutdown_tracing)
        if meter is not None:
            await asyncio.to_thread(meter.shutdown)
    return exit_code


class _Gateway:
    def __init__(self, server: Any, task: asyncio.Task[None]) -> None:
        self.server = server
        self.task = task

    async def stop(self) -> None:
        # Event streams never end by themselves: ended first, so that the server's
        # shutdown finds their answers complete instead of cancelling them mid-way.
        self.server.config.app.state.streams.end_all()
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.task, 5)


async def start_gateway(bus: Bus, port: int, *, tokens: Mapping[str, str],
                        allowed_hosts: Sequence[str] | None = None,
                        allowed_origins: Sequence[str] = (),
                        metrics: Callable[[], str] | None = None) -> _Gateway:
    """The HTTP gateway on 127.0.0.1:`port`, in this event loop; `tokens` maps each bearer
    token to its role, `allowed_hosts` defaults to the loopback names (services/gateway.py).
    `ConfigError` if it cannot listen there."""
    import socket

    import uvicorn  # only when asked for

    from services.gateway import DEFAULT_HOSTS, build_app, guarded_protocol

    app = build_app(bus, tokens=tokens, allowed_origins=allowed_origins, metrics=metrics,
                    allowed_hosts=DEFAULT_HOSTS if allowed_hosts is None else allowed_hosts)
    # Bound here, not by uvicorn: it answers a bind error with sys.exit, which would end
    # this whole event loop with a traceback instead of one line.
    where = f"the HTTP gateway cannot listen on 127.0.0.1:{port}"
    if not 1 <= port <= 65535:
        raise ConfigError(f"{where}: a port is 1 to 65535")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        sock.bind(("127.0.0.1", port))
        sock.listen(2048)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"{where}: {(exc.strerror or str(exc)).lower()}; pick another "
                          "--http-port") from exc
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                           http=guarded_protocol()))
    task = asyncio.create_task(server.serve(sockets=[sock]), name="http-gateway")
    async with asyncio.timeout(10):
        while not server.started:
            if task.done():
                task.result()  # raises why it could not start
                raise ConfigError(f"the HTTP gateway could not listen on port {port}")
            await asyncio.sleep(0.02)
    return _Gateway(server, task)


def up(*, nats_url: str | None, data_dir: Path, port: int, settings: ActorSettings,
       fsync: str = "batch", workers: int = 1, auth: bool = True,
       metrics_port: int | None = None, metrics_host: str = "127.0.0.1") -> int:
    """Everything in one process (`workers=1`), or the session and approval actors here
    and the executors and MCP connectors in `workers - 1` child processes."""
    if workers < 1:
        raise ConfigError(f"--workers {workers}: give 1 (everything in this process) or more")
    if workers > (most := max_workers()):
        raise ConfigError(
            f"--workers {workers}: at most {most} here ({usable_cpus()} usable "
            "cores, up to 4 processes each); each worker is a whole Python process with every "
            "executor pool and MCP connection, and more than the cores can run only compete. "
            "For more calls at once, raise --max-in-flight (calls each process runs at once)")
    taken: dict[int, str] = {}
    # The embedded server and the gateway listen on 127.0.0.1; the metrics on
    # --metrics-host, which shares their ports only on loopback or every address.
    shared = metrics_host in ("127.0.0.1", "localhost", "0.0.0.0", "", "::")
    for flag, wanted in (("--port", port if nats_url is None else None),
                         ("--http-port", settings.http_port),
                         ("--metrics-port", metrics_port if shared else None)):
        if wanted:  # 0 or none: any free port
            if wanted in taken:
                raise ConfigError(f"{flag} {wanted} is also the {taken[wanted]}: each needs "
                                  "a port of its own")
            taken[wanted] = flag
    # The manifest was read and checked when the settings were built: a bad one has
    # already failed, before anything started.
    kinds = ["executors", "mcp", "approval", "planner", "session"] if workers == 1 else \
        ["approval", "planner", "session"]
    server: EmbeddedServer | None = None
    url = nats_url
    lock = None if url else _own_data_dir(data_dir)
    if not url:
        if not auth:
            print(NO_AUTH_WARNING, file=sys.stderr, flush=True)
        try:
            server = EmbeddedServer(data_dir, port=port, fsync=fsync, auth=auth)
            server.preexec = die_with_parent  # SIGTERM if toolbus dies without cleaning up
            if lock is not None:
                server.pass_fds = (lock,)
            server.start()
        except BaseException:
            if lock is not None:
                os.close(lock)
            raise
        url = server.url
    try:
        children = None
        if workers > 1:
            children = Workers(workers - 1, url, settings, parent_pid=os.getpid(),
                               ready_timeout_s=_ready_timeout_s(settings),
                               verbose=logging.getLogger().isEnabledFor(logging.DEBUG))
        pid = server.process.pid if server is not None and server.process else None
        banner = _banner(url, data_dir if pid else None, pid, settings, workers=children,
                         server=server)
        tokens: dict[str, str] = {}
        if settings.http_port is not None:
            # The gateway's bearer tokens live in the data dir, whichever server is used.
            tokens = (server.credentials if server is not None
                      else Credentials.ensure(data_dir)).tokens()
        try:
            return run(run_actors(url, kinds, settings, server=server, workers=children,
                                  banner=banner, gateway_tokens=tokens,
                                  metrics_port=metrics_port, metrics_host=metrics_host))
        except ConnectError as exc:
            if server is not None or isinstance(exc, AuthError):
                raise
            # Not "start one with `toolbus up`": this is it, told to use that server.
            raise ConnectError(exc.url, exc.detail, hint="Start that server, or leave "
                               "--nats (and NATS_URL) out for toolbus's own") from exc
        except WorkerError as exc:
            print(f"toolbus: {exc}", file=sys.stderr, flush=True)
            code = exc.code if exc.code is not None and 0 < exc.code <= EXIT_BUS else EXIT_BUS
            return code
    finally:
        if server is not None:
            server.stop()
        if lock is not None:
            os.close(lock)  # and with it the lock


def _own_data_dir(data_dir: Path) -> int:
    """An exclusive lock on the data dir for as long as this process runs its server (the
    kernel drops it when the process dies, however it dies): a second `toolbus up` there
    would start a second server on the same store, which corrupts it, and point the
    credentials the commands read at itself."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(data_dir / "toolbus.lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise ConfigError(f"cannot use the data dir {data_dir}: "
                          f"{exc.strerror or exc}") from None
    try:
        import fcntl  # POSIX only
    except ImportError:
        return fd
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            log.warning("the data dir %s cannot be locked (%s): nothing stops a second "
                        "`toolbus up` there", data_dir, exc.strerror or exc)
            return fd
        holder = os.read(fd, 32).decode(errors="replace").strip()
        os.close(fd)
        raise BusError(f"the data dir {data_dir} is in use by another `toolbus up` or the "
                       f"nats-server it started{f' (pid {holder})' if holder.isdigit() else ''}"
                       ": stop it, or give this one another --data-dir") from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


def run_actor(url: str, kind: str, settings: ActorSettings, *,
              parent_pid: int | None = None, metrics_port: int | None = None,
              metrics_host: str = "127.0.0.1") -> int:
    """`toolbus actor KIND`: one actor kind alone, or `worker`: every executor pool and
    MCP connector, as each child of `toolbus up --workers N` runs them."""
    if parent_pid is not None:
        die_with_parent()
        if not parent_is(parent_pid):  # it died before the line above took effect
            print(f"toolbus: the parent process {parent_pid} is gone; not starting",
                  file=sys.stderr, flush=True)
            return EXIT_BUS
    kinds, banner = (["executors", "mcp"], worker_banner(url)) if kind == "worker" else \
        ([kind], f"toolbus {kind} actor on {redact(url)}")
    return run(run_actors(url, kinds, settings, banner=banner, metrics_port=metrics_port,
                          metrics_host=metrics_host, worker=parent_pid is not None))


def _ready_timeout_s(settings: ActorSettings) -> float:
    """How long a worker may take to be ready: start-up, plus its slowest MCP server's
    connect timeout (they connect at once)."""
    servers = settings.manifest.mcps if settings.manifest is not None else []
    return 60.0 + max((s.connect_timeout_s for s in servers), default=0.0)


def actor_lines(actors: Sequence[Actor]) -> list[str]:
    """What the executors and MCP connectors among `actors` serve, a line each."""
    lines: list[str] = []
    for a in actors:
        if isinstance(a, _PlannerWithCatalog):
            lines.append(f"  planner: {a.planner.describe()}")
        elif isinstance(a, Executor):
            lines.append(f"  executor {a.instance} (pool {a.pool}): "
                         f"{', '.join(sorted(a.tools))}")
        elif isinstance(a, McpConnector):
            for sid, link in a.links.items():
                names = sorted(n for n in a.tools if n.startswith(f"{sid}:"))
                lines.append(f"  mcp {sid} ({link.cfg.describe()}): {', '.join(names)}")
    return lines


def _where_flag(server: EmbeddedServer | None, data_dir: Path | None) -> str:
    """What `toolbus call` needs to find this server: nothing with the default data dir,
    else the data dir (it holds the credentials and the port), or the address."""
    if server is None or data_dir == default_data_dir():
        return ""
    return f" --data-dir {data_dir}"


def worker_banner(url: str) -> Callable[[list[Actor]], str]:
    """`toolbus actor worker`: what it serves, then the line its parent waits for."""

    def text(actors: list[Actor]) -> str:
        return "\n".join([*actor_lines(actors),
                          f"{WORKER_READY}: pid {os.getpid()} on {redact(url)}"])

    return text


NO_AUTH_WARNING = """\
toolbus: WARNING: --no-auth: the embedded NATS server accepts ANYONE who can reach its
toolbus: port, with every right: they can forge tool results and approvals, rewrite the
toolbus: catalog and run any tool. Use it for local experiments only, never on a shared
toolbus: machine or a network."""


def _banner(url: str, data_dir: Path | None, pid: int | None, settings: ActorSettings,
            *, workers: Workers | None = None, server: EmbeddedServer | None = None
            ) -> Callable[[list[Actor]], str]:
    where = (f"embedded nats-server (pid {pid}) on {server.address}, data in {data_dir}"
             if pid and server is not None else redact(url))

    def text(actors: list[Actor]) -> str:
        lines = [f"toolbus is up: {where}"]
        if server is not None and server.auth:
            auth = server.credentials.dir
            # The password is shown on a terminal only, never into a log file or journal.
            client = (server.url_for("client") if sys.stdout.isatty()
                      else f"{redact(server.url_for('client'))} (in {auth}/client.url)")
            lines.append(f"  client: {client}")
            lines.append(f"  auth:   every role's URL and HTTP token is in {auth} (mode "
                         "0600); the CLI finds them there")
        elif server is not None:
            lines.append("  auth:   OFF (--no-auth): anyone on the port can do anything")
        planner = any(isinstance(a, _PlannerWithCatalog) for a in actors)
        kinds = "session, approval" + (", planner" if planner else "")
        if workers is None:
            lines += [f"  actors: {kinds}", *actor_lines(actors)]
        else:
            here = kinds + (", HTTP gateway" if settings.http_port else "")
            lines.append(f"  process {os.getpid()}: {here}")
            lines += [f"  {line}" for line in actor_lines(actors)]
            for w in workers.workers:
                lines.append(f"  process {w.pid} (worker {w.index}):")
                lines += [f"  {line}" for line in w.lines]
        lines.append("  try:    " + ("toolbus chat --session demo 'hello'" if planner else
                                     "toolbus call built-in:echo '{\"text\": \"hi\"}' "
                                     "--session demo") + _where_flag(server, data_dir))
        if settings.http_port is not None:
            lines.append(f"  http:   http://127.0.0.1:{settings.http_port} (GET /approvals, "
                         "POST /sessions/SID/requests, ...)")
        lines.append("  stop:   Ctrl-C")
        return "\n".join(lines)

    return text
