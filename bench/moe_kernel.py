"""The fused MoE (worker_svc/kernels/moe.py) at Qwen3-30B-A3B's expert shapes: its tiles swept per token
count, against the time to read the experts the tokens route to.

Per token count: router choices drawn as a router makes them (top-k distinct experts per token from seeded
random scores, weights normalised), several draws so that successive calls read other experts' weights,
not L2's copy. fused_moe is timed whole with CUDA events, the median of --reps after a warm-up: replayed in a
CUDA graph of one call per draw up to --graph-max-tokens (the decode step's sizes), eagerly above.
The search, one GEMM at a time: for each BLOCK_M (align's, so both GEMMs share it; only those that suit the
rows per expert), gate_up's tiles with down's from the table, then down's with the best gate_up; the three
fastest and the table's config are timed again with 3x the reps, and the fastest of them wins. Every config's
output is checked against the loop over experts before it is timed; a mismatch is reported, never picked.
Before the sweep, worker processes build every candidate kernel into Triton's cache in parallel. The sweep
stops at --budget-s (shared out over the token counts; what it skipped is marked "partial").

Reports per token count the table's config (moe_config: what serves now) and the best found, each as
microseconds and as the ratio to reading the routed experts' weights (distinct experts x their bytes) at
--bandwidth, the best's time per stage, and prints the shape's HOPPER_CONFIGS entry to paste into moe.py (also
written next to --out as *_table.txt: an entry, not a module); every trial goes to *_trials.json. With --fp8 the
experts are e4m3 in 128 x 128 blocks with their scales (model/quantized.py), the GEMMs' inputs quantised as served,
K tiles at most a block, and the entry is HOPPER_FP8_CONFIGS'.

python -m bench moe-kernel
python -m bench moe-kernel --tokens 1,130 --budget-s 60
python -m bench moe-kernel --block-m 16 --block-n 64,128 --warps 4 --stages 3,4
python -m bench moe-kernel --fp8
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from multiprocessing import get_context
from pathlib import Path

import torch

from bench.common import csv_numbers, rnd, save
from common.util import available_cpus, cdiv
from worker_svc.kernels import moe, reference
from worker_svc.kernels.moe import MoeConfig, Tiles
from worker_svc.model.quantized import quantize_blocks

TOKENS = "1,8,32,64,130,256,512,1024,4096,16384"
SHARED_MEMORY = 232_448  # bytes a Hopper block may ask for (the H200's sharedMemPerBlockOptin)
MAX_ACC_PER_THREAD = 128  # fp32 accumulators per thread past which a tile spills
GEMMS = ("gate_up", "down")
STAGES = ("align", "gate_up", "silu", "down", "sum")


@dataclass(frozen=True)
class Shape:
    experts: int
    top_k: int
    hidden: int
    inter: int

    def nk(self, gemm: str) -> tuple[int, int]:
        """(N, K) of a GEMM's weights."""
        return (2 * self.inter, self.hidden) if gemm == "gate_up" else (self.hidden, self.inter)

    def expert_bytes(self, itemsize: int) -> int:
        return 3 * self.inter * self.hidden * itemsize


