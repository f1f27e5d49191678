"""The output constraint of an OpenAI request, from whichever field names it: OpenAI's `response_format`
(json_object, json_schema; vLLM's structural_tag), vLLM's `structured_outputs` (json, regex, choice, grammar,
json_object, structural_tag) and its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. At
most one may be given; the scheduler compiles it (scheduler_svc/structured.py) and names what does not."""
from __future__ import annotations

import json
from typing import Any

from gateway.errors import invalid

# vLLM's structured_outputs keys -> the gRPC StructuredOutput kinds
_STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                       "json_object": "json_object", "structural_tag": "structural_tag"}
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def _response_format(fmt: dict[str, Any]) -> dict[str, Any] | None:
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, bool)):
            raise invalid("response_format.json_schema.schema", "a json_schema response_format needs "
                                                                "json_schema.schema, a JSON schema object")
        return {"json_schema": schema}
    if kind == "structural_tag":  # vLLM's: the scheduler checks the structures and triggers
        return {"structural_tag": json.dumps({k: fmt.get(k) for k in ("structures", "triggers")})}
    raise invalid("response_format", "response_format type must be text, json_object, json_schema or structural_tag, "
                                     f"got {kind!r}")


def _structured_outputs(spec: dict[str, Any]) -> dict[str, Any] | None:
    given = {k: v for k, v in spec.items() if k in _STRUCTURED_OUTPUTS and v not in (None, False)}
    if len(given) > 1:
        raise invalid("structured_outputs", f"structured_outputs takes one of {', '.join(_STRUCTURED_OUTPUTS)}, "
                                            f"got {', '.join(sorted(given))}")
    if not given:
        return None
    (key, value), = given.items()
    return {_STRUCTURED_OUTPUTS[key]: value}


def structured_of(body: Any) -> tuple[str, dict[str, Any]] | None:
    """(the request field it came from, the client's `structured` argument), or None for free output; 400
    naming the field for a malformed one or for two at once."""
    found: list[tuple[str, dict[str, Any]]] = []
    fmt = getattr(body, "response_format", None)
    if fmt and (spec := _response_format(fmt)) is not None:
        found.append(("response_format", spec))
    outputs = getattr(body, "structured_outputs", None)
    if outputs and (spec := _structured_outputs(outputs)) is not None:
        found.append(("structured_outputs", spec))
    for name, kind in _GUIDED.items():
        value = getattr(body, name, None)
        if value is not None:
            found.append((name, {kind: value}))
    if len(found) > 1:
        raise invalid(found[1][0], f"{found[0][0]} and {found[1][0]} both constrain the output; give one")
    if not found:
        return None
    name, spec = found[0]
    (kind, value), = spec.items()
    if kind == "choice" and not (isinstance(value, list) and all(isinstance(c, str) for c in value)):
        raise invalid(name, "a choice constraint is a list of strings")
    if kind in ("regex", "grammar", "structural_tag") and not isinstance(value, str):
        raise invalid(name, f"a {kind} constraint is a string")
    if kind == "json_schema" and isinstance(value, bool):
        # JSON Schema's boolean schemas, which llguidance does not take: true admits any JSON value, as {} does.
        if not value:
            raise invalid(name, "the JSON schema false admits no output")
        return name, {"json_schema": {}}
    return found[0]
