"""Shared by the built-in tool tests: a real HTTP server on 127.0.0.1 (which also speaks
Tavily's search API under /search), the PATH handed to subprocesses, and `run_tool`, which
validates and runs a tool the way the session actor and the executor do."""

from __future__ import annotations

import http.server
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from actors.tools import LocalTool, ResourceScope
from schemas.validation import Validator

PATH = os.environ.get("PATH", "/usr/bin:/bin")


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass

    def _reply(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        if self.path.startswith("/slow"):
            time.sleep(1.5)
        if self.path.startswith("/big"):
            self._reply(200, b"x" * 50_000, "text/plain")
            return
        if self.path.startswith("/missing"):
            self._reply(404, b'{"error": "no such ticket"}')
            return
        if self.path.startswith("/search"):  # Tavily's API shape
            auth = self.headers.get("Authorization")
            if auth != "Bearer tvly-test":
                self._reply(401, b'{"detail": "bad key"}')
                return
            q = json.loads(body)
            if q["query"] == "fail":  # a gateway's error page quoting the request
                self._reply(502, f"upstream refused Authorization: {auth}".encode())
                return
            results = [{"title": f"r{i}", "url": f"https://e.com/{i}", "content": q["query"],
                        "score": 0.9} for i in range(q["max_results"])]
            self._reply(200, json.dumps({"answer": "42", "results": results}).encode())
            return
        echo = {"method": self.command, "path": self.path,
                "headers": {k.lower(): v for k, v in self.headers.items()},
                "body": json.loads(body) if body else None}
        self._reply(200, json.dumps(echo).encode())

    do_GET = do_POST = do_DELETE = do_HEAD = _handle


@pytest.fixture(scope="module")
def http_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


async def run_tool(tool: LocalTool, args: dict[str, Any]) -> Any:
    """Validate like the session actor does, then run like the executor does."""
    filled, problems = Validator(tool.spec.parameters).check(args)
    if problems:
        raise ValueError("; ".join(str(p) for p in problems))
    async with ResourceScope([tool]) as scope:
        result = await tool.run(filled, scope.values)
    if tool.spec.output is not None:
        assert not Validator(tool.spec.output).violations(result)
    return result
