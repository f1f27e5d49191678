"""Embedding throughput: --inputs distinct inputs of --input-len random token ids (no prefix is shared), embedded
in-process (LLM.embed) and through the services (Client.embed calls of --batch inputs each, --concurrency calls at
once), beside the floor: the inputs' FLOPs at the dense bf16 peak (2 x the non-embedding parameters a token, plus
attention's; the LM head does not run for an embedding). With --rerank each input is scored instead, by the model
served as Qwen3-Reranker is (vLLM's overrides: a classifier head of two LM-head rows), through Classify.

    python -m bench embed --preset qwen3-0.6b --device cuda
    python -m bench embed --preset qwen3-0.6b --device cuda --rerank
    python -m bench embed --simulate
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import Sequence
from pathlib import Path

from bench import common
from bench.floor import H200_FLOPS, ModelShape
from common import model_files
from common.util import run_loop


def floor_seconds(model: Path, inputs: list[list[int]]) -> float:
    """The inputs' FLOPs at the bf16 peak: the layers' weights a token computes with, and attention (causal, or both
    ways for an encoder)."""
    from worker_svc.model.registry import architecture_of

    cfg = json.loads((model / "config.json").read_text())
    shape = ModelShape.from_config(cfg)
    m = architecture_of(cfg).config(cfg)
    heads = 1 if m.tie_word_embeddings or m.encoder is not None else 2  # the embedding, and an untied LM head
    layers = shape.active_params() - m.vocab_size * m.hidden_size * heads
    flops = sum(2 * layers * len(ids) + 4 * shape.heads * shape.head_dim * shape.prompt_pairs(len(ids))
                for ids in inputs)
    return flops / H200_FLOPS


async def _services(address: str, inputs: list[list[int]], args: argparse.Namespace) -> float:
    from client import AsyncClient

    calls = [inputs[i:i + args.batch] for i in range(0, len(inputs), args.batch)]
    limit = asyncio.Semaphore(args.concurrency)
    async with AsyncClient(address) as client:
        call = client.classify if args.rerank else client.embed
        await call([[1, 2, 3]])  # warm-up

        async def one(batch: list[list[int]]) -> None:
            async with limit:
                await call(batch)

        start = time.perf_counter()
        await asyncio.gather(*(one(b) for b in calls))
        return time.perf_counter() - start


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.embed", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(ap, out="bench/results/embed.json")
    ap.add_argument("--inputs", type=int, default=4096)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64, help="inputs per Embed call through the services")
    ap.add_argument("--concurrency", type=int, default=16, help="Embed calls in flight through the services")
    ap.add_argument("--mode", choices=["in-process", "services", "both"], default="both")
    ap.add_argument("--rerank", action="store_true",
                    help="score the inputs (Classify) by the model served as Qwen3-Reranker is, instead of embedding "
                         "them (not with --simulate)")
    return ap


def main(argv: Sequence[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.rerank and args.simulate:
        raise SystemExit("--rerank needs a model: the simulated worker serves no classifier")
    overrides = model_files.QWEN3_RERANKER_OVERRIDES if args.rerank else {}
    rng = random.Random(0)
    inputs = [[rng.randrange(1, 30000) for _ in range(args.input_len)] for _ in range(args.inputs)]
    tokens = args.inputs * args.input_len
    rows = []
    with common.model_dir(args) as model:
        floor = tokens / floor_seconds(Path(model), inputs)

        def row(path: str, seconds: float) -> dict:
            return {"path": common.path_label(args, path), "inputs": args.inputs, "tokens": tokens,
                    "seconds": common.rnd(seconds, 3), "tokens_per_s": common.rnd(tokens / seconds, 0),
                    "floor_tokens_per_s": common.rnd(floor, 0),
                    "pct_of_floor": common.rnd(100 * tokens / seconds / floor, 1)}

        if args.mode in ("in-process", "both"):
            with common.in_process_llm(args, Path(model), **({"hf_overrides": overrides} if overrides else {})) as llm:
                run = llm.classify if args.rerank else llm.embed
                run(inputs[:args.batch], use_tqdm=False)  # warm-up
                start = time.perf_counter()
                run(inputs, use_tqdm=False)
                rows.append(row("in-process", time.perf_counter() - start))
            print(rows[-1], flush=True)
        if args.mode in ("services", "both"):
            flags = ["--hf-overrides", json.dumps(overrides)] if overrides else []
            with common.cluster(args, Path(model), extra_worker_args=flags) as address:
                rows.append(row("grpc services", run_loop(_services(address, inputs, args))))
            print(rows[-1], flush=True)
    return common.save("bench.embed", argv, args.out, "rerank" if args.rerank else "embed", args, rows)


if __name__ == "__main__":
    main()
