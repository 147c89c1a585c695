"""The Responses API (``POST /v1/responses``), as vLLM serves it, on the chat path.

``parse_responses`` turns a body into a chat request (openai_request.parse_chat): ``input``
as text or items (messages with text parts, ``function_call`` and ``function_call_output``
items; ``reasoning`` items are not shown to the model), ``instructions`` as a system message
first, ``max_output_tokens``, ``temperature``, ``top_p``, function ``tools``, ``tool_choice``,
``parallel_tool_calls``, ``text.format`` (structured output), ``reasoning.effort`` (the chat
template's ``reasoning_effort``, as vLLM passes it), ``include: ["message.output_text.logprobs"]``
with ``top_logprobs``. An input that ends in an assistant message still ``in_progress`` or
``incomplete`` is continued, not answered in a new turn. Stateless: nothing is stored (the
response says ``"store": false``; ``store: true`` is taken and not honoured, as vLLM does when
it keeps no responses), and ``previous_response_id`` is refused by name: no response is kept.

``ResponseOutput`` builds the answer from the relayed messages: one ``response`` object, or
the typed stream (``response.created``, ``response.in_progress``, per item
``response.output_item.added`` ... ``response.output_text.delta`` /
``response.reasoning_text.delta`` / ``response.function_call_arguments.delta`` ...
``response.output_item.done``, then ``response.completed``), each event as
``event: <type>`` and ``data: <json>``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pagefleet.protos import generation_pb2 as pb

from .openai_request import ApiRequest, BadParam, parse_chat
from .openai_response import _finite, compact_json

RESPONSES_PARAMS = frozenset({"model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
                              "stream", "tools", "tool_choice", "parallel_tool_calls", "text", "store", "metadata",
                              "user", "truncation", "include", "reasoning", "background", "prompt_cache_key",
                              "safety_identifier", "service_tier", "top_logprobs", "max_tool_calls",
                              "previous_response_id", "conversation", "prompt", "stream_options",
                              # vLLM's sampling extras
                              "top_k", "min_p", "min_tokens", "repetition_penalty", "seed", "stop", "ignore_eos",
                              "presence_penalty", "frequency_penalty", "priority", "structured_outputs"})
# Accepted only as their "off" value (or null).
_OFF_VALUES = {"conversation": None, "prompt": None, "background": False, "max_tool_calls": None}
# Taken as vLLM takes them, and not acted on: nothing is stored, no input is cut to fit, one tier.
_IGNORED = {"store": bool, "truncation": ("auto", "disabled"), "service_tier": str}
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# What ``include`` may name: logprobs are sent; the rest have nothing to add here (no stored or
# encrypted reasoning, no tools that run on the server).
_INCLUDE = frozenset({LOGPROBS_INCLUDE, "reasoning.encrypted_content", "message.input_image.image_url",
                      "computer_call_output.output.image_url", "file_search_call.results",
                      "web_search_call.action.sources", "web_search_call.results", "code_interpreter_call.outputs"})
_REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_PASS_THROUGH = ("model", "temperature", "top_p", "top_k", "min_p", "min_tokens", "repetition_penalty", "seed", "stop",
                 "ignore_eos", "presence_penalty", "frequency_penalty", "priority", "parallel_tool_calls",
                 "structured_outputs")


def parse_responses(body: Any, limits) -> ApiRequest:
    if not isinstance(body, dict):
        raise BadParam(None, "the request body must be a JSON object")
    for key, value in body.items():
        if key not in RESPONSES_PARAMS:
            raise BadParam(key, f"unknown parameter {key!r}", "unknown_parameter")
        if key in _OFF_VALUES and value is not None and value != _OFF_VALUES[key]:
            raise BadParam(key, f"{key} is not supported by this server (it keeps no state: store is false)"
                           if key == "conversation" else f"{key} is not supported by this server",
                           "unsupported_parameter")
        allowed = _IGNORED.get(key)
        if allowed is not None and value is not None and \
                not (isinstance(value, allowed) if isinstance(allowed, type) else value in allowed):
            raise BadParam(key, f"{key} must be {allowed.__name__ if isinstance(allowed, type) else ' or '.join(allowed)}")
    if body.get("previous_response_id") is not None:
        raise BadParam("previous_response_id", "previous_response_id is not supported: this server keeps no "
                       "responses (store is false); send the whole conversation as input",
                       "unsupported_parameter")
    chat: dict[str, Any] = {k: body[k] for k in _PASS_THROUGH if body.get(k) is not None}
    messages = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise BadParam("instructions", "instructions must be a string")
        if body["instructions"]:  # empty: no system turn, as vLLM
            messages.append({"role": "system", "content": body["instructions"]})
    items = _list("input", body.get("input")) if not isinstance(body.get("input"), str) else None
    messages += _input_messages(body.get("input"))
    chat["messages"] = messages
    if items and isinstance(items[-1], dict) and items[-1].get("type", "message") == "message" \
            and items[-1].get("role") == "assistant" and items[-1].get("status") in ("in_progress", "incomplete"):
        chat["continue_final_message"], chat["add_generation_prompt"] = True, False  # go on with it, as vLLM
    if (effort := _reasoning_effort(body.get("reasoning"))) is not None:
        chat["chat_template_kwargs"] = {"reasoning_effort": effort}
    include = _include(body.get("include"))
    top = body.get("top_logprobs")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool)):
        raise BadParam("top_logprobs", "top_logprobs must be an integer")
    if LOGPROBS_INCLUDE in include:
        chat["logprobs"] = True
        chat["top_logprobs"] = body.get("top_logprobs") or 0
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        chat["tools"] = [_tool(i, t) for i, t in enumerate(_list("tools", body["tools"]))]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    for name in ("text", "metadata", "stream_options"):
        if body.get(name) is not None and not isinstance(body[name], dict):
            raise BadParam(name, f"{name} must be an object")
    if body.get("text") is not None and body["text"].get("format") is not None:
        chat["response_format"] = _format(body["text"]["format"])
    if body.get("stream") is not None:
        chat["stream"] = body["stream"]  # checked there: true or false
    try:
        req = parse_chat(chat, limits)
    except BadParam as e:
        raise BadParam(_responses_name(e.param), _responses_text(e.message), e.code) from None
    req.api = "responses"
    if req.structured_param == "response_format":
        req.structured_param = "text.format"
    req.responses = {k: body.get(k) for k in ("instructions", "max_output_tokens", "temperature", "top_p",
                                              "tool_choice", "tools", "text", "metadata", "parallel_tool_calls",
                                              "user", "reasoning", "top_logprobs")}
    req.max_tokens_param = "max_output_tokens"  # what a refusal of the output's length names
    return req


def _responses_text(message: str) -> str:
    """A refusal's text with the chat request's names for what the client sent as a response's."""
    for chat_name, name in (("max_completion_tokens", "max_output_tokens"), ("response_format", "text.format"),
                            ("messages", "input")):
        message = message.replace(chat_name, name)
    return message


