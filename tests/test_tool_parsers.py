"""Tool-call and reasoning parsers, without a cluster: each format read as vLLM reads it, and
a stream cut anywhere joins to what the whole output gives."""

from __future__ import annotations

import json
import re

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
        ("llama3_json", ' \n{"name": "a", "parameters": {}}', "", [("a", {})]),  # whitespace is no content
        ("mistral", 'ok [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}]', "ok ",
         [("get_weather", {"city": "Rome"})]),
        ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Lima"}', "", [("get_weather", {"city": "Lima"})]),
    ],
)
def test_formats_parse_as_vllm_reads_them(parser, text, content, calls):
    got_content, got = tool_parser(parser).parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    if parser == "mistral":  # its template refuses other ids when the calls come back
        assert all(re.fullmatch("[A-Za-z0-9]{9}", c.id) for c in got)
    else:
        assert all(c.id.startswith("call_") for c in got)


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("text", ["<think>step one</think>the answer", "no thinking at all", "<think>cut sho",
                                  "<thi", "plain </think> after", "<think></think>", '[{"a": 1}]'])
@pytest.mark.parametrize(("constrained", "opened"), [(False, False), (True, False), (False, True), (True, True)])
def test_reasoning_streamed_anyhow_joins_to_the_whole(parser, text, constrained, opened):
    whole_r, whole_c = split_reasoning(parser, text, constrained, opened)
    for cut in range(len(text) + 1):
        for step in (1, 3):
            s = ThinkSplitter(parser, constrained, opened)
            pieces = [s.feed(text[:cut])] + [s.feed(text[i:i + step]) for i in range(cut, len(text), step)]
            pieces.append(s.feed("", final=True))
            assert "".join(r for r, _ in pieces) == (whole_r or "")
            assert "".join(c for _, c in pieces) == whole_c


def test_reasoning_parsers_split_as_vllm():
    assert split_reasoning("qwen3", "<think>a</think>b") == ("a", "b")
    assert split_reasoning("qwen3", "just b") == (None, "just b")
    assert split_reasoning("deepseek_r1", "a</think>b") == ("a", "b")
    assert split_reasoning("deepseek_r1", "all thinking") == ("all thinking", "")
    # A thinking model's template opens <think> in the prompt: its output only closes it.
    assert split_reasoning("qwen3", "pondering it</think>the answer", opened=True) == ("pondering it", "the answer")
    assert split_reasoning("qwen3", "no think", opened=True) == ("no think", "")


def test_constrained_output_is_reasoning_only_where_it_closes_a_think():
    """Structured output shapes the output from its first token: deepseek_r1 must not take the
    constrained JSON for reasoning, and still splits an output that closes </think>."""
    assert split_reasoning("deepseek_r1", '{"a": 1}', constrained=True) == (None, '{"a": 1}')
    assert split_reasoning("deepseek_r1", "hm</think>{}", constrained=True) == ("hm", "{}")
    assert split_reasoning("deepseek_r1", "<think>hm</think>{}", constrained=True) == ("hm", "{}")
    assert split_reasoning("qwen3", "[1]", constrained=True, opened=True) == (None, "[1]")
    required = ToolPlan([WEATHER], "required")
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    for step in (1, 5, len(text)):
        out = ChatOutput("deepseek_r1", required, None, constrained=True)
        pieces = [out.feed(text[i:i + step]) for i in range(0, len(text), step)]
        reasoning, rest, calls = out.finish()
        assert "".join(r for r, _ in pieces) + reasoning == "" and not out.reasoning_seen
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_include_reasoning_false_leaves_the_reasoning_out():
    out = ChatOutput("qwen3", None, None, include_reasoning=False)
    assert out.feed("<think>secret</think>the answer") == ("", "the answer")
    assert out.finish() == ("", "", []) and not out.reasoning_seen


def test_parallel_tool_calls_false_keeps_the_first_call_of_auto():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    for parallel, names in ((True, ["a", "b"]), (False, ["a"])):
        out = ChatOutput(None, ToolPlan([WEATHER], "auto", parallel=parallel), tool_parser("hermes"))
        out.feed(text)
        assert [c.name for c in out.finish()[2]] == names


def test_a_named_call_cut_short_is_still_the_named_call():
    """As vLLM answers a named tool_choice: the arguments are the output, whole or cut by max_tokens."""
    out = ChatOutput(None, ToolPlan([WEATHER], "named", named="get_weather"), None, constrained=True)
    assert out.feed('{"ci') == ("", "")
    _, content, calls = out.finish()
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"ci')]


def test_required_lifts_each_tools_defs_to_the_root():
    """Pydantic's schemas (LangChain's bind_tools) keep nested models under $defs: inside the
    list that required constrains to, their $refs must still resolve."""
    import jsonschema

    from pagefleet.common import grammar
    from pagefleet.common.sampling_proto import structured_from_proto
    from pagefleet.gateway.openai_request import BadParam

    unit = {"type": "string", "enum": ["c", "f"]}
    tool = {"type": "function", "function": {"name": "w", "parameters": {
        "type": "object", "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "required": ["unit"],
        "$defs": {"Unit": unit}}}}
    other = {"type": "function", "function": {"name": "v", "parameters": {
        "type": "object", "properties": {"u": {"$ref": "#/$defs/Unit"}}, "$defs": {"Unit": unit}}}}
    so = ToolPlan([tool, other], "required").structured_outputs()
    grammar.check(structured_from_proto(so))  # compiles as the door checks it (it did not: $ref unresolved)
    schema = json.loads(so.json)
    assert schema["$defs"] == {"Unit": unit}
    jsonschema.validate([{"name": "w", "parameters": {"unit": "c"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "w", "parameters": {"unit": "k"}}], schema)
    clash = {"type": "function", "function": {"name": "x", "parameters": {"$defs": {"Unit": {"type": "integer"}}}}}
    with pytest.raises(BadParam, match="Unit"):
        ToolPlan([tool, clash], "required").structured_outputs()


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


@pytest.mark.parametrize("name", ["hermes", "qwen", "llama3_json", "mistral"])
def test_auto_tool_choice_keeps_the_special_tokens_a_format_marks_calls_with(name):
    """Hermes-2-Pro's ``<tool_call>`` is a special token of its vocabulary: decoded with special
    tokens skipped (the default) the marker vanished and its calls came back as plain content.
    As vLLM's parsers do, ``auto`` keeps special tokens for every format whose markers may be
    one, unless the request says otherwise."""
    from pagefleet.gateway.openai_door import OpenAIDoor
    from pagefleet.gateway.openai_request import parse_chat

    parser = tool_parser(name)
    door = OpenAIDoor.__new__(OpenAIDoor)
    door.tool_call_parser = name
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    req = parse_chat(body)
    door._plan_tools(req)
    assert req.sampling.HasField("skip_special_tokens") and not req.sampling.skip_special_tokens
    assert parser.needs_special_tokens
    said = parse_chat({**body, "skip_special_tokens": True})
    door._plan_tools(said)
    assert said.sampling.skip_special_tokens  # the client's own choice stands
