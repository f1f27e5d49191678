"""A fake worker for scheduler tests, and the model folder it stands for.

FakeWorker applies StepPlans exactly as a real worker must (a conformance check of the plans): it
keeps its own mirror of every sequence (known tokens, block table, computed tokens), rejects step
gaps, a wrong epoch, unknown or duplicate ids, decodes that are not at the end of the known tokens,
block tables that do not cover the scheduled positions, a write to a block another live sequence
holds, and a read of KV that is not what the sequence's prefix wrote there. Each KV slot stores a
hash of the whole prefix up to its position, so a prefix hit on the wrong block, or a block reused
while still live, shows up as a mismatch.

It samples token = token_fn(seed, position): results do not depend on batching, chunking or
preemption, so tests can predict every sequence's output.
"""

from __future__ import annotations

import json
import math
import shutil
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from protos import worker_pb2

QWEN_EOS_IDS = (151645, 151643)  # <|im_end|>, <|endoftext|>


class ProtocolViolation(AssertionError):
    pass


def default_token_fn(vocab_size: int) -> Callable[[int, int], int]:
    def token(seed: int, position: int) -> int:
        return xxhash.xxh64_intdigest(position.to_bytes(8, "little"), seed) % vocab_size

    return token


@dataclass
class _Mirror:
    token_ids: list[int]  # known to the worker: sent, then sampled
    num_sent: int
    prompt_len: int
    seed: int
    logprobs: int
    block_table: list[int]
    num_computed: int
    keys: list[int] = field(default_factory=list)  # expected KV content per position

    def key(self, position: int) -> int:
        while len(self.keys) <= position:
            p = len(self.keys)
            prev = self.keys[-1] if p else 0
            self.keys.append(hash((prev, self.token_ids[p])))
        return self.keys[position]


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ProtocolViolation(msg)


