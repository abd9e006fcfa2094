"""The HTTP gateway: requests, approvals and state over HTTP, for programs that do not
speak NATS. Every route is a thin mapping onto the bus; nothing here holds state.

    POST /sessions/{sid}/requests      body: a request (README) -> 202 {request_id, turn_id}
    POST /sessions/{sid}/tool_events   body: a tool event (seed 000) -> 201 {session_id,
                                       event_id, seq, turn_id} | 200 the same ids, its
                                       idempotency_key seen before | 400/413 bad body,
                                       nothing published | 409 refused (no planner)
    POST /sessions/{sid}/requests?stream=1
                                       the same, answered with the turn's events as
                                       server-sent events, ending with its end
    GET  /sessions/{sid}/events        server-sent events: the stored events after
                                       `?after=` (or `Last-Event-ID`), then the live ones;
                                       `?turn=` one turn's, ending with its end
    GET  /sessions/{sid}/state         the session actor's live state (`?full=1`: results
                                       stored by reference put back in)
    GET  /approvals                    calls waiting for a human
    POST /approvals/{sid}/{call_id}    body: {"decision": "approve"|"deny", "by", "note",
                                       "reason"} -> 200 taken | 409 already decided |
                                       404 not waiting | 400 bad body
    GET  /openapi.json                 this API as an OpenAPI document
    GET  /metrics                      this process's metrics, Prometheus text (any role)
    GET  /healthz                      no token; says nothing but "up"

The edge, in the order it is checked (DESIGN.md, "Roles and permissions"):

- Host must be one of `allowed_hosts` (any port): a page that rebinds its own DNS name to
  127.0.0.1 still sends its own name, and is refused (400).
- A request that carries `Origin` (a browser's) is refused (403) unless the origin is in
  `allowed_origins`, empty by default: a web page elsewhere can do nothing. Programs send
  no Origin.
- Every route but /healthz needs `Authorization: Bearer <token>`; the token names the role
  (`client` submits and reads state; `approver` also lists and decides approvals; `admin`
  everything): 401 without a valid token, 403 for a role without the right.
- POST bodies must be `Content-Type: application/json` (415 otherwise; it is also not a
  type a cross-origin page can send without a preflight), at most `MAX_BODY` bytes (413),
  and nest at most 64 levels (400).

The OpenAPI document's schemas are pydantic models for the gateway's own answers and the
request format, and msgspec's schemas of the bus's own structs (state, pending approval,
decision), so the document cannot drift from what is sent. Pydantic only documents: no
request goes through it.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal

import msgspec
import pydantic
from fastapi import FastAPI, Path, Query, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from actors import compressor
from bus.approvals import ApprovalStore
from bus.artifacts import ArtifactStore
from bus.client import ToolbusClient
from bus.connection import Bus, as_bus_error
from bus.feed import MAX_SEQ, SessionFeed
from bus.subjects import approval_subject
from schemas.errors import (
    BusTimeoutError,
    ConfigError,
    InvalidIdError,
    InvalidRequestError,
    RpcError,
    ToolbusError,
)
from schemas.ids import SYSTEM_SESSION, TOKEN_RULE, check_session_id, is_token, turn_id_for
from schemas.policy import HumanDecision, PendingApproval
from schemas.requests import (
    DEFAULT_MAX_REQUEST_BYTES,
    MAX_IDEMPOTENCY_KEY_CHARS,
    decode_json,
    is_tool_event,
    parse_request,
    parse_tool_event,
)
from schemas.state import SessionState, encode_state
from services.event_stream import error_frame, frame, frames

log = logging.getLogger("toolbus.gateway")

MAX_BODY: Final = 256 * 1024
# Slow clients: a request's head must arrive within HEAD_TIMEOUT_S of the connection (or of
# the answer before it), its body within BODY_TIMEOUT_S; at most MAX_CONNECTIONS are open
# at once, the rest closed as they come. Before any authentication, so that connections
# left open on purpose cannot use up the process's files.
HEAD_TIMEOUT_S: Final = 10.0
BODY_TIMEOUT_S: Final = 30.0
MAX_CONNECTIONS: Final = 512
# A stopping gateway drops an answer still unread after this (its reader reads no more).
STALLED_AT_STOP_S: Final = 1.0
# Event streams (server-sent events) open at once; more are refused (503).
MAX_STREAMS: Final = 256
# States too large for one reply, folded from the log here at once: each reads its whole
# log (tens of MB) on the gateway's one connection, which NATS cuts off as a slow consumer
# once 64 MB wait for it. The others wait their turn, at most FOLD_WAIT_S (then 503).
FOLDS_AT_ONCE: Final = 1
FOLD_WAIT_S: Final = 30.0
ROLES: Final = ("client", "approver", "admin")
# Loopback names only: a browser reaching the gateway under any other name came through
# someone else's DNS.
DEFAULT_HOSTS: Final = ("127.0.0.1", "localhost", "[::1]")
# Shorter than this is a password someone typed, not a token `toolbus up` issued.
MIN_TOKEN_CHARS: Final = 16

_ANY_ROLE: Final = frozenset(ROLES)
_APPROVERS: Final = frozenset({"approver", "admin"})

_STATUS_OF_CODE = {"invalid": 400, "not_found": 404, "conflict": 409, "too_large": 413,
                   "unavailable": 503, "internal": 500}

# A tool event refused, by its reason (`InvalidRequestError.reason`): 400 otherwise.
_TOOL_EVENT_STATUS = {"payload_too_large": 413, "no_planner": 409}

_SCHEMAS: Final = "#/components/schemas/{name}"


# The `code` of an error answer that names no more precise one, by its status.
_CODE_OF_STATUS: Final = {400: "invalid_request", 401: "unauthorized", 403: "forbidden",
                          404: "not_found", 405: "method_not_allowed", 408: "timeout",
                          409: "conflict", 413: "payload_too_large",
                          415: "unsupported_media_type", 500: "internal",
                          503: "unavailable"}



def _writable_session(sid: str) -> Response | None:
    """The 400 for a session no request or tool event may go to: an invalid id, or
    toolbus's own session (the session actor would refuse it; said now, not after a 202).
    None if it may."""
    try:
        check_session_id(sid)
    except InvalidIdError as exc:
        return _error(400, str(exc))
    if sid == SYSTEM_SESSION:
        return _error(400, f"{sid} is toolbus's own session (it keeps the rejections of "
                           "requests that name no usable session): send to a session of "
                           "yours")
    return None


def _error(status: int, message: str, headers: Mapping[str, str] | None = None
           ) -> JSONResponse:
    """`{ok: false, error, code}`, as every error answer of the gateway."""
    return JSONResponse({"ok": False, "error": message,
                         "code": _CODE_OF_STATUS.get(status, "error")},
                        status_code=status, headers=headers)


def _refuse(status: int, message: str, headers: Mapping[str, str] | None = None
            ) -> HTTPException:
    return HTTPException(status, detail=message, headers=dict(headers or {}))


# --- the edge: Host and Origin, before any route ------------------------------------------


def _host_name(value: str) -> str:
    """The name in a Host header, without its port, lowercased; "" if malformed."""
    value = value.strip().lower()
    if value.startswith("["):  # an IPv6 literal: [::1]:8787
        inside, bracket, rest = value.partition("]")
        if not bracket:
            return ""
        name = inside + bracket
    else:
        name, colon, port = value.partition(":")
        rest = colon + port
    if rest and not (rest.startswith(":") and rest[1:].isdigit()):
        return ""
    return name


class _EdgeGuard:
    """Refuses, before routing, what came through a browser or someone else's name."""

    def __init__(self, app: ASGIApp, *, hosts: frozenset[str], origins: frozenset[str]
                 ) -> None:
        self.app = app
        self.hosts = hosts
        self.origins = origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers: dict[str, str] = {}
        for raw_name, raw_value in scope["headers"]:
            name = raw_name.decode("latin-1")
            if name in headers and name in ("host", "origin"):
                # Two of them: which one counts depends on who reads; none does.
                refusal: tuple[int, str] | None = (400, f"more than one {name} header")
                break
            headers[name] = raw_value.decode("latin-1")
        else:
            refusal = self.refusal(headers)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await _error(*refusal)(scope, receive, send)

    def refusal(self, headers: Mapping[str, str]) -> tuple[int, str] | None:
        host = headers.get("host", "")
        if _host_name(host) not in self.hosts:
            return 400, (f"host {host!r} is not served here: address the gateway as "
                         f"{', '.join(sorted(self.hosts))}")
        origin = headers.get("origin")
        if origin is not None:
            if origin.rstrip("/").lower() in self.origins:
                return None
            allowed = ", ".join(sorted(self.origins)) or "none"
            return 403, (f"requests from web pages are refused: origin {origin!r} is not "
                         f"allowed (allowed origins: {allowed})")
        # A browser that sent no Origin (a top-level GET) still says where it came from.
        if headers.get("sec-fetch-site") in ("cross-site", "same-site"):
            return 403, "requests from other web sites are refused"
        return None


