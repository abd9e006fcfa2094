"""The HTTP gateway of `toolbus up --http-port`: requests, approvals and state over HTTP."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from bus.server import free_port
from tests.conftest import Proc


async def test_a_call_is_requested_and_approved_over_http(tmp_path: Path) -> None:
    port, http_port = free_port(), free_port()
    up = Proc("up", "--port", str(port), "--data-dir", str(tmp_path / "data"),
              "--http-port", str(http_port), "--tools", "tests/sdk_toolkit.py", ready="stop:")
    try:
        banner = await up.wait_ready()
        assert f"http:   http://127.0.0.1:{http_port}" in banner
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}") as web:
            assert (await web.get("/healthz")).json()["ok"] is True
            sent = await web.post("/sessions/web1/requests", json={
                "request_id": "label-1",
                "calls": [{"tool": "shipping:label", "arguments": {"order_id": 3}}]})
            assert sent.status_code == 202 and sent.json()["turn_id"] == "label-1"
            async with asyncio.timeout(10):  # the approval actor records it
                # Another process's state: poll it.
                while not (pending := (await web.get("/approvals")).json()):  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            assert pending[0]["tool"] == "shipping:label"
            assert pending[0]["rule"] == "tool:requires_approval"
            assert pending[0]["arguments"] == {"order_id": 3, "copies": 1}
            url = f"/approvals/web1/{pending[0]['call_id']}"
            ok = await web.post(url, json={"decision": "approve", "by": "web", "note": "ok"})
            assert ok.status_code == 200 and ok.json() == {"ok": True, "decision": "approved"}
            again = await web.post(url, json={"decision": "deny", "by": "x", "reason": "no"})
            assert again.status_code == 409 and "approved by web" in again.json()["error"]
            bad = await web.post(url, content=b"not json")
            assert bad.status_code == 400
            missing = await web.post("/approvals/web1/nope-0", json={"decision": "approve"})
            assert missing.status_code == 404
            async with asyncio.timeout(10):
                while True:
                    state = (await web.get("/sessions/web1/state")).json()
                    if state["turns"]["label-1"]["status"] == "completed":
                        break
                    await asyncio.sleep(0.05)  # another process: poll it
            call = state["calls"][pending[0]["call_id"]]
            assert call["result"] == {"order_id": 3, "copies": 1}
            assert call["decided_by"] == "web" and call["decision_note"] == "ok"
            assert (await web.post("/sessions/bad%20id/requests", json={})).status_code == 400
    finally:
        assert up.stop() == 0


async def test_state_over_http_resolves_references_and_survives_a_huge_state(
        tmp_path: Path) -> None:
    port, http_port = free_port(), free_port()
    up = Proc("up", "--port", str(port), "--data-dir", str(tmp_path / "data"), "--workers",
              "1", "--http-port", str(http_port), "--tools", "tests/toolkit.py", ready="stop:")
    try:
        await up.wait_ready()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}",
                                     timeout=30) as web:
            calls = [{"tool": "testing:blob", "arguments": {"size": 300_000}}] + [
                {"tool": "testing:blob", "arguments": {"size": 225_000}}] * 20
            sent = await web.post("/sessions/big1/requests",
                                  json={"request_id": "r1", "calls": calls})
            assert sent.status_code == 202
            async with asyncio.timeout(30):
                while True:
                    got = await web.get("/sessions/big1/state")
                    assert got.status_code == 200, got.text
                    if got.json()["turns"].get("r1", {}).get("status") == "completed":
                        break
                    await asyncio.sleep(0.1)  # another process: poll it
            # 4.5 MB of inline results: over one state reply, so folded from the log.
            assert got.headers["X-Toolbus-State-Source"] == "log"
            first = got.json()["calls"]["r1-0"]
            assert first["result"] is None and first["result_ref"]["size"] == 300_002
            full = await web.get("/sessions/big1/state?full=1")
            assert full.headers["X-Toolbus-Resolved-References"] == "1"
            assert full.json()["calls"]["r1-0"]["result"] == "x" * 300_000
    finally:
        assert up.stop() == 0
