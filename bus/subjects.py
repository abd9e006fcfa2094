"""Stream, bucket and subject names of DESIGN.md."""

from __future__ import annotations

from typing import Final

EVENTS_STREAM: Final = "TOOLBUS_EVENTS"
REQUESTS_STREAM: Final = "TOOLBUS_REQUESTS"
CATALOG_BUCKET: Final = "toolbus_catalog"
SNAPSHOTS_BUCKET: Final = "toolbus_snapshots"
ARTIFACTS_BUCKET: Final = "toolbus_artifacts"
# Live executor instances, `<instance>` -> {pool, tools}; entries expire unless refreshed.
EXECUTORS_BUCKET: Final = "toolbus_executors"
# Who consumes which partition (actors/partitions.py): `<group>.p<N>` -> instance, and
# `<group>.m.<instance>` for each live member; entries expire unless renewed.
LEASES_BUCKET: Final = "toolbus_partitions"

EVENTS_PREFIX: Final = "toolbus.evt"
# Every *stored* event is republished by the server on `toolbus.live.<sid>.<type>...`, in
# stream order. Watch these, not `toolbus.evt.>`: a core subscription there also sees
# publishes the stream refused (duplicates, failed concurrency checks).
LIVE_PREFIX: Final = "toolbus.live"
REQUESTS_PREFIX: Final = "toolbus.req"
STATE_PREFIX: Final = "toolbus.ctl.state"
# Human decisions: a JSON request on `toolbus.approval.<sid>.<call_id>.<principal>`, where
# `<principal>` is who decides as NATS knows them: the `approver` role may publish only
# under its own user name (bus/auth.py), so the recorded principal cannot be forged.
APPROVAL_PREFIX: Final = "toolbus.approval"
# Pending approvals, `<sid>.<call_id>` -> what a human needs to decide; a projection of the
# event log kept for listing and timeouts.
APPROVALS_BUCKET: Final = "toolbus_approvals"


# Sessions are spread over N partitions (set when the streams are first provisioned, kept
# in the events stream's metadata): an event is stored on
# `toolbus.evt.<sid>.<partition>.<type>[.<route>]`, and a request published on
# `toolbus.req.<sid>` is stored on `toolbus.req.<sid>.<partition>` by the stream's
# subject transform. Each partition has its own consumers, owned by one process at a time.
DEFAULT_PARTITIONS: Final = 8
MAX_PARTITIONS: Final = 1024
PARTITIONS_METADATA: Final = "toolbus_partitions"


def partition(session_id: str, partitions: int) -> int:
    """The session's partition, as NATS's `{{partition(n, 1)}}` computes it: FNV-1a
    (32 bits) of the token, modulo `partitions`."""
    h = 0x811C9DC5
    for byte in session_id.encode():
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return h % partitions


def event_subject(session_id: str, event_type: str, route: str | None = None, *,
                  partitions: int) -> str:
    subject = f"{EVENTS_PREFIX}.{session_id}.{partition(session_id, partitions)}.{event_type}"
    return f"{subject}.{route}" if route else subject


def event_filter(session_id: str, event_type: str, route: str | None = None) -> str:
    """Every stored event of one type (and route) of a session, whatever the partitions."""
    subject = f"{EVENTS_PREFIX}.{session_id}.*.{event_type}"
    return f"{subject}.{route}" if route else subject


def type_filter(event_type: str, part: int | None = None) -> str:
    """Events of one type of every session (of one partition)."""
    return f"{EVENTS_PREFIX}.*.{'*' if part is None else part}.{event_type}"


def partition_filter(part: int) -> str:
    """Every event of the sessions of one partition."""
    return f"{EVENTS_PREFIX}.*.{part}.>"


def requests_filter(part: int) -> str:
    """The requests of the sessions of one partition, as the stream stores them."""
    return f"{REQUESTS_PREFIX}.*.{part}"


def session_filter(session_id: str) -> str:
    return f"{EVENTS_PREFIX}.{session_id}.>"


def request_subject(session_id: str) -> str:
    return f"{REQUESTS_PREFIX}.{session_id}"


def dispatch_filter(route: str) -> str:
    return f"{EVENTS_PREFIX}.*.*.call.dispatched.{route}"


def state_subject(session_id: str) -> str:
    return f"{STATE_PREFIX}.{session_id}"


def session_of(subject: str) -> str:
    """`toolbus.evt.<sid>.…` or `toolbus.req.<sid>[.<partition>]` -> `<sid>` (the third
    token)."""
    parts = subject.split(".", 3)
    return parts[2] if len(parts) > 2 else ""


def approval_subject(session_id: str, call_id: str, principal: str) -> str:
    return f"{APPROVAL_PREFIX}.{session_id}.{call_id}.{principal}"


def approval_decision_filter(session_id: str, call_id: str) -> str:
    """Every human (or timeout) decision on one call: `approval.granted.<call_id>` and
    `approval.denied.<call_id>`. Appending with an expected last sequence of 0 on it makes
    the first decision win."""
    return f"{EVENTS_PREFIX}.{session_id}.*.approval.*.{call_id}"


def live_filter(session_id: str) -> str:
    return f"{LIVE_PREFIX}.{session_id}.>"
