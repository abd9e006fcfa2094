"""Every command as a new user tries it: bad flags, a missing or refusing server, a closed
pipe. Each ends with one clear line and its exit code, never a traceback or a hang."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from bus.server import free_port
from schemas.errors import InvalidRequestError
from schemas.events import TurnCompleted
from tests.conftest import REPO, run_toolbus, toolbus_cmd


def _one_clear_line(out: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in out.stderr, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert lines, "no message at all"
    return lines[-1]


@pytest.mark.parametrize(("args", "says"), [
    (("up", "--port", "99999"), "argument --port: 99999 is not a TCP port: give 1 to 65535"),
    (("up", "--port", "-1"), "argument --port: -1 is not a TCP port"),
    (("up", "--http-port", "99999"), "argument --http-port: 99999 is not a TCP port"),
    (("up", "--workers", "0"), "--workers 0"),
    # Each a whole process: 10,000 on 2 cores had loaded the machine past 100, for long.
    (("up", "--workers", "10000"), "--workers 10000: at most"),
    # One port for two servers: the second failed, blaming its own flag only.
    (("up", "--http-port", "24227", "--metrics-port", "24227"),
     "--metrics-port 24227 is also the --http-port: each needs a port of its own"),
    (("up", "--port", "24228", "--http-port", "24228"), "--http-port 24228 is also the --port"),
    (("call", "built-in:echo", "--timeout", "-1"), "argument --timeout: -1 is not a positive"),
    (("call", "built-in:echo", "--timeout", "soon"), "argument --timeout: invalid float"),
    (("replay", "s", "--until", "0"), "argument --until: 0 is not a positive"),
    (("replay", "s", "--follow", "--until", "3"), "it takes no --until"),
    (("replay", "s", "-f", "--full"), "it takes no --full"),
    (("bench", "calls", "--n", "0"), "argument --n: 0 is not a positive"),
    (("bench", "agent", "--turns", "1"), "--turns 1 has no history to compare"),
    (("bench", "agent", "--nats", "nats://127.0.0.1:4222"),
     "bench agent: not used here: --nats"),
    (("bench", "mcp", "--session-actors", "2"),
     "bench mcp: not used here: --session-actors"),
    (("bench", "validation", "--concurrency", "4", "--fsync", "always"),
     "bench validation: not used here: --concurrency, --fsync (--concurrency is for "
     "`bench calls`, `bench mcp`; --fsync is for `bench calls`, `bench mcp`, `bench replay`"),
    (("bench", "agent", "--events", "10"), "--events is for `bench replay`"),
    # With --nats the running server is measured: what would shape the one a benchmark
    # starts is not silently dropped; nor is a data dir no benchmark reads.
    (("bench", "calls", "--nats", "nats://127.0.0.1:9", "--fsync", "always", "--workers",
      "2"), "bench calls: not used with --nats: --fsync, --workers"),
    (("bench", "replay", "--nats", "nats://127.0.0.1:9", "--fsync", "always"),
     "bench replay: not used with --nats: --fsync"),
    (("bench", "validation", "--data-dir", "/nowhere"), "unrecognized arguments: --data-dir"),
    (("state", "no.dots"), "invalid session id 'no.dots'"),
    (("chat", "hi", "--session", "a b"), "invalid session id 'a b'"),
    (("chat", "hi", "--session", ""), "invalid session id ''"),  # not a new session
    (("call", "built-in:echo", "--session", ""), "invalid session id ''"),
    (("chat", "hi", "--agent", "bad agent"), "invalid agent name 'bad agent'"),
    (("chat", "hi", "--timeout", "nan"), "argument --timeout: nan is not a positive"),
    (("chat", "hi", "--timeout", "inf"), "argument --timeout: inf is more than 604800 "
                                         "seconds (a week)"),
    (("call", "built-in:echo", "--timeout", "1e300"), "argument --timeout: 1e300 is more"),
    (("chat", " "), "MESSAGE is empty"),  # not a new session holding a rejection
    (("chat", "a" * 70_000), "MESSAGE is 70000 bytes; the limit is 65536"),
    (("tools", "show"), "tools show needs a NAME"),
    # Given and unused: refused, not dropped without a word.
    (("tools", "list", "extra"), "`tools list` takes no NAME (got 'extra')"),
    (("tools", "list", "--format", "openai"), "`tools list --format openai` takes no --format"),
    (("tools", "export", "--output-schema", "f.json"), "`tools export` takes no "
                                                       "--output-schema"),
    (("tools", "export", "--force"), "`tools export` takes no --force"),
    (("tools", "export", "--format", "composed", "--names"), "takes no --names"),
    (("tools", "show", "built-in:echo", "--names"), "`tools show` takes no --names"),
    (("actor", "executor", "--only", "cars"), "--only names MCP servers: it is for"),
    (("actor", "session", "--tools", "x.py", "--pool", "p"),
     "`actor session` takes no --tools, --pool: tool modules and their pool are for"),
    (("actor", "approval", "--pool", "zz"), "`actor approval` takes no --pool"),
    (("approve", "a.b.>"), "invalid call id 'a.b.>'"),
    (("deny", "", "--reason", "no"), "invalid call id ''"),
    (("deny", "c1", "--reason", " "), "--reason must say why"),
    (("approve", "c1", "--by", "b" * 200), "--by is at most 128 characters"),
    (("deny", "c1", "--reason", "r" * 5000), "--note and --reason at most 4000"),
    (("cancel", "a.b", "--session", "s1"), "invalid turn id 'a.b'"),
    (("cancel", "t1", "--session", "s1", "--reason", " "), "--reason must say why"),
    (("cancel", "t1"), "the following arguments are required: --session"),
    # A URL nats-py cannot use is not a server that cannot be reached.
    (("state", "demo", "--nats", "http://x"),
     "invalid NATS URL 'http://x': 'http' is not a NATS scheme"),
    (("state", "demo", "--nats", "not a url"), "invalid NATS URL 'not a url': a space"),
    (("state", "demo", "--nats", "nats//127.0.0.1:4222"),
     "invalid NATS URL 'nats//127.0.0.1:4222': a path after the host"),
    (("state", "demo", "--nats", "nats://u:secret@127.0.0.1:99999"),
     "invalid NATS URL 'nats://***@127.0.0.1:99999': port out of range"),
    # A password with a / in it: unparsable, and not a piece of it printed.
    (("state", "demo", "--nats", "nats://user:pa/ss@127.0.0.1:4222"),
     "invalid NATS URL 'nats://***@127.0.0.1:4222': unparsable"),
    (("up", "--nats", "nats://[::1"), "invalid NATS URL 'nats://[::1'"),
])
def test_bad_flags_are_one_line_usage_errors(args: tuple[str, ...], says: str,
                                            tmp_path: Path) -> None:
    out = run_toolbus(*args, "--data-dir", str(tmp_path)) if args[0] in (
        "call", "replay", "state", "tools", "chat", "cancel") else run_toolbus(*args)
    assert out.returncode == 2, out.stderr
    assert says in _one_clear_line(out)


@pytest.mark.parametrize("module", ["services.sample_llm", "services.sample_mcp"])
def test_the_sample_servers_refuse_a_port_that_is_not_one(module: str) -> None:
    out = subprocess.run([sys.executable, "-m", module, "--port", "99999"],
                         capture_output=True, text=True, timeout=30, cwd=REPO)
    assert out.returncode == 2
    assert "99999 is not a TCP port: give 1 to 65535" in _one_clear_line(out)


@pytest.mark.parametrize("args", [
    ("call", "built-in:echo", "{}"), ("replay", "s1"), ("replay", "s1", "--follow"),
    ("state", "s1"), ("tools",),
    ("executors",), ("approvals",), ("approve", "c1", "--session", "s1"),
    ("deny", "c1", "--session", "s1", "--reason", "no"), ("tools", "remove", "x:y"),
    ("chat", "hi"), ("cancel", "t1", "--session", "s1"),
])
def test_every_client_command_without_a_server_says_how_to_start_one(
        args: tuple[str, ...], tmp_path: Path) -> None:
    out = run_toolbus(*args, "--nats", f"nats://127.0.0.1:{free_port()}",
                      "--data-dir", str(tmp_path), timeout=30)
    assert out.returncode == 3, out.stderr
    line = _one_clear_line(out)
    assert "cannot reach NATS at nats://127.0.0.1:" in line and "toolbus up" in line


def test_wrong_credentials_are_refused_in_one_line_without_the_password(
        nats_server) -> None:
    wrong = nats_server.url_for("client").replace("client:", "client:zz", 1)
    out = run_toolbus("call", "built-in:echo", "{}", "--nats", wrong)
    assert out.returncode == 3
    line = _one_clear_line(out)
    assert "refused the connection" in line and "client:***@" in line
    assert wrong.split("@")[0].split(":")[-1] not in out.stderr  # no password shown


def test_a_client_may_not_do_what_its_role_may_not(nats_server, system) -> None:
    out = run_toolbus("tools", "remove", "built-in:echo", "--force", "--nats",
                      nats_server.url_for("client"))
    assert out.returncode == 3, out.stderr
    line = _one_clear_line(out)
    assert "NATS refused this role's publish to" in line and "permissions violation" in line


def test_a_server_toolbus_never_set_up_is_named_as_such(tmp_path: Path) -> None:
    from bus.server import EmbeddedServer

    with EmbeddedServer(tmp_path, port=free_port()) as bare:
        out = run_toolbus("tools", "--nats", bare.url_for("client"))
    assert out.returncode == 3, out.stderr
    assert "Is this server toolbus's?" in _one_clear_line(out)


async def test_a_decision_no_approval_actor_answers_says_what_to_check(
        tmp_path: Path) -> None:
    # An approval actor subscribed but silent (`toolbus up` stopped with Ctrl-Z, wedged):
    # "no answer on toolbus.approval... within 10 s" said nothing of what to check.
    from bus.connection import connect
    from bus.server import EmbeddedServer

    with EmbeddedServer(tmp_path, port=free_port(), auth=False) as bare:
        bus = await connect(bare.url, name="mute approval actor")
        try:
            async def mute(msg: object) -> None:
                pass

            await bus.nc.subscribe("toolbus.approval.>", cb=mute)
            await bus.nc.flush()
            out = await asyncio.to_thread(run_toolbus, "approve", "c1-0", "--session", "s1",
                                          "--nats", bare.url, timeout=60)
        finally:
            await bus.close()
    assert out.returncode == 3, out.stderr
    assert _one_clear_line(out).endswith(
        "within 10 s: is an approval actor (`toolbus up`) running and answering?"), out.stderr


async def test_replay_into_a_closed_pipe_ends_quietly(client, nats_url: str) -> None:
    sid = f"pipe-{uuid.uuid4().hex[:8]}"
    for _ in range(3):  # about 1,200 events: far more output than a pipe holds
        end = await client.call(sid, [{"tool": "built-in:echo", "arguments": {"i": i}}
                                      for i in range(64)])
        assert isinstance(end, TurnCompleted)
    # `toolbus replay SID | head -1`, as a shell runs it.
    cmd = " ".join(toolbus_cmd("replay", sid, "--json", "--nats", f"'{nats_url}'"))
    out = await asyncio.to_thread(
        subprocess.run, ["bash", "-o", "pipefail", "-c", f"{cmd} | head -1"],
        capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.stdout.count("\n") == 1 and '"turn.requested"' in out.stdout
    assert out.stderr == "", out.stderr
    assert out.returncode == 0


async def test_replay_follow_of_a_quiet_session_ends_when_its_reader_goes(
        client, nats_url: str) -> None:
    # `toolbus replay SID --follow --json | head -1` on a session with nothing yet: it
    # waited for an event to write (and fail) before it noticed.
    sid = f"quiet-{uuid.uuid4().hex[:8]}"
    cmd = " ".join(toolbus_cmd("replay", sid, "--follow", "--json", "--nats",
                               f"'{nats_url}'"))
    out = await asyncio.to_thread(
        subprocess.run, ["bash", "-o", "pipefail", "-c", f"{cmd} | true"],
        capture_output=True, text=True, timeout=20, cwd=REPO)
    assert out.returncode == 0 and out.stderr == "", out.stderr


async def test_replay_until_before_the_sessions_first_event_says_so(client,
                                                                     nats_url: str) -> None:
    for sid in (f"before-{uuid.uuid4().hex[:8]}", f"until-{uuid.uuid4().hex[:8]}"):
        end = await client.call(sid, [{"tool": "built-in:echo", "arguments": {}}])
        assert isinstance(end, TurnCompleted)
    listed = await asyncio.to_thread(run_toolbus, "replay", sid, "--json", "--nats", nats_url)
    first = json.loads(listed.stdout.splitlines()[0])["seq"]
    # --until counts the stream, not the session's events: "has no events" was wrong.
    out = await asyncio.to_thread(run_toolbus, "replay", sid, "--until", str(first - 1),
                                  "--nats", nats_url)
    assert out.returncode == 1
    assert f"session {sid} has no events up to seq {first - 1}" in _one_clear_line(out)
    # With --json too: the empty state printed, the same status and line.
    out = await asyncio.to_thread(run_toolbus, "replay", sid, "--until", str(first - 1),
                                  "--json", "--nats", nats_url)
    assert out.returncode == 1 and json.loads(out.stdout)["state"]["last_seq"] == 0
    assert f"session {sid} has no events up to seq {first - 1}" in _one_clear_line(out)


async def test_chat_reads_a_line_with_no_end_in_bounded_memory() -> None:
    # `toolbus chat < /dev/zero` (or a binary file piped in) held the whole endless line:
    # 730 MB after 15 s, every read copying it all again.
    from services.commands import _StdinLines

    read, write = os.pipe()

    def feed() -> None:
        with os.fdopen(write, "wb") as out:
            for _ in range(80):
                out.write(b"a" * 65536)
            out.write(b"\nnext\n")

    threading.Thread(target=feed, daemon=True).start()
    try:
        lines = _StdinLines(read, limit=128 * 1024)
        assert await lines.next() == 80 * 65536  # the size of the line skipped
        assert lines.held() <= 128 * 1024 + 65536
        assert await lines.next() == "next\n"
        assert await lines.next() is None
    finally:
        os.close(read)


def test_bench_validation_works_without_the_dev_only_package(tmp_path: Path) -> None:
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "fastjsonschema.py").write_text("raise ImportError('not installed')\n")
    out = run_toolbus("bench", "validation", PYTHONPATH=str(shadow))
    assert out.returncode == 0, out.stderr
    assert "fastjsonschema: not installed" in out.stdout
    assert "toolbus (jsonschema-rs + defaults), valid" in out.stdout


async def test_up_takes_its_server_from_nats_url_and_keeps_passwords_out_of_argv(
        tmp_path: Path) -> None:
    import re

    from bus.server import EmbeddedServer
    from tests.conftest import Proc

    with EmbeddedServer(tmp_path / "nats", port=free_port()) as server:
        up = Proc("up", "--workers", "2", "--data-dir", str(tmp_path / "data"),
                  ready="stop:", env={"NATS_URL": server.url})
        try:
            banner = await up.wait_ready()
            assert f"toolbus is up: nats://actor:***@127.0.0.1:{server.port}" in banner
            worker = int(re.search(r"process (\d+) \(worker 1\)", banner).group(1))  # type: ignore[union-attr]
            for pid in (up.pid, worker):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                assert not any(b"@" in part for part in argv), argv
        finally:
            code = up.stop()
    assert code == 0


@pytest.mark.parametrize("delay", [0.0, 0.03, 0.1, 0.3])
def test_ctrl_c_while_the_command_starts_is_one_line_not_a_traceback(tmp_path: Path,
                                                                     delay: float) -> None:
    # SIGINT lands while Python is still importing toolbus's modules (the first fraction
    # of a second); the imports are guarded so the command ends with status 130. Timed
    # from the moment the child maps msgspec's extension, which only the guarded imports
    # load: a fixed delay from the spawn may still land in the interpreter's own start-up
    # (runpy compiling the entry module) on a slow machine, before any code of toolbus
    # can guard anything, and that start-up is Python's, not toolbus's.
    import signal
    import time

    import msgspec._core

    marker = Path(msgspec._core.__file__).name
    proc = subprocess.Popen([*toolbus_cmd(), "up", "--port", str(free_port()), "--data-dir",
                             str(tmp_path / "data"), "--workers", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while marker not in Path(f"/proc/{proc.pid}/maps").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, "msgspec never loaded"
            time.sleep(0.001)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:  # it ignored the signal: not left running
            proc.kill()
            proc.communicate(timeout=10)
    assert "Traceback" not in err, err
    # -2: the signal came before the interpreter had set up its own handler.
    assert proc.returncode in (130, -signal.SIGINT), (proc.returncode, err)
    assert len(err.strip().splitlines()) <= 1, err


@pytest.mark.parametrize("args", [
    ("call", "built-in:echo", '{"text": "hi"}', "--request-id", "r\udcff"),
    ("call", "built-in:echo", '{"text": "\udcff"}'),
    ("chat", "x\udcfe"),
])
async def test_text_that_is_not_utf8_is_a_one_line_usage_error(
        client, nats_url: str, args: tuple[str, ...]) -> None:
    # As a shell passes $'\xff': bytes Python holds as surrogate escapes.
    out = await asyncio.to_thread(run_toolbus, *args, "--nats", nats_url)
    assert out.returncode == 2, out.stderr
    assert "not valid UTF-8" in _one_clear_line(out)


def test_a_tools_module_that_fails_on_import_is_one_line_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "badmod.py"
    bad.write_text('x = 1\nraise RuntimeError("boom at import")\n')
    out = run_toolbus("up", "--port", str(free_port()), "--data-dir", str(tmp_path / "d"),
                      "--tools", str(bad), "--workers", "1")
    assert out.returncode == 2, out.stderr
    assert _one_clear_line(out) == (f"toolbus: --tools {bad}: importing it failed (line 2): "
                                    "RuntimeError: boom at import")


def test_a_data_dir_without_credentials_is_named_when_nothing_answers(
        tmp_path: Path) -> None:
    # A mistyped --data-dir: the default address is tried, and the error says why.
    out = run_toolbus("chat", "hi", "--data-dir", str(tmp_path / "typo"))
    assert out.returncode == 3, out.stderr
    assert _one_clear_line(out).startswith(
        f"toolbus: the data dir {tmp_path / 'typo'} holds no client credentials")


def test_a_tools_module_that_exits_on_import_does_not_end_toolbus_quietly(
        tmp_path: Path) -> None:
    bad = tmp_path / "exits.py"
    bad.write_text("import sys\nsys.exit(0)\n")
    out = run_toolbus("up", "--port", str(free_port()), "--data-dir", str(tmp_path / "d"),
                      "--tools", str(bad), "--workers", "1")
    assert out.returncode == 2, out.stderr
    assert _one_clear_line(out) == f"toolbus: --tools {bad}: it called sys.exit(0) while " \
        "it was imported"


async def test_a_request_id_over_its_limit_is_refused_at_once_not_waited_for(
        client, nats_url: str) -> None:
    # The session actor refuses it without naming it (it is too long to store), so no
    # answer could ever match: `toolbus call` used to wait out its whole --timeout, then
    # ask whether toolbus was running.
    out = await asyncio.to_thread(run_toolbus, "call", "built-in:echo", '{"text": "hi"}',
                                  "--request-id", "k" * 257, "--timeout", "30",
                                  "--nats", nats_url, timeout=20)
    assert out.returncode == 2, out.stderr
    assert "--request-id is longer than 256 characters (257)" in _one_clear_line(out)
    # Server or not.
    out = await asyncio.to_thread(run_toolbus, "call", "built-in:echo", "{}", "--request-id",
                                  "k" * 300, "--nats", f"nats://127.0.0.1:{free_port()}")
    assert out.returncode == 2, out.stderr
    # The library's client refuses it too, before publishing anything.
    with pytest.raises(InvalidRequestError, match="request_id is longer than 256"):
        await client.call(f"t-{uuid.uuid4().hex[:8]}", [{"tool": "built-in:echo"}],
                          request_id="k" * 257, timeout=5)


async def test_call_prints_a_tools_error_without_its_escape_sequences(
        client, nats_url: str) -> None:
    # A tool's (an MCP server's, an approver's) text must not drive the terminal of the
    # person who called it, as `toolbus chat` and `toolbus replay` already ensure.
    reason = "no\x1b[2J\x1b]0;owned\x07 way\u202e"
    out = await asyncio.to_thread(run_toolbus, "call", "testing:refuse",
                                  json.dumps({"reason": reason}), "--nats", nats_url)
    assert out.returncode == 1, out.stderr
    line = _one_clear_line(out)
    assert line == "toolbus: testing:refuse failed (refused): no[2J]0;owned way", line


def test_files_that_are_not_utf8_are_one_line_errors_not_tracebacks(tmp_path: Path) -> None:
    manifest = tmp_path / "m.yaml"
    manifest.write_bytes(b"version: 1\ntools:\n  builtins: [\"\xff\"]\n")
    out = run_toolbus("up", "--port", str(free_port()), "--data-dir", str(tmp_path / "d"),
                      "--manifest", str(manifest), "--workers", "1")
    assert out.returncode == 2, out.stderr
    assert _one_clear_line(out) == "  not UTF-8 text: byte 0xff at offset 32"
    token = tmp_path / "token"
    token.write_bytes(b"\xff\xfe")
    out = run_toolbus("top", "--once", "--token-file", str(token))
    assert out.returncode == 2, out.stderr
    assert "is not a token (not UTF-8 text)" in _one_clear_line(out)
    (tmp_path / "d2" / "auth").mkdir(parents=True)
    (tmp_path / "d2" / "auth" / "client.url").write_bytes(b"nats://client:\xff@127.0.0.1:1")
    out = run_toolbus("tools", "--data-dir", str(tmp_path / "d2"))
    assert out.returncode == 2, out.stderr
    assert "client.url are not UTF-8 text" in _one_clear_line(out)


async def test_json_output_escapes_what_would_drive_or_reorder_the_terminal(
        client, nats_url: str) -> None:
    # JSON escapes C0 (ESC included) but leaves C1 controls (U+009B is CSI to a terminal
    # that takes 8-bit controls), DEL and bidirectional overrides raw: a tool result or a
    # prompt-injected model's text printed by `call`, `state` or `replay --json` could
    # drive the terminal or reorder what it shows. Escaped, the JSON reads back the same.
    sid = f"esc-{uuid.uuid4().hex[:8]}"
    text = "a\u009b2Jb\u202ecba\u2066\U000e0041\x7f é 😀"
    raw = ("\u009b", "\u202e", "\u2066", "\U000e0041", "\x7f")
    out = await asyncio.to_thread(run_toolbus, "call", "built-in:echo",
                                  json.dumps({"text": text}), "--session", sid,
                                  "--nats", nats_url)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"text": text}
    state = await asyncio.to_thread(run_toolbus, "state", sid, "--nats", nats_url)
    replay = await asyncio.to_thread(run_toolbus, "replay", sid, "--json", "--nats",
                                     nats_url)
    for printed in (out.stdout, state.stdout, replay.stdout):
        assert not any(c in printed for c in raw), ascii(printed)
    assert text in json.dumps(json.loads(state.stdout), ensure_ascii=False)
    events = [json.loads(line) for line in replay.stdout.splitlines()]
    assert any(text in json.dumps(e, ensure_ascii=False) for e in events)


def test_up_with_a_server_that_is_not_there_says_to_start_that_one(tmp_path: Path) -> None:
    from bus.server import free_port

    out = run_toolbus("up", "--nats", f"nats://127.0.0.1:{free_port()}", "--data-dir",
                      str(tmp_path), timeout=60)
    assert out.returncode == 3, out.stderr
    assert "Start that server, or leave --nats (and NATS_URL) out" in out.stderr
    assert "Start one with `toolbus up`" not in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("args", [("approve", "a" * 100_000), ("state", "b" * 5_000),
                                  ("cancel", "c." * 3_000, "--session", "s1")])
def test_an_invalid_id_is_quoted_back_cut_short(args: tuple[str, ...],
                                                 tmp_path: Path) -> None:
    # A 100,000-character id was printed back whole, in a line as long.
    out = run_toolbus(*args, "--data-dir", str(tmp_path)) if args[0] != "approve" \
        else run_toolbus(*args)
    assert out.returncode == 2, out.stderr
    assert len(out.stderr) < 1_000 and "characters)" in out.stderr, out.stderr[:300]


def test_the_metrics_on_another_address_may_share_the_gateways_port(tmp_path: Path) -> None:
    from bus.server import free_port

    # The gateway listens on 127.0.0.1; metrics on another address may take the same
    # port (here an address this machine does not have: refused for that, not a clash).
    port = str(free_port())
    out = run_toolbus("up", "--port", str(free_port()), "--http-port", port,
                      "--metrics-port", port, "--metrics-host", "192.0.2.1",
                      "--data-dir", str(tmp_path), timeout=60)
    assert out.returncode != 0
    assert "each needs a port of its own" not in out.stderr
    assert "the metrics endpoint cannot listen on 192.0.2.1" in out.stderr, out.stderr


@pytest.mark.parametrize("blocked", ["task", "loop", "task, stderr closed"])
def test_a_command_stuck_after_sigterm_exits_anyway_saying_where(blocked: str) -> None:
    """SIGTERM cancels a command (chat, bench) so that its cleanup runs; a cleanup that
    waits on something that never comes (or blocks the event loop) would keep the
    process forever. It exits 143 after its grace period, naming what it waited for."""
    script = f"""
