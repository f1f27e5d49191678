"""A minimal test driver for the ModelRunner: builds StepPlans for a handful of sequences with
controllable chunking, block placement, prefix reuse and drops, without the real scheduler."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch

from common.util import cdiv
from protos import worker_pb2 as pb
from worker_svc.kernels.attention import prefill_metadata
from worker_svc.runtime.model_runner import ModelRunner

GREEDY = pb.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0, logprobs=-1)


@dataclass
class DriverSeq:
    seq_id: int
    tokens: list[int]          # everything known: prompt + generated
    prompt_len: int
    max_new: int
    params: pb.SamplingParams
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    on_worker: bool = False
    known_to_worker: int = 0   # len(token_ids) sent in NewSequence

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]


class PagedDriver:
    def __init__(self, runner: ModelRunner, chunk: int = 1 << 30, shuffle_seed: int | None = None):
        self.runner, self.chunk, self.bs = runner, chunk, runner.block_size
        self.free = list(range(runner.num_blocks))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(self.free)
        self.seqs: dict[int, DriverSeq] = {}
        self.step = 0
        self.pending_drop: list[int] = []
        self.next_id = 0

    def add(self, prompt: list[int], max_new: int, params: pb.SamplingParams = GREEDY,
            prefix_blocks: list[int] | None = None, seq_id: int | None = None) -> DriverSeq:
        """prefix_blocks: blocks that already hold the KV of the prompt's first tokens (a prefix hit)."""
        seq_id = self.next_id if seq_id is None else seq_id
        self.next_id = max(self.next_id, seq_id + 1)
        s = DriverSeq(seq_id, list(prompt), len(prompt), max_new, params)
        if prefix_blocks:
            s.blocks, s.computed = list(prefix_blocks), len(prefix_blocks) * self.bs
        self.seqs[seq_id] = s
        return s

    def drop(self, s: DriverSeq) -> None:
        """Forgets the sequence's KV (as a preemption does); it is recomputed from all known tokens."""
        self.pending_drop.append(s.seq_id)
        self.free.extend(s.blocks)
        s.blocks, s.computed, s.on_worker = [], 0, False

    def done(self, s: DriverSeq) -> bool:
        return len(s.generated) >= s.max_new

    def run_step(self, only: set[int] | None = None) -> dict[int, int]:
        self.step += 1
        dropping = self.pending_drop
        plan = pb.StepPlan(step=self.step, epoch=self.runner.epoch, preempted_ids=dropping)
        self.pending_drop = []
        scheduled = []
        for s in self.seqs.values():
            if self.done(s) or (only is not None and s.seq_id not in only):
                continue
            if s.seq_id in dropping:  # as the scheduler: resent only after the worker has dropped it
                continue
            known = len(s.tokens)
            n = 1 if s.computed >= known else min(self.chunk, known - s.computed)
            need = cdiv(s.computed + n, self.bs) - len(s.blocks)
            new_blocks = [self.free.pop() for _ in range(max(0, need))]
            s.blocks += new_blocks
            if not s.on_worker:
                plan.new_seqs.add(seq_id=s.seq_id, token_ids=s.tokens, prompt_len=s.prompt_len,
                                  sampling=s.params, block_ids=s.blocks, num_computed_tokens=s.computed,
                                  num_scheduled_tokens=n)
                s.on_worker, s.known_to_worker = True, known
            else:
                plan.seq_ids.append(s.seq_id)
                plan.num_scheduled_tokens.append(n)
                plan.num_new_blocks.append(len(new_blocks))
                plan.new_block_ids.extend(new_blocks)
            s.computed += n
            scheduled.append(s)
        for s in self.seqs.values():
            if self.done(s) and s.on_worker:
                plan.finished_ids.append(s.seq_id)
                s.on_worker = False
        result = self.last_result = self.runner.execute(plan).result()
        out = dict(zip(result.seq_ids, result.token_ids))
        for seq_id, token in out.items():
            self.seqs[seq_id].tokens.append(token)
        return out

    def update_adapters(self, load: dict[str, str] | None = None, unload: tuple[str, ...] = (),
                        place: dict[int, str] | None = None) -> dict[str, str]:
        """One plan of LoRA adapter deltas alone (StepPlan.load_loras, unload_loras, lora_slots: slot -> adapter);
        returns the failed loads."""
        self.step += 1
        plan = pb.StepPlan(step=self.step, epoch=self.runner.epoch, unload_loras=unload,
                           load_loras=[pb.LoraAdapter(name=n, path=str(p)) for n, p in (load or {}).items()],
                           lora_slots=[pb.LoraSlot(slot=k, name=n) for k, n in (place or {}).items()])
        return dict(self.runner.execute(plan).result().failed_loras)

    def reload_weights(self, folder: str) -> str:
        """One plan that has the worker read its weights again from folder (StepPlan.load_weights), where the driver's
        sequences have all finished; returns why not ("": done)."""
        self.step += 1
        finished = [s.seq_id for s in self.seqs.values() if s.on_worker]
        for s in self.seqs.values():
            s.on_worker = False
        plan = pb.StepPlan(step=self.step, epoch=self.runner.epoch, finished_ids=finished, load_weights=str(folder))
        return self.runner.execute(plan).result().failed_weights

    def run_all(self) -> None:
        while any(not self.done(s) for s in self.seqs.values()):
            self.run_step()


def prefill_logits(runner: ModelRunner, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Every position's logits of each prompt, from one prefill step of all of them straight through the model
    (blocks in order from 0): what compares with transformers' logits of each prompt alone."""
    lens = [len(p) for p in prompts]
    positions, meta = prefill_metadata(lens, runner.block_size, runner.device)
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(np.concatenate(prompts), device=runner.device), positions, meta)
        return list(runner.model.compute_logits(hidden).split(lens))


def run_with_drops(driver: PagedDriver, seqs: list[DriverSeq], drop_at: tuple[int, ...]) -> None:
    """Runs to the end, dropping every third sequence (a different third each time) after the steps in drop_at:
    they recompute from all their tokens, as after a preemption."""
    for step in range(max(drop_at) + 1):
        driver.run_step()
        if step in drop_at:
            for s in seqs[step % 3::3]:
                driver.drop(s)
    driver.run_all()
