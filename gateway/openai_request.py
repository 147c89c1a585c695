"""OpenAI request bodies, checked and turned into ``pb.GenerateRequest``s.

``parse_completion`` and ``parse_chat`` read a ``/v1/completions`` or
``/v1/chat/completions`` body into an ``ApiRequest``; ``fan_out`` makes one
``pb.GenerateRequest`` per choice (every prompt times ``n``, in OpenAI's choice order).
What the gateway's own ``check`` validates (ranges of sampling values, prompt lengths)
is left to it; here only what the protobuf cannot express is refused. Every refusal is a
``BadParam`` naming the parameter, and a parameter this server does not implement is
refused by name (a ``null``, or the value that means "off", is accepted), never ignored.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from pagefleet.common.sampling_params import MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORDS
from pagefleet.protos import generation_pb2 as pb

from .limits import Limits

_DEFAULT_LIMITS = Limits()
MAX_COMPLETION_LOGPROBS = 5
MAX_TOP_LOGPROBS = 20
MAX_CLIENT_REQUEST_ID = 1024  # a body's request_id, as long as a header may be
_UINT32 = 2**32
_UINT64 = 2**64
_INT32 = 2**31

_COMMON = ("model", "n", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature", "top_p",
           "stop", "seed", "presence_penalty", "frequency_penalty", "logprobs", "user", "logit_bias", "echo",
           # vLLM's extras (``extra_body`` of the openai client)
           "top_k", "min_p", "min_tokens", "repetition_penalty", "ignore_eos", "priority", "stop_token_ids",
           "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
           "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "request_id", "return_tokens_as_token_ids",
           # structured output: OpenAI's response_format, vLLM's guided_* and structured_outputs
           "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
           "guided_decoding_backend", "structured_outputs")
COMPLETION_PARAMS = frozenset((*_COMMON, "prompt"))
CHAT_PARAMS = frozenset((*_COMMON, "messages", "top_logprobs", "add_generation_prompt", "continue_final_message",
                         "chat_template_kwargs", "tools", "tool_choice", "parallel_tool_calls",
                         "include_reasoning"))
# Template variables the server sets itself: chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                                         "continue_final_message"})

_OFF = object()  # no value but null turns it off
# OpenAI parameters this server does not implement -> the value that means "not used".
UNSUPPORTED = {
    "best_of": 1, "suffix": "", "prompt_logprobs": _OFF, "tools": [], "tool_choice": "none",
    "functions": [], "function_call": "none", "guided_whitespace_pattern": _OFF, "parallel_tool_calls": _OFF,
    "audio": _OFF, "modalities": ["text"], "prediction": _OFF,
    "reasoning_effort": _OFF, "web_search_options": _OFF,
    # vLLM's own request fields (what its clients may send at their defaults): refused only when set.
    # ``chat_template`` too: vLLM itself refuses a request's template unless told to trust them.
    "use_beam_search": False, "length_penalty": 1.0, "logits_processors": _OFF, "return_token_ids": False,
    "cache_salt": _OFF, "kv_transfer_params": _OFF, "vllm_xargs": _OFF, "prompt_embeds": _OFF,
    "documents": _OFF, "chat_template": _OFF, "mm_processor_kwargs": _OFF,
}
# OpenAI's fields about the call, not its output (what is kept, billed or tagged where): taken
# and ignored whatever their value, as vLLM takes them, so clients that always send them work.
IGNORED = frozenset({"store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier"})
_ROLES = ("system", "developer", "user", "assistant", "tool")
# ``reasoning`` is vLLM's newer name of ``reasoning_content`` (an assistant turn's thinking,
# for templates that show it again); both reach the template.
_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "reasoning")
# Fields of OpenAI's message objects (a response's message sent back as the next turn's) that
# mean nothing to a prompt: taken when empty, refused by name otherwise.
_UNSUPPORTED_MESSAGE_KEYS = ("function_call", "audio", "refusal", "annotations")


class BadParam(ValueError):
    """A request parameter refused: HTTP 400 naming ``param``."""

    def __init__(self, param: str | None, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.message = message
        self.code = code


@dataclass(slots=True)
class ApiRequest:
    """One completion body, checked. Chat bodies carry ``messages`` until the gateway renders
    them into ``prompts`` (one list of token ids)."""

    chat: bool
    model: str | None
    prompts: list[str | list[int]]
    sampling: pb.SamplingParams
    messages: list[dict[str, Any]] = field(default_factory=list)
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    include_reasoning: bool = True  # vLLM's: false leaves a reasoning parser's reasoning out
    priority: int = 0
    user: str | None = None
    max_tokens_param: str = "max_tokens"  # the name the client used, for refusals
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk
    echo: bool = False
    truncate_prompt_tokens: int | None = None
    bad_words: list[str] = field(default_factory=list)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    structured_param: str | None = None  # the parameter that set sampling.structured_outputs
    tools: Any = None  # openai_tools.ToolPlan of a chat with tools
    api: str = ""  # "responses": a /v1/responses body read as a chat (responses_api.py)
    held_logprobs: int = 0  # log-probabilities this (unstreamed) request may hold at the gateway (OpenAIDoor._hold)
    responses: dict[str, Any] = field(default_factory=dict)  # what the response object repeats
    request_id: str | None = None  # vLLM's body field: the client's id, as an X-Request-Id header gives it
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: log-probabilities name tokens "token_id:<id>"

    @property
    def id_prefix(self) -> str:
        return "resp_" if self.api == "responses" else "chatcmpl-" if self.chat else "cmpl-"

    @property
    def prompt_param(self) -> str:
        return "input" if self.api == "responses" else "messages" if self.chat else "prompt"

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    @property
    def logprobs(self) -> int | None:
        """Alternatives per token the client asked for; None: no log-probabilities."""
        return self.sampling.logprobs if self.sampling.HasField("logprobs") else None


def parse_completion(body: Any, limits: Limits = _DEFAULT_LIMITS) -> ApiRequest:
    p = _params(body, COMPLETION_PARAMS)
    req = ApiRequest(chat=False, model=_model(p), prompts=_prompts(p.get("prompt")), sampling=_sampling(p))
    if (k := p.get("logprobs")) is not None:
        req.sampling.logprobs = _int("logprobs", k, 0, MAX_COMPLETION_LOGPROBS)
    return _finish(req, p, limits)


def parse_chat(body: Any, limits: Limits = _DEFAULT_LIMITS) -> ApiRequest:
    p = _params(body, CHAT_PARAMS)
    from .openai_tools import parse_tools

    req = ApiRequest(chat=True, model=_model(p), prompts=[], sampling=_sampling(p), messages=_messages(p))
    req.tools = parse_tools(p)
    req.include_reasoning = _bool("include_reasoning", p.get("include_reasoning", True))
    req.add_generation_prompt = _bool("add_generation_prompt", p.get("add_generation_prompt", True))
    req.continue_final_message = _bool("continue_final_message", p.get("continue_final_message", False))
    if req.continue_final_message:
        if p.get("add_generation_prompt") is True:
            raise BadParam("continue_final_message", "continue_final_message and add_generation_prompt "
                                                     "cannot both be true")
        req.add_generation_prompt = False
        if req.messages[-1]["role"] != "assistant":
            raise BadParam("continue_final_message", "continue_final_message needs an assistant message last")
    if "chat_template_kwargs" in p:
        kwargs = p["chat_template_kwargs"]
        if not isinstance(kwargs, dict):
            raise BadParam("chat_template_kwargs", "chat_template_kwargs must be an object")
        if reserved := sorted(RESERVED_TEMPLATE_VARIABLES & kwargs.keys()):
            raise BadParam(f"chat_template_kwargs.{reserved[0]}", f"{reserved[0]} is set by the server")
        req.chat_template_kwargs = kwargs
    want = _bool("logprobs", p["logprobs"]) if "logprobs" in p else False
    if "top_logprobs" in p:
        top = _int("top_logprobs", p["top_logprobs"], 0, MAX_TOP_LOGPROBS)
        if want:
            req.sampling.logprobs = top
        elif top:  # 0 without logprobs asks for nothing, as vLLM takes it
            raise BadParam("top_logprobs", "top_logprobs needs logprobs: true")
    elif want:
        req.sampling.logprobs = 0
    return _finish(req, p, limits)


TOKENIZE_CHAT_PARAMS = frozenset({"model", "messages", "add_generation_prompt", "continue_final_message",
                                  "chat_template_kwargs", "tools", "add_special_tokens", "return_token_strs"})


def parse_tokenize_chat(body: Any) -> ApiRequest:
    """A ``/tokenize`` body with ``messages``: the chat's rendering options only."""
    for key in body:
        if key not in TOKENIZE_CHAT_PARAMS:
            raise BadParam(key, f"unknown parameter {key!r}", "unknown_parameter")
    chat = {k: v for k, v in body.items() if k not in ("add_special_tokens", "return_token_strs")}
    if chat.get("tools"):
        chat["tool_choice"] = "none"  # rendered, not generated
    return parse_chat(chat)


