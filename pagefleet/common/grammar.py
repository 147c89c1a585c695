"""Structured output as llguidance grammars: one place that turns a ``StructuredOutputs`` into
a grammar, checks that it compiles, and builds llguidance's view of a tokenizer. Torch-free:
the gateway checks grammars with it, the worker compiles and matches them (worker/structured.py).

Each kind becomes one llguidance grammar: ``json`` (a JSON schema) and ``json_object``
(``{"type": "object"}``) through llguidance's JSON-schema compiler with no free whitespace
(``{"a":1}``, as the output then always ends where the value does); ``regex``; ``choice``
as a Lark grammar of string literals; ``grammar`` as Lark (llguidance's dialect) or GBNF
(recognised by a line that starts a ``name ::=`` rule, converted to Lark).
"""

from __future__ import annotations

import json
import re
from typing import Any

from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

from .sampling_params import StructuredOutputs

# Compact JSON: a model cannot pad its output with whitespace until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A constraint that does not compile; ``field`` names the kind (json, regex, ...)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


def kind_of(so: StructuredOutputs) -> str:
    """The constraint ``so`` sets: a kind given empty (``regex=""``) is still that kind, never
    the ``json_object`` of none set."""
    for name in ("json", "regex", "grammar"):
        if getattr(so, name) is not None:
            return name
    return "choice" if so.choice else "json_object"


# Bounds on one constraint: compiling one takes the gateway's event loop (100,000 choices took
# 7 s) and each distinct one is cached, so a request may not bring more than this.
MAX_CONSTRAINT_CHARS = 128 * 1024
MAX_CHOICES = 1024
# ``patternProperties`` entries in one schema: llguidance works out the keys none of them match,
# and that grows steeply with their number (64: 14 ms; 200: 1 s; 400: 21 s on one core).
MAX_PATTERN_PROPERTIES = 64
# A GBNF grammar: a rule ``name ::= ...`` starts a line (Lark's rules are ``name: ...``; a
# ``::=`` inside a Lark string or comment does not make it GBNF).
_GBNF_RULE = re.compile(r"^\s*<?[A-Za-z_][\w-]*>?\s*::=", re.MULTILINE)


def _count_pattern_properties(schema: Any) -> int:
    """``patternProperties`` entries anywhere in ``schema`` (iteratively: no depth limit)."""
    count, todo = 0, [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            pp = node.get("patternProperties")
            if isinstance(pp, dict):
                count += len(pp)
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return count


def grammar_of(so: StructuredOutputs) -> str:
    """The llguidance grammar of ``so``; ``GrammarError`` when it is not even well formed."""
    kind = kind_of(so)
    if kind in ("json", "regex", "grammar") and getattr(so, kind) == "":
        raise GrammarError(kind, f"the {kind} is empty")
    if kind == "choice" and len(so.choice) > MAX_CHOICES:
        raise GrammarError(kind, f"at most {MAX_CHOICES} choices, got {len(so.choice)}")
    size = sum(map(len, so.choice)) if kind == "choice" else len(so.json or so.regex or so.grammar or "")
    if size > MAX_CONSTRAINT_CHARS:
        raise GrammarError(kind, f"at most {MAX_CONSTRAINT_CHARS} characters, got {size}")
    try:
        if kind == "json" or kind == "json_object":
            schema: Any = json.loads(so.json) if kind == "json" else {"type": "object"}
            if not isinstance(schema, dict | bool):
                raise GrammarError(kind, "a JSON schema must be an object")
            if (n := _count_pattern_properties(schema)) > MAX_PATTERN_PROPERTIES:
                raise GrammarError(kind, f"at most {MAX_PATTERN_PROPERTIES} patternProperties entries in a schema "
                                         f"(their cost to compile grows steeply), got {n}")
            return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(so.regex)
        if kind == "choice":
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice))
        text = so.grammar
        if _GBNF_RULE.search(text):
            from llguidance.gbnf_to_lark import gbnf_to_lark

            text = gbnf_to_lark(text)
        return LLMatcher.grammar_from_lark(text)
    except GrammarError:
        raise
    except Exception as e:  # llguidance's and json's errors alike: the client's grammar is wrong
        raise GrammarError(kind, str(e) or type(e).__name__) from None


def matcher_error(matcher: LLMatcher, default: str) -> str:
    """A failed matcher's error in one line (its first), or ``default`` where it gives none."""
    return (matcher.get_error() or "").strip().split("\n")[0] or default


