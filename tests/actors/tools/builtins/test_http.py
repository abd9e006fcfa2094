"""The `http` built-in against real HTTP servers on 127.0.0.1: defaults, annotations and
policy, refused methods, paths and addresses (the SSRF matrix, directly and after a
redirect), the DNS pin, where credentials may go, query strings, timeouts and the caps."""

from __future__ import annotations

import http.server
import ipaddress
import json
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

import httpcore
import pytest

from actors.tools import ToolError
from actors.tools.builtins.http import PinnedBackend, http_tool, refusal
from schemas.manifest import HttpToolConfig, parse_manifest
from schemas.policy import Policy, evaluate
from tests.actors.tools.builtins.conftest import run_tool

REPO = Path(__file__).resolve().parents[4]
SECRETS = ("bearer-s3cret", "key-s3cret", "tenant-s3cret", "query-s3cret")


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Records every request it gets (`server.hits`), and answers:
    /redirect?to=URL[&status=N] with a redirect, /echo[?as=text] with the headers and path
    it got (JSON, or text), /loop with a redirect to itself, /slow
    after 1.5 s, /endless with a body that never ends, /typed?type=T&body=B with body B
    (latin-1) as Content-Type T, anything else with a small JSON."""

    server: _RecordingServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        self.server.hits.append({"method": self.command, "path": self.path,
                                 "headers": {k.lower(): v for k, v in self.headers.items()},
                                 "body": body.decode()})
        url = urlsplit(self.path)
        q = parse_qs(url.query)
        if url.path == "/redirect":
            self._redirect(int(q.get("status", ["302"])[0]), q["to"][0])
        elif url.path == "/echo":  # what it was sent, as a reflecting or chatty API does
            seen = {"headers": dict(self.headers.items()), "path": self.path}
            if q.get("as") == ["text"]:
                self._reply(f"401 bad credentials: {seen}".encode(), "text/plain")
            else:
                self._reply(json.dumps(seen).encode())
        elif url.path == "/loop":
            self._redirect(302, "/loop")
        elif url.path == "/typed":
            self._reply(q["body"][0].encode("latin-1"), q["type"][0])
        elif url.path == "/slow":
            time.sleep(1.5)
            self._reply(b'{"slow": true}')
        elif url.path == "/endless":
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Connection", "close")
            self.end_headers()
            try:
                for _ in range(1024):  # 64 MiB at most, should the client never stop
                    self.wfile.write(b"y" * 65536)
            except OSError:
                pass  # the client stopped reading: what the test wants
            self.close_connection = True
        else:
            self._reply(b'{"seen": true}')

    def _redirect(self, status: int, to: str) -> None:
        self.send_response(status)
        self.send_header("Location", to)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _reply(self, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:
            pass  # the client timed out first (/slow): what the test wants

    do_GET = do_POST = do_PUT = do_HEAD = _handle


class _RecordingServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Recorder)
        self.hits: list[dict[str, Any]] = []

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[_RecordingServer, _RecordingServer]]:
    pair = (_RecordingServer(), _RecordingServer())
    for s in pair:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    yield pair
    for s in pair:
        s.shutdown()
        s.server_close()


@pytest.fixture
def a_b(servers: tuple[_RecordingServer, _RecordingServer]
        ) -> tuple[_RecordingServer, _RecordingServer]:
    for s in servers:
        s.hits.clear()
    return servers


def _redirect(server: _RecordingServer, to: str, status: int = 302) -> str:
    return f"{server.url}/redirect?status={status}&to={quote(to, safe='')}"


class _Table:
    """A DNS that knows only its table (names no real DNS answers for, like
    *.rebind.test), and remembers what it was asked."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table
        self.calls: list[str] = []

    async def __call__(self, host: str, port: int) -> Sequence[str]:
        self.calls.append(host)
        if host not in self.table:
            raise OSError(-2, "Name or service not known")
        return self.table[host]


# --- configuration, annotations, arguments -------------------------------------------------


