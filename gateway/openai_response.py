"""OpenAI response objects built from the relayed ``pb.GenerateResponse`` messages.

``Choices`` follows every choice of one request: ``chunk`` turns one message into a
streaming chunk (``text_completion`` or ``chat.completion.chunk``), ``body`` gives the
whole non-streaming response, ``usage`` the token counts (the prompt counted once per
prompt, not per choice, as OpenAI counts it). Log-probabilities come in each API's
shape: completions' ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``,
chat's ``content`` list of ``{token, logprob, bytes, top_logprobs}``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from json.encoder import encode_basestring as _json_str
from typing import Any

from pagefleet.common.step_write import stop_of
from pagefleet.common.tokenizer import ByteTokenizer
from pagefleet.protos import generation_pb2 as pb

from .openai_request import ApiRequest

FINISH_REASONS = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_ERROR: "error",
}
# JSON has no -inf: a log-probability below this is sent as this (as vLLM does).
MIN_LOGPROB = -9999.0
# ``_json_str``: a str as JSON with non-ASCII kept, as ``_COMPACT`` writes one (C when built).
# One encoder for every chunk: ``json.dumps`` with arguments builds an encoder a call (~40 % of a chunk's encoding).
_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def compact_json(obj: Any) -> str:
    """``obj`` as JSON without spaces, non-ASCII as it is (what a stream's chunks carry)."""
    return _COMPACT.encode(obj)


def sse(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + _COMPACT.encode(obj).encode() + b"\n\n"


# The byte tokenizer's special tokens by name (their text in log-probabilities, as a tokenizer's
# own special tokens are named there).
_BYTE_SPECIALS = {ByteTokenizer.BOS: "<s>", ByteTokenizer.EOS: "</s>", ByteTokenizer.PAD: "<pad>"}


class TokenPieces:
    """Each token's own text and bytes (what log-probabilities are reported for): a special
    token's is its name (``</s>``), as vLLM gives it, not the nothing it adds to the text."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._lengths: dict[tuple[int, bool], int] = {}

    def text_length(self, token_id: int, skip_special_tokens: bool = True) -> int:
        """The characters ``token_id`` adds to an output's text (none for a special token skipped;
        completions' ``text_offset`` moves by it)."""
        key = (token_id, skip_special_tokens)
        n = self._lengths.get(key)
        if n is None:
            if isinstance(self._tokenizer, ByteTokenizer):
                n = 1 if token_id < 256 else 0
            else:
                n = len(self._tokenizer.decode([token_id], skip_special_tokens=skip_special_tokens))
            if len(self._lengths) < 65536:
                self._lengths[key] = n
        return n

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        piece = self._cache.get(token_id)
        if piece is None:
            if isinstance(self._tokenizer, ByteTokenizer):
                raw = bytes((token_id,)) if token_id < 256 else _BYTE_SPECIALS.get(token_id, "").encode()
                piece = (raw.decode("utf-8", errors="replace"), list(raw))
            else:
                text = self._tokenizer.decode([token_id], skip_special_tokens=False)
                piece = (text, list(text.encode("utf-8")))
            if len(self._cache) < 65536:
                self._cache[token_id] = piece
        return piece


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    num_prompt_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token that ended it
    error: str = ""
    text_len: int = 0  # characters of text so far
    # completions' text_offset of the next token: what the tokens so far add to the text, each
    # by its own decode (as vLLM sums its tokens' strings), not the text sent so far, which lags
    # while a character's bytes are held back
    next_offset: int = 0
    logprobs: list[Any] = field(default_factory=list)  # chat entries, or completions' (token, lp, top, offset)
    echo: str = ""  # sent before the first message's text (and already in ``text``)
    output: Any = None  # chat_output.ChatOutput: reasoning and tool calls parsed from the text
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    tool_calls: list[Any] = field(default_factory=list)

    def ended(self, msg: pb.GenerateResponse) -> None:
        """Its last message: why it finished (and what stopped it, what failed)."""
        self.finish_reason = FINISH_REASONS.get(msg.finish_reason, "error")
        self.stop_reason = stop_of(msg)
        self.error = msg.error


class Choices:
    """The OpenAI objects of one request's choices."""

    def __init__(self, req: ApiRequest, response_id: str, model: str, pieces: TokenPieces,
                 echoes: list[str] | None = None, outputs: list[Any] | None = None) -> None:
        self.req = req
        self.id = response_id
        self.model = model
        self.pieces = pieces
        self.created = int(time.time())
        self.object = "chat.completion" if req.chat else "text_completion"
        self._choices = [_Choice() for _ in range(req.num_choices)]
        for c, echo in zip(self._choices, echoes or (), strict=False):  # echo: the text goes first
            c.text.append(echo)
            c.echo = echo
        for c, output in zip(self._choices, outputs or (), strict=False):  # chat_output.ChatOutput
            c.output = output
        # ``events``' template: every chunk's JSON but the choice's own fields, written once.
        self._plain = req.logprobs is None and not req.continuous_usage
        kind = "chat.completion.chunk" if req.chat else "text_completion"
        self._head = (f'data: {{"id":{_json_str(self.id)},"object":"{kind}","created":{self.created},'
                      f'"model":{_json_str(self.model)},"choices":[{{"index":')
        self._tail = ',"usage":null}\n\n' if req.include_usage else '}\n\n'

    def set_prompt_tokens(self, index: int, num_prompt_tokens: int) -> None:
        self._choices[index].num_prompt_tokens = num_prompt_tokens

    @property
    def error(self) -> str | None:
        """The first failed choice's error, if any failed."""
        return next((c.error or "generation failed" for c in self._choices if c.finish_reason == "error"), None)

    def add(self, index: int, msg: pb.GenerateResponse) -> list[dict[str, Any]]:
        """Record one message of choice ``index``; its streaming chunks (tool calls in one before the last)."""
        c = self._choices[index]
        c.text.append(msg.text)
        text = msg.text
        if c.echo:
            text, c.echo = c.echo + text, ""
        c.num_tokens += len(msg.token_ids)
        if msg.finish_reason:
            c.ended(msg)
        logprobs = self._logprobs(c, msg) if self.req.logprobs is not None else None
        c.text_len += len(msg.text)
        choice: dict[str, Any] = {"index": index}
        chunks = []
        if self.req.chat:
            delta, calls = self._chat_delta(c, text, bool(msg.finish_reason))
            if calls:
                chunks.append(self._chunk([{"index": index, "delta": {"tool_calls": [
                    {"index": k, **call.as_openai()} for k, call in enumerate(calls)]},
                    "logprobs": None, "finish_reason": None, "stop_reason": None}]))
                # As OpenAI's and vLLM's: calls the model chose end "tool_calls", a named one "stop".
                if c.finish_reason == "stop" and (self.req.tools is None or self.req.tools.choice != "named"):
                    c.finish_reason = "tool_calls"
            if not delta and not msg.finish_reason and not logprobs:
                return chunks  # nothing to say yet (text a parser holds back): no chunk, as vLLM sends none
            choice["delta"] = delta
            choice["logprobs"] = None if logprobs is None else {"content": logprobs, "refusal": None}
        else:
            choice["text"] = text
            choice["logprobs"] = None if logprobs is None else _completion_logprobs(logprobs)
        choice["finish_reason"] = c.finish_reason
        choice["stop_reason"] = c.stop_reason
        return [*chunks, self._chunk([choice])]

    def events(self, index: int, msg: pb.GenerateResponse) -> list[bytes]:
        """``add``, as the stream's server-sent events: the bytes ``sse`` gives of each chunk.
        The common message (no log-probabilities, no echo, no reasoning or tool-call parsing,
        no usage in every chunk) is written from a template, without building its chunk."""
        c = self._choices[index]
        if not self._plain or c.echo or c.output is not None:
            return [sse(chunk) for chunk in self.add(index, msg)]
        text = msg.text
        c.text.append(text)
        c.num_tokens += len(msg.token_ids)
        if msg.finish_reason:
            c.ended(msg)
        c.text_len += len(text)
        if self.req.chat:
            c.content.append(text)
            if not text and c.finish_reason is None:
                return []  # a token whose character is not complete yet: nothing to send
            fields = f',"delta":{{"content":{_json_str(text)}}}' if text else ',"delta":{}'
        else:
            fields = f',"text":{_json_str(text)}'
        reason = "null" if c.finish_reason is None else _json_str(c.finish_reason)
        stop = c.stop_reason
        stop = "null" if stop is None else _json_str(stop) if isinstance(stop, str) else str(stop)
        return [f'{self._head}{index}{fields},"logprobs":null,"finish_reason":{reason},"stop_reason":{stop}}}]'
                f'{self._tail}'.encode()]

    def _chat_delta(self, c: _Choice, text: str, last: bool) -> tuple[dict[str, Any], list[Any]]:
        """A chat message's delta (content and reasoning) and, with the last, its tool calls."""
        if c.output is None:
            c.content.append(text)
            return ({"content": text} if text else {}), []
        reasoning, content = c.output.feed(text)
        calls: list[Any] = []
        if last:
            r, rest, calls = c.output.finish()
            reasoning, content = reasoning + r, content + rest
            c.tool_calls = calls
        c.reasoning.append(reasoning)
        c.content.append(content)
        delta = {}
        if content:
            delta["content"] = content
        if reasoning:  # vLLM's names, the older and the newer
            delta["reasoning_content"] = delta["reasoning"] = reasoning
        return delta, calls

    done_marker = True  # the stream ends with "data: [DONE]"

    def opening(self) -> list[dict[str, Any]]:
        """The stream's first chunks: a chat's role chunk per choice."""
        return [self.role_chunk(i) for i in range(self.req.num_choices)] if self.req.chat else []

    def closing(self) -> list[dict[str, Any]]:
        """The stream's last chunks: the usage chunk, when asked for."""
        return [self.usage_chunk()] if self.req.include_usage else []

    sse = staticmethod(sse)

    def role_chunk(self, index: int) -> dict[str, Any]:
        """Chat streams open each choice with the assistant's role."""
        return self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None, "stop_reason": None}])

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.req.chat else "text_completion"
        chunk = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if self.req.include_usage:
            chunk["usage"] = None
            if self.req.continuous_usage:
                # A chunk's usage is that of the choice it carries, as vLLM counts it (each
                # choice its own prompt and completion tokens); the stream's last chunk sums them.
                c = self._choices[choices[0]["index"]] if len(choices) == 1 else None
                chunk["usage"] = self.usage() if c is None else {
                    "prompt_tokens": c.num_prompt_tokens, "completion_tokens": c.num_tokens,
                    "total_tokens": c.num_prompt_tokens + c.num_tokens}
        return chunk

    def usage(self) -> dict[str, int]:
        n = self.req.n
        prompt = sum(c.num_prompt_tokens for i, c in enumerate(self._choices) if i % n == 0)
        completion = sum(c.num_tokens for c in self._choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def usage_chunk(self) -> dict[str, Any]:
        chunk = self._chunk([])
        chunk["usage"] = self.usage()
        return chunk

    def body(self) -> dict[str, Any]:
        """The non-streaming response."""
        choices = []
        for i, c in enumerate(self._choices):
            text = "".join(c.text)
            choice: dict[str, Any] = {"index": i}
            if self.req.chat:
                choice["message"] = self._message(c)
                choice["logprobs"] = None if self.req.logprobs is None else {"content": c.logprobs, "refusal": None}
            else:
                choice["text"] = text
                choice["logprobs"] = None if self.req.logprobs is None else _completion_logprobs(c.logprobs)
            choice["finish_reason"] = c.finish_reason
            choice["stop_reason"] = c.stop_reason
            choices.append(choice)
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}

    @staticmethod
    def _message(c: _Choice) -> dict[str, Any]:
        content = "".join(c.content)
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if c.tool_calls else "")}
        if c.output is not None and (c.output.reasoning_seen or c.reasoning):
            message["reasoning_content"] = message["reasoning"] = \
                "".join(c.reasoning) if c.output.reasoning_seen else None
        if c.tool_calls:
            message["tool_calls"] = [call.as_openai() for call in c.tool_calls]
        return message

    def _logprobs(self, c: _Choice, msg: pb.GenerateResponse) -> list[Any]:
        """This message's entries (also kept on the choice for the whole body; a stream's go
        out in its chunks and are not kept: what a stream holds does not grow with its output)."""
        entries = []
        offset = c.next_offset
        pieces = _as_token_ids if self.req.tokens_as_ids else self.pieces
        skip = not self.req.sampling.HasField("skip_special_tokens") or self.req.sampling.skip_special_tokens
        for token_id, lp in zip(msg.token_ids, msg.logprobs, strict=False):
            text, raw = pieces(token_id)
            tops = [(pieces(t.token_id), _finite(t.logprob)) for t in lp.top_logprobs]
            if self.req.chat:
                entries.append({"token": text, "logprob": _finite(lp.logprob), "bytes": raw,
                                "top_logprobs": [{"token": t, "logprob": v, "bytes": b} for (t, b), v in tops]})
            else:
                top = {t: v for (t, _), v in tops}
                top.setdefault(text, _finite(lp.logprob))
                entries.append((text, _finite(lp.logprob), top, offset))
                offset += self.pieces.text_length(token_id, skip)  # what it adds to the text, however it is named
        c.next_offset = offset
        if not self.req.stream:
            c.logprobs.extend(entries)
        return entries


def _as_token_ids(token_id: int) -> tuple[str, list[int]]:
    """A token named by its id (``return_tokens_as_token_ids``), as vLLM names it."""
    name = f"token_id:{token_id}"
    return name, list(name.encode())


def _completion_logprobs(entries: list[tuple[str, float, dict[str, float], int]]) -> dict[str, list[Any]]:
    return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
            "top_logprobs": [e[2] for e in entries], "text_offset": [e[3] for e in entries]}


def _finite(logprob: float) -> float:
    value = float(logprob)
    return value if value >= MIN_LOGPROB else MIN_LOGPROB  # NaN too: JSON has no NaN
