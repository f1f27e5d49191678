"""Multi-turn chat through the services, for the host-memory KV tier (issue 23): C conversations of T turns,
all running at once, each turn sent when the conversation's previous one finished (or, with --think-time, a
user's reading and typing later). With --request-rate the turns that are ready go out at that rate instead
(Poisson arrivals, as SGLang's HiCache multi-turn benchmark paces its clients), so that TTFT is timed at a load
below the server's capacity rather than at saturation, where a closed system's wait is set by its throughput
alone; several rates run a round each, with conversations of their own, on the same two clusters. A turn appends
U fresh "user" token ids (seeded, distinct per conversation: conversations share no prefix) to the history, sends
the whole history as the prompt, streams exactly G tokens (ignore EOS) and appends them to the history.

The GPU's KV pool is cut (the worker's --num-blocks) so that the histories at the end are about 4x what it
holds: the scheduler evicts a conversation's blocks between its turns. The workload runs twice, each on a
fresh cluster: with the worker's host tier off, where an evicted history is recomputed, and on
(--kv-offload-gib), where it can be swapped back in. Per run: TTFT p50/p99 over all turns and p50 over turns
2.. (those whose history can come from a cache), output tok/s over the wall time, the prompt tokens served
from cache, and the blocks swapped either way (the scheduler's Prometheus counters) with their bandwidth.

    python -m bench multiturn --preset qwen3-0.6b --device cuda
    python -m bench multiturn --preset qwen3-tiny --device cpu --block-size 16 --conversations 4 --turns 2 \\
        --user-tokens 20 --output-tokens 8
    python -m bench multiturn --simulate --conversations 32   # the scheduler's side on a CPU: copies timed, not made
    python -m bench multiturn --preset llama-3.1-8b --device cuda --conversations 64 --request-rate 3,6,9
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
import urllib.request
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from bench import common
from common import model_files
from common.util import run_loop

SWAPPED_OUT = "splitserve:kv_blocks_swapped_out_total"
SWAPPED_IN = "splitserve:kv_blocks_swapped_in_total"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(model: Path, kv_cache_dtype: str) -> int:
    """K and V of one token over every layer, from the checkpoint's config.json."""
    cfg = json.loads((model / "config.json").read_text())
    return model_files.kv_bytes_per_token(
        cfg, 1 if kv_cache_dtype == "fp8" else DTYPE_BYTES[cfg.get("torch_dtype") or cfg["dtype"]])


def history_tokens(args: argparse.Namespace) -> int:
    """Tokens of every conversation's history after its last turn."""
    return args.conversations * args.turns * (args.user_tokens + args.output_tokens)


def gpu_blocks(args: argparse.Namespace) -> int:
    """--gpu-blocks, or a quarter of the final histories; never fewer than one whole conversation needs."""
    if args.gpu_blocks:
        return args.gpu_blocks
    one = math.ceil(args.turns * (args.user_tokens + args.output_tokens) / args.block_size)
    return max(math.ceil(history_tokens(args) / 4 / args.block_size), one + 1)


def offload_gib(args: argparse.Namespace, bytes_per_token: int) -> float:
    """--kv-offload-gib (the tier-on run's), or room for every history with a quarter to spare."""
    if args.kv_offload_gib:
        return args.kv_offload_gib
    return history_tokens(args) * bytes_per_token * 1.25 / 2**30


class _Recorder:
    """An AsyncClient that keeps the token ids of what it streams: common.stream keeps their counts only,
    and the next turn's prompt needs them."""

    def __init__(self, client):
        self.client = client
        self.token_ids: list[int] = []

    async def generate(self, **kwargs) -> AsyncIterator:
        async for delta in self.client.generate(**kwargs):
            self.token_ids += delta.token_ids
            yield delta


class Pacer:
    """Send times at `rate` a second, exponentially apart (seeded): each slot() waits for the next one."""

    def __init__(self, rate: float, seed: int):
        self.rate, self.rng, self.next = rate, random.Random(seed), time.perf_counter()

    async def slot(self) -> None:
        at = max(self.next, time.perf_counter())
        self.next = at + self.rng.expovariate(self.rate)
        await asyncio.sleep(at - time.perf_counter())


