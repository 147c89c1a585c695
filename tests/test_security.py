"""Nobody in where they don't belong: API keys, TLS, mutual TLS, Redis AUTH, limits.

One secure cluster for the module (``LocalCluster`` with material from
``pagefleet.common.certs``: the gateway over TLS wanting an API key and a client certificate,
mutual TLS between scheduler and worker, Redis with a password, metrics over TLS), tracing to
a receiver here. Every service (gateway gRPC, gateway HTTP, scheduler, worker, each metrics
port) is tried with a plaintext client, no key, a wrong key, a certificate from another CA
and an expired certificate: each is refused, and the refusal leaves nothing in Redis and no
block held. The right credentials work end to end, and no key or password shows up in any
log line the cluster wrote. Without a cluster: key checks, certificates, limits, flags.
"""

from __future__ import annotations

import datetime as dt
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import redis as sync_redis
from cluster_fixtures import log_events, start_cluster, wait_for, worker_reports
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from test_tracing import serving_receiver

from pagefleet.client import Client
from pagefleet.common.api_keys import ApiKeys, Unauthenticated, key_id, parse_keys
from pagefleet.common.certs import (
    CLIENT,
    CertFiles,
    issue,
    new_api_key,
    new_ca,
    write_cluster_material,
)
from pagefleet.common.redis import Keys, redacted
from pagefleet.common.service import EnvArgumentParser, free_port
from pagefleet.common.tls import channel_credentials, client_context
from pagefleet.gateway.limits import Limits
from pagefleet.gateway.openai_request import BadParam, parse_completion
from pagefleet.gateway.validate import BadField
from pagefleet.protos import cluster_pb2, cluster_pb2_grpc, generation_pb2_grpc
from pagefleet.protos import generation_pb2 as pb

pytestmark = pytest.mark.timeout(300)

WRONG_KEY = "pf-" + "w" * 43
LIMITS = ["--max-request-bytes", "65536", "--max-prompt-chars", "2000", "--max-choices", "4",
          "--max-stop-strings", "4", "--max-concurrent-streams", "2"]


# -- without a cluster ---------------------------------------------------------------------------
def test_keys_are_checked_in_full_and_named_by_id(tmp_path):
    a, b = new_api_key(), new_api_key()
    file = tmp_path / "keys.txt"
    file.write_text(f"# the ops team\n{b}  # rotated 2025-01\n\n")
    keys = ApiKeys([a], str(file))
    assert keys.required and keys.num_keys == 2
    assert keys.check(f"Bearer {a}") == key_id(a) and keys.check(f"bearer  {b} ") == key_id(b)
    assert len(key_id(a)) == 12 and key_id(a) not in a
    for header, reason in ((None, "missing API key"), ("", "missing API key"), (a, "malformed"),
                           (f"Basic {a}", "malformed"), (f"Bearer {a[:-1]}", "invalid"), (f"Bearer {a}x", "invalid")):
        with pytest.raises(Unauthenticated, match=reason) as info:
            keys.check(header)
        assert a not in str(info.value)
    file.write_text("")  # emptied: the door stays shut for everyone but the fixed key
    keys.reload()
    assert keys.num_keys == 1 and not keys.accepts(f"Bearer {b}") and keys.accepts(f"Bearer {a}")
    file.write_text("short\n")  # refused: a reload that fails changes nothing
    keys.reload()
    assert keys.num_keys == 1
    file.unlink()
    keys.reload()
    assert keys.accepts(f"Bearer {a}")
    assert not ApiKeys().required
    with pytest.raises(ValueError, match="at least 16 characters"):
        ApiKeys(["too-short"])
    assert parse_keys("x" * 20 + "\r\n# c\n") == ["x" * 20]


