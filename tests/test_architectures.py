"""Every architecture against `transformers`: greedy tokens equal in each setting that
changes the step plan, seeded sampling the same with the prefix cache on and off."""

from __future__ import annotations

import random

import pytest
import torch
from arch_checkpoints import CASES, WINDOW, hf_greedy, make_arch_checkpoint

from pagefleet import Engine, SamplingParams
from pagefleet.common.model_config import load_model_spec

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
# Phi-3's longrope: transformers switches a whole sequence to its long factors, pagefleet per
# position (docs/MODELS.md); the case's original context is transformers' top-level 4,096, so
# neither reaches them here.
MAX_PROMPT = {"phi3": 28}


def prompts_for(case: str, n: int = 4) -> list[list[int]]:
    rng = random.Random(case)
    longest = MAX_PROMPT.get(case, 40)
    lens = [longest] + [rng.randrange(longest // 2, longest) for _ in range(n - 1)]
    return [[rng.randrange(3, 199) for _ in range(k)] for k in lens]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made: dict[str, tuple] = {}

    def get(case: str):
        if case not in made:
            path = make_arch_checkpoint(tmp_path_factory.mktemp(case), case)
            prompts = prompts_for(case)
            made[case] = (path, prompts, hf_greedy(path, prompts, MAX_TOKENS))
        return made[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_prefill_then_prefix_cache_hits(checkpoints, case):
    path, prompts, ref = checkpoints(case)
    assert max(len(p) for p in prompts) > WINDOW
    engine = Engine(str(path), block_size=4, num_blocks=128, max_num_batched_tokens=7, max_model_len=64)
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == ref
    hits = engine.kv.prefix_cache_hits_total
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == ref
    assert engine.kv.prefix_cache_hits_total > hits, "the second pass was meant to hit the prefix cache"


@pytest.mark.parametrize("case", list(CASES))
def test_preemption_under_a_small_pool(checkpoints, case):
    path, prompts, ref = checkpoints(case)
    # Room for the longest request and a little more: the others take turns.
    num_blocks = -(-(len(prompts[0]) + MAX_TOKENS) // 4) + 3
    engine = Engine(str(path), block_size=4, num_blocks=num_blocks, max_num_batched_tokens=16, max_model_len=64)
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == ref
    assert engine.stats().num_preemptions_total > 0, "the pool was meant to force preemption"


@pytest.mark.parametrize("case", list(CASES))
def test_seeded_sampling_is_the_same_with_the_cache_on_and_off(checkpoints, case):
    path, prompts, _ = checkpoints(case)
    on = Engine(str(path), block_size=4, num_blocks=64, max_model_len=64)
    on.generate(prompts[:1], GREEDY)  # the prompt's blocks now cached
    cached = on.generate(prompts[:1], SEEDED)[0].token_ids
    assert on.kv.prefix_cache_hits_total > 0
    off = Engine(str(path), block_size=4, num_blocks=64, max_model_len=64, enable_prefix_caching=False,
                 max_num_batched_tokens=5)
    assert off.generate(prompts[:1], SEEDED)[0].token_ids == cached


def test_max_model_len_is_the_context_not_the_window(checkpoints):
    path, prompts, _ = checkpoints("mistral-window")
    spec = load_model_spec(str(path))
    assert spec.config.sliding_window == WINDOW
    assert spec.max_model_len() == spec.config.max_position_embeddings > WINDOW


TIE = 0.15  # as the GPU suite's Llama test: a differing token must be a near-tie in fp32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers_in_bf16_on_a_gpu_within_ties(checkpoints, case):
    """The Triton kernels (window, soft-cap and sinks switches, fused MoE) in bf16: tokens agree
    with `transformers` in bf16 up to the first position where fp32 logits are a near-tie."""
    import transformers

    path, prompts, _ = checkpoints(case)
    load = transformers.AutoModelForCausalLM.from_pretrained
    ref_bf16 = load(path, dtype=torch.bfloat16, attn_implementation="eager").cuda().eval()
    ref_fp32 = load(path, dtype=torch.float32, attn_implementation="eager").cuda().eval()
    engine = Engine(str(path), device="cuda", dtype="bfloat16", block_size=16, num_blocks=64, max_model_len=64,
                    max_num_batched_tokens=16)
    ours = engine.generate(prompts, GREEDY)
    for p, o in zip(prompts, ours, strict=True):
        ids = torch.tensor([p], device="cuda")
        with torch.no_grad():
            theirs = ref_bf16.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                       do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        i = next((j for j, (a, b) in enumerate(zip(o.token_ids, theirs, strict=True)) if a != b), None)
        if i is None:
            continue
        with torch.no_grad():
            logits = ref_fp32(torch.tensor([p + theirs[:i]], device="cuda")).logits[0, -1].float()
        top = float(logits.max())
        gaps = (top - float(logits[o.token_ids[i]]), top - float(logits[theirs[i]]))
        assert max(gaps) <= TIE, f"{case}: token {i} differs and is no tie (gaps {gaps})"


# -- checkpoints as they are published ---------------------------------------------------------
# transformers drops the values equal to its defaults when it saves a config, and Gemma 3's
# vision-language checkpoints give only a few of their text model's: a key left out must read
# as transformers reads it.
_TYPES = ["llama", "qwen2", "mistral", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "phi3", "mixtral", "olmo2",
          "granite", "gpt_oss"]


def _as_transformers_reads(hf_cfg) -> dict:
    rope = hf_cfg.rope_parameters or {}
    rope = rope.get("full_attention", rope)
    return dict(vocab_size=hf_cfg.vocab_size, hidden_size=hf_cfg.hidden_size,
                intermediate_size=hf_cfg.intermediate_size, num_hidden_layers=hf_cfg.num_hidden_layers,
                num_attention_heads=hf_cfg.num_attention_heads, num_key_value_heads=hf_cfg.num_key_value_heads,
                head_dim=getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads,
                max_position_embeddings=hf_cfg.max_position_embeddings, rms_norm_eps=hf_cfg.rms_norm_eps,
                tie_word_embeddings=hf_cfg.tie_word_embeddings, rope_theta=float(rope["rope_theta"]),
                hidden_act=getattr(hf_cfg, "hidden_activation", None) or hf_cfg.hidden_act)


def _as_we_read(cfg) -> dict:
    return {k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                         "num_attention_heads", "num_key_value_heads", "head_dim",
                                         "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                                         "rope_theta", "hidden_act")}


@pytest.mark.parametrize("model_type", _TYPES)
def test_a_config_of_defaults_reads_as_transformers_reads_it(model_type):
    import transformers

    from pagefleet.common.model_config import ModelConfig

    ours = ModelConfig.from_hf({"model_type": model_type})
    assert _as_we_read(ours) == _as_transformers_reads(transformers.AutoConfig.for_model(model_type))


def test_gemma3_vision_language_config_as_google_published_it():
    """google/gemma-3-4b-it's text_config holds six keys; the rest are Gemma3TextConfig's
    defaults (it was a KeyError, then a model of the wrong shape). Its head is tied as the whole
    model says, and the whole model applies no final soft-cap."""
    import transformers

    from pagefleet.common.model_config import ModelConfig

    published = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
                 "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                                 "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                                 "sliding_window": 1024, "final_logit_softcapping": 30.0,
                                 "tie_word_embeddings": True},
                 "tie_word_embeddings": False}
    ours = ModelConfig.from_hf(published)
    theirs = transformers.AutoConfig.for_model(**published)
    want = _as_transformers_reads(theirs.text_config)
    want["tie_word_embeddings"] = theirs.tie_word_embeddings
    assert _as_we_read(ours) == want
    assert ours.hf["final_logit_softcapping"] is None and ours.hf["query_pre_attn_scalar"] == 256


def test_specs_follow_the_config_as_transformers_does():
    from pagefleet.common.model_config import ModelConfig
    from pagefleet.worker.models.registry import architecture

    def spec(cfg):
        return architecture(cfg.model_type).decoder_spec(cfg)

    small = dict(COMMON_SMALL)
    gemma3 = ModelConfig.from_hf({"model_type": "gemma3_text", **small, "attn_logit_softcapping": 50.0,
                                  "attention_bias": True})
    assert spec(gemma3).attn_soft_cap is None  # Gemma3Attention never soft-caps
    assert spec(gemma3).o_bias and spec(gemma3).qkv_bias  # its o_proj has the bias too
    assert spec(ModelConfig.from_hf({"model_type": "gemma2", **small, "attention_bias": True})).o_bias
    for moe in ({"model_type": "mixtral", **small, "hidden_act": "gelu"},
                {"model_type": "qwen3_moe", **small, "hidden_act": "gelu", "num_experts": 4,
                 "moe_intermediate_size": 8}):
        assert spec(ModelConfig.from_hf(moe)).moe.activation == "gelu"  # the experts' act, as transformers'
    assert ModelConfig.from_hf({"architectures": ["Qwen3ForCausalLM"], **small}).model_type == "qwen3"


COMMON_SMALL = dict(vocab_size=199, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16)


def test_only_the_checkpoints_own_weight_files_are_read(tmp_path, llama_dir):
    """A Mistral repository ships consolidated.safetensors (the same weights under other names)
    beside the sharded ones; a LoRA leaves adapter_model.safetensors. Every *.safetensors was
    read, and the names refused."""
    import shutil

    from safetensors.torch import save_file

    path = tmp_path / "ckpt"
    shutil.copytree(llama_dir, path)
    save_file({"layers.0.attention.wq.weight": torch.zeros(2, 2)}, str(path / "consolidated.safetensors"))
    save_file({"base_model.model.x.lora_A.weight": torch.zeros(2, 2)}, str(path / "adapter_model.safetensors"))
    out = Engine(str(path), device="cpu").generate([[5, 6, 7]], GREEDY)[0].token_ids
    assert out == Engine(str(llama_dir), device="cpu").generate([[5, 6, 7]], GREEDY)[0].token_ids


def test_weights_of_another_shape_are_refused_naming_them(tmp_path, llama_dir):
    import json
    import shutil

    path = tmp_path / "ckpt"
    shutil.copytree(llama_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 2 * cfg["intermediate_size"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="does not match its config.json: .*mlp"):
        Engine(str(path), device="cpu")


def test_yarn_extends_the_context_as_the_model_cards_say(tmp_path):
    """Qwen's model cards extend the context by adding a yarn rope_scaling and leaving
    max_position_embeddings as it is: the context is original_max_position_embeddings x factor
    (as vLLM derives it); it was refused past max_position_embeddings. Tokens past it equal
    transformers' (which generates there too)."""
    import json

    path = make_arch_checkpoint(tmp_path / "ckpt", "qwen2-yarn")  # original 16 x factor 4
    cfg = json.loads((path / "config.json").read_text())
    cfg["max_position_embeddings"] = 24
    (path / "config.json").write_text(json.dumps(cfg))
    assert load_model_spec(str(path)).max_model_len() == 64
    prompt = prompts_for("qwen2-yarn", 1)[0][:40]
    engine = Engine(str(path), device="cpu")
    assert engine.max_model_len == 64
    assert engine.generate([prompt], GREEDY)[0].token_ids == hf_greedy(path, [prompt], MAX_TOKENS)[0]


def test_attention_both_ways_is_refused_not_run_causally(tmp_path):
    """A Gemma 3 text config with ``use_bidirectional_attention`` (EmbeddingGemma's) ran causally,
    its tokens other than transformers' from the first; it is refused by name."""
    import transformers

    transformers.Gemma3TextConfig(vocab_size=199, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  use_bidirectional_attention=True).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        load_model_spec(str(tmp_path))
