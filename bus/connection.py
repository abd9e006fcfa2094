"""Connecting to NATS with reconnect settings fit for long-running actors."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext

from schemas.errors import BusError, BusTimeoutError, ConnectError

log = logging.getLogger("toolbus.bus")

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


@dataclass(frozen=True, slots=True)
class Bus:
    """A live connection: the core client and its JetStream context."""

    nc: Client
    js: JetStreamContext
    url: str

    async def request(self, subject: str, data: bytes, *, timeout: float,
                      who: str = "an actor") -> bytes:
        """Core request/reply, with NATS errors mapped to ours."""
        try:
            msg = await self.nc.request(subject, data, timeout=timeout)
        except nats.errors.NoRespondersError as exc:
            raise BusError(f"no one answers on {subject}: is {who} running?") from exc
        except nats.errors.TimeoutError as exc:
            raise BusTimeoutError(f"no answer on {subject} within {timeout:g} s") from exc
        return bytes(msg.data)

    async def close(self) -> None:
        if not self.nc.is_closed:
            try:
                await self.nc.drain()
            except Exception:  # closing is best-effort once the server is gone
                await self.nc.close()


async def connect(url: str, *, name: str, connect_timeout: float = 2.0) -> Bus:
    """Connect, or raise `ConnectError` naming the URL within about `connect_timeout`.

    Once connected, the client reconnects forever with a short wait, buffering up to
    8 MiB of publishes, so an actor rides out a server restart.
    """

    async def on_error(exc: Exception) -> None:
        log.debug("nats %s: %s", name, exc)

    async def on_disconnect() -> None:
        if nc_ref and (nc_ref[0].is_closed or nc_ref[0].is_draining):
            return  # our own close, not an outage
        log.warning("%s: disconnected from NATS at %s; reconnecting", name, url)

    async def on_reconnect() -> None:
        log.warning("%s: reconnected to NATS at %s", name, url)

    nc_ref: list[Client] = []
    options: dict[str, Any] = {
        "servers": [url],
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
    try:
        nc = await nats.connect(**options)
    except (nats.errors.NoServersError, OSError, TimeoutError) as exc:
        raise ConnectError(url, str(exc) or type(exc).__name__) from exc
    except Exception as exc:
        raise ConnectError(url, f"{type(exc).__name__}: {exc}") from exc
    nc_ref.append(nc)
    nc.options["max_reconnect_attempts"] = -1
    return Bus(nc=nc, js=nc.jetstream(), url=url)
