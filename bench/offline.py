"""Offline throughput on nano-vLLM's workload (256 sequences, prompts and outputs of 100-1024 tokens,
temperature 0.6, ignore EOS): in-process (engine and ModelRunner in one process, no gRPC) and through
the services (client -> scheduler -> worker over gRPC on loopback). Output tokens / wall time,
prefill included.

python -m bench.offline --preset qwen3-0.6b --device cuda --mode both
"""
from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from bench.record import record
from bench.workload import Request, offline


def run_in_process(model_dir: Path, reqs: list[Request], worker: dict, engine: dict) -> float:
    from scheduler_svc.llm import LLM
    from scheduler_svc.sampling import SamplingParams

    with LLM(model_dir, **engine, **worker) as llm:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=r.max_tokens) for r in reqs]
        start = time.perf_counter()
        outs = llm.generate([r.prompt_ids for r in reqs], params, use_tqdm=True)
        elapsed = time.perf_counter() - start
    assert sum(len(o.token_ids) for o in outs) == sum(r.max_tokens for r in reqs)
    return elapsed


async def _through_services(address: str, reqs: list[Request]) -> float:
    from client import AsyncClient

    async with AsyncClient(address) as client:
        await client.complete(token_ids=[1, 2, 3], max_tokens=8)  # warm-up

        async def one(r: Request) -> int:
            n = 0
            async for delta in client.generate(token_ids=r.prompt_ids, max_tokens=r.max_tokens, temperature=0.6,
                                               ignore_eos=True):
                n += len(delta.token_ids)
            return n

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(r) for r in reqs))
        elapsed = time.perf_counter() - start
    assert sum(counts) == sum(r.max_tokens for r in reqs), (sum(counts), sum(r.max_tokens for r in reqs))
    return elapsed


def run_services(model_dir: Path, reqs: list[Request], worker_args: list[str], scheduler_args: list[str],
                 device: str, simulate: bool = False) -> float:
    from client.launcher import LocalCluster

    with LocalCluster(model_dir, device=device, worker_args=worker_args, scheduler_args=scheduler_args,
                      worker_command="simulate" if simulate else "serve") as cluster:
        try:
            return asyncio.run(_through_services(cluster.address, reqs))
        finally:
            for p in cluster.processes:
                print(f"--- {p.name} log tail ---\n{p.tail(8)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--model", type=Path, help="checkpoint folder (default: write the preset)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--mode", choices=["in-process", "services", "both"], default="both")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-input", type=int, default=1024)
    ap.add_argument("--max-output", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--simulate", action="store_true",
                    help="services over the simulated worker (no model, GPU-like step times): the split's cost on a CPU")
    ap.add_argument("--out", default="bench/results/offline.json")
    args = ap.parse_args()
    reqs = offline(args.num_seqs, args.max_input, args.max_output)
    total = sum(r.max_tokens for r in reqs)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or __import__("worker_svc.make_model", fromlist=["make_model"]).make_model(
            args.preset, Path(tmp) / "model", seed=0, dtype="bfloat16")
        worker = dict(device=args.device, block_size=args.block_size)
        engine = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                      max_model_len=args.max_model_len)
        rows = []
        if args.mode in ("in-process", "both"):
            t = run_in_process(model_dir, reqs, worker, engine)
            rows.append({"path": "in-process", "seconds": round(t, 2), "output_tokens": total,
                         "tokens_per_s": round(total / t)})
            print(rows[-1], flush=True)
        if args.mode in ("services", "both"):
            worker_args = ["--block-size", str(args.block_size), "--max-num-seqs", str(args.max_num_seqs),
                           "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                           "--max-model-len", str(args.max_model_len)]
            scheduler_args = ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens",
                              str(args.max_num_batched_tokens)]
            t = run_services(model_dir, reqs, worker_args, scheduler_args, args.device, args.simulate)
            rows.append({"path": "grpc services" + (" (simulated worker)" if args.simulate else ""), "seconds": round(t, 2), "output_tokens": total,
                         "tokens_per_s": round(total / t)})
            print(rows[-1], flush=True)
    record(args.out, "offline", vars(args) | {"model": str(args.model or args.preset)}, rows)


if __name__ == "__main__":
    main()
