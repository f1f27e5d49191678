"""CPU cost of the scheduler per step: schedule() + update() at 512 running decodes and at a mixed
step (pipelined, depth 2), the engine step with detokenization, and the block manager's paths.

    python -m bench.scheduler_cpu [--seqs 512] [--steps 300]

Prints a table and writes bench/results/scheduler_cpu.json (command, commit, machine, date).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

from common.limits import Limits
from protos import WORKER_PROTOCOL_VERSION, worker_pb2
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine import LLMEngine
from scheduler_svc.sampling import SamplingParams
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.sequence import Sequence
from worker_svc.runtime.batch import PersistentBatch

RESULTS = Path(__file__).parent / "results" / "scheduler_cpu.json"
BLOCK_SIZE = 16
NUM_BLOCKS = 65536
MAX_MODEL_LEN = 8192
VOCAB = 10000
EPOCH = 1


class Sampler:
    """Answers plans like a worker: each is applied through the workers' PersistentBatch (with its checks), and
    every sequence that samples gets a token from a fixed random list."""

    def __init__(self, max_num_seqs: int = 1024) -> None:
        self.batch = PersistentBatch(max_num_seqs, NUM_BLOCKS, BLOCK_SIZE, MAX_MODEL_LEN, epoch=EPOCH)
        self.pending: deque[worker_pb2.StepResult] = deque()
        self.rng = random.Random(0)
        self.tokens = [self.rng.randrange(VOCAB) for _ in range(4096)]

    def execute(self, plan: worker_pb2.StepPlan) -> worker_pb2.StepResult:
        step = self.batch.apply(plan)
        ids = step.seq_ids[step.samples].tolist()
        result = worker_pb2.StepResult(step=plan.step)
        result.seq_ids.extend(ids)
        start = self.rng.randrange(len(self.tokens) - len(ids) - 1) if len(ids) < len(self.tokens) else 0
        result.token_ids.extend((self.tokens * (1 + len(ids) // len(self.tokens)))[start : start + len(ids)])
        return result

    # The Executor protocol, for the engine measurement.
    def describe(self, request: worker_pb2.DescribeRequest) -> worker_pb2.DescribeResponse:
        return worker_pb2.DescribeResponse(
            protocol_version=WORKER_PROTOCOL_VERSION, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
            max_model_len=MAX_MODEL_LEN, epoch=EPOCH, vocab_size=151936,
        )  # fmt: skip

    def submit(self, plan: worker_pb2.StepPlan) -> None:
        self.pending.append(self.execute(plan))

    def receive(self) -> worker_pb2.StepResult:
        return self.pending.popleft()

    def close(self) -> None:
        pass


def make_scheduler(num_seqs: int) -> Scheduler:
    cfg = SchedulerConfig(limits=Limits(max_num_seqs=num_seqs, max_num_batched_tokens=8192,
                                        max_model_len=MAX_MODEL_LEN), max_waiting=100_000)
    return Scheduler(cfg, NUM_BLOCKS, BLOCK_SIZE, eos_token_ids=[VOCAB], epoch=EPOCH)


def add_seqs(sched: Scheduler, rng: random.Random, first_id: int, count: int, prompt_len, max_tokens: int) -> None:
    for i in range(count):
        n = prompt_len(rng)
        prompt = [rng.randrange(VOCAB) for _ in range(n)]
        sched.add(Sequence(first_id + i, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i)))


class Pipeline:
    """The engine's loop at depth 2 (schedule N+1, then apply result N), timing only the scheduler."""

    def __init__(self, sched: Scheduler, sampler: Sampler):
        self.sched, self.sampler = sched, sampler
        self.in_flight: deque[worker_pb2.StepResult] = deque()

    def step(self) -> tuple[float, float | None, int, int]:
        """(schedule us, update us or None, sequences in the plan, tokens in the plan)"""
        t0 = time.perf_counter()
        plan = self.sched.schedule()
        t1 = time.perf_counter()
        if plan is not None:
            self.in_flight.append(self.sampler.execute(plan))
        update_us = None
        if self.in_flight and (plan is None or len(self.in_flight) >= 2):
            result = self.in_flight.popleft()
            t2 = time.perf_counter()
            self.sched.update(result)
            update_us = (time.perf_counter() - t2) * 1e6
        if plan is None:
            return (t1 - t0) * 1e6, update_us, 0, 0
        tokens = sum(plan.num_scheduled_tokens) + sum(ns.num_scheduled_tokens for ns in plan.new_seqs)
        return (t1 - t0) * 1e6, update_us, len(plan.seq_ids) + len(plan.new_seqs), tokens

    def prefill_all(self) -> None:
        sched = self.sched
        while sched.waiting or any(s.num_computed_tokens < s.num_sent_tokens for s in sched.running):
            self.step()

    def measure(self, steps: int, before_step=None) -> dict:
        sched_us, update_us, seqs, tokens = [], [], [], []
        for _ in range(steps):
            if before_step:
                before_step()
            s, u, n, t = self.step()
            sched_us.append(s)
            seqs.append(n)
            tokens.append(t)
            if u is not None:
                update_us.append(u)
        n = statistics.median(seqs)
        s, u = statistics.median(sched_us), statistics.median(update_us)
        return {
            "seqs_per_step": n,
            "tokens_per_step": statistics.median(tokens),
            "schedule_us": round(s, 1),
            "update_us": round(u, 1),
            "total_us": round(s + u, 1),
            "per_seq_us": round((s + u) / n, 3),
        }


