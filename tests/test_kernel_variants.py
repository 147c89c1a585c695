"""A GPU worker compiles its Triton kernels before its first step, never in one.

Triton's JIT compiles one binary per *compile key*: the kernel's compile-time parameters and,
for every other argument, the class Triton specializes it on (an integer equal to 1 or a
multiple of 16, a pointer aligned to 16 bytes). On an H200's host a compile took 1.1-1.9 s,
and a step that met a new key stalled every request in it (`pagefleet bench engine` on the
GPU: 4 such steps took 5.5-6.4 s of a 6.8-7.3 s run, docs/BENCHMARKS.md). Two things keep
that out of serving, and this file checks both on a CPU, under Triton's interpreter, with the
keys computed by Triton's own specialization function:

* the arguments that move from step to step (sequence counts, block-table widths, views into
  a step's packed inputs) are not specialized on, so they add no key;
* ``ModelRunner.warm_up`` (run at a GPU worker's start) runs a decode-only and a prompt-shaped
  padding batch under every split count the attention can take, so a trace of steps of every
  kind (many short prompts, one long one chunked) meets no key the warm-up has not compiled.

The number of splits the attention picks is emulated for a GPU (of 4 SMs, so that the
interpreter stays quick: an H200 has 132), so the split and merge variants are covered too.
"""

from __future__ import annotations

import importlib
import inspect
import os
import random
from collections import defaultdict

import pytest
import torch
from arch_checkpoints import CASES, make_arch_checkpoint

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")
jit = pytest.importorskip("triton.runtime.jit")
if not hasattr(jit, "native_specialize_impl"):
    pytest.skip("this Triton computes its specialization elsewhere", allow_module_level=True)

from triton.backends.compiler import BaseBackend  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import pagefleet.kernels as kernels  # noqa: E402
from pagefleet import Engine, SamplingParams  # noqa: E402
from pagefleet.kernels import fused_triton, moe_triton, triton_ops  # noqa: E402
from pagefleet.worker.models.layers import AttentionMetadata  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GPU_SMS = 4


class _Recorder:
    """Stands in for one ``@triton.jit`` kernel: records each launch's compile key, then launches."""

    def __init__(self, name: str, kernel, keys: dict) -> None:
        self.name, self.kernel, self.keys = name, kernel, keys
        opts = getattr(kernel, "kwargs", None)  # an InterpretedFunction keeps its decorator's options here
        if opts is None:
            opts = dict(do_not_specialize=kernel.do_not_specialize,
                        do_not_specialize_on_alignment=kernel.do_not_specialize_on_alignment)
        dns = set(opts.get("do_not_specialize") or ())
        dns_align = set(opts.get("do_not_specialize_on_alignment") or ())
        params = list(inspect.signature(kernel.fn).parameters.values())
        self.params = [(p.name, "constexpr" in str(p.annotation), p.name not in dns and i not in dns,
                        p.name not in dns_align and i not in dns_align) for i, p in enumerate(params)]

    def key(self, args, kwargs) -> tuple:
        bound = dict(zip([name for name, *_ in self.params], args, strict=False)) | kwargs
        out = []
        for name, constexpr, specialize, align in self.params:
            value = bound.get(name)
            out.append((name, value if constexpr else
                        jit.native_specialize_impl(BaseBackend, value, False, specialize, align)))
        options = tuple(sorted((k, v) for k, v in kwargs.items() if k in ("num_warps", "num_stages")))
        return (*out, options)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.keys[self.name].add(self.key(args, kwargs))
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.fixture
def compile_keys(monkeypatch) -> dict[str, set]:
    """Every kernel launch's compile key, by kernel; the engine on the Triton kernels."""
    keys: dict[str, set] = defaultdict(set)
    for module in (triton_ops, fused_triton, moe_triton):
        if DEVICE == "cpu" and not any(isinstance(v, InterpretedFunction) for v in vars(module).values()):
            importlib.reload(module)  # decorated before the interpreter was switched on
        for name, value in list(vars(module).items()):
            if name.endswith("_kernel") and hasattr(value, "fn") and hasattr(value, "__getitem__"):
                monkeypatch.setattr(module, name, _Recorder(name, value, keys))
    monkeypatch.setattr(kernels, "_use_triton", lambda t: True)

    monkeypatch.setattr(triton_ops, "_default_num_splits",  # as on a GPU of GPU_SMS multiprocessors
                        lambda device, num_programs: triton_ops.splits_for(GPU_SMS, num_programs))
    return keys


@pytest.mark.parametrize(("max_num_seqs", "max_num_batched_tokens", "longest_prompt"),
                         [(4, 8, 10), (1, 64, 40)], ids=["many-short", "one-long"])