async def test_http_tool_merges_defaults_and_returns_ok_status_url_data(http_server) -> None:
    t = http_tool(HttpToolConfig(
        name="tickets:create_ticket", description="Open a ticket.", base_url=http_server,
        allowed_methods=["POST", "GET"], default_headers={"X-Api": "k1"},
        default_query={"tenant": "acme"}, allow_private=True))
    assert t.spec.name == "tickets:create_ticket" and t.spec.description == "Open a ticket."
    out = await run_tool(t, {"path": "/tickets", "body": {"title": "broken"},
                         "query": {"prio": 2}, "headers": {"X-Trace": "t"}})
    assert out["ok"] and out["status"] == 200
    # The tool's own query values may be keys: the reported URL hides them.
    assert out["url"] == f"{http_server}/tickets?tenant=REDACTED&prio=2"
    data = out["data"]
    assert data["method"] == "POST" and data["body"] == {"title": "broken"}
    assert data["path"] == "/tickets?tenant=acme&prio=2"
    assert data["headers"]["x-api"] == "k1" and data["headers"]["x-trace"] == "t"
    missing = await run_tool(t, {"path": "/missing", "method": "GET"})
    assert missing["ok"] is False and missing["status"] == 404
    assert missing["data"] == {"error": "no such ticket"}


async def test_http_tool_annotations_follow_the_allowed_methods() -> None:
    ro = http_tool(HttpToolConfig(name="api:read")).spec
    assert ro.annotations.readOnlyHint and not ro.requires_approval and ro.risk_level == "low"
    assert ro.parameters["properties"]["method"]["enum"] == ["GET", "HEAD"]
    rw = http_tool(HttpToolConfig(name="api:write", allowed_methods=["POST", "DELETE"])).spec
    assert not rw.annotations.readOnlyHint and rw.annotations.destructiveHint
    assert rw.risk_level == "high" and not rw.auto_approve
    auto = http_tool(HttpToolConfig(name="api:auto", allowed_methods=["POST"],
                                    auto_approve=True)).spec
    assert auto.auto_approve
    # What the policy makes of them (seed 002): mutating calls wait for a human unless
    # the tool's config says auto_approve.
    policy = Policy()
    assert evaluate(ro, session_id="s", agent=None, policy=policy).rule == "auto:read_only"
    assert evaluate(rw, session_id="s", agent=None, policy=policy).rule == "policy:mutating"
    assert evaluate(auto, session_id="s", agent=None, policy=policy).rule == \
        "auto:auto_approve"


async def test_http_method_outside_allowed_and_relative_path_without_base_are_rejected(
        http_server) -> None:
    t = http_tool(HttpToolConfig(name="api:read"))
    with pytest.raises(ValueError, match=r'\$\.method: "DELETE" is not one of'):
        await run_tool(t, {"path": f"{http_server}/x", "method": "DELETE"})
    with pytest.raises(ValueError, match=r'\$\.path: "/tickets" does not match'):
        await run_tool(t, {"path": "/tickets"})
    with pytest.raises(ToolError, match="relative path and this tool has no base_url"):
        await t.run({"path": "tickets"}, {t.injected["http"]: None})  # a direct caller


async def test_http_keeps_the_paths_query_and_merges_the_query_argument_over_it(
        a_b: tuple[_RecordingServer, _RecordingServer]) -> None:
    a, _ = a_b
    t = http_tool(HttpToolConfig(name="weather:forecast", base_url=a.url, allow_private=True,
                                 default_query={"units": "metric", "lang": "en"}))
    out = await run_tool(t, {"path": "/forecast?city=Paris&lang=fr&tag=a&tag=b",
                             "query": {"days": 3, "tag": "c"}})
    assert out["ok"]
    # Defaults first, the path's query over them, the query argument over both.
    assert a.hits[-1]["path"] == "/forecast?units=metric&lang=fr&city=Paris&tag=c&days=3"


async def test_the_example_manifests_weather_tool_sends_the_city_in_its_path(
        a_b: tuple[_RecordingServer, _RecordingServer]) -> None:
    """The example in deploy/examples/manifest.yaml (and the README): path
    "/forecast?city=Paris" reaches the server with its query."""
    a, _ = a_b
    text = (REPO / "deploy/examples/manifest.yaml").read_text()
    manifest = parse_manifest(text, env={"WEATHER_URL": a.url}, path="manifest.yaml")
    cfg = next(h for h in manifest.tools.http if h.name == "weather:forecast")
    out = await run_tool(http_tool(cfg), {"path": "/forecast?city=Paris"})
    assert out["ok"] and out["url"] == f"{a.url}/forecast?city=Paris"
    assert a.hits[-1]["path"] == "/forecast?city=Paris"


