"""Tools on the chat route: ``tools``, ``tool_choice``, ``parallel_tool_calls``, read into a
``ToolPlan``.

``tool_choice``: ``none`` (the tools are still shown to the template; nothing is parsed),
``auto`` (the default with tools; the model's own format is parsed with
``--tool-call-parser``, refused by name without one), ``required`` and a named function
(``{"type": "function", "function": {"name": ...}}``). The last two are enforced with
structured output, as vLLM enforces them, so they cannot fail to parse: ``required``
constrains the output to a JSON list of ``{"name", "parameters"}`` (one item unless
``parallel_tool_calls``), each validating against its tool's parameters; a named function
constrains it to that function's arguments.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

from pagefleet.protos import generation_pb2 as pb

from .openai_request import BadParam


@dataclass(slots=True)
class ToolPlan:
    """What the request's tools ask of the output."""

    tools: list[dict[str, Any]] = field(default_factory=list)  # as given, for the chat template
    choice: str = "none"  # none | auto | required | named
    named: str | None = None
    parallel: bool = True

    @property
    def parameters(self) -> dict[str, Any]:
        return {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in self.tools}

    def structured_outputs(self) -> pb.StructuredOutputs | None:
        """The constraint of ``required`` or a named function; None for the others."""
        if self.choice == "named":
            return pb.StructuredOutputs(json=json.dumps(self.parameters[self.named]))
        if self.choice != "required":
            return None
        defs: dict[str, dict[str, Any]] = {}  # each tool's $defs / definitions, lifted to the root
        items = [{"type": "object", "properties": {"name": {"const": name}, "parameters": _lift_defs(params, defs)},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, params in self.parameters.items()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}, **defs}
        if not self.parallel:
            schema["maxItems"] = 1
        return pb.StructuredOutputs(json=json.dumps(schema))


def _lift_defs(params: Any, defs: dict[str, dict[str, Any]]) -> Any:
    """``params`` without its ``$defs`` and ``definitions``, which go into ``defs`` (the combined
    schema's root): a tool's ``{"$ref": "#/$defs/Unit"}`` (Pydantic's schemas, LangChain's
    ``bind_tools``) then resolves inside the list that ``required`` constrains the output to,
    as vLLM lifts them. One name defined two ways by two tools is refused."""
    if not isinstance(params, dict):
        return params
    for key in ("$defs", "definitions"):
        found = params.get(key)
        for name, schema in (found.items() if isinstance(found, dict) else ()):
            known = defs.setdefault(key, {})
            if name in known and known[name] != schema:
                raise BadParam("tools", f"two tools define {key}/{name} differently; tool_choice required "
                                        f"puts every tool's definitions in one schema")
            known[name] = schema
    return {k: v for k, v in params.items() if k not in ("$defs", "definitions")}


def parse_tools(p: dict[str, Any]) -> ToolPlan | None:
    """The body's tool plan; None without tools."""
    tools = p.get("tools") or []
    if not isinstance(tools, list):
        raise BadParam("tools", "tools must be a list of {\"type\": \"function\", \"function\": {...}}")
    plan = ToolPlan(tools=[_tool(i, t) for i, t in enumerate(tools)])
    names = [t["function"]["name"] for t in plan.tools]
    if len(set(names)) != len(names):
        raise BadParam("tools", "tool names must be unique")
    if "parallel_tool_calls" in p:
        if not isinstance(p["parallel_tool_calls"], bool):
            raise BadParam("parallel_tool_calls", "parallel_tool_calls must be true or false")
        plan.parallel = p["parallel_tool_calls"]
    choice = p.get("tool_choice", "auto" if plan.tools else "none")
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadParam("tool_choice", "a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}")
        if fn["name"] not in names:
            raise BadParam("tool_choice", f"tool_choice names {fn['name']!r}, which is not in tools")
        plan.choice, plan.named = "named", fn["name"]
    elif choice in ("none", "auto", "required"):
        plan.choice = choice
        if choice != "none" and not plan.tools:
            raise BadParam("tool_choice", f"tool_choice {choice!r} needs tools")
    else:
        raise BadParam("tool_choice", "tool_choice must be none, auto, required or a named function")
    return plan if plan.tools else None


def _tool(i: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise BadParam(where, "each tool must be {\"type\": \"function\", \"function\": {...}}")
    fn = tool["function"]
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise BadParam(f"{where}.function.name", "a function needs a name")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise BadParam(f"{where}.function.parameters", "parameters must be a JSON schema object")
    return tool


def template_tool_calls(where: str, calls: Any) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as chat templates read them: ``arguments`` as an
    object when it is JSON text (as vLLM hands them to templates)."""
    if not isinstance(calls, list):
        raise BadParam(where, "tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadParam(f"{where}[{j}]", "a tool call is {\"id\", \"type\": \"function\", \"function\": "
                                            "{\"name\", \"arguments\"}}")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            with contextlib.suppress(ValueError):  # not JSON: the template gets the text
                args = json.loads(args)
        out.append({**call, "function": {**fn, "arguments": args}})
    return out
