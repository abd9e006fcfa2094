"""Idempotent provisioning of the streams, buckets and consumers of DESIGN.md.

Create what is missing, update what drifted, never delete or purge: running `toolbus up`
against a server that already holds sessions must leave every event where it was.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import nats.js.errors
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    RePublish,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    SubjectTransform,
)

from bus.connection import Bus
from bus.subjects import (
    APPROVALS_BUCKET,
    ARTIFACTS_BUCKET,
    CATALOG_BUCKET,
    DEFAULT_PARTITIONS,
    EVENTS_PREFIX,
    EVENTS_STREAM,
    EXECUTORS_BUCKET,
    LEASES_BUCKET,
    LIVE_PREFIX,
    MAX_PARTITIONS,
    PARTITIONS_METADATA,
    REQUESTS_PREFIX,
    REQUESTS_STREAM,
    SNAPSHOTS_BUCKET,
)
from schemas.defaults import (
    DUPLICATE_WINDOW_S,
    EXECUTORS_TTL_S,
    LEASE_TTL_S,
    MAX_EVENT_BYTES,
    SERVER_MAX_PAYLOAD,
)
from schemas.errors import BusError, ConfigError

log = logging.getLogger("toolbus.bus")

# The stream's own cap, a backstop above the event limit that EventLog enforces.
_EVENTS_MAX_MSG_BYTES = 4 * MAX_EVENT_BYTES


def events_stream_config(partitions: int = DEFAULT_PARTITIONS, *,
                         atomic: bool = True) -> StreamConfig:
    return StreamConfig(
        name=EVENTS_STREAM,
        description="toolbus event log: the source of truth",
        subjects=[f"{EVENTS_PREFIX}.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        duplicate_window=DUPLICATE_WINDOW_S,
        allow_direct=True,
        # A decision's events stored all together or none (bus/eventlog.py): from
        # nats-server 2.12 on; None leaves an older server's stream as it is.
        allow_atomic=True if atomic else None,
        max_msg_size=_EVENTS_MAX_MSG_BYTES,
        # `toolbus.evt.<sid>.<partition>.<type>` -> `toolbus.live.<sid>.<type>`: watchers
        # need not know the partitions.
        republish=RePublish(src=f"{EVENTS_PREFIX}.*.*.>",
                            dest=f"{LIVE_PREFIX}.{{{{wildcard(1)}}}}.>"),
        metadata={PARTITIONS_METADATA: str(partitions)},
    )


def requests_stream_config(partitions: int = DEFAULT_PARTITIONS) -> StreamConfig:
    return StreamConfig(
        name=REQUESTS_STREAM,
        description="toolbus requests, consumed once by the session actor",
        subjects=[f"{REQUESTS_PREFIX}.>"],
        # Stored as `toolbus.req.<sid>.<partition>`, NATS's own hash of the session id
        # (bus/subjects.py `partition` computes the same): each partition's consumer
        # takes its sessions' requests.
        subject_transform=SubjectTransform(
            src=f"{REQUESTS_PREFIX}.*",
            dest=f"{REQUESTS_PREFIX}.{{{{wildcard(1)}}}}.{{{{partition({partitions},1)}}}}"),
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        duplicate_window=DUPLICATE_WINDOW_S,
        # Up to the server's max payload: an oversized request is stored, then rejected
        # with a `request.rejected` that says so, instead of vanishing at the socket.
        max_msg_size=SERVER_MAX_PAYLOAD,
    )


async def ensure_stream(bus: Bus, config: StreamConfig, *, rescale: bool = False) -> None:
    """Create the stream, or update what drifted; its replicas change only with `rescale`
    (`--replicas`), so an operator's choice is never undone by an actor starting."""
    assert config.name is not None
    try:
        info = await bus.js.stream_info(config.name)
    except nats.js.errors.NotFoundError:
        await bus.js.add_stream(config)
        log.info("created stream %s", config.name)
        return
    current = info.config
    wanted = {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if getattr(config, f.name) is not None
    }
    drift = {k: v for k, v in wanted.items() if getattr(current, k) != v}
    # Retention cannot change on a live stream; never try, never recreate.
    drift.pop("retention", None)
    if "metadata" in drift:  # the server adds keys of its own: only ours matter
        merged = {**(current.metadata or {}), **(config.metadata or {})}
        if merged == (current.metadata or {}):
            drift.pop("metadata")
        else:
            drift["metadata"] = merged
    if not rescale:
        drift.pop("num_replicas", None)
    if drift:
        await bus.js.update_stream(dataclasses.replace(current, **drift))
        log.info("updated stream %s: %s", config.name, ", ".join(sorted(drift)))


CLUSTER_REPLICAS = 3