async def test_http_refuses_framing_headers_and_credentials_in_the_url(
        a_b: tuple[_RecordingServer, _RecordingServer]) -> None:
    a, _ = a_b
    t = http_tool(HttpToolConfig(name="api:any", allow_private=True))
    for headers in ({"Host": "admin.internal"}, {"Content-Length": "0"},
                    {"transfer-encoding": "chunked"}):
        with pytest.raises(ToolError, match="is set by the tool itself") as err:
            await run_tool(t, {"path": f"{a.url}/x", "headers": headers})
        assert err.value.error_type == "header_not_allowed"
    # Not ASCII: httpx could not encode it, and the call failed with UnicodeEncodeError.
    for headers in ({"X-Name": "caf\u00e9"}, {"X-Caf\u00e9": "v"}):
        with pytest.raises(ToolError, match="only ASCII") as err:
            await run_tool(t, {"path": f"{a.url}/x", "headers": headers})
        assert err.value.error_type == "header_not_allowed"
    # Refused by h11 as it frames the request: no retry can send it either.
    for headers in ({"X-A": "a\r\nX-Injected: 1"}, {"X A": "v"}, {"X-A": "a\x00b"}):
        with pytest.raises(ToolError, match="could not be sent") as err:
            await run_tool(t, {"path": f"{a.url}/x", "headers": headers})
        assert err.value.error_type == "http_error" and not err.value.retryable
    with pytest.raises(ToolError, match="user name or password in the URL") as err:
        await run_tool(t, {"path": f"http://u:p@127.0.0.1:{a.port}/x"})
    assert err.value.error_type == "url_not_allowed" and a.hits == []


# --- the network guard ---------------------------------------------------------------------


@pytest.mark.parametrize("address, kind", [
    ("127.0.0.1", "loopback"), ("127.255.0.9", "loopback"), ("::1", "loopback"),
    ("0.0.0.0", "unspecified"), ("::", "unspecified"),
    ("10.1.2.3", "private"), ("172.16.0.1", "private"), ("192.168.1.1", "private"),
    ("fd00::1", "private"), ("100.64.0.1", "shared (carrier-grade NAT)"),
    ("224.0.0.1", "multicast"), ("ff02::1", "multicast"), ("240.0.0.1", "private"),
    ("255.255.255.255", "private"), ("fec0::1", "site-local"),
    ("169.254.169.254", "cloud metadata"), ("169.254.1.1", "link-local"),
    ("fe80::1", "link-local"), ("fd00:ec2::254", "cloud metadata"),
    ("100.100.100.200", "cloud metadata"),
    # IPv4 carried in IPv6: mapped, 6to4, Teredo (client 127.0.0.1), NAT64, compatible.
    ("::ffff:127.0.0.1", "loopback"), ("::ffff:169.254.169.254", "cloud metadata"),
    ("2002:7f00:1::", "loopback"), ("2002:a9fe:a9fe::1", "cloud metadata"),
    ("2001:0:4136:e378:8000:63bf:80ff:fffe", "private"), ("64:ff9b::7f00:1", "loopback"),
    ("::127.0.0.1", "reserved"),
])
def test_non_public_addresses_are_refused_and_say_what_they_are(address: str,
                                                                 kind: str) -> None:
    addr = ipaddress.ip_address(address)
    why = refusal(addr, allow_private=False, allow_link_local=False)
    assert why is not None and why[0] == kind
    # allow_private opens all but link-local and metadata; allow_link_local only those.
    opened = refusal(addr, allow_private=True, allow_link_local=False)
    assert (opened is None) == (kind not in ("link-local", "cloud metadata"))
    assert refusal(addr, allow_private=True, allow_link_local=True) is None


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700::1111",
                                     "2002:808:808::1", "::ffff:8.8.8.8", "64:ff9b::808:808"])
