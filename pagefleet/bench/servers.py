"""The servers ``pagefleet bench serve`` starts itself when it is given none.

* ``local_cluster``: a pagefleet cluster in this process's care (``LocalCluster``: Redis,
  scheduler, workers, gateway), for a run without ``--base-url``.
* ``pagefleet_up`` and ``transformers_serve``: whole servers started as their commands
  (``pagefleet up``, ``transformers serve``), each a subprocess in its own process group
  with its output in a log file, for ``--compare``. ``stop()`` ends the group (SIGTERM,
  then SIGKILL) and leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from pagefleet.common.service import free_port


class ServerProcess:
    """One server command running in its own process group; ``url``: its HTTP base.

    Ready when ``GET url + ready_path`` answers 200 and, if ``ready_text`` is given, the
    server has written that text to its log (``pagefleet up`` serves HTTP before its
    workers have reported; its ready line comes after)."""

    def __init__(self, name: str, cmd: list[str], url: str, ready_path: str, log_path: Path,
                 ready_text: str | None = None) -> None:
        self.name, self.cmd, self.url, self.ready_path, self.log_path = name, cmd, url, ready_path, log_path
        self.ready_text = ready_text
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 300.0) -> ServerProcess:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         start_new_session=True)
        try:
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout_s: float) -> None:
        """Until ready (see the class); RuntimeError if the process exits first."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before it was ready; "
                                   f"see {self.log_path}:\n{self.log_tail()}")
            if self.ready_text is None or self.ready_text in self.log_tail(1000):
                with (contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError),
                      urllib.request.urlopen(self.url + self.ready_path, timeout=2) as resp):
                    if resp.status == 200:
                        return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready within {timeout_s:.0f}s; see {self.log_path}")
            time.sleep(0.25)

    def log_tail(self, num_lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        return ""

    def stop(self, grace_s: float = 15.0) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group: whatever a child left behind too
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self.proc = None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def pagefleet_up(model: str, log_dir: Path, *, workers: int = 1, device: str = "cpu",
                 num_blocks: int | None = None) -> ServerProcess:
    """``pagefleet up --workers N --model DIR --http-port P``, measured through its OpenAI door."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagefleet", "up", "--workers", str(workers), "--model", model,
           "--device", device, "--port", "0", "--http-port", str(port), "--log-level", "warning"]
    if num_blocks:
        cmd += ["--num-blocks", str(num_blocks)]
    return ServerProcess("pagefleet", cmd, f"http://127.0.0.1:{port}", "/v1/models", log_dir / "pagefleet.log",
                         ready_text="pagefleet ready:")


def transformers_cli() -> str | None:
    """The ``transformers`` command of this Python's environment, else the one on PATH."""
    exe = Path(sys.executable).with_name("transformers")
    return str(exe) if exe.exists() else shutil.which("transformers")


def transformers_serve(model: str, log_dir: Path) -> ServerProcess:
    """``transformers serve --continuous-batching`` on the CPU in float32, the model preloaded.

    Ready on ``/health`` (its ``/v1/models`` lists the Hub cache, which fails when there is none)."""
    port = free_port()
    cmd = [transformers_cli() or "transformers", "serve",
           "--continuous-batching", "--device", "cpu", "--dtype", "float32",
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", model]
    return ServerProcess("transformers", cmd, f"http://127.0.0.1:{port}", "/health", log_dir / "transformers.log")


def local_cluster(model: str, *, workers: int = 1, device: str = "auto", num_blocks: int | None = None,
                  http: bool = False):
    """A started ``LocalCluster`` (its gRPC gateway at ``gateway_target``; ``http``: its
    OpenAI door too, at ``http_url``). The caller stops it."""
    from pagefleet.launcher import ClusterConfig, LocalCluster

    extra = {"http_port": 0} if http else {}
    try:
        cfg = ClusterConfig(port=0, num_workers=workers, model=model, device=device, log_level="warning",
                            worker_args=["--num-blocks", str(num_blocks)] if num_blocks else [], **extra)
    except TypeError as e:  # a launcher without the HTTP door
        raise RuntimeError(f"this pagefleet's LocalCluster has no OpenAI door ({e}); use --backend grpc") from e
    cluster = LocalCluster(cfg)
    try:
        return cluster.start()
    except BaseException:
        cluster.stop()
        raise
