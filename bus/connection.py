"""Connecting to NATS with reconnect settings fit for long-running actors."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext

from bus.auth import inbox_prefix, redact
from bus.tasks import retrieve
from schemas.errors import (
    AuthError,
    BusError,
    BusTimeoutError,
    ConfigError,
    ConnectError,
    PermissionDeniedError,
)
from schemas.ids import is_token

log = logging.getLogger("toolbus.bus")

_CRLF = b"\r\n"
_SPACE = re.compile(r"\s")


def _parse_header_lines(raw: bytes) -> dict[str, str]:
    """nats-py's header parser, the same rules at half the cost: it runs for every
    delivery, and it tested each character of each name in a generator."""
    out: dict[str, str] = {}
    for line in raw.split(_CRLF):
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        try:
            key = name.strip().decode("ascii")
        except UnicodeDecodeError:
            continue  # a malformed name: skipped, as nats-py skips it
        if _SPACE.search(key) is not None:
            continue
        out[key] = value.strip().decode("utf-8", "replace")
    return out


Client._parse_header_lines = staticmethod(_parse_header_lines)  # type: ignore[method-assign]


async def _process_pong(self: Client) -> None:
    """nats-py's, but a PONG whose flush was cancelled meanwhile (a Ctrl-C, a reader of
    the gateway gone) is taken as answered: nats-py set its result all the same, the
    `InvalidStateError` ended the connection's read loop, and nothing was delivered on it
    until the stale-connection check reconnected, 15 s or more later."""
    if self._pongs:
        future = self._pongs.pop(0)
        if not future.done():
            future.set_result(True)
        self._pongs_received += 1
        self._pings_outstanding = 0


Client._process_pong = _process_pong  # type: ignore[method-assign]

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


@dataclass(slots=True, eq=False)
class Bus:
    """A live connection: the core client and its JetStream context."""

    nc: Client
    js: JetStreamContext
    url: str  # without its password: safe to print
    user: str | None = None  # the URL's user name
    # How many partitions sessions are spread over (bus/subjects.py): read from the
    # events stream by `provision`, which every actor process runs before writing.
    partitions: int = 1
    # The events stream has replicas (a cluster): a checked append can then be stored
    # after another of its session's events still in flight (NATS applies the check to
    # what the leader has applied), and pipelined appends can be reordered by a leader
    # change, so decisions are appended one by one and re-read (bus/eventlog.py,
    # actors/kernel.py). Set by `provision`.
    replicated: bool = False
    # The events stream stores atomic batches (nats-server 2.12+, `allow_atomic`): a
    # decision's events are then stored all together or none (bus/eventlog.py). Set by
    # `provision`.
    atomic: bool = False
    # Requests waiting on a subject: failed at once if NATS denies publishing to it.
    _waiting: dict[str, set[asyncio.Future[Any]]] = field(default_factory=dict)

    @property
    def principal(self) -> str:
        """Who this connection is, as NATS authenticated it: the URL's user name (the
        role, for the credentials `toolbus up` writes), or `anonymous`."""
        return self.user if self.user and is_token(self.user) else "anonymous"

    def denied(self, action: str, subject: str) -> None:
        """NATS refused `action` ("publish"/"subscription") on `subject`: the requests
        waiting for an answer there fail now instead of timing out."""
        if action != "publish":
            return
        # nats-py hands the server's message over in lower case: so are the keys.
        for fut in self._waiting.pop(subject.lower(), set()):
            if not fut.done():
                fut.set_exception(PermissionDeniedError(
                    f"NATS denies the {self.principal} role publishing to {subject}: "
                    "connect with the credentials of a role that may (README: Roles and "
                    "permissions)"))

    @contextlib.contextmanager
    def fails_if_denied(self, subject: str, waiter: asyncio.Future[Any]) -> Iterator[None]:
        """While inside, `waiter` fails with `PermissionDeniedError` at once if NATS denies
        this connection publishing to `subject` (the server says so on its own, never to
        the request, which would wait out its timeout)."""
        key = subject.lower()
        self._waiting.setdefault(key, set()).add(waiter)
        try:
            yield
        finally:
            waiting = self._waiting.get(key)
            if waiting is not None:
                waiting.discard(waiter)
                if not waiting:
                    del self._waiting[key]

    async def request(self, subject: str, data: bytes, *, timeout: float,
                      who: str | None = None) -> bytes:
        """Core request/reply, with NATS errors mapped to ours (`PermissionDeniedError`
        at once when the role may not publish there); `who` names what should answer,
        for the error to say what to check."""
        denied: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        reply = asyncio.ensure_future(self.nc.request(subject, data, timeout=timeout))
        try:
            with self.fails_if_denied(subject, denied):
                await asyncio.wait((reply, denied), return_when=asyncio.FIRST_COMPLETED)
            if denied.done():
                reply.cancel()
                return denied.result()  # raises PermissionDeniedError
            msg = reply.result()
        except nats.errors.NoRespondersError as exc:
            raise BusError(f"no one answers on {subject}: is {who or 'an actor'} running?"
                           ) from exc
        except nats.errors.TimeoutError as exc:
            # Subscribed but silent: a stopped (paused, wedged) process, or one overloaded.
            check = f": is {who} running and answering?" if who else ""
            raise BusTimeoutError(f"no answer on {subject} within {timeout:g} s{check}"
                                  ) from exc
        finally:
            if not reply.done():
                reply.cancel()
        return bytes(msg.data)

    async def close(self) -> None:
        """Drain (what was received is handled, what was published is sent), then close;
        bounded by `CLOSE_S` in all. A server that stopped answering (paused, or gone
        without the connection noticing yet) made nats-py's drain wait out its flush's
        10 s before closing, past a stopping command's budget."""
        if self.nc.is_closed:
            return
        drain = asyncio.ensure_future(self.nc.drain())
        drain.add_done_callback(retrieve)
        await asyncio.wait({drain}, timeout=CLOSE_S * 0.6)
        if drain.done() and not drain.cancelled() and drain.exception() is None:
            return
        drain.cancel()  # not drained in time (or failed): closed at once
        closing = asyncio.ensure_future(self.nc.close())
        closing.add_done_callback(retrieve)
        # A cancellation of this task ends the wait; nats-py's own close can end in the
        # cancellation of its socket's close waiter (a server gone mid-read), which is
        # the closing task's, and dropped with its other errors (uvloop: "handler is
        # closed").
        await asyncio.wait({closing}, timeout=CLOSE_S * 0.4)
        if not closing.done():
            closing.cancel()
        # Not closed in time (its pending data unwritten to a server that reads nothing),
        # or the drain was cut inside its own close: the socket goes all the same.
        writer = getattr(self.nc._transport, "_io_writer", None)
        transport = getattr(writer, "transport", None)
        if transport is not None and not transport.is_closing():
            transport.abort()


