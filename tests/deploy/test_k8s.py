"""deploy/k8s: the manifests validate against the Kubernetes schemas (kubernetes-validate,
offline), the KEDA ScaledObjects against KEDA's CRD (the models cloudcoil generates from
it) and the scaler's own fields, and each pool's triggers name the stream and consumers
that the pool's Deployment, run as its command line says, creates on a real server, as
the KEDA scaler reads them from the monitoring endpoint. No cluster is at hand: what a
cluster would add (admission, the chart's templates, KEDA itself) is not tested here."""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import jsonschema_rs
import kubernetes_validate
import pytest
import yaml
from cloudcoil.models.keda.v1alpha1 import ScaledObject

from actors.executor import Executor
from bus.auth import ROLES, TOOLBUS_ACCOUNT, deploy_roles_conf, password_variable
from bus.connection import Bus, connect
from bus.server import EmbeddedServer, free_port
from bus.streams import provision
from bus.subjects import EVENTS_STREAM, dispatch_filter
from schemas.defaults import SERVER_MAX_PAYLOAD
from schemas.errors import ServerStartError
from schemas.tools import instance_route, pool_route
from services.commands import _actor_settings, build_parser
from services.runtime import ACTOR_KINDS, collect_tools, start_actors, stop_actors

K8S = Path(__file__).parents[2] / "deploy" / "k8s"
HELM_VALUES = K8S / "15-nats-values.yaml"
NAMESPACE = "toolbus"
# The oldest and newest Kubernetes minor versions checked, both bundled offline.
K8S_VERSIONS = ("1.33.0", "1.37.0")
MANIFEST_MOUNT = "/etc/toolbus"


class _StrictLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys without a word; Kubernetes tools differ
    (kubectl refuses them): a duplicate is an error here."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            assert key not in seen, f"duplicate key {key!r} at {key_node.start_mark}"
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _load_all(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        docs = [d for d in yaml.load_all(f, Loader=_StrictLoader) if d is not None]
    assert docs, f"{path.name} holds no document"
    for d in docs:
        assert isinstance(d, dict), f"{path.name}: a document is not a mapping"
    return docs


def _resources() -> list[tuple[str, dict[str, Any]]]:
    """Every Kubernetes object of deploy/k8s (the Helm values are not one)."""
    return [(p.name, d) for p in sorted(K8S.glob("*.yaml")) if p != HELM_VALUES
            for d in _load_all(p)]


def _of_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for _, d in _resources() if d["kind"] == kind}


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert isinstance(container, dict)
    return container


def _cli_args(deployment: dict[str, Any]) -> argparse.Namespace:
    """The Deployment's command line, parsed by toolbus's own parser."""
    container = _container(deployment)
    assert container["command"] == ["toolbus"]
    return build_parser().parse_args(container["args"])


def _triggers(scaled: dict[str, Any]) -> list[dict[str, str]]:
    return [t["metadata"] for t in scaled["spec"]["triggers"] if t["type"] == "nats-jetstream"]


def test_every_file_is_yaml_that_loads_document_by_document() -> None:
    files = sorted(K8S.glob("*.yaml"))
    assert HELM_VALUES in files
    for path in files:
        _load_all(path)
    for name, doc in _resources():
        assert {"apiVersion", "kind", "metadata"} <= doc.keys(), name
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == NAMESPACE, f"{name}: {doc['kind']}"
    assert set(_of_kind("Namespace")) == {NAMESPACE}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_validate_against_the_kubernetes_schemas(version: str) -> None:
    checked, errors = 0, []
    for name, doc in _resources():
        if doc["apiVersion"].startswith("keda.sh/"):
            continue  # a CRD: kubernetes-validate has no schema for it (next tests)
        try:
            # strict: a key the schema does not declare is an error, as with kubectl's
            # default field validation.
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{name}: {doc['kind']} {doc['metadata']['name']}: "
                          f"{'.'.join(map(str, exc.path))}: {exc.message}")
        checked += 1
    assert not errors
    assert checked >= 10


