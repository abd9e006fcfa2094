"""The README's planner quick start, as a user runs it: the sample model server, `toolbus
up --manifest deploy/examples/agent.yaml` pointed at it through the manifest's own
`${VAR}`s, `toolbus chat`, then `toolbus replay`, which calls no model."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from bus.server import free_port
from services.sample_llm import SampleModel, listen
from tests.conftest import REPO, Proc, run_toolbus, toolbus_cmd


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
        await _chat_as_a_careless_user(data)
    finally:
        up.stop()
        server.close()
        await server.wait_closed()
    assert os.environ.get("OPENAI_API_KEY") != "sk-sample"  # the test's env stayed its own


async def _chat_as_a_careless_user(data: Path) -> None:
    """What a new user tried and broke (each once a traceback, a hang or an abort)."""
    where = ("--data-dir", str(data))
    # Bytes that are not UTF-8: one line, exit 2, for the argument; a line of stdin is
    # skipped and the others still answered.
    bad = await asyncio.to_thread(run_toolbus, "chat", "--session", "u1", "\udcff\udcfe x",
                                  *where)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    assert bad.stderr.strip().splitlines()[-1] == "toolbus: MESSAGE is not valid UTF-8 text"
    for strict in ({}, {"PYTHONIOENCODING": "utf-8:strict"}):  # as a desktop's locale
        piped = await asyncio.to_thread(
            subprocess.run, toolbus_cmd("chat", "--session", "u2", *where),
            input=b"first\n\xff\xfe\x80\nlast\n", capture_output=True, timeout=60,
            cwd=REPO, env={**os.environ, **strict})
        assert piped.returncode == 2 and b"Traceback" not in piped.stderr, piped.stderr
        assert piped.stdout.decode().splitlines() == [
            'The tool answered: {"text":"first"}', 'The tool answered: {"text":"last"}']
        assert b"skipped a line that is not valid UTF-8 text" in piped.stderr
    # Started with its output closed (`>&-`): no abort (uvloop asserted on closing the
    # socket that had taken the number of stdout), and refused before anything is done
    # (its output was lost silently, with status 0; the turn ran all the same).
    for command in (("replay", "s1"), ("chat", "--session", "u4", "closed")):
        closed = await asyncio.to_thread(
            subprocess.run, ["bash", "-c", " ".join(toolbus_cmd(*command, *where)) +
                             " >&-"], capture_output=True, text=True, timeout=60, cwd=REPO)
        assert closed.returncode == 2 and "Assertion" not in closed.stderr, closed.stderr
        assert closed.stderr.strip().splitlines()[-1].startswith(
            "toolbus: standard output is closed (`>&-`): what this command prints would "
            "be lost"), closed.stderr
    replayed = await asyncio.to_thread(run_toolbus, "replay", "u4", *where)
    assert "turn.requested" not in replayed.stdout  # no turn was asked for
    # Ctrl-C at the interactive prompt ends it at once (a thread blocked reading stdin
    # kept it alive until another line came).
    proc = await asyncio.create_subprocess_exec(
        *toolbus_cmd("chat", "--session", "u3", *where), stdin=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL, cwd=REPO,
        start_new_session=True)
    try:
        assert proc.stdin is not None and proc.stderr is not None
        proc.stdin.write(b"hello\n")
        async with asyncio.timeout(60):
            while b"<- built-in:echo ok" not in await proc.stderr.readline():
                pass
        await asyncio.sleep(0.3)  # back at the prompt, reading the next line
        os.killpg(proc.pid, signal.SIGINT)
        async with asyncio.timeout(10):
            assert await proc.wait() == 130
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": "hi"}], "tools": [{"function": "x"}]},
    {"messages": [{"role": "user", "content": "hi"}], "tools": "x"},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
    {"messages": [{"role": "user", "content": "hi"}], "stream": True, "stream_options": "x"},
])
def test_the_sample_model_server_answers_a_malformed_field_instead_of_hanging_up(
        body: dict[str, object]) -> None:
    # A body whose fields have the wrong shape: an answer, never a dropped connection.
    import msgspec

    answer = SampleModel().handle("POST", "/v1/chat/completions", {},
                                  msgspec.json.encode(body))
    status = answer.split(b" ", 2)[1]
    assert status in (b"200", b"400"), answer[:200]
