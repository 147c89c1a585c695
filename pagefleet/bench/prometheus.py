"""Reading a component's ``/metrics`` in the benchmarks."""

from __future__ import annotations

import urllib.request


def scrape(url: str) -> dict[str, float]:
    """Prometheus text: ``name{labels}`` -> value (comments dropped); ``OSError`` if it does not answer."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