@dataclass
class Experts:
    """w13 [E, 2I, H] and w2 [E, H, I]; where e4m3, their block scales s13 and s2 (fused_moe's arguments)."""
    w13: torch.Tensor
    w2: torch.Tensor
    s13: torch.Tensor | None = None
    s2: torch.Tensor | None = None

    @classmethod
    def of(cls, w13: torch.Tensor, w2: torch.Tensor, fp8: bool) -> Experts:
        """These weights as served: as they are, or (fp8) each expert's in e4m3 128 x 128 blocks."""
        if not fp8:
            return cls(w13, w2)
        (q13, s13), (q2, s2) = (map(torch.stack, zip(*(quantize_blocks(e) for e in w))) for w in (w13, w2))
        return cls(q13, q2, s13, s2)

    @property
    def fp8(self) -> bool:
        return self.s13 is not None

    def fused_moe(self, d: Draw, config: MoeConfig) -> torch.Tensor:
        return moe.fused_moe(d.x, self.w13, self.w2, d.weights, d.ids, 0, config, s13=self.s13, s2=self.s2)

    def gemm(self, gemm: str, a: torch.Tensor, aligned: tuple, weights: torch.Tensor | None, top_k: int,
             block_m: int, tiles: Tiles) -> torch.Tensor:
        w, scale = (self.w13, self.s13) if gemm == "gate_up" else (self.w2, self.s2)
        return moe.grouped_gemm(a, w, *aligned, weights, top_k, gemm == "down", block_m, tiles, scale=scale)

    @functools.cached_property
    def loop_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The loop's w13 and w2: the values the kernel reads (float32 copies, made once; the codes where e4m3)."""
        return (self.w13, self.w2) if self.fp8 else (self.w13.float(), self.w2.float())

    def reference(self, d: Draw) -> torch.Tensor:
        """The loop over experts on the same values the kernel reads (its codes and scales where e4m3)."""
        return reference.fused_moe(d.x.float(), *self.loop_weights, d.weights.float(), d.ids, s13=self.s13,
                                   s2=self.s2)


@dataclass
class Draw:
    x: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor


@dataclass
class Case:
    """One token count: the draws, the loop's output for the first, and the routed experts' bytes."""
    tokens: int
    draws: list[Draw]
    reference: torch.Tensor
    distinct: float  # experts routed to, mean over draws
    graph: bool


# ---- the candidates ------------------------------------------------------------------------------------
def block_ms(tokens: int, shape: Shape, wanted: Sequence[int]) -> list[int]:
    """BLOCK_M values that suit the rows an expert gets (slots over the experts they reach): from a 16th of
    them (more blocks per expert re-read its weights) to 4x (more is empty rows), at least up to 32."""
    slots = tokens * shape.top_k
    reached = shape.experts * (1 - (1 - shape.top_k / shape.experts) ** tokens)
    rows = slots / max(reached, 1.0)
    return [m for m in wanted if rows / 16 <= m <= max(32, 4 * rows)] or [min(wanted)]


def fits(block_m: int, tiles: Tiles, n: int, k: int, fp8: bool = False) -> bool:
    """Tiles worth compiling for an [N, K] GEMM: no wider than the weights, within shared memory and
    registers, 8 warps only for tiles that give them work, no more stages than K has tiles to prefetch. e4m3
    (fp8): K tiles within a block of scales, one byte an element, and each tile's scaled product held beside the
    accumulator (moe.fp8_config)."""
    if tiles.block_n > max(16, 1 << (n - 1).bit_length()) or tiles.block_k > max(16, 1 << (k - 1).bit_length()):
        return False
    if fp8 and tiles.block_k > moe.FP8_GROUP:
        return False
    # Triton keeps num_stages tiles in shared memory where it issues wgmma (64 rows and more), one fewer else
    buffers = tiles.num_stages if block_m >= 64 else tiles.num_stages - 1
    smem = buffers * (block_m * tiles.block_k + tiles.block_k * tiles.block_n) * (1 if fp8 else 2)
    per_thread = block_m * tiles.block_n / (32 * tiles.num_warps) * (2 if fp8 else 1)
    return (smem <= SHARED_MEMORY and per_thread <= MAX_ACC_PER_THREAD
            and (tiles.num_warps == 4 or block_m * tiles.block_n >= 2048)
            and tiles.num_stages - 1 <= cdiv(k, tiles.block_k))


def candidates(block_m: int, n: int, k: int, args: argparse.Namespace) -> list[Tiles]:
    return [t for bn in args.block_n for bk in args.block_k for w in args.warps for s in args.stages
            if fits(block_m, t := Tiles(bn, bk, w, s), n, k, args.fp8)]


