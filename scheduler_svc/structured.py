"""Structured outputs: a request's constraint (JSON schema, any JSON object, regex, choice, context-free grammar,
structural tag) compiled into one llguidance grammar, checked here at the edge and sent to the worker once with the
sequence. For a reasoning model the constraint may start after its thinking, which stays free (vLLM's structured
outputs with a reasoning parser).

The worker holds a matcher per sequence and masks the logits of each step it samples (worker_svc/runtime/
grammar.py): it has every sampled token first, while the scheduler learns one only a pipeline depth later, so
masks made here would stall each constrained row by that depth or cross the wire as ~19 KB per row per step.
llguidance rather than xgrammar: it needs no torch (the scheduler never imports it) and builds masks lazily
from the grammar, with no compile step to cache or bound (validation of a large schema takes about a ms).
"""
from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable

import llguidance

from protos import splitserve_pb2 as api

MAX_SPEC_BYTES = 256 << 10  # a schema, regex or grammar; larger ones are refused before compiling
MAX_CHOICES = 1024
# JSON as its compact canonical form: no free whitespace between tokens, which a model may otherwise
# emit without end (every whitespace token stays allowed).
_JSON_OPTIONS = {"whitespace_flexible": False}


class InvalidStructured(ValueError):
    """A constraint that does not compile: `field` names it (structured.json_schema, ...), `detail` why."""

    def __init__(self, field: str, detail: str):
        super().__init__(f"{field} {detail}")
        self.field, self.detail = field, detail


# The free thinking before a reasoning model's constrained answer (StructuredOutput.reasoning), in llguidance's Lark:
# a lazy lexeme ends at the first </think>; up to 4 spaces or newlines may follow it (a model writes two newlines
# there; unbounded, a random one may write nothing else).
_THINKING = {
    "qwen3": 'start: (think SEP)? @constraint\nthink[lazy]: /<think>(?s:.*)<\\/think>/\nSEP: /[ \\n]{0,4}/',
    "deepseek_r1": 'start: think SEP @constraint\nthink[lazy]: /(?s:.*)<\\/think>/\nSEP: /[ \\n]{0,4}/',
    # gpt-oss's harmony messages (gateway/harmony.py): an optional analysis message, then the final one's text
    "openai_gptoss": 'start: (<|channel|> "analysis" <|message|> ANALYSIS <|end|> <|start|> "assistant")? '
                     '<|channel|> "final" <|message|> @constraint\nANALYSIS: /(?s:.*)/',
}


def thinking_tokens(reasoning: str) -> list[str]:
    """The special tokens the thinking grammar of `reasoning` names (Lark's `<|...|>`), which the model's tokenizer
    must have as special tokens."""
    return sorted(set(re.findall(r"<\|\w+\|>", _THINKING.get(reasoning, ""))))


def grammar_of(structured: api.StructuredOutput, is_special: Callable[[str], bool] = lambda token: False) -> str:
    """The llguidance grammar of a public StructuredOutput, or InvalidStructured naming its field. is_special: whether
    the model's tokenizer has a text as a special token (a structural tag's trigger)."""
    kind = structured.WhichOneof("kind")
    if kind is None:
        raise InvalidStructured("structured", "must set one of json_schema, json_object, regex, choice, grammar, "
                                              "structural_tag")
    if kind == "json_object":
        if not structured.json_object:
            raise InvalidStructured("structured.json_object", "must be true when it is the constraint")
        grammar = compile_grammar("json_schema", '{"type": "object"}')
    elif kind == "choice":
        choices = list(structured.choice.choices)
        if not 1 <= len(choices) <= MAX_CHOICES or not all(choices):
            raise InvalidStructured("structured.choice.choices", f"must hold 1 to {MAX_CHOICES} non-empty strings")
        grammar = compile_grammar("choice", json.dumps(choices))
    elif kind == "structural_tag":
        grammar = structural_tag_grammar(structured.structural_tag, is_special)
    else:
        grammar = compile_grammar(kind, getattr(structured, kind))
    return after_thinking(grammar, structured.reasoning) if structured.reasoning else grammar


