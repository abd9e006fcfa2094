"""Where aiohttp, which sends the model calls, behaves unlike httpx did with a hostile or
broken model server (a review of the move to aiohttp). Each test talks to a real socket
speaking raw HTTP/1.1 (`RawServer`)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from actors.llm import Message, ModelClient, ModelSettings, complete
from schemas.errors import ModelError
from tests.actors.llm.test_client import Proxy, proxy
from tests.actors.llm.test_hostile_provider import RawServer, Reply, server

__all__ = ["proxy", "server"]

# A key in no provider's shape (an Azure or self-hosted one): only `redact`'s exact match
# would find it, and not once it is cut.
KEY = "Zq7vT3pL9xK2mN8rB4wY6cH1dF5gJ0sA"


def raw(data: bytes, *, then: bytes = b"", after_s: float = 0.0) -> Reply:
    """`data` as sent, then (`after_s` later) `then`."""
    async def send(w: asyncio.StreamWriter) -> None:
        w.write(data)
        await w.drain()
        if then:
            await asyncio.sleep(after_s)
            w.write(then)
            await w.drain()
        await asyncio.sleep(0.2)
    return send


async def ask(port: int, *, stream: bool = False, timeout_s: float = 5.0) -> Any:
    settings = ModelSettings(provider="openai", model="m", api_key=KEY, max_retries=0,
                             timeout_s=timeout_s, base_url=f"http://127.0.0.1:{port}")

    async def on_delta(text: str) -> None:
        pass

    try:
        return await complete(settings, system=None, messages=[Message(role="user",
                                                                       text="hi")],
                              tools=[], on_delta=on_delta if stream else None)
    except ModelError as exc:
        return exc


def quotes_key(text: str) -> bool:
    """`text` holds a fair part of the key (12 characters of it, anywhere)."""
    return any(KEY[i:i + 12] in text for i in range(len(KEY) - 11))


K = KEY.encode()
A = b"a" * 70  # puts the key across aiohttp's 100-byte clip of what it quotes


@pytest.mark.parametrize("reply", [
    b"HTTP/1.1 2x0 " + K + b"\r\n\r\n",
    b"HTTP/1.1 200 " + A + K + b"a" * 9000 + b"\r\ncontent-length: 2\r\n\r\n{}",
    b"HTTP/1.1 200 OK\r\nx: " + A + K + b"a" * 9000 + b"\r\ncontent-length: 2\r\n\r\n{}",
    b"HTTP/1.1 200 OK\r\n" + K + b" : a\r\ncontent-length: 2\r\n\r\n{}",
    b"HTTP/1.1 200 OK\r\nx: a\x00" + K + b"\r\ncontent-length: 2\r\n\r\n{}",
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked"
    b"\r\n\r\n" + K + b"\r\n",
], ids=["status-line", "long-status-line", "long-header", "header-name", "header-nul",
        "chunk-size"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_reply_aiohttp_cannot_parse_never_quotes_the_key_nor_part_of_it(
        server: tuple[RawServer, int], reply: bytes, stream: bool) -> None:
    # aiohttp's parser errors quote the bytes that broke it, clipped at 100: a server
    # echoing the key there put it, whole or cut (where redact cannot find it), into
    # the error stored in model.failed, and whole into the error it was raised from.
    srv, port = server
    srv.reply = raw(reply)
    got = await ask(port, stream=stream)
    assert isinstance(got, ModelError) and got.kind == "unavailable" and got.retryable, got
    assert "could not be read as HTTP" in got.message, got.message
    assert not quotes_key(got.message), got.message
    cause = got.__cause__
    while cause is not None:
        assert not quotes_key(repr(cause)) and not quotes_key(str(cause)), repr(cause)
        cause = cause.__cause__


CHUNKED = (b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n"
           b"keep-alive: timeout=60\r\n\r\n")
EVENT = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n'


@pytest.mark.parametrize(("stream", "first", "then"), [
    (False, CHUNKED % b"application/json" + b"2\r\n{\"\r\n", b"zz\r\n"),
    (True, CHUNKED % b"text/event-stream" + b"%x\r\n%s\r\n" % (len(EVENT), EVENT),
     b"zz" + K + b"\r\n"),
    (True, CHUNKED % b"text/event-stream" + b"%x\r\n%s\r\n" % (len(EVENT), EVENT),
     b"4\r\nabcdef\r\n"),
], ids=["whole-chunk-size", "streamed-chunk-size", "streamed-chunk-overrun"])
async def test_a_body_aiohttp_refuses_after_the_headers_fails_within_timeout_s(
        server: tuple[RawServer, int], stream: bool, first: bytes, then: bytes) -> None:
    # aiohttp hands such a parser error to the connection, not to the body being read,
    # and stops its sock_read timer: the read waited for the attempt's deadline
    # (10 x timeout_s, ten minutes by default), with the connection long closed. Each
    # read is bounded by timeout_s of the transport's own.
    srv, port = server
    srv.reply = raw(first, then=then, after_s=0.2)
    start = time.monotonic()
    got = await ask(port, stream=stream, timeout_s=0.5)
    assert time.monotonic() - start < 3.0  # 0.2 + 0.5, with room for a loaded machine
    assert isinstance(got, ModelError) and got.retryable, got
    assert got.kind == ("partial_stream" if stream else "unavailable"), got
    assert "the model server sent nothing for 0.5 s (timeout_s)" in got.message, got
    assert not quotes_key(got.message), got.message


async def test_the_proxy_is_looked_up_per_scheme_not_only_per_host(proxy: Proxy) -> None:
    # HTTP_PROXY only: a call to https:// on a host called before over http:// is not
    # sent through it (the lookup was cached by host alone).
    async with ModelClient() as client:
        assert client.proxy("http://model.test/v1")[0] is not None
        assert client.proxy("https://model.test/v1") == (None, None)
    assert proxy.lines == []
