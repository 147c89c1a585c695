"""``pagefleet bench <suite>``: routes to each suite's own benchmark module."""

from __future__ import annotations

import importlib
import sys

SUITES = {
    "engine": "pagefleet.worker.bench",
    "kernels": "pagefleet.kernels.bench",
    "preemption": "pagefleet.worker.bench_preemption",
    "serve": "pagefleet.bench_serve",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in SUITES:
        print(f"usage: pagefleet bench {{{'|'.join(SUITES)}}} [options]", file=sys.stderr)
        return 2
    return int(importlib.import_module(SUITES[argv[0]]).main(argv[1:]) or 0)
