"""Structured outputs and tool calling through the gateway, driven by the official `openai` package against real
processes (a scheduler over one CPU worker serving qwen3-tiny, random weights): only the constraint can make its
outputs valid, so valid ones prove it. Hermes-style calls under tool_choice "auto" are forced with a choice
constraint (the parser is tested on text, not on luck); the parser itself: tests/test_tool_parsers.py."""
from __future__ import annotations

import json
import re
from enum import Enum

import httpx
import jsonschema
import pytest
import transformers
from pydantic import BaseModel, ConfigDict, Field

from client import Client
from client.launcher import LocalCluster
from tests.test_gateway import Gateway

pytestmark = pytest.mark.timeout(300)

WORKER_ARGS = ["--num-blocks", "256", "--block-size", "16", "--max-num-seqs", "32", "--max-num-batched-tokens", "512"]
MESSAGES = [{"role": "user", "content": "Describe the item."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                    "unit": {"enum": ["C", "F"]}},
               "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}},
                                       "required": ["utc"], "additionalProperties": False}}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>'
TWO_CALLS = 'Let me check.\n' + CALL_TEXT + '\n<tool_call>\n{"name": "get_time", "arguments": {"utc": true}}\n</tool_call>'


class Colour(str, Enum):
    red = "red"
    green = "green"


class Part(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a schema that allows more keys lets a random model write them
    size: int = Field(ge=1, le=99)
    spare: bool


class Item(BaseModel):
    model_config = ConfigDict(extra="forbid")
    colour: Colour
    count: int = Field(ge=0, le=500)
    parts: list[Part] = Field(min_length=1, max_length=2)
    inner: Part


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    c = LocalCluster(tiny_model_dir, worker_args=WORKER_ARGS, log_dir=tmp_path_factory.mktemp("gws-cluster"))
    c.start(timeout=240)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def gateway(cluster, tiny_model_dir, tmp_path_factory):
    g = Gateway(cluster.address, tmp_path_factory.mktemp("gws") / "gateway.log", "--tokenizer", str(tiny_model_dir))
    g.wait_healthy()
    yield g
    g.stop()


@pytest.fixture(scope="module")
def oai(gateway):
    return gateway.openai()


def test_parse_with_a_pydantic_model_returns_the_object_for_every_seed(oai):
    for seed in range(8):
        completion = oai.chat.completions.parse(model="model", messages=MESSAGES, response_format=Item, temperature=0.8,
                                                seed=seed, max_tokens=200)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Item), choice.message.content


def test_a_streamed_json_schema_answer_concatenates_to_valid_json(oai):
    schema = Item.model_json_schema()
    stream = oai.chat.completions.create(
        model="model", messages=MESSAGES, temperature=0.7, seed=3, max_tokens=200, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "item", "schema": schema, "strict": True}})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3  # it streamed
    Item.model_validate(json.loads(text))


def test_json_object_is_an_object_on_chat_and_completions(oai, tiny_model_dir):
    # A random model almost never closes a free key (a quote among ~150k tokens); `}` made likely by a bias
    # closes the object at once, and only the constraint keeps the bias from writing `}}}}`.
    close = transformers.AutoTokenizer.from_pretrained(tiny_model_dir).convert_tokens_to_ids("}")
    chat = oai.chat.completions.create(model="model", messages=MESSAGES, response_format={"type": "json_object"},
                                       logit_bias={str(close): 100}, max_tokens=20, temperature=0.5, seed=1)
    assert json.loads(chat.choices[0].message.content) == {}
    text = oai.completions.create(model="model", prompt="JSON:", max_tokens=20, logit_bias={str(close): 100},
                                  temperature=0.5, seed=1,
                                  extra_body={"response_format": {"type": "json_object"}}).choices[0].text
    assert json.loads(text) == {}


