"""The planner's history cache renders exactly what `transcript` renders without it.

Random sessions: turns that start, end (completed, failed, cancelled) in any order,
overlap, and injected tool events between them, with two agents; after every stored
event, every open turn's transcript is asked for through one shared cache (older turns,
other agents, turns still running before the asking one) and compared with the uncached
rendering.
"""

from __future__ import annotations

import random

import pytest
from msgspec.json import encode

from actors.compressor import Compression
from actors.llm import BUILDERS
from actors.llm.types import Message, ModelSettings
from actors.planner import HistoryCache, message_chars, transcript
from schemas.events import (
    Event,
    ToolEventInjected,
    TurnCancelled,
    TurnCompleted,
    TurnFailed,
    TurnRequested,
)
from schemas.manifest import CompressionConfig
from schemas.state import SessionState, TurnState, evolve

SID = "history-test"


def _events(rng: random.Random, n: int) -> list[Event]:
    out: list[Event] = []
    running: list[str] = []
    turns = 0
    for _ in range(n):
        roll = rng.random()
        if roll < 0.35 or not running:
            turns += 1
            tid = f"t{turns}"
            out.append(TurnRequested(session_id=SID, at=0.0, actor="session", turn_id=tid,
                                     request_id=tid, call_ids=[],
                                     agent=rng.choice(["default", "helper"]),
                                     message=rng.choice([f"question {turns}", ""])))
            running.append(tid)
        elif roll < 0.8:
            tid = running.pop(rng.randrange(len(running)))
            kind = rng.random()
            if kind < 0.7:
                out.append(TurnCompleted(session_id=SID, at=0.0, actor="planner",
                                         turn_id=tid, request_id=tid, ok=True, outcomes=[],
                                         text=rng.choice([f"answer to {tid}", None])))
            elif kind < 0.85:
                out.append(TurnFailed(session_id=SID, at=0.0, actor="planner", turn_id=tid,
                                      request_id=tid, reason="model_error", message="no"))
            else:
                out.append(TurnCancelled(session_id=SID, at=0.0, actor="session",
                                         turn_id=tid, request_id=tid, reason="superseded",
                                         message="a newer event"))
        else:
            k = len(out)
            out.append(ToolEventInjected(session_id=SID, at=0.0, actor="session",
                                         event_id=f"e{k}", tool_id="crm:note",
                                         arguments={"k": k},
                                         result={"note": "x" * rng.choice([10, 3000])},
                                         idempotency_key=f"key{k}"))
    return out


@pytest.mark.parametrize(("seed", "history_chars"),
                         [*((s, None) for s in range(12)), *((s, 4000) for s in range(12))])
def test_the_cached_history_is_the_rendered_history(seed: int,
                                                    history_chars: int | None) -> None:
    """Also under a history budget small enough that older exchanges are left out, again
    and again (the 3000-character injected events overflow it)."""
    rng = random.Random(seed)
    compression = Compression(default=CompressionConfig(budget=400),
                              agents={"helper": CompressionConfig(budget=2000)},
                              history_chars=history_chars)
    cache = HistoryCache(size=4)
    state = SessionState(session_id=SID)
    asked = 0
    for seq, event in enumerate(_events(rng, 120), start=1):
        evolve(state, event, seq * 3)  # sequences with gaps, as other sessions leave
        open_turns = [state.turns[t] for t in state.open_turns]
        rng.shuffle(open_turns)
        for turn in open_turns:
            cached = transcript(state, turn, compression, cache)
            assert cached == transcript(state, turn, compression), (seed, seq, turn.turn_id)
            asked += 1
            if asked % 7 == 0:  # and as each API receives it, with the memo or without
                for provider, build in BUILDERS.items():
                    args = {"system": "sys", "messages": cached, "tools": [],
                            "tool_choice": "auto", "response_schema": None,
                            "stream": False}
                    settings = ModelSettings(provider=provider, model="m")
                    assert encode(build(settings, **args, memo=cache.wire(SID)).body) == \
                        encode(build(settings, **args).body), (seed, seq, provider)
    assert asked > 50


def test_a_long_session_renders_only_what_ended_since() -> None:
    cache = HistoryCache()
    state = SessionState(session_id=SID)
    seq = 0
    for i in range(200):
        seq += 1
        evolve(state, TurnRequested(session_id=SID, at=0.0, actor="session", turn_id=f"t{i}",
                                    request_id=f"t{i}", call_ids=[], message=f"q{i}"), seq)
        turn = state.turns[f"t{i}"]
        first = transcript(state, turn, None, cache)
        assert first == transcript(state, turn)
        seq += 1
        evolve(state, TurnCompleted(session_id=SID, at=0.0, actor="planner", turn_id=f"t{i}",
                                    request_id=f"t{i}", ok=True, outcomes=[], text=f"a{i}"),
               seq)
    kept = cache._entries[SID]
    # Everything before the last turn is kept, as rendered once.
    assert kept.upto == state.turns["t199"].seq and len(kept.window.view()) == 2 * 199
    assert cache.wire(SID) is kept.wire


def _long_session(n: int, cache: HistoryCache | None, compression: Compression,
                  ) -> list[list[Message]]:
    """`n` turns of 100-character questions and answers; what each turn's model reads."""
    state = SessionState(session_id=SID)
    seen: list[list[Message]] = []
    for i in range(n):
        evolve(state, TurnRequested(session_id=SID, at=0.0, actor="session", turn_id=f"t{i}",
                                    request_id=f"t{i}", call_ids=[],
                                    message=f"q{i:04d}".ljust(100, ".")), 2 * i + 1)
        seen.append(transcript(state, state.turns[f"t{i}"], compression, cache))
        evolve(state, TurnCompleted(session_id=SID, at=0.0, actor="planner", turn_id=f"t{i}",
                                    request_id=f"t{i}", ok=True, outcomes=[],
                                    text=f"a{i:04d}".ljust(100, ".")), 2 * i + 2)
    return seen