def test_public_addresses_pass(address: str) -> None:
    assert refusal(ipaddress.ip_address(address), allow_private=False,
                   allow_link_local=False) is None


SSRF_HOSTS = [
    ("127.0.0.1", "address_not_allowed"), ("localhost", "address_not_allowed"),
    ("[::1]", "address_not_allowed"), ("0.0.0.0", "address_not_allowed"),
    ("10.0.0.1", "address_not_allowed"), ("192.168.0.1", "address_not_allowed"),
    ("169.254.169.254", "address_not_allowed"), ("[fe80::1]", "address_not_allowed"),
    ("2130706433", "address_not_allowed"), ("0x7f000001", "address_not_allowed"),
    ("127.1", "address_not_allowed"), ("0x7f.1", "address_not_allowed"),
    ("[::ffff:127.0.0.1]", "address_not_allowed"), ("[::]", "address_not_allowed"),
    ("[2002:7f00:1::]", "address_not_allowed"), ("100.64.0.1", "address_not_allowed"),
    ("224.0.0.1", "address_not_allowed"), ("metadata.google.internal", "address_not_allowed"),
    ("0177.0.0.1", "invalid_url"),  # httpx refuses leading zeros before any lookup
]


@pytest.mark.parametrize("host, error_type", SSRF_HOSTS)
async def test_ssrf_matrix_every_local_address_form_is_refused_by_default(
        a_b: tuple[_RecordingServer, _RecordingServer], host: str, error_type: str) -> None:
    a, _ = a_b
    t = http_tool(HttpToolConfig(name="api:read"))
    with pytest.raises(ToolError) as err:
        await run_tool(t, {"path": f"http://{host}:{a.port}/x"})
    assert err.value.error_type == error_type, err.value
    assert a.hits == []  # nothing reached the server listening on 127.0.0.1


@pytest.mark.parametrize("host, _", SSRF_HOSTS)
async def test_ssrf_matrix_a_redirect_to_any_of_them_is_refused(
        a_b: tuple[_RecordingServer, _RecordingServer], host: str, _: str) -> None:
    """The first hop is opened by listing its host exactly; the redirect target is not."""
    a, b = a_b
    opener = "localhost" if host != "localhost" else "127.0.0.1"
    t = http_tool(HttpToolConfig(name="api:read", allowed_hosts=[opener]))
    first = _redirect(a, f"http://{host}:{b.port}/x").replace("127.0.0.1", opener, 1)
    with pytest.raises(ToolError) as err:
        await run_tool(t, {"path": first})
    assert err.value.error_type in ("host_not_allowed", "address_not_allowed", "invalid_url")
    assert len(a.hits) == 1 and b.hits == []


REBIND = {
    "loop.rebind.test": ["127.0.0.1"], "v6.rebind.test": ["::1"],
    "mapped.rebind.test": ["::ffff:127.0.0.1"], "meta.rebind.test": ["169.254.169.254"],
    "ten.rebind.test": ["10.0.0.1"], "zero.rebind.test": ["0.0.0.0"],
    "cgnat.rebind.test": ["100.64.0.1"], "6to4.rebind.test": ["2002:7f00:1::"],
    # one public answer does not excuse a loopback one: every address is checked
    "mixed.rebind.test": ["8.8.8.8", "127.0.0.1"],
}


@pytest.mark.parametrize("name", sorted(REBIND))
async def test_a_name_resolving_to_a_local_address_is_refused_directly_and_after_a_redirect(
        a_b: tuple[_RecordingServer, _RecordingServer], name: str) -> None:
    """Through an allowed wildcard, which (unlike an exact entry) does not open local
    addresses. The DNS answers come from a table; the servers and redirects are real."""
    a, b = a_b
    t = http_tool(HttpToolConfig(name="api:read", allowed_hosts=["127.0.0.1", "*.rebind.test"]),
                  resolver=_Table(REBIND))
    for path in (f"http://{name}:{b.port}/x", _redirect(a, f"http://{name}:{b.port}/x")):
        with pytest.raises(ToolError, match=f"{name} resolves to") as err:
            await run_tool(t, {"path": path})
        assert err.value.error_type == "address_not_allowed"
    assert len(a.hits) == 1 and b.hits == []