def test_a_structural_tag_as_response_format_and_as_structured_outputs(oai, tiny_model_dir):
    """vLLM's structural tag, either way: the text is free, and each call the model opens (a bias on <tool_call>) is
    the structure, its arguments valid under the schema."""
    schema = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Bergen"]}}, "required": ["city"],
              "additionalProperties": False}
    tag = {"structures": [{"begin": '<tool_call>{"name": "get_weather", "arguments": ', "schema": schema,
                           "end": "}</tool_call>"}], "triggers": ["<tool_call>"]}
    trigger = transformers.AutoTokenizer.from_pretrained(tiny_model_dir).convert_tokens_to_ids("<tool_call>")
    for extra in ({"response_format": {"type": "structural_tag", **tag}},
                  {"structured_outputs": {"structural_tag": json.dumps(tag)}}):
        text = oai.completions.create(model="model", prompt="Weather?", max_tokens=100, temperature=0.8, seed=3,
                                      logit_bias={str(trigger): 30}, extra_body=extra).choices[0].text
        calls = re.findall(r'<tool_call>\{"name": "get_weather", "arguments": (.*?)\}</tool_call>', text)
        assert calls and text.count("<tool_call>") - len(calls) <= 1, text
        for arguments in calls:
            jsonschema.validate(json.loads(arguments), schema)


def test_with_a_reasoning_parser_the_constraint_follows_the_thinking(cluster, tiny_model_dir, tmp_path_factory):
    """--reasoning-parser deepseek_r1: a chat answer thinks first, free (cut short here by a bias on </think>), then
    its content is valid under the response_format, whole and streamed; a completion is constrained from its start."""
    from tokenizers import Tokenizer

    end = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).token_to_id("</think>")
    g = Gateway(cluster.address, tmp_path_factory.mktemp("gws-r1") / "gateway.log", "--reasoning-parser",
                "deepseek_r1", "--workers", "1")
    try:
        client = g.wait_healthy().openai()
        kwargs = dict(model="model", messages=MESSAGES, max_tokens=300, temperature=0.8, logit_bias={str(end): 30},
                      response_format={"type": "json_schema", "json_schema": {"name": "item",
                                                                              "schema": Item.model_json_schema()}})
        for seed in range(2):
            whole = client.chat.completions.create(seed=seed, **kwargs).choices[0]
            assert whole.finish_reason == "stop" and whole.message.model_extra.get("reasoning_content") is not None
            Item.model_validate_json(whole.message.content)
            chunks = [c.choices[0] for c in client.chat.completions.create(seed=seed, stream=True, **kwargs)
                      if c.choices]
            assert Item.model_validate_json("".join(c.delta.content or "" for c in chunks)) == \
                Item.model_validate_json(whole.message.content)
        text = client.completions.create(model="model", prompt="Item:", max_tokens=300, temperature=0.8, seed=0,
                                         extra_body={"structured_outputs": {"json": Item.model_json_schema()}})
        Item.model_validate_json(text.choices[0].text)
    finally:
        g.stop()


def test_vllm_structured_outputs_and_guided_fields_constrain_completions(oai):
    for body, check in [({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, r"[0-9]{3}-[a-z]{2}"),
                        ({"guided_regex": "(ab)+c"}, r"(ab)+c"),
                        ({"guided_choice": ["left", "right"]}, r"left|right"),
                        ({"structured_outputs": {"choice": ["up", "down"]}}, r"up|down")]:
        out = oai.completions.create(model="model", prompt="Answer:", max_tokens=30, temperature=0.9, seed=2,
                                     extra_body=body).choices[0]
        assert out.finish_reason == "stop" and re.fullmatch(check, out.text), (body, out.text)


def test_tool_choice_required_and_named_give_schema_valid_arguments(oai):
    # One call per answer: a random model rarely ends an unbounded array of calls within max_tokens.
    for seed in range(6):
        required = oai.chat.completions.create(model="model", messages=MESSAGES, tools=[WEATHER, CLOCK],
                                               tool_choice="required", parallel_tool_calls=False, temperature=0.8,
                                               seed=seed, max_tokens=120)
        choice = required.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice.message
        for call in choice.message.tool_calls:
            fn = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]["function"]
            jsonschema.validate(json.loads(call.function.arguments), fn["parameters"])
            assert call.id.startswith("call_") and call.type == "function"
        named = oai.chat.completions.create(
            model="model", messages=MESSAGES, tools=[WEATHER, CLOCK], temperature=0.8, seed=seed, max_tokens=60,
            tool_choice={"type": "function", "function": {"name": "get_time"}})
        choice = named.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), CLOCK["function"]["parameters"])


