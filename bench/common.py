"""What the benchmark scripts share: the model and engine flags, the checkpoint folder, the local cluster
(real or simulated worker), the offline LLM over either, timed streams
(Trace, stream), percentiles, and record() with the command as `python -m bench.<name> ...`."""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from common import limits
from scheduler_svc.config import SchedulerConfig


def add_model_args(ap: argparse.ArgumentParser, out: str | None) -> None:
    """--preset/--model, --device, --simulate, the limits both sides agree on, and --out (unless None)."""
    ap.add_argument("--preset", default="qwen3-0.6b", help="checkpoint written to a temp dir when --model is not given")
    ap.add_argument("--model", type=Path, help="checkpoint folder (default: write the preset, bfloat16)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--simulate", action="store_true",
                    help="the simulated worker (same protocol, no model, GPU-like step times): runs on a CPU")
    ap.add_argument("--step-cost", default="",
                    help="with --simulate: the simulated worker's step-cost flags, e.g. \"--base-ms 4 --per-token-us 20\" "
                         "(default: Qwen3-0.6B's fit)")
    ap.add_argument("--block-size", type=int, default=256)
    limits.add_arguments(ap, limits.Limits(max_num_seqs=512, max_num_batched_tokens=16384, max_model_len=4096))
    ap.add_argument("--attention", default="auto", help="the worker's --attention (not with --simulate)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                    help="the worker's --kv-cache-dtype (not with --simulate)")
    ap.add_argument("--quantization", default="auto", choices=["auto", "fp8", "packed", "none"],
                    help="the worker's --quantization (not with --simulate)")
    ap.add_argument("--kv-offload-gib", type=float, default=0.0,
                    help="the worker's host KV tier, GiB (--kv-offload-gib)")
    ap.add_argument("--pipeline-depth", type=int, default=SchedulerConfig().pipeline_depth,
                    help="steps in flight per worker (the scheduler's --pipeline-depth)")
    if out is not None:
        ap.add_argument("--out", default=out, help="results JSON (a .md table is written next to it)")


def write_config_only(preset: str, out: Path) -> Path:
    """config.json, generation_config.json and the tokenizer: all the simulated worker and the scheduler
    read (no weights, no torch)."""
    from worker_svc.checkpoints.presets import GENERATION_CONFIG, get_preset
    from worker_svc.checkpoints.tokenizer_files import write_qwen_tokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = get_preset(preset)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    write_qwen_tokenizer(out)
    return out


@contextlib.contextmanager
def model_dir(args: argparse.Namespace) -> Iterator[Path]:
    """--model as given; else the preset in a temp dir: weights in bfloat16, or only config and tokenizer
    with --simulate (the simulated worker needs no weights)."""
    if args.model:
        yield Path(args.model)
        return
    with tempfile.TemporaryDirectory(prefix="splitserve-bench-") as tmp:
        if args.simulate:
            yield write_config_only(args.preset, Path(tmp) / args.preset)
        else:
            from worker_svc.checkpoints.writer import make_model

            yield make_model(args.preset, Path(tmp) / args.preset, seed=0, dtype="bfloat16")


def worker_args(args: argparse.Namespace) -> list[str]:
    """Flags of `splitserve-worker serve` (or `simulate`, with --simulate)."""
    flags = ["--block-size", str(args.block_size), "--max-num-seqs", str(args.max_num_seqs),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-model-len", str(args.max_model_len)]
    flags += ["--kv-offload-gib", str(args.kv_offload_gib)]
    if args.simulate:
        return [*flags, *shlex.split(args.step_cost)]
    return [*flags, "--attention", args.attention, "--kv-cache-dtype", args.kv_cache_dtype,
            "--quantization", args.quantization]


def scheduler_args(args: argparse.Namespace, extra: Sequence[str] = ()) -> list[str]:
    # --generation-config vllm: a workload's requests sample as they say (nano-vLLM's, temperature alone), through the
    # services as in-process, not under the checkpoint's top_k and top_p
    return ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--max-model-len", str(args.max_model_len), "--pipeline-depth", str(args.pipeline_depth),
            "--generation-config", "vllm", *extra]


def engine_options(args: argparse.Namespace) -> dict:
    """Options of offline.LLM: the limits (which an in-process worker gets too) and the pipeline depth."""
    return dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len, pipeline_depth=args.pipeline_depth)


