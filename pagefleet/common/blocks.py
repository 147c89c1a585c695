"""Block arithmetic and block keys, shared by the gateway, the scheduler and the worker."""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens: the ceiling of ``num_tokens / block_size``."""
    return -(-num_tokens // block_size)


# -- block keys (prefix caching) ---------------------------------------------------------------
_KEY_BYTES = 16
_PERSON = b"pagefleet-kv-v1"  # versioned: a change of the key scheme never matches old keys
# Each key starts from a copy of this: a copy costs a third of a new personalized hasher.
_EMPTY = hashlib.blake2b(digest_size=_KEY_BYTES, person=_PERSON)


def block_hashes(
    token_ids: Sequence[int], block_size: int, extra_key: bytes = b"", parent: bytes | None = None
) -> list[bytes]:
    """The keys of the full blocks of ``token_ids`` (a partial last block has none).

    ``key[i] = blake2b-128(key[i-1], the block's token ids, extra_key)``, starting from
    ``parent`` (``None``: the sequence starts here). Equal keys mean equal prefixes, so a
    block's K/V can be shared by every sequence whose key chain reaches it. The same on every
    process and machine (no salted ``hash()``); 128 bits, so nobody can craft a collision to
    read another request's cache. ``extra_key`` separates what changes K/V beyond the tokens
    (e.g. an adapter id).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    keys: list[bytes] = []
    prev = parent or b""
    ids = array("I", token_ids)
    if sys.byteorder != "little":
        ids.byteswap()
    raw = ids.tobytes()
    step = block_size * ids.itemsize
    empty = _EMPTY.copy
    for start in range(0, len(raw) - step + 1, step):
        h = empty()
        h.update(prev + raw[start:start + step] + extra_key)
        prev = h.digest()
        keys.append(prev)
    return keys
