"""Tool calling on /v1/chat/completions: what `tools` and `tool_choice` ask of a request, and its calls out of
the model's text.

- "none": the tools are still shown to the model (its chat template renders them); the text stays text.
- "auto" (the default with tools): the model decides; the gateway's tool-call parser (--tool-call-parser,
  gateway/tool_parsers.py) finds the calls it wrote.
- "required": the output is constrained to a JSON array of one or more {"name", "arguments"} objects, each
  valid under its function's parameters schema (one call only where parallel_tool_calls is false).
- a named function: the output is constrained to that function's arguments (its parameters schema).
Constrained output is JSON, not the model's own call syntax: the schema then decides what is valid, as vLLM
does for these two choices.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import invalid
from gateway.tool_parsers import ToolCall, make_parser, new_call_id

MAX_TOOLS = 128


@dataclass(slots=True)
class ToolPlan:
    mode: str                             # none, auto, required or named
    tools: list[dict[str, Any]]           # as the chat template receives them
    structured: dict[str, Any] | None = None  # the constraint of required / named
    name: str | None = None               # the named function
    schemas: dict[str, Any] = field(default_factory=dict)  # function name -> parameters schema

    def calls(self, text: str) -> list[ToolCall]:
        """The calls of a constrained (required / named) output; none where it is not complete JSON (cut by
        max_tokens)."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return []
        if self.mode == "named":
            return [ToolCall(new_call_id(), self.name, json.dumps(value, ensure_ascii=False))]
        return [ToolCall(new_call_id(), c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in value]


def _parameters(tool: dict[str, Any], i: int) -> tuple[str, dict[str, Any]]:
    if tool.get("type", "function") != "function" or not isinstance(tool.get("function"), dict):
        raise invalid(f"tools[{i}]", "a tool is {\"type\": \"function\", \"function\": {\"name\", \"parameters\"}}")
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise invalid(f"tools[{i}].function.name", "a function needs a name")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise invalid(f"tools[{i}].function.parameters", "parameters must be a JSON schema object")
    return name, params


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
               parallel: bool | None) -> ToolPlan | None:
    """None without tools; else the plan, or a 400 naming the field (an unknown function, a choice that needs
    tools it does not have)."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise invalid("tool_choice", "tool_choice needs tools")
        return None
    if len(tools) > MAX_TOOLS:
        raise invalid("tools", f"at most {MAX_TOOLS} tools")
    schemas: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        name, params = _parameters(tool, i)
        if name in schemas:
            raise invalid(f"tools[{i}].function.name", f"two tools are named {name!r}")
        schemas[name] = params
    choice = tool_choice if tool_choice is not None else "auto"
    if choice in ("none", "auto"):
        return ToolPlan(choice, tools, schemas=schemas)
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"const": n}, "arguments": p},
                  "required": ["name", "arguments"], "additionalProperties": False} for n, p in schemas.items()]
        array = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1}
        if parallel is False:
            array["maxItems"] = 1
        return ToolPlan("required", tools, {"json_schema": array}, schemas=schemas)
    if isinstance(choice, dict) and choice.get("type", "function") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or name not in schemas:
            raise invalid("tool_choice", f"tool_choice names function {name!r}, which is not in tools "
                                         f"({', '.join(schemas)})")
        return ToolPlan("named", tools, {"json_schema": schemas[name]}, name, schemas)
    raise invalid("tool_choice", "tool_choice must be none, auto, required or {\"type\": \"function\", "
                                 "\"function\": {\"name\": ...}}")


def call_bodies(calls: list[ToolCall], streamed: bool = False, first: int = 0) -> list[dict[str, Any]]:
    """OpenAI's tool_calls entries (with their index where streamed, from `first`: the calls sent before)."""
    out = []
    for i, c in enumerate(calls):
        body = {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        out.append({"index": first + i, **body} if streamed else body)
    return out


class ToolStream:
    """One streamed choice's text as content and tool-call deltas: a constrained output is held whole and
    turned into its calls at the end; under "auto" the parser lets content through as it comes."""

    def __init__(self, plan: ToolPlan, parser: str):
        self.plan = plan
        self.parser = make_parser(parser, plan.schemas) if plan.mode == "auto" else None
        self.held: list[str] = []
        self.called = 0  # calls emitted so far

    def feed(self, text: str, last: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content to send, tool-call deltas to send) for the next piece of text; `last`: the choice ends."""
        if self.plan.mode == "none":
            return text, []
        if self.parser is None:
            self.held.append(text)
            if not last:
                return "", []
            whole = "".join(self.held)
            calls = self.plan.calls(whole)
            return ("", self._deltas(calls)) if calls else (whole, [])
        events = self.parser.feed(text) + (self.parser.finish() if last else [])
        content = "".join(e.content for e in events if e.content)
        return content, self._deltas([e.call for e in events if e.call is not None])

    def _deltas(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        out = call_bodies(calls, streamed=True, first=self.called)
        self.called += len(calls)
        return out


def with_tool_calls(message: dict[str, Any], finish: str | None, plan: ToolPlan, parser: str
                    ) -> tuple[dict[str, Any], str | None]:
    """A whole answer's message with the calls its content holds, and its finish reason (tool_calls when a
    call ended it)."""
    text = message.get("content") or ""
    if plan.mode == "none":
        return message, finish
    if plan.mode == "auto":
        content, calls = make_parser(parser, plan.schemas).parse(text)
    else:
        content, calls = "", plan.calls(text)
    return with_calls(message, content, calls, finish)


def with_calls(message: dict[str, Any], content: str, calls: list[ToolCall], finish: str | None
               ) -> tuple[dict[str, Any], str | None]:
    """A whole answer's message with the calls read out of it and the content left (None if none), and its finish
    reason (tool_calls when a call ended it); as it was without calls."""
    if not calls:
        return message, finish
    message = dict(message, content=content or None, tool_calls=call_bodies(calls))
    return message, "tool_calls" if finish == "stop" else finish
