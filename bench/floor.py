"""The hardware floor of a workload: how fast one GPU could run it if every step cost only its bytes and FLOPs.

Steps are replayed as a continuous-batching engine runs them (up to max_num_seqs sequences, a new one admitted
when another ends, its prompt computed in the step it is admitted); a step costs the larger of
- its bytes at the memory bandwidth: the weights once, plus the K and V of every context token it reads and
  of every token it writes, and
- its FLOPs at the dense bf16 peak: 2 x parameters per token computed, plus attention's 4 x heads x head_dim
  per (query, key) pair it multiplies (causal: half the square for a prompt).
No launch, host or scheduling cost counts. The H200 figures are what this machine measures close to (a
device-to-device copy reaches 4.27 TB/s, the decode attention kernel 3.9-4.2 TB/s), not the datasheet's
4.8 TB/s, so the floor is one a kernel can reach.

    python -m bench.floor --preset qwen3-0.6b --workload offline
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

H200_BYTES_PER_S = 4.0e12
H200_FLOPS = 989e12  # dense bf16


@dataclass(frozen=True, slots=True)
class ModelShape:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    params: int  # every weight the forward pass reads (the embedding counts once, as the tied LM head)

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelShape":
        h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
        heads, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        per_layer = h * (heads + 2 * kv) * d + heads * d * h + 3 * h * i
        embed = cfg["vocab_size"] * h * (1 if cfg.get("tie_word_embeddings") else 2)
        return cls(layers, heads, kv, d, layers * per_layer + embed)

    def kv_bytes_per_token(self, kv_element_bytes: float) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * kv_element_bytes


def floor_seconds(shape: ModelShape, requests: Sequence[tuple[int, int]], *, max_num_seqs: int = 512,
                  weight_bytes: float = 2, kv_bytes: float = 2, bandwidth: float = H200_BYTES_PER_S,
                  flops: float = H200_FLOPS) -> float:
    """requests: (prompt tokens, output tokens). The floor's wall time of running them all."""
    kv_token = shape.kv_bytes_per_token(kv_bytes)
    attn = 4 * shape.layers * shape.heads * shape.head_dim  # FLOPs per (query, key) pair
    queue = list(requests)[::-1]
    running: list[tuple[int, int]] = []  # (tokens left to generate, context so far) per running sequence
    total = 0.0
    while queue or running:
        new = []
        while queue and len(running) + len(new) < max_num_seqs:
            new.append(queue.pop())
        read = sum(ctx for _, ctx in running)
        tokens = sum(p for p, _ in new) + len(running)
        step_bytes = shape.params * weight_bytes + (read + tokens) * kv_token
        step_flops = 2 * shape.params * tokens + attn * (read + sum(p * (p + 1) // 2 for p, _ in new))
        total += max(step_bytes / bandwidth, step_flops / flops)
        # the prompt's step samples its first token; each decode one more
        running = [(left - 1, ctx + 1) for left, ctx in running if left > 1]
        running += [(out - 1, p + 1) for p, out in new if out > 1]
    return total


def floor_tokens_per_s(shape: ModelShape, requests: Sequence[tuple[int, int]], **kw) -> float:
    return sum(out for _, out in requests) / floor_seconds(shape, requests, **kw)


def main(argv: Sequence[str] | None = None) -> None:
    from bench.workload import WORKLOADS
    from worker_svc.checkpoints.presets import get_preset

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--workload", default="offline", choices=sorted(WORKLOADS))
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    args = ap.parse_args(argv)
    shape = ModelShape.from_config(get_preset(args.preset))
    reqs = [(len(r.prompt_ids), r.max_tokens) for r in WORKLOADS[args.workload]()]
    rate = floor_tokens_per_s(shape, reqs, max_num_seqs=args.max_num_seqs,
                              kv_bytes=1 if args.kv_cache_dtype == "fp8" else 2)
    print(f"{args.preset}, {args.workload} ({len(reqs)} requests), KV {args.kv_cache_dtype}: "
          f"floor {rate:,.0f} output tokens/s")


if __name__ == "__main__":
    main()
