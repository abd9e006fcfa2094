"""One scripted fake provider server for the LLM tests (tests/llm_servers.py), emptied
before each test, and the catalog the tests offer the model."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from schemas.tools import ToolSpec
from tests.llm_servers import FakeProvider

# Looks like a key of every provider at once, so any redaction path would have to find it.
KEY = "sk-test-AIzaSyD0-not-a-real-key-7f3c9a"

TOOLS = [
    ToolSpec(name="weather:get_forecast", description="The forecast for a city.",
             parameters={"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}),
    ToolSpec(name="clock:now", description="The time now."),
]


@pytest.fixture(scope="session")
async def provider_server() -> AsyncIterator[FakeProvider]:
    async with FakeProvider() as server:
        yield server


@pytest.fixture
def fake(provider_server: FakeProvider) -> FakeProvider:
    provider_server.reset()
    return provider_server