def path_label(args: argparse.Namespace, path: str) -> str:
    return path + (" (simulated worker)" if args.simulate else "")


def _plain(v: object) -> object:
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def save(module: str, argv: Sequence[str] | None, path: str | Path, name: str, args: argparse.Namespace,
         rows: list[dict]) -> dict:
    """record() with the command as `python -m <module> <argv>`, however the script was reached
    (python -m bench <name>, a test calling main(argv), ...)."""
    from bench.record import record

    saved = sys.argv
    sys.argv = ["-m", module, *(sys.argv[1:] if argv is None else argv)]
    try:
        return record(path, name, params(args), rows)
    finally:
        sys.argv = saved


def params(args: argparse.Namespace) -> dict:
    """The run's parameters for record(): every flag (JSON-safe), the model as given."""
    return {k: _plain(v) for k, v in vars(args).items()} | {"model": str(args.model or args.preset)}


@contextlib.contextmanager
def cluster(args: argparse.Namespace, model: Path, extra_scheduler_args: Sequence[str] = (),
            log_lines: int = 8, extra_worker_args: Sequence[str] = ()) -> Iterator[str]:
    """A scheduler and one worker (or simulated worker) on loopback; yields the scheduler's address and
    prints the log tails when it stops."""
    from client.launcher import LocalCluster

    with LocalCluster(model, device=args.device, worker_args=[*worker_args(args), *extra_worker_args],
                      scheduler_args=scheduler_args(args, extra_scheduler_args),
                      worker_command="simulate" if args.simulate else "serve") as c:
        try:
            yield c.address
        finally:
            if log_lines:
                for p in c.processes:
                    print(f"--- {p.name} log tail ---\n{p.tail(log_lines)}", flush=True)


@contextlib.contextmanager
def gateway(address: str, flags: Sequence[str], log: Path | None = None,
            timeout: float = 120.0) -> Iterator[tuple[str, int]]:
    """`splitserve-gateway` with `flags` on a free loopback port in front of the scheduler at `address` (output to
    `log`, else discarded); yields (its base URL, its pid) once /health answers 200, and stops it on the way out
    (SIGTERM, then kill)."""
    import signal
    import subprocess
    import urllib.error
    import urllib.request

    from client.launcher import free_port

    url = f"http://127.0.0.1:{free_port()}"
    with open(log or "/dev/null", "ab") as out:
        popen = subprocess.Popen([sys.executable, "-m", "gateway.cli", "--scheduler", address, "--host", "127.0.0.1",
                                  "--port", url.rsplit(":", 1)[1], "--no-access-log", *flags],
                                 cwd=Path(__file__).resolve().parents[1], stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if popen.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-3000:] if log else ""
                raise RuntimeError(f"the gateway did not come up (exit status {popen.poll()})\n{tail}")
            time.sleep(0.2)
        yield url, popen.pid
    finally:
        popen.send_signal(signal.SIGTERM)
        try:
            popen.wait(30)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()


def in_process_llm(args: argparse.Namespace, model: Path, **engine: object):
    """offline.llm.LLM over the model on --device, or over the simulated worker with --simulate; `engine`: more
    LLM options (num_blocks: the worker's KV blocks)."""
    from offline.llm import LLM

    options = engine_options(args) | engine
    if args.simulate:
        from offline.executor import InProcessExecutor
        from worker_svc.runtime.simulated import SimulatedRunner, StepCost

        runner = SimulatedRunner(model, options.pop("num_blocks", 4096), args.block_size, limits.from_args(args),
                                 StepCost(), int(args.kv_offload_gib * (1 << 30)))
        return LLM(model, executor=InProcessExecutor(runner), **options)
    return LLM(model, device=args.device, block_size=args.block_size, attention=args.attention,
               kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
               kv_offload_bytes=int(args.kv_offload_gib * (1 << 30)), **options)