def fan_out(req: ApiRequest, base_id: str) -> list[pb.GenerateRequest]:
    """One request per choice, in choice order (prompt i's choices at ``i * n ... i * n + n - 1``).

    A single choice keeps ``base_id``; several get ``<base_id>-<index>``. Choice j of each
    prompt samples with a seed derived from ``seed`` (j = 0: ``seed`` itself), so seeded
    choices differ from each other and each is reproducible.
    """
    out = []
    for i, prompt in enumerate(req.prompts):
        for j in range(req.n):
            index = i * req.n + j
            r = pb.GenerateRequest(request_id=base_id if req.num_choices == 1 else f"{base_id}-{index}",
                                   sampling=req.sampling, priority=req.priority)
            if req.sampling.HasField("seed") and j:
                r.sampling.seed = derived_seed(req.sampling.seed, j)
            if isinstance(prompt, str):
                r.prompt = prompt
            else:
                r.prompt_token_ids.ids.extend(prompt)
            out.append(r)
    return out


def derived_seed(seed: int, choice: int) -> int:
    """The seed of choice ``choice`` (> 0) of a request seeded with ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{choice}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


# -- the body ----------------------------------------------------------------------------------
MAX_BODY_DEPTH = 64  # JSON schemas and tool parameters nest, but not this deep


def parse_json_body(raw: bytes) -> Any:
    """The body's JSON; ``BadParam`` for invalid JSON, NaN or Infinity, nesting past
    ``MAX_BODY_DEPTH``, or text that is not Unicode (a lone surrogate such as ``"\\ud800"``)."""
    def constant(name: str) -> Any:
        raise BadParam(None, f"the request body is not valid JSON: {name} is not a JSON value", "invalid_json")

    try:
        body = json.loads(raw, parse_constant=constant)
    except RecursionError:
        raise BadParam(None, f"the request body nests deeper than {MAX_BODY_DEPTH} levels", "invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        if isinstance(e, BadParam):
            raise
        raise BadParam(None, f"the request body is not valid JSON: {e}", "invalid_json") from None
    check_json_value(body)
    return body


def check_json_value(body: Any) -> None:
    """``BadParam`` naming where ``body`` nests too deep or holds a string (or key) that is not
    valid Unicode; iterative, so no depth overflows it."""
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        if depth > MAX_BODY_DEPTH:
            raise BadParam(where or None, f"the request body nests deeper than {MAX_BODY_DEPTH} levels",
                           "invalid_json")
        if isinstance(value, str):
            _check_text(where, value)
        elif isinstance(value, dict):
            for key, v in value.items():
                _check_text(where, key, key=True)
                stack.append((v, f"{where}.{key}" if where else key, depth + 1))
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))


def _check_text(where: str, text: str, key: bool = False) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        what = "a key" if key else "a string"
        raise BadParam(where or None, f"{what}{' in ' + where if where else ''} is not valid Unicode "
                                      "(a lone surrogate such as \\ud800)", "invalid_unicode") from None


def _params(body: Any, allowed: frozenset[str]) -> dict[str, Any]:
    """The body's parameters that are set (null means unset); unknown and unsupported ones refused."""
    if not isinstance(body, dict):
        raise BadParam(None, "the request body must be a JSON object")
    params = {}
    for name, value in body.items():
        if name in allowed:
            if value is not None:
                params[name] = value
        elif name in IGNORED:
            continue
        elif name in UNSUPPORTED:
            if value is not None and value != UNSUPPORTED[name]:
                raise BadParam(name, f"{name} is not supported by this server", "unsupported_parameter")
        else:
            raise BadParam(name, f"unknown parameter {name!r}", "unknown_parameter")
    return params


