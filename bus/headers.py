"""NATS header names used by toolbus, in one place."""

from __future__ import annotations

from enum import StrEnum


class Header(StrEnum):
    MSG_ID = "Nats-Msg-Id"
    EXPECTED_LAST_SUBJECT_SEQUENCE = "Nats-Expected-Last-Subject-Sequence"
    EXPECTED_LAST_SUBJECT_SEQUENCE_SUBJECT = "Nats-Expected-Last-Subject-Sequence-Subject"
    STATUS = "Status"
    DESCRIPTION = "Description"
    PENDING_MESSAGES = "Nats-Pending-Messages"
    SEQUENCE = "Nats-Sequence"
    SUBJECT = "Nats-Subject"
    TIME_STAMP = "Nats-Time-Stamp"
    NUM_PENDING = "Nats-Num-Pending"
    TRACEPARENT = "traceparent"
    # The process instance that stored an event (partitioned actors set it): which
    # process decided a session, for operators and the partition tests.
    WRITER = "Toolbus-Writer"
    # On every event of a decision but its last: how many more of it follow. An actor
    # that folds every event of a session (the session actor) decides again only once
    # the decision is whole, not on each of its parts.
    MORE = "Toolbus-More"
    # An atomic batch (nats-server 2.12+, a stream with `allow_atomic`): the events of
    # one decision stored all together, or none of them (bus/eventlog.py).
    BATCH_ID = "Nats-Batch-Id"
    BATCH_SEQUENCE = "Nats-Batch-Sequence"
    BATCH_COMMIT = "Nats-Batch-Commit"


class Status(StrEnum):
    IDLE_HEARTBEAT = "100"
    END_OF_BATCH = "204"
    NOT_FOUND = "404"
    REQUEST_TIMEOUT = "408"
    CONFLICT = "409"
