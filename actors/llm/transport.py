"""One attempt of a model call: POST the body, map an error status, then read either one
JSON body or a stream of server-sent events, handing each text delta to `on_delta` as it
arrives.

The HTTP client is aiohttp (`ModelClient`), not httpx as everywhere else in toolbus: a
model call is on the planner's hot path, and httpx spends about 0.65 ms of CPU on one
streamed POST to a local server where aiohttp spends 0.18 (its parser is C). It is set up
to behave as httpx did: redirects not followed (the key would go wherever they point),
no cookies kept, the proxy from HTTP(S)_PROXY/NO_PROXY, certificates as httpx finds them.

Failure mapping (every one a `ModelError`, see retry.py for which are retried): an error
status by its code; a connection error, a timeout or a body that is not JSON as
`unavailable`; a stream that ends before its last event, or an error event inside it, as
what it says, except that once a delta has been delivered any of these is
`partial_stream` (retryable, but never retried here).
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final, Protocol

import aiohttp
import httpx
import msgspec
from aiohttp.helpers import BasicAuth, get_env_proxy_for_url
from yarl import URL

from actors.llm.convert import count, stable_id
from actors.llm.retry import clip, http_error, redact
from actors.llm.types import ModelResponse
from schemas.defaults import MAX_JSON_DEPTH
from schemas.errors import ModelError
from schemas.requests import INVISIBLE, json_depth, json_values

ERROR_BODY_LIMIT: Final = 64 * 1024  # bytes of an error body read before giving up on it
# What a provider may send in one reply, body or stream, before it is refused: a broken or
# hostile server must not fill memory, nor keep a turn waiting forever.
MAX_REPLY_BYTES: Final = 16 * 1024 * 1024
MAX_CALLS_PER_REPLY: Final = 128
MAX_CALL_ID_CHARS: Final = 512  # a tool call's id, and its name
# A call id every API takes back (Anthropic's `tool_use.id` pattern is the narrowest).
_CALL_ID: Final = re.compile(r"[a-zA-Z0-9_-]+")
# Levels of JSON in a reply as stored (its calls' arguments at most MAX_JSON_DEPTH of them):
# deeper, the event might not be read back.
MAX_REPLY_DEPTH: Final = 2 * MAX_JSON_DEPTH
# An attempt ends after this many times `timeout_s` in all (`timeout_s` bounds each read).
ATTEMPT_DEADLINE_FACTOR: Final = 10

OnDelta = Callable[[str], Awaitable[None]]

_MAX_CONNECTIONS = 100  # per client, as httpx's default


class SSEError(ValueError):
    """A streamed reply that is not an event stream."""


class ModelClient:
    """The HTTP client model calls share: one aiohttp session and its connection pool.
    Make it inside the event loop that uses it; `aclose` it when done."""

    def __init__(self) -> None:
        # httpx's context: certifi, or SSL_CERT_FILE / SSL_CERT_DIR when set.
        connector = aiohttp.TCPConnector(limit=_MAX_CONNECTIONS,
                                         ssl=httpx.create_ssl_context())
        # No trust_env: aiohttp would then read ~/.netrc on every request (in a thread) and
        # put what it finds for the host over the API key. The proxy is looked up here.
        self.session = aiohttp.ClientSession(connector=connector,
                                             cookie_jar=aiohttp.DummyCookieJar(),
                                             timeout=aiohttp.ClientTimeout(total=None))
        self._proxies: dict[str, tuple[URL | None, BasicAuth | None]] = {}

    def proxy(self, url: str) -> tuple[URL | None, BasicAuth | None]:
        """The proxy the environment names for `url` (and its credentials), or none."""
        # By scheme and host: HTTP_PROXY and HTTPS_PROXY may differ for the same host.
        scheme, _, rest = url.partition("://")
        origin = f"{scheme.lower()}://{rest.partition('/')[0]}"
        found = self._proxies.get(origin)
        if found is None:
            try:
                found = get_env_proxy_for_url(URL(url))
            except LookupError:
                found = (None, None)
            if len(self._proxies) < 64:
                self._proxies[origin] = found
        return found

    async def aclose(self) -> None:
        await self.session.close()

    async def __aenter__(self) -> ModelClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


_DRAIN_EVENTS = 16  # events read past a stream's last one before giving up on reuse
_DRAIN_S = 1.0  # and how long they may take: the reply is whole, whatever comes after it
_LINE_BREAK = re.compile(r"\r\n|\r|\n")


class StreamDecoder(Protocol):
    """Assembles one API's event stream into a reply. `feed` returns the text delta the
    event carries ("" if none) and raises `ModelError` for an error event; `ended` is set by
    the API's last event (read no further); `complete` once the reply is whole;
    `open_ended` for an API whose stream has no last event (it ends with the body)."""

    ended: bool
    complete: bool
    open_ended: bool

    def feed(self, event: str, data: str) -> str: ...

    def result(self) -> ModelResponse: ...


@dataclass(frozen=True)
class WireRequest:
    """What one API module built: where to POST what, and how to read the answer."""

    provider: str
    url: str
    headers: dict[str, str]
    body: dict[str, Any]
    parse: Callable[[Any], ModelResponse]
    stream: Callable[[], StreamDecoder] | None = None


def decode_json(data: bytes | str, provider: str) -> Any:
    try:
        return msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as exc:
        what = "nested too deeply" if isinstance(exc, RecursionError) else \
            "not UTF-8" if isinstance(exc, UnicodeDecodeError) else clip(str(exc), 200)
        raise ModelError("unavailable", f"the reply is not JSON ({what})", provider=provider,
                         retryable=True) from None


class _Stalled(aiohttp.SocketTimeoutError):
    """A read of the body that waited `timeout_s` for nothing."""


async def _chunks(response: aiohttp.ClientResponse, timeout_s: float
                  ) -> AsyncIterator[bytes]:
    """The body as it comes, each read bounded by `timeout_s` here too. aiohttp's own
    bound (sock_read) is not enough: a body its parser refuses after the headers (an
    invalid chunk size, a chunk longer than it said) fails the connection but not the
    body, and stops that timer, so the read waited for the attempt's deadline (10 x
    timeout_s, ten minutes by default) on a connection long closed."""
    content = response.content
    while True:
        try:
            async with asyncio.timeout(timeout_s):
                chunk = await content.readany()
        except TimeoutError:
            raise _Stalled() from None
        if not chunk:
            return
        yield chunk


async def _read_bounded(response: aiohttp.ClientResponse, provider: str,
                        timeout_s: float) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in _chunks(response, timeout_s):
        size += len(chunk)
        if size > MAX_REPLY_BYTES:
            raise _too_large(provider)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(provider: str) -> ModelError:
    return ModelError("unavailable", f"the reply is over {MAX_REPLY_BYTES} bytes",
                      provider=provider)


def checked(reply: ModelResponse) -> ModelResponse:
    """`reply` as it may be stored: every field of its declared type (a provider's JSON
    can put a number where text belongs, and an event that cannot be read back breaks
    replay), within the bounds above. Raises `ValueError` or `msgspec.ValidationError`."""
    data = msgspec.to_builtins(reply)
    if json_depth(data, MAX_REPLY_DEPTH) > MAX_REPLY_DEPTH:
        raise ValueError(f"the reply nests deeper than {MAX_REPLY_DEPTH} levels")
    # Token counts only feed the turn's budget: a count that is not one is taken as none.
    data["usage"] = {k: count(v) for k, v in (data.get("usage") or {}).items()}
    reply = msgspec.convert(data, ModelResponse)
    if len(reply.tool_calls) > MAX_CALLS_PER_REPLY:
        raise ValueError(f"{len(reply.tool_calls)} tool calls in one reply, over "
                         f"{MAX_CALLS_PER_REPLY}")
    for call in reply.tool_calls:
        if len(call.id) > MAX_CALL_ID_CHARS or len(call.name) > MAX_CALL_ID_CHARS:
            raise ValueError(f"a tool call id or name over {MAX_CALL_ID_CHARS} characters")
    return _with_unique_ids(reply)


def _with_unique_ids(reply: ModelResponse) -> ModelResponse:
    """`reply` with an id of its own for each call: a call with no id, with the id of a
    call before it in the reply, or with one some API refuses (a space, a control or a
    bidi character), gets a deterministic new one. The ids go back to the provider with
    the results, and every API refuses a conversation whose results do not answer its
    calls one to one (a server that repeats ids would end the next request in a 400 that
    names nothing the user did)."""
    seen: set[str] = set()
    items: set[str] = set()  # the Responses API's item ids (`fc_...`), sent back too
    calls = list(reply.tool_calls)
    changed = False
    for i, call in enumerate(calls):
        call_id = call.id
        n = 0
        while call_id in seen or not _CALL_ID.fullmatch(call_id):
            call_id = stable_id("call", reply.response_id, i, n, call.name, call.id)
            n += 1
        seen.add(call_id)
        item = call.extra.get("id")
        extra = call.extra
        if isinstance(item, str):
            if item in items:  # optional when sent back: a repeated one is left out
                extra = {k: v for k, v in extra.items() if k != "id"}
            items.add(item)
        if call_id != call.id or extra is not call.extra:
            calls[i] = msgspec.structs.replace(call, id=call_id, extra=extra)
            changed = True
    return msgspec.structs.replace(reply, tool_calls=calls) if changed else reply


# A key shorter than this is a placeholder a local server ignores ("ollama", "EMPTY",
# "sk-no-key-required"), not a secret: a reply saying the word is not refused for it.
# Real keys are far longer (OpenAI's and Anthropic's 50 and more, Gemini's 39).
MIN_GUARDED_KEY_CHARS: Final = 20


def _is_json(response: aiohttp.ClientResponse) -> bool:
    media = str(response.headers.get("content-type", "")).partition(";")[0].strip().lower()
    return media == "application/json"


def _guarded(key: str | None) -> str:
    return key if key and len(key) >= MIN_GUARDED_KEY_CHARS else ""


def _quotes_key(provider: str) -> ModelError:
    return ModelError("unavailable", "the reply quotes the API key; it is refused, so that "
                      "the key is never shown or stored", provider=provider, retryable=True)


def _refuse_quoted_key(reply: ModelResponse, key: str | None, provider: str) -> None:
    """A reply quoting the key (text, a call's arguments, anything stored of it) is refused:
    whatever the provider sends is stored in an event, and events never hold a secret."""
    key = _guarded(key)
    if key and any(key in INVISIBLE.sub("", text)
                   for text in _strings(msgspec.to_builtins(reply))):
        raise _quotes_key(provider)


def _refuse_empty(reply: ModelResponse, provider: str) -> None:
    """A reply with neither text nor a call that did not simply stop (with a reason given)
    is no answer, and an empty answer would tell the user nothing. Cut short by the
    provider's content filter (Gemini's blocked prompt, Anthropic's refusal) or by the
    token limit, the same request would end the same way; for any other reason, or none
    (Gemini's MALFORMED_FUNCTION_CALL), another attempt may well answer."""
    raw = reply.extra.get("block_reason") or reply.extra.get("stop_reason")
    if reply.text or reply.tool_calls or (
            raw is not None and reply.finish_reason in ("stop", "tool_calls")):
        return
    if raw is None:  # no reason given at all (a stream of only its usage, then [DONE])
        raise ModelError("unavailable", "the reply is empty, with no finish reason",
                         provider=provider, retryable=True)
    why = clip(str(raw or reply.finish_reason), 60)
    if reply.finish_reason == "length":
        what = (f"the model reached its token limit ({why}) before any text or call: "
                "raise the model's max_tokens")
    elif reply.finish_reason == "content_filter":
        what = f"the provider's content filter stopped it ({why})"
    else:
        raise ModelError("unavailable", f"the reply is empty (finish reason {why})",
                         provider=provider, retryable=True)
    raise ModelError("bad_request", f"the reply is empty: {what}", provider=provider)


def _refuse_cut_calls(reply: ModelResponse, provider: str) -> None:
    """Tool calls in a reply the token limit cut short are not run: the last one's
    arguments may be a prefix (and some APIs hand a prefix over as a whole object), and
    the same request would be cut the same way."""
    if reply.tool_calls and reply.finish_reason == "length":
        why = clip(str(reply.extra.get("stop_reason") or "length"), 60)
        raise ModelError("bad_request", f"the model reached its token limit ({why}) in the "
                         f"middle of its tool calls, so none of the {len(reply.tool_calls)} "
                         "ran: raise the model's max_tokens", provider=provider)


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON-like value, keys included (as decoded: JSON's escapes
    would hide a control character inside the key)."""
    return (item for item in json_values(value) if isinstance(item, str))


class _KeyGuard:
    """Text deltas, shown live before the reply is whole, with the key never among them:
    the end of what came so far that could be the start of the key is held back until the
    next delta tells (or the stream ends); the key itself ends the attempt."""

    def __init__(self, key: str | None) -> None:
        self._key = _guarded(key)
        self._held = ""

    def feed(self, delta: str, provider: str) -> str:
        key = self._key
        if not key:
            return delta
        text = self._held + delta
        # Judged on what shows: a key with a zero-width character inside is still the key
        # to whoever reads it. The text itself is handed on as it came (joiners make emoji).
        visible = INVISIBLE.sub("", text)
        if key in visible:
            raise _quotes_key(provider)
        # The longest end of what shows that the key starts with: it starts with the key's
        # first character, within the last len(key) - 1 characters.
        keep = 0
        at = visible.find(key[0], max(0, len(visible) - len(key) + 1))
        while at != -1:
            if key.startswith(visible[at:]):
                keep = len(visible) - at
                break
            at = visible.find(key[0], at + 1)
        cut = len(text)
        while keep:
            cut -= 1
            if not INVISIBLE.match(text, cut):
                keep -= 1
        held = text[cut:]
        if len(held) > 2 * len(key) + 64:  # padded with invisible characters: drop them
            held = INVISIBLE.sub("", held)
        self._held = held
        return text[:cut]

    def rest(self) -> str:
        held, self._held = self._held, ""
        return held


async def _read_clipped(response: aiohttp.ClientResponse, timeout_s: float) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in _chunks(response, timeout_s):
        chunks.append(chunk)
        size += len(chunk)
        if size >= ERROR_BODY_LIMIT:
            break
    return b"".join(chunks)[:ERROR_BODY_LIMIT]


async def send(client: ModelClient, req: WireRequest, *, key: str | None,
               timeout_s: float, on_delta: OnDelta | None) -> ModelResponse:
    """One attempt; the reply with `latency_ms` set."""
    start = time.monotonic()
    try:
        proxy, proxy_auth = client.proxy(req.url)
    except ValueError:  # not a URL at all (an IPv6 address left open)
        raise _bad_url(req.provider, "ValueError") from None
    delivered = False
    headers = dict(req.headers)
    if req.stream is not None:
        headers["accept"] = "text/event-stream"
        headers["cache-control"] = "no-store"
    deadline = timeout_s * ATTEMPT_DEADLINE_FACTOR
    try:
        async with asyncio.timeout(deadline), client.session.post(
                req.url, data=msgspec.json.encode(req.body), headers=headers,
                allow_redirects=False, proxy=proxy, proxy_auth=proxy_auth,
                timeout=aiohttp.ClientTimeout(total=None, connect=timeout_s,
                                              sock_read=timeout_s)) as response:
            if not 200 <= response.status < 300:
                body = await _read_clipped(response, timeout_s)
                err = http_error(req.provider, response.status, response.headers, body, key)
                if response.status in (404, 405):
                    # Most often no such API there: a base_url or provider that is wrong.
                    where = clip(redact(req.url, key), 200)
                    raise ModelError(err.kind, f"{err.message.rstrip('.')}; there is no "
                                     f"{req.provider} API at {where}: check the model's "
                                     "base_url and provider", provider=err.provider,
                                     status=err.status, retryable=err.retryable)
                raise err
            guard = _KeyGuard(key)
            if req.stream is None or _is_json(response):
                # Not streamed, or a server that ignores `stream: true` (some OpenAI-
                # compatible ones) and answers with the whole reply: read as one.
                data = decode_json(await _read_bounded(response, req.provider, timeout_s),
                                   req.provider)
                with _shape(req.provider):
                    reply = checked(req.parse(data))
                if req.stream is not None and reply.text and on_delta is not None:
                    _refuse_quoted_key(reply, key, req.provider)  # before it is shown
                    delivered = True
                    await on_delta(reply.text)
            else:
                decoder = req.stream()
                async with contextlib.aclosing(_events(response, req.provider,
                                                       timeout_s)) as events:
                    async for name, data in _settled(events, decoder):
                        with _shape(req.provider):
                            delta = decoder.feed(name, data)
                        if delta and on_delta is not None:
                            delta = guard.feed(delta, req.provider)
                            if delta:
                                delivered = True
                                await on_delta(delta)
                        if decoder.ended:
                            await _drain(events)
                            break
                if not decoder.complete:
                    raise ModelError("unavailable", "the stream ended before its last event",
                                     provider=req.provider, retryable=True)
                with _shape(req.provider):
                    reply = checked(decoder.result())
            _refuse_quoted_key(reply, key, req.provider)
            _refuse_empty(reply, req.provider)
            _refuse_cut_calls(reply, req.provider)
            rest = guard.rest()
            if rest and on_delta is not None:
                delivered = True
                await on_delta(rest)
    except (aiohttp.InvalidURL, aiohttp.NonHttpUrlClientError) as exc:
        raise _bad_url(req.provider, type(exc).__name__) from None
    except aiohttp.ClientError as exc:  # connect, read, timeouts, protocol
        what = _transport_error(exc, req.url, timeout_s, key)
        # Not chained to an error of aiohttp's parser: its text quotes what the server
        # sent, the key too if the server echoes it, and a traceback would show it.
        cause = None if isinstance(exc, _QUOTING_ERRORS) else exc
        if delivered:
            raise _partial(req.provider, what, None) from cause
        raise ModelError("unavailable", what, provider=req.provider,
                         retryable=True) from cause
    except TimeoutError as exc:  # the attempt's deadline, not a read's (aiohttp's own)
        what = (f"no whole reply within {deadline:g} s ({ATTEMPT_DEADLINE_FACTOR} x "
                f"timeout_s)")
        if delivered:
            raise _partial(req.provider, what, None) from exc
        raise ModelError("unavailable", what, provider=req.provider, retryable=True) from exc
    except ModelError as err:
        if delivered:
            raise _partial(err.provider, redact(err.message, key), err.status) from err
        cleaned = redact(err.message, key) if key else err.message
        if cleaned != err.message:  # an error event quoting the key, or pieces of it
            raise ModelError(err.kind, cleaned, provider=err.provider,
                             status=err.status, retryable=err.retryable,
                             retry_after_s=err.retry_after_s) from err.__cause__
        raise
    except SSEError as exc:
        if "text/html" in str(exc):  # a web page: not an API, so not where base_url should be
            raise ModelError("bad_request", f"the model server answered with an HTML page, "
                             f"not the {req.provider} API: check the model's base_url",
                             provider=req.provider) from exc
        raise ModelError("bad_request", f"expected an event stream: {clip(str(exc))}",
                         provider=req.provider) from exc
    except OSError as exc:  # a socket's error aiohttp did not wrap
        what = clip(redact(f"{type(exc).__name__}: {exc}".rstrip(": "), key))
        if delivered:
            raise _partial(req.provider, what, None) from exc
        raise ModelError("unavailable", what, provider=req.provider, retryable=True) from exc
    except (RecursionError, UnicodeDecodeError, LookupError, TypeError, ValueError) as exc:
        # Anything else a broken reply can raise on the way (its text not decodable, an
        # odd header): still the provider's fault, never the planner's. Not quoted: its
        # text may hold the reply, and the reply may quote the key.
        what = f"the reply could not be read ({type(exc).__name__})"
        if delivered:
            raise _partial(req.provider, what, None) from None
        raise ModelError("unavailable", what, provider=req.provider, retryable=True) from None
    latency_ms = int((time.monotonic() - start) * 1000)
    return msgspec.structs.replace(reply, latency_ms=latency_ms)


def _bad_url(provider: str, name: str) -> ModelError:
    """The same URL fails the same way: not worth another attempt."""
    return ModelError("bad_request", f"the model's URL is not an http(s) URL the client can "
                      f"use ({name}): check its base_url", provider=provider)


# aiohttp's errors for a reply its parser refused (ClientResponseError, status 400 of its
# own: the client never raises for a status) or a body it could not read whole: their
# texts quote the bytes that broke the parser.
_QUOTING_ERRORS: Final = (aiohttp.ClientResponseError, aiohttp.ClientPayloadError)
# Where such a text starts quoting (b'...', bytearray(b'...'), clipped at 100 bytes): a
# key cut there is no longer found by `redact`, so nothing from there on is kept.
_QUOTED_BYTES = re.compile(r"""(?:bytearray\()?\bb['"].*""", re.DOTALL)


def _parser_words(text: str) -> str:
    """aiohttp's words for what broke its parser, without the bytes it quotes."""
    return _QUOTED_BYTES.sub("", text).rstrip(" :.\n") or "no reason given"


def _transport_error(exc: aiohttp.ClientError, url: str, timeout_s: float,
                     key: str | None) -> str:
    """What went wrong on the way, in words (aiohttp's own texts are often empty)."""
    name = "SocketTimeoutError" if isinstance(exc, _Stalled) else type(exc).__name__
    where = url.partition("://")[2].partition("/")[0]
    if isinstance(exc, aiohttp.SocketTimeoutError):
        what = f"the model server sent nothing for {timeout_s:g} s (timeout_s): {name}"
    elif isinstance(exc, aiohttp.ServerTimeoutError):
        what = f"could not connect to {where} within {timeout_s:g} s (timeout_s): {name}"
    elif isinstance(exc, aiohttp.ClientConnectorError):
        what = f"could not connect to {where} ({exc.os_error.strerror or name}): {name}"
    elif isinstance(exc, aiohttp.ServerDisconnectedError):
        what = f"the model server closed the connection: {name}"
    elif isinstance(exc, aiohttp.ClientResponseError):
        # Its str() also says "400" (not the server's status) and the URL.
        what = (f"the model server's reply could not be read as HTTP "
                f"({_parser_words(exc.message)}): {name}")
    elif isinstance(exc, aiohttp.ClientPayloadError):
        what = f"{name}: {_parser_words(str(exc))}"
    else:
        what = f"{name}: {exc}".rstrip(": ")
    return clip(redact(what, key))


async def _events(response: aiohttp.ClientResponse, provider: str, timeout_s: float,
                  ) -> AsyncGenerator[tuple[str, str], None]:
    """The stream's events, (name, data), as the SSE spec reads them (lines end with CRLF,
    LF or CR; a blank line ends an event, dispatched if it has data; UTF-8), with every
    byte of the body counted: a line, or an event, that never ends must not fill memory
    before it is whole enough to be counted. Comments, `id`
    and `retry` are of no use here."""
    media = str(response.headers.get("content-type", "")).partition(";")[0]
    if "text/event-stream" not in media:
        raise SSEError("Expected response header Content-Type to contain "
                       f"'text/event-stream', got {media!r}")
    # utf-8-sig: a byte order mark at the start is not part of the first field (the spec).
    text = codecs.getincrementaldecoder("utf-8-sig")(errors="replace")
    size = 0
    line: list[str] = []  # the line read so far
    cr = False  # the last piece ended with CR: an LF first in the next one belongs to it
    name = ""
    data: list[str] = []
    async for chunk in _chunks(response, timeout_s):
        size += len(chunk)
        if size > MAX_REPLY_BYTES:
            raise _too_large(provider)
        piece = text.decode(chunk)
        if not piece:
            continue
        if cr and piece[0] == "\n":
            piece = piece[1:]
        cr = piece.endswith("\r")
        lines = _LINE_BREAK.split(piece)
        line.append(lines[0])
        for rest in lines[1:]:  # each starts after a line break
            whole, line = "".join(line), [rest]
            if not whole:  # the event ends; one without data is none (the SSE spec)
                if data:
                    yield name, "\n".join(data)
                name, data = "", []
                continue
            field, _, value = whole.partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                name = value
            elif field == "data":
                data.append(value)
    # What is left is an event no blank line ended: not one.


async def _settled(events: AsyncIterator[tuple[str, str]], decoder: StreamDecoder
                   ) -> AsyncIterator[tuple[str, str]]:
    """`events`, until the stream ends or, for an API with no last event (Gemini's ends
    when the body does), until the reply is whole and nothing more comes within
    `_DRAIN_S`: a server that keeps such a stream open after its last chunk has nothing
    more to say, and waiting for the body's end would fail the whole reply on a read
    timeout."""
    iterator = aiter(events)
    while True:
        quiet: asyncio.Timeout | None = None
        try:
            # Only for an API with no last event: one that has one (Chat Completions'
            # `[DONE]`) may still send what belongs to the reply after it is complete
            # (the usage, after the chunk with `finish_reason`), however slowly.
            if decoder.open_ended and decoder.complete and not decoder.ended:
                async with asyncio.timeout(_DRAIN_S) as quiet:
                    item = await anext(iterator)
            else:
                item = await anext(iterator)
        except StopAsyncIteration:
            return
        except TimeoutError:
            if quiet is not None and quiet.expired():
                return
            raise
        yield item


async def _drain(events: AsyncIterator[tuple[str, str]]) -> None:
    """Read on past a stream's last event to the end of the body (a few bytes at most),
    so that the connection goes back to the pool instead of being closed. Best effort:
    the reply is whole, so a server that keeps the stream open, breaks it or sends more
    only costs the connection."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(_DRAIN_S):
            n = 0
            async for _ in events:
                n += 1
                if n > _DRAIN_EVENTS:
                    return


@contextlib.contextmanager
def _shape(provider: str) -> Iterator[None]:
    """A reply that is JSON but not in the API's shape (a field of the wrong type) is the
    provider's fault, like a garbled body: `unavailable`, worth another attempt."""
    try:
        yield
    except RecursionError:
        raise ModelError("unavailable", "the reply does not have the API's shape (nested "
                         "too deeply)", provider=provider, retryable=True) from None
    except (KeyError, IndexError, TypeError, AttributeError, ValueError,
            msgspec.ValidationError) as exc:
        raise ModelError("unavailable", f"the reply does not have the API's shape "
                         f"({type(exc).__name__}: {clip(str(exc), 200)})", provider=provider,
                         retryable=True) from exc


def stream_error(provider: str, error: Any) -> ModelError:
    """An error event inside a stream (`{"type", "code", "message"}` in any of the APIs'
    spellings). A request the provider had accepted failed on its side, so unless it says
    otherwise (invalid request, auth) it is worth another attempt."""
    if not isinstance(error, dict):
        error = {"message": str(error)}
    label = " ".join(str(error.get(k) or "") for k in ("type", "code", "status")).lower()
    message = str(error.get("message") or label.strip() or "error event")
    if any(w in label for w in ("auth", "permission")):
        kind, retryable = "auth", False
    elif "invalid" in label:
        kind, retryable = "bad_request", False
    elif "rate" in label or "quota" in label or "exhausted" in label:
        kind, retryable = "rate_limited", True
    else:
        kind, retryable = "unavailable", True
    if label.strip() and label.split()[0] not in message.lower():
        message = f"{message} ({label.split()[0]})"
    # As much as an error body is read of (a message can be a whole event, 16 MiB).
    message = clip(redact(message[:ERROR_BODY_LIMIT], None))
    return ModelError(kind, message, provider=provider, retryable=retryable)


def _partial(provider: str, message: str, status: int | None) -> ModelError:
    return ModelError("partial_stream", f"the stream broke after text was delivered "
                      f"({message})", provider=provider, status=status, retryable=True)
