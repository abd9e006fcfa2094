"""The configurable HTTP tool (seed 002), one per manifest entry, under the entry's name.

Arguments: `path` (absolute URL, or relative to `base_url`; a `?query` in it is kept),
`method`, `headers`, `query`, `body`. Result: `{ok, status, url, data}`, plus `truncated`
and `bytes_read` when the body was cut at `max_response_bytes` (read from the network) or
`max_response_chars` (returned). A non-2xx answer is a result with `ok: false`, not a
failure: the model needs to see the status and body. Transport errors, timeouts and
refused destinations are failures (`ToolError` with an `error_type`).

Network guard, on the first request and on every redirect hop (followed here, at most
`_MAX_REDIRECTS`, never by the HTTP library): http(s) only; the host must match
`allowed_hosts` when that is set; the host is resolved once, off the event loop, and every
address it resolves to (and any IPv4 address embedded in an IPv6 one: mapped, 6to4,
Teredo, NAT64) must be public. Loopback, private, shared, unspecified, multicast and
reserved addresses need `allow_private: true`, or the host listed by its exact name in
`allowed_hosts` (a wildcard does not open them: anyone may own a subdomain's DNS).
Link-local and cloud metadata addresses need `allow_link_local: true`, whatever else is
set. The connection then goes to a vetted address (`PinnedBackend`), so a DNS answer that
changes between the check and the connect (rebinding) is never used; the Host header, TLS
SNI and certificate check stay on the URL's name.

Credentials: the tool's own `default_headers` (all but a few plain ones such as
User-Agent) and `default_query` are sent only to the tool's origin: `base_url`'s scheme,
host and port (for a tool without `base_url`, a host listed by exact name in
`allowed_hosts`, over https on port 443). An absolute URL elsewhere gets none of
them. Once a redirect leaves the first hop's origin, no default credential and no
credential-named call header (Authorization, Cookie, X-Api-Key, Proxy-Authorization) goes
on for the rest of the chain.
`default_query` values are shown as REDACTED in URLs the tool reports. A credential the
server quotes back (in its body, or a redirect's Location) is returned as `[redacted]`:
the values of the secret default headers and of `default_query`, and each of their
words, of 8 characters or more. No cookie jar is kept: one call's cookies never reach
another.
"""

from __future__ import annotations

import codecs
import ipaddress
import json
import re
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextvars import ContextVar
from typing import Any
from urllib.parse import quote, quote_plus, urljoin

import anyio
import httpcore
import httpx

from actors.redaction import redact, redact_cut
from actors.tools import LocalTool, Resource, ToolError
from schemas.defaults import MAX_JSON_DEPTH
from schemas.manifest import HttpToolConfig
from schemas.requests import json_depth
from schemas.tools import Annotations, ToolSpec

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
# host, port -> the addresses the host resolves to, as strings a socket can connect to
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
Origin = tuple[str, str, int]

_READ_ONLY = frozenset({"GET", "HEAD", "OPTIONS"})
_METADATA_HOSTS = frozenset({"metadata.google.internal", "metadata", "metadata.azure.internal"})
_METADATA_IPS = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "169.254.170.2", "100.100.100.200", "fd00:ec2::254",
))
_SHARED = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT; not is_private
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_LINK_LOCAL_KINDS = frozenset({"cloud metadata", "link-local"})
# Never forwarded to another origin, whoever set them.
_CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie", "x-api-key"})
# Default headers that carry no secret, sent wherever the tool goes.
_PLAIN_HEADERS = frozenset({"accept", "accept-language", "content-type", "user-agent"})
# Framing belongs to the client: a caller's Content-Length could desynchronise a pooled
# connection, and a caller's Host would aim the request at another virtual host.
_FRAMING_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection",
                              "accept-encoding"})
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_MAX_REDIRECTS = 5
_REDACTED = "REDACTED"
# Credentials a server quotes back (a 401 page, an echo endpoint) are replaced in what the
# tool returns; shorter values are no keys, and would take words out of every body.
_SECRET_MIN_CHARS = 8

