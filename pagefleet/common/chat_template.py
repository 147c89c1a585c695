"""Chat templates: a checkpoint's own Jinja template turning messages into one prompt string.

Rendered as ``transformers``' ``apply_chat_template`` renders it: a sandboxed Jinja2
environment with ``trim_blocks`` and ``lstrip_blocks``, the loop-controls extension and
a no-op ``{% generation %}`` block, ``raise_exception``, ``strftime_now``, a ``tojson``
that keeps non-ASCII text, and the tokenizer's special tokens (``bos_token``,
``eos_token``, ...) as strings. Message keys whose value is ``None`` are dropped first.
The prompt's token ids are ``tokenizer.encode(text, add_special_tokens=False)``: the
template writes the special tokens itself.

Where the template comes from: ``chat_template.jinja`` in the checkpoint (it wins, as in
``transformers``), else ``chat_template`` in ``tokenizer_config.json`` (a string, or a
list of named templates of which ``default`` is used). The built-in ``tiny`` model has
a small template of its own (its byte tokenizer adds BOS, so ``add_special_tokens`` is
True there). Torch-free.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from .model_config import TINY, ModelSpec

# The special tokens transformers hands every template (SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template refused the messages (``raise_exception``) or failed to render them."""


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """A compiled-on-demand chat template and the variables it renders with."""

    source: str
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    # Whether the tokenizer adds its own special tokens to the rendered text (tiny only).
    add_special_tokens: bool = False

    def render(self, messages: Sequence[Mapping[str, Any]], /, *, add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, **variables: Any) -> str:
        """The prompt for ``messages`` (``tools``: JSON-schema tool definitions, as ``transformers``
        passes them); ``ChatTemplateError`` if the template refuses them. ``variables``: more of
        the template's variables (a request's ``chat_template_kwargs``), any name (``self`` and
        ``tokenizer`` too: they reach the template as one mapping, never this call's arguments)."""
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        context = {**self.special_tokens, **variables, "messages": chat, "tools": list(tools) if tools else None,
                   "documents": None, "add_generation_prompt": add_generation_prompt}
        try:
            return _compile(self.source).render(context)
        except Exception as e:  # the template is the checkpoint's code: any failure refuses the messages
            raise ChatTemplateError(str(e) or type(e).__name__) from None

    def encode(self, tokenizer: Any, messages: Sequence[Mapping[str, Any]], /, *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, **variables: Any) -> list[int]:
        """The token ids of the rendered prompt (by default with the generation prompt).

        ``continue_final_message``: the prompt ends where the last message's content ends,
        so the model continues it (``transformers``' rule: the rendered text is cut after
        the last occurrence of that content).
        """
        text = self.render(messages, add_generation_prompt=add_generation_prompt and not continue_final_message,
                           **variables)
        if continue_final_message:
            text = continue_final(text, messages[-1].get("content") or "")
        return tokenizer.encode(text, add_special_tokens=self.add_special_tokens)


def continue_final(rendered: str, final: str) -> str:
    """``rendered`` cut right after the last occurrence of the final message's content."""
    if not final.strip():
        return rendered
    at = rendered.rfind(final.strip())
    if at == -1:
        raise ChatTemplateError("continue_final_message: the final message's content is not in the rendered chat")
    if rendered[at:at + len(final.lstrip())] == final.lstrip():
        return rendered[:at + len(final.lstrip())]
    return rendered[:at + len(final.strip())]


def load_chat_template(model: ModelSpec) -> ChatTemplate | None:
    """The model's chat template, or None when its checkpoint has none."""
    if model.name == TINY:
        return ChatTemplate(TINY_CHAT_TEMPLATE, add_special_tokens=True)
    if model.path is None:
        return None
    return read_chat_template(model.path)


def read_chat_template(path: Path) -> ChatTemplate | None:
    """The chat template of a checkpoint directory (see the module's docstring), or None."""
    path = Path(path)
    config = _read_json(path / "tokenizer_config.json")
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        source = jinja_file.read_text(encoding="utf-8")
    else:
        source = config.get("chat_template")
        if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    if not isinstance(source, str) or not source:
        return None
    return ChatTemplate(source, _special_tokens(path, config))


def _special_tokens(path: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Special tokens as strings: tokenizer_config.json's, then special_tokens_map.json's."""
    legacy = _read_json(path / "special_tokens_map.json")
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name, legacy.get(name))
        if isinstance(value, Mapping):  # a serialized AddedToken
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


@functools.lru_cache(maxsize=8)
def _compile(source: str):
    """The template compiled in transformers' sandboxed environment."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (assistant-token masks): renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class Dict:
        """``dict(...)`` and ``dict.fromkeys(...)`` without handing templates the type itself."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class Namespace(jinja2.utils.Namespace):
        """``namespace()`` that refuses underscore names (no reach into Python internals)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} may not start with '_'")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = Dict()
    env.globals["namespace"] = Namespace
    return env.from_string(source)
