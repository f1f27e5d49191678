"""Tool calls read out of a model's text answer, chosen by the gateway's `--tool-call-parser` flag
(like vLLM's flag of that name): `hermes`, `qwen3_coder` (Hermes' blocks holding XML-like parameters instead of
JSON: Qwen3CoderParser below), `minimax_m2` (MiniMax-M2's tags and invokes: MiniMaxM2Parser below), `glm45` or
`glm47` (GLM-4.5's to 4.7's names and key / value tags: Glm45Parser below), `deepseek_v3` / `deepseek_v31`
(DeepSeek's tool-call tokens: DeepSeekV3Parser below), `kimi_k2` (Kimi-K2's: KimiK2Parser below), `llama3_json`
(Llama 3's bare JSON calls: Llama3JsonParser below) and `mistral` (calls from a tag to the answer's end:
MistralParser below); the last two close no block (TrailingCallsParser).

The Hermes format (Hermes 2/3, Qwen2.5, Qwen3): after optional content text the model writes zero or
more blocks

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

(the whitespace around the JSON is optional). The rules, the same for whole answers and streams (`parse`
is one `feed` of the whole text and a `finish`):
- a block is a call when its JSON is one object with a non-empty string "name" and an "arguments" object
  ("parameters" is accepted for it; so is a JSON string holding an object; no arguments at all means {});
  `ToolCall.arguments` is that object as `json.dumps(obj, ensure_ascii=False)`;
- any other block stays in the content, as its raw text with the tags: no text is lost;
- a block left open at the end (cut by max_tokens) is a call when its text parses completely as above,
  else content;
- `</tool_call>` inside a JSON string of the block (`{"arguments": {"code": "print('</tool_call>')"}}`)
  does not end the block: while the block's text is a JSON object still open, the tag counts only outside
  its strings. (A block whose string never closes therefore runs to the end of the answer and, not
  parsing, is content.) Text that does not start with `{` ends at the first `</tool_call>`;
- content is the text outside the calls. The text between two calls, before the first or after the last
  is one piece; a piece of whitespace only is dropped (streams do not send the newlines between calls);
  `parse` also strips the content's ends, a stream sends the other whitespace as it comes.
A stream sends content as soon as it cannot be the start of `<tool_call>`, and a call when its block
closes (or at `finish`).
"""
from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

from gateway.text import held_back

OPEN, CLOSE = "<tool_call>", "</tool_call>"

# How a block's text is scanned for its closing tag: not yet started, inside a JSON object, or plain text.
_BEFORE, _JSON, _PLAIN = 0, 1, 2


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass(slots=True)
class StreamEvent:
    """Either content text to stream, or a complete call and its 0-based index among the answer's calls."""

    content: str = ""
    call: ToolCall | None = None
    index: int | None = None


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")  # json.loads would take NaN and Infinity


def _loads(text: str) -> object:
    return json.loads(text, parse_constant=_reject_constant)


def _as_call(block: str) -> ToolCall | None:
    """The call a block's inner text holds, or None when it is not one."""
    try:
        return _call(_loads(block))
    except (ValueError, RecursionError):
        return None


