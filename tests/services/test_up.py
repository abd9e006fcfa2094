"""`toolbus up` as users run it: a subprocess with its own embedded server and data dir."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import select
import signal
from pathlib import Path

import nats

from bus.catalog import Catalog
from bus.connection import connect
from bus.server import free_port
from tests.conftest import Proc, role_url, run_toolbus


def _replay_json(url: str, sid: str) -> list[dict]:
    out = run_toolbus("replay", sid, "--json", "--nats", url)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


async def _raw_client_call(url: str, sid: str) -> list[dict]:
    """What any NATS client in any language does: publish JSON, watch the events."""
    nc = await nats.connect(url)
    got: list[dict] = []
    done = asyncio.Event()

    async def on_event(msg) -> None:
        got.append(json.loads(msg.data))
        if got[-1]["type"] == "turn.completed":
            done.set()

    await nc.subscribe(f"toolbus.live.{sid}.>", cb=on_event)  # stored events, in order
    await nc.publish(f"toolbus.req.{sid}", json.dumps(
        {"calls": [{"tool": "built-in:echo", "arguments": {"from": "raw"}}]}).encode())
    async with asyncio.timeout(10):
        await done.wait()
    await nc.close()
    return got


async def test_toolbus_up_serves_cli_and_raw_clients_and_survives_a_server_kill(
    tmp_path: Path,
) -> None:
    port = free_port()
    address = f"nats://127.0.0.1:{port}"
    data = tmp_path / "data"
    up = Proc("up", "--port", str(port), "--data-dir", str(data), ready="stop:")
    try:
        banner = await up.wait_ready()
        assert f"on {address}" in banner and "toolbus call built-in:echo" in banner
        server_pid = int(re.search(r"nats-server \(pid (\d+)\)", banner).group(1))  # type: ignore[union-attr]
        # The banner gives the client role's URL; the data dir holds every role's.
        url = (data / "auth" / "client.url").read_text().strip()
        # Not a terminal: the password stays out of the banner (and of any log).
        assert "client: nats://client:***@127.0.0.1:" in banner and url not in banner
        assert "actor" not in url and (data / "auth" / "client.url").stat().st_mode & 0o077 == 0

        # The CLI finds the credentials in the data dir.
        out = run_toolbus("call", "built-in:echo", '{"text": "hi"}', "--session", "demo",
                          "--data-dir", str(data))
        assert out.returncode == 0, out.stderr
        assert out.stdout == '{"text":"hi"}\n'
        assert "session: demo" in out.stderr

        raw = await _raw_client_call(url, "raw1")
        assert [e["type"] for e in raw] == ["turn.requested", "call.requested",
                                           "call.approved", "call.dispatched",
                                           "call.started", "call.succeeded",
                                           "turn.completed"]
        assert raw[2]["rule"] == "auto:read_only"
        # The result is in call.succeeded; the turn's end references it, never copies it.
        assert raw[5]["result"] == {"from": "raw"}
        assert raw[-1]["outcomes"][0]["status"] == "succeeded"
        assert raw[-1]["outcomes"][0]["result_seq"] is not None

        bad = run_toolbus("call", "nowhere:tool", "{}", "--session", "demo", "--nats", url)
        assert bad.returncode == 1 and "no tool named 'nowhere:tool'" in bad.stderr
        bad_json = run_toolbus("call", "built-in:echo", "{oops", "--nats", url)
        assert bad_json.returncode == 2 and "not valid JSON" in bad_json.stderr
        failed = run_toolbus("call", "built-in:current_time", '{"timezone": "No/Where"}',
                             "--nats", url)
        assert failed.returncode == 1 and "invalid_timezone" in failed.stderr

        tools = run_toolbus("tools", "--nats", url)
        assert "built-in:echo" in tools.stdout and "built-in:current_time" in tools.stdout
        show = run_toolbus("tools", "show", "built-in:current_time", "--nats", url)
        assert json.loads(show.stdout)["properties"]["timezone"]["type"] == "string"

        timeline = run_toolbus("replay", "demo", "--nats", url)
        assert timeline.returncode == 0
        assert "call.succeeded" in timeline.stdout and "turn.failed" in timeline.stdout
        assert "state:" in timeline.stdout

        before = {sid: _replay_json(url, sid) for sid in ("demo", "raw1")}
        for sid, lines in before.items():
            live = run_toolbus("state", sid, "--nats", url)
            assert json.loads(live.stdout) == lines[-1]["state"], f"replay != live for {sid}"
        first_two = _replay_json_until(url, "demo", before["demo"][1]["seq"])
        assert len(first_two) == 3 and first_two[-1]["state"]["event_count"] == 2

        os.kill(server_pid, signal.SIGKILL)
        assert await asyncio.to_thread(up.proc.wait, 20) == 1
        assert "embedded nats-server exited" in up.stderr_after_exit()
    finally:
        up.stop()

    again = Proc("up", "--port", str(port), "--data-dir", str(data), ready="stop:")
    try:
        await again.wait_ready()
        for sid, lines in before.items():
            assert _replay_json(url, sid) == lines, f"session {sid} changed across the restart"
        out = run_toolbus("call", "built-in:echo", '{"after": "restart"}', "--session", "demo",
                          "--nats", url)
        assert out.stdout == '{"after":"restart"}\n'
    finally:
        assert again.stop(signal.SIGINT) == 0


def _replay_json_until(url: str, sid: str, seq: int) -> list[dict]:
    out = run_toolbus("replay", sid, "--json", "--until", str(seq), "--nats", url)
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_call_without_a_server_says_how_to_start_one() -> None:
    out = run_toolbus("call", "built-in:echo", "--nats", f"nats://127.0.0.1:{free_port()}")
    assert out.returncode == 3
    assert "cannot reach NATS" in out.stderr and "toolbus up" in out.stderr


def test_up_on_a_busy_port_says_what_to_do(nats_server, tmp_path: Path) -> None:
    out = run_toolbus("up", "--port", str(nats_server.port), "--data-dir", str(tmp_path))
    assert out.returncode == 3
    assert "is in use" in out.stderr and "--port" in out.stderr


async def test_a_second_up_on_a_data_dir_in_use_is_refused_and_changes_nothing(
        tmp_path: Path) -> None:
    data = tmp_path / "data"
    up = Proc("up", "--port", str(free_port()), "--data-dir", str(data), ready="stop:")
    try:
        banner = await up.wait_ready()
        # The server holds the lock too: killed, `toolbus up` leaves it held until its
        # nats-server is gone as well.
        server = re.search(r"nats-server \(pid (\d+)\)", banner)
        assert server is not None, banner
        held = {os.readlink(f"/proc/{server.group(1)}/fd/{fd}")
                for fd in os.listdir(f"/proc/{server.group(1)}/fd")}
        assert str(data / "toolbus.lock") in held
        urls = {f.name: f.read_text() for f in (data / "auth").glob("*.url")}
        conf = (data / "nats-server.conf").read_text()
        second = await asyncio.to_thread(run_toolbus, "up", "--port", str(free_port()),
                                         "--data-dir", str(data))
        assert second.returncode == 3, second.stderr
        assert f"the data dir {data} is in use by another `toolbus up` or the nats-server " \
            f"it started (pid {up.pid})" in second.stderr.strip().splitlines()[-1]
        # Its server never started: the store, the config and the credentials the
        # commands read still point at the first.
        assert {f.name: f.read_text() for f in (data / "auth").glob("*.url")} == urls
        assert (data / "nats-server.conf").read_text() == conf
        out = await asyncio.to_thread(run_toolbus, "call", "built-in:echo", '{"a": 1}',
                                      "--data-dir", str(data))
        assert out.returncode == 0 and out.stdout == '{"a":1}\n', out.stderr
    finally:
        assert up.stop(signal.SIGTERM) == 0
    # Once it stopped, the data dir is free again.
    again = Proc("up", "--port", str(free_port()), "--data-dir", str(data), ready="stop:")
    try:
        await again.wait_ready()
    finally:
        again.stop(signal.SIGTERM)


def test_up_on_a_data_dir_it_cannot_create_names_it() -> None:
    out = run_toolbus("up", "--port", str(free_port()), "--data-dir", "/proc/nope/data")
    assert out.returncode == 2
    assert "cannot use the data dir /proc/nope/data" in out.stderr.strip().splitlines()[-1]


def test_a_bad_session_id_is_refused_before_anything_is_sent(nats_url: str) -> None:
    out = run_toolbus("call", "built-in:echo", "--session", "no.dots", "--nats", nats_url)
    assert out.returncode == 2 and "invalid session id 'no.dots'" in out.stderr


async def test_actors_ride_out_a_restart_of_an_external_nats_server(tmp_path: Path) -> None:
    from bus.server import EmbeddedServer

    port = free_port()
    server = EmbeddedServer(tmp_path / "nats", port=port).start()
    url = server.url
    up = Proc("up", "--nats", url, ready="stop:")
    try:
        await up.wait_ready()
        first = run_toolbus("call", "built-in:echo", '{"n": 1}', "--session", "ride", "--nats", url)
        assert first.stdout == '{"n":1}\n'
        assert server.process is not None
        server.process.kill()
        server.process.wait(10)
        server.stop()
        server = EmbeddedServer(tmp_path / "nats", port=port).start()
        # No restart of toolbus: its actors reconnect and pull again.
        second = run_toolbus("call", "built-in:echo", '{"n": 2}', "--session", "ride",
                             "--nats", url, "--timeout", "20")
        assert second.returncode == 0, second.stderr
        assert second.stdout == '{"n":2}\n'
        events = _replay_json(url, "ride")
        assert [e["event"]["type"] for e in events[:-1]].count("turn.completed") == 2
        assert json.loads(run_toolbus("state", "ride", "--nats", url).stdout) == events[-1]["state"]
    finally:
        code = up.stop()
        server.stop()  # whatever happened above: no server outlives the test
    assert code == 0


async def test_each_actor_kind_runs_in_its_own_process(tmp_path: Path) -> None:
    """DESIGN.md's scale-out shape: session, approval and executor as separate processes
    on one NATS server, and a call through all of them."""
    from bus.server import EmbeddedServer

    server = EmbeddedServer(tmp_path / "nats", port=free_port()).start()
    procs = [Proc("actor", kind, "--nats", server.url, ready=f"{kind} actor")
             for kind in ("executor", "approval", "session")]
    try:
        for p in procs:
            await p.wait_ready()
        out = await asyncio.to_thread(run_toolbus, "call", "built-in:echo", '{"x": 1}',
                                      "--session", "apart", "--nats", server.url)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == {"x": 1}
        events = _replay_json(server.url, "apart")
        kinds = [e["event"]["type"] for e in events if "event" in e]
        assert kinds[:3] == ["turn.requested", "call.requested", "call.approved"]
        assert events[2]["event"]["actor"] == "approval"  # decided by the other process
    finally:
        for p in procs:
            p.stop()
        server.stop()


def _gone(pid: int, timeout: float) -> bool:
    """Whether process `pid` has ended (a zombie has), waiting up to `timeout` for it."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def _pids(banner: str) -> tuple[int, int]:
    """The embedded server's pid and worker 1's, from the banner."""
    server = re.search(r"nats-server \(pid (\d+)\)", banner)
    worker = re.search(r"process (\d+) \(worker 1\):", banner)
    assert server and worker, banner
    return int(server.group(1)), int(worker.group(1))


