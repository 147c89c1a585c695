"""Tiny random checkpoints of every architecture pagefleet loads, saved by `transformers`."""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(vocab_size=199, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)
WINDOW = 8  # shorter than most test prompts
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
ALTERNATING = ["sliding_attention", "full_attention"]

# name -> (transformers config class name, overrides). Several names per model_type where a
# feature needs its own checkpoint (a window, a rope scaling).
CASES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "mistral-window": ("MistralConfig", dict(sliding_window=WINDOW)),
    "qwen2-yarn": ("Qwen2Config", dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16))),
    "qwen3": ("Qwen3Config", {}),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         norm_topk_prob=True, mlp_only_layers=[1])),
    # transformers' Qwen3-MoE slides on every layer, max_window_layers or not (Qwen2/3 slide from it on).
    "qwen3_moe-window": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    # Untied heads: a tied Gemma of random weights mostly repeats its last token.
    "gemma2": ("Gemma2Config", dict(sliding_window=WINDOW, tie_word_embeddings=False, attn_logit_softcapping=0.5,
                                    final_logit_softcapping=5.0, query_pre_attn_scalar=24)),
    "gemma3_text": ("Gemma3TextConfig", dict(sliding_window=WINDOW, layer_types=ALTERNATING, tie_word_embeddings=False,
                                             rope_parameters={
                                                 "full_attention": dict(rope_type="linear", factor=2.0,
                                                                        rope_theta=100000.0),
                                                 "sliding_attention": dict(rope_type="default",
                                                                           rope_theta=100.0)})),
    # A vision-language checkpoint: pagefleet serves its language model (text prompts).
    "gemma3": ("Gemma3Config", dict(sliding_window=WINDOW, layer_types=ALTERNATING, tie_word_embeddings=False)),
    "phi3": ("Phi3Config", dict(partial_rotary_factor=0.75, max_position_embeddings=128, sliding_window=None,
                                rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                                     original_max_position_embeddings=32,
                                                     short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                                     long_factor=[1.0, 1.5, 2.5, 4.0, 6.0, 9.0]))),
    "mixtral-window": ("MixtralConfig", dict(sliding_window=WINDOW, **MOE)),
    "olmo2": ("Olmo2Config", {}),
    "granite": ("GraniteConfig", dict(embedding_multiplier=2.0, attention_multiplier=0.1,
                                      residual_multiplier=0.5, logits_scaling=2.0)),
    "gpt_oss": ("GptOssConfig", dict(sliding_window=WINDOW, layer_types=ALTERNATING, **MOE,
                                     rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=16.0,
                                                          beta_fast=32.0, beta_slow=1.0, truncate=False,
                                                          original_max_position_embeddings=16))),
}


def make_arch_checkpoint(path: Path, case: str) -> Path:
    """The checkpoint of ``case`` with wide random weights (logits far apart, greedy stable),
    norms and sinks perturbed so that every weight matters."""
    import transformers

    cls_name, overrides = CASES[case]
    torch.manual_seed(0)
    if cls_name == "Gemma3Config":
        cfg = _gemma3_vision_language(transformers.Gemma3TextConfig(**{**COMMON, **overrides}))
        model = transformers.Gemma3ForConditionalGeneration(cfg)
    else:
        cfg = getattr(transformers, cls_name)(**{**COMMON, **overrides})
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    gemma = cfg.model_type.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 3:  # stacked experts [E, in, out] (gpt-oss)
                p.normal_(0, 1.0 / p.shape[1] ** 0.5)
            elif p.dim() == 2:
                p.normal_(0, 1.0 / p.shape[-1] ** 0.5)
            elif "bias" in name or "sinks" in name:
                p.normal_(0, 0.5 if "sinks" in name else 0.1)
            else:  # norm weights: Gemma stores w of (1 + w)
                p.normal_(0.0 if gemma else 1.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _gemma3_vision_language(text):
    import transformers

    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    return transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                                     image_token_index=198, boi_token_index=196, eoi_token_index=197,
                                     tie_word_embeddings=False)


def hf_greedy(path: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """`transformers` greedy decoding in float32 with its eager attention (the reference
    implementation: soft-caps and sinks included), one prompt at a time."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
        outs.append(g[0, len(p):].tolist())
    return outs
