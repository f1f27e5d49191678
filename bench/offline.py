"""Offline throughput on nano-vLLM's workload (256 sequences, prompts and outputs of 100-1024 tokens,
temperature 0.6, ignore EOS): in-process (engine and ModelRunner in one process, no gRPC) and through
the services (client -> scheduler -> worker over gRPC on loopback). Output tokens / wall time,
prefill included; through the services once streaming token by token and once with one message per
completion (stream_interval 0, how a batch client asks). With --simulate both paths run over the simulated worker (no model, GPU-like step
times), which measures the scheduler's and the split's cost on a CPU.

python -m bench offline --preset qwen3-0.6b --device cuda --mode both
"""
from __future__ import annotations

import argparse
import asyncio
import time
from collections import deque
from collections.abc import Sequence

from bench import common
from bench.workload import Request, offline


class StepTrace:
    """Engine step observer: when each step's result came back and what the step held, to split the run
    into steps with prefill tokens (eager) and decode-only steps (CUDA graphs on a GPU)."""

    def __init__(self):
        self.plans: deque = deque()
        self.steps: list[tuple[float, int, int]] = []  # (result time, sequences, tokens)

    def plan(self, plan) -> None:
        tokens = sum(plan.num_scheduled_tokens) + sum(s.num_scheduled_tokens for s in plan.new_seqs)
        self.plans.append((len(plan.seq_ids) + len(plan.new_seqs), tokens))

    def result(self, result) -> None:
        self.steps.append((time.perf_counter(), *self.plans.popleft()))

    def durations(self, start: float) -> list[tuple[float, int, bool]]:
        """(seconds since the previous result, sequences, decode-only) per step, from `start`."""
        ends = [start] + [t for t, _, _ in self.steps]
        return [(t - last, seqs, tokens == seqs) for last, (t, seqs, tokens) in zip(ends, self.steps)]

    def by_batch(self, start: float, width: int = 32) -> dict[str, float]:
        """Mean decode-only step time (ms) per bucket of batch sizes."""
        buckets: dict[int, list[float]] = {}
        for seconds, seqs, decode in self.durations(start):
            if decode:
                buckets.setdefault(seqs // width, []).append(seconds)
        return {f"{b * width}-{b * width + width - 1}": round(sum(v) / len(v) * 1e3, 2)
                for b, v in sorted(buckets.items())}

    def summary(self, start: float) -> dict:
        steps = self.durations(start)
        decodes = [(seconds, seqs) for seconds, seqs, decode in steps if decode]
        decode = sum(seconds for seconds, _ in decodes)
        n = max(len(decodes), 1)
        return {"steps": len(steps), "mixed_steps": len(steps) - len(decodes),
                "mixed_s": round(sum(seconds for seconds, _, d in steps if not d), 2),
                "decode_steps": len(decodes), "decode_s": round(decode, 2),
                "decode_ms_per_step": round(decode / n * 1e3, 2),
                "mean_decode_batch": round(sum(seqs for _, seqs in decodes) / n, 1)}


def run_in_process(args: argparse.Namespace, model, reqs: list[Request]) -> tuple[float, dict]:
    from scheduler_svc.sampling import SamplingParams

    with common.in_process_llm(args, model) as llm:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=r.max_tokens) for r in reqs]
        trace = llm.engine.step_observer = StepTrace()
        start = time.perf_counter()
        outs = llm.generate([r.prompt_ids for r in reqs], params, use_tqdm=True)
        elapsed = time.perf_counter() - start
    assert sum(len(o.token_ids) for o in outs) == sum(r.max_tokens for r in reqs)
    print("decode step ms by batch size:", trace.by_batch(start), flush=True)
    return elapsed, trace.summary(start)


async def _through_services(address: str, reqs: list[Request], stream_interval: int) -> float:
    from client import AsyncClient

    async with AsyncClient(address) as client:
        await client.complete(token_ids=[1, 2, 3], max_tokens=8)  # warm-up

        async def one(r: Request) -> int:
            n = 0
            async for delta in client.generate(token_ids=r.prompt_ids, max_tokens=r.max_tokens, temperature=0.6,
                                               ignore_eos=True, stream_interval=stream_interval):
                n += len(delta.token_ids)
            return n

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(r) for r in reqs))
        elapsed = time.perf_counter() - start
    assert sum(counts) == sum(r.max_tokens for r in reqs), (sum(counts), sum(r.max_tokens for r in reqs))
    return elapsed


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(ap, out="bench/results/offline.json")
    ap.add_argument("--mode", choices=["in-process", "services", "both"], default="both")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-input", type=int, default=1024)
    ap.add_argument("--max-output", type=int, default=1024)
    ap.add_argument("--stream-intervals", default="1,0",
                    help="services passes, by tokens per message (the request's stream_interval; 0: one message "
                         "per completion, as a batch client asks)")
    args = ap.parse_args(argv)
    reqs = offline(args.num_seqs, args.max_input, args.max_output)
    total = sum(r.max_tokens for r in reqs)
    rows = []
    with common.model_dir(args) as model:
        if args.mode in ("in-process", "both"):
            t, steps = run_in_process(args, model, reqs)
            rows.append({"path": common.path_label(args, "in-process"), "seconds": round(t, 2),
                         "output_tokens": total, "tokens_per_s": round(total / t), **steps})
            print(rows[-1], flush=True)
        if args.mode in ("services", "both"):
            with common.cluster(args, model) as address:
                for k, interval in enumerate(int(i) for i in args.stream_intervals.split(",")):
                    # a first token outside the workload's ids: a later pass hits no block an earlier cached
                    fresh = reqs if k == 0 else [Request([10_001 + k, *r.prompt_ids[1:]], r.max_tokens) for r in reqs]
                    t = asyncio.run(_through_services(address, fresh, interval))
                    label = "grpc services" + ("" if interval == 1 else f", stream_interval {interval}")
                    rows.append({"path": common.path_label(args, label), "seconds": round(t, 2),
                                 "output_tokens": total, "tokens_per_s": round(total / t)})
                    print(rows[-1], flush=True)
    common.save("bench.offline", argv, args.out, "offline", args, rows)


if __name__ == "__main__":
    main()
