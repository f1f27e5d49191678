"""A decode layer's kernels outside attention, as the model runs them against a fused design, chained over 28
layers (Qwen3-0.6B's projections) and replayed in one CUDA graph: GPU time per layer.

As run (9 kernels a layer less rope/store and attention, which neither side changes here): the residual add +
RMSNorm kernel, qkv, o, add + RMSNorm, gate_up, SwiGLU, down, with cuBLAS's GEMMs or the same chain with plain
Triton GEMMs. Fused (4 kernels a layer): RMSNorm's 1/rms is a row scale, so it moves into the epilogue of the GEMM
that reads the norm's output, whose columns carry the norm's weight (folded at load time); the residual add and the
new row's sum of squares (an atomic add per row and N-tile) go into the epilogue of o and down; SwiGLU into down's
prologue. Attention's output is stood in for by qkv's first 2,048 columns. The fused chain's last residual is
compared with cuBLAS's (relative to its largest value).

python -m bench fused-layer
python -m bench fused-layer --rows 64,128,256 --pdl
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from bench.decode_attention import graph_time_us
from bench.record import record
from worker_svc.kernels.elementwise import rms_norm, silu_and_mul

HIDDEN, Q, QKV, INTER = 1024, 2048, 4096, 3072
EPS = 1e-6
# (BLOCK_M, BLOCK_N, BLOCK_K) per projection and row count: the best of `bench pdl-chain` (pdl_chain_32a7521.md)
TILES = {
    64: {"qkv": (64, 32, 128), "o": (64, 16, 128), "gate_up": (64, 64, 128), "down": (64, 16, 128)},
    128: {"qkv": (64, 64, 128), "o": (64, 16, 128), "gate_up": (64, 64, 64), "down": (64, 16, 128)},
    256: {"qkv": (128, 64, 128), "o": (64, 32, 128), "gate_up": (64, 64, 64), "down": (64, 32, 128)},
}


@triton.jit
def _gemm(X, W, Y, Res, SsIn, SsOut, M, N, K, stride_x, stride_w, stride_y, stride_r, eps, hidden,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWIGLU: tl.constexpr,
          ROW_SCALE: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    """Y = X @ W^T, where X is silu(gate) * up of [gate | up] rows with SWIGLU; times rsqrt(SsIn / hidden + eps)
    per row with ROW_SCALE; plus Res with RESIDUAL, adding the rounded row's sum of squares into SsOut."""
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    rows = m < M
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x_rows = X + m[:, None].to(tl.int64) * stride_x
    w_rows = W + n[:, None].to(tl.int64) * stride_w
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k[None, :]
        if SWIGLU:  # rounded as silu_and_mul rounds: the activation, then the product
            gate = tl.load(x_rows + kk, mask=rows[:, None], other=0.0)
            up = tl.load(x_rows + K + kk, mask=rows[:, None], other=0.0)
            g = gate.to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
            x = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
        else:
            x = tl.load(x_rows + kk, mask=rows[:, None], other=0.0)
        acc += tl.dot(x, tl.trans(tl.load(w_rows + kk)))
    if ROW_SCALE:
        acc = acc * tl.rsqrt(tl.load(SsIn + m, mask=rows, other=0.0) / hidden + eps)[:, None]
    out = acc.to(Y.dtype.element_ty)
    if RESIDUAL:  # rounded before it is squared, as rms_norm rounds x + residual
        out = (acc + tl.load(Res + m[:, None] * stride_r + n[None, :], mask=rows[:, None], other=0.0)
               .to(tl.float32)).to(Y.dtype.element_ty)
        o = out.to(tl.float32)
        tl.atomic_add(SsOut + m, tl.sum(o * o, 1), mask=rows)
    tl.store(Y + m[:, None] * stride_y + n[None, :], out, mask=rows[:, None])


