"""The edge: turns a public GenerateRequest into prompt token ids and SamplingParams, or an error naming the
field. Everything is checked here, before anything is allocated, and the seed is resolved; the offline edge
(LLMEngine.add_request) makes the same checks through check_params and check_prompt_ids."""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jinja2
import xxhash

from common.model_files import TEMPLATE_ARGUMENTS
from protos import splitserve_pb2 as api
from scheduler_svc.sampling import MAX_LOGPROBS, InvalidParam, SamplingParams
from scheduler_svc.structured import InvalidStructured, grammar_of, thinking_tokens
from scheduler_svc.tokenizer import ModelTokenizer, UntrustedTemplate

CHAT_ROLES = {"system", "user", "assistant", "tool"}
DEFAULT_MAX_TOKENS = 16  # when unset, capped by the room the prompt leaves
MAX_N = 16
MAX_REQUEST_ID_LEN = 256  # printable characters
MAX_PRIORITY = 100  # priority in [-MAX_PRIORITY, MAX_PRIORITY]
MAX_CHAT_MESSAGES = 256
MAX_EMBED_INPUTS = 2048  # OpenAI's bound on one embeddings request's inputs
MAX_CACHE_SALT = 256  # characters
# Text is tokenized on the event loop: its size is bounded before that, by bytes per token of the model
# length (real text averages about 4), with a floor for short models.
PROMPT_BYTES_PER_TOKEN = 16
MIN_PROMPT_BYTES = 64 << 10
# SamplingParams field -> its path in the public GenerateRequest, for error messages.
PROTO_FIELD = {"max_tokens": "stopping.max_tokens", "min_tokens": "stopping.min_tokens", "stop": "stopping.stop",
               "stop_token_ids": "stopping.stop_token_ids", "logprobs": "logprobs",
               "skip_special_tokens": "skip_special_tokens", "prompt_logprobs": "prompt_logprobs",
               "ignore_eos": "stopping.ignore_eos"}


class InvalidRequest(ValueError):
    """Bad input; the message names the field (its path in the proto) and what it allows."""


@dataclass(slots=True)
class ParsedRequest:
    prompt_ids: list[int]
    params: SamplingParams
    n: int
    priority: int
    beam_search: bool = False  # the n best beams (beam_search.py) instead of n samples
    length_penalty: float = 1.0  # a beam's score: its logprob over its length to this power

    def completion_params(self, index: int) -> SamplingParams:
        """The parameters of completion `index` of the n: each completion gets its own seed derived from the
        request's (the first keeps it), so the n differ and the request stays reproducible."""
        seed = self.params.seed
        if index == 0:
            return self.params
        return dataclasses.replace(self.params, seed=xxhash.xxh64_intdigest(index.to_bytes(8, "little"), seed))


AnyRequest = api.GenerateRequest | api.EmbedRequest | api.ClassifyRequest


@dataclass(slots=True)
class ParsedEmbed:
    """An Embed or Classify call's checked fields."""
    inputs: list[list[int]]  # each input's token ids
    dimensions: int | None
    normalize: bool | None  # None: the model's
    priority: int
    lora: str


def check_params(params: SamplingParams, vocab_size: int) -> None:
    """Raises InvalidParam naming the first bad field (its SamplingParams name)."""
    params.validate()
    if params.stop_token_ids and max(params.stop_token_ids) >= vocab_size:
        raise InvalidParam("stop_token_ids", f"must lie in [0, {vocab_size}), got {max(params.stop_token_ids)}")
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        raise InvalidParam("logit_bias", f"keys must lie in [0, {vocab_size}), got {max(params.logit_bias)}")
    if params.allowed_token_ids and max(params.allowed_token_ids) >= vocab_size:
        raise InvalidParam("allowed_token_ids", f"must lie in [0, {vocab_size}), got {max(params.allowed_token_ids)}")


def check_prompt_ids(ids: list[int], vocab_size: int, field: str) -> None:
    """Raises InvalidRequest naming `field` unless the prompt holds at least one token id, each in the
    vocabulary."""
    if not ids:
        raise InvalidRequest(f"{field} must not be empty")
    if not 0 <= min(ids) <= max(ids) < vocab_size:
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise InvalidRequest(f"{field} must lie in [0, {vocab_size}), got {bad}")


