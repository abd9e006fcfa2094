"""The model calls' HTTP client (actors/llm/transport.py `ModelClient`, aiohttp): set up to
behave as httpx did, because aiohttp's defaults differ where it matters for a key-bearing
request. Each test talks to a real local server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from actors.llm import Message, ModelClient, ModelSettings, complete
from schemas.errors import ModelError
from tests.actors.llm.conftest import KEY, TOOLS
from tests.actors.llm.test_retry import settings
from tests.llm_servers import FakeProvider, chat_body, reply

ASK = [Message(role="user", text="Weather?")]
PROXY_VARS = ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY",
              "all_proxy", "NO_PROXY", "no_proxy")


async def test_cookies_a_model_server_sets_are_not_sent_back(fake: FakeProvider) -> None:
    # aiohttp keeps cookies by default: a server (or whoever answers in its place) could
    # then tag every later call of every session the planner makes.
    fake.script(reply("openai", "one", headers={"set-cookie": "tag=abc; Path=/"}),
                reply("openai", "two"))
    # By name: aiohttp's jar takes no cookie from an IP address.
    s = settings(fake, "openai")
    s = msgspec.structs.replace(s, base_url=(s.base_url or "").replace("127.0.0.1",
                                                                        "localhost"))
    async with ModelClient() as client:
        for _ in range(2):
            await complete(s, system=None, messages=ASK, tools=TOOLS, client=client)
    assert [r.headers.get("cookie") for r in fake.requests] == [None, None]


async def test_netrc_credentials_never_replace_the_api_key(
        fake: FakeProvider, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # With trust_env, aiohttp reads ~/.netrc on every request and puts what it finds for
    # the host in the Authorization header: the key would be swapped for someone's login.
    netrc = tmp_path / "netrc"
    netrc.write_text("machine 127.0.0.1 login someone password their-password\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    fake.script(reply("openai", "Sunny."))
    await complete(settings(fake, "openai"), system=None, messages=ASK, tools=TOOLS)
    assert fake.requests[0].headers["authorization"] == f"Bearer {KEY}"


class Proxy:
    """An HTTP proxy that answers every request itself, with a Chat Completions reply,
    recording the request line (absolute-form: the URL the client asked the proxy for)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.port = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                     ) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        self.lines.append(head.split(b"\r\n", 1)[0].decode())
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        await reader.readexactly(length)
        body = json.dumps(chat_body("via the proxy")).encode()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()


@pytest.fixture
async def proxy(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Proxy]:
    for name in PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
    found = Proxy()
    server = await asyncio.start_server(found._serve, "127.0.0.1", 0)
    found.port = server.sockets[0].getsockname()[1]
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{found.port}")
    async with server:
        yield found


async def test_the_proxy_the_environment_names_carries_the_call(proxy: Proxy) -> None:
    # As httpx did: HTTP(S)_PROXY is honoured (a host only the proxy can reach).
    s = ModelSettings(provider="openai", model="m-test", api_key=KEY,
                      base_url="http://model.test/v1")
    answer = await complete(s, system=None, messages=ASK, tools=TOOLS)
    assert answer.text == "via the proxy"
    assert proxy.lines == ["POST http://model.test/v1/chat/completions HTTP/1.1"]


async def test_no_proxy_sends_the_call_direct(proxy: Proxy, fake: FakeProvider,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    fake.script(reply("openai", "direct"))
    answer = await complete(settings(fake, "openai"), system=None, messages=ASK, tools=TOOLS)
    assert answer.text == "direct" and proxy.lines == [] and len(fake.requests) == 1


@pytest.mark.parametrize("url", ["ftp://model.test/v1", "http://[::1/v1"])
async def test_a_url_the_client_cannot_use_fails_at_once_naming_base_url(url: str) -> None:
    s = ModelSettings(provider="openai", model="m-test", api_key=KEY, base_url=url,
                      max_retries=3)
    with pytest.raises(ModelError) as caught:
        await complete(s, system=None, messages=ASK, tools=TOOLS)
    err = caught.value
    assert (err.kind, err.retryable, err.attempts) == ("bad_request", False, 1)
    assert "base_url" in err.message and KEY not in str(err)
