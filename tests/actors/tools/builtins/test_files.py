"""`file_read`/`file_write` against real files and symbolic links: every path that
leaves the tool's root is refused, and a read costs what it returns, whatever the file's
size."""

from __future__ import annotations

import os
import tempfile
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.tools import ToolError
from actors.tools.builtins.files import confine, file_tools, open_beneath, read_chars
from schemas.manifest import FilesConfig
from tests.actors.tools.builtins.conftest import run_tool


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    (r / "notes").mkdir(parents=True)
    (r / "notes" / "a.txt").write_text("hello world")
    (tmp_path / "secret.txt").write_text("top secret")
    (r / "escape").symlink_to(tmp_path / "secret.txt")
    (r / "dir_escape").symlink_to(tmp_path)
    (r / "inside").symlink_to(r / "notes" / "a.txt")
    return r


async def test_file_read_and_write_stay_inside_the_root(root: Path) -> None:
    read, write = file_tools(FilesConfig(root=str(root)))
    assert write.spec.annotations.destructiveHint and read.spec.annotations.readOnlyHint
    assert (await run_tool(read, {"path": "notes/a.txt"}))["content"] == "hello world"
    assert (await run_tool(read, {"path": "inside"}))["content"] == "hello world"
    part = await run_tool(read, {"path": "notes/a.txt", "offset": 6, "max_chars": 3})
    assert part["content"] == "wor" and part["truncated"]
    assert (await run_tool(write, {"path": "out/new.md", "content": "x"}))["bytes_written"] == 1
    await run_tool(write, {"path": "out/new.md", "content": "y", "append": True})
    assert (root / "out" / "new.md").read_text() == "xy"


@pytest.mark.parametrize("args, why, kind", [
    ({"offset": -100}, "offset must be 0 or a previous result's next_offset", "invalid"),
    # -1 read nothing with next_offset 0 (a pager never moved); 0 read the whole budget.
    ({"max_chars": -1}, "max_chars must be 1 or more", "invalid"),
    ({"max_chars": 0}, "max_chars must be 1 or more", "invalid"),
    ({"path": "notes/a.txt/"}, "ends with /", "not_a_file"),
    ({"path": "notes/a.txt/."}, "ends with /", "not_a_file"),
])
async def test_file_read_refuses_arguments_a_pager_could_not_use(
        root: Path, args: dict[str, object], why: str, kind: str) -> None:
    read, _ = file_tools(FilesConfig(root=str(root)))
    with pytest.raises(ToolError, match=why) as err:
        await run_tool(read, {"path": "notes/a.txt", **args})
    assert err.value.error_type == ("invalid_arguments" if kind == "invalid" else kind)


@pytest.mark.parametrize("path, why", [
    ("../secret.txt", "contains '..'"),
    ("notes/../../secret.txt", "contains '..'"),
    ("/etc/passwd", "is absolute"),
    ("escape", "outside the tool's root through a symbolic link"),
    ("dir_escape/secret.txt", "outside the tool's root through a symbolic link"),
])
async def test_file_paths_that_leave_the_root_are_refused(root: Path, path: str,
                                                          why: str) -> None:
    read, write = file_tools(FilesConfig(root=str(root)))
    for t, args in ((read, {"path": path}), (write, {"path": path, "content": "pwned"})):
        with pytest.raises(ToolError, match=why) as err:
            await run_tool(t, args)
        assert err.value.error_type == "path_refused"
    assert (root.parent / "secret.txt").read_text() == "top secret"


async def test_file_read_pages_by_byte_offset_and_never_splits_a_character(
        root: Path) -> None:
    text = "héllo wörld € 𝄞 done"
    (root / "notes" / "u.txt").write_text(text, encoding="utf-8")
    read, _ = file_tools(FilesConfig(root=str(root)))
    pages, offset = [], 0
    while True:
        out = await run_tool(read, {"path": "notes/u.txt", "offset": offset, "max_chars": 3})
        assert out["offset"] == offset and len(out["content"]) <= 3
        pages.append(out["content"])
        offset = out["next_offset"]
        if not out["truncated"]:
            break
    assert "".join(pages) == text and offset == out["size_bytes"] == len(text.encode())
    # An offset inside "€" (bytes 14 to 16) starts at the next character.
    for offset in (15, 16):
        inside = await run_tool(read, {"path": "notes/u.txt", "offset": offset,
                                       "max_chars": 2})
        assert inside["offset"] == 17 and inside["content"] == " 𝄞"
    past = await run_tool(read, {"path": "notes/u.txt", "offset": 10_000})
    assert past["content"] == "" and past["offset"] == past["next_offset"] == len(text.encode())
    (root / "notes" / "bad.txt").write_bytes(b"ok\xff\xfeok")
    assert (await run_tool(read, {"path": "notes/bad.txt"}))["content"] == "ok\ufffd\ufffdok"


