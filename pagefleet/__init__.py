"""pagefleet: an LLM-serving cluster with paged KV caches and continuous batching.

In-process use (one worker's engine)::

    from pagefleet import Engine, SamplingParams
    engine = Engine(model="tiny")
    outs = engine.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["Engine", "SamplingParams", "RequestOutput", "__version__"]


def __getattr__(name: str):
    # Lazy: `import pagefleet` (the CLI, the gateway) must not pay for importing torch.
    if name == "Engine":
        from pagefleet.worker.engine import Engine

        return Engine
    if name == "SamplingParams":
        from pagefleet.common.sampling_params import SamplingParams

        return SamplingParams
    if name == "RequestOutput":
        from pagefleet.worker.outputs import RequestOutput

        return RequestOutput
    raise AttributeError(f"module 'pagefleet' has no attribute {name!r}")