def _closed(schema: Any) -> Any:
    """The CRD's schema as `kubectl apply` checks it (strict field validation): an object
    with declared properties admits no other key. cloudcoil's models ignore unknown keys,
    which would let a misspelt field (`minReplicas`) through."""
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


def test_scaled_objects_validate_against_the_keda_crd() -> None:
    scaled = _of_kind("ScaledObject")
    assert scaled
    validator = jsonschema_rs.validator_for(
        _closed(ScaledObject.model_json_schema(by_alias=True)))
    for name, doc in scaled.items():
        assert doc["apiVersion"] == "keda.sh/v1alpha1"
        errors = [f"{'.'.join(map(str, e.instance_path))}: {e.message}"
                  for e in validator.iter_errors(doc)]
        assert not errors, f"{name}: {errors}"
        ScaledObject.model_validate(doc)


# The trigger's metadata is a map of strings in the CRD; its fields are the scaler's,
# written down from KEDA's docs (keda.sh/docs/scalers/nats-jetstream) and its source
# (pkg/scalers/nats_jetstream_scaler.go: integers parsed with ParseInt, useHttps with
# ParseBool). No package ships them.
NATS_JETSTREAM_METADATA = {
    "type": "object",
    "properties": {
        "natsServerMonitoringEndpoint": {"type": "string", "pattern": r"^[A-Za-z0-9.-]+:\d+$"},
        "account": {"type": "string", "minLength": 1},
        "stream": {"type": "string", "minLength": 1},
        "consumer": {"type": "string", "minLength": 1},
        "lagThreshold": {"type": "string", "pattern": r"^[1-9]\d*$"},
        "activationLagThreshold": {"type": "string", "pattern": r"^\d+$"},
        "useHttps": {"enum": ["true", "false"]},
    },
    "required": ["natsServerMonitoringEndpoint", "account", "stream", "consumer",
                 "lagThreshold"],
    "additionalProperties": False,
}


def test_every_trigger_sets_the_nats_jetstream_scaler_fields() -> None:
    validator = jsonschema_rs.validator_for(NATS_JETSTREAM_METADATA)
    for name, doc in _of_kind("ScaledObject").items():
        triggers = doc["spec"]["triggers"]
        assert triggers and all(t["type"] == "nats-jetstream" for t in triggers), name
        for meta in _triggers(doc):
            errors = [e.message for e in validator.iter_errors(meta)]
            assert not errors, f"{name}: {meta.get('consumer')}: {errors}"


def _helm_values() -> dict[str, Any]:
    (values,) = _load_all(HELM_VALUES)
    return values


def test_helm_values_ask_for_three_replicas_with_file_storage_and_monitoring() -> None:
    config = _helm_values()["config"]
    assert config["cluster"]["enabled"] is True
    assert config["cluster"]["replicas"] == 3
    js = config["jetstream"]
    assert js["enabled"] is True
    assert js["fileStore"]["enabled"] is True
    assert js["fileStore"]["pvc"]["enabled"] is True
    assert js["fileStore"]["pvc"]["size"]
    assert js["memoryStore"]["enabled"] is False
    assert config["monitor"] == {"enabled": True, "port": 8222}
    assert config["merge"]["max_payload"] == "<< 8MB >>"
    assert SERVER_MAX_PAYLOAD == 8 * 1024 * 1024


def test_helm_values_give_the_servers_the_roles_of_bus_auth() -> None:
    values = _helm_values()
    includes = [v for k, v in values["config"]["merge"].items() if k.endswith("$include")]
    assert includes == ["toolbus-roles.conf"]
    # The file itself comes from deploy/nats/roles.conf, never a copy that could drift.
    assert "toolbus-roles.conf" not in values.get("configMap", {}).get("merge", {}).get(
        "data", {})
    set_file = (r"--set-file 'configMap.merge.data.toolbus-roles\.conf="
                "deploy/nats/roles.conf'")
    assert set_file in (K8S / "README.md").read_text()
    assert (K8S.parent / "nats" / "roles.conf").read_text() == deploy_roles_conf()
    passwords = _of_kind("Secret")["toolbus-nats-passwords"]["stringData"]
    env = values["container"]["env"]
    for role in ROLES:
        ref = env[password_variable(role)]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "toolbus-nats-passwords", "key": password_variable(role)}
        assert ref["key"] in passwords


