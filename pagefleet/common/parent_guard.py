"""``python -m pagefleet.common.parent_guard PARENT_PID PROGRAM [ARGS...]``: run PROGRAM so that
it gets SIGTERM when process PARENT_PID (the one that started it) dies, however it dies.

Linux's ``PR_SET_PDEATHSIG`` is set here, in a process of its own, and kept across the
``exec`` of PROGRAM (Redis, or a pagefleet component): a parent with threads must not run
code between ``fork`` and ``exec`` (``preexec_fn``; a child of a process running gRPC's threads
crashed there). A parent already gone when the signal is set: PROGRAM is not run.
"""

from __future__ import annotations

import os
import sys

from pagefleet.common.service import PARENT_DEATH_SIGNAL


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit():
        print("usage: python -m pagefleet.common.parent_guard PARENT_PID PROGRAM [ARGS...]", file=sys.stderr)
        return 2
    if PARENT_DEATH_SIGNAL is not None:
        PARENT_DEATH_SIGNAL()
    if os.getppid() != int(argv[0]):
        return 1  # the parent died before the signal was set: nobody would stop PROGRAM
    os.execvp(argv[1], argv[1:])
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
