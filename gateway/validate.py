"""Check a ``GenerateRequest`` at the door; refusals name the field and the reason.

``check`` returns the prompt's token ids or raises ``BadField`` (also for a request past one of
the gateway's ``Limits``); ``bad_request_metadata`` turns that into the ``google.rpc.BadRequest``
details that grpcio-status clients read.
"""

from __future__ import annotations

import functools
import re

from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from pagefleet.common import grammar
from pagefleet.common.model_config import ModelSpec
from pagefleet.common.sampling_params import StructuredOutputs
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
    params = from_proto(req.sampling)
    try:
        params.validate()
    except ValueError as e:
        msg = str(e)
        name = next((f for f in _SAMPLING_FIELDS if msg.startswith(f)), "sampling")
        raise BadField(f"sampling.{name}" if name != "sampling" else name, msg) from None
    for name, ids in (("logit_bias", req.sampling.logit_bias), ("allowed_token_ids", req.sampling.allowed_token_ids)):
        if ids and max(ids) >= model.vocab_size:  # most requests have neither: no generator a request
            bad = next(t for t in ids if t >= model.vocab_size)
            raise BadField(f"sampling.{name}", f"token id {bad} is outside the vocabulary [0, {model.vocab_size})")
    if params.structured_outputs is not None and (error := _grammar_error(params.structured_outputs)):
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
        field = "prompt" if which == "prompt" else "prompt_token_ids"
        raise BadField(field, f"{len(ids)} prompt tokens + max_tokens {params.max_tokens} = {total} "
                              f"exceeds the model's context of {max_model_len} tokens")
    return ids


@functools.lru_cache(maxsize=256)
def _grammar_error(so: StructuredOutputs) -> grammar.GrammarError | None:
    """Why ``so`` does not compile (llguidance, no tokenizer, no torch), or None; once per constraint."""
    try:
        grammar.check(so)
    except grammar.GrammarError as e:
        return e
    return None


def _status_metadata(status: status_pb2.Status) -> tuple[tuple[str, bytes], ...]:
    return (("grpc-status-details-bin", status.SerializeToString()),)


def bad_request_metadata(e: BadField) -> tuple[tuple[str, bytes], ...]:
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.BadRequest(
        field_violations=[error_details_pb2.BadRequest.FieldViolation(field=e.field, description=e.reason)]
    ))
    return _status_metadata(status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=str(e), details=[detail]))


def retry_metadata(message: str, retry_after_s: float) -> tuple[tuple[str, bytes], ...]:
    detail = any_pb2.Any()
    delay = duration_pb2.Duration()
    delay.FromMilliseconds(int(retry_after_s * 1000))
    detail.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    return _status_metadata(status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message=message, details=[detail]))
