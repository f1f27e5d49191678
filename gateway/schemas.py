"""JSON Schema, for the OpenAPI document, of the rules the gateway checks in its own code (with its own messages,
in jobs.py, tools.py and structured.py) rather than through pydantic's constraints: the shapes of the free-form
fields (tools, tool_choice, response_format, ...) and the rules between fields."""
from __future__ import annotations

from typing import Any

MAX_CHOICES = 1024  # the scheduler's (scheduler_svc/structured.py; a test holds them equal)


def doc(schema: dict[str, Any], nullable: bool = True) -> dict[str, Any]:
    """A field's JSON Schema in the document, for a rule the gateway checks in its own code (and message)."""
    return {"json_schema_extra": {"anyOf": [schema, {"type": "null"}]} if nullable else schema}


def _either(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [a, b]}


def _unset_or(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """Holds where the field is absent, or present and valid under `schema`."""
    return {"properties": {name: schema}}


def _set(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"required": [name], "properties": {name: schema}}


# Rules between fields that the gateway checks (jobs.py), as JSON Schema.
STREAM_OPTIONS_RULE = _either(_unset_or("stream_options", {"type": "null"}), _set("stream", {"const": True}))
MAX_TOKENS_0_RULE = _either(_unset_or("max_tokens", {"not": {"const": 0}}), _set("echo", {"const": True}))
# prompt_logprobs, not where echo scores the prompt (echo with logprobs, or max_tokens 0)
ECHO_PROMPT_LOGPROBS_RULE = {"anyOf": [
    _unset_or("prompt_logprobs", {"type": "null"}), _unset_or("echo", {"enum": [False, None]}),
    {"allOf": [_unset_or("logprobs", {"type": "null"}), _unset_or("max_tokens", {"not": {"const": 0}})]}]}
TOP_LOGPROBS_RULE = _either(_unset_or("top_logprobs", {"enum": [None, 0]}), _set("logprobs", {"const": True}))
# add_generation_prompt, where given, is the opposite of continue_final_message (jobs.continues)
GENERATION_PROMPT_RULE = {"anyOf": [
    _unset_or("add_generation_prompt", {"type": "null"}),
    {"allOf": [_set("continue_final_message", {"const": True}), _set("add_generation_prompt", {"const": False})]},
    {"allOf": [_unset_or("continue_final_message", {"enum": [False, None]}),
               _set("add_generation_prompt", {"const": True})]}]}
TOOL_CHOICE_RULE = _either(_unset_or("tool_choice", {"enum": [None, "none"]}),
                           _set("tools", {"type": "array", "minItems": 1}))
# a Responses API input holds a message, a call or a call's output: reasoning items alone render no prompt
INPUT_RULE = {"properties": {"input": {"anyOf": [{"type": "string"}, {"type": "array", "contains": {
    "not": {"required": ["type"], "properties": {"type": {"const": "reasoning"}}}}}]}}}
CONTENT_RULE = {"anyOf": [{"properties": {"role": {"const": "assistant"}}},
                          _set("tool_calls", {"type": "array", "minItems": 1}),
                          _set("content", {"type": ["string", "array"]})]}
TOOL_CALL = {"type": "object", "required": ["function"], "properties": {
    "id": {"type": "string"}, "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"}, "arguments": {"type": "string", "description": "a JSON object's text"}}}}}
TOOL = {"type": "object", "required": ["function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "minLength": 1}, "description": {"type": "string"},
        "parameters": {"type": "object", "description": "a JSON schema of the arguments"},
        "strict": {"type": ["boolean", "null"]}}}}}
TOOL_CHOICE = {"anyOf": [{"enum": ["none", "auto", "required"]}, {
    "type": "object", "required": ["function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}]}
RESPONSE_FORMAT = {"anyOf": [
    {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
    {"type": "object", "required": ["type", "json_schema"], "properties": {
        "type": {"const": "json_schema"},
        "json_schema": {"type": "object", "required": ["schema"], "properties": {
            "name": {"type": "string"}, "description": {"type": "string"},
            "schema": {"anyOf": [{"type": "object"}, {"const": True}]},
            "strict": {"type": ["boolean", "null"]}}}}},
    # vLLM's structural tag: free text in which a trigger opens a structure (its begin, JSON under its schema, its end)
    {"type": "object", "required": ["type", "structures", "triggers"], "properties": {
        "type": {"const": "structural_tag"},
        "structures": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["begin", "end"], "properties": {
                "begin": {"type": "string", "minLength": 1}, "end": {"type": "string"},
                "schema": {"anyOf": [{"type": "object"}, {"const": True}]}}}},
        "triggers": {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}}}}]}
CHOICES = {"type": "array", "minItems": 1, "maxItems": MAX_CHOICES, "items": {"type": "string", "minLength": 1}}
STRUCTURED_OUTPUTS = {"type": "object", "maxProperties": 1, "properties": {
    "json": {"anyOf": [{"type": ["object", "boolean"]}, {"type": "string", "minLength": 1}]},
    "regex": {"type": "string", "minLength": 1}, "choice": CHOICES, "grammar": {"type": "string", "minLength": 1},
    "json_object": {"type": "boolean"}, "structural_tag": {"type": "string", "minLength": 1}}}


def response_event_schema() -> dict[str, Any]:
    """One server-sent event of a streamed /v1/responses answer: its event name and, as data, an object of that
    `type` with its sequence number (response.created, response.output_text.delta, ..., response.completed)."""
    data = {"type": "string", "contentMediaType": "application/json", "contentSchema": {
        "type": "object", "required": ["type", "sequence_number"],
        "properties": {"type": {"type": "string"}, "sequence_number": {"type": "integer", "minimum": 0}}}}
    return {"type": "object", "description": "one server-sent event", "required": ["event", "data"],
            "properties": {"event": {"type": "string"}, "data": data}}


def event_schema(chunk: str) -> dict[str, Any]:
    """One server-sent event of a streamed answer: its data is a chunk (the component named `chunk`), an error
    (after the stream's start) or, last, [DONE]."""
    data = {"type": "string", "contentMediaType": "application/json", "contentSchema": {
        "anyOf": [{"$ref": f"#/components/schemas/{chunk}"}, {"$ref": "#/components/schemas/ErrorBody"}]}}
    return {"type": "object", "description": "one server-sent event", "required": ["data"],
            "properties": {"data": {"anyOf": [{"const": "[DONE]"}, data]}}}
