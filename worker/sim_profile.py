"""What a simulated worker stands for: a step-time model and the memory of one GPU.

A step of ``n`` batched tokens (prompt chunks and decode rows) whose attention reads ``k``
KV tokens (every scheduled request's context, its new tokens included) takes

    seconds = a + b * n + c * k

plus, when it copies blocks to or from the swap pool, ``transfer_overhead_s`` per
direction and the bytes over ``swap_bytes_per_s``. ``a`` is the fixed cost of a step
(reading the weights, launch and framework overhead), ``b`` the compute per token, ``c``
the KV-cache reads of attention. A profile also sizes the KV pool (``kv_cache_bytes`` over
``kv_bytes_per_token``) and the longest sequence.

Profiles ship as TOML in ``sim_profiles/`` (``load_profile("llama-3-8b-h100")``), each with
a ``source`` that says where its numbers come from; ``fit_step_time`` fits ``a, b, c`` by
least squares from measured steps (``pagefleet bench sim-fit``). Torch-free.
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

PROFILE_DIR = Path(__file__).resolve().parent / "sim_profiles"


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    """``seconds(n, k) = a + b * n + c * k`` (see the module docstring)."""

    a: float  # seconds per step
    b: float  # seconds per batched token
    c: float  # seconds per KV token read

    def __post_init__(self) -> None:
        for name in ("a", "b", "c"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise ValueError(f"step time coefficient {name} must be a finite number >= 0, got {v!r}")

    def seconds(self, num_batched_tokens: int, num_kv_tokens: int) -> float:
        return self.a + self.b * num_batched_tokens + self.c * num_kv_tokens


@dataclass(frozen=True, slots=True)
class SimProfile:
    """One model on one kind of GPU (per GPU when tensor parallel: bytes are one rank's share)."""

    name: str
    source: str  # where the numbers come from, and how they were derived
    step: StepTimeModel
    kv_bytes_per_token: int  # K and V of every layer, one token
    kv_cache_bytes: int  # the KV pool of one worker
    max_model_len: int
    swap_bytes_per_s: float  # host <-> device copies
    transfer_overhead_s: float = 0.0  # per swap transfer (one direction of one step)
    # KV moved between two workers (disaggregation, migration): the link one worker has to
    # another, and the fixed cost of one transfer (its control messages and setup). 0: none given.
    kv_transfer_bytes_per_s: float = 0.0
    kv_transfer_overhead_s: float = 0.0
    model: str = ""  # what it stands for, e.g. "meta-llama/Meta-Llama-3-8B-Instruct, bf16"
    hardware: str = ""

    def __post_init__(self) -> None:
        if not self.source.strip():
            raise ValueError(f"profile {self.name!r}: a source must say where its numbers come from")
        for name in ("kv_bytes_per_token", "kv_cache_bytes", "max_model_len"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"profile {self.name!r}: {name} must be a positive integer")
        if not self.swap_bytes_per_s > 0 or self.transfer_overhead_s < 0:
            raise ValueError(f"profile {self.name!r}: swap_bytes_per_s must be > 0, transfer_overhead_s >= 0")
        if self.kv_transfer_bytes_per_s < 0 or self.kv_transfer_overhead_s < 0:
            raise ValueError(f"profile {self.name!r}: kv_transfer_bytes_per_s and kv_transfer_overhead_s must be >= 0")

    def block_bytes(self, block_size: int) -> int:
        return self.kv_bytes_per_token * block_size

    def num_blocks(self, block_size: int) -> int:
        return self.kv_cache_bytes // self.block_bytes(block_size)

    def transfer_seconds(self, num_blocks: int, block_size: int) -> float:
        """One swap transfer of ``num_blocks`` blocks (0 for none)."""
        if not num_blocks:
            return 0.0
        return self.transfer_overhead_s + num_blocks * self.block_bytes(block_size) / self.swap_bytes_per_s

    def kv_transfer_seconds(self, num_tokens: int) -> float:
        """Moving ``num_tokens`` tokens' KV to another worker (0 for none); ``ValueError`` if
        the profile gives no ``kv_transfer_bytes_per_s``."""
        if not self.kv_transfer_bytes_per_s:
            raise ValueError(f"profile {self.name!r} gives no kv_transfer_bytes_per_s: it cannot move KV")
        if num_tokens <= 0:
            return 0.0
        return self.kv_transfer_overhead_s + num_tokens * self.kv_bytes_per_token / self.kv_transfer_bytes_per_s

    def to_dict(self) -> dict:
        d = asdict(self)
        d["step"] = asdict(self.step)
        return d

    @classmethod
    def from_dict(cls, d: dict, name: str | None = None) -> SimProfile:
        d = dict(d)
        step = d.pop("step", None)
        if not isinstance(step, dict):
            raise ValueError("profile: a [step] table with a, b and c is required")
        d.setdefault("name", name or "")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known - {"notes"})
        if unknown:
            raise ValueError(f"profile {d['name']!r}: unknown fields {unknown}")
        d.pop("notes", None)
        return cls(step=StepTimeModel(**{k: float(step[k]) for k in ("a", "b", "c")}), **d)


def profile_names() -> list[str]:
    """The profiles that ship with pagefleet."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def load_profile(name_or_path: str) -> SimProfile:
    """A shipped profile by name, or a ``.toml`` / ``.json`` file; ``ValueError`` if neither."""
    path = Path(name_or_path)
    if not path.is_file():
        shipped = PROFILE_DIR / f"{name_or_path}.toml"
        if not shipped.is_file():
            raise ValueError(f"sim profile: {name_or_path!r} is neither a file nor one of {profile_names()}")
        path = shipped
    text = path.read_text()
    raw = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    return SimProfile.from_dict(raw, name=path.stem)


# -- fitting ---------------------------------------------------------------------------------
def fit_step_time(samples: Iterable[Sequence[float]]) -> tuple[StepTimeModel, float]:
    """Least-squares ``a, b, c`` from ``(num_batched_tokens, num_kv_tokens, seconds)`` samples,
    each coefficient at least 0 (one that comes out negative is dropped and the rest refitted);
    the fit and its R² (0..1; how much of the variation in step time it explains)."""
    import numpy as np

    rows = np.asarray([tuple(s)[:3] for s in samples], dtype=np.float64)
    if rows.ndim != 2 or len(rows) < 3:
        raise ValueError(f"fit: need at least 3 steps, got {len(rows)}")
    x = np.column_stack([np.ones(len(rows)), rows[:, 0], rows[:, 1]])
    y = rows[:, 2]
    keep = [0, 1, 2]
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            break
        del keep[int(np.argmin(coef))]
    full = np.zeros(3)
    full[keep] = np.maximum(coef, 0.0)
    residual = y - x @ full
    spread = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((residual**2).sum()) / spread if spread > 0 else 1.0
    return StepTimeModel(*(float(v) for v in full)), r2
