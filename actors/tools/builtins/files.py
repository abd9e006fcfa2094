"""`built-in:file_read` and `built-in:file_write`, confined to one root folder.

A path is refused when it is absolute, contains `..`, or resolves (through symlinks)
outside the root. The checked path is then opened one component at a time from the root,
each with O_NOFOLLOW, so a symlink planted between the check and the open is refused too.

`file_read` reads only what it returns: it seeks to a byte `offset` and reads at most about
`max_chars` characters' worth of bytes, whatever the file's size, and tells where to go on
(`next_offset`). An offset inside a UTF-8 character moves to the next character; bytes
that are not UTF-8 read as U+FFFD.
"""

from __future__ import annotations

import codecs
import errno
import os
import stat
from pathlib import Path, PurePosixPath
from typing import Any

from actors.tools import LocalTool, ToolError, tool
from schemas.errors import ConfigError
from schemas.manifest import FilesConfig


def confine(root: Path, rel: str) -> Path:
    """The real path of `rel` under `root`, or a `ToolError` saying why it is refused."""
    if not rel or "\x00" in rel:
        raise ToolError("path is empty or contains a NUL byte", error_type="path_refused")
    p = PurePosixPath(rel.replace("\\", "/"))
    if p.is_absolute() or (len(rel) > 1 and rel[1] == ":"):
        raise ToolError(f"{rel!r} is absolute; give a path relative to the tool's root",
                        error_type="path_refused")
    if ".." in p.parts:
        raise ToolError(f"{rel!r} contains '..'; paths may not leave the tool's root",
                        error_type="path_refused")
    real = Path(os.path.realpath(root / p))
    if real != root and root not in real.parents:
        raise ToolError(f"{rel!r} leads outside the tool's root through a symbolic link",
                        error_type="path_refused")
    return real


def open_beneath(root: Path, real: Path, flags: int, mode: int = 0o644) -> int:
    """Open `real` (a path `confine` returned) walking down from `root`, refusing a symbolic
    link at any step: what openat2's RESOLVE_BENEATH gives, with plain openat."""
    parts = real.relative_to(root).parts
    if not parts:
        raise ToolError("the tool's root is a folder, not a file", error_type="not_found")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            try:
                step = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                               dir_fd=fd)
            except OSError as exc:
                raise _open_error(exc, part, fd) from exc
            os.close(fd)
            fd = step
        try:
            return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
        except OSError as exc:
            raise _open_error(exc, parts[-1], fd) from exc
    finally:
        os.close(fd)


