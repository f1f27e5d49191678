"""Decode step time of the ModelRunner alone (no scheduler), at a given batch and context length,
for several KV block sizes, CUDA graphs on and off. Used to choose the block size.

python -m bench.runner_step --preset qwen3-0.6b --batch 256 --context 800 --block-sizes 16,64,128,256
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from bench.record import record
from protos import worker_pb2 as pb
from worker_svc.make_model import make_model
from worker_svc.model_runner import ModelRunner, RunnerConfig

SAMPLING = pb.SamplingParams(temperature=0.6, top_p=1.0, repetition_penalty=1.0, logprobs=-1, seed=1)


def measure(model_dir: Path, batch: int, context: int, block_size: int, graphs: bool, steps: int) -> dict:
    blocks_per_seq = -(-(context + steps + 8) // block_size)
    runner = ModelRunner(model_dir, RunnerConfig(
        device="cuda", block_size=block_size, num_blocks=batch * blocks_per_seq, max_num_seqs=batch,
        max_num_batched_tokens=8192, max_model_len=context + steps + 64, cuda_graphs=graphs))
    rng = random.Random(0)
    step = 0
    per_plan = max(1, 8192 // context)
    for first in range(0, batch, per_plan):
        step += 1
        plan = pb.StepPlan(step=step, epoch=runner.epoch)
        for i in range(first, min(batch, first + per_plan)):
            plan.new_seqs.add(seq_id=i, token_ids=[rng.randrange(10000) for _ in range(context)],
                              prompt_len=context, sampling=SAMPLING,
                              block_ids=list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
                              num_computed_tokens=0, num_scheduled_tokens=context)
        runner.execute(plan).result()
    ids = list(range(batch))

    def decode(step_no: int):
        return runner.execute(pb.StepPlan(step=step_no, epoch=runner.epoch, seq_ids=ids,
                                          num_scheduled_tokens=[1] * batch, num_new_blocks=[0] * batch))

    for _ in range(3):
        step += 1
        decode(step).result()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pending = None
    for _ in range(steps):  # depth-2 pipeline: launch N+1 before waiting for N
        step += 1
        nxt = decode(step)
        if pending is not None:
            pending.result()
        pending = nxt
    pending.result()
    ms = (time.perf_counter() - t0) / steps * 1e3
    torch.cuda.empty_cache()
    return {"block_size": block_size, "cuda_graphs": graphs, "batch": batch, "context": context,
            "step_ms": round(ms, 3), "tokens_per_s": round(batch / ms * 1e3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=800)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--block-sizes", default="16,64,128,256")
    ap.add_argument("--out", default="bench/results/runner_step.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(args.preset, Path(tmp) / "m", seed=0, dtype="bfloat16")
        rows = []
        for bs in [int(b) for b in args.block_sizes.split(",")]:
            for graphs in (True, False):
                rows.append(measure(model_dir, args.batch, args.context, bs, graphs, args.steps))
                print(json.dumps(rows[-1]), flush=True)
    record(args.out, "runner_step", vars(args), rows)


if __name__ == "__main__":
    main()
