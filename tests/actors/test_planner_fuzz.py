"""The planner fuzzed (tests/actors/planner_fuzz.py): a short seeded run per provider.
`FUZZ_SESSIONS`, `FUZZ_SEED`, `FUZZ_PROVIDERS` (comma-separated) and `FUZZ_MODE`
(`composed`) make other runs."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from typing import Any

import pytest

from bus.client import ToolbusClient
from bus.connection import Bus
from tests.actors.planner_fuzz import fuzz, fuzz_planner, logged_errors
from tests.conftest import REPO

PROVIDERS = os.environ.get("FUZZ_PROVIDERS", "openai,anthropic,openai-responses,gemini")
SESSIONS = int(os.environ.get("FUZZ_SESSIONS", "6"))
SEED = int(os.environ.get("FUZZ_SEED", "1"))
MODE = os.environ.get("FUZZ_MODE", "native")  # or composed (seed 001)


@pytest.mark.parametrize("provider", PROVIDERS.split(","))
async def test_hostile_model_output_and_clients_never_break_a_turn(
        bus: Bus, client: ToolbusClient, system: dict[str, Any], provider: str,
        nats_url: str) -> None:
    with logged_errors() as errors:
        async with fuzz_planner(bus, system, provider, SEED, MODE) as model:
            report = await fuzz(bus, client, model, sessions=SESSIONS, seed=SEED,
                                errors=errors)
            if provider == PROVIDERS.split(",")[0]:  # reading the log is the same for all
                # `toolbus replay` asks no model.
                before = len(model.fake.requests)
                out = await asyncio.to_thread(
                    subprocess.run, [sys.executable, "-m", "services.cli", "replay",
                                     report.sessions[0], "--nats", nats_url],
                    capture_output=True, text=True, timeout=60, cwd=REPO)
                assert out.returncode == 0, out.stderr
                assert len(model.fake.requests) == before
    for note in report.notes:
        print(f"{provider}: {note}")
    problems = report.problems()
    assert not problems, "\n".join(problems[:40])