def _call(obj: object) -> ToolCall | None:
    """The call a decoded JSON value is ({"name", "arguments" or "parameters": an object, or JSON text of one}), or
    None when it is not one."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = _loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), name, json.dumps(args, ensure_ascii=False))


class HermesParser:
    """Splits one answer into content and tool calls: `parse` for a whole answer, `feed`/`finish` for
    its deltas (one parser per answer). `schemas`: each function's parameters schema (formats whose values are
    text read them by it)."""

    OPEN, CLOSE = OPEN, CLOSE  # a block's tags
    keeps_special_tokens = False  # the answer's text must keep the tokenizer's special tokens (its tags may be some)

    def __init__(self, schemas: dict[str, Any] | None = None) -> None:
        self._schemas = schemas or {}
        self._text = ""  # outside a block: text held back (a possible start of OPEN)
        self._blank = ""  # whitespace starting the current piece, sent only if the piece turns out not blank
        self._piece_started = False  # the current piece has sent content
        self._in_block = False
        self._block = ""  # inside a block: its text after OPEN
        self._scan = 0  # how far `_block` has been scanned for CLOSE
        self._mode, self._depth, self._in_str, self._escape = _BEFORE, 0, False, False
        self._calls = 0

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, stripped, "" if none; the calls in order) of a whole answer. Leaves this parser's
        stream alone."""
        stream = type(self)(self._schemas)
        events = stream.feed(text) + stream.finish()
        content = "".join(e.content for e in events).strip()
        return content, [e.call for e in events if e.call is not None]

    def feed(self, delta: str) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        rest = delta
        while rest:
            rest = self._feed_block(rest, events) if self._in_block else self._feed_text(rest, events)
        return events

    def finish(self) -> list[StreamEvent]:
        """What is still held, at the end of the answer."""
        events: list[StreamEvent] = []
        if self._in_block:
            self._end_block(self._block, self.OPEN + self._block, events)
        else:
            self._content(self._text, events)
            self._text = ""
        return events

    def _feed_text(self, delta: str, events: list[StreamEvent]) -> str:
        """Takes text outside a block; returns what follows an OPEN it reaches (to be fed to the block)."""
        text = self._text + delta
        start = text.find(self.OPEN)
        if start >= 0:
            self._content(text[:start], events)
            self._text = ""
            self._open_block()
            return text[start + len(self.OPEN):]
        keep = held_back(text, self.OPEN)
        self._content(text[:len(text) - keep], events)
        self._text = text[len(text) - keep:]
        return ""

    def _feed_block(self, delta: str, events: list[StreamEvent]) -> str:
        """Takes text inside a block; returns what follows its CLOSE, if it closes."""
        self._block += delta
        end = self._find_close()
        if end < 0:
            return ""
        block, after = self._block[:end], self._block[end + len(self.CLOSE):]
        self._end_block(block, self.OPEN + block + self.CLOSE, events)
        return after

    def _open_block(self) -> None:
        self._in_block, self._block, self._scan = True, "", 0
        self._mode, self._depth, self._in_str, self._escape = _BEFORE, 0, False, False

    def _find_close(self) -> int:
        """Where CLOSE starts in the block (outside the strings of a JSON object), or -1 as yet."""
        block = self._block
        while self._scan < len(block):
            i = self._scan
            c = block[i]
            if c == "<" and not self._in_str:
                if block.startswith(self.CLOSE, i):
                    return i
                if self.CLOSE.startswith(block[i:]):  # the tag may be arriving: wait for the next delta
                    return -1
            self._lex(c)
            self._scan += 1
        return -1

    def _lex(self, c: str) -> None:
        """Follows a JSON object's strings and nesting, just far enough to know where its strings are."""
        if self._mode == _BEFORE:
            if c == "{":
                self._mode, self._depth = _JSON, 1
            elif not c.isspace():
                self._mode = _PLAIN
        elif self._mode == _JSON:
            if self._in_str:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_str = False
            elif c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._mode = _PLAIN

    def _end_block(self, block: str, raw: str, events: list[StreamEvent]) -> None:
        self._in_block, self._block, self._scan = False, "", 0
        calls = self._block_calls(block)
        if calls is None:
            self._content(raw, events)
            return
        for call in calls:
            events.append(StreamEvent(call=call, index=self._calls))
            self._calls += 1
        self._blank, self._piece_started = "", False  # a new piece; a blank one before the call is dropped

    def _block_calls(self, block: str) -> list[ToolCall] | None:
        """The calls a block's inner text holds (Hermes': one), or None when it is not a block of calls."""
        call = _as_call(block)
        return None if call is None else [call]

    def _typed(self, name: str, params: list[tuple[str, str]]) -> ToolCall:
        """A call of `name` whose parameter values are text: each stays text where the function's schema types
        the parameter a string (or does not know it), and is read as JSON where the schema gives another type (a
        number, boolean, array or object), staying text if it is not JSON."""
        schema = (self._schemas.get(name) or {}).get("properties") or {}
        args: dict[str, Any] = {}
        for key, value in params:
            if (schema.get(key) or {}).get("type", "string") != "string":
                try:
                    value = _loads(value)
                except (ValueError, RecursionError):
                    pass
            args[key] = value
        return ToolCall(new_call_id(), name, json.dumps(args, ensure_ascii=False))

    def _content(self, text: str, events: list[StreamEvent]) -> None:
        """Sends content text, holding the whitespace that starts a piece until the piece has more."""
        if not text:
            return
        if not self._piece_started:
            text = self._blank + text
            if text.isspace():
                self._blank = text
                return
            self._blank, self._piece_started = "", True
        events.append(StreamEvent(content=text))


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


