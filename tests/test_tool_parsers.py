"""gateway/tool_parsers.py: the Hermes (Qwen2.5/Qwen3), Qwen3-Coder, MiniMax-M2, GLM-4.5, DeepSeek and Llama 3 JSON
tool-call parsers, on whole answers and streams."""
from __future__ import annotations

import json
import re

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gateway.tool_parsers import CLOSE, OPEN, PARSERS, HermesParser, StreamEvent, ToolCall, make_parser, new_call_id


def block(obj: object, pad: str = "\n") -> str:
    return f"{OPEN}{pad}{json.dumps(obj, ensure_ascii=False)}{pad}{CLOSE}"


def calls_of(text: str) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in HermesParser().parse(text)[1]]


def content_of(text: str) -> str:
    return HermesParser().parse(text)[0]


def stream(chunks: list[str]) -> tuple[str, list[ToolCall], list[StreamEvent]]:
    """(the content events joined, the calls, all events) of an answer fed in these chunks."""
    parser = HermesParser()
    events = [e for chunk in chunks for e in parser.feed(chunk)] + parser.finish()
    return "".join(e.content for e in events), [e.call for e in events if e.call], events


WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
TIME = {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}


# ---- whole answers --------------------------------------------------------------------------------------


def test_plain_text():
    assert HermesParser().parse("  The sky is blue.\n") == ("The sky is blue.", [])
    assert HermesParser().parse("") == ("", [])
    assert HermesParser().parse("a < b and </tool_call> alone") == ("a < b and </tool_call> alone", [])


def test_one_call():
    content, calls = HermesParser().parse(block(WEATHER))
    assert content == ""
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris", "unit": "celsius"}')]
    assert re.fullmatch(r"call_[0-9a-f]{24}", calls[0].id)


def test_whitespace_around_the_json_is_optional():
    for pad in ("", " ", "\n\n", "\t "):
        assert calls_of(block(WEATHER, pad)) == [("get_weather", WEATHER["arguments"])]


def test_two_parallel_calls():
    content, calls = HermesParser().parse(block(WEATHER) + "\n" + block(TIME) + "\n")
    assert content == ""
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert calls[0].id != calls[1].id


def test_content_before_a_call():
    text = "Let me check the weather.\n\n" + block(WEATHER)
    assert HermesParser().parse(text)[0] == "Let me check the weather."
    assert calls_of(text) == [("get_weather", WEATHER["arguments"])]


def test_content_between_and_after_calls_is_kept():
    text = "First.\n" + block(WEATHER) + "\nThen.\n" + block(TIME) + "\nDone."
    assert content_of(text) == "First.\n\nThen.\n\nDone."
    assert len(calls_of(text)) == 2


def test_closing_tag_inside_a_json_string():
    """The tag inside a string of the call's JSON does not end the block; outside a string it does."""
    obj = {"name": "write", "arguments": {"code": 'print("</tool_call>")', "nested": {"list": [1, {"x": "}"}]}}}
    text = block(obj) + "after"
    assert calls_of(text) == [("write", obj["arguments"])]
    assert content_of(text) == "after"
    escaped = '<tool_call>{"name": "w", "arguments": {"s": "a\\"</tool_call>\\\\"}}</tool_call>'
    assert calls_of(escaped) == [("w", {"s": 'a"</tool_call>\\'})]


def test_closing_tag_outside_strings_ends_a_truncated_object():
    text = '<tool_call>{"name": "f", "arguments": {</tool_call> ok ' + block(TIME)
    assert content_of(text) == '<tool_call>{"name": "f", "arguments": {</tool_call> ok'
    assert [name for name, _ in calls_of(text)] == ["get_time"]


def test_string_never_closed_runs_to_the_end_as_content():
    text = '<tool_call>{"name": "f, </tool_call>\n' + block(TIME)
    assert HermesParser().parse(text) == (text.strip(), [])


