"""Where a decode step's time goes on the GPU: torch.profiler over steady-state decode steps of the
ModelRunner, kernels grouped by name, plus the CUDA-graph replay timed alone with CUDA events.

python -m bench.profile_step --preset qwen3-0.6b --batch 256 --context 800
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from protos import worker_pb2 as pb
from worker_svc.make_model import make_model
from worker_svc.model_runner import ModelRunner, RunnerConfig

SAMPLING = pb.SamplingParams(temperature=0.6, top_p=1.0, repetition_penalty=1.0, logprobs=-1, seed=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=800)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    batch, context, bsz = args.batch, args.context, args.block_size
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(args.preset, Path(tmp) / "m", seed=0, dtype="bfloat16")
        per_seq = -(-(context + 4 * args.steps + 16) // bsz)
        runner = ModelRunner(model_dir, RunnerConfig(
            device="cuda", block_size=bsz, num_blocks=batch * per_seq, max_num_seqs=batch,
            max_model_len=per_seq * bsz))
    rng = random.Random(0)
    step = 0
    for first in range(0, batch, max(1, 8192 // context)):
        step += 1
        plan = pb.StepPlan(step=step, epoch=runner.epoch)
        for i in range(first, min(batch, first + max(1, 8192 // context))):
            plan.new_seqs.add(seq_id=i, token_ids=[rng.randrange(10000) for _ in range(context)],
                              prompt_len=context, sampling=SAMPLING,
                              block_ids=list(range(i * per_seq, (i + 1) * per_seq)),
                              num_computed_tokens=0, num_scheduled_tokens=context)
        runner.execute(plan).result()
    ids = list(range(batch))

    def decode():
        nonlocal step
        step += 1
        return runner.execute(pb.StepPlan(step=step, epoch=runner.epoch, seq_ids=ids,
                                          num_scheduled_tokens=[1] * batch, num_new_blocks=[0] * batch))

    for _ in range(5):
        decode().result()
    # host time of execute() alone, and the full step serially
    t0 = time.perf_counter()
    host = 0.0
    for _ in range(args.steps):
        h0 = time.perf_counter()
        p = decode()
        host += time.perf_counter() - h0
        p.result()
    serial = (time.perf_counter() - t0) / args.steps * 1e3
    print(f"serial step {serial:.3f} ms, of which host execute() {host / args.steps * 1e3:.3f} ms")
    graph = runner.graphs.graphs[max(runner.graphs.graphs)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.steps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    print(f"graph replay alone (batch {max(runner.graphs.graphs)}): {start.elapsed_time(end) / args.steps:.3f} ms")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            decode().result()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


if __name__ == "__main__":
    main()
