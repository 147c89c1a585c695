"""One chat choice's output as it streams: reasoning (``--reasoning-parser``), content, and
tool calls (``tool_choice`` with ``--tool-call-parser``, or constrained JSON).

``ChatOutput.feed(text)`` returns the (reasoning, content) ready to send now; ``finish()`` the
rest and the tool calls. Content that may be the start of tool calls is held back; calls are
sent whole when the output ends (each one delta with its id, name and arguments). The
pieces of a stream join to what the whole output gives, so streamed and unstreamed answers
agree.
"""

from __future__ import annotations

from .openai_tools import ToolPlan
from .reasoning import ThinkSplitter
from .tool_parsers import ToolCall, ToolParser, parse_named, parse_required


class ChatOutput:
    """``constrained``: structured output shapes the whole output from its first token (a
    ``response_format``, ``required`` or a named function), so an output that would start as
    reasoning is reasoning only if it closes ``</think>`` (``ThinkSplitter``); ``deepseek_r1``
    read the constrained JSON as reasoning. ``opened``: the prompt ends inside ``<think>`` (Qwen3's thinking models'
    templates), so the output starts as reasoning. ``include_reasoning`` false (vLLM's
    parameter): the reasoning is split off and not sent."""

    __slots__ = ("_think", "_plan", "_parser", "_content", "_sent", "reasoning_seen", "_include_reasoning")

    def __init__(self, reasoning_parser: str | None, plan: ToolPlan | None, parser: ToolParser | None, *,
                 constrained: bool = False, opened: bool = False, include_reasoning: bool = True) -> None:
        self._think = ThinkSplitter(reasoning_parser, constrained=constrained, opened=opened) \
            if reasoning_parser else None
        self._plan = plan if plan is not None and plan.choice != "none" else None
        self._parser = parser
        self._content = ""  # all content so far
        self._sent = 0  # how much of it went out
        self.reasoning_seen = False
        self._include_reasoning = include_reasoning

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, content = self._think.feed(text) if self._think else ("", text)
        return self._reasoning(reasoning), self._content_ready(content)

    def _reasoning(self, reasoning: str) -> str:
        if not self._include_reasoning:
            return ""
        self.reasoning_seen |= bool(reasoning)
        return reasoning

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        reasoning, content = self._think.feed("", final=True) if self._think else ("", "")
        reasoning = self._reasoning(reasoning)
        self._content += content
        calls: list[ToolCall] = []
        rest = self._content
        if self._plan is not None:
            rest, calls = self._calls()
        out = rest[self._sent:] if len(rest) >= self._sent else ""
        self._sent = len(self._content)
        return reasoning, out, calls

    def _content_ready(self, content: str) -> str:
        self._content += content
        if self._plan is None:
            end = len(self._content)
        elif self._plan.choice in ("required", "named") or self._parser is None:
            return ""  # all of it is the calls' JSON
        else:
            at = self._parser.calls_start(self._content)
            end = self._parser.safe_content_end(self._content) if at is None else at
        end = max(end, self._sent)
        out, self._sent = self._content[self._sent:end], end
        return out

    def _calls(self) -> tuple[str, list[ToolCall]]:
        """(content, calls) of the whole output; unparsable calls stay content."""
        text = self._content
        try:
            if self._plan.choice == "required":
                return "", parse_required(text)
            if self._plan.choice == "named":
                return "", parse_named(self._plan.named, text)
        except (ValueError, TypeError):
            return text, []
        if self._parser is None:
            return text, []
        content, calls = self._parser.parse(text)
        if not self._plan.parallel:  # parallel_tool_calls false: the first call alone (as vLLM)
            calls = calls[:1]
        return content, calls
