"""Paged-KV kernels against the plain-torch reference, and the reference against a naive loop.

Without a GPU the Triton kernels run on CPU tensors in Triton's interpreter. Triton reads
``TRITON_INTERPRET`` when a kernel is *decorated*, so it is set here before the kernels
module is imported (and the module is reloaded if another test imported it first). With a
GPU the same tests run the compiled kernels on CUDA.
"""

from __future__ import annotations

import importlib
import itertools
import json
import math
import os

import pytest
import torch

_HAS_CUDA = torch.cuda.is_available()
if not _HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from pagefleet.kernels import paged_attention, triton_ops, write_kv  # noqa: E402
from pagefleet.kernels.reference import paged_attention_ref, write_kv_ref  # noqa: E402

if not _HAS_CUDA and not isinstance(triton_ops._write_kv_kernel, InterpretedFunction):
    triton_ops = importlib.reload(triton_ops)  # decorated before the interpreter was switched on

DEVICE = "cuda" if _HAS_CUDA else "cpu"
TOL = {
    torch.float32: dict(atol=2e-4, rtol=2e-4),
    torch.float16: dict(atol=4e-3, rtol=1e-2),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


# ---------------------------------------------------------------------------- batch builder


def make_batch(
    seqs: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str = DEVICE,
    pad_rows: int = 0,
    seed: int = 0,
) -> dict:
    """A step over ``seqs`` = [(seq_len, q_len), ...] with blocks scattered in a larger pool.

    Unused block-table entries hold -1; ``pad_rows`` extra query rows follow the last
    sequence's queries (padding a kernel must not read as anyone's).
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(seq_len / block_size) for seq_len, _ in seqs]
    num_blocks = 2 * sum(blocks_per_seq) + 3
    pool = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((len(seqs), max(blocks_per_seq + [1])), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = pool[used : used + n]
        used += n
    q_lens = [q_len for _, q_len in seqs]
    query_start_loc = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    num_tokens = int(query_start_loc[-1]) + pad_rows
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return dict(
        query=torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(device, dtype),
        key_cache=torch.randn(cache_shape, generator=gen).to(device, dtype),
        value_cache=torch.randn(cache_shape, generator=gen).to(device, dtype),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor([s for s, _ in seqs], dtype=torch.int32, device=device),
        query_start_loc=query_start_loc.to(device),
        scale=head_dim**-0.5,
    )


def mixed_seqs(bs: int) -> list[tuple[int, int]]:
    """Decode rows and prefill chunks over the context lengths that find off-by-ones."""
    return [
        (1, 1),  # first token: decode over a context of one
        (bs - 1, 1),
        (bs, bs),  # whole prompt in one chunk, exactly one block
        (bs + 1, 1),
        (5 * bs + 3, 7),  # chunk after a cached prefix, ending mid-block
        (bs + 2, 0),  # in the batch but without queries this step
        (80, 67),  # chunk longer than one query tile
        (3 * bs, 2),
    ]


def decode_seqs(bs: int) -> list[tuple[int, int]]:
    return [(1, 1), (bs - 1, 1), (bs, 1), (bs + 1, 1), (6 * bs + 5, 1)]


def run_both(batch: dict, num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    num_rows = int(batch["query_start_loc"][-1])
    out = triton_ops.paged_attention_triton(**batch, num_splits=num_splits)
    ref = paged_attention_ref(**{k: v.cpu() if torch.is_tensor(v) else v for k, v in batch.items()})
    return out[:num_rows].cpu().float(), ref[:num_rows].float()


# ---------------------------------------------------------------------------- the reference


def naive_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                    window=None, soft_cap=None, sinks=None):
    """Per token, per head, in float64: walk the block table one position at a time."""
    num_tokens, num_heads, head_dim = query.shape
    group = num_heads // key_cache.shape[2]
    block_size = key_cache.shape[1]
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float64)
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = query_start_loc[i].item(), query_start_loc[i + 1].item()
        for t in range(start, end):
            pos = seq_len - (end - t)  # the query's own position in its sequence
            for h in range(num_heads):
                keys, values = [], []
                first = 0 if window is None else max(0, pos - window + 1)
                for j in range(first, pos + 1):
                    block = block_tables[i, j // block_size].item()
                    keys.append(key_cache[block, j % block_size, h // group].double())
                    values.append(value_cache[block, j % block_size, h // group].double())
                scores = torch.stack(keys) @ query[t, h].double() * scale
                if soft_cap is not None:
                    scores = soft_cap * torch.tanh(scores / soft_cap)
                if sinks is not None:  # one more logit, with no value
                    scores = torch.cat([scores, sinks[h].double().view(1)])
                    values.append(torch.zeros_like(values[0]))
                out[t, h] = torch.softmax(scores, 0) @ torch.stack(values)
    return out


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "block_size"), [(4, 4, 4), (6, 2, 8)])
def test_reference_attention_matches_naive_loop(num_heads, num_kv_heads, block_size):
    seqs = [(1, 1), (block_size + 1, 1), (2 * block_size + 3, 5), (block_size, block_size), (9, 1)]
    batch = make_batch(
        seqs,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=16,
        block_size=block_size,
        dtype=F32,
        device="cpu",
    )
    ref = paged_attention_ref(**batch)
    torch.testing.assert_close(ref.double(), naive_attention(**batch), atol=1e-5, rtol=1e-5)


OPTIONS = {
    "window": dict(window=5),
    "soft_cap": dict(soft_cap=1.5),
    "sinks": dict(sinks="random"),
    "all": dict(window=12, soft_cap=3.0, sinks="random"),
}


def _options(name: str, num_heads: int, device: str = "cpu") -> dict:
    opts = dict(OPTIONS[name])
    if opts.get("sinks") == "random":
        opts["sinks"] = torch.randn(num_heads, generator=torch.Generator().manual_seed(1)).to(device)
    return opts


@pytest.mark.parametrize("option", list(OPTIONS))
def test_reference_attention_options_match_naive_loop(option):
    block_size = 4
    seqs = [(1, 1), (block_size + 1, 1), (3 * block_size + 3, 9), (block_size, block_size), (13, 1)]
    batch = make_batch(seqs, num_heads=6, num_kv_heads=2, head_dim=16, block_size=block_size, dtype=F32, device="cpu")
    opts = _options(option, 6)
    ref = paged_attention_ref(**batch, **opts)
    torch.testing.assert_close(ref.double(), naive_attention(**batch, **opts), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize(("dtype", "num_splits"), [(F32, 1), (BF16, 4)])
def test_attention_options_match_reference(option, dtype, num_splits):
    """Window, soft-cap and sinks, each alone and together, over decode rows and chunks
    longer than the window (split-KV included)."""
    block_size = 8
    seqs = [(1, 1), (block_size + 1, 1), (5 * block_size + 3, 7), (40, 33), (3 * block_size, 2)]
    batch = make_batch(seqs, num_heads=4, num_kv_heads=2, head_dim=32, block_size=block_size, dtype=dtype)
    opts = _options(option, 4, DEVICE)
    num_rows = int(batch["query_start_loc"][-1])
    out = triton_ops.paged_attention_triton(**batch, **opts, num_splits=num_splits)
    cpu = {k: v.cpu() if torch.is_tensor(v) else v for k, v in {**batch, **opts}.items()}
    ref = paged_attention_ref(**cpu)
    torch.testing.assert_close(out[:num_rows].cpu().float(), ref[:num_rows].float(), **TOL[dtype])


def test_attention_options_change_the_result():
    """Each option is really applied (the tests above would pass for a no-op otherwise)."""
    batch = make_batch([(40, 33)], num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, dtype=F32, device="cpu")
    plain = paged_attention_ref(**batch)
    for name in ("window", "soft_cap", "sinks"):
        assert not torch.allclose(paged_attention_ref(**batch, **_options(name, 4)), plain, atol=1e-3), name


def test_reference_write_kv_matches_naive_loop():
    key_cache = torch.zeros(6, 4, 2, 8)
    value_cache = torch.zeros(6, 4, 2, 8)
    key, value = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slot_mapping = torch.tensor([0, 23, -1, 9, 14])
    write_kv_ref(key, value, key_cache, value_cache, slot_mapping)
    want_k, want_v = torch.zeros_like(key_cache), torch.zeros_like(value_cache)
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            want_k[slot // 4, slot % 4] = key[t]
            want_v[slot // 4, slot % 4] = value[t]
    assert torch.equal(key_cache, want_k)
    assert torch.equal(value_cache, want_v)


# ---------------------------------------------------------------------------- write_kv kernel


@pytest.mark.parametrize(
    ("dtype", "num_kv_heads", "head_dim", "block_size"),
    [(F32, 2, 64, 8), (F16, 8, 128, 16), (BF16, 1, 64, 32), (F16, 3, 128, 8)],
)
def test_write_kv_kernel_matches_reference(dtype, num_kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(1)
    num_blocks, num_tokens = 9, 12
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1  # padding rows
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    want_k, want_v = (
        torch.randn(shape, generator=gen).to(dtype),
        torch.randn(shape, generator=gen).to(dtype),
    )
    got_k, got_v = want_k.clone().to(DEVICE), want_v.clone().to(DEVICE)
    write_kv_ref(key, value, want_k, want_v, slots)
    triton_ops.write_kv_triton(key.to(DEVICE), value.to(DEVICE), got_k, got_v, slots.to(DEVICE))
    assert torch.equal(got_k.cpu(), want_k)
    assert torch.equal(got_v.cpu(), want_v)


def test_write_kv_kernel_casts_to_cache_dtype():
    key, value = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    shape = (2, 8, 2, 64)
    got_k = torch.zeros(shape, dtype=F16, device=DEVICE)
    got_v = torch.zeros_like(got_k)
    want_k, want_v = torch.zeros(shape, dtype=F16), torch.zeros(shape, dtype=F16)
    slots = torch.tensor([3, 15, -1])
    write_kv_ref(key, value, want_k, want_v, slots)
    triton_ops.write_kv_triton(key.to(DEVICE), value.to(DEVICE), got_k, got_v, slots.to(DEVICE))
    torch.testing.assert_close(got_k.cpu(), want_k, atol=1e-3, rtol=0)
    torch.testing.assert_close(got_v.cpu(), want_v, atol=1e-3, rtol=0)


# ---------------------------------------------------------------------------- attention kernel

# A sample of dtype x GQA ratio x head_dim x block_size in which every value of each
# appears with several of the others; the full product is test_attention_full_grid (slow).
CASES = [
    (F32, 1, 64, 8),
    (F32, 4, 128, 16),
    (F32, 3, 128, 32),
    (F16, 3, 64, 16),
    (F16, 8, 128, 32),
    (F16, 4, 64, 8),
    (BF16, 4, 64, 32),
    (BF16, 1, 128, 8),
    (BF16, 8, 64, 16),
]


def _case_id(case) -> str:
    dtype, group, head_dim, block_size = case
    return f"{str(dtype).removeprefix('torch.')}-gqa{group}-d{head_dim}-bs{block_size}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_attention_mixed_batch(case):
    dtype, group, head_dim, block_size = case
    batch = make_batch(
        mixed_seqs(block_size),
        num_heads=2 * group,
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        pad_rows=3,
    )
    out, ref = run_both(batch, num_splits=1)
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("case", CASES[::2], ids=_case_id)
def test_attention_decode_batch(case):
    dtype, group, head_dim, block_size = case
    batch = make_batch(
        decode_seqs(block_size),
        num_heads=2 * group,
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
    out, ref = run_both(batch, num_splits=1)
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize(
    ("seqs", "num_splits"),
    [("decode", 2), ("decode", 16), ("mixed", 4)],
)
def test_attention_split_kv(seqs, num_splits):
    block_size = 16
    batch = make_batch(
        decode_seqs(block_size) if seqs == "decode" else mixed_seqs(block_size),
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=block_size,
        dtype=F16,
    )
    out, ref = run_both(batch, num_splits=num_splits)
    torch.testing.assert_close(out, ref, **TOL[F16])


@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_attention_single_sequence(q_len, num_splits):
    batch = make_batch(
        [(37, q_len)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=F16
    )
    out, ref = run_both(batch, num_splits=num_splits)
    torch.testing.assert_close(out, ref, **TOL[F16])


def test_attention_non_power_of_two_head_dim():
    batch = make_batch(
        [(20, 1), (9, 9)], num_heads=4, num_kv_heads=2, head_dim=80, block_size=8, dtype=F32
    )
    out, ref = run_both(batch)
    torch.testing.assert_close(out, ref, **TOL[F32])


def test_write_then_attend_one_step():
    """A mixed step end to end: new K/V written by slot, then attended over, both paths."""
    block_size, group = 8, 4
    seqs = [(11, 3), (1, 1), (17, 1)]
    batch = make_batch(
        seqs, num_heads=2 * group, num_kv_heads=2, head_dim=64, block_size=block_size, dtype=F16
    )
    tables = batch["block_tables"].cpu().long()
    slots = []
    for i, (seq_len, q_len) in enumerate(seqs):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(int(tables[i, pos // block_size]) * block_size + pos % block_size)
    slot_mapping = torch.tensor(slots + [-1], device=DEVICE)  # one padding row
    key = torch.randn(len(slot_mapping), 2, 64).to(DEVICE, F16)
    value = torch.randn(len(slot_mapping), 2, 64).to(DEVICE, F16)
    batch["query"] = torch.randn(len(slot_mapping), 8, 64).to(DEVICE, F16)
    cpu = {k: v.cpu().clone() if torch.is_tensor(v) else v for k, v in batch.items()}

    triton_ops.write_kv_triton(key, value, batch["key_cache"], batch["value_cache"], slot_mapping)
    out = triton_ops.paged_attention_triton(**batch)
    write_kv_ref(key.cpu(), value.cpu(), cpu["key_cache"], cpu["value_cache"], slot_mapping.cpu())
    ref = paged_attention_ref(**cpu)
    assert torch.equal(batch["key_cache"].cpu(), cpu["key_cache"])
    torch.testing.assert_close(out[:-1].cpu().float(), ref[:-1].float(), **TOL[F16])


def test_offsets_past_int32():
    """Blocks whose element offset ``block_id * block_stride`` is past 2**31.

    K and V share one pool, interleaved per block (``key_cache = kv[:, 0]``), so the caches
    are strided views and a block is 2 * 16 * 1 * 64 elements: offsets pass 2**31 after
    2**20 blocks, a 4 GiB fp16 allocation of which only the touched blocks are ever paged
    in. A kernel that multiplies in int32 wraps to a negative offset here and reads
    outside the pool (wrong values or a fault).
    """
    block_size, num_kv_heads, head_dim = 16, 1, 64
    try:
        kv = torch.empty(2**20 + 8, 2, block_size, num_kv_heads, head_dim, dtype=F16, device=DEVICE)
    except (RuntimeError, MemoryError) as exc:
        pytest.skip(f"cannot reserve a 4 GiB pool: {exc}")
    key_cache, value_cache = kv[:, 0], kv[:, 1]
    num_blocks = kv.shape[0]
    first_big = 2**31 // key_cache.stride(0)  # the first block whose offset needs int64
    assert first_big < num_blocks - 2
    gen = torch.Generator().manual_seed(3)
    seq_lens = [40, 1, 3]  # seq 0 spans a low block and two high ones
    tables = torch.tensor(
        [[5, first_big + 3, num_blocks - 1], [first_big + 1, -1, -1], [num_blocks - 2, -1, -1]],
        dtype=torch.int32,
    )
    slots = []
    for i, seq_len in enumerate(seq_lens):
        for pos in range(seq_len):
            slots.append(int(tables[i, pos // block_size]) * block_size + pos % block_size)
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    key = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(DEVICE, F16)
    value = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(DEVICE, F16)
    triton_ops.write_kv_triton(key, value, key_cache, value_cache, slot_mapping)
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    assert torch.equal(key_cache[blocks, offsets], key)
    assert torch.equal(value_cache[blocks, offsets], value)

    # Attention: sequence 0 prefills its last 6 tokens, the others decode.
    args = dict(
        query=torch.randn(8, 4, head_dim, generator=gen).to(DEVICE, F16),
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=tables.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.tensor([0, 6, 7, 8], dtype=torch.int32, device=DEVICE),
        scale=head_dim**-0.5,
    )
    ref = paged_attention_ref(**args).float()
    for num_splits in (1, 2):
        out = triton_ops.paged_attention_triton(**args, num_splits=num_splits)
        torch.testing.assert_close(out.float(), ref, **TOL[F16])


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("PAGEFLEET_SLOW_TESTS") != "1" and not _HAS_CUDA,
    reason="exhaustive interpreter grid (~6 CPU-minutes); set PAGEFLEET_SLOW_TESTS=1",
)
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_attention_full_grid(dtype, group, head_dim, block_size):
    for seqs in (mixed_seqs(block_size), decode_seqs(block_size)):
        batch = make_batch(
            seqs,
            num_heads=2 * group,
            num_kv_heads=2,
            head_dim=head_dim,
            block_size=block_size,
            dtype=dtype,
        )
        for num_splits in (1, 4):
            out, ref = run_both(batch, num_splits=num_splits)
            torch.testing.assert_close(out, ref, **TOL[dtype])


# ---------------------------------------------------------------------------- launcher checks


def _valid_attention_args() -> dict:
    return make_batch(
        [(5, 1), (9, 2)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, dtype=F16
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.update(query=a["query"][0]), "query must be"),
        (lambda a: a.update(query=a["query"].float()), "cache dtype"),
        (lambda a: a.update(query=a["query"][:, :3]), "multiple of num_kv_heads"),
        (lambda a: a.update(query=a["query"][..., :32]), "head_dim"),
        (
            lambda a: a.update(query=a["query"].transpose(1, 2).contiguous().transpose(1, 2)),
            "unit stride",
        ),
        (lambda a: a.update(key_cache=a["key_cache"][:-1]), "must match key_cache"),
        (
            lambda a: a.update(value_cache=a["value_cache"].float()),
            "must match key_cache|dtypes differ",
        ),
        (lambda a: a.update(key_cache=a["key_cache"][0]), "key_cache must be"),
        (lambda a: a.update(block_tables=a["block_tables"].long()), "block_tables must be int32"),
        (lambda a: a.update(block_tables=a["block_tables"][:1]), "block_tables must be"),
        (lambda a: a.update(seq_lens=a["seq_lens"].long()), "seq_lens must be int32"),
        (lambda a: a.update(query_start_loc=a["query_start_loc"][:-1]), "query_start_loc must be"),
        (lambda a: a.update(key_cache=a["key_cache"].to(torch.int8)), "dtype"),
    ],
)
def test_attention_launcher_rejects(change, message):
    args = _valid_attention_args()
    change(args)
    with pytest.raises(ValueError, match=message):
        triton_ops.paged_attention_triton(**args)


def test_attention_launcher_rejects_bad_num_splits():
    with pytest.raises(ValueError, match="num_splits"):
        triton_ops.paged_attention_triton(**_valid_attention_args(), num_splits=3)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.update(slot_mapping=a["slot_mapping"].int()), "slot_mapping must be int64"),
        (lambda a: a.update(slot_mapping=a["slot_mapping"][:1]), "slot_mapping must be"),
        (lambda a: a.update(value=a["value"][:, :1]), "value .* must match key"),
        (lambda a: a.update(key=a["key"][..., :32], value=a["value"][..., :32]), "do not match"),
        (lambda a: a.update(value_cache=a["value_cache"][:, :4]), "must match key_cache"),
        (
            lambda a: a.update(key=a["key"].to(torch.int32), value=a["value"].to(torch.int32)),
            "dtype",
        ),
    ],
)
def test_write_kv_launcher_rejects(change, message):
    args = dict(
        key=torch.randn(2, 2, 64, device=DEVICE),
        value=torch.randn(2, 2, 64, device=DEVICE),
        key_cache=torch.zeros(3, 8, 2, 64, device=DEVICE),
        value_cache=torch.zeros(3, 8, 2, 64, device=DEVICE),
        slot_mapping=torch.tensor([1, 9], device=DEVICE),
    )
    change(args)
    with pytest.raises(ValueError, match=message):
        triton_ops.write_kv_triton(**args)


def test_dispatch_uses_reference_on_cpu():
    batch = _valid_attention_args()
    batch = {k: v.cpu() if torch.is_tensor(v) else v for k, v in batch.items()}
    assert torch.equal(paged_attention(**batch), paged_attention_ref(**batch))
    key, value = torch.randn(1, 2, 64, dtype=F16), torch.randn(1, 2, 64, dtype=F16)
    write_kv(key, value, batch["key_cache"], batch["value_cache"], torch.tensor([3]))
    assert torch.equal(batch["key_cache"][0, 3], key[0])


# ---------------------------------------------------------------------------- GPU and bench


@pytest.mark.gpu
@pytest.mark.skipif(not _HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_kernels_match_reference_with_default_splits():
    """Compiled kernels through the public dispatch, with the launcher's own split choice."""
    for seqs in ([(2048, 1)] * 3, [(700, 1)] * 64 + [(1500, 300)]):
        batch = make_batch(
            seqs, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=BF16
        )
        out = paged_attention(**batch)
        ref = paged_attention_ref(
            **{k: v.cpu() if torch.is_tensor(v) else v for k, v in batch.items()}
        )
        torch.testing.assert_close(out.cpu().float(), ref.float(), **TOL[BF16])


def test_bench_cpu_part_writes_json(tmp_path):
    if _HAS_CUDA:
        pytest.skip("the CPU part of the benchmark runs only without a GPU")
    from pagefleet.benchmarks import kernels as bench

    path = tmp_path / "kernels.json"
    assert bench.main(["--quick", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert result["gpu"]["measured"] is False
    assert result["cpu"]["decode"] and result["cpu"]["prefill"]
    assert all(row["seconds"] > 0 for row in result["cpu"]["decode"])
