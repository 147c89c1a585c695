"""What every study's JSON starts with, and the small option parsers the studies share."""

from __future__ import annotations

import datetime as dt
import os
import platform


def machine(**extra) -> dict:
    """Where it ran: platform, CPUs, Python, and what the study adds (torch, GPU, threads)."""
    return {"platform": platform.platform(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), **extra}


def header(benchmark: str, command: str = "", **machine_extra) -> dict:
    """The first keys of a study's JSON: ``benchmark``, ``date`` (UTC), ``command``, ``machine``."""
    out = {"benchmark": benchmark, "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")}
    if command:
        out["command"] = command
    out["machine"] = machine(**machine_extra)
    return out


def int_list(text: str) -> list[int]:
    """A comma-separated option's integers (``--workers 16,64``)."""
    return [int(x) for x in text.split(",") if x]