def server_version(bus: Bus) -> tuple[int, int]:
    """The connected server's major and minor version ((0, 0) if it said none)."""
    version = str(bus.nc._server_info.get("version", ""))
    parts = version.split("-")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return 0, 0


def default_replicas(bus: Bus) -> int:
    """How many copies of each stream and bucket to make: 3 on a JetStream cluster (its
    size, if it has fewer servers), 1 on a single server. From the INFO the server sent at
    connect: a clustered server names its cluster and lists every node's client URL,
    itself included (`connect_urls`)."""
    info = bus.nc._server_info
    if not info.get("cluster"):
        return 1
    nodes = len(set(info.get("connect_urls") or ()))
    return max(1, min(CLUSTER_REPLICAS, nodes))


async def stored_partitions(bus: Bus, wanted: int | None = None) -> int:
    """How many partitions the store spreads sessions over: those it was provisioned
    with (the events stream's metadata), else `wanted`, else the default. `ConfigError`
    when `wanted` differs from the store's: they cannot change once events are stored."""
    if wanted is not None and not 1 <= wanted <= MAX_PARTITIONS:
        raise ConfigError(f"--partitions {wanted}: give 1 to {MAX_PARTITIONS}")
    try:
        info = await bus.js.stream_info(EVENTS_STREAM)
    except nats.js.errors.NotFoundError:
        return wanted or DEFAULT_PARTITIONS
    have = (info.config.metadata or {}).get(PARTITIONS_METADATA)
    if have is None or not have.isdigit():
        return wanted or DEFAULT_PARTITIONS  # a store from before partitions
    if wanted is not None and wanted != int(have):
        raise ConfigError(f"this store spreads sessions over {have} partitions; it cannot "
                          f"change to {wanted} (every stored event is on its partition's "
                          "subject): leave --partitions out, or start a new store")
    return int(have)


async def provision(bus: Bus, *, replicas: int | None = None,
                    partitions: int | None = None) -> None:
    """Create or update every stream and bucket toolbus uses. Safe to run any time.
    Sets `bus.partitions` to the store's (`stored_partitions`).

    New streams and buckets get `replicas` copies (default: `default_replicas`). Existing
    ones keep theirs unless `replicas` is given (`--replicas`): then NATS rescales them in
    place, a stream update that keeps every message."""
    n = replicas if replicas is not None else default_replicas(bus)
    rescale = replicas is not None
    try:
        bus.partitions = await stored_partitions(bus, partitions)
        await ensure_stream(bus, dataclasses.replace(
            events_stream_config(bus.partitions, atomic=server_version(bus) >= (2, 12)),
            num_replicas=n), rescale=rescale)
        events = await bus.js.stream_info(EVENTS_STREAM)
        bus.replicated = (events.config.num_replicas or 1) > 1
        bus.atomic = bool(events.config.allow_atomic)
        await ensure_stream(bus, dataclasses.replace(
            requests_stream_config(bus.partitions), num_replicas=n), rescale=rescale)
        ttls = {EXECUTORS_BUCKET: EXECUTORS_TTL_S, LEASES_BUCKET: LEASE_TTL_S}
        for bucket in (CATALOG_BUCKET, SNAPSHOTS_BUCKET, APPROVALS_BUCKET, EXECUTORS_BUCKET,
                       LEASES_BUCKET):
            try:
                await bus.js.key_value(bucket)
            except nats.js.errors.BucketNotFoundError:
                ttl = ttls.get(bucket)
                await bus.js.create_key_value(bucket=bucket, history=1, ttl=ttl,
                                              direct=True, replicas=n)
            # Direct gets, so the read-only roles read entries without consumers (older
            # installs created the buckets without them).
            # Per-message TTLs too, for the approvals' purge markers (bus/approvals.py);
            # buckets made by older clients lack them, and they can be turned on in place.
            info = await bus.js.stream_info(f"KV_{bucket}")
            wanted = n if rescale else (info.config.num_replicas or 1)
            if not info.config.allow_direct or not info.config.allow_msg_ttl or \
                    (info.config.num_replicas or 1) != wanted:
                await bus.js.update_stream(dataclasses.replace(
                    info.config, allow_direct=True, allow_msg_ttl=True,
                    num_replicas=wanted))
        try:
            await bus.js.object_store(ARTIFACTS_BUCKET)
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError):
            await bus.js.create_object_store(bucket=ARTIFACTS_BUCKET, replicas=n)
        else:
            info = await bus.js.stream_info(f"OBJ_{ARTIFACTS_BUCKET}")
            if rescale and (info.config.num_replicas or 1) != n:
                await bus.js.update_stream(dataclasses.replace(info.config, num_replicas=n))
    except nats.js.errors.ServiceUnavailableError as exc:
        raise BusError(
            f"JetStream is not enabled on {bus.url}: start nats-server with -js"
        ) from exc
    except nats.js.errors.APIError as exc:
        if exc.err_code in _REPLICAS_REFUSED:
            raise BusError(
                f"NATS at {bus.url} cannot keep {n} replicas of toolbus's streams "
                f"({exc.description}): pass --replicas N with N at most its number of "
                "JetStream servers (1 for a single server)") from exc
        raise