def gemm(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, tiles: tuple[int, int, int], *, swiglu: bool = False,
         ss_in: torch.Tensor | None = None, residual: torch.Tensor | None = None,
         ss_out: torch.Tensor | None = None, pdl: bool = False) -> None:
    bm, bn, bk = tiles
    rows, n, k = x.shape[0], w.shape[0], w.shape[1]
    assert n % bn == 0 and k % bk == 0
    dummy = y
    grid = (n // bn, triton.cdiv(rows, bm))
    _gemm[grid](x, w, y, residual if residual is not None else dummy, ss_in if ss_in is not None else dummy,
                ss_out if ss_out is not None else dummy, rows, n, k, x.stride(0), w.stride(0), y.stride(0),
                residual.stride(0) if residual is not None else 0, EPS, HIDDEN, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                SWIGLU=swiglu, ROW_SCALE=ss_in is not None, RESIDUAL=residual is not None, PDL=pdl,
                num_warps=4, num_stages=4 if x.is_cuda else 1, **({"launch_pdl": True} if pdl else {}))


def make_layers(num_layers: int, device: str, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    """Each layer's weights, and the fused chain's: the norms' weights folded into qkv's and gate_up's columns."""
    layers = []
    for _ in range(num_layers):
        w = {name: torch.randn(n, k, device=device, dtype=dtype) * k ** -0.5
             for name, n, k in (("qkv", QKV, HIDDEN), ("o", HIDDEN, Q), ("gate_up", 2 * INTER, HIDDEN),
                                ("down", HIDDEN, INTER))}
        w["norm_in"] = (1 + 0.2 * torch.randn(HIDDEN, device=device)).to(dtype)
        w["norm_post"] = (1 + 0.2 * torch.randn(HIDDEN, device=device)).to(dtype)
        w["qkv_folded"] = (w["qkv"].float() * w["norm_in"].float()).to(dtype)
        w["gate_up_folded"] = (w["gate_up"].float() * w["norm_post"].float()).to(dtype)
        layers.append(w)
    return layers


class Chains:
    """The three chains over one set of layers and buffers for `rows` rows; each leaves its last residual in
    `self.out`."""

    def __init__(self, layers: list[dict[str, torch.Tensor]], h0: torch.Tensor, tiles: dict):
        self.layers, self.h0, self.tiles = layers, h0, tiles
        rows, dev, dt = h0.shape[0], h0.device, h0.dtype
        self.qkv = torch.empty(rows, QKV, device=dev, dtype=dt)
        self.o = torch.empty(rows, HIDDEN, device=dev, dtype=dt)
        self.gate_up = torch.empty(rows, 2 * INTER, device=dev, dtype=dt)
        self.down = torch.empty(rows, HIDDEN, device=dev, dtype=dt)
        self.h = [torch.empty_like(h0), torch.empty_like(h0)]
        self.ss = torch.empty(len(layers) + 1, 2, rows, device=dev, dtype=torch.float32)
        self.out = torch.empty_like(h0)

    def unfused(self, gemms: str = "cublas", split_k: int | None = 1) -> None:
        def mm(x, name, w, y):
            if gemms == "triton":
                gemm(x, w[name], y, self.tiles[name])
            elif gemms == "quack":  # CuTe-DSL Hopper GEMMs (flash-attn-4's dependency), autotuned per shape
                from quack.gemm_interface import gemm as quack_gemm
                quack_gemm(x, w[name].t(), out=y, tuned=True, split_k=split_k)
            else:
                torch.mm(x, w[name].t(), out=y)

        h = self.h0
        self.down.zero_()
        for w in self.layers:
            x, h = rms_norm(self.down, w["norm_in"], EPS, residual=h)
            mm(x, "qkv", w, self.qkv)
            mm(self.qkv[:, :Q], "o", w, self.o)
            x, h = rms_norm(self.o, w["norm_post"], EPS, residual=h)
            mm(x, "gate_up", w, self.gate_up)
            mm(silu_and_mul(self.gate_up), "down", w, self.down)
        torch.add(h, self.down, out=self.out)

    def fused(self, pdl: bool = False, swiglu_prologue: bool = True) -> None:
        t, ss, (h, h2) = self.tiles, self.ss, self.h
        ss.zero_()
        ss[0, 0] = self.h0.float().pow(2).sum(1)
        h.copy_(self.h0)
        for i, w in enumerate(self.layers):
            last = i == len(self.layers) - 1
            gemm(h, w["qkv_folded"], self.qkv, t["qkv"], ss_in=ss[i, 0], pdl=pdl)
            gemm(self.qkv[:, :Q], w["o"], h2, t["o"], residual=h, ss_out=ss[i, 1], pdl=pdl)
            gemm(h2, w["gate_up_folded"], self.gate_up, t["gate_up"], ss_in=ss[i, 1], pdl=pdl)
            act = self.gate_up if swiglu_prologue else silu_and_mul(self.gate_up)
            gemm(act, w["down"], self.out if last else h, t["down"], swiglu=swiglu_prologue, residual=h2,
                 ss_out=ss[i + 1, 0], pdl=pdl)


def max_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return round(float((got.float() - ref.float()).abs().max() / ref.float().abs().max()), 4)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="64,128,256")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--pdl", action="store_true", help="also the fused chain with programmatic dependent launch")
    ap.add_argument("--quack", action="store_true", help="also the chain on quack's autotuned GEMMs (with PDL)")
    ap.add_argument("--only-quack", action="store_true", help="cuBLAS and quack only")
    ap.add_argument("--out", default="bench/results/fused_layer.json")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    layers = make_layers(args.layers, "cuda", torch.bfloat16)
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        chains = Chains(layers, torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16), TILES[rows])
        variants = {"cublas": chains.unfused}
        if not args.only_quack:
            variants |= {"triton": lambda: chains.unfused("triton"), "fused": chains.fused,
                         "fused_but_swiglu": lambda: chains.fused(swiglu_prologue=False)}
        if args.quack or args.only_quack:
            variants["quack"] = lambda: chains.unfused("quack")
            variants["quack_split_k"] = lambda: chains.unfused("quack", split_k=None)
        if args.pdl:
            variants["fused_pdl"] = lambda: chains.fused(True)
        row: dict = {"rows": rows}
        ref = None
        for name, chain in variants.items():
            row[f"{name}_us_per_layer"] = round(graph_time_us(chain, 1, args.replays) / args.layers, 2)
            chain()
            torch.cuda.synchronize()
            ref = chains.out.clone() if ref is None else ref
            row[f"{name}_max_err"] = max_err(chains.out, ref)
        print(row)
        results.append(row)
    record(args.out, "fused_layer", vars(args), results)


if __name__ == "__main__":
    main()
