"""The approval actor and the execution policy, against a real server: every policy path
with its decision event and rule, human decisions over NATS and the CLI, timeouts,
duplicate and late decisions, the parallel cap, side-effect ordering, and that nothing
invalid ever reaches an executor."""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import uuid
from typing import Any

import pytest

from bus import approvals
from bus.approvals import ApprovalStore
from bus.client import ToolbusClient
from bus.connection import Bus
from bus.subjects import APPROVALS_BUCKET, approval_subject
from schemas.errors import ManifestError
from schemas.events import Event, TurnCompleted, TurnFailed
from schemas.manifest import parse_manifest
from schemas.policy import PendingApproval, Policy, evaluate, risk_score
from schemas.tools import Annotations, ToolSpec
from tests.conftest import EventWatch, of_type, run_toolbus, settled_state, toolbus_cmd


async def _decision(bus: Bus, client: ToolbusClient, sid: str, tool: str,
                    args: dict[str, Any] | None = None, *, agent: str | None = None,
                    wait_end: bool = True) -> tuple[Event, Any]:
    """Send one call; return the policy's decision event and (if it ends) the outcome."""
    async with EventWatch(bus, sid) as watch:
        before = len(of_type(await watch.until(lambda evs: True), "call.requested"))
        task = asyncio.create_task(client.call(
            sid, [{"tool": tool, "arguments": args or {}}], agent=agent, timeout=20))
        def decided(evs: list[Event]) -> Event | None:
            requested = of_type(evs, "call.requested")
            if len(requested) <= before:
                return None
            call_id = requested[-1].call_id  # this call: the newest of the session
            return next((e for e in evs if type(e).__struct_config__.tag in
                         ("call.approved", "approval.requested", "call.rejected")
                         and e.call_id == call_id), None)

        events = await watch.until(lambda evs: decided(evs) is not None)
    decision = decided(events)
    assert decision is not None
    if not wait_end:
        return decision, task
    end = await task
    assert isinstance(end, TurnCompleted | TurnFailed)
    return decision, end.outcomes[0]


# --- each policy path, through the real actors ----------------------------------------------


async def test_read_only_tools_are_approved_at_once(bus, client, sid) -> None:
    decision, out = await _decision(bus, client, sid, "built-in:echo", {"a": 1})
    assert decision.rule == "auto:read_only" and decision.risk == 1
    assert type(decision).__struct_config__.tag == "call.approved" and out.status == "succeeded"


async def test_a_denylisted_tool_is_rejected_naming_the_glob(bus, client, sid) -> None:
    decision, out = await _decision(bus, client, sid, "testing:forbidden_tool")
    assert decision.rule == "deny:testing:forbidden*" and decision.reason == "policy_denied"
    assert out.status == "rejected" and "denied by the policy" in out.error.message


async def test_mutating_tools_ask_a_human_unless_auto_approved(bus, client, sid) -> None:
    decision, task = await _decision(bus, client, sid, "approvals:write", {"text": "x"},
                                     wait_end=False)
    assert type(decision).__struct_config__.tag == "approval.requested"
    assert decision.rule == "policy:mutating" and "not read-only" in decision.reason
    await bus.request(approval_subject(sid, decision.call_id, "tester"),
                      b'{"decision": "deny", "by": "ada", "reason": "not today"}', timeout=5)
    await task
    auto, out = await _decision(bus, client, sid, "approvals:write_auto", {"text": "y"})
    assert auto.rule == "auto:auto_approve" and out.result == {"wrote": "y"}
    glob, _ = await _decision(bus, client, sid, "testing:create_record",
                              {"label": "x", "seconds": 0})
    assert glob.rule == "auto:policy:testing:*" and glob.side_effect


async def test_a_risk_score_at_the_block_threshold_is_rejected(bus, client, sid) -> None:
    decision, out = await _decision(bus, client, sid, "testing:dangerous")
    assert decision.rule == "risk:block" and out.status == "rejected"
    assert "risk 10" in out.error.message


