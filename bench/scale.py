"""How the scheduler scales with its workers: one scheduler over N simulated workers (the real protocol, GPU-like
step times fitted to the H200, no model), 256 requests of the offline workload per worker, the client load spread
over several processes (one Python client process cannot read 200k messages a second). Streamed token by token
and with one message per completion (stream_interval 0); aggregate output tok/s beside N x the one-worker figure,
and the CPU seconds the scheduler's whole process tree spends per 1,000 output tokens.

    python -m bench scale --workers 1,2,4,8 [--client-procs 8] [--scheduler-args "--frontends 4"]
    python -m bench scale --workers 1,2 --gateway   # the same load through the OpenAI gateway
    python -m bench scale --workers 8 --stream-intervals "" --burst 10000   # 10,000 streams at once

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
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from bench import common
from client.launcher import LocalCluster, free_port
from common.util import CPUS_ENV, available_cpus, run_loop

STEP_CLOCK = os.sysconf("SC_CLK_TCK")


def process_cpu(roots: list[tuple[str, int]]) -> dict[int, tuple[str, float]]:
    """User + system CPU seconds of each live process under the labelled root pids (from /proc): pid ->
    (role, seconds). In the scheduler's tree the role is what the process title says (frontend, engine),
    else its root's label."""
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
    out: dict[int, tuple[str, float]] = {}
    for label, root in roots:
        todo = [root]
        while todo:
            pid = todo.pop()
            role = label
            with contextlib.suppress(OSError):
                words = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").split()
                if len(words) > 1 and words[0] == b"splitserve-scheduler":
                    role = words[1].decode()
            out[pid] = (role, stats.get(pid, 0.0))
            todo.extend(children.get(pid, []))
    return out


def cpu_use(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], seconds: float,
            tokens: int) -> dict:
    """Per role: CPU seconds per 1,000 output tokens over the pass, and the busiest process's share of one core."""
    total: dict[str, float] = {}
    busiest: dict[str, float] = {}
    for pid, (role, cpu) in after.items():
        used = cpu - before.get(pid, (role, 0.0))[1]
        total[role] = total.get(role, 0.0) + used
        busiest[role] = max(busiest.get(role, 0.0), used / seconds)
    return {"cpu_s_per_1k_tokens": {r: round(1000 * c / max(tokens, 1), 4) for r, c in sorted(total.items())},
            "busiest_core_share": {r: round(b, 2) for r, b in sorted(busiest.items())}}


STEP_METRIC = "splitserve:worker_step_duration_seconds"


def worker_steps(metrics_ports: list[int]) -> list[tuple[float, float]]:
    """Each simulated worker's steps so far and the seconds they took (the time the GPU would have been busy),
    from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    out = []
    for port in metrics_ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            samples = {s.name: s.value for f in text_string_to_metric_families(r.read().decode())
                       for s in f.samples if s.name.startswith(STEP_METRIC)}
        out.append((samples.get(STEP_METRIC + "_count", 0.0), samples.get(STEP_METRIC + "_sum", 0.0)))
    return out


def worker_use(before: list[tuple[float, float]], after: list[tuple[float, float]], seconds: float,
               tokens: int) -> dict:
    """Over the pass: the workers' steps, output tokens per step, and each worker's busy share of the pass (the
    rest it waited for plans: what the scheduler tree cost the workers)."""
    steps = sum(a[0] - b[0] for a, b in zip(after, before))
    busy = [(a[1] - b[1]) / seconds for a, b in zip(after, before)]
    return {"worker_steps": int(steps), "tokens_per_step": round(tokens / max(steps, 1), 1),
            "worker_busy": [round(b, 3) for b in busy]}


class _MeteredCluster(LocalCluster):
    """LocalCluster whose workers serve /metrics, each on a port of its own (read by worker_steps)."""
    metrics_ports: list[int]

    def start_worker(self, port: int | None = None, extra: list[str] | None = None):
        metrics_port = free_port()
        self.metrics_ports = [*getattr(self, "metrics_ports", []), metrics_port]
        return super().start_worker(port, [*(extra or []), "--metrics-port", str(metrics_port)])


async def _start_together(ready, go) -> None:
    """Says this client process is ready and waits for every other one: a process still starting (imports,
    connections) would stretch the pass by its start-up, which is none of the scheduler's doing."""
    ready.put(os.getpid())
    await asyncio.get_running_loop().run_in_executor(None, go.wait)