# JSStreamReplicasNotSupportedErr (R>1 on a single server), JSInsufficientResourcesErr,
# JSClusterNoPeersErr (fewer servers than replicas).
_REPLICAS_REFUSED = frozenset({10074, 10023, 10005})


@dataclass(frozen=True, slots=True)
class ConsumerSpec:
    """A durable pull consumer shared by every process of one actor kind."""

    stream: str
    durable: str
    filter_subjects: tuple[str, ...]
    ack_wait_s: float = 30.0
    max_ack_pending: int = 1024
    inactive_threshold_s: float | None = None  # None: kept until deleted


async def ensure_consumer(bus: Bus, spec: ConsumerSpec) -> None:
    config = ConsumerConfig(
        durable_name=spec.durable,
        deliver_policy=DeliverPolicy.ALL,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=spec.ack_wait_s,
        max_deliver=-1,
        max_ack_pending=spec.max_ack_pending,
        max_waiting=512,
        inactive_threshold=spec.inactive_threshold_s,
        **(
            {"filter_subject": spec.filter_subjects[0]}
            if len(spec.filter_subjects) == 1
            else {"filter_subjects": list(spec.filter_subjects)}
        ),
    )
    try:
        info = await bus.js.consumer_info(spec.stream, spec.durable)
    except nats.js.errors.NotFoundError:
        await bus.js.add_consumer(spec.stream, config)
        return
    current = info.config
    if (
        current.ack_wait != config.ack_wait
        or current.max_ack_pending != config.max_ack_pending
        or (current.filter_subject, current.filter_subjects)
        != (config.filter_subject, config.filter_subjects)
    ):
        # CONSUMER.CREATE with the same durable name updates it in place.
        await bus.js.add_consumer(spec.stream, config)


@dataclass(frozen=True, slots=True)
class Backlog:
    """Calls sent to one executor route that no executor has acknowledged: a pool's
    (`exec_<pool>_<namespace>`, `instance` None) or one instance's (`_instance`,
    `exec_instance_<instance>_<namespace>`)."""

    pool: str | None
    instance: str | None
    namespace: str
    filter_subject: str
    after_seq: int  # everything up to here is acknowledged


async def executor_backlogs(bus: Bus) -> list[Backlog]:
    """The executor consumers (`exec_*`) that still hold unacknowledged calls."""
    out = []
    offset = 0
    while True:
        page = await bus.js.consumers_info(EVENTS_STREAM, offset=offset)
        for info in page:
            name = info.name or ""
            filt = info.config.filter_subject or ""
            waiting = (info.num_pending or 0) + (info.num_ack_pending or 0)
            if not name.startswith("exec_") or not waiting:
                continue
            floor = info.ack_floor.stream_seq if info.ack_floor else 0
            # toolbus.evt.*.*.call.dispatched.<pool>.<namespace>, or
            # toolbus.evt.*.*.call.dispatched.instance.<instance>.<namespace>
            tokens = filt.split(".")
            if tokens[4:6] != ["call", "dispatched"]:
                continue
            if len(tokens) == 8:
                out.append(Backlog(tokens[6], None, tokens[7], filt, floor))
            elif len(tokens) == 9 and tokens[6] == "instance":
                out.append(Backlog(None, tokens[7], tokens[8], filt, floor))
        if len(page) < 256:
            return out
        offset += len(page)


@dataclass(frozen=True, slots=True)
class ConsumerState:
    """What a durable consumer filters, and how many of its messages are not delivered."""

    filter_subjects: tuple[str, ...]
    pending: int


async def consumer_state(bus: Bus, stream: str, durable: str) -> ConsumerState | None:
    """The consumer's filter and undelivered count, None if it does not exist."""
    try:
        info = await bus.js.consumer_info(stream, durable)
    except nats.js.errors.NotFoundError:
        return None
    config = info.config
    filters = tuple(config.filter_subjects or ()) or (
        (config.filter_subject,) if config.filter_subject else ())
    return ConsumerState(filters, int(info.num_pending or 0))


async def delete_consumers(bus: Bus, stream: str, names: tuple[str, ...]) -> None:
    """Delete these durable consumers of `stream` where they exist (a layout retired)."""
    for name in names:
        try:
            await bus.js.delete_consumer(stream, name)
            log.info("deleted the retired consumer %s of %s", name, stream)
        except nats.js.errors.NotFoundError:
            pass
