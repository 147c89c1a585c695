"""Reasoning parsers (``--reasoning-parser``): a chat output's ``<think>...</think>`` part
becomes ``reasoning_content``, the rest ``content``, streamed or not.

``qwen3``: the output is content unless it starts with ``<think>`` (Qwen3's template leaves the
tag to the model; with ``enable_thinking`` false there is none). ``deepseek_r1``: the output
starts inside the reasoning (the template opens ``<think>``; a leading ``<think>`` is
dropped) until ``</think>``. ``ThinkSplitter.feed`` takes text as it comes and returns what can
be sent now, holding back only what may be the start of a tag; the pieces of a stream join
to what the whole text gives.
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

    __slots__ = ("_state", "_buf")

    def __init__(self, parser: str) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(REASONING_PARSERS)}, got {parser!r}")
        # "start": nothing seen yet (a leading <think> decides); "reasoning"; "content"
        self._state = "start" if parser == "qwen3" else "reasoning_start"
        self._buf = ""

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
                continue
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


def split_reasoning(parser: str, text: str) -> tuple[str | None, str]:
    """The whole output's (reasoning or None, content)."""
    splitter = ThinkSplitter(parser)
    reasoning, content = splitter.feed(text, final=True)
    in_reasoning = parser == "deepseek_r1" or text.startswith(START)
    return (reasoning if in_reasoning else None), content