async def test_up_with_two_workers_runs_tools_in_a_worker_and_sigterm_stops_every_process(
        tmp_path: Path) -> None:
    port = free_port()
    up = Proc("up", "--port", str(port), "--data-dir", str(tmp_path / "data"),
              "--workers", "2", "--instance", "wk", ready="stop:")
    try:
        banner = await up.wait_ready()
        url = role_url(tmp_path / "data", "client")
        server_pid, worker_pid = _pids(banner)
        assert f"process {up.pid}: session, approval" in banner
        assert "executor wk-1 (pool default): built-in:current_time, built-in:echo" in banner
        # The worker's tools were in the catalog before the banner: the first call works.
        out = await asyncio.to_thread(run_toolbus, "call", "built-in:echo", '{"w": 2}',
                                      "--session", "workers", "--nats", url)
        assert out.returncode == 0, out.stderr
        assert out.stdout == '{"w":2}\n'
        started = [e["event"] for e in _replay_json(url, "workers")
                   if e.get("event", {}).get("type") == "call.started"]
        assert [s["executor"] for s in started] == ["wk-1"]  # run by the worker process
        executors = await asyncio.to_thread(run_toolbus, "executors", "--nats", url)
        assert "wk-1  pool=default  host=" in executors.stdout
        assert f"pid={worker_pid}" in executors.stdout
        assert not any(_gone(pid, 0) for pid in (up.pid, worker_pid, server_pid))
    finally:
        code = up.stop(signal.SIGTERM)
    assert code == 0
    assert _gone(worker_pid, 20) and _gone(server_pid, 20), "a process outlived toolbus up"


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            found.update(int(c) for c in (task / "children").read_text().split())
    return found


