"""``jit``: ``triton.jit`` with specialization options, where this Triton takes them."""

from __future__ import annotations

import inspect

import triton

_TAKES = frozenset(inspect.signature(triton.jit).parameters)


def jit(**options):
    """``triton.jit(**options)``. A Triton without ``do_not_specialize_on_alignment`` gets
    those arguments in ``do_not_specialize`` instead (which there covers alignment too)."""
    if "do_not_specialize_on_alignment" not in _TAKES:
        unaligned = options.pop("do_not_specialize_on_alignment", [])
        options["do_not_specialize"] = [*options.get("do_not_specialize", []), *unaligned]
    return triton.jit(**{k: v for k, v in options.items() if k in _TAKES})