def sweep_jobs(shape: Shape, args: argparse.Namespace) -> list[Job]:
    """Every (GEMM, BLOCK_M, tiles) the sweep may run."""
    ms = sorted({m for t in args.tokens for m in block_ms(t, shape, args.block_m)})
    return [(g, m, t) for m in ms for g in GEMMS for t in candidates(m, *shape.nk(g), args)]


# ---- building kernels in parallel ----------------------------------------------------------------------
Job = tuple[str, int, Tiles]  # (GEMM, BLOCK_M, tiles)


def _build(jobs: list[Job], shape: Shape, device: str, dtype: torch.dtype, fp8: bool) -> list[tuple[Job, str]]:
    """In a worker process: runs each job's GEMM once on a few tokens, which puts its kernel in Triton's
    cache (the same specialisation as the sweep's: same N, K, strides, dtypes). Returns the failures."""
    tokens, experts = 4, shape.top_k
    x = torch.randn(tokens, shape.hidden, device=device, dtype=dtype)
    w13, w2 = (torch.randn(experts, *shape.nk(g), device=device, dtype=dtype) * 0.02 for g in GEMMS)
    e = Experts.of(w13, w2, fp8)
    ids = torch.arange(shape.top_k, device=device).repeat(tokens, 1)
    weights = torch.full((tokens, shape.top_k), 1.0 / shape.top_k, device=device, dtype=dtype)
    act = torch.randn(tokens * shape.top_k, shape.inter, device=device, dtype=dtype)
    failed = []
    for gemm, block_m, tiles in jobs:
        aligned = moe.align(ids, 0, experts, block_m)
        try:
            if gemm == "gate_up":
                e.gemm(gemm, x, aligned, None, shape.top_k, block_m, tiles)
            else:
                e.gemm(gemm, act, aligned, weights.reshape(-1), shape.top_k, block_m, tiles)
            if device == "cuda":
                torch.cuda.synchronize()
        except Exception as err:  # out of resources: the sweep skips it
            failed.append(((gemm, block_m, tiles), type(err).__name__))
    return failed


def build_all(jobs: list[Job], shape: Shape, workers: int, device: str, dtype: torch.dtype, fp8: bool) -> set[Job]:
    """Builds the jobs' kernels in `workers` processes; returns the jobs that failed to build or run."""
    workers = min(workers, len(jobs))
    if workers <= 0:
        return set()
    start = time.perf_counter()
    shares = [jobs[i::workers] for i in range(workers)]
    try:
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            failed = [f for fs in pool.map(_build, shares, [shape] * workers, [device] * workers,
                                           [dtype] * workers, [fp8] * workers) for f in fs]
    except Exception as e:  # the sweep then builds each kernel as it first runs it
        print(f"parallel build failed ({type(e).__name__}: {e}); building in the sweep", flush=True)
        return set()
    print(f"built {len(jobs)} kernels in {time.perf_counter() - start:.0f} s with {workers} processes; "
          f"{len(failed)} failed: {[f'{g} {m} {describe(t)}: {why}' for (g, m, t), why in failed[:6]]}", flush=True)
    return {job for job, _ in failed}


# ---- timing --------------------------------------------------------------------------------------------
def _median_ms(run: Callable[[], None], reps: int, device: torch.device) -> float:
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_us(calls: list[Callable[[], object]], graph: bool, reps: int, device: torch.device) -> float:
    """Microseconds per call: the calls (one per draw) in one CUDA graph, replayed, or run eagerly."""
    def eager() -> None:
        for call in calls:
            call()

    eager()  # warm-up (and the eager path's allocations)
    if not graph:
        return _median_ms(eager, reps, device) * 1e3 / len(calls)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        eager()
    g.replay()
    ms = _median_ms(g.replay, reps, device)
    del g
    return ms * 1e3 / len(calls)