def _finish(req: ApiRequest, p: dict[str, Any], limits: Limits) -> ApiRequest:
    if found := _structured(p):
        req.structured_param, so = found
        req.sampling.structured_outputs.CopyFrom(so)
    if req.tools is not None and (so := req.tools.structured_outputs()) is not None:
        # required or a named function: the tools' schema is the constraint, whatever else the
        # body asks (as vLLM: the tool call wins over response_format)
        req.structured_param = "tools"
        req.sampling.structured_outputs.CopyFrom(so)
    if "max_completion_tokens" in p:
        req.max_tokens_param = "max_completion_tokens"
    req.echo = _bool("echo", p.get("echo", False))
    if req.echo and req.logprobs is not None and not req.chat:
        raise BadParam("echo", "echo with logprobs needs the prompt's log-probabilities (prompt_logprobs), "
                               "which this server does not support", "unsupported_parameter")
    if "truncate_prompt_tokens" in p:
        k = _int("truncate_prompt_tokens", p["truncate_prompt_tokens"], -1, _UINT32 - 1)
        req.truncate_prompt_tokens = None if k == -1 else k  # vLLM's -1: the model's context
        if k == 0:
            raise BadParam("truncate_prompt_tokens", "truncate_prompt_tokens must be >= 1 (or -1)")
    if "bad_words" in p:
        bad = p["bad_words"]
        req.bad_words = [bad] if isinstance(bad, str) else _list_of("bad_words", bad, str, "strings")
        if any(not w.strip() for w in req.bad_words):
            raise BadParam("bad_words", "bad words must not be empty")
        if len(req.bad_words) > MAX_BAD_WORDS // 2:  # each is matched alone and after a space: two sequences
            raise BadParam("bad_words", f"bad_words: at most {MAX_BAD_WORDS // 2} words, got {len(req.bad_words)}")
    _bool("spaces_between_special_tokens", p.get("spaces_between_special_tokens", True))
    req.n = _int("n", p.get("n", 1), 1, _INT32 - 1)
    if error := limits.choices_error(len(req.prompts) or 1, req.n):
        raise BadParam("n", error)
    req.stream = _bool("stream", p.get("stream", False))
    if "stream_options" in p:
        req.include_usage, req.continuous_usage = _stream_options(p["stream_options"], req.stream)
    # vLLM's priority: a lower value is served first; the cluster's (gRPC's): a larger one.
    req.priority = -_int("priority", p.get("priority", 0), -(_INT32 - 1), _INT32 - 1)
    if "user" in p:
        req.user = _str("user", p["user"])
    if "request_id" in p:
        req.request_id = _str("request_id", p["request_id"]) or None
        if req.request_id is not None and len(req.request_id) > MAX_CLIENT_REQUEST_ID:
            raise BadParam("request_id", f"request_id: at most {MAX_CLIENT_REQUEST_ID} characters")
    req.tokens_as_ids = _bool("return_tokens_as_token_ids", p.get("return_tokens_as_token_ids", False))
    return req


