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
)

from bus.connection import Bus
from bus.subjects import (
    APPROVALS_BUCKET,
    ARTIFACTS_BUCKET,
    CATALOG_BUCKET,
    EVENTS_PREFIX,
    EVENTS_STREAM,
    EXECUTORS_BUCKET,
    LIVE_PREFIX,
    REQUESTS_PREFIX,
    REQUESTS_STREAM,
    SNAPSHOTS_BUCKET,
)
from schemas.defaults import (
    DUPLICATE_WINDOW_S,
    EXECUTORS_TTL_S,
    MAX_EVENT_BYTES,
    SERVER_MAX_PAYLOAD,
)
from schemas.errors import BusError

log = logging.getLogger("toolbus.bus")

# The stream's own cap, a backstop above the event limit that EventLog enforces.
_EVENTS_MAX_MSG_BYTES = 4 * MAX_EVENT_BYTES


def events_stream_config() -> StreamConfig:
    return StreamConfig(
        name=EVENTS_STREAM,
        description="toolbus event log: the source of truth",
        subjects=[f"{EVENTS_PREFIX}.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        duplicate_window=DUPLICATE_WINDOW_S,
        allow_direct=True,
        max_msg_size=_EVENTS_MAX_MSG_BYTES,
        republish=RePublish(src=f"{EVENTS_PREFIX}.>", dest=f"{LIVE_PREFIX}.>"),
    )


def requests_stream_config() -> StreamConfig:
    return StreamConfig(
        name=REQUESTS_STREAM,
        description="toolbus requests, consumed once by the session actor",
        subjects=[f"{REQUESTS_PREFIX}.>"],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        duplicate_window=DUPLICATE_WINDOW_S,
        # Up to the server's max payload: an oversized request is stored, then rejected
        # with a `request.rejected` that says so, instead of vanishing at the socket.
        max_msg_size=SERVER_MAX_PAYLOAD,
    )


async def ensure_stream(bus: Bus, config: StreamConfig) -> None:
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
    if drift:
        await bus.js.update_stream(dataclasses.replace(current, **drift))
        log.info("updated stream %s: %s", config.name, ", ".join(sorted(drift)))


async def provision(bus: Bus) -> None:
    """Create or update every stream and bucket toolbus uses. Safe to run any time."""
    try:
        await ensure_stream(bus, events_stream_config())
        await ensure_stream(bus, requests_stream_config())
        for bucket in (CATALOG_BUCKET, SNAPSHOTS_BUCKET, APPROVALS_BUCKET, EXECUTORS_BUCKET):
            try:
                await bus.js.key_value(bucket)
            except nats.js.errors.BucketNotFoundError:
                ttl = EXECUTORS_TTL_S if bucket == EXECUTORS_BUCKET else None
                await bus.js.create_key_value(bucket=bucket, history=1, ttl=ttl,
                                              direct=True)
            # Direct gets, so the read-only roles read entries without consumers (older
            # installs created the buckets without them).
            info = await bus.js.stream_info(f"KV_{bucket}")
            if not info.config.allow_direct:
                await bus.js.update_stream(dataclasses.replace(info.config, allow_direct=True))
        try:
            await bus.js.object_store(ARTIFACTS_BUCKET)
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError):
            await bus.js.create_object_store(bucket=ARTIFACTS_BUCKET)
    except nats.js.errors.ServiceUnavailableError as exc:
        raise BusError(
            f"JetStream is not enabled on {bus.url}: start nats-server with -js"
        ) from exc


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
            # toolbus.evt.*.call.dispatched.<pool>.<namespace>, or
            # toolbus.evt.*.call.dispatched.instance.<instance>.<namespace>
            tokens = filt.split(".")
            if tokens[3:5] != ["call", "dispatched"]:
                continue
            if len(tokens) == 7:
                out.append(Backlog(tokens[5], None, tokens[6], filt, floor))
            elif len(tokens) == 8 and tokens[5] == "instance":
                out.append(Backlog(None, tokens[6], tokens[7], filt, floor))
        if len(page) < 256:
            return out
        offset += len(page)
