"""The configurable HTTP tool (seed 002), one per manifest entry, under the entry's name.

Arguments: `path` (absolute URL, or relative to `base_url`), `method`, `headers`, `query`,
`body`. Result: `{ok, status, url, data}` plus `truncated` when the body was cut at
`max_response_chars`. A non-2xx answer is a result with `ok: false`, not a failure: the
model needs to see the status and body. Transport errors and timeouts are failures.

Network guard, checked for the first request and for every redirect: http(s) only; the
host must match `allowed_hosts` when that is set; every address the host resolves to must
be outside link-local and cloud metadata ranges unless `allow_link_local` is set. The
check resolves names itself, so a DNS answer that changes between the check and the
connection (rebinding) is not covered; run such tools in a pool whose machines have no
route to metadata services when that matters.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urljoin

import httpx

from actors.tools import LocalTool, Resource, ToolError
from schemas.manifest import HttpToolConfig
from schemas.tools import Annotations, ToolSpec

_READ_ONLY = frozenset({"GET", "HEAD", "OPTIONS"})
_METADATA_HOSTS = frozenset({"metadata.google.internal", "metadata", "metadata.azure.internal"})
_METADATA_IPS = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "169.254.170.2", "100.100.100.200", "fd00:ec2::254",
))


def _spec(cfg: HttpToolConfig) -> ToolSpec:
    methods = cfg.allowed_methods
    read_only = set(methods) <= _READ_ONLY
    default_method = cfg.default_method or methods[0]
    path_schema: dict[str, Any] = {
        "type": "string", "minLength": 1,
        "description": (f"a path relative to {cfg.base_url}, or an absolute http(s) URL"
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
                      "description": "merged over the tool's default query parameters"},
            "body": {"description": "JSON request body"},
        },
        "required": ["path"],
        "additionalProperties": False,
    }
    output = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "status": {"type": "integer"},
                       "url": {"type": "string"}, "data": {},
                       "truncated": {"type": "boolean"}},
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


def _host_allowed(host: str, allowed: list[str]) -> bool:
    host = host.lower().rstrip(".")
    for pattern in allowed:
        pattern = pattern.lower().rstrip(".")
        if pattern.startswith("*."):
            if host.endswith(pattern[1:]) and host != pattern[2:]:
                return True
        elif host == pattern:
            return True
    return False


async def check_destination(url: httpx.URL, cfg: HttpToolConfig) -> None:
    """Refuse a URL the tool's configuration does not allow, saying why."""
    if url.scheme not in ("http", "https"):
        raise ToolError(f"{url}: only http and https URLs are allowed",
                        error_type="url_not_allowed")
    host = url.host
    if cfg.allowed_hosts and not _host_allowed(host, cfg.allowed_hosts):
        raise ToolError(f"host {host} is not in this tool's allowed_hosts "
                        f"({', '.join(cfg.allowed_hosts)})", error_type="host_not_allowed")
    if cfg.allow_link_local:
        return
    if host.lower().rstrip(".") in _METADATA_HOSTS:
        raise ToolError(f"{host} is a cloud metadata service; refused (set "
                        "allow_link_local: true on the tool to allow it)",
                        error_type="address_not_allowed")
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(
            host, url.port or (443 if url.scheme == "https" else 80), type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ToolError(f"cannot resolve {host}: {exc}", error_type="dns_error",
                        retryable=True) from exc
    for info in infos:
        addr = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        if addr.is_link_local or addr in _METADATA_IPS:
            raise ToolError(f"{host} resolves to {addr}, a link-local or cloud metadata "
                            "address; refused (set allow_link_local: true on the tool to "
                            "allow it)", error_type="address_not_allowed")


def http_tool(cfg: HttpToolConfig) -> LocalTool:
    spec = _spec(cfg)

    async def guard(request: httpx.Request) -> None:
        await check_destination(request.url, cfg)

    async def client() -> AsyncIterator[httpx.AsyncClient]:
        async with httpx.AsyncClient(
            timeout=cfg.timeout_ms / 1000, follow_redirects=True, max_redirects=5,
            event_hooks={"request": [guard]}, trust_env=False,
        ) as c:
            yield c

    res = Resource(client, name=f"httpx client of {cfg.name}")

    async def run(path: str, method: str | None = None, headers: dict[str, str] | None = None,
                  query: dict[str, Any] | None = None, body: Any = None, *,
                  http: httpx.AsyncClient) -> dict[str, Any]:
        method = method or cfg.default_method or cfg.allowed_methods[0]
        if method not in cfg.allowed_methods:  # also in the schema; kept for direct callers
            raise ToolError(f"method {method} is not allowed; this tool allows "
                            f"{', '.join(cfg.allowed_methods)}", error_type="method_not_allowed")
        if path.startswith(("http://", "https://")):
            url = path
        elif cfg.base_url is None:
            raise ToolError(f"{path!r} is a relative path and this tool has no base_url; "
                            "give an absolute http(s) URL", error_type="relative_path")
        else:
            url = urljoin(cfg.base_url.rstrip("/") + "/", path.lstrip("/"))
        params = {k: _query_value(v) for k, v in {**cfg.default_query, **(query or {})}.items()}
        try:
            async with http.stream(method, url, params=params,
                                   headers={**cfg.default_headers, **(headers or {})},
                                   json=body if body is not None else None) as response:
                raw, cut = await _read_capped(response, cfg.max_response_chars * 4)
        except httpx.TimeoutException as exc:
            raise ToolError(f"{method} {url} did not answer within {cfg.timeout_ms} ms",
                            error_type="timeout", retryable=True) from exc
        except httpx.TooManyRedirects as exc:
            raise ToolError(f"{method} {url}: too many redirects", error_type="http_error") from exc
        except httpx.TransportError as exc:
            raise ToolError(f"{method} {url} failed: {exc!r}", error_type="http_error",
                            retryable=True) from exc
        data, truncated = _decode_body(raw, cut, response.headers.get("content-type", ""), cfg)
        out: dict[str, Any] = {"ok": response.is_success, "status": response.status_code,
                               "url": str(response.url), "data": data}
        if truncated:
            out["truncated"] = True
        return out

    run.__name__ = cfg.name.replace(":", "_").replace("-", "_")
    return LocalTool(spec=spec, fn=run, injected={"http": res})


def _query_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


async def _read_capped(response: httpx.Response, limit: int) -> tuple[bytes, bool]:
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            return b"".join(chunks)[:limit], True
    return b"".join(chunks), False


def _decode_body(raw: bytes, cut: bool, content_type: str,
                 cfg: HttpToolConfig) -> tuple[Any, bool]:
    text = raw.decode("utf-8", errors="replace")
    fmt = cfg.response_format
    if fmt == "auto":
        fmt = "json" if "json" in content_type.lower() else "text"
    if fmt == "json" and not cut and len(text) <= cfg.max_response_chars:
        try:
            return json.loads(text) if text.strip() else None, False
        except ValueError:
            if cfg.response_format == "json":
                raise ToolError("the response is not valid JSON (response_format is json)",
                                error_type="invalid_response") from None
    if len(text) > cfg.max_response_chars:
        return text[:cfg.max_response_chars], True
    return text, cut