async def _grpc_share(address: str, reqs: list, interval: int, connections: int, ready, go) -> dict:
    from client import AsyncClient

    clients = [AsyncClient(address) for _ in range(connections)]
    await asyncio.gather(*(c.model_info() for c in clients))  # every connection up
    await _start_together(ready, go)
    out = {"tokens": 0, "messages": 0, "short": 0, "statuses": {}, "examples": {}, "ttft": []}

    async def one(i: int, r) -> None:
        trace = await common.stream(clients[i % connections], r.prompt_ids, r.max_tokens, ignore_eos=True,
                                    temperature=0.6, stream_interval=interval)
        out["tokens"] += trace.output_tokens
        if trace.times:
            out["ttft"].append(trace.ttft)
        out["messages"] += len(trace.counts)
        if trace.error is not None:
            code = trace.error.split(":", 1)[0]
            out["statuses"][code] = out["statuses"].get(code, 0) + 1
            out["examples"].setdefault(code, trace.error)
        elif trace.output_tokens != r.max_tokens:
            out["short"] += 1

    out["start"], out["cpu"] = time.time(), time.process_time()
    await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
    out["end"] = time.time()
    for c in clients:
        await c.close()
    return out


async def _gateway_share(url: str, model: str, reqs: list, interval: int, ready, go) -> dict:
    import json

    import httpx

    out = {"tokens": 0, "short": 0, "statuses": {}}
    limits = httpx.Limits(max_connections=len(reqs), max_keepalive_connections=len(reqs))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        (await http.get("/v1/models")).raise_for_status()
        await _start_together(ready, go)
        async def one(r) -> None:
            body = {"model": model, "prompt": r.prompt_ids, "max_tokens": r.max_tokens, "temperature": 0.6,
                    "ignore_eos": True, "stream": interval != 0}
            try:
                if interval == 0:
                    response = await http.post("/v1/completions", json=body)
                    response.raise_for_status()
                    usage = response.json()["usage"]
                else:
                    body["stream_options"] = {"include_usage": True}
                    last = ""
                    async with http.stream("POST", "/v1/completions", json=body) as response:
                        response.raise_for_status()
                        async for line in response.aiter_lines():
                            if line.startswith("data: {"):
                                last = line
                    usage = json.loads(last[len("data: "):])["usage"]
                out["tokens"] += usage["completion_tokens"]
                out["short"] += usage["completion_tokens"] != r.max_tokens
            except httpx.HTTPStatusError as e:
                key = f"HTTP {e.response.status_code}"
                out["statuses"][key] = out["statuses"].get(key, 0) + 1
            except httpx.HTTPError as e:
                key = type(e).__name__
                out["statuses"][key] = out["statuses"].get(key, 0) + 1

        out["start"], out["cpu"] = time.time(), time.process_time()
        await asyncio.gather(*(one(r) for r in reqs))
        out["end"] = time.time()
        return out


def _client_process(target: dict, reqs: list, interval: int, results, ready, go) -> None:
    if "gateway" in target:
        share = _gateway_share(target["gateway"], target["model"], reqs, interval, ready, go)
    else:
        share = _grpc_share(target["address"], reqs, interval, target["connections"], ready, go)
    out = run_loop(share)
    out["cpu"] = time.process_time() - out["cpu"]
    results.put(out)


def drive(target: dict, reqs: list, interval: int, procs: int, at_start: Callable[[], None] | None = None) -> dict:
    """Runs the requests from `procs` client processes, started together once every one is up and connected
    (`at_start` is called then): output tokens, streams that ended early with no error, error statuses by code,
    the seconds from the first send to the last end, and the streams' time to first token (gRPC only: where a
    saturated front-end takes new calls late, the pass waits for them)."""
    ctx = multiprocessing.get_context("spawn")
    results, ready, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    shares = [reqs[k::procs] for k in range(procs)]
    workers = [ctx.Process(target=_client_process, args=(target, share, interval, results, ready, go))
               for share in shares]
    for w in workers:
        w.start()
    for _ in workers:
        ready.get(timeout=300)
    if at_start is not None:
        at_start()
    go.set()
    outs = [results.get(timeout=900) for _ in workers]
    for w in workers:
        w.join()
    statuses: dict[str, int] = {}
    examples: dict[str, str] = {}
    for o in outs:
        for code, count in o["statuses"].items():
            statuses[code] = statuses.get(code, 0) + count
        for code, example in o.get("examples", {}).items():
            examples.setdefault(code, example)
    ttft = sorted(t for o in outs for t in o.get("ttft", ()))
    return {"tokens": sum(o["tokens"] for o in outs), "messages": sum(o.get("messages", 0) for o in outs),
            "ttft": {"p50": _quantile(ttft, 0.5), "p90": _quantile(ttft, 0.9), "max": _quantile(ttft, 1.0)},
            "short": sum(o["short"] for o in outs),
            "statuses": statuses, "examples": examples,
            "seconds": max(o["end"] for o in outs) - min(o["start"] for o in outs),
            "client_cpu": [o["cpu"] for o in outs]}


