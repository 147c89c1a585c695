"""The OpenAI API over the gateway's core: one completion request from body to response.

``OpenAIDoor.completion`` parses a ``/v1/completions`` or ``/v1/chat/completions`` body
(openai_request.py: one ``pb.GenerateRequest`` per choice), renders chats with the
model's chat template, and takes the path a gRPC call takes: ``GatewayCore.check``,
``enqueue``, ``relay_all``. The answer is one JSON body or server-sent events
(``EventStream``, ending in ``data: [DONE]``), built by openai_response.py. Refusals are
``ApiError``s in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400
naming the parameter (or the limit a request is past, limits.py), 413 for a body past
``--max-request-bytes``, 404 for a model this gateway does not serve, 429 with
``Retry-After`` when the queue is full, 503 when the queue (Redis) is unreachable. A
client that goes away (while waiting or streaming) cancels its requests.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import structlog
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from pagefleet.common import telemetry
from pagefleet.common.chat_template import ChatTemplate, ChatTemplateError
from pagefleet.common.sampling_params import DEFAULT_MAX_TOKENS
from pagefleet.protos import generation_pb2 as pb

from .chat_output import ChatOutput
from .core import (
    GatewayCore,
    IdInUse,
    Queued,
    QueueUnavailable,
    Relays,
    Shed,
    fingerprint,
    traceparent_or_new,
)
from .limits import Limits, TooLarge
from .models import UnknownModel
from .observe import CallObserver, http_call
from .openai_request import ApiRequest, BadParam, fan_out, parse_json_body
from .openai_response import Choices, TokenPieces, sse
from .reasoning import START as THINK_START
from .responses_api import ResponseOutput
from .tool_parsers import tool_parser
from .validate import BadField, ContextTooLong, compile_ahead, valid_request_id

log = structlog.get_logger("gateway")

# What each HTTP status counts as in the gateway's (gRPC-coded) request metrics.
CODE_OF_STATUS = {
    200: grpc.StatusCode.OK,
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.INVALID_ARGUMENT,  # not RESOURCE_EXHAUSTED: that counts as shed for a full queue
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,  # the client closed the connection first (nginx's code)
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
}
CLIENT_GONE = 499


# Log-probabilities the unstreamed answers of one gateway process may hold at once (~300 bytes
# each as they are gathered: about 600 MB); a stream's wait in Redis instead.
MAX_HELD_LOGPROBS = 2_000_000

class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    @classmethod
    def bad(cls, e: BadParam) -> ApiError:
        return cls(400, e.message, "invalid_request_error", e.param, e.code)

    @classmethod
    def unavailable(cls, e: QueueUnavailable) -> ApiError:
        return cls(503, str(e), "service_unavailable_error", code="queue_unavailable")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return AsciiJSONResponse(self.body(), status_code=self.status, headers=self.headers)


def request_id_of(header: str) -> str:
    """The request id an ``X-Request-Id`` header names: itself where it is one (see
    ``valid_request_id``), else (any other value, as vLLM takes any: braces, '/', '=', long
    ones) a digest of it, the same for every retry."""
    if valid_request_id(header):
        return header
    return "xrid-" + hashlib.blake2b(header.encode("utf-8", "surrogateescape"), digest_size=16).hexdigest()


def _header_safe(value: str) -> bool:
    """Whether ``value`` can be an HTTP header's value as it is (printable ASCII)."""
    return value.isascii() and value.isprintable()


def _rename(checked: list[tuple[pb.GenerateRequest, list[int]]], base_id: str) -> str:
    """Give the choices the ids of ``base_id`` (``fan_out``'s: itself alone, else
    ``<base_id>-<choice>``); the first choice's."""
    for k, (r, _) in enumerate(checked):
        r.request_id = base_id if len(checked) == 1 else f"{base_id}-{k}"
    return checked[0][0].request_id


def _own_id(base_id: str, checked: list[tuple[pb.GenerateRequest, list[int]]]) -> str:
    """The id of a request whose client id is another request's: the client's, then a digest of
    every choice's fingerprint (at most 121 characters: room for ``-<choice>``)."""
    h = hashlib.blake2b(digest_size=12)
    for r, ids in checked:
        h.update(fingerprint(ids, r.sampling).encode())
    return f"{base_id[:96]}.{h.hexdigest()}"


class AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: a refusal that quotes the client's text (a lone surrogate
    included) is always valid UTF-8."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class OpenAIDoor:
    """The completion routes over one ``GatewayCore``."""

    def __init__(self, core: GatewayCore, served_model_name: str, template: ChatTemplate | None) -> None:
        self.core = core
        self.tool_call_parser = getattr(core.args, "tool_call_parser", None)
        self.reasoning_parser = getattr(core.args, "reasoning_parser", None)
        self.served_model_name = served_model_name
        self.template = template
        self.pieces = TokenPieces(core.model.tokenizer)
        self.created = int(time.time())
        self._held_logprobs = 0  # what the unstreamed answers being gathered may hold (``_hold``)

    async def completion(self, request: Request, route: str, parse: Callable[[Any, Limits], ApiRequest]) -> Response:
        call = http_call(self.core.metrics, "POST", route, request.headers)
        try:
            req, queued, base_id = await self._admit(request, parse, call)
        except ApiError as e:
            _end(call, e.status)
            return e.response()
        except ClientDisconnect:  # the client hung up before its body was read: nothing to answer
            log.info("http.client_gone", route=route, while_="reading the body")
            _end(call, CLIENT_GONE)
            return Response(status_code=CLIENT_GONE)
        except BaseException:
            _end(call, 500)
            raise
        relays = self.core.relay_all(queued)  # from here on, closing it cancels what has not finished
        handed = False  # to the stream or the collector, which close it however they end
        try:
            # The answer's id, as vLLM's: the route's prefix and the request's id (a client's too).
            answer_id = base_id if base_id.startswith(req.id_prefix) else f"{req.id_prefix}{base_id}"
            if req.api == "responses":
                outputs = self.chat_outputs(req) or [ChatOutput(None, None, None)]
                choices = ResponseOutput(req, answer_id, self.served_model_name, outputs[0], self.pieces)
            else:
                choices = Choices(req, answer_id, self.served_model_name, self.pieces, self._echoes(req),
                                  self.chat_outputs(req))
            for i, q in enumerate(queued):
                choices.set_prompt_tokens(i, q.num_prompt_tokens)
            # The client's own header back (a mesh's, whatever its form), else the id chosen here;
            # a body's id where it can be a header's value (it may hold any character).
            body_id = req.request_id if req.request_id and _header_safe(req.request_id) else None
            headers = {"X-Request-Id": request.headers.get("x-request-id") or body_id or base_id}
            if req.stream:
                stream = EventStream(self._events(choices, relays, call), relays, call,
                                     headers={**headers, "Cache-Control": "no-cache"})
                handed = True
                return stream
            handed = True
            return await self._collect(request, choices, relays, call, headers)
        finally:
            if not handed:  # failed before anyone read them: cancelled, not left running for no one
                await relays.aclose()
            self._release(req)  # what an unstreamed answer held (``_hold``): nothing for a stream

    async def _admit(self, request: Request, parse, call: CallObserver) -> tuple[ApiRequest, list[Queued], str]:
        """Parse, check and queue; ``ApiError`` for every refusal."""
        try:
            raw = await request.body()
        except TooLarge as e:
            raise ApiError(413, str(e), "invalid_request_error", code="request_too_large") from None
        try:
            req = parse(parse_json_body(raw), self.core.limits)
            if req.model is not None and req.model != self.served_model_name:
                raise ApiError(404, str(UnknownModel(req.model, [self.served_model_name])), "invalid_request_error",
                               "model", "model_not_found")
            if req.chat:
                self.render_messages(req)
            # The header's id, else the body's (vLLM's ``request_id``); an empty one: none.
            client_id = request.headers.get("x-request-id") or req.request_id
            base_id = request_id_of(client_id) if client_id else self.core.new_id(req.id_prefix, req.num_choices)
            call.describe(_request_attributes(req, self.served_model_name, base_id))
            self._tokenize_bad_words(req)
            requests = fan_out(req, base_id)
            await compile_ahead(requests[0].sampling, self.core.model)  # the choices share it
            checked = [(r, self._check(r, req)) for r in requests]
        except BadParam as e:
            raise ApiError.bad(e) from None
        except RecursionError:  # a template or schema deeper than the body check lets through
            raise ApiError(400, "the request nests too deep", "invalid_request_error") from None
        self._hold(req)
        try:
            with call.current():
                traceparent = traceparent_or_new(request.headers.get("traceparent"))
                # The client's id may name another request already (a mesh's X-Request-Id
                # forwarded on each of one call's several requests): this one is then served
                # under an id of its own, made from both, which its retries find again (looked
                # up first: the other's claim may be gone by then, and this one's not).
                own = _own_id(base_id, checked) if client_id else None
                if own is not None and await self.core.claimed(_rename(checked, own)):
                    base_id = own
                else:
                    _rename(checked, base_id)
                try:
                    queued = await self.core.enqueue(checked, traceparent, client_ids=bool(client_id))
                except IdInUse:
                    if own is None or base_id == own:
                        raise
                    base_id = own
                    _rename(checked, own)
                    queued = await self.core.enqueue(checked, traceparent, client_ids=True)
        except IdInUse as e:  # a fingerprint collision (2^-96): refused, never another's answer
            self._release(req)
            raise ApiError(409, str(e), "invalid_request_error", "X-Request-Id", "request_id_in_use") from None
        except Shed as e:
            self._release(req)
            retry_after = str(max(1, math.ceil(e.retry_after_s)))
            raise ApiError(429, str(e), "rate_limit_error", code="queue_full",
                           headers={"Retry-After": retry_after}) from None
        except QueueUnavailable as e:
            self._release(req)
            raise ApiError.unavailable(e) from None
        except BaseException:
            self._release(req)
            raise
        return req, queued, base_id

    def _hold(self, req: ApiRequest) -> None:
        """Reserve what an unstreamed answer with log-probabilities holds here until it is sent
        (choices x max_tokens x (1 + top_logprobs) entries, some 300 bytes each): one past
        ``MAX_HELD_LOGPROBS`` alone is refused (streamed, it costs no more than a stream), one
        past what the others hold now waits its turn (429, Retry-After)."""
        if req.stream or req.logprobs is None:
            return
        cost = req.num_choices * max(1, req.sampling.max_tokens) * (1 + req.logprobs)
        if cost > MAX_HELD_LOGPROBS:
            raise ApiError(400, f"n x max_tokens x (1 + top_logprobs) is {cost} log-probabilities, more than the "
                                f"{MAX_HELD_LOGPROBS} an unstreamed answer may hold: stream it (stream: true), or ask "
                                "for fewer choices, tokens or top_logprobs", "invalid_request_error",
                           req.max_tokens_param, "too_many_logprobs")
        if self._held_logprobs + cost > MAX_HELD_LOGPROBS:
            raise ApiError(429, "the gateway holds as many unstreamed log-probabilities as it may now; retry "
                                "shortly, or stream the answer (stream: true)", "rate_limit_error",
                           code="logprobs_budget", headers={"Retry-After": "1"})
        self._held_logprobs += cost
        req.held_logprobs = cost

    def _release(self, req: ApiRequest) -> None:
        self._held_logprobs -= req.held_logprobs
        req.held_logprobs = 0

    def render_messages(self, req: ApiRequest) -> None:
        """A chat's messages through the model's chat template into its one prompt."""
        if self.template is None:
            raise BadParam(req.prompt_param, "this model has no chat template; use /v1/completions")
        if error := self.core.limits.prompt_error(sum(len(m["content"]) for m in req.messages)):
            whose = "the input's" if req.api == "responses" else "the messages'"
            raise BadParam(req.prompt_param, f"{whose} contents: {error}")
        try:
            ids = self.template.encode(self.core.model.tokenizer, req.messages,
                                       tools=req.tools.tools if req.tools is not None else None,
                                       add_generation_prompt=req.add_generation_prompt,
                                       continue_final_message=req.continue_final_message,
                                       **req.chat_template_kwargs)
        except (ChatTemplateError, ValueError) as e:
            raise BadParam(req.prompt_param, f"the chat template refused the {req.prompt_param}: {e}") from None
        if req.truncate_prompt_tokens is not None:
            ids = ids[-req.truncate_prompt_tokens:]
        req.prompts = [ids]
        self._plan_tools(req)
        if not req.sampling.HasField("max_tokens"):  # OpenAI's chat default: the rest of the context
            req.sampling.max_tokens = max(1, self.core.max_model_len - len(ids))

    def _plan_tools(self, req: ApiRequest) -> None:
        plan = req.tools
        if plan is None or plan.choice != "auto":
            return
        if self.tool_call_parser is None:
            raise BadParam("tool_choice", "tool_choice auto needs the server started with --tool-call-parser "
                                          "(or use required or a named function)", "unsupported_parameter")
        if tool_parser(self.tool_call_parser).needs_special_tokens and not req.sampling.HasField("skip_special_tokens"):
            req.sampling.skip_special_tokens = False  # the format's markers are special tokens

    def chat_outputs(self, req: ApiRequest) -> list[ChatOutput] | None:
        """Per choice, the parser of a chat's reasoning and tool calls; None when there is nothing to parse."""
        if not req.chat or (self.reasoning_parser is None and req.tools is None):
            return None
        parser = tool_parser(self.tool_call_parser) if self.tool_call_parser and req.tools is not None else None
        constrained = req.sampling.HasField("structured_outputs")
        opened = self.reasoning_parser is not None and self._opens_reasoning(req)
        return [ChatOutput(self.reasoning_parser, req.tools, parser, constrained=constrained, opened=opened,
                           include_reasoning=req.include_reasoning) for _ in range(req.num_choices)]

    def _opens_reasoning(self, req: ApiRequest) -> bool:
        """Whether the rendered prompt ends inside ``<think>`` (a thinking model's template opens
        it for the model), so the output starts as reasoning."""
        tail = req.prompts[0][-8:] if req.prompts and isinstance(req.prompts[0], list) else []
        text = self.core.model.tokenizer.decode(tail, skip_special_tokens=False).rstrip()
        return text.endswith(THINK_START)

    def _tokenize_bad_words(self, req: ApiRequest) -> None:
        """Each bad word's token ids, as vLLM finds them: the word alone and after a space."""
        tokenizer = self.core.model.tokenizer
        seen: set[tuple[int, ...]] = set()
        for word in req.bad_words:
            for prefix in ("", " "):
                try:
                    ids = tuple(tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False))
                except ValueError as e:
                    raise BadParam("bad_words", str(e)) from None
                if ids and ids not in seen:
                    seen.add(ids)
                    req.sampling.bad_words_token_ids.add(ids=ids)

    def _echoes(self, req: ApiRequest) -> list[str]:
        """Per choice, the text ``echo`` puts before the output: completions' prompt, or a chat's
        last message when it is the assistant's (as vLLM echoes)."""
        if not req.echo:
            return []
        if req.chat:
            last = req.messages[-1]
            text = last["content"] if last["role"] == "assistant" else ""
            return [text] * req.num_choices
        decode = self.core.model.tokenizer.decode
        texts = [p if isinstance(p, str) else decode(p) for p in req.prompts]
        return [texts[i // req.n] for i in range(req.num_choices)]

    def _check(self, r: pb.GenerateRequest, req: ApiRequest) -> list[int]:
        if req.truncate_prompt_tokens is not None and r.WhichOneof("input") == "prompt" and r.prompt:
            try:
                ids = self.core.model.tokenizer.encode(r.prompt)
            except ValueError as e:
                raise BadParam(req.prompt_param, str(e)) from None
            r.prompt_token_ids.ids[:] = ids[-req.truncate_prompt_tokens:]
        elif req.truncate_prompt_tokens is not None and not req.chat:
            ids = list(r.prompt_token_ids.ids)[-req.truncate_prompt_tokens:]
            r.prompt_token_ids.ids[:] = ids
        try:
            return self.core.check(r, choice_id=req.num_choices > 1)
        except BadField as e:
            field = e.field.removeprefix("sampling.")
            if field.startswith("structured_outputs"):
                raise BadParam(req.structured_param, f"{req.structured_param} does not compile: {e.reason}") from None
            param = {"prompt": req.prompt_param, "prompt_token_ids": req.prompt_param, "request_id": "X-Request-Id",
                     "bad_words_token_ids": "bad_words",
                     "max_tokens": req.max_tokens_param, "logprobs": "top_logprobs" if req.chat else "logprobs",
                     "sampling": None}.get(field, field)
            reason = e.reason
            if param and param != field and reason.startswith(field):  # the message names what the client sent
                reason = param + reason[len(field):]
            raise BadParam(param, reason, "context_length_exceeded" if isinstance(e, ContextTooLong)
                           else "invalid_value") from None

    async def _events(self, choices: Choices, relays: Relays, call: CallObserver) -> AsyncIterator[bytes]:
        status = CLIENT_GONE  # until the stream is through
        try:
            for chunk in choices.opening():
                yield choices.sse(chunk)
            async for i, msg in relays:
                call.message(msg)
                if msg.finish_reason == pb.FINISH_REASON_ERROR and isinstance(choices, ResponseOutput):
                    status = 500  # the Responses stream ends with its own event
                    for event in [*choices.add(i, msg), *choices.failed()]:
                        yield choices.sse(event)
                    return
                if msg.finish_reason == pb.FINISH_REASON_ERROR:
                    choices.add(i, msg)
                    status = 500
                    yield sse(ApiError(500, choices.error or "generation failed", "server_error").body())
                    if choices.done_marker:
                        yield b"data: [DONE]\n\n"
                    return
                for event in choices.events(i, msg):
                    yield event
            for chunk in choices.closing():
                yield choices.sse(chunk)
            if choices.done_marker:
                yield b"data: [DONE]\n\n"
            status = 200
        except QueueUnavailable as e:  # Redis failed the relay past every retry: said, in the stream
            status = 503
            yield sse(ApiError.unavailable(e).body())
            if choices.done_marker:
                yield b"data: [DONE]\n\n"
        finally:
            await relays.aclose()
            _end(call, status, streamed=True)

    async def _collect(self, request: Request, choices: Choices, relays: Relays, call: CallObserver,
                       headers: dict[str, str]) -> Response:
        async def run() -> None:
            async for i, msg in relays:
                call.message(msg)
                choices.add(i, msg)

        done = asyncio.ensure_future(run())
        gone = asyncio.ensure_future(_disconnected(request))
        status = CLIENT_GONE
        try:
            await asyncio.wait((done, gone), return_when=asyncio.FIRST_COMPLETED)
            if not done.done():  # the client went away: closing the relay cancels the requests
                return Response(status_code=CLIENT_GONE)
            try:
                done.result()
            except QueueUnavailable as e:  # Redis failed the relay past every retry
                status = 503
                return ApiError.unavailable(e).response()
            if choices.error is not None:
                status = 500
                return ApiError(500, choices.error, "server_error").response()
            status = 200
            return JSONResponse(choices.body(), headers=headers)
        finally:
            for t in (done, gone):
                t.cancel()
            await asyncio.gather(done, gone, return_exceptions=True)
            await relays.aclose()
            _end(call, status)

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict[str, Any]:
        return {"id": self.served_model_name, "object": "model", "created": self.created, "owned_by": "pagefleet",
                "root": self.core.model.name, "max_model_len": self.core.max_model_len}


class EventStream(StreamingResponse):
    """Server-sent events that stop as soon as the client disconnects, even while no token is
    due (a long prefill, a wait in the queue). Then the body and ``relays`` are closed, which
    cancels the requests, and ``call`` ends - also when the body never started."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], relays: Relays, call: CallObserver,
                 headers: dict[str, str]) -> None:
        super().__init__(content, headers=headers)
        self.relays = relays
        self.call = call

    async def __call__(self, scope, receive, send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        gone = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait((stream, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (stream, gone):
                t.cancel()
            await asyncio.gather(stream, gone, return_exceptions=True)
            await self.body_iterator.aclose()
            await self.relays.aclose()
            _end(self.call, CLIENT_GONE, streamed=True)  # a no-op when the body ended it
        if not stream.cancelled() and stream.exception() is not None:
            raise stream.exception()


def _end(call: CallObserver, status: int, streamed: bool = False) -> None:
    attrs = {"http.response.status_code": 200 if streamed else status}
    call.end(CODE_OF_STATUS.get(status, grpc.StatusCode.UNKNOWN), attrs)


async def _disconnected(request: Request) -> None:
    """Returns when the client has closed the connection (the body was read before)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _request_attributes(req: ApiRequest, model: str, request_id: str) -> dict[str, Any]:
    s = req.sampling
    attrs = telemetry.request_attributes(
        model=model, max_tokens=s.max_tokens if s.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
        request_id=request_id,
        temperature=s.temperature if s.HasField("temperature") else None,
        top_p=s.top_p if s.HasField("top_p") else None,
    )
    if req.chat:
        attrs[telemetry.GEN_AI_OPERATION_NAME] = "chat"
    attrs["pagefleet.num_choices"] = req.num_choices
    if req.user is not None:
        attrs["enduser.id"] = req.user
    return attrs