def bench_decode(num_seqs: int, steps: int) -> dict:
    rng = random.Random(0)
    sched = make_scheduler(num_seqs)
    add_seqs(sched, rng, 1, num_seqs, lambda r: r.randint(100, 1024), max_tokens=4096)
    pipe = Pipeline(sched, Sampler(num_seqs))
    pipe.prefill_all()
    pipe.measure(5)
    return pipe.measure(steps)


def bench_mixed(num_seqs: int, steps: int) -> dict:
    """7/8 of max_num_seqs decoding; prompts of 512 tokens arrive and finish after one token."""
    rng = random.Random(1)
    sched = make_scheduler(num_seqs)
    add_seqs(sched, rng, 1, num_seqs * 7 // 8, lambda r: r.randint(100, 1024), max_tokens=4096)
    pipe = Pipeline(sched, Sampler(num_seqs))
    pipe.prefill_all()
    next_id = [1_000_000]

    def arrivals() -> None:
        while sched.num_waiting < 32:
            add_seqs(sched, rng, next_id[0], 1, lambda r: 512, max_tokens=1)
            next_id[0] += 1

    pipe.measure(5, arrivals)
    return pipe.measure(steps, arrivals)


def bench_engine(num_seqs: int, steps: int) -> dict | None:
    """LLMEngine.step at num_seqs decodes: schedule + update + detokenize + outputs (executor excluded)."""
    try:
        from worker_svc.checkpoints.tokenizer_files import write_qwen_tokenizer
    except ImportError:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        write_qwen_tokenizer(Path(tmp))
        sampler = Sampler()
        sampler.tokens = [279, 3974, 13876, 38835, 34208, 916, 264, 15678, 5562, 13] * 400  # English words
        engine = LLMEngine(tmp, sampler, SchedulerConfig(limits=Limits(max_num_seqs=num_seqs,
                                                                       max_num_batched_tokens=8192)))
    rng = random.Random(2)
    for i in range(num_seqs):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(100, 1024))]
        engine.add_request(prompt, SamplingParams(max_tokens=4096, ignore_eos=True, stop=["\n\n"]))
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_sent_tokens for s in engine.scheduler.running):
        engine.step()
    submit, receive = sampler.submit, sampler.receive
    worker_us = []

    def timed_submit(plan):
        t = time.perf_counter()
        submit(plan)
        worker_us.append((time.perf_counter() - t) * 1e6)

    sampler.submit = timed_submit
    step_us = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        step_us.append((time.perf_counter() - t) * 1e6)
    sampler.submit, sampler.receive = submit, receive
    s = statistics.median(step_us) - statistics.median(worker_us)
    return {"seqs_per_step": num_seqs, "step_us": round(s, 1), "per_seq_us": round(s / num_seqs, 3)}


