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


def event_subject(session_id: str, event_type: str, route: str | None = None) -> str:
    subject = f"{EVENTS_PREFIX}.{session_id}.{event_type}"
    return f"{subject}.{route}" if route else subject


def session_filter(session_id: str) -> str:
    return f"{EVENTS_PREFIX}.{session_id}.>"


def request_subject(session_id: str) -> str:
    return f"{REQUESTS_PREFIX}.{session_id}"


TOOL_EVENTS_SUFFIX: Final = "tool_events"


def tool_events_subject(session_id: str) -> str:
    """Where programs inject tool events into a session (seed 000), the gateway's body."""
    return f"{REQUESTS_PREFIX}.{session_id}.{TOOL_EVENTS_SUFFIX}"


def dispatch_filter(route: str) -> str:
    return f"{EVENTS_PREFIX}.*.call.dispatched.{route}"


def state_subject(session_id: str) -> str:
    return f"{STATE_PREFIX}.{session_id}"


def session_of(subject: str) -> str:
    """`toolbus.evt.<sid>.…` or `toolbus.req.<sid>` -> `<sid>` (the third token)."""
    parts = subject.split(".", 3)
    return parts[2] if len(parts) > 2 else ""


def approval_subject(session_id: str, call_id: str, principal: str) -> str:
    return f"{APPROVAL_PREFIX}.{session_id}.{call_id}.{principal}"


def approval_decision_filter(session_id: str, call_id: str) -> str:
    """Every human (or timeout) decision on one call: `approval.granted.<call_id>` and
    `approval.denied.<call_id>`. Appending with an expected last sequence of 0 on it makes
    the first decision win."""
    return f"{EVENTS_PREFIX}.{session_id}.approval.*.{call_id}"


def live_filter(session_id: str) -> str:
    return f"{LIVE_PREFIX}.{session_id}.>"
