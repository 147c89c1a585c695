"""Tool-call and reasoning parsers, without a cluster: each format read as vLLM reads it, and
a stream cut anywhere joins to what the whole output gives."""

from __future__ import annotations

import json

import pytest

from pagefleet.gateway.chat_output import ChatOutput
from pagefleet.gateway.openai_tools import ToolPlan
from pagefleet.gateway.reasoning import ThinkSplitter, split_reasoning
from pagefleet.gateway.tool_parsers import parse_required, tool_parser

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [
        ("hermes", 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
         "Sure.", [("get_weather", {"city": "Paris"})]),
        ("qwen", '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": '
                 '{"x": 1}}</tool_call>', "", [("a", {}), ("b", {"x": 1})]),
        ("hermes", '<tool_call>{"name": "a", "arguments": {"x": 1}}', "", [("a", {"x": 1})]),  # cut before its end
        ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
        ("hermes", "no calls here", "no calls here", []),
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', "",
         [("get_weather", {"city": "Oslo"})]),
        ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"y": 2}}', "",
         [("a", {}), ("b", {"y": 2})]),
        ("llama3_json", "Hello {not a call}", "Hello {not a call}", []),
        ("mistral", 'ok [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}]', "ok ",
         [("get_weather", {"city": "Rome"})]),
        ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Lima"}', "", [("get_weather", {"city": "Lima"})]),
    ],
)
def test_formats_parse_as_vllm_reads_them(parser, text, content, calls):
    got_content, got = tool_parser(parser).parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert all(c.id.startswith("call_") for c in got)


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("text", ["<think>step one</think>the answer", "no thinking at all", "<think>cut sho",
                                  "<thi", "plain </think> after", "<think></think>"])
def test_reasoning_streamed_anyhow_joins_to_the_whole(parser, text):
    whole_r, whole_c = split_reasoning(parser, text)
    for cut in range(len(text) + 1):
        for step in (1, 3):
            s = ThinkSplitter(parser)
            pieces = [s.feed(text[:cut])] + [s.feed(text[i:i + step]) for i in range(cut, len(text), step)]
            pieces.append(s.feed("", final=True))
            assert "".join(r for r, _ in pieces) == (whole_r or "")
            assert "".join(c for _, c in pieces) == whole_c


def test_reasoning_parsers_split_as_vllm():
    assert split_reasoning("qwen3", "<think>a</think>b") == ("a", "b")
    assert split_reasoning("qwen3", "just b") == (None, "just b")
    assert split_reasoning("deepseek_r1", "a</think>b") == ("a", "b")
    assert split_reasoning("deepseek_r1", "all thinking") == ("all thinking", "")


def test_chat_output_holds_calls_back_and_streams_content():
    text = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    for step in (1, 2, 7):
        out = ChatOutput("qwen3", ToolPlan([WEATHER], "auto"), tool_parser("hermes"))
        content = "".join(out.feed(text[i:i + step])[1] for i in range(0, len(text), step))
        assert "<" not in content  # nothing of the call leaked as content
        _, rest, calls = out.finish()
        assert content + rest == "Let me check. "
        assert [c.name for c in calls] == ["get_weather"] and json.loads(calls[0].arguments) == {"city": "Paris"}


def test_required_plan_constrains_to_a_list_of_known_calls():
    import jsonschema

    plan = ToolPlan([WEATHER], "required", parallel=False)
    schema = json.loads(plan.structured_outputs().json)
    good = [{"name": "get_weather", "parameters": {"city": "Paris"}}]
    jsonschema.validate(good, schema)
    for bad in ([], good * 2, [{"name": "other", "parameters": {}}], [{"name": "get_weather", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert [c.name for c in parse_required(json.dumps(good))] == ["get_weather"]
