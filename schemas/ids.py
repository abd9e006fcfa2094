"""Identifiers: validation of user-supplied names and derivation of deterministic ids."""

from __future__ import annotations

import hashlib
import re

from schemas.errors import InvalidIdError

TOKEN_RULE = "use 1 to 128 characters from A-Z a-z 0-9 _ -"
_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,128}")
# Tool names may also hold dots, which MCP servers use (`files.read`); namespaces may not.
_TOOL_PART = re.compile(r"[A-Za-z0-9_.-]{1,128}")

# Rejections of requests whose session id is unusable are stored under this reserved
# session, since the event subject needs a valid token.
SYSTEM_SESSION = "_toolbus"
AUTO_REQUEST_PREFIX = "auto-"


def is_token(value: object) -> bool:
    return isinstance(value, str) and _TOKEN.fullmatch(value) is not None


def check_session_id(value: object) -> str:
    if not is_token(value):
        raise InvalidIdError("session id", value, TOKEN_RULE)
    assert isinstance(value, str)
    return value


def check_namespace(value: object) -> str:
    if not is_token(value):
        raise InvalidIdError("tool namespace", value, TOKEN_RULE)
    assert isinstance(value, str)
    return value


def split_tool_name(name: object) -> tuple[str, str]:
    """Split `namespace:tool`, raising `InvalidIdError` naming what is wrong."""
    if not isinstance(name, str) or name.count(":") != 1:
        raise InvalidIdError(
            "tool name", name, "write it as namespace:tool, e.g. built-in:echo"
        )
    ns, tool = name.split(":")
    if not _TOKEN.fullmatch(ns) or not _TOOL_PART.fullmatch(tool):
        raise InvalidIdError(
            "tool name", name, f"namespace: {TOKEN_RULE}; tool: the same, dots allowed"
        )
    return ns, tool


def check_tool_name(name: object) -> str:
    split_tool_name(name)
    assert isinstance(name, str)
    return name


def turn_id_for(request_id: str) -> str:
    """A token-safe turn id derived from a request id, the same every time."""
    if len(request_id) <= 64 and _TOKEN.fullmatch(request_id):
        return request_id
    return "h" + hashlib.blake2b(request_id.encode(), digest_size=12).hexdigest()


def call_id_for(turn_id: str, index: int) -> str:
    return f"{turn_id}-{index}"


def catalog_key(tool_name: str) -> str:
    """KV keys cannot hold ':'; `ns:tool` is stored as `ns.tool`."""
    ns, tool = split_tool_name(tool_name)
    return f"{ns}.{tool}"