GUIDED_BACKENDS = ("auto", "guidance", "llguidance")
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's structured_outputs options that change nothing here: JSON is always generated without
# free whitespace between its tokens (grammar.JSON_OPTIONS), which is what disable_any_whitespace
# asks for; false, its default, asks nothing.
NO_OP_STRUCTURED = ("disable_any_whitespace",)
# vLLM's structured_outputs options this server does not implement -> their "off" value.
UNSUPPORTED_STRUCTURED = {"disable_fallback": False,
                          "disable_additional_properties": False, "whitespace_pattern": None,
                          "structural_tag": None, "backend": None}


def _structured(p: dict[str, Any]) -> tuple[str, pb.StructuredOutputs] | None:
    """The one structured-output constraint a body sets, and the parameter that set it."""
    found: list[tuple[str, pb.StructuredOutputs]] = []
    if (rf := p.get("response_format")) is not None:
        if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
            raise BadParam("response_format", "response_format must be an object with a type")
        kind = rf["type"]
        if kind == "json_object":
            found.append(("response_format", pb.StructuredOutputs(json_object=True)))
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict | bool):
                raise BadParam("response_format.json_schema", "json_schema must be an object with a schema object")
            schema = spec.get("schema", {})
            found.append(("response_format.json_schema.schema", pb.StructuredOutputs(json=json.dumps(schema))))
        elif kind != "text":
            raise BadParam("response_format.type", "response_format.type must be text, json_object or json_schema")
    if "guided_json" in p:
        found.append(("guided_json", pb.StructuredOutputs(json=_schema_text("guided_json", p["guided_json"]))))
    if "guided_regex" in p:
        found.append(("guided_regex", pb.StructuredOutputs(regex=_str("guided_regex", p["guided_regex"]))))
    if "guided_choice" in p:
        found.append(("guided_choice", pb.StructuredOutputs(choice=_choices("guided_choice", p["guided_choice"]))))
    if "guided_grammar" in p:
        found.append(("guided_grammar", pb.StructuredOutputs(grammar=_str("guided_grammar", p["guided_grammar"]))))
    if "structured_outputs" in p:
        found.append(_structured_outputs(p["structured_outputs"]))
    if "guided_decoding_backend" in p and p["guided_decoding_backend"] not in GUIDED_BACKENDS:
        raise BadParam("guided_decoding_backend", f"this server's structured output is llguidance's; "
                                                  f"guided_decoding_backend must be one of {', '.join(GUIDED_BACKENDS)}",
                       "unsupported_parameter")
    if len(found) > 1:
        raise BadParam(found[1][0], f"give one structured-output constraint, not {found[0][0]} and {found[1][0]}")
    return found[0] if found else None