def test_the_http_doors_metrics_open_only_with_no_auth_for_metrics():
    """The door's ``/metrics`` needs a key as ``--metrics-port``'s does, and ``--no-auth-for
    metrics`` opens both; ``/health`` and ``/ping`` are always open."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from pagefleet.gateway.http import RequireApiKey

    app = Starlette(routes=[Route(p, lambda r: PlainTextResponse("ok")) for p in ("/metrics", "/ping", "/health")])
    keys = ApiKeys([new_api_key()])
    for open_metrics, metrics_status in ((False, 401), (True, 200)):
        paths = RequireApiKey.OPEN_PATHS | ({"/metrics"} if open_metrics else set())
        with TestClient(RequireApiKey(app, keys, lambda: None, open_paths=paths)) as client:
            assert client.get("/metrics").status_code == metrics_status
            assert client.get("/ping").status_code == client.get("/health").status_code == 200


def test_a_listed_flag_reads_a_comma_separated_variable(monkeypatch, capsys):
    def parse(*argv):
        p = EnvArgumentParser()
        p.add_argument("--api-key", action="append", default=None)
        p.add_argument("--no-auth-for", action="append", default=None, choices=("reflection", "metrics"))
        return p.parse_args(list(argv))

    monkeypatch.setenv("PAGEFLEET_API_KEY", "k1, k2,")
    assert parse().api_key == ["k1", "k2"]
    assert parse("--api-key", "k3", "--api-key", "k4").api_key == ["k3", "k4"]  # the command line wins
    monkeypatch.setenv("PAGEFLEET_NO_AUTH_FOR", "metrics")
    assert parse().no_auth_for == ["metrics"]
    monkeypatch.setenv("PAGEFLEET_NO_AUTH_FOR", "metrics,everything")
    with pytest.raises(SystemExit) as e:  # the flag's error: usage, the variable named, exit 2
        parse()
    assert e.value.code == 2 and "PAGEFLEET_NO_AUTH_FOR" in capsys.readouterr().err
    # values with commas of their own (MODEL=S1,S2) apart by ';': PAGEFLEET_SHARDS could not say a=s0,s1
    monkeypatch.delenv("PAGEFLEET_NO_AUTH_FOR")
    monkeypatch.setenv("PAGEFLEET_API_KEY", "a=s0,s1; b=s2")
    assert parse().api_key == ["a=s0,s1", "b=s2"]
    for value in ("tiny=s0,s1,llama=s2", "tiny=s0,s1;llama=s2"):  # or each NAME= starts the next
        monkeypatch.setenv("PAGEFLEET_SHARDS", value)
        p = EnvArgumentParser()
        p.add_argument("--shards", action="append", default=None)
        assert p.parse_args([]).shards == ["tiny=s0,s1", "llama=s2"], value


def test_material_chains_to_its_ca_with_the_right_usages(tmp_path):
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    m = write_cluster_material(tmp_path)
    ca = x509.load_pem_x509_certificate(Path(m.ca).read_bytes())
    usages = {}
    for name in ("gateway", "scheduler", "worker", "client"):
        files: CertFiles = getattr(m, name)
        cert = x509.load_pem_x509_certificate(Path(files.cert).read_bytes())
        cert.verify_directly_issued_by(ca)
        usages[name] = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
        assert os.stat(files.key).st_mode & 0o077 == 0, f"{name}'s key is readable by others"
    server, client = ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH
    assert usages == {"gateway": {server}, "scheduler": {server, client}, "worker": {server}, "client": {client}}
    assert not any(p.name.startswith("ca-key") for p in tmp_path.iterdir()), "the CA's key stays in memory"
    assert Path(m.api_keys_file).read_text().split() == [m.api_key]
    assert Path(m.redis_password_file).read_text() == m.redis_password


def test_limits_refuse_naming_their_flag():
    from pagefleet.common.model_config import load_model_spec
    from pagefleet.gateway.validate import check

    limits = Limits(max_prompt_chars=10, max_choices=4, max_stop_strings=2, max_stop_string_len=5)
    model = load_model_spec("tiny")
    cases = [
        (pb.GenerateRequest(prompt="x" * 11), "--max-prompt-chars"),
        (pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(stop=["a", "b", "c"])), "--max-stop-strings"),
        (pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(stop=["abcdef"])), "--max-stop-string-len"),
    ]
    for request, flag in cases:
        with pytest.raises(BadField, match=flag):
            check(request, model, 2048, limits)
    assert check(pb.GenerateRequest(prompt="x" * 10), model, 2048, limits)
    with pytest.raises(BadParam, match="--max-choices") as info:
        parse_completion({"prompt": ["a", "b"], "n": 3}, limits)
    assert info.value.param == "n"
    assert parse_completion({"prompt": ["a", "b"], "n": 2}, limits).num_choices == 4
    assert "--max-request-bytes" in Limits(max_request_bytes=10).body_error(11)
    assert "--max-concurrent-streams" in Limits(max_concurrent_streams=2).streams_error(3)
    assert Limits().streams_error(Limits().max_concurrent_streams) is None


def test_redis_urls_are_logged_without_their_password():
    assert redacted("redis://pagefleet:s3cret@redis:6379/0") == "redis://pagefleet:***@redis:6379/0"
    assert redacted("rediss://:s3cret@redis/0?ssl_ca_certs=/ca.pem") == "rediss://:***@redis/0?ssl_ca_certs=/ca.pem"
    assert redacted("redis://redis:6379/0") == "redis://redis:6379/0"


# -- one secure cluster ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def material(tmp_path_factory):
    d = tmp_path_factory.mktemp("secrets")
    d.chmod(0o700)
    return write_cluster_material(d)


@pytest.fixture(scope="module")
def strangers(material, tmp_path_factory) -> dict[str, CertFiles]:
    """Client certificates that must open nothing: another CA's, an expired one of the cluster's
    CA, and the gateway's (the cluster's CA, but issued for servers only)."""
    d = tmp_path_factory.mktemp("strangers")
    now = dt.datetime.now(dt.UTC)
    return {
        "other-ca": issue(new_ca("somebody else's CA"), "intruder", usages=CLIENT).write(d, "other"),
        "expired": issue(material.authority, "pagefleet-client", usages=CLIENT, not_before=now - dt.timedelta(days=3),
                         not_after=now - dt.timedelta(days=1)).write(d, "expired"),
        "server-only": material.gateway,
    }


@pytest.fixture(scope="module")
def receiver():
    with serving_receiver(2) as rx:
        yield rx


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("secure-logs")


@pytest.fixture(scope="module")
def cluster(material, receiver, log_dir):
    mp = pytest.MonkeyPatch()
    for k, v in {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
                 "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_BSP_SCHEDULE_DELAY": "200"}.items():
        mp.setenv(k, v)
    for k in ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_SERVICE_NAME"):
        mp.delenv(k, raising=False)
    health_port = free_port()
    try:
        c = start_cluster(log_dir, num_workers=1, http_port=0, metrics_port=0, material=material,
                          worker_args=["--num-blocks", "128"],
                          gateway_args=["--tls-client-ca", material.ca, "--health-port", str(health_port), *LIMITS])
    finally:
        mp.undo()
    c.health_port = health_port
    yield c
    c.stop()


@dataclass(frozen=True)
class Attempt:
    """How a caller comes: over TLS or not, with which client certificate and API key."""

    tls: bool
    cert: CertFiles | None
    key: str | None


PUBLIC = ("gateway-grpc", "gateway-http", "gateway-metrics")
SERVICES = (*PUBLIC, "scheduler", "worker", "scheduler-metrics", "worker-metrics")
WRONG = ("plaintext", "no-key", "wrong-key", "other-ca", "expired")


def attempt(how: str, service: str, material, strangers) -> Attempt:
    """``how`` a stranger tries ``service``. Internal services take a certificate, not a key: for
    them "no key" is no certificate and "wrong key" a certificate not issued for clients."""
    public = service in PUBLIC
    return {
        "plaintext": Attempt(False, None, material.api_key),
        "no-key": Attempt(True, material.client if public else None, None if public else material.api_key),
        "wrong-key": Attempt(True, material.client, WRONG_KEY) if public else
        Attempt(True, strangers["server-only"], material.api_key),
        "other-ca": Attempt(True, strangers["other-ca"], material.api_key),
        "expired": Attempt(True, strangers["expired"], material.api_key),
        "right": Attempt(True, material.client, material.api_key if public else None),
    }[how]


def _worker_address(cluster) -> str:
    (w,) = cluster.scheduler_state().workers
    return w.address


def _target(cluster, service: str) -> str:
    if service == "gateway-grpc":
        return cluster.gateway_target
    if service == "scheduler":
        return cluster.scheduler_target
    if service == "worker":
        return _worker_address(cluster)
    if service == "gateway-http":
        return cluster.http_url.split("://")[1]
    name = service.removesuffix("-metrics")
    return f"127.0.0.1:{cluster.metrics_ports['worker-0' if name == 'worker' else name]}"


def call_grpc(cluster, material, service: str, a: Attempt, request_id: str, prompt: str = "let me in") -> str:
    """One call of ``service`` as ``a``; "OK" or the status code's name."""
    target = _target(cluster, service)
    if a.tls:
        creds = channel_credentials(material.ca, a.cert.cert if a.cert else None, a.cert.key if a.cert else None)
        options = [("grpc.ssl_target_name_override", "pagefleet-worker")] if service == "worker" else []
        channel = grpc.secure_channel(target, creds, options=options)
    else:
        channel = grpc.insecure_channel(target)
    metadata = (("authorization", f"Bearer {a.key}"),) if a.key else None
    try:
        with channel:
            if service == "gateway-grpc":
                stub = generation_pb2_grpc.GenerationStub(channel)
                req = pb.GenerateRequest(request_id=request_id, prompt=prompt,
                                         sampling=pb.SamplingParams(max_tokens=2, temperature=0))
                list(stub.Generate(req, metadata=metadata, timeout=10))
            elif service == "scheduler":
                cluster_pb2_grpc.SchedulerStub(channel).GetState(cluster_pb2.GetStateRequest(), metadata=metadata,
                                                                  timeout=10)
            else:
                req = cluster_pb2.AssignRequest(request_id=request_id, prompt_token_ids=[1, 2, 3],
                                                sampling=pb.SamplingParams(max_tokens=2), scheduler_epoch=1 << 30)
                if a.key is None and a.cert is material.client:  # the right credentials: ask, change nothing
                    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                else:
                    cluster_pb2_grpc.WorkerStub(channel).Assign(req, metadata=metadata, timeout=10)
    except grpc.RpcError as e:
        return e.code().name
    return "OK"


