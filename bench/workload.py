"""The benchmark workloads, built the same way for every path that runs them."""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(slots=True)
class Request:
    prompt_ids: list[int]
    max_tokens: int


def offline(num_seqs: int = 256, max_input: int = 1024, max_output: int = 1024, seed: int = 0) -> list[Request]:
    """nano-vLLM's bench.py: prompt and output lengths uniform in [100, max], token ids in [0, 10000]."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, max_input))] for _ in range(num_seqs)]
    return [Request(p, rng.randint(100, max_output)) for p in prompts]


def short(num_seqs: int = 2048, lo: int = 100, hi: int = 300, seed: int = 0) -> list[Request]:
    """Many short requests (chat-like traffic): prompt and output lengths uniform in [lo, hi]."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(lo, hi))] for _ in range(num_seqs)]
    return [Request(p, rng.randint(lo, hi)) for p in prompts]


def prefix_sharing(num_prefixes: int = 4, per_prefix: int = 64, prefix_len: int = 1024, suffix_len: int = 64,
                   output_len: int = 64, seed: int = 0) -> list[Request]:
    """Many requests over a few long shared prefixes (system prompts, few-shot examples)."""
    rng = random.Random(seed)
    prefixes = [[rng.randint(0, 10000) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    reqs = [Request(prefixes[i % num_prefixes] + [rng.randint(0, 10000) for _ in range(suffix_len)], output_len)
            for i in range(num_prefixes * per_prefix)]
    rng.shuffle(reqs)
    return reqs


# The throughput workloads by name, at their default sizes (bench offline --workload, bench floor)
WORKLOADS = {"offline": offline, "short": short}
