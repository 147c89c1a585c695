"""``pagefleet gateway --processes N``: N gateway processes on one host, sharing its ports.

A gateway is stateless (everything a request needs is in Redis), so one host can run as many
as it has cores for. This process supervises: it takes the ports first (``0``: a free one),
starts N children (``pagefleet gateway`` with the same flags and the ports it took), each
binding them with ``SO_REUSEPORT`` so the kernel spreads connections over them, restarts a
child that dies, passes SIGHUP on (the children reload their keys), and stops them all on
SIGTERM or SIGINT; a child dies with it however it dies (``PR_SET_PDEATHSIG`` on Linux). It serves ``/metrics``
(``--metrics-port``) alone, summed over the children with prometheus-client's multiprocess
mode (``PROMETHEUS_MULTIPROC_DIR``, a temp dir it owns): counters and histograms add up,
the in-flight gauge is the sum of the live children's.

Any child relays any request and takes any ``Cancel``: a retry of the same request id
through another child replays it from Redis, and a cancel is an entry in the requests stream.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import structlog

from pagefleet.common.service import die_with_parent

log = structlog.get_logger("gateway.processes")

# A child that dies is restarted after this long (doubling to RESTART_MAX_S while it keeps dying).
RESTART_S = 0.5
RESTART_MAX_S = 10.0
RESTART_RESET_S = 30.0  # a child that ran this long before it died starts the doubling afresh
MAX_EARLY_EXITS = 3  # exits at start a child, none having run RESTART_RESET_S: the supervisor gives up
METRICS_DIR_PREFIX = "pagefleet-gateway-metrics-"
MAX_PROCESSES = 256  # --processes: one host's gateway processes (each a Python process of ~100 MiB)


_SUPERVISOR = os.getpid()  # set again by ``supervise`` (the process that forks the children)


def _die_with_parent() -> None:
    """Run in the child before it execs (``preexec_fn``): ``die_with_parent``'s, for the
    supervisor (SIGHUP ignored until the gateway installs its own handler: passed on while a
    child starts, its default action would end it)."""
    die_with_parent(ignore_sighup=True, parent=_SUPERVISOR)()


def reserve_port(host: str, port: int) -> tuple[socket.socket, int]:
    """A socket bound to ``host:port`` with ``SO_REUSEPORT`` (port 0: a free one), held so the
    port stays ours while the children bind it too; and the bound port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if port:
        # Free, not only shareable: a port another supervisor (another cluster, perhaps) holds
        # with SO_REUSEPORT would take it too, and the kernel would split the clients between them.
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as e:
                raise SystemExit(f"pagefleet gateway: error: port {port} on {host} is taken: {e.strerror}") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock, sock.getsockname()[1]


def _child_argv(argv: list[str], port: int, http_port: int | None, health_port: int | None = None) -> list[str]:
    """``argv`` without --processes, --metrics-port and the ports, then the ports taken."""
    out, skip = [], False
    drop = ("--processes", "--metrics-port", "--port", "--http-port", "--health-port")
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in drop:
            skip = "=" not in a
            continue
        out.append(a)
    out += ["--port", str(port), "--processes", "1", "--reuse-port"]
    if http_port is not None:
        out += ["--http-port", str(http_port)]
    if health_port is not None:
        out += ["--health-port", str(health_port)]
    return out


_KILLED = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT)


