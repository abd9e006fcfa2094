"""Every node's URL, everywhere a URL is taken: comma-separated, credentials from the first
URL (or the data dir), passwords redacted."""

from __future__ import annotations

from pathlib import Path

import pytest

from bus.auth import redact
from bus.connection import connect
from bus.server import free_port
from bus.streams import default_replicas, provision
from bus.subjects import EVENTS_STREAM
from services.config import nats_url_for
from tests.cluster.conftest import Cluster


def test_a_list_without_credentials_borrows_the_data_dirs_for_every_node(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NATS_URL", raising=False)
    (tmp_path / "auth").mkdir()
    (tmp_path / "auth" / "client.url").write_text("nats://client:s3cret@127.0.0.1:4222\n")
    url = nats_url_for("client", "nats://127.0.0.1:4222,nats://127.0.0.1:4223", tmp_path)
    assert url == "nats://client:s3cret@127.0.0.1:4222,nats://client:s3cret@127.0.0.1:4223"
    assert redact(url) == "nats://client:***@127.0.0.1:4222,nats://client:***@127.0.0.1:4223"
    # A list naming other servers, or with credentials of its own, is left as it is.
    other = "nats://10.0.0.1:4222,nats://10.0.0.2:4222"
    assert nats_url_for("client", other, tmp_path) == other
    given = "nats://a:b@127.0.0.1:4222,nats://127.0.0.1:4223"
    assert nats_url_for("client", given, tmp_path) == given
    monkeypatch.setenv("NATS_URL", other)
    assert nats_url_for("client", None, tmp_path) == other


async def test_a_client_connects_through_any_live_node_with_the_first_urls_credentials(
        cluster: Cluster) -> None:
    pw = cluster.passwords["client"]
    dead = f"nats://client:{pw}@127.0.0.1:{free_port()}"
    live = ",".join(f"nats://127.0.0.1:{n.client_port}" for n in cluster.nodes[1:])
    bus = await connect(f"{dead},{live}", name="test-cluster-urls")
    try:
        assert bus.principal == "client"
        assert pw not in bus.url and bus.url.count("***") == 1
        assert default_replicas(bus) == 3  # the server says it is one of three
    finally:
        await bus.close()


async def test_replicas_rescales_existing_streams_in_place(cluster: Cluster) -> None:
    bus = await connect(cluster.url("actor"), name="test-cluster-rescale")
    try:
        await provision(bus, replicas=1)  # an R1 store, as a single server made it
        await bus.js.publish("toolbus.evt.rescale-probe.0.x", b"{}")
        before = (await bus.js.stream_info(EVENTS_STREAM)).state.messages
        await provision(bus)  # without --replicas: existing streams keep theirs
        assert (await bus.js.stream_info(EVENTS_STREAM)).config.num_replicas == 1
        await provision(bus, replicas=3)
        for name in (EVENTS_STREAM, "KV_toolbus_catalog", "OBJ_toolbus_artifacts"):
            info = await bus.js.stream_info(name)
            assert info.config.num_replicas == 3, name
        info = await bus.js.stream_info(EVENTS_STREAM)
        assert info.state.messages == before
    finally:
        await bus.close()