def call_http(cluster, material, service: str, a: Attempt, request_id: str, prompt: str = "let me in") -> str:
    """One request to ``service`` as ``a``: "OK", "HTTP <status>" or "refused: <error>"."""
    host, port = _target(cluster, service).rsplit(":", 1)
    if a.tls:
        ctx = client_context(material.ca, a.cert.cert if a.cert else None, a.cert.key if a.cert else None)
        conn = http.client.HTTPSConnection(host, int(port), context=ctx, timeout=10)
    else:
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
    headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
    if a.key:
        headers["Authorization"] = f"Bearer {a.key}"
    try:
        if service == "gateway-http":
            body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
            conn.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
        else:
            conn.request("GET", "/metrics", headers=headers)
        resp = conn.getresponse()
        text = resp.read()
    except (OSError, http.client.HTTPException) as e:
        return f"refused: {type(e).__name__}"
    finally:
        conn.close()
    if resp.status != 200:
        return f"HTTP {resp.status}"
    assert text
    return "OK"


def call(cluster, material, service: str, a: Attempt, request_id: str, prompt: str = "let me in") -> str:
    """``prompt=""``: a Generate or completion the gateway refuses as invalid, having let it in."""
    grpc_service = service in ("gateway-grpc", "scheduler", "worker")
    return (call_grpc if grpc_service else call_http)(cluster, material, service, a, request_id, prompt)


