"""Paged decode attention over DeepSeek's latent cache alone: the latent kernel (kernels/latent_attention.py) in
each configuration against the generic decode kernel that served it before (a head of 576 padded to 1,024, K and V
read from the one plane), per layer call, in CUDA graphs (bench.decode_attention.graph_time_us). Bandwidth counts
the cache rows read once; each output is checked against the torch backend's.

python -m bench latent-attention
python -m bench latent-attention --heads 64 --configs 64:4:2:512:tma:h16,64:8:2:512:tma:h64
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from bench.decode_attention import CASES, add_row, graph_time_us, make_case, parse_case
from bench.record import record


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--cases", default=CASES, help="comma-separated BxL or BxLO-HI (bench decode-attention's)")
    ap.add_argument("--configs", default="32:4:2:512,64:4:2:512,32:4:3:512,16:4:4:512,32:8:2:512,32:4:2:256",
                    help="latent kernel configurations block_n:num_warps:num_stages:split[:tma][:hH], comma-separated "
                         "(tma: tiles loaded by the tensor memory accelerator; hH: H query heads a program)")
    ap.add_argument("--heads", type=int, default=16, help="query heads a worker holds (DeepSeek-V2-Lite 16)")
    ap.add_argument("--latent", type=int, default=512, help="kv_lora_rank")
    ap.add_argument("--rope", type=int, default=64, help="qk_rope_head_dim")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--out", default="bench/results/latent_attention.json")
    args = ap.parse_args(argv)
    from worker_svc.kernels.attention import AttentionMetadata, latent_columns
    from worker_svc.kernels.decode_attention import merge_counters, paged_decode_attention
    from worker_svc.kernels.latent_attention import head_blocks, paged_latent_decode_attention
    from worker_svc.kernels.reference import TorchAttention

    head_dim, scale = args.latent + args.rope, 192 ** -0.5
    gen, rows = torch.Generator(), []
    for i, case in enumerate(args.cases.split(",")):
        batch, lo, hi = parse_case(case)
        gen.manual_seed(i)
        q, cache, _, lens, table, tokens = make_case(batch, lo, hi, args.block_size, args.heads, 1, head_dim, gen)
        if args.kv_cache_dtype == "fp8":
            cache = cache.to(torch.float8_e4m3fn)
        meta = AttentionMetadata(torch.arange(batch + 1, dtype=torch.int32), lens, table, torch.empty(0), 1,
                                 [1] * batch, lens.tolist())
        reference = TorchAttention().latent(q.float(), cache.float(), meta, scale, 1.0, args.rope)
        gbytes = tokens * head_dim * cache.element_size() / 1e9
        counters = merge_counters(batch, head_blocks(args.heads), "cuda")  # the most any configuration takes
        kernels = {"generic": lambda q=q, cache=cache: latent_columns(
            paged_decode_attention(q, cache, cache, lens, table, scale, counters=counters), args.rope)}
        for config in args.configs.split(","):
            block_n, warps, stages, split = (int(x) for x in config.split(":")[:4])
            kernels[f"latent {config}"] = (
                lambda q=q, cache=cache, b=block_n, w=warps, s=stages, sp=split, t=":tma" in config,
                h=int(config.partition(":h")[2] or 0) or None:
                paged_latent_decode_attention(q, cache, lens, table, scale, args.rope, counters=counters,
                                              base_split=sp, block_n=b, num_warps=w, num_stages=s, tma=t, block_h=h))
        for name, fn in kernels.items():
            row = {"case": case, "heads": args.heads, "kernel": name}
            try:
                err = (fn().float() - reference).abs().max().item()
                us = graph_time_us(fn)
            except Exception as e:  # a configuration past shared memory or registers
                add_row(rows, {**row, "error": str(e)[:200]})
                continue
            add_row(rows, {**row, "us": round(us, 1), "tb_per_s": round(gbytes / us * 1e3, 2),
                           "max_abs_diff": round(err, 4)})
        del q, cache
        torch.cuda.empty_cache()
    record(args.out, "latent_attention", vars(args), rows)


if __name__ == "__main__":
    main()
