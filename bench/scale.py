"""How the scheduler scales with its workers: one scheduler over N simulated workers (the real protocol, GPU-like
step times fitted to the H200, no model), 256 requests of the offline workload per worker, the client load spread
over several processes (one Python client process cannot read 200k messages a second). Streamed token by token
and with one message per completion (stream_interval 0); aggregate output tok/s beside N x the one-worker figure,
and the CPU seconds the scheduler's whole process tree spends per 1,000 output tokens.

    python -m bench scale --workers 1,2,4,8 [--client-procs 8] [--scheduler-args "--frontends 4"]
    python -m bench scale --workers 1 --gateway   # the same load through the OpenAI gateway

Needs no GPU: run it where there are cores (the H200 machine's 16) and on the 2-core box.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import shlex
import time
from collections.abc import Sequence
from pathlib import Path

from bench import common

STEP_CLOCK = os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and every live descendant (from /proc)."""
    children: dict[int, list[int]] = {}
    stats: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
        stats[int(entry)] = (int(fields[11]) + int(fields[12])) / STEP_CLOCK
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += stats.get(p, 0.0)
        todo.extend(children.get(p, []))
    return total


async def _grpc_share(address: str, reqs: list, interval: int, connections: int) -> tuple[int, int, float, float]:
    from client import AsyncClient

    clients = [AsyncClient(address) for _ in range(connections)]
    tokens = errors = 0

    async def one(i: int, r) -> None:
        nonlocal tokens, errors
        trace = await common.stream(clients[i % connections], r.prompt_ids, r.max_tokens, ignore_eos=True,
                                    temperature=0.6, stream_interval=interval)
        tokens += trace.output_tokens
        errors += trace.error is not None or trace.output_tokens != r.max_tokens

    start = time.time()
    await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
    end = time.time()
    for c in clients:
        await c.close()
    return tokens, errors, start, end


async def _gateway_share(url: str, model: str, reqs: list, interval: int) -> tuple[int, int, float, float]:
    import httpx

    tokens = errors = 0
    limits = httpx.Limits(max_connections=len(reqs), max_keepalive_connections=len(reqs))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        async def one(r) -> None:
            nonlocal tokens, errors
            body = {"model": model, "prompt": r.prompt_ids, "max_tokens": r.max_tokens, "temperature": 0.6,
                    "ignore_eos": True, "stream": interval != 0}
            try:
                if interval == 0:
                    response = await http.post("/v1/completions", json=body)
                    response.raise_for_status()
                    got = response.json()["usage"]["completion_tokens"]
                else:
                    got = 0
                    async with http.stream("POST", "/v1/completions", json=body) as response:
                        response.raise_for_status()
                        async for line in response.aiter_lines():
                            got += line.startswith("data: {")
                tokens += got
                errors += got != r.max_tokens
            except httpx.HTTPError:
                errors += 1

        start = time.time()
        await asyncio.gather(*(one(r) for r in reqs))
        return tokens, errors, start, time.time()


def _client_process(target: dict, reqs: list, interval: int, results) -> None:
    if "gateway" in target:
        results.put(asyncio.run(_gateway_share(target["gateway"], target["model"], reqs, interval)))
    else:
        results.put(asyncio.run(_grpc_share(target["address"], reqs, interval, target["connections"])))


