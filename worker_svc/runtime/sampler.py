"""Sampling on the device without host syncs.

Every random draw comes from a counter-based hash of (seed, position, token id), so a seeded request
samples the same tokens whatever else is in the batch, and after a preemption it re-samples exactly
what it sampled before. Unseeded requests get a random seed from the scheduler; one code path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from worker_svc.kernels import Kernels
from worker_svc.kernels.reference import gumbel_race


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling parameters of one step (rows = sequences that sample)."""
    temperature: torch.Tensor          # float32 [S]; 0 = greedy
    seeds: torch.Tensor                # int64 [S]
    positions: torch.Tensor            # int64 [S]: position of the token being sampled
    top_k: torch.Tensor | None         # int64 [S], vocab size where off; None if no row uses it
    top_p: torch.Tensor | None         # float32 [S], 1 where off
    min_p: torch.Tensor | None         # float32 [S], 0 where off
    all_greedy: bool
    max_logprobs: int                  # -1: no row wants logprobs; else the largest top-n asked


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor            # int64 [S]
    logprobs: torch.Tensor | None      # float32 [S]: log p(sampled token) under the model
    top_ids: torch.Tensor | None       # int64 [S, max_logprobs]
    top_logprobs: torch.Tensor | None  # float32 [S, max_logprobs]


def sample(logits: torch.Tensor, batch: SamplingBatch, kernels: Kernels) -> SamplerOutput:
    """logits: [S, vocab], already penalised; float32 where logprobs are asked for."""
    if kernels.sampling_dtype is not None:
        logits = logits.to(kernels.sampling_dtype)
    logprobs = top_ids = top_logprobs = None
    if batch.max_logprobs >= 0:
        all_logprobs = torch.log_softmax(logits, dim=-1)
    if batch.top_k is None and batch.top_p is None and batch.min_p is None:
        tokens = kernels.gumbel_argmax(logits, batch.temperature, batch.seeds, batch.positions)
    elif batch.all_greedy:
        tokens = logits.argmax(dim=-1)
    else:
        tokens = gumbel_race(logits, batch.temperature, batch.seeds, batch.positions, lambda x: _filter(x, batch))
    if batch.max_logprobs >= 0:
        logprobs = all_logprobs.gather(-1, tokens[:, None]).squeeze(-1)
        if batch.max_logprobs > 0:
            top_logprobs, top_ids = all_logprobs.topk(batch.max_logprobs, dim=-1)
    return SamplerOutput(tokens, logprobs, top_ids, top_logprobs)


def _filter(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.top_k is not None or batch.top_p is not None:
        sorted_x, order = x.sort(dim=-1, descending=True)
        drop = torch.zeros_like(sorted_x, dtype=torch.bool)
        if batch.top_k is not None:
            ranks = torch.arange(x.shape[-1], device=x.device)[None, :]
            drop |= ranks >= batch.top_k[:, None]
        if batch.top_p is not None:
            probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
            before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above
            drop |= before >= batch.top_p[:, None]  # the top token always stays (before = 0)
        x = torch.empty_like(x).scatter_(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    if batch.min_p is not None:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < batch.min_p[:, None] * probs.max(dim=-1, keepdim=True).values,
                          float("-inf"))
    return x


class Penalties:
    """Repetition (prompt and output tokens), presence and frequency (output tokens) penalties.

    Token statistics live on the device per persistent-batch row; allocated on first use, since
    [rows, vocab] is large and most requests use no penalty."""

    def __init__(self, rows: int, vocab: int, device: torch.device):
        self.counts = torch.zeros(rows, vocab, dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros(rows, vocab, dtype=torch.bool, device=device)

    def reset_row(self, row: int, prompt_ids: torch.Tensor, output_ids: torch.Tensor) -> None:
        self.counts[row].zero_()
        self.in_prompt[row].zero_()
        self.in_prompt[row, prompt_ids] = True
        self.counts[row].index_add_(0, output_ids, torch.ones_like(output_ids, dtype=torch.int32))

    def apply(self, logits: torch.Tensor, rows: torch.Tensor, repetition: torch.Tensor,
              presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
        counts = self.counts[rows]
        seen = self.in_prompt[rows] | (counts > 0)
        rep = repetition[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)

    def record(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        self.counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.int32),
                               accumulate=True)


class RecentTokens:
    """Each persistent-batch row's last `width` sampled tokens on the device (-1 before its first), for bad words:
    a word's last token is banned where the tokens before it end the row's output. Kept on the device, as penalties'
    counts are, so that a step launched before the previous one's tokens reach the host still sees them; allocated
    on first use."""

    def __init__(self, rows: int, width: int, device: torch.device):
        self.tokens = torch.full((rows, width), -1, dtype=torch.int64, device=device)

    def reset_row(self, row: int, output_ids: torch.Tensor) -> None:
        """The row's tokens: the last `width` of output_ids (a preempted sequence's), -1 before them."""
        self.tokens[row] = -1
        kept = output_ids[-self.tokens.shape[1]:]
        if len(kept):
            self.tokens[row, self.tokens.shape[1] - len(kept):] = kept

    def record(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        self.tokens[rows] = torch.cat([self.tokens[rows, 1:], tokens[:, None]], dim=1)

    def ban(self, logits: torch.Tensor, rows: torch.Tensor, word_row: torch.Tensor, before: torch.Tensor,
            last: torch.Tensor) -> torch.Tensor:
        """logits [S, vocab] of the sampling rows `rows` with each word's last token at -inf where the row's recent
        tokens end with the word's tokens before it (-1 in `before`: no token asked there). word_row: each word's
        index into rows."""
        recent = self.tokens[rows[word_row]]
        ends = ((recent == before) | (before < 0)).all(dim=1)
        banned = torch.where(ends, float("-inf"), 0.0).to(logits.dtype)
        return logits.index_put((word_row, last), banned, accumulate=True)
