"""Token strings for logprobs. The scheduler sends token ids; OpenAI's logprobs name tokens by their text
(and, in chat, their UTF-8 bytes). With `--tokenizer` (the checkpoint folder, or its tokenizer.json) the
gateway renders them itself; without it a token is written `token_id:<id>`, vLLM's
`--return-tokens-as-token-ids` form, and its bytes are null."""
from __future__ import annotations

from pathlib import Path

from common.byte_level import char_to_byte
from common.model_files import tokenizer_json


class TokenRenderer:
    def __init__(self, tokenizer: str | Path | None = None):
        self._tokenizer = None
        self._added: dict[int, str] = {}
        self._byte_level = False
        if tokenizer is not None:
            from tokenizers import Tokenizer

            path = Path(tokenizer)
            self._tokenizer = Tokenizer.from_str(tokenizer_json(path)) if path.is_dir() else Tokenizer.from_file(
                str(path))
            self._added = {i: t.content for i, t in self._tokenizer.get_added_tokens_decoder().items()}
            decoder = self._tokenizer.decoder
            self._byte_level = decoder is not None and type(decoder).__name__ == "ByteLevel"
        self._cache: dict[int, tuple[str, list[int] | None]] = {}

    def render(self, token_id: int) -> tuple[str, list[int] | None]:
        """(the token's text, its UTF-8 bytes or None). A token holding part of a multi-byte character
        has a text with U+FFFD in it; its bytes are exact."""
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        if self._tokenizer is None:
            out: tuple[str, list[int] | None] = (f"token_id:{token_id}", None)
        elif (raw := self._raw_bytes(token_id)) is not None:
            out = (raw.decode("utf-8", errors="replace"), list(raw))
        else:
            out = (f"token_id:{token_id}", None)
        if len(self._cache) < 1 << 18:
            self._cache[token_id] = out
        return out

    def decode(self, token_ids: list[int]) -> str | None:
        """The text of some token ids, special tokens included (an echoed token-id prompt); None without a
        tokenizer."""
        if self._tokenizer is None:
            return None
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)

    def _raw_bytes(self, token_id: int) -> bytes | None:
        assert self._tokenizer is not None
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return None
        if self._byte_level:
            table = char_to_byte()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        return self._tokenizer.decode([token_id], skip_special_tokens=False).encode()
