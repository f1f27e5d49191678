"""The worker's mirror of the scheduler's state, kept by applying each StepPlan (a delta): which sequences
it holds, in which row of the persistent batch, their block tables, token counts and sampling parameters.
numpy only, no torch: the ModelRunner, the simulated runner, tensor-parallel followers, the scheduler's test
fake and bench/scheduler_cpu all apply plans through `PersistentBatch.apply`, which makes every check of the
protocol (docs/architecture.md) and refuses a plan that breaks one with a PlanError.

Token counts per row: `num_sent` tokens came with the sequence's NewSequence (its prompt, plus its
generated tokens when it resumes or moved); `num_tokens` counts those and every token sampled since;
`num_computed` positions have KV (scheduled in an applied plan). A row samples in the step that runs its
last known token, so a decode runs exactly position num_tokens - 1.

With a sliding window on every layer, a row's first `num_released` table blocks are no longer its own: they lie
wholly before the window of every position it computes from now on, the scheduler has freed them (the plan's
num_released_blocks), and their ids stay in the table unread.
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from common.limits import MAX_BAD_WORD_TOKENS
from common.model_files import POOLING_TYPES
from common.util import cdiv
from protos import worker_pb2 as pb

POOLING = ("", *POOLING_TYPES)  # PersistentBatch.pooling's codes: 0 a generation, else an embedding's pooling
_SEED_MASK = (1 << 63) - 1  # seeds travel as 64 bits; the device keeps them as int64
_row = attrgetter("row")


def pooled_span(kind: str, start: int, count: int, prompt_len: int) -> tuple[int, int] | None:
    """The rows of a chunk of positions [start, start + count) an embedding request pools this step, as offsets in
    the chunk (StepResult.pooled sums them), or None: "mean" every row, "last" the prompt's last position where the
    chunk holds it, "cls" its first."""
    if kind == "mean":
        return 0, count
    if kind == "last" and start + count == prompt_len:
        return count - 1, count
    if kind == "cls" and start == 0:
        return 0, 1
    return None


class PlanError(ValueError):
    """A plan that does not fit the worker's state (gap in steps, other epoch, unknown sequence, ...)."""


@dataclass(slots=True)
class SeqState:
    row: int
    token_ids: list[int]  # the ids the scheduler sent; later tokens exist only where they were sampled
    prompt_len: int


@dataclass(slots=True)
class BatchStep:
    """An applied plan: its sequences in result order (new ones, then the running columns)."""
    step: int
    seq_ids: np.ndarray       # uint64
    rows: np.ndarray          # int64
    num_computed: np.ndarray  # int64: positions with KV before the step
    num_scheduled: np.ndarray  # int64: tokens the step runs
    num_sent: np.ndarray      # int64
    samples: np.ndarray       # bool: the row samples its next token in this step
    states: list[SeqState]
    new: list[SeqState]       # sequences this plan starts
    unloaded_loras: list[int]  # LoRA slots this plan clears (StepPlan.unload_loras, drop_loras of adapters in one)
    placed_loras: list[tuple[int, str]]  # (slot, adapter) this plan fills (StepPlan.lora_slots)

    @property
    def num_tokens(self) -> int:
        return int(self.num_scheduled.sum())


@dataclass(slots=True)
class SamplingArrays:
    """The sampling parameters of a step's sampling rows, gathered on the host."""
    temperature: np.ndarray  # float32
    penalty: np.ndarray      # float32 [S, 3]: repetition, presence, frequency
    top_k: np.ndarray        # int64, vocab size where off
    top_p: np.ndarray        # float32
    min_p: np.ndarray        # float32
    use_k: bool
    use_p: bool
    use_min_p: bool
    use_penalty: bool
    all_greedy: bool
    max_logprobs: int
    general: np.ndarray      # bool: rows that need more than a temperature (a filter, a penalty, a bias, a mask)
    bias: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # logit biases: (sample row, token id, value)
    allowed: tuple[np.ndarray, np.ndarray] | None = None  # allowed_token_ids: (sample row, token id)
    bad_words: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # (sample row, tokens before, last token)
    constrained: np.ndarray | None = None  # which sampling rows follow a grammar (structured output)

    def arrays(self) -> list[np.ndarray]:
        return [self.temperature, self.penalty, self.top_k, self.top_p, self.min_p]


