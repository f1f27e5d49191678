"""A simulated worker: the worker protocol and handshake without a model (no torch).

It applies each plan as the ModelRunner does (same delta, same checks), samples a deterministic token
per (seed, position), and answers after the time the GPU would take for the step, from a cost model
fitted to H200 measurements. The scheduler's overhead and the cost of the split can be measured and
tuned on a CPU with it.
"""
from __future__ import annotations

import json
import random
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from protos import WORKER_PROTOCOL_VERSION
from protos import worker_pb2 as pb
from worker_svc.errors import PlanError


@dataclass(slots=True)
class StepCost:
    """Step time = base + per query token + per token of context read by attention. The defaults fit
    Qwen3-0.6B in bf16 on one H200: a decode step of 256 sequences at 800 tokens of context takes about
    7.7 ms, 6.6 of them attention (bench/results/runner_step.md); the offline workload's 9 prefill steps
    take 0.43 s and its 1,023 decode steps 4.93 s (bench/results/offline.md)."""
    base_ms: float = 0.95
    per_token_us: float = 2.7
    per_context_token_ns: float = 30.0

    def seconds(self, num_tokens: int, context_tokens: int) -> float:
        return (self.base_ms * 1e3 + self.per_token_us * num_tokens + self.per_context_token_ns * 1e-3
                * context_tokens) * 1e-6


@dataclass(slots=True)
class _Seq:
    known: int
    computed: int
    blocks: int
    seed: int


class _SimStep:
    def __init__(self, result: pb.StepResult, done_at: float):
        self._result, self._done_at = result, done_at

    def result(self) -> pb.StepResult:
        delay = self._done_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        return self._result


class SimulatedRunner:
    def __init__(self, model_dir: str | Path, num_blocks: int, block_size: int, max_model_len: int | None,
                 max_num_seqs: int, max_num_batched_tokens: int, cost: StepCost):
        config = json.loads((Path(model_dir) / "config.json").read_text())
        self.model_name = Path(model_dir).name
        self.vocab_size = config["vocab_size"]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_model_len = min(max_model_len or config["max_position_embeddings"],
                                 config["max_position_embeddings"])
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.cost = cost
        self.worker_id = uuid.uuid4().hex[:12]
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.seqs: dict[int, _Seq] = {}
        self.next_step = 1
        self.epoch = random.getrandbits(63)
        self._busy_until = 0.0

    def describe(self, request: pb.DescribeRequest | None = None) -> pb.DescribeResponse:
        return pb.DescribeResponse(
            protocol_version=WORKER_PROTOCOL_VERSION, model=self.model_name, dtype="simulated",
            num_blocks=self.num_blocks, block_size=self.block_size, max_model_len=self.max_model_len,
            tensor_parallel_size=1, epoch=self.epoch, vocab_size=self.vocab_size, worker_id=self.worker_id,
            device="simulated", max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens)

    def execute(self, plan: pb.StepPlan) -> _SimStep:
        if plan.epoch != self.epoch:
            raise PlanError(f"plan for epoch {plan.epoch}, this worker is at epoch {self.epoch}")
        if plan.step != self.next_step:
            raise PlanError(f"expected step {self.next_step}, got {plan.step}")
        self.next_step += 1
        for seq_id in (*plan.finished_ids, *plan.preempted_ids):
            self.seqs.pop(seq_id, None)
        batch: list[tuple[int, _Seq, int]] = []
        for new in plan.new_seqs:
            if new.seq_id in self.seqs or len(self.seqs) >= self.max_num_seqs:
                raise PlanError(f"sequence {new.seq_id} is already running, or too many sequences")
            seq = self.seqs[new.seq_id] = _Seq(len(new.token_ids), new.num_computed_tokens, len(new.block_ids),
                                               new.sampling.seed)
            batch.append((new.seq_id, seq, new.num_scheduled_tokens))
        for seq_id, n, nb in zip(plan.seq_ids, plan.num_scheduled_tokens, plan.num_new_blocks):
            seq = self.seqs.get(seq_id)
            if seq is None:
                raise PlanError(f"unknown sequence {seq_id}")
            seq.blocks += nb
            batch.append((seq_id, seq, n))
        result = pb.StepResult(step=plan.step)
        tokens = context = 0
        for seq_id, seq, n in batch:
            end = seq.computed + n
            if n <= 0 or end > self.max_model_len or end > seq.blocks * self.block_size or (
                    seq.computed >= seq.known and n != 1):
                raise PlanError(f"sequence {seq_id}: {n} tokens from {seq.computed} do not fit")
            if end >= seq.known:
                result.seq_ids.append(seq_id)
                result.token_ids.append(random.Random(seq.seed * 1_000_003 + end).randrange(self.vocab_size // 2))
            seq.computed = end
            tokens += n
            context += end
        with self._lock:
            start = max(time.monotonic(), self._busy_until)
            self._busy_until = start + self.cost.seconds(tokens, context)
        result.forward_ms = (self._busy_until - start) * 1e3
        return _SimStep(result, self._busy_until)