def _structured_outputs(value: Any) -> tuple[str, pb.StructuredOutputs]:
    if not isinstance(value, dict):
        raise BadParam("structured_outputs", "structured_outputs must be an object")
    so = pb.StructuredOutputs()
    for key, v in value.items():
        name = f"structured_outputs.{key}"
        if key in NO_OP_STRUCTURED:
            if v is not None:
                _bool(name, v)
        elif key in UNSUPPORTED_STRUCTURED:
            if v is not None and v != UNSUPPORTED_STRUCTURED[key]:
                raise BadParam(name, f"{name} is not supported by this server", "unsupported_parameter")
        elif key not in STRUCTURED_KEYS:
            raise BadParam(name, f"unknown parameter {key!r}", "unknown_parameter")
        elif v is None:
            continue
        elif key == "json":
            so.json = _schema_text(name, v)
        elif key == "choice":
            so.choice.extend(_choices(name, v))
        elif key == "json_object":
            so.json_object = _bool(name, v)
        else:
            setattr(so, key, _str(name, v))
    num_set = sum(so.HasField(k) for k in ("json", "regex", "grammar")) + bool(so.choice) + so.json_object
    if num_set != 1:
        raise BadParam("structured_outputs", "structured_outputs must set exactly one of " + ", ".join(STRUCTURED_KEYS))
    return "structured_outputs", so


def _schema_text(name: str, value: Any) -> str:
    """A JSON schema given as an object or as JSON text, as JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise BadParam(name, f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict | bool):
        raise BadParam(name, f"{name} must be a JSON schema (an object)")
    return json.dumps(value)


def _choices(name: str, value: Any) -> list[str]:
    choices = _list_of(name, value, str, "strings")
    if not choices:
        raise BadParam(name, f"{name} must not be empty")
    return choices


def _model(p: dict[str, Any]) -> str | None:
    return _str("model", p["model"]) if "model" in p else None


def _stream_options(value: Any, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats); as vLLM, usage goes in every chunk only with both."""
    if not stream:
        raise BadParam("stream_options", "stream_options is only allowed with stream: true")
    if not isinstance(value, dict):
        raise BadParam("stream_options", "stream_options must be an object")
    for key in value:
        if key not in ("include_usage", "continuous_usage_stats"):
            raise BadParam(f"stream_options.{key}", f"unknown stream option {key!r}", "unknown_parameter")
    flags = [False if value.get(k) is None else _bool(f"stream_options.{k}", value[k])
             for k in ("include_usage", "continuous_usage_stats")]
    return flags[0], flags[0] and flags[1]