# The addresses vetted for the current task's request, by host name (lowercase). Set
# around each hop; httpcore connects in the task that sends the request.
_PINNED: ContextVar[Mapping[str, Sequence[str]] | None] = ContextVar(
    "toolbus_http_pinned", default=None)


def _spec(cfg: HttpToolConfig) -> ToolSpec:
    methods = cfg.allowed_methods
    read_only = set(methods) <= _READ_ONLY
    default_method = cfg.default_method or methods[0]
    path_schema: dict[str, Any] = {
        "type": "string", "minLength": 1,
        "description": (f"a path relative to {cfg.base_url} (a ?query is kept), or an "
                        "absolute http(s) URL"
                        if cfg.base_url else
                        "an absolute http(s) URL (this tool has no base_url)"),
    }
    if cfg.base_url is None:
        path_schema["pattern"] = "^https?://"
    params: dict[str, Any] = {
        "type": "object",
        "properties": {
            "path": path_schema,
            "method": {"type": "string", "enum": list(methods), "default": default_method},
            "headers": {"type": "object", "additionalProperties": {"type": "string"},
                        "description": "merged over the tool's default headers"},
            "query": {"type": "object",
                      "additionalProperties": {"type": ["string", "number", "boolean"]},
                      "description": "merged over the path's query and the tool's default "
                                     "query parameters"},
            "body": {"description": "JSON request body"},
        },
        "required": ["path"],
        "additionalProperties": False,
    }
    output = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "status": {"type": "integer"},
                       "url": {"type": "string"}, "data": {},
                       "truncated": {"type": "boolean"}, "bytes_read": {"type": "integer"}},
        "required": ["ok", "status", "url", "data"],
    }
    return ToolSpec(
        name=cfg.name,
        description=cfg.description or f"HTTP {'/'.join(methods)} requests"
        + (f" to {cfg.base_url}" if cfg.base_url else ""),
        parameters=params,
        output=output,
        annotations=Annotations(
            readOnlyHint=read_only,
            destructiveHint=bool({"DELETE", "PUT"} & set(methods)),
            idempotentHint=not ({"POST", "PATCH"} & set(methods)),
            openWorldHint=True,
        ),
        risk_level="low" if read_only else ("high" if "DELETE" in methods else "medium"),
        # The tool's own timeout fires first with a clear message; this is the backstop.
        timeout_ms=cfg.timeout_ms + 2_000,
        requires_approval=False,  # mutating calls ask unless auto_approve (the policy)
        auto_approve=cfg.auto_approve,
        source=f"http:{cfg.name}",
        pools=[cfg.pool],
    )


# --- the network guard --------------------------------------------------------------------


def _norm_host(host: str) -> str:
    return host.lower().rstrip(".")


def _host_allowed(host: str, allowed: list[str]) -> bool:
    host = _norm_host(host)
    for pattern in allowed:
        pattern = _norm_host(pattern)
        if pattern.startswith("*."):
            if host.endswith(pattern[1:]) and host != pattern[2:]:
                return True
        elif host == pattern:
            return True
    return False


def _listed_exactly(host: str, allowed: list[str]) -> bool:
    host = _norm_host(host)
    return any(_norm_host(p) == host for p in allowed if not p.startswith("*."))


def _deciding(addr: Address) -> list[Address]:
    """The addresses that decide whether `addr` may be reached. An IPv4-mapped or NAT64
    address is the IPv4 one it carries (on an IPv6-only host, DNS64 answers every IPv4 site
    with one); a 6to4 or Teredo address is itself and the IPv4 one a relay may deliver to."""
    if isinstance(addr, ipaddress.IPv4Address):
        return [addr]
    if addr.ipv4_mapped is not None:
        return [addr.ipv4_mapped]
    if addr in _NAT64:
        return [ipaddress.IPv4Address(int(addr) & 0xFFFF_FFFF)]
    out: list[Address] = [addr]
    if addr.sixtofour is not None:
        out.append(addr.sixtofour)
    if addr.teredo is not None:
        out.extend(addr.teredo)
    return out


