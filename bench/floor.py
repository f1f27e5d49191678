"""The hardware floor of a workload: how fast one GPU could run it if every step cost only its bytes and FLOPs.

Steps are replayed as a continuous-batching engine runs them (up to max_num_seqs sequences, a new one admitted
when another ends, its prompt computed in the step it is admitted); a step costs the larger of
- its bytes at the memory bandwidth: the weights once, plus the K and V of every context token it reads and
  of every token it writes, and
- its FLOPs at the dense bf16 peak: 2 x parameters per token computed, plus attention's 4 x heads x head_dim
  per (query, key) pair it multiplies (causal: half the square for a prompt), a layer with a sliding window
  reading only the keys inside it.
With routed experts (Qwen3-MoE) a step reads the experts its tokens route to: with T tokens each choosing k of E
experts uniformly, E (1 - (1 - k/E)^T) of them per layer; a token computes its k experts only.
No launch, host or scheduling cost counts. The H200 figures are what this machine measures close to (a
device-to-device copy reaches 4.27 TB/s, the decode attention kernel 3.9-4.2 TB/s), not the datasheet's
4.8 TB/s, so the floor is one a kernel can reach.

    python -m bench.floor --preset qwen3-0.6b --workload offline
"""
from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

H200_BYTES_PER_S = 4.0e12
H200_FLOPS = 989e12  # dense bf16


