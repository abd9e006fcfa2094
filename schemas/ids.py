"""Identifiers: validation of user-supplied names and derivation of deterministic ids."""

from __future__ import annotations

import hashlib
import re

from schemas.errors import InvalidIdError

TOKEN_RULE = "use 1 to 128 characters from A-Z a-z 0-9 _ -"
_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,128}")
# Tool names may also hold dots, which MCP servers use (`files.read`); namespaces may not.
# Dots separate non-empty parts: a catalog key (`ns.tool`) with an empty token is no key.
_TOOL_PART = re.compile(r"(?=.{1,128}$)[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*")

# Rejections of requests whose session id is unusable are stored under this reserved
# session, since the event subject needs a valid token.
SYSTEM_SESSION = "_toolbus"
AUTO_REQUEST_PREFIX = "auto-"
TOOL_EVENT_PREFIX = "te-"  # injected tool events: their ids, and the turns they start


def is_token(value: object) -> bool:
    return isinstance(value, str) and _TOKEN.fullmatch(value) is not None


def check_session_id(value: object) -> str:
    if not is_token(value):
        raise InvalidIdError("session id", value, TOKEN_RULE)
    assert isinstance(value, str)
    return value


def check_agent_name(value: object) -> str:
    if not is_token(value):
        raise InvalidIdError("agent name", value, TOKEN_RULE)
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
            "tool name", name,
            f"namespace: {TOKEN_RULE}; tool: the same, dots allowed between characters",
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


# -- message ids -------------------------------------------------------------------------
# Every event toolbus stores carries one of these as `Nats-Msg-Id`, so a redelivered
# message, a retried append or two processes racing write each fact once. They are
# derived from the session and the turn or call id only, never from time or chance.


def turn_requested_id(session_id: str, turn_id: str) -> str:
    return f"{session_id}:{turn_id}:requested"


def turn_ended_id(session_id: str, turn_id: str) -> str:
    """`turn.completed` and `turn.failed` share it: a turn ends once."""
    return f"{session_id}:{turn_id}:ended"


def call_requested_id(session_id: str, call_id: str) -> str:
    return f"{session_id}:{call_id}:requested"


def policy_decision_id(session_id: str, call_id: str) -> str:
    """`call.approved`, `approval.requested` and `call.rejected` share it."""
    return f"{session_id}:{call_id}:policy"


def human_decision_id(session_id: str, call_id: str) -> str:
    """`approval.granted` and `approval.denied` share it."""
    return f"{session_id}:{call_id}:decision"


def model_requested_id(session_id: str, turn_id: str, iteration: int) -> str:
    return f"{session_id}:{turn_id}:model:{iteration}:requested"


def model_responded_id(session_id: str, turn_id: str, iteration: int) -> str:
    """A model answers each iteration once: a planner that re-ran the call after a crash
    (the model call has no side effects) stores nothing new."""
    return f"{session_id}:{turn_id}:model:{iteration}:responded"


def policies_matched_id(session_id: str, turn_id: str, round_: int) -> str:
    """The policies are matched once per reevaluation round of a turn."""
    return f"{session_id}:{turn_id}:policies:{round_}"


def turn_reevaluated_id(session_id: str, turn_id: str, after_iteration: int) -> str:
    """One reevaluation (or its refusal at the limit) per model iteration whose calls set
    it off."""
    return f"{session_id}:{turn_id}:reeval:{after_iteration}"


def output_verdict_id(session_id: str, call_id: str) -> str:
    """`output.emitted` and `output.rejected` share it: an emit_output call is judged once."""
    return f"{session_id}:{call_id}:output"


def dispatch_id(session_id: str, call_id: str) -> str:
    return f"{session_id}:{call_id}:dispatch"


def call_started_id(session_id: str, call_id: str, attempt: int) -> str:
    return f"{session_id}:{call_id}:started:{attempt}"


def call_terminal_id(session_id: str, call_id: str) -> str:
    """Every terminal event of a call (`call.succeeded`, `call.failed`), whoever writes
    it: an executor, the session actor for a denied call, the janitor, or the kernel for
    a call that made an actor fail. So a call ends once."""
    return f"{session_id}:{call_id}:terminal"


def result_compressed_id(session_id: str, call_id: str) -> str:
    """A call's result is compressed (or transformed) once."""
    return f"{session_id}:{call_id}:compressed"


def tool_event_id(session_id: str, idempotency_key: str) -> str:
    """The id of an injected tool event, from its idempotency key: the same key in the
    same session is the same event (token-safe; the key itself may be any text)."""
    digest = hashlib.blake2b(f"{session_id}\x00{idempotency_key}".encode(),
                             digest_size=10).hexdigest()
    return f"{TOOL_EVENT_PREFIX}{digest}"


def tool_event_msg_id(session_id: str, event_id: str) -> str:
    return f"{session_id}:{event_id}:injected"


def turn_cancelled_id(session_id: str, turn_id: str) -> str:
    """Shares `turn_ended_id`'s: a turn ends once, completed, failed or cancelled."""
    return turn_ended_id(session_id, turn_id)


def request_rejected_id(request_seq: int) -> str:
    """A rejection of the request at this sequence of the requests stream."""
    return f"req:{request_seq}:rejected"


def message_rejected_id(actor: str, stream_seq: int) -> str:
    """A rejection, by the kernel, of the event at this sequence that `actor` could not
    handle."""
    return f"{actor}:{stream_seq}:rejected"


def client_request_id(session_id: str, request_id: str) -> str:
    """The message id a client publishes a request with: a resent request is stored once."""
    return f"{session_id}:{request_id}"


def catalog_key(tool_name: str) -> str:
    """KV keys cannot hold ':'; `ns:tool` is stored as `ns.tool`."""
    ns, tool = split_tool_name(tool_name)
    return f"{ns}.{tool}"


# An agent's child session (actors/agent_tools.py): `<agent>--<depth>-<20 hex>`.
_CHILD = re.compile(r"--(\d+)-[0-9a-f]{20}$")


def depth_of(session_id: str) -> int:
    """How deep in agent calls a session is: 0 for one a client started."""
    m = _CHILD.search(session_id)
    return int(m.group(1)) if m else 0


def child_session_id(parent: str, call_id: str, agent: str) -> str:
    """The child session of the call `call_id` of session `parent` (a call of
    `agent:<agent>`): the same every time, named for the agent, within the 128-character
    token rule."""
    digest = hashlib.blake2b(f"{parent}/{call_id}".encode(), digest_size=10).hexdigest()
    suffix = f"--{depth_of(parent) + 1}-{digest}"
    return f"{agent[:128 - len(suffix)]}{suffix}"