def test_secrets_hold_each_role_as_placeholders_only() -> None:
    secrets = _of_kind("Secret")
    passwords = secrets["toolbus-nats-passwords"]["stringData"]
    for secret in secrets.values():
        for key, value in secret["stringData"].items():
            assert "CHANGE_ME" in value, f"{secret['metadata']['name']}.{key} is not a placeholder"
    for role in ROLES:
        url = urlsplit(secrets[f"toolbus-role-{role}"]["stringData"]["NATS_URL"])
        assert (url.scheme, url.username, url.password) == (
            "nats", role, passwords[password_variable(role)])
        # The client Service of the Helm release `nats` (15-nats-values.yaml).
        assert (url.hostname, url.port) == (f"nats.{NAMESPACE}.svc.cluster.local", 4222)


def test_a_deployment_runs_every_actor_kind_as_the_actor_role() -> None:
    deployments = _of_kind("Deployment")
    kinds = set()
    for name, d in deployments.items():
        args = _cli_args(d)
        assert args.command == "actor"
        kinds.add(args.kind)
        assert args.manifest == Path(MANIFEST_MOUNT) / "manifest.yaml", name
        pod = d["spec"]["template"]["spec"]
        (mount,) = [m for m in _container(d)["volumeMounts"] if m["mountPath"] == MANIFEST_MOUNT]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert volume["configMap"]["name"] in _of_kind("ConfigMap")
        env = {e["name"]: e for e in _container(d)["env"]}
        assert env["NATS_URL"]["valueFrom"]["secretKeyRef"] == {
            "name": "toolbus-role-actor", "key": "NATS_URL"}, name
        # Only the planner holds the model's key.
        assert ("OPENAI_API_KEY" in env) == (args.kind == "planner"), name
        assert d["spec"]["selector"]["matchLabels"].items() <= \
            d["spec"]["template"]["metadata"]["labels"].items()
    assert kinds == set(ACTOR_KINDS)


@pytest.fixture
def manifest_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The ConfigMap's manifest, as the pods see it; the files tool's root made here."""
    (configmap,) = _of_kind("ConfigMap").values()
    path = tmp_path / "manifest.yaml"
    path.write_text(configmap["data"]["manifest.yaml"])
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    monkeypatch.setenv("TOOLBUS_WORKSPACE", str(workspace))
    return path


def _executor_pools() -> Iterator[tuple[str, dict[str, Any], argparse.Namespace]]:
    """(ScaledObject name, ScaledObject, its target Deployment's command line)."""
    deployments = _of_kind("Deployment")
    for name, scaled in _of_kind("ScaledObject").items():
        target = scaled["spec"]["scaleTargetRef"]
        assert target.get("kind", "Deployment") == "Deployment"
        yield name, scaled, _cli_args(deployments[target["name"]])


def test_every_pool_of_the_manifest_has_an_executor_deployment_scaled_on_lag(
        manifest_file: Path) -> None:
    scaled_pools = {}
    for name, scaled, args in _executor_pools():
        assert (args.command, args.kind) == ("actor", "executor"), name
        # Never 0: the janitor fails the calls of a pool with no live executor.
        assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]
        scaled_pools[args.pool] = name
    by_pool = collect_tools(_actor_settings(build_parser().parse_args(
        ["actor", "executor", "--manifest", str(manifest_file)])))
    assert set(scaled_pools) == {p for p, tools in by_pool.items() if tools}
    executors = [a.pool for a in map(_cli_args, _of_kind("Deployment").values())
                 if a.kind == "executor"]
    assert sorted(executors) == sorted(scaled_pools)