async def test_allow_private_or_an_exactly_listed_host_opens_local_addresses_but_not_metadata(
        a_b: tuple[_RecordingServer, _RecordingServer]) -> None:
    a, _ = a_b
    opened = http_tool(HttpToolConfig(name="api:private", allow_private=True))
    for host in ("127.0.0.1", "localhost", "2130706433", "127.1"):
        assert (await run_tool(opened, {"path": f"http://{host}:{a.port}/x"}))["ok"], host
    listed = http_tool(HttpToolConfig(name="api:listed",
                                      allowed_hosts=["localhost", "169.254.169.254"]))
    assert (await run_tool(listed, {"path": f"http://localhost:{a.port}/x"}))["ok"]
    for t in (opened, listed):
        with pytest.raises(ToolError, match="allow_link_local") as err:
            await run_tool(t, {"path": "http://169.254.169.254/latest/meta-data/"})
        assert err.value.error_type == "address_not_allowed"
    assert len(a.hits) == 5


async def test_http_refuses_link_local_and_metadata_addresses_and_unlisted_hosts(
        http_server) -> None:
    t = http_tool(HttpToolConfig(name="api:read"))
    for url in ("http://169.254.169.254/latest/meta-data/", "http://[fe80::1]/",
                "http://metadata.google.internal/computeMetadata/v1/"):
        with pytest.raises(ToolError) as err:
            await run_tool(t, {"path": url})
        assert err.value.error_type == "address_not_allowed", url
    listed = http_tool(HttpToolConfig(name="api:listed", allowed_hosts=["*.example.com"]))
    with pytest.raises(ToolError, match="not in this tool's allowed_hosts") as err:
        await run_tool(listed, {"path": f"{http_server}/x"})
    assert err.value.error_type == "host_not_allowed"
    ok = http_tool(HttpToolConfig(name="api:local", allowed_hosts=["127.0.0.1"]))
    assert (await run_tool(ok, {"path": f"{http_server}/x"}))["ok"]


async def test_the_connection_goes_to_the_vetted_address_and_keeps_the_host_name(
        a_b: tuple[_RecordingServer, _RecordingServer]) -> None:
    """api.test exists only in the tool's resolver: reaching the server proves the socket
    went to the address that was checked, resolved once per hop, with Host unchanged."""
    a, _ = a_b
    resolver = _Table({"api.test": ["127.0.0.1"]})
    t = http_tool(HttpToolConfig(name="api:pinned", base_url=f"http://api.test:{a.port}",
                                 allowed_hosts=["api.test"]), resolver=resolver)
    out = await run_tool(t, {"path": "/x"})
    assert out["ok"] and out["url"] == f"http://api.test:{a.port}/x"
    assert a.hits[-1]["headers"]["host"] == f"api.test:{a.port}"
    assert resolver.calls == ["api.test"]


async def test_the_pinned_backend_never_connects_to_an_unvetted_host(http_server) -> None:
    async with httpcore.AsyncConnectionPool(network_backend=PinnedBackend()) as pool:
        with pytest.raises(httpcore.ConnectError, match="was not checked before connecting"):
            await pool.request("GET", f"{http_server}/x")


# --- credentials -----------------------------------------------------------------------------


def _secret_tool(base: str, **more: Any) -> Any:
    return http_tool(HttpToolConfig(
        name="api:secret", base_url=base, allow_private=True, allowed_methods=["GET", "POST"],
        default_headers={"Authorization": f"Bearer {SECRETS[0]}", "X-Api-Key": SECRETS[1],
                         "X-Tenant": SECRETS[2], "User-Agent": "toolbus-test"},
        default_query={"appid": SECRETS[3]}, **more))


def _leaks(hit: dict[str, Any]) -> list[str]:
    text = json.dumps(hit)
    return [s for s in SECRETS if s in text]