@pytest.mark.parametrize("inner", [
    '{"name": "f", "arguments": {"a": 1}',  # truncated JSON
    "not json at all",
    '{"arguments": {"a": 1}}',  # no name
    '{"name": 3, "arguments": {}}',  # name not a string
    '{"name": "", "arguments": {}}',
    '{"name": "f", "arguments": [1, 2]}',  # arguments not an object
    '{"name": "f", "arguments": null}',
    '{"name": "f", "arguments": "[1, 2]"}',  # a string, but not of an object
    '{"name": "f", "arguments": "{broken"}',
    '{"name": "f", "arguments": {"x": NaN}}',  # not JSON
    '[{"name": "f", "arguments": {}}]',
    '{"name": "f", "arguments": {}} trailing',
    "",
])
def test_invalid_block_stays_content(inner):
    text = f"Before.\n{OPEN}\n{inner}\n{CLOSE}\nAfter."
    assert HermesParser().parse(text) == (text, [])
    assert stream([text])[0] == text


def test_invalid_block_next_to_a_valid_one():
    bad = f"{OPEN}oops{CLOSE}"
    text = block(WEATHER) + "\n" + bad + "\n" + block(TIME)
    assert content_of(text) == bad
    assert [name for name, _ in calls_of(text)] == ["get_weather", "get_time"]


def test_unterminated_block_with_complete_json_is_a_call():
    text = "Checking.\n" + OPEN + "\n" + json.dumps(WEATHER) + "\n"
    assert HermesParser().parse(text)[0] == "Checking."
    assert calls_of(text) == [("get_weather", WEATHER["arguments"])]


def test_unterminated_garbage_stays_content():
    text = "Checking.\n" + OPEN + '\n{"name": "get_weather", "argum'
    assert HermesParser().parse(text) == (text, [])
    assert content_of(block(WEATHER) + "\n" + OPEN) == OPEN
    assert calls_of(block(WEATHER) + "\n" + OPEN) == [("get_weather", WEATHER["arguments"])]


def test_arguments_as_a_json_string():
    text = block({"name": "f", "arguments": json.dumps({"a": [1, 2], "b": "x"})})
    assert HermesParser().parse(text)[1][0].arguments == '{"a": [1, 2], "b": "x"}'


def test_parameters_alias_and_no_arguments():
    assert calls_of(block({"name": "f", "parameters": {"a": 1}})) == [("f", {"a": 1})]
    assert calls_of(block({"name": "f", "arguments": {"a": 1}, "parameters": {"b": 2}})) == [("f", {"a": 1})]
    assert HermesParser().parse(block({"name": "now"}))[1][0].arguments == "{}"


def test_unicode():
    obj = {"name": "météo", "arguments": {"ville": "Zürich", "note": "☀️ 晴れ", "emoji": "🙂"}}
    content, calls = HermesParser().parse("Voilà 🙂\n" + block(obj))
    assert content == "Voilà 🙂"
    assert calls[0].name == "météo"
    assert calls[0].arguments == '{"ville": "Zürich", "note": "☀️ 晴れ", "emoji": "🙂"}'  # not \u-escaped


# ---- streaming ------------------------------------------------------------------------------------------


def test_stream_sends_text_at_once_and_holds_only_a_possible_tag():
    parser = HermesParser()
    assert parser.feed("Hello <to") == [StreamEvent(content="Hello ")]
    assert parser.feed("ol") == []
    assert parser.feed("s>") == [StreamEvent(content="<tools>")]
    assert parser.feed("<tool_call>") == []
    assert parser.feed(json.dumps(WEATHER)) == []
    events = parser.feed("</tool_call>")
    assert len(events) == 1 and events[0].index == 0 and events[0].call.name == "get_weather"
    assert parser.finish() == []


def test_stream_holds_a_partial_tag_until_finish():
    parser = HermesParser()
    assert parser.feed("x <tool_ca") == [StreamEvent(content="x ")]
    assert parser.finish() == [StreamEvent(content="<tool_ca")]


def test_stream_drops_whitespace_between_and_after_calls():
    chunks = ["\n", OPEN, json.dumps(WEATHER), CLOSE, "\n", "\n", OPEN, json.dumps(TIME), CLOSE, "\n  ", "\n"]
    content, calls, events = stream(chunks)
    assert content == ""
    assert [e.index for e in events] == [0, 1]


def test_stream_sends_whitespace_that_leads_to_text():
    content, calls, _ = stream([block(WEATHER), "\n", "\n", "Done", "."])
    assert content == "\n\nDone."
    assert len(calls) == 1


