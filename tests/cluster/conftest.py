"""A real 3-node JetStream cluster started from the checked-in `deploy/nats/cluster/`
configs (copied with free ports), the roles of `deploy/nats/roles.conf`, authenticated
routes, and `toolbus up --nats URL,URL,URL` against it."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bus.auth import ROLES, password_variable
from bus.server import free_port, nats_server_binary
from tests.conftest import REPO

DEPLOY = REPO / "deploy" / "nats"
NODES = 3


def _password() -> str:
    # nats-server parses a variable's value as a config value: a letter, then alphanumerics.
    return "p" + secrets.token_hex(16)


@dataclass
class Node:
    index: int  # 1..3, as in node-<index>.conf
    client_port: int
    route_port: int
    monitor_port: int
    conf: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def name(self) -> str:
        return f"toolbus-{self.index}"

    def monitor(self, path: str) -> dict[str, object]:
        with urllib.request.urlopen(
                f"http://127.0.0.1:{self.monitor_port}{path}", timeout=2) as r:
            data: dict[str, object] = json.loads(r.read())
            return data

    def healthy(self) -> bool:
        """JetStream on this node is current: meta group and every stream it holds."""
        try:
            return self.monitor("/healthz").get("status") == "ok"
        except (OSError, ValueError):
            return False


@dataclass
class Cluster:
    root: Path
    env: dict[str, str]
    passwords: dict[str, str]
    nodes: list[Node] = field(default_factory=list)

    def url(self, role: str) -> str:
        """Every node's URL with `role`'s credentials, comma-separated, as `--nats`."""
        pw = self.passwords[role]
        return ",".join(f"nats://{role}:{pw}@127.0.0.1:{n.client_port}" for n in self.nodes)

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def start(self, node: Node) -> None:
        # Its store is ./data/node-<i>, relative to where it starts: the cluster's folder.
        node.proc = subprocess.Popen(
            [nats_server_binary(), "-c", str(node.conf), "-l", str(node.log)],
            cwd=self.root, env=self.env, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def kill(self, node: Node) -> None:
        assert node.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(node.proc.pid, signal.SIGKILL)
        node.proc.wait(10)
        if node.proc.stderr is not None:
            node.proc.stderr.close()

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Bounded: every node runs, routes to the two others, and sees a JetStream meta
        leader with all three peers; every node that holds streams is current."""
        deadline = time.monotonic() + timeout
        while True:
            problems = self._problems()
            if not problems:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the cluster is not ready after {timeout:g} s: "
                                     f"{'; '.join(problems)}")
            time.sleep(0.1)

    def _problems(self) -> list[str]:
        out = []
        for n in self.nodes:
            if n.proc is None or n.proc.poll() is not None:
                err = n.log.read_text()[-1500:] if n.log.exists() else ""
                raise AssertionError(f"{n.name} is not running: {err}")
            try:
                routes = n.monitor("/routez").get("routes") or []
                jsz = n.monitor("/jsz")
            except (OSError, ValueError) as exc:
                out.append(f"{n.name}: {exc}")
                continue
            peers = {r.get("remote_name") for r in routes if isinstance(r, dict)}
            if len(peers) < NODES - 1:
                out.append(f"{n.name} routes to {sorted(map(str, peers))}")
            meta = jsz.get("meta_cluster") or {}
            assert isinstance(meta, dict)
            if not meta.get("leader") or meta.get("cluster_size") != NODES:
                out.append(f"{n.name} meta: {meta}")
            elif not n.healthy():
                out.append(f"{n.name} not current")
        return out

    def stop(self) -> None:
        for n in self.nodes:
            if n.proc is not None and n.proc.poll() is None:
                n.proc.terminate()
                try:
                    n.proc.wait(10)
                except subprocess.TimeoutExpired:
                    n.proc.kill()
                    n.proc.wait(10)
            if n.proc is not None and n.proc.stderr is not None:
                n.proc.stderr.close()


def write_cluster(root: Path) -> Cluster:
    """The checked-in node configs and roles, in `root`, on free ports."""
    (root / "cluster").mkdir(parents=True)
    (root / "roles.conf").write_text((DEPLOY / "roles.conf").read_text())
    passwords = {r: _password() for r in ROLES}
    route_password = _password()
    nodes = []
    ports: list[int] = []
    while len(ports) < 3 * NODES:  # distinct: a port just released can come back at once
        port = free_port()
        if port not in ports:
            ports.append(port)
    for i in range(1, NODES + 1):
        text = (DEPLOY / "cluster" / f"node-{i}.conf").read_text()
        node = Node(i, ports.pop(), ports.pop(), ports.pop(),
                    root / "cluster" / f"node-{i}.conf", root / f"node-{i}.log")
        for default, port in ((4221 + i, node.client_port), (6221 + i, node.route_port),
                              (8221 + i, node.monitor_port)):
            listen = f"127.0.0.1:{default}"
            assert listen in text, f"node-{i}.conf does not listen on {listen}"
            text = text.replace(listen, f"127.0.0.1:{port}")
        node.conf.write_text(text)
        nodes.append(node)
    routes = ", ".join(f"nats-route://route:{route_password}@127.0.0.1:{n.route_port}"
                       for n in nodes)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "TOOLBUS_ROUTE_PASSWORD": route_password, "TOOLBUS_ROUTES": f"[{routes}]",
           **{password_variable(r): p for r, p in passwords.items()}}
    return Cluster(root, env, passwords, nodes)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = write_cluster(tmp_path_factory.mktemp("cluster"))
    try:
        for n in c.nodes:
            c.start(n)
        c.wait_ready()
        yield c
    finally:
        c.stop()