async def test_a_dead_worker_is_restarted_and_a_killed_parent_leaves_no_process_behind(
        tmp_path: Path) -> None:
    port = free_port()
    up = Proc("up", "--port", str(port), "--data-dir", str(tmp_path / "data"),
              "--workers", "2", "--instance", "wr", ready="stop:")
    try:
        server_pid, worker_pid = _pids(await up.wait_ready())
        url = role_url(tmp_path / "data", "client")
        bus = await connect(role_url(tmp_path / "data", "actor"), name="test-workers")
        catalog = Catalog(bus)
        await catalog.start()
        try:
            os.kill(worker_pid, signal.SIGKILL)
            # Its replacement killed too, before it is ready: one more restart, not the
            # end of toolbus up.
            async with asyncio.timeout(20):
                while not (starting := _children(up.pid) - {server_pid, worker_pid}):  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
            for pid in starting:
                os.kill(pid, signal.SIGKILL)
            # The next one announces itself under the same instance name.
            await catalog._executors.wait_until(
                lambda items: "wr-1" in items and items["wr-1"].pid not in
                {worker_pid, *starting}, 30)
            new_pid = catalog._executors.items["wr-1"].pid
        finally:
            await catalog.stop()
            await bus.close()
        out = await asyncio.to_thread(run_toolbus, "call", "built-in:echo", '{"again": 1}',
                                      "--nats", url)
        assert out.stdout == '{"again":1}\n', out.stderr
        os.kill(up.pid, signal.SIGKILL)  # no clean-up: the kernel tells the children
        assert _gone(new_pid, 20) and _gone(server_pid, 20), "orphans of a killed toolbus up"
        assert (f"worker wr-1 (pid {worker_pid}) exited with code -9; restarting it"
                in up.stderr_after_exit())
    finally:
        up.stop()


