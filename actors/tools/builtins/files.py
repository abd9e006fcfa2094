"""`built-in:file_read` and `built-in:file_write`, confined to one root folder.

A path is refused when it is absolute, contains `..`, or resolves (through symlinks)
outside the root. Writes open the final component with O_NOFOLLOW, so a symlink planted
between the check and the write is refused too.
"""

from __future__ import annotations

import os
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


def file_tools(cfg: FilesConfig) -> list[LocalTool]:
    root = Path(os.path.realpath(cfg.root))
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"tools.files.root: cannot use {cfg.root}: {exc.strerror}") from exc

    @tool("built-in:file_read", read_only=True, idempotent=True, open_world=False,
          timeout_ms=10_000, source="built-in", pool=cfg.pool)
    def file_read(path: str, offset: int = 0, max_chars: int | None = None) -> dict[str, Any]:
        """Read a UTF-8 text file under the configured root.

        Args:
            path: relative to the root, e.g. notes/todo.md.
            offset: the first character to return.
            max_chars: how many characters at most (capped by the tool's max_read_chars).
        """
        real = confine(root, path)
        if not real.is_file():
            raise ToolError(f"{path!r} is not a file", error_type="not_found")
        limit = min(max_chars or cfg.max_read_chars, cfg.max_read_chars)
        text = real.read_text(encoding="utf-8", errors="replace")
        chunk = text[max(offset, 0):max(offset, 0) + limit]
        return {"path": path, "content": chunk, "total_chars": len(text),
                "truncated": max(offset, 0) + len(chunk) < len(text)}

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
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if append else os.O_TRUNC)
        try:
            fd = os.open(real, flags, 0o644)
        except OSError as exc:
            raise ToolError(f"cannot write {path!r}: {exc.strerror}",
                            error_type="path_refused" if exc.errno == 40 else "io_error") from exc
        data = content.encode()
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return {"path": path, "bytes_written": len(data), "appended": append}

    return [file_read, file_write]
