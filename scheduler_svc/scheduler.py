"""Continuous batching over one worker group: turns waiting and running sequences into StepPlans
(deltas against the worker's state) and applies StepResults.

Order: a sequence's `arrival` is its arrival count minus priority_aging x its priority, so a more
urgent request (larger priority) is admitted first and preempted last, equal priorities stay first
come first served, and a request is overtaken by at most priority_aging x (difference in priority)
requests that arrive after it (the bound on starvation). "Arrival order" below means this order.

Policy, per step: one token budget. Decodes of running sequences first, oldest first; then prompts
already partially prefilled continue; then waiting sequences are admitted in arrival order; all in
one mixed plan. Prefill chunks get at most `chunk_cap` tokens in that pass so several prompts
progress side by side; budget left over afterwards goes back to the capped chunks, oldest first.
KV blocks are allocated chunk by chunk. When a decode needs a block and none is free, the newest
running sequence is preempted and goes back to the waiting queue in arrival order; a continuing prefill
with no free block preempts newer prefills not scheduled yet, or waits. The head of the waiting queue, where
it finds no room (blocks for its first chunk, or a slot under max_num_seqs), and a prompt still prefilling,
where its next chunk finds none, preempt the last running sequences while they are less urgent (a smaller
priority, and after it in arrival order), before the step's decodes are planned, and a less urgent prompt's
chunk leaves the head's first chunk of the budget: an urgent request does not wait for less urgent ones to
end. A preempted sequence resumes through the prefix cache: its full blocks are hit where they are, on the
GPU or (with a host tier, block_manager.py) swapped back in from the host, and the rest is recomputed. While a
reload of the worker's weights is asked for (weights.py), sequences added after the ask are not admitted.

Pipelining: schedule() for step N+1 may run before the result of step N is applied. Every length is
known, so a decode is scheduled for the token still being sampled. Rules that keep this exact:
- a sequence is not scheduled past its length limit: max_tokens never wastes a step;
- a sequence that stops at step N (EOS, stop token, stop string) may have a decode in flight at N+1;
  its id reaches the worker in the next plan's finished_ids and the extra token is discarded;
- the scheduler knows which sequences sample in each plan it hands out and checks each result
  against that list; a token is accepted only from a sequence still RUNNING in the incarnation that
  plan ran (start_step <= step); anything else (finished, aborted, preempted, or a result from
  before a resume) is discarded, and a preempted sequence recomputes from the tokens it knows;
- a sequence's preemption reaches the worker before it is resent: it is never admitted in a plan
  that carries its preempted id, and a plan is sent even with nothing to run when it carries
  preempted ids;
- blocks freed while a plan is in flight may be reused at once (the worker runs plans in order);
  a block is registered in the prefix cache only after the plan computing its last token is handed
  out, and never in the plan that computes it, so a hit never reads KV written in the same step.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from common.util import cdiv
from protos import worker_pb2
from scheduler_svc.adapters import AdapterPlan, Adapters
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.sequence import NEVER, Sequence, SequenceStatus, TokenLogprob
from scheduler_svc.weights import WeightsOutcome, WeightsUpdate

RUNNING = SequenceStatus.RUNNING
PREEMPTED = SequenceStatus.PREEMPTED
FINISHED = SequenceStatus.FINISHED
WAITING = SequenceStatus.WAITING


class _InFlight(NamedTuple):
    step: int
    sampling: list[Sequence]  # the sequences that sample in the plan, in result order
    sampling_ids: list[int]


@dataclass(slots=True)
class _Draft:
    """The plan one schedule() call is building: what each of its passes decided so far."""
    step: int
    budget: int  # tokens the step may still schedule
    cap: int  # the most tokens of a prefill chunk in the first passes
    decodes: list[Sequence] = field(default_factory=list)  # in the plan's column order
    grew: list[int] = field(default_factory=list)  # indices into decodes of those given a new block
    decode_blocks: list[int] = field(default_factory=list)  # those blocks, in that order
    completes: list[Sequence] = field(default_factory=list)  # decodes whose last block this step completes
    partial: list[Sequence] = field(default_factory=list)  # running sequences still prefilling, in arrival order
    chunks: list[list] = field(default_factory=list)  # continued prefills: [seq, n, table length before]
    admitted: list[list] = field(default_factory=list)  # new sequences: [seq, n, num computed before]
    capped: list[list] = field(default_factory=list)  # entries of both whose chunk was cut at the cap
    released: list[tuple[int, int]] = field(default_factory=list)  # (seq id, blocks given back behind the window)


class QueueFullError(RuntimeError):
    """The waiting queue is at max_waiting: admission refused."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, num_blocks: int, block_size: int, eos_token_ids: Iterable[int] = (),
                 epoch: int = 0, num_host_blocks: int = 0, sliding_window: int = 0, adapters: Adapters | None = None,
                 whole_prompts: bool = False):
        """config.limits.max_model_len must be resolved (the worker's, or smaller); num_blocks, block_size and
        num_host_blocks: the worker's KV cache and its host pool; sliding_window: the model's when every layer
        has one (DescribeResponse.sliding_window), else 0; adapters: the worker's LoRA adapters (none: no slots);
        whole_prompts: a sequence is admitted only with its whole prompt in one step (an encoder's,
        DescribeResponse.encoder: its attention sees both ways), so no prompt may be longer than a step."""
        if config.limits.max_model_len < 1:
            raise ValueError("max_model_len must be resolved against the worker's before scheduling")
        self.config = config
        self.block_manager = BlockManager(num_blocks, block_size, config.enable_prefix_caching, num_host_blocks)
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.max_model_len = config.limits.max_model_len
        self.whole_prompts = whole_prompts
        if whole_prompts and self.max_model_len > config.limits.max_num_batched_tokens:
            raise ValueError("whole prompts need max_model_len within max_num_batched_tokens")
        self.eos_token_ids = frozenset(eos_token_ids)
        self.epoch = epoch
        self.adapters = adapters or Adapters([], [])
        # (adapter, why, its sequences) for each LoRA adapter that could not be read again: the sequences that
        # waited for it are finished (reason "abort"), for the caller to take and answer with why.
        self.lost: list[tuple[str, str, list[Sequence]]] = []
        self.weights: WeightsUpdate | None = None  # a reload of the worker's weights asked for (weights.py)
        self.weights_outcomes: list[WeightsOutcome] = []
        self.waiting: deque[Sequence] = deque()  # in arrival order
        self.running: list[Sequence] = []  # in arrival order; the last one is preempted first
        self._seqs: dict[int, Sequence] = {}  # every sequence not finished
        self._in_flight: deque[_InFlight] = deque()
        self._finished_ids: list[int] = []  # for the next plan
        self._preempted_ids: list[int] = []  # for the next plan
        self._step = 0  # of the latest plan
        self._arrivals = 0
        self._waiting_tokens = 0
        self.num_preemptions = 0
        self.num_prefix_hit_tokens = 0  # prompt (and resume) tokens served from the prefix cache
        self.num_host_hit_tokens = 0  # of those, the ones swapped in from the host tier
        self.num_admitted_tokens = 0  # tokens of every admission, the hit rate's denominator
        self.num_released_blocks = 0  # given back behind the sliding window

    # --- admission and removal -------------------------------------------------------------------

    def add(self, seq: Sequence, force: bool = False) -> None:
        """Queue a new sequence whose parameters were validated at the edge (requests.py). Raises
        QueueFullError, or ValueError when it does not fit this worker group (its model length or its
        blocks: groups may differ).

        A sequence may come with generated tokens already (token_ids longer than prompt_len: a request
        moved from another worker group); its limits count from its prompt. force: admit it beyond
        max_waiting (it was admitted once already)."""
        cfg = self.config
        if len(self.waiting) >= cfg.max_waiting and not force:
            raise QueueFullError(f"waiting queue is full ({cfg.max_waiting} requests)")
        n = len(seq.token_ids)
        if n == 0:
            raise ValueError("prompt is empty")
        if seq.seq_id in self._seqs:
            raise ValueError(f"sequence id {seq.seq_id} is already in use")
        params = seq.params
        p = seq.prompt_len
        max_new = params.max_tokens if params.max_tokens is not None else self.max_model_len - p
        if max_new == 0 and (params.prompt_logprobs is not None or params.pooling):
            # Scoring or embedding a prompt (max_tokens 0): run as max_tokens 1. The token sampled with the prompt's
            # last chunk (an embedding's worker samples none: a 0) finishes it ("length") in that same step, no
            # decode is scheduled, and OutputState drops the token.
            max_new = 1
        # a pooled input's one step samples no token (a 0 stands for it): its prompt may fill max_model_len
        length = p + max_new - 1 if params.pooling else p + max_new
        if max_new < 1 or length > self.max_model_len or n >= p + max_new:
            raise ValueError(
                f"prompt ({p} tokens) + max_tokens ({max_new}) exceeds max_model_len ({self.max_model_len})"
            )
        # The last token is never fed back, so max_len - 1 positions of KV.
        blocks = min(cdiv(p + max_new - 1, self.block_size), self._window_blocks())
        if blocks > self.block_manager.num_blocks:
            raise ValueError(f"prompt ({p} tokens) + max_tokens ({max_new}) needs {blocks} KV blocks, the worker "
                             f"has {self.block_manager.num_blocks}")
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        seq.stop_ids = frozenset(stop_ids)
        seq.max_len = p + max_new
        seq.min_len = seq.prompt_len + params.min_tokens
        seq.sampling = params.to_proto()
        if params.logprobs is None:
            seq.logprobs = None
        elif seq.logprobs is None:
            seq.logprobs = []
        if params.prompt_logprobs is None:
            seq.prompt_logprobs = None
        elif seq.prompt_logprobs is None:
            seq.prompt_logprobs = []
        seq.arrival = self._arrivals - cfg.priority_aging * seq.priority
        self._arrivals += 1
        seq.status = WAITING
        if not self.waiting or self.waiting[-1].arrival <= seq.arrival:
            self.waiting.append(seq)
        else:
            bisect.insort(self.waiting, seq, key=_arrival)
        self._waiting_tokens += n
        self._seqs[seq.seq_id] = seq

    def get(self, seq_id: int) -> Sequence | None:
        return self._seqs.get(seq_id)

    def abort(self, seq_id: int) -> bool:
        """Finish a sequence in any state with reason "abort"; every block it holds comes back."""
        return self.finish(seq_id, "abort")

    def finish(self, seq_id: int, reason: str) -> bool:
        """Finish a live sequence (e.g. a stop string found by the detokenizer). False if not live."""
        seq = self.get(seq_id)
        if seq is None:
            return False
        self._finish(seq, reason)
        return True

    def stop(self, seq: Sequence) -> None:
        """A stop string ended seq at its latest token (the detokenizer found it): it finishes with reason
        "stop", also when that token had already finished it by length."""
        if seq.status is FINISHED:
            seq.finish_reason = "stop"
        else:
            self._finish(seq, "stop")

    def take_lost(self) -> list[tuple[str, str, list[Sequence]]]:
        """The LoRA adapters lost since the last call: (adapter, why, the sequences that were waiting for it)."""
        lost, self.lost = self.lost, []
        return lost

    def update_weights(self, path: str, ticket: object = None) -> None:
        """Asks for the worker's weights to be read again from the checkpoint folder at path, once every sequence
        held now has finished (weights.py); its outcome comes in weights_outcomes. Raises ValueError while another
        is asked for."""
        if self.weights is not None:
            raise ValueError("a weight update is in progress on this worker group")
        self.weights = WeightsUpdate(path, ticket, set(self._seqs))

    def take_weights_outcomes(self) -> list[WeightsOutcome]:
        outcomes, self.weights_outcomes = self.weights_outcomes, []
        return outcomes

    def _held_back(self, seq: Sequence) -> bool:
        """Added after a weight update was asked for: admitted once the worker answered it."""
        return self.weights is not None and seq.seq_id not in self.weights.before

    def preempt(self, seq_id: int) -> bool:
        """Send a running sequence back to the waiting queue; it resumes through the prefix cache."""
        seq = self.get(seq_id)
        if seq is None or seq.status is not RUNNING:
            return False
        self._preempt(seq)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running) or self.adapters.pending or self.weights is not None

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_waiting_tokens(self) -> int:
        """Tokens of the waiting sequences (prefill work queued), for routing."""
        return self._waiting_tokens

    @property
    def num_running(self) -> int:
        return len(self.running)

    def _finish(self, seq: Sequence, reason: str, unlink: bool = True) -> None:
        """unlink=False leaves it in `running` for the caller to compact in one pass."""
        if seq.status is RUNNING:
            if unlink:
                self.running.remove(seq)
            self._free_blocks(seq)
            self._finished_ids.append(seq.seq_id)
        else:
            self.waiting.remove(seq)
            self._waiting_tokens -= len(seq.token_ids)
        seq.status = FINISHED
        seq.start_step = NEVER
        seq.finish_reason = reason
        del self._seqs[seq.seq_id]

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free_blocks(seq)
        seq.num_computed_tokens = 0
        seq.num_sent_tokens = 0
        seq.num_committed_blocks = 0
        seq.status = PREEMPTED
        seq.start_step = NEVER
        waiting = self.waiting
        i = 0
        while i < len(waiting) and waiting[i].arrival < seq.arrival:
            i += 1
        waiting.insert(i, seq)
        self._waiting_tokens += len(seq.token_ids)
        self._preempted_ids.append(seq.seq_id)
        self.num_preemptions += 1

    def _runs_under(self, lora: str) -> bool:
        """Whether a sequence of this group (waiting, running or preempted) runs under the LoRA adapter."""
        return any(seq.params.lora == lora for seq in self._seqs.values())

    def _window_blocks(self) -> int:
        """The most blocks a sequence holds at once behind a sliding window, however long it grows: its window and
        a step's chunk, after a release at the chunk's start (_release) and the chunk's allocation."""
        if not self.sliding_window:
            return 1 << 62
        return (self.config.limits.max_num_batched_tokens + self.sliding_window + 2 * self.block_size - 3) // \
            self.block_size

    def _free_blocks(self, seq: Sequence) -> None:
        self.block_manager.free(seq.block_table[seq.num_released_blocks:])
        seq.block_table = []
        seq.num_released_blocks = 0

    def _release(self, seq: Sequence, c: int) -> int:
        """Gives back seq's leading blocks that lie wholly before the sliding window of position c, the first it
        computes in the plan being built (so of every later one too); returns how many."""
        keep_from = (c + 1 - self.sliding_window) // self.block_size
        n = keep_from - seq.num_released_blocks
        if n <= 0:
            return 0
        self.block_manager.free(seq.block_table[seq.num_released_blocks:keep_from])
        seq.num_released_blocks = keep_from
        self.num_released_blocks += n
        return n

    def _make_room(self, seq: Sequence, num_blocks: int) -> bool:
        """Preempt the newest running sequences until num_blocks are free; False if seq itself went."""
        bm = self.block_manager
        while bm.num_free_blocks < num_blocks:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _first_chunk(self, seq: Sequence, budget: int, cap: int) -> tuple[list[int], int, int]:
        """What admitting seq now would take: its prefix hits (match_prefix), the tokens of its first chunk, and
        the fresh blocks they need beside the hits."""
        bm = self.block_manager
        bs = self.block_size
        hits = bm.match_prefix(seq)
        total = len(seq.token_ids)
        while True:
            c = len(hits) * bs
            n = min(total - c, cap, budget)
            need = cdiv(c + n, bs) - len(hits)
            if len(hits) + need <= bm.num_blocks or not hits:
                return hits, n, need
            # Behind a sliding window a sequence may outgrow the pool, and so may its cached prefix: the part
            # that does not fit beside its first chunk is computed again.
            hits = hits[:max(bm.num_blocks - need, 0)]

    def _preempt_for_urgent(self, budget: int, cap: int) -> tuple[Sequence | None, int]:
        """Room for the sequences that wait for blocks to prefill into (the running ones still prefilling, and the
        waiting queue's head, which needs a slot under max_num_seqs too), in arrival order and within a step's
        budget: each preempts the last running sequences while they are less urgent than it (a smaller priority,
        and after it in arrival order, so that they resume behind it). A head whose LoRA adapter is in no slot is
        left to wait: the room might go to others while its adapter is placed. Returns the head where it was one of
        them, and its first chunk's tokens (what less urgent prefills leave it of the budget); else None, 0."""
        running = self.running
        if not running:
            return None, 0
        least = running[-1].priority
        wanting = [s for s in running if s.num_computed_tokens < s.num_sent_tokens and s.priority > least]
        head = self.waiting[0] if self.waiting else None
        if head is not None and head.priority > least and not (
                head.params.lora and head.params.lora not in self.adapters.slots) and not (
                head.status is PREEMPTED and head.seq_id in self._preempted_ids) and not self._held_back(head):
            bisect.insort(wanting, head, key=_arrival)
        bm = self.block_manager
        max_num_seqs = self.config.limits.max_num_seqs
        want = 0  # blocks the wanting sequences so far take
        first_chunk = 0
        for seq in wanting:
            if budget <= 0:
                break
            if seq is head:
                hits, n, need = self._first_chunk(seq, budget, cap)
                need += bm.num_free_among(hits)
                first_chunk = n
            elif seq.status is RUNNING:  # not preempted for an earlier one
                c = seq.num_computed_tokens
                n = min(seq.num_sent_tokens - c, cap, budget)
                need = max(cdiv(c + n, self.block_size) - len(seq.block_table), 0)
            else:
                continue
            want += need
            budget -= n
            while running and (bm.num_free_blocks < want or seq is head and len(running) >= max_num_seqs) and (
                    victim := running[-1]).priority < seq.priority and victim.arrival > seq.arrival:
                self._preempt(victim)
        return (head, first_chunk) if first_chunk else (None, 0)

    # --- scheduling ------------------------------------------------------------------------------

    def schedule(self) -> worker_pb2.StepPlan | None:
        """The next step's plan, or None when there is nothing to run or tell the worker."""
        cfg = self.config
        cap = self.max_model_len if self.whole_prompts else cfg.chunk_cap(self.block_size)
        draft = _Draft(self._step + 1, cfg.limits.max_num_batched_tokens, cap)
        if self.weights is not None and not self.weights.step:
            self.weights.before.intersection_update(self._seqs)
            if not self.weights.before:
                return self._plan_weights(draft)
        urgent, urgent_chunk = self._preempt_for_urgent(draft.budget, cap)
        preemptions = self.num_preemptions
        self._plan_decodes(draft)
        self._continue_prefills(draft, urgent, urgent_chunk)
        if self.num_preemptions == preemptions:  # admitting after this step preempted would only thrash
            self._admit(draft)
        self._extend_capped(draft)

        bm = self.block_manager
        adapters = self.adapters.take(draft.step, self._runs_under, {s.params.lora for s in self.running}) \
            if self.adapters.pending else None
        if not (draft.decodes or draft.chunks or draft.admitted or self._preempted_ids or draft.released
                or bm.swap_out or bm.swap_in or adapters and (adapters.unloads or adapters.drops or adapters.loads)):
            if adapters and adapters.forget_kv:
                bm.forget_free()
            return None
        # Blocks the next plan may allocate: a budget's worth (every token it schedules counts against it).
        bm.offload_ahead(cdiv(cfg.limits.max_num_batched_tokens, self.block_size))
        plan = self._plan_message(draft, adapters)
        self._step = draft.step
        return plan

    def _plan_decodes(self, d: _Draft) -> None:
        """Pass 1: a decode for each running sequence, oldest first, a block for it where its table is full (making
        room by preempting the newest); the sequences still prefilling are left in d.partial for pass 2. Victims of
        preemption are popped from the end of `running`, so they were not visited yet: the loop then ends sooner."""
        bm = self.block_manager
        bs = self.block_size
        for seq in self.running:
            if d.budget == 0:
                return
            c = seq.num_computed_tokens
            if c < seq.num_sent_tokens:
                d.partial.append(seq)
                continue
            if self.sliding_window and (freed := self._release(seq, c)):
                d.released.append((seq.seq_id, freed))
            if c + 2 > seq.max_len:  # its last token is in flight
                continue
            if c % bs == 0:  # its table is full (tables hold exactly the blocks computed tokens use)
                if bm.num_free_blocks == 0 and not self._make_room(seq, 1):
                    if d.released and d.released[-1][0] == seq.seq_id:
                        d.released.pop()  # its blocks were shared: seq itself went, the worker drops its table
                    return
                b = bm.allocate_one()
                seq.block_table.append(b)
                d.decode_blocks.append(b)
                d.grew.append(len(d.decodes))
            d.decodes.append(seq)
            c += 1
            seq.num_computed_tokens = c
            d.budget -= 1
            if c % bs == 0 and self.config.enable_prefix_caching and len(seq.token_ids) >= c:
                d.completes.append(seq)  # the block is complete once this step runs

    def _continue_prefills(self, d: _Draft, urgent: Sequence | None, urgent_chunk: int) -> None:
        """Pass 2: the next chunk of each prompt still prefilling, with what is free. With no free block at all,
        preempt newer partial prefills (not scheduled in this step); with none left, wait a step. A prefill less
        urgent than the waiting head that room was made for (`urgent`) leaves it its first chunk of the budget."""
        bm = self.block_manager
        bs = self.block_size
        partial = d.partial
        j = 0
        while j < len(partial) and d.budget > 0:
            seq = partial[j]
            j += 1
            c = seq.num_computed_tokens
            if self.sliding_window and (freed := self._release(seq, c)):  # victims below are later partials
                d.released.append((seq.seq_id, freed))
            remaining = seq.num_sent_tokens - c
            n = min(remaining, d.cap, d.budget)
            if urgent is not None and seq.priority < urgent.priority and seq.arrival > urgent.arrival:
                n = min(n, d.budget - urgent_chunk)
                if n <= 0:
                    continue
            table = seq.block_table
            room = len(table) * bs - c
            while room == 0 and bm.num_free_blocks == 0 and len(partial) > j:
                self._preempt(partial.pop())
            n = min(n, room + bm.num_free_blocks * bs)
            if n == 0:
                continue
            entry = [seq, n, len(table)]
            if n > room:
                table.extend(bm.allocate(cdiv(n - room, bs)))
            if n < remaining and n == d.cap:
                d.capped.append(entry)
            d.chunks.append(entry)
            seq.num_computed_tokens = c + n
            d.budget -= n

    def _admit(self, d: _Draft) -> None:
        """Waiting sequences in arrival order, each with its prefix hits and first chunk, while budget, slots and
        blocks last. A sequence whose LoRA adapter finds no slot waits, and every adapter's sequence behind it: the
        others go on."""
        bm = self.block_manager
        bs = self.block_size
        running = self.running
        waiting = self.waiting
        no_slot: list[Sequence] = []
        skipped: list[Sequence] = []  # no_slot and the sequences held back for a weight update, in queue order
        while waiting and d.budget > 0 and len(running) < self.config.limits.max_num_seqs:
            seq = waiting[0]
            if seq.status is PREEMPTED and seq.seq_id in self._preempted_ids:
                break  # the worker must drop it before it is resent
            if self._held_back(seq):
                skipped.append(waiting.popleft())
                continue
            lora = seq.params.lora
            if lora and no_slot:
                no_slot.append(seq)
                skipped.append(waiting.popleft())
                continue
            hits, n, need = self._first_chunk(seq, d.budget, d.cap)
            total = len(seq.token_ids)
            c = len(hits) * bs
            remaining = total - c
            if need + bm.num_free_among(hits) > bm.num_free_blocks or (self.whole_prompts and n < remaining):
                break
            if lora and not self.adapters.place(lora, d.step, lambda: {s.params.lora for s in running}):
                no_slot.append(seq)
                skipped.append(waiting.popleft())
                continue
            waiting.popleft()
            self._waiting_tokens -= total
            on_host = sum(1 for b in hits if b < 0)
            table = bm.acquire(hits)
            table.extend(bm.allocate(need))
            seq.block_table = table
            seq.num_committed_blocks = c // bs
            seq.num_computed_tokens = c + n
            seq.num_sent_tokens = total
            seq.start_step = d.step
            seq.status = RUNNING
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens, seq.scheduled_at = c, time.monotonic()
            self.num_prefix_hit_tokens += c
            self.num_host_hit_tokens += on_host * bs
            self.num_admitted_tokens += total
            if not running or running[-1].arrival < seq.arrival:
                running.append(seq)
            else:
                bisect.insort(running, seq, key=_arrival)
            entry = [seq, n, c]
            if n < remaining and n == d.cap:
                d.capped.append(entry)
            d.admitted.append(entry)
            d.budget -= n
        waiting.extendleft(reversed(skipped))

    def _extend_capped(self, d: _Draft) -> None:
        """Budget left: the chunks cut at the cap grow, oldest first, with blocks that are free (no preemption)."""
        bm = self.block_manager
        bs = self.block_size
        for entry in d.capped:
            if d.budget == 0:
                return
            seq = entry[0]
            c = seq.num_computed_tokens
            table = seq.block_table
            room = len(table) * bs - c
            extra = min(seq.num_sent_tokens - c, d.budget, room + bm.num_free_blocks * bs)
            if extra <= 0:
                continue
            if extra > room:
                table.extend(bm.allocate(cdiv(extra - room, bs)))
            entry[1] += extra
            seq.num_computed_tokens = c + extra
            d.budget -= extra

    def _plan_weights(self, d: _Draft) -> worker_pb2.StepPlan:
        """The plan that has the worker, holding no sequence now, read its weights again (weights.py); every
        cached block is forgotten first, since its KV came from the weights before."""
        plan = self._plan_message(d, None)
        self.block_manager.forget_free()
        plan.load_weights = self.weights.path
        self.weights.step = self._step = d.step
        return plan

    def _plan_message(self, d: _Draft, adapters: AdapterPlan | None) -> worker_pb2.StepPlan:
        """The draft as the worker takes it; its sampling sequences recorded in flight, its full blocks registered
        in the prefix cache. Result order: new sequences, then the columns (decodes, then continued prefills)."""
        bm = self.block_manager
        sampling: list[Sequence] = []  # the sequences that sample in this plan
        sampling_ids: list[int] = []
        plan = worker_pb2.StepPlan(step=d.step, epoch=self.epoch)
        for seq, n, c in d.admitted:
            ns = plan.new_seqs.add()
            ns.seq_id = seq.seq_id
            ns.token_ids.extend(seq.token_ids)
            ns.prompt_len = seq.prompt_len
            ns.sampling.CopyFrom(seq.sampling)
            ns.block_ids.extend(seq.block_table)
            ns.num_computed_tokens = c
            ns.num_scheduled_tokens = n
            if c + n == seq.num_sent_tokens:
                sampling.append(seq)
                sampling_ids.append(seq.seq_id)
        # the running columns (seq_ids, num_scheduled_tokens, num_new_blocks, new_block_ids): decodes, then chunks
        col_ids = [seq.seq_id for seq in d.decodes]
        sampling += d.decodes
        sampling_ids += col_ids
        col_tokens = [1] * len(col_ids)
        col_new = [0] * len(col_ids)  # new blocks per decode: 0 or 1
        for k in d.grew:
            col_new[k] = 1
        col_blocks = d.decode_blocks
        for seq, n, before in d.chunks:
            table = seq.block_table
            col_ids.append(seq.seq_id)
            col_tokens.append(n)
            col_new.append(len(table) - before)
            col_blocks.extend(table[before:])
            if seq.num_computed_tokens == seq.num_sent_tokens:
                sampling.append(seq)
                sampling_ids.append(seq.seq_id)
        plan.seq_ids.extend(col_ids)
        plan.num_scheduled_tokens.extend(col_tokens)
        plan.num_new_blocks.extend(col_new)
        plan.new_block_ids.extend(col_blocks)
        if self._finished_ids:
            plan.finished_ids.extend(self._finished_ids)
            self._finished_ids.clear()
        if self._preempted_ids:
            plan.preempted_ids.extend(self._preempted_ids)
            self._preempted_ids.clear()
        for seq_id, n in d.released:
            plan.released_ids.append(seq_id)
            plan.num_released_blocks.append(n)
        if bm.has_copies:
            swap_out, swap_in, offload = bm.take_swaps()
            for g, h in swap_out:
                plan.swap_out_blocks.append(g)
                plan.swap_out_host_blocks.append(h)
            for h, g in swap_in:
                plan.swap_in_host_blocks.append(h)
                plan.swap_in_blocks.append(g)
            for g, h in offload:
                plan.offload_blocks.append(g)
                plan.offload_host_blocks.append(h)
        if adapters is not None:
            if adapters.forget_kv:  # KV computed under an adapter dies with it: nothing it left may be hit later
                bm.forget_free()
            plan.unload_loras.extend(adapters.unloads)
            plan.drop_loras.extend(adapters.drops)
            for name, path in adapters.loads:
                plan.load_loras.add(name=name, path=path)
            for slot, name in adapters.placements:
                plan.lora_slots.add(slot=slot, name=name)
        self._in_flight.append(_InFlight(d.step, sampling, sampling_ids))

        # Register full blocks only now: a hit in this same plan would read KV the step writes.
        if self.config.enable_prefix_caching:
            for seq in d.completes:
                bm.commit(seq)
            for entry in d.chunks:
                bm.commit(entry[0])
            for entry in d.admitted:
                bm.commit(entry[0])
        return plan

    # --- results ---------------------------------------------------------------------------------

    def update(self, result: worker_pb2.StepResult) -> list[Sequence]:
        """Apply the result of the oldest plan in flight.

        Returns the sequences that received a token: each has just appended exactly one
        (token_ids[-1]), with its logprob appended to seq.logprobs when asked for, and
        finish_reason set when it stopped ("stop", "length", or "grammar" where the worker found its structured
        output's grammar dead); its blocks are then already free.
        Stop tokens and lengths are decided here; stop strings by the caller, through stop().
        """
        if not self._in_flight:
            raise RuntimeError(f"result for step {result.step} with no plan in flight")
        step, sampling, ids = self._in_flight.popleft()
        if result.step != step or result.seq_ids != ids or len(result.token_ids) != len(ids):
            raise RuntimeError(
                f"result for step {result.step} does not answer plan {step}: "
                f"{len(result.seq_ids)} sequences, {len(ids)} expected"
            )
        if self.weights is not None and self.weights.step == step:
            self.weights_outcomes.append(WeightsOutcome(self.weights.path, self.weights.ticket, result.failed_weights))
            self.weights = None
        if self.adapters.pending:
            self.adapters.answered(step, result.failed_loras)
            for name, why in self.adapters.take_lost():
                seqs = [seq for seq in self._seqs.values() if seq.params.lora == name]
                for seq in seqs:
                    self._finish(seq, "abort")
                self.lost.append((name, why, seqs))
        bs = self.block_size
        caching = self.config.enable_prefix_caching
        commit = self.block_manager.commit
        finish = self._finish
        if len(result.prompt_seq_ids):
            # First: a sequence that finishes at the token sampled after its prompt's last chunk (max_tokens 0 or
            # 1, a stop token) leaves _seqs below, and that chunk's prompt logprobs come in this same result.
            self._add_prompt_logprobs(result)
        if len(result.pooled_seq_ids):
            self._add_pooled(result)
        accepted: list[Sequence] = []
        num_finished = 0
        dead = set(result.grammar_dead_ids)  # structured outputs that no token could continue
        for seq, tok in zip(sampling, result.token_ids):
            if step < seq.start_step:
                continue  # finished, aborted or preempted since: stale
            accepted.append(seq)
            toks = seq.token_ids
            toks.append(tok)
            n = len(toks)
            # Its last block is complete once known and computed: the later of the two commits it.
            if n % bs == 0 and caching and seq.num_computed_tokens >= n:
                commit(seq)
            if dead and seq.seq_id in dead:
                finish(seq, "grammar", False)
                num_finished += 1
            elif tok in seq.stop_ids and n >= seq.min_len:
                finish(seq, "stop", False)
                num_finished += 1
            elif n >= seq.max_len:
                finish(seq, "length", False)
                num_finished += 1
        if num_finished:
            self.running = [s for s in self.running if s.status is RUNNING]
        if len(result.logprobs):
            self._add_logprobs(step, sampling, accepted, result)
        return accepted

    def _add_prompt_logprobs(self, result: worker_pb2.StepResult) -> None:
        """Appends the prompt positions the worker scored to seq.prompt_logprobs, in order; a position already
        there (scored again after a preemption) is skipped."""
        at = top_at = 0
        for seq_id, start, count in zip(result.prompt_seq_ids, result.prompt_starts, result.prompt_counts):
            seq = self._seqs.get(seq_id)
            n_top = max(seq.sampling.prompt_logprobs, 0) if seq is not None else 0
            if seq is not None and seq.prompt_logprobs is not None:
                have = len(seq.prompt_logprobs)
                for k in range(max(have - start, 0), count):
                    if start + k != len(seq.prompt_logprobs):
                        break  # a gap: never expected, the chunks come in order
                    j = top_at + k * n_top
                    top = list(zip(result.prompt_top_token_ids[j:j + n_top],
                                   result.prompt_top_logprobs[j:j + n_top])) if n_top else None
                    seq.prompt_logprobs.append(TokenLogprob(seq.token_ids[start + k + 1],
                                                            result.prompt_logprobs[at + k], top))
            at += count
            top_at += count * n_top

    def _add_pooled(self, result: worker_pb2.StepResult) -> None:
        """Keeps what the worker pooled for each embedding request: its row ("last", "cls"), or the sum of its rows
        so far ("mean": a chunk from position 0 starts the sum over, as after a preemption by recompute; one that
        continues where the sum stops adds to it)."""
        size = len(result.pooled) // len(result.pooled_seq_ids)
        for k, (seq_id, start, count) in enumerate(zip(result.pooled_seq_ids, result.pooled_starts,
                                                       result.pooled_counts)):
            seq = self._seqs.get(seq_id)
            if seq is None:
                continue
            values = result.pooled[k * size:(k + 1) * size]
            if seq.sampling.pooling != "mean" or start == 0:
                seq.pooled, seq.pooled_upto = list(values), start + count
            elif start == seq.pooled_upto and seq.pooled is not None:
                seq.pooled = [a + b for a, b in zip(seq.pooled, values)]
                seq.pooled_upto = start + count

    @staticmethod
    def _add_logprobs(step: int, sampling: list[Sequence], accepted: list[Sequence],
                      result: worker_pb2.StepResult) -> None:
        """Appends each accepted sequence's logprob (and top alternatives) to seq.logprobs. The result holds an
        entry for every sampling sequence, stale ones included."""
        top_ids, top_lps = result.top_token_ids, result.top_logprobs
        taken = set(accepted)
        offset = 0
        for k, (seq, tok) in enumerate(zip(sampling, result.token_ids)):
            n_top = max(seq.sampling.logprobs, 0)
            if seq in taken and seq.logprobs is not None:
                top = None
                if n_top:
                    top = list(zip(top_ids[offset : offset + n_top], top_lps[offset : offset + n_top]))
                seq.logprobs.append(TokenLogprob(tok, result.logprobs[k], top))
            offset += n_top

    # --- checks ----------------------------------------------------------------------------------

    def check(self) -> None:
        """Assert the scheduler's and the block manager's invariants (tests)."""
        self.block_manager.check(s.block_table[s.num_released_blocks:] for s in self.running)
        for seq in self.waiting:
            assert seq.status in (WAITING, PREEMPTED) and not seq.block_table
        arrivals = [s.arrival for s in self.waiting]
        assert arrivals == sorted(arrivals), "waiting queue out of arrival order"
        assert self._waiting_tokens == sum(len(s.token_ids) for s in self.waiting)
        arrivals = [s.arrival for s in self.running]
        assert arrivals == sorted(arrivals), "running list out of arrival order"
        if self.weights is not None:  # nothing runs that would see both the old weights and the new
            assert not any(self._held_back(s) for s in self.running), "admitted while a weight update waits"
            assert not (self.weights.step and self.running), "a sequence runs while the worker reads weights"
        bs = self.block_size
        for seq in self.running:
            assert seq.status is RUNNING
            assert seq.num_computed_tokens <= len(seq.block_table) * bs
            assert len(seq.block_table) == cdiv(seq.num_computed_tokens, bs), "blocks allocated ahead of use"
            assert seq.num_committed_blocks <= min(seq.num_computed_tokens, len(seq.token_ids)) // bs
            reach = seq.num_computed_tokens + 1 - self.sliding_window if self.sliding_window else 0
            assert seq.num_released_blocks <= max(reach, 0) // bs, "a released block is still read"
        live = {s.seq_id for s in self.running} | {s.seq_id for s in self.waiting}
        assert live == self._seqs.keys()
        for seq in self.waiting:
            assert seq.start_step == NEVER
        slots = [name for name in self.adapters.slots if name]
        assert len(set(slots)) == len(slots), "an adapter in two slots"
        assert all(s.params.lora in slots for s in self.running if s.params.lora), "running under no slot's adapter"
        assert set(slots) <= self.adapters.held, "a slot's adapter is not in host memory"
        assert len(self.adapters.held) <= self.adapters.capacity, "more adapters in host memory than it holds"


def _arrival(seq: Sequence) -> int:
    return seq.arrival