def _reasoning_effort(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BadParam("reasoning", "reasoning must be an object")
    for key in value:
        if key not in ("effort", "summary", "generate_summary"):
            raise BadParam(f"reasoning.{key}", f"unknown parameter reasoning.{key}", "unknown_parameter")
    effort = value.get("effort")
    if effort is not None and effort not in _REASONING_EFFORTS:
        raise BadParam("reasoning.effort", f"reasoning.effort must be one of {', '.join(_REASONING_EFFORTS)}")
    return effort


def _include(value: Any) -> list[str]:
    if value is None:
        return []
    for i, name in enumerate(_list("include", value)):
        if not isinstance(name, str) or name not in _INCLUDE:
            raise BadParam(f"include[{i}]", f"include[{i}] must be one of {', '.join(sorted(_INCLUDE))}")
    return value


def _responses_name(param: str | None) -> str | None:
    if param is None:
        return None
    if param.startswith("messages"):
        return "input"
    return {"max_completion_tokens": "max_output_tokens", "response_format": "text.format"}.get(
        param.split(".")[0] if param.startswith("response_format") else param, param)


def _list(name: str, value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise BadParam(name, f"{name} must be a list")
    return value


def _input_messages(value: Any) -> list[dict[str, Any]]:
    if value is None:
        raise BadParam("input", "input is required")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(_list("input", value)):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadParam(where, "each input item must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item.get("role"), "content": _text(where, item.get("content"))})
        elif kind == "function_call":
            for key in ("call_id", "name"):
                if not isinstance(item.get(key), str) or not item[key]:
                    raise BadParam(f"{where}.{key}", f"a function_call item needs its {key}")
            arguments = item.get("arguments", "{}")
            if not isinstance(arguments, str):
                raise BadParam(f"{where}.arguments", "arguments must be a string (the call's JSON)")
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": arguments}}
            if out and out[-1]["role"] == "assistant":  # one assistant turn: its text, then its calls
                out[-1].setdefault("tool_calls", []).append(call)
                if out[-1]["tool_calls"] is None:
                    out[-1]["tool_calls"] = [call]
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or not item["call_id"]:
                raise BadParam(f"{where}.call_id", "a function_call_output item needs the call_id of its call")
            output = item.get("output")
            if not isinstance(output, (str, list)):
                raise BadParam(f"{where}.output", "output must be a string or a list of input_text parts")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text(where, output, field="output")})
        elif kind == "reasoning":
            continue  # earlier reasoning is not shown to the model again
        else:
            raise BadParam(f"{where}.type", f"input items of type {kind!r} are not supported", "unsupported_parameter")
    return out


def _text(where: str, content: Any, field: str = "content") -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                    or not isinstance(part.get("text"), str):
                raise BadParam(f"{where}.{field}[{j}]", "only text parts (input_text, output_text) are supported")
            texts.append(part["text"])
        return "\n".join(texts)
    raise BadParam(f"{where}.{field}", f"{field} must be a string or a list of text parts")


def _tool(i: int, tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise BadParam(f"tools[{i}]", "only function tools are supported", "unsupported_parameter")
    fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _format(fmt: Any) -> dict[str, Any]:
    if not isinstance(fmt, dict):
        raise BadParam("text.format", "text.format must be an object")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"),
                                                       "schema": fmt.get("schema", {}), "strict": fmt.get("strict")}}
    return {"type": fmt.get("type")}


