"""OpenTelemetry metrics of the actors, through the OTel API only.

`services/metrics.py` installs an SDK meter provider (`install`) when a process is asked
for metrics; until then every recording function returns after one test of a module
global, so a process without metrics pays nothing more.

- `toolbus.calls` (counter, `{call}`): `gen_ai.tool.name`, `toolbus.outcome`
  (succeeded, failed, rejected);
- `toolbus.call.duration` (histogram, s): `gen_ai.tool.name`;
- `toolbus.turn.duration` (histogram, s): `toolbus.turn.status` (completed, failed,
  cancelled);
- `toolbus.consumer.lag` (gauge, `{message}`): `toolbus.actor`,
  `messaging.consumer.group.name`, and `toolbus.pool` for executors;
- `toolbus.redeliveries` (counter, `{message}`): `toolbus.actor`,
  `messaging.consumer.group.name` (and `toolbus.pool`);
- `toolbus.rejections` (counter, `{message}`): `toolbus.actor`, `toolbus.reason`: every
  stored `request.rejected` and `call.rejected` (counted where the stream stored it, as
  calls are), and each poison message the kernel stored as another fact (a call's
  `call.failed` `internal`);
- `toolbus.approvals.waiting` (gauge, `{call}`);
- `toolbus.sessions.active` (gauge, `{session}`): `toolbus.actor` (the session actor).

Where each count is taken, so that it is exact across any number of processes:

- **Calls** are counted from a turn's end (`turn.completed` / `turn.failed` /
  `turn.cancelled`), by the process whose append of it the stream stored first: the end
  of a turn has one message id (`turn_ended_id`), so of all the writers that may race on
  it (session-actor partitions handing over, the planner, a kernel rejection) exactly one
  gets an acknowledgement that is not a duplicate. Its `outcomes` list every call of the
  turn, however it ended: run by an executor, rejected by the policy, denied by a human,
  failed by the janitor. Counting where a call ends would need every one of those
  writers to count; counting where events are folded would count again whenever a
  session is re-read (a partition handover, a cold cache).
- **Call and turn durations** are taken with the call counts, from the writer's state of
  the session: a call's from its latest `call.started` to its outcome (both stamped by the
  executor that ran it; calls that never started, such as rejections, have none), a
  turn's from its request to its end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Final

from schemas.events import (
    CallRejected,
    RequestRejected,
    TurnCancelled,
    TurnCompleted,
    TurnFailed,
)
from schemas.state import SessionState

if TYPE_CHECKING:
    from opentelemetry.metrics import CallbackOptions, Meter, MeterProvider, Observation

__all__ = [
    "DURATION_BUCKETS_S",
    "LAG_POLL_S",
    "Source",
    "enabled",
    "install",
    "redelivered",
    "rejected",
    "turn_ended",
    "watch",
]

SCOPE: Final = "toolbus"
LAG_POLL_S: Final = 5.0  # consumer info is polled, never read per message
# Seconds: tools range from sub-millisecond built-ins to minutes-long processes.
DURATION_BUCKETS_S: Final = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                             0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                             300.0)
# A rejected call may name any tool a client made up: one label value per distinct name
# would let a client grow the metrics without bound.
UNKNOWN_TOOL: Final = "_unknown"
_UNKNOWN_REASONS: Final = frozenset({"unknown_tool", "invalid_tool_name", "tool_not_offered"})
_MAX_ATTRIBUTE_SETS: Final = 4096

TOOL: Final = "gen_ai.tool.name"
OUTCOME: Final = "toolbus.outcome"
ACTOR: Final = "toolbus.actor"
CONSUMER: Final = "messaging.consumer.group.name"
POOL: Final = "toolbus.pool"
REASON: Final = "toolbus.reason"
TURN_STATUS: Final = "toolbus.turn.status"

Attributes = Mapping[str, str]
Source = Callable[[], Iterable[tuple[Attributes, float]]]
"""What an observable gauge reads at collection time: (attributes, value) pairs."""

_TURN_STATUS: Final[dict[type, dict[str, str]]] = {
    TurnCompleted: {TURN_STATUS: "completed"},
    TurnFailed: {TURN_STATUS: "failed"},
    TurnCancelled: {TURN_STATUS: "cancelled"},
}
TURN_ENDS: Final = frozenset(_TURN_STATUS)
REJECTIONS: Final = frozenset({RequestRejected, CallRejected})


class _Instruments:
    def __init__(self, meter: Meter) -> None:
        self.calls = meter.create_counter(
            "toolbus.calls", unit="{call}",
            description="Calls ended, by tool and outcome (counted once, when their turn "
                        "ends)")
        self.call_duration = meter.create_histogram(
            "toolbus.call.duration", unit="s",
            description="Time from a call's latest start to its outcome, by tool",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS_S)
        self.turn_duration = meter.create_histogram(
            "toolbus.turn.duration", unit="s",
            description="Time from a turn's request to its end, by how it ended",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS_S)
        self.redeliveries = meter.create_counter(
            "toolbus.redeliveries", unit="{message}",
            description="Messages delivered again to an actor (not acknowledged in time)")
        self.rejections = meter.create_counter(
            "toolbus.rejections", unit="{message}",
            description="Requests and calls rejected (request.rejected, call.rejected, and "
                        "poison messages), by actor and reason")
        meter.create_observable_gauge(
            "toolbus.consumer.lag", callbacks=[_observer("lag")], unit="{message}",
            description=f"Messages a durable consumer has not delivered yet (num_pending, "
                        f"polled every {LAG_POLL_S:g} s)")
        meter.create_observable_gauge(
            "toolbus.approvals.waiting", callbacks=[_observer("approvals")], unit="{call}",
            description="Calls waiting for a human decision")
        meter.create_observable_gauge(
            "toolbus.sessions.active", callbacks=[_observer("sessions")], unit="{session}",
            description="Sessions with a turn running, in this process's memory")


_on: _Instruments | None = None
_sources: dict[str, list[Source]] = {"lag": [], "approvals": [], "sessions": []}
_call_attrs: dict[tuple[str, str], dict[str, str]] = {}
_tool_attrs: dict[str, dict[str, str]] = {}
_reject_attrs: dict[tuple[str, str], dict[str, str]] = {}


def install(provider: MeterProvider | None) -> None:
    """Record into `provider` from now on; None turns recording off."""
    global _on
    _on = None if provider is None else _Instruments(provider.get_meter(SCOPE))


def enabled() -> bool:
    return _on is not None


def watch(kind: str, source: Source) -> Callable[[], None]:
    """Read `source` for the gauge `kind` (lag, approvals, sessions) at each collection;
    returns the function that stops it."""
    sources = _sources[kind]
    sources.append(source)
    return lambda: sources.remove(source) if source in sources else None


def _observer(kind: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
    def observe(options: CallbackOptions) -> Iterable[Observation]:
        from opentelemetry.metrics import Observation

        out: list[Observation] = []
        for source in list(_sources[kind]):
            out.extend(Observation(value, dict(attrs)) for attrs, value in source())
        return out

    return observe


def _cached(cache: dict[tuple[str, str], dict[str, str]], key: tuple[str, str],
            names: tuple[str, str]) -> dict[str, str]:
    attrs = cache.get(key)
    if attrs is None:
        if len(cache) >= _MAX_ATTRIBUTE_SETS:
            cache.clear()
        attrs = cache[key] = {names[0]: key[0], names[1]: key[1]}
    return attrs


def turn_ended(event: TurnCompleted | TurnFailed | TurnCancelled,
               state: SessionState | None) -> None:
    """A turn's end was stored by this process (not a duplicate): count its calls, and
    time them and the turn from `state`, the writer's state of the session."""
    on = _on
    if on is None:
        return
    calls = state.calls if state is not None else {}
    for outcome in event.outcomes:
        tool = outcome.tool
        if outcome.status == "rejected" and outcome.error is not None and \
                outcome.error.error_type in _UNKNOWN_REASONS:
            tool = UNKNOWN_TOOL
        on.calls.add(1, _cached(_call_attrs, (tool, outcome.status), (TOOL, OUTCOME)))
        call = calls.get(outcome.call_id)
        if call is not None and call.started_at is not None and call.finished_at is not None:
            # Both stamped by the executor's clock: `call.started` just before the tool
            # ran, the outcome just after.
            attrs = _tool_attrs.get(tool)
            if attrs is None:
                if len(_tool_attrs) >= _MAX_ATTRIBUTE_SETS:
                    _tool_attrs.clear()
                attrs = _tool_attrs[tool] = {TOOL: tool}
            on.call_duration.record(max(call.finished_at - call.started_at, 0.0), attrs)
    turn = state.turns.get(event.turn_id) if state is not None else None
    if turn is not None and turn.requested_at:
        on.turn_duration.record(max(event.at - turn.requested_at, 0.0),
                                _TURN_STATUS[type(event)])


def redelivered(attrs: Attributes) -> None:
    on = _on
    if on is not None:
        on.redeliveries.add(1, attrs)


def rejected(actor: str, reason: str) -> None:
    on = _on
    if on is not None:
        on.rejections.add(1, _cached(_reject_attrs, (actor, reason), (ACTOR, REASON)))