def replay_ms(graph, replays: int) -> float:
    """Mean GPU time (ms) of one replay of a captured CUDA graph, after one untimed replay."""
    import torch

    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); nan for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def rnd(x: float, digits: int = 2) -> float | None:
    """Rounded for the table; None (JSON null) for nan."""
    if x is None or math.isnan(x):
        return None
    return round(x) if digits == 0 else round(x, digits)


def csv_numbers(text: str, kind: type = float) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


class Trace:
    """One streamed request: when it was sent, when each delta with tokens came, and its usage."""
    __slots__ = ("sent", "times", "counts", "usage", "finish_reason", "error")

    def __init__(self, sent: float):
        self.sent = sent
        self.times: list[float] = []
        self.counts: list[int] = []
        self.usage = None
        self.finish_reason: str | None = None
        self.error: str | None = None

    @property
    def output_tokens(self) -> int:
        return sum(self.counts)

    @property
    def ttft(self) -> float:
        return self.times[0] - self.sent if self.times else math.nan

    @property
    def end(self) -> float:
        return self.times[-1] if self.times else self.sent

    def token_gaps(self) -> list[float]:
        """Seconds per token after the first delta: the gap before a delta, shared by the tokens it brings."""
        gaps = []
        for i in range(1, len(self.times)):
            n = self.counts[i]
            gaps += [(self.times[i] - self.times[i - 1]) / n] * n
        return gaps

    @property
    def tpot(self) -> float:
        """Mean seconds per output token after the first (nan with fewer than 2 tokens)."""
        n = self.output_tokens - self.counts[0] if self.counts else 0
        return (self.times[-1] - self.times[0]) / n if n > 0 else math.nan


async def stream(client, prompt_ids: list[int], max_tokens: int, *, sent: float | None = None,
                 **sampling: object) -> Trace:
    """Streams one request with `client` (an AsyncClient) and times its deltas (time.perf_counter)."""
    import grpc

    trace = Trace(time.perf_counter() if sent is None else sent)
    try:
        async for delta in client.generate(token_ids=prompt_ids, max_tokens=max_tokens, **sampling):
            if delta.token_ids:
                trace.times.append(time.perf_counter())
                trace.counts.append(len(delta.token_ids))
            if delta.usage is not None:
                trace.usage = delta.usage
            if delta.finish_reason is not None:
                trace.finish_reason = delta.finish_reason
    except grpc.RpcError as e:
        trace.error = f"{e.code().name}: {e.details()}"
    return trace


def offline_workload(num: int, max_input: int, max_output: int, seed: int = 0):
    """bench.workload.offline (lengths uniform in [100, max]); below 100 the lower bound drops to the max,
    with the same draws, so that smoke tests can shrink it."""
    from bench.workload import Request, offline

    if min(max_input, max_output) >= 100:
        return offline(num, max_input, max_output, seed)
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(min(100, max_input), max_input))]
               for _ in range(num)]
    return [Request(p, rng.randint(min(100, max_output), max_output)) for p in prompts]


def redraw_tokens(reqs: list, seed: int) -> list:
    """The same lengths with fresh random token ids (so that a second pass does not hit the prefix cache)."""
    from bench.workload import Request

    rng = random.Random(seed)
    return [Request([rng.randint(0, 10000) for _ in r.prompt_ids], r.max_tokens) for r in reqs]


# A JSON schema of one free string: a random-weight model writes it for a few hundred tokens before a token
# with a quote closes it, so constrained requests end before max_tokens (fewer output tokens than free ones).
# A minLength that keeps the quote out costs llguidance ~35 ms per step at 100 % constrained (bench/NOTES.md).
STRUCTURED_SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
                     "additionalProperties": False}


def constraint(on: bool, in_process: bool = False) -> dict:
    """The keyword arguments of a request constrained by STRUCTURED_SCHEMA (a client's, or in_process
    SamplingParams'), or of a free one (which ignores EOS, as the workloads do)."""
    if not on:
        return {"ignore_eos": True}
    if in_process:
        from scheduler_svc.structured import compile_grammar

        return {"grammar": compile_grammar("json_schema", json.dumps(STRUCTURED_SCHEMA)), "ignore_eos": False}
    return {"structured": {"json_schema": STRUCTURED_SCHEMA}, "ignore_eos": False}
