"""The limits that the scheduler and a worker must agree on: the scheduler plans within them, the worker sizes
its buffers by them. Each side has its own (flags); at the handshake (worker.proto's Describe) the scheduler
states its own and plans within the smaller of each."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

# Tokens of one bad word (SamplingParams.bad_words): a worker keeps each row's last MAX_BAD_WORD_TOKENS - 1 sampled
# tokens to match the tokens before a word's last.
MAX_BAD_WORD_TOKENS = 32


@dataclass(frozen=True, slots=True)
class Limits:
    max_num_seqs: int = 256  # sequences in one step (rows of the persistent batch)
    max_num_batched_tokens: int = 8192  # tokens in one step
    max_model_len: int = 0  # tokens of one sequence, prompt and output; 0: the model's

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value < (0 if f.name == "max_model_len" else 1):
                raise ValueError(f"{f.name} must be at least {0 if f.name == 'max_model_len' else 1}, got {value}")

    def within(self, other: Limits) -> Limits:
        """The smaller of each limit; a max_model_len of 0 (unset) takes the other's."""
        mine, theirs = self.max_model_len, other.max_model_len
        return Limits(min(self.max_num_seqs, other.max_num_seqs),
                      min(self.max_num_batched_tokens, other.max_num_batched_tokens),
                      min(mine, theirs) if mine and theirs else mine or theirs)


def add_arguments(parser: argparse.ArgumentParser, defaults: Limits = Limits()) -> None:
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs,
                        help=f"sequences in one step (default {defaults.max_num_seqs})")
    parser.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens,
                        help=f"tokens in one step (default {defaults.max_num_batched_tokens})")
    parser.add_argument("--max-model-len", type=int, default=defaults.max_model_len,
                        help="tokens of one sequence, prompt and output (default 0: the model's)")


def from_args(args: argparse.Namespace) -> Limits:
    """Raises ValueError naming the limit that is out of range."""
    return Limits(args.max_num_seqs, args.max_num_batched_tokens, args.max_model_len)