def checked_us(case: Case, config: MoeConfig, experts: Experts, reps: int) -> tuple[float | None, str]:
    """(microseconds per fused_moe, '') or (None, why: an error or a mismatch with the loop)."""
    first = case.draws[0]
    try:
        out = experts.fused_moe(first, config).float()
        far = ~torch.isclose(out, case.reference, atol=3e-2, rtol=3e-2)
        # e4m3 experts: an input a rounding apart from the loop's takes the next code, which reaches a few outputs
        allowed = 1e-4 * far.numel() if experts.fp8 else 0
        diff = float((out - case.reference).abs().max())
        if far.sum() > allowed or experts.fp8 and diff > 0.1:
            return None, f"mismatch: max abs diff {diff:.3g}, {int(far.sum())} outputs past 3e-2"
        calls = [lambda d=d: experts.fused_moe(d, config) for d in case.draws]
        return time_us(calls, case.graph, reps, first.x.device), ""
    except Exception as e:  # a tile too large for this GPU: skipped, and said so
        return None, f"{type(e).__name__}: {str(e)[:120]}"


def stage_us(case: Case, config: MoeConfig, e: Experts, reps: int) -> dict[str, float]:
    """Each stage of fused_moe alone (the same graph or eager timing as the whole; with e4m3 experts a GEMM's
    input quantiser is in its stage)."""
    from worker_svc.kernels.elementwise import silu_and_mul

    top_k, experts, m = case.draws[0].ids.shape[1], e.w13.shape[0], config.block_m
    aligned = [moe.align(d.ids, 0, experts, m) for d in case.draws]
    inter = [e.gemm("gate_up", d.x, a, None, top_k, m, config.gate_up) for d, a in zip(case.draws, aligned)]
    act = [silu_and_mul(i) for i in inter]
    y = [e.gemm("down", a_, a, d.weights.reshape(-1), top_k, m, config.down)
         for d, a, a_ in zip(case.draws, aligned, act)]
    stages = {
        "align": [lambda d=d: moe.align(d.ids, 0, experts, m) for d in case.draws],
        "gate_up": [lambda d=d, a=a: e.gemm("gate_up", d.x, a, None, top_k, m, config.gate_up)
                    for d, a in zip(case.draws, aligned)],
        "silu": [lambda i=i: silu_and_mul(i) for i in inter],
        "down": [lambda d=d, a=a, a_=a_: e.gemm("down", a_, a, d.weights.reshape(-1), top_k, m, config.down)
                 for d, a, a_ in zip(case.draws, aligned, act)],
        "sum": [lambda d=d, y_=y_: moe.topk_sum(y_, d.ids, 0, experts) for d, y_ in zip(case.draws, y)],
    }
    device = case.draws[0].x.device
    return {name: time_us(calls, case.graph, reps, device) for name, calls in stages.items()}


# ---- the search ----------------------------------------------------------------------------------------
@dataclass
class Search:
    case: Case
    experts: Experts
    reps: int
    deadline: float
    trials: list[dict]
    timed: dict[MoeConfig, float | None]
    unbuilt: set[Job]  # what build_all could not build: not tried again
    cut: bool = False  # the deadline stopped a sweep

    def tiles(self, gemm: str, block_m: int, shape: Shape, args: argparse.Namespace) -> list[Tiles]:
        return [t for t in candidates(block_m, *shape.nk(gemm), args) if (gemm, block_m, t) not in self.unbuilt]

    def time(self, config: MoeConfig) -> float | None:
        if config not in self.timed:
            self.retime(config, self.reps)
        return self.timed[config]

    def retime(self, config: MoeConfig, reps: int) -> None:
        us, why = checked_us(self.case, config, self.experts, reps)
        self.timed[config] = us
        self.trials.append({"tokens": self.case.tokens, "block_m": config.block_m, "gate_up": describe(config.gate_up),
                            "down": describe(config.down), "reps": reps, "us": rnd(us, 2) if us is not None else None,
                            **({"error": why} if why else {})})

    def best_of(self, configs: list[MoeConfig]) -> MoeConfig | None:
        """The fastest of configs, timed in order until the deadline (the first is always timed)."""
        best, best_us = None, math.inf
        for i, config in enumerate(configs):
            if i and time.perf_counter() > self.deadline:
                self.cut = True
                break
            us = self.time(config)
            if us is not None and us < best_us:
                best, best_us = config, us
        return best