def test_stream_invalid_block_is_sent_whole_when_it_closes():
    parser = HermesParser()
    assert parser.feed("<tool_call>{oops") == []
    assert parser.feed("}</tool_call>") == [StreamEvent(content="<tool_call>{oops}</tool_call>")]


def test_parse_leaves_the_stream_alone():
    parser = HermesParser()
    assert parser.feed("Hi <tool") == [StreamEvent(content="Hi ")]
    assert parser.parse(block(TIME))[1][0].name == "get_time"
    assert parser.feed("_call>" + json.dumps(WEATHER) + CLOSE)[0].index == 0


# ---- streams split anywhere give parse()'s answer -------------------------------------------------------

FRAGMENTS = [
    OPEN, CLOSE, "<tool", "_call>", "</tool", "<", ">", "\n", " ", "\n\n", "Hi", "é🙂", "{", "}", '"', "\\", "[",
    json.dumps(WEATHER), json.dumps(TIME), '{"name": "f", "arguments": {"s": "</tool_call>"}}',
    '{"name": "g", "parameters": "{\\"k\\": [1, {}]}"}', '{"name": "h", "arguments": [1]}', '{"name": "f",',
    block(WEATHER), block(TIME, ""), block(TIME, " "), OPEN + json.dumps(WEATHER), OPEN + "\n" + json.dumps(TIME),
]

texts = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=4), max_size=14).map("".join)


@st.composite
def split_texts(draw) -> tuple[str, list[str]]:
    text = draw(texts)
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=10)))
    return text, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@settings(deadline=None, max_examples=200)
@given(split_texts())
def test_any_split_streams_as_parse(case):
    text, chunks = case
    content, calls, events = stream(chunks)
    whole_content, whole_calls, _ = stream([text])
    assert content == whole_content
    parsed_content, parsed_calls = HermesParser().parse(text)
    assert content.strip() == parsed_content
    key = [(c.name, c.arguments) for c in calls]
    assert key == [(c.name, c.arguments) for c in whole_calls] == [(c.name, c.arguments) for c in parsed_calls]
    assert [e.index for e in events if e.call] == list(range(len(calls)))
    assert all((e.call is None) != (e.content == "") for e in events)  # one or the other, never empty
    if not calls:  # no text is lost: without calls the content is the text (unless it is all blank)
        assert content == ("" if text.isspace() else text)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.lists(st.sampled_from(["a", " ", '"', "\\", "\n", "<", "é", "🙂", "\\u00e9", CLOSE, OPEN]), max_size=4)
    .map("".join),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
pieces = st.lists(st.sampled_from(["a", "é", " ", "\n", "<", "<tool", "<tool_call", "_call>", CLOSE, "{", '"']),
                  max_size=5).map("".join)
answer_calls = st.tuples(st.text(min_size=1, max_size=5), st.dictionaries(st.text(max_size=4), json_values, max_size=3))


@settings(deadline=None, max_examples=200)
@given(st.lists(st.tuples(pieces, answer_calls), max_size=4), pieces, st.sampled_from(["", "\n", " \n "]), st.data())
def test_written_calls_are_read_back(items, last, pad, data):
    text = "".join(p + block({"name": n, "arguments": a}, pad) for p, (n, a) in items) + last
    content_pieces = [p for p, _ in items] + [last]
    assume(not any(OPEN in p for p in content_pieces))  # content cannot hold the tag: it would open a block
    expected_content = "".join(p for p in content_pieces if not p.isspace()).strip()
    expected_calls = [(n, json.dumps(a, ensure_ascii=False)) for _, (n, a) in items]
    assert HermesParser().parse(text)[0] == expected_content
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    content, calls, _ = stream([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    assert content.strip() == expected_content
    assert [(c.name, c.arguments) for c in calls] == expected_calls


# ---- the registry ---------------------------------------------------------------------------------------


def test_make_parser():
    assert isinstance(make_parser("hermes"), HermesParser)
    assert make_parser("hermes") is not make_parser("hermes")
    assert set(PARSERS) == {"hermes", "qwen3_coder", "minimax_m2", "glm45", "glm47", "deepseek_v3", "deepseek_v31",
                            "kimi_k2", "llama3_json", "mistral"}
    with pytest.raises(ValueError, match="hermes"):
        make_parser("made_up")


def test_new_call_id():
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)


# ---- Qwen3-Coder's XML-like parameters ---------------------------------------------------------------------

SCHEMAS = {"get_weather": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "hours": {"type": "array"}, "where": {"type": "object"}, "zip": {"type": "string"}}}}