def test_a_long_history_is_cut_to_its_budget_oldest_first() -> None:
    compression = Compression(history_chars=5000)
    seen = _long_session(300, HistoryCache(), compression)
    starts = []
    for i, messages in enumerate(seen):
        assert messages[-1].text.startswith(f"q{i:04d}")  # the turn's own question
        history = messages[:-1]
        if i <= 25:  # 25 exchanges of 200 characters fit 5,000
            assert [m.text[:5] for m in history[::2]] == [f"q{k:04d}" for k in range(i)]
            continue
        note, *read = history
        assert note.role == "user" and "left out" in note.text
        left_out = int(note.text[1:].split()[0])
        # The most recent exchanges, whole and in order, right up to this turn...
        assert [m.text[:5] for m in read] == \
            [w for k in range(left_out, i) for w in (f"q{k:04d}", f"a{k:04d}")]
        # ... within the budget, and once cut, no less than the refill share of it.
        assert 0.75 * 5000 - 200 < sum(map(message_chars, read)) <= 5000
        starts.append(left_out)
    # The cut moves by a quarter of the budget at a time, not at every turn: what the model
    # reads starts the same way for runs of turns (a provider's prompt cache hits).
    assert len(set(starts)) <= len(starts) // 5
    # Without the cache, the same.
    assert _long_session(300, None, compression) == seen


def test_a_long_history_is_whole_without_a_budget() -> None:
    seen = _long_session(120, HistoryCache(), Compression(history_chars=None))
    assert len(seen[-1]) == 2 * 119 + 1 and seen[-1][0].text.startswith("q0000")


def test_the_cut_history_is_sent_from_the_memo() -> None:
    """After the cut moves, the wire forms of what is read are kept anew: a request is
    built from them (not converted whole), and is byte for byte the one built without."""
    cache = HistoryCache()
    compression = Compression(history_chars=2000)
    seen = _long_session(60, cache, compression)
    memo = cache.wire(SID)
    assert memo is not None and memo._kept and memo._kept[0] is seen[-1][0]
    for provider, build in BUILDERS.items():
        args = {"system": "sys", "messages": seen[-1], "tools": [], "tool_choice": "auto",
                "response_schema": None, "stream": False}
        settings = ModelSettings(provider=provider, model="m")
        assert encode(build(settings, **args, memo=memo).body) == \
            encode(build(settings, **args).body), provider


def _exchanges(sizes: list[int]) -> tuple[SessionState, TurnState]:
    """Ended turns whose questions are `sizes` characters long (answers: 1), then a
    running turn asking."""
    state = SessionState(session_id=SID)
    seq = 0
    for i, size in enumerate(sizes):
        seq += 1
        evolve(state, TurnRequested(session_id=SID, at=0.0, actor="session", turn_id=f"t{i}",
                                    request_id=f"t{i}", call_ids=[], message="q" * size), seq)
        seq += 1
        evolve(state, TurnCompleted(session_id=SID, at=0.0, actor="planner", turn_id=f"t{i}",
                                    request_id=f"t{i}", ok=True, outcomes=[], text="a"), seq)
    evolve(state, TurnRequested(session_id=SID, at=0.0, actor="session", turn_id="now",
                                request_id="now", call_ids=[], message="now"), seq + 1)
    return state, state.turns["now"]


def test_the_last_exchange_stays_while_it_fits_the_budget_alone() -> None:
    """An exchange over the refill share (75%) but within the budget is not cut for being
    large: the model reads at least what was said last. Over the budget alone, it goes."""
    compression = Compression(history_chars=1000)
    state, turn = _exchanges([300, 850])
    read = transcript(state, turn, compression)
    assert read == transcript(state, turn, compression, HistoryCache())
    assert "1 earlier exchange of" in read[0].text
    assert [len(m.text) for m in read[1:]] == [850, 1, 3]
    state, turn = _exchanges([300, 850, 1200])
    read = transcript(state, turn, compression)
    assert read == transcript(state, turn, compression, HistoryCache())
    assert "3 earlier exchanges" in read[0].text and [m.text for m in read[1:]] == ["now"]


def test_ids_repeated_across_a_turns_replies_are_made_unique() -> None:
    """A call id, or a Responses item id (`fc_...`), that an earlier reply of the turn
    gave: the call id is replaced, the item id (optional when sent back) left out."""
    from actors.planner import _with_turn_unique_ids
    from schemas.events import ModelResponded, ModelToolCall

    state, _ = _exchanges([])
    first = ModelToolCall(call_id="k1", id="call_1", name="a:b", arguments={},
                          extra={"id": "fc_1"})
    evolve(state, ModelResponded(session_id=SID, at=0.0, actor="planner", turn_id="now",
                                 iteration=1, text="", tool_calls=[first]), 9)
    again = ModelToolCall(call_id="k2", id="call_1", name="a:b", arguments={},
                          extra={"id": "fc_1", "status": "completed"})
    (fixed,) = _with_turn_unique_ids(state.turns["now"], [again])
    assert fixed.id not in ("call_1", "") and fixed.extra == {"status": "completed"}
    fresh = ModelToolCall(call_id="k3", id="call_9", name="a:b", arguments={},
                          extra={"id": "fc_9"})
    assert _with_turn_unique_ids(state.turns["now"], [fresh]) == [fresh]