def max_prompt_bytes(max_model_len: int) -> int:
    return max(MIN_PROMPT_BYTES, PROMPT_BYTES_PER_TOKEN * max_model_len)


def check_text_size(text: str, field: str, max_bytes: int) -> None:
    """Before tokenizing: at most max_bytes of UTF-8 (a character takes 1 to 4)."""
    if len(text) > max_bytes or (len(text) * 4 > max_bytes and len(text.encode("utf-8", "replace")) > max_bytes):
        raise InvalidRequest(f"{field} must be at most {max_bytes} bytes of UTF-8")


def kept_tokens(req: AnyRequest, most: int) -> int | None:
    """How many of a prompt's last tokens the request keeps (truncate_prompt_tokens), or None: all of them. `most`:
    the longest prompt the request may run (a generation's leaves room for a token, a pooled input's need not)."""
    if not req.HasField("truncate_prompt_tokens"):
        return None
    keep = req.truncate_prompt_tokens
    if keep == -1:
        return most
    if not 1 <= keep <= most:
        raise InvalidRequest(f"truncate_prompt_tokens must be -1 (as many as the model takes) or in [1, {most}] "
                             f"(within max_model_len), got {keep}")
    return keep


def prompt_ids(prompt: api.GenerateRequest | api.TokenizeRequest, tokenizer: ModelTokenizer,
               vocab_size: int, max_model_len: int | None = None, keep: int | None = None,
               add_special_tokens: bool | None = None) -> list[int]:
    """The prompt's token ids, its last `keep` only where that is given. With max_model_len, sizes are checked
    before any tokenizing: prompts that cannot fit fail cheaply, whatever their size (text within
    max_prompt_bytes whether or not it is truncated after). add_special_tokens: whether a text's or a rendered chat's
    encoding adds the tokenizer's own (BOS, EOS); None: a text's does, a chat's does not (its template places them)."""
    kind = prompt.WhichOneof("prompt")
    max_bytes = max_prompt_bytes(max_model_len) if max_model_len else None
    if kind is None:
        raise InvalidRequest("prompt must be set: exactly one of text, token_ids or chat")
    if kind == "text":
        if not prompt.text:
            raise InvalidRequest("prompt.text must not be empty")
        if max_bytes:
            check_text_size(prompt.text, "prompt.text", max_bytes)
        ids = tokenizer.encode(prompt.text, add_special_tokens=add_special_tokens is not False)
    elif kind == "token_ids":
        raw = prompt.token_ids.ids
        if max_model_len and len(raw) >= max_model_len and keep is None:
            raise InvalidRequest(f"prompt.token_ids must be fewer than max_model_len ({max_model_len}) tokens, "
                                 f"got {len(raw)}")
        ids = list(raw)
        check_prompt_ids(ids, vocab_size, "prompt.token_ids")
    else:
        chat = prompt.chat
        if not chat.messages:
            raise InvalidRequest("prompt.chat.messages must not be empty")
        if len(chat.messages) > MAX_CHAT_MESSAGES:
            raise InvalidRequest(f"prompt.chat.messages must hold at most {MAX_CHAT_MESSAGES} messages, "
                                 f"got {len(chat.messages)}")
        for i, m in enumerate(chat.messages):
            if m.role not in CHAT_ROLES:
                raise InvalidRequest(f"prompt.chat.messages[{i}].role must be one of {sorted(CHAT_ROLES)}, "
                                     f"got {m.role[:32]!r}")
        if max_bytes:
            check_text_size("".join(m.content + "".join(c.arguments for c in m.tool_calls) for m in chat.messages),
                            "prompt.chat.messages[].content (in all)", max_bytes)
            check_text_size("".join(chat.tools), "prompt.chat.tools (in all)", max_bytes)
            check_text_size(chat.template_kwargs, "prompt.chat.template_kwargs", max_bytes)
            check_text_size(chat.chat_template, "prompt.chat.chat_template", max_bytes)
        kwargs = _template_kwargs(chat)
        if chat.continue_final_message and chat.add_generation_prompt:
            raise InvalidRequest("prompt.chat.continue_final_message continues the last message, which a generation "
                                 "prompt would close: add_generation_prompt must not be true with it")
        try:
            text = tokenizer.apply_chat_template(
                [_chat_message(i, m) for i, m in enumerate(chat.messages)], tools=_tools(chat) or None,
                add_generation_prompt=chat.add_generation_prompt if chat.HasField("add_generation_prompt")
                else not chat.continue_final_message, continue_final_message=chat.continue_final_message,
                chat_template=chat.chat_template or None, **kwargs)
        except InvalidRequest:
            raise
        except UntrustedTemplate as e:
            raise InvalidRequest(f"prompt.chat.chat_template: {e}") from None
        except Exception as e:  # the template's own checks (raise_exception) or a rendering error
            if chat.chat_template and isinstance(e, jinja2.TemplateSyntaxError):
                raise InvalidRequest(f"prompt.chat.chat_template does not compile: {e} (line {e.lineno})") from None
            whose = "the request's chat template" if chat.chat_template else "the chat template"
            raise InvalidRequest(f"prompt.chat.messages: {whose} refused them: {e}") from None
        ids = tokenizer.encode(text, add_special_tokens=bool(add_special_tokens))
    if not ids:
        raise InvalidRequest(f"prompt.{kind} must encode to at least one token")
    return ids if keep is None else ids[-keep:]