def test_triggers_read_the_toolbus_account_on_the_monitoring_port_of_every_node() -> None:
    monitor = _helm_values()["config"]["monitor"]["port"]
    for name, scaled in _of_kind("ScaledObject").items():
        for meta in _triggers(scaled):
            assert meta["account"] == TOOLBUS_ACCOUNT, name
            assert meta["stream"] == EVENTS_STREAM, name
            host, _, port = meta["natsServerMonitoringEndpoint"].rpartition(":")
            # The headless Service: in a cluster the scaler asks the consumer's leader
            # at <server name (the pod's)>.<this host>.
            assert host == f"nats-headless.{NAMESPACE}.svc.cluster.local", name
            assert int(port) == monitor, name


@pytest.fixture(scope="module")
def monitored_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    """A server with the roles (so accounts, as in the cluster) and HTTP monitoring."""
    for attempt in range(3):
        port = free_port()
        monitor = free_port()
        while monitor == port:  # a port just released can come back at once
            monitor = free_port()
        server = EmbeddedServer(tmp_path_factory.mktemp("k8s-nats"), port=port,
                                monitor_port=monitor)
        try:
            server.start()
            break
        except ServerStartError:  # taken by another process meanwhile: other ports
            server.stop()
            if attempt == 2:
                raise
    yield server
    server.stop()


@pytest.fixture
async def actor_bus(monitored_server: EmbeddedServer) -> AsyncIterator[Bus]:
    bus = await connect(monitored_server.url, name="tests-k8s")
    await provision(bus)
    yield bus
    await bus.close()


async def _consumers_as_keda_sees_them(server: EmbeddedServer, meta: dict[str, str]
                                       ) -> dict[tuple[str, str], str]:
    """(stream, consumer) -> filter subject, from the URL the scaler builds from a
    trigger (`/jsz?acc=<account>&consumers=true&config=true`), on this server."""
    assert server.monitor_port is not None
    url = (f"http://127.0.0.1:{server.monitor_port}/jsz?acc={meta['account']}"
           "&consumers=true&config=true")
    async with httpx.AsyncClient(timeout=5.0) as http:
        body = (await http.get(url)).raise_for_status().json()
    return {(stream["name"], c["name"]): c["config"].get("filter_subject", "")
            for account in body.get("account_details", [])
            if account["name"] == meta["account"]
            for stream in account.get("stream_detail", [])
            for c in stream.get("consumer_detail", [])}


async def test_each_pools_triggers_name_the_consumers_its_executors_create(
        monitored_server: EmbeddedServer, actor_bus: Bus, manifest_file: Path) -> None:
    for name, scaled, args in _executor_pools():
        triggers = _triggers(scaled)
        before = await _consumers_as_keda_sees_them(monitored_server, triggers[0])
        # The Deployment's own command line, its manifest where the pod mounts it.
        args.manifest = manifest_file
        settings = _actor_settings(args)
        namespaces = {t.spec.namespace for t in collect_tools(settings)[args.pool]}
        actors = await start_actors(actor_bus, ["executor"], settings)
        try:
            after = await _consumers_as_keda_sees_them(monitored_server, triggers[0])
        finally:
            await stop_actors(actors)
        created = {key: subject for key, subject in after.items() if key not in before}
        instances = [a.instance for a in actors if isinstance(a, Executor)]
        pool_filters = {dispatch_filter(pool_route(args.pool, ns)) for ns in namespaces}
        # Besides the pool's consumers, each pod makes its own for the calls that name it
        # (`_instance`): those come and go with the pods, and are not scaled on.
        instance_filters = {dispatch_filter(instance_route(i, ns))
                            for i in instances for ns in namespaces}
        assert set(created.values()) == pool_filters | instance_filters, name
        shared = {key for key, subject in created.items() if subject in pool_filters}
        assert len(shared) == len(namespaces), name
        assert {(t["stream"], t["consumer"]) for t in triggers} == shared, name
