"""Large tool results in the `toolbus_artifacts` object store, under
`<sid>/<call_id>/<attempt>` (per attempt, so a rerun on another executor never replaces
the bytes an event already references).

The event keeps a `ResultRef` (key, size, sha256, preview) instead of the result, so no
event grows past the event limit. Chunks are streamed in and out; a read can write into
a file so that a 50 MB result is never held twice.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
from collections.abc import Iterable, Iterator
from typing import BinaryIO

import msgspec
import nats.errors
import nats.js.errors
from nats.js.object_store import ObjectStore

from bus.connection import Bus
from bus.direct import direct_batch, direct_last
from bus.subjects import ARTIFACTS_BUCKET
from schemas.defaults import RESULT_PREVIEW_CHARS
from schemas.errors import ArtifactError, BusTimeoutError
from schemas.events import ResultRef

_encode = msgspec.json.Encoder().encode
_CHUNK_BATCH = 32  # chunks (128 KiB each) per direct get


def artifact_key(session_id: str, call_id: str, attempt: int) -> str:
    return f"{session_id}/{call_id}/{attempt}"


class _ChunkReader:
    """`readinto` over an iterable of byte strings, hashing and counting them, and
    keeping the first few KB for the preview. nats-py calls it from a worker thread."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks = iter(chunks)
        self._buf = memoryview(b"")
        self.sha = hashlib.sha256()
        self.size = 0
        self.head = b""

    def readinto(self, out: bytearray) -> int:
        while not self._buf:
            try:
                chunk = next(self._chunks)
            except StopIteration:
                return 0
            self.sha.update(chunk)
            self.size += len(chunk)
            if len(self.head) < 4 * RESULT_PREVIEW_CHARS:
                self.head += chunk[: 4 * RESULT_PREVIEW_CHARS]
            self._buf = memoryview(chunk)
        n = min(len(out), len(self._buf))
        out[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


def json_string_chunks(text: str, piece: int = 64 * 1024) -> Iterator[bytes]:
    """The JSON encoding of a string, in pieces: each piece of characters encodes on its
    own (a Python string holds whole code points, so no escape is ever split)."""
    yield b'"'
    for i in range(0, len(text), piece):
        yield _encode(text[i:i + piece])[1:-1]
    yield b'"'


class _Checked:
    """A writer that hashes and counts what passes through it."""

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.out.write(data)


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

    async def put(self, session_id: str, call_id: str, attempt: int,
                  data: bytes) -> ResultRef:
        """Store one result's JSON (the same attempt again replaces it)."""
        return await self.put_chunks(session_id, call_id, attempt, (data,))

    async def put_chunks(self, session_id: str, call_id: str, attempt: int,
                         chunks: Iterable[bytes]) -> ResultRef:
        """Store one result's JSON given in pieces, never joined: a large result is held
        once (as the tool returned it), not twice."""
        key = artifact_key(session_id, call_id, attempt)
        reader = _ChunkReader(chunks)
        try:
            await (await self._store()).put(key, reader)  # type: ignore[arg-type]  # any object with readinto() works
        except (nats.errors.Error, TimeoutError) as exc:
            raise ArtifactError(key, f"could not store {reader.size} bytes: {exc}") from exc
        return ResultRef(key=key, size=reader.size, sha256=reader.sha.hexdigest(),
                         preview=preview_of(reader.head))

    async def read_into(self, ref: ResultRef, out: BinaryIO) -> None:
        """Write the stored bytes into `out`, then check their size and sha256 against the
        reference (`ArtifactError` if they differ: `out` then holds bad bytes). Bounded:
        30 s plus a second per MB. Direct gets only: the read-only roles can read a
        result without the right to create a consumer."""
        checked = _Checked(out)
        stream = f"OBJ_{ARTIFACTS_BUCKET}"
        name = base64.urlsafe_b64encode(ref.key.encode()).decode()
        try:
            async with asyncio.timeout(30 + ref.size / 1e6):
                meta = await direct_last(self._bus, stream, f"$O.{ARTIFACTS_BUCKET}.M.{name}")
                info = msgspec.json.decode(meta) if meta else None
                if not isinstance(info, dict) or info.get("deleted") or \
                        not isinstance(info.get("nuid"), str):
                    raise ArtifactError(ref.key, "not in the object store (deleted, or the "
                                                 "stream was purged)")
                chunks = f"$O.{ARTIFACTS_BUCKET}.C.{info['nuid']}"
                start = 1
                while True:
                    batch, pending = await direct_batch(self._bus, stream, chunks, start,
                                                        _CHUNK_BATCH)
                    for _, _, data in batch:
                        checked.write(data)
                    if not batch or pending == 0:
                        break
                    start = batch[-1][0] + 1
        except TimeoutError as exc:
            raise ArtifactError(ref.key, "not read in time (its chunks may be missing)"
                                ) from exc
        except (nats.errors.Error, BusTimeoutError) as exc:
            raise ArtifactError(ref.key, f"could not read it: {exc}") from exc
        if checked.size != ref.size or checked.sha.hexdigest() != ref.sha256:
            raise ArtifactError(ref.key, f"holds {checked.size} bytes that do not match "
                                         f"the event's reference ({ref.size} bytes, sha256 "
                                         f"{ref.sha256[:12]}…)")

    async def read(self, ref: ResultRef) -> bytes:
        buf = io.BytesIO()
        await self.read_into(ref, buf)
        return buf.getvalue()