class _Outage:
    """A NATS error no route turned into one of ours (nats-py's own: a flush timeout as a
    stream subscribes, a read timing out), answered 503 here as the routes answer theirs
    (the connection logs its losses). Starlette's handler for `Exception` answers too, but
    re-raises, and the server then logs a traceback for what is an outage, not a bug."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:
            mapped = as_bus_error(exc)
            if mapped is None or started:
                raise
            await _error(503, str(mapped))(scope, receive, send)


# --- authentication ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Tokens:
    """Token digests -> role. Digests, so every comparison is over 32 bytes and the time
    taken says nothing about a token's length or how much of it matched."""

    roles: tuple[tuple[bytes, str], ...]

    @classmethod
    def of(cls, tokens: Mapping[str, str]) -> _Tokens:
        if not tokens:
            raise ConfigError("the HTTP gateway needs at least one bearer token (token -> "
                              f"role, roles {', '.join(ROLES)})")
        roles = []
        for token, role in tokens.items():
            if role not in ROLES:
                raise ConfigError(f"unknown HTTP gateway role {role!r}: choose from "
                                  f"{', '.join(ROLES)}")
            if len(token) < MIN_TOKEN_CHARS or not token.isascii() or \
                    not token.isprintable() or " " in token:
                raise ConfigError(f"a bearer token of the {role} role is not usable: give "
                                  f"at least {MIN_TOKEN_CHARS} printable ASCII characters, "
                                  "no spaces")
            roles.append((_digest(token), role))
        return cls(tuple(roles))

    def role_of(self, presented: str) -> str | None:
        digest = _digest(presented)
        found = None
        for known, role in self.roles:  # no early exit: every token costs the same
            if hmac.compare_digest(digest, known):
                found = role
        return found


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


