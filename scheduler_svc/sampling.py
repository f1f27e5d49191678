"""User-facing sampling and stopping parameters, and their resolved form for the worker."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.limits import MAX_BAD_WORD_TOKENS
from common.model_files import POOLING_TYPES, read_json
from protos import worker_pb2
from scheduler_svc.prefix_hash import root_hash

SEED_LIMIT = 1 << 64
# Caps on sizes a request may ask for (each names its field when exceeded).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256  # characters
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024  # tokens one request may bias (OpenAI: 300)
MAX_LOGPROBS = 20  # top alternatives per token
MAX_ALLOWED_TOKEN_IDS = 1 << 16  # tokens one request may restrict sampling to
MAX_BAD_WORDS = 128  # vLLM's VLLM_MAX_NUM_BAD_WORDS
# What an engine process needs of a request's parameters (front-ends keep the stop strings and detokenize).
ENGINE_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "seed", "stop_token_ids", "ignore_eos", "logprobs", "min_tokens", "logit_bias",
                 "allowed_token_ids", "bad_words_token_ids", "prompt_logprobs", "grammar", "pooling", "lora",
                 "cache_salt")
_seed_source = random.SystemRandom()


class InvalidParam(ValueError):
    """A bad sampling or stopping parameter: `field` is its name here, `detail` what it allows."""

    def __init__(self, field: str, detail: str):
        super().__init__(f"{field} {detail}")
        self.field, self.detail = field, detail


@dataclass(slots=True)
class SamplingParams:
    # None: until the model length; 0 (with prompt_logprobs or pooling only): score or embed the prompt
    max_tokens: int | None = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # -1 or 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # None: a random seed is drawn at admission
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # the stop string (or stop token's text) that ended it stays in the text
    logprobs: int | None = None  # None = none, 0 = the sampled token's, n = also the top n
    min_tokens: int = 0
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    allowed_token_ids: list[int] = field(default_factory=list)  # only these may be sampled (vLLM's); empty: any
    bad_words: list[str] = field(default_factory=list)  # words the output may not contain (vLLM's)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # resolved at the edge: resolve_bad_words
    prompt_logprobs: int | None = None  # None = none, 0 = each prompt token's, n = also the top n
    grammar: str | None = None  # llguidance grammar of structured output (scheduler_svc/structured.py)
    pooling: str | None = None  # an embedding request (max_tokens 0): how its hidden states pool (POOLING_TYPES)
    lora: str = ""  # the LoRA adapter (a name the workers loaded) whose weights run it; "": the base model
    cache_salt: str = ""  # cached prefixes are shared only between requests of the same salt (and adapter)

    def validate(self) -> None:
        """Raise InvalidParam (a ValueError) naming the first bad field and what it allows."""
        def bad(name: str, allowed: str, value: object) -> InvalidParam:
            return InvalidParam(name, f"must be {allowed}, got {value!r}")

        if self.max_tokens is not None and self.max_tokens < 1 and not (
                self.max_tokens == 0 and (self.prompt_logprobs is not None or self.pooling)):
            raise bad("max_tokens", "at least 1 (0 only with prompt_logprobs: scoring the prompt)", self.max_tokens)
        if self.pooling is not None and (self.pooling not in POOLING_TYPES or self.max_tokens != 0):
            raise bad("pooling", f"one of {', '.join(POOLING_TYPES)}, with max_tokens 0 (an embedding)", self.pooling)
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise bad("temperature", "a finite number >= 0 (0 = greedy)", self.temperature)
        if not 0.0 < self.top_p <= 1.0:  # NaN fails every comparison
            raise bad("top_p", "in (0, 1]", self.top_p)
        if self.top_k < -1:
            raise bad("top_k", "-1 or 0 (off) or positive", self.top_k)
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]", self.min_p)
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise bad("repetition_penalty", "a finite number > 0 (1 = off)", self.repetition_penalty)
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]", self.presence_penalty)
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:
            raise bad("seed", "in [0, 2**64)", self.seed)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidParam("stop", f"must hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_STRING_LEN:
                got = f"one of {len(s)} characters" if isinstance(s, str) else repr(s)
                raise InvalidParam("stop", f"must hold non-empty strings of at most {MAX_STOP_STRING_LEN} "
                                           f"characters, got {got}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidParam("stop_token_ids", f"must hold at most {MAX_STOP_TOKEN_IDS} ids, "
                                                 f"got {len(self.stop_token_ids)}")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidParam("stop_token_ids", "must be non-negative token ids")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", f"None (off) or in [0, {MAX_LOGPROBS}]", self.logprobs)
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise bad("prompt_logprobs", f"None (off) or in [0, {MAX_LOGPROBS}]", self.prompt_logprobs)
        if self.min_tokens < 0:
            raise bad("min_tokens", ">= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParam("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.grammar is not None and self.ignore_eos:
            raise InvalidParam("ignore_eos", "cannot be set with structured output: it ends where its grammar does")
        if self.grammar is not None and self.min_tokens:
            raise InvalidParam("min_tokens", "cannot be set with structured output: it ends where its grammar does")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidParam("logit_bias", f"must hold at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        for token, bias in self.logit_bias.items():
            if not (isinstance(token, int) and token >= 0):
                raise InvalidParam("logit_bias", f"keys must be non-negative token ids, got {token!r}")
            if not -100.0 <= bias <= 100.0:  # NaN fails
                raise InvalidParam("logit_bias", f"values must be in [-100, 100], got {bias!r} for token {token}")
        if len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
            raise InvalidParam("allowed_token_ids", f"must hold at most {MAX_ALLOWED_TOKEN_IDS} ids, "
                                                    f"got {len(self.allowed_token_ids)}")
        if any(t < 0 for t in self.allowed_token_ids):
            raise InvalidParam("allowed_token_ids", "must be non-negative token ids")
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise InvalidParam("bad_words", f"must hold at most {MAX_BAD_WORDS} words, got {len(self.bad_words)}")
        for word in self.bad_words:
            if not isinstance(word, str) or not word.strip() or len(word) > MAX_STOP_STRING_LEN:
                got = f"one of {len(word)} characters" if isinstance(word, str) else repr(word)
                raise InvalidParam("bad_words", f"must hold words (not only spaces) of at most {MAX_STOP_STRING_LEN} "
                                                f"characters, got {got}")

    def resolve_bad_words(self, encode: Callable[[str], list[int]], vocab_size: int) -> None:
        """bad_words_token_ids from bad_words, as vLLM tokenizes them: each word without its leading spaces, then after
        one space where that gives other tokens of the same count (a word begins the text or follows a space)."""
        resolved = []
        for word in self.bad_words:
            bare = encode(word.lstrip())
            spaced = encode(" " + word.lstrip())
            resolved.append(bare)
            if spaced[0] != bare[0] and len(spaced) == len(bare):
                resolved.append(spaced)
        longest = max(map(len, resolved), default=0)
        if longest > MAX_BAD_WORD_TOKENS:
            raise InvalidParam("bad_words", f"must hold words of at most {MAX_BAD_WORD_TOKENS} tokens, got one of "
                                            f"{longest}")
        if any(t >= vocab_size for ids in resolved for t in ids):
            raise InvalidParam("bad_words", f"must tokenize within the model's vocabulary of {vocab_size}")
        self.bad_words_token_ids = resolved

    @property
    def hash_root(self) -> int:
        """Where its prefix hashes chain from (prefix_hash.root_hash)."""
        return root_hash(self.lora, self.cache_salt)

    def engine_fields(self) -> dict:
        """ENGINE_FIELDS, for the message that hands the request to its engine process."""
        return {name: getattr(self, name) for name in ENGINE_FIELDS}

    def resolved_seed(self) -> int:
        """The user's seed, or a fresh random 64-bit one."""
        return self.seed if self.seed is not None else _seed_source.getrandbits(64)

    def to_proto(self) -> worker_pb2.SamplingParams:
        """The parameters the worker samples with; the seed must be resolved (resolved_seed)."""
        assert self.seed is not None, "the seed is resolved at the edge"
        return worker_pb2.SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            logprobs=-1 if self.logprobs is None else self.logprobs,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=[worker_pb2.BadWord(token_ids=ids) for ids in self.bad_words_token_ids],
            prompt_logprobs=self.prompt_logprobs,
            grammar=self.grammar or "",
            pooling=self.pooling or "",
            lora=self.lora,
        )