class Qwen3CoderParser(HermesParser):
    """Qwen3-Coder's calls (Qwen3.5's too): Hermes' blocks holding

        <function=get_weather>
        <parameter=city>
        Paris
        </parameter>
        </function>

    instead of JSON. A value loses the newline on each side of it and is read by the function's schema
    (HermesParser._typed). A block of any other shape is content, as Hermes'."""

    def _block_calls(self, block: str) -> list[ToolCall] | None:
        match = _FUNCTION.fullmatch(block)
        if match is None or not match[1].strip() or _PARAMETER.sub("", match[2]).strip():  # text beside: no call
            return None
        params = [(k.strip(), v.removeprefix("\n").removesuffix("\n")) for k, v in _PARAMETER.findall(match[2])]
        return [self._typed(match[1].strip(), params)]


_INVOKE = re.compile(r'<invoke name="([^"\n]+)">(.*?)</invoke>', re.DOTALL)
_NAMED_PARAMETER = re.compile(r'<parameter name="([^"\n]+)">(.*?)</parameter>', re.DOTALL)


class MiniMaxM2Parser(HermesParser):
    """MiniMax-M2's calls: blocks of its own tags holding one or more

        <invoke name="get_weather">
        <parameter name="city">Paris</parameter>
        </invoke>

    each value read by the function's schema (HermesParser._typed). A block holding anything but invokes is
    content."""

    OPEN, CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"

    def _block_calls(self, block: str) -> list[ToolCall] | None:
        invokes = _INVOKE.findall(block)
        if not invokes or _INVOKE.sub("", block).strip() or any(_NAMED_PARAMETER.sub("", body).strip()
                                                                 for _, body in invokes):
            return None
        return [self._typed(name, [(k, v.strip("\n")) for k, v in _NAMED_PARAMETER.findall(body)])
                for name, body in invokes]


_GLM_CALL = re.compile(r"\s*([\w.\-]+)\s*((?:<arg_key>.*?</arg_key>\s*<arg_value>.*?</arg_value>\s*)*)", re.DOTALL)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class Glm45Parser(HermesParser):
    """GLM-4.5's, 4.6's and 4.7's calls: Hermes' blocks holding the function's name and its arguments as key and value
    tags (4.7 writes them without the newlines)

        <tool_call>get_weather
        <arg_key>city</arg_key>
        <arg_value>Paris</arg_value>
        </tool_call>

    each value read by the function's schema (HermesParser._typed). A block of any other shape is content."""

    def _block_calls(self, block: str) -> list[ToolCall] | None:
        match = _GLM_CALL.fullmatch(block)
        if match is None:
            return None
        return [self._typed(match[1], [(k.strip(), v) for k, v in _GLM_ARG.findall(match[2])])]


_DEEPSEEK_V3_CALL = re.compile(r"<｜tool▁call▁begin｜>function<｜tool▁sep｜>([^\n<]+)\n```json\n(.*?)\n```"
                               r"\s*(?:<｜tool▁call▁end｜>|$)", re.DOTALL)
_DEEPSEEK_V31_CALL = re.compile(r"<｜tool▁call▁begin｜>([^<]+?)<｜tool▁sep｜>(.*?)(?:<｜tool▁call▁end｜>|$)", re.DOTALL)