def search(s: Search, table: MoeConfig, shape: Shape, args: argparse.Namespace) -> MoeConfig:
    """Per BLOCK_M: gate_up's tiles with the table's down, then down's with that best. The three fastest
    configs and the table's are then timed again with more reps, the fastest of those wins."""
    s.time(table)
    for m in block_ms(s.case.tokens, shape, args.block_m):
        down = table.down if fits(m, table.down, *shape.nk("down"), args.fp8) else Tiles()
        gate_up = s.best_of([MoeConfig(m, t, down) for t in s.tiles("gate_up", m, shape, args)])
        if gate_up is not None:
            s.best_of([replace(gate_up, down=t) for t in s.tiles("down", m, shape, args)])
    ranked = sorted((c for c, us in s.timed.items() if us is not None), key=lambda c: s.timed[c])
    finalists = list(dict.fromkeys([*ranked[:3], *([table] if s.timed[table] is not None else [])]))
    for c in finalists:
        s.retime(c, args.reps * 3)
    timed = [c for c in finalists if s.timed[c] is not None]
    return min(timed, key=lambda c: s.timed[c]) if timed else table


# ---- the cases -----------------------------------------------------------------------------------------
def routing(tokens: int, shape: Shape, gen: torch.Generator, device: torch.device,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids): top-k distinct experts per token from random scores, weights normalised (Qwen3's
    norm_topk_prob), as model/moe.py's router hands them to fused_moe."""
    weights, ids = torch.randn(tokens, shape.experts, generator=gen).softmax(-1).topk(shape.top_k, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).to(device, dtype), ids.to(device)


def make_case(tokens: int, shape: Shape, experts: Experts, args: argparse.Namespace, device: torch.device,
              dtype: torch.dtype) -> Case:
    gen = torch.Generator().manual_seed(args.seed + tokens)
    graph = device.type == "cuda" and tokens <= args.graph_max_tokens
    draws = []
    for _ in range(args.draws if graph else 1):
        weights, ids = routing(tokens, shape, gen, device, dtype)
        draws.append(Draw(torch.randn(tokens, shape.hidden, generator=gen).to(device, dtype), weights, ids))
    ref = experts.reference(draws[0])
    distinct = statistics.mean(float(d.ids.unique().numel()) for d in draws)
    return Case(tokens, draws, ref, distinct, graph)


def describe(t: Tiles) -> str:
    return f"{t.block_n}/{t.block_k}/{t.num_warps}/{t.num_stages}"


def result_row(case: Case, shape: Shape, table: MoeConfig, table_us: float | None, best: MoeConfig,
               best_us: float | None, stages: dict[str, float | None], searched: str, trials: int,
               args: argparse.Namespace, dtype: torch.dtype) -> dict:
    itemsize = 1 if args.fp8 else dtype.itemsize
    floor_us = case.distinct * shape.expert_bytes(itemsize) / args.bandwidth * 1e6
    n_gu, k_gu = shape.nk("gate_up")
    gu_floor = case.distinct * n_gu * k_gu * itemsize / args.bandwidth * 1e6
    ratio = (lambda us: rnd(us / floor_us, 3) if us else None)
    return {
        "tokens": case.tokens, "timing": "graph" if case.graph else "eager", "experts_routed": rnd(case.distinct, 1),
        "routed_mb": rnd(case.distinct * shape.expert_bytes(itemsize) / 1e6, 1), "floor_us": rnd(floor_us, 1),
        "table": f"{table.block_m} {describe(table.gate_up)} {describe(table.down)}", "table_us": rnd(table_us, 1),
        "table_ratio": ratio(table_us), "block_m": best.block_m, "gate_up": describe(best.gate_up),
        "down": describe(best.down), "best_us": rnd(best_us, 1), "best_ratio": ratio(best_us),
        **{f"{k}_us": rnd(v, 1) for k, v in stages.items()},
        "gate_up_ratio": rnd(stages["gate_up"] / gu_floor, 3) if stages["gate_up"] else None,
        "down_ratio": rnd(stages["down"] / (floor_us - gu_floor), 3) if stages["down"] else None,
        "searched": searched, "trials": trials,
    }