async def conversation(client, c: int, args: argparse.Namespace, bar: tqdm, pacer: Pacer | None,
                       round_: int) -> list[tuple[int, common.Trace]]:
    """One conversation's turns in sequence: (turn, trace) per turn sent; it ends at its first failed turn. Each
    round (request rate) has conversations of its own, sharing no prefix with an earlier round's."""
    rng = random.Random((args.seed + round_) * 1_000_003 + c)
    history: list[int] = []
    turns = []
    for turn in range(1, args.turns + 1):
        history += [rng.randint(0, 10000) for _ in range(args.user_tokens)]
        if pacer is not None:
            await pacer.slot()
        recorder = _Recorder(client)
        trace = await common.stream(recorder, history, args.output_tokens, temperature=args.temperature,
                                    ignore_eos=True)
        turns.append((turn, trace))
        bar.update(1)
        if trace.error is not None:
            break
        history += recorder.token_ids
        if args.think_time and turn < args.turns:  # the user reads the answer and writes the next turn
            await asyncio.sleep(rng.expovariate(1 / args.think_time))
    return turns


@dataclass(slots=True)
class Round:
    """One request rate's workload on a cluster: every conversation's turns, the seconds they took, the blocks
    swapped out and in meanwhile."""
    rate: float
    turns: list[tuple[int, common.Trace]]
    seconds: float
    swapped: tuple[float, float]


async def run_workload(address: str, args: argparse.Namespace, desc: str, metrics_port: int) -> tuple[list[Round], int]:
    """The workload once per --request-rate on one cluster (a round's conversations its own), and the host blocks
    the workers kept (a worker drops a tier that does not pay: worker_svc/runtime/tier_policy.py)."""
    from client import AsyncClient

    async with AsyncClient(address) as client:
        host_blocks = sum(w.get("num_host_blocks", 0) for w in (await client.model_info())["workers"])
        for _ in range(args.warmup):  # a prompt no conversation shares
            await common.stream(client, [1, 2, 3], 16, temperature=args.temperature, ignore_eos=True)
        rounds = []
        for i, rate in enumerate(args.request_rate):
            before = swapped_blocks(metrics_port)
            bar = tqdm(total=args.conversations * args.turns, desc=f"{desc} at {rate}/s" if rate else desc,
                       dynamic_ncols=True)
            start = time.perf_counter()
            pacer = Pacer(rate, args.seed + i) if rate else None
            try:
                done = await asyncio.gather(*(conversation(client, c, args, bar, pacer, i)
                                              for c in range(args.conversations)))
            finally:
                bar.close()
            turns = [t for conv in done for t in conv]
            after = swapped_blocks(metrics_port)
            rounds.append(Round(rate, turns, max((t.end for _, t in turns), default=start) - start,
                                (after[0] - before[0], after[1] - before[1])))
        return rounds, host_blocks


