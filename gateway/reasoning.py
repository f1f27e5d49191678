"""A thinking model's reasoning, returned apart from the answer (`--reasoning-parser qwen3` or `deepseek_r1`).

A Qwen3 answer with thinking on starts with `<think>`, thinks, closes with `</think>` and then answers;
with `enable_thinking: false` the chat template puts an empty think block in the prompt and the answer
has none. DeepSeek-R1's chat template (and GLM-4.5's, Qwen3-Thinking-2507's) ends the prompt with `<think>`, so its
answer starts inside the reasoning. Like vLLM's and SGLang's parsers of those names, text between the tags becomes
`reasoning_content` and the rest `content`. One rule serves streaming and whole answers alike (the whole answer is one
feed):
- qwen3: only an answer that *starts* with `<think>` (after whitespace) has reasoning; anything else is content;
- deepseek_r1: every answer starts in its reasoning (a `<think>` it writes first is dropped), up to `</think>`;
- the whitespace at the start of the reasoning and right after `</think>` is dropped;
- an answer cut off (length) before `</think>` is all reasoning, with empty content.
The tags are single tokens of these tokenizers, but a tag split over two deltas is handled too.
"""
from __future__ import annotations

from gateway.text import held_back

REASONING_PARSERS = ("qwen3", "deepseek_r1")
THINK_START, THINK_END = "<think>", "</think>"

_START, _REASONING, _CONTENT = 0, 1, 2


class ReasoningStream:
    """Splits the text deltas of one answer into (reasoning, content) deltas, as the named parser does."""

    def __init__(self, parser: str = "qwen3") -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r} ({', '.join(REASONING_PARSERS)})")
        self._state = _START
        self._buf = ""
        self._skip_space = False
        self._starts_inside = parser == "deepseek_r1"  # the prompt opened the think block
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
                if self._starts_inside:
                    self._state, self._skip_space, self.saw_reasoning = _REASONING, True, True
                else:
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
        if self._state == _START and self._starts_inside and buf.strip():  # "<th" and no more: reasoning too
            self.saw_reasoning = True
            return buf.lstrip(), ""
        if self._state == _REASONING:
            return buf, ""
        return "", buf


def split_reasoning(text: str, parser: str = "qwen3") -> tuple[str | None, str]:
    """(reasoning or None when the answer has no think block, content) of a whole answer."""
    stream = ReasoningStream(parser)
    r1, c1 = stream.feed(text)
    r2, c2 = stream.finish()
    return (r1 + r2 if stream.saw_reasoning else None), c1 + c2
