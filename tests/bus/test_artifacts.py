"""Large results in the object store: streamed in pieces, read back checked."""

from __future__ import annotations

import io

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bus.artifacts import ArtifactStore, json_string_chunks
from bus.connection import Bus
from schemas.errors import ArtifactError


@given(st.text(), st.integers(min_value=1, max_value=7))
def test_a_string_encoded_in_pieces_is_its_json_encoding(text: str, piece: int) -> None:
    assert b"".join(json_string_chunks(text, piece)) == msgspec.json.encode(text)


async def test_a_result_streamed_in_pieces_reads_back_whole_and_checked(bus: Bus, sid) -> None:
    store = ArtifactStore(bus)
    text = 'quote " newline \n emoji \U0001f600 ' * 20_000
    ref = await store.put_chunks(sid, "c-0", 1, json_string_chunks(text, 1000))
    data = msgspec.json.encode(text)
    assert ref.size == len(data) and ref.key == f"{sid}/c-0/1"
    assert ref.preview.startswith('"quote \\" newline')
    assert await store.read(ref) == data
    # The same key with other bytes (a forged or stale object) is refused, not served.
    await store.put_chunks(sid, "c-0", 1, [b'"' + b"x" * (len(data) - 2) + b'"'])
    with pytest.raises(ArtifactError, match="do not match"):
        await store.read_into(ref, io.BytesIO())
