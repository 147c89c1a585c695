"""The seam between an engine and what runs its steps.

An ``Engine`` owns everything about requests and blocks: the batch scheduler, the KV
manager and its prefix cache, the swap pool's block accounting. An executor owns what a
step costs and what it produces:

* ``ModelExecutor`` (here): the network, its KV tensors, the swap copies and the runner;
* ``SimExecutor`` (``sim.py``): a step-time model and tokens hashed from (seed, position).

Contract: ``allocate`` is called once, before any step, with the engine's KV manager and
the size of its swap pool (0: no swap pool); ``execute`` runs one step's block copies
(``blocks_to_swap_out``, then ``blocks_to_swap_in``) and then, if the step computes any
tokens, its forward pass, and returns the requests that sampled a token with their tokens
(one per request, in the order of ``out.requests``). The executor never changes a
request or a block table: the engine advances them from what ``execute`` returns.
"""

from __future__ import annotations

import abc
import time

import torch

from pagefleet.common.blocks import num_blocks_for
from pagefleet.common.model_config import ModelSpec

from .batch_scheduler import SchedulerOutput
from .cost_model import CostModel
from .kv_cache_manager import KVCacheManager
from .model_runner import ModelRunner
from .models.loader import load_model
from .request import Request
from .sampler import SamplerOutput
from .swap import SwapSpace

# Without num_blocks on a CPU: at most this much memory for the KV pool.
_CPU_KV_BYTES = 1 << 30
_GPU_MEMORY_UTILIZATION = 0.90
NO_TOKENS = SamplerOutput([])


class Executor(abc.ABC):
    """What runs an engine's steps. ``device``: where (for logs); ``max_model_len``: the
    longest prompt + output it runs (checked against the model's context here)."""

    device: object
    max_model_len: int

    @abc.abstractmethod
    def block_bytes(self, block_size: int) -> int:
        """Bytes one KV block of every layer takes (what a swap moves per block)."""

    @abc.abstractmethod
    def num_blocks_that_fit(self, block_size: int) -> int:
        """The KV pool's size when the engine is not told one; ``ValueError`` if one
        ``max_model_len`` sequence does not fit."""

    @abc.abstractmethod
    def allocate(self, kv: KVCacheManager, num_swap_blocks: int) -> None:
        """Make the pools for ``kv``'s blocks and ``num_swap_blocks`` swap blocks."""

    @abc.abstractmethod
    def calibrate(self, max_num_batched_tokens: int) -> CostModel:
        """The costs of swap and recompute on this executor (called while the pools are empty)."""

    @abc.abstractmethod
    def execute(self, out: SchedulerOutput) -> tuple[list[Request], SamplerOutput]:
        """Run ``out``: its copies, then its forward pass; the requests that sampled and their tokens."""

    @property
    def graph_sizes(self) -> list[int]:
        """The decode batch sizes replayed from CUDA graphs (empty: every step runs eagerly)."""
        return []

    def check_fits(self, num_blocks: int, block_size: int) -> int:
        """``num_blocks`` if one ``max_model_len`` sequence fits in it, else ``ValueError``."""
        need = num_blocks_for(self.max_model_len, block_size)
        if num_blocks < need:
            raise ValueError(
                f"num_blocks: only {num_blocks} blocks fit in memory but one max_model_len sequence needs "
                f"{need}; lower max_model_len or free memory"
            )
        return num_blocks


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be auto, cpu or cuda; got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device: cuda was asked for but no CUDA device is available")
    return torch.device(device)


class ModelExecutor(Executor):
    """A real model: its weights on ``device``, one KV tensor for every layer, the CPU swap
    pool's tensor, and the runner that flattens a step into tensors and samples. On a CUDA
    device decode steps of up to ``max_num_seqs`` sequences replay CUDA graphs captured in
    ``allocate`` (``cuda_graphs``) unless ``enforce_eager``."""

    def __init__(self, spec: ModelSpec, *, device: str, dtype: str, max_model_len: int | None,
                 seed: int, max_num_seqs: int = 256, enforce_eager: bool = False, load_format: str = "auto") -> None:
        self.device = resolve_device(device)
        self.spec = spec
        self.seed = seed
        self.max_num_seqs = max_num_seqs
        self.enforce_eager = enforce_eager
        max_model_len = spec.max_model_len(max_model_len)
        self.model = load_model(spec, self.device, dtype, max_positions=max_model_len, load_format=load_format)
        self.model.extend_positions(max_model_len)
        self.max_model_len = max_model_len
        self.dtype = next(self.model.parameters()).dtype
        self.kv_cache: torch.Tensor | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.swap_space: SwapSpace | None = None
        self.runner: ModelRunner | None = None
        self.warm_up_seconds = 0.0  # compiling the kernels' variants at start (a GPU's; see ModelRunner.warm_up)
        self.block_size = 0

    def block_bytes(self, block_size: int) -> int:
        cfg = self.spec.config
        elt = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elt

    def num_blocks_that_fit(self, block_size: int) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(free - total * (1 - _GPU_MEMORY_UTILIZATION))
        else:
            budget = _CPU_KV_BYTES
        return self.check_fits(int(budget // self.block_bytes(block_size)), block_size)

    def allocate(self, kv: KVCacheManager, num_swap_blocks: int) -> None:
        cfg = self.spec.config
        self.block_size = kv.block_size
        shape = (kv.num_blocks, kv.block_size, cfg.num_key_value_heads, cfg.head_dim)
        # Zeroed, not empty: masked-out slots must hold finite values (0 * NaN is NaN).
        # One tensor [num_layers, 2, *shape]; each layer's (key, value) caches are
        # contiguous views, and a range of blocks moves across all layers in one copy (swap).
        self.kv_cache = torch.zeros((cfg.num_hidden_layers, 2, *shape), dtype=self.dtype, device=self.device)
        self.kv_caches = [(layer[0], layer[1]) for layer in self.kv_cache]
        if num_swap_blocks:
            self.swap_space = SwapSpace(self.kv_cache, num_swap_blocks)
        self.runner = ModelRunner(self.model, kv, self.kv_caches, self.device, self.max_model_len, self.seed)
        if self.device.type == "cuda":  # every kernel variant compiled before the first step
            t0 = time.perf_counter()
            self.runner.warm_up()
            self.warm_up_seconds = time.perf_counter() - t0
            if not self.enforce_eager:
                self.runner.capture_graphs(self.max_num_seqs)

    @property
    def graph_sizes(self) -> list[int]:
        graphs = self.runner.graphs if self.runner is not None else None
        return sorted(graphs.graphs) if graphs is not None else []

    def calibrate(self, max_num_batched_tokens: int) -> CostModel:
        """Measure copy bandwidth and prefill throughput while the pools are still empty."""
        from .cost_model import calibrate

        tokens = max(1, min(max_num_batched_tokens, self.max_model_len, 512))
        return calibrate(
            self.swap_space, self.model, self.kv_caches, block_size=self.block_size,
            num_device_blocks=self.kv_cache.shape[2], prefill_tokens=tokens,
        )

    def execute(self, out: SchedulerOutput) -> tuple[list[Request], SamplerOutput]:
        if self.swap_space is not None:
            self.swap_space.fence()  # last step's swap-ins land before this forward
            self.swap_space.swap_out(out.blocks_to_swap_out)
            self.swap_space.swap_in(out.blocks_to_swap_in)
        if not out.requests:  # a step of copies only
            return [], NO_TOKENS
        return self.runner.execute(out)