@dataclass(frozen=True, slots=True)
class ModelShape:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    params: int  # every weight the forward pass reads but the experts (the embedding once, as the tied LM head)
    expert_params: int = 0  # one expert's weights, over every layer that has experts
    num_experts: int = 0
    top_k: int = 0
    windows: tuple[int, ...] = ()  # the sliding window of each layer that has one (a layer reads its last w keys)
    kv_planes: int = 2  # K and V, or K alone where V is K (latent attention)
    bidirectional: bool = False  # an encoder's: every query sees every key of its sequence

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelShape":
        """From the worker's reading of the config (its windows, its experts' layers)."""
        from worker_svc.model.registry import architecture_of

        m = architecture_of(cfg).config(cfg)
        windows = tuple(w for n in range(m.num_hidden_layers) if (w := m.window_of(n)))
        h, i, layers = m.hidden_size, m.intermediate_size, m.num_hidden_layers
        heads, kv, d = m.num_attention_heads, m.num_key_value_heads, m.head_dim
        attention, planes = h * (heads + 2 * kv) * d + heads * d * h, 2
        if m.mla is not None:  # DeepSeek's latent attention: its projections; its cache one plane of the latent
            a, planes = m.mla, 1
            q_dim = a.qk_nope_head_dim + a.qk_rope_head_dim
            q = heads * q_dim * (h if a.q_lora_rank is None else a.q_lora_rank) + (a.q_lora_rank or 0) * h
            attention = (q + h * (a.kv_lora_rank + a.qk_rope_head_dim)
                         + a.kv_lora_rank * heads * (a.qk_nope_head_dim + a.v_head_dim) + heads * a.v_head_dim * h)
        embed = m.vocab_size * h * (1 if m.tie_word_embeddings else 2)
        if m.encoder is not None:  # no LM head; an MLP of two projections, not gated
            return cls(layers, heads, kv, d, layers * (attention + 2 * h * i) + m.vocab_size * h, bidirectional=True)
        if m.moe is None:
            return cls(layers, heads, kv, d, layers * (attention + 3 * h * i) + embed, windows=windows,
                       kv_planes=planes)
        sparse, experts = len(m.moe.layers), m.moe.num_experts
        shared = 3 * h * m.moe.shared_intermediate_size  # the shared expert (and Qwen2-MoE's gate): every token's
        shared += h if m.moe.shared_intermediate_size and m.moe.shared_expert_gated else 0
        params = layers * attention + (layers - sparse) * 3 * h * i + sparse * (h * experts + shared) + embed
        return cls(layers, heads, kv, d, params, sparse * 3 * h * m.moe.intermediate_size, experts, m.moe.top_k,
                   windows, planes)

    def weights_read(self, tokens: int) -> float:
        """Parameters a step of `tokens` tokens reads: the dense ones and the experts routed to."""
        if not self.num_experts:
            return self.params
        touched = self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** tokens)
        return self.params + touched * self.expert_params

    def active_params(self) -> int:
        """Parameters one token computes with."""
        return self.params + self.top_k * self.expert_params

    def kv_bytes_per_token(self, kv_element_bytes: float) -> float:
        return self.kv_planes * self.layers * self.kv_heads * self.head_dim * kv_element_bytes

    def keys_read(self, ctx: int) -> int:
        """Keys, summed over the layers, that a query after `ctx` tokens reads."""
        return (self.layers - len(self.windows)) * ctx + sum(min(ctx, w) for w in self.windows)

    def prompt_pairs(self, p: int) -> int:
        """(query, key) pairs of a p-token prompt, causal (or both ways: an encoder's), summed over the layers."""
        if self.bidirectional:
            return self.layers * p * p
        full = p * (p + 1) // 2
        return (self.layers - len(self.windows)) * full + sum(
            full if p <= w else w * (w + 1) // 2 + (p - w) * w for w in self.windows)


def replay(shape: ModelShape, requests: Sequence[tuple[int, int]], *, max_num_seqs: int = 512,
           weight_bytes: float = 2, kv_bytes: float = 2) -> Iterator[tuple[float, float, float, bool]]:
    """The steps of running requests ((prompt tokens, output tokens) each), as (bytes, FLOPs, bytes of the routed
    experts, decode-only) per step."""
    kv_key = shape.kv_bytes_per_token(kv_bytes) / shape.layers  # one layer's K and V of a token
    attn = 4 * shape.heads * shape.head_dim  # FLOPs per (query, key) pair of one layer
    queue = list(requests)[::-1]
    running: list[tuple[int, int]] = []  # (tokens left to generate, context so far) per running sequence
    while queue or running:
        new = []
        while queue and len(running) + len(new) < max_num_seqs:
            new.append(queue.pop())
        read = sum(shape.keys_read(ctx) for _, ctx in running)
        tokens = sum(p for p, _ in new) + len(running)
        experts = (shape.weights_read(tokens) - shape.params) * weight_bytes
        step_bytes = shape.params * weight_bytes + experts + (read + tokens * shape.layers) * kv_key
        step_flops = 2 * shape.active_params() * tokens + attn * (read + sum(shape.prompt_pairs(p) for p, _ in new))
        yield step_bytes, step_flops, experts, not new
        # the prompt's step samples its first token; each decode one more
        running = [(left - 1, ctx + 1) for left, ctx in running if left > 1]
        running += [(out - 1, p + 1) for p, out in new if out > 1]


def floor_seconds(shape: ModelShape, requests: Sequence[tuple[int, int]], *, bandwidth: float = H200_BYTES_PER_S,
                  flops: float = H200_FLOPS, **kw) -> float:
    """requests: (prompt tokens, output tokens). The floor's wall time of running them all."""
    return sum(max(b / bandwidth, f / flops) for b, f, _, _ in replay(shape, requests, **kw))


def decode_step_floor(shape: ModelShape, requests: Sequence[tuple[int, int]], *,
                      bandwidth: float = H200_BYTES_PER_S, **kw) -> tuple[float, float]:
    """Seconds per decode-only step, averaged over the run: its bytes at the bandwidth, and the routed experts'
    share of them (0 without experts), what a decode step of a MoE model is weighed against."""
    steps = [(b, e) for b, _, e, decode in replay(shape, requests, **kw) if decode]
    n = max(len(steps), 1)
    return sum(b for b, _ in steps) / n / bandwidth, sum(e for _, e in steps) / n / bandwidth


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
