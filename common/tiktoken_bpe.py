"""A tokenizer published as tiktoken BPE ranks, as a Hugging Face `tokenizer.json`: byte-level BPE whose merges are
recovered from the ranks (the standard tiktoken -> Hugging Face conversion), the pre-tokenizer's pattern, and the
added tokens with their ids. The project writes Qwen's tokenizer this way (worker_svc/checkpoints/tokenizer_files.py),
and a checkpoint that ships `tiktoken.model` instead of a tokenizer.json (Kimi-K2, Moonlight) is read
this way (model_files.tokenizer_json).

A tiktoken file holds no pattern: it is the `pat_str` of the tokenizer module the checkpoint names in
tokenizer_config.json's auto_map, so the modules known here are listed in PATTERNS and any other is refused."""
from __future__ import annotations

import base64
import json

from common.byte_level import byte_to_char

RANKS_FILE = "tiktoken.model"

# The pat_str of Moonshot's tokenizer modules (one and the same in tokenization_kimi.py and tokenization_moonshot.py):
# Han runs split from other letters by class intersection, which the `tokenizers` regex engine (Oniguruma) reads as
# tiktoken's does.
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
# tokenizer module (auto_map's AutoTokenizer entry, before its class) -> (pattern, reserved special tokens after the
# ranks, each named by tokenizer_config.json's added_tokens_decoder or <|reserved_token_ID|>)
PATTERNS: dict[str, tuple[str, int]] = {
    "tokenization_kimi": (KIMI_PATTERN, 256),
    "tokenization_moonshot": (KIMI_PATTERN, 256),
}


def read_ranks(data: bytes) -> dict[bytes, int]:
    """Token bytes -> rank (= token id) from a tiktoken file's lines of base64 token and rank."""
    ranks: dict[bytes, int] = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _last_merge(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes]:
    """The two parts tiktoken's BPE joins last when it encodes `token`: BPE on the token's bytes with only the ranks
    below its own; what remains is the merge that creates it."""
    max_rank = ranks[token]
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, best_rank = -1, max_rank
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best, best_rank = i, rank
        if best < 0:
            break
        parts[best : best + 2] = [parts[best] + parts[best + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} cannot be built from lower-ranked merges")
    return parts[0], parts[1]


def vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level vocab (string -> id) and merges in priority order."""
    byte_char = byte_to_char()

    def to_str(b: bytes) -> str:
        return "".join(byte_char[x] for x in b)

    ordered = sorted(ranks.items(), key=lambda kv: kv[1])
    vocab = {to_str(tok): rank for tok, rank in ordered}
    merges = [tuple(map(to_str, _last_merge(ranks, tok))) for tok, _ in ordered if len(tok) > 1]
    return vocab, merges


def added_token(token_id: int, content: str, special: bool) -> dict:
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": special}


def tokenizer_json(ranks: dict[bytes, int], pattern: str, added: list[tuple[int, str, bool]],
                   nfc: bool = False) -> str:
    """The tokenizer.json text: `added` as (id, content, special); `nfc`: text NFC-normalised first (Qwen's)."""
    vocab, merges = vocab_and_merges(ranks)
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [added_token(*t) for t in added],
        "normalizer": {"type": "NFC"} if nfc else None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
                byte_level,
            ],
        },
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": vocab, "merges": [list(m) for m in merges],
        },
    }
    return json.dumps(doc, ensure_ascii=False)


def checkpoint_tokenizer_json(ranks_file: bytes, tokenizer_config: dict) -> str:
    """A checkpoint's tiktoken.model and tokenizer_config.json as tokenizer.json text; ValueError where its tokenizer
    module is not one of PATTERNS."""
    auto = tokenizer_config.get("auto_map", {}).get("AutoTokenizer")
    # "tokenization_kimi.TikTokenTokenizer", or with the repository before "--"
    module = (auto[0] if isinstance(auto, list) else auto or "").rpartition(".")[0].split("--")[-1]
    if module not in PATTERNS:
        raise ValueError(f"the checkpoint's tokenizer is tiktoken's with the pattern of {module or 'no module'!r} "
                         f"(tokenizer_config.json's auto_map), which splitserve does not know: it reads "
                         f"{', '.join(PATTERNS)}; give the checkpoint a tokenizer.json")
    pattern, reserved = PATTERNS[module]
    ranks = read_ranks(ranks_file)
    named = {int(i): (t["content"], t.get("special", True))
             for i, t in tokenizer_config.get("added_tokens_decoder", {}).items()}
    ids = sorted(set(range(len(ranks), len(ranks) + reserved)) | set(named))
    added = [(i, *named.get(i, (f"<|reserved_token_{i}|>", True))) for i in ids]
    return tokenizer_json(ranks, pattern, added)
