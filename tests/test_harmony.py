"""gateway/harmony.py: gpt-oss's harmony answers as reasoning, content and tool calls, whole and streamed in any
pieces, and the chat renderers and job with the parser on."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.harmony import MAX_HEADER, HarmonyStream, Split, on, split_answer

ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather in Paris.<|end|>"
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris."


def stream(text: str, cuts: list[int], calls: bool = True) -> Split:
    """The events of `text` fed in pieces cut at `cuts`, joined."""
    parser, out, start = HarmonyStream(calls), Split(), 0
    for end in [*sorted(cuts), len(text)]:
        out += parser.feed(text[start:end])
        start = max(start, end)
    return out + parser.finish()


def calls_of(split: Split) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in split.calls]


def test_reasoning_then_final_answer():
    split = split_answer(ANALYSIS + FINAL)
    assert (split.reasoning, split.content, split.calls) == ("The user wants the weather in Paris.",
                                                             "It is sunny in Paris.", [])


def test_a_call_ends_the_answer():
    """<|call|> is an end-of-sequence token: the text stops before it, and the call is read at the end."""
    split = split_answer(ANALYSIS + CALL)
    assert split.reasoning == "The user wants the weather in Paris." and split.content == ""
    assert calls_of(split) == [("get_weather", {"city": "Paris"})]
    assert split.calls[0].arguments == '{"city": "Paris"}' and split.calls[0].id.startswith("call_")


def test_the_recipient_may_stand_in_the_role_and_the_final_message_may_follow_calls():
    text = ('<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{"q": "a"}<|call|>'
            '<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{"q": "b"}<|end|>'
            "<|start|>assistant<|channel|>final<|message|>Done.<|return|>")
    split = split_answer(text)
    assert calls_of(split) == [("lookup", {"q": "a"}), ("lookup", {"q": "b"})] and split.content == "Done."


def test_preambles_and_other_recipients_are_content_and_arguments_that_are_no_object_stay_as_written():
    text = ("<|channel|>commentary<|message|>Let me look that up. <|end|>"
            "<|start|>assistant<|channel|>analysis to=browser.search<|message|>weather paris<|end|>"
            "<|start|>assistant<|channel|>commentary to=functions.f<|message|> not json ")
    split = split_answer(text)
    assert split.content == "Let me look that up. weather paris" and split.reasoning == ""
    assert [(c.name, c.arguments) for c in split.calls] == [("f", "not json")]


def test_with_calls_off_a_call_is_content():
    split = split_answer(ANALYSIS + CALL, calls=False)
    assert split.calls == [] and split.content == '{"city":"Paris"}'


def test_text_that_is_not_harmony_is_content():
    assert split_answer("Just text.") == Split("", "Just text.", [])
    long = "x" * (MAX_HEADER + 1) + "<|message|>y<|end|>"
    assert split_answer(long) == Split("", long, [])
    assert split_answer("") == Split("", "", [])
    assert split_answer("   ") == Split("", "", [])


def test_an_answer_cut_inside_a_message_keeps_what_it_has():
    assert split_answer("<|channel|>analysis<|message|>Thinking ab") == Split("Thinking ab", "", [])
    assert split_answer(ANALYSIS + "<|start|>assistant<|channel|>fin") == Split(
        "The user wants the weather in Paris.", "<|start|>assistant<|channel|>fin", [])
    # cut before its arguments close: a call with the text it has
    assert [(c.name, c.arguments) for c in split_answer(CALL[:-3]).calls] == [("get_weather", '{"city":"Pari')]


@settings(deadline=None, max_examples=200)
@given(st.lists(st.integers(0, len(ANALYSIS + CALL + FINAL)), max_size=12), st.booleans())
def test_any_cuts_of_a_stream_give_the_whole_answers_split(cuts, calls):
    for text in (ANALYSIS + FINAL + "<|return|>", ANALYSIS + CALL, ANALYSIS + CALL + "<|end|>" + FINAL):
        cut = [c for c in cuts if c <= len(text)]
        whole, streamed = split_answer(text, calls), stream(text, cut, calls)
        assert (streamed.reasoning, streamed.content) == (whole.reasoning, whole.content)
        assert [(c.name, c.arguments) for c in streamed.calls] == [(c.name, c.arguments) for c in whole.calls]


def test_a_stream_sends_text_as_it_comes_holding_back_only_a_possible_marker():
    parser = HarmonyStream()
    assert parser.feed("<|channel|>analysis<|mess") == Split()
    assert parser.feed("age|>Think") == Split("Think")
    assert parser.feed("ing<|e") == Split("ing")  # "<|e" may be <|end|>
    assert parser.feed("nd|><|start|>assistant<|channel|>final<|message|>Sun") == Split("", "Sun")
    assert parser.finish() == Split()


def test_either_flag_turns_it_on():
    assert on("openai_gptoss", "hermes") and on(None, "openai") and not on("qwen3", "hermes") and not on(None, "hermes")


def _backend(**config):
    from gateway.backend import GatewayConfig
    from gateway.tokens import TokenRenderer

    return SimpleNamespace(config=GatewayConfig(**config), tokens=TokenRenderer())


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.parametrize("flags", [{"reasoning_parser": "openai_gptoss"}, {"tool_call_parser": "openai"}])
def test_a_harmony_chat_job_keeps_the_special_tokens_and_constrains_the_final_message(flags):
    from gateway.jobs import chat_job
    from gateway.protocol import ChatCompletionRequest

    def job(**body):
        return asyncio.run(chat_job(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                                          max_tokens=8, **body), _backend(**flags)))

    for one in (job(), job(tools=TOOLS), job(tools=TOOLS, tool_choice="none"), job(tools=TOOLS, tool_choice="required"),
                job(response_format={"type": "json_object"})):
        assert one.harmony and one.params["skip_special_tokens"] is False
    # a response format's or tool_choice's constraint applies to the final message, after a free analysis
    assert job(response_format={"type": "json_object"}).params["structured"] == {"json_object": True,
                                                                                 "reasoning": "openai_gptoss"}
    assert job(tools=TOOLS, tool_choice="required").params["structured"]["reasoning"] == "openai_gptoss"
    assert not asyncio.run(chat_job(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                                          max_tokens=8), _backend())).harmony


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_constrained_tool_choice_reads_the_final_messages_json_streamed_and_whole(choice):
    """Under harmony, tool_choice required (a JSON array of calls) or a named function (its arguments) constrains the
    final message's text: its JSON becomes the calls, the analysis stays reasoning."""
    from client.client import Delta
    from gateway.events import chat_events
    from gateway.jobs import Job
    from gateway.render import Choice, chat_completion
    from gateway.tools import plan_tools

    final = ('[{"name": "get_weather", "arguments": {"city": "Paris"}}]' if choice == "required"
             else '{"city": "Paris"}')
    text = ANALYSIS + "<|start|>assistant<|channel|>final<|message|>" + final
    deltas = [Delta(0, [i], text[i:i + 9]) for i in range(0, len(text), 9)]
    deltas[-1].finish_reason = "stop"
    backend, body = _backend(tool_call_parser="openai"), SimpleNamespace(include_reasoning=True)
    job = Job([{"token_ids": [1]}], {}, 1, tools=plan_tools(TOOLS, choice, None), harmony=True)

    async def events():
        async def source():
            for d in deltas:
                yield 0, d
        return [e async for e in chat_events(source(), None, job, backend, "id", "m", 0, body, False)]

    chunks = [json.loads(e[len("data: "):])["choices"][0] for e in asyncio.run(events()) if e != "data: [DONE]\n\n"]
    calls = [c for chunk in chunks for c in chunk["delta"].get("tool_calls", [])]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})]
    assert "".join(c["delta"].get("content") or "" for c in chunks) == ""
    assert chunks[-1]["finish_reason"] == "tool_calls"
    assert "".join(c["delta"].get("reasoning_content", "") for c in chunks) == "The user wants the weather in Paris."
    whole = chat_completion([Choice(0, [text], finish_reason="stop")], SimpleNamespace(body=lambda: {}), job, backend,
                            "id", "m", 0, body)["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in whole["message"]["tool_calls"]] == [{"city": "Paris"}]
    assert whole["message"]["reasoning_content"] == "The user wants the weather in Paris."


@pytest.mark.parametrize("with_tools", [False, True])
def test_harmony_chat_answers_streamed_and_whole(with_tools):
    """The chat renderers fed an answer's deltas as the scheduler sends them: reasoning apart, the call as
    tool_calls with finish_reason tool_calls where tools are on (tool_choice auto), else its text as content."""
    from client.client import Delta, Usage
    from gateway.events import chat_events
    from gateway.jobs import Job
    from gateway.render import Choice, chat_completion
    from gateway.tools import plan_tools

    text = ANALYSIS + CALL
    pieces = [text[i:i + 7] for i in range(0, len(text), 7)]
    deltas = [Delta(0, [i], t) for i, t in enumerate(pieces)]
    deltas[-1].finish_reason, deltas[-1].usage = "stop", Usage(9, len(pieces), 0)
    backend = _backend(reasoning_parser="openai_gptoss")
    body = SimpleNamespace(include_reasoning=True)
    plan = plan_tools(TOOLS, None, None) if with_tools else None
    job = Job([{"token_ids": [1]}], {}, 1, tools=plan, harmony=True)

    async def source():
        for d in deltas:
            yield 0, d

    async def events():
        return [e async for e in chat_events(source(), None, job, backend, "id", "m", 0, body, True)]

    chunks = [json.loads(e[len("data: "):]) for e in asyncio.run(events()) if e != "data: [DONE]\n\n"]
    streamed = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(c["delta"].get("reasoning_content", "") for c in streamed) == "The user wants the weather in Paris."
    calls = [call for c in streamed for call in c["delta"].get("tool_calls", [])]
    content = "".join(c["delta"].get("content", "") for c in streamed)
    whole = chat_completion([Choice(0, [text], finish_reason="stop")], SimpleNamespace(body=lambda: {}), job, backend,
                            "id", "m", 0, body)["choices"][0]
    if with_tools:
        assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            (0, "get_weather", {"city": "Paris"})]
        assert content == "" and streamed[-1]["finish_reason"] == "tool_calls"
        assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
        assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["get_weather"]
    else:
        assert calls == [] and content == '{"city":"Paris"}' and streamed[-1]["finish_reason"] == "stop"
        assert whole["finish_reason"] == "stop" and whole["message"]["content"] == '{"city":"Paris"}'
    assert whole["message"]["reasoning_content"] == "The user wants the weather in Paris."