def _json_object(text: str, field: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"{field} must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{field} must be a JSON object")
    return value


def _template_kwargs(chat: api.ChatPrompt) -> dict:
    """The chat template's keyword arguments beyond the messages and tools; none may stand for one the renderer passes
    itself."""
    kwargs = _json_object(chat.template_kwargs, "prompt.chat.template_kwargs") if chat.template_kwargs else {}
    for key in kwargs:
        if key in TEMPLATE_ARGUMENTS or not key.isidentifier():
            raise InvalidRequest(f"prompt.chat.template_kwargs.{key[:32]} is not a keyword argument a request may "
                                 f"give the chat template ({', '.join(TEMPLATE_ARGUMENTS)} are the renderer's own)")
    if chat.HasField("enable_thinking"):
        kwargs["enable_thinking"] = chat.enable_thinking
    return kwargs


def _tools(chat: api.ChatPrompt) -> list[dict]:
    return [_json_object(t, f"prompt.chat.tools[{i}]") for i, t in enumerate(chat.tools)]


def _chat_message(i: int, m: api.ChatMessage) -> dict:
    """A message as chat templates read it (OpenAI's shape: tool calls with parsed arguments)."""
    message: dict = {"role": m.role, "content": m.content}
    if m.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.name,
                          "arguments": _json_object(c.arguments, f"prompt.chat.messages[{i}].tool_calls[{j}].arguments")}}
            for j, c in enumerate(m.tool_calls)]
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    return message


def _check_id_and_priority(req: AnyRequest) -> None:
    rid = req.request_id
    if len(rid) > MAX_REQUEST_ID_LEN or not rid.isprintable():
        raise InvalidRequest(f"request_id must be at most {MAX_REQUEST_ID_LEN} printable characters "
                             f"(empty: the server assigns one), got {len(rid)} characters")
    if not -MAX_PRIORITY <= req.priority <= MAX_PRIORITY:
        raise InvalidRequest(f"priority must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}] (larger is more urgent), "
                             f"got {req.priority}")


def _check_lora(req: AnyRequest, lora_adapters: list[str]) -> None:
    if req.lora and req.lora not in lora_adapters:
        raise InvalidRequest(f"lora {req.lora[:64]!r} is not an adapter the workers serve (they serve "
                             f"{', '.join(map(repr, lora_adapters)) or 'none'})")


def parse_embed(req: api.EmbedRequest, tokenizer: ModelTokenizer, max_model_len: int, vocab_size: int,
                hidden_size: int, lora_adapters: list[str] = ()) -> ParsedEmbed:
    """Checks every field, and each input's size before it is tokenized (text with the tokenizer's special tokens,
    as sentence-transformers and vLLM embed it: Qwen3-Embedding's tokenizer closes each input with its EOS);
    `lora_adapters`: those every worker serves."""
    if req.HasField("dimensions") and not 1 <= req.dimensions <= hidden_size:
        raise InvalidRequest(f"dimensions must be in [1, {hidden_size}] (this model's hidden size), "
                             f"got {req.dimensions}")
    inputs = _pooled_inputs(req, tokenizer, max_model_len, vocab_size, lora_adapters)
    return ParsedEmbed(inputs, req.dimensions if req.HasField("dimensions") else None,
                       req.normalize if req.HasField("normalize") else None, req.priority, req.lora)


