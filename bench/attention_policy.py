"""Which prefill kernel runs a step faster, whole steps of the ModelRunner timed with each: the measurement
behind `auto` attention's per-step choice (worker_svc/kernels/attention.py, FLASH_ATTN_MIN_FLOPS).

Each case is one eager step (steps with prefills run eagerly): new prompts of L tokens, alone or beside decodes
(rows of one query token over a cached context), timed with the Triton prefill kernel forced, flash-attn-4
forced, and `auto`'s choice. The table gives each case's attention FLOPs per layer; the summary the threshold on
them that would have picked the faster kernel most often, weighed by the time lost where it did not.

python -m bench attention-policy --preset qwen3-0.6b
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from bench.record import record
from common.limits import Limits
from common.util import cdiv
from protos import worker_pb2 as pb
from worker_svc.checkpoints.writer import make_model
from worker_svc.kernels import attention
from worker_svc.runtime.model_runner import ModelRunner, RunnerConfig

SAMPLING = pb.SamplingParams(temperature=0.6, top_p=1.0, repetition_penalty=1.0, logprobs=-1, seed=1)
# (prompt length, prompts, decodes beside them); decodes run over DECODE_CONTEXT cached tokens
CASES = [(L, max(1, tokens // L), 0) for tokens in (1024, 4096, 16384) for L in (64, 128, 256, 512, 1024, 2048, 4096)
         if L <= tokens] + [(L, n, 256) for L, n in ((128, 1), (128, 4), (256, 8), (512, 8), (1024, 4), (2048, 4))]
DECODE_CONTEXT = 512


class StepTimer:
    """A runner whose steps are one case each: the case's sequences are sent new and dropped by the next step."""

    def __init__(self, model_dir: Path, block_size: int, budget: int, attention_name: str, device: str = "cuda"):
        self.block_size = block_size
        max_len = 4096 + block_size
        self.per_seq = cdiv(max_len, block_size)
        rows = 512
        blocks = max((n * cdiv(L + 1, block_size) + d * cdiv(DECODE_CONTEXT + 2, block_size)) for L, n, d in CASES)
        self.runner = ModelRunner(model_dir, RunnerConfig(
            device=device, block_size=block_size, num_blocks=blocks, cuda_graphs=False,
            attention=attention_name, limits=Limits(max_num_seqs=rows, max_num_batched_tokens=budget,
                                                    max_model_len=max_len)))
        self.step_no, self.held = 0, []

    def _plan(self, prompt_len: int, prompts: int, decodes: int) -> pb.StepPlan:
        self.step_no += 1
        plan = pb.StepPlan(step=self.step_no, epoch=self.runner.epoch)
        plan.finished_ids.extend(self.held)  # ids are fresh each step: one plan may not drop and resend an id
        self.held = [self.step_no * 100_000 + i for i in range(prompts + decodes)]
        blocks = iter(range(self.runner.num_blocks))
        for i, seq_id in enumerate(self.held):
            decode = i >= prompts
            computed = DECODE_CONTEXT if decode else 0
            length = computed + (1 if decode else prompt_len)
            plan.new_seqs.add(seq_id=seq_id, token_ids=[(7 * i + j) % 10000 for j in range(length)], prompt_len=length,
                              sampling=SAMPLING, block_ids=[next(blocks) for _ in range(cdiv(length + 1, self.block_size))],
                              num_computed_tokens=computed, num_scheduled_tokens=length - computed)
        return plan

    def time_ms(self, case: tuple[int, int, int], forced: str | None, repeats: int) -> float:
        backend = self.runner.kernels.attention
        backend.forced = forced
        times = []
        for i in range(repeats + 2):
            plan = self._plan(*case)
            torch.cuda.synchronize()
            start = time.perf_counter()
            self.runner.execute(plan).result()
            if i >= 2:
                times.append((time.perf_counter() - start) * 1e3)
        backend.forced = None
        return statistics.median(times)


def best_threshold(rows: list[dict]) -> tuple[float, float]:
    """The FLOPs threshold that loses the least time against always picking the faster kernel, and that loss."""
    candidates = sorted({0.0, float("inf"), *(r["attention_gflops"] * 1e9 for r in rows)})

    def loss(threshold: float) -> float:
        return sum(max(0.0, (r["flash_attn_ms"] if r["attention_gflops"] * 1e9 >= threshold else r["triton_ms"])
                       - min(r["flash_attn_ms"], r["triton_ms"])) for r in rows)

    best = min(candidates, key=loss)
    return best, loss(best)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="bench/results/attention_policy.json")
    args = ap.parse_args(argv)
    if not attention.flash_attn_available(torch.device("cuda")):
        raise SystemExit("needs a GPU with flash-attn-4: the choice is between its kernel and Triton's")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(args.preset, Path(tmp) / "m", seed=0, dtype="bfloat16")
        timer = StepTimer(model_dir, args.block_size, 16384 + 256, "auto")
        layer = timer.runner.model.layers[0].self_attn
        heads, dim = layer.num_heads, timer.runner.model_config.head_dim
        for case in CASES:
            prompt_len, prompts, decodes = case
            q_lens = [prompt_len] * prompts + [1] * decodes
            c_lens = [prompt_len] * prompts + [DECODE_CONTEXT + 1] * decodes
            meta = attention.AttentionMetadata(None, None, None, None, max(q_lens), q_lens, c_lens)
            row = {"prompts": f"{prompts}x{prompt_len}", "decodes": decodes, "tokens": sum(q_lens),
                   "attention_gflops": round(attention.attention_flops(meta, heads, dim) / 1e9, 2)}
            for forced in ("triton", "flash_attn", None):
                row[f"{forced or 'auto'}_ms"] = round(timer.time_ms(case, forced, args.repeats), 3)
            row["auto_picks"] = attention.prefill_kernel(meta, heads, dim)
            row["faster"] = "flash_attn" if row["flash_attn_ms"] < row["triton_ms"] else "triton"
            rows.append(row)
            print(row, flush=True)
    threshold, lost = best_threshold(rows)
    total = sum(min(r["flash_attn_ms"], r["triton_ms"]) for r in rows)
    auto = sum(r["auto_ms"] for r in rows)
    print(f"best threshold {threshold / 1e9:.1f} GFLOPs per layer (loses {lost:.2f} ms of {total:.2f}); "
          f"FLASH_ATTN_MIN_FLOPS = {attention.FLASH_ATTN_MIN_FLOPS / 1e9:.1f} GFLOPs: auto {auto:.2f} ms")
    record(args.out, "attention_policy", vars(args) | {"best_threshold_gflops": threshold / 1e9,
                                                       "heads": heads, "head_dim": dim}, rows)


if __name__ == "__main__":
    main()
