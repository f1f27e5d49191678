"""Incremental detokenization of one sequence, with stop strings.

Text comes from `tokenizers.decoders.DecodeStream` (Rust), which returns nothing while a UTF-8
character is incomplete, so no delta ever splits one. With stop strings, the tail of the text that
could be the start of a stop string is held back until the next tokens decide; a stop string found
truncates the text before it (or after it, where the request includes it) and ends the sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

_PROMPT_CONTEXT = 4  # prompt tokens seeding the stream, so the first delta decodes in context


class IncrementalDetokenizer:
    __slots__ = ("_tokenizer", "_skip_special", "_stream", "_stops", "_include_stop", "_prefix_ends", "_pending",
                 "_undecoded", "stop_string")

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop: bool = False,
    ):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        context = list(prompt_ids[-_PROMPT_CONTEXT:])
        # A context that ends inside a UTF-8 character makes DecodeStream emit all of the context's text
        # with the first token: leave such tokens out (the text is then that of the generated tokens).
        while context and tokenizer.decode(context, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
            context.pop()
        self._stream = DecodeStream(context, skip_special_tokens=skip_special_tokens)
        self._stops = tuple(stop)
        self._include_stop = include_stop  # the stop string, or a stop token's text, stays in the text
        # Characters that can end a proper prefix of a stop string: text ending otherwise holds nothing.
        self._prefix_ends = frozenset(ch for s in self._stops for ch in s[:-1])
        self._pending = ""  # decoded but held back
        self._undecoded: list[int] = []  # tokens since the stream's last text: an incomplete character
        self.stop_string: str | None = None  # the stop string found, once add() reported one

    def add(self, token_id: int, check_stop: bool = True) -> tuple[str, bool]:
        """Feed one token; returns (text delta, stop string found). After a stop, stop feeding."""
        piece = self._stream.step(self._tokenizer, token_id)
        if piece is None:
            self._undecoded.append(token_id)
        elif self._undecoded:
            self._undecoded.clear()
        if not self._stops:
            return piece or "", False
        text = self._pending + piece if piece else self._pending
        if not check_stop:
            self._pending = ""
            return text, False
        # A match cannot start in text already emitted: that text was not a stop-string prefix.
        cut = -1
        for s in self._stops:
            k = text.find(s)
            if k != -1 and (cut == -1 or k < cut):
                cut, self.stop_string = k, s
        if cut != -1:
            self._pending = ""
            return text[:cut + len(self.stop_string) if self._include_stop else cut], True
        if not text or text[-1] not in self._prefix_ends:
            self._pending = ""
            return text, False
        hold = 0  # the longest tail of text that starts a stop string
        for s in self._stops:
            for size in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:size]):
                    hold = size
                    break
        self._pending = text[len(text) - hold :]
        return text[: len(text) - hold], False

    def next(self, token_id: int, finish_reason: str | None, check_stop: bool) -> tuple[str, str | None, str | None]:
        """One new token of a sequence and how the scheduler left it: (text delta, finish reason, stop reason).
        A stop token (reason "stop") is no part of the text unless stop strings are included, nor the EOS that ends
        a dead grammar ("grammar"); a stop string found here finishes it with reason "stop" whatever the scheduler
        said (its caller tells the scheduler); the end flushes what is held."""
        if finish_reason == "stop":
            text = self.add(token_id, check_stop=False)[0] if self._include_stop else ""
            return text + self.flush(), "stop", str(token_id)
        if finish_reason == "grammar":  # an EOS the worker sampled where the grammar allowed no token
            return self.flush(), "grammar", None
        text, stopped = self.add(token_id, check_stop)
        if stopped:
            return text, "stop", self.stop_string
        if finish_reason is not None:
            text += self.flush()
        return text, finish_reason, None

    def flush(self) -> str:
        """Text held back for a stop string that did not come (the sequence ended otherwise), and an
        incomplete character at the end as decode() renders it (U+FFFD), so the whole text is decode()'s."""
        text, self._pending = self._pending, ""
        if self._undecoded:
            text += self._tokenizer.decode(self._undecoded, skip_special_tokens=self._skip_special)
            self._undecoded.clear()
        return text