def address_kind(addr: Address) -> str | None:
    """What makes `addr` non-public ("loopback", "private", ...), or None if it is public.
    Only the address itself: `refusal` also looks at the IPv4 addresses it carries."""
    if addr in _METADATA_IPS:
        return "cloud metadata"
    if addr.is_link_local:
        return "link-local"
    if addr.is_loopback:
        return "loopback"
    if addr.is_unspecified:
        return "unspecified"
    if addr.is_multicast:
        return "multicast"
    if isinstance(addr, ipaddress.IPv6Address) and addr.is_site_local:
        return "site-local"
    if addr in _SHARED:
        return "shared (carrier-grade NAT)"
    if addr.is_private:
        return "private"
    if addr.is_reserved:
        return "reserved"
    if not addr.is_global:
        return "non-public"
    return None


def refusal(addr: Address, *, allow_private: bool,
            allow_link_local: bool) -> tuple[str, Address] | None:
    """Why connecting to `addr` is refused under these settings: the kind of address and
    the address of that kind (`addr` or one embedded in it), or None when it is allowed."""
    for a in _deciding(addr):
        kind = address_kind(a)
        if kind is None:
            continue
        if not (allow_link_local if kind in _LINK_LOCAL_KINDS else allow_private):
            return kind, a
    return None


async def system_resolver(host: str, port: int) -> list[str]:
    """The system's getaddrinfo, in a worker thread."""
    infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _is_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def vet(url: httpx.URL, cfg: HttpToolConfig, resolver: Resolver) -> list[str]:
    """The addresses `url`'s host may be reached at, or a `ToolError` saying why not."""
    if url.scheme not in ("http", "https"):
        raise ToolError(f"{url.scheme or 'a URL without a scheme'}: only http and https URLs "
                        "are allowed", error_type="url_not_allowed")
    host = url.host
    if not host:
        raise ToolError("the URL has no host", error_type="url_not_allowed")
    if url.userinfo:
        raise ToolError("a user name or password in the URL is not supported; pass an "
                        "Authorization header", error_type="url_not_allowed")
    if cfg.allowed_hosts and not _host_allowed(host, cfg.allowed_hosts):
        raise ToolError(f"host {host} is not in this tool's allowed_hosts "
                        f"({', '.join(cfg.allowed_hosts)})", error_type="host_not_allowed")
    if _norm_host(host) in _METADATA_HOSTS and not cfg.allow_link_local:
        raise ToolError(f"{host} is a cloud metadata service; refused (set "
                        "allow_link_local: true on the tool to allow it)",
                        error_type="address_not_allowed")
    port = url.port or (443 if url.scheme == "https" else 80)
    if _is_literal(host):
        found: Sequence[str] = [host]
    else:
        try:
            found = await resolver(host, port)
        except OSError as exc:
            raise ToolError(f"cannot resolve {host}: {exc.strerror or exc}",
                            error_type="dns_error", retryable=True) from exc
        if not found:
            raise ToolError(f"{host} resolves to no address", error_type="dns_error",
                            retryable=True)
    allow_private = cfg.allow_private or _listed_exactly(host, cfg.allowed_hosts)
    for text in found:
        try:
            addr = ipaddress.ip_address(text.split("%", 1)[0])
        except ValueError as exc:
            raise ToolError(f"{host} resolves to {text!r}, which is not an IP address",
                            error_type="dns_error") from exc
        why = refusal(addr, allow_private=allow_private,
                      allow_link_local=cfg.allow_link_local)
        if why is not None:
            kind, bad = why
            hint = ("set allow_link_local: true on the tool" if kind in _LINK_LOCAL_KINDS else
                    f"set allow_private: true on the tool, or list {host} in allowed_hosts")
            carried = f" (which carries {bad})" if bad != addr else ""
            raise ToolError(f"{host} resolves to {addr}{carried}, a {kind} address; refused "
                            f"({hint} to allow it)", error_type="address_not_allowed")
    return list(found)


class PinnedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend, connecting only to the addresses `vet` returned for the
    host of the request this task is sending. httpcore passes the URL's host here and
    keeps it for the Host header and TLS, so only the socket's address is pinned."""

    def __init__(self) -> None:
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self, host: str, port: int, timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        pinned = _PINNED.get()
        addresses = pinned.get(host.lower()) if pinned is not None else None
        if not addresses:  # a connection the guard did not vet: never open it
            raise httpcore.ConnectError(f"{host} was not checked before connecting")
        error: httpcore.ConnectError | httpcore.ConnectTimeout | None = None
        for address in addresses:
            try:
                return await self._inner.connect_tcp(
                    address, port, timeout=timeout, local_address=local_address,
                    socket_options=socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc
        assert error is not None
        raise error

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


# --- the tool -----------------------------------------------------------------------------


def _origin(url: httpx.URL) -> Origin:
    return (url.scheme, _norm_host(url.host), url.port or (443 if url.scheme == "https" else 80))


def _parse(text: str) -> httpx.URL:
    try:
        return httpx.URL(text)
    except httpx.InvalidURL as exc:
        raise ToolError(f"{text!r} is not a valid URL: {exc}", error_type="invalid_url") from exc


def http_tool(cfg: HttpToolConfig, *, resolver: Resolver | None = None) -> LocalTool:
    """The tool `cfg` declares. `resolver` replaces the system's DNS (a test seam)."""
    spec = _spec(cfg)
    resolve = resolver or system_resolver
    home = _origin(httpx.URL(cfg.base_url)) if cfg.base_url else None
    secret_defaults = {k: v for k, v in cfg.default_headers.items()
                       if k.lower() not in _PLAIN_HEADERS}
    plain_defaults = {k: v for k, v in cfg.default_headers.items()
                      if k.lower() in _PLAIN_HEADERS}
    secret_names = _CREDENTIAL_HEADERS | {k.lower() for k in secret_defaults}
    secrets = _secret_forms([*secret_defaults.values(),
                             *(_query_value(v) for v in cfg.default_query.values())])
    seconds = cfg.timeout_ms / 1000

    def is_home(url: httpx.URL) -> bool:
        if home is not None:
            return _origin(url) == home
        # A listed name's origin is https on its default port: the model picks the URL,
        # and `http://host/` or `http://host:8080/` would carry the secrets in clear text,
        # or to whatever else listens there.
        return _origin(url)[::2] == ("https", 443) and \
            _listed_exactly(url.host, cfg.allowed_hosts)

    def shown(url: httpx.URL) -> str:
        """`url` as the model and the logs may see it: default query values hidden."""
        if not cfg.default_query:
            return str(url)
        hidden = {k: _query_value(v) for k, v in cfg.default_query.items()}
        items = url.params.multi_items()
        if not any(hidden.get(k) == v for k, v in items):
            return str(url)
        return str(url.copy_with(params=[(k, _REDACTED if hidden.get(k) == v else v)
                                         for k, v in items]))

    async def pool() -> AsyncIterator[httpcore.AsyncConnectionPool]:
        async with httpcore.AsyncConnectionPool(
            ssl_context=httpx.create_ssl_context(trust_env=False),
            network_backend=PinnedBackend(), max_connections=20, keepalive_expiry=30.0,
        ) as p:
            yield p

    res = Resource(pool, name=f"HTTP connection pool of {cfg.name}")

    async def exchange(http: httpcore.AsyncConnectionPool, method: str, url: httpx.URL,
                        content: bytes | None, call_headers: dict[str, str],
                        credentials: bool) -> tuple[int, httpx.URL, httpx.Headers, bytes, bool]:
        """Send, following redirects hop by hop: each hop is vetted, pinned and given only
        the headers its origin may see."""
        first = _origin(url)
        left_first = False
        for hop in range(_MAX_REDIRECTS + 1):
            if _origin(url) != first:
                left_first = True
            send = httpx.Headers(plain_defaults)
            if credentials and not left_first:
                send.update(secret_defaults)
            send.update({k: v for k, v in call_headers.items()
                         if not (left_first and k.lower() in secret_names)})
            send["Accept-Encoding"] = "identity"  # a compressed body would defeat the cap
            if content is not None and "content-type" not in send:
                send["Content-Type"] = "application/json"
            request = httpx.Request(method, url, headers=send, content=content)
            addresses = await vet(url, cfg, resolve)
            token = _PINNED.set({url.raw_host.decode("ascii").lower(): addresses})
            try:
                async with http.stream(
                    method, httpcore.URL(scheme=url.raw_scheme, host=url.raw_host,
                                         port=url.port, target=url.raw_path),
                    headers=request.headers.raw, content=content,
                    extensions={"timeout": dict.fromkeys(
                        ("connect", "read", "write", "pool"), seconds)},
                ) as response:
                    reply = httpx.Headers(response.headers)
                    location = reply.get("location")
                    if response.status not in _REDIRECTS or not location:
                        raw, cut = await _read_capped(response, cfg.max_response_bytes)
                        return response.status, url, reply, raw, cut
            finally:
                _PINNED.reset(token)
            if hop == _MAX_REDIRECTS:
                break
            try:
                url = url.join(location)
            except httpx.InvalidURL as exc:
                raise ToolError(f"the server redirected to {location!r}, which is not a valid "
                                f"URL: {exc}", error_type="invalid_url") from exc
            if (response.status == 303 and method != "HEAD") or (
                    response.status in (301, 302) and method == "POST"):
                method, content = "GET", None  # what browsers and httpx do
        raise ToolError(f"{method} {shown(url)}: more than {_MAX_REDIRECTS} redirects",
                        error_type="http_error")

    async def run(path: str, method: str | None = None, headers: dict[str, str] | None = None,
                  query: dict[str, Any] | None = None, body: Any = None, *,
                  http: httpcore.AsyncConnectionPool) -> dict[str, Any]:
        method = method or cfg.default_method or cfg.allowed_methods[0]
        if method not in cfg.allowed_methods:  # also in the schema; kept for direct callers
            raise ToolError(f"method {method} is not allowed; this tool allows "
                            f"{', '.join(cfg.allowed_methods)}", error_type="method_not_allowed")
        if path.startswith(("http://", "https://")):
            url = _parse(path)
        elif cfg.base_url is None:
            raise ToolError(f"{path!r} is a relative path and this tool has no base_url; "
                            "give an absolute http(s) URL", error_type="relative_path")
        else:
            url = _parse(urljoin(cfg.base_url.rstrip("/") + "/", path.lstrip("/")))
        call_headers = dict(headers or {})
        framing = sorted(k for k in call_headers if k.lower() in _FRAMING_HEADERS)
        if framing:
            raise ToolError(f"header {', '.join(framing)} is set by the tool itself; leave "
                            "it out", error_type="header_not_allowed")
        wide = sorted(k for k, v in call_headers.items() if not (k + v).isascii())
        if wide:
            raise ToolError(f"header {', '.join(wide)}: names and values may hold only ASCII "
                            "characters", error_type="header_not_allowed")
        credentials = is_home(url)
        merged = httpx.QueryParams({k: _query_value(v) for k, v in cfg.default_query.items()}
                                   if credentials else {})
        merged = merged.merge(url.params).merge(
            {k: _query_value(v) for k, v in (query or {}).items()})
        if merged:
            url = url.copy_with(params=merged)
        content = (json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
                   if body is not None else None)
        try:
            with anyio.fail_after(seconds):
                status, final, reply, raw, cut = await exchange(
                    http, method, url, content, call_headers, credentials)
        except ToolError as exc:  # a redirect's Location may quote them too
            if not any(secret in exc.message for secret in secrets):
                raise
            raise ToolError(redact(exc.message, secrets), error_type=exc.error_type,
                            retryable=exc.retryable) from None
        except (TimeoutError, httpcore.TimeoutException) as exc:
            raise ToolError(f"{method} {shown(url)} did not answer within {cfg.timeout_ms} ms",
                            error_type="timeout", retryable=True) from exc
        except (httpcore.LocalProtocolError, httpcore.UnsupportedProtocol) as exc:
            # What this call asked for cannot be sent (a header h11 refuses): the same
            # call again would fail the same way.
            raise ToolError(f"{method} {shown(url)} could not be sent: {exc}",
                            error_type="http_error", retryable=False) from exc
        except (httpcore.NetworkError, httpcore.ProtocolError) as exc:
            raise ToolError(f"{method} {shown(url)} failed: {type(exc).__name__}: {exc}",
                            error_type="http_error", retryable=True) from exc
        data, truncated = _decode_body(raw, cut, reply.get("content-type", ""), cfg)
        out: dict[str, Any] = {"ok": 200 <= status < 300, "status": status,
                               "url": shown(final), "data": data}
        if truncated:
            out["truncated"] = True
            out["bytes_read"] = len(raw)
        if truncated and isinstance(data, str):
            out["data"] = redact_cut(data, secrets)
        unquoted: dict[str, Any] = redact(out, secrets)
        return unquoted

    run.__name__ = cfg.name.replace(":", "_").replace("-", "_")
    return LocalTool(spec=spec, fn=run, injected={"http": res})


def _secret_forms(values: Iterable[str]) -> list[str]:
    """What of the tool's credentials a server may quote back: each value, and each word
    of it (the token of `Bearer <token>`), if long enough to be a key, also as a URL's
    query carries it (percent-encoded: a server quoting the URL it was asked) and as a
    JSON string does; longest first."""
    words = {form for v in values for form in (v, *v.split())
             if len(form) >= _SECRET_MIN_CHARS}
    forms = {encoded for w in words for encoded in
             (w, quote(w, safe=""), quote_plus(w), json.dumps(w)[1:-1])}
    return sorted(forms, key=len, reverse=True)


def _query_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


async def _read_capped(response: httpcore.Response, limit: int) -> tuple[bytes, bool]:
    """At most `limit` body bytes, and whether there was more. Stops reading there: the
    connection is closed rather than drained."""
    buf = bytearray()
    async for chunk in response.aiter_stream():
        room = limit - len(buf)
        if len(chunk) > room:
            buf += chunk[:room]
            return bytes(buf), True
        buf += chunk
    return bytes(buf), False


_CHARSET = re.compile(r"charset\s*=\s*\"?([\w.:-]+)", re.IGNORECASE)
# Text codecs that are no character set: punycode decodes in quadratic time (a crafted
# 1 MB body held the event loop for 30 s), idna and undefined raise whatever the handler.
_NOT_CHARSETS = frozenset({"punycode", "idna", "undefined"})


def _encoding(content_type: str) -> str:
    """The character set the server names, if Python has it; else UTF-8. Looked up, not
    tried on b"": decoding nothing succeeds with any name, even an unknown one."""
    m = _CHARSET.search(content_type)
    if m is None:
        return "utf-8"
    try:
        info = codecs.lookup(m.group(1))
    except LookupError:
        return "utf-8"
    # _is_text_encoding is what bytes.decode checks: false for base64, zlib, rot13.
    if not info._is_text_encoding or info.name in _NOT_CHARSETS:
        return "utf-8"
    return info.name


def _decode_text(raw: bytes, cut: bool, content_type: str) -> str:
    # A body cut mid-character ends where the last whole character does.
    final = not cut
    try:
        return codecs.getincrementaldecoder(_encoding(content_type))(
            errors="replace").decode(raw, final=final)
    except UnicodeError:  # UTF-16 without a byte order mark, whatever the handler
        return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(raw, final=final)


def _decode_body(raw: bytes, cut: bool, content_type: str,
                 cfg: HttpToolConfig) -> tuple[Any, bool]:
    text = _decode_text(raw, cut, content_type)
    fmt = cfg.response_format
    if fmt == "auto":
        fmt = "json" if "json" in content_type.lower() else "text"
    if fmt == "json" and not cut and len(text) <= cfg.max_response_chars:
        why = "not valid JSON"
        try:
            data = json.loads(text) if text.strip() else None
        except ValueError:
            pass
        except RecursionError:  # deeper than the stack: surely deeper than the limit
            why = f"JSON nested deeper than {MAX_JSON_DEPTH} levels"
        else:
            # As a model's JSON: a result nested deeper than that is kept as text, not
            # stored as deep as this stack allowed for each reader to decode on its own.
            if json_depth(data, MAX_JSON_DEPTH) <= MAX_JSON_DEPTH:
                return data, False
            why = f"JSON nested deeper than {MAX_JSON_DEPTH} levels"
        if cfg.response_format == "json":
            raise ToolError(f"the response is {why} (response_format is json)",
                            error_type="invalid_response")
    if len(text) > cfg.max_response_chars:
        return text[:cfg.max_response_chars], True
    return text, cut