def _plain_file(fd: int, path: str) -> os.stat_result:
    """The file's stat, if it is a regular file with one name; a `ToolError` if it is a
    FIFO, a device or a folder, or has other hard links (one of which may be outside the
    root: writing or reading it here would reach there)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ToolError(f"{path!r} is not a file", error_type="not_found")
    if st.st_nlink > 1:
        raise ToolError(f"{path!r} has other hard links, which may lie outside the root; "
                        "refused", error_type="path_refused")
    return st


def _open_error(exc: OSError, name: str, dir_fd: int) -> ToolError:
    try:
        link = stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
    except OSError:
        link = False
    if link or exc.errno == errno.ELOOP:
        return ToolError(f"{name!r} became a symbolic link while it was being opened",
                         error_type="path_refused")
    if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.EISDIR):
        return ToolError(f"{name!r}: {exc.strerror}", error_type="not_found")
    if exc.errno == errno.ENXIO:  # a FIFO without a reader, opened without waiting
        return ToolError(f"{name!r} is not a file (a FIFO or a device)",
                         error_type="not_found")
    return ToolError(f"cannot open {name!r}: {exc.strerror}", error_type="io_error")


_READ_CHUNK = 64 * 1024


def _next_boundary(fd: int, offset: int, size: int) -> int:
    """`offset`, or the end of the character it falls inside. A character that contains it
    starts at most 3 bytes before and ends at most 3 after, and a lead byte always starts
    a new character, so decoding those 6 bytes finds it."""
    low = max(0, offset - 3)
    window = os.pread(fd, min(offset + 3, size) - low, low)
    pos = low
    for ch in window.decode("utf-8", "surrogateescape"):
        end = pos + len(ch.encode("utf-8", "surrogateescape"))
        if end > offset:
            return end if pos < offset else offset
        pos = end
    return offset


def read_chars(fd: int, offset: int, limit: int) -> tuple[str, int, int]:
    """At most `limit` characters of the UTF-8 file `fd` from byte `offset`: the text, the
    byte offset it really starts at and the one after it. Reads about `limit` characters'
    worth of bytes (at most 4 each), never the rest of the file."""
    size = os.fstat(fd).st_size
    start = min(max(offset, 0), size)
    if 0 < start < size:
        start = _next_boundary(fd, start, size)
    # surrogateescape maps each undecodable byte to one character, so the text returned
    # re-encodes to exactly the bytes it came from and the end offset is exact.
    decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
    parts: list[str] = []
    count, pos = 0, start
    while count < limit and pos < size:
        data = os.pread(fd, min(max(limit - count, 4), _READ_CHUNK, size - pos), pos)
        if not data:  # the file shrank under us
            break
        pos += len(data)
        text = decoder.decode(data, final=pos >= size)
        parts.append(text)
        count += len(text)
    raw = "".join(parts)[:limit].encode("utf-8", "surrogateescape")
    return raw.decode("utf-8", "replace"), start, start + len(raw)


def file_tools(cfg: FilesConfig) -> list[LocalTool]:
    root = Path(os.path.realpath(cfg.root))
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"tools.files.root: cannot use {cfg.root}: {exc.strerror}") from exc

    @tool("built-in:file_read", read_only=True, idempotent=True, open_world=False,
          timeout_ms=10_000, source="built-in", pool=cfg.pool)
    def file_read(path: str, offset: int = 0, max_chars: int | None = None) -> dict[str, Any]:
        """Read part of a UTF-8 text file under the configured root.

        Args:
            path: relative to the root, e.g. notes/todo.md.
            offset: the byte to start at: 0, or a previous result's next_offset.
            max_chars: how many characters at most (capped by the tool's max_read_chars).
        """
        if offset < 0:
            raise ToolError(f"offset must be 0 or a previous result's next_offset, got "
                            f"{offset}", error_type="invalid_arguments")
        if max_chars is not None and max_chars < 1:
            # 0 read the whole budget, and a negative one nothing, forever (next_offset 0).
            raise ToolError(f"max_chars must be 1 or more (or left out: "
                            f"{cfg.max_read_chars}), got {max_chars}",
                            error_type="invalid_arguments")
        if path.endswith(("/", "/.")):
            raise ToolError(f"{path[:200]!r} ends with / (a directory's path): give a file's",
                            error_type="not_a_file")
        real = confine(root, path)
        limit = min(max_chars or cfg.max_read_chars, cfg.max_read_chars)
        # O_NONBLOCK: a FIFO planted at the path must not hang the open.
        fd = open_beneath(root, real, os.O_RDONLY | os.O_NONBLOCK)
        try:
            st = _plain_file(fd, path)
            try:
                content, start, end = read_chars(fd, offset, limit)
            except OSError as exc:
                raise ToolError(f"cannot read {path!r}: {exc.strerror}",
                                error_type="io_error") from exc
        finally:
            os.close(fd)
        return {"path": path, "content": content, "offset": start, "next_offset": end,
                "size_bytes": st.st_size, "truncated": end < st.st_size}

    @tool("built-in:file_write", destructive=True, idempotent=True, open_world=False,
          risk_level="medium", timeout_ms=10_000, source="built-in", pool=cfg.pool)
    def file_write(path: str, content: str, append: bool = False,
                   create_dirs: bool = True) -> dict[str, Any]:
        """Write (or append) UTF-8 text to a file under the configured root.

        Args:
            path: relative to the root, e.g. out/report.md.
            content: the text to write.
            append: add to the end instead of replacing the file.
            create_dirs: create missing parent folders.
        """
        real = confine(root, path)
        if create_dirs:
            real.parent.mkdir(parents=True, exist_ok=True)
            confine(root, path)  # the folders just made must still be inside the root
        # Not truncated at open: only once it is known to be a plain file of its own (a
        # FIFO must not hang the call, a hard link must not carry the write outside).
        flags = os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | (os.O_APPEND if append else 0)
        fd = open_beneath(root, real, flags)
        data = content.encode()
        try:
            _plain_file(fd, path)
            os.set_blocking(fd, True)
            if not append:
                os.ftruncate(fd, 0)
        except BaseException:
            os.close(fd)
            raise
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return {"path": path, "bytes_written": len(data), "appended": append}

    return [file_read, file_write]
