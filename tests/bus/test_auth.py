"""Roles and permissions on NATS (bus/auth.py), checked against `toolbus up` as users run
it and against `deploy/nats/single.conf` run by hand: an anonymous connection is refused,
a client cannot write events, the catalog or approvals, an approver's decision records
who decided."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import uuid
from pathlib import Path

import nats
import pytest

from bus.auth import ROLES, deploy_roles_conf, inbox_prefix, password_variable, redact
from bus.connection import Bus, connect
from bus.server import free_port, nats_server_binary
from bus.subjects import approval_subject, event_subject
from schemas.errors import AuthError, PermissionDeniedError
from tests.conftest import REPO, Proc, pending_approval_call, role_url, run_toolbus

DEPLOY = REPO / "deploy" / "nats"


def test_deploy_roles_match_the_embedded_servers() -> None:
    assert (DEPLOY / "roles.conf").read_text() == deploy_roles_conf(), \
        "regenerate: python -c 'from bus.auth import deploy_roles_conf as d; " \
        "print(d(), end=\"\")' > deploy/nats/roles.conf"


@pytest.mark.parametrize("conf", ["single.conf", "cluster/node-1.conf"])
def test_deploy_configs_are_valid_and_need_every_password(conf: str) -> None:
    env = {password_variable(r): _password() for r in ROLES}
    if conf.startswith("cluster/"):  # authenticated routes: deploy/nats/README.md
        env["TOOLBUS_ROUTE_PASSWORD"] = route = _password()
        env["TOOLBUS_ROUTES"] = f"[nats-route://route:{route}@127.0.0.1:6223]"
    ok = subprocess.run([nats_server_binary(), "-c", str(DEPLOY / conf), "-t"],
                        capture_output=True, text=True, env=env, timeout=30)
    assert ok.returncode == 0, ok.stderr + ok.stdout
    env.pop(password_variable("client"))
    missing = subprocess.run([nats_server_binary(), "-c", str(DEPLOY / conf), "-t"],
                             capture_output=True, text=True, env=env, timeout=30)
    assert missing.returncode != 0 and "TOOLBUS_CLIENT_PASSWORD" in missing.stderr


def _password() -> str:
    """As deploy/nats/README.md says to make them: nats-server parses a variable's value
    as a config value, so it starts with a letter and is alphanumeric."""
    return "p" + secrets.token_hex(16)


def test_redact_hides_passwords() -> None:
    assert redact("nats://client:s3cr%2Ft@127.0.0.1:4222") == "nats://client:***@127.0.0.1:4222"
    assert redact("nats://tok@h:1,nats://a:b@[::1]:2") == "nats://***@h:1,nats://a:***@[::1]:2"
    assert redact("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"
    # Without a scheme, as nats-py takes it (it adds nats://): `--nats client:PW@host:port`
    # was printed whole in "NATS at ... refused the connection".
    assert redact("client:s3cret@127.0.0.1:4222") == "client:***@127.0.0.1:4222"
    assert redact("nats://u:pa,ss@h:1") == "<unparsable URL>,***@h:1"  # a comma in it
    assert redact("no servers available: user@host") == "no servers available: user@host"


async def _check_roles(address: str, urls: dict[str, str]) -> None:
    """The acceptance checks of the roles, for any server that enforces them."""
    with pytest.raises(AuthError, match="refused the connection"):
        await connect(address, name="anonymous")
    wrong = urls["client"].replace("client:", "client:x", 1)
    with pytest.raises(AuthError) as refused:
        await connect(wrong, name="wrong-password")
    assert "client:x" not in str(refused.value)  # no password in the message

    sid = f"auth-{uuid.uuid4().hex[:8]}"
    client = await connect(urls["client"], name="test-client")
    try:
        # Forging an event, the catalog, an approval, or managing streams: refused.
        for subject in (event_subject(sid, "call.succeeded", partitions=8),
                        event_subject(sid, "approval.granted", "c1", partitions=8),
                        "$KV.toolbus_catalog.evil.tool",
                        "$KV.toolbus_approvals.x.y",
                        approval_subject(sid, "c1", "client"),
                        approval_subject(sid, "c1", "approver"),
                        "$JS.API.STREAM.PURGE.TOOLBUS_EVENTS",
                        "$JS.API.CONSUMER.CREATE.TOOLBUS_EVENTS",
                        "$JS.API.CONSUMER.MSG.NEXT.TOOLBUS_EVENTS.session",
                        "toolbus.live.x.call.succeeded"):
            with pytest.raises(PermissionDeniedError, match="denies the client role"):
                await client.request(subject, b"{}", timeout=5)
        # Nor by aiming an answer at one: a publish acknowledgement or an actor's reply
        # sent to a reply subject of the client's choosing.
        for subject in ("toolbus.req.x", f"toolbus.ctl.state.{sid}"):
            for target in (event_subject(sid, "call.succeeded", "c1", partitions=8),
                           "$KV.toolbus_catalog.built-in.echo"):
                await client.nc.publish(subject, b"digest", reply=target)
        await client.nc.flush()
        await asyncio.sleep(0.5)
        assert run_toolbus("replay", sid, "--nats", urls["client"]).stdout == ""
        listed = run_toolbus("tools", "--nats", urls["client"])
        assert "built-in:echo" in listed.stdout, listed.stderr
        # Requests, live events and reads work: what any NATS client does.
        events = await _raw_call(urls["client"], sid)
        assert [e["type"] for e in events][-1] == "turn.completed"
        assert events[-1]["outcomes"][0]["status"] == "succeeded"
        replay = run_toolbus("replay", sid, "--json", "--nats", urls["client"])
        assert replay.returncode == 0, replay.stderr
        types = [json.loads(line).get("event", {}).get("type") for line in
                 replay.stdout.splitlines()]
        assert "call.succeeded" in types and "approval.granted" not in types
        state = run_toolbus("state", sid, "--nats", urls["client"])
        assert json.loads(state.stdout) == json.loads(replay.stdout.splitlines()[-1])["state"]
        tools = run_toolbus("tools", "--nats", urls["client"])
        assert "approvals:write" in tools.stdout, tools.stderr
    finally:
        await client.close()

    admin = await connect(urls["admin"], name="test-admin")
    try:  # the operator inspects and trims the store, but writes no event
        assert b"TOOLBUS_EVENTS" in await admin.request("$JS.API.STREAM.INFO.TOOLBUS_EVENTS",
                                                        b"", timeout=5)
        for subject in (event_subject(sid, "call.succeeded", partitions=8),
                        "$JS.API.STREAM.UPDATE.TOOLBUS_EVENTS", "$KV.toolbus_catalog.x.y",
                        "$JS.API.STREAM.CREATE.EVIL", "_INBOX.anything"):
            with pytest.raises(PermissionDeniedError, match="denies the admin role"):
                await admin.request(subject, b"{}", timeout=5)
    finally:
        await admin.close()

    await _replies_stay_with_their_role(urls)

    out = run_toolbus("call", "built-in:echo", '{"as": "client"}', "--nats", urls["client"])
    assert out.returncode == 0 and out.stdout == '{"as":"client"}\n', out.stderr

    # A call that needs a human: the client waits, the approver decides.
    asid = f"auth-a-{uuid.uuid4().hex[:8]}"
    waiting = await asyncio.to_thread(
        subprocess.Popen,
        [*_toolbus(), "call", "approvals:write", '{"text": "x"}', "--session", asid,
         "--nats", urls["client"]], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, cwd=REPO)
    try:
        call_id = await pending_approval_call(urls["approver"], asid)
        as_client = run_toolbus("approve", call_id, "--session", asid, "--nats", urls["client"])
        assert as_client.returncode == 3, as_client.stderr
        assert "denies the client role publishing" in as_client.stderr
        approved = run_toolbus("approve", call_id, "--session", asid, "--by", "alice",
                               "--nats", urls["approver"])
        assert approved.returncode == 0, approved.stderr
        out_text, err = waiting.communicate(timeout=30)
        assert waiting.returncode == 0, err
        assert out_text == '{"wrote":"x"}\n'
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.wait()
    replay = run_toolbus("replay", asid, "--json", "--nats", urls["client"])
    granted = [json.loads(line)["event"] for line in replay.stdout.splitlines()
               if json.loads(line).get("event", {}).get("type") == "approval.granted"]
    assert len(granted) == 1
    assert granted[0]["by"] == "alice" and granted[0]["principal"] == "approver"


async def _replies_stay_with_their_role(urls: dict[str, str]) -> None:
    """client and approver share an account: a client reads no reply of the approver's
    (pending approvals and their arguments), on any inbox."""
    denied: list[str] = []

    async def on_error(exc: Exception) -> None:
        denied.append(str(exc))

    sniffer = await nats.connect(urls["client"], error_cb=on_error)
    approver = await connect(urls["approver"], name="test-approver")
    try:
        seen: list[bytes] = []

        async def sniff(msg) -> None:
            seen.append(msg.data)

        for subject in ("_INBOX.>", f"{inbox_prefix('approver')}.>", ">"):
            await sniffer.subscribe(subject, cb=sniff)
        await sniffer.flush()
        assert approver.nc.new_inbox().startswith(f"{inbox_prefix('approver')}.")
        # The approver's read of the pending approvals, answered on its inbox.
        info = await approver.request("$JS.API.DIRECT.GET.KV_toolbus_approvals",
                                      b'{"last_by_subj": "$KV.toolbus_approvals.>"}',
                                      timeout=5)
        assert info is not None
        await asyncio.sleep(0.3)
        assert seen == []
        assert sum("permissions violation for subscription" in d.lower() for d in denied) == 3, \
            denied
    finally:
        await approver.close()
        await sniffer.close()


def _toolbus() -> list[str]:
    import sys
    return [sys.executable, "-m", "services.cli"]


async def _raw_call(url: str, sid: str) -> list[dict]:
    nc = await nats.connect(url, inbox_prefix=inbox_prefix("client"))  # as the README says
    got: list[dict] = []
    done = asyncio.Event()

    async def on_event(msg) -> None:
        got.append(json.loads(msg.data))
        if got[-1]["type"] in ("turn.completed", "turn.failed", "request.rejected"):
            done.set()

    try:
        await nc.subscribe(f"toolbus.live.{sid}.>", cb=on_event)
        await nc.jetstream().publish(f"toolbus.req.{sid}", json.dumps(
            {"calls": [{"tool": "built-in:echo", "arguments": {"raw": 1}}]}).encode())
        async with asyncio.timeout(15):
            await done.wait()
    finally:
        await nc.close()
    return got


async def test_toolbus_up_enforces_the_roles(tmp_path: Path) -> None:
    port = free_port()
    data = tmp_path / "data"
    up = Proc("up", "--port", str(port), "--data-dir", str(data), "--workers", "1",
              "--tools", "tests/toolkit.py", ready="stop:")
    try:
        await up.wait_ready()
        auth = data / "auth"
        assert (auth.stat().st_mode & 0o777) == 0o700
        for f in auth.iterdir():
            assert (f.stat().st_mode & 0o077) == 0, f"{f} is readable by others"
        urls = {r: role_url(data, r) for r in ROLES}
        await _check_roles(f"nats://127.0.0.1:{port}", urls)
        # A command given another role's URL is told which role it takes.
        out = await asyncio.to_thread(run_toolbus, "approve", "c1", "--nats", urls["client"])
        assert out.returncode == 3, out.stderr
        assert "`toolbus approve` takes the approver role (or admin)" in out.stderr
        assert "Traceback" not in out.stderr and "bus/auth.py" not in out.stderr
        # The same URL in NATS_URL, as deploy/nats/README exports the client's.
        out = await asyncio.to_thread(run_toolbus, "approvals", NATS_URL=urls["client"])
        assert out.returncode == 3, out.stderr
        assert "`toolbus approvals` takes the approver role (or admin): leave NATS_URL " \
            "out" in out.stderr
    finally:
        assert up.stop(signal.SIGINT) == 0
    # The credentials are reused at the next start.
    again = Proc("up", "--port", str(port), "--data-dir", str(data), "--workers", "1",
                 ready="stop:")
    try:
        await again.wait_ready()
        assert role_url(data, "client") == urls["client"]
        bus: Bus = await connect(urls["client"], name="again")
        await bus.close()
    finally:
        again.stop(signal.SIGINT)


async def test_deploy_single_conf_enforces_the_same_roles(tmp_path: Path) -> None:
    port = free_port()
    passwords = {r: _password() for r in ROLES}
    env = {**os.environ, **{password_variable(r): p for r, p in passwords.items()}}
    server: subprocess.Popen[bytes] = await asyncio.to_thread(
        subprocess.Popen,
        # Its store is ./toolbus-data/jetstream: here, in the test's folder.
        [nats_server_binary(), "-c", str(DEPLOY / "single.conf"), "-p", str(port)],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    urls = {r: f"nats://{r}:{p}@127.0.0.1:{port}" for r, p in passwords.items()}
    up: Proc | None = None
    try:
        await _listening(port, server)
        up = Proc("up", "--nats", urls["actor"], "--workers", "1", "--tools",
                  "tests/toolkit.py", ready="stop:")
        banner = await up.wait_ready()
        assert passwords["actor"] not in banner
        await _check_roles(f"nats://127.0.0.1:{port}", urls)
    finally:
        if up is not None:
            up.stop(signal.SIGINT)
        server.terminate()
        server.wait(10)
        if server.stderr is not None:
            server.stderr.close()


async def _listening(port: int, server: subprocess.Popen[bytes]) -> None:
    async with asyncio.timeout(15):
        while True:
            assert server.poll() is None, server.stderr.read() if server.stderr else ""
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                await asyncio.sleep(0.05)
                continue
            writer.close()
            return


async def test_no_auth_says_so_loudly(tmp_path: Path) -> None:
    port = free_port()
    up = Proc("up", "--port", str(port), "--data-dir", str(tmp_path), "--workers", "1",
              "--no-auth", ready="stop:")
    try:
        banner = await up.wait_ready()
        assert "auth:   OFF (--no-auth)" in banner
        bus = await connect(f"nats://127.0.0.1:{port}", name="anyone")
        await bus.close()
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(20) == 0
        assert "WARNING: --no-auth" in up.stderr_after_exit()
    finally:
        up.stop(signal.SIGINT)


# --- the read-only roles read everything they may without creating a consumer ---------


@pytest.fixture
async def client_bus(nats_server, bus: Bus):  # `bus` provisions the streams first
    b = await connect(nats_server.url_for("client"), name="test-client-role")
    yield b
    await b.close()


async def test_a_client_reads_a_long_session_and_a_large_result_by_direct_gets(
        bus: Bus, client, client_bus: Bus, sid: str) -> None:
    from bus.artifacts import ArtifactStore
    from bus.eventlog import EventLog

    for _ in range(7):  # past the length at which an actor reads with a consumer
        await client.call(sid, [{"tool": "built-in:echo", "arguments": {"i": i}}
                                for i in range(64)])
    log = EventLog(bus)
    as_actor = await log.read_session(sid)
    as_client = await EventLog(client_bus).read_session(sid)
    assert len(as_client) > 2_100 and as_client == as_actor

    data = b'"' + b"y" * 3_000_000 + b'"'  # 23 chunks
    ref = await ArtifactStore(bus).put(sid, "c-1", 1, data)
    assert await ArtifactStore(client_bus).read(ref) == data


async def test_a_bucket_the_role_may_not_read_is_refused_at_once(client_bus: Bus) -> None:
    # `toolbus approvals` (or approve) with the client's URL, $NATS_URL as set for `toolbus
    # call`, waited 30 s for the direct get NATS had refused, then blamed a timeout.
    from bus.approvals import ApprovalStore

    async with asyncio.timeout(5):
        with pytest.raises(PermissionDeniedError, match="denies the client role"):
            await ApprovalStore(client_bus).load()


@pytest.mark.parametrize("content", ["{garbage", '["x"]'])
def test_a_damaged_secrets_file_is_one_clear_line(tmp_path: Path, content: str) -> None:
    (tmp_path / "auth").mkdir()
    (tmp_path / "auth" / "secrets.json").write_text(content)
    out = run_toolbus("up", "--data-dir", str(tmp_path), "--port", str(free_port()),
                      timeout=30)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "secrets.json is unreadable" in out.stderr and "delete the folder" in out.stderr


def test_a_damaged_role_entry_is_issued_again_and_the_others_kept(tmp_path: Path) -> None:
    from bus.auth import Credentials

    first = Credentials.ensure(tmp_path)
    stored = json.loads((tmp_path / "auth" / "secrets.json").read_text())
    stored["client"] = 7
    (tmp_path / "auth" / "secrets.json").write_text(json.dumps(stored))
    again = Credentials.ensure(tmp_path)
    assert again.roles["actor"] == first.roles["actor"]
    assert again.roles["client"].password != first.roles["client"].password
