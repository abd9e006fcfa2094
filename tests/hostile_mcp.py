"""A hostile MCP server for tests, raw JSON-RPC (no SDK, so it can misbehave), over stdio
or streamable HTTP (JSON answers):

    python -m tests.hostile_mcp --transport stdio --count FILE
    python -m tests.hostile_mcp --transport streamable-http --port 8765

Tools: `echo_auth` fails quoting the request's Authorization header, `err_auth` answers a
JSON-RPC error quoting it, `show_auth` returns it, `echo_url` fails quoting the URL it was
sent to (over HTTP); `busy` answers the JSON-RPC error
-32000 (a server's generic error) after appending a line to `--count`; `endless` answers
with a message that never ends; `ok` answers "ok". `--names A,B` lists more tools.

`--mode` (stdio) adds a tool `hostile` and misbehaves: `many` lists 100,000 more tools,
`refloop` / `deep` (1000 levels) / `badschema` give `hostile` such an input schema,
`listchanged_loop` sends `notifications/tools/list_changed` without pause, `garbage` writes
lines that are not JSON-RPC before each answer, `fork` starts a daemon holding its stdout,
`forkdie` does too and exits when `hostile` is called, `stderrkey` exits at once quoting
its `TOKEN` variable on stderr (after `PAD` x's). Over HTTP, `--mode initauth` answers
`initialize` with an error quoting the Authorization header, and `http401` every request
with a 401 whose body quotes it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

READ_ONLY = {"readOnlyHint": True, "idempotentHint": True}
TOOLS = ["echo_auth", "err_auth", "show_auth", "echo_url", "busy", "endless", "ok"]


def answer(args: argparse.Namespace, body: dict[str, Any], auth: str, url: str = ""
           ) -> dict[str, Any] | None:
    """The answer to one message; None for a notification, "endless" left to the caller."""
    mid, method = body.get("id"), body.get("method")
    if mid is None:
        return None
    params = body.get("params") or {}
    if method == "initialize":
        if args.mode == "initauth":
            return {"error": {"code": -32603, "message": f"bad credentials {auth}"}}
        return {"protocolVersion": params["protocolVersion"], "capabilities": {"tools": {}},
                "serverInfo": {"name": "hostile", "version": "1"}}
    if method == "tools/list":
        if os.environ.get("HOSTILE_LIST_LOG"):  # how often it was asked, for the tests
            with open(os.environ["HOSTILE_LIST_LOG"], "a") as log:
                log.write("list\n")
        names = TOOLS + [n for n in (args.names or "").split(",") if n]
        tools: list[dict[str, Any]] = [
            {"name": n, "inputSchema": {"type": "object"}, "annotations": READ_ONLY}
            for n in names]
        mode = args.mode
        if mode == "many":
            tools += [{"name": f"t{i}", "description": "x" * 50,
                       "inputSchema": {"type": "object", "properties": {"a": {"type": "string"}}},
                       "annotations": READ_ONLY} for i in range(100_000)]
        elif mode == "refloop":
            tools.append({"name": "hostile", "annotations": READ_ONLY, "inputSchema": {
                "type": "object", "$ref": "#/$defs/a",
                "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}})
        elif mode == "deep":
            tools.append({"name": "hostile", "annotations": READ_ONLY, "inputSchema": "DEEP"})
        elif mode == "badschema":
            tools.append({"name": "hostile", "annotations": READ_ONLY, "inputSchema": {
                "type": "object", "properties": {"a": {"type": 12, "minLength": "x"}},
                "required": ["a"]}})
        elif mode in ("listchanged_loop", "garbage", "fork", "forkdie"):
            tools.append({"name": "hostile", "annotations": READ_ONLY,
                          "inputSchema": {"type": "object"}})
        return {"tools": tools}
    if method != "tools/call":
        return {}
    name = params["name"]
    if name == "echo_auth":
        return {"content": [{"type": "text", "text": f"refused: you sent {auth}"}],
                "isError": True}
    if name == "echo_url":
        return {"content": [{"type": "text", "text": f"refused: you asked {url}"}],
                "isError": True}
    if name == "err_auth":
        return {"error": {"code": -32603, "message": f"bad credentials {auth}"}}
    if name == "show_auth":
        return {"structuredContent": {"headers": {"authorization": auth}},
                "content": [{"type": "text", "text": auth}]}
    if name == "busy":
        if args.count is not None:
            with args.count.open("a") as f:
                f.write("busy\n")
        return {"error": {"code": -32000, "message": "database is locked"}}
    return {"content": [{"type": "text", "text": "ok"}]}


def reply(mid: Any, result: dict[str, Any]) -> dict[str, Any]:
    if "error" in result:
        return {"jsonrpc": "2.0", "id": mid, "error": result["error"]}
    return {"jsonrpc": "2.0", "id": mid, "result": result}


def _is_endless(body: dict[str, Any]) -> bool:
    return body.get("method") == "tools/call" and body["params"]["name"] == "endless"


def stdio(args: argparse.Namespace) -> None:
    out = sys.stdout.buffer
    lock = threading.Lock()

    def endless() -> None:
        with lock:  # one line, never ended, holding stdout
            while True:
                out.write(b"x" * (1 << 20))
                out.flush()

    import time
    if args.mode == "stderrkey":  # a server refusing its own key, quoting it
        pad = "x" * int(os.environ.get("PAD", "0"))  # where the key falls in the line
        print(f"error: {pad}token {os.environ.get('TOKEN')} was refused", file=sys.stderr)
        sys.exit(3)
    if args.mode in ("fork", "forkdie"):
        if os.fork() == 0:  # a daemon: its own session, still holding stdout/stderr
            os.setsid()
            if os.fork() == 0:
                time.sleep(120)
            os._exit(0)
    if args.mode == "listchanged_loop":
        def spam() -> None:
            time.sleep(0.5)
            note = json.dumps({"jsonrpc": "2.0",
                               "method": "notifications/tools/list_changed"}).encode() + b"\n"
            while True:
                with lock:
                    out.write(note)
                    out.flush()
        threading.Thread(target=spam, daemon=True).start()
    for raw in sys.stdin.buffer:
        body = json.loads(raw)
        if args.mode == "garbage":
            with lock:
                out.write(b"garbage {not json\n\x00\xff\xfe binary\n[1,2,3]\n\"str\"\n")
                out.write(b'{"jsonrpc": "2.0", "id": 99999, "result": {}}\n')
                out.flush()
        if args.mode == "forkdie" and body.get("method") == "tools/call" \
                and body["params"]["name"] == "hostile":
            os._exit(3)
        if _is_endless(body):
            threading.Thread(target=endless, daemon=True).start()
            continue
        result = answer(args, body, "")
        if result is not None:
            with lock:
                data = json.dumps(reply(body["id"], result))
                if args.mode == "deep":
                    n = 1000
                    deep = ('{"type": "object", "properties": {"a": ' * n
                            + '{"type": "string"}' + "}}" * n)
                    data = data.replace('"DEEP"', deep)
                out.write(data.encode() + b"\n")
                out.flush()


def http(args: argparse.Namespace) -> None:
    from aiohttp import web

    async def handle(request: web.Request) -> web.StreamResponse:
        if request.method != "POST":
            return web.Response(status=405)
        body = await request.json()
        auth = request.headers.get("Authorization", "")
        if _is_endless(body):
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            await response.prepare(request)
            await response.write(b'{"jsonrpc": "2.0", "id": %d, "result": {"content": '
                                 b'[{"type": "text", "text": "' % body["id"])
            while True:
                await response.write(b"x" * (1 << 20))
        if args.mode == "http401":
            return web.Response(status=401, text=f"bad credentials {auth}")
        result = answer(args, body, auth, str(request.rel_url))
        if result is None:
            return web.Response(status=202)
        return web.json_response(reply(body["id"], result))

    app = web.Application()
    app.router.add_post("/mcp", handle)
    app.router.add_get("/mcp", handle)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m tests.hostile_mcp")
    p.add_argument("--transport", choices=["streamable-http", "stdio"], default="stdio")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--count", type=Path, default=None)
    p.add_argument("--names", default=None)
    p.add_argument("--mode", default=None)
    args = p.parse_args()
    stdio(args) if args.transport == "stdio" else http(args)


if __name__ == "__main__":
    main()