def check(so: StructuredOutputs, tokenizer: LLTokenizer | None = None) -> str:
    """The grammar of ``so`` if it compiles; ``GrammarError`` naming it if not. With the model's
    ``tokenizer`` (``ll_tokenizer``) its token references are checked too (``<[99999]>`` past
    the vocabulary, a special token the model does not have), as the worker will compile it."""
    grammar = grammar_of(so)
    error = LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise GrammarError(kind_of(so), error.strip())
    if tokenizer is not None:
        # What validation does not build: the lexer and the first mask (a recursive ``$ref``
        # fails there, and would end every request with an error at its first token).
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if not matcher.is_error():
            matcher.compute_bitmask()
        if matcher.is_error():
            why = matcher_error(matcher, "no reason given")
            raise GrammarError(kind_of(so), f"its first token's mask cannot be built ({why})")
    return grammar


class _HFTokens:
    """A ``tokenizer.json`` as llguidance's ``TokenizerWrapper`` reads one: each token's bytes as
    llguidance's own loader gives them, but only the tokenizer's special tokens special.

    llguidance's loader makes every added token special (matched only by a grammar's
    ``<|name|>`` or ``<[id]>``), Qwen's ``<think>`` and ``<tool_call>`` too, which the tokenizer
    adds as text; yet it tokenizes text with them, and with the special ones (``</s>``), when it
    forces a grammar's literal: the forced token was then one its matcher refused, and the
    request ended quietly (``"<think>yes"`` as a choice came out ``"<think>"``). Here an added
    token that is not special is text, and a special token's text in a literal is tokenized
    as text (its bytes), never as the special token."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos: list[int] | None) -> None:
        base = LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=eos)
        self._base = base
        self.tokens = [base.decode_bytes([i]) for i in range(vocab_size)]
        # Past the tokenizer's own ids (a model's padded vocabulary): special, named <[id]>.
        self._special = (tokenizer.special_token_ids() | set(eos or ())
                         | set(range(tokenizer.vocab_size, vocab_size)))
        self.special_token_ids = sorted(self._special)
        self.eos_token_id = eos[0] if eos else None
        self.bos_token_id = tokenizer.bos_token_id

    def __call__(self, text: bytes) -> list[int]:
        ids = self._base.tokenize_bytes(text)
        tokens = self.tokens
        if self._special.isdisjoint(ids) and b"".join([tokens[i] for i in ids]) == text:
            return ids
        # A special token, or an added token whose bytes are not the text it was matched in (one
        # that strips the space before it; one of byte-level symbols): the text, token by token
        # of the vocabulary's own (llguidance's greedy walk, which uses no added token).
        try:
            return self._base.greedy_tokenize(text.decode("utf-8"))
        except UnicodeDecodeError:  # part of a character: as the tokenizer gave it, specials as text
            out: list[int] = []
            for i in ids:
                if i in self._special:
                    out.extend(self._base.greedy_tokenize(tokens[i].decode("utf-8", "replace")))
                else:
                    out.append(i)
            return out


class _ByteTokens:
    """The built-in byte tokenizer as llguidance's ``TokenizerWrapper`` reads one."""

    def __init__(self, tokenizer: Any) -> None:
        self.eos_token_id = tokenizer.EOS
        self.bos_token_id = tokenizer.BOS
        self.tokens = [bytes((i,)) for i in range(256)] + [b"<s>", b"</s>", b"<pad>"]
        self.special_token_ids = [tokenizer.BOS, tokenizer.EOS, tokenizer.PAD]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> LLTokenizer:
    """llguidance's tokenizer for one of ours (``HFTokenizer`` or ``ByteTokenizer``), with the
    model's vocabulary size (its logits' width) and end-of-sequence ids."""
    from .tokenizer import ByteTokenizer, HFTokenizer

    eos = list(eos_token_ids) or None
    if isinstance(tokenizer, HFTokenizer):
        return LLTokenizer(TokenizerWrapper(_HFTokens(tokenizer, vocab_size, eos)), n_vocab=vocab_size, eos_token=eos)
    if isinstance(tokenizer, ByteTokenizer):
        return LLTokenizer(TokenizerWrapper(_ByteTokens(tokenizer)), n_vocab=vocab_size, eos_token=eos)
    raise GrammarError("structured_outputs", "this model's tokenizer cannot drive structured output")
