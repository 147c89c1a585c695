"""What every pagefleet process shares: flags from the environment, logs, health, ports.

Every flag ``--some-flag`` of a component can also be set with the environment variable
``PAGEFLEET_SOME_FLAG`` (the command line wins). Metrics (a later addition) get their
place here too: one ``add_*`` helper that every server calls.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import random
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterable

ENV_PREFIX = "PAGEFLEET_"
_PR_SET_NAME = 15


@functools.lru_cache(maxsize=1)
def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` where the OS shows it (``/proc/<pid>/task/<tid>/comm``,
    ``top -H``, ``perf``, ``bench token-path``'s CPU by thread): Python's thread names are its own.
    Linux only (15 bytes kept); elsewhere nothing. A thread started from this one starts with its
    name (torch's CPU threads started by the engine thread show as ``engine``) until it names itself."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        _libc().prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def env_name(flag: str) -> str:
    """``--max-queue`` -> ``PAGEFLEET_MAX_QUEUE``."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off", "")


class EnvArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose optional flags default to ``PAGEFLEET_<FLAG>`` when set.

    The help text of every flag names its variable, so ``--help`` is the list.
    """

    def add_argument(self, *names, **kwargs):  # noqa: D401 - argparse signature
        long = next((n for n in names if n.startswith("--")), None)
        if long is None or long == "--help":
            return super().add_argument(*names, **kwargs)
        var = env_name(long)
        kwargs["help"] = f"{kwargs.get('help', '')} [env {var}]".strip()
        raw = os.environ.get(var)
        if raw is not None:
            action = kwargs.get("action")
            # A bad value is the flag's error, as on the command line (usage, exit 2), not a traceback.
            if action in ("store_true", argparse.BooleanOptionalAction):
                word = raw.strip().lower()
                if word not in _TRUE_WORDS + _FALSE_WORDS:
                    self.error(f"{var}={raw!r}: one of {', '.join(_TRUE_WORDS + _FALSE_WORDS)}")
                kwargs["default"] = word in _TRUE_WORDS
            elif action == "append":  # a comma-separated list, which values on the command line replace
                conv = kwargs.get("type", str)
                # Values with commas of their own (--shards MODEL=S1,S2) are separated by ';', or
                # for such a flag each NAME= starts the next (PAGEFLEET_SHARDS=a=s0,s1,b=s2).
                sep = ";" if ";" in raw else ","
                pieces = [v.strip() for v in raw.split(sep) if v.strip()]
                if long in _NAMED_LISTS and sep == ",":
                    pieces = _named_groups(pieces)
                try:
                    kwargs["default"] = [conv(v) for v in pieces]
                except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
                    self.error(f"{var}={raw!r}: {e}")
                bad = [v for v in kwargs["default"] if kwargs.get("choices") and v not in kwargs["choices"]]
                if bad:
                    self.error(f"{var}={raw!r}: {bad[0]!r} is not one of {', '.join(kwargs['choices'])}")
                kwargs["action"] = _AppendOverDefault
            else:
                conv = kwargs.get("type", str)
                try:
                    kwargs["default"] = conv(raw)
                except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
                    self.error(f"{var}={raw!r}: {e}")
                if kwargs.get("choices") and kwargs["default"] not in kwargs["choices"]:
                    self.error(f"{var}={raw!r}: not one of {', '.join(map(str, kwargs['choices']))}")
        return super().add_argument(*names, **kwargs)


# Listed flags whose values are NAME=A,B: their variable's comma-separated pieces are grouped by NAME=.
_NAMED_LISTS = frozenset({"--shards"})


def _named_groups(pieces: list[str]) -> list[str]:
    """``["a=s0", "s1", "b=s2"]`` -> ``["a=s0,s1", "b=s2"]``."""
    out: list[str] = []
    for p in pieces:
        if "=" not in p and out:
            out[-1] += "," + p
        else:
            out.append(p)
    return out


class _AppendOverDefault(argparse.Action):
    """``action="append"`` whose first value on the command line replaces the default (the
    environment's list) instead of extending it: the command line wins."""

    def __call__(self, parser, namespace, values, option_string=None):
        items = getattr(namespace, self.dest, None)
        items = [] if items is None or items is self.default else list(items)
        setattr(namespace, self.dest, [*items, values])


METRICS_PORT_HELP = "serve Prometheus /metrics on this port (0: any free port; default: off)"


def add_common_flags(parser: argparse.ArgumentParser, metrics_help: str = METRICS_PORT_HELP) -> None:
    """``--log-level``, ``--log-format``, ``--metrics-port`` (``metrics_help``: its help text) and
    ``--otlp-traces-endpoint``."""
    parser.add_argument("--log-level", default="info", type=str.lower,
                        choices=("debug", "info", "warning", "error", "critical"), help="how much to log")
    parser.add_argument("--log-format", default="auto", choices=("auto", "json", "console"),
                        help="json for machines; auto picks console on a terminal")
    parser.add_argument("--metrics-port", type=int, default=None, metavar="N", help=metrics_help)
    parser.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                        help="export OpenTelemetry traces to this OTLP endpoint (as OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; "
                             "gRPC unless OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf; the other OTEL_* variables apply)")