async def test_agent_and_session_grants_limit_the_tools(bus, client, sid) -> None:
    ok, _ = await _decision(bus, client, sid, "built-in:echo", agent="restricted")
    assert ok.rule == "auto:read_only"
    no, _ = await _decision(bus, client, sid, "testing:probe", {"label": "x"},
                              agent="restricted")
    assert no.rule == "grant:agent:restricted" and "not granted testing:probe" in no.message
    unknown, _ = await _decision(bus, client, sid, "built-in:echo", agent="stranger")
    assert unknown.rule == "grant:unknown_agent"
    granted_sid = f"granted-{uuid.uuid4().hex[:8]}"
    by_session, _ = await _decision(bus, client, granted_sid, "testing:probe", {"label": "x"})
    assert by_session.rule == "grant:session:granted-*"


async def test_a_request_without_an_agent_is_the_default_agent_and_its_events_say_so(
        bus, client, sid, nats_url) -> None:
    decision, out = await _decision(bus, client, sid, "built-in:echo")
    assert decision.rule == "auto:read_only" and out.status == "succeeded"  # default: *
    state = await settled_state(bus, client, sid)
    turn = state.turns[state.calls[decision.call_id].turn_id]
    assert turn.agent == "default" and state.calls[decision.call_id].agent == "default"
    replay = await asyncio.to_thread(run_toolbus, "replay", sid, "--nats", nats_url)
    assert "agent default" in replay.stdout, replay.stderr


def test_the_session_actor_stores_the_agent_it_applies() -> None:
    from actors.session import accept_request
    from schemas.requests import parse_request
    from schemas.state import SessionState

    def agents(body: bytes) -> set[str | None]:
        items = accept_request(SessionState(session_id="s"), parse_request(body), "r",
                               now=1.0, default_agent="anon")
        return {getattr(i.event, "agent", None) for i in items}

    assert agents(b'{"calls": [{"tool": "a:b"}, {"tool": "a:c"}]}') == {"anon"}
    assert agents(b'{"agent": "ops", "calls": [{"tool": "a:b"}]}') == {"ops"}


def test_grants_apply_to_the_default_agent_and_an_unlisted_agent_gets_none() -> None:
    echo, probe = ToolSpec(name="built-in:echo"), ToolSpec(name="testing:probe")
    policy = Policy(agents={"default": ("built-in:*",), "ops": ("*",)})

    def rule(spec: ToolSpec, agent: str | None, p: Policy = policy) -> str:
        return evaluate(spec, session_id="s", agent=agent, policy=p).rule

    assert rule(echo, None) == rule(echo, "default") == "policy:mutating"  # granted
    assert rule(probe, None) == rule(probe, "default") == "grant:agent:default"
    assert rule(probe, "ops") == "policy:mutating"
    stranger = evaluate(probe, session_id="s", agent="stranger", policy=policy)
    assert (stranger.kind, stranger.rule) == ("reject", "grant:unknown_agent")
    assert "policy.agents.stranger.tools" in stranger.message
    # A default agent the grants leave out may call nothing, and is told why.
    renamed = Policy(agents={"ops": ("*",)}, default_agent="anonymous")
    nobody = evaluate(echo, session_id="s", agent=None, policy=renamed)
    assert (nobody.kind, nobody.rule) == ("reject", "grant:unknown_agent")
    assert "'anonymous' (the policy's default_agent" in nobody.message
    # Without agent grants, no agent is restricted.
    assert rule(probe, None, Policy()) == rule(probe, "stranger", Policy()) == "policy:mutating"


def test_the_manifest_names_the_default_agent() -> None:
    manifest = parse_manifest("policy:\n  default_agent: anon\n  agents:\n"
                              "    anon: {tools: ['built-in:*']}\n", env={})
    assert manifest.policy.to_policy().default_agent == "anon"
    assert parse_manifest("", env={}).policy.to_policy().default_agent == "default"
    with pytest.raises(ManifestError) as err:
        parse_manifest("policy: {default_agent: 'a b'}", env={})
    assert "policy.default_agent" in str(err.value)


