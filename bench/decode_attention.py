"""Paged decode attention alone: flash-attn-4 against the Triton split-KV kernel, per layer call.

Each case is a batch of sequences with one query token and a context drawn from a range, on a KV cache
with pages in random order; each kernel is captured in a CUDA graph 20 times and replayed, so the time
is GPU time. Bandwidth counts the K and V rows read. Checks every kernel against flash-attn-4's output.

python -m bench decode-attention
python -m bench decode-attention --configs 64:4:3:256,128:8:2:512 --block-size 256
python -m bench decode-attention --layouts nhd,hnd   # KV cache token-major or head-major within a block
python -m bench decode-attention --kv-cache-dtype fp8 --configs 128:4:3:512,256:8:3:512   # an e4m3 cache
python -m bench decode-attention --heads 32:4 --configs 128:4:3:512,128:4:3:256   # Qwen3-30B-A3B's GQA
ncu --clock-control none -k regex:_split_kernel -c 1 --section SpeedOfLight --section WarpStateStats \
    --section Occupancy python3 -m bench decode-attention --cases 128x900 --configs 128:4:3:512   # its counters
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

import torch

from bench.common import replay_ms
from bench.record import record

CASES = "256x800,128x900,256x100-2048,128x100-2048,64x1500,32x1000-2048,16x1000,8x1000,1x1000"


def parse_case(name: str) -> tuple[int, int, int]:
    """A case's (batch, min context, max context): BxL is B sequences of L tokens, BxLO-HI of LO..HI tokens."""
    batch, _, lens = name.partition("x")
    lo, _, hi = lens.partition("-")
    return int(batch), int(lo), int(hi or lo)