def _quantile(ordered: list[float], q: float) -> float | None:
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3) if ordered else None


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-0.6b", help="config and tokenizer of this preset (no weights)")
    ap.add_argument("--workers", default="1,2,4,8", help="numbers of simulated workers")
    ap.add_argument("--requests-per-worker", type=int, default=256)
    ap.add_argument("--max-input", type=int, default=1024)
    ap.add_argument("--max-output", type=int, default=1024)
    ap.add_argument("--stream-intervals", default="1,0")
    ap.add_argument("--client-procs", type=int, default=0,
                    help="client processes (0: three quarters of the cores, up to 16)")
    ap.add_argument("--connections", type=int, default=4, help="gRPC connections per client process")
    ap.add_argument("--scheduler-args", default="", help="extra flags of splitserve-scheduler")
    ap.add_argument("--worker-args", default="", help="extra flags of splitserve-worker simulate")
    ap.add_argument("--gateway", action="store_true", help="drive the load through the OpenAI gateway")
    ap.add_argument("--gateway-args", default="", help="extra flags of splitserve-gateway")
    ap.add_argument("--burst", type=int, default=0,
                    help="then this many short streams at once (32 prompt tokens, 16 out): all must complete")
    ap.add_argument("--scheduler-cores", type=int, default=0,
                    help="pin the scheduler tree to this many cores of its own (and size it to them); the "
                         "clients, workers and gateway get the rest (0: everything shares every core)")
    ap.add_argument("--out", default="bench/results/scale.json")
    args = ap.parse_args(argv)
    tree_cores: set[int] = set()
    if args.scheduler_cores:
        cores = sorted(os.sched_getaffinity(0))
        if not 0 < args.scheduler_cores < len(cores):
            ap.error(f"--scheduler-cores must leave cores for the load: 1 to {len(cores) - 1}")
        tree_cores = set(cores[:args.scheduler_cores])
        os.sched_setaffinity(0, set(cores[args.scheduler_cores:]))  # inherited by the clients and workers
    import tempfile

    procs = args.client_procs or max(1, min(16, available_cpus() * 3 // 4))
    rows: list[dict] = []
    one_worker: dict[int, float] = {}
    with tempfile.TemporaryDirectory(prefix="splitserve-scale-") as tmp:
        model = common.write_config_only(args.preset, Path(tmp) / args.preset)
        for n in common.csv_numbers(args.workers, int):
            reqs = common.offline_workload(n * args.requests_per_worker, args.max_input, args.max_output)
            cluster = _MeteredCluster(model, num_workers=n, worker_command="simulate",
                                   worker_args=shlex.split(args.worker_args),
                                   scheduler_args=["--max-num-seqs", "512", *shlex.split(args.scheduler_args)],
                                   log_dir=Path(tmp) / f"logs-{n}")
            with contextlib.ExitStack() as stack:
                with _cpus_env(args.scheduler_cores):
                    c = stack.enter_context(cluster)
                target, gateway_pid = stack.enter_context(_gateway(args, c, model))
                _wait_for_workers(c.address, n)  # every group up (and its engine started) before anything counts
                if tree_cores:
                    _pin_tree(next(p.popen.pid for p in c.processes if p.name == "scheduler"), tree_cores)
                roots = [("supervisor" if p.name == "scheduler" else "worker", p.popen.pid) for p in c.processes]
                roots += [("gateway", gateway_pid)] if gateway_pid else []
                drive(target, common.offline_workload(8, 128, 16, seed=99), 1, 1)  # connections up, the tree warm
                passes = [(interval, reqs) for interval in common.csv_numbers(args.stream_intervals, int)]
                if args.burst:
                    passes.append((1, common.offline_workload(args.burst, 32, 16, seed=7)))
                for k, (interval, work) in enumerate(passes):
                    run = common.redraw_tokens(work, seed=k + 1)  # no prefix hits between passes
                    before: dict[int, tuple[str, float]] = {}
                    steps_before: list[tuple[float, float]] = []

                    routed_before = requests_by_worker(c.address)

                    def at_start() -> None:
                        before.update(process_cpu(roots))
                        steps_before.extend(worker_steps(c.metrics_ports))

                    got = drive(target, run, interval, procs, at_start=at_start)
                    after = process_cpu(roots)
                    steps_after = worker_steps(c.metrics_ports)
                    routed = requests_by_worker(c.address)
                    tokens, seconds = got["tokens"], got["seconds"]
                    use = cpu_use(before, after, seconds, tokens)
                    use["cpu_s_per_1k_tokens"]["client"] = round(1000 * sum(got["client_cpu"]) / max(tokens, 1), 4)
                    use["busiest_core_share"]["client"] = round(max(got["client_cpu"]) / seconds, 2)
                    tree = {"supervisor", "frontend", "engine"}
                    row = {"workers": n, "stream_interval": interval, "path": "gateway" if args.gateway else "grpc",
                           "pass": "burst" if work is not reqs else "offline", "streams": len(run),
                           "client_procs": procs, "output_tokens": tokens, "short_streams": got["short"],
                           "error_statuses": got["statuses"], "error_examples": got["examples"],
                           "seconds": round(seconds, 2),
                           "tokens_per_s": round(tokens / seconds),
                           "tokens_per_message": round(tokens / got["messages"], 2) if got["messages"] else None,
                           "ttft_s": got["ttft"],
                           "scheduler_cpu_s_per_1k_tokens": round(sum(
                               v for r, v in use["cpu_s_per_1k_tokens"].items() if r in tree), 4)}
                    if work is reqs:
                        one_worker.setdefault(interval, tokens / seconds / n)  # from the first N run
                        ideal = n * one_worker[interval]
                        row.update(n_x_one_worker=round(ideal), ratio=round(tokens / seconds / ideal, 3))
                    row.update(use)
                    row.update(worker_use(steps_before, steps_after, seconds, tokens))
                    row["requests_by_worker"] = sorted(v - routed_before.get(k, 0) for k, v in routed.items())
                    rows.append(row)
                    print(row, flush=True)
    args.model, args.cpus = None, available_cpus()
    common.save("bench.scale", argv, args.out, "scale", args, rows)


@contextlib.contextmanager
def _cpus_env(cores: int):
    """$SPLITSERVE_CPUS = cores while the cluster starts (the tree sizes itself to them); unset after, so that
    the gateway sizes itself to the cores it runs on."""
    if not cores:
        yield
        return
    os.environ[CPUS_ENV] = str(cores)
    try:
        yield
    finally:
        os.environ.pop(CPUS_ENV, None)


def _pin_tree(root: int, cores: set[int]) -> None:
    """Every thread of every process under `root` onto `cores` (threads and processes started later inherit)."""
    for pid in process_cpu([("tree", root)]):
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(tid), cores)


def requests_by_worker(address: str) -> dict[str, int]:
    """The requests each worker's engine has taken so far."""
    from client import Client

    with Client(address, timeout=10) as client:
        return {w["address"]: w["num_requests"] for w in client.model_info()["workers"]}


def _wait_for_workers(address: str, n: int, timeout: float = 120.0) -> None:
    from client import Client

    deadline = time.monotonic() + timeout
    with Client(address, timeout=10) as client:
        while sum(w["alive"] for w in client.model_info()["workers"]) < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{n} workers not connected after {timeout} s")
            time.sleep(0.1)


@contextlib.contextmanager
def _gateway(args: argparse.Namespace, cluster, model: Path):
    """The load's target (the scheduler, or a gateway in front of it) and the gateway's pid (None without)."""
    if not args.gateway:
        yield {"address": cluster.address, "connections": args.connections}, None
        return
    with common.gateway(cluster.address, ["--served-model-name", model.name, *shlex.split(args.gateway_args)]) as (
            url, pid):
        yield {"gateway": url, "model": model.name}, pid


if __name__ == "__main__":
    main()
