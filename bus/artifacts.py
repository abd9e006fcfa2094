"""Large tool results in the `toolbus_artifacts` object store, under `<sid>/<call_id>`.

The event keeps a `ResultRef` (key, size, sha256, preview) instead of the result, so no
event grows past the event limit. Chunks are streamed in and out; a read can write into
a file so that a 50 MB result is never held twice.
"""

from __future__ import annotations

import hashlib
import io
from typing import BinaryIO

import nats.errors
import nats.js.errors
from nats.js.object_store import ObjectStore

from bus.connection import Bus
from bus.subjects import ARTIFACTS_BUCKET
from schemas.defaults import RESULT_PREVIEW_CHARS
from schemas.errors import ArtifactError
from schemas.events import ResultRef


def artifact_key(session_id: str, call_id: str) -> str:
    return f"{session_id}/{call_id}"


def preview_of(data: bytes, chars: int = RESULT_PREVIEW_CHARS) -> str:
    head = data[: chars * 4].decode("utf-8", errors="ignore")[:chars]
    return head + ("…" if len(data) > len(head.encode()) else "")


class ArtifactStore:
    def __init__(self, bus: Bus) -> None:
        self._bus = bus
        self._obs: ObjectStore | None = None

    async def _store(self) -> ObjectStore:
        if self._obs is None:
            self._obs = await self._bus.js.object_store(ARTIFACTS_BUCKET)
        return self._obs

    async def put(self, session_id: str, call_id: str, data: bytes) -> ResultRef:
        """Store one result's JSON; storing the same key again replaces it (a rerun)."""
        key = artifact_key(session_id, call_id)
        try:
            await (await self._store()).put(key, io.BytesIO(data))
        except (nats.errors.Error, TimeoutError) as exc:
            raise ArtifactError(key, f"could not store {len(data)} bytes: {exc}") from exc
        return ResultRef(key=key, size=len(data), sha256=hashlib.sha256(data).hexdigest(),
                         preview=preview_of(data))

    async def read_into(self, ref: ResultRef, out: BinaryIO) -> None:
        """Write the stored bytes into `out`, checking size and digest."""
        try:
            result = await (await self._store()).get(ref.key, writeinto=out)  # type: ignore[arg-type]  # nats-py types it BufferedIOBase; any writable works
        except (nats.js.errors.NotFoundError, nats.js.errors.ObjectNotFoundError) as exc:
            raise ArtifactError(ref.key, "not in the object store (deleted, or the "
                                         "stream was purged)") from exc
        except (nats.errors.Error, TimeoutError) as exc:
            raise ArtifactError(ref.key, f"could not read it: {exc}") from exc
        if result.info.size != ref.size:
            raise ArtifactError(ref.key, f"is {result.info.size} bytes; the event says "
                                         f"{ref.size}")

    async def read(self, ref: ResultRef) -> bytes:
        buf = io.BytesIO()
        await self.read_into(ref, buf)
        data = buf.getvalue()
        if hashlib.sha256(data).hexdigest() != ref.sha256:
            raise ArtifactError(ref.key, "its sha256 does not match the event's")
        return data
