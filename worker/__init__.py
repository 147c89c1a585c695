"""The worker engine: paged KV cache, iteration-level scheduling, model runner."""