async def test_secret_headers_go_only_to_the_base_urls_origin(
        a_b: tuple[_RecordingServer, _RecordingServer]) -> None:
    a, b = a_b
    t = _secret_tool(a.url)
    home = await run_tool(t, {"path": "/x"})
    assert home["url"] == f"{a.url}/x?appid=REDACTED"
    assert sorted(_leaks(a.hits[-1])) == sorted(SECRETS)
    # Another host, and the same host on another port, are other origins.
    for other in (f"http://localhost:{b.port}/y", f"{b.url}/y"):
        out = await run_tool(t, {"path": other, "headers": {"X-Trace": "t1"}})
        assert out["ok"] and not _leaks(b.hits[-1])
        assert b.hits[-1]["headers"]["user-agent"] == "toolbus-test"  # a plain header
        assert b.hits[-1]["headers"]["x-trace"] == "t1"
        assert b.hits[-1]["path"] == "/y"
        assert not [s for s in SECRETS if s in json.dumps(out)]
    assert not [s for s in SECRETS if s in json.dumps(home)]


async def test_secret_headers_never_follow_a_redirect_to_a_second_host(
        a_b: tuple[_RecordingServer, _RecordingServer]) -> None:
    a, b = a_b
    t = _secret_tool(a.url)
    for status in (301, 302, 303, 307, 308):
        for target in (f"http://localhost:{b.port}/landing", f"{b.url}/landing"):
            a.hits.clear()
            b.hits.clear()
            out = await run_tool(t, {"path": _redirect(a, target, status),
                                     "headers": {"Authorization": "Bearer model-s3cret",
                                                 "Cookie": "sid=model-s3cret",
                                                 "X-Trace": "t2"}})
            assert out["ok"] and out["url"] == target
            assert len(_leaks(a.hits[0])) == 3  # the model's Authorization replaced ours
            assert "model-s3cret" in json.dumps(a.hits[0])
            hop = b.hits[0]
            assert not _leaks(hop) and "model-s3cret" not in json.dumps(hop), (status, hop)
            assert "authorization" not in hop["headers"] and "cookie" not in hop["headers"]
            assert hop["headers"]["x-trace"] == "t2"  # not a credential: it goes on


async def test_a_redirect_within_the_origin_keeps_credentials_and_one_that_left_never_regains_them(
        a_b: tuple[_RecordingServer, _RecordingServer]) -> None:
    a, b = a_b
    t = _secret_tool(a.url)
    await run_tool(t, {"path": _redirect(a, "/x")})
    assert [len(_leaks(h)) for h in a.hits] == [4, 3]  # appid was in the first URL only
    a.hits.clear()
    back = _redirect(b, f"{a.url}/back")  # A -> B -> A
    await run_tool(t, {"path": _redirect(a, back)})
    assert [len(_leaks(h)) for h in a.hits] == [4, 0] and not _leaks(b.hits[0])


async def test_a_307_keeps_method_and_body_a_303_turns_into_get(
        a_b: tuple[_RecordingServer, _RecordingServer]) -> None:
    a, _ = a_b
    t = http_tool(HttpToolConfig(name="api:post", base_url=a.url, allow_private=True,
                                 allowed_methods=["POST"]))
    await run_tool(t, {"path": _redirect(a, "/kept", 307), "body": {"n": 1}})
    assert (a.hits[-1]["method"], a.hits[-1]["body"]) == ("POST", '{"n":1}')
    await run_tool(t, {"path": _redirect(a, "/got", 303), "body": {"n": 1}})
    assert (a.hits[-1]["method"], a.hits[-1]["body"]) == ("GET", "")


async def test_a_redirect_loop_stops_and_errors_never_show_secrets(
        a_b: tuple[_RecordingServer, _RecordingServer]) -> None:
    a, _ = a_b
    t = _secret_tool(a.url)
    with pytest.raises(ToolError, match="more than 5 redirects") as err:
        await run_tool(t, {"path": "/loop"})
    assert err.value.error_type == "http_error" and len(a.hits) == 6
    slow = _secret_tool(a.url, timeout_ms=300)
    with pytest.raises(ToolError, match="did not answer within 300 ms") as err:
        await run_tool(slow, {"path": "/slow"})
    assert "appid=REDACTED" in str(err.value)
    assert not [s for s in SECRETS if s in str(err.value)]


