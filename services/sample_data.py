"""Deterministic sample tool results, shared by the benchmarks and the tests (which may
import from here; a benchmark may not import from tests/)."""

from __future__ import annotations

import hashlib
from typing import Any

_API = "https://api.github.com/repos/tylerjrbuell/reactive-agents-ts"
MESSAGES = ["chore: update bun.lock", "feat(examples): unified runner",
            "fix(examples): maxIterations"]


def list_commits(count: int = 30) -> list[dict[str, Any]]:
    """A result shaped like the GitHub MCP server's `list_commits` (seed 003's example of
    a 31,000-character result): `count` commits, the same ones every time."""
    return [_commit(i) for i in range(count)]


def _commit(i: int) -> dict[str, Any]:
    """One item shaped like GitHub's list_commits (trimmed, as MCP servers return it)."""
    sha = hashlib.sha1(f"commit {i}".encode()).hexdigest()
    parent = hashlib.sha1(f"commit {i + 1}".encode()).hexdigest()
    message = MESSAGES[i] if i < 3 else f"fix(core): handle case {i} in the reasoning loop"
    day = f"2026-02-{27 - i // 3:02d}T{10 + i % 12:02d}:00:00Z"
    login = ["tylerjrbuell", "octocat", "dependabot[bot]"][i % 3]
    return {
        "sha": sha,
        "node_id": f"C_kwDOL{sha[:16]}",
        "commit": {
            "author": {"name": login, "email": f"{login}@users.noreply.github.com",
                       "date": day},
            "committer": {"name": "GitHub", "email": "noreply@github.com", "date": day},
            "message": message,
            "comment_count": 0,
            "verification": {"verified": i % 2 == 0,
                             "reason": "valid" if i % 2 == 0 else "unsigned"},
        },
        "url": f"{_API}/commits/{sha}",
        "html_url": f"https://github.com/tylerjrbuell/reactive-agents-ts/commit/{sha}",
        "author": {"login": login, "id": 1000 + i % 3,
                   "avatar_url": f"https://avatars.githubusercontent.com/u/{1000 + i % 3}?v=4",
                   "html_url": f"https://github.com/{login}", "type": "User"},
        "committer": {"login": "web-flow", "id": 19864447, "type": "User"},
        "parents": [{"sha": parent, "url": f"{_API}/commits/{parent}"}],
    }