def parse_classify(req: api.ClassifyRequest, tokenizer: ModelTokenizer, max_model_len: int, vocab_size: int,
                   lora_adapters: list[str] = ()) -> ParsedEmbed:
    """As parse_embed; a text pair is tokenized as the tokenizer pairs two texts (a cross-encoder's input)."""
    return ParsedEmbed(_pooled_inputs(req, tokenizer, max_model_len, vocab_size, lora_adapters), None, None,
                       req.priority, req.lora)


def _pooled_inputs(req: api.EmbedRequest | api.ClassifyRequest, tokenizer: ModelTokenizer, max_model_len: int,
                   vocab_size: int, lora_adapters: list[str]) -> list[list[int]]:
    """Each input's token ids, every field checked and each text's size before it is tokenized."""
    _check_id_and_priority(req)
    _check_lora(req, lora_adapters)
    if not 1 <= len(req.inputs) <= MAX_EMBED_INPUTS:
        raise InvalidRequest(f"inputs must hold 1 to {MAX_EMBED_INPUTS} inputs, got {len(req.inputs)}")
    max_bytes = max_prompt_bytes(max_model_len)
    keep = kept_tokens(req, max_model_len)  # a pooled input samples no token: it may fill the model's length
    inputs = []
    for i, item in enumerate(req.inputs):
        field, kind = f"inputs[{i}]", item.WhichOneof("input")
        if kind == "text":
            if not item.text:
                raise InvalidRequest(f"{field}.text must not be empty")
            check_text_size(item.text, f"{field}.text", max_bytes)
            ids = tokenizer.encode(item.text)
        elif kind == "token_ids":
            ids = list(item.token_ids.ids)
            check_prompt_ids(ids, vocab_size, f"{field}.token_ids")
        elif kind == "pair":
            for name in ("text", "text_pair"):
                if not getattr(item.pair, name):
                    raise InvalidRequest(f"{field}.pair.{name} must not be empty")
            check_text_size(item.pair.text + item.pair.text_pair, f"{field}.pair", max_bytes)
            ids = tokenizer.encode_pair(item.pair.text, item.pair.text_pair)
        else:
            raise InvalidRequest(f"{field} must be set: text or token_ids"
                                 + (" or pair" if isinstance(req, api.ClassifyRequest) else ""))
        if keep is not None:
            ids = ids[-keep:]
        if len(ids) > max_model_len:
            raise InvalidRequest(f"{field}.{kind} must be at most max_model_len ({max_model_len}) tokens, "
                                 f"got {len(ids)}")
        inputs.append(ids)
    return inputs


