"""A request's outputs: each token an engine samples, turned into text by the request's detokenizer, with the
finish and stop reasons and, at the end, the usage. The offline LLMEngine and the service's front-ends both
make them here."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from common.usage import Usage
from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.sampling import SamplingParams
from scheduler_svc.sequence import TokenLogprob


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    token_ids: list[int]  # new since the previous output
    text: str  # new text since the previous output
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "abort" or "grammar" (structured output dead)
    logprobs: list[TokenLogprob] | None = None  # for token_ids, when asked for
    usage: Usage | None = None  # on the final output
    stop_reason: str | None = None  # with reason "stop": the stop string, or the stop token's id in decimal
    prompt_logprobs: list[TokenLogprob] | None = None  # on a completion's first output, when asked for
    prompt_token_ids: list[int] | None = None  # with prompt_logprobs: the prompt's every token id
    # an embedding request's (SamplingParams.pooling) final output: its row as pooled ("mean": the sum of its rows)
    pooled: list[float] | None = None


class OutputState:
    """One request's text so far. `cached_tokens`: its prompt tokens the prefix cache served at its first
    admission, set by the caller once known."""
    __slots__ = ("request_id", "detokenizer", "prompt_len", "min_len", "num_output", "cached_tokens", "scoring")

    def __init__(self, request_id: str, tokenizer: Tokenizer, token_ids: list[int], prompt_len: int,
                 params: SamplingParams):
        self.request_id = request_id
        self.detokenizer = IncrementalDetokenizer(tokenizer, token_ids[:prompt_len], params.skip_special_tokens,
                                                  params.stop, params.include_stop_str_in_output)
        self.prompt_len = prompt_len
        self.min_len = prompt_len + params.min_tokens  # stop strings count from this total length
        self.num_output = len(token_ids) - prompt_len
        self.cached_tokens: int | None = None
        # max_tokens 0 (with prompt_logprobs): the prompt is scored and nothing generated. The engine runs it as
        # max_tokens 1, and the one token sampled at the prompt's end is dropped here.
        self.scoring = params.max_tokens == 0

    def output(self, token_id: int, finish_reason: str | None,
               logprob: TokenLogprob | None = None) -> tuple[RequestOutput, bool]:
        """The output of one new token, given how the engine left the sequence, and whether a stop string
        ended it here (the engine must then be told: a stop string is found only here)."""
        if self.scoring:  # the token sampled at the prompt's end finished it: none of it is output
            out = RequestOutput(self.request_id, [], "", True, "length")
            out.usage = self.usage()
            return out, False
        text, reason, stop_reason = self.next(token_id, finish_reason)
        out = RequestOutput(self.request_id, [token_id], text, reason is not None, reason,
                            None if logprob is None else [logprob], stop_reason=stop_reason)
        if reason is not None:
            out.usage = self.usage()
        return out, reason == "stop" and finish_reason != "stop"

    def next(self, token_id: int, finish_reason: str | None) -> tuple[str, str | None, str | None]:
        """One new token of a request that does not score its prompt: (text delta, finish reason, stop reason) as
        IncrementalDetokenizer.next gives them (a stop string found here finishes it whatever finish_reason said)."""
        self.num_output += 1
        return self.detokenizer.next(token_id, finish_reason, self.prompt_len + self.num_output >= self.min_len)

    def usage(self) -> Usage:
        return Usage(self.prompt_len, self.num_output, self.cached_tokens or 0)


def embedding(pooled: Sequence[float], kind: str, prompt_len: int, dimensions: int | None,
              normalize: bool) -> list[float]:
    """A pooled row as the request asks for it: a "mean" row's sum divided by the prompt's length, the first
    `dimensions` values (Matryoshka), L2-normalised."""
    values = np.asarray(pooled, dtype=np.float64)[:dimensions]
    if kind == "mean":
        values = values / prompt_len
    if normalize and (norm := np.linalg.norm(values)) > 0:
        values = values / norm
    return values.tolist()


def class_probs(logits: Sequence[float], activation: str) -> list[float]:
    """A classifier's probabilities of its logits (common/model_files.Classifier.activation)."""
    values = np.asarray(logits, dtype=np.float64)
    if activation == "sigmoid":
        return (1.0 / (1.0 + np.exp(-values))).tolist()
    values = np.exp(values - values.max())
    return (values / values.sum()).tolist()
