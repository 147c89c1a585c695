"""The floor of ``pagefleet bench token-path``: what streaming a message costs with nothing behind it.

``python -m pagefleet.bench.floor grpc|sse PORT``: a server that answers every call with
``max_tokens`` canned messages of the size the gateway sends (one token, one character, the
same fields), as fast as the client takes them:

* ``grpc``: a trivial grpc.aio servicer of ``pagefleet.v1.Generation/Generate``;
* ``sse``: a trivial uvicorn app whose ``POST /v1/completions`` streams OpenAI completion
  chunks (``data: {...}``, a usage chunk, ``data: [DONE]``), as the HTTP door does.

The same client (``token_client``) drives it as it drives the cluster, so the server's CPU
per message is the floor a gateway's relay is compared with.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time


async def _grpc(port: int) -> None:
    import grpc

    from pagefleet.common.service import SERVER_OPTIONS
    from pagefleet.protos import generation_pb2 as pb
    from pagefleet.protos import generation_pb2_grpc

    class Canned(generation_pb2_grpc.GenerationServicer):
        async def Generate(self, request, context):
            n = request.sampling.max_tokens
            for i in range(n):
                msg = pb.GenerateResponse(request_id=request.request_id, token_ids=[65 + i % 58],
                                          text=chr(65 + i % 58), index=i)
                if i == n - 1:
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


def _sse_app():
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
            for i in range(n):
                yield chunk(chr(65 + i % 58), "length" if i == n - 1 else None)
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
    kind, port = argv[0], int(argv[1])
    if kind == "grpc":
        asyncio.run(_grpc(port))
    elif kind == "sse":
        import uvicorn

        print("ready", flush=True)
        uvicorn.run(_sse_app(), host="127.0.0.1", port=port, log_level="warning", access_log=False)
    else:
        print(f"usage: python -m pagefleet.bench.floor grpc|sse PORT (not {kind!r})", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
