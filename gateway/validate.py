"""Check a ``GenerateRequest`` at the door; refusals name the field and the reason.

``check`` returns the prompt's token ids or raises ``BadField`` (also for a request past one of
the gateway's ``Limits``); ``bad_request_metadata`` turns that into the ``google.rpc.BadRequest``
details that grpcio-status clients read.
"""

from __future__ import annotations

import asyncio
import functools
import re
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from pagefleet.common import grammar
from pagefleet.common.model_config import ModelSpec
from pagefleet.common.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    StructuredOutputs,
    only_finish_tokens_allowed,
)
from pagefleet.common.sampling_proto import from_proto
from pagefleet.protos import generation_pb2 as pb

from .limits import Limits

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
REQUEST_ID_RULE = "1 to 128 characters of A-Z a-z 0-9 . _ : -"  # what _REQUEST_ID takes, in words
# The HTTP door's choice ids: a client's id (as above) and ``-<choice>`` (``fan_out``).
_CHOICE_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}-[0-9]{1,10}$")
_DEFAULT_LIMITS = Limits()
# Longer names before their prefixes ("stop_token_ids" before "stop").
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "stop",
                    "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "logprobs",
                    "logit_bias", "allowed_token_ids", "bad_words", "structured_outputs")
# Where SamplingParams' name for a field is not the proto's.
_PROTO_NAMES = {"bad_words": "bad_words_token_ids"}


def valid_request_id(request_id: str, choice_id: bool = False) -> bool:
    """Whether a client's request id is one ``check`` takes (``choice_id``: or one of the HTTP
    door's choice ids, ``<id>-<choice>``)."""
    return bool(_REQUEST_ID.match(request_id) or (choice_id and _CHOICE_ID.match(request_id)))


class BadField(ValueError):
    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def check(req: pb.GenerateRequest, model: ModelSpec, max_model_len: int, limits: Limits = _DEFAULT_LIMITS,
          *, choice_id: bool = False) -> list[int]:
    """The prompt's token ids; ``BadField`` if anything is wrong or past one of ``limits``.
    ``choice_id``: the id may be a client's id with ``-<choice>`` after it (the HTTP door's choices)."""
    if req.request_id and not valid_request_id(req.request_id, choice_id):
        raise BadField("request_id", REQUEST_ID_RULE)
    if req.HasField("deadline_ms") and req.deadline_ms == 0:
        raise BadField("deadline_ms", "must be > 0 when set")
    if error := limits.stop_error(req.sampling.stop):
        raise BadField("sampling.stop", error)
    if len(req.sampling.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:  # a bound before each id is read
        raise BadField("sampling.allowed_token_ids", f"at most {MAX_ALLOWED_TOKEN_IDS} ids, "
                                                     f"got {len(req.sampling.allowed_token_ids)}")
    params = from_proto(req.sampling)
    if params.structured_outputs is None and req.sampling.HasField("structured_outputs"):
        # Present and empty: none ("at most one of these is set"); not passed on as set, so a
        # worker of an older version (which refused it) runs it too.
        req.sampling.ClearField("structured_outputs")
    try:
        params.validate()
    except ValueError as e:
        msg = str(e)
        name = next((f for f in _SAMPLING_FIELDS if msg.startswith(f)), "sampling")
        name = _PROTO_NAMES.get(name, name)
        raise BadField(f"sampling.{name}" if name != "sampling" else name, msg) from None
    for name, ids in (("logit_bias", req.sampling.logit_bias), ("allowed_token_ids", req.sampling.allowed_token_ids),
                      ("bad_words_token_ids", [t for w in req.sampling.bad_words_token_ids for t in w.ids])):
        if ids and max(ids) >= model.vocab_size:  # most requests have none: no generator a request
            bad = next(t for t in ids if t >= model.vocab_size)
            raise BadField(f"sampling.{name}", f"token id {bad} is outside the vocabulary [0, {model.vocab_size})")
    if params.min_tokens and params.allowed_token_ids:
        finish = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else set(model.config.eos_token_ids))
        if error := only_finish_tokens_allowed(params, finish):
            raise BadField("sampling.allowed_token_ids", error)
    if params.structured_outputs is not None and (error := grammar_error(params.structured_outputs, model)):
        raise BadField(f"sampling.structured_outputs.{error.field}", error.reason)
    which = req.WhichOneof("input")
    if which is None:
        raise BadField("prompt", "one of prompt or prompt_token_ids is required")
    if which == "prompt":
        if not req.prompt:
            raise BadField("prompt", "must not be empty")
        if error := limits.prompt_error(len(req.prompt)):
            raise BadField("prompt", error)
        try:
            ids = model.tokenizer.encode(req.prompt)
        except ValueError as e:
            raise BadField("prompt", str(e)) from None
    else:
        ids = list(req.prompt_token_ids.ids)
        if not ids:
            raise BadField("prompt_token_ids", "must not be empty")
        if max(ids) >= model.vocab_size:  # the one at fault looked for only when there is one
            bad = next(t for t in ids if t >= model.vocab_size)
            raise BadField("prompt_token_ids", f"token id {bad} is outside the vocabulary [0, {model.vocab_size})")
    total = len(ids) + params.max_tokens
    if total > max_model_len:
        raise ContextTooLong(which, len(ids), params.max_tokens, max_model_len)
    return ids


