"""Reasoning parsers (``--reasoning-parser``): a chat output's ``<think>...</think>`` part
becomes ``reasoning_content``, the rest ``content``, streamed or not.

``qwen3``: the output is content unless it starts with ``<think>`` (Qwen3's template leaves the
tag to the model; with ``enable_thinking`` false there is none), or the prompt ends inside
``<think>`` (Qwen3's thinking models' templates open it: the output is then reasoning up to
``</think>``). ``deepseek_r1``: the output starts inside the reasoning (the template opens
``<think>``; a leading ``<think>`` is dropped) until ``</think>``. Under structured output
(which shapes the output from its first token) an output that would start as reasoning is held
until ``</think>`` comes (then it is reasoning) or the output ends (then it is content: a
constrained JSON answer is not taken for reasoning). ``ThinkSplitter.feed`` takes text as it
comes and returns what can be sent now, holding back only what may be the start of a tag; the
pieces of a stream join to what the whole text gives.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ThinkSplitter:
    """One output's split into (reasoning, content) pieces."""

    __slots__ = ("_state", "_buf", "entered")

    def __init__(self, parser: str, constrained: bool = False, opened: bool = False) -> None:
        """``opened``: the prompt ends inside ``<think>``, so the output starts as reasoning
        (whichever parser). ``constrained``: structured output shapes the output from its first
        token, so an output that would start as reasoning is held until ``</think>`` comes (then
        it is reasoning) or the output ends without one (then it is content: a JSON answer is
        not taken for reasoning)."""
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(REASONING_PARSERS)}, got {parser!r}")
        # "start": nothing seen yet (a leading <think> decides); "reasoning_start": reasoning, a
        # leading <think> dropped; "held": reasoning if </think> comes, else content;
        # "reasoning"; "content"
        if parser == "qwen3" and not opened:
            self._state = "start"
        else:
            self._state = "held" if constrained else "reasoning_start"
        self._buf = ""
        self.entered = False  # whether the output had a reasoning part (empty or not)

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The (reasoning, content) that ``text`` makes ready; ``final``: nothing more comes."""
        self._buf += text
        reasoning, content = [], []
        while True:
            buf = self._buf
            if self._state in ("start", "reasoning_start"):
                if START.startswith(buf) and not final:  # may still become <think>
                    return "".join(reasoning), "".join(content)
                if buf.startswith(START):
                    self._buf, self._state = buf[len(START):], "reasoning"
                else:
                    self._state = "content" if self._state == "start" else "reasoning"
                self.entered = self._state == "reasoning"
                continue
            if self._state == "held":
                at = buf.find(END)
                if at == -1 and not final:
                    return "".join(reasoning), "".join(content)
                body = buf[len(START):] if buf.startswith(START) else buf
                if at != -1:
                    reasoning.append(body[:body.find(END)])
                    self._buf, self._state, self.entered = buf[at + len(END):], "content", True
                    continue
                if buf.startswith(START):  # opened, never closed: reasoning, as a leading <think> is
                    reasoning.append(body)
                    self.entered = True
                else:
                    content.append(buf)
                self._buf = ""
                return "".join(reasoning), "".join(content)
            if self._state == "reasoning":
                at = buf.find(END)
                if at != -1:
                    reasoning.append(buf[:at])
                    self._buf, self._state = buf[at + len(END):], "content"
                    continue
                keep = 0 if final else _partial_suffix(buf, END)
                reasoning.append(buf[:len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                return "".join(reasoning), "".join(content)
            content.append(buf)
            self._buf = ""
            return "".join(reasoning), "".join(content)


def split_reasoning(parser: str, text: str, constrained: bool = False, opened: bool = False) -> tuple[str | None, str]:
    """The whole output's (reasoning or None, content)."""
    splitter = ThinkSplitter(parser, constrained=constrained, opened=opened)
    reasoning, content = splitter.feed(text, final=True)
    return (reasoning if splitter.entered else None), content