# ---- the table to paste ---------------------------------------------------------------------------------
def capture_floor(x: float) -> int:
    """The largest CUDA-graph batch size (1, 2, 4, 8, then multiples of 16) <= x."""
    if x >= 16:
        return int(x) // 16 * 16
    return 1 << (max(1, int(x)).bit_length() - 1)


def capture_ceil(x: int) -> int:
    return x if x <= 1 else (1 << (x - 1).bit_length() if x <= 8 else cdiv(x, 16) * 16)


def table_keys(tokens: list[int]) -> list[int]:
    """Each measured count serves the counts up to the geometric middle to the next one, that bound
    rounded down to a CUDA-graph batch size (but never below the count's own); the last, all above."""
    keys = [max(capture_floor(math.sqrt(a * b)), capture_ceil(a)) for a, b in zip(tokens, tokens[1:])]
    return [*keys, capture_ceil(tokens[-1])] if tokens else []


def paste_table(best: dict[int, MoeConfig], shape: Shape) -> str:
    """The shape's entry of HOPPER_CONFIGS as Python: one entry per bucket, neighbours with the same config
    merged."""
    tokens = sorted(best)
    entries: list[tuple[int, int, MoeConfig]] = []
    for key, t in zip(table_keys(tokens), tokens):
        if entries and key <= entries[-1][0]:
            continue  # rounding left no counts of its own to this one
        if entries and entries[-1][2] == best[t]:
            entries.pop()
        entries.append((key, t, best[t]))
    lines = [f"    ({shape.hidden}, {shape.inter}): {{  # {shape.experts} experts, top {shape.top_k}"]
    for key, t, c in entries:
        g, d = c.gate_up, c.down
        lines.append(f"        {key}: MoeConfig({c.block_m}, Tiles({g.block_n}, {g.block_k}, {g.num_warps}, "
                     f"{g.num_stages}), Tiles({d.block_n}, {d.block_k}, {d.num_warps}, {d.num_stages})),"
                     f"  # from {t} tokens")
    return "\n".join([*lines, "    },"])