def _redis(cluster, material) -> sync_redis.Redis:
    return sync_redis.Redis.from_url(cluster.redis_url, password=material.redis_password)


def _idle(cluster) -> bool:
    """No request holds blocks or a place on any worker."""
    return all(not r.request_ids and not r.blocks_per_request and r.num_running == 0
               for r in worker_reports(cluster).values())


def _traces(r: sync_redis.Redis, ns: str, request_id: str) -> list[str]:
    """Every sign of ``request_id`` in Redis: its keys, its entries in the requests stream."""
    found = [k.decode() for k in r.scan_iter(match=f"{ns}:*{request_id}*")]
    for _, fields in r.xrange(Keys(ns).requests):
        if fields.get(b"rid", b"").decode() == request_id:
            found.append(f"{Keys(ns).requests} entry")
    return found


@pytest.mark.parametrize("how", WRONG)
@pytest.mark.parametrize("service", SERVICES)
def test_strangers_are_refused_and_leave_no_trace(cluster, material, strangers, service, how):
    rid = f"refused-{service}-{how}"
    r = _redis(cluster, material)
    try:
        keys_before = set(r.keys("*"))
        outcome = call(cluster, material, service, attempt(how, service, material, strangers), rid)
        assert outcome in ("UNAUTHENTICATED", "UNAVAILABLE", "HTTP 401") or outcome.startswith("refused"), outcome
        if how in ("no-key", "wrong-key") and service in PUBLIC:  # past TLS: refused by the key, by name
            assert outcome in ("UNAUTHENTICATED", "HTTP 401"), outcome
        assert _traces(r, cluster.cfg.namespace, rid) == []
        # The scheduler's published queue length is set with a TTL every second, whatever
        # anyone calls: it may be new here (the cluster just started, or a stall let it lapse).
        standing = {Keys(cluster.cfg.namespace).num_waiting.encode()}
        assert set(r.keys("*")) - keys_before - standing == set()
    finally:
        r.close()
    assert _idle(cluster)
    # The service was there all along: the right credentials get in (and no further: an empty prompt).
    control = call(cluster, material, service, attempt("right", service, material, strangers), rid, prompt="")
    assert control in ("OK", "INVALID_ARGUMENT", "HTTP 400"), control