# -- the answer ------------------------------------------------------------------------------------
def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseOutput:
    """The Responses API's objects for one request (one choice), built as its messages come."""

    done_marker = False  # no "data: [DONE]" at the end

    def __init__(self, req: ApiRequest, response_id: str, model: str, output, pieces=None) -> None:
        self.req, self.id, self.model, self._output = req, response_id, model, output
        self._pieces = pieces  # token id -> (text, bytes), for logprobs
        self.num_reasoning_tokens = 0
        self._pending_logprobs: list[dict[str, Any]] = []  # of tokens whose text is not out yet
        self.created = int(time.time())
        self._seq = 0
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being streamed: reasoning or message
        self.num_prompt_tokens = 0
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self._error = ""

    # the same faces as openai_response.Choices
    def set_prompt_tokens(self, index: int, num_prompt_tokens: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens

    @property
    def error(self) -> str | None:
        return (self._error or "generation failed") if self.finish_reason == "error" else None

    def opening(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self._response("in_progress")),
                self._event("response.in_progress", response=self._response("in_progress"))]

    def closing(self) -> list[dict[str, Any]]:
        return [self._event("response.completed", response=self.body())]

    def failed(self) -> list[dict[str, Any]]:
        """The stream's end when generation failed part way: ``response.failed``, its error named."""
        return [self._event("response.failed", response=self._response("failed"))]

    def add(self, index: int, msg: pb.GenerateResponse) -> list[dict[str, Any]]:
        self.num_tokens += len(msg.token_ids)
        events: list[dict[str, Any]] = []
        reasoning, content = self._output.feed(msg.text)
        calls = []
        if msg.finish_reason:
            self.finish_reason = {pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_STOP: "stop"}.get(
                msg.finish_reason, "error")
            self._error = msg.error
            r, rest, calls = self._output.finish()
            reasoning, content = reasoning + r, content + rest
        self._count_reasoning(msg, reasoning, content)
        if not reasoning or content:  # a reasoning token's log-probability is not the answer's
            self._pending_logprobs += self._logprobs(msg)
        if reasoning:
            events += self._delta("reasoning", reasoning)
        if content:
            events += self._delta("message", content, self._pending_logprobs)
            self._pending_logprobs = []
        elif msg.finish_reason and self._pending_logprobs and self._open is not None \
                and self._open["type"] == "message":
            self._open["content"][0]["logprobs"] += self._pending_logprobs  # tokens whose text never came
            self._pending_logprobs = []
        if msg.finish_reason and self.finish_reason == "error":
            if self._open is not None:  # left as it was cut; response.failed follows
                self._open["status"] = "incomplete"
                self._open = None
        elif msg.finish_reason:
            events += self._close()
            for call in calls:
                events += self._function_call(call)
        return events

    def body(self) -> dict[str, Any]:
        status = "completed" if self.finish_reason != "length" else "incomplete"
        return self._response(status)

    def events(self, index: int, msg: pb.GenerateResponse) -> list[bytes]:
        """``add``, as the stream's server-sent events."""
        return [self.sse(event) for event in self.add(index, msg)]

    def sse(self, event: dict[str, Any]) -> bytes:
        data = compact_json(event)
        return f"event: {event['type']}\ndata: {data}\n\n".encode()

    def _count_reasoning(self, msg: pb.GenerateResponse, reasoning: str, content: str) -> None:
        """The message's tokens that were reasoning (usage's ``reasoning_tokens``): all of them when
        its text went to reasoning alone, a share by characters when it crossed ``</think>``."""
        if not reasoning or not msg.token_ids:
            return
        n = len(msg.token_ids)
        self.num_reasoning_tokens += n if not content else max(1, round(n * len(reasoning) / (len(reasoning)
                                                                                              + len(content))))

    def _logprobs(self, msg: pb.GenerateResponse) -> list[dict[str, Any]]:
        """The message's tokens' log-probabilities in the Responses shape (``include`` asked for
        them; its ``top_logprobs`` alternatives each)."""
        if self.req.logprobs is None or self._pieces is None:
            return []
        entries = []
        for token_id, lp in zip(msg.token_ids, msg.logprobs, strict=False):
            text, raw = self._pieces(token_id)
            tops = []
            for t in lp.top_logprobs:
                t_text, t_raw = self._pieces(t.token_id)
                tops.append({"token": t_text, "logprob": _finite(t.logprob), "bytes": t_raw})
            entries.append({"token": text, "logprob": _finite(lp.logprob), "bytes": raw, "top_logprobs": tops})
        return entries

    # -- items ---------------------------------------------------------------------------------------
    def _delta(self, kind: str, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        events = []
        if self._open is not None and self._open["type"] != kind:
            events += self._close()
        if self._open is None:
            events += self._add_item(kind)
        item, index = self._open, len(self.items) - 1
        if kind == "reasoning":
            item["content"][0]["text"] += text
            events.append(self._event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                                      content_index=0, delta=text))
        else:
            part = item["content"][0]
            part["text"] += text
            logprobs = logprobs or []
            part["logprobs"] += logprobs
            events.append(self._event("response.output_text.delta", item_id=item["id"], output_index=index,
                                      content_index=0, delta=text, logprobs=logprobs))
        return events

    def _add_item(self, kind: str) -> list[dict[str, Any]]:
        if kind == "reasoning":
            item = {"id": _id("rs"), "type": "reasoning", "summary": [], "status": "in_progress",
                    "content": [{"type": "reasoning_text", "text": ""}]}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": _id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                    "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.items.append(item)
        self._open = item
        index = len(self.items) - 1
        shown = {**item, "content": []}
        return [self._event("response.output_item.added", output_index=index, item=shown),
                self._event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                            part=part)]

    def _close(self) -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        self._open = None
        item["status"] = "completed"
        index = self.items.index(item)
        part = item["content"][0]
        kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
        return [self._event(f"response.{kind}.done", item_id=item["id"], output_index=index, content_index=0,
                            text=part["text"], **({"logprobs": part["logprobs"]} if kind == "output_text" else {})),
                self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=part),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _function_call(self, call) -> list[dict[str, Any]]:
        item = {"id": _id("fc"), "type": "function_call", "call_id": call.id, "name": call.name, "arguments": "",
                "status": "in_progress"}
        self.items.append(item)
        index = len(self.items) - 1
        events = [self._event("response.output_item.added", output_index=index, item=dict(item))]
        item["arguments"], item["status"] = call.arguments, "completed"
        events += [self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                               delta=call.arguments),
                   self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               arguments=call.arguments, name=call.name),
                   self._event("response.output_item.done", output_index=index, item=item)]
        return events

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **fields}

    def _response(self, status: str) -> dict[str, Any]:
        r = self.req.responses
        fmt = (r.get("text") or {}).get("format") if isinstance(r.get("text"), dict) else None
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
               "background": False,
               "error": {"code": "server_error", "message": self.error or "generation failed"}
               if status == "failed" else None,
               "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
               "instructions": r.get("instructions"), "max_output_tokens": r.get("max_output_tokens"),
               "model": self.model, "output": self.items if status != "in_progress" else [],
               "parallel_tool_calls": r.get("parallel_tool_calls") is not False, "previous_response_id": None,
               "reasoning": r.get("reasoning"), "store": False, "temperature": r.get("temperature"),
               "text": {"format": fmt or {"type": "text"}}, "tool_choice": r.get("tool_choice") or "auto",
               "tools": r.get("tools") or [], "top_p": r.get("top_p"), "truncation": "disabled",
               "metadata": r.get("metadata") or {}, "user": r.get("user")}
        if status != "in_progress":
            out["usage"] = {"input_tokens": self.num_prompt_tokens, "output_tokens": self.num_tokens,
                            "total_tokens": self.num_prompt_tokens + self.num_tokens,
                            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                            "output_tokens_details": {"reasoning_tokens": self.num_reasoning_tokens}}
        else:
            out["usage"] = None
        return out