def coder_block(name: str, params: dict[str, str]) -> str:
    """A block as Qwen3-Coder's chat template shows calls to the model: each value on lines of its own."""
    inner = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"{OPEN}\n<function={name}>\n{inner}</function>\n{CLOSE}"


def test_qwen3_coder_reads_values_by_their_schema_types():
    text = "Let me look.\n" + coder_block("get_weather", {
        "city": "New York", "days": "3", "metric": "true", "hours": "[9, 12]", "where": '{"lat": 40.7}',
        "zip": "10001", "note": "not in the schema"})
    content, calls = make_parser("qwen3_coder", SCHEMAS).parse(text)
    assert content == "Let me look." and [c.name for c in calls] == ["get_weather"]
    # a string (or unknown) parameter stays text, even one that reads as a number; the others are JSON
    assert json.loads(calls[0].arguments) == {"city": "New York", "days": 3, "metric": True, "hours": [9, 12],
                                              "where": {"lat": 40.7}, "zip": "10001", "note": "not in the schema"}


def test_qwen3_coder_keeps_multiline_values_and_unparsable_typed_ones():
    text = coder_block("run", {"code": "print('a')\n\nprint('</parameter')", "n": "three"})
    calls = make_parser("qwen3_coder", {"run": {"properties": {"n": {"type": "integer"}}}}).parse(text)[1]
    assert json.loads(calls[0].arguments) == {"code": "print('a')\n\nprint('</parameter')", "n": "three"}


def test_qwen3_coder_blocks_of_another_shape_stay_content():
    for inner in ('{"name": "get_time", "arguments": {}}', "<function=f>\n<parameter=a>\n1\n</parameter>\nchatter\n"
                  "</function>", "no function here"):
        text = f"{OPEN}\n{inner}\n{CLOSE}"
        assert make_parser("qwen3_coder").parse(text) == (text, [])


def test_qwen3_coder_streams_as_it_parses():
    text = ("I'll check both.\n\n" + coder_block("get_weather", {"city": "Paris", "days": "2"}) + "\n"
            + coder_block("get_time", {"tz": "Europe/Paris"}))
    whole = make_parser("qwen3_coder", SCHEMAS).parse(text)
    for size in (1, 3, 7, 50):
        parser = make_parser("qwen3_coder", SCHEMAS)
        events = [e for i in range(0, len(text), size) for e in parser.feed(text[i:i + size])] + parser.finish()
        content = "".join(e.content for e in events).strip()
        calls = [(e.index, e.call.name, e.call.arguments) for e in events if e.call]
        assert content == whole[0] == "I'll check both."
        assert calls == [(i, c.name, c.arguments) for i, c in enumerate(whole[1])]
        assert json.loads(calls[0][2]) == {"city": "Paris", "days": 2}


def test_a_whole_chat_answer_and_a_stream_read_qwen3_coder_calls_by_the_requests_schemas():
    """gateway/tools.py hands the request's schemas to the parser: `days` comes back a number both ways."""
    from gateway.tools import ToolPlan, ToolStream, with_tool_calls

    plan = ToolPlan("auto", [], schemas=SCHEMAS)
    text = coder_block("get_weather", {"city": "Oslo", "days": "4"})
    message, finish = with_tool_calls({"role": "assistant", "content": text}, "stop", plan, "qwen3_coder")
    assert finish == "tool_calls" and message["content"] is None
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo", "days": 4}
    content, deltas = ToolStream(plan, "qwen3_coder").feed(text, last=True)
    assert content == "" and json.loads(deltas[0]["function"]["arguments"]) == {"city": "Oslo", "days": 4}


# ---- MiniMax-M2's invokes ----------------------------------------------------------------------------------


