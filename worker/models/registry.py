"""``model_type`` -> the architecture that builds its network: adding one is a file
beside these and a line here (and its name in ``common.model_config.SUPPORTED``)."""

from __future__ import annotations

from types import ModuleType

from . import gemma2, gemma3, gpt_oss, granite, llama, mixtral, olmo2, phi3, qwen3, qwen3_moe

# Each module has ``decoder_spec(cfg) -> DecoderSpec`` and may have ``convert(state, cfg)``,
# which renames a checkpoint's state dict to the network's names (before q/k/v fusion).
ARCHITECTURES: dict[str, ModuleType] = {
    "llama": llama,
    "mistral": llama,
    "qwen2": llama,
    "qwen3": qwen3,
    "qwen3_moe": qwen3_moe,
    "gemma2": gemma2,
    "gemma3_text": gemma3,
    "gemma3": gemma3,
    "phi3": phi3,
    "mixtral": mixtral,
    "olmo2": olmo2,
    "granite": granite,
    "gpt_oss": gpt_oss,
}


def architecture(model_type: str) -> ModuleType:
    try:
        return ARCHITECTURES[model_type]
    except KeyError:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {sorted(ARCHITECTURES)}") from None
