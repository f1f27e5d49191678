"""Attention of steps with prefills alone: flash-attn-4 against the Triton paged prefill kernel, per layer call.

Two times per kernel: GPU time (20 calls captured in a CUDA graph, replayed) and eager time (20 calls
launched one after another from Python, then a sync: what a mixed step, which runs eagerly, pays when the
host is slower than the GPU). Checks every kernel against the first one.

python -m bench prefill-attention
python -m bench prefill-attention --layouts nhd,hnd
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import numpy as np
import torch

from bench.decode_attention import add_row, as_layout, graph_time_us, kernel_output
from bench.record import record
from common.util import cdiv
from worker_svc.kernels.attention import AttentionMetadata, flash_attn_available, make_attention

CASES = {  # name: (query tokens per sequence, context lengths)
    "29x560 prompts": ([560] * 29, [560] * 29),
    "1x128 prompt": ([128], [128]),
    "1x8192 prompt": ([8192], [8192]),
    "8x1024 over 1024 cached": ([1024] * 8, [2048] * 8),
    "mixed 16 chunks + 200 decodes": ([512] * 16 + [1] * 200, [512] * 16 + [900] * 200),
}


def make_case(q_lens: list[int], c_lens: list[int], page: int, gen: torch.Generator, layout: str = "nhd"):
    heads, kv_heads, dim = 16, 8, 128
    pages = [cdiv(c, page) for c in c_lens]
    num_blocks = sum(pages) + 1
    perm = torch.randperm(num_blocks, generator=gen).int()
    table = torch.zeros(len(c_lens), max(pages), dtype=torch.int32)
    used = 0
    for i, n in enumerate(pages):
        table[i, :n] = perm[used:used + n]
        used += n
    k = as_layout(torch.randn(num_blocks, page, kv_heads, dim, generator=gen).to("cuda", torch.bfloat16), layout)
    v = as_layout(torch.randn(num_blocks, page, kv_heads, dim, generator=gen).to("cuda", torch.bfloat16), layout)
    q = torch.randn(sum(q_lens), heads, dim, generator=gen).to("cuda", torch.bfloat16)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32, device="cuda")
    meta = AttentionMetadata(cu, torch.tensor(c_lens, dtype=torch.int32, device="cuda"), table.cuda(), None,
                             max(q_lens), list(q_lens), list(c_lens))
    return q, k, v, meta


def eager_us(fn, calls: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--layouts", default="nhd", help="KV cache layouts: nhd, hnd (bench/decode_attention.py)")
    ap.add_argument("--out", default="bench/results/prefill_attention.json")
    args = ap.parse_args(argv)
    cuda = torch.device("cuda")
    names = ["triton", "flash_attn"] if flash_attn_available(cuda) else ["triton"]
    backends = {name: make_attention(name, cuda) for name in names}
    gen = torch.Generator()
    rows = []
    reference = {}  # per case, the first layout's first kernel
    for (case, (q_lens, c_lens)), layout in ((c, lay) for c in CASES.items() for lay in args.layouts.split(",")):
        gen.manual_seed(list(CASES).index(case))  # every layout of a case holds the same values
        q, k, v, meta = make_case(q_lens, c_lens, args.block_size, gen, layout)
        scale = q.shape[-1] ** -0.5
        # causal multiply-adds of QK^T and PV: query i of a chunk of n over context c sees c - n + i + 1 keys
        flop = sum(4 * q.shape[1] * q.shape[2] * (n * (c - n) + n * (n + 1) / 2) for n, c in zip(q_lens, c_lens))
        for name, backend in backends.items():
            fn = (lambda b=backend, q=q, k=k, v=v, meta=meta: b.forward(q, k, v, meta, scale))
            row = {"case": case, "layout": layout, "kernel": name}
            if (out := kernel_output(fn, rows, row)) is None:
                continue
            err = (out - reference.setdefault(case, out)).abs().max().item()
            gpu, eager = graph_time_us(fn), eager_us(fn)
            add_row(rows, {**row, "gpu_us": round(gpu, 1), "eager_us": round(eager, 1),
                           "tflops": round(flop / gpu / 1e6, 1), "max_abs_diff": round(err, 4)})
        del q, k, v
        torch.cuda.empty_cache()
    record(args.out, "prefill_attention", vars(args), rows)


if __name__ == "__main__":
    main()
