"""Turns a public GenerateRequest into prompt token ids and SamplingParams, or an error naming the
field. Everything is checked here, before anything is allocated."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import xxhash

from protos import splitserve_pb2 as api
from scheduler_svc.sampling import SamplingParams
from scheduler_svc.tokenizer import ModelTokenizer

CHAT_ROLES = {"system", "user", "assistant", "tool"}
DEFAULT_MAX_TOKENS = 16
MAX_N = 16


class InvalidRequest(ValueError):
    """Bad input; the message names the field and what it allows."""


@dataclass(slots=True)
class ParsedRequest:
    prompt_ids: list[int]
    params: SamplingParams
    n: int
    priority: int

    def completion_params(self, index: int) -> SamplingParams:
        """The parameters of completion `index` of the n: with a seed, each completion gets its own seed
        derived from it (the first keeps it), so the n differ and the request stays reproducible."""
        seed = self.params.seed
        if index == 0 or seed is None:
            return self.params
        return dataclasses.replace(self.params, seed=xxhash.xxh64_intdigest(index.to_bytes(8, "little"), seed))


def prompt_ids(prompt: api.GenerateRequest | api.TokenizeRequest, tokenizer: ModelTokenizer,
               vocab_size: int) -> list[int]:
    kind = prompt.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequest("prompt: set exactly one of text, token_ids or chat")
    if kind == "text":
        if not prompt.text:
            raise InvalidRequest("prompt.text must not be empty")
        ids = tokenizer.encode(prompt.text)
    elif kind == "token_ids":
        ids = list(prompt.token_ids.ids)
        if not ids:
            raise InvalidRequest("prompt.token_ids must not be empty")
        if not 0 <= min(ids) <= max(ids) < vocab_size:
            raise InvalidRequest(f"prompt.token_ids must lie in [0, {vocab_size})")
    else:
        chat = prompt.chat
        if not chat.messages:
            raise InvalidRequest("prompt.chat.messages must not be empty")
        for i, m in enumerate(chat.messages):
            if m.role not in CHAT_ROLES:
                raise InvalidRequest(f"prompt.chat.messages[{i}].role must be one of {sorted(CHAT_ROLES)}, "
                                     f"got {m.role!r}")
        kwargs = {}
        if chat.HasField("enable_thinking"):
            kwargs["enable_thinking"] = chat.enable_thinking
        text = tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in chat.messages],
            add_generation_prompt=chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True,
            **kwargs)
        ids = tokenizer.encode(text, add_special_tokens=False)
    return ids


def parse_generate(req: api.GenerateRequest, tokenizer: ModelTokenizer, max_model_len: int,
                   vocab_size: int) -> ParsedRequest:
    ids = prompt_ids(req, tokenizer, vocab_size)
    s, st = req.sampling, req.stopping

    def opt(msg, name, default):
        return getattr(msg, name) if msg.HasField(name) else default

    params = SamplingParams(
        max_tokens=opt(st, "max_tokens", DEFAULT_MAX_TOKENS), temperature=opt(s, "temperature", 1.0),
        top_p=opt(s, "top_p", 1.0), top_k=opt(s, "top_k", 0), min_p=opt(s, "min_p", 0.0),
        repetition_penalty=opt(s, "repetition_penalty", 1.0), presence_penalty=opt(s, "presence_penalty", 0.0),
        frequency_penalty=opt(s, "frequency_penalty", 0.0), seed=opt(s, "seed", None), stop=list(st.stop),
        stop_token_ids=list(st.stop_token_ids), ignore_eos=st.ignore_eos, min_tokens=opt(st, "min_tokens", 0),
        logprobs=opt(req, "logprobs", None), skip_special_tokens=opt(req, "skip_special_tokens", True))
    try:
        params.validate()
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    if params.stop_token_ids and max(params.stop_token_ids) >= vocab_size:
        raise InvalidRequest(f"stopping.stop_token_ids must lie in [0, {vocab_size})")
    if len(ids) >= max_model_len:
        raise InvalidRequest(f"prompt has {len(ids)} tokens; max_model_len is {max_model_len}")
    if len(ids) + params.max_tokens > max_model_len:
        raise InvalidRequest(f"stopping.max_tokens: prompt ({len(ids)} tokens) + max_tokens "
                             f"({params.max_tokens}) exceeds max_model_len {max_model_len}")
    n = opt(req, "n", 1)
    if not 1 <= n <= MAX_N:
        raise InvalidRequest(f"n must be in [1, {MAX_N}], got {n}")
    return ParsedRequest(ids, params, n, req.priority)