def setup_logging(component: str, args) -> None:
    """Logs as ``pagefleet.common.log`` sets them up, at the level and format of the flags; and
    tracing, when the ``OTEL_*`` variables ask for it (``pagefleet.common.telemetry``); a
    process of one shard (``--shard``) names it and its model on every span."""
    from pagefleet.common import telemetry
    from pagefleet.common.log import configure_logging

    configure_logging(component, level=args.log_level, fmt=args.log_format)
    telemetry.set_traces_endpoint(getattr(args, "otlp_traces_endpoint", None))
    telemetry.setup_tracing(component, attributes=shard_attributes(args))


def shard_attributes(args) -> dict[str, str]:
    """The shard and model of a one-shard process (a scheduler, a worker), from its flags."""
    shard = getattr(args, "shard", None)
    if not isinstance(shard, str):
        return {}
    from pagefleet.common import telemetry

    model = getattr(args, "served_model_name", None) or getattr(args, "model", None)
    return {telemetry.SHARD: shard, **({telemetry.MODEL: model} if isinstance(model, str) else {})}


def freeze_startup_heap() -> None:
    """Move every object alive now (modules, the model, the servers) out of the garbage
    collector's sight: a full collection then scans only what serving allocated, not the
    import-time heap (torch alone is ~190k objects, 70 ms a full collection). Call once, when
    a process is ready to serve; its objects still die by reference counting (as vLLM's
    engine core does after its start-up)."""
    import gc

    gc.collect()
    gc.freeze()


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for ports it hands out to ``bind(0)`` and outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now (another process may still take it before you bind).

    Drawn at random below the kernel's ephemeral range where there is room (10,000-32,767
    on Linux's default), so that no ``bind(0)`` or outgoing connection of another process
    (a peer's server on port 0, a client socket, UCX) is handed the same port meanwhile;
    else, or if 64 draws are taken, a port the kernel picks. Never one this process was handed
    in its last ``_RECENT`` calls: a cluster's ports are all drawn before any of its processes
    binds one (a scheduler and a gateway given the same port: one of them failed to start)."""
    low, _ = _ephemeral_ports()
    if low > 11_000:
        rng = random.SystemRandom()
        for _ in range(64):
            port = rng.randrange(10_000, low)
            if port in _handed_out:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            return _hand_out(port)
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            break
    return _hand_out(port)


_RECENT = 4096
_handed_out: dict[int, None] = {}  # the ports free_port returned lately, oldest first
_handed_out_lock = threading.Lock()


def _hand_out(port: int) -> int:
    with _handed_out_lock:
        _handed_out[port] = None
        if len(_handed_out) > _RECENT:
            del _handed_out[next(iter(_handed_out))]
    return port


# Long generations can stay silent (no message) for a while: ping, and let clients ping.
SERVER_OPTIONS = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 << 20),
    # Calls that arrived but that the server has not taken up yet: past grpc's default of 1,000
    # it fails new ones with CANCELLED (a burst of 2,000 streams lost ~9 % of them that way,
    # on a trivial servicer too). The bound on open calls is the gateway's own (--max-queue,
    # --max-concurrent-streams per connection), not this one.
    ("grpc.server.max_pending_requests", 65_536),
    ("grpc.server.max_pending_requests_hard_limit", 131_072),
    # grpc binds with SO_REUSEPORT unless told not to: a second server given a port already in
    # use (a free_port() race, a mistyped flag) would then bind it too and take half its
    # connections silently ("Method not found" for the first's clients). Bind alone; only
    # the gateway's --processes share a port, on purpose (server_options(reuse_port=True)).
    ("grpc.so_reuseport", 0),
]
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 << 20),
]


def add_health_and_reflection(server, service_names: Iterable[str]):
    """Register ``grpc.health.v1.Health`` and reflection; the health servicer (all NOT_SERVING)."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    names = list(service_names)
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return servicer, names, health_pb2.HealthCheckResponse


def server_options(*, max_receive_message_length: int | None = None,
                   max_concurrent_streams: int | None = None, reuse_port: bool = False) -> list[tuple[str, int]]:
    """``SERVER_OPTIONS`` with a different bound on a received message, a bound on the
    streams one connection may have open at once (None: as ``SERVER_OPTIONS``: none), and
    ``reuse_port``: bind with ``SO_REUSEPORT``, sharing the port with other processes."""
    replaced = {"grpc.so_reuseport"} | ({"grpc.max_receive_message_length"} if max_receive_message_length is not None else set())
    options = [o for o in SERVER_OPTIONS if o[0] not in replaced]
    options.append(("grpc.so_reuseport", int(reuse_port)))
    if max_receive_message_length is not None:
        options.append(("grpc.max_receive_message_length", max_receive_message_length))
    if max_concurrent_streams is not None:
        options.append(("grpc.max_concurrent_streams", max_concurrent_streams))
    return options


def add_door_flags(parser: argparse.ArgumentParser, open_choices: Iterable[str]) -> None:
    """``--health-port`` and ``--no-auth-for`` (``open_choices``: what it may open)."""
    choices = tuple(open_choices)
    parser.add_argument("--health-port", type=int, default=None, metavar="N",
                        help="also serve grpc.health.v1.Health alone, in plaintext, on this port: for probes "
                             "that cannot speak TLS or show a certificate, like the kubelet's (default: off)")
    parser.add_argument("--no-auth-for", action="append", default=None, choices=choices, metavar="|".join(choices),
                        help="serve this without the API key or client certificate the other calls need "
                             "(repeatable; TLS stays on; health is always open)")


def open_to_all(args, what: str) -> bool:
    """Whether ``--no-auth-for`` names ``what`` (reflection, metrics)."""
    return what in (getattr(args, "no_auth_for", None) or ())


async def start_health_port(health_servicer, host: str, port: int | None, reuse_port: bool = False):
    """A second gRPC server with only ``health_servicer``, in plaintext on ``host:port``; None
    when ``port`` is None. It reports what the main port's servicer reports. ``reuse_port``:
    shared with other processes (the gateway's ``--processes``, as its main port)."""
    if port is None:
        return None
    import grpc
    import structlog
    from grpc_health.v1 import health_pb2_grpc

    server = grpc.aio.server(options=server_options(reuse_port=reuse_port))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    structlog.get_logger("service").info("health.serving", host=host, health_port=bound)
    return server


async def set_serving(health_servicer, names: Iterable[str], serving: bool) -> None:
    from grpc_health.v1 import health_pb2

    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", *names):
        await health_servicer.set(name, status)


def _parent_death_signal() -> Callable[[], object] | None:
    """Linux's ``prctl(PR_SET_PDEATHSIG, SIGTERM)``, bound here (None elsewhere): a child a
    process starts is sent SIGTERM when that process dies, however it dies (SIGKILL, a closed
    terminal): a child left behind serves on, with ports, keys and metrics no one manages."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


PARENT_DEATH_SIGNAL = _parent_death_signal()


def guarded_argv(argv: list[str]) -> list[str]:
    """``argv`` started so that it dies with this process, however this one dies
    (``pagefleet.common.parent_guard``: ``PR_SET_PDEATHSIG`` set in a process of its own, then
    ``exec``; safe from a process with threads, unlike ``die_with_parent``). ``argv`` as it is
    where the signal does not exist."""
    if PARENT_DEATH_SIGNAL is None:
        return argv
    return [sys.executable, "-m", "pagefleet.common.parent_guard", str(os.getpid()), *argv]


def die_with_parent(ignore_sighup: bool = False, parent: int | None = None) -> Callable[[], None]:
    """A ``preexec_fn`` for children of a process with no other thread (``preexec_fn`` is not
    safe with threads: ``guarded_argv`` is; the signal follows the thread that started the
    child): each gets SIGTERM when this process dies, and
    one whose parent (``parent``, this process by default) died before the call exits at once.
    ``ignore_sighup``: SIGHUP ignored until the child installs its own handler."""
    parent = os.getpid() if parent is None else parent

    def preexec() -> None:
        if ignore_sighup:
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
        if PARENT_DEATH_SIGNAL is not None:
            PARENT_DEATH_SIGNAL()
            if os.getppid() != parent:
                os._exit(1)

    return preexec