def test_right_credentials_work_end_to_end(cluster, material, strangers, receiver, log_dir):
    for service in SERVICES:
        rid = f"welcome-{service}"
        assert call(cluster, material, service, attempt("right", service, material, strangers), rid) == "OK", service
    with Client(cluster.gateway_target, api_key=material.api_key, ca=material.ca, client_cert=material.client.cert,
                client_key=material.client.key) as c:
        out = c.generate("the quick brown fox", max_tokens=5, temperature=0, ignore_eos=True, request_id="secure-1",
                         timeout=60)
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    kid = key_id(material.api_key)
    for rid, span_name in (("secure-1", "pagefleet.v1.Generation/Generate"),
                           ("welcome-gateway-http", "POST /v1/completions")):  # both doors: log line and span
        enqueued = wait_for(lambda rid=rid: [e for e in log_events(log_dir, "gateway")
                                             if e["event"] == "request.enqueued" and e.get("request_id") == rid],
                            10, f"{rid}'s log line")
        assert enqueued[0]["api_key_id"] == kid

        def span(rid=rid, span_name=span_name):
            found = [s for _, s in receiver.snapshot() if s.name == span_name and any(
                kv.key == "pagefleet.request_id" and kv.value.string_value == rid for kv in s.attributes)]
            return found[0] if found else None

        attrs = {kv.key: kv.value.string_value for kv in wait_for(span, 30, f"{rid}'s span").attributes}
        assert attrs["pagefleet.api_key_id"] == kid
    wait_for(lambda: _idle(cluster), 20, "the requests to finish")