_bearer = HTTPBearer(
    auto_error=False, scheme_name="bearer",
    description="A role's token: `toolbus up` writes one per role in "
                "`<data-dir>/auth/<role>.token` (client, approver, admin).")

_NO_TOKEN = {"WWW-Authenticate": 'Bearer realm="toolbus"'}


def _requires(allowed: frozenset[str], what: str
              ) -> Callable[[Request, HTTPAuthorizationCredentials | None], Awaitable[str]]:
    """A dependency: the caller's role, if its token is valid and the role may `what`."""

    async def role(request: Request, credentials: Annotated[
            HTTPAuthorizationCredentials | None, Security(_bearer)]) -> str:
        if credentials is None:
            raise _refuse(401, "this route needs a bearer token: send `Authorization: "
                               "Bearer <token>`, the token of a role as `toolbus up` wrote "
                               "it in <data-dir>/auth/<role>.token", _NO_TOKEN)
        tokens: _Tokens = request.app.state.tokens
        found = tokens.role_of(credentials.credentials)
        if found is None:
            raise _refuse(401, "the bearer token is not valid: use one of "
                               "<data-dir>/auth/<role>.token",
                          {"WWW-Authenticate": 'Bearer realm="toolbus", '
                                               'error="invalid_token"'})
        if found not in allowed:
            may = " or ".join(r for r in ROLES if r in allowed)
            raise _refuse(403, f"the {found} role may not {what}: use the token of the "
                               f"{may} role",
                          {"WWW-Authenticate": 'Bearer realm="toolbus", '
                                               'error="insufficient_scope"'})
        return found

    return role


Sid = Annotated[str, Path(description=f"the session id: {TOKEN_RULE}")]
CallId = Annotated[str, Path(description="the call id, as GET /approvals lists it")]
AnyRole = Annotated[str, Security(_requires(_ANY_ROLE, "use this route"))]
Approver = Annotated[str, Security(_requires(_APPROVERS, "list or decide approvals"))]


# --- bodies -------------------------------------------------------------------------------


async def _json_body(request: Request) -> tuple[bytes, Any]:
    """The body and its decoded value, once it is known to be JSON of a usable size and
    depth. The bytes go on to the bus as sent: its consumers decode them themselves."""
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != "application/json":
        raise _refuse(415, "send the body as JSON, with `Content-Type: application/json` "
                           f"(got {media or 'no Content-Type'})")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise _refuse(413, f"request body over {MAX_BODY} bytes")
    body = bytearray()
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            async for chunk in request.stream():  # bounded as it arrives, not after
                body += chunk
                if len(body) > MAX_BODY:
                    raise _refuse(413, f"request body over {MAX_BODY} bytes")
    except TimeoutError:
        raise _refuse(408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s"
                      ) from None
    except ClientDisconnect:  # nobody reads the answer; not the gateway's failure
        raise _refuse(400, "the client closed the connection before its body ended"
                      ) from None
    try:
        return bytes(body), decode_json(bytes(body), what="body")
    except InvalidRequestError as exc:
        raise _refuse(400, exc.message) from exc


# --- the OpenAPI document's models (documentation only) -----------------------------------


class Failure(pydantic.BaseModel):
    """Every refusal and error."""

    ok: Literal[False] = False
    error: str = pydantic.Field(description="what was wrong and what to do")
    code: str | None = pydantic.Field(
        None, description="from the bus: invalid, not_found, conflict, too_large, "
                          "unavailable, internal; for a request or a tool event, why it was "
                          "refused: "
                          "invalid_request, malformed_json, payload_too_large, no_planner")


class Accepted(pydantic.BaseModel):
    ok: Literal[True] = True
    request_id: str = pydantic.Field(description="the given one, or one made up")
    turn_id: str = pydantic.Field(description="the turn the request starts, derived from "
                                              "request_id")
    duplicate: bool = pydantic.Field(description="true if this request_id was seen before "
                                                 "(nothing new was started)")


