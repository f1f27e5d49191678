"""The gateway against its own OpenAPI document: schemathesis (its Python API, not its pytest plugin) generates
requests for every operation of the live /openapi.json, sends them to a real gateway in front of a real scheduler
over a simulated worker (loopback), and checks each answer: no 5xx, a documented status code and content type, a
body valid under the documented schema.

Two kinds of requests per operation, a fixed number of each, derandomized (the same requests every run):
- positive (valid under the document): besides the checks, one must not be refused (400) unless for a rule that
  the document cannot state in a field's JSON Schema (REFUSALS: the model's vocabulary and length, one field
  against another, the content of a grammar); everything a field's schema can say, the document says.
- negative (violating it): the checks only; the gateway coerces as pydantic's lax mode does (0 for false), so
  an accepted one is not a failure, a 5xx or an undocumented answer is.
The cluster's --max-model-len keeps every generation short; the document's bounds are the gateway's own.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

from tests import sim_cluster
from tests.test_gateway import Gateway

pytestmark = pytest.mark.timeout(300)

EXAMPLES = 40  # per operation and kind
MAX_MODEL_LEN = 128
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
ROUTES = ["GET /health", "GET /version", "GET /metrics", "GET /v1/models", "GET /v1/models/{model_id}",
          "POST /tokenize", "POST /detokenize", "POST /v1/completions", "POST /v1/chat/completions",
          "POST /v1/responses", "POST /v1/embeddings", "POST /v1/score", "POST /v1/rerank", "POST /classify",
          "POST /v1/load_lora_adapter", "POST /v1/unload_lora_adapter", "POST /reset_prefix_cache",
          "POST /update_weights_from_disk",  # 403 here: the scheduler runs without --allow-weight-updates
          "GET /get_weight_version"]
# the GET routes and /reset_prefix_cache take nothing a request could violate
WITH_INPUT = [r for r in ROUTES if r.startswith("POST") and r != "POST /reset_prefix_cache"]
# 400s to valid requests that no field's JSON Schema can foresee: message pattern -> the rule.
REFUSALS = {
    r"max_model_len|this model takes at most": "the prompt's tokens and max_tokens within the model's length",
    r"must lie in \[0, \d+\)": "token ids within the model's vocabulary",
    r"min_tokens \(\d+\) must not exceed max_tokens": "min_tokens at most max_tokens",
    r"cannot be set with structured output": "ignore_eos and min_tokens not with an output constraint",
    r"best_of other than n": "best_of equal to n",
    r"both constrain the output|constrains the output, as does": "one output constraint at most",
    r"does not compile|must be valid JSON|must be a JSON object": "a grammar, regex, JSON schema or arguments text "
                                                                  "that parses",
    r"which is not in tools|two tools are named": "tool_choice naming one of the tools, tools' names distinct",
    r"this model's hidden size": "an embedding's dimensions at most the model's hidden size",
    r"must hold one text for each of text_1's": "a score's text_2 one text for each of text_1's, or text_1 one text",
    r"truncate_prompt_tokens cannot be set with echo": "a truncated prompt not echoed",
    r"--trust-request-chat-template": "a request's own chat_template only where the scheduler trusts them (this "
                                      "one does not)",
    r"is not a sequence classifier": "/classify on a sequence classifier's checkpoint (this one is not)",
    r"with use_beam_search|applies to beam search only": "beam search without sampling, stop strings, logprobs or "
                                                         "constraints, n within 10; length_penalty with it only",
}


@dataclass
class Found:
    """One request whose answer failed a check."""
    failure: str
    curl: str


@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> Iterator[Gateway]:
    root = tmp_path_factory.mktemp("schemathesis")
    model = sim_cluster.config_only_model(root / "model")
    cluster = sim_cluster.start_simulated(model, root / "logs", scheduler_args=["--max-model-len", str(MAX_MODEL_LEN)])
    try:
        g = Gateway(cluster.address, root / "gateway.log", "--tokenizer", str(model), "--workers", "1",
                    "--no-access-log")
        try:
            yield g.wait_healthy()
        finally:
            g.stop()
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def schema(gateway):
    return schemathesis.openapi.from_url(f"{gateway.url}/openapi.json", timeout=30)


def _refusal(status: int, content: bytes) -> str | None:
    """A 400's message unless REFUSALS names its rule; None for an accepted request or a foreseen refusal."""
    if status != 400:
        return None
    try:
        message = json.loads(content)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return content.decode(errors="replace")
    return None if any(re.search(p, message) for p in REFUSALS) else message


def _run(operation, mode: GenerationMode, base_url: str) -> tuple[list[Found], dict[int, int]]:
    found: list[Found] = []
    statuses: dict[int, int] = {}

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), verbosity=hypothesis.Verbosity.quiet)
    @given(operation.as_strategy(generation_mode=mode))
    def send(case) -> None:
        response = case.call(base_url=base_url, timeout=60)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        try:
            case.validate_response(response, checks=CHECKS)
            refused = _refusal(response.status_code, response.content) if mode is GenerationMode.POSITIVE else None
            if refused is not None:
                raise AssertionError(f"a valid request refused: 400 {refused}")
        except (AssertionError, BaseExceptionGroup) as e:  # schemathesis's FailureGroup is a BaseExceptionGroup
            found.append(Found(str(e).strip()[:2000], case.as_curl_command(base_url=base_url)))

    send()
    return found, statuses


def _report(found: list[Found], statuses: dict[int, int]) -> str:
    distinct = {f.failure.splitlines()[0] if f.failure else "": f for f in found}
    return f"{len(found)} failing requests (statuses {statuses}); distinct:\n" + "\n\n".join(
        f"{f.failure}\n  {f.curl[:1500]}" for f in distinct.values())


def test_the_document_lists_every_route(schema):
    labels = sorted(r.ok().label for r in schema.get_all_operations())
    assert labels == sorted(ROUTES)


@pytest.mark.parametrize("route", ROUTES)
def test_valid_requests_are_answered_as_documented(schema, gateway, route):
    operation = schema.find_operation_by_label(route)
    found, statuses = _run(operation, GenerationMode.POSITIVE, gateway.url)
    assert not found, _report(found, statuses)


@pytest.mark.parametrize("route", WITH_INPUT)
def test_invalid_requests_are_answered_as_documented(schema, gateway, route):
    operation = schema.find_operation_by_label(route)
    found, statuses = _run(operation, GenerationMode.NEGATIVE, gateway.url)
    assert not found, _report(found, statuses)
    assert statuses.get(400), statuses  # what the document forbids is refused, in OpenAI's error body


def test_the_served_model_is_answered_as_documented(schema, gateway):
    """The fuzzed model ids are unknown ones (404); the served one, from /v1/models, through the same checks."""
    (card,) = httpx.get(f"{gateway.url}/v1/models", timeout=30).json()["data"]
    operation = schema.find_operation_by_label("GET /v1/models/{model_id}")
    case = operation.Case(path_parameters={"model_id": card["id"]})
    response = case.call(base_url=gateway.url, timeout=30)
    assert response.status_code == 200
    case.validate_response(response, checks=CHECKS)
