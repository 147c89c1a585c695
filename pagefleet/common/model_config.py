"""A model without its weights: its shape (``config.json``), EOS ids, tokenizer and context.

``load_model_spec`` is the one reader of a checkpoint directory's metadata: the worker's
loader builds the network from it, the gateway tokenizes and checks prompts with it.
Torch-free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .tokenizer import ByteTokenizer, HFTokenizer, NoTokenizer

TINY = "tiny"

# model_type -> the Hugging Face architecture it names. The worker's registry
# (``worker/models/registry.py``) has one entry per name here; a test checks they agree.
SUPPORTED = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "granite": "GraniteForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# The MLP activations the worker's layers have (worker/models/layers.py ``ACTIVATIONS``), checked
# here so that a gateway or ``pagefleet models`` refuses a checkpoint its workers cannot load.
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh", "gelu")
# Each architecture's config defaults, as transformers' config classes have them: a key that
# config.json leaves out (transformers drops values equal to its defaults when it saves, and
# Gemma 3's vision-language checkpoints give only a few of their text model's) means this.
# Values derived from others (num_key_value_heads = heads, head_dim = hidden / heads) are not here.
_BASE = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
         "num_attention_heads": 32, "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
         "tie_word_embeddings": False, "rope_theta": 10000.0}
_QWEN = {**_BASE, "vocab_size": 151936, "intermediate_size": 22016, "max_position_embeddings": 32768,
         "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28}
_GEMMA = {**_BASE, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
          "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
          "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096}
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": _BASE,
    "qwen2": {**_QWEN, "num_key_value_heads": 32},
    "mistral": {**_BASE, "intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                "sliding_window": 4096},
    "qwen3": {**_QWEN, "num_key_value_heads": 32, "head_dim": 128},
    "qwen3_moe": {**_QWEN, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
                  "num_key_value_heads": 4, "decoder_sparse_step": 1, "moe_intermediate_size": 768,
                  "num_experts_per_tok": 8, "norm_topk_prob": False},  # num_experts: 128, under either name
    "gemma2": {**_GEMMA, "vocab_size": 256000, "max_position_embeddings": 8192, "final_logit_softcapping": 30.0,
               "attn_logit_softcapping": 50.0},
    "gemma3_text": {**_GEMMA, "vocab_size": 262208, "max_position_embeddings": 131072, "rope_theta": 1000000.0,
                    "rope_local_base_freq": 10000.0},
    "phi3": {**_BASE, "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
             "max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
    "mixtral": {**_BASE, "intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-5, "num_experts_per_tok": 2, "num_local_experts": 8, "rope_theta": 1000000.0},
    "olmo2": {**_BASE, "vocab_size": 50304, "rms_norm_eps": 1e-5},
    "granite": {**_BASE, "embedding_multiplier": 1.0, "logits_scaling": 1.0, "residual_multiplier": 1.0,
                "attention_multiplier": 1.0},
    "gpt_oss": {**_BASE, "num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088, "hidden_size": 2880,
                "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
                "sliding_window": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                "num_experts_per_tok": 4, "swiglu_limit": 7.0, "attention_bias": True, "rope_theta": 150000.0},
}
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    hidden_act: str = "silu"
    # One of SLIDING / FULL per layer (empty: every layer FULL, or every layer SLIDING when
    # ``sliding_window`` is set).
    layer_types: tuple[str, ...] = ()
    # The text model's whole ``config.json`` (a multimodal checkpoint's ``text_config``): each
    # architecture reads its own extras from it (soft-caps, multipliers, MoE routing).
    hf: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def window_of(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (keys a query sees, itself included), or ``None``."""
        if self.sliding_window is None:
            return None
        if not self.layer_types:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    def __post_init__(self) -> None:
        # The shape's sizes as config.json gave them: a string or a fraction failed deep inside
        # a layer's construction (a traceback where one line naming the field belongs).
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("sliding_window", "bos_token_id"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"{name} must be an integer >= 0 or null, got {v!r}")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.eos_token_ids):
            raise ValueError(f"eos_token_id must be an integer >= 0 or a list of them, got {list(self.eos_token_ids)!r}")
        if not isinstance(self.rms_norm_eps, int | float) or isinstance(self.rms_norm_eps, bool):
            raise ValueError(f"rms_norm_eps must be a number, got {self.rms_norm_eps!r}")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        # No model_type: the architecture names it (else a Llama, as the oldest checkpoints are).
        inferred = next((t for a in archs for t, cls_name in SUPPORTED.items() if a == cls_name), "llama")
        model_type = cfg.get("model_type") or inferred
        if model_type not in SUPPORTED:
            raise ValueError(
                f"model_type {model_type!r} is not supported; supported: {sorted(SUPPORTED)}"
            )
        if archs and SUPPORTED[model_type] not in archs and not any(a.endswith("ForCausalLM") for a in archs):
            raise ValueError(f"architectures {archs} are not a causal language model; pagefleet serves "
                             f"{SUPPORTED[model_type]} for model_type {model_type!r}")
        if model_type == "gemma3":  # a vision-language checkpoint: serve its text model
            text = {**cfg.get("text_config", {}), "model_type": "gemma3_text"}
            # Its head is tied as the whole model says (not its text config), and its logits are
            # not soft-capped (Gemma3ForConditionalGeneration applies no final soft-cap).
            text["tie_word_embeddings"] = cfg.get("tie_word_embeddings", True)
            text["final_logit_softcapping"] = None
            for key in ("eos_token_id", "bos_token_id"):
                text.setdefault(key, cfg.get(key))
            cfg = text
            model_type = "gemma3_text"
        cfg = {**HF_DEFAULTS[model_type], **cfg}
        heads = cfg["num_attention_heads"]
        theta, rope_type, rope = _rope_of(cfg)
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope scaling type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)})")
        if cfg.get("use_bidirectional_attention"):  # EmbeddingGemma's: every token sees every other
            raise ValueError("use_bidirectional_attention: not a causal language model (attention both ways "
                             "is for embeddings, which pagefleet does not serve)")
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act {act!r} is not supported ({', '.join(HIDDEN_ACTS)})")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        window = cfg.get("sliding_window")
        if model_type in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window", False):
            window = None
        layer_types = tuple(cfg.get("layer_types") or _default_layer_types(model_type, cfg))
        if model_type == "qwen3_moe":
            # transformers' Qwen3-MoE gives every layer the window (its attention reads
            # config.sliding_window alone: no max_window_layers, no layer_types), unlike Qwen2/3.
            layer_types = ()
        if window is None:
            layer_types = ()
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v biases; Llama says so in its config.
            attention_bias=model_type == "qwen2" or cfg.get("attention_bias", False),
            mlp_bias=cfg.get("mlp_bias", False),
            sliding_window=window,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hidden_act=act,
            layer_types=layer_types,
            hf=dict(cfg),
        )

    def to_hf(self) -> dict[str, Any]:
        """A ``config.json`` that ``transformers`` loads as the same model."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope = {**self.rope_scaling, "rope_theta": self.rope_theta}
        return {
            "architectures": [SUPPORTED[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else (self.eos_token_ids[0] if self.eos_token_ids else None),
            "torch_dtype": "float32",
        }


def _default_layer_types(model_type: str, cfg: dict[str, Any]) -> tuple[str, ...]:
    """Which layers slide when ``config.json`` has no ``layer_types`` (checkpoints saved before
    transformers wrote them), as transformers fills them in; empty: every layer."""
    n = cfg["num_hidden_layers"]
    pattern = {"gemma2": 2, "gpt_oss": 2,
               "gemma3_text": cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6}
    if model_type in pattern:
        return tuple(SLIDING if (i + 1) % pattern[model_type] else FULL for i in range(n))
    if model_type in ("qwen2", "qwen3"):
        first = cfg.get("max_window_layers", 28)
        return tuple(SLIDING if i >= first else FULL for i in range(n))
    return ()


def _rope_of(cfg: dict[str, Any]) -> tuple[float, str, dict[str, Any]]:
    """(theta, rope type, scaling parameters) of the full-attention layers. transformers 5
    folds rope_theta and rope_scaling into rope_parameters, per layer type where they differ
    (Gemma 3: ``{"full_attention": {...}, "sliding_attention": {...}}``)."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if FULL in rope:
        rope = dict(rope[FULL])
    theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("yarn", "longrope") and "original_max_position_embeddings" not in rope:
        # Older Phi-3 configs keep it beside rope_scaling, not in it.
        rope["original_max_position_embeddings"] = cfg.get("original_max_position_embeddings",
                                                           cfg.get("max_position_embeddings", 2048))
    return float(theta), kind, rope


