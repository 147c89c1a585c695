"""``POST /tokenize`` and ``POST /detokenize``, as vLLM serves them.

``/tokenize`` takes ``prompt`` (with ``add_special_tokens``, default true) or ``messages``
(rendered with the chat template: ``add_generation_prompt``, ``continue_final_message``,
``chat_template_kwargs``; ``add_special_tokens`` default false) and answers
``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` with
``return_token_strs``). ``/detokenize`` takes ``tokens`` and answers ``{"prompt"}``. Both
refuse what they do not know by name, and a model this gateway does not serve with 404.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from pagefleet.common.tokenizer import NoTokenizer

from .limits import TooLarge
from .openai_door import CLIENT_GONE, ApiError, OpenAIDoor
from .openai_request import BadParam, parse_json_body, parse_tokenize_chat

_PROMPT_KEYS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
_DETOKENIZE_KEYS = frozenset({"model", "tokens"})


async def tokenize(door: OpenAIDoor, request: Request) -> Response:
    try:
        body = await _body(door, request)
        return JSONResponse(_tokenize(door, body))
    except ClientDisconnect:
        return Response(status_code=CLIENT_GONE)
    except BadParam as e:
        return ApiError.bad(e).response()
    except ApiError as e:
        return e.response()


async def detokenize(door: OpenAIDoor, request: Request) -> Response:
    try:
        body = await _body(door, request)
        _known(body, _DETOKENIZE_KEYS)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise BadParam("tokens", "tokens must be a list of token ids")
        vocab = door.core.model.vocab_size
        if isinstance(door.core.model.tokenizer, NoTokenizer):
            raise BadParam("tokens", "this model has no tokenizer.json: its tokens have no text here")
        if bad := next((t for t in tokens if not 0 <= t < vocab), None):
            raise BadParam("tokens", f"token id {bad} is outside the vocabulary [0, {vocab})")
        # As vLLM's: special tokens are text too here (``<s>``), the inverse of ``/tokenize``.
        return JSONResponse({"prompt": door.core.model.tokenizer.decode(tokens, skip_special_tokens=False)})
    except ClientDisconnect:
        return Response(status_code=CLIENT_GONE)
    except BadParam as e:
        return ApiError.bad(e).response()
    except ApiError as e:
        return e.response()


async def _body(door: OpenAIDoor, request: Request) -> dict[str, Any]:
    try:
        raw = await request.body()
    except TooLarge as e:
        raise ApiError(413, str(e), "invalid_request_error", code="request_too_large") from None
    body = parse_json_body(raw)
    if not isinstance(body, dict):
        raise BadParam(None, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != door.served_model_name:
        raise ApiError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model",
                       "model_not_found")
    return body


def _tokenize(door: OpenAIDoor, body: dict[str, Any]) -> dict[str, Any]:
    tokenizer = door.core.model.tokenizer
    if "messages" in body:
        req = parse_tokenize_chat(body)
        door.render_messages(req)
        add_special = _flag(body, "add_special_tokens", False)
        ids = list(req.prompts[0])
        if add_special and tokenizer.bos_token_id is not None and ids[:1] != [tokenizer.bos_token_id]:
            ids.insert(0, tokenizer.bos_token_id)
    else:
        _known(body, _PROMPT_KEYS)
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise BadParam("prompt", "prompt must be a string (or give messages)")
        if error := door.core.limits.prompt_error(len(prompt)):
            raise BadParam("prompt", error)
        try:
            ids = tokenizer.encode(prompt, add_special_tokens=_flag(body, "add_special_tokens", True))
        except ValueError as e:
            raise BadParam("prompt", str(e)) from None
    out: dict[str, Any] = {"count": len(ids), "max_model_len": door.core.max_model_len, "tokens": ids,
                           "token_strs": None}
    if _flag(body, "return_token_strs", False):
        # The vocabulary's own strings (``Ġhow``, ``<s>``), as vLLM's ``convert_ids_to_tokens``;
        # a tokenizer without them (bytes) gives each token's text.
        by_id = getattr(tokenizer, "id_to_token", None)
        out["token_strs"] = [s if by_id is not None and (s := by_id(t)) is not None else door.pieces(t)[0]
                             for t in ids]
    return out


def _known(body: dict[str, Any], keys: frozenset[str]) -> None:
    for key in body:
        if key not in keys:
            raise BadParam(key, f"unknown parameter {key!r}", "unknown_parameter")


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadParam(name, f"{name} must be true or false, got {value!r}")
    return value
