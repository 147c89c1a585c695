"""``jit``: ``triton.jit`` with specialization options, where this Triton takes them."""

from __future__ import annotations

import inspect

import triton

_TAKES = frozenset(inspect.signature(triton.jit).parameters)


def jit(**options):
    """``triton.jit(**options)`` less the options this Triton does not know (an older one
    lacks ``do_not_specialize_on_alignment``: there a kernel only compiles more variants)."""
    return triton.jit(**{k: v for k, v in options.items() if k in _TAKES})
