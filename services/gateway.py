"""The HTTP gateway: requests, approvals and state over HTTP, for programs that do not
speak NATS. Every route is a thin mapping onto the bus; nothing here holds state.

    POST /sessions/{sid}/requests      body: a request (README) -> 202 {request_id, turn_id}
    GET  /sessions/{sid}/state         the session actor's live state
    GET  /approvals                    calls waiting for a human
    POST /approvals/{sid}/{call_id}    body: {"decision": "approve"|"deny", "by", "note",
                                       "reason"} -> 200 taken | 409 already decided |
                                       404 not waiting | 400 bad body
    GET  /healthz
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from bus.approvals import ApprovalStore
from bus.client import ToolbusClient
from bus.connection import Bus
from bus.subjects import approval_subject
from schemas.errors import InvalidIdError, InvalidRequestError, RpcError, ToolbusError
from schemas.ids import check_session_id
from schemas.requests import decode_json
from schemas.state import encode_state

MAX_BODY = 256 * 1024


_STATUS_OF_CODE = {"invalid": 400, "not_found": 404, "conflict": 409, "too_large": 413,
                   "unavailable": 503, "internal": 500}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"ok": False, "error": message}, status_code=status)


def build_app(bus: Bus) -> Starlette:
    client = ToolbusClient(bus)
    approvals = ApprovalStore(bus)

    async def submit(request: Request) -> Response:
        try:
            sid = check_session_id(request.path_params["sid"])
        except InvalidIdError as exc:
            return _error(400, str(exc))
        body = await request.body()
        if len(body) > MAX_BODY:
            return _error(413, f"request body over {MAX_BODY} bytes")
        try:
            parsed = decode_json(body, what="body")
        except InvalidRequestError as exc:
            return _error(400, exc.message)
        request_id = parsed.get("request_id") if isinstance(parsed, dict) else None
        if not isinstance(request_id, str):
            request_id = uuid.uuid4().hex
            if isinstance(parsed, dict) and "request_id" not in parsed:
                # Give it an id, so the caller can find its turn and retry safely.
                parsed["request_id"] = request_id
                body = msgspec.json.encode(parsed)
        # Anything else wrong with the body becomes a stored `request.rejected`, exactly
        # as for a NATS client.
        try:
            sub = await client.submit(sid, body, request_id=request_id)
        except ToolbusError as exc:
            return _error(503, str(exc))
        return JSONResponse({"ok": True, "request_id": request_id, "turn_id": sub.turn_id,
                             "duplicate": sub.duplicate}, status_code=202)

    async def state(request: Request) -> Response:
        headers: dict[str, str] = {}
        try:
            sid = check_session_id(request.path_params["sid"])
            try:
                live = await client.live_state(sid)
            except RpcError as exc:
                if exc.code != "too_large":
                    raise
                # Too large for one reply: the same reducer over the log, here.
                live = await client.fold_session(sid)
                headers["X-Toolbus-State-Source"] = "log"
            if request.query_params.get("full") in ("1", "true"):
                resolved = await client.resolve_references(live)
                headers["X-Toolbus-Resolved-References"] = str(resolved)
        except InvalidIdError as exc:
            return _error(400, str(exc))
        except ToolbusError as exc:
            return _error(503, str(exc))
        return Response(encode_state(live), media_type="application/json", headers=headers)

    async def pending(request: Request) -> Response:
        items = await approvals.load()
        return Response(msgspec.json.encode(items), media_type="application/json")

    async def decide(request: Request) -> Response:
        sid, call_id = request.path_params["sid"], request.path_params["call_id"]
        try:
            check_session_id(sid)
        except InvalidIdError as exc:
            return _error(400, str(exc))
        try:
            reply = await bus.request(approval_subject(sid, call_id), await request.body(),
                                      timeout=10, who="an approval actor")
        except ToolbusError as exc:
            return _error(503, str(exc))
        answer: dict[str, Any] = msgspec.json.decode(reply)
        if answer.get("ok"):
            return JSONResponse(answer)
        status = _STATUS_OF_CODE.get(str(answer.get("code")), 500)
        return JSONResponse(answer, status_code=status)

    async def health(request: Request) -> Response:
        return JSONResponse({"ok": True, "nats": bus.url})

    return Starlette(routes=[
        Route("/sessions/{sid}/requests", submit, methods=["POST"]),
        Route("/sessions/{sid}/state", state, methods=["GET"]),
        Route("/approvals", pending, methods=["GET"]),
        Route("/approvals/{sid}/{call_id}", decide, methods=["POST"]),
        Route("/healthz", health, methods=["GET"]),
    ])