def minimax_block(*invokes: tuple[str, dict[str, str]]) -> str:
    inner = "".join(f'<invoke name="{name}">\n' + "".join(f'<parameter name="{k}">{v}</parameter>\n'
                                                          for k, v in params.items()) + "</invoke>\n"
                    for name, params in invokes)
    return f"<minimax:tool_call>\n{inner}</minimax:tool_call>"


def test_minimax_m2_reads_every_invoke_of_a_block_by_the_schemas():
    text = "Checking.\n" + minimax_block(("get_weather", {"city": "Paris", "days": "2", "hours": "[8]"}),
                                          ("get_time", {"tz": "Europe/Paris"}))
    content, calls = make_parser("minimax_m2", SCHEMAS).parse(text)
    assert content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2, "hours": [8]}), ("get_time", {"tz": "Europe/Paris"})]
    for size in (1, 4, 9):  # streamed in pieces: the same calls, numbered in order
        parser = make_parser("minimax_m2", SCHEMAS)
        events = [e for i in range(0, len(text), size) for e in parser.feed(text[i:i + size])] + parser.finish()
        assert "".join(e.content for e in events).strip() == "Checking."
        assert [(e.index, e.call.name, e.call.arguments) for e in events if e.call] == [
            (i, c.name, c.arguments) for i, c in enumerate(calls)]


def test_minimax_m2_blocks_of_another_shape_and_hermes_blocks_stay_content():
    for text in ("<minimax:tool_call>\nchatter\n</minimax:tool_call>",
                 '<minimax:tool_call><invoke name="f"><parameter name="a">1</parameter>x</invoke></minimax:tool_call>',
                 block(WEATHER)):
        assert make_parser("minimax_m2").parse(text) == (text.strip(), [])


# ---- GLM-4.5's to 4.7's key and value tags -----------------------------------------------------------------


def glm_block(name: str, params: dict[str, str], sep: str = "\n") -> str:
    """A block as GLM-4.5's chat template shows calls to the model (4.7's: no newlines, sep "")."""
    inner = "".join(f"<arg_key>{k}</arg_key>{sep}<arg_value>{v}</arg_value>{sep}" for k, v in params.items())
    return f"{OPEN}{name}{sep}{inner}{CLOSE}"


@pytest.mark.parametrize("name, sep", [("glm45", "\n"), ("glm47", "")])
def test_glm_reads_names_and_values_by_the_schemas_whole_and_streamed(name, sep):
    text = ("Let me check.\n" + glm_block("get_weather", {"city": "New York", "days": "3", "hours": "[9, 12]",
                                                          "zip": "10001"}, sep)
            + "\n" + glm_block("get_time", {}, sep))
    content, calls = make_parser(name, SCHEMAS).parse(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "New York", "days": 3, "hours": [9, 12], "zip": "10001"}), ("get_time", {})]
    for size in (1, 5, 40):
        parser = make_parser(name, SCHEMAS)
        events = [e for i in range(0, len(text), size) for e in parser.feed(text[i:i + size])] + parser.finish()
        assert "".join(e.content for e in events).strip() == "Let me check."
        assert [(e.index, e.call.name, e.call.arguments) for e in events if e.call] == [
            (i, c.name, c.arguments) for i, c in enumerate(calls)]


def test_glm_keeps_multiline_values_and_blocks_of_another_shape_stay_content():
    code = "for i in range(3):\n    print(i)\n"
    (call,) = make_parser("glm45").parse(glm_block("run", {"code": code}))[1]
    assert json.loads(call.arguments) == {"code": code}
    for inner in ("", "f\n<arg_key>a</arg_key>\nchatter\n<arg_value>1</arg_value>",
                  "f\n<arg_key>a</arg_key>\n", "two words", json.dumps(WEATHER)):
        text = f"{OPEN}{inner}{CLOSE}"
        assert make_parser("glm45").parse(text) == (text, []), inner


# ---- DeepSeek's tool-call tokens ---------------------------------------------------------------------------

DS_OPEN, DS_CLOSE, DS_CALL, DS_SEP, DS_END = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                                              "<｜tool▁sep｜>", "<｜tool▁call▁end｜>")