# How long closing a connection takes at most: a stopping command (`toolbus chat` after
# Ctrl-C or SIGTERM) has a budget to keep.
CLOSE_S = 5.0


async def connect(url: str, *, name: str, connect_timeout: float = 2.0) -> Bus:
    """Connect, or raise `ConnectError` naming the URL within about `connect_timeout`.

    Once connected, the client reconnects forever with a short wait, buffering up to
    8 MiB of publishes, so an actor rides out a server restart.
    """

    safe_url = redact(url)

    async def on_error(exc: Exception) -> None:
        if not bus_ref:  # while connecting: kept to say why it failed
            errors.append(str(exc))
        denial = _DENIAL.search(str(exc))
        if denial:
            _recent_denials.append(f"{denial.group(1).lower()} to {denial.group(2)}")
        if denial and bus_ref:
            log.warning("%s: %s", name, str(exc).removeprefix("nats: "))
            bus_ref[0].denied(denial.group(1).lower(), denial.group(2))
            return
        log.debug("nats %s: %s", name, exc)

    async def on_disconnect() -> None:
        if nc_ref and (nc_ref[0].is_closed or nc_ref[0].is_draining):
            return  # our own close, not an outage
        log.warning("%s: disconnected from NATS at %s; reconnecting", name, safe_url)

    async def on_reconnect() -> None:
        log.warning("%s: reconnected to NATS at %s", name, safe_url)

    nc_ref: list[Client] = []
    bus_ref: list[Bus] = []
    servers = server_urls(url)
    options: dict[str, Any] = {
        # Every node of a cluster, tried in random order and again on each reconnect,
        # plus the nodes the server announces (`connect_urls`).
        "servers": servers,
        **_credentials(servers),
        "name": name,
        "connect_timeout": connect_timeout,
        "allow_reconnect": True,
        # Bounded while first connecting, so an absent server is a prompt error; the
        # limit is lifted once connected (nats-py reads it on every reconnect).
        "max_reconnect_attempts": 1,
        "reconnect_time_wait": 0.25,
        "ping_interval": 5,
        "max_outstanding_pings": 3,
        "pending_size": 8 * 1024 * 1024,
        # Closing waits this long at most for subscriptions to drain (a reader that
        # failed halfway leaves one nobody reads; nats-py's default is 30 s).
        "drain_timeout": 2,
        "error_cb": on_error,
        "disconnected_cb": on_disconnect,
        "reconnected_cb": on_reconnect,
    }
    user = options.get("user")
    if user is not None and is_token(user):
        options["inbox_prefix"] = inbox_prefix(user)  # the only replies its role may read
    errors: list[str] = []
    try:
        nc = await nats.connect(**options)
    except Exception as exc:
        if any("authorization violation" in t.lower() for t in [*errors, str(exc)]):
            raise AuthError(safe_url, "its credentials are missing or wrong "
                                      "(Authorization Violation)") from exc
        if isinstance(exc, nats.errors.NoServersError | OSError | TimeoutError):
            raise ConnectError(safe_url, redact(str(exc)) or type(exc).__name__) from exc
        raise ConnectError(safe_url, f"{type(exc).__name__}: {redact(str(exc))}") from exc
    nc_ref.append(nc)
    nc.options["max_reconnect_attempts"] = -1
    bus = Bus(nc=nc, js=nc.jetstream(), url=safe_url, user=user)
    bus_ref.append(bus)
    return bus


