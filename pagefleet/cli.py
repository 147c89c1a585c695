"""The ``pagefleet`` command.

Each subcommand lives in its own module and receives the rest of the command line,
so this file only routes: ``pagefleet <command> [args...]``.
"""

from __future__ import annotations

import importlib
import sys

# command -> (module, function, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "up": ("pagefleet.launcher", "main", "start a whole local cluster (redis, scheduler, workers, gateway)"),
    "gateway": ("pagefleet.gateway.server", "main", "run one gateway"),
    "scheduler": ("pagefleet.scheduler.server", "main", "run the scheduler"),
    "worker": ("pagefleet.worker.service", "main", "run one worker"),
    "generate": ("pagefleet.client", "main", "stream a generation from a running gateway"),
    "certs": ("pagefleet.common.certs", "main", "write a throwaway CA, certificates, an API key, a Redis password"),
    "models": ("pagefleet.worker.models.catalog", "main", "list the model architectures that load (or one checkpoint's)"),
    "run": ("pagefleet.demo", "main", "generate in-process (no cluster) and stream the tokens"),
    "bench": ("pagefleet.bench", "main", "benchmarks: `pagefleet bench --help` lists them"),
}


def _usage() -> str:
    lines = ["usage: pagefleet <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines.append("\n`pagefleet <command> --help` for a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from pagefleet import __version__

        print(f"pagefleet {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"pagefleet: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    try:
        return int(getattr(importlib.import_module(module), func)(rest) or 0)
    except Exception as e:
        # Redis refusing the process outright (a wrong password, a database index it does not
        # have, a missing permission): one line naming it, not a traceback of fifty.
        if not type(e).__module__.startswith("redis."):
            raise
        print(f"pagefleet {name}: Redis refused: {type(e).__name__}: {e} (see --redis-url)", file=sys.stderr)
        return 1
