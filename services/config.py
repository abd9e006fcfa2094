"""Settings, read once from the environment and the command line, then passed down."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import platformdirs

from bus.auth import read_role_url
from bus.connection import DEFAULT_NATS_URL
from schemas.defaults import EXECUTOR_ACK_WAIT_S, MAX_IN_FLIGHT
from schemas.errors import ConfigError, ManifestError

if TYPE_CHECKING:
    from schemas.manifest import Manifest


def default_nats_url() -> str:
    return os.environ.get("NATS_URL") or DEFAULT_NATS_URL


def nats_url_for(role: str, explicit: str | None, data_dir: Path | None) -> str:
    """The URL a command of `role` connects with: `--nats`, else `$NATS_URL`, else the
    role's URL that `toolbus up` wrote in the data dir (`--data-dir`, `$TOOLBUS_DATA_DIR`,
    or the default), else the default address (which only a `--no-auth` server accepts).

    A URL given without credentials borrows them from the data dir's URL for the same
    host and port, so `--nats nats://127.0.0.1:4333` works beside `toolbus up --port
    4333` on the same machine. A comma-separated list (a cluster's nodes) is kept as a
    list: when none of its URLs has credentials and one names the data dir's server,
    each borrows them."""
    given = explicit or os.environ.get("NATS_URL")
    stored = read_role_url(data_dir or default_data_dir(), role)
    if not given:
        return stored or DEFAULT_NATS_URL
    if not stored:
        return given
    urls = [u.strip() for u in given.split(",") if u.strip()]
    try:
        b = urlsplit(stored)
        parts = [urlsplit(u) for u in urls]
        if any(a.username is not None for a in parts) or not any(
                a.hostname == b.hostname and (a.port or 4222) == (b.port or 4222)
                for a in parts):
            return given
    except ValueError:
        return given
    if len(urls) == 1:
        return stored
    return ",".join(a._replace(netloc=f"{b.netloc.rpartition('@')[0]}@{a.netloc}").geturl()
                    for a in parts)


def default_data_dir() -> Path:
    env = os.environ.get("TOOLBUS_DATA_DIR")
    return Path(env) if env else Path(platformdirs.user_data_dir("toolbus"))


def usable_cpus(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """The cores this process may run on: the machine's, narrowed by its CPU affinity
    (`taskset`, a cpuset) and by a cgroup CPU quota (a container's CPU limit, cgroup v2
    `cpu.max` or v1 `cpu.cfs_quota_us`), rounded up; at least 1. `os.cpu_count()` is the
    host's: in a container limited to 2 CPUs on a 64-core host it says 64."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)
    quota = _cgroup_quota(cgroup)
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


def _cgroup_quota(root: Path) -> float | None:
    """CPUs' worth of time per period a cgroup quota allows, None without one."""
    try:
        text = (root / "cpu.max").read_text().split()  # v2: "<quota|max> <period>"
        if len(text) == 2 and text[0] != "max" and int(text[1]) > 0:
            return int(text[0]) / int(text[1])
        if text:
            return None
    except (OSError, ValueError):
        pass
    for v1 in (root / "cpu", root / "cpu,cpuacct"):
        try:
            quota = int((v1 / "cpu.cfs_quota_us").read_text())
            period = int((v1 / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return quota / period if quota > 0 and period > 0 else None
    return None


def default_workers() -> int:
    """`toolbus up --workers`: one process per usable core (the parent's session and
    approval actors, and a worker with the executors on each other core)."""
    return usable_cpus()


def max_workers() -> int:
    """The most `toolbus up --workers` takes: four processes per usable core (at least
    8)."""
    return max(8, 4 * usable_cpus())


@dataclass(frozen=True, slots=True)
class ActorSettings:
    tools: tuple[str, ...] = ()
    # The manifest, read and validated once by whoever builds the settings (the CLI), and
    # the file it came from: worker processes are given the path and read it themselves.
    manifest: Manifest | None = None
    manifest_path: Path | None = None
    only: tuple[str, ...] = ()  # MCP server ids this connector serves (default: all)
    http_port: int | None = None  # the HTTP gateway (services/gateway.py), off if None
    pool: str = "default"
    instance: str | None = None
    ack_wait_s: float = EXECUTOR_ACK_WAIT_S
    max_in_flight: int = MAX_IN_FLIGHT
    # Copies of each stream and bucket (`--replicas`); None: 3 on a cluster, 1 otherwise,
    # and existing streams keep theirs (bus/streams.py `provision`).
    replicas: int | None = None
    # Partitions sessions are spread over (`--partitions`), fixed when the store is first
    # provisioned; None: the store's, or 8 for a new one.
    partitions: int | None = None


def load_manifest(path: Path) -> Manifest:
    """Read and validate a manifest, resolving `${VAR}` from this process's environment."""
    # Here, not at the top: the manifest's models take a third of every command's start.
    from schemas.manifest import parse_manifest, with_base_dir

    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ManifestError(str(path), [f"cannot read it: {exc.strerror}"]) from exc
    except UnicodeDecodeError as exc:
        raise ManifestError(str(path), [f"not UTF-8 text: byte {exc.object[exc.start]:#04x} "
                                        f"at offset {exc.start}"]) from None
    base = path.resolve().parent
    manifest = parse_manifest(text, env=os.environ, path=str(path))
    return with_base_dir(manifest, lambda p: str(base / Path(p).expanduser()))


def tool_secrets() -> dict[str, str]:
    """Provider keys the built-in tools may use, from the environment, as a manifest's
    `api_key` is taken (`usable_key`): a key no header may carry is refused at boot."""
    from schemas.manifest import usable_key

    out = {}
    for name in ("TAVILY_API_KEY",):
        try:
            key = usable_key(os.environ.get(name))
        except ValueError as exc:
            raise ConfigError(f"${name}: {exc}") from None
        if key:
            out[name] = key
    return out


def subprocess_path() -> str:
    """The only variable code_execute and git children get."""
    return os.environ.get("PATH") or "/usr/local/bin:/usr/bin:/bin"
