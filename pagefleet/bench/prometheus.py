"""Reading a component's ``/metrics`` in the benchmarks."""

from __future__ import annotations

import re
import urllib.request


def scrape(url: str) -> dict[str, float]:
    """Prometheus text: ``name{labels}`` -> value (comments dropped); ``OSError`` if it does not answer."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            name = without_shard_labels(name)
            out[name] = out.get(name, 0.0) + float(value)
    return out


_SHARD_LABEL = re.compile(r'(model|shard)="(?:[^"\\]|\\.)*",?')


def without_shard_labels(name: str) -> str:
    """``name{labels}`` without its ``model`` and ``shard`` labels (a scheduler's and a worker's
    samples carry them): a bench sums a fleet's shards."""
    if "{" not in name:
        return name
    base, _, rest = name.partition("{")
    labels = _SHARD_LABEL.sub("", rest[:-1]).rstrip(",")
    return f"{base}{{{labels}}}" if labels else base
