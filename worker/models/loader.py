"""Load a model: the built-in ``tiny`` or a Hugging Face checkpoint directory."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pagefleet.common.model_config import ModelConfig, ModelSpec, tiny_config

from .decoder import CausalLM, fuse_projections
from .registry import architecture

TINY_SEED = 1234


def _llama_shapes(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """A Llama checkpoint's tensors, in the order ``tiny``'s weights are drawn."""
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim, \
        cfg.num_key_value_heads * cfg.head_dim
    shapes = [("model.embed_tokens.weight", (cfg.vocab_size, h))]
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}"
        shapes += [(f"{p}.self_attn.q_proj.weight", (q, h)), (f"{p}.self_attn.k_proj.weight", (kv, h)),
                   (f"{p}.self_attn.v_proj.weight", (kv, h)), (f"{p}.self_attn.o_proj.weight", (h, q)),
                   (f"{p}.mlp.gate_proj.weight", (i, h)), (f"{p}.mlp.up_proj.weight", (i, h)),
                   (f"{p}.mlp.down_proj.weight", (h, i)), (f"{p}.input_layernorm.weight", (h,)),
                   (f"{p}.post_attention_layernorm.weight", (h,))]
    return shapes + [("model.norm.weight", (h,)), ("lm_head.weight", (cfg.vocab_size, h))]


def tiny_state_dict(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Fixed-seed weights (Hugging Face Llama names), the same on every machine."""
    g = torch.Generator().manual_seed(TINY_SEED)
    sd = {}
    for name, shape in _llama_shapes(cfg):
        if name.endswith("norm.weight"):
            sd[name] = torch.ones(shape)
        else:
            sd[name] = torch.randn(shape, generator=g) * (1.0 / shape[-1] ** 0.5)
    return sd


def save_tiny(path: str | Path) -> Path:
    """Write ``tiny`` as a Hugging Face checkpoint (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config()
    (path / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
    save_file({k: v.contiguous() for k, v in tiny_state_dict(cfg).items()}, str(path / "model.safetensors"))
    return path


def resolve_dtype(dtype: str, device: torch.device, cfg_dtype: str | None) -> torch.dtype:
    names = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if dtype == "auto":
        # CPUs run float32 (half precision is slow there); GPUs take the checkpoint's dtype.
        if device.type == "cpu":
            return torch.float32
        return names.get(cfg_dtype or "", torch.bfloat16) if cfg_dtype != "float32" else torch.float32
    if dtype not in names:
        raise ValueError(f"dtype must be one of auto, float32, float16, bfloat16; got {dtype!r}")
    return names[dtype]


LOAD_FORMATS = ("auto", "dummy")


def load_model(spec: ModelSpec, device: torch.device, dtype: str, max_positions: int | None = None,
               load_format: str = "auto"):
    """The network of ``spec`` (``load_model_spec``), weights loaded, on ``device``.

    ``load_format="dummy"`` (as vLLM names it) reads no weights: the checkpoint's shape with
    fixed-seed random weights made on the device, for benchmarks of large shapes (a directory
    with only a ``config.json`` is enough).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}; got {load_format!r}")
    cfg = spec.config
    cfg_dtype = spec.dtype
    torch_dtype = resolve_dtype(dtype, device, cfg_dtype)
    arch = architecture(cfg.model_type)
    decoder = arch.decoder_spec(cfg)
    if load_format == "dummy":
        return _dummy_model(cfg, decoder, device, torch_dtype, max_positions)
    state = tiny_state_dict(cfg) if spec.path is None else _read_safetensors(spec.path)
    state = {k.removeprefix("base_model."): v for k, v in state.items()}
    if hasattr(arch, "convert"):
        state = arch.convert(state, cfg)
    fuse_projections(state)
    if "lm_head.weight" not in state:
        if not cfg.tie_word_embeddings:
            raise ValueError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    net = CausalLM(cfg, decoder, max_positions=max_positions)
    own = net.state_dict()
    wrong = [f"{k} {tuple(v.shape)} (the config makes {tuple(own[k].shape)})" for k, v in state.items()
             if k in own and own[k].shape != v.shape]
    if wrong:
        raise ValueError(f"checkpoint does not match its config.json: {'; '.join(wrong[:3])}"
                         f"{f' and {len(wrong) - 3} more' if len(wrong) > 3 else ''}")
    missing, unexpected = net.load_state_dict(state, strict=False)
    unexpected = [u for u in unexpected if "rotary_emb" not in u]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    net.tie_weights()
    net.to(device=device, dtype=torch_dtype)
    # RoPE tables stay float32 for accuracy; they are cast per use.
    for rope in net.ropes():
        rope.float()
    net.eval()
    return net


def _dummy_model(cfg: ModelConfig, decoder, device: torch.device, dtype: torch.dtype, max_positions: int | None):
    """Random weights made where they will run, in their dtype (an 8B model never passes
    through host memory): N(0, 1/fan_in) matrices, unit norms, from a fixed seed."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            net = CausalLM(cfg, decoder, max_positions=1)
    finally:
        torch.set_default_dtype(default)
    g = torch.Generator(device=device).manual_seed(TINY_SEED)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if p.dim() == 1 and name.endswith("weight"):
                p.fill_(1.0)
            elif p.dim() == 1 or "bias" in name:
                p.zero_()
            else:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5, generator=g)
    for rope in net.ropes():
        rope.float()
    net.extend_positions(max_positions or cfg.max_position_embeddings)
    net.tie_weights()
    net.eval()
    return net


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's weight files, as transformers finds them: the shards its
    ``model.safetensors.index.json`` names, else ``model.safetensors``, else every
    ``*.safetensors`` but other tools' files (Mistral's ``consolidated.safetensors``, a LoRA
    adapter's ``adapter_model.safetensors``), which hold the same or other weights under other names."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"model: {index} is not a safetensors index ({e})") from None
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ValueError(f"model: {index} names files that are not there: {missing[:3]}")
        return [path / n for n in names]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    return sorted(f for f in path.glob("*.safetensors")
                  if not f.name.startswith(("consolidated", "adapter_model")))


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = weight_files(path)
    if not files:
        raise ValueError(f"model: no *.safetensors files in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state
