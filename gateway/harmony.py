"""gpt-oss's answers in OpenAI's harmony format, split into reasoning, content and tool calls
(`--reasoning-parser openai_gptoss` or `--tool-call-parser openai`, vLLM's names; either turns this parse on).

A gpt-oss chat prompt ends with `<|start|>assistant`; the answer is one or more messages, each a header, `<|message|>`,
its text and an end:

    <|channel|>analysis<|message|>The user asks for the weather.<|end|><|start|>assistant<|channel|>commentary
    to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

    ...<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|return|>

(one line: the header runs from `<|start|>` to `<|message|>`). `<|call|>` and `<|return|>` end the generation (they
are the checkpoint's end-of-sequence tokens, so the text the scheduler sends stops before them); `<|end|>` ends one
message of several. The rules, the same for streams and whole answers (a whole answer is one feed):
- a message on the analysis channel is reasoning;
- a message to a recipient `functions.NAME` (written in the header, before or after the channel) is a call of NAME, its
  text the arguments (re-serialised when it is a JSON object, else as written), sent when the message ends; with
  calls off (tool_choice none, or no tools) its text is content;
- every other message (final; commentary without a recipient, the preamble a model writes to the user before its
  calls; a built-in tool's) is content;
- text that never reaches a `<|message|>` within MAX_HEADER characters is not harmony: it and all after it is
  content, as is a header left unfinished at the end of the answer.
The markers are special tokens of gpt-oss's tokenizer, so the gateway asks for the answer's text with special tokens
kept (jobs.chat_job); a marker split over two deltas is handled too. A constraint (response_format, tool_choice
required or named) applies to the final message's text, after a free analysis (scheduler_svc/structured.py); under
tool_choice required or named that text is the calls' JSON, read as without harmony (gateway/tools.py).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from gateway.text import held_back
from gateway.tool_parsers import ToolCall, _loads, new_call_id

REASONING_PARSER, TOOL_CALL_PARSER = "openai_gptoss", "openai"
START, MESSAGE = "<|start|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
MAX_HEADER = 256

_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_HEADER, _BODY, _RAW = 0, 1, 2


def on(reasoning_parser: str | None, tool_call_parser: str | None) -> bool:
    """Whether the gateway's parsers name the harmony format."""
    return reasoning_parser == REASONING_PARSER or tool_call_parser == TOOL_CALL_PARSER


@dataclass(slots=True)
class Split:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __add__(self, later: Split) -> Split:
        return Split(self.reasoning + later.reasoning, self.content + later.content, self.calls + later.calls)


class HarmonyStream:
    """One answer's text deltas as reasoning, content and calls (one stream per answer). `calls`: whether messages to
    functions are calls (tool_choice auto) or content."""

    def __init__(self, calls: bool = True) -> None:
        self._calls = calls
        self._state, self._buf = _HEADER, ""
        self._kind = "content"  # of the open message: reasoning, content or call
        self._name = ""  # the function a call message is to
        self._args: list[str] = []

    def feed(self, text: str) -> Split:
        out = Split()
        self._buf += text
        while self._step(out):
            pass
        return out

    def finish(self) -> Split:
        """What is still held, at the end of the answer."""
        out = Split()
        buf, self._buf = self._buf, ""
        if self._state == _BODY:
            self._take(buf, out)
            self._close(out)
        elif self._state == _RAW or buf.strip():
            out.content += buf
        return out

    def _step(self, out: Split) -> bool:
        """Takes what it can of the buffer; True while there may be more to take."""
        buf = self._buf
        if self._state == _RAW:
            out.content, self._buf = out.content + buf, ""
            return False
        if self._state == _HEADER:
            i = buf.find(MESSAGE)
            if (i if i >= 0 else len(buf)) > MAX_HEADER:
                self._state = _RAW
                return True
            if i < 0:
                return False
            self._open(buf[:i])
            self._buf, self._state = buf[i + len(MESSAGE):], _BODY
            return True
        found = [(i, end) for end in ENDS if (i := buf.find(end)) >= 0]
        if found:
            i, end = min(found)
            self._take(buf[:i], out)
            self._close(out)
            self._buf, self._state = buf[i + len(end):], _HEADER
            return True
        keep = max(held_back(buf, end) for end in ENDS)
        self._take(buf[:len(buf) - keep], out)
        self._buf = buf[len(buf) - keep:]
        return False

    def _open(self, header: str) -> None:
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient and recipient[1].startswith("functions.") and self._calls:
            self._kind, self._name, self._args = "call", recipient[1].removeprefix("functions."), []
        elif channel and channel[1] == "analysis" and not recipient:
            self._kind = "reasoning"
        else:
            self._kind = "content"

    def _take(self, text: str, out: Split) -> None:
        if self._kind == "call":
            self._args.append(text)
        elif self._kind == "reasoning":
            out.reasoning += text
        else:
            out.content += text

    def _close(self, out: Split) -> None:
        if self._kind != "call":
            return
        args = "".join(self._args).strip()
        try:
            value = _loads(args)
        except (ValueError, RecursionError):
            value = None
        if isinstance(value, dict):
            args = json.dumps(value, ensure_ascii=False)
        out.calls.append(ToolCall(new_call_id(), self._name, args))
        self._kind, self._args = "content", []


def split_answer(text: str, calls: bool = True) -> Split:
    """A whole answer's reasoning, content and calls."""
    stream = HarmonyStream(calls)
    return stream.feed(text) + stream.finish()
