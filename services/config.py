"""Settings, read once from the environment and the command line, then passed down."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from bus.connection import DEFAULT_NATS_URL


def default_nats_url() -> str:
    return os.environ.get("NATS_URL") or DEFAULT_NATS_URL


def default_data_dir() -> Path:
    env = os.environ.get("TOOLBUS_DATA_DIR")
    return Path(env) if env else Path(platformdirs.user_data_dir("toolbus"))


@dataclass(frozen=True, slots=True)
class ActorSettings:
    tools: tuple[str, ...] = ()
    pool: str = "default"
    instance: str | None = None
    ack_wait_s: float = 30.0
    max_in_flight: int = 64
