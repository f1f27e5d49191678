"""Batch-1 decode latency: one request at a time (a 128-token prompt, 256 output tokens, greedy,
ignore EOS), through the gRPC services and in-process (offline.llm.LLM's engine, no gRPC) for
comparison. Per output token after the first: the median, mean and p99 of the time between deltas
(shared by the tokens a delta brings); and the time to the first token.

    python -m bench.latency --preset qwen3-0.6b --device cuda
    python -m bench.latency --simulate      # both paths over the simulated worker: the split's cost
"""
from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import trange

from bench import common
from common.util import run_loop


def prompts(args: argparse.Namespace) -> list[list[int]]:
    """A fresh prompt per repeat (so no repeat's prefill hits the prefix cache of another)."""
    rng = random.Random(0)
    return [[rng.randint(0, 10000) for _ in range(args.prompt_len)] for _ in range(args.repeats)]


async def _services(address: str, args: argparse.Namespace) -> list[common.Trace]:
    from client import AsyncClient

    traces = []
    async with AsyncClient(address) as client:
        for _ in range(args.warmup):
            await common.stream(client, [1, 2, 3], 16, temperature=0.0, ignore_eos=True)
        todo = prompts(args)
        for i in trange(len(todo), desc="grpc services", dynamic_ncols=True):
            traces.append(await common.stream(client, todo[i], args.output_len, temperature=0.0,
                                              **common.constraint(args.structured)))
    return traces


def run_services(model: Path, args: argparse.Namespace) -> list[common.Trace]:
    with common.cluster(args, model) as address:
        return run_loop(_services(address, args))


def _engine_trace(engine, prompt: list[int], max_tokens: int, structured: bool = False) -> common.Trace:
    from scheduler_svc.sampling import SamplingParams

    trace = common.Trace(time.perf_counter())
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                              **common.constraint(structured, in_process=True)))
    while engine.has_unfinished():
        for out in engine.step():
            if out.token_ids:
                trace.times.append(time.perf_counter())
                trace.counts.append(len(out.token_ids))
            if out.finished:
                trace.finish_reason, trace.usage = out.finish_reason, out.usage
    return trace


def run_in_process(model: Path, args: argparse.Namespace) -> list[common.Trace]:
    with common.in_process_llm(args, model) as llm:
        for _ in range(args.warmup):
            _engine_trace(llm.engine, [1, 2, 3], 16)
        todo = prompts(args)
        return [_engine_trace(llm.engine, todo[i], args.output_len, args.structured)
                for i in trange(len(todo), desc="in-process", dynamic_ncols=True)]


def summarize(path: str, traces: list[common.Trace], args: argparse.Namespace) -> dict:
    done = [t for t in traces if t.error is None and t.times]
    gaps = [g * 1e3 for t in done for g in t.token_gaps()]
    mean = sum(gaps) / len(gaps) if gaps else float("nan")
    return {
        "path": path,
        "requests": len(traces),
        "errors": len(traces) - len(done),
        "prompt_tokens": args.prompt_len,
        "output_tokens": round(sum(t.output_tokens for t in done) / len(done)) if done else 0,
        "ttft_p50_ms": common.rnd(common.percentile([t.ttft * 1e3 for t in done], 50), 3),
        "ms_per_token_p50": common.rnd(common.percentile(gaps, 50), 3),
        "ms_per_token_mean": common.rnd(mean, 3),
        "ms_per_token_p99": common.rnd(common.percentile(gaps, 99), 3),
        "tokens_per_s": common.rnd(1e3 / mean if gaps else float("nan"), 0),
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.latency", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(ap, out="bench/results/latency.json")
    ap.add_argument("--mode", choices=["in-process", "services", "both"], default="both")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5, help="requests, one after another")
    ap.add_argument("--warmup", type=int, default=2, help="16-token requests before measuring")
    ap.add_argument("--structured", action="store_true",
                    help="constrain every measured request by a JSON schema (bench/common.py STRUCTURED_SCHEMA)")
    return ap


def main(argv: Sequence[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    rows = []
    with common.model_dir(args) as model:
        if args.mode in ("in-process", "both"):
            rows.append(summarize(common.path_label(args, "in-process"), run_in_process(Path(model), args), args))
            print(rows[-1], flush=True)
        if args.mode in ("services", "both"):
            rows.append(summarize(common.path_label(args, "grpc services"), run_services(Path(model), args), args))
            print(rows[-1], flush=True)
    return common.save("bench.latency", argv, args.out, "latency", args, rows)


if __name__ == "__main__":
    main()
