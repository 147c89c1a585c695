"""Step inputs reach the device in one copy; block tables travel as diffs, with the same tokens."""

from __future__ import annotations

import numpy as np
import torch

from pagefleet import Engine, SamplingParams
from pagefleet.worker.model_runner import _block_table
from pagefleet.worker.step_inputs import DeviceBlockTables, StepUploader


def _apply(t: DeviceBlockTables, rids, tables, live):
    rows, dr, dc, dv = t.diffs(rids, tables, live)
    width = max((len(x) for x in tables), default=1)
    return t.apply(torch.tensor(rows, dtype=torch.int64), torch.tensor(dr, dtype=torch.int64),
                   torch.tensor(dc, dtype=torch.int64), torch.tensor(dv, dtype=torch.int32), width), len(dv)


def test_only_new_blocks_travel_and_replaced_tables_are_sent_whole():
    t = DeviceBlockTables(2, 4, torch.device("cpu"))
    a, b = [3, 4], [7]
    got, sent = _apply(t, ["a", "b"], [a, b], {"a": a, "b": b})
    assert got.tolist() == [[3, 4], [7, 0]] and sent == 3
    a.append(5)  # grew in place
    got, sent = _apply(t, ["b", "a"], [b, a], {"a": a, "b": b})
    assert got.tolist() == [[7, 0, 0], [3, 4, 5]] and sent == 1
    a2 = [9, 4, 5]  # a preempted and allocated again: another list, same length
    got, sent = _apply(t, ["a"], [a2], {"a": a2, "b": b})
    assert got.tolist() == [[9, 4, 5]] and sent == 3
    c = [1, 2, 3, 4, 5, 6]  # a third request: b's row comes back (b left), the table widens
    got, sent = _apply(t, ["c", "a"], [c, a2], {"a": a2, "c": c})
    assert got.tolist() == [[1, 2, 3, 4, 5, 6], [9, 4, 5, 0, 0, 0]] and sent == 6
    d = [8]  # every row taken by a live request: the table grows
    got, _ = _apply(t, ["d", "c"], [d, c], {"a": a2, "c": c, "d": d})
    assert got.tolist() == [[8, 0, 0, 0, 0, 0], c]


def test_one_upload_carries_every_array_with_its_dtype():
    up = StepUploader(torch.device("cpu"), initial_bytes=8)
    arrays = [np.arange(5, dtype=np.int64), np.array([7, 8], dtype=np.int32), np.array([], dtype=np.int64)]
    out = up.upload(arrays)
    assert [o.tolist() for o in out] == [a.tolist() for a in arrays]
    assert [o.dtype for o in out] == [torch.int64, torch.int32, torch.int64]
    assert up.num_copies == 1


def test_uploads_of_one_layout_reuse_its_views_and_carry_each_steps_values():
    up = StepUploader(torch.device("cpu"), initial_bytes=64)
    rng = np.random.default_rng(0)
    for step in range(40):  # layouts come back (a decode step's), change, and outgrow the buffer
        n, d = (3, 0) if step % 3 else (1 + step % 7, step)
        arrays = [rng.integers(0, 1000, n, dtype=np.int64), rng.integers(0, 1000, n + 1, dtype=np.int32),
                  rng.integers(0, 1000, d, dtype=np.int64), rng.integers(0, 1000, d, dtype=np.int32)]
        out = up.upload(arrays)
        assert [o.tolist() for o in out] == [a.tolist() for a in arrays], step
        assert [o.dtype for o in out] == [torch.int64, torch.int32, torch.int64, torch.int32]
    assert up.num_copies == 40


def test_decoding_sends_each_block_id_once_and_one_copy_per_step():
    prompts = [[1 + i] * (20 + 7 * i) for i in range(8)]
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    reference = [o.token_ids for o in Engine("tiny", device="cpu", num_blocks=256, block_size=4,
                                             enable_prefix_caching=False).generate(prompts, params)]
    engine = Engine("tiny", device="cpu", num_blocks=256, block_size=4, enable_prefix_caching=False)
    engine.executor.runner.stage_inputs = True  # the GPU's path, on the CPU
    full_tables = 0
    steps = 0
    ids = [engine.add_request(p, params) for p in prompts]
    outs = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for d in engine.step():
            outs[d.request_id].extend(d.token_ids)
        steps += 1
        full_tables += sum(len(t) for t in engine.kv.block_tables.values())
    assert [outs[r] for r in ids] == reference
    runner = engine.executor.runner
    assert runner.uploader.num_copies == steps
    total_blocks = sum(-(-(len(p) + 60) // 4) for p in prompts)
    assert runner.device_tables.num_entries_sent <= total_blocks  # each block id went over once
    assert runner.device_tables.num_entries_sent * 10 < full_tables  # not the whole table every step


def test_staged_inputs_give_the_same_tokens_under_preemption_swap_and_prefix_hits():
    shared = [5] * 40
    prompts = [shared + [10 + i] * (3 + i) for i in range(10)]
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.8, seed=3, ignore_eos=True)] * 5

    def run(stage: bool):
        e = Engine("tiny", device="cpu", num_blocks=48, block_size=4, num_swap_blocks=24, preemption="swap",
                   max_num_batched_tokens=32)
        e.executor.runner.stage_inputs = stage
        first = [o.token_ids for o in e.generate(prompts, params)]
        again = [o.token_ids for o in e.generate(prompts, params)]  # prefix hits this time
        assert e.stats().num_preemptions_total > 0 and e.stats().prefix_cache_hits_total > 0
        return first, again

    assert run(True) == run(False)


def test_a_staged_decode_step_has_the_inputs_of_an_unstaged_one():
    """A decode step with staged inputs builds no host block table: its slots (from each
    request's last block) and its gathered device tables are the unstaged step's."""
    e = Engine("tiny", device="cpu", num_blocks=200, block_size=4)
    for i in range(6):
        e.add_request([7 + i] * (5 + 3 * i), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    runner = e.executor.runner
    prepare, checked = runner.prepare, []

    def both(out):  # every step's inputs, built both ways
        got = {}
        for stage in (False, True):
            runner.stage_inputs = stage
            input_ids, positions, meta, logits_rows, sampled, keep, decode = prepare(out)
            got[stage] = (input_ids.tolist(), positions.tolist(), meta.slot_mapping.tolist(),
                          meta.block_tables.tolist(), meta.seq_lens.tolist(), meta.query_start_loc.tolist(),
                          logits_rows.tolist(), sampled, keep, decode)
        assert got[True] == got[False]
        if got[True][-1]:  # a decode step: each token's slot, read from the whole table as before
            rows = [runner.kv.block_tables.get(r.request_id, []) for r in out.requests]
            lens = [len(t) for t in rows]
            table = _block_table(rows, lens, max(max(lens), 1))
            starts = np.array([r.num_computed_tokens for r in out.requests])
            bs = runner.block_size
            assert got[True][2] == (table[np.arange(len(rows)), starts // bs].astype(np.int64) * bs
                                    + starts % bs).tolist()
        checked.append(got[True][-1])
        return prepare(out)

    runner.prepare = both
    while e.has_unfinished_requests():
        e.step()
    assert checked.count(True) >= 25 and False in checked  # decode steps (blocks gained on the way) and prompts
