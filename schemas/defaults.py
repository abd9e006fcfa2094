"""Every default limit and timing of toolbus, in one place.

Settings read by `services/` start from these; library code takes them as keyword
arguments. Sizes are bytes of encoded JSON.
"""

from __future__ import annotations

from typing import Final

# -- the bus
# The embedded server's max payload. Larger than any event so that an oversized request
# still reaches the session actor and gets a stored `payload_too_large` rejection,
# instead of being refused at the socket with nothing recorded.
SERVER_MAX_PAYLOAD: Final = 8 * 1024 * 1024
# No stored event is larger than this; results above the result limit go to the object
# store and the event carries a reference.
MAX_EVENT_BYTES: Final = 256 * 1024
# A result is stored inline up to this size; the headroom is for the event's own fields.
MAX_INLINE_RESULT_BYTES: Final = MAX_EVENT_BYTES - 16 * 1024
# The largest result stored at all (in the object store): a tool that returns more fails
# `result_too_large`, so one call cannot fill the store.
MAX_RESULT_BYTES: Final = 256 * 1024 * 1024
# Characters of a large result kept in its reference, for people and logs.
RESULT_PREVIEW_CHARS: Final = 1024
DUPLICATE_WINDOW_S: Final = 600.0

# Free text in events (error messages, reasons) is clipped to this many characters; in a
# turn's outcomes, to the shorter limit, so a turn's end always fits in one event.
MAX_MESSAGE_CHARS: Final = 8000
OUTCOME_MESSAGE_CHARS: Final = 1000

# -- requests (the decoder's limits; see README "Limits")
MAX_REQUEST_BYTES: Final = 128 * 1024  # under MAX_EVENT_BYTES: arguments land in events
MAX_JSON_DEPTH: Final = 64
# A tool's result stored in an event nests at most this deep: every reader decodes it
# with a recursion of its own, within Python's limit (1000) less the reader's stack.
MAX_RESULT_DEPTH: Final = 128
MAX_CALLS_PER_REQUEST: Final = 64

# -- the kernel
# Deliveries of one message that fail for a passing reason (the bus timed out) before
# it is rejected for good; a message that cannot be decoded, or makes `decide` raise, is
# rejected at its first delivery.
MAX_DELIVERIES: Final = 5
# A consumer redelivers an unacknowledged message after this long; running tools send
# in-progress acks at a third of it, so a dead executor is noticed within it.
ACK_WAIT_S: Final = 3.0
EXECUTOR_ACK_WAIT_S: Final = 3.0
# Events folded per session between two snapshots in `toolbus_snapshots` (or an eighth of
# the session's events, when that is more).
SNAPSHOT_EVERY: Final = 500
SESSION_CACHE_SIZE: Final = 10_000
DECIDE_ATTEMPTS: Final = 8

# -- executors
EXECUTORS_TTL_S: Final = 15.0
# A partition's owner renews its lease every LEASE_RENEW_S; a lease not renewed for
# LEASE_TTL_S (its process died) lets another process take the partition.
LEASE_TTL_S: Final = 3.0
LEASE_RENEW_S: Final = 1.0
# The ack wait of the partitioned consumers: a dead owner's unacknowledged messages are
# redelivered to the next one after it. Messages queued in a live owner are kept alive.
PARTITION_ACK_WAIT_S: Final = 4.0
MAX_IN_FLIGHT: Final = 64