def _sampling(p: dict[str, Any]) -> pb.SamplingParams:
    s = pb.SamplingParams()
    if "max_tokens" in p:
        s.max_tokens = _int("max_tokens", p["max_tokens"], 0, _UINT32 - 1)
    if (m := p.get("max_completion_tokens")) is not None:  # OpenAI's newer name wins over max_tokens, as in vLLM
        s.max_tokens = _int("max_completion_tokens", m, 0, _UINT32 - 1)
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if name in p:
            setattr(s, name, _number(name, p[name]))
    if "top_k" in p:
        k = _int("top_k", p["top_k"], -1, _UINT32 - 1)
        s.top_k = max(k, 0)  # vLLM's -1 is off, as 0 is here
    if "seed" in p:  # vLLM's range (int64, negatives too) and uint64: the proto's, two's complement
        s.seed = _int("seed", p["seed"], -(2**63), _UINT64 - 1) % _UINT64
    if "min_tokens" in p:
        s.min_tokens = _int("min_tokens", p["min_tokens"], 0, _UINT32 - 1)
    if "stop" in p:
        stop = p["stop"]
        s.stop.extend([stop] if isinstance(stop, str) else _list_of("stop", stop, str, "strings"))
    if "stop_token_ids" in p:
        ids = _list_of("stop_token_ids", p["stop_token_ids"], int, "token ids")
        s.stop_token_ids.extend(_int("stop_token_ids", t, 0, _UINT32 - 1) for t in ids)
    if "ignore_eos" in p:
        s.ignore_eos = _bool("ignore_eos", p["ignore_eos"])
    if "include_stop_str_in_output" in p:
        s.include_stop_str_in_output = _bool("include_stop_str_in_output", p["include_stop_str_in_output"])
    if "skip_special_tokens" in p:
        s.skip_special_tokens = _bool("skip_special_tokens", p["skip_special_tokens"])
    if "logit_bias" in p:
        s.logit_bias.update(_logit_bias(p["logit_bias"]))
    if "allowed_token_ids" in p:
        if isinstance(p["allowed_token_ids"], list) and len(p["allowed_token_ids"]) > MAX_ALLOWED_TOKEN_IDS:
            raise BadParam("allowed_token_ids", f"allowed_token_ids: at most {MAX_ALLOWED_TOKEN_IDS} ids, "
                                                f"got {len(p['allowed_token_ids'])}")
        ids = _list_of("allowed_token_ids", p["allowed_token_ids"], int, "token ids")
        if not ids:
            raise BadParam("allowed_token_ids", "allowed_token_ids must not be empty")
        s.allowed_token_ids.extend(_int("allowed_token_ids", t, 0, _UINT32 - 1) for t in ids)
    return s


def _logit_bias(value: Any) -> dict[int, float]:
    """OpenAI's ``{"token id": bias}`` (keys are strings in JSON)."""
    if not isinstance(value, dict):
        raise BadParam("logit_bias", "logit_bias must be an object of token ids to numbers")
    out = {}
    for key, bias in value.items():
        try:
            t = int(key)
        except ValueError:
            raise BadParam("logit_bias", f"logit_bias keys must be token ids, got {key!r}") from None
        if not 0 <= t < _UINT32:
            raise BadParam("logit_bias", f"logit_bias keys must be token ids >= 0, got {key!r}")
        out[t] = _number(f"logit_bias.{key}", bias)
    return out


