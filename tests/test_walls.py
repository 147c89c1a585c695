"""The walls between the parts: what importing each part loads (a fresh interpreter each)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN_IN_DOORS = ("torch", "triton", "transformers", "matplotlib", "pagefleet.worker", "pagefleet.kernels")


def _loaded_after(module: str) -> list[str]:
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.split()


@pytest.mark.parametrize("module", [
    "pagefleet.gateway.server", "pagefleet.scheduler.server", "pagefleet.client", "pagefleet.cli",
    "pagefleet.common",
])
def test_doors_and_scheduler_load_no_torch_and_no_worker(module):
    loaded = _loaded_after(module)
    bad = [m for m in loaded if m.split(".")[0] in FORBIDDEN_IN_DOORS or m.startswith(FORBIDDEN_IN_DOORS)]
    assert bad == [], f"importing {module} loads {bad[:8]}"


def _imports_of(folder: str) -> set[str]:
    """Every module name imported (absolutely or relatively) by the files of ``folder``."""
    names: set[str] = set()
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
    return names


def test_kernels_import_nothing_of_ours():
    ours = sorted(n for n in _imports_of("kernels") if n.startswith("pagefleet"))
    assert ours == []


def test_worker_imports_no_gateway_or_scheduler():
    ours = sorted(n for n in _imports_of("worker")
                  if n.startswith(("pagefleet.gateway", "pagefleet.scheduler")))
    assert ours == []


@pytest.mark.parametrize("folder", ["worker", "kernels", "gateway", "scheduler", "pagefleet/common"])
def test_serving_code_imports_no_benchmark_tools(folder):
    heavy = sorted(n for n in _imports_of(folder)
                   if n.split(".")[0] in ("transformers", "matplotlib") or n.startswith(("pagefleet.bench", "pagefleet.benchmarks")))
    assert heavy == []


def test_worker_and_kernels_load_no_gateway_or_scheduler():
    loaded = _loaded_after("pagefleet.worker.service")
    assert not [m for m in loaded if m.startswith(("pagefleet.gateway", "pagefleet.scheduler"))]
