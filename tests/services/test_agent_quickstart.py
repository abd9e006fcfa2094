"""The README's planner quick start, as a user runs it: the sample model server, `toolbus
up --manifest deploy/examples/agent.yaml` pointed at it through the manifest's own
`${VAR}`s, `toolbus chat`, then `toolbus replay`, which calls no model."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import httpx

from bus.server import free_port
from services.sample_llm import SampleModel, listen
from tests.conftest import REPO, Proc, run_toolbus


async def test_the_agent_quick_start_chats_and_replays_without_the_model(
        tmp_path: Path) -> None:
    model = SampleModel(api_key="sk-sample")
    server = await listen(model)
    base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    env = {"OPENAI_API_KEY": "sk-sample", "OPENAI_BASE_URL": base, "OPENAI_MODEL": "sample"}
    data = tmp_path / "data"
    up = Proc("up", "--manifest", str(REPO / "deploy/examples/agent.yaml"), "--port",
              str(free_port()), "--data-dir", str(data), ready="stop:", env=env)
    try:
        banner = await up.wait_ready(60)
        # The banner says the planner runs, with which model, and how to talk to it.
        assert f"process {up.pid}: session, approval, planner\n" in banner, banner
        assert f"\n    planner: openai sample at {base}\n" in banner, banner
        assert "(worker 1):" in banner
        assert f"try:    toolbus chat --session demo 'hello' --data-dir {data}" in banner
        assert "sk-sample" not in banner + up.stderr_tail  # the key is never shown

        chat = await asyncio.to_thread(run_toolbus, "chat", "--session", "s1",
                                       "What time is it in Tokyo?", "--data-dir", str(data),
                                       timeout=60)
        assert chat.returncode == 0, chat.stderr
        assert chat.stdout == 'The tool answered: {"text":"What time is it in Tokyo?"}\n'
        assert "session: s1" in chat.stderr
        assert '  -> built-in:echo {"text":"What time is it in Tokyo?"}' in chat.stderr
        assert "  <- built-in:echo ok" in chat.stderr

        async with httpx.AsyncClient(trust_env=False) as web:
            asked = len((await web.get(f"{base.removesuffix('/v1')}/requests")).json())
            replay = await asyncio.to_thread(run_toolbus, "replay", "s1", "--json",
                                             "--data-dir", str(data), timeout=60)
            assert replay.returncode == 0, replay.stderr
            again = len((await web.get(f"{base.removesuffix('/v1')}/requests")).json())
        assert asked >= 2 and again == asked  # replay called no model
        *events, last = [json.loads(line) for line in replay.stdout.splitlines()]
        types = [e["event"]["type"] for e in events]
        assert types.count("model.requested") == types.count("model.responded") >= 2
        assert types[-1] == "turn.completed" and "call.succeeded" in types
        (turn,) = last["state"]["turns"].values()
        assert turn["status"] == "completed"
        assert "sk-sample" not in replay.stdout
    finally:
        up.stop()
        server.close()
        await server.wait_closed()
    assert os.environ.get("OPENAI_API_KEY") != "sk-sample"  # the test's env stayed its own
