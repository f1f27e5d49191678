"""Decode step time of the ModelRunner alone (no scheduler), at a given batch and context length,
for several KV block sizes, CUDA graphs on and off. Used to choose the block size. With --profile, also
where the step's GPU time goes (torch.profiler, kernels grouped by name) and the graph replay alone.

python -m bench runner-step --preset qwen3-0.6b --batches 256 --context 800 --block-sizes 16,64,128,256
python -m bench runner-step --block-sizes 256 --batches 1,32,256 --graphs-only --profile
python -m bench runner-step --block-sizes 256 --prefill 16384 --context 585 --profile   # a prefill step
python -m bench runner-step --preset llama-3.1-8b --num-layers 8 --block-sizes 256 --batches 128 --graphs-only --profile
python -m bench runner-step --block-sizes 256 --batches 1,128 --graphs-only --loras 0,1,4   # LoRA adapters' cost
python -m bench runner-step --loras 2 --place   # reading a LoRA adapter into host memory, and moving it into a slot
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from bench.common import replay_ms
from bench.record import record
from common.limits import Limits
from common.util import cdiv
from protos import worker_pb2 as pb
from worker_svc.checkpoints.writer import make_lora_adapter, make_model
from worker_svc.runtime.model_runner import ModelRunner, RunnerConfig

SAMPLING = pb.SamplingParams(temperature=0.6, top_p=1.0, repetition_penalty=1.0, logprobs=-1, seed=1)


def _sync() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


class DecodeBatch:
    """`batch` sequences prefilled to `context` tokens on a fresh runner, then decoded together."""

    def __init__(self, model_dir: Path, batch: int, context: int, block_size: int, graphs: bool, steps: int,
                 kv_cache_dtype: str = "auto", device: str = "cuda", loras: dict[str, Path] | None = None,
                 quantization: str = "auto"):
        """loras: LoRA adapters served (name -> folder); the sequences run under them in turn."""
        per_seq = cdiv(context + 4 * steps + 32, block_size)  # room for step_ms's, host_ms's and profile's steps
        names = list(loras or {})
        self.runner = ModelRunner(model_dir, RunnerConfig(
            device=device, block_size=block_size, num_blocks=batch * per_seq, cuda_graphs=graphs,
            kv_cache_dtype=kv_cache_dtype, lora_modules={n: str(f) for n, f in (loras or {}).items()},
            quantization=quantization,
            limits=Limits(max_num_seqs=batch, max_num_batched_tokens=8192, max_model_len=per_seq * block_size)))
        self.ids, self.step = list(range(batch)), 0
        rng = random.Random(0)
        per_plan = max(1, 8192 // context)
        for first in range(0, batch, per_plan):
            plan = self._plan()
            for i in range(first, min(batch, first + per_plan)):
                sampling = pb.SamplingParams(lora=names[i % len(names)] if names else "")
                sampling.MergeFrom(SAMPLING)
                plan.new_seqs.add(seq_id=i, token_ids=[rng.randrange(10000) for _ in range(context)],
                                  prompt_len=context, sampling=sampling,
                                  block_ids=list(range(i * per_seq, (i + 1) * per_seq)),
                                  num_computed_tokens=0, num_scheduled_tokens=context)
            self.runner.execute(plan).result()

    def _plan(self) -> pb.StepPlan:
        self.step += 1
        return pb.StepPlan(step=self.step, epoch=self.runner.epoch)

    def decode(self):
        plan = self._plan()
        n = len(self.ids)
        plan.seq_ids.extend(self.ids)
        plan.num_scheduled_tokens.extend([1] * n)
        plan.num_new_blocks.extend([0] * n)
        return self.runner.execute(plan)

    def step_ms(self, steps: int) -> float:
        """Steady-state step time with a depth-2 pipeline: step N+1 is launched before N is waited for."""
        for _ in range(3):
            self.decode().result()
        _sync()
        start, pending = time.perf_counter(), None
        for _ in range(steps):
            launched = self.decode()
            if pending is not None:
                pending.result()
            pending = launched
        pending.result()
        return (time.perf_counter() - start) / steps * 1e3

    def host_ms(self, steps: int, busy: bool) -> float:
        """Host time of execute(); busy: launched behind ~10 ms of GPU work, so a wait for the GPU inside
        execute() would show as ~10 ms more."""
        host = 0.0
        for _ in range(steps):
            if busy:
                torch.cuda._sleep(20_000_000)
            t = time.perf_counter()
            pending = self.decode()
            host += time.perf_counter() - t
            pending.result()
        return host / steps * 1e3

    def profile(self, steps: int) -> None:
        print(f"host time of execute(): {self.host_ms(steps, False):.3f} ms per step, "
              f"{self.host_ms(steps, True):.3f} behind a busy GPU")
        graphs = self.runner.decode.graphs
        if graphs:
            print(f"graph replay alone: {replay_ms(graphs[max(graphs)], steps):.3f} ms")
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(5):
                self.decode().result()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


def prefill_step(model_dir: Path, tokens: int, context: int, block_size: int, steps: int,
                 profile: bool, device: str = "cuda") -> dict:
    """Time (and profile) an eager step of new `context`-token prompts totalling about `tokens` tokens,
    as the offline workload's prefill steps are (16k tokens each)."""
    seqs = max(1, tokens // context)
    per_seq = cdiv(context + 1, block_size)
    runner = ModelRunner(model_dir, RunnerConfig(
        device=device, block_size=block_size, num_blocks=seqs * per_seq, cuda_graphs=False,
        limits=Limits(max_num_seqs=seqs, max_num_batched_tokens=seqs * context, max_model_len=per_seq * block_size)))
    rng = random.Random(0)
    prompts = [[rng.randrange(10000) for _ in range(context)] for _ in range(seqs)]
    counter = iter(range(1, 1 << 30))

    def step():
        plan = pb.StepPlan(step=next(counter), epoch=runner.epoch)
        first = (plan.step - 1) * seqs  # fresh ids each step: the batch refuses an id ended and sent in one plan
        if plan.step > 1:  # the previous step's sequences end (applied before the new ones)
            plan.finished_ids.extend(range(first - seqs, first))
        for i, prompt in enumerate(prompts):
            plan.new_seqs.add(seq_id=first + i, token_ids=prompt, prompt_len=context, sampling=SAMPLING,
                              block_ids=list(range(i * per_seq, (i + 1) * per_seq)),
                              num_computed_tokens=0, num_scheduled_tokens=context)
        return runner.execute(plan).result()

    for _ in range(3):
        step()
    _sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    ms = (time.perf_counter() - start) / steps * 1e3
    if profile:
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(3):
                step()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
    return {"block_size": block_size, "cuda_graphs": False, "prefill_tokens": seqs * context, "context": context,
            "step_ms": round(ms, 3), "tokens_per_s": round(seqs * context / ms * 1e3)}


def place_lora(model_dir: Path, adapters: dict[str, Path], device: str, reps: int = 10) -> dict:
    """How long a worker takes to read each adapter into host memory (StepPlan.load_loras) and to copy one into its
    only slot (StepPlan.lora_slots; the adapters in turn, each replacing the last): both hold the worker's steps."""
    runner = ModelRunner(model_dir, RunnerConfig(device=device, num_blocks=64, cuda_graphs=False, max_loras=1,
                                                 max_cpu_loras=len(adapters), limits=Limits(max_num_seqs=8)))
    reads, places = [], []
    for name, folder in adapters.items():
        _sync()
        t = time.perf_counter()
        runner.lora.register(name, folder)
        reads.append((time.perf_counter() - t) * 1e3)
    names = list(adapters)
    for i in range(reps + 1):
        _sync()
        t = time.perf_counter()
        runner.lora.place(0, names[i % len(names)])
        _sync()
        places.append((time.perf_counter() - t) * 1e3)
    size = sum(t.numel() * t.element_size() for a, b in runner.lora.registered[names[0]].values() for t in (a, b))
    return {"adapters": len(adapters), "adapter_mb": round(size / 1e6, 2),
            "read_ms": round(statistics.median(reads), 2), "place_ms": round(statistics.median(places[1:]), 3),
            "first_place_ms": round(places[0], 3)}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--device", default="cuda", help="cpu: the same steps eagerly (a smoke test; no --profile)")
    ap.add_argument("--num-layers", type=int, help="the preset's first N layers only (a large model's step per layer)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--quantization", default="auto", help="the projections' GEMMs, comma-separated to time several "
                    "(auto, fp8, none: the worker's --quantization)")
    ap.add_argument("--batches", default="256", help="decode batch sizes, comma-separated")
    ap.add_argument("--context", type=int, default=800)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--block-sizes", default="16,64,128,256")
    ap.add_argument("--profile", action="store_true", help="profile each configuration's decode step with graphs")
    ap.add_argument("--graphs-only", action="store_true", help="skip the eager steps")
    ap.add_argument("--prefill", type=int, default=0,
                    help="time a prefill step of this many tokens (prompts of --context tokens) instead")
    ap.add_argument("--loras", default="0", help="LoRA adapters served, comma-separated counts to time (decode "
                    "steps only): the sequences run under them in turn")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--place", action="store_true", help="time reading the largest --loras count of adapters into "
                    "host memory and moving them into a slot in turn, instead of steps")
    ap.add_argument("--out", default="bench/results/runner_step.json")
    args = ap.parse_args(argv)
    rows = []
    counts = [int(n) for n in args.loras.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(args.preset, Path(tmp) / "m", seed=0, dtype="bfloat16",
                               num_layers=args.num_layers)
        adapters = {f"lora{i}": make_lora_adapter(model_dir, Path(tmp) / f"lora{i}", rank=args.lora_rank, seed=i)
                    for i in range(max(counts))}
        if args.place:
            rows.append(place_lora(model_dir, adapters, args.device))
            print(json.dumps(rows[-1]), flush=True)
        for bs in [int(b) for b in args.block_sizes.split(",")] if not args.place else []:
            if args.prefill:
                rows.append(prefill_step(model_dir, args.prefill, args.context, bs, args.steps, args.profile,
                                         args.device))
                print(json.dumps(rows[-1]), flush=True)
                continue
            for size, loras, quantization, graphs in itertools.product(
                    [int(b) for b in args.batches.split(",")], counts, args.quantization.split(","),
                    (True,) if args.graphs_only else (True, False)):
                batch = DecodeBatch(model_dir, size, args.context, bs, graphs, args.steps, args.kv_cache_dtype,
                                    args.device, dict(list(adapters.items())[:loras]), quantization)
                ms = batch.step_ms(args.steps)
                rows.append({"block_size": bs, "cuda_graphs": graphs, "batch": size, "context": args.context,
                             "loras": loras, "quantization": quantization, "step_ms": round(ms, 3),
                             "tokens_per_s": round(size / ms * 1e3)})
                print(json.dumps(rows[-1]), flush=True)
                if args.profile and graphs:
                    batch.profile(args.steps)
                del batch
                if torch.cuda.is_initialized():
                    torch.cuda.empty_cache()
    record(args.out, "runner_step", vars(args), rows)


if __name__ == "__main__":
    main()
