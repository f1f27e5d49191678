"""Offline throughput: in-process (engine and ModelRunner in one process, no gRPC) and through the services
(client -> scheduler -> worker over gRPC on loopback). Output tokens / wall time, prefill included; through
the services once streaming token by token and once with one message per completion (stream_interval 0, how a
batch client asks). Workloads (temperature 0.6, ignore EOS): `offline`, nano-vLLM's (256 sequences, prompts and
outputs of 100-1024 tokens), and `short`, many short requests (2,048, 100-300 tokens each). Each path runs the
workload --runs times in one process (fresh token ids each time), so the first run shows any warm-up left, and
every figure stands beside the workload's hardware floor (bench/floor.py). With --simulate both paths run over
the simulated worker (no model, GPU-like step times), which measures the scheduler's and the split's cost on a CPU.

python -m bench offline --preset qwen3-0.6b --device cuda --mode both [--workload short] [--runs 2]
"""
from __future__ import annotations

import argparse
import asyncio
import time
from collections import deque
from collections.abc import Sequence

from bench import common
from bench.workload import Request, offline, short
from common.util import run_loop


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


def run_in_process(args: argparse.Namespace, model, runs: list[list[Request]]) -> list[tuple[float, dict]]:
    from scheduler_svc.sampling import SamplingParams

    timings = []
    kv = {"num_blocks": args.num_blocks} if args.num_blocks else {}
    with common.in_process_llm(args, model, **kv) as llm:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)  # the engine's first step
        for reqs in runs:
            params = [SamplingParams(temperature=0.6, max_tokens=r.max_tokens,
                                     **common.constraint(constrained(i, args.structured), in_process=True))
                      for i, r in enumerate(reqs)]
            trace = llm.engine.step_observer = StepTrace()
            preempted = llm.engine.scheduler.num_preemptions
            start = time.perf_counter()
            outs = llm.generate([r.prompt_ids for r in reqs], params, use_tqdm=True)
            elapsed = time.perf_counter() - start
            tokens = sum(len(o.token_ids) for o in outs)
            assert args.structured or tokens == sum(r.max_tokens for r in reqs)
            print("decode step ms by batch size:", trace.by_batch(start), flush=True)
            timings.append((elapsed, {"output_tokens": tokens, **trace.summary(start),
                                      "preemptions": llm.engine.scheduler.num_preemptions - preempted}))
    return timings


def constrained(i: int, share: float) -> bool:
    """Whether request i of a workload is constrained, `share` of them spread evenly."""
    return int((i + 1) * share) > int(i * share)


async def _through_services(address: str, reqs: list[Request], stream_interval: int,
                            share: float = 0.0) -> tuple[float, list[int]]:
    """Seconds for the requests, and each one's output tokens."""
    from client import AsyncClient

    async with AsyncClient(address) as client:
        await client.complete(token_ids=[1, 2, 3], max_tokens=8)  # warm-up

        async def one(i: int, r: Request) -> int:
            n = 0
            async for delta in client.generate(token_ids=r.prompt_ids, max_tokens=r.max_tokens, temperature=0.6,
                                               stream_interval=stream_interval,
                                               **common.constraint(constrained(i, share))):
                n += len(delta.token_ids)
            return n

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
        elapsed = time.perf_counter() - start
    assert share or sum(counts) == sum(r.max_tokens for r in reqs), (sum(counts), sum(r.max_tokens for r in reqs))
    return elapsed, counts


