"""What a LoRA adapter's load costs the streams already running: an in-process engine decodes --seqs sequences of
no adapter, and the same run again while --loads adapters are loaded one by one (each asked for --every steps after
the last); the gaps between the steps that give tokens, with and without the loads. A load that held the worker's
steps for its read shows as a gap the size of the read.

python -m bench lora-loads --preset qwen3-0.6b --device cuda
python -m bench lora-loads --preset qwen3-tiny --device cpu --seqs 8 --tokens 60 --every 10   # a smoke test
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.record import record
from offline.llm import LLM
from scheduler_svc.sampling import SamplingParams
from worker_svc.checkpoints.writer import make_lora_adapter, make_model


def gaps_ms(llm: LLM, seqs: int, tokens: int, prompt_len: int, loads: dict[int, tuple[str, Path]],
            seed: int) -> list[float]:
    """The gaps between the steps that gave tokens, in order, while `loads` (step -> adapter) are asked for."""
    engine, rng = llm.engine, random.Random(seed)
    for i in range(seqs):
        engine.add([rng.randrange(1, 1000) for _ in range(prompt_len)],
                   SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0, seed=i), f"{seed}:{i}")
    stamps, step = [], 0
    while engine.has_unfinished():
        if step in loads:
            engine.scheduler.adapters.load(loads[step][0], str(loads[step][1]))
        if engine.step():
            stamps.append(time.perf_counter())
        step += 1
    outcomes = engine.scheduler.adapters.take_outcomes()
    if any(o.error for o in outcomes):
        raise RuntimeError(f"a load failed: {outcomes}")
    return [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]


def summary(name: str, gaps: list[float]) -> dict:
    ordered = sorted(gaps)
    return {"run": name, "gaps": len(gaps), "median_ms": round(statistics.median(ordered), 3),
            "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 3),
            "max_ms": round(ordered[-1], 3)}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seqs", type=int, default=32, help="sequences decoding")
    ap.add_argument("--tokens", type=int, default=400, help="tokens each generates")
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--loads", type=int, default=3, help="adapters loaded while they decode")
    ap.add_argument("--every", type=int, default=100, help="steps between loads (the first after as many)")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--out", default="bench/results/lora_loads.json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        dtype = "float32" if args.device == "cpu" else "bfloat16"
        model_dir = make_model(args.preset, Path(tmp) / "m", seed=0, dtype=dtype)
        adapters = [(f"lora{i}", make_lora_adapter(model_dir, Path(tmp) / f"lora{i}", rank=args.lora_rank, seed=i))
                    for i in range(args.loads)]
        extra = {"num_blocks": 4 * args.seqs * -(-(args.prompt_len + args.tokens) // 16), "block_size": 16} \
            if args.device == "cpu" else {}
        with LLM(model_dir, device=args.device, max_num_seqs=max(args.seqs, 8), max_loras=1,
                 max_cpu_loras=max(args.loads, 1), max_lora_rank=args.lora_rank, **extra) as llm:
            gaps_ms(llm, args.seqs, min(args.tokens, 20), args.prompt_len, {}, seed=-1)  # warm
            rows = [summary("no loads", gaps_ms(llm, args.seqs, args.tokens, args.prompt_len, {}, seed=0)),
                    summary(f"{args.loads} loads", gaps_ms(
                        llm, args.seqs, args.tokens, args.prompt_len,
                        {args.every * (k + 1): adapter for k, adapter in enumerate(adapters)}, seed=1))]
    record(args.out, "lora_loads", vars(args), rows)


if __name__ == "__main__":
    main()
