"""Can a decode layer's projection weights wait in L2 while attention streams the KV cache?

A decode layer is attention (hundreds of MB of KV read once, bandwidth-bound) followed by four small GEMMs
(~30 MB of weights at Qwen3-0.6B's shapes) that take ~4x their bytes' time at 64-256 rows. If the weights were
pulled into L2 during attention, by a few programs on a second stream, and attention's loads told L2 to evict
its own lines first, the GEMMs would read L2. This times that on stand-ins: a streaming read of STREAM_MB (with
or without an evict_first hint) for attention, the layer's four cuBLAS GEMMs after it, and a prefetch of the
layer's weights (evict_last) beside the stream; 28 layers with their own weights in one CUDA graph, replayed.

python -m bench l2-weights
python -m bench l2-weights --rows 128,256 --stream-mb 130,840
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from bench.decode_attention import graph_time_us
from bench.pdl_chain import SHAPES
from bench.record import record


@triton.jit
def _read(SRC, DST, n_elements, BLOCK: tl.constexpr, EVICT: tl.constexpr):
    """Each program sums strided BLOCK-sized pieces of SRC (so nothing is optimised away)."""
    pid, step = tl.program_id(0), tl.num_programs(0) * BLOCK
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_elements, step):
        acc += tl.load(SRC + start + offs, mask=start + offs < n_elements, other=0.0, eviction_policy=EVICT)
    tl.store(DST + pid, tl.sum(acc))


def read(src: torch.Tensor, dst: torch.Tensor, programs: int, evict: str) -> None:
    _read[(programs,)](src, dst, src.numel(), BLOCK=2048, EVICT=evict, num_warps=4)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="64,256")
    ap.add_argument("--stream-mb", default="130,840", help="the attention stand-in's bytes a layer")
    ap.add_argument("--prefetch-programs", type=int, default=8)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--out", default="bench/results/l2_weights.json")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    weights = [[torch.randn(n, k, device=dev, dtype=dt) * k ** -0.5 for _, n, k in SHAPES]
               for _ in range(args.layers)]
    flat = [[w.view(torch.float32).view(-1) for w in layer] for layer in weights]
    sink = torch.empty(4 * sms, device=dev, dtype=torch.float32)
    side = torch.cuda.Stream()
    rows_out = []
    for mb in [int(m) for m in args.stream_mb.split(",")]:
        stream = torch.empty(mb * 2 ** 18, device=dev, dtype=torch.float32)  # mb MiB
        for rows in [int(r) for r in args.rows.split(",")]:
            x0 = torch.randn(rows, 1024, device=dev, dtype=dt)
            outs = [torch.empty(rows, n, device=dev, dtype=dt) for _, n, _ in SHAPES]

            def gemms(layer):
                for i, w in enumerate(layer):
                    prev = outs[i - 1] if i else outs[-1]
                    torch.mm(prev[:, :SHAPES[i][2]], w.t(), out=outs[i])

            def run(stream_evict: str | None, prefetch: str | None, do_gemms: bool = True):
                outs[-1].copy_(x0)
                for layer, parts in zip(weights, flat):
                    if prefetch:
                        side.wait_stream(torch.cuda.current_stream())
                        with torch.cuda.stream(side):
                            for p in parts:
                                read(p, sink[sms:], args.prefetch_programs, prefetch)
                    if stream_evict is not None:
                        read(stream, sink, 4 * sms, stream_evict)
                    if prefetch:
                        torch.cuda.current_stream().wait_stream(side)
                    if do_gemms:
                        gemms(layer)

            variants = {
                "gemms_cold": lambda: run(None, None),
                "gemms_hot": lambda: [gemms(weights[0]) for _ in weights],
                "stream": lambda: run("", None, False),
                "stream_first": lambda: run("evict_first", None, False),
                "stream_then_gemms": lambda: run("", None),
                "stream_first_then_gemms": lambda: run("evict_first", None),
                "stream_prefetch_last": lambda: run("", "evict_last"),
                "stream_first_prefetch_last": lambda: run("evict_first", "evict_last"),
                "stream_first_prefetch_only": lambda: run("evict_first", "evict_last", False),
            }
            row = {"stream_mb": mb, "rows": rows}
            for name, fn in variants.items():
                row[f"{name}_us"] = round(graph_time_us(fn, 1, args.replays) / args.layers, 2)
            row["stream_tb_s"] = round(mb * 2 ** 20 / row["stream_first_us"] / 1e6, 2)
            row["gain_us"] = round(row["stream_first_then_gemms_us"] - row["stream_first_prefetch_last_us"], 2)
            print(row, flush=True)
            rows_out.append(row)
    record(args.out, "l2_weights", vars(args), rows_out)


if __name__ == "__main__":
    main()