def swapped_blocks(metrics_port: int) -> tuple[float, float]:
    """The scheduler's swap counters (blocks out, in), summed over workers; 0 where a counter is absent."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    totals = {SWAPPED_OUT: 0.0, SWAPPED_IN: 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in totals:
                totals[s.name] += s.value
    return totals[SWAPPED_OUT], totals[SWAPPED_IN]


def summarize(run: str, turns: list[tuple[int, common.Trace]], seconds: float, swapped: tuple[float, float],
              block_bytes: int, blocks: int, host_gib: float, host_blocks: int) -> dict:
    done = [(k, t) for k, t in turns if t.error is None and t.times]
    ttfts = [t.ttft * 1e3 for _, t in done]
    later = [t.ttft * 1e3 for k, t in done if k >= 2]
    usage = [t.usage for _, t in done if t.usage is not None]
    prompt = sum(u.prompt_tokens for u in usage)
    cached = sum(u.cached_prompt_tokens for u in usage)
    out_tokens = sum(t.output_tokens for _, t in done)
    out, back = swapped
    return {
        "run": run,
        "gpu_blocks": blocks,
        "host_gib": significant(host_gib),  # asked for
        "host_blocks": host_blocks,  # what the worker kept
        "turns": len(turns),
        "errors": len(turns) - len(done),
        "seconds": common.rnd(seconds, 3),
        "output_tokens_per_s": common.rnd(out_tokens / seconds if seconds > 0 else math.nan, 0),
        "ttft_p50_ms": common.rnd(common.percentile(ttfts, 50)),
        "ttft_p99_ms": common.rnd(common.percentile(ttfts, 99)),
        "ttft_p50_turn2plus_ms": common.rnd(common.percentile(later, 50)),
        "cached_prompt_share": common.rnd(cached / prompt if prompt else math.nan, 4),
        "swapped_out_blocks": int(out),
        "swapped_in_blocks": int(back),
        "swap_gb_s": significant((out + back) * block_bytes / seconds / 1e9 if seconds > 0 else math.nan),
    }


def significant(x: float) -> float | None:
    """4 significant digits, not places: on a tiny model the tier is KiB and its swaps KB/s."""
    return None if math.isnan(x) else float(f"{x:.4g}")


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.multiturn", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(ap, out="bench/results/multiturn.json")
    ap.add_argument("--conversations", type=int, default=128)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--user-tokens", type=int, default=300, help="new prompt tokens per turn")
    ap.add_argument("--output-tokens", type=int, default=200, help="generated tokens per turn")
    ap.add_argument("--gpu-blocks", type=int, default=0,
                    help="the worker's --num-blocks (default: the final histories / 4, in blocks)")
    ap.add_argument("--think-time", type=float, default=0.0,
                    help="mean seconds between an answer and the conversation's next turn (exponential, seeded; "
                         "0: at once, so every conversation is live all the time)")
    ap.add_argument("--request-rate", type=lambda text: common.csv_numbers(text, float), default=[0.0],
                    help="turns a second sent of those ready (Poisson, seeded); 0: each as soon as it is ready; "
                         "several, comma-separated: one round each on the same clusters")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--seed", type=int, default=0, help="of the user tokens and of the send times")
    ap.add_argument("--warmup", type=int, default=2, help="3-token requests (16 out) before measuring")
    return ap


def main(argv: Sequence[str] | None = None) -> dict:
    from client.launcher import free_port

    ap = build_parser()
    args = ap.parse_args(argv)
    if args.turns * (args.user_tokens + args.output_tokens) > args.max_model_len:
        ap.error(f"a conversation's last turn ends past --max-model-len {args.max_model_len}")
    blocks = gpu_blocks(args)
    rows = []
    with common.model_dir(args) as model:
        per_token = kv_bytes_per_token(Path(model), args.kv_cache_dtype)
        for run, gib in (("tier off", 0.0), ("tier on", offload_gib(args, per_token))):
            worker = ["--num-blocks", str(blocks), "--kv-offload-gib", str(gib)]  # after common's: this one counts
            metrics_port = free_port()
            with common.cluster(args, Path(model), ["--metrics-port", str(metrics_port)],
                                extra_worker_args=worker) as address:
                rounds, host_blocks = run_loop(run_workload(address, args, run, metrics_port))
            for r in rounds:
                rows.append({"path": "grpc services", "request_rate": r.rate,
                             **summarize(run, r.turns, r.seconds, r.swapped, per_token * args.block_size, blocks,
                                         gib, host_blocks)})
                print(rows[-1], flush=True)
                errors = [t.error for _, t in r.turns if t.error]
                if errors:
                    print(f"{len(errors)} turns failed, e.g. {errors[0]}", flush=True)
    doc = common.save("bench.multiturn", argv, args.out, "multiturn", args, rows)
    half, lines = len(rows) // 2, []
    for off, on in zip(rows[:half], rows[half:]):
        at = f" at {off['request_rate']}/s" if off["request_rate"] else ""
        lines.append(f"ratios{at}: TTFT p50 off/on {ratio(off['ttft_p50_ms'], on['ttft_p50_ms'])}, "
                     f"TTFT p50 turns 2+ off/on {ratio(off['ttft_p50_turn2plus_ms'], on['ttft_p50_turn2plus_ms'])}, "
                     f"output tok/s on/off {ratio(on['output_tokens_per_s'], off['output_tokens_per_s'])}")
    print("\n".join(lines))
    with Path(args.out).with_suffix(".md").open("a") as md:
        md.write("\n" + "".join(f"{line}\n" for line in lines))
    return doc


if __name__ == "__main__":
    main()
