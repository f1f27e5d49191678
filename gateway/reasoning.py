"""Qwen3's thinking, returned apart from the answer (`--reasoning-parser qwen3`).

A Qwen3 answer with thinking on starts with `<think>`, thinks, closes with `</think>` and then answers;
with `enable_thinking: false` the chat template puts an empty think block in the prompt and the answer
has none. Like vLLM's and SGLang's Qwen3 parsers, text between the tags becomes `reasoning_content` and
the rest `content`. One rule serves streaming and whole answers alike (the whole answer is one feed):
- only an answer that *starts* with `<think>` (after whitespace) has reasoning; anything else is content;
- the whitespace right after `<think>` and right after `</think>` is dropped;
- an answer cut off (length) before `</think>` is all reasoning, with empty content.
The tags are single tokens of the Qwen3 tokenizer, but a tag split over two deltas is handled too.
"""
from __future__ import annotations

from gateway.text import held_back

REASONING_PARSERS = ("qwen3",)
THINK_START, THINK_END = "<think>", "</think>"

_START, _REASONING, _CONTENT = 0, 1, 2


class ReasoningStream:
    """Splits the text deltas of one answer into (reasoning, content) deltas."""

    def __init__(self) -> None:
        self._state = _START
        self._buf = ""
        self._skip_space = False
        self.saw_reasoning = False

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning = content = ""
        while True:
            if self._state == _START:
                stripped = self._buf.lstrip()
                if stripped.startswith(THINK_START):
                    self._buf = stripped[len(THINK_START):]
                    self._state, self._skip_space, self.saw_reasoning = _REASONING, True, True
                    continue
                if THINK_START.startswith(stripped):  # "", "  ", "<th": wait for more
                    break
                self._state = _CONTENT
                continue
            if self._skip_space:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    break
                self._skip_space = False
            if self._state == _REASONING:
                end = self._buf.find(THINK_END)
                if end >= 0:
                    reasoning += self._buf[:end]
                    self._buf = self._buf[end + len(THINK_END):]
                    self._state, self._skip_space = _CONTENT, True
                    continue
                keep = held_back(self._buf, THINK_END)
                reasoning += self._buf[:len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                break
            content += self._buf
            self._buf = ""
            break
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held back, at the end of the answer."""
        buf, self._buf = self._buf, ""
        if self._state == _REASONING:
            return buf, ""
        return "", buf


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning or None when the answer has no think block, content) of a whole answer."""
    stream = ReasoningStream()
    r1, c1 = stream.feed(text)
    r2, c2 = stream.finish()
    return (r1 + r2 if stream.saw_reasoning else None), c1 + c2