def parse_generate(req: api.GenerateRequest, tokenizer: ModelTokenizer, max_model_len: int,
                   vocab_size: int, lora_adapters: list[str] = (), defaults: Mapping[str, Any] = {}) -> ParsedRequest:
    """Checks every field, cheap ones first, before anything is tokenized or allocated; `lora_adapters`: those every
    worker serves; `defaults`: the model's sampling defaults (sampling.generation_defaults) for fields left unset."""
    _check_id_and_priority(req)
    if len(req.cache_salt) > MAX_CACHE_SALT:
        raise InvalidRequest(f"cache_salt must be at most {MAX_CACHE_SALT} characters, got {len(req.cache_salt)}")
    _check_lora(req, lora_adapters)
    s, st = req.sampling, req.stopping

    def opt(msg, name, default):
        return getattr(msg, name) if msg.HasField(name) else default

    def sampled(name: str, ours: float) -> float:
        """A sampling field as the request sets it, else as the model's defaults do, else ours."""
        return opt(s, name, defaults.get(name, ours))

    n = opt(req, "n", 1)
    if not 1 <= n <= MAX_N:
        raise InvalidRequest(f"n must be in [1, {MAX_N}], got {n}")
    max_tokens = opt(st, "max_tokens", None)
    default_max_tokens = defaults.get("max_tokens", DEFAULT_MAX_TOKENS)
    params = SamplingParams(
        max_tokens=default_max_tokens if max_tokens is None else max_tokens, temperature=sampled("temperature", 1.0),
        top_p=sampled("top_p", 1.0), top_k=sampled("top_k", 0), min_p=sampled("min_p", 0.0),
        repetition_penalty=sampled("repetition_penalty", 1.0), presence_penalty=opt(s, "presence_penalty", 0.0),
        frequency_penalty=opt(s, "frequency_penalty", 0.0), seed=opt(s, "seed", None), stop=list(st.stop),
        stop_token_ids=list(st.stop_token_ids), ignore_eos=st.ignore_eos, min_tokens=opt(st, "min_tokens", 0),
        include_stop_str_in_output=st.include_stop_str_in_output,
        logprobs=opt(req, "logprobs", None), skip_special_tokens=opt(req, "skip_special_tokens", True),
        logit_bias=dict(s.logit_bias), allowed_token_ids=list(s.allowed_token_ids), bad_words=list(s.bad_words),
        prompt_logprobs=opt(req, "prompt_logprobs", None), lora=req.lora,
        cache_salt=req.cache_salt)
    try:
        if req.HasField("structured"):
            params.grammar = grammar_of(req.structured, tokenizer.is_special)
            missing = [t for t in thinking_tokens(req.structured.reasoning) if not tokenizer.is_special(t)]
            if missing:
                raise InvalidStructured("structured.reasoning", f"{req.structured.reasoning} needs the special tokens "
                                        f"{', '.join(missing)}, which this model's tokenizer lacks")
        check_params(params, vocab_size)
        params.resolve_bad_words(lambda word: tokenizer.encode(word, add_special_tokens=False), vocab_size)
    except InvalidStructured as e:
        raise InvalidRequest(f"{e.field} {e.detail}") from None
    except InvalidParam as e:
        raise InvalidRequest(f"{PROTO_FIELD.get(e.field, 'sampling.' + e.field)} {e.detail}") from None
    ids = prompt_ids(req, tokenizer, vocab_size, max_model_len, kept_tokens(req, max_model_len - 1))
    kind = req.WhichOneof("prompt")
    if len(ids) >= max_model_len:
        raise InvalidRequest(f"prompt.{kind} must be fewer than max_model_len ({max_model_len}) tokens, "
                             f"got {len(ids)}")
    room = max_model_len - len(ids)
    if max_tokens is None:
        params.max_tokens = min(default_max_tokens, room)
        if params.min_tokens > params.max_tokens:
            raise InvalidRequest(f"stopping.min_tokens ({params.min_tokens}) must not exceed max_tokens "
                                 f"({params.max_tokens}: the default, capped by the model length)")
    elif params.max_tokens > room:
        raise InvalidRequest(f"stopping.max_tokens must be at most {room}: prompt ({len(ids)} tokens) + "
                             f"max_tokens ({params.max_tokens}) exceeds max_model_len ({max_model_len})")
    # Resolved here, once: a request moved to another worker samples the same.
    params.seed = params.resolved_seed()
    if req.use_beam_search:
        _check_beam_search(req, n)
    elif req.HasField("length_penalty"):
        raise InvalidRequest("length_penalty applies to beam search only (use_beam_search)")
    return ParsedRequest(ids, params, n, req.priority, req.use_beam_search,
                         req.length_penalty if req.HasField("length_penalty") else 1.0)


def _check_beam_search(req: api.GenerateRequest, n: int) -> None:
    """Beam search scores the model's own logprobs, greedily: nothing that samples, stops or constrains otherwise."""
    s, st = req.sampling, req.stopping
    given = [f"sampling.{f}" for f in ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                                        "frequency_penalty") if s.HasField(f)]
    given += [f"sampling.{f}" for f in ("logit_bias", "allowed_token_ids", "bad_words") if len(getattr(s, f))]
    given += [f"stopping.{f}" for f in ("stop", "stop_token_ids") if len(getattr(st, f))]
    given += ["sampling.temperature"] * (s.HasField("temperature") and s.temperature > 0)
    given += ["stopping.min_tokens"] * (st.HasField("min_tokens") and st.min_tokens > 0)
    given += ["stopping.include_stop_str_in_output"] * st.include_stop_str_in_output
    given += [f for f in ("logprobs", "prompt_logprobs", "structured") if req.HasField(f)]
    if given:
        raise InvalidRequest(f"{given[0]} cannot be set with use_beam_search (beam search keeps the likeliest beams, "
                             "greedily)")
    if n > MAX_LOGPROBS // 2:
        raise InvalidRequest(f"n must be at most {MAX_LOGPROBS // 2} with use_beam_search (each beam is extended by "
                             f"its {2 * n} likeliest tokens), got {n}")
    if not math.isfinite(req.length_penalty):
        raise InvalidRequest("length_penalty must be a finite number")
