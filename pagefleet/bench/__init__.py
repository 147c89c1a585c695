"""The benchmarks, kept apart from the serving packages; ``pagefleet bench <suite>`` routes here."""

from __future__ import annotations

import importlib
import sys

SUITES = {
    "decode": "pagefleet.bench.decode",
    "engine": "pagefleet.bench.engine",
    "kernels": "pagefleet.bench.kernels",
    "preemption": "pagefleet.bench.preemption",
    "scheduler": "pagefleet.bench.scheduler",
    "reliability": "pagefleet.bench.reliability",
    "serve": "pagefleet.bench.serve",
    "sim-fit": "pagefleet.bench.sim_fit",
    "study": "pagefleet.bench.study",
    "token-path": "pagefleet.bench.token_path",
    "structured": "pagefleet.bench.structured",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in SUITES:
        print(f"usage: pagefleet bench {{{'|'.join(SUITES)}}} [options]", file=sys.stderr)
        return 2
    return int(importlib.import_module(SUITES[argv[0]]).main(argv[1:]) or 0)
