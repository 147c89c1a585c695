"""The floor of ``pagefleet bench token-path``: what streaming a message costs with nothing behind it.

``python -m pagefleet.bench.floor grpc|sse PORT``: a server that answers every call with
``max_tokens`` canned messages of the size the gateway sends (one token, one character, the
same fields), as fast as the client takes them:

* ``grpc``: a trivial grpc.aio servicer of ``pagefleet.v1.Generation/Generate``;
* ``sse``: a trivial uvicorn app whose ``POST /v1/completions`` streams OpenAI completion
  chunks (``data: {...}``, a usage chunk, ``data: [DONE]``), as the HTTP door does.

The same client (``token_client``) drives it as it drives the cluster, so the server's CPU
per message is the floor a gateway's relay is compared with.

``--tokens-per-message N`` sends N tokens a message on average (2.5: 2, 3, 2, 3, ...; the last
one may hold fewer), as a
gateway does with ``--stream-interval N`` or for a client that fell behind; ``--pace-ms X``
sends a stream's messages X ms apart (its first one at once), as a cluster's steps pace them:
the floor of a relay whose messages wait for the model, each write alone on its connection.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time


def _pieces(n: int, per: float):
    """A stream of ``n`` canned tokens as messages of ``per`` on average (a fraction: sizes
    round up and down so the k-th message ends at round(k * per)): (index, token ids, text)
    each, one character a token."""
    if per == 1:
        for i in range(n):
            yield i, [65 + i % 58], chr(65 + i % 58)
        return
    i, k = 0, 0
    while i < n:
        k += 1
        end = min(n, max(i + 1, round(k * per)))
        ids = [65 + j % 58 for j in range(i, end)]
        yield i, ids, "".join(map(chr, ids))
        i = end


async def _grpc(port: int, per: float = 1, pace_s: float = 0.0) -> None:
    import grpc

    from pagefleet.common.service import SERVER_OPTIONS
    from pagefleet.protos import generation_pb2 as pb
    from pagefleet.protos import generation_pb2_grpc

    class Canned(generation_pb2_grpc.GenerationServicer):
        async def Generate(self, request, context):
            n = request.sampling.max_tokens
            for i, ids, text in _pieces(n, per):
                if pace_s and i:
                    await asyncio.sleep(pace_s)
                msg = pb.GenerateResponse(request_id=request.request_id, token_ids=ids, text=text, index=i)
                if i + len(ids) == n:
                    msg.finish_reason = pb.FINISH_REASON_LENGTH
                    msg.usage.prompt_tokens = len(request.prompt_token_ids.ids)
                    msg.usage.completion_tokens = n
                yield msg

    server = grpc.aio.server(options=SERVER_OPTIONS)
    generation_pb2_grpc.add_GenerationServicer_to_server(Canned(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


def _sse_app(per: float = 1, pace_s: float = 0.0):
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    async def completions(request):
        body = await request.json()
        n, rid, created = int(body["max_tokens"]), "cmpl-0123456789abcdef0123456789abcdef", int(time.time())

        def chunk(text: str, finish) -> bytes:
            obj = {"id": rid, "object": "text_completion", "created": created, "model": body["model"],
                   "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
            return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"

        async def events():
            for i, ids, text in _pieces(n, per):
                if pace_s and i:
                    await asyncio.sleep(pace_s)
                yield chunk(text, "length" if i + len(ids) == n else None)
            usage = {"id": rid, "object": "text_completion", "created": created, "model": body["model"],
                     "choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                                              "total_tokens": len(body["prompt"]) + n}}
            yield b"data: " + json.dumps(usage, separators=(",", ":")).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    completions.__annotations__ = {"request": Request}  # resolved here (this module's annotations are strings)
    app.post("/v1/completions")(completions)
    return app


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m pagefleet.bench.floor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=("grpc", "sse"))
    p.add_argument("port", type=int)
    p.add_argument("--tokens-per-message", type=float, default=1, metavar="N", help="on average (a fraction: sizes mixed)")
    p.add_argument("--pace-ms", type=float, default=0.0, metavar="X")
    args = p.parse_args(argv)
    if not 1 <= args.tokens_per_message < math.inf:
        p.error(f"--tokens-per-message must be at least 1 (and finite), got {args.tokens_per_message}")
    if not 0 <= args.pace_ms < math.inf:
        p.error(f"--pace-ms must be 0 or more (and finite), got {args.pace_ms}")
    per, pace_s = args.tokens_per_message, args.pace_ms / 1000
    if args.kind == "grpc":
        asyncio.run(_grpc(args.port, per, pace_s))
    else:
        import uvicorn

        print("ready", flush=True)
        uvicorn.run(_sse_app(per, pace_s), host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