def test_untrusted_sources_annotations_are_not_believed() -> None:
    claims_read_only = Annotations(readOnlyHint=True, destructiveHint=False)
    trusted = ToolSpec(name="srv:lookup", annotations=claims_read_only)
    untrusted = ToolSpec(name="srv:lookup", annotations=claims_read_only, trusted=False)
    policy = Policy()
    assert evaluate(trusted, session_id="s", agent=None, policy=policy).rule == "auto:read_only"
    d = evaluate(untrusted, session_id="s", agent=None, policy=policy)
    assert d.kind == "ask" and d.rule == "policy:mutating" and d.side_effect
    assert "read-only claim is not believed" in d.message
    assert risk_score(untrusted) > risk_score(trusted)
    ask = evaluate(ToolSpec(name="a:b", risk_level="high", annotations=claims_read_only),
                   session_id="s", agent=None, policy=Policy(approve_at=7))
    assert (ask.kind, ask.rule) == ("ask", "risk:approval")
    always = evaluate(ToolSpec(name="a:b", requires_approval=True,
                               annotations=claims_read_only),
                      session_id="s", agent=None, policy=Policy())
    assert (always.kind, always.rule) == ("ask", "tool:requires_approval")
    allow = evaluate(ToolSpec(name="a:b", annotations=claims_read_only), session_id="s",
                     agent=None, policy=Policy(allow=("cars:*",)))
    assert (allow.kind, allow.rule) == ("reject", "allow:no_match")


# --- human decisions --------------------------------------------------------------------------


async def test_a_raw_nats_approval_lets_the_call_run_and_repeats_are_refused(
        bus, client, nats_url, sid) -> None:
    decision, task = await _decision(bus, client, sid, "approvals:write", {"text": "hello"},
                                     wait_end=False)
    subject = approval_subject(sid, decision.call_id, "tester")
    reply = json.loads(await bus.request(
        subject, b'{"decision": "approve", "by": "ada", "note": "fine"}', timeout=5))
    assert reply == {"ok": True, "decision": "approved"}
    end = await task
    assert end.outcomes[0].result == {"wrote": "hello"}
    again = json.loads(await bus.request(
        subject, b'{"decision": "deny", "by": "bob", "reason": "no"}', timeout=5))
    assert again == {"ok": False, "decision": "approved", "code": "conflict",
                     "error": "already decided: approved by ada"}
    bad = json.loads(await bus.request(subject, b'{"decision": "maybe"}', timeout=5))
    assert bad["ok"] is False and "bad decision" in bad["error"] and bad["code"] == "invalid"
    nothing = json.loads(await bus.request(approval_subject(sid, "nope-0", "tester"),
                                           b'{"decision": "approve"}', timeout=5))
    assert "is not waiting for approval" in nothing["error"]
    assert nothing["code"] == "not_found"
    replay = await asyncio.to_thread(run_toolbus, "replay", sid, "--nats",
                                     nats_url)  # who approved what, when and why
    assert "approved by ada (as tester): fine" in replay.stdout
    assert "needs a human [rule policy:mutating]" in replay.stdout


async def test_a_denied_call_fails_with_the_reason(bus, client, sid) -> None:
    decision, task = await _decision(bus, client, sid, "approvals:write", {"text": "x"},
                                     wait_end=False)
    await bus.request(approval_subject(sid, decision.call_id, "tester"),
                      b'{"decision": "deny", "by": "ada", "reason": "wrong customer"}', timeout=5)
    end = await task
    out = end.outcomes[0]
    assert out.status == "failed" and out.error.error_type == "approval_denied"
    assert "wrong customer" in out.error.message and "ada" in out.error.message