class FakeWorker:
    def __init__(
        self,
        num_blocks: int = 64,
        block_size: int = 4,
        max_model_len: int = 256,
        vocab_size: int = 1000,
        epoch: int = 7,
        token_fn: Callable[[int, int], int] | None = None,
        check_kv: bool = True,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.epoch = epoch
        self.token_fn = token_fn or default_token_fn(vocab_size)
        self.check_kv = check_kv
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.holders: list[set[int]] = [set() for _ in range(num_blocks)]
        self.seqs: dict[int, _Mirror] = {}
        self.step = 0
        self.max_num_batched_tokens = 0  # from Describe; 0 = unchecked
        self.max_num_seqs = 0
        self.plans: list[worker_pb2.StepPlan] = []
        self.results: list[worker_pb2.StepResult] = []
        self._pending: deque[worker_pb2.StepResult] = deque()
        self.closed = False

    # --- the Executor protocol -------------------------------------------------------------------

    def describe(self, request: worker_pb2.DescribeRequest) -> worker_pb2.DescribeResponse:
        self.max_num_batched_tokens = request.max_num_batched_tokens
        self.max_num_seqs = request.max_num_seqs
        return worker_pb2.DescribeResponse(
            protocol_version=1,
            model="fake",
            dtype="float32",
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            tensor_parallel_size=1,
            epoch=self.epoch,
            vocab_size=self.vocab_size,
            worker_id="fake-0",
            device="cpu",
            max_num_seqs=request.max_num_seqs,
            max_num_batched_tokens=request.max_num_batched_tokens,
        )

    def submit(self, plan: worker_pb2.StepPlan) -> None:
        self._pending.append(self.execute(plan))

    def receive(self) -> worker_pb2.StepResult:
        return self._pending.popleft()

    def close(self) -> None:
        self.closed = True

    @property
    def num_in_flight(self) -> int:
        return len(self._pending)

    # --- applying a plan -------------------------------------------------------------------------

    def _drop(self, seq_id: int, what: str) -> None:
        _check(seq_id in self.seqs, f"step {self.step}: {what} id {seq_id} is not held")
        for b in self.seqs.pop(seq_id).block_table:
            self.holders[b].discard(seq_id)

    def _hold(self, seq_id: int, blocks: list[int]) -> None:
        for b in blocks:
            _check(0 <= b < self.num_blocks, f"block id {b} out of range")
            self.holders[b].add(seq_id)

    def execute(self, plan: worker_pb2.StepPlan) -> worker_pb2.StepResult:
        bs = self.block_size
        _check(plan.step == self.step + 1, f"step {plan.step} after {self.step}")
        _check(plan.epoch == self.epoch, f"epoch {plan.epoch}, worker has {self.epoch}")
        self.step = plan.step
        self.plans.append(plan)
        dropped = list(plan.finished_ids) + list(plan.preempted_ids)
        _check(len(set(dropped)) == len(dropped), "an id is dropped twice")
        for sid in plan.finished_ids:
            self._drop(sid, "finished")
        for sid in plan.preempted_ids:
            self._drop(sid, "preempted")

        batch: list[tuple[int, _Mirror, int, int]] = []  # (seq id, mirror, computed, scheduled)
        for ns in plan.new_seqs:
            sid = ns.seq_id
            _check(sid not in self.seqs, f"new sequence {sid} is already held")
            _check(sid not in dropped, f"sequence {sid} dropped and resent in one plan")
            toks = list(ns.token_ids)
            c, n = ns.num_computed_tokens, ns.num_scheduled_tokens
            _check(0 < ns.prompt_len <= len(toks), f"seq {sid}: prompt_len {ns.prompt_len} of {len(toks)}")
            _check(c % bs == 0, f"seq {sid}: computed {c} is not a block multiple")
            _check(c < len(toks), f"seq {sid}: computed {c} covers all {len(toks)} tokens")
            _check(n >= 1 and c + n <= len(toks), f"seq {sid}: chunk [{c}, {c + n}) beyond {len(toks)} tokens")
            table = list(ns.block_ids)
            _check(len(table) >= math.ceil((c + n) / bs), f"seq {sid}: {len(table)} blocks for {c + n} tokens")
            _check(len(set(table)) == len(table), f"seq {sid}: a block twice in its table")
            m = _Mirror(toks, len(toks), ns.prompt_len, ns.sampling.seed, ns.sampling.logprobs, table, c)
            self.seqs[sid] = m
            self._hold(sid, table)
            batch.append((sid, m, c, n))

        k = len(plan.seq_ids)
        _check(
            len(plan.num_scheduled_tokens) == k and len(plan.num_new_blocks) == k,
            "running columns differ in length",
        )
        _check(sum(plan.num_new_blocks) == len(plan.new_block_ids), "new_block_ids do not match num_new_blocks")
        offset = 0
        seen = {ns.seq_id for ns in plan.new_seqs}
        for sid, n, nb in zip(plan.seq_ids, plan.num_scheduled_tokens, plan.num_new_blocks):
            _check(sid in self.seqs, f"step {plan.step}: running id {sid} is not held")
            _check(sid not in seen, f"seq {sid} twice in one plan")
            seen.add(sid)
            m = self.seqs[sid]
            blocks = list(plan.new_block_ids[offset : offset + nb])
            offset += nb
            m.block_table.extend(blocks)
            _check(len(set(m.block_table)) == len(m.block_table), f"seq {sid}: a block twice in its table")
            self._hold(sid, blocks)
            c = m.num_computed
            _check(n >= 1, f"seq {sid}: scheduled {n} tokens")
            if c >= m.num_sent:
                _check(n == 1, f"seq {sid}: decode of {n} tokens")
                _check(c == len(m.token_ids) - 1, f"seq {sid}: decode at {c} but {len(m.token_ids)} tokens known")
            else:
                _check(c + n <= m.num_sent, f"seq {sid}: chunk [{c}, {c + n}) crosses the sent tokens {m.num_sent}")
            _check(len(m.block_table) >= math.ceil((c + n) / bs), f"seq {sid}: table too short for {c + n}")
            batch.append((sid, m, c, n))

        total = sum(n for *_, n in batch)
        if self.max_num_batched_tokens:
            _check(total <= self.max_num_batched_tokens, f"{total} tokens over the budget")
        if self.max_num_seqs:
            _check(len(self.seqs) <= self.max_num_seqs, f"{len(self.seqs)} sequences held")

        # Reads first (KV of earlier steps only), then writes: a hit on a block written in this same
        # step reads nothing and fails.
        if self.check_kv:
            for sid, m, c, n in batch:
                for p in range(c):
                    got = self.kv[m.block_table[p // bs]][p % bs]
                    _check(got == m.key(p), f"seq {sid}: wrong KV at position {p}")
        result = worker_pb2.StepResult(step=plan.step)
        sampled: list[tuple[_Mirror, int]] = []
        for sid, m, c, n in batch:
            for p in range(c, c + n):
                b = m.block_table[p // bs]
                _check(self.holders[b] == {sid}, f"seq {sid} writes block {b} held by {sorted(self.holders[b])}")
                self.kv[b][p % bs] = m.key(p)
            m.num_computed = c + n
            if c + n >= len(m.token_ids):
                _check(c + n < self.max_model_len, f"seq {sid}: position {c + n} beyond max_model_len")
                tok = self.token_fn(m.seed, c + n)
                m.token_ids.append(tok)
                result.seq_ids.append(sid)
                result.token_ids.append(tok)
                sampled.append((m, tok))
        if any(m.logprobs >= 0 for m, _ in sampled):
            for m, tok in sampled:
                result.logprobs.append(fake_logprob(tok) if m.logprobs >= 0 else math.nan)
                for r in range(max(m.logprobs, 0)):
                    result.top_token_ids.append((tok + r) % self.vocab_size)
                    result.top_logprobs.append(fake_logprob(tok) - r)
        self.results.append(result)
        return result


def fake_logprob(token_id: int) -> float:
    return -0.125 * (1 + token_id % 8)


def write_model_dir(out_dir: Path, tokenizer_cache: Path, *, max_position_embeddings: int = 1024) -> Path:
    """The model folder the fake worker stands for: config files and Qwen3's tokenizer, copied from
    tokenizer_cache (written there on first use)."""
    from worker_svc.tokenizer_files import write_qwen_tokenizer

    if not (tokenizer_cache / "tokenizer.json").exists():
        write_qwen_tokenizer(tokenizer_cache)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_cache / name, out_dir / name)
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "eos_token_id": QWEN_EOS_IDS[0],
        "bos_token_id": QWEN_EOS_IDS[1],
        "max_position_embeddings": max_position_embeddings,
    }
    (out_dir / "config.json").write_text(json.dumps(config))
    generation = {"eos_token_id": list(QWEN_EOS_IDS), "bos_token_id": QWEN_EOS_IDS[1]}
    (out_dir / "generation_config.json").write_text(json.dumps(generation))
    return out_dir