class ToolEvent(pydantic.BaseModel):
    """Data the agent treats as if a tool had fetched it (seed 000): what a NATS client
    publishes on `toolbus.req.<sid>.tool_events`. Control characters (but tab and newline)
    are removed from every string before it is stored. Seen by the model from the
    session's next turn on."""

    model_config = pydantic.ConfigDict(extra="forbid")

    tool_id: str = pydantic.Field(
        pattern=r"^[A-Za-z0-9_-]{1,128}:[A-Za-z0-9_-]{1,128}$",
        description="a namespace:name label, e.g. injected:bank_statement; it need not "
                    "name a real tool")
    arguments: dict[str, Any] = pydantic.Field(
        default_factory=dict, description="what the tool was called with, for the record")
    result: Any = pydantic.Field(description="what the tool returned: any JSON")
    idempotency_key: str = pydantic.Field(
        min_length=1, max_length=MAX_IDEMPOTENCY_KEY_CHARS,
        description="the same key again stores nothing and answers the first event's ids")
    trigger_processing: bool = pydantic.Field(
        False, description="start a turn of the agent now, cancelling any turn in flight "
                           "(needs agent_config.model)")


class Injected(pydantic.BaseModel):
    ok: Literal[True] = True
    session_id: str
    event_id: str = pydantic.Field(description="derived from the idempotency_key")
    seq: int = pydantic.Field(description="the stream sequence of its tool_event.injected")
    turn_id: str | None = pydantic.Field(description="the turn it started "
                                                     "(trigger_processing), else null")
    created: bool = pydantic.Field(description="false when the key had been injected "
                                               "before (answered with 200)")


class DecisionTaken(pydantic.BaseModel):
    ok: Literal[True] = True
    decision: Literal["approved", "denied"]


class Health(pydantic.BaseModel):
    ok: Literal[True] = True


class Call(pydantic.BaseModel):
    """One call. It may also be written flat, `{"_tool": "ns:tool", "x": 1}`: every key
    without an underscore is then an argument."""

    model_config = pydantic.ConfigDict(extra="allow")

    tool: str | None = pydantic.Field(None, description="namespace:tool (or `_tool`, flat)")
    arguments: dict[str, Any] = pydantic.Field(default_factory=dict)
    reasoning: str | None = pydantic.Field(None, alias="_reasoningForCall",
                                           description="why the agent chose this call")
    output_path: str | None = pydantic.Field(
        None, alias="_outputPath", description="where the result goes in the session's "
                                               "state object (dotted)")
    delegate: str | None = pydantic.Field(None, alias="_delegate",
                                          description="an executor pool")
    instance: str | None = pydantic.Field(None, alias="_instance",
                                          description="one executor instance")


class ToolRequest(pydantic.BaseModel):
    """A request: what a NATS client publishes on `toolbus.req.<sid>`. What is wrong with
    it beyond being JSON is stored as a `request.rejected` event of the session."""

    model_config = pydantic.ConfigDict(extra="forbid")

    request_id: str | None = pydantic.Field(
        None, description="the idempotency key: the same id again starts nothing new")
    agent: str | None = pydantic.Field(None, description="who asks (per-agent grants)")
    calls: list[Call] | None = pydantic.Field(
        None, description="explicit tool calls; give these or `message`, not both")
    message: str | None = pydantic.Field(
        None, min_length=1, description="a turn the planner plays with the model "
                                        "(needs agent_config.model); or `calls`")
    messages: list[dict[str, str]] | None = pydantic.Field(
        None, description="instead of `message`: the conversation the client keeps, "
                          "oldest first, each {role: user|assistant, content}, the last "
                          "the user's")


def _body(schema: str) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _SCHEMAS.format(name=schema)}}}}}


def _json(schema: dict[str, Any], description: str, **extra: Any) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": schema}}, **extra}


def _failures(*statuses: int) -> dict[int | str, dict[str, Any]]:
    what = {400: "a bad id, Host or body", 401: "no valid bearer token",
            403: "a web page's Origin, or a role without the right",
            404: "not found", 409: "already decided, refused by the session, or a "
                                    "request id used for another request",
            413: "body too large",
            415: "not JSON", 503: "the bus did not answer"}
    return {s: {"model": Failure, "description": what[s]} for s in (400, 401, *statuses)}