def _prompts(value: Any) -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids or a list of such lists."""
    if value is None:
        raise BadParam("prompt", "prompt is required")
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise BadParam("prompt", "prompt must be a string, a list of strings, a list of token ids "
                                 "or a list of token-id lists, and not empty")
    if all(isinstance(x, str) for x in value):
        return list(value)
    if all(_is_int(x) for x in value):
        return [_token_ids(value)]
    if all(isinstance(x, list) for x in value):
        return [_token_ids(x) for x in value]
    raise BadParam("prompt", "prompt lists must hold only strings, only token ids or only token-id lists")


def _token_ids(ids: list[Any]) -> list[int]:
    if not all(_is_int(t) and 0 <= t < _UINT32 for t in ids):
        raise BadParam("prompt", "token ids must be integers >= 0")
    return ids


def _messages(p: dict[str, Any]) -> list[dict[str, Any]]:
    messages = p.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadParam("messages", "messages must be a non-empty list")
    return [_message(i, m) for i, m in enumerate(messages)]


def _message(i: int, m: Any) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise BadParam(where, "each message must be an object with role and content")
    for key, value in m.items():
        if key in _UNSUPPORTED_MESSAGE_KEYS and value not in (None, []):
            raise BadParam(f"{where}.{key}", f"{key} is not supported by this server", "unsupported_parameter")
        if key not in _MESSAGE_KEYS and key not in _UNSUPPORTED_MESSAGE_KEYS:
            raise BadParam(f"{where}.{key}", f"unknown message field {key!r}", "unknown_parameter")
    role = m.get("role")
    if role not in _ROLES:
        raise BadParam(f"{where}.role", f"role must be one of {', '.join(_ROLES)}, got {role!r}")
    out: dict[str, Any] = {"role": role, "content": _content(where, m.get("content"), role)}
    if m.get("name") is not None:
        out["name"] = _str(f"{where}.name", m["name"])
    if m.get("tool_calls"):
        if role != "assistant":
            raise BadParam(f"{where}.tool_calls", "only assistant messages carry tool_calls")
        from .openai_tools import template_tool_calls

        out["tool_calls"] = template_tool_calls(f"{where}.tool_calls", m["tool_calls"])
    if m.get("tool_call_id") is not None:
        out["tool_call_id"] = _str(f"{where}.tool_call_id", m["tool_call_id"])
    for key in ("reasoning_content", "reasoning"):
        if m.get(key) is not None:
            out["reasoning_content"] = out["reasoning"] = _str(f"{where}.{key}", m[key])
    return out


def _content(where: str, content: Any, role: str) -> str:
    """Text, or text parts joined by newlines (as vLLM joins them)."""
    if isinstance(content, str):
        return content
    if content is None and role in ("assistant", "tool"):
        return ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadParam(f"{where}.content[{j}]", "only text parts ({\"type\": \"text\", \"text\": ...}) "
                                                        "are supported")
            texts.append(part["text"])
        return "\n".join(texts)
    raise BadParam(f"{where}.content", "content must be a string or a list of text parts")


# -- values ------------------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(name: str, v: Any, lo: int, hi: int) -> int:
    if isinstance(v, float) and v.is_integer():  # 2.0 is 2, as vLLM's request models read it
        v = int(v)
    if not _is_int(v) or not lo <= v <= hi:
        raise BadParam(name, f"{name} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _number(name: str, v: Any) -> float:
    if not isinstance(v, int | float) or isinstance(v, bool):
        raise BadParam(name, f"{name} must be a number, got {v!r}")
    try:
        return float(v)
    except OverflowError:  # an integer past float's range (JSON integers have no bound)
        raise BadParam(name, f"{name} must be a finite number, got an integer of {len(str(abs(v)))} digits") from None


def _bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise BadParam(name, f"{name} must be true or false, got {v!r}")
    return v


def _str(name: str, v: Any) -> str:
    if not isinstance(v, str):
        raise BadParam(name, f"{name} must be a string, got {v!r}")
    return v


def _list_of(name: str, v: Any, kind: type, what: str) -> list[Any]:
    if not isinstance(v, list) or not all(isinstance(x, kind) and not isinstance(x, bool) for x in v):
        raise BadParam(name, f"{name} must be a list of {what}" + (" or a string" if name == "stop" else ""))
    return v