def deepseek_call(name: str, args: dict, v31: bool) -> str:
    if v31:
        return f"{DS_CALL}{name}{DS_SEP}{json.dumps(args)}{DS_END}"
    return f"{DS_CALL}function{DS_SEP}{name}\n```json\n{json.dumps(args)}\n```{DS_END}"


@pytest.mark.parametrize("v31", [False, True])
def test_deepseek_reads_every_call_of_its_block_whole_and_streamed(v31):
    name = "deepseek_v31" if v31 else "deepseek_v3"
    calls = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris"})]
    body = "".join(deepseek_call(n, a, v31) for n, a in calls)
    for text in ("I'll check." + DS_OPEN + body + DS_CLOSE, "I'll check." + DS_OPEN + body):  # the end may be missing
        content, got = make_parser(name).parse(text)
        assert content == "I'll check." and [(c.name, json.loads(c.arguments)) for c in got] == calls
        for size in (1, 6, 33):
            parser = make_parser(name)
            events = [e for i in range(0, len(text), size) for e in parser.feed(text[i:i + size])] + parser.finish()
            assert "".join(e.content for e in events) == "I'll check."
            assert [(e.index, e.call.name, json.loads(e.call.arguments)) for e in events if e.call] == [
                (i, n, a) for i, (n, a) in enumerate(calls)]


@pytest.mark.parametrize("v31", [False, True])
def test_deepseek_blocks_of_another_shape_stay_content(v31):
    name = "deepseek_v31" if v31 else "deepseek_v3"
    good = deepseek_call("f", {"a": 1}, v31)
    bad_args = good.replace('{"a": 1}', '{"a": ')
    for inner in ("chatter", good + "chatter", bad_args, deepseek_call("f", {"a": 1}, not v31)):
        text = DS_OPEN + inner + DS_CLOSE
        assert make_parser(name).parse(text) == (text, []), inner
    # the last call cut by max_tokens before its end token: still a call where its arguments are whole
    assert [c.name for c in make_parser(name).parse(DS_OPEN + good.removesuffix(DS_END))[1]] == ["f"]


KIMI_OPEN, KIMI_CLOSE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"


def kimi_call(call_id: str, args: dict, end: bool = True) -> str:
    return (f"<|tool_call_begin|>{call_id}<|tool_call_argument_begin|>{json.dumps(args)}"
            + ("<|tool_call_end|>" if end else ""))


def test_kimi_k2_reads_every_call_of_its_section_with_the_ids_it_wrote():
    calls = [("functions.get_weather:0", "get_weather", {"city": "Paris"}),
             ("functions.get_time:1", "get_time", {"tz": "Europe/Paris"})]
    body = "".join(kimi_call(i, a) for i, _, a in calls)
    for text in ("Let me look." + KIMI_OPEN + body + KIMI_CLOSE, "Let me look." + KIMI_OPEN + body,
                 "Let me look." + KIMI_OPEN + body.removesuffix("<|tool_call_end|>")):  # ends cut or left out
        content, got = make_parser("kimi_k2").parse(text)
        assert content == "Let me look." and [(c.id, c.name, json.loads(c.arguments)) for c in got] == calls
        for size in (1, 7, 40):
            parser = make_parser("kimi_k2")
            events = [e for i in range(0, len(text), size) for e in parser.feed(text[i:i + size])] + parser.finish()
            assert "".join(e.content for e in events) == "Let me look."
            assert [(e.index, e.call.id, e.call.name) for e in events if e.call] == [
                (k, i, n) for k, (i, n, _) in enumerate(calls)]
    good = kimi_call("functions.f:0", {"a": 1})
    for inner in ("chatter", good + "chatter", good.replace('{"a": 1}', '{"a": '), kimi_call("a:b:c", {"a": 1})):
        text = KIMI_OPEN + inner + KIMI_CLOSE
        assert make_parser("kimi_k2").parse(text) == (text, []), inner


