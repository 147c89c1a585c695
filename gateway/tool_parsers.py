"""Tool-call parsers (``--tool-call-parser``): a model's own tool-call format, read from its
output into OpenAI's ``tool_calls``.

=============== ============================================================================
``hermes``      ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per
(``qwen``)      call (Hermes 2 Pro, Qwen 2.5 and Qwen 3); the text before the first block is content
``llama3_json`` the output is ``{"name": ..., "parameters": {...}}`` (after an optional
                ``<|python_tag|>``), several separated by ``;``
``mistral``     ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` (or, in newer
                tokenizers, ``name[ARGS]{...}`` per call)
=============== ============================================================================

``ToolParser.calls_start(text)`` says where the calls begin (None: not yet, and the text may be
streamed up to ``safe_content_end``); ``parse(text)`` gives (content, calls) for a whole
output, or (text, []) when what looked like calls does not parse (then it is content, as vLLM
answers). ``tool_choice`` ``required`` and a named function are not parsed from the model's
format: they are constrained to JSON (openai_tools.py) and read by ``parse_required`` /
``parse_named``.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Any

TOOL_CALL_PARSERS = ("hermes", "qwen", "llama3_json", "mistral")


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


_ALNUM = string.ascii_letters + string.digits


def new_call(name: str, arguments: Any, mistral_id: bool = False) -> ToolCall:
    """A call with a fresh id: ``call_<24 hex>``, or 9 letters and digits for Mistral's format
    (its chat template refuses any other id when the call comes back in the next turn)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    call_id = "".join(secrets.choice(_ALNUM) for _ in range(9)) if mistral_id else f"call_{uuid.uuid4().hex[:24]}"
    return ToolCall(name, args, call_id)


def _partial_suffix(text: str, tag: str) -> int:
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _call(obj: Any, args_key: str = "arguments", mistral_id: bool = False) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("a tool call must be an object with a name")
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return new_call(obj["name"], args, mistral_id)


class ToolParser:
    marker = ""
    # Special tokens the format uses: the door keeps special tokens in the text for them.
    needs_special_tokens = False

    def calls_start(self, text: str) -> int | None:
        at = text.find(self.marker)
        return None if at == -1 else at

    def safe_content_end(self, text: str) -> int:
        """How much of ``text`` (no calls started in it) can be sent as content now."""
        return len(text) - _partial_suffix(text, self.marker)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        at = self.calls_start(text)
        if at is None:
            return text, []
        try:
            calls = self._calls(text[at:])
        except (ValueError, TypeError):
            return text, []
        return (text[:at], calls) if calls else (text, [])

    def _calls(self, text: str) -> list[ToolCall]:
        raise NotImplementedError


class HermesParser(ToolParser):
    marker = "<tool_call>"
    needs_special_tokens = True  # a special token in Hermes-2-Pro's vocabulary (not in Qwen's): kept either way
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def _calls(self, text: str) -> list[ToolCall]:
        return [_call(json.loads(body)) for body in self._BLOCK.findall(text) if body.strip()]


class Llama3JsonParser(ToolParser):
    marker = "<|python_tag|>"
    needs_special_tokens = True

    def calls_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(("{", self.marker)):
            return len(text) - len(stripped)
        return None

    def safe_content_end(self, text: str) -> int:
        stripped = text.lstrip()
        return 0 if self.marker.startswith(stripped) else len(text)  # calls only ever start the output

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        content, calls = super().parse(text)
        # Calls only ever start the output: what came before them is whitespace, not content
        # (as vLLM answers: no content beside the calls).
        return ("" if calls and not content.strip() else content), calls

    def _calls(self, text: str) -> list[ToolCall]:
        body = text.strip().removeprefix(self.marker).strip()
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            obj, at = decoder.raw_decode(body, at)
            calls.append(_call(obj, "parameters"))
            while at < len(body) and body[at] in "; \n\t":
                at += 1
        return calls


class MistralParser(ToolParser):
    marker = "[TOOL_CALLS]"
    needs_special_tokens = True

    def _calls(self, text: str) -> list[ToolCall]:
        parts = [p.strip() for p in text.split(self.marker) if p.strip()]
        calls = []
        for part in parts:
            if part.startswith("["):
                calls += [_call(obj, mistral_id=True) for obj in json.loads(part)]
            else:
                name, sep, args = part.partition("[ARGS]")
                if not sep:
                    at = part.index("{")
                    name, args = part[:at], part[at:]
                calls.append(new_call(name.strip(), json.loads(args), mistral_id=True))
        return calls


PARSERS = {"hermes": HermesParser, "qwen": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}


def tool_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"tool-call parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {name!r}")
    return PARSERS[name]()


def parse_required(text: str) -> list[ToolCall]:
    """``tool_choice: required``'s constrained output: ``[{"name": ..., "parameters": {...}}, ...]``."""
    return [_call(obj, "parameters") for obj in json.loads(text)]


def parse_named(name: str, text: str) -> list[ToolCall]:
    """A named ``tool_choice``'s constrained output: the arguments themselves, as the text is
    (cut short by ``max_tokens`` too, as vLLM answers: the call is the one asked for)."""
    return [new_call(name, text)]