def test_health_is_open_reflection_is_not(cluster, material):
    creds = channel_credentials(material.ca, material.client.cert, material.client.key)
    with grpc.secure_channel(cluster.gateway_target, creds) as ch:  # no key
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as info:
            list(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(iter([ask]), timeout=5))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        answers = list(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([ask]), timeout=5, metadata=(("authorization", f"Bearer {material.api_key}"),)))
        assert "pagefleet.v1.Generation" in {s.name for s in answers[0].list_services_response.service}
    with grpc.insecure_channel(f"127.0.0.1:{cluster.health_port}") as ch:  # the probes' port: health only
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
        with pytest.raises(grpc.RpcError) as info:
            list(generation_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(prompt="x"), timeout=5))
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    ctx = client_context(material.ca, material.client.cert, material.client.key)
    conn = http.client.HTTPSConnection("127.0.0.1", int(cluster.http_url.rsplit(":", 1)[1]), context=ctx, timeout=10)
    conn.request("GET", "/health")
    resp = conn.getresponse()
    resp.read()
    assert resp.status == 200
    for method, path, headers, status in (
            ("GET", "/ping", {}, 200),  # a probe's, as /health
            ("GET", "/metrics", {}, 401),  # the API port's metrics need a key
            ("GET", "/metrics", {"Authorization": f"Bearer {material.api_key}"}, 200),
            # a browser's preflight carries no key: answered before the key is asked for
            ("OPTIONS", "/v1/completions", {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"},
             200)):
        conn.request(method, path, headers=headers)
        resp = conn.getresponse()
        resp.read()
        assert resp.status == status, (method, path)
    conn.close()


def test_keys_file_is_read_again_on_sighup(cluster, material):
    new = new_api_key()
    path = Path(material.api_keys_file)
    creds = dict(ca=material.ca, client_cert=material.client.cert, client_key=material.client.key)

    def works(key: str) -> bool:
        with Client(cluster.gateway_target, api_key=key, **creds) as c:
            try:
                return c.generate("rotate", max_tokens=1, temperature=0, timeout=30).finish_reason == "length"
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAUTHENTICATED
                return False

    old = path.read_text()
    assert not works(new)
    try:
        path.write_text(old + new + "\n")
        os.kill(cluster.procs["gateway"].pid, signal.SIGHUP)
        wait_for(lambda: works(new), 10, "the new key to work")
        path.write_text(old)
        os.kill(cluster.procs["gateway"].pid, signal.SIGHUP)
        wait_for(lambda: not works(new), 10, "the removed key to be refused")
        assert works(material.api_key)
    finally:
        path.write_text(old)
    (Path(material.dir) / "retired-key").write_text(new)  # for the log check below


# -- limits ------------------------------------------------------------------------------------------
def _client(cluster, material) -> Client:
    return Client(cluster.gateway_target, api_key=material.api_key, ca=material.ca,
                  client_cert=material.client.cert, client_key=material.client.key)


def test_grpc_limits_refuse_naming_the_limit(cluster, material):
    r = _redis(cluster, material)
    try:
        with _client(cluster, material) as c:
            cases = [
                (dict(prompt="x" * 70_000), grpc.StatusCode.RESOURCE_EXHAUSTED, "65536"),
                (dict(prompt="x" * 2001), grpc.StatusCode.INVALID_ARGUMENT, "--max-prompt-chars"),
                (dict(prompt="x", stop=["a", "b", "c", "d", "e"]), grpc.StatusCode.INVALID_ARGUMENT, "--max-stop-strings"),
            ]
            for i, (kwargs, code, named) in enumerate(cases):
                prompt = kwargs.pop("prompt")
                with pytest.raises(grpc.RpcError) as info:
                    c.generate(prompt, max_tokens=2, request_id=f"limited-{i}", timeout=10, **kwargs)
                assert info.value.code() == code and named in info.value.details(), info.value.details()
                assert _traces(r, cluster.cfg.namespace, f"limited-{i}") == []
    finally:
        r.close()


def test_concurrent_streams_per_connection_are_bounded(cluster, material):
    with _client(cluster, material) as c, _client(cluster, material) as other:
        streams = [c.generate_stream(f"stream {i}", max_tokens=400, temperature=0, ignore_eos=True, timeout=60)
                   for i in range(2)]
        try:
            for s in streams:
                next(s)  # both are running
            with pytest.raises(grpc.RpcError) as info:
                c.generate("a third", max_tokens=2, timeout=10)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-concurrent-streams" in info.value.details()
            assert other.generate("another connection", max_tokens=2, temperature=0, ignore_eos=True,
                                  timeout=30).finish_reason == "length"
        finally:
            for s in streams:
                s.cancel()
    wait_for(lambda: _idle(cluster), 20, "the cancelled streams' blocks to be freed")


def test_http_limits_refuse_naming_the_limit(cluster, material):
    port = int(cluster.http_url.rsplit(":", 1)[1])
    ctx = client_context(material.ca, material.client.cert, material.client.key)
    auth = {"Authorization": f"Bearer {material.api_key}", "Content-Type": "application/json"}

    def post(body, chunked=False) -> tuple[int, dict]:
        conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=30)
        try:
            data = json.dumps(body).encode()
            if chunked:
                conn.request("POST", "/v1/completions", body=iter([data[i:i + 8192] for i in range(0, len(data), 8192)]),
                             headers=auth, encode_chunked=True)
            else:
                conn.request("POST", "/v1/completions", body=data, headers=auth)
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read() or b"{}")
        finally:
            conn.close()

    big = {"prompt": "x" * 70_000, "max_tokens": 2}
    for chunked in (False, True):
        status, body = post(big, chunked)
        assert status == 413 and "--max-request-bytes" in body["error"]["message"], body
    status, body = post({"prompt": ["a", "b"], "n": 3, "max_tokens": 1})
    assert status == 400 and body["error"]["param"] == "n" and "--max-choices" in body["error"]["message"]
    status, body = post({"prompt": "y" * 2001, "max_tokens": 1})
    assert status == 400 and "--max-prompt-chars" in body["error"]["message"]
    status, body = post({"prompt": "fine", "max_tokens": 2, "temperature": 0})
    assert status == 200 and body["choices"]


