"""Session snapshots in the `toolbus_snapshots` KV bucket: `<sid>` -> `{version, state}`.

An optimisation only: a missing, stale, unreadable or old-version snapshot means the
session is folded from the log instead, so nothing here can change what a state is.
"""

from __future__ import annotations

import logging

import msgspec
import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from bus.connection import Bus
from bus.subjects import SNAPSHOTS_BUCKET
from schemas.state import STATE_VERSION, SessionState

log = logging.getLogger("toolbus.bus")

# Room left in the server's max payload for the KV message's subject and headers.
_PUT_HEADROOM = 16 * 1024


class Snapshot(msgspec.Struct, kw_only=True):
    version: int
    state: SessionState


_encoder = msgspec.json.Encoder(order="deterministic")
_decoder = msgspec.json.Decoder(Snapshot)


class SnapshotStore:
    def __init__(self, bus: Bus) -> None:
        self._bus = bus
        self._kv: KeyValue | None = None

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            self._kv = await self._bus.js.key_value(SNAPSHOTS_BUCKET)
        return self._kv

    async def load(self, session_id: str) -> SessionState | None:
        try:
            entry = await (await self._bucket()).get(session_id)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.BucketNotFoundError):
            return None
        except (nats.errors.Error, TimeoutError) as exc:
            log.debug("snapshot of %s not read: %s", session_id, exc)
            return None
        if not entry.value:
            return None
        try:
            snap = _decoder.decode(entry.value)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("snapshot of %s is unreadable (%s); folding the log", session_id, exc)
            return None
        if snap.version != STATE_VERSION or snap.state.session_id != session_id:
            return None
        return snap.state

    async def save(self, state: SessionState) -> bool:
        """Store a snapshot; False (and nothing stored) when it is too large."""
        return await self.save_encoded(state.session_id, encode_snapshot(state))

    def max_bytes(self) -> int:
        """The largest snapshot stored: what one KV value on this server can hold. A
        larger state is not snapshotted, and the snapshot it had stays where it was, so
        a cold start folds every event since: a fixed 1 MiB here (an eighth of toolbus's
        own servers' 8 MiB) froze a long session's snapshot at about 5,000 events and its
        cold starts read a tail that grew with each turn."""
        return self._bus.nc.max_payload - _PUT_HEADROOM

    async def save_encoded(self, session_id: str, data: bytes) -> bool:
        if len(data) > self.max_bytes():
            return False
        await (await self._bucket()).put(session_id, data)
        return True


def encode_snapshot(state: SessionState) -> bytes:
    return _encoder.encode(Snapshot(version=STATE_VERSION, state=state))