class PersistentBatch:
    def __init__(self, max_num_seqs: int, num_blocks: int, block_size: int, max_model_len: int,
                 max_num_batched_tokens: int = 0, epoch: int = 0, num_host_blocks: int = 0, sliding_window: int = 0,
                 lora_adapters: list[str] | None = None):
        """max_num_batched_tokens 0: no bound on a step's tokens; num_host_blocks: of the host KV pool;
        sliding_window: the model's, when every layer has one (ModelConfig.kv_window), else 0; lora_adapters: the
        LoRA adapter in each slot by name, "" where free (a row's slot in `lora`), as plans place them."""
        self.lora_adapters = lora_adapters or []
        self.max_num_seqs, self.num_blocks, self.block_size = max_num_seqs, num_blocks, block_size
        self.num_host_blocks, self.sliding_window = num_host_blocks, sliding_window
        self.max_model_len, self.max_num_batched_tokens = max_model_len, max_num_batched_tokens
        self.epoch = epoch
        rows = max_num_seqs
        self.seqs: dict[int, SeqState] = {}
        self.free_rows = list(range(rows - 1, -1, -1))
        self.num_computed = np.zeros(rows, np.int64)
        self.num_sent = np.zeros(rows, np.int64)
        self.num_tokens = np.zeros(rows, np.int64)
        self.block_table = np.zeros((rows, cdiv(max_model_len, block_size)), np.int32)
        self.num_table_blocks = np.zeros(rows, np.int64)
        self.num_released = np.zeros(rows, np.int64)  # leading table blocks given back (sliding window)
        self.holders = np.zeros(num_blocks, np.int32)  # live sequences whose table holds each block
        # sampling parameters per row
        self.temperature = np.zeros(rows, np.float32)
        self.top_k = np.zeros(rows, np.int64)
        self.top_p = np.ones(rows, np.float32)
        self.min_p = np.zeros(rows, np.float32)
        self.seed = np.zeros(rows, np.int64)
        self.logprobs = np.full(rows, -1, np.int64)
        self.prompt_logprobs = np.full(rows, -1, np.int64)  # -1: the row's prompt is not scored
        self.pooling = np.zeros(rows, np.int8)  # POOLING's code of an embedding request's rows; 0: a generation
        self.lora = np.full(rows, -1, np.int64)  # the row's LoRA adapter, an index into lora_adapters; -1: none
        self.penalty = np.zeros((rows, 3), np.float32)  # repetition, presence, frequency
        self.logit_bias: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # row -> (token ids, biases), where given
        self.allowed: dict[int, tuple[np.ndarray]] = {}  # row -> (the only token ids it may sample,), where given
        self.grammar: dict[int, str] = {}  # row -> the llguidance grammar its output follows, where given
        # row -> (the tokens before each bad word's last: [words, MAX_BAD_WORD_TOKENS - 1], right-aligned, -1 before
        # them; each word's last token), where given
        self.bad_words: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.next_step = 1

    def reset(self, epoch: int) -> None:
        """Forgets every sequence; plans start again at step 1 of `epoch`."""
        for seq_id in list(self.seqs):
            self._drop(seq_id)
        self.next_step, self.epoch = 1, epoch

    # ---- applying a plan ----------------------------------------------------------------------------
    def apply(self, plan: pb.StepPlan) -> BatchStep:
        """Applies the delta, after checking it against the state; returns the step it schedules. On a
        PlanError the state may be half applied: the stream that sent the plan ends and the worker resets."""
        if plan.epoch != self.epoch:
            raise PlanError(f"plan for epoch {plan.epoch}, this worker is at epoch {self.epoch}")
        if plan.step != self.next_step:
            raise PlanError(f"expected step {self.next_step}, got {plan.step}")
        self.next_step += 1
        dropped = [*plan.finished_ids, *plan.preempted_ids]
        if len(set(dropped)) != len(dropped):
            raise PlanError(f"step {plan.step}: a sequence is dropped twice")
        for seq_id in dropped:
            if seq_id not in self.seqs:
                raise PlanError(f"step {plan.step}: dropped sequence {seq_id} is not held")
            self._drop(seq_id)
        if len(plan.released_ids):
            self._release(plan)
        unloaded = [slot for name in (*plan.unload_loras, *plan.drop_loras) if (slot := self._unload(name)) is not None]
        placed = [self._place(p.slot, p.name) for p in plan.lora_slots]
        if len(plan.swap_out_blocks) or len(plan.swap_in_blocks):
            self._check_swaps(plan)
        new = [self._add(ns, dropped) for ns in plan.new_seqs]
        k = len(plan.seq_ids)
        if len(plan.num_scheduled_tokens) != k or len(plan.num_new_blocks) != k:
            raise PlanError("seq_ids, num_scheduled_tokens and num_new_blocks differ in length")
        id_list = [ns.seq_id for ns in plan.new_seqs] + list(plan.seq_ids)
        try:
            states = new + [self.seqs[seq_id] for seq_id in id_list[len(new):]]
        except KeyError as e:
            raise PlanError(f"step {plan.step}: unknown sequence {e.args[0]}") from None
        if len(set(id_list)) != len(id_list):
            raise PlanError(f"step {plan.step}: a sequence is scheduled twice")
        ids = np.array(id_list, np.uint64)
        rows = np.fromiter(map(_row, states), np.int64, len(states))
        n = np.array([ns.num_scheduled_tokens for ns in plan.new_seqs] + list(plan.num_scheduled_tokens), np.int64)
        self._append_blocks(plan, ids[len(new):], rows[len(new):])
        c, sent, known = self.num_computed[rows], self.num_sent[rows], self.num_tokens[rows]
        end = c + n
        decode = c >= sent
        bad = (n <= 0) | (end > self.num_table_blocks[rows] * self.block_size) | (end > self.max_model_len)
        bad |= decode & ((n != 1) | (c != known - 1))  # a decode runs its last sampled token, alone
        bad |= ~decode & (end > sent)  # a chunk stays within the sent tokens
        samples = end >= known
        bad |= samples & (end >= self.max_model_len) & (self.pooling[rows] == 0)  # a sampled token's position too
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise PlanError(f"sequence {ids[i]}: {n[i]} tokens from position {c[i]} (of {known[i]} known, {sent[i]} "
                            f"sent) do not fit its {self.num_table_blocks[rows[i]]} blocks, max_model_len "
                            f"{self.max_model_len}, or a decode's single token")
        total = int(n.sum())
        if self.max_num_batched_tokens and total > self.max_num_batched_tokens:
            raise PlanError(f"step {plan.step}: {total} tokens, more than max_num_batched_tokens "
                            f"{self.max_num_batched_tokens}")
        self._check_writes(ids, rows, c, n)
        if len(plan.offload_blocks) or len(plan.offload_host_blocks):
            self._check_offloads(plan)
        self.num_computed[rows] = end
        self.num_tokens[rows[samples]] = end[samples] + 1
        return BatchStep(plan.step, ids, rows, c, n, sent, samples, states, new, unloaded, placed)

    def _unload(self, name: str) -> int | None:
        """Frees the LoRA adapter's slot, where it has one; returns the slot."""
        if name not in self.lora_adapters or not name:
            return None
        slot = self.lora_adapters.index(name)
        self._vacate(slot, f"LoRA adapter {name!r} is unloaded")
        self.lora_adapters[slot] = ""
        return slot

    def _place(self, slot: int, name: str) -> tuple[int, str]:
        """Puts the LoRA adapter into the slot, replacing the one there."""
        if slot >= len(self.lora_adapters) or not name or name in self.lora_adapters:
            raise PlanError(f"LoRA adapter {name!r} is placed into slot {slot} of {len(self.lora_adapters)}, or twice")
        self._vacate(slot, f"LoRA slot {slot} takes {name!r}")
        self.lora_adapters[slot] = name
        return slot, name

    def _vacate(self, slot: int, what: str) -> None:
        holders = [sid for sid, state in self.seqs.items() if self.lora[state.row] == slot]
        if holders:
            raise PlanError(f"{what} while sequence {holders[0]} runs under {self.lora_adapters[slot]!r}")

    def _check_swaps(self, plan: pb.StepPlan) -> None:
        """Swap columns pair up and stay in range, and a swap-in fills only blocks no live sequence holds."""
        out_g, out_h = np.asarray(plan.swap_out_blocks), np.asarray(plan.swap_out_host_blocks)
        in_h, in_g = np.asarray(plan.swap_in_host_blocks), np.asarray(plan.swap_in_blocks)
        if len(out_g) != len(out_h) or len(in_h) != len(in_g):
            raise PlanError(f"step {plan.step}: swap columns differ in length")
        if not self._in_range((out_g, in_g), (out_h, in_h)):
            raise PlanError(f"step {plan.step}: swapped block out of range (GPU {self.num_blocks}, "
                            f"host {self.num_host_blocks})")
        if len(np.unique(in_g)) != len(in_g) or len(np.unique(out_h)) != len(out_h):
            raise PlanError(f"step {plan.step}: a block is filled twice by one plan's swaps")
        if self.holders[in_g].any():
            raise PlanError(f"step {plan.step}: swap-in into block {in_g[self.holders[in_g] > 0][0]}, "
                            "which a live sequence holds")

    def _check_offloads(self, plan: pb.StepPlan) -> None:
        """Offload columns pair up and stay in range, fill each host block once (with the swap-outs), and copy
        only blocks no live sequence holds after the plan (the step writes none of them)."""
        g, h = np.asarray(plan.offload_blocks), np.asarray(plan.offload_host_blocks)
        if len(g) != len(h):
            raise PlanError(f"step {plan.step}: offload columns differ in length")
        if not self._in_range((g,), (h,)):
            raise PlanError(f"step {plan.step}: offloaded block out of range (GPU {self.num_blocks}, "
                            f"host {self.num_host_blocks})")
        filled = np.concatenate([h, np.asarray(plan.swap_out_host_blocks, h.dtype)])
        if len(np.unique(g)) != len(g) or len(np.unique(filled)) != len(filled):
            raise PlanError(f"step {plan.step}: a block is filled twice by one plan's copies")
        if self.holders[g].any():
            raise PlanError(f"step {plan.step}: offload of block {g[self.holders[g] > 0][0]}, "
                            "which a live sequence holds")

    def _in_range(self, gpu: tuple[np.ndarray, ...], host: tuple[np.ndarray, ...]) -> bool:
        """Whether every id of the copy columns names a GPU block, or a host block, of this worker."""
        return all(not len(b) or (0 <= b.min() and b.max() < limit)
                   for blocks, limit in ((gpu, self.num_blocks), (host, self.num_host_blocks)) for b in blocks)

    def _release(self, plan: pb.StepPlan) -> None:
        """Released blocks go back before anything in the plan may reuse them; each lies wholly before the window
        of the next position its sequence computes."""
        if len(plan.num_released_blocks) != len(plan.released_ids):
            raise PlanError("released_ids and num_released_blocks differ in length")
        if not self.sliding_window:
            raise PlanError(f"step {plan.step}: blocks released, but some layer reads the whole context")
        bs, window = self.block_size, self.sliding_window
        for seq_id, n in zip(plan.released_ids, plan.num_released_blocks):
            state = self.seqs.get(seq_id)
            if state is None:
                raise PlanError(f"step {plan.step}: released sequence {seq_id} is not held")
            row = state.row
            start, c = int(self.num_released[row]), int(self.num_computed[row])
            if (start + n) * bs > c + 1 - window:
                raise PlanError(f"sequence {seq_id} releases blocks up to position {(start + n) * bs}, but its "
                                f"next position {c} reads keys from {c + 1 - window} (window {window})")
            self.holders[self.block_table[row, start:start + n]] -= 1
            self.num_released[row] = start + n

    def _drop(self, seq_id: int) -> None:
        state = self.seqs.pop(seq_id)
        row = state.row
        # a table never holds a block twice
        self.holders[self.block_table[row, self.num_released[row]:self.num_table_blocks[row]]] -= 1
        self.logit_bias.pop(row, None)
        self.allowed.pop(row, None)
        self.grammar.pop(row, None)
        self.bad_words.pop(row, None)
        self.free_rows.append(row)

    def _add(self, new: pb.NewSequence, dropped: list[int]) -> SeqState:
        sid, c, n, total = new.seq_id, new.num_computed_tokens, new.num_scheduled_tokens, len(new.token_ids)
        if sid in self.seqs:
            raise PlanError(f"sequence {sid} is already running on this worker")
        if sid in dropped:
            raise PlanError(f"sequence {sid} is dropped and sent again in one plan")
        if not self.free_rows:
            raise PlanError(f"more than max_num_seqs={self.max_num_seqs} sequences")
        if not 0 < new.prompt_len <= total:
            raise PlanError(f"sequence {sid}: prompt_len {new.prompt_len} of {total} tokens")
        if not 0 <= c < total or c % self.block_size:
            raise PlanError(f"sequence {sid}: num_computed_tokens {c} must be a whole number of blocks below its "
                            f"{total} tokens")
        if n < 1 or c + n > total:
            raise PlanError(f"sequence {sid}: chunk [{c}, {c + n}) beyond its {total} tokens")
        blocks = np.asarray(new.block_ids, np.int64)
        if len(np.unique(blocks)) != len(blocks):
            raise PlanError(f"sequence {sid}: a block twice in its table")
        row = self.free_rows.pop()
        state = SeqState(row, list(new.token_ids), new.prompt_len)
        self.seqs[sid] = state
        self.num_computed[row], self.num_sent[row], self.num_tokens[row] = c, total, total
        self.num_table_blocks[row] = self.num_released[row] = 0
        self._extend_table(sid, row, blocks)
        p = new.sampling
        self.temperature[row], self.top_k[row], self.top_p[row] = p.temperature, p.top_k, p.top_p
        self.min_p[row], self.seed[row], self.logprobs[row] = p.min_p, p.seed & _SEED_MASK, p.logprobs
        self.penalty[row] = (p.repetition_penalty or 1.0, p.presence_penalty, p.frequency_penalty)
        self.prompt_logprobs[row] = p.prompt_logprobs if p.HasField("prompt_logprobs") else -1
        if p.pooling not in POOLING:
            raise PlanError(f"sequence {sid}: pooling {p.pooling!r} is none of {', '.join(POOLING_TYPES)}")
        self.pooling[row] = POOLING.index(p.pooling)
        if p.lora and p.lora not in self.lora_adapters:
            raise PlanError(f"sequence {sid}: LoRA adapter {p.lora!r} is not loaded here")
        self.lora[row] = self.lora_adapters.index(p.lora) if p.lora else -1
        if p.logit_bias:
            self.logit_bias[row] = (np.fromiter(p.logit_bias.keys(), np.int64),
                                    np.fromiter(p.logit_bias.values(), np.float32))
        if p.allowed_token_ids:
            self.allowed[row] = (np.asarray(p.allowed_token_ids, np.int64),)
        if p.grammar:
            self.grammar[row] = p.grammar
        if p.bad_words:
            self.bad_words[row] = _bad_words(sid, p.bad_words)
        return state

    def _append_blocks(self, plan: pb.StepPlan, ids: np.ndarray, rows: np.ndarray) -> None:
        """The running columns' new blocks."""
        counts = np.array(plan.num_new_blocks, np.int64)
        if int(counts.sum()) != len(plan.new_block_ids):
            raise PlanError("num_new_blocks does not add up to the number of new_block_ids")
        if not len(plan.new_block_ids):
            return
        blocks = np.array(plan.new_block_ids, np.int64)
        if blocks.min() < 0 or blocks.max() >= self.num_blocks:
            raise PlanError(f"step {plan.step}: block id outside [0, {self.num_blocks})")
        # Blocks appended to running sequences are fresh: every one covers positions the step computes.
        if len(np.unique(blocks)) != len(blocks) or self.holders[blocks].any():
            raise PlanError(f"step {plan.step}: a new block is held already or given twice")
        offsets = np.concatenate([[0], np.cumsum(counts)])
        for i in np.flatnonzero(counts):
            self._extend_table(int(ids[i]), int(rows[i]), blocks[offsets[i]:offsets[i + 1]])

    def _extend_table(self, seq_id: int, row: int, blocks: np.ndarray) -> None:
        have = int(self.num_table_blocks[row])
        if have + len(blocks) > self.block_table.shape[1]:
            raise PlanError(f"sequence {seq_id}: block table longer than max_model_len needs")
        if len(blocks) and not 0 <= blocks.min() <= blocks.max() < self.num_blocks:
            raise PlanError(f"sequence {seq_id}: block id outside [0, {self.num_blocks})")
        self.block_table[row, have:have + len(blocks)] = blocks
        self.num_table_blocks[row] = have + len(blocks)
        self.holders[blocks] += 1

    def _check_writes(self, ids: np.ndarray, rows: np.ndarray, c: np.ndarray, n: np.ndarray) -> None:
        """Every block the step writes (its new tokens' K/V) is held by the writing sequence alone: a block
        twice in a table, or a shared prefix block written, would corrupt another sequence's KV."""
        bs = self.block_size
        first, last = c // bs, (c + n - 1) // bs
        if (first == last).all():
            owner = np.arange(len(rows))
            blocks = self.block_table[rows, first]
        else:
            per_seq = last - first + 1
            owner = np.repeat(np.arange(len(rows)), per_seq)
            col = np.repeat(first, per_seq) + np.arange(int(per_seq.sum())) - np.repeat(np.cumsum(per_seq) - per_seq,
                                                                                        per_seq)
            blocks = self.block_table[rows[owner], col]
        shared = self.holders[blocks] != 1
        if shared.any():
            i = int(np.flatnonzero(shared)[0])
            raise PlanError(f"sequence {ids[owner[i]]} writes block {blocks[i]}, which "
                            f"{self.holders[blocks[i]]} live sequences hold")

    # ---- reading ------------------------------------------------------------------------------------
    def sampling(self, rows: np.ndarray, vocab_size: int, penalties: bool) -> SamplingArrays:
        """The sampling parameters of `rows`; penalties: whether penalty statistics are kept at all."""
        top_k = self.top_k[rows]
        use_k = (top_k > 0) & (top_k < vocab_size)
        penalty = self.penalty[rows]
        temperature, top_p, min_p = self.temperature[rows], self.top_p[rows], self.min_p[rows]
        use_p, use_min_p = top_p < 1, min_p > 0
        use_penalty = ((penalty[:, 0] != 1) | penalty[:, 1:].any(axis=1)) & penalties
        bias, allowed = self._columns(self.logit_bias, rows), self._columns(self.allowed, rows)
        bad_words = self._columns(self.bad_words, rows)
        constrained = self._constrained(rows)
        general = use_k | use_p | use_min_p | use_penalty
        for index in (bias[0] if bias is not None else None, allowed[0] if allowed is not None else None,
                      bad_words[0] if bad_words is not None else None, constrained):
            if index is not None:
                general[index] = True
        return SamplingArrays(temperature=temperature, penalty=penalty, top_k=np.where(use_k, top_k, vocab_size),
                              top_p=top_p, min_p=min_p, use_k=bool(use_k.any()), use_p=bool(use_p.any()),
                              use_min_p=bool(use_min_p.any()), use_penalty=bool(use_penalty.any()),
                              all_greedy=bool((temperature == 0).all()),
                              max_logprobs=int(self.logprobs[rows].max(initial=-1)), general=general, bias=bias,
                              allowed=allowed, bad_words=bad_words, constrained=constrained)

    @staticmethod
    def _columns(per_row: dict[int, tuple[np.ndarray, ...]], rows: np.ndarray) -> tuple[np.ndarray, ...] | None:
        """The entries of the sampling rows `rows` in a table of per-row arrays (logit biases: token ids and biases;
        allowed tokens: token ids), joined as columns led by each entry's index into rows; None where none has one."""
        found = [(i, per_row[r]) for i, r in enumerate(rows.tolist()) if r in per_row] if per_row else []
        if not found:
            return None
        index = np.concatenate([np.full(len(arrays[0]), i, np.int64) for i, arrays in found])
        return (index, *(np.concatenate(column) for column in zip(*(arrays for _, arrays in found))))

    def _constrained(self, rows: np.ndarray) -> np.ndarray | None:
        if not self.grammar:
            return None
        index = np.flatnonzero(np.fromiter((r in self.grammar for r in rows.tolist()), bool, len(rows)))
        return index if len(index) else None

    def has_penalty(self, row: int) -> bool:
        rep, pres, freq = self.penalty[row]
        return rep != 1.0 or pres != 0.0 or freq != 0.0

    def num_blocks_in_use(self) -> int:
        """Distinct blocks in the tables of the sequences held."""
        return int(np.count_nonzero(self.holders))


def _bad_words(seq_id: int, words) -> tuple[np.ndarray, np.ndarray]:
    """A sequence's bad words (BadWord messages) as PersistentBatch.bad_words holds them."""
    before = np.full((len(words), MAX_BAD_WORD_TOKENS - 1), -1, np.int64)
    last = np.empty(len(words), np.int64)
    for i, word in enumerate(words):
        ids = word.token_ids
        if not 1 <= len(ids) <= MAX_BAD_WORD_TOKENS or min(ids) < 0:
            raise PlanError(f"sequence {seq_id}: a bad word must be 1 to {MAX_BAD_WORD_TOKENS} token ids, got "
                            f"{list(ids)}")
        if len(ids) > 1:
            before[i, before.shape[1] - len(ids) + 1:] = ids[:-1]
        last[i] = ids[-1]
    return before, last
