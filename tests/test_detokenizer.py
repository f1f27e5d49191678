"""Incremental detokenization and stop strings with Qwen3's real tokenizer; load_tokenizer."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers.decoders import DecodeStream

from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.tokenizer import ModelTokenizer, load_tokenizer
from tests.fake_worker import QWEN_EOS_IDS, write_model_dir


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("fake-model"), tmp_path_factory.getbasetemp() / "qwen3-tokenizer")


@pytest.fixture(scope="session")
def qwen(model_dir) -> ModelTokenizer:
    return load_tokenizer(model_dir)


def stream(qwen: ModelTokenizer, text: str, stop=(), skip_special_tokens=True,
           include_stop=False) -> tuple[list[str], bool]:
    detok = IncrementalDetokenizer(qwen.tokenizer, [], skip_special_tokens, list(stop), include_stop)
    deltas = []
    for tok in qwen.encode(text):
        delta, stopped = detok.add(tok)
        deltas.append(delta)
        if stopped:
            return deltas, True
    deltas.append(detok.flush())
    return deltas, False


def test_plain_stream_reproduces_the_text(qwen):
    text = "Hello world! 你好，世界。\n  def f(x):\n\treturn x"
    deltas, stopped = stream(qwen, text)
    assert "".join(deltas) == text and not stopped


def test_utf8_split_across_tokens_is_never_emitted_half(qwen):
    text = "🦜 parrot 𝔘𝔫𝔦"
    ids = qwen.encode(text)
    assert any("\ufffd" in qwen.decode([i]) for i in ids), "the sample must split a character"
    deltas, _ = stream(qwen, text)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # a token that completed no character emitted nothing


def test_stop_string_split_across_tokens(qwen):
    text = "Stop here: END OF TEXT"
    assert [qwen.decode([i]) for i in qwen.encode(text)][3:5] == [" END", " OF"]
    deltas, stopped = stream(qwen, text, stop=["END OF"])
    assert stopped and "".join(deltas) == "Stop here: "
    assert deltas[3] == " "  # "END" held back: it may start the stop string


def test_held_back_text_is_released_when_no_stop_follows(qwen):
    deltas, stopped = stream(qwen, "Stop here: END IT", stop=["END OF"])
    assert not stopped and "".join(deltas) == "Stop here: END IT"
    assert deltas[3] == " " and deltas[4] == "END IT"


def test_stop_string_inside_a_token_truncates_it(qwen):
    deltas, stopped = stream(qwen, "Stop here: END", stop=["ere"])
    assert stopped and "".join(deltas) == "Stop h"


def test_earliest_stop_string_wins_and_flush_returns_held_text(qwen):
    deltas, stopped = stream(qwen, "one two three", stop=["three", "two"])
    assert stopped and "".join(deltas) == "one "
    detok = IncrementalDetokenizer(qwen.tokenizer, [], True, ["xyz"])
    assert detok.add(qwen.encode("abc x")[-1]) == (" ", False)
    assert detok.flush() == "x" and detok.flush() == ""


def test_stop_string_over_a_split_character(qwen):
    deltas, stopped = stream(qwen, "🦜 parrot 𝔘𝔫𝔦", stop=["𝔘𝔫"])
    assert stopped and "".join(deltas) == "🦜 parrot "


def test_check_stop_false_emits_everything(qwen):
    detok = IncrementalDetokenizer(qwen.tokenizer, [], True, ["END"])
    out = [detok.add(t, check_stop=False) for t in qwen.encode("x END y")]
    assert "".join(d for d, _ in out) == "x END y" and not any(s for _, s in out)


def test_special_tokens_skipped_or_kept(qwen):
    ids = qwen.encode("a<|im_end|>b")
    assert ids[1] == QWEN_EOS_IDS[0]
    assert "".join(stream_ids(qwen, ids, True)) == "ab"
    assert "".join(stream_ids(qwen, ids, False)) == "a<|im_end|>b"


def stream_ids(qwen, ids, skip_special_tokens):
    detok = IncrementalDetokenizer(qwen.tokenizer, [], skip_special_tokens)
    return [detok.add(i)[0] for i in ids]


def test_prompt_context_does_not_leak_into_the_output(qwen):
    prompt = qwen.encode("The answer is")
    detok = IncrementalDetokenizer(qwen.tokenizer, prompt, True)
    assert "".join(detok.add(t)[0] for t in qwen.encode(" forty-two")) == " forty-two"


ALPHABET = list("ab ENDé日😀\n")


@given(
    text=st.text(alphabet=st.sampled_from(ALPHABET), max_size=30),
    stops=st.lists(st.text(alphabet=st.sampled_from(ALPHABET), min_size=1, max_size=4), max_size=3),
    include=st.booleans(),
)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_streaming_matches_a_check_after_every_token(qwen, text, stops, include):
    """Reference: after each token, the decoded text so far; the first time any stop string occurs,
    the output is the text before its earliest occurrence (the first listed of those that start there), or
    through its end where stop strings are included."""
    ids = qwen.encode(text)
    ref_stream = DecodeStream(skip_special_tokens=True)
    so_far = ""
    want, want_stop = None, False
    for tok in ids:
        so_far += ref_stream.step(qwen.tokenizer, tok) or ""
        hits = [(so_far.find(s), i, s) for i, s in enumerate(stops) if s in so_far]
        if hits:
            k, _, s = min(hits)
            want, want_stop = so_far[: k + len(s) if include else k], True
            break
    if want is None:
        want = so_far
    deltas, stopped = stream(qwen, text, stops, include_stop=include)
    assert ("".join(deltas), stopped) == (want, want_stop)
    emitted = ""
    for d in deltas[:-1] if include and stopped else deltas:  # included, a stop string is in the last delta only
        emitted += d
        assert not any(s in emitted for s in stops)


# --- load_tokenizer --------------------------------------------------------------------------------


def test_load_tokenizer_reads_eos_and_vocab(qwen):
    assert qwen.eos_token_ids == QWEN_EOS_IDS
    assert qwen.vocab_size == 151669
    assert qwen.special_tokens["eos_token"] == "<|im_end|>"
    assert qwen.decode(qwen.encode("héllo 世界")) == "héllo 世界"


def test_chat_template_matches_transformers(qwen, model_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHello."},
        {"role": "user", "content": "2+2?"},
    ]
    for kwargs in ({}, {"enable_thinking": False}, {"add_generation_prompt": False}):
        want = hf.apply_chat_template(messages, tokenize=False, **{"add_generation_prompt": True, **kwargs})
        got = qwen.apply_chat_template(messages, **kwargs)
        assert got == want
    # the last message continued: an assistant's start, and a user's
    for last in ({"role": "assistant", "content": "The answer is"}, {"role": "user", "content": "And 3+3? "}):
        want = hf.apply_chat_template([*messages, last], tokenize=False, add_generation_prompt=False,
                                      continue_final_message=True)
        assert qwen.apply_chat_template([*messages, last], add_generation_prompt=False,
                                        continue_final_message=True) == want
        assert want.rstrip().endswith(last["content"].rstrip())
    ids = qwen.apply_chat_template(messages[1:2], tokenize=True)
    assert ids == qwen.encode("<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)


def test_a_requests_template_kwargs_reach_the_chat_template(qwen):
    """prompt.chat.template_kwargs (a JSON object) are keyword arguments of the template (gpt-oss's reasoning_effort
    here), beside enable_thinking; names the renderer passes itself, and anything but an object, are refused by
    name."""
    import dataclasses
    import json

    from protos import splitserve_pb2 as api
    from scheduler_svc.requests import InvalidRequest, prompt_ids

    tok = dataclasses.replace(qwen, chat_template="effort={{ reasoning_effort | default('medium') }} "
                              "think={{ enable_thinking | default(true) }} {{ messages[0].content }}")

    def rendered(**chat) -> str:
        request = api.TokenizeRequest(chat=api.ChatPrompt(messages=[api.ChatMessage(role="user", content="hi")],
                                                          **chat))
        return tok.decode(prompt_ids(request, tok, 1024))

    assert rendered() == "effort=medium think=True hi"
    assert rendered(template_kwargs=json.dumps({"reasoning_effort": "high"}), enable_thinking=False) == \
        "effort=high think=False hi"
    for bad, field in ((json.dumps({"messages": []}), "prompt.chat.template_kwargs.messages"),
                       (json.dumps({"eos_token": "x"}), "prompt.chat.template_kwargs.eos_token"),
                       (json.dumps({"a-b": 1}), "prompt.chat.template_kwargs.a-b"),
                       ("[1]", "prompt.chat.template_kwargs must be a JSON object"),
                       ("{", "prompt.chat.template_kwargs must be a JSON object")):
        with pytest.raises(InvalidRequest, match=field.replace(".", r"\.").replace("[", r"\[")):
            rendered(template_kwargs=bad)