@settings(max_examples=200, deadline=None)
@given(data=st.one_of(st.text().map(lambda t: t.encode("utf-8")), st.binary(max_size=64)),
       limit=st.integers(min_value=1, max_value=9), offset=st.integers(min_value=0,
                                                                      max_value=80))
def test_pages_tile_the_file_and_rebuild_any_utf8_text(data: bytes, limit: int,
                                                       offset: int) -> None:
    with tempfile.TemporaryFile() as f:
        f.write(data)
        f.flush()
        start = min(offset, len(data))
        _, begin, _ = read_chars(f.fileno(), offset, limit)
        assert start <= begin <= min(start + 3, len(data))
        pages, pos = [], 0
        while True:
            content, begin, end = read_chars(f.fileno(), pos, limit)
            assert begin == pos and len(content) <= limit
            assert content == data[begin:end].decode("utf-8", "replace")
            pages.append(content)
            if end == len(data):
                break
            assert end > pos  # always progress
            pos = end
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return
    assert "".join(pages) == text


async def test_file_read_of_a_huge_file_costs_only_what_it_returns(root: Path) -> None:
    big = root / "notes" / "huge.bin"
    with big.open("wb") as f:  # 1 GiB, sparse: nothing but this word is on disk
        f.truncate(1 << 30)
        f.seek(600_000_000)
        f.write(b"needle")
    read, _ = file_tools(FilesConfig(root=str(root)))
    tracemalloc.start()
    try:
        out = await run_tool(read, {"path": "notes/huge.bin", "offset": 600_000_000,
                                    "max_chars": 10})
        _, small_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        full = await run_tool(read, {"path": "notes/huge.bin"})  # the default 100k chars
        _, default_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out["content"] == "needle\x00\x00\x00\x00" and out["truncated"]
    assert out["next_offset"] == 600_000_010 and out["size_bytes"] == 1 << 30
    assert len(full["content"]) == 100_000 and full["next_offset"] == 100_000
    assert small_peak < 1 << 20, small_peak  # reading it whole would take 2 GiB
    assert default_peak < 4 << 20, default_peak


async def test_file_read_refuses_a_fifo_and_a_folder_swapped_for_a_link_after_the_check(
        root: Path) -> None:
    read, _ = file_tools(FilesConfig(root=str(root)))
    os.mkfifo(root / "notes" / "pipe")
    with pytest.raises(ToolError, match="is not a file") as err:
        await run_tool(read, {"path": "notes/pipe"})  # opened without waiting for a writer
    assert err.value.error_type == "not_found"
    real = confine(root, "notes/a.txt")  # checked; then the folder becomes a link outward
    (root / "notes").rename(root / "was_notes")
    (root / "notes").symlink_to(root.parent)
    (root.parent / "a.txt").write_text("outside")
    with pytest.raises(ToolError, match="symbolic link") as err:
        open_beneath(root, real, os.O_RDONLY)
    assert err.value.error_type == "path_refused"


async def test_file_write_refuses_a_fifo_and_hard_links_leave_nothing_reachable(
        root: Path) -> None:
    read, write = file_tools(FilesConfig(root=str(root)))
    os.mkfifo(root / "notes" / "pipe")
    with pytest.raises(ToolError, match="is not a file"):
        await run_tool(write, {"path": "notes/pipe", "content": "x"})  # no hang
    outside = root.parent / "secret.txt"
    outside.write_text("do not touch")
    os.link(outside, root / "notes" / "linked.txt")  # planted by someone else
    for tool, args in ((write, {"path": "notes/linked.txt", "content": "overwritten"}),
                       (write, {"path": "notes/linked.txt", "content": "+", "append": True}),
                       (read, {"path": "notes/linked.txt"})):
        with pytest.raises(ToolError, match="other hard links") as err:
            await run_tool(tool, args)
        assert err.value.error_type == "path_refused"
    assert outside.read_text() == "do not touch"  # not truncated either