def test_required_without_parallel_calls_makes_one_call_and_streams_it(oai):
    stream = oai.chat.completions.create(model="model", messages=MESSAGES, tools=[WEATHER, CLOCK], tool_choice="required",
                                         parallel_tool_calls=False, temperature=0.8, seed=4, max_tokens=80,
                                         stream=True)
    chunks = [c for c in stream if c.choices]
    calls = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or ()]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name in ("get_weather", "get_time")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_parses_the_models_hermes_call_whole_and_streamed(oai):
    force = {"structured_outputs": {"choice": [CALL_TEXT]}}
    whole = oai.chat.completions.create(model="model", messages=MESSAGES, tools=[WEATHER], max_tokens=80,
                                        extra_body=force).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo", "unit": "C"}
    chunks = [c for c in oai.chat.completions.create(model="model", messages=MESSAGES, tools=[WEATHER], max_tokens=80,
                                                     stream=True, extra_body=force) if c.choices]
    streamed = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or ()]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in streamed] == [
        ("get_weather", {"city": "Oslo", "unit": "C"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks).strip()
    free = oai.chat.completions.create(model="model", messages=MESSAGES, tools=[WEATHER], tool_choice="none",
                                       max_tokens=80, extra_body=force).choices[0]
    assert free.finish_reason == "stop" and free.message.content == CALL_TEXT and not free.message.tool_calls


def test_tool_messages_render_as_transformers_renders_them(cluster, tiny_model_dir):
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"}]
    hf = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    hf_messages = [dict(m, tool_calls=[{**c, "function": {**c["function"], "arguments": json.loads(
        c["function"]["arguments"])}} for c in m["tool_calls"]]) if m.get("tool_calls") else m for m in messages]
    expected = list(hf.apply_chat_template(hf_messages, tools=[WEATHER, CLOCK], add_generation_prompt=True,
                                           tokenize=True, return_dict=False))
    with Client(cluster.address, timeout=60) as c:
        assert c.tokenize(messages=messages, tools=[WEATHER, CLOCK]) == expected


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ({"response_format": {"type": "structural_tag", "structures": [{"begin": "<b>", "end": ""}], "triggers": ["<a"]}},
     "response_format"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
])
def test_constraints_that_cannot_work_are_400_naming_the_field(gateway, body, param):
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json={"model": "model", "messages": MESSAGES, "max_tokens": 4,
                                                                 **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_parallel_calls_come_back_in_order_with_the_content_before_them(oai):
    force = {"structured_outputs": {"choice": [TWO_CALLS]}}
    whole = oai.chat.completions.create(model="model", messages=MESSAGES, tools=[WEATHER, CLOCK], max_tokens=120,
                                        extra_body=force).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == [
        ("get_weather", {"city": "Oslo", "unit": "C"}), ("get_time", {"utc": True})]
    assert len({c.id for c in whole.message.tool_calls}) == 2
    chunks = [c for c in oai.chat.completions.create(model="model", messages=MESSAGES, tools=[WEATHER, CLOCK],
                                                     max_tokens=120, stream=True, extra_body=force) if c.choices]
    streamed = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or ()]
    assert [(t.index, t.function.name) for t in streamed] == [(0, "get_weather"), (1, "get_time")]
    assert "".join(c.choices[0].delta.content or "" for c in chunks).strip() == "Let me check."


@pytest.mark.parametrize("path,field", [("/v1/chat/completions", "mm_processor_kwargs"),
                                        ("/v1/chat/completions", "documents"),
                                        ("/v1/chat/completions", "web_search_options"),
                                        ("/v1/completions", "best_of_n_made_up")])
def test_a_field_the_gateway_does_not_implement_is_400_naming_it(gateway, path, field):
    body = {"model": "model", "max_tokens": 2, **({"messages": MESSAGES} if "chat" in path else {"prompt": "x"})}
    if "." in field:
        body["chat_template_kwargs"] = {field.split(".")[1]: True}
    else:
        body[field] = True
    r = httpx.post(f"{gateway.url}{path}", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert r.json()["error"]["code"] == "unsupported_parameter"


def test_fields_about_openais_platform_alone_pass(gateway):
    r = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=30, json={
        "model": "model", "messages": MESSAGES, "max_tokens": 2, "metadata": {"k": "v"}, "store": False,
        "service_tier": "auto"})
    assert r.status_code == 200, r.text


def test_models_retrieve_tokenize_and_detokenize(gateway, oai, cluster):
    assert oai.models.retrieve("model").id == "model"
    assert httpx.get(f"{gateway.url}/v1/models/nope", timeout=30).status_code == 404
    with Client(cluster.address, timeout=60) as c:
        ids = c.tokenize("Hello there")
        chat_ids = c.tokenize(messages=MESSAGES)
    r = httpx.post(f"{gateway.url}/tokenize", json={"model": "model", "prompt": "Hello there"}, timeout=30).json()
    assert r["tokens"] == ids and r["count"] == len(ids) and r["max_model_len"] > 0 and r["token_strs"] is None
    r = httpx.post(f"{gateway.url}/tokenize", json={"prompt": "Hello there", "return_token_strs": True,
                                                     "add_special_tokens": False}, timeout=30).json()
    assert r["tokens"] == ids and r["token_strs"] == ["Hello", "Ġthere"]
    r = httpx.post(f"{gateway.url}/tokenize", json={"messages": MESSAGES}, timeout=30).json()
    assert r["tokens"] == chat_ids
    with Client(cluster.address, timeout=60) as c:  # the tools and template arguments a chat request gives
        rendered = c.tokenize(messages=MESSAGES, tools=[WEATHER], enable_thinking=False)
    r = httpx.post(f"{gateway.url}/tokenize", json={"messages": MESSAGES, "tools": [WEATHER], "chat_template_kwargs": {
        "enable_thinking": False}}, timeout=30).json()
    assert r["tokens"] == rendered != chat_ids
    assert httpx.post(f"{gateway.url}/detokenize", json={"tokens": ids}, timeout=30).json() == {"prompt": "Hello there"}
    bad = httpx.post(f"{gateway.url}/detokenize", json={"tokens": [-1]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(f"{gateway.url}/tokenize", json={"prompt": "x", "messages": MESSAGES}, timeout=30)
    assert both.status_code == 400


def test_tokenize_renders_tool_calls_as_chat_does(gateway, oai):
    """Found by tests/test_gateway_schemathesis.py: /tokenize dropped the messages' tool_calls and tool_call_id, so
    its ids were not the chat prompt's."""
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5 C"}]
    r = httpx.post(f"{gateway.url}/tokenize", json={"messages": messages}, timeout=30)
    assert r.status_code == 200, r.text
    without_calls = httpx.post(f"{gateway.url}/tokenize", json={"messages": [
        *MESSAGES, {"role": "assistant", "content": None}, {"role": "tool", "content": "5 C"}]}, timeout=30).json()
    assert r.json()["count"] > without_calls["count"]
    chat = oai.chat.completions.create(model="model", messages=messages, max_tokens=1)
    assert chat.usage.prompt_tokens == r.json()["count"]
    messages[1]["tool_calls"][0]["id"] = 5  # not a string: 400 naming it (the Tokenize call's TypeError was a 500)
    bad = httpx.post(f"{gateway.url}/tokenize", json={"messages": messages}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[1].tool_calls[0].id", bad.text


def test_the_openapi_document_describes_what_the_gateway_answers(gateway):
    """No FastAPI 422 bodies (every invalid request is a 400 in OpenAI's shape), each route's 200 body and its
    error bodies described, and what the schema allows is accepted (a one-message chat, a subnormal top_p)."""
    doc = httpx.get(f"{gateway.url}/openapi.json", timeout=30).json()
    assert "422" not in json.dumps(doc["paths"]) and "HTTPValidationError" not in json.dumps(doc)
    schemas = doc["components"]["schemas"]
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        op = doc["paths"][path]["post"]
        assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].startswith("#/components")
        for status in ("400", "401", "404", "429", "503", "504"):
            assert op["responses"][status]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/ErrorBody"}, (path, status)
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1
    ok = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=30,
                    json={"model": "model", "messages": MESSAGES, "max_tokens": 2, "top_p": 5e-324})
    assert ok.status_code == 200, ok.text
    body = ok.json()
    jsonschema.validate(body, {"$ref": "#/components/schemas/ChatCompletionResponse", "components": doc["components"]})
    empty = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=30,
                       json={"model": "model", "messages": [], "max_tokens": 2})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages"


# ---- /v1/responses: the chat path answered as OpenAI's Responses API ---------------------------------------------
RESPONSE_TOOLS = [{"type": "function", **t["function"]} for t in (WEATHER, CLOCK)]


def test_a_response_is_the_chat_answer_to_the_same_conversation(oai):
    chat = oai.chat.completions.create(model="model", messages=[{"role": "system", "content": "Be brief."}, *MESSAGES],
                                       temperature=0, max_tokens=12)
    whole = oai.responses.create(model="model", instructions="Be brief.", input=MESSAGES[0]["content"],
                                 temperature=0, max_output_tokens=12)
    assert whole.id.startswith("resp_") and whole.object == "response"
    assert whole.output_text == chat.choices[0].message.content
    assert whole.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    assert [item.type for item in whole.output] == ["message"]
    # the same as a list of items with content parts, and streamed
    items = [{"role": "system", "content": [{"type": "input_text", "text": "Be brief."}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": MESSAGES[0]["content"]}]}]
    assert oai.responses.create(model="model", input=items, temperature=0, max_output_tokens=12).output_text == \
        whole.output_text
    events = list(oai.responses.create(model="model", instructions="Be brief.", input=MESSAGES[0]["content"],
                                       temperature=0, max_output_tokens=12, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_a_response_calls_functions_and_takes_their_outputs_back(oai):
    required = dict(model="model", input=MESSAGES[0]["content"], tools=RESPONSE_TOOLS, tool_choice="required",
                    parallel_tool_calls=False, temperature=0.8, extra_body={"seed": 1}, max_output_tokens=120)
    called = oai.responses.create(**required)
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and called.status == "completed", called.output
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), {"get_weather": WEATHER, "get_time": CLOCK}[
            call.name]["function"]["parameters"])
    named = oai.responses.create(model="model", input=MESSAGES[0]["content"], tools=RESPONSE_TOOLS,
                                 tool_choice={"type": "function", "name": "get_time"}, extra_body={"seed": 2},
                                 max_output_tokens=60)
    assert [item.name for item in named.output if item.type == "function_call"] == ["get_time"]
    # the calls and their outputs as the next turn's input: the chat answer to the same messages
    call = calls[0]
    turn = [{"role": "user", "content": MESSAGES[0]["content"]},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "12 degrees"}]
    answer = oai.responses.create(model="model", input=turn, tools=RESPONSE_TOOLS, tool_choice="none",
                                  temperature=0, max_output_tokens=10)
    chat = oai.chat.completions.create(model="model", tools=[WEATHER, CLOCK], tool_choice="none", temperature=0,
                                       max_tokens=10, messages=[
        MESSAGES[0], {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "12 degrees"}])
    assert answer.output_text == chat.choices[0].message.content
    streamed = list(oai.responses.create(**required, stream=True))
    done = [e.item for e in streamed if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert [(c.name, c.arguments) for c in done] == [(c.name, c.arguments) for c in calls]
    assert "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta") == \
        "".join(c.arguments for c in calls)


def test_a_response_in_a_json_schema_is_valid_json(oai):
    out = oai.responses.create(model="model", input=MESSAGES[0]["content"], temperature=0.7, extra_body={"seed": 3},
                               max_output_tokens=200, text={"format": {
                                   "type": "json_schema", "name": "item", "schema": Item.model_json_schema()}})
    Item.model_validate(json.loads(out.output_text))


@pytest.mark.parametrize("extra,param", [
    ({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"include": ["reasoning.encrypted_content"]}, "include"), ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"tool_choice": "required"}, "tool_choice"), ({"input": [{"type": "reasoning", "id": "rs_1"}]}, "input"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format"),
])
def test_a_response_request_the_gateway_cannot_serve_is_400_naming_the_field(gateway, extra, param):
    body = {"model": "model", "input": "hi", "max_output_tokens": 4, **extra}
    r = httpx.post(f"{gateway.url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