def test_generate_command_takes_key_and_ca(cluster, material):
    out = subprocess.run([sys.executable, "-m", "pagefleet", "generate", "--target", cluster.gateway_target,
                          "--ca", material.ca, "--client-cert", material.client.cert, "--client-key", material.client.key,
                          "--max-tokens", "3", "--temperature", "0", "hello"],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PAGEFLEET_API_KEY": material.api_key})
    assert out.returncode == 0, out.stderr
    assert "3 completion tokens" in out.stderr
    out = subprocess.run([sys.executable, "-m", "pagefleet", "generate", "--target", cluster.gateway_target,
                          "--ca", material.ca, "--client-cert", material.client.cert, "--client-key", material.client.key,
                          "hello"], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if k != "PAGEFLEET_API_KEY"})
    assert out.returncode == 1 and "UNAUTHENTICATED" in out.stderr


def test_no_key_or_password_in_any_log_line(cluster, material, log_dir):
    """Last in this module: every refusal and request above has been logged by now."""
    secrets = {"the API key": material.api_key, "a wrong key": WRONG_KEY, "the Redis password": material.redis_password}
    retired = Path(material.dir) / "retired-key"
    if retired.exists():
        secrets["a rotated key"] = retired.read_text()
    time.sleep(0.5)  # the last lines
    logs = sorted(log_dir.glob("*.log"))
    assert {p.stem for p in logs} >= {"gateway", "scheduler", "worker-0"}
    events = log_events(log_dir, "gateway")
    assert any(e["event"] == "auth.refused" for e in events), "the refusals were logged (without the keys)"
    for path in logs:
        text = path.read_text(errors="replace")
        for what, secret in secrets.items():
            assert secret not in text, f"{what} appears in {path.name}"


# -- pagefleet up --secure ---------------------------------------------------------------------------
def test_up_secure_prints_the_key_once_and_the_demo_uses_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PAGEFLEET_", "OTEL_"))}
    out = subprocess.run([sys.executable, "-m", "pagefleet", "up", "--secure", "--demo", "Hello there", "--demo-tokens",
                          "4", "--port", "0", "--http-port", "0", "--workers", "1", "--device", "cpu"],
                         capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    (secure,) = [line for line in lines if line.startswith("pagefleet secure:")]
    key = secure.split("API key ")[1].split()[0]
    ca = secure.split(" CA ")[1].split()[0]
    assert key.startswith("pf-") and (out.stdout + out.stderr).count(key) == 1
    (ready,) = [line for line in lines if line.startswith("pagefleet ready:")]
    assert "http https://" in ready and "completion tokens" in out.stdout
    assert not Path(ca).exists(), "the throwaway material is removed at exit"