def test_parsers_whose_tags_may_be_special_tokens_keep_them_in_the_answer():
    import asyncio
    from types import SimpleNamespace

    from gateway.backend import GatewayConfig
    from gateway.jobs import chat_job
    from gateway.protocol import ChatCompletionRequest

    assert [n for n, p in PARSERS.items() if p.keeps_special_tokens] == ["deepseek_v3", "deepseek_v31", "kimi_k2",
                                                                         "mistral"]
    tools = [{"type": "function", "function": {"name": "f"}}]

    def skip(parser: str, **body) -> bool | None:
        request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=4, **body)
        backend = SimpleNamespace(config=GatewayConfig(tool_call_parser=parser))
        return asyncio.run(chat_job(request, backend)).params["skip_special_tokens"]

    assert skip("deepseek_v3", tools=tools) is False and skip("deepseek_v31", tools=tools) is False
    assert skip("deepseek_v3") is None and skip("deepseek_v3", tools=tools, tool_choice="required") is None
    assert skip("hermes", tools=tools) is None


# ---- Llama 3's bare JSON calls -----------------------------------------------------------------------------


def test_llama3_json_reads_an_answer_that_is_calls_whole_and_streamed():
    weather = {"name": "get_weather", "parameters": {"city": "Paris"}}
    for text in (json.dumps(weather), "  <|python_tag|>" + json.dumps(weather),
                 json.dumps(weather) + "; " + json.dumps(TIME)):
        content, calls = make_parser("llama3_json").parse(text)
        assert content == "" and calls[0].name == "get_weather"
        assert json.loads(calls[0].arguments) == {"city": "Paris"} and len(calls) == 1 + text.count(";")
        for size in (1, 5, 17):
            parser = make_parser("llama3_json")
            events = [e for i in range(0, len(text), size) for e in parser.feed(text[i:i + size])]
            assert events == []  # a call is held to the answer's end
            assert [(e.index, e.call.name) for e in parser.finish()] == [(i, c.name) for i, c in enumerate(calls)]


def test_llama3_json_streams_text_and_keeps_what_is_not_a_call_as_content():
    parser = make_parser("llama3_json")
    assert parser.feed("  ") == [] and [e.content for e in parser.feed("The sky")] == ["  The sky"]
    assert [e.content for e in parser.feed(" {is} blue.")] == [" {is} blue."] and parser.finish() == []
    for text in ('{"name": "f", "parameters": {"a": 1}} and then text', '{"no": "name"}', "{not json",
                 '{"name": "f", "parameters": 3}', "<|python_tag|>print(1)"):
        assert make_parser("llama3_json").parse(text) == (text, []), text


# ---- Mistral's [TOOL_CALLS] ----------------------------------------------------------------------------------


def test_mistral_reads_both_formats_after_content_whole_and_streamed():
    v3 = ('Let me check. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, ' + json.dumps(TIME)
          + "]")
    v11 = 'Let me check. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]' \
          + json.dumps(TIME["arguments"])
    for text in (v3, v11):
        content, calls = make_parser("mistral").parse(text)
        assert content == "Let me check."
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                      ("get_time", TIME["arguments"])]
        assert all(re.fullmatch("[A-Za-z0-9]{9}", c.id) for c in calls)  # as Mistral's chat templates take them
        for size in (1, 4, 19):
            parser = make_parser("mistral")
            events = [e for i in range(0, len(text), size) for e in parser.feed(text[i:i + size])] + parser.finish()
            assert "".join(e.content for e in events) == "Let me check. "
            assert [(e.index, e.call.name) for e in events if e.call] == [(0, "get_weather"), (1, "get_time")]


def test_mistral_keeps_what_is_not_a_call_as_content():
    for text in ("No calls [TOOL_ here.", "[TOOL_CALLS] not json", "[TOOL_CALLS]f[ARGS]{bad",
                 '[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]chatter', "[TOOL_CALLS] []", '[TOOL_CALLS] [{"x": 1}]'):
        assert make_parser("mistral").parse(text) == (text, []), text


def test_the_gateway_takes_vllms_tool_command_line():
    """`--enable-auto-tool-choice --tool-call-parser NAME`, as vLLM is started: auto tool choice reads calls with it."""
    from gateway.cli import load

    _, config = load(["--scheduler", "127.0.0.1:1", "--enable-auto-tool-choice", "--tool-call-parser", "mistral"])
    assert config.tool_call_parser == "mistral"