async def test_credentials_the_server_quotes_back_are_never_returned(
        a_b: tuple[_RecordingServer, _RecordingServer]) -> None:
    # An API echoing the request (a 401 page quoting the token, a /headers endpoint) would
    # put the tool's keys in the call's event, for every client and the model to read.
    a, _ = a_b
    t = _secret_tool(a.url)
    for path in ("/echo", "/echo?as=text"):
        out = await run_tool(t, {"path": path})
        assert out["ok"] and sorted(_leaks(a.hits[-1])) == sorted(SECRETS)  # all were sent
        shown = json.dumps(out)
        assert not [s for s in SECRETS if s in shown], shown
        assert "[redacted]" in shown and "toolbus-test" in shown  # a plain header stays
    with pytest.raises(ToolError) as err:  # a Location quoting one, no URL nor a host
        await run_tool(t, {"path": _redirect(a, f"http://[{SECRETS[1]}/")})
    assert SECRETS[1] not in str(err.value) and "[redacted]" in str(err.value)


async def test_a_body_cut_inside_a_quoted_credential_shows_none_of_it(
        a_b: tuple[_RecordingServer, _RecordingServer]) -> None:
    # Cut at the size limit in the middle of a quoted key, the body kept its first part.
    a, _ = a_b
    whole = await run_tool(_secret_tool(a.url), {"path": "/echo?as=text"})
    cuts = 0
    for chars in range(40, len(whole["data"]), 3):
        out = await run_tool(_secret_tool(a.url, max_response_chars=chars),
                             {"path": "/echo?as=text"})
        assert out["truncated"] is True
        cuts += out["data"].endswith("[redacted]")
        assert not [s for s in SECRETS for k in range(4, len(s) + 1)
                    if out["data"].endswith(s[:k])], out["data"][-30:]
    assert cuts > 4  # some cuts did fall inside a credential


# --- timeouts and caps -------------------------------------------------------------------------


async def test_http_timeout_and_response_cap(http_server) -> None:
    slow = http_tool(HttpToolConfig(name="api:slow", base_url=http_server, timeout_ms=300,
                                    allow_private=True))
    with pytest.raises(ToolError, match="did not answer within 300 ms") as err:
        await run_tool(slow, {"path": "/slow"})
    assert err.value.error_type == "timeout" and err.value.retryable
    capped = http_tool(HttpToolConfig(name="api:big", base_url=http_server,
                                      max_response_chars=1000, allow_private=True))
    out = await run_tool(capped, {"path": "/big"})
    assert len(out["data"]) == 1000 and out["truncated"] is True
    assert out["bytes_read"] == 50_000
    text = http_tool(HttpToolConfig(name="api:text", base_url=http_server,
                                    response_format="text", allow_private=True))
    assert isinstance((await run_tool(text, {"path": "/x"}))["data"], str)


async def test_a_body_is_read_only_up_to_max_response_bytes(
        a_b: tuple[_RecordingServer, _RecordingServer]) -> None:
    a, _ = a_b
    small = http_tool(HttpToolConfig(name="api:small", base_url=a.url,
                                     max_response_bytes=1000, allow_private=True))
    out = await run_tool(small, {"path": "/endless"})
    assert out == {"ok": True, "status": 200, "url": f"{a.url}/endless",
                   "data": "y" * 1000, "truncated": True, "bytes_read": 1000}
    # A body that never ends: streamed, cut at the default 1 MiB, the connection dropped.
    endless = http_tool(HttpToolConfig(name="api:endless", base_url=a.url,
                                       max_response_chars=10, allow_private=True))
    out = await run_tool(endless, {"path": "/endless"})
    assert out["truncated"] and out["bytes_read"] == 1_048_576 and out["data"] == "y" * 10


