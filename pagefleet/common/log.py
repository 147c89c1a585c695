"""Structured logs for every pagefleet service (structlog).

One JSON object per line on stderr with ``timestamp``, ``level``, ``event``, ``component``,
whatever was bound (``request_id``...), and ``trace_id`` / ``span_id`` when logged inside
a span; a coloured console format instead when stderr is a terminal. Standard-library
loggers (grpc, redis, asyncio) go through the same renderer.

    from pagefleet.common.log import configure_logging, get_logger
    configure_logging("gateway")
    log = get_logger(__name__)
    log.info("request_enqueued", request_id=rid, num_prompt_tokens=12)

``PAGEFLEET_LOG_LEVEL`` (default ``info``) and ``PAGEFLEET_LOG_FORMAT`` (``json``,
``console`` or ``auto``) override the defaults. Bind per-request fields for a block
of code with :func:`bound`.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

import structlog

from pagefleet.common import telemetry

__all__ = ["bound", "configure_logging", "get_logger"]

FORMATS = ("auto", "json", "console")


def _add_trace_ids(_logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
    ids = telemetry.current_ids()
    if ids is not None:
        event.setdefault("trace_id", ids[0])
        event.setdefault("span_id", ids[1])
    return event


def _add_component(component: str):
    def processor(_logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
        event.setdefault("component", component)
        return event

    return processor


def configure_logging(
    component: str,
    *,
    level: str | None = None,
    fmt: str | None = None,
    stream: TextIO | None = None,
) -> None:
    """Set up structlog and the standard ``logging`` root for this process.

    ``fmt`` is ``json``, ``console`` or ``auto`` (console when ``stream`` is a terminal).
    """
    stream = sys.stderr if stream is None else stream
    level = (level or os.environ.get("PAGEFLEET_LOG_LEVEL") or "info").upper()
    fmt = (fmt or os.environ.get("PAGEFLEET_LOG_FORMAT") or "auto").lower()
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    if level not in logging.getLevelNamesMapping():
        raise ValueError(f"log level {level!r} is not a logging level")
    if fmt == "auto":
        fmt = "console" if stream.isatty() else "json"
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_component(component),
        _add_trace_ids,
    ]
    if fmt == "json":
        renderer: Any = structlog.processors.JSONRenderer()
        tail = [structlog.processors.dict_tracebacks]
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=stream.isatty())
        tail = []
    structlog.configure(
        # Below the level, an event is dropped before any processor runs (not after them all).
        processors=[structlog.stdlib.filter_by_level, *shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.ExtraAdder(), *shared],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            *tail,
            renderer,
        ],
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)


def get_logger(name: str | None = None, **bound_fields: Any) -> structlog.stdlib.BoundLogger:
    return structlog.stdlib.get_logger(name, **bound_fields)


@contextmanager
def bound(**fields: Any) -> Iterator[None]:
    """Bind ``fields`` (e.g. ``request_id``) to every log line inside the block."""
    with structlog.contextvars.bound_contextvars(**fields):
        yield
