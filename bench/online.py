"""Online serving through the services (client -> scheduler -> worker over gRPC on loopback): requests
arrive as a Poisson process at several rates, each streamed; per rate the TTFT and inter-token latency
(p50/p99), output throughput and goodput (requests within the TTFT and per-token SLOs).

One cluster serves every rate (started once, warmed up, then the rates in sequence); each rate gets
fresh prompt token ids with the same lengths, so no rate hits the prefix cache of another.

    python -m bench.online --preset qwen3-0.6b --device cuda --rates 8,32,128
    python -m bench.online --simulate          # over the simulated worker, on a CPU
"""
from __future__ import annotations

import argparse
import asyncio
import math
import random
import time
from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import tqdm

from bench import common
from bench.workload import Request
from common.util import run_loop


async def run_rate(client, reqs: list[Request], rate: float, seed: int, sampling: dict, desc: str,
                   urgent: set[int] = frozenset()) -> tuple[list[common.Trace], float]:
    """Sends `reqs` at Poisson arrivals of `rate` per second (inf: all at once), those whose index is in `urgent`
    at priority 1; each request's clock starts at its scheduled arrival, so client lag counts against it. Returns
    the traces and the wall time from the first arrival to the last token."""
    rng = random.Random(seed)
    bar = tqdm(total=len(reqs), desc=desc, dynamic_ncols=True)
    tasks = []
    start = arrival = time.perf_counter()
    try:
        for i, r in enumerate(reqs):
            delay = arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(common.stream(client, r.prompt_ids, r.max_tokens, sent=arrival,
                                                     priority=int(i in urgent), **sampling))
            task.add_done_callback(lambda _: bar.update(1))
            tasks.append(task)
            arrival += rng.expovariate(rate) if math.isfinite(rate) else 0.0
        traces = await asyncio.gather(*tasks)
    finally:
        bar.close()
    return list(traces), max((t.end for t in traces), default=start) - start


def summarize(rate: float, traces: list[common.Trace], seconds: float, slo_ttft_ms: float,
              slo_itl_ms: float, urgent: set[int] = frozenset()) -> dict:
    """One rate's row; with urgent requests (their indices), their TTFT and the others' beside it."""
    done = [t for t in traces if t.error is None and t.times]
    ttfts = [t.ttft * 1e3 for t in done]
    gaps = [g * 1e3 for t in done for g in t.token_gaps()]
    tpots = [t.tpot * 1e3 for t in done]
    # a request with one token has no per-token latency: it is held to the TTFT only
    good = sum(1 for t, tp in zip(ttfts, tpots) if t <= slo_ttft_ms and (math.isnan(tp) or tp <= slo_itl_ms))
    out_tokens = sum(t.output_tokens for t in done)
    by_class = {}
    if urgent:
        for name, mine in (("urgent", True), ("others", False)):
            ttft = [t.ttft * 1e3 for i, t in enumerate(traces) if (i in urgent) == mine and t.error is None and t.times]
            by_class[f"ttft_p50_{name}_ms"] = common.rnd(common.percentile(ttft, 50))
            by_class[f"ttft_p99_{name}_ms"] = common.rnd(common.percentile(ttft, 99))
    return {
        "rate_req_s": rate if math.isfinite(rate) else "inf",
        "requests": len(traces),
        "errors": len(traces) - len(done),
        "seconds": common.rnd(seconds, 3),
        "achieved_req_s": common.rnd(len(done) / seconds if seconds > 0 else math.nan),
        "output_tokens_per_s": common.rnd(out_tokens / seconds if seconds > 0 else math.nan, 0),
        "ttft_p50_ms": common.rnd(common.percentile(ttfts, 50)),
        "ttft_p99_ms": common.rnd(common.percentile(ttfts, 99)),
        "itl_p50_ms": common.rnd(common.percentile(gaps, 50), 3),
        "itl_p99_ms": common.rnd(common.percentile(gaps, 99), 3),
        "tpot_p50_ms": common.rnd(common.percentile([x for x in tpots if not math.isnan(x)], 50), 3),
        "goodput_req_s": common.rnd(good / seconds if seconds > 0 else math.nan),
        "slo_met_pct": common.rnd(100 * good / len(traces) if traces else math.nan, 1),
        **by_class,
    }


async def run_all(address: str, reqs: list[Request], args: argparse.Namespace) -> list[dict]:
    from client import AsyncClient

    sampling = dict(temperature=args.temperature, ignore_eos=True)
    rows = []
    pick = random.Random(args.seed)
    urgent = {i for i in range(len(reqs)) if pick.random() < args.urgent_share}
    async with AsyncClient(address) as client:
        warm = reqs[: args.warmup]
        await asyncio.gather(*(common.stream(client, r.prompt_ids, min(r.max_tokens, 16), **sampling) for r in warm))
        for i, rate in enumerate(args.rates):
            batch = common.redraw_tokens(reqs, seed=1000 + i)  # fresh prompts: no hits on earlier rates' cache
            traces, seconds = await run_rate(client, batch, rate, seed=i, sampling=sampling, desc=f"{rate:g} req/s",
                                             urgent=urgent)
            rows.append(summarize(rate, traces, seconds, args.slo_ttft_ms, args.slo_itl_ms, urgent))
            print(rows[-1], flush=True)
            errors = [t.error for t in traces if t.error]
            if errors:
                print(f"{len(errors)} requests failed, e.g. {errors[0]}", flush=True)
    return rows


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.online", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(ap, out="bench/results/online.json")
    ap.add_argument("--rates", type=lambda s: common.csv_numbers(s), default=[8.0, 32.0, 128.0],
                    help="arrival rates in requests/s, comma separated (inf: all at once)")
    ap.add_argument("--num-requests", type=int, default=256, help="requests per rate")
    ap.add_argument("--max-input", type=int, default=1024, help="prompt lengths uniform in [100, max]")
    ap.add_argument("--max-output", type=int, default=1024, help="output lengths uniform in [100, max]")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--slo-ttft-ms", type=float, default=500.0, help="goodput: time to first token at most this")
    ap.add_argument("--slo-itl-ms", type=float, default=50.0,
                    help="goodput: mean time per output token after the first at most this")
    ap.add_argument("--warmup", type=int, default=8, help="requests (16 tokens each) before the first rate")
    ap.add_argument("--num-blocks", type=int, help="the worker's KV blocks (default: what its memory budget holds)")
    ap.add_argument("--urgent-share", type=float, default=0.0, metavar="SHARE",
                    help="requests sent at priority 1 (the rest at 0), drawn with --seed: each row gives their TTFT "
                         "and the others' apart")
    ap.add_argument("--seed", type=int, default=0, help="of the urgent requests' draw")
    return ap


def main(argv: Sequence[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    reqs = common.offline_workload(args.num_requests, args.max_input, args.max_output)
    with common.model_dir(args) as model:
        kv = ["--num-blocks", str(args.num_blocks)] if args.num_blocks else []
        with common.cluster(args, Path(model), extra_worker_args=kv) as address:
            rows = run_loop(run_all(address, reqs, args))
    rows = [{"path": common.path_label(args, "grpc services"), **row} for row in rows]
    return common.save("bench.online", argv, args.out, "online", args, rows)


if __name__ == "__main__":
    main()