def per_op_us(fn, repeat: int) -> float:
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    return round((time.perf_counter() - t) / repeat * 1e6, 3)


def bench_block_manager() -> dict:
    bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    rng = random.Random(3)
    out = {}

    def alloc_free_1():
        bm.free(bm.allocate(1))

    def alloc_free_64():
        bm.free(bm.allocate(64))

    out["allocate+free 1 block"] = per_op_us(alloc_free_1, 20000)
    out["allocate+free 64 blocks"] = per_op_us(alloc_free_64, 2000)

    prompts = [[rng.randrange(VOCAB) for _ in range(1025)] for _ in range(301)]
    owners = iter(prompts[1:])

    def commit_64():
        seq = Sequence(1, next(owners), SamplingParams(seed=0))
        seq.block_table = bm.allocate(65)
        seq.num_computed_tokens = 1025
        bm.commit(seq)
        bm.free(seq.block_table)

    out["allocate 65 + hash+register 64 full blocks + free"] = per_op_us(commit_64, 300)

    prompt = prompts[0]
    owner = Sequence(1, list(prompt), SamplingParams(seed=0))
    owner.block_table = bm.allocate(65)
    owner.num_computed_tokens = 1025
    bm.commit(owner)

    def hit_64():
        seq = Sequence(2, prompt, SamplingParams(seed=0))
        hits = bm.match_prefix(seq)
        assert len(hits) == 64
        bm.acquire(hits)
        bm.free(hits)

    out["prefix hit 64 blocks: hash+match+acquire+free"] = per_op_us(hit_64, 300)
    return out


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cpus, Python {platform.python_version()}, {platform.system()} {platform.release()}"


def commit() -> str:
    """HEAD, with "+dirty" when the working tree differs from it."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()

    try:
        return git("rev-parse", "HEAD") + ("+dirty" if git("status", "--porcelain") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=512)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    decode = bench_decode(args.seqs, args.steps)
    mixed = bench_mixed(args.seqs, args.steps)
    engine = bench_engine(args.seqs, args.steps)
    blocks = bench_block_manager()

    print(f"scheduler CPU per step, {args.seqs} max seqs, block size {BLOCK_SIZE}, pipelined (median of {args.steps})")
    print(f"{'step':<34}{'seqs':>6}{'tokens':>8}{'schedule us':>13}{'update us':>11}{'total us':>10}{'us/seq':>8}")
    for name, r in (("decode", decode), ("mixed (prefill chunks + decodes)", mixed)):
        print(
            f"{name:<34}{r['seqs_per_step']:>6.0f}{r['tokens_per_step']:>8.0f}{r['schedule_us']:>13.1f}"
            f"{r['update_us']:>11.1f}{r['total_us']:>10.1f}{r['per_seq_us']:>8.3f}"
        )
    if engine:
        print(
            f"{'engine step (+ detok, outputs)':<34}{engine['seqs_per_step']:>6}{engine['seqs_per_step']:>8}"
            f"{'':>24}{engine['step_us']:>10.1f}{engine['per_seq_us']:>8.3f}"
        )
    print("\nblock manager, us per operation")
    for name, us in blocks.items():
        print(f"  {name:<48}{us:>8.3f}")

    record = {
        "command": " ".join(["python -m bench.scheduler_cpu", *sys.argv[1:]]),
        "commit": commit(),
        "machine": machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": {"seqs": args.seqs, "steps": args.steps, "block_size": BLOCK_SIZE, "pipeline_depth": 2},
        "decode": decode,
        "mixed": mixed,
        "engine_decode": engine,
        "block_manager_us": blocks,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
