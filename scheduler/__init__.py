"""The central scheduler: the global queue, the worker table and admission, placement, the lease."""