def drive(target: dict, reqs: list, interval: int, procs: int) -> tuple[int, int, float]:
    """Runs the requests from `procs` client processes at once: (output tokens, failed streams, seconds)."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    shares = [reqs[k::procs] for k in range(procs)]
    workers = [ctx.Process(target=_client_process, args=(target, share, interval, results)) for share in shares]
    for w in workers:
        w.start()
    outs = [results.get(timeout=900) for _ in workers]
    for w in workers:
        w.join()
    tokens, errors = sum(o[0] for o in outs), sum(o[1] for o in outs)
    return tokens, errors, max(o[3] for o in outs) - min(o[2] for o in outs)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-0.6b", help="config and tokenizer of this preset (no weights)")
    ap.add_argument("--workers", default="1,2,4,8", help="numbers of simulated workers")
    ap.add_argument("--requests-per-worker", type=int, default=256)
    ap.add_argument("--max-input", type=int, default=1024)
    ap.add_argument("--max-output", type=int, default=1024)
    ap.add_argument("--stream-intervals", default="1,0")
    ap.add_argument("--client-procs", type=int, default=0, help="client processes (0: min(8, cores // 2))")
    ap.add_argument("--connections", type=int, default=4, help="gRPC connections per client process")
    ap.add_argument("--scheduler-args", default="", help="extra flags of splitserve-scheduler")
    ap.add_argument("--worker-args", default="", help="extra flags of splitserve-worker simulate")
    ap.add_argument("--gateway", action="store_true", help="drive the load through the OpenAI gateway")
    ap.add_argument("--gateway-args", default="", help="extra flags of splitserve-gateway")
    ap.add_argument("--out", default="bench/results/scale.json")
    args = ap.parse_args(argv)
    import tempfile

    from client.launcher import LocalCluster

    procs = args.client_procs or max(1, min(8, (os.cpu_count() or 2) // 2))
    rows: list[dict] = []
    one_worker: dict[int, float] = {}
    with tempfile.TemporaryDirectory(prefix="splitserve-scale-") as tmp:
        model = common.write_config_only(args.preset, Path(tmp) / args.preset)
        for n in common.csv_numbers(args.workers, int):
            reqs = common.offline_workload(n * args.requests_per_worker, args.max_input, args.max_output)
            cluster = LocalCluster(model, num_workers=n, worker_command="simulate",
                                   worker_args=shlex.split(args.worker_args),
                                   scheduler_args=["--max-num-seqs", "512", *shlex.split(args.scheduler_args)],
                                   log_dir=Path(tmp) / f"logs-{n}")
            with cluster as c, _gateway(args, c, model) as target:
                scheduler = next(p for p in c.processes if p.name == "scheduler").popen.pid
                drive(target, common.offline_workload(8, 128, 16, seed=99), 1, 1)  # connections up, the tree warm
                for k, interval in enumerate(common.csv_numbers(args.stream_intervals, int)):
                    run = common.redraw_tokens(reqs, seed=k + 1)  # no prefix hits between passes
                    cpu = tree_cpu_seconds(scheduler)
                    tokens, errors, seconds = drive(target, run, interval, procs)
                    cpu = tree_cpu_seconds(scheduler) - cpu
                    rate = tokens / seconds
                    if n == 1 or interval not in one_worker:
                        one_worker.setdefault(interval, rate / n)
                    ideal = n * one_worker[interval]
                    rows.append({"workers": n, "stream_interval": interval, "path": "gateway" if args.gateway else
                                 "grpc", "client_procs": procs, "output_tokens": tokens, "errors": errors,
                                 "seconds": round(seconds, 2), "tokens_per_s": round(rate),
                                 "n_x_one_worker": round(ideal), "ratio": round(rate / ideal, 3),
                                 "scheduler_cpu_s": round(cpu, 1),
                                 "cpu_s_per_1k_tokens": round(1000 * cpu / max(tokens, 1), 4)})
                    print(rows[-1], flush=True)
    args.model, args.cpus = None, os.cpu_count()
    common.save("bench.scale", argv, args.out, "scale", args, rows)


@contextlib.contextmanager
def _gateway(args: argparse.Namespace, cluster, model: Path):
    if not args.gateway:
        yield {"address": cluster.address, "connections": args.connections}
        return
    import subprocess
    import sys

    from client.launcher import free_port, wait_http

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "--scheduler", cluster.address, "--port", str(port),
                             "--model-name", model.name, *shlex.split(args.gateway_args)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 120)
        yield {"gateway": f"http://127.0.0.1:{port}", "model": model.name}
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
