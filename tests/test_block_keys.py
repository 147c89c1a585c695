"""The prefix-caching block keys: one scheme on every process (gateway, scheduler, workers)."""

from __future__ import annotations

import hashlib
import struct

import pytest

from pagefleet.common.blocks import block_hashes


def _reference(token_ids: list[int], block_size: int, extra_key: bytes = b"", parent: bytes | None = None):
    """The documented chain, written out: blake2b-128 personalized ``pagefleet-kv-v1`` over the
    parent key, the block's token ids (uint32, little-endian) and ``extra_key``."""
    keys, prev = [], parent or b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        data = struct.pack(f"<{block_size}I", *token_ids[start:start + block_size])
        prev = hashlib.blake2b(prev + data + extra_key, digest_size=16, person=b"pagefleet-kv-v1").digest()
        keys.append(prev)
    return keys


@pytest.mark.parametrize("n, bs, extra", [(0, 4, b""), (3, 4, b""), (64, 16, b""), (70, 16, b"lora:7"), (33, 1, b"")])
def test_block_keys_follow_the_documented_chain(n, bs, extra):
    ids = [(i * 2654435761) % 200_000 for i in range(n)]
    assert block_hashes(ids, bs, extra) == _reference(ids, bs, extra)


def test_a_chain_continues_from_its_parent():
    ids = list(range(1, 49))
    whole = block_hashes(ids, 16)
    assert block_hashes(ids[16:], 16, parent=whole[0]) == whole[1:]
    assert len(set(whole)) == 3 and all(len(k) == 16 for k in whole)


def test_a_bad_block_size_is_refused():
    with pytest.raises(ValueError, match="block_size must be at least 1"):
        block_hashes([1, 2, 3], 0)
