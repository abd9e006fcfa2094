"""Safe defaults shown end to end, beside the narrower tests elsewhere:

- SSRF: with the default HTTP tool (no allowed_hosts), a redirect to each local address
  form is refused by the address guard. tests/actors/tools/builtins/test_http.py's redirect
  matrix opens its first hop with `allowed_hosts`, so a literal-IP target there is refused
  by the allow list (host_not_allowed) before the address guard is reached.
- The default agent's grants applied end to end: a real `toolbus up` whose policy restricts
  the default agent, and `toolbus call` without `--agent` (message and exit code); two
  pools of that one process listed by `toolbus executors` under distinct instance names.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

import httpx
import pytest

import actors.tools.builtins.http as http_module
from actors.tools import ToolError
from actors.tools.builtins.http import http_tool
from bus.server import free_port
from schemas.manifest import HttpToolConfig
from tests.actors.tools.builtins.conftest import run_tool
from tests.conftest import Proc, run_toolbus

# --- SSRF: a redirect under the default settings ---------------------------------------------


class _Hop(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.server.hits.append(self.path)  # type: ignore[attr-defined]
        to = parse_qs(urlsplit(self.path).query).get("to")
        self.send_response(302 if to else 200)
        if to:
            self.send_header("Location", to[0])
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")


@pytest.fixture(scope="module")
def hops() -> Iterator[tuple[Any, Any]]:
    pair = []
    for _ in range(2):
        s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hop)
        s.hits = []  # type: ignore[attr-defined]
        threading.Thread(target=s.serve_forever, daemon=True).start()
        pair.append(s)
    yield pair[0], pair[1]
    for s in pair:
        s.shutdown()
        s.server_close()


TARGETS = ["127.0.0.1", "localhost", "[::1]", "0.0.0.0", "10.0.0.1", "169.254.169.254",
           "2130706433", "0x7f000001", "[::ffff:127.0.0.1]", "metadata.google.internal"]


@pytest.mark.parametrize("host", TARGETS)
async def test_default_http_tool_refuses_a_redirect_to_a_local_address_by_address(
        hops: tuple[Any, Any], host: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first hop stands for a public site: its vetting is skipped (the only way to
    reach a test server on 127.0.0.1 with the default settings); every later hop goes
    through the real guard."""
    a, b = hops
    a.hits.clear()
    b.hits.clear()
    a_port = a.server_address[1]
    real_vet = http_module.vet
    skipped: list[str] = []

    async def vet(url: httpx.URL, cfg: HttpToolConfig, resolver: Any) -> list[str]:
        if not skipped and url.host == "127.0.0.1" and url.port == a_port:
            skipped.append(str(url))
            return ["127.0.0.1"]
        return await real_vet(url, cfg, resolver)

    monkeypatch.setattr(http_module, "vet", vet)
    t = http_tool(HttpToolConfig(name="api:read"))  # defaults: no allow list, no private
    target = f"http://{host}:{b.server_address[1]}/x"
    with pytest.raises(ToolError) as err:
        await run_tool(t, {"path": f"http://127.0.0.1:{a_port}/r?to={quote(target, safe='')}"})
    assert err.value.error_type == "address_not_allowed", err.value
    assert len(skipped) == 1 and len(a.hits) == 1 and b.hits == []


# --- the default agent's grants, and two pools, through the real commands ---------------------


async def test_up_applies_the_default_agents_grants_and_names_each_pools_executor(
        tmp_path: Path) -> None:
    manifest = tmp_path / "m.yaml"
    manifest.write_text(
        "version: 1\npools:\n  extra: {}\ntools:\n  builtins: [echo]\n  http:\n"
        "    - {name: 'gap:fetch', base_url: 'http://127.0.0.1:9', pool: extra}\n"
        "policy:\n  auto_approve: ['testing:*']\n  agents:\n"
        "    default: {tools: ['built-in:*']}\n    ops: {tools: ['*']}\n")
    data = tmp_path / "data"
    up = Proc("up", "--port", str(free_port()), "--data-dir", str(data), "--workers", "1",
              "--manifest", str(manifest), "--tools", "tests/toolkit.py", ready="stop:")
    try:
        await up.wait_ready()

        def call(*args: str) -> Any:
            return run_toolbus("call", *args, "--data-dir", str(data), timeout=60)

        ok, denied, as_ops, listed = await asyncio.gather(*(asyncio.to_thread(f) for f in (
            lambda: call("built-in:echo", '{"a": 1}'),
            lambda: call("testing:probe", '{"label": "x", "seconds": 0}'),
            lambda: call("testing:probe", '{"label": "y", "seconds": 0}', "--agent", "ops"),
            lambda: run_toolbus("executors", "--data-dir", str(data)))))
        assert ok.returncode == 0 and json.loads(ok.stdout) == {"a": 1}, ok.stderr
        assert denied.returncode == 1, denied.stderr
        assert "testing:probe rejected (policy_denied): agent default is not granted " \
            "testing:probe" in denied.stderr
        assert "Traceback" not in denied.stderr
        assert as_ops.returncode == 0 and json.loads(as_ops.stdout) == {"label": "y"}, \
            as_ops.stderr
        assert listed.returncode == 0, listed.stderr
        # "NAME  pool=POOL  host=H pid=PID  tools=...": one line per live executor
        rows = [dict(f.split("=", 1) for f in line.split()[1:] if "=" in f) | {
                "name": line.split()[0]} for line in listed.stdout.splitlines() if line.strip()]
        by_pool = {r["pool"]: r for r in rows}
        assert set(by_pool) == {"default", "extra"}, listed.stdout
        assert by_pool["default"]["pid"] == by_pool["extra"]["pid"]  # one process
        assert by_pool["default"]["name"] != by_pool["extra"]["name"]
        assert by_pool["extra"]["name"].endswith("-extra")
    finally:
        assert up.stop(signal.SIGINT) == 0
