"""A small client for the gateway, sync and asyncio; and ``pagefleet generate``.

    from pagefleet.client import Client
    with Client("localhost:50051") as c:
        for msg in c.generate_stream("Hello", max_tokens=16, temperature=0):
            print(msg.text, end="", flush=True)
        out = c.generate("Hello", max_tokens=16)      # Completion(token_ids, text, finish_reason, ...)

    from pagefleet.client import AsyncClient
    async with AsyncClient("localhost:50051") as c:
        async for msg in c.generate_stream("Hello", max_tokens=16): ...

    Client("gateway.example:50051", api_key="pf-...", ca="ca.pem")   # TLS, and a key on every call
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from pagefleet.common.service import CHANNEL_OPTIONS, EnvArgumentParser
from pagefleet.common.step_write import stop_of
from pagefleet.protos import generation_pb2 as pb
from pagefleet.protos import generation_pb2_grpc

FINISH_NAMES = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_ERROR: "error",
}


@dataclass(slots=True)
class Completion:
    """A whole generation, gathered from its stream."""

    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    stop_reason: str | int | None = None  # with "stop": the stop string or stop token that ended it

    def add(self, msg: pb.GenerateResponse) -> None:
        if msg.index != len(self.token_ids):
            raise RuntimeError(f"stream out of order: index {msg.index}, expected {len(self.token_ids)}")
        self.request_id = msg.request_id
        self.token_ids.extend(msg.token_ids)
        self.text += msg.text
        if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self.finish_reason = FINISH_NAMES[msg.finish_reason]
            self.error = msg.error
            self.prompt_tokens = msg.usage.prompt_tokens
            self.completion_tokens = msg.usage.completion_tokens
            self.stop_reason = stop_of(msg)


def build_request(
    prompt: str | Sequence[int],
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    stop: str | Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    priority: int = 0,
    deadline_ms: int | None = None,
    request_id: str = "",
    structured_outputs: pb.StructuredOutputs | None = None,
    model: str | None = None,
) -> pb.GenerateRequest:
    """The ``GenerateRequest`` of these arguments (as vLLM's: a ``stop`` string is one stop
    string, ``top_k`` -1 is off). A value its field cannot hold is a ``ValueError`` naming the
    field (the gateway checks the rest and answers ``INVALID_ARGUMENT`` naming it)."""
    sampling = pb.SamplingParams(ignore_eos=ignore_eos)
    _set(sampling.stop.extend, "stop", [stop] if isinstance(stop, str) else list(stop))
    _set(sampling.stop_token_ids.extend, "stop_token_ids", list(stop_token_ids))
    if structured_outputs is not None:
        sampling.structured_outputs.CopyFrom(structured_outputs)
    if seed is not None and -(1 << 63) <= seed < 0:  # vLLM's int64 seeds: a negative one as its two's complement
        seed += 1 << 64
    if top_k == -1:  # vLLM's off, as 0 is here
        top_k = 0
    for name, value in (("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p),
                        ("top_k", top_k), ("min_p", min_p), ("seed", seed)):
        if value is not None:
            _set(lambda v, n=name: setattr(sampling, n, v), name, value)
    req = pb.GenerateRequest(request_id=request_id, sampling=sampling)
    _set(lambda v: setattr(req, "priority", v), "priority", priority)
    if isinstance(prompt, str):
        req.prompt = prompt
    else:
        _set(req.prompt_token_ids.ids.extend, "prompt", list(prompt))
    if deadline_ms is not None:
        _set(lambda v: setattr(req, "deadline_ms", v), "deadline_ms", deadline_ms)
    if model is not None:
        req.model = model
    return req


def _set(put, name: str, value) -> None:
    """``put(value)`` into a protobuf field; its range or type error named by the field."""
    try:
        put(value)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{name}: {e} (got {value!r})") from None


def _metadata(auth: tuple, traceparent: str | None):
    return (*auth, *((("traceparent", traceparent),) if traceparent else ())) or None


def _auth(api_key: str | None) -> tuple:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def _credentials(ca: str | None, client_cert: str | None, client_key: str | None):
    """TLS channel credentials when ``ca`` or a client certificate is given, else None (plaintext)."""
    if ca is None and client_cert is None:
        return None
    from pagefleet.common.tls import channel_credentials

    return channel_credentials(ca, client_cert, client_key)


class Client:
    """Blocking client; one channel, thread-safe. ``options``: more gRPC channel options.

    ``api_key``: sent with every call (``authorization: Bearer``); ``ca``: speak TLS and trust
    this CA (PEM) for the gateway's certificate; ``client_cert``/``client_key``: show this
    certificate, for a gateway that asks for one (TLS with the system's roots if ``ca`` is None).
    """

    def __init__(self, target: str = "localhost:50051", options: Sequence[tuple[str, object]] = (), *,
                 api_key: str | None = None, ca: str | None = None, client_cert: str | None = None,
                 client_key: str | None = None) -> None:
        credentials = _credentials(ca, client_cert, client_key)
        options = [*CHANNEL_OPTIONS, *options]
        self.channel = (grpc.insecure_channel(target, options=options) if credentials is None
                        else grpc.secure_channel(target, credentials, options=options))
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self._auth = _auth(api_key)

    def generate_stream(self, prompt, *, traceparent: str | None = None, timeout: float | None = None,
                        **kwargs) -> Iterator[pb.GenerateResponse]:
        """Stream the messages; cancel the iterator (``.cancel()``) or drop it to stop the request."""
        return self.stub.Generate(build_request(prompt, **kwargs), timeout=timeout,
                                  metadata=_metadata(self._auth, traceparent))

    def generate(self, prompt, **kwargs) -> Completion:
        out = Completion()
        for msg in self.generate_stream(prompt, **kwargs):
            out.add(msg)
        return out

    def cancel(self, request_id: str) -> bool:
        return self.stub.Cancel(pb.CancelRequest(request_id=request_id), metadata=_metadata(self._auth, None)).accepted

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """asyncio client (``grpc.aio``). ``options``: more gRPC channel options; ``api_key``, ``ca``,
    ``client_cert``, ``client_key`` as ``Client`` takes them."""

    def __init__(self, target: str = "localhost:50051", options: Sequence[tuple[str, object]] = (), *,
                 api_key: str | None = None, ca: str | None = None, client_cert: str | None = None,
                 client_key: str | None = None) -> None:
        credentials = _credentials(ca, client_cert, client_key)
        options = [*CHANNEL_OPTIONS, *options]
        self.channel = (grpc.aio.insecure_channel(target, options=options) if credentials is None
                        else grpc.aio.secure_channel(target, credentials, options=options))
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self._auth = _auth(api_key)

    def generate_stream(self, prompt, *, traceparent: str | None = None, timeout: float | None = None,
                        **kwargs) -> AsyncIterator[pb.GenerateResponse]:
        """An async iterator of messages; ``.cancel()`` on it stops the request."""
        return self.stub.Generate(build_request(prompt, **kwargs), timeout=timeout,
                                  metadata=_metadata(self._auth, traceparent))

    async def generate(self, prompt, **kwargs) -> Completion:
        out = Completion()
        async for msg in self.generate_stream(prompt, **kwargs):
            out.add(msg)
        return out

    async def cancel(self, request_id: str) -> bool:
        return (await self.stub.Cancel(pb.CancelRequest(request_id=request_id),
                                       metadata=_metadata(self._auth, None))).accepted

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _ranged(low: int, high: int):
    """An argparse type: an integer in [low, high], else the flag's error (not a traceback)."""
    def parse(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def main(argv: list[str]) -> int:
    """``pagefleet generate "text"``: stream one generation to stdout."""
    p = EnvArgumentParser(prog="pagefleet generate", description="Stream a generation from a running gateway.")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--target", default="localhost:50051", help="gateway host:port")
    p.add_argument("--max-tokens", type=_ranged(1, (1 << 32) - 1), default=64, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=None, help="0 is greedy (default: the server's 1.0)")
    p.add_argument("--seed", type=_ranged(-(1 << 63), (1 << 64) - 1), default=None,
                   help="seed of this request's sampling (any int64, as vLLM's, or up to 2^64-1)")
    p.add_argument("--priority", type=_ranged(-(1 << 31), (1 << 31) - 1), default=0, help="larger is more important")
    p.add_argument("--model", default=None, help="the model to run (needed when the gateway serves several)")
    p.add_argument("--show-tokens", action="store_true", help="print token ids instead of text")
    p.add_argument("--api-key", default=None, help="the gateway's API key (sent as `authorization: Bearer`)")
    p.add_argument("--ca", default=None, metavar="PATH", help="speak TLS, trusting this CA for the gateway's certificate")
    p.add_argument("--client-cert", default=None, metavar="PATH",
                   help="show this client certificate (a gateway with --tls-client-ca wants one)")
    p.add_argument("--client-key", default=None, metavar="PATH", help="the private key of --client-cert")
    args = p.parse_args(argv)
    try:
        with Client(args.target, api_key=args.api_key, ca=args.ca, client_cert=args.client_cert,
                    client_key=args.client_key) as c:
            done = Completion()
            for msg in c.generate_stream(args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                                         seed=args.seed, priority=args.priority, model=args.model):
                done.add(msg)
                sys.stdout.write(" ".join(map(str, msg.token_ids)) + " " if args.show_tokens else msg.text)
                sys.stdout.flush()
    except grpc.RpcError as e:
        print(f"\npagefleet generate: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:  # a certificate or key that cannot be read, a bad target
        print(f"pagefleet generate: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    print(f"\n[{done.finish_reason}{': ' + done.error if done.error else ''}; "
          f"{done.prompt_tokens} prompt + {done.completion_tokens} completion tokens]", file=sys.stderr)
    return 0 if done.finish_reason != "error" else 1