# generation_config.json's sampling fields (Hugging Face's name -> ours) that a request leaving them unset takes
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(model_dir: str | Path, source: str = "auto",
                        overrides: dict[str, Any] | None = None) -> dict[str, float | int]:
    """The model creator's sampling defaults, as vLLM's --generation-config and --override-generation-config take
    them: generation_config.json's temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens (as
    max_tokens) where it sets them, read from the model's folder ("auto"), from no file ("vllm") or from the folder
    `source` names; then `overrides` (generation_config.json's names) over them. ValueError where a field is unknown
    or its value not a valid sampling parameter, or the folder named has no generation_config.json."""
    config: dict[str, Any] = {}
    if source != "vllm":
        path = Path(model_dir if source == "auto" else source) / "generation_config.json"
        if source != "auto" and not path.is_file():
            raise ValueError(f"--generation-config {source}: no generation_config.json there (auto: the model's, "
                             "vllm: none)")
        config = read_json(path)
    unknown = sorted(set(overrides or ()) - set(GENERATION_CONFIG_FIELDS))
    if unknown:
        raise ValueError(f"--override-generation-config: {', '.join(unknown)} are not among the sampling fields "
                         f"taken from a generation config ({', '.join(GENERATION_CONFIG_FIELDS)})")
    config = {**config, **(overrides or {})}
    defaults = {ours: config[hf] for hf, ours in GENERATION_CONFIG_FIELDS.items() if config.get(hf) is not None}
    try:
        SamplingParams(**defaults).validate()
    except (InvalidParam, TypeError) as e:
        source_named = "the model's generation_config.json" if source == "auto" else f"--generation-config {source}"
        raise ValueError(f"{source_named}{' with --override-generation-config' if overrides else ''}: {e}") from None
    return defaults
