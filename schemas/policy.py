"""The execution policy: which calls run, which wait for a human, which are refused.

`evaluate` is pure and total: given a tool's spec, who asks and the policy, it returns
one decision and the rule that made it, checked in this order:

 1. `deny:<glob>`            the tool matches a denylist glob                    -> reject
 2. `allow:no_match`         an allowlist is set and the tool matches none of it -> reject
 3. `grant:...`              the agent's or the session's grants leave it out     -> reject
 4. `risk:block`             risk score >= `block_at`                            -> reject
 5. `tool:requires_approval` the tool always asks                                -> ask
 6. `risk:approval`          risk score >= `approve_at`                          -> ask
 7. `auto:read_only`         read-only (and the source is trusted)               -> approve
 8. `auto:auto_approve`      the tool's config, or a policy glob, says so        -> approve
 9. `policy:mutating`        anything else changes the world                     -> ask

The risk score (0-10) is the tool's risk level (low 1, medium 4, high 7) plus 2 if
destructive, 1 if not idempotent, 1 if open-world; read-only tools add nothing. Annotations
of an untrusted source are not believed: its tools count as destructive, non-idempotent,
open-world and never read-only, plus 1.

Agent grants fail closed: a call always has an agent (a request that names none is the
policy's `default_agent`), and once the policy grants tools to any agent, an agent it does
not list may call nothing. A policy without agent grants restricts no agent.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import msgspec

from schemas.tools import ToolSpec

DEFAULT_SIDE_EFFECT_PATTERNS: Final = ("create_*", "delete_*", "send_*", "push_*", "update_*")
# Who a request that names no agent is, for the grants.
DEFAULT_AGENT: Final = "default"
_BASE_RISK: Final = {"low": 1, "medium": 4, "high": 7}


@dataclass(frozen=True, slots=True)
class Policy:
    allow: tuple[str, ...] = ()  # empty: everything not denied
    deny: tuple[str, ...] = ()
    auto_approve: tuple[str, ...] = ()  # mutating tools that need no human
    block_at: int | None = None  # risk score that refuses a call (None: never)
    approve_at: int | None = None  # risk score that asks a human (None: never)
    approval_timeout_s: float = 900.0
    agents: dict[str, tuple[str, ...]] = field(default_factory=dict)  # agent -> tool globs
    sessions: dict[str, tuple[str, ...]] = field(default_factory=dict)  # sid glob -> globs
    side_effect_patterns: tuple[str, ...] = DEFAULT_SIDE_EFFECT_PATTERNS
    max_parallel: int = 3  # calls of one turn running at once
    default_agent: str = DEFAULT_AGENT  # the agent of a request that names none


Kind = Literal["approve", "ask", "reject"]


@dataclass(frozen=True, slots=True)
class Decision:
    kind: Kind
    rule: str
    message: str
    risk: int
    side_effect: bool


def matches(name: str, globs: tuple[str, ...]) -> str | None:
    """The first glob `name` matches (`cars:*`, `built-in:file_*`), or None."""
    for glob in globs:
        if fnmatch.fnmatchcase(name, glob):
            return glob
    return None


def believed_read_only(spec: ToolSpec) -> bool:
    return spec.trusted and spec.annotations.readOnlyHint


def risk_score(spec: ToolSpec) -> int:
    score = _BASE_RISK.get(spec.risk_level, 4)
    a = spec.annotations
    if not spec.trusted:
        return min(10, score + 2 + 1 + 1 + 1)
    if a.readOnlyHint:
        return score
    score += 2 if a.destructiveHint else 0
    score += 0 if a.idempotentHint else 1
    score += 1 if a.openWorldHint else 0
    return min(10, score)


def is_side_effect(spec: ToolSpec, patterns: tuple[str, ...] = DEFAULT_SIDE_EFFECT_PATTERNS
                   ) -> bool:
    """Runs alone in its turn. Without annotations, the name decides (`create_*`...)."""
    if not spec.annotated:
        return matches(spec.name.split(":", 1)[1], patterns) is not None
    if not spec.trusted:
        return True
    return not spec.annotations.readOnlyHint


def evaluate(spec: ToolSpec, *, session_id: str, agent: str | None, policy: Policy) -> Decision:
    name = spec.name
    risk = risk_score(spec)
    side_effect = is_side_effect(spec, policy.side_effect_patterns)

    def decide(kind: Kind, rule: str, message: str) -> Decision:
        return Decision(kind, rule, message, risk, side_effect)

    glob = matches(name, policy.deny)
    if glob is not None:
        return decide("reject", f"deny:{glob}", f"{name} is denied by the policy ({glob})")
    if policy.allow and matches(name, policy.allow) is None:
        return decide("reject", "allow:no_match",
                      f"{name} is not in the policy's allowlist ({', '.join(policy.allow)})")
    # None only in calls stored before every request had an agent: the default one.
    agent = agent or policy.default_agent
    if policy.agents:
        grants = policy.agents.get(agent)
        if grants is None:
            why = (" (the policy's default_agent, which requests that name no agent run as)"
                   if agent == policy.default_agent else "")
            return decide("reject", "grant:unknown_agent",
                          f"agent {agent!r}{why} has no tool grants in the policy, so it "
                          f"may call no tool: add policy.agents.{agent}.tools to the manifest")
        if matches(name, grants) is None:
            return decide("reject", f"grant:agent:{agent}",
                          f"agent {agent} is not granted {name} (granted: {', '.join(grants)})")
    for sid_glob, grants in policy.sessions.items():
        if fnmatch.fnmatchcase(session_id, sid_glob):
            if matches(name, grants) is None:
                return decide("reject", f"grant:session:{sid_glob}",
                              f"sessions {sid_glob} are not granted {name} "
                              f"(granted: {', '.join(grants)})")
            break
    if policy.block_at is not None and risk >= policy.block_at:
        return decide("reject", "risk:block",
                      f"{name} scores risk {risk}, at or above the block threshold "
                      f"{policy.block_at}")
    if spec.requires_approval:
        return decide("ask", "tool:requires_approval", f"{name} always asks for approval")
    if policy.approve_at is not None and risk >= policy.approve_at:
        return decide("ask", "risk:approval",
                      f"{name} scores risk {risk}, at or above the approval threshold "
                      f"{policy.approve_at}")
    if believed_read_only(spec):
        return decide("approve", "auto:read_only", f"{name} is read-only")
    if spec.auto_approve:
        return decide("approve", "auto:auto_approve", f"{name} is configured auto_approve")
    glob = matches(name, policy.auto_approve)
    if glob is not None:
        return decide("approve", f"auto:policy:{glob}",
                      f"the policy auto-approves {glob}")
    why = "its source is untrusted, so its read-only claim is not believed" \
        if not spec.trusted and spec.annotations.readOnlyHint else "it is not read-only"
    return decide("ask", "policy:mutating", f"{name} needs approval: {why}")


class PendingApproval(msgspec.Struct, frozen=True, kw_only=True):
    """What `toolbus approvals` shows, from `approval.requested` (kept in
    `toolbus_approvals` until a decision)."""

    session_id: str
    call_id: str
    turn_id: str
    tool: str
    arguments: dict[str, Any]
    rule: str
    reason: str
    risk: int
    requested_at: float
    expires_at: float


class HumanDecision(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The body of a request on `toolbus.approval.<sid>.<call_id>`."""

    decision: Literal["approve", "deny"]
    by: str = "anonymous"
    note: str | None = None  # with approve
    reason: str | None = None  # with deny (required)
