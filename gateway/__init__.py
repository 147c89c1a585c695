"""The public doors: the gRPC ``Generation`` service and the OpenAI-compatible HTTP API, one path
behind both (core.py: validate, tokenize, queue in Redis, relay the output stream)."""