def test_a_trace_meets_no_kernel_variant_the_warm_up_did_not_compile(compile_keys, max_num_seqs,
                                                                     max_num_batched_tokens, longest_prompt):
    engine = Engine("tiny", device=DEVICE, dtype="float32", block_size=4, num_blocks=128,
                    max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, enforce_eager=True)
    compile_keys.clear()  # what the engine's own start launched (a GPU's warm-up) is not under test
    passes = engine.executor.runner.warm_up()
    assert passes == 2 * len(triton_ops.split_choices())  # one query row and two, under each split count
    warmed = {name: set(keys) for name, keys in compile_keys.items()}
    assert {"_paged_attention_kernel", "_merge_splits_kernel", "_write_kv_kernel", "_rope_kernel",
            "_rms_norm_kernel", "_silu_and_mul_kernel"} <= set(warmed)

    # Steps of every kind: chunked prompts beside decodes, a cached prefix, sequence counts of
    # 1 to max_num_seqs, block tables of one to several blocks, a last request decoding alone.
    rng = random.Random(0)
    shapes: set[tuple[int, bool]] = set()
    execute = engine.executor.execute

    def recorded(out, *args, **kwargs):
        counts = out.num_scheduled_tokens
        shapes.add((len(counts), all(c == 1 for c in counts)))
        return execute(out, *args, **kwargs)

    engine.executor.execute = recorded
    prefix = [rng.randrange(5, 200) for _ in range(8)]
    for i in range(6 if max_num_seqs > 1 else 3):
        prompt = (prefix if i % 3 == 0 else []) + [rng.randrange(5, 200) for _ in range(rng.randint(1, longest_prompt))]
        engine.add_request(prompt, SamplingParams(max_tokens=rng.randint(1, 4) + (6 if i == 2 else 0),
                                                  temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert {n for n, _ in shapes} >= {1, max_num_seqs} and {d for _, d in shapes} == {True, False}

    for name, keys in compile_keys.items():
        new = keys - warmed.get(name, set())
        assert not new, f"{name}: a step compiled {len(new)} variant(s) the warm-up did not: {_diff(new, warmed)}"


def _diff(new: set, warmed: dict) -> str:
    """What the first new key differs in from the nearest warmed one (for the message)."""
    key = next(iter(new))
    pool = [k for keys in warmed.values() for k in keys if len(k) == len(key)]
    if not pool:
        return str(key)
    near = min(pool, key=lambda k: sum(a != b for a, b in zip(k, key, strict=True)))
    return str([(a, b[1]) for a, b in zip(key, near, strict=True) if a != b])


def test_the_arguments_that_move_between_steps_add_no_compile_key(compile_keys):
    """The same kernel on the same model, launched with sequence counts of 1, 16 and 5 and
    with its step inputs at offsets of 0, 4 and 8 bytes: one key each."""
    engine = Engine("tiny", device=DEVICE, dtype="float32", block_size=16, num_blocks=64, max_num_seqs=16,
                    max_num_batched_tokens=64, enforce_eager=True)
    compile_keys.clear()
    runner = engine.executor.runner
    i32 = dict(dtype=torch.int32, device=DEVICE)
    for seqs, offset, width in ((1, 0, 1), (16, 1, 16), (5, 2, 3)):
        packed = torch.zeros(64, **i32)  # as a step's packed inputs: views at moving offsets
        seq_lens = packed[offset:offset + seqs].fill_(1)
        qsl = packed[32 + offset:32 + offset + seqs + 1]
        qsl.copy_(torch.arange(seqs + 1, **i32))
        slots = torch.full((seqs + offset,), -1, dtype=torch.int64, device=DEVICE)[offset:]
        positions = torch.zeros(seqs + offset, dtype=torch.int64, device=DEVICE)[offset:]

        meta = AttentionMetadata(slot_mapping=slots, block_tables=torch.zeros((seqs, width), **i32),
                                 seq_lens=seq_lens, query_start_loc=qsl)
        with torch.inference_mode():
            runner.model(torch.zeros(seqs, dtype=torch.int64, device=DEVICE), positions, runner.kv_caches, meta,
                         torch.arange(seqs, dtype=torch.int64, device=DEVICE))
    by_splits = defaultdict(set)
    for key in compile_keys["_paged_attention_kernel"]:
        by_splits[dict(k[:2] for k in key[:-1])["NUM_SPLITS"]].add(key)
    assert all(len(keys) == 1 for keys in by_splits.values()), by_splits
    for name in ("_write_kv_kernel", "_rope_kernel", "_rms_norm_kernel", "_silu_and_mul_kernel"):
        assert len(compile_keys[name]) == 1, (name, compile_keys[name])


@pytest.mark.parametrize("case", list(CASES))
def test_the_warm_up_runs_every_architecture_and_leaves_its_tokens_alone(tmp_path, case):
    """Every architecture we load takes the warm-up's padding batches (windows, soft-caps, sinks,
    experts, vision-language checkpoints), and writes nothing a request then reads: the greedy
    tokens after a warm-up are those of an engine that had none."""
    path = str(make_arch_checkpoint(tmp_path, case))
    prompts = [[5, 9, 17, 33, 4, 71, 8, 19, 101, 3], [150, 7, 7, 90]]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engines = [Engine(path, device="cpu", dtype="float32", block_size=4, num_blocks=32, max_model_len=64,
                      max_num_seqs=4) for _ in range(2)]
    assert engines[0].executor.runner.warm_up() == 2  # no split counts off the Triton kernels
    got, want = ([o.token_ids for o in e.generate(prompts, params)] for e in engines)
    assert got == want


def test_the_launch_overhead_bench_times_every_launcher_and_leaves_the_kernels_in_place():
    from pagefleet.benchmarks import launch_overhead

    kernel = triton_ops._paged_attention_kernel
    out = launch_overhead.main(reps=3)
    assert set(out) == {"paged_attention", "write_kv", "rms_norm", "rope", "silu_and_mul"}
    assert all(us > 0 for us in out.values())
    assert triton_ops._paged_attention_kernel is kernel
