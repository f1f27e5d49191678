"""A third-party load generator against the OpenAI-compatible gateway, beside splitserve's own online bench.

NVIDIA's aiperf (`aiperf profile`, streaming /v1/completions) drives a gateway in front of the scheduler (over the
simulated worker with --simulate, else a real worker) at a fixed Poisson request rate with fixed prompt and output
lengths; then bench.online's client sends the same load to the same scheduler over gRPC (no gateway). One table:
TTFT, time per output token (per request: aiperf's inter_token_latency, bench.online's tpot), the gap between
streamed tokens (aiperf's inter_chunk_latency, bench.online's itl), request and output token throughput.

aiperf is not a dependency of the project (its own tree is large); give its command with --aiperf, e.g. from a
venv of its own (it needs no torch):

    python -m venv /tmp/aiperf && /tmp/aiperf/bin/pip install aiperf
    python -m bench thirdparty --simulate --aiperf /tmp/aiperf/bin/aiperf --rate 16 --num-requests 128
"""
from __future__ import annotations

import argparse
import json
import random
import shlex
import subprocess
import tempfile
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from bench import common
from bench.workload import Request
from common.util import run_loop


def aiperf_command(args: argparse.Namespace, url: str, model: Path, served: str, out: Path) -> list[str]:
    return [*shlex.split(args.aiperf), "profile", "--model", served, "--url", url, "--endpoint-type", "completions",
            "--streaming", "--tokenizer", str(model), "--isl", str(args.input_len), "--isl-stddev", "0",
            "--osl", str(args.output_len), "--osl-stddev", "0", "--extra-inputs", "ignore_eos:true",
            "--extra-inputs", f"temperature:{args.temperature}", "--request-rate", str(args.rate),
            "--arrival-pattern", "poisson", "--request-count", str(args.num_requests),
            "--warmup-request-count", str(args.warmup), "--random-seed", str(args.seed), "--ui", "none",
            "--output-artifact-dir", str(out)]


def _metric(report: dict, name: str, stat: str) -> float | None:
    value = (report.get(name) or {}).get(stat)
    return None if value is None else float(value)


def aiperf_row(report: dict) -> dict:
    """aiperf's profile_export_aiperf.json as a row of the table (its units: ms, requests/s, tokens/s)."""
    requests = _metric(report, "request_count", "avg") or 0
    completed = _metric(report, "completed_request_count", "avg")
    return {
        "client": f"aiperf {report.get('aiperf_version', '?')} -> HTTP gateway",
        "requests": int(requests),
        "errors": int(requests - completed) if completed is not None else len(report.get("error_summary") or []),
        "seconds": common.rnd(_metric(report, "benchmark_duration", "avg"), 3),
        "achieved_req_s": common.rnd(_metric(report, "request_throughput", "avg")),
        "output_tokens_per_s": common.rnd(_metric(report, "output_token_throughput", "avg"), 0),
        "ttft_p50_ms": common.rnd(_metric(report, "time_to_first_token", "p50")),
        "ttft_p99_ms": common.rnd(_metric(report, "time_to_first_token", "p99")),
        "tpot_p50_ms": common.rnd(_metric(report, "inter_token_latency", "p50"), 3),
        "tpot_p99_ms": common.rnd(_metric(report, "inter_token_latency", "p99"), 3),
        "gap_p50_ms": common.rnd(_metric(report, "inter_chunk_latency", "p50"), 3),
        "gap_p99_ms": common.rnd(_metric(report, "inter_chunk_latency", "p99"), 3),
    }


def run_aiperf(args: argparse.Namespace, url: str, model: Path, served: str) -> tuple[dict, list[str]]:
    with tempfile.TemporaryDirectory(prefix="splitserve-aiperf-") as tmp:
        out = Path(tmp) / "artifacts"
        command = aiperf_command(args, url, model, served, out)
        print("$", shlex.join(command), flush=True)
        # The tokenizer is the checkpoint folder's. (HF_HUB_OFFLINE=1 would make aiperf 0.13 take the path for a
        # hub repo id and fail.)
        done = subprocess.run(command, cwd=tmp, capture_output=True, text=True, timeout=args.timeout)
        report_path = out / "profile_export_aiperf.json"
        if done.returncode != 0 or not report_path.exists():
            raise RuntimeError(f"aiperf failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
        return aiperf_row(json.loads(report_path.read_text())), command


def online_row(args: argparse.Namespace, address: str) -> dict:
    """bench.online's client over gRPC, the same rate and lengths (random token ids, as bench.online sends)."""
    from bench import online
    from client import AsyncClient

    rng = random.Random(args.seed)
    reqs = [Request([rng.randint(0, 10000) for _ in range(args.input_len)], args.output_len)
            for _ in range(args.num_requests + args.warmup)]
    sampling = dict(temperature=args.temperature, ignore_eos=True)

    async def run() -> dict:
        async with AsyncClient(address) as client:
            await online.run_rate(client, reqs[:args.warmup], args.rate, seed=args.seed, sampling=sampling,
                                  desc="warmup")
            traces, seconds = await online.run_rate(client, reqs[args.warmup:], args.rate, seed=args.seed + 1,
                                                    sampling=sampling, desc=f"{args.rate:g} req/s")
        row = online.summarize(args.rate, traces, seconds, args.slo_ttft_ms, args.slo_itl_ms)
        return {"client": "bench.online AsyncClient -> gRPC scheduler", "requests": row["requests"],
                "errors": row["errors"], "seconds": row["seconds"], "achieved_req_s": row["achieved_req_s"],
                "output_tokens_per_s": row["output_tokens_per_s"], "ttft_p50_ms": row["ttft_p50_ms"],
                "ttft_p99_ms": row["ttft_p99_ms"], "tpot_p50_ms": row["tpot_p50_ms"],
                "tpot_p99_ms": common.rnd(common.percentile(
                    [t.tpot * 1e3 for t in traces if t.error is None and t.output_tokens > 1], 99), 3),
                "gap_p50_ms": row["itl_p50_ms"], "gap_p99_ms": row["itl_p99_ms"]}

    return run_loop(run())


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.thirdparty", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(ap, out="bench/results/thirdparty.json")
    ap.add_argument("--aiperf", default="aiperf", help="aiperf's command (a path, or e.g. 'python -m aiperf')")
    ap.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals, requests/s")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=4, help="requests before the measured ones")
    ap.add_argument("--input-len", type=int, default=256, help="prompt tokens of every request")
    ap.add_argument("--output-len", type=int, default=64, help="output tokens of every request (ignore_eos)")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gateway-workers", type=int, default=2, help="the gateway's HTTP processes")
    ap.add_argument("--slo-ttft-ms", type=float, default=500.0)
    ap.add_argument("--slo-itl-ms", type=float, default=50.0)
    ap.add_argument("--timeout", type=float, default=1800.0, help="aiperf's run, seconds")
    return ap


def main(argv: Sequence[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    with common.model_dir(args) as model, tempfile.TemporaryDirectory(prefix="splitserve-gw-") as logs:
        with common.cluster(args, Path(model)) as address:
            with common.gateway(address, ["--tokenizer", str(model), "--workers", str(args.gateway_workers)],
                                Path(logs) / "gateway.log") as (url, _):
                with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
                    served = json.load(r)["data"][0]["id"]
                third, command = run_aiperf(args, url, Path(model), served)
            own = online_row(args, address)
    rows = [{"path": common.path_label(args, "grpc services"), **row} for row in (third, own)]
    args.aiperf_command = shlex.join(command)
    return common.save("bench.thirdparty", argv, args.out, "thirdparty", args, rows)


if __name__ == "__main__":
    main()
