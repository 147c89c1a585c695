"""``pagefleet models``: the architectures that load, or what one checkpoint loads as.

    pagefleet models                 # model_type, Hugging Face architecture, what it adds
    pagefleet models /path/to/ckpt   # that checkpoint's architecture and features
"""

from __future__ import annotations

import argparse

from pagefleet.common.model_config import SUPPORTED, load_model_spec

from .registry import ARCHITECTURES, architecture


def summary(model_type: str) -> str:
    """The first sentence of the architecture file's docstring."""
    doc = (ARCHITECTURES[model_type].__doc__ or "").strip().replace("\n", " ").replace("``", "")
    return doc.split(". ")[0].rstrip(".")


def features(path: str) -> dict[str, object]:
    """What the checkpoint at ``path`` loads as (reads its config, not its weights)."""
    spec = load_model_spec(path)
    cfg = spec.config
    decoder = architecture(cfg.model_type).decoder_spec(cfg)
    windows = [cfg.window_of(i) for i in range(cfg.num_hidden_layers)]
    moe = decoder.moe
    return {
        "model_type": cfg.model_type,
        "layers": cfg.num_hidden_layers,
        "context": spec.context_limit,
        "rope": (cfg.rope_scaling or {}).get("rope_type", "default"),
        "sliding window": "none" if not any(windows) else
        f"{cfg.sliding_window} on {sum(w is not None for w in windows)} of {len(windows)} layers",
        "moe": "none" if moe is None else f"{moe.num_experts} experts, top {moe.top_k} ({moe.routing})",
        "attention soft-cap": decoder.attn_soft_cap,
        "final soft-cap": decoder.final_soft_cap,
        "attention sinks": decoder.sinks,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagefleet models", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", nargs="?", help="a Hugging Face checkpoint directory")
    args = parser.parse_args(argv)
    if args.checkpoint is None:
        width = max(map(len, SUPPORTED))
        for model_type, hf_name in SUPPORTED.items():
            print(f"{model_type:<{width}}  {hf_name:<32} {summary(model_type)}")
        return 0
    try:
        table = features(args.checkpoint)
    except (ValueError, OSError) as e:  # a checkpoint that does not load: why, in one line
        parser.exit(2, f"pagefleet models: {args.checkpoint}: {e}\n")
    for key, value in table.items():
        print(f"{key:<20} {value}")
    return 0