def tiny_config() -> ModelConfig:
    """The built-in ``tiny`` model: a small Llama shape (GQA, untied head) over the byte tokenizer."""
    return ModelConfig(
        model_type="llama",
        vocab_size=ByteTokenizer.vocab_size,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=2048,
        bos_token_id=ByteTokenizer.BOS,
        eos_token_ids=ByteTokenizer.eos_token_ids,
    )


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What every part knows of a model before (or without) loading its weights.

    ``config.eos_token_ids`` already include ``generation_config.json``'s; ``dtype`` is the
    checkpoint's own (``None`` when it does not say).
    """

    name: str
    config: ModelConfig
    tokenizer: Any
    dtype: str | None = None
    path: Path | None = None

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def context_limit(self) -> int:
        """The longest sequence the model handles: its own context (a sliding window slides),
        or YaRN's extended one (``original_max_position_embeddings`` x ``factor``, as vLLM
        derives it): Qwen's model cards extend the context by adding a yarn ``rope_scaling``
        and leaving ``max_position_embeddings`` as it is."""
        cfg = self.config
        scaling = cfg.rope_scaling or {}
        if scaling.get("rope_type") == "yarn" and scaling.get("factor"):
            extended = int(scaling["original_max_position_embeddings"] * scaling["factor"])
            return max(cfg.max_position_embeddings, extended)
        return cfg.max_position_embeddings

    def max_model_len(self, requested: int | None = None) -> int:
        """``requested`` checked against the model's context (``None``: the whole context)."""
        limit = self.context_limit
        if requested is None:
            return limit
        if isinstance(requested, bool) or not isinstance(requested, int) or not 1 <= requested <= limit:
            raise ValueError(f"max_model_len must be between 1 and {limit} for this model, got {requested!r}")
        return requested


