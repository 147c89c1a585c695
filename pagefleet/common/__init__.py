"""Torch-free parts every component shares: tokenizers, sampling params, model specs, block arithmetic, Redis keys, flags, logs, metrics, tracing."""