async def test_a_worker_still_starting_when_its_parent_is_killed_is_not_left_behind(
        tmp_path: Path) -> None:
    """The parent asks the kernel for a worker's SIGTERM between fork and exec: a worker
    still importing when `toolbus up` is SIGKILLed (on a loaded machine, many of them, for
    a long while) is not left running until it gets to ask for itself."""
    up = Proc("up", "--port", str(free_port()), "--data-dir", str(tmp_path / "data"),
              "--workers", "2", ready="stop:")
    try:
        worker = 0
        async with asyncio.timeout(30):
            while not worker:
                for pid in _children(up.pid):
                    with contextlib.suppress(OSError):
                        if b"\0actor\0worker\0" in Path(f"/proc/{pid}/cmdline").read_bytes():
                            worker = pid
                await asyncio.sleep(0.002)
        os.kill(worker, signal.SIGSTOP)  # held where it is: importing toolbus
        try:
            up.proc.kill()
            up.proc.wait(10)
            # The kernel's SIGTERM waits for it to run again (the stop holds it).
            status = Path(f"/proc/{worker}/status").read_text()
            pending = [int(line.split()[1], 16) for line in status.splitlines()
                       if line.startswith(("SigPnd:", "ShdPnd:"))]
            assert any(mask & (1 << (signal.SIGTERM - 1)) for mask in pending), status
        finally:
            os.kill(worker, signal.SIGCONT)
        assert _gone(worker, 10), "a worker outlived its killed parent"
    finally:
        up.stop()


