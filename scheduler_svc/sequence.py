"""A request's state in the scheduler: its tokens, its KV blocks and where it is in its life."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from protos import worker_pb2
from scheduler_svc.prefix_hash import ROOT_HASH
from scheduler_svc.sampling import SamplingParams

NEVER = 1 << 63  # start_step while not running: no result is accepted


class SequenceStatus(enum.IntEnum):
    WAITING = 0  # never scheduled
    RUNNING = 1  # the worker holds it
    PREEMPTED = 2  # back in the waiting queue, resumes through the prefix cache (block_manager.py)
    FINISHED = 3


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] | None = None  # (token id, logprob), best first


# eq=False: sequences are compared and hashed by identity (list.remove, sets).
@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    token_ids: list[int]  # every token the scheduler knows: prompt, then generated
    params: SamplingParams  # its seed resolved at the edge (requests.py): a moved sequence samples the same
    request_id: str = ""
    prompt_len: int = 0  # set from token_ids when 0
    status: SequenceStatus = SequenceStatus.WAITING
    priority: int = 0  # larger is more urgent
    arrival: int = 0  # queue order, assigned by the scheduler from arrival count and priority
    # Positions whose KV is computed or scheduled in a plan already handed out (in flight included).
    num_computed_tokens: int = 0
    # len(NewSequence.token_ids) of the current incarnation (the worker's num_sent); later positions are decodes.
    num_sent_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Chained hashes of the full blocks of token_ids (prefix_hash.py), extended lazily; they survive preemption.
    block_hashes: list[int] = field(default_factory=list)
    # The parent hash of its first block (SamplingParams.hash_root): KV is shared only under the same one.
    hash_root: int = ROOT_HASH
    # Leading blocks of block_table already handed to the prefix cache (registered, or hits).
    num_committed_blocks: int = 0
    # Leading blocks of block_table given back: wholly before the sliding window of every position still to
    # compute (Scheduler._release). Their ids stay in the table, no longer held.
    num_released_blocks: int = 0
    # The step that (re)sent it as new: results of earlier steps are stale. NEVER while not running.
    start_step: int = NEVER
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission (usage)
    scheduled_at: float | None = None  # time.monotonic() of its first admission (queue time, in metrics)
    finish_reason: str | None = None  # "stop", "length", "abort" or "grammar" (structured output dead)
    logprobs: list[TokenLogprob] | None = None  # one per generated token when asked for
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.. when asked for (worker-scored)
    # An embedding request's pooled row (Scheduler._add_pooled: a "mean" one's sum over positions [0, pooled_upto))
    pooled: list[float] | None = None
    pooled_upto: int = 0
    # Resolved by the scheduler at admission.
    stop_ids: frozenset[int] = frozenset()  # EOS (unless ignore_eos) and stop_token_ids
    max_len: int = 0  # total length at which it stops: prompt + max_tokens, capped by the model length
    min_len: int = 0  # stop tokens and stop strings are ignored below this total length (min_tokens)
    sampling: worker_pb2.SamplingParams | None = None

    def __post_init__(self) -> None:
        if self.prompt_len == 0:
            self.prompt_len = len(self.token_ids)
        self.hash_root = self.params.hash_root

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