async def test_an_unanswered_approval_times_out_and_a_late_decision_is_refused(
        bus, client, sid) -> None:
    decision, task = await _decision(bus, client, sid, "approvals:write", {"text": "x"},
                                     wait_end=False)
    end = await task  # the test policy's approval timeout is 3 s
    out = end.outcomes[0]
    assert out.error.error_type == "approval_denied" and "timeout" in out.error.message
    late = json.loads(await bus.request(approval_subject(sid, decision.call_id, "tester"),
                                        b'{"decision": "approve", "by": "ada"}', timeout=5))
    assert late["ok"] is False and late["error"].startswith("already decided: denied by toolbus")
    state = await settled_state(bus, client, sid)
    assert state.calls[decision.call_id].decided_by == "toolbus"


async def test_the_cli_approves_from_another_process(bus, client, sid, nats_url) -> None:
    # A right-to-left override shows "cli.txt\u202egnp.exe" as "cli.txtexe.png": the
    # approver must see what would run.
    decision, task = await _decision(bus, client, sid, "approvals:write",
                                     {"text": "cli.txt\u202egnp.exe"},
                                     wait_end=False)
    listed = await asyncio.to_thread(run_toolbus, "approvals", "--nats", nats_url)
    assert decision.call_id in listed.stdout and "approvals:write" in listed.stdout
    # Shown as its escape, as it is sent to the tool: neither acting on the terminal nor
    # dropped (which would show an approver another name than the one written).
    assert "cli.txt\\u202egnp.exe" in listed.stdout and "\u202e" not in listed.stdout
    ok = await asyncio.to_thread(run_toolbus, "approve", decision.call_id, "--session", sid,
                                 "--by", "carol", "--nats", nats_url)
    assert ok.returncode == 0, ok.stderr
    end = await task
    assert end.outcomes[0].result == {"wrote": "cli.txt\u202egnp.exe"}
    state = await settled_state(bus, client, sid)
    assert state.calls[decision.call_id].decided_by == "carol"


