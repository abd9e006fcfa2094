"""Property tests for the reducer and the event codec."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.events import (
    EVENT_TYPES,
    ApprovalDenied,
    ApprovalGranted,
    ApprovalRequested,
    CallApproved,
    CallDispatched,
    CallFailed,
    CallOutcome,
    CallRejected,
    CallRequested,
    CallStarted,
    CallSucceeded,
    ErrorInfo,
    Event,
    RequestRejected,
    ResultCompressed,
    ToolEventInjected,
    TurnCancelled,
    TurnCompleted,
    TurnFailed,
    TurnRequested,
    decode_event,
    encode_event,
)
from schemas.state import SessionState, encode_state, evolve, fold

SID = "s1"
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=3),
    max_leaves=8,
)
turn_ids = st.sampled_from(["t1", "t2", "t3"])
call_ids = st.sampled_from(["t1-0", "t1-1", "t2-0", "t3-0"])
times = st.floats(0, 2e9, allow_nan=False)
common = {"session_id": st.just(SID), "at": times, "actor": st.sampled_from(["session", "ex"])}
outcome = st.builds(CallOutcome, call_id=call_ids, tool=st.just("ns:t"),
                    status=st.sampled_from(["succeeded", "failed", "rejected"]),
                    result=json_values,
                    error=st.none() | st.builds(ErrorInfo, error_type=st.text(max_size=5),
                                                message=st.text(max_size=10),
                                                retryable=st.booleans()))

events: st.SearchStrategy[Event] = st.one_of(
    st.builds(TurnRequested, **common, turn_id=turn_ids, request_id=st.text(max_size=5),
              call_ids=st.lists(call_ids, max_size=3)),
    st.builds(CallRequested, **common, call_id=call_ids, turn_id=turn_ids,
              tool=st.just("ns:t"), arguments=json_values,
              reasoning=st.none() | st.text(max_size=10)),
    st.builds(CallRejected, **common, call_id=call_ids, turn_id=turn_ids, tool=st.just("x"),
              reason=st.text(max_size=5), message=st.text(max_size=10),
              rule=st.none() | st.text(max_size=6)),
    st.builds(CallApproved, **common, call_id=call_ids, turn_id=turn_ids, tool=st.just("x"),
              rule=st.sampled_from(["auto:read_only", "auto:auto_approve"]),
              arguments=st.dictionaries(st.text(max_size=4), json_values, max_size=2),
              route=st.just("default.ns"), side_effect=st.booleans(), risk=st.integers(0, 10)),
    st.builds(ApprovalRequested, **common, call_id=call_ids, turn_id=turn_ids,
              tool=st.just("x"), rule=st.just("policy:mutating"), reason=st.text(max_size=8),
              arguments=st.dictionaries(st.text(max_size=4), json_values, max_size=2),
              route=st.just("default.ns"), expires_at=times, side_effect=st.booleans()),
    st.builds(ApprovalGranted, **common, call_id=call_ids, turn_id=turn_ids,
              by=st.text(max_size=5), note=st.none() | st.text(max_size=8)),
    st.builds(ApprovalDenied, **common, call_id=call_ids, turn_id=turn_ids,
              by=st.text(max_size=5), reason=st.text(max_size=8),
              rule=st.sampled_from(["human", "timeout"])),
    st.builds(CallDispatched, **common, call_id=call_ids, turn_id=turn_ids, tool=st.just("x"),
              arguments=st.dictionaries(st.text(max_size=4), json_values, max_size=2),
              route=st.just("default.ns"), timeout_ms=st.none() | st.integers(1, 10**6)),
    st.builds(CallStarted, **common, call_id=call_ids, turn_id=turn_ids,
              executor=st.text(max_size=5), attempt=st.integers(1, 5)),
    st.builds(CallSucceeded, **common, call_id=call_ids, turn_id=turn_ids, result=json_values,
              executor=st.text(max_size=5), duration_ms=st.floats(0, 1e6)),
    st.builds(CallFailed, **common, call_id=call_ids, turn_id=turn_ids,
              error_type=st.text(max_size=5), message=st.text(max_size=10),
              retryable=st.booleans(), executor=st.none() | st.text(max_size=5)),
    st.builds(TurnCompleted, **common, turn_id=turn_ids, request_id=st.text(max_size=5),
              ok=st.booleans(), outcomes=st.lists(outcome, max_size=2)),
    st.builds(TurnFailed, **common, turn_id=turn_ids, request_id=st.text(max_size=5),
              reason=st.text(max_size=5), message=st.text(max_size=10)),
    st.builds(TurnCancelled, **common, turn_id=turn_ids, request_id=st.text(max_size=5),
              reason=st.just("superseded"), message=st.text(max_size=10),
              by=st.none() | st.text(max_size=5)),
    st.builds(ResultCompressed, **common, call_id=call_ids, turn_id=turn_ids,
              tool=st.just("ns:t"), chars=st.integers(0, 10**6), budget=st.integers(1, 900),
              view=st.text(max_size=20),
              key=st.none() | st.sampled_from(["_tool_result_1", "_tool_result_2"]),
              transform=st.none() | st.text(max_size=8),
              transform_error=st.none() | st.text(max_size=8)),
    st.builds(ToolEventInjected, **common, event_id=st.sampled_from(["te-1", "te-2"]),
              tool_id=st.just("crm:note"), arguments=json_values, result=json_values,
              idempotency_key=st.sampled_from(["k1", "k2"]),
              trigger_processing=st.booleans(), turn_id=st.none() | turn_ids),
    st.builds(RequestRejected, **common, reason=st.text(max_size=5),
              message=st.text(max_size=10), request_id=st.none() | st.text(max_size=5)),
)
histories = st.lists(events, max_size=40).map(lambda evs: list(enumerate(evs, start=1)))


@given(events)
def test_every_event_round_trips_through_encode_and_decode(event: Event) -> None:
    assert decode_event(encode_event(event)) == event


def test_every_event_type_is_covered_by_the_strategy() -> None:
    tags = {t.__struct_config__.tag for t in EVENT_TYPES}
    assert len(tags) == len(EVENT_TYPES) == 17


@settings(max_examples=300)
@given(histories, st.integers(0, 40))
def test_replay_rebuilds_the_state_folded_live_in_any_split(history, cut) -> None:
    # Live: an actor folds a prefix, keeps it, and folds the rest as it arrives.
    live = fold(SID, history[:cut])
    for seq, event in history[cut:]:
        evolve(live, event, seq)
    replayed = fold(SID, history)
    assert encode_state(live) == encode_state(replayed)


@settings(max_examples=200)
@given(histories)
def test_replay_of_events_decoded_from_the_wire_equals_the_original(history) -> None:
    wire = [(seq, decode_event(encode_event(ev))) for seq, ev in history]
    assert encode_state(fold(SID, wire)) == encode_state(fold(SID, history))


@settings(max_examples=200)
@given(histories)
def test_redelivered_events_change_nothing(history) -> None:
    state = fold(SID, history)
    before = encode_state(state)
    for seq, event in history:
        evolve(state, event, seq)
    assert encode_state(state) == before


@given(histories)
def test_state_round_trips_through_its_encoding(history) -> None:
    state = fold(SID, history)
    data = encode_state(state)
    assert encode_state(msgspec.json.decode(data, type=SessionState)) == data


def test_a_terminal_call_never_changes_again() -> None:
    s = fold(SID, [
        (1, TurnRequested(session_id=SID, at=1, actor="s", turn_id="t1", request_id="r",
                          call_ids=["t1-0"])),
        (2, CallRequested(session_id=SID, at=1, actor="s", call_id="t1-0", turn_id="t1",
                          tool="ns:t", arguments={})),
        (3, CallSucceeded(session_id=SID, at=2, actor="e", call_id="t1-0", turn_id="t1",
                          result=1, executor="a")),
        (4, CallFailed(session_id=SID, at=3, actor="e", call_id="t1-0", turn_id="t1",
                       error_type="interrupted", message="late")),
    ])
    assert s.calls["t1-0"].status == "succeeded"
    assert s.calls["t1-0"].result == 1


def test_a_path_under_an_earlier_results_path_leaves_that_result_as_it_came() -> None:
    """`_outputPath` `p`, then `p.q`: the second result was written into the first one's
    object, and the first call (what `toolbus state` and `replay` show of it, and what
    the model reads) held a result its tool never returned."""
    first = {"text": "original"}
    events: list[tuple[int, Event | None]] = [
        (1, TurnRequested(session_id=SID, at=1, actor="s", turn_id="t1", request_id="r",
                          call_ids=["t1-0", "t1-1"]))]
    for i, path in enumerate(["p", "p.q"]):
        events.append((2 + i, CallRequested(session_id=SID, at=1, actor="s",
                                            call_id=f"t1-{i}", turn_id="t1", tool="ns:t",
                                            arguments={}, output_path=path)))
    events += [(4, CallSucceeded(session_id=SID, at=2, actor="e", call_id="t1-0",
                                 turn_id="t1", result=first, executor="a")),
               (5, CallSucceeded(session_id=SID, at=2, actor="e", call_id="t1-1",
                                 turn_id="t1", result={"text": "injected"}, executor="a"))]
    s = fold(SID, events)
    assert s.calls["t1-0"].result == {"text": "original"} and first == {"text": "original"}
    assert s.data == {"p": {"text": "original", "q": {"text": "injected"}}}


def test_payloads_written_by_version_0_1_still_decode() -> None:
    # Stored by toolbus 0.1.0: events only grow, so these must keep decoding.
    old = [
        b'{"type":"turn.requested","turn_id":"r1","request_id":"r1","call_ids":["r1-0"],'
        b'"session_id":"demo","at":1795321076.3,"actor":"session"}',
        b'{"type":"call.dispatched","call_id":"r1-0","turn_id":"r1","tool":"built-in:echo",'
        b'"arguments":{"text":"hi"},"route":"default.built-in","timeout_ms":5000,'
        b'"session_id":"demo","at":1795321076.3,"actor":"session"}',
        b'{"type":"call.succeeded","call_id":"r1-0","turn_id":"r1","result":{"text":"hi"},'
        b'"executor":"vm-1","duration_ms":0.26,"session_id":"demo","at":1.0,"actor":"executor"}',
    ]
    decoded = [decode_event(p) for p in old]
    assert isinstance(decoded[2], CallSucceeded) and decoded[2].result == {"text": "hi"}