import asyncio, sys, time
from services.process import run, terminable

async def wait_for_good() -> int:
    try:
        await asyncio.sleep(3600)
    finally:
        try:
            print("cleanup", file=sys.stderr, flush=True)
        except OSError:  # stderr closed
            pass
        if {blocked!r} == "loop":
            time.sleep(3600)
        await asyncio.Event().wait()  # never set
    return 0

async def main() -> int:
    loop = asyncio.get_running_loop()
    loop.call_later(0.2, lambda: print("ready", flush=True))
    return await terminable(wait_for_good(), grace_s=1.0)

sys.exit(run(main()))
"""
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        if "stderr closed" in blocked:  # where it would say so is gone: it exits all the same
            assert proc.stderr is not None
            proc.stderr.close()
            proc.terminate()
            proc.wait(timeout=15)
            proc.stdout.close()
            assert proc.returncode == 143
            return
        proc.terminate()
        _, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err
    assert "cleanup" in err
    assert "toolbus: still stopping 1 s after SIGTERM; exiting now" in err
    # Where it was stuck: the task's stack, or the main thread's when the loop is blocked.
    assert "wait_for_good" in err, err


async def test_an_unwritable_stderr_stops_no_command(client, nats_url: str) -> None:
    """`2>/dev/full`: what a command says on stderr is dropped, not the work. `toolbus
    call` sent nothing and exited 1 (its first line to stderr failed)."""
    sid = f"full-{uuid.uuid4().hex[:8]}"
    cmd = " ".join(toolbus_cmd("call", "built-in:echo", '\'{"text": "hi"}\'', "--session",
                               sid, "--nats", f"'{nats_url}'"))
    out = await asyncio.to_thread(
        subprocess.run, ["bash", "-c", f"{cmd} 2>/dev/full"],
        capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stdout
    assert '"hi"' in out.stdout
    state = await client.fold_session(sid)
    assert [c.status for c in state.calls.values()] == ["succeeded"]