def test_a_harmony_answer_under_a_schema_through_the_services(harmony_model_dir, tmp_path_factory):
    """A gateway with --reasoning-parser openai_gptoss over a model whose tokenizer has harmony's markers: under a
    response_format the answer is harmony (an analysis message, free, ended early here by a bias on <|end|>, or none),
    and the final message's text, the content, is valid under the schema, whole and streamed."""
    import jsonschema
    from tokenizers import Tokenizer

    from client.launcher import LocalCluster
    from tests.test_gateway import START_S, WORKER_ARGS, Gateway

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    end = Tokenizer.from_file(str(harmony_model_dir / "tokenizer.json")).token_to_id("<|end|>")
    cluster = LocalCluster(harmony_model_dir, worker_args=WORKER_ARGS, log_dir=tmp_path_factory.mktemp("harmony-logs"))
    cluster.start(timeout=START_S)
    gateway = Gateway(cluster.address, tmp_path_factory.mktemp("harmony-gw") / "gateway.log", "--reasoning-parser",
                      "openai_gptoss", "--workers", "1")
    try:
        client = gateway.wait_healthy().openai()
        kwargs = dict(model=harmony_model_dir.name, messages=[{"role": "user", "content": "A number?"}],
                      max_tokens=200, temperature=0.8, logit_bias={str(end): 60.0},
                      response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
        for seed in range(3):
            whole = client.chat.completions.create(seed=seed, **kwargs).choices[0]
            assert whole.finish_reason == "stop", whole
            jsonschema.validate(json.loads(whole.message.content), schema)
            streamed = "".join(c.choices[0].delta.content or "" for c in
                               client.chat.completions.create(seed=seed, stream=True, **kwargs) if c.choices)
            assert json.loads(streamed) == json.loads(whole.message.content)
    finally:
        gateway.stop()
        cluster.stop()
