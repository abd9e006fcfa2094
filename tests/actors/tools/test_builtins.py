"""Built-in tools against real local resources: an HTTP server on 127.0.0.1, real files
and symlinks, real subprocesses, a real git repository, a local server speaking Tavily's
search API. Each refusal path is exercised."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from actors.tools import LocalTool, ResourceScope, ToolError
from actors.tools.builtins.code import code_tool
from actors.tools.builtins.files import file_tools
from actors.tools.builtins.git import git_tools
from actors.tools.builtins.http import http_tool
from actors.tools.builtins.search import search_tool
from schemas.manifest import (
    CodeConfig,
    FilesConfig,
    GitConfig,
    HttpToolConfig,
    WebSearchConfig,
)
from schemas.policy import Policy, evaluate
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


async def _run(tool: LocalTool, args: dict[str, Any]) -> Any:
    """Validate like the session actor does, then run like the executor does."""
    filled, problems = Validator(tool.spec.parameters).check(args)
    if problems:
        raise ValueError("; ".join(str(p) for p in problems))
    async with ResourceScope([tool]) as scope:
        result = await tool.run(filled, scope.values)
    if tool.spec.output is not None:
        assert not Validator(tool.spec.output).violations(result)
    return result


# --- http -------------------------------------------------------------------------------


async def test_http_tool_merges_defaults_and_returns_ok_status_url_data(http_server) -> None:
    t = http_tool(HttpToolConfig(
        name="tickets:create_ticket", description="Open a ticket.", base_url=http_server,
        allowed_methods=["POST", "GET"], default_headers={"X-Api": "k1"},
        default_query={"tenant": "acme"}))
    assert t.spec.name == "tickets:create_ticket" and t.spec.description == "Open a ticket."
    out = await _run(t, {"path": "/tickets", "body": {"title": "broken"},
                         "query": {"prio": 2}, "headers": {"X-Trace": "t"}})
    assert out["ok"] and out["status"] == 200
    assert out["url"] == f"{http_server}/tickets?tenant=acme&prio=2"
    data = out["data"]
    assert data["method"] == "POST" and data["body"] == {"title": "broken"}
    assert data["headers"]["x-api"] == "k1" and data["headers"]["x-trace"] == "t"
    missing = await _run(t, {"path": "/missing", "method": "GET"})
    assert missing["ok"] is False and missing["status"] == 404
    assert missing["data"] == {"error": "no such ticket"}


async def test_http_tool_annotations_follow_the_allowed_methods() -> None:
    ro = http_tool(HttpToolConfig(name="api:read")).spec
    assert ro.annotations.readOnlyHint and not ro.requires_approval and ro.risk_level == "low"
    assert ro.parameters["properties"]["method"]["enum"] == ["GET", "HEAD"]
    rw = http_tool(HttpToolConfig(name="api:write", allowed_methods=["POST", "DELETE"])).spec
    assert not rw.annotations.readOnlyHint and rw.annotations.destructiveHint
    assert rw.risk_level == "high" and not rw.auto_approve
    auto = http_tool(HttpToolConfig(name="api:auto", allowed_methods=["POST"],
                                    auto_approve=True)).spec
    assert auto.auto_approve
    # What the policy makes of them (seed 002): mutating calls wait for a human unless
    # the tool's config says auto_approve.
    policy = Policy()
    assert evaluate(ro, session_id="s", agent=None, policy=policy).rule == "auto:read_only"
    assert evaluate(rw, session_id="s", agent=None, policy=policy).rule == "policy:mutating"
    assert evaluate(auto, session_id="s", agent=None, policy=policy).rule == \
        "auto:auto_approve"


async def test_http_method_outside_allowed_and_relative_path_without_base_are_rejected(
        http_server) -> None:
    t = http_tool(HttpToolConfig(name="api:read"))
    with pytest.raises(ValueError, match=r'\$\.method: "DELETE" is not one of'):
        await _run(t, {"path": f"{http_server}/x", "method": "DELETE"})
    with pytest.raises(ValueError, match=r'\$\.path: "/tickets" does not match'):
        await _run(t, {"path": "/tickets"})
    with pytest.raises(ToolError, match="relative path and this tool has no base_url"):
        await t.run({"path": "tickets"}, {t.injected["http"]: None})  # a direct caller


async def test_http_refuses_link_local_and_metadata_addresses_and_unlisted_hosts(
        http_server) -> None:
    t = http_tool(HttpToolConfig(name="api:read"))
    for url in ("http://169.254.169.254/latest/meta-data/", "http://[fe80::1]/",
                "http://metadata.google.internal/computeMetadata/v1/"):
        with pytest.raises(ToolError) as err:
            await _run(t, {"path": url})
        assert err.value.error_type == "address_not_allowed", url
    listed = http_tool(HttpToolConfig(name="api:listed", allowed_hosts=["*.example.com"]))
    with pytest.raises(ToolError, match="not in this tool's allowed_hosts") as err:
        await _run(listed, {"path": f"{http_server}/x"})
    assert err.value.error_type == "host_not_allowed"
    ok = http_tool(HttpToolConfig(name="api:local", allowed_hosts=["127.0.0.1"]))
    assert (await _run(ok, {"path": f"{http_server}/x"}))["ok"]


async def test_http_timeout_and_response_cap(http_server) -> None:
    slow = http_tool(HttpToolConfig(name="api:slow", base_url=http_server, timeout_ms=300))
    with pytest.raises(ToolError, match="did not answer within 300 ms") as err:
        await _run(slow, {"path": "/slow"})
    assert err.value.error_type == "timeout" and err.value.retryable
    capped = http_tool(HttpToolConfig(name="api:big", base_url=http_server,
                                      max_response_chars=1000))
    out = await _run(capped, {"path": "/big"})
    assert len(out["data"]) == 1000 and out["truncated"] is True
    text = http_tool(HttpToolConfig(name="api:text", base_url=http_server,
                                    response_format="text"))
    assert isinstance((await _run(text, {"path": "/x"}))["data"], str)


# --- files ------------------------------------------------------------------------------


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
    assert (await _run(read, {"path": "notes/a.txt"}))["content"] == "hello world"
    assert (await _run(read, {"path": "inside"}))["content"] == "hello world"
    part = await _run(read, {"path": "notes/a.txt", "offset": 6, "max_chars": 3})
    assert part["content"] == "wor" and part["truncated"]
    assert (await _run(write, {"path": "out/new.md", "content": "x"}))["bytes_written"] == 1
    await _run(write, {"path": "out/new.md", "content": "y", "append": True})
    assert (root / "out" / "new.md").read_text() == "xy"


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
            await _run(t, args)
        assert err.value.error_type == "path_refused"
    assert (root.parent / "secret.txt").read_text() == "top secret"


# --- code_execute -----------------------------------------------------------------------


async def test_code_runs_in_a_fresh_folder_with_only_path_in_its_environment() -> None:
    os.environ["TOOLBUS_TEST_SECRET"] = "hunter2"
    try:
        t = code_tool(CodeConfig(languages=["python", "shell"]), path_env=PATH)
        out = await _run(t, {"code": "import os, json\n"
                                     "print(json.dumps({'env': sorted(os.environ), "
                                     "'cwd': os.getcwd(), 'files': os.listdir('.')}))"})
    finally:
        del os.environ["TOOLBUS_TEST_SECRET"]
    seen = json.loads(out["stdout"])
    assert out["ok"] and out["exit_code"] == 0
    assert [k for k in seen["env"] if k != "LC_CTYPE"] == ["PATH"]  # no secret leaks
    assert "toolbus-code-" in seen["cwd"] and seen["files"] == ["main.py"]
    assert not Path(seen["cwd"]).exists()  # removed after the run
    sh = await _run(t, {"code": "echo $((6*7)); exit 3", "language": "shell"})
    assert sh["stdout"] == "42\n" and sh["exit_code"] == 3 and sh["ok"] is False


async def test_code_timeout_output_cap_and_memory_limit() -> None:
    t = code_tool(CodeConfig(timeout_ms=500, max_output_bytes=1000, memory_mb=64),
                  path_env=PATH)
    with pytest.raises(ToolError, match="longer than 500 ms") as err:
        await _run(t, {"code": "import time\ntime.sleep(30)"})
    assert err.value.error_type == "timeout"
    big = await _run(t, {"code": "print('x' * 5000)"})
    assert len(big["stdout"]) == 1000 and big["stdout_cut_bytes"] == 4001
    mem = await _run(t, {"code": "b = bytearray(512 * 1024 * 1024)"})
    assert mem["exit_code"] != 0 and "MemoryError" in mem["stderr"]
    with pytest.raises(ValueError, match=r"\$\.language"):
        await _run(t, {"code": "echo hi", "language": "shell"})  # not enabled here


# --- git --------------------------------------------------------------------------------


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    r = tmp_path / "repo"
    r.mkdir()
    env = {"PATH": PATH, "HOME": str(tmp_path), "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@x",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@x"}
    for cmd in (["init", "-q", "-b", "main"], ["commit", "-q", "--allow-empty", "-m", "first"],
                ["commit", "-q", "--allow-empty", "-m", "second commit"]):
        subprocess.run(["git", *cmd], cwd=r, env=env, check=True)
    (r / "big.txt").write_text("line\n" * 20_000)
    return r


async def test_git_read_runs_read_only_subcommands_without_a_shell(repo: Path) -> None:
    (read,) = git_tools(GitConfig(repo=str(repo)), path_env=PATH)
    assert read.spec.annotations.readOnlyHint
    log = await _run(read, {"command": "log --format=%s"})
    assert log["output"].splitlines() == ["second commit", "first"]
    with pytest.raises(ToolError, match="ambiguous argument '\\|'"):
        await _run(read, {"command": "log --format=%s | rm -rf /"})  # '|' reaches git as is
    with pytest.raises(ToolError, match="exited with 128") as err:
        await _run(read, {"command": "show no-such-rev"})
    assert err.value.error_type == "git_failed"


@pytest.mark.parametrize("command, why", [
    ("commit -m x", "not a read-only subcommand"),
    ("-c core.pager=evil log", "options before the subcommand"),
    ("diff --output=/tmp/x", "not allowed in built-in:git_read"),
])
async def test_git_read_refuses_writes_and_global_options(repo: Path, command: str,
                                                          why: str) -> None:
    (read,) = git_tools(GitConfig(repo=str(repo)), path_env=PATH)
    with pytest.raises(ToolError, match=why):
        await _run(read, {"command": command})


async def test_git_output_is_capped_with_the_count_of_cut_bytes(repo: Path) -> None:
    read, write = git_tools(GitConfig(repo=str(repo), allow_write=True, max_output_bytes=32768),
                            path_env=PATH)
    assert not write.spec.annotations.readOnlyHint and write.spec.name == "built-in:git"
    await _run(write, {"command": "add big.txt"})
    out = await _run(read, {"command": "diff --cached"})
    assert len(out["output"].encode()) == 32768 and out["cut_bytes"] > 60_000
    assert "bytes were cut" in out["note"]


# --- web_search -------------------------------------------------------------------------


async def test_web_search_without_a_key_fails_at_once_naming_the_variable() -> None:
    t = search_tool(WebSearchConfig(base_url="http://127.0.0.1:9"), api_key=None)
    with pytest.raises(ToolError, match="set TAVILY_API_KEY") as err:
        await _run(t, {"query": "x"})
    assert err.value.error_type == "not_configured" and not err.value.retryable


async def test_web_search_speaks_tavilys_api(http_server) -> None:
    t = search_tool(WebSearchConfig(base_url=http_server), api_key="tvly-test")
    out = await _run(t, {"query": "toolbus", "max_results": 2})
    assert out["answer"] == "42" and [r["title"] for r in out["results"]] == ["r0", "r1"]
    assert out["results"][0] == {"title": "r0", "url": "https://e.com/0", "content": "toolbus"}
    bad = search_tool(WebSearchConfig(base_url=http_server), api_key="wrong")
    with pytest.raises(ToolError, match="refused the API key") as err:
        await _run(bad, {"query": "x"})
    assert err.value.error_type == "auth_failed"




async def test_code_cpu_limit_stops_a_busy_loop() -> None:
    t = code_tool(CodeConfig(timeout_ms=20_000, cpu_seconds=1), path_env=PATH)
    out = await _run(t, {"code": "while True:\n    pass"})
    assert out["ok"] is False and out["signal"] in ("SIGXCPU", "SIGKILL")
    assert out["duration_ms"] < 20_000  # the CPU limit, not the timeout, ended it