def _json_object(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file that must hold an object; ``ValueError`` naming it otherwise."""
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:  # not JSON, or not UTF-8
        raise ValueError(f"model: {path} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"model: {path} must hold a JSON object, got {type(raw).__name__}")
    return raw


def load_model_spec(model: str) -> ModelSpec:
    """``"tiny"`` or a Hugging Face checkpoint directory; ``ValueError`` naming what is wrong."""
    if model == TINY:
        return ModelSpec(TINY, tiny_config(), ByteTokenizer(), "float32")
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model: {model!r} is neither 'tiny' nor a directory with config.json "
            "(no model can be downloaded; pass a local Hugging Face checkpoint)"
        )
    raw = _json_object(path / "config.json")
    try:
        cfg = ModelConfig.from_hf(raw)
    except (TypeError, AttributeError, KeyError, IndexError) as e:  # a field of the wrong type or shape
        raise ValueError(f"model: {path / 'config.json'}: a field has the wrong type or shape "
                         f"({type(e).__name__}: {e})") from None
    gen_cfg = path / "generation_config.json"
    if gen_cfg.is_file():
        g_eos = _json_object(gen_cfg).get("eos_token_id")
        if g_eos is not None:
            extra = g_eos if isinstance(g_eos, list) else [g_eos]
            cfg = replace(cfg, eos_token_ids=tuple(sorted(set(cfg.eos_token_ids) | set(extra))))
    if (path / "tokenizer.json").is_file():
        tokenizer = HFTokenizer(path / "tokenizer.json", cfg.eos_token_ids, cfg.bos_token_id)
    else:
        tokenizer = NoTokenizer(cfg.eos_token_ids)
    return ModelSpec(model, cfg, tokenizer, raw.get("dtype") or raw.get("torch_dtype"), path)