async def test_ctrl_c_ends_toolbus_up_while_a_sync_tool_it_gave_up_on_still_runs(
        tmp_path: Path) -> None:
    tools = tmp_path / "stuck.py"
    tools.write_text(
        "import time\nfrom actors.tools import tool\n\n"
        "@tool('stuck:forever', read_only=True, timeout_ms=300)\n"
        "def forever() -> dict:\n    time.sleep(3600)\n    return {}\n")
    up = Proc("up", "--port", str(free_port()), "--data-dir", str(tmp_path / "data"),
              "--tools", str(tools), "--workers", "1", ready="stop:")
    try:
        await up.wait_ready()
        url = role_url(tmp_path / "data", "client")
        out = await asyncio.to_thread(run_toolbus, "call", "stuck:forever", "{}",
                                      "--nats", url)
        assert "timeout" in out.stderr, out.stderr
    finally:
        # Closing the event loop waited for the thread of the call it timed out on, an
        # hour here: Ctrl-C never ended the process.
        code = up.stop(signal.SIGINT, timeout=30)
    assert code == 0, up.stderr_tail[-2000:]


async def test_up_whose_stdout_reader_is_gone_keeps_serving(tmp_path: Path) -> None:
    """`toolbus up | head -1`: its banner written to a pipe no one reads any more raised
    BrokenPipeError, which ended `toolbus up` quietly, with status 0 (a new user's pass)."""
    import subprocess

    from tests.conftest import toolbus_cmd

    data = tmp_path / "data"
    up = subprocess.Popen(  # noqa: ASYNC220  # spawning does not block
        toolbus_cmd("up", "--port", str(free_port()), "--data-dir", str(data)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert up.stdout is not None
    up.stdout.close()  # the reader is gone before the banner is written
    try:
        async with asyncio.timeout(60):
            while not (data / "auth" / "client.url").exists():
                assert up.poll() is None, up.communicate()[1]
                await asyncio.sleep(0.1)
        out = await asyncio.to_thread(run_toolbus, "call", "built-in:echo", '{"a": 1}',
                                      "--data-dir", str(data))
        assert out.returncode == 0 and out.stdout == '{"a":1}\n', out.stderr
        await asyncio.sleep(2)  # well past the banner
        assert up.poll() is None, up.communicate()[1]
        out = await asyncio.to_thread(run_toolbus, "call", "built-in:echo", '{"b": 2}',
                                      "--data-dir", str(data))
        assert out.returncode == 0 and out.stdout == '{"b":2}\n', out.stderr
    finally:
        up.send_signal(signal.SIGTERM)
        _, err = await asyncio.to_thread(up.communicate, timeout=30)
    assert up.returncode == 0, err


async def test_toolbus_up_exits_at_once_when_its_embedded_server_is_killed(
    tmp_path: Path,
) -> None:
    """Its message says to run `toolbus up` again to resume, and the data dir stays locked
    until it has exited: each executor stopping (the worker's, and the planner's for the
    context tools and the agents) waited out a request to a server that was gone, 5 s
    each, 15 s in all before the advised restart could start."""
    port = free_port()
    data = tmp_path / "data"
    manifest = tmp_path / "agents.yaml"
    manifest.write_text(
        "version: 1\n"
        "agent_config:\n"
        "  model: {provider: openai, model: m, base_url: 'http://127.0.0.1:9/v1',\n"
        "          api_key: '${NO_KEY:-}'}\n"
        "  agents:\n"
        "    writer: {instructions: You write.}\n")
    up = Proc("up", "--port", str(port), "--data-dir", str(data), "--workers", "2",
              "--manifest", str(manifest), ready="stop:")
    try:
        banner = await up.wait_ready()
        server_pid = int(re.search(r"nats-server \(pid (\d+)\)", banner).group(1))  # type: ignore[union-attr]
        os.kill(server_pid, signal.SIGKILL)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await asyncio.to_thread(up.proc.wait, 30) == 1
        took = loop.time() - t0
        assert "embedded nats-server exited" in up.stderr_after_exit()
        # 15 s before (5 s per executor); about 5 s now: a bound far from both, on a busy machine.
        assert took < 12.0, f"toolbus up took {took:.1f} s to exit after its server died"
    finally:
        up.stop()
    # What it says to do works at once.
    again = Proc("up", "--port", str(port), "--data-dir", str(data), "--workers", "1",
                 ready="stop:")
    try:
        await again.wait_ready()
    finally:
        assert again.stop(signal.SIGINT) == 0