async def test_toolbus_call_says_its_call_did_not_run_when_its_turn_is_cancelled(
        bus, client, sid, nats_url) -> None:
    # It exited 1 with nothing but the session id on stderr.
    from schemas.ids import turn_id_for
    async with EventWatch(bus, sid) as watch:
        proc = await asyncio.create_subprocess_exec(
            *toolbus_cmd("call", "approvals:write", '{"text": "x"}', "--session", sid,
                         "--request-id", "rq-cancel", "--nats", nats_url),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        await watch.until(lambda evs: bool(of_type(evs, "approval.requested")), timeout=30)
    await client.cancel(sid, turn_id_for("rq-cancel"), reason="not today")
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 1 and out == b""
    assert b"approvals:write did not run: the turn was cancelled (cancelled)" in err, err
    assert b"not today" in err


async def test_the_approvals_list_shows_the_arguments_a_human_approves_whole(
        bus, client, sid, nats_url) -> None:
    # A prompt-injected model pads what it asks for: the listing cut the arguments at
    # 120 characters with a bare "…", so the approver never saw the end of them.
    text = "routine cleanup of temporary files, nothing else " * 4 + "AND /etc/passwd"
    decision, task = await _decision(bus, client, sid, "approvals:write", {"text": text},
                                     wait_end=False)
    listed = await asyncio.to_thread(run_toolbus, "approvals", "--nats", nats_url)
    assert "AND /etc/passwd" in listed.stdout
    huge = "x" * 9000 + "HIDDEN"
    other, other_task = await _decision(bus, client, f"{sid}-2", "approvals:write",
                                        {"text": huge}, wait_end=False)
    listed = await asyncio.to_thread(run_toolbus, "approvals", "--nats", nats_url)
    line = next(x for x in listed.stdout.splitlines() if "x" * 100 in x)
    assert "HIDDEN" not in line and len(line) < 5000
    assert "more characters not shown: toolbus approvals --json shows them" in line
    for call_id, s in ((decision.call_id, sid), (other.call_id, f"{sid}-2")):
        await bus.request(approval_subject(s, call_id, "tester"),
                          b'{"decision": "deny", "by": "ada", "reason": "padded"}', timeout=5)
    await task
    await other_task


# --- parallel and side-effect rules ---------------------------------------------------------


def _runs() -> list[tuple[str, float, float]]:
    """What the probe and record tools saw, in the module the in-process executor runs."""
    return sys.modules["toolbus_user_tools_toolkit"].RUNS  # type: ignore[no-any-return]


def _overlap(runs: list[tuple[str, float, float]]) -> int:
    points = sorted([(s, 1) for _, s, _ in runs] + [(e, -1) for _, _, e in runs],
                    key=lambda p: (p[0], p[1]))
    return max(itertools.accumulate(d for _, d in points))


async def test_at_most_three_calls_of_a_turn_run_at_once(client, sid) -> None:
    _runs().clear()
    end = await client.call(sid, [{"tool": "testing:probe",
                                   "arguments": {"label": f"p{i}", "seconds": 0.3}}
                                  for i in range(9)], timeout=30)
    assert isinstance(end, TurnCompleted) and end.ok
    assert len(_runs()) == 9
    assert _overlap(_runs()) == 3


async def test_side_effect_calls_run_alone_and_in_order(client, sid) -> None:
    _runs().clear()
    plan = [("probe", "a"), ("probe", "b"), ("create_record", "C"), ("probe", "d"),
            ("probe", "e"), ("create_record", "F"), ("probe", "g")]
    end = await client.call(sid, [{"tool": f"testing:{t}", "arguments": {"label": label,
                                                                          "seconds": 0.2}}
                                  for t, label in plan], timeout=30)
    assert isinstance(end, TurnCompleted) and end.ok
    runs = {label: (start, stop) for label, start, stop in _runs()}
    assert set(runs) == {label for _, label in plan}
    for fx in ("C", "F"):  # nothing overlaps a side-effect call
        s, e = runs[fx]
        for other, (os_, oe) in runs.items():
            if other != fx:
                assert oe <= s or os_ >= e, (fx, other)
    # the barrier: everything requested before a side effect ended before it started,
    # everything after it started after it ended
    assert max(runs["a"][1], runs["b"][1]) <= runs["C"][0]
    assert runs["C"][1] <= min(runs["d"][0], runs["e"][0])
    assert max(runs["d"][1], runs["e"][1]) <= runs["F"][0] and runs["F"][1] <= runs["g"][0]
    assert _overlap([toolkit_run for toolkit_run in _runs()
                     if toolkit_run[0] in ("d", "e")]) == 2  # reads still run together


# --- nothing invalid reaches an executor --------------------------------------------------


async def test_a_flood_of_bad_arguments_never_reaches_an_executor(
        bus: Bus, client: ToolbusClient, system: dict[str, Any]) -> None:
    executor = system["executor"]
    runs_before = executor.runs
    bad = [{"seconds": "soon"}, {}, {"seconds": 1, "extra": True}, {"seconds": None},
           [1, 2], "text"]
    sessions = [f"flood-{uuid.uuid4().hex[:8]}" for _ in range(20)]
    ends = await asyncio.gather(*(
        client.call(s, [{"tool": "testing:sleep", "arguments": args} for args in bad] * 5,
                    timeout=30) for s in sessions))
    assert all(isinstance(e, TurnFailed) and e.reason == "all_calls_rejected" for e in ends)
    assert all(o.error.error_type == "invalid_arguments" for e in ends for o in e.outcomes)
    assert executor.runs == runs_before
    for s in sessions[:5]:
        async with EventWatch(bus, s) as watch:
            events = await watch.until(lambda evs: bool(of_type(evs, "turn.failed")))
        assert not of_type(events, "call.dispatched") and not of_type(events, "call.started")
        assert {r.rule for r in of_type(events, "call.rejected")} == {"schema"}


@pytest.fixture(autouse=True)
def _no_leftover_runs() -> None:
    if "toolbus_user_tools_toolkit" in sys.modules:
        _runs().clear()


def test_the_inline_path_writes_the_same_events_in_one_round_trip() -> None:
    """`toolbus up` runs both actors in one process: the session actor asks the approval
    decision directly and dispatches in the same batch. Same events, same ids."""
    from actors.approval import decide
    from actors.session import accept_request
    from schemas.requests import parse_request
    from schemas.state import SessionState
    from schemas.validation import CompiledTools

    specs = {"built-in:echo": ToolSpec(name="built-in:echo", source="built-in",
                                       annotations=Annotations(readOnlyHint=True)),
             "shop:order": ToolSpec(name="shop:order")}
    tools = CompiledTools(specs.get)
    policy = Policy()
    request = parse_request(b'{"calls": [{"tool": "built-in:echo", "arguments": {"a": 1}},'
                            b' {"tool": "shop:order"}, {"tool": "nope:x"}]}')

    def approver(call):  # what ApprovalActor.decide_inline does
        d = decide(call, tools, policy, now=5.0)
        return None if type(d).__struct_config__.tag == "approval.requested" else d

    items = accept_request(SessionState(session_id="s"), request, "r1", now=5.0,
                           approver=approver)
    got = [(type(i.event).__struct_config__.tag, i.msg_id) for i in items]
    assert got == [("turn.requested", "s:r1:requested"),
                   ("call.requested", "s:r1-0:requested"),
                   ("call.requested", "s:r1-1:requested"),
                   ("call.requested", "s:r1-2:requested"),
                   ("call.approved", "s:r1-0:policy"),   # echo: read-only
                   ("call.rejected", "s:r1-2:policy"),   # unknown tool
                   ("call.dispatched", "s:r1-0:dispatch")]
    # shop:order needs a human: left to the approval actor's consumer, which records it.


# --- the approvals bucket stays the size of what is waiting ---------------------------------


async def _approval_subjects(bus: Bus, prefix: str) -> dict[str, int]:
    info = await bus.js.stream_info(f"KV_{APPROVALS_BUCKET}",
                                    subjects_filter=f"$KV.{APPROVALS_BUCKET}.{prefix}.>")
    return dict(info.state.subjects or {})


async def test_a_decided_approval_leaves_only_a_marker_that_expires(bus, client, sid) -> None:
    # A delete marker per decided approval stayed forever (a soak: 1 message per approval,
    # replayed by every watcher that starts): each leaves a purge marker with a TTL.
    decided = []
    for n in range(3):
        decision, task = await _decision(bus, client, sid, "approvals:write",
                                         {"text": str(n)}, wait_end=False)
        await bus.request(approval_subject(sid, decision.call_id, "tester"),
                          b'{"decision": "approve", "by": "ada"}', timeout=5)
        await task
        decided.append(decision.call_id)
    assert set(await _approval_subjects(bus, sid)) == {
        f"$KV.{APPROVALS_BUCKET}.{sid}.{c}" for c in decided}
    for call_id in decided:
        marker = await bus.js.get_last_msg(f"KV_{APPROVALS_BUCKET}",
                                           f"$KV.{APPROVALS_BUCKET}.{sid}.{call_id}")
        assert marker.headers is not None and marker.headers["KV-Operation"] == "PURGE"
        assert marker.headers["Nats-TTL"] == str(int(approvals.MARKER_TTL_S))


async def test_approval_markers_leave_the_bucket_empty_once_their_ttl_passed(
        bus, monkeypatch) -> None:
    monkeypatch.setattr(approvals, "MARKER_TTL_S", 1.0)
    store = ApprovalStore(bus)
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    for n in range(20):
        await store.put(PendingApproval(session_id=prefix, call_id=f"c{n}", turn_id="t",
                                        tool="approvals:write", arguments={}, rule="r",
                                        reason="r", risk=5, requested_at=0.0,
                                        expires_at=1e12))
        await store.delete(prefix, f"c{n}")
    assert len(await _approval_subjects(bus, prefix)) == 20
    async with asyncio.timeout(15):  # the server expires them (1 s, checked every second)
        while True:  # nothing to wait on: the server removes them without a word
            if not await _approval_subjects(bus, prefix):
                break
            await asyncio.sleep(0.2)
    await store.start()
    try:
        assert not [p for p in store.pending() if p.session_id == prefix]
    finally:
        await store.stop()