class ContextTooLong(BadField):
    """A prompt and its ``max_tokens`` past the model's context, in the words OpenAI's and vLLM's
    servers use (clients such as LiteLLM and LangChain tell a context overflow by them). Names
    the prompt when the prompt alone fills the context, else ``max_tokens``."""

    def __init__(self, which: str, num_prompt: int, max_tokens: int, max_model_len: int) -> None:
        if num_prompt >= max_model_len:
            field = "prompt" if which == "prompt" else "prompt_token_ids"
            reason = (f"This model's maximum context length is {max_model_len} tokens. However, your request has "
                      f"{num_prompt} input tokens. Please reduce the length of the input.")
        else:
            field = "sampling.max_tokens"
            reason = (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                      f"{num_prompt + max_tokens} tokens ({num_prompt} in the input, {max_tokens} in the completion; "
                      f"max_tokens may be at most {max_model_len - num_prompt}). Please reduce the length of the "
                      "input or of the completion.")
        super().__init__(field, reason)


# A constraint is compiled off the event loop, at most this long (``compile_ahead``): one that
# takes longer is refused as too complex, and no other request waits for it meanwhile.
GRAMMAR_CHECK_S = 5.0
_GRAMMAR_POOL = ThreadPoolExecutor(2, thread_name_prefix="grammar-check")
_TOO_SLOW_MAX = 256
_too_slow: OrderedDict[tuple[StructuredOutputs, int], grammar.GrammarError] = OrderedDict()
_ll_tokenizers: dict[int, tuple[object, object]] = {}  # id(tokenizer) -> (it, llguidance's view of it)
_ll_lock = threading.Lock()


def _ll_tokenizer_key(model: ModelSpec) -> int:
    """A key for ``model``'s tokenizer as llguidance sees it (built once a tokenizer)."""
    key = id(model.tokenizer)
    with _ll_lock:
        if key not in _ll_tokenizers:
            try:
                ll = grammar.ll_tokenizer(model.tokenizer, model.vocab_size, model.config.eos_token_ids)
            except Exception:  # a tokenizer llguidance cannot read: grammars are checked without it
                ll = None
            _ll_tokenizers[key] = (model.tokenizer, ll)
    return key


def grammar_error(so: StructuredOutputs, model: ModelSpec) -> grammar.GrammarError | None:
    """Why ``so`` does not compile for ``model`` (llguidance, with its tokenizer, no torch), or
    None; once per constraint (cached), or the refusal ``compile_ahead`` recorded."""
    key = _ll_tokenizer_key(model)
    if (slow := _too_slow.get((so, key))) is not None:
        return slow
    return _grammar_error(so, key)


@functools.lru_cache(maxsize=256)
def _grammar_error(so: StructuredOutputs, tokenizer_key: int) -> grammar.GrammarError | None:
    try:
        grammar.check(so, _ll_tokenizers[tokenizer_key][1])
    except grammar.GrammarError as e:
        return e
    return None


async def compile_ahead(sampling: pb.SamplingParams, model: ModelSpec) -> None:
    """Check the request's constraint in a thread of its own, before ``check`` (which then finds
    it cached): a constraint that takes long to compile holds no other request, and one not
    compiled within ``GRAMMAR_CHECK_S`` is refused as too complex (its compile runs on, once)."""
    if not sampling.HasField("structured_outputs"):
        return
    try:
        so = from_proto(sampling).structured_outputs
    except ValueError:
        return  # ``check`` names what is wrong
    if so is None:
        return
    key = _ll_tokenizer_key(model)
    if (so, key) in _too_slow:
        return
    work = asyncio.get_running_loop().run_in_executor(_GRAMMAR_POOL, _grammar_error, so, key)
    try:
        await asyncio.wait_for(asyncio.shield(work), GRAMMAR_CHECK_S)
    except TimeoutError:
        _too_slow[(so, key)] = grammar.GrammarError(
            grammar.kind_of(so), f"too complex: not compiled within {GRAMMAR_CHECK_S:g} s (fewer alternatives, "
                                 "patterns or nesting compile faster)")
        while len(_too_slow) > _TOO_SLOW_MAX:
            _too_slow.popitem(last=False)


def _status_metadata(status: status_pb2.Status) -> tuple[tuple[str, bytes], ...]:
    return (("grpc-status-details-bin", status.SerializeToString()),)


def bad_request_metadata(e: BadField) -> tuple[tuple[str, bytes], ...]:
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.BadRequest(
        field_violations=[error_details_pb2.BadRequest.FieldViolation(field=e.field, description=e.reason)]
    ))
    return _status_metadata(status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=str(e), details=[detail]))


def retry_metadata(message: str, retry_after_s: float,
                   code: int = code_pb2.RESOURCE_EXHAUSTED) -> tuple[tuple[str, bytes], ...]:
    """A ``google.rpc.RetryInfo`` for a call that ends with ``code`` (the call's own status code:
    grpcio-status refuses details of another)."""
    detail = any_pb2.Any()
    delay = duration_pb2.Duration()
    delay.FromMilliseconds(int(retry_after_s * 1000))
    detail.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    return _status_metadata(status_pb2.Status(code=code, message=message, details=[detail]))