def forget_metrics_dir() -> None:
    """Remove this child's metrics dir (``PROMETHEUS_MULTIPROC_DIR``) as it exits after its
    supervisor died without removing it (SIGKILL); the children that go with it race to, harmlessly."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR", "")
    if os.path.basename(path).startswith(METRICS_DIR_PREFIX):  # only a dir of ours
        shutil.rmtree(path, ignore_errors=True)


def supervise(args, argv: list[str]) -> int:
    """Run ``args.processes`` gateways until SIGTERM/SIGINT (see the module docstring)."""
    from prometheus_client import CollectorRegistry
    from prometheus_client import multiprocess as prom_mp

    from pagefleet.common.metrics import serve_metrics

    from .guard import Doors

    global _SUPERVISOR
    _SUPERVISOR = os.getpid()
    held = []
    sock, port = reserve_port(args.host, args.port)
    held.append(sock)
    http_port = None
    if args.http_port is not None:
        sock, http_port = reserve_port(args.host, args.http_port)
        held.append(sock)
    health_port = None  # shared as the others (each child bound it alone, and all but one died in a loop)
    if getattr(args, "health_port", None) is not None:
        sock, health_port = reserve_port(args.host, args.health_port)
        held.append(sock)
    metrics_dir = tempfile.mkdtemp(prefix=METRICS_DIR_PREFIX)
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=metrics_dir)
    for name in ("PAGEFLEET_METRICS_PORT", "PAGEFLEET_PROCESSES", "PAGEFLEET_PORT", "PAGEFLEET_HTTP_PORT",
                 "PAGEFLEET_HEALTH_PORT"):
        env.pop(name, None)
    registry = CollectorRegistry()
    prom_mp.MultiProcessCollector(registry, path=metrics_dir)
    serve_metrics(args, registry, "gateway", **Doors.from_args(args).metrics_guard())
    cmd = [sys.executable, "-m", "pagefleet", "gateway", *_child_argv(argv, port, http_port, health_port)]
    stop = False
    children: list[subprocess.Popen | None] = [None] * args.processes

    def on_signal(signum, frame):
        nonlocal stop
        stop = True

    def on_hangup(signum, frame):  # the children reload their keys (OPERATIONS.md): pass it on
        for c in children:
            if c is not None and c.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    c.send_signal(signal.SIGHUP)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    signal.signal(signal.SIGHUP, on_hangup)
    delays = [RESTART_S] * args.processes
    next_start = [0.0] * args.processes
    started = [0.0] * args.processes
    # Children that exit at start (a model that cannot load, a flag they refuse) would be
    # restarted for ever: past a few exits each, with none ever having run a while, give up.
    early_exits, ever_ran = 0, False
    rc = 0
    log.info("gateway.supervising", processes=args.processes, port=port, http_port=http_port)
    try:
        while not stop:
            now = time.monotonic()
            for i, child in enumerate(children):
                if child is not None and child.poll() is not None:
                    log.warning("gateway.process_exited", index=i, pid=child.pid, code=child.returncode)
                    prom_mp.mark_process_dead(child.pid, path=metrics_dir)
                    children[i] = None
                    if now - started[i] > RESTART_RESET_S:  # it had run a while: not a crash loop
                        delays[i] = RESTART_S
                        ever_ran = True
                    elif not ever_ran and -child.returncode not in _KILLED:
                        # It failed by itself (an error it logged, a crash). One killed from outside
                        # (an operator's kill -9, the OOM killer, a SIGTERM) says nothing of the
                        # others: a few young children killed so stopped every healthy one too.
                        early_exits += 1
                        if early_exits >= MAX_EARLY_EXITS * args.processes:
                            log.error("gateway.processes_never_started", exits=early_exits,
                                      hint="each exited at start: see its error above")
                            rc = 1
                            stop = True
                            break
                    next_start[i] = now + delays[i]
                    delays[i] = min(delays[i] * 2, RESTART_MAX_S)
                if children[i] is None and now >= next_start[i]:
                    children[i] = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
                    started[i] = now
            time.sleep(0.1)
    finally:
        live = [c for c in children if c is not None and c.poll() is None]
        for c in live:
            with contextlib.suppress(ProcessLookupError):
                c.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + getattr(args, "shutdown_grace", 0) + 8  # their streams' grace, then stop
        for c in live:
            try:
                c.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.kill()
                c.wait(5)
        for s in held:
            s.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    log.info("gateway.stopped", processes=args.processes)
    return rc
