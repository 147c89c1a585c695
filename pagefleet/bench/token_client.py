"""The load of ``pagefleet bench token-path``: N streams of T tokens at concurrency C, checked.

Run as its own process (``python -m pagefleet.bench.token_client CONFIG_JSON``), so its CPU
is apart from the processes measured; prints one JSON object: per stream whether it came back
whole, and the latencies every stream saw.

* ``grpc``: ``pagefleet.v1.Generation/Generate`` over ``connections`` channels, each its own
  TCP connection (a local subchannel pool: by default grpc shares one connection among the
  channels to one target, and past the gateway's bound on one connection's streams
  (``--max-concurrent-streams``, 1,024) the server refuses new ones with HTTP/2
  ``REFUSED_STREAM``), streams spread round-robin. A stream is whole when its messages' indices run 0, 1, ... with no gap or
  repeat, it carries exactly T tokens and it ends with ``length``.
* ``openai``: ``POST /v1/completions`` with ``stream: true`` (one HTTP/1.1 connection a
  concurrent stream) and ``stream_options.include_usage``. The byte tokenizer makes one
  character a token, so a stream is whole when its text is T characters long, its usage says
  T completion tokens, and it ends with ``length``.

Latencies: TTFT from the call to the first token; ITL as the gap between two messages
divided over the tokens of the later one (one token a message: the gap itself).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time


def _stream_record(ok: bool, t0: float, times: list[tuple[float, int]], error: str = "") -> dict:
    ttft = times[0][0] - t0 if times else None
    itl = []
    for (a, _), (b, k) in zip(times, times[1:], strict=False):
        itl.extend([(b - a) / max(1, k)] * max(1, k))
    return {"ok": ok, "ttft_s": ttft, "itl_s": itl, "num_messages": len(times),
            "num_tokens": sum(k for _, k in times), "error": error,
            "span_unix": [time.time() - (time.perf_counter() - t0), time.time()]}


async def _grpc(cfg: dict) -> list[dict]:
    import grpc

    from pagefleet.common.service import CHANNEL_OPTIONS
    from pagefleet.protos import generation_pb2 as pb
    from pagefleet.protos import generation_pb2_grpc

    # A subchannel pool of its own per channel: else grpc gives every channel to one target the
    # same connection, and all the streams share one HTTP/2 connection's stream bound.
    options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(cfg["target"], options=options) for _ in range(cfg["connections"])]
    stubs = [generation_pb2_grpc.GenerationStub(c) for c in channels]
    prompt = list(range(65, 65 + cfg["prompt_len"]))
    t_out = cfg["max_tokens"]
    sem = asyncio.Semaphore(cfg["concurrency"])

    async def one(i: int) -> dict:
        req = pb.GenerateRequest(
            request_id=f"{cfg['run']}-{i}", prompt_token_ids=pb.TokenIds(ids=prompt),
            sampling=pb.SamplingParams(max_tokens=t_out, ignore_eos=True, seed=i, temperature=1.0))
        async with sem:
            t0 = time.perf_counter()
            times: list[tuple[float, int]] = []
            expected, finish = 0, None
            try:
                async for msg in stubs[i % len(stubs)].Generate(req, timeout=cfg["timeout_s"]):
                    n = len(msg.token_ids)
                    if msg.index != expected:
                        return _stream_record(False, t0, times, f"index {msg.index}, expected {expected}")
                    expected += n
                    if n:
                        times.append((time.perf_counter(), n))
                    if msg.finish_reason:
                        finish = msg.finish_reason
            except grpc.aio.AioRpcError as e:
                return _stream_record(False, t0, times, f"{e.code().name}: {e.details()}")
            ok = expected == t_out and finish == pb.FINISH_REASON_LENGTH
            return _stream_record(ok, t0, times, "" if ok else f"{expected} tokens, finish {finish}")

    try:
        return await asyncio.gather(*(one(i) for i in range(cfg["num_requests"])))
    finally:
        for c in channels:
            await c.close()


async def _openai(cfg: dict) -> list[dict]:
    import httpx

    t_out = cfg["max_tokens"]
    sem = asyncio.Semaphore(cfg["concurrency"])
    limits = httpx.Limits(max_connections=cfg["concurrency"], max_keepalive_connections=cfg["concurrency"])
    prompt = list(range(65, 65 + cfg["prompt_len"]))

    async def one(client, i: int) -> dict:
        body = {"model": cfg["model"], "prompt": prompt, "max_tokens": t_out, "stream": True, "seed": i,
                "temperature": 1.0, "ignore_eos": True, "stream_options": {"include_usage": True}}
        async with sem:
            t0 = time.perf_counter()
            times: list[tuple[float, int]] = []
            text, finish, usage = "", None, None
            try:
                # The client's id, as the gRPC client sends its own: the request's records in
                # Redis are named by it (``kept_bytes``), and the door keeps them for its retry.
                async with client.stream("POST", "/v1/completions", json=body,
                                         headers={"X-Request-Id": f"{cfg['run']}-{i}"}) as r:
                    if r.status_code != 200:
                        return _stream_record(False, t0, times, f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                        for c in chunk.get("choices") or ():
                            piece = c.get("text") or ""
                            if piece:
                                text += piece
                                times.append((time.perf_counter(), len(piece)))
                            finish = c.get("finish_reason") or finish
            except httpx.HTTPError as e:
                return _stream_record(False, t0, times, f"{type(e).__name__}: {e}")
            n = usage.get("completion_tokens") if usage else None
            ok = len(text) == t_out and n == t_out and finish == "length"
            return _stream_record(ok, t0, times, "" if ok else f"{len(text)} chars, usage {n}, finish {finish}")

    async with httpx.AsyncClient(base_url=cfg["target"], limits=limits, timeout=cfg["timeout_s"]) as client:
        return await asyncio.gather(*(one(client, i) for i in range(cfg["num_requests"])))


def run(cfg: dict) -> dict:
    """Drive the load ``cfg`` describes; the per-stream records and the wall time."""
    t0 = time.perf_counter()
    streams = asyncio.run(_grpc(cfg) if cfg["backend"] == "grpc" else _openai(cfg))
    return {"wall_s": time.perf_counter() - t0, "streams": streams}


def main() -> int:
    cfg = json.loads(sys.argv[1])
    out = run(cfg)
    with open(cfg["out"], "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
