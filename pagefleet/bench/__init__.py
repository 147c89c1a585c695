"""``pagefleet bench <suite>``: what users run here (``serve``, ``sim-fit``); the studies live in
``pagefleet.benchmarks`` (the top-level ``benchmarks/`` folder) and are routed to by name."""

from __future__ import annotations

import importlib
import sys

SUITES = {
    "decode": "pagefleet.benchmarks.decode",
    "drain": "pagefleet.benchmarks.drain",
    "engine": "pagefleet.benchmarks.engine",
    "host-path": "pagefleet.benchmarks.host_path",
    "kernels": "pagefleet.benchmarks.kernels",
    "migration": "pagefleet.benchmarks.migration",
    "preemption": "pagefleet.benchmarks.preemption",
    "scheduler": "pagefleet.benchmarks.fleet.scheduler",
    "reliability": "pagefleet.benchmarks.reliability",
    "serve": "pagefleet.bench.serve",
    "sim-fit": "pagefleet.bench.sim_fit",
    "study": "pagefleet.benchmarks.fleet.study",
    "token-path": "pagefleet.bench.token_path",
    "structured": "pagefleet.bench.structured",
}


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(f"usage: pagefleet bench {{{'|'.join(SUITES)}}} [options]\n\n"
              "`pagefleet bench <suite> --help` for a suite's options.")
        return 0
    if not argv or argv[0] not in SUITES:
        print(f"usage: pagefleet bench {{{'|'.join(SUITES)}}} [options]", file=sys.stderr)
        return 2
    return int(importlib.import_module(SUITES[argv[0]]).main(argv[1:]) or 0)