@functools.lru_cache(maxsize=256)
def after_thinking(grammar: str, reasoning: str) -> str:
    """`grammar` applied after a reasoning model's free thinking (_THINKING[reasoning]): a grammar of two, the
    thinking's Lark and the constraint by name."""
    if reasoning not in _THINKING:
        raise InvalidStructured("structured.reasoning",
                                f"must be one of {', '.join(_THINKING)}, got {reasoning[:32]!r}")
    inner = json.loads(grammar) if grammar.lstrip().startswith("{") else {"grammars": [{"lark_grammar": grammar}]}
    constraint = [dict(inner["grammars"][0], name="constraint"), *inner["grammars"][1:]]
    wrapped = json.dumps({"grammars": [{"name": "thinking", "lark_grammar": _THINKING[reasoning]}, *constraint]})
    error = llguidance.LLMatcher.validate_grammar(wrapped)
    if error:
        raise InvalidStructured("structured", f"does not compile after thinking: {error.strip()}")
    return wrapped


def structural_tag_grammar(spec: str, is_special: Callable[[str], bool]) -> str:
    """vLLM's structural tag (StructuredOutput.structural_tag) as llguidance's StructTag grammar: free text, each
    structure's JSON (compact, as json_schema's) between its begin and end once its trigger appears."""
    field = "structured.structural_tag"
    if len(spec.encode()) > MAX_SPEC_BYTES:
        raise InvalidStructured(field, f"must be at most {MAX_SPEC_BYTES} bytes")
    try:
        tag = json.loads(spec)
    except json.JSONDecodeError as e:
        raise InvalidStructured(field, f"must be valid JSON: {e}") from None
    triggers = tag.get("triggers") if isinstance(tag, dict) else None
    if not (isinstance(triggers, list) and triggers and all(isinstance(t, str) and t for t in triggers)):
        raise InvalidStructured(f"{field}.triggers", "must be a list of one or more non-empty strings")
    tagged = {t for t in triggers if t.startswith("<") and t.endswith(">")}
    special = {t for t in tagged if is_special(t)}
    if special and special != tagged:
        raise InvalidStructured(f"{field}.triggers", f"does not compile: {sorted(special)[0]} is a special token of "
                                f"this model's tokenizer and {sorted(tagged - special)[0]} is not: give either kind")
    return _structural_tag_grammar(spec, bool(special))


@functools.lru_cache(maxsize=256)
def _structural_tag_grammar(spec: str, assume_special: bool) -> str:
    field = "structured.structural_tag"
    tag = json.loads(spec)
    triggers, structures = tag["triggers"], tag.get("structures")
    if not (isinstance(structures, list) and structures):
        raise InvalidStructured(f"{field}.structures", "must be a list of one or more structures")
    tags = []
    for i, s in enumerate(structures):
        where = f"{field}.structures[{i}]"
        if not (isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)):
            raise InvalidStructured(where, "must be an object with begin and end strings and a schema")
        schema = s.get("schema", {})
        if schema is True:  # JSON Schema's boolean true: any value
            schema = {}
        if not isinstance(schema, dict):
            raise InvalidStructured(f"{where}.schema", "must be a JSON object (a schema)")
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise InvalidStructured(f"{where}.begin", "does not compile: it starts with none of the triggers")
        tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"], end=s["end"],
                                         grammar={**schema, "x-guidance": _JSON_OPTIONS}))
    grammar = llguidance.StructTag.to_grammar(tags, assume_special=assume_special)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidStructured(field, f"does not compile: {error.strip()}")
    return grammar


@functools.lru_cache(maxsize=256)
def compile_grammar(kind: str, spec: str) -> str:
    """kind: json_schema, choice (a JSON list), regex or grammar (Lark or GBNF). The same spec twice compiles
    once (the cache), and an invalid one raises InvalidStructured every time (exceptions are not cached, but
    refusing is as cheap as compiling)."""
    field = f"structured.{kind}"
    if len(spec.encode()) > MAX_SPEC_BYTES:
        raise InvalidStructured(field, f"must be at most {MAX_SPEC_BYTES} bytes")
    if not spec.strip():
        raise InvalidStructured(field, "must not be empty")
    try:
        if kind == "json_schema":
            schema = json.loads(spec)
            if not isinstance(schema, (dict, bool)):
                raise InvalidStructured(field, "must be a JSON object (a schema)")
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
        else:
            grammar = llguidance.grammar_from(kind, spec)
    except json.JSONDecodeError as e:
        raise InvalidStructured(field, f"must be valid JSON: {e}") from None
    except ValueError as e:
        raise InvalidStructured(field, f"does not compile: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidStructured(field, f"does not compile: {error.strip()}")
    return grammar