# ---- main ----------------------------------------------------------------------------------------------
def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench moe-kernel", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768, help="per expert (moe_intermediate_size)")
    ap.add_argument("--tokens", default=TOKENS)
    ap.add_argument("--block-m", default="16,32,64,128")
    ap.add_argument("--block-n", default="32,64,128,256")
    ap.add_argument("--block-k", default="64,128,256")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="2,3,4,5")
    ap.add_argument("--graph-max-tokens", type=int, default=512, help="up to this, timed as CUDA-graph replays")
    ap.add_argument("--draws", type=int, default=8, help="routings per graph, each call reading other experts")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=200.0,
                    help="the sweep's seconds (building kernels included), shared out over the token counts")
    ap.add_argument("--build-workers", type=int, default=-1,
                    help="processes building kernels before the sweep (default: the cores less one; 0: none)")
    ap.add_argument("--bandwidth", type=float, default=4.0e12, help="bytes/s the floor reads the experts at")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--fp8", action="store_true", help="experts in e4m3 128 x 128 blocks (HOPPER_FP8_CONFIGS' entry)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/moe_kernel.json")
    ap.set_defaults(model=None, preset="random experts")  # what save() records as the model
    args = ap.parse_args(argv)
    for name in ("tokens", "block_m", "block_n", "block_k", "warps", "stages"):
        setattr(args, name, csv_numbers(getattr(args, name), int))
    return args


def _write(argv: Sequence[str] | None, args: argparse.Namespace, shape: Shape, rows: list[dict], trials: list[dict],
           best: dict[int, MoeConfig], quiet: bool) -> str:
    """The results so far (JSON, .md, *_trials.json, *_table.txt): a run cut short keeps what it measured."""
    with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
        save("bench.moe_kernel", argv, args.out, "moe_kernel", args, rows)
    out = Path(args.out)
    out.with_name(out.stem + "_trials.json").write_text(json.dumps(trials, indent=1) + "\n")
    literal = paste_table(best, shape)
    out.with_name(out.stem + "_table.txt").write_text(literal + "\n")
    return literal


def weights(shape: Shape, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Experts:
    """w13 [E, 2I, H] and w2 [E, H, I], scaled as trained weights are (outputs of unit size), as served."""
    gen = torch.Generator(device).manual_seed(args.seed)
    w13 = torch.randn(shape.experts, *shape.nk("gate_up"), generator=gen, device=device) / shape.hidden ** 0.5
    w2 = torch.randn(shape.experts, *shape.nk("down"), generator=gen, device=device) / shape.inter ** 0.5
    return Experts.of(w13.to(dtype), w2.to(dtype), args.fp8)


def measure(case: Case, shape: Shape, experts: Experts, deadline: float, trials: list[dict], unbuilt: set[Job],
            args: argparse.Namespace, dtype: torch.dtype) -> tuple[dict, MoeConfig]:
    """One token count: the search until the deadline, then the stages of the best. (row, best)."""
    device = case.draws[0].x.device
    s = Search(case, experts, args.reps, deadline, trials, {}, unbuilt)
    table = moe.moe_config(case.tokens, shape.top_k,
                           moe.hopper_table(shape.hidden, shape.inter, dtype, device, args.fp8))
    found = search(s, table, shape, args) if time.perf_counter() < deadline else table
    searched = "none" if found is table and len(s.timed) <= 1 else ("partial" if s.cut else "full")
    stages = stage_us(case, found, experts, args.reps) if s.time(found) is not None else dict.fromkeys(STAGES)
    row = result_row(case, shape, table, s.time(table), found, s.time(found), stages, searched, len(s.timed),
                     args, dtype)
    return row, found


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    started = time.perf_counter()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    shape = Shape(args.experts, args.top_k, args.hidden, args.intermediate)
    workers = available_cpus() - 1 if args.build_workers < 0 else args.build_workers
    unbuilt = build_all(sweep_jobs(shape, args), shape, min(workers, 16), args.device, dtype, args.fp8) \
        if device.type == "cuda" else set()
    experts = weights(shape, args, device, dtype)
    rows, trials, best = [], [], {}
    literal = ""
    for i, tokens in enumerate(args.tokens):
        case = make_case(tokens, shape, experts, args, device, dtype)
        share = (args.budget_s - (time.perf_counter() - started)) / (len(args.tokens) - i)
        row, best[tokens] = measure(case, shape, experts, time.perf_counter() + share, trials, unbuilt, args, dtype)
        rows.append(row)
        print(json.dumps(row), flush=True)
        literal = _write(argv, args, shape, rows, trials, best, quiet=i + 1 < len(args.tokens))
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()
    name = "HOPPER_FP8_CONFIGS" if args.fp8 else "HOPPER_CONFIGS"
    print(f"\n# paste into {name} in worker_svc/kernels/moe.py (this shape's entry):\n{literal}")
    print(f"# {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