def as_layout(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """A [num_blocks, page, kv_heads, head_dim] cache stored as `layout` ("nhd" as it is, "hnd" with each
    KV head's rows of a block contiguous), as a view of the same shape and values."""
    return cache.transpose(1, 2).contiguous().transpose(1, 2) if layout == "hnd" else cache


def make_case(batch: int, lo: int, hi: int, page: int, heads: int, kv_heads: int, head_dim: int,
              gen: torch.Generator, layout: str = "nhd"):
    """layout "nhd": blocks stored [page, kv_heads, head_dim] (a KV head's rows 256 bytes apart by
    kv_heads); "hnd": [kv_heads, page, head_dim] (each head's rows of a block contiguous), handed to the
    kernels as a [num_blocks, page, kv_heads, head_dim] view either way."""
    lens = torch.randint(lo, hi + 1, (batch,), generator=gen)
    pages_per_seq = (lens + page - 1) // page
    num_blocks = int(pages_per_seq.sum()) + 1
    width = int(pages_per_seq.max())
    perm = torch.randperm(num_blocks, generator=gen).int()
    table = torch.zeros(batch, width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(pages_per_seq.tolist()):
        table[i, :n] = perm[used:used + n]
        used += n
    k = torch.randn(num_blocks, page, kv_heads, head_dim, generator=gen).to("cuda", torch.bfloat16)
    v = torch.randn(num_blocks, page, kv_heads, head_dim, generator=gen).to("cuda", torch.bfloat16)
    k, v = as_layout(k, layout), as_layout(v, layout)
    q = torch.randn(batch, heads, head_dim, generator=gen).to("cuda", torch.bfloat16)
    return q, k, v, lens.int().cuda(), table.cuda(), int(lens.sum())


def reference_attention(q, k, v, lens, table, scale) -> torch.Tensor:
    """The torch backend's output (float32), the same whatever the layout."""
    from worker_svc.kernels.attention import AttentionMetadata
    from worker_svc.kernels.reference import TorchAttention

    n = len(lens)
    meta = AttentionMetadata(cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32), seqused_k=lens, page_table=table,
                             slot_mapping=torch.empty(0), max_seqlen_q=1, query_lens=[1] * n,
                             context_lens=lens.tolist())
    return TorchAttention().forward(q.float(), k.float(), v.float(), meta, scale)


def add_row(rows: list[dict], row: dict) -> None:
    rows.append(row)
    print(json.dumps(row), flush=True)


def kernel_output(fn, rows: list[dict], row: dict) -> torch.Tensor | None:
    """fn()'s output in float32; None, after adding `row` with the error to `rows`, where the kernel refuses
    the case (flash-attn-4 may refuse a layout)."""
    try:
        return fn().float()
    except Exception as e:
        add_row(rows, {**row, "error": str(e)[:200]})
        return None


def graph_time_us(fn, reps: int = 20, replays: int = 10) -> float:
    """GPU time of one call of fn: `reps` calls captured in a CUDA graph, replayed `replays` times."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return replay_ms(graph, replays) * 1e3 / reps


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--cases", default=CASES, help="comma-separated BxL or BxLO-HI: B sequences of L or LO..HI "
                                                   "context tokens")
    ap.add_argument("--configs", default="64:4:3:256,128:4:3:512",
                    help="Triton configurations block_n:num_warps:num_stages:split[:tma][:f16], comma-separated "
                         "(tma: K and V tiles loaded by the tensor memory accelerator; f16: fp16 dots)")
    ap.add_argument("--layouts", default="nhd", help="KV cache layouts to time: nhd, hnd (see make_case)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                    help="fp8: the Triton kernels read an e4m3 copy of the cache (flash-attn-4 reads no fp8)")
    ap.add_argument("--heads", default="16:8", help="query heads:KV heads (16:8 Qwen3-0.6B, 32:8 Llama-3.1-8B, "
                                                    "32:4 Qwen3-30B-A3B); head_dim 128")
    ap.add_argument("--out", default="bench/results/decode_attention.json")
    args = ap.parse_args(argv)
    from worker_svc.kernels.decode_attention import merge_counters, paged_decode_attention

    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError:
        flash_attn_varlen_func = None
    heads, kv_heads = (int(x) for x in args.heads.split(":"))
    head_dim = 128
    scale = head_dim ** -0.5
    gen = torch.Generator()
    rows = []
    cases = args.cases.split(",")
    for case, layout in ((c, lay) for c in cases for lay in args.layouts.split(",")):
        batch, lo, hi = parse_case(case)
        gen.manual_seed(cases.index(case))  # both layouts of a case hold the same values
        q, k, v, lens, table, tokens = make_case(batch, lo, hi, args.block_size, heads, kv_heads, head_dim, gen,
                                                 layout)
        fp8 = args.kv_cache_dtype == "fp8"
        if fp8:  # the reference reads the same rounded values
            k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        gbytes = tokens * kv_heads * head_dim * 2 * k.element_size() / 1e9
        kernels = {}
        if flash_attn_varlen_func is not None and not fp8:
            cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")

            def fa4(q=q, k=k, v=v, cu=cu, lens=lens, table=table):
                out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, seqused_k=lens, page_table=table,
                                             max_seqlen_q=1, softmax_scale=scale, causal=True)
                return out[0] if isinstance(out, tuple) else out
            kernels["flash_attn"] = fa4
        counters = merge_counters(batch, kv_heads, "cuda")  # as the backend holds them: no memset per call
        for config in args.configs.split(","):
            block_n, warps, stages, split = (int(x) for x in config.split(":")[:4])
            tma, f16 = ":tma" in config, ":f16" in config
            if tma and layout != "nhd":
                continue
            kernels[f"triton {config}"] = (
                lambda q=q, k=k, v=v, lens=lens, table=table, b=block_n, w=warps, s=stages, sp=split, t=tma, f=f16:
                paged_decode_attention(q, k, v, lens, table, scale, counters=counters, base_split=sp, block_n=b,
                                       num_warps=w, num_stages=s, tma=t, f16_dots=f))
        reference = reference_attention(q, k.to(torch.bfloat16), v.to(torch.bfloat16), lens, table, scale)
        for name, fn in kernels.items():
            row = {"case": case, "layout": layout, "kernel": name}
            if (out := kernel_output(fn, rows, row)) is None:
                continue
            err = (out - reference).abs().max().item()
            us = graph_time_us(fn)
            add_row(rows, {**row, "block_size": args.block_size, "us": round(us, 1),
                           "tb_per_s": round(gbytes / us * 1e3, 2), "max_abs_diff": round(err, 4)})
        del q, k, v
        torch.cuda.empty_cache()
    record(args.out, "decode_attention", vars(args), rows)


if __name__ == "__main__":
    main()
