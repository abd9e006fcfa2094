"""A result shaped like the GitHub MCP server's `list_commits` (seed 003's example of a
31,000-character result): 30 commits, deterministic. Generated in services/sample_data.py,
which the benchmarks use too."""

from __future__ import annotations

from services.sample_data import MESSAGES, list_commits

COMMITS = list_commits()

__all__ = ["COMMITS", "MESSAGES"]
