"""A model folder's tokenizer without transformers: its tokenizer.json (or tiktoken ranks converted:
model_files.tokenizer_json) through `tokenizers`, EOS ids from generation_config.json and config.json, and the chat
template rendered with jinja2 the way transformers renders it."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from common.model_files import SPECIAL_TOKEN_KEYS, eos_token_ids, read_json, tokenizer_json


@dataclass(slots=True)
class ModelTokenizer:
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]
    vocab_size: int  # with added tokens
    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ... for the template
    # whether a request may bring a template of its own (vLLM's --trust-request-chat-template): the sandbox keeps it
    # from the host, not from looping for as long as it likes on the thread that renders it
    trust_request_chat_template: bool = False
    _specials: frozenset[str] | None = None

    def is_special(self, text: str) -> bool:
        """Whether `text` is one of the tokenizer's special tokens."""
        if self._specials is None:
            self._specials = frozenset(t.content for t in self.tokenizer.get_added_tokens_decoder().values()
                                       if t.special)
        return text in self._specials

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(self, text: str, pair: str) -> list[int]:
        """Two texts as one input, joined as the tokenizer's post-processor pairs them (a cross-encoder's)."""
        return self.tokenizer.encode(text, pair, add_special_tokens=True).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        tokenize: bool = False,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render messages (extra kwargs such as enable_thinking reach the template). continue_final_message: the last
        message's text is left open, as transformers does it: rendered with a tag after it, cut at the tag.
        chat_template: a request's own template in place of the model's (UntrustedTemplate unless trusted;
        jinja2.TemplateSyntaxError where it does not compile)."""
        if chat_template is not None and not self.trust_request_chat_template:
            raise UntrustedTemplate("a request's own chat template is rendered only where the scheduler runs with "
                                    "--trust-request-chat-template")
        if chat_template is not None:
            template = _request_template(chat_template)
        elif self.chat_template is not None:
            template = _model_template(self.chat_template)
        else:
            raise ValueError("this model has no chat template")
        final = messages[-1].get("content") if continue_final_message else None
        if continue_final_message:
            if not isinstance(final, str):
                raise ValueError("continue_final_message needs a final message with text content")
            messages = [*messages[:-1], {**messages[-1], "content": final + _CONTINUE_TAG}]
        text = template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
            **kwargs,
        )
        if continue_final_message:
            if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
                raise ValueError("continue_final_message: the chat template does not render the final message's text "
                                 "as given")
            cut = text.rindex(_CONTINUE_TAG.strip())
            text = text[:cut] if text.startswith(_CONTINUE_TAG, cut) else text[:cut].rstrip()
        return self.encode(text, add_special_tokens=False) if tokenize else text


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker of where a continued message is cut


class UntrustedTemplate(ValueError):
    """A request brought a chat template of its own where the server renders only the model's."""


def _compile(source: str) -> jinja2.Template:
    return _environment().from_string(source)


# Compiled once each: the model's templates (one a tokenizer), and apart from them, so that requests bringing many
# cannot evict the model's, the last few that requests brought.
_model_template = functools.lru_cache(maxsize=None)(_compile)
_request_template = functools.lru_cache(maxsize=32)(_compile)


def _environment() -> ImmutableSandboxedEnvironment:
    # As transformers' chat-template renderer.
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "...", ...} in older tokenizer configs
        return value.get("content")
    return value


def read_chat_template(given: str) -> str:
    """vLLM's --chat-template: a file's text, or the template itself where it is not a file (it then holds a jinja
    tag or a line break; anything else is taken for a file's path that is not there: ValueError)."""
    path = Path(given)
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError as e:  # a long template is no path
        if "{" not in given:
            raise ValueError(f"cannot read the chat template {given!r}: {e}") from None
    if any(c in given for c in "{}\n"):
        return given
    raise ValueError(f"the chat template {given!r} is neither a file nor a template")


def load_tokenizer(model_dir: str | Path, chat_template: str | None = None,
                   trust_request_chat_template: bool = False) -> ModelTokenizer:
    """The folder's tokenizer; chat_template (read_chat_template's) in place of the folder's own;
    trust_request_chat_template: requests may bring their own."""
    model_dir = Path(model_dir)
    tokenizer = Tokenizer.from_str(tokenizer_json(model_dir))
    tok_config = read_json(model_dir / "tokenizer_config.json")
    special = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(tok_config.get(k))) is not None}

    eos = eos_token_ids(model_dir)
    if not eos and "eos_token" in special:
        eos_id = tokenizer.token_to_id(special["eos_token"])
        if eos_id is not None:
            eos.append(eos_id)

    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja_file = model_dir / "chat_template.jinja"
    if template is None and jinja_file.exists():
        template = jinja_file.read_text(encoding="utf-8")
    if chat_template is not None:
        template = chat_template

    return ModelTokenizer(
        tokenizer=tokenizer,
        eos_token_ids=tuple(eos),
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        chat_template=template,
        special_tokens=special,
        trust_request_chat_template=trust_request_chat_template,
    )