def workload(args: argparse.Namespace) -> list[Request]:
    if args.workload == "short":
        return short(args.num_seqs or 2048)
    return offline(args.num_seqs or 256, args.max_input, args.max_output)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(ap, out="bench/results/offline.json")
    ap.add_argument("--mode", choices=["in-process", "services", "both"], default="both")
    ap.add_argument("--workload", choices=["offline", "short"], default="offline")
    ap.add_argument("--num-seqs", type=int, help="requests (default: the workload's, 256 or 2,048)")
    ap.add_argument("--max-input", type=int, default=1024, help="the offline workload's longest prompt")
    ap.add_argument("--max-output", type=int, default=1024, help="the offline workload's longest output")
    ap.add_argument("--runs", type=int, default=1, help="times each path runs the workload in one process")
    ap.add_argument("--num-blocks", type=int, help="the worker's KV blocks (default: what its memory budget holds)")
    ap.add_argument("--stream-intervals", default="1,0",
                    help="services passes, by tokens per message (the request's stream_interval; 0: one message "
                         "per completion, as a batch client asks)")
    ap.add_argument("--structured", type=float, default=0.0, metavar="SHARE",
                    help="share of requests constrained by a JSON schema (bench/common.py STRUCTURED_SCHEMA; "
                         "they may end before max_tokens, so tokens are counted, and each services pass is "
                         "followed by the same requests unconstrained, each as long as it ran constrained)")
    args = ap.parse_args(argv)
    reqs = workload(args)
    total = sum(r.max_tokens for r in reqs)
    # a first token outside the workload's ids, per pass: no pass hits a block an earlier one cached
    passes = [reqs] + [[Request([10_001 + k, *r.prompt_ids[1:]], r.max_tokens) for r in reqs]
                       for k in range(1, args.runs * len(args.stream_intervals.split(",")))]
    rows = []
    with common.model_dir(args) as model:
        floor, step_floor = _floor(args, model, reqs)

        def row(path: str, run: int, seconds: float, output_tokens: int = total, constrained: bool = True,
                **extra) -> dict:
            rate = output_tokens / seconds
            if args.structured and constrained:
                path += f", {args.structured:.0%} constrained"
            return {"path": common.path_label(args, path), "run": run, "seconds": round(seconds, 2),
                    "output_tokens": output_tokens, "tokens_per_s": round(rate), "floor_tokens_per_s": round(floor),
                    "pct_of_floor": round(100 * rate / floor, 1), **extra}

        if args.mode in ("in-process", "both"):
            for run, (t, steps) in enumerate(run_in_process(args, model, passes[:args.runs]), 1):
                rows.append(row("in-process", run, t, **steps, **step_floor))
                print(rows[-1], flush=True)
        if args.mode in ("services", "both"):
            kv = ["--num-blocks", str(args.num_blocks)] if args.num_blocks else []
            with common.cluster(args, model, extra_worker_args=kv) as address:
                k = 0
                for run in range(1, args.runs + 1):
                    for interval in (int(i) for i in args.stream_intervals.split(",")):
                        t, counts = run_loop(_through_services(address, passes[k], interval, args.structured))
                        label = "grpc services" + ("" if interval == 1 else f", stream_interval {interval}")
                        rows.append(row(label, run, t, sum(counts)))
                        print(rows[-1], flush=True)
                        if args.structured:  # the same work without constraints: each request as long as it ran
                            same = [Request([20_001 + k, *r.prompt_ids[1:]], max(n, 1))
                                    for r, n in zip(passes[k], counts)]
                            t, counts = run_loop(_through_services(address, same, interval))
                            rows.append(row(label + ", free at the constrained lengths", run, t, sum(counts), False))
                            print(rows[-1], flush=True)
                        k += 1
    common.save("bench.offline", argv, args.out, "offline", args, rows)


def _floor(args: argparse.Namespace, model, reqs: list[Request]) -> tuple[float, dict]:
    """The workload's hardware floor on one H200 (bench/floor.py), for the model's shape and the KV dtype, and a
    decode step's: its bytes, and for a MoE model the routed experts' read, in ms per step over the run."""
    import json

    from bench.floor import ModelShape, decode_step_floor, floor_tokens_per_s

    shape = ModelShape.from_config(json.loads((model / "config.json").read_text()))
    requests = [(len(r.prompt_ids), r.max_tokens) for r in reqs]
    kw = dict(max_num_seqs=args.max_num_seqs, kv_bytes=1 if args.kv_cache_dtype == "fp8" else 2)
    step_s, experts_s = decode_step_floor(shape, requests, **kw)
    step = {"decode_floor_ms_per_step": round(step_s * 1e3, 2)}
    if shape.num_experts:
        step["experts_ms_per_step"] = round(experts_s * 1e3, 2)
    return floor_tokens_per_s(shape, requests, **kw), step


if __name__ == "__main__":
    main()
