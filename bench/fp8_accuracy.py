"""What an fp8 KV cache, and FP8 projections (`--quantization fp8`), do to the model's outputs: per-token KL
divergence of the next-token distribution with an fp8 (e4m3) cache, or with FP8 projections, against the model's
dtype throughout, and how often their greedy (argmax) tokens agree.

Greedy completions are generated with the model's-dtype cache (`--num-seqs` prompts of `--prompt-len` tokens,
`--output-len` tokens each); then each whole sequence is run once through a ModelRunner with each cache and
scored at every generated position: every earlier token's K and V come back from that cache, as in decoding.

python -m bench fp8-accuracy --preset qwen3-0.6b                    # 256 x 1,024 generated tokens
python -m bench fp8-accuracy --preset qwen3-8b --num-seqs 64
"""
from __future__ import annotations

import argparse
import random
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from bench.record import record
from common.limits import Limits
from common.util import cdiv
from offline.llm import LLM
from scheduler_svc.sampling import SamplingParams
from worker_svc.checkpoints.writer import make_model
from worker_svc.kernels.attention import prefill_metadata
from worker_svc.runtime.model_runner import ModelRunner, RunnerConfig


@torch.inference_mode()
def log_probs(runner: ModelRunner, seq: list[int], start: int) -> torch.Tensor:
    """Log-probabilities (float32) of the next token at positions start-1 .. len(seq)-2: one prefill of the
    whole sequence, its K and V written to and read back from the runner's cache."""
    n = len(seq)
    positions, meta = prefill_metadata([n], runner.block_size, runner.device)
    hidden = runner.model(torch.tensor(seq, device=runner.device), positions, meta)
    return runner.model.compute_logits(hidden[start - 1:n - 1]).float().log_softmax(-1)


def make_runner(model_dir: Path, longest: int, device: str, dtype: str, cache: str, attention: str,
                quantization: str = "none") -> ModelRunner:
    return ModelRunner(model_dir, RunnerConfig(
        device=device, dtype=dtype, kv_cache_dtype=cache, cuda_graphs=False, attention=attention,
        quantization=quantization,
        num_blocks=cdiv(longest, 256) + 1, block_size=256,
        limits=Limits(max_num_seqs=1, max_num_batched_tokens=longest, max_model_len=longest)))


def divergence(ref: torch.Tensor, other: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: KL(ref || other) of the next-token distributions, and whether their argmaxes agree."""
    return (ref.exp() * (ref - other)).sum(-1), ref.argmax(-1) == other.argmax(-1)


def compare(model_dir: Path, sequences: list[list[int]], prompt_len: int, device: str, dtype: str) -> list[dict]:
    """An fp8 cache, and FP8 projections, against the model's dtype throughout, all read by one attention kernel
    (Triton on a GPU: flash-attn-4 reads no fp8; the torch reference on a CPU). On a GPU also a control: the
    model's-dtype cache read by the torch reference instead of Triton, two kernels equally right up to rounding, which
    shows how far this model carries a rounding-sized change in K and V (random weights carry it much further than
    trained ones)."""
    longest = max(map(len, sequences))
    kernel = "triton" if device == "cuda" else "torch"
    runners = {"base": make_runner(model_dir, longest, device, dtype, "auto", kernel),
               "fp8": make_runner(model_dir, longest, device, dtype, "fp8", kernel),
               "fp8 projections": make_runner(model_dir, longest, device, dtype, "auto", kernel, "fp8")}
    if device == "cuda":
        runners["control"] = make_runner(model_dir, longest, device, dtype, "auto", "torch")
    kls = {name: [] for name in runners if name != "base"}
    agrees = {name: 0 for name in kls}
    count = 0
    for seq in sequences:
        ref = log_probs(runners["base"], seq, prompt_len)
        count += len(ref)
        for name in kls:
            kl, agree = divergence(ref, log_probs(runners[name], seq, prompt_len))
            kls[name].append(kl.cpu())
            agrees[name] += agree.sum().item()
    for r in runners.values():
        r.close()
    rows = []
    for name, per_seq in kls.items():
        seq_means = sorted(kl.mean().item() for kl in per_seq)
        every = torch.cat(per_seq)
        against = {"fp8": "fp8 cache", "fp8 projections": f"fp8 projections, {dtype} cache"}.get(
            name, f"{dtype} cache, torch attention (control)")
        rows.append({"against": against,
                     "tokens": count, "mean_kl": round(every.mean().item(), 6),
                     "p50_kl": round(every.median().item(), 6), "max_kl": round(every.max().item(), 4),
                     "median_seq_kl": round(seq_means[len(seq_means) // 2], 6),
                     "greedy_agreement": round(agrees[name] / count, 5)})
    return rows


def capacity(model_dir: Path, dtype: str, seq_len: int = 4096) -> dict:
    """How many sequences of `seq_len` tokens fit in the KV cache at once (default memory use), per cache dtype, and
    with FP8 projections (their weights' half of the memory goes to the cache)."""
    fits = {}
    for cache, quantization, name in (("auto", "none", dtype), ("fp8", "none", "fp8"),
                                      ("auto", "fp8", f"{dtype}_fp8_projections")):
        runner = ModelRunner(model_dir, RunnerConfig(device="cuda", dtype=dtype, kv_cache_dtype=cache,
                                                     quantization=quantization, limits=Limits(max_model_len=seq_len)))
        fits[f"{seq_len}_token_seqs_{name}"] = runner.num_blocks // cdiv(seq_len, runner.block_size)
        runner.close()
    return fits


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--model", default=None, help="a checkpoint folder (else --preset is written with random weights)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=1024)
    ap.add_argument("--capacity", action="store_true", help="also the largest batch of 4,096-token sequences that "
                                                              "fits, per cache dtype (GPU)")
    ap.add_argument("--out", default="bench/results/fp8_accuracy.json")
    args = ap.parse_args(argv)
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(args.prompt_len)] for _ in range(args.num_seqs)]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else make_model(args.preset, Path(tmp) / "m", seed=0,
                                                                   dtype=args.dtype)
        longest = args.prompt_len + args.output_len
        with LLM(model_dir, device=args.device, dtype=args.dtype, max_model_len=longest + 1,
                 max_num_seqs=min(256, args.num_seqs)) as llm:
            outs = llm.generate(prompts, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.output_len),
                                use_tqdm=False)
        sequences = [p + o.token_ids for p, o in zip(prompts, outs)]
        head = {"model": args.model or args.preset, "dtype": args.dtype, "seqs": args.num_seqs,
                "prompt_len": args.prompt_len, "output_len": args.output_len}
        rows = [head | row for row in compare(model_dir, sequences, args.prompt_len, args.device, args.dtype)]
        if args.capacity:
            rows[0] |= capacity(model_dir, args.dtype)
    for row in rows:
        print(row)
    record(args.out, "fp8_accuracy", vars(args), rows)


if __name__ == "__main__":
    main()
