"""The public door: the gRPC ``Generation`` service (validate, tokenize, queue in Redis, relay the output stream)."""
