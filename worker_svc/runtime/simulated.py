"""A simulated worker: the worker protocol and handshake without a model (no torch).

It applies each plan through the PersistentBatch the ModelRunner uses (same delta, same checks), samples a
deterministic token per (seed, position), and answers after the time the GPU would take for the step, from a
cost model fitted to H200 measurements. The scheduler's overhead and the cost of the split can be measured and
tuned on a CPU with it. With a host tier (--kv-offload-gib) it keeps no KV either, but times the copies as the
real worker makes them: a plan's swaps before its step (which waits for them), its offloads after, on a copy
engine of their own that later swaps queue behind.
"""
from __future__ import annotations

import dataclasses
import json
import random
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.limits import Limits
from common.model_files import kv_bytes_per_token
from protos import WORKER_PROTOCOL_VERSION
from protos import worker_pb2 as pb
from worker_svc.runtime.batch import POOLING, PersistentBatch, pooled_span
from worker_svc.runtime.tier_policy import host_tier_pays


@dataclass(slots=True)
class StepCost:
    """Step time = base + per query token + per token of context read by attention. The defaults are fitted
    to Qwen3-0.6B in bf16 on one H200 (bench/NOTES.md says from which runs)."""
    base_ms: float = 0.95
    per_token_us: float = 2.7
    per_context_token_ns: float = 30.0
    host_copy_gb_s: float = 25.0  # one block's copy between the GPU and pinned host memory

    def seconds(self, num_tokens: int, context_tokens: int) -> float:
        return (self.base_ms * 1e3 + self.per_token_us * num_tokens + self.per_context_token_ns * 1e-3
                * context_tokens) * 1e-6


class _SimStep:
    def __init__(self, result: pb.StepResult, done_at: float):
        self._result, self._done_at = result, done_at

    def result(self) -> pb.StepResult:
        delay = self._done_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        return self._result