class _Gateway(FastAPI):
    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema is None:
            doc = get_openapi(title=self.title, version=self.version,
                              description=self.description, routes=self.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            # FastAPI documents a 422 for every route with parameters; refusals here are
            # 400s (`_on_invalid`), already listed.
            for ops in doc["paths"].values():
                for op in ops.values():
                    op["responses"].pop("422", None)
            for unused in ("HTTPValidationError", "ValidationError"):
                schemas.pop(unused, None)
            _, bus_structs = msgspec.json.schema_components(
                [SessionState, PendingApproval, HumanDecision], ref_template=_SCHEMAS)
            schemas.update(bus_structs)
            request = ToolRequest.model_json_schema(
                ref_template=_SCHEMAS.replace("{name}", "{model}"))
            schemas.update(request.pop("$defs", {}))
            schemas["ToolRequest"] = request
            schemas["ToolEvent"] = ToolEvent.model_json_schema(
                ref_template=_SCHEMAS.replace("{name}", "{model}"))
            self.openapi_schema = doc
        return self.openapi_schema


def _operation_id(route: APIRoute) -> str:
    return route.name  # the handler's name: submit, state, pending, decide...


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return _error(exc.status_code, str(exc.detail), exc.headers)


async def _on_invalid(request: Request, exc: Exception) -> Response:
    """A parameter of the wrong shape: named, with what it must be (not pydantic's dump,
    which quotes the route's source file and line)."""
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    said = []
    for error in errors[:5]:
        loc = [str(part) for part in error.get("loc", ())]
        where = ".".join(loc[1:]) or ".".join(loc) or "the request"
        said.append(f"{where}: {str(error.get('msg', 'invalid')).lower()}")
    return _error(400, "; ".join(said) or "the request is not valid")


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    """A NATS error a route did not turn into one of ours is an outage (503); anything
    else a bug, answered without its details (500) and logged."""
    mapped = as_bus_error(exc)
    if mapped is not None:
        return _error(503, str(mapped))
    if isinstance(exc, ClientDisconnect):  # gone before its request ended: nobody to tell
        return _error(400, "the client closed the connection")
    log.error("gateway: %s %s failed", request.method, request.url.path, exc_info=exc)
    return _error(500, "internal error (logged by the gateway)")


# --- slow and idle connections --------------------------------------------------------------


def guarded_protocol() -> type:
    """uvicorn's HTTP/1.1 protocol, with the limits above (HEAD_TIMEOUT_S, MAX_CONNECTIONS);
    uvicorn itself waits for a request's head forever and takes any number of
    connections."""
    from uvicorn.protocols.http.h11_impl import H11Protocol  # only with the gateway

    class Guarded(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _waiting_for: object = None  # the scope when the timer started

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > MAX_CONNECTIONS:
                log.warning("gateway: over %d connections open; closing new ones",
                            MAX_CONNECTIONS)
                transport.abort()
                return
            self._await_head()

        def _await_head(self) -> None:
            self._waiting_for = self.scope
            self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_too_slow)

        def _head_too_slow(self) -> None:
            if self.scope is self._waiting_for:  # no new request since: drop it
                self.transport.abort()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._head_timer is not None and self.scope is not self._waiting_for:
                self._head_timer.cancel()  # a request's head came whole
                self._head_timer = None

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._head_timer is None and not self.transport.is_closing():
                self._await_head()  # the next request on this connection, if any

        def shutdown(self) -> None:
            super().shutdown()
            # An answer whose reader stopped reading (an event stream to a laptop gone to
            # sleep) waits for the socket forever: the stop would wait for it, then cancel
            # it mid-way. Dropped instead, once it had a moment to drain.
            if self.cycle is not None and not self.cycle.response_complete:
                self.loop.call_later(STALLED_AT_STOP_S, self._drop_if_stalled)

        def _drop_if_stalled(self) -> None:
            if self.flow.write_paused and not self.transport.is_closing():
                self.transport.abort()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

    return Guarded


# --- event streams ------------------------------------------------------------------------


def _flag(value: str | None, name: str) -> bool | Response:
    if value is None or value.lower() in ("0", "false"):
        return False
    if value.lower() in ("1", "true"):
        return True
    return _error(400, f"?{name}= takes 1 or true (or 0, false)")


class _Streams:
    """The event streams open, bounded: each holds a connection and a subscription."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open_now = 0
        self._streams: set[SessionFeed] = set()
        self._ending = False

    def end_all(self) -> None:
        """End every stream open (each with an `error` event, `stopping`), and refuse new
        ones: the gateway is stopping."""
        self._ending = True
        for stream in self._streams:
            stream.stop()

    async def open(self, stream: SessionFeed,
                   first: Callable[[SessionFeed], Awaitable[bytes]] | None = None
                   ) -> Response:
        """The SSE answer of `stream`; `first` (called once it is subscribed) gives its
        first event."""
        if self._ending:
            return _error(503, "the gateway is stopping")
        if self.open_now >= self.limit:
            return _error(503, f"{self.limit} event streams are open, the most this "
                               "gateway serves: close one, or try again later")
        self.open_now += 1
        self._streams.add(stream)
        try:
            await stream.open()
            head = await first(stream) if first is not None else b""
        except BaseException as exc:
            self._closed(stream)
            await stream.close()
            if isinstance(exc, InvalidRequestError):
                return _reused(exc)
            if isinstance(exc, ToolbusError):
                return _error(503, str(exc))
            raise
        return _EventStreamResponse(stream, head, self._closed)

    def _closed(self, stream: SessionFeed) -> None:
        self.open_now -= 1
        self._streams.discard(stream)


def _reused(exc: InvalidRequestError) -> Response:
    """409: the request id was used in the session for another request."""
    return JSONResponse({"ok": False, "error": exc.message, "code": "request_id_reused"},
                        status_code=409)


class _EventStreamResponse(StreamingResponse):
    """Server-sent events; the stream is closed however the answer ends, including when
    the reader left before its first byte (the body is then never iterated)."""

    def __init__(self, stream: SessionFeed, head: bytes,
                 closed: Callable[[SessionFeed], None]) -> None:
        self._stream = stream
        self._on_closed = closed
        super().__init__(self._body(head), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _body(self, head: bytes) -> AsyncIterator[bytes]:
        if head:
            yield head
        try:
            async for chunk in frames(self._stream):
                yield chunk
        except Exception as exc:  # the top of this answer: said to the reader, and ended
            mapped = exc if isinstance(exc, ToolbusError) else as_bus_error(exc)
            if mapped is None:
                log.error("gateway: an event stream failed", exc_info=exc)
            yield error_frame("unavailable", f"{mapped}; reconnect later with Last-Event-ID "
                              f"{self._stream.last}") if mapped is not None else \
                error_frame("internal", "the stream failed (the gateway logged why)")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_closed(self._stream)
            await self._stream.close()


# --- the app ------------------------------------------------------------------------------


def build_app(bus: Bus, *, tokens: Mapping[str, str],
              allowed_hosts: Sequence[str] = DEFAULT_HOSTS,
              allowed_origins: Sequence[str] = (),
              metrics: Callable[[], str] | None = None) -> FastAPI:
    """The gateway over `bus`. `tokens` maps each bearer token to its role (`client`,
    `approver` or `admin`); `allowed_hosts` are the names it answers to (any port);
    `allowed_origins` the web origins (`https://host[:port]`) whose pages may call it;
    `metrics` renders what `/metrics` serves (404 without it)."""
    known = _Tokens.of(tokens)  # before anything else: a bad token fails at once
    hosts = frozenset(f"[{h.lower()}]" if ":" in h and not h.startswith("[") else h.lower()
                      for h in allowed_hosts)
    origins = frozenset(o.rstrip("/").lower() for o in allowed_origins)
    client = ToolbusClient(bus)
    approvals = ApprovalStore(bus)
    streams = _Streams(MAX_STREAMS)
    artifacts = ArtifactStore(bus)
    folding = asyncio.Semaphore(FOLDS_AT_ONCE)

    async def folded(sid: str) -> SessionState:
        """The session's state, folded here from its log (`FOLDS_AT_ONCE`)."""
        try:
            async with asyncio.timeout(FOLD_WAIT_S):
                await folding.acquire()
        except TimeoutError:
            raise BusTimeoutError(f"this state is too large for one reply, and others "
                                  f"like it were being read from the log for "
                                  f"{FOLD_WAIT_S:g} s: try again later") from None
        try:
            return await client.fold_session(sid)
        finally:
            folding.release()

    async def resolve(state: SessionState) -> tuple[int, int]:
        """Put results stored by reference back into `state`, as the context tools read
        them (at most `READS_AT_ONCE` at a time in this process), up to
        `MAX_READ_RESULT_BYTES` in all: a tool may store 256 MiB, decoded here several
        times that, and any client may ask. Returns (resolved, left as references)."""
        resolved = left = 0
        budget = compressor.MAX_READ_RESULT_BYTES
        for call in state.calls.values():
            ref = call.result_ref
            if ref is None:
                continue
            if ref.size > budget:
                left += 1
                continue
            budget -= ref.size
            async with compressor.reading_bound():
                call.result = await compressor.read_result(artifacts, ref)
            resolved += 1
        return resolved, left

    app = _Gateway(
        title="toolbus HTTP gateway", version="1",
        description="Requests, approvals and state of toolbus over HTTP (README, "
                    "\"Over HTTP\"). Every route but /healthz needs a bearer token.",
        openapi_url=None, docs_url=None, redoc_url=None,  # served below, behind a token
        generate_unique_id_function=_operation_id,
        exception_handlers={HTTPException: _on_http_error,
                            RequestValidationError: _on_invalid,
                            Exception: _on_unexpected})
    app.state.tokens = known
    app.state.streams = streams

    @app.post("/sessions/{sid}/requests", status_code=202, response_model=Accepted,
              summary="Submit a request", openapi_extra=_body("ToolRequest"),
              responses={200: {"content": {"text/event-stream": {"schema": {
                  "type": "string"}}}, "description": "with ?stream=1: the turn's events "
                  "as server-sent events (as GET /sessions/{sid}/events?turn=), the first "
                  "`request.accepted`, the last the turn's end"},
                  **_failures(403, 409, 413, 415, 503)})
    async def submit(sid: Sid, request: Request, role: AnyRole, stream: Annotated[
            str | None, Query(description="1 or true: answer with the turn's events as "
                              "server-sent events (as GET /sessions/{sid}/events?turn=), "
                              "the first `request.accepted`, the last the turn's end")
            ] = None) -> Response:
        refused = _writable_session(sid)
        if refused is not None:
            return refused
        streamed = _flag(stream, "stream")
        if isinstance(streamed, Response):
            return streamed
        body, parsed = await _json_body(request)
        if is_tool_event(body):
            return JSONResponse({"ok": False, "code": "invalid_request", "error": (
                "this is a tool event: post it to /sessions/{sid}/tool_events, which "
                "answers with its stored ids")}, status_code=400)
        # A body that can never be a request is refused here, at once, with what is wrong,
        # and nothing is submitted: so is one over the session actor's size limit, as on
        # /tool_events. The number of calls is left to the session actor, whose limit is
        # the manifest's policy (a stored rejection).
        try:
            checked = parse_request(body, max_bytes=DEFAULT_MAX_REQUEST_BYTES,
                                    max_calls=sys.maxsize)
        except InvalidRequestError as exc:
            status = 413 if exc.reason == "payload_too_large" else 400
            return JSONResponse({"ok": False, "error": exc.message, "code": exc.reason},
                                status_code=status)
        if streamed and checked.cancel is not None:
            return _error(400, "a cancel request starts no turn to stream: follow the turn "
                               "it cancels (GET /sessions/{sid}/events?turn=)")
        request_id = parsed.get("request_id") if isinstance(parsed, dict) else None
        if not isinstance(request_id, str):
            request_id = uuid.uuid4().hex
            if isinstance(parsed, dict) and "request_id" not in parsed:
                # Give it an id, so the caller can find its turn and retry safely.
                parsed["request_id"] = request_id
                body = msgspec.json.encode(parsed)
        # Anything else wrong with the body becomes a stored `request.rejected`, exactly
        # as for a NATS client.
        if not streamed:
            try:
                sub = await client.submit(sid, body, request_id=request_id)
                if sub.duplicate:
                    await client.check_resent(sid, body, request_id)
            except InvalidRequestError as exc:  # its request id is another request's
                return _reused(exc)
            except ToolbusError as exc:
                return _error(503, str(exc))
            return JSONResponse({"ok": True, "request_id": request_id,
                                 "turn_id": sub.turn_id, "duplicate": sub.duplicate},
                                status_code=202)
        # Watching before submitting, from the log's end then: nothing of the turn can be
        # stored before the stream sees it.
        turn_id = turn_id_for(request_id)
        try:
            after = await client.log.last_seq_of(sid)
        except ToolbusError as exc:
            return _error(503, str(exc))

        async def submitted(watch: SessionFeed) -> bytes:
            sub = await client.submit(sid, body, request_id=request_id)
            if sub.duplicate:
                await client.check_resent(sid, body, request_id)  # not another request
                watch.restart(0)  # sent before: its turn is in the log, read from the start
            return frame("request.accepted", msgspec.json.encode({
                "ok": True, "request_id": request_id, "turn_id": sub.turn_id,
                "duplicate": sub.duplicate}))

        return await streams.open(SessionFeed(bus, sid, after=after, turn_id=turn_id),
                                  submitted)

    @app.get("/sessions/{sid}/events", summary="A session's events, as server-sent events",
             responses={200: {"content": {"text/event-stream": {"schema": {
                 "type": "string"}}}, "description": "`id` the stream sequence, `event` "
                 "the event's type, `data` its JSON; `model.delta` (live text, not stored) "
                 "has no id; `error` (the bus unavailable, the gateway stopping) ends it; "
                 "`: keep-alive` comments every 15 s while quiet"},
                 **_failures(403, 503)})
    async def events(sid: Sid, request: Request, role: AnyRole,
                     after: Annotated[int | None, Query(
                         ge=0, le=MAX_SEQ, description="start after this stream "
                         "sequence (default 0: the whole session); a `Last-Event-ID` header "
                         "wins")] = None,
                     turn: Annotated[str | None, Query(
                         description="only this turn's events; the stream ends with its "
                         "end")] = None) -> Response:
        try:
            check_session_id(sid)
            if turn is not None and not is_token(turn):
                raise InvalidIdError("turn id", turn, TOKEN_RULE)
        except InvalidIdError as exc:
            return _error(400, str(exc))
        resume = request.headers.get("last-event-id")
        if resume is not None:
            if not (resume.isascii() and resume.isdigit() and len(resume) <= 20
                    and int(resume) <= MAX_SEQ):
                return _error(400, "Last-Event-ID is not an event id of this stream (a "
                                   "stream sequence, as its `id:` lines give)")
            after = int(resume)
        return await streams.open(SessionFeed(bus, sid, after=after or 0, turn_id=turn))

    @app.post("/sessions/{sid}/tool_events", status_code=201, response_model=Injected,
              summary="Inject a tool event", openapi_extra=_body("ToolEvent"),
              responses={200: {"model": Injected, "description": "its idempotency_key was "
                               "injected before: the first event's ids, nothing new"},
                         **_failures(403, 409, 413, 415, 503)})
    async def inject(sid: Sid, request: Request, role: AnyRole) -> Response:
        refused = _writable_session(sid)
        if refused is not None:
            return refused
        body, _ = await _json_body(request)
        # Checked here, unlike a request: a bad tool event is refused with nothing
        # published, so the caller learns at once (and the session's log stays clean).
        try:
            tool_event = parse_tool_event(body)
            got = await client.inject(
                sid, tool_event.tool_id, tool_event.result, arguments=tool_event.arguments,
                idempotency_key=tool_event.idempotency_key,
                trigger_processing=tool_event.trigger_processing)
        except InvalidRequestError as exc:
            status = _TOOL_EVENT_STATUS.get(exc.reason, 400)
            return JSONResponse({"ok": False, "error": exc.message, "code": exc.reason},
                                status_code=status)
        except ToolbusError as exc:
            return _error(503, str(exc))
        return JSONResponse({"ok": True, "session_id": sid, "event_id": got.event_id,
                             "seq": got.seq, "turn_id": got.turn_id, "created": got.created},
                            status_code=201 if got.created else 200)

    @app.get("/sessions/{sid}/state", summary="A session's live state",
             responses={200: _json({"$ref": _SCHEMAS.format(name="SessionState")},
                                   "the state", headers={
                 "X-Toolbus-State-Source": {"description": "`log` when the state was too "
                                            "large for one reply and was folded from the "
                                            "event log here", "schema": {"type": "string"}},
                 "X-Toolbus-Resolved-References": {"description": "with full=1: how many "
                                                   "results were put back in",
                                                   "schema": {"type": "integer"}},
                 "X-Toolbus-Unresolved-References": {
                     "description": "with full=1: how many results were left as references "
                     "(`result_ref`), past the 16 MiB put back in one reply (`toolbus "
                     "replay SID --full` reads them all)", "schema": {"type": "integer"}}}),
                        **_failures(403, 503)})
    async def state(sid: Sid, role: AnyRole, full: Annotated[str | None, Query(
            description="1 or true: put results stored by reference back in")] = None
                    ) -> Response:
        headers: dict[str, str] = {}
        resolving = _flag(full, "full")
        if isinstance(resolving, Response):
            return resolving
        try:
            check_session_id(sid)
            try:
                live = await client.live_state(sid)
            except RpcError as exc:
                if exc.code != "too_large":
                    raise
                # Too large for one reply: the same reducer over the log, here.
                live = await folded(sid)
                headers["X-Toolbus-State-Source"] = "log"
            if resolving:
                resolved, left = await resolve(live)
                headers["X-Toolbus-Resolved-References"] = str(resolved)
                if left:
                    headers["X-Toolbus-Unresolved-References"] = str(left)
        except InvalidIdError as exc:
            return _error(400, str(exc))
        except ToolbusError as exc:
            return _error(503, str(exc))
        return Response(encode_state(live), media_type="application/json", headers=headers)

    @app.get("/approvals", summary="Calls waiting for a human",
             responses={200: _json({"type": "array", "items": {
                 "$ref": _SCHEMAS.format(name="PendingApproval")}}, "oldest first"),
                 **_failures(403, 503)})
    async def pending(role: Approver) -> Response:
        try:
            items = await approvals.load()
        except ToolbusError as exc:
            return _error(503, str(exc))
        return Response(msgspec.json.encode(items), media_type="application/json")

    @app.post("/approvals/{sid}/{call_id}", response_model=DecisionTaken,
              summary="Approve or deny a call", openapi_extra=_body("HumanDecision"),
              responses=_failures(403, 404, 409, 413, 415, 503))
    async def decide(sid: Sid, call_id: CallId, request: Request, role: Approver) -> Response:
        try:
            check_session_id(sid)
            if not is_token(call_id):
                raise InvalidIdError("call id", call_id, TOKEN_RULE)
        except InvalidIdError as exc:
            return _error(400, str(exc))
        body, _ = await _json_body(request)
        # The approval actor records the principal beside the name the body gives (`by`).
        subject = approval_subject(sid, call_id, f"http-{role}")
        try:
            reply = await bus.request(subject, body, timeout=10, who="an approval actor")
        except ToolbusError as exc:
            return _error(503, str(exc))
        answer: dict[str, Any] = msgspec.json.decode(reply)
        if answer.get("ok"):
            return JSONResponse(answer)
        status = _STATUS_OF_CODE.get(str(answer.get("code")), 500)
        # The actor's own codes ("invalid"), told in the gateway's words as every other
        # error answer ("invalid_request").
        answer["code"] = _CODE_OF_STATUS.get(status, "error")
        return JSONResponse(answer, status_code=status)

    @app.get("/openapi.json", summary="This API, as an OpenAPI document",
             responses={200: _json({"type": "object"}, "OpenAPI 3"), **_failures(403)})
    async def openapi(role: AnyRole) -> Response:
        return JSONResponse(app.openapi())

    @app.get("/metrics", summary="This process's metrics, in the Prometheus text format",
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text exposition 0.0.4"},
                        **_failures(404)})
    async def metrics_text(role: AnyRole) -> Response:
        # Any role's token: a scraper is given the least one (client). Rendered here, in
        # the event loop that owns the actors' state the gauges read.
        if metrics is None:
            return _error(404, "metrics are off in this process")
        return Response(metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.head("/healthz", include_in_schema=False)  # as some load balancers ask
    @app.get("/healthz", response_model=Health, summary="Is the gateway up (no token)")
    async def health() -> Response:
        return JSONResponse({"ok": True})  # and nothing more: anyone may ask

    app.add_middleware(_Outage)
    if origins:
        # The pages allowed in need CORS answers, and their preflights answered.
        app.add_middleware(CORSMiddleware, allow_origins=sorted(origins),
                           allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(_EdgeGuard, hosts=hosts, origins=origins)  # outermost
    return app

