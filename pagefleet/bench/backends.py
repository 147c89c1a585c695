"""How ``pagefleet bench serve`` sends one request and times it: ``openai`` and ``grpc``.

* ``openai`` streams ``/v1/completions`` (vLLM's ``openai`` backend) or
  ``/v1/chat/completions`` (``--endpoint``) over HTTP with ``stream_options.include_usage``,
  and takes the token counts from the usage the server sends. A chunk counts as a token
  chunk when it carries text: a role-only first chunk or a final chunk with only a finish
  reason and usage times nothing.
* ``grpc`` streams ``Generate`` from a pagefleet gateway with ``pagefleet.client``'s
  ``AsyncClient``; every message says how many tokens it carries.

A request succeeded when it streamed at least one token chunk and ended with a finish
reason (``stop`` or ``length``); anything else is a failure with its error kept.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Protocol

from .datasets import SampleRequest
from .serve_metrics import RequestResult


@dataclass(frozen=True, slots=True)
class Sampling:
    """What every request asks besides its prompt and length (``None``: the server's default)."""

    temperature: float | None = None
    ignore_eos: bool = False
    extra_body: dict = field(default_factory=dict)  # openai only: merged into every request body


class Backend(Protocol):
    async def send(self, req: SampleRequest, max_tokens: int | None = None) -> RequestResult: ...

    async def aclose(self) -> None: ...


class _Timer:
    """Arrival times of one request's token chunks."""

    __slots__ = ("result", "last", "num_chunks")

    def __init__(self, req: SampleRequest, max_tokens: int) -> None:
        self.result = RequestResult(prompt_len=req.prompt_len, expected_output_len=max_tokens)
        self.result.start_time = self.last = time.perf_counter()
        self.num_chunks = 0

    def chunk(self, text: str) -> None:
        now = time.perf_counter()
        r = self.result
        if self.num_chunks == 0:
            r.ttft = now - r.start_time
        else:
            r.itl.append(now - self.last)
        self.last = now
        self.num_chunks += 1
        r.generated_text += text

    def finish(self, finish_reason: str | None, error: str = "") -> RequestResult:
        r = self.result
        r.latency = self.last - r.start_time
        r.success = bool(self.num_chunks) and finish_reason in ("stop", "length") and not error
        if not r.success:
            r.error = error or (f"stream ended with finish reason {finish_reason!r} after {self.num_chunks} "
                                "token chunks")
        return r


# -- OpenAI-compatible HTTP ------------------------------------------------------------------------
def _httpx():
    try:
        import httpx2 as httpx  # what this environment's openai client ships with
    except ImportError:
        import httpx
    return httpx


class OpenAIBackend:
    def __init__(self, base_url: str, endpoint: str, model: str, sampling: Sampling,
                 max_connections: int = 256) -> None:
        httpx = _httpx()
        self.url = base_url.rstrip("/") + endpoint
        self.chat = endpoint.rstrip("/").endswith("chat/completions")
        self.model, self.sampling = model, sampling
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(6 * 3600.0, connect=30.0), limits=limits)

    def payload(self, prompt: str, max_tokens: int) -> dict:
        body: dict = {"model": self.model, "stream": True, "stream_options": {"include_usage": True}}
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
            body["max_completion_tokens"] = max_tokens
        else:
            body["prompt"] = prompt
            body["max_tokens"] = max_tokens
        if self.sampling.temperature is not None:
            body["temperature"] = self.sampling.temperature
        if self.sampling.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.sampling.extra_body)
        return body

    async def send(self, req: SampleRequest, max_tokens: int | None = None) -> RequestResult:
        n = req.expected_output_len if max_tokens is None else max_tokens
        body = self.payload(req.prompt, n)
        timer = _Timer(req, n)
        finish_reason, error, usage = None, "", None
        try:
            async with self.client.stream("POST", self.url, json=body) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode("utf-8", "replace")
                    return timer.finish(None, f"HTTP {resp.status_code}: {text[:500]}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, SSE comments (pings)
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if chunk.get("error"):
                        error = json.dumps(chunk["error"])[:500]
                        break
                    for choice in chunk.get("choices") or ():
                        text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
                        if text:
                            timer.chunk(text)
                        finish_reason = choice.get("finish_reason") or finish_reason
                    usage = chunk.get("usage") or usage
        except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
            return timer.finish(None, f"{type(e).__name__}: {e}")
        r = timer.result
        if usage:
            r.output_tokens = int(usage.get("completion_tokens") or 0)
            r.prompt_len = int(usage.get("prompt_tokens") or r.prompt_len)
        else:
            r.output_tokens = timer.num_chunks
        return timer.finish(finish_reason, error)

    async def aclose(self) -> None:
        await self.client.aclose()


async def first_model(base_url: str) -> str:
    """The first model a server lists at ``/v1/models`` (vLLM's default for ``--model``)."""
    httpx = _httpx()
    async with httpx.AsyncClient(timeout=30.0) as c:
        resp = await c.get(base_url.rstrip("/") + "/v1/models")
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]


# -- pagefleet's gRPC gateway ----------------------------------------------------------------------------
class GrpcBackend:
    def __init__(self, target: str, sampling: Sampling) -> None:
        from pagefleet.client import AsyncClient

        self.client = AsyncClient(target.removeprefix("grpc://"))
        self.sampling = sampling

    async def send(self, req: SampleRequest, max_tokens: int | None = None) -> RequestResult:
        import grpc

        from pagefleet.client import FINISH_NAMES

        n = req.expected_output_len if max_tokens is None else max_tokens
        timer = _Timer(req, n)
        finish_reason, error = None, ""
        num_tokens = 0
        try:
            async for msg in self.client.generate_stream(req.prompt, max_tokens=n,
                                                         temperature=self.sampling.temperature,
                                                         ignore_eos=self.sampling.ignore_eos):
                if msg.token_ids:
                    timer.chunk(msg.text)
                    num_tokens += len(msg.token_ids)
                if msg.finish_reason:
                    finish_reason, error = FINISH_NAMES.get(msg.finish_reason), msg.error
                    timer.result.prompt_len = msg.usage.prompt_tokens or timer.result.prompt_len
        except grpc.RpcError as e:
            return timer.finish(None, f"{e.code().name}: {e.details()}")
        timer.result.output_tokens = num_tokens
        return timer.finish(finish_reason, error)

    async def aclose(self) -> None:
        await self.client.close()