class SimulatedRunner:
    def __init__(self, model_dir: str | Path, num_blocks: int, block_size: int, limits: Limits, cost: StepCost,
                 kv_offload_bytes: int = 0):
        """kv_offload_bytes: the host tier's size, in blocks of the model's K and V in bfloat16 (0: none); none
        where the cost model's block copy costs more than its prefill (tier_policy.py)."""
        config = self._config = json.loads((Path(model_dir) / "config.json").read_text())
        self.model_name, self.weights_path = Path(model_dir).name, str(model_dir)
        self.vocab_size, self.hidden_size = config["vocab_size"], config["hidden_size"]
        self.num_blocks, self.block_size = num_blocks, block_size
        model_len = config["max_position_embeddings"]
        self.limits = dataclasses.replace(limits, max_model_len=min(limits.max_model_len or model_len, model_len))
        self.cost = cost
        self.worker_id = uuid.uuid4().hex[:12]
        self._lock = threading.Lock()
        self.block_bytes = kv_bytes_per_token(config, 2) * block_size
        pays = host_tier_pays(self.block_bytes / (cost.host_copy_gb_s * 1e9), cost.per_token_us * 1e-6, block_size)
        self.num_host_blocks = kv_offload_bytes // self.block_bytes if pays else 0
        self.batch = PersistentBatch(self.limits.max_num_seqs, num_blocks, block_size, self.limits.max_model_len,
                                     self.limits.max_num_batched_tokens, epoch=random.getrandbits(63),
                                     num_host_blocks=self.num_host_blocks)
        self._busy_until = 0.0
        self._copies_until = 0.0  # the copy engine's

    @property
    def epoch(self) -> int:
        return self.batch.epoch

    def close(self) -> None:
        pass

    def reset(self) -> None:
        self.batch.reset(random.getrandbits(63))
        self._busy_until = self._copies_until = 0.0

    def describe(self, request: pb.DescribeRequest | None = None) -> pb.DescribeResponse:
        limits = self.limits
        return pb.DescribeResponse(
            protocol_version=WORKER_PROTOCOL_VERSION, model=self.model_name, dtype="simulated",
            num_blocks=self.num_blocks, block_size=self.block_size, max_model_len=limits.max_model_len,
            tensor_parallel_size=1, epoch=self.epoch, vocab_size=self.vocab_size, worker_id=self.worker_id,
            device="simulated", max_num_seqs=limits.max_num_seqs,
            max_num_batched_tokens=limits.max_num_batched_tokens, num_host_blocks=self.num_host_blocks,
            hidden_size=self.hidden_size, weights_path=self.weights_path)

    def execute(self, plan: pb.StepPlan) -> _SimStep:
        step = self.batch.apply(plan)
        failed_weights = self._load_weights(plan.load_weights) if plan.load_weights else ""
        end = step.num_computed + step.num_scheduled
        rows = np.flatnonzero(step.samples)
        tokens = _mix(self.batch.seed[step.rows][rows].astype(np.uint64), end[rows].astype(np.uint64))
        token_ids = (tokens % np.uint64(self.vocab_size // 2)).astype(np.int64)
        token_ids[self.batch.pooling[step.rows[rows]] > 0] = 0  # embedding requests sample nothing
        result = pb.StepResult(step=plan.step, seq_ids=step.seq_ids[rows].tolist(), token_ids=token_ids.tolist(),
                               failed_weights=failed_weights)
        self._logprobs(result, step, rows, token_ids)
        self._pooled(result, step)
        block_s = self.block_bytes / (self.cost.host_copy_gb_s * 1e9)
        swaps = len(plan.swap_out_blocks) + len(plan.swap_in_blocks)
        with self._lock:
            start = max(time.monotonic(), self._busy_until)
            if swaps:  # behind the copies queued before them; the forward waits for them
                self._copies_until = start = max(start, self._copies_until) + swaps * block_s
            self._busy_until = start + self.cost.seconds(step.num_tokens, int(end.sum()))
            if len(plan.offload_blocks):  # behind the forward, off its path
                self._copies_until = (max(self._busy_until, self._copies_until)
                                      + len(plan.offload_blocks) * block_s)
        result.forward_ms = (self._busy_until - start) * 1e3
        return _SimStep(result, self._busy_until)

    def _load_weights(self, folder: str) -> str:
        """No weights to read: a folder whose config.json is this model's is taken, as a GPU worker would."""
        try:
            same = json.loads((Path(folder) / "config.json").read_text()) == self._config
        except (OSError, ValueError) as e:
            return f"weights from {folder}: {e}"
        if not same:
            return f"weights from {folder}: its config.json describes another model than the one served"
        self.weights_path = folder
        return ""

    def _logprobs(self, result: pb.StepResult, step, sampled: np.ndarray, token_ids: np.ndarray) -> None:
        """Made-up logprobs where asked (-(1 + t % 8) / 8 for token t; its top n the tokens after it, each one
        nat less likely), so that every field a client may ask for comes back: the sampled tokens' and the
        prompt positions' this step computed."""
        batch = self.batch
        asked = batch.logprobs[step.rows[sampled]]
        if (asked >= 0).any():
            result.logprobs.extend(np.where(asked >= 0, _logprob(token_ids), np.nan).tolist())
            for t, n in zip(token_ids.tolist(), asked.tolist()):
                self._top(result.top_token_ids, result.top_logprobs, t, n)
        for i in np.flatnonzero(batch.prompt_logprobs[step.rows] >= 0):
            state, c = step.states[i], int(step.num_computed[i])
            end = min(c + int(step.num_scheduled[i]), state.prompt_len - 1)
            if end <= c:
                continue
            targets = np.asarray(state.token_ids[c + 1:end + 1], np.int64)
            result.prompt_seq_ids.append(int(step.seq_ids[i]))
            result.prompt_starts.append(c)
            result.prompt_counts.append(end - c)
            result.prompt_logprobs.extend(_logprob(targets).tolist())
            for t in targets.tolist():
                self._top(result.prompt_top_token_ids, result.prompt_top_logprobs, t,
                          int(batch.prompt_logprobs[step.rows[i]]))

    def _pooled(self, result: pb.StepResult, step) -> None:
        """Made-up pooled rows for embedding requests, as a model whose final state at a position is a fixed
        vector of its token ((t * (j + 1)) % 17 - 8) / 8 in dimension j: rows of the positions the pooling takes
        (the last, the first, or the sum of the step's for a mean)."""
        pooling = self.batch.pooling[step.rows]
        for i in np.flatnonzero(pooling):
            state, c, n = step.states[i], int(step.num_computed[i]), int(step.num_scheduled[i])
            span = pooled_span(POOLING[pooling[i]], c, n, state.prompt_len)
            if span is None:
                continue
            tokens = state.token_ids[c + span[0]:c + span[1]]
            dims = np.arange(1, self.hidden_size + 1)
            rows = ((np.asarray(tokens, np.int64)[:, None] * dims) % 17 - 8) / 8
            result.pooled_seq_ids.append(int(step.seq_ids[i]))
            result.pooled_starts.append(c)
            result.pooled_counts.append(n)
            result.pooled.extend(rows.sum(0).tolist())

    def _top(self, ids, values, token: int, n: int) -> None:
        for r in range(max(n, 0)):
            ids.append((token + r) % self.vocab_size)
            values.append(float(_logprob(np.int64(token))) - r)


def _logprob(token_ids: np.ndarray) -> np.ndarray:
    return -(1 + token_ids % 8) / 8


def _mix(seed: np.ndarray, position: np.ndarray) -> np.ndarray:
    """A token drawn from (sequence seed, position) alone, the same on every run and after a recompute:
    splitmix64's finaliser over both (uint64 arithmetic wraps)."""
    with np.errstate(over="ignore"):
        z = seed * np.uint64(0x9E3779B97F4A7C15) + position
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))