@pytest.mark.parametrize("charset, body, data", [
    ("latin-1", "caf\xe9", "caf\xe9"), ("utf-8", "caf\xc3\xa9", "caf\xe9"),
    ("utf-16-le", "a\x00b\x00", "ab"),
    # Codecs that are no character set read as UTF-8: punycode (quadratic: a crafted 1 MB
    # body held the event loop 30 s), idna and undefined (which raise), bytes-to-bytes ones.
    ("punycode", "bcher-kva", "bcher-kva"), ("idna", "xn--bcher-kva", "xn--bcher-kva"),
    ("undefined", "abc", "abc"), ("base64", "aGk=", "aGk="), ("zlib", "abc", "abc"),
    ("rot13", "abc", "abc"), ("no-such-charset", "abc", "abc"),
    # A UTF-16 body without a byte order mark, which Python's decoder refuses outright.
    ("utf-16", "abc", "abc"),
])
async def test_a_body_is_decoded_only_with_a_real_character_set(
        a_b: tuple[_RecordingServer, _RecordingServer], charset: str, body: str,
        data: str) -> None:
    a, _ = a_b
    t = http_tool(HttpToolConfig(name="api:typed", base_url=a.url, allow_private=True))
    out = await run_tool(t, {"path": "/typed", "query": {
        "type": f"text/plain; charset={charset}", "body": body}})
    assert out["ok"] and out["data"] == data


@pytest.mark.parametrize("depth", [65, 5000])
async def test_a_json_body_nested_too_deeply_is_returned_as_text(
        a_b: tuple[_RecordingServer, _RecordingServer], depth: int) -> None:
    """Past MAX_JSON_DEPTH levels, as a model's JSON. Deeper than the stack, json.loads
    raised RecursionError and failed the call; a little less, it became a result nested
    as deep as the executor's stack allowed, for every reader of the event to decode."""
    a, _ = a_b
    body = "[" * depth + "]" * depth
    t = http_tool(HttpToolConfig(name="api:deep", base_url=a.url, allow_private=True))
    out = await run_tool(t, {"path": "/typed", "query": {"type": "application/json",
                                                          "body": body}})
    assert out["ok"] and out["data"] == body
    strict = http_tool(HttpToolConfig(name="api:deep", base_url=a.url, allow_private=True,
                                      response_format="json"))
    with pytest.raises(ToolError, match="nested deeper than 64") as err:
        await run_tool(strict, {"path": "/typed", "query": {"type": "application/json",
                                                             "body": body}})
    assert err.value.error_type == "invalid_response"
    shallow = "[" * 64 + "]" * 64
    out = await run_tool(t, {"path": "/typed", "query": {"type": "application/json",
                                                          "body": shallow}})
    assert out["data"] == json.loads(shallow)


async def test_without_base_url_secrets_go_to_an_allowed_host_over_https_only(
        a_b: tuple[_RecordingServer, _RecordingServer]) -> None:
    """A tool without base_url sends its credentials to a host listed exactly in
    allowed_hosts, as that host's https origin: a model given `http://host:port/` must
    not have them sent in clear text, or to whatever listens on another port."""
    a, b = a_b
    t = http_tool(HttpToolConfig(
        name="api:secret", allowed_hosts=["127.0.0.1", "localhost"],
        allowed_methods=["GET"],
        default_headers={"Authorization": f"Bearer {SECRETS[0]}", "X-Api-Key": SECRETS[1],
                         "User-Agent": "toolbus-test"},
        default_query={"appid": SECRETS[3]}))
    for url in (f"{a.url}/x", f"http://localhost:{b.port}/y"):
        out = await run_tool(t, {"path": url, "headers": {"X-Trace": "t1"}})
        assert out["ok"]
    for hit in (a.hits[-1], b.hits[-1]):
        assert not _leaks(hit), hit
        assert hit["headers"]["user-agent"] == "toolbus-test"  # a plain header goes on
        assert hit["headers"]["x-trace"] == "t1"


async def test_a_query_key_the_server_quotes_percent_encoded_is_never_returned(
        a_b: tuple[_RecordingServer, _RecordingServer]) -> None:
    # A base64 key (+, /, =) goes out percent-encoded in the query; an API echoing the URL
    # it was asked (httpbin's `url`, a 401 page) quotes it in that form.
    a, _ = a_b
    key = "q+s3cret/key=="
    t = http_tool(HttpToolConfig(name="api:q", base_url=a.url, allow_private=True,
                                 default_query={"appid": key}))
    for path in ("/echo", "/echo?as=text"):
        out = await run_tool(t, {"path": path})
        assert out["ok"] and "q%2Bs3cret%2Fkey%3D%3D" in a.hits[-1]["path"]
        shown = json.dumps(out)
        assert "s3cret" not in shown, shown