class DeepSeekV3Parser(HermesParser):
    """DeepSeek-V3's and R1's calls (`deepseek_v3`): one block of calls between its tool-call tokens,

        <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
        ```json
        {"city": "Paris"}
        ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

    the arguments JSON. A block holding anything else is content. Its end may be missing (the model stops at its
    end-of-sentence token after the last call); so may the last call's end, where max_tokens cut it."""

    OPEN, CLOSE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    keeps_special_tokens = True  # the tool-call tokens may be special tokens of the checkpoint's tokenizer
    _CALL = _DEEPSEEK_V3_CALL

    def _block_calls(self, block: str) -> list[ToolCall] | None:
        calls = []
        for name, args in self._CALL.findall(block):
            call = _call({"name": name.strip(), "arguments": args})
            if call is None:
                return None
            calls.append(call)
        return calls if calls and not self._CALL.sub("", block).strip() else None


class DeepSeekV31Parser(DeepSeekV3Parser):
    """DeepSeek-V3.1's calls (`deepseek_v31`): the same tokens, each call `NAME<｜tool▁sep｜>{arguments}` with no type
    and no code fence."""

    _CALL = _DEEPSEEK_V31_CALL


_KIMI_K2_CALL = re.compile(r"<\|tool_call_begin\|>([^<]+?)<\|tool_call_argument_begin\|>(.*?)(?:<\|tool_call_end\|>|$)",
                           re.DOTALL)
_KIMI_K2_ID = re.compile(r"\s*(?:functions\.)?([^:\s]+)(?::\d+)?\s*")


class KimiK2Parser(HermesParser):
    """Kimi-K2's calls (`kimi_k2`): one section of calls between its tool-call tokens,

        <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
        {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

    the arguments JSON. Each call keeps the id the model wrote, `functions.NAME:INDEX`: Kimi's chat template renders
    the call and its result under that id, and the model is trained on ids of that form. A section holding anything
    else is content; its end or the last call's end may be missing, as DeepSeek's."""

    OPEN, CLOSE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    keeps_special_tokens = True

    def _block_calls(self, block: str) -> list[ToolCall] | None:
        calls = []
        for call_id, args in _KIMI_K2_CALL.findall(block):
            name = _KIMI_K2_ID.fullmatch(call_id)
            call = _call({"name": name.group(1), "arguments": args}) if name else None
            if call is None:
                return None
            call.id = call_id.strip()
            calls.append(call)
        return calls if calls and not _KIMI_K2_CALL.sub("", block).strip() else None


class TrailingCallsParser:
    """Calls that run from where they start to the answer's end, closing no block: content streams up to that start
    (`_calls_start`), and what follows is held to the end, then is calls if `_read_calls` reads every one, else content
    as written. The interface of HermesParser."""

    keeps_special_tokens = False

    def __init__(self, schemas: dict[str, Any] | None = None) -> None:
        self._text = ""  # held: a possible start, or the calls
        self._held = False  # the calls have started
        self._sent = False  # content has gone out
        self._calls = 0

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """As HermesParser.parse."""
        stream = type(self)()
        events = stream.feed(text) + stream.finish()
        return "".join(e.content for e in events).strip(), [e.call for e in events if e.call is not None]

    def feed(self, delta: str) -> list[StreamEvent]:
        self._text += delta
        if self._held:
            return []
        start, keep = self._calls_start(self._text)
        if start >= 0:
            content, self._text, self._held = self._text[:start], self._text[start:], True
        else:
            content, self._text = self._text[:len(self._text) - keep], self._text[len(self._text) - keep:]
        self._sent = self._sent or bool(content)
        return [StreamEvent(content=content)] if content else []

    def finish(self) -> list[StreamEvent]:
        text, self._text = self._text, ""
        calls = self._read_calls(text) if self._held else None
        if calls is None:
            return [StreamEvent(content=text)] if text else []
        events = [StreamEvent(call=c, index=self._calls + i) for i, c in enumerate(calls)]
        self._calls += len(calls)
        return events

    def _calls_start(self, text: str) -> tuple[int, int]:
        """Where in the held text the calls start, or -1 and how much of its end to hold back (a possible start)."""
        raise NotImplementedError

    def _read_calls(self, text: str) -> list[ToolCall] | None:
        """The calls of the text from their start to the answer's end, or None if any does not read."""
        raise NotImplementedError


PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(TrailingCallsParser):
    """Llama 3.1's to 3.3's calls (`llama3_json`): an answer that is a call is one JSON object, or several joined by
    `;`, each {"name", "parameters" or "arguments"}, after an optional `<|python_tag|>`:

        {"name": "get_weather", "parameters": {"city": "Paris"}}

    An answer that starts otherwise (after whitespace) is content, streamed as it comes; one that starts like a call
    is held to its end, then is calls if every object is one, else content as written."""

    def _calls_start(self, text: str) -> tuple[int, int]:
        start = text.lstrip()
        if self._sent:
            return -1, 0
        if not start or PYTHON_TAG.startswith(start):  # "", "<|pyth": wait for more
            return -1, len(text)
        return (0, 0) if start.startswith(("{", PYTHON_TAG)) else (-1, 0)

    def _read_calls(self, text: str) -> list[ToolCall] | None:
        text = text.strip().removeprefix(PYTHON_TAG).strip()
        decoder, calls, i = json.JSONDecoder(parse_constant=_reject_constant), [], 0
        while i < len(text):
            try:
                obj, end = decoder.raw_decode(text, i)
            except (ValueError, RecursionError):
                return None
            call = _call(obj)
            if call is None:
                return None
            calls.append(call)
            i = end
            while i < len(text) and (text[i].isspace() or text[i] == ";"):
                i += 1
        return calls or None


TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_MISTRAL_CALL = re.compile(r"\s*([\w.\-]+)\s*(?:\[CALL_ID\]\s*\w+\s*)?\[ARGS\](.*)", re.DOTALL)


class MistralParser(TrailingCallsParser):
    """Mistral's calls (`mistral`): after optional content, `[TOOL_CALLS]` and the calls to the answer's end, either
    as the v3 tokenizer's models write them (Mistral-7B v0.3, Mixtral, Mistral Nemo), a JSON array

        [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]

    or as the v11 tokenizer's do (Mistral Small 3.2, Magistral, Devstral, Ministral 3), one call after each tag

        [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

    (`[CALL_ID]id` before `[ARGS]` is read too). Content streams up to the first tag; what follows is held to the
    answer's end and is calls if every call reads, else content as written. The tags are control tokens of Mistral's
    tokenizers, so the answer's text keeps special tokens."""

    keeps_special_tokens = True

    def _calls_start(self, text: str) -> tuple[int, int]:
        return text.find(TOOL_CALLS), held_back(text, TOOL_CALLS)

    def _read_calls(self, text: str) -> list[ToolCall] | None:
        pieces = text.split(TOOL_CALLS)[1:]
        if len(pieces) == 1 and pieces[0].lstrip().startswith("["):
            try:
                value = _loads(pieces[0])
            except (ValueError, RecursionError):
                return None
            calls = [_call(v) for v in (value if isinstance(value, list) else [])]
        else:
            calls = []
            for piece in pieces:
                match = _MISTRAL_CALL.fullmatch(piece)
                calls.append(None if match is None else _call({"name": match[1], "arguments": match[2]}))
        if not calls or None in calls:
            return None
        for call in calls:  # Mistral's chat templates take back only ids of 9 letters and digits
            call.id = "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
        return calls


ToolParser = HermesParser | TrailingCallsParser
PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "qwen3_coder": Qwen3CoderParser,
                                        "minimax_m2": MiniMaxM2Parser, "glm45": Glm45Parser, "glm47": Glm45Parser,
                                        "deepseek_v3": DeepSeekV3Parser, "deepseek_v31": DeepSeekV31Parser,
                                        "kimi_k2": KimiK2Parser, "llama3_json": Llama3JsonParser,
                                        "mistral": MistralParser}


def make_parser(name: str, schemas: dict[str, Any] | None = None) -> ToolParser:
    """A new parser (one per answer) of the `--tool-call-parser` name; `schemas`: the request's functions'
    parameters schemas."""
    try:
        return PARSERS[name](schemas)
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(PARSERS))}") from None
