"""Prefix sharing through the services: many requests over a few long shared prefixes
(bench.workload.prefix_sharing), with the scheduler's prefix caching on and off (a fresh cluster each).
Throughput and the cache hit rate: cached prompt tokens / prompt tokens, summed over the usage of
every request. `ideal_hit_rate` is what a cache that already held every prefix's first copy would hit
(the full blocks of each shared prefix, from each prefix's second request on).

    python -m bench.prefix --preset qwen3-0.6b --device cuda
    python -m bench.prefix --simulate
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import tqdm

from bench import common
from bench.workload import Request, prefix_sharing
from common.util import run_loop


async def _run(address: str, reqs: list[Request], args: argparse.Namespace,
               desc: str) -> tuple[list[common.Trace], float]:
    from client import AsyncClient

    sampling = dict(temperature=args.temperature, ignore_eos=True)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency > 0 else contextlib.nullcontext()
    async with AsyncClient(address) as client:
        for _ in range(args.warmup):  # a prompt no request shares
            await common.stream(client, [1, 2, 3], 16, **sampling)
        bar = tqdm(total=len(reqs), desc=desc, dynamic_ncols=True)

        async def one(r: Request) -> common.Trace:
            async with limit:
                trace = await common.stream(client, r.prompt_ids, r.max_tokens, **sampling)
            bar.update(1)
            return trace

        start = time.perf_counter()
        try:
            traces = await asyncio.gather(*(one(r) for r in reqs))
        finally:
            bar.close()
        return list(traces), time.perf_counter() - start


def ideal_hit_rate(args: argparse.Namespace, reqs: list[Request]) -> float:
    shared = args.prefix_len // args.block_size * args.block_size
    prompt = sum(len(r.prompt_ids) for r in reqs)
    return (len(reqs) - args.num_prefixes) * shared / prompt if prompt else 0.0


def summarize(caching: bool, traces: list[common.Trace], seconds: float) -> dict:
    done = [t for t in traces if t.error is None and t.usage is not None]
    prompt = sum(t.usage.prompt_tokens for t in done)
    cached = sum(t.usage.cached_prompt_tokens for t in done)
    out = sum(t.output_tokens for t in done)
    ttfts = [t.ttft * 1e3 for t in done if t.times]
    return {
        "prefix_caching": "on" if caching else "off",
        "requests": len(traces),
        "errors": len(traces) - len(done),
        "seconds": common.rnd(seconds, 3),
        "prompt_tokens": prompt,
        "cached_prompt_tokens": cached,
        "hit_rate": common.rnd(cached / prompt if prompt else 0.0, 4),
        "output_tokens_per_s": common.rnd(out / seconds if seconds > 0 else float("nan"), 0),
        "total_tokens_per_s": common.rnd((prompt + out) / seconds if seconds > 0 else float("nan"), 0),
        "ttft_p50_ms": common.rnd(common.percentile(ttfts, 50)),
        "ttft_p99_ms": common.rnd(common.percentile(ttfts, 99)),
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.prefix", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(ap, out="bench/results/prefix.json")
    ap.add_argument("--num-prefixes", type=int, default=4)
    ap.add_argument("--per-prefix", type=int, default=64, help="requests per prefix")
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--max-concurrency", type=int, default=0, help="requests in flight at most (0: all at once)")
    ap.add_argument("--caching", choices=["on", "off", "both"], default="both")
    ap.add_argument("--warmup", type=int, default=2, help="16-token requests before measuring")
    return ap


def main(argv: Sequence[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    reqs = prefix_sharing(args.num_prefixes, args.per_prefix, args.prefix_len, args.suffix_len, args.output_len)
    ideal = common.rnd(ideal_hit_rate(args, reqs), 4)
    rows = []
    with common.model_dir(args) as model:
        for caching in (True, False):
            if args.caching not in ("both", "on" if caching else "off"):
                continue
            with common.cluster(args, Path(model), [] if caching else ["--no-enable-prefix-caching"]) as address:
                traces, seconds = run_loop(_run(address, reqs, args, f"prefix caching {'on' if caching else 'off'}"))
            rows.append({"path": common.path_label(args, "grpc services"), **summarize(caching, traces, seconds),
                         "ideal_hit_rate": ideal if caching else 0.0})
            print(rows[-1], flush=True)
    return common.save("bench.prefix", argv, args.out, "prefix", args, rows)


if __name__ == "__main__":
    main()