def server_urls(url: str) -> list[str]:
    """`url` split into its servers: `--nats` and `$NATS_URL` take a comma-separated list,
    one URL per node of a cluster."""
    urls = [u.strip() for u in url.split(",") if u.strip()]
    if not urls:
        raise ConnectError(url, "no server URL given")
    for one in urls:
        why = _unusable(one)
        if why is not None:
            # Shown with everything up to its last @ masked: what is there may be a
            # password, whole or in part (one with a / makes the URL unparsable).
            scheme, sep, rest = one.rpartition("://") if "://" in one else ("", "", one)
            shown = f"{scheme}{sep}***@{rest.rpartition('@')[2]}" if "@" in rest else one
            raise ConfigError(f"invalid NATS URL {shown[:300]!r}: {why}; give "
                              "nats://HOST:PORT (or tls://, ws://, wss://), with "
                              "user:password@ before the host if it needs them (a / # ? "
                              "or @ in them percent-encoded)")
    return urls


_SCHEMES = ("nats", "tls", "ws", "wss")


def _unusable(url: str) -> str | None:
    """Why nats-py could not use `url` as a server's URL, or None. Never quotes the URL:
    a password may be in it."""
    # A bare `host:port` is taken as nats:// (as nats-py takes it).
    text = url if "://" in url else f"nats://{url}"
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:  # its text may quote the URL: only a known one is said
        return "port out of range 1-65535" if "out of range" in str(exc) else "unparsable"
    if parts.scheme.lower() not in _SCHEMES:
        return f"{parts.scheme.lower()[:20]!r} is not a NATS scheme"
    if "@" in parts.path + parts.query + parts.fragment:
        # `user:pa/ss@host`: the password ended at the /, and the rest is a path.
        return "unparsable"
    if not parts.hostname:
        return "no host"
    if any(c.isspace() for c in parts.hostname):
        return "a space in its host"
    if parts.path not in ("", "/") and parts.scheme.lower() in ("nats", "tls"):
        # `nats//host:4222`, read as the host `nats` (a websocket URL may have a path)
        return "a path after the host (a NATS URL has none)"
    if port == 0:
        return "port 0"
    return None


def _credentials(servers: list[str]) -> dict[str, str]:
    """The user and password of the first URL that has them, for every server: the nodes
    a cluster announces come without credentials, and nats-py would connect to them
    anonymously after a failover (refused)."""
    for u in servers:
        try:
            parts = urlsplit(u)
        except ValueError:
            continue
        if parts.username is not None and parts.password is not None:
            return {"user": unquote(parts.username), "password": unquote(parts.password)}
    return {}


# nats-server's "-ERR 'Permissions Violation for Publish to "subject"'" as nats-py hands it
# to the error callback.
_DENIAL = re.compile(r"permissions violation for (publish|subscription) to \"?([^\"\s']+)",
                     re.IGNORECASE)


_recent_denials: deque[str] = deque(maxlen=8)


def as_bus_error(exc: BaseException) -> BusError | None:
    """A nats-py error that escaped a command, as one of ours with a clear message (None
    if `exc` is not one): what the CLI prints instead of a traceback."""
    if isinstance(exc, nats.js.errors.NotFoundError):
        return BusError(f"NATS answered: {exc.description or 'not found'}. Is this server "
                        "toolbus's? `toolbus up` (or any actor) creates its streams")
    if isinstance(exc, TimeoutError) and _recent_denials:  # nats-py's is one too
        return PermissionDeniedError(
            f"NATS refused this role's {_recent_denials[-1]} (permissions violation): "
            "connect with the credentials of a role that may (README: Roles and permissions)")
    if isinstance(exc, TimeoutError):
        return BusTimeoutError("NATS did not answer in time")
    if isinstance(exc, nats.errors.Error):
        return BusError(f"NATS: {redact(str(exc))}")
    return None
