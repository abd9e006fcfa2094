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
from actors.llm.types import ModelSettings
from actors.planner import HistoryCache, transcript
from schemas.events import (
    Event,
    ToolEventInjected,
    TurnCancelled,
    TurnCompleted,
    TurnFailed,
    TurnRequested,
)
from schemas.manifest import CompressionConfig
from schemas.state import SessionState, evolve

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


@pytest.mark.parametrize("seed", range(12))
def test_the_cached_history_is_the_rendered_history(seed: int) -> None:
    rng = random.Random(seed)
    compression = Compression(default=CompressionConfig(budget=400),
                              agents={"helper": CompressionConfig(budget=2000)})
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
    assert kept.upto == state.turns["t199"].seq and len(kept.messages) == 2 * 199
    assert cache.wire(SID) is kept.wire
