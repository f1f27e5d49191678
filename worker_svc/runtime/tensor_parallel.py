"""Tensor parallelism inside one worker pod: one process per rank, one KV cache sharded by heads.

The serve process is rank 0, the leader: it holds the gRPC stream and is the only rank that answers.
It spawns ranks 1..N-1 (multiprocessing, spawn context) and all of them join one torch.distributed
group (NCCL on GPUs, gloo on CPUs) through a TCP store on 127.0.0.1 whose port the OS picks, plus a
gloo group for control messages. Each rank builds its own ModelRunner: the layers in
`worker_svc/model/parallel.py` cut this rank's shard out of each checkpoint tensor as it is loaded, and the
KV block count is the minimum over ranks.

For every plan the leader serializes it once and broadcasts the bytes over the control group, then
executes it itself; the other ranks execute every plan in lockstep (same delta, same collectives)
and drop their results. Sampling needs no broadcast: the logits are gathered on every rank and the
sampler is deterministic given (seed, position), so every rank keeps the same last token of each
sequence on its own device. reset() and the epoch go through the control group too.

Failure: a rank that dies takes the group down. The leader watches its children and exits (code 1)
if one ends, so the scheduler sees the worker's stream break; each child watches a pipe from the
leader and exits when it breaks (the leader died). A step that fails on the leader with anything but
a PlanError leaves the ranks out of step, so the leader exits then too. `close()` (SIGTERM in
`splitserve-worker serve`) stops every rank.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from common.util import freeze_heap
from protos import worker_pb2 as pb
from worker_svc.runtime.batch import PlanError

log = logging.getLogger("splitserve.worker.tp")

_EXECUTE, _RESET, _STOP, _NOOP = 1, 2, 3, 4
# Followers wait on the control group between plans; the leader sends a no-op when idle this long,
# so the wait never reaches the group's timeout however long the worker sits without work.
KEEPALIVE_S = 60.0
CONTROL_TIMEOUT = datetime.timedelta(hours=1)
STARTUP_TIMEOUT = datetime.timedelta(minutes=30)


def rank_device(device: str, rank: int) -> str:
    """cuda or cuda:K -> cuda:(K + rank); a CPU stays a CPU."""
    d = torch.device(device)
    if d.type == "cuda":
        return f"cuda:{(d.index or 0) + rank}"
    return str(d)


def check_shapes(mc, size: int) -> None:
    """Raises ValueError unless the model splits over `size` ranks (before any process starts)."""
    kv = mc.num_key_value_heads
    problems = [f"{name} {n}" for name, n in (("attention heads", mc.num_attention_heads),
                                              ("intermediate size", mc.intermediate_size)) if n % size]
    if kv % size and size % kv:
        problems.append(f"KV heads {kv} (neither divisible by it nor dividing it)")
    if mc.moe is not None and mc.moe.num_experts % size:
        problems.append(f"experts {mc.moe.num_experts} (each rank holds whole experts)")
    if problems:
        raise ValueError(f"the model does not split over tensor-parallel size {size}: {', '.join(problems)}")


def _init_process_group(rank: int, size: int, store: dist.Store, device: str) -> dist.ProcessGroup:
    """Joins the model group (default group) and returns the gloo control group."""
    # All ranks of a pod share one host: gloo's sockets stay on loopback unless told otherwise.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=size, timeout=STARTUP_TIMEOUT,
                                device_id=dev)
    else:
        # On a CPU the ranks share the cores: split them instead of oversubscribing.
        torch.set_num_threads(max(1, torch.get_num_threads() // size))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=STARTUP_TIMEOUT)
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


class TensorParallelRunner:
    """The leader (rank 0) of a tensor-parallel group, behind the same interface as ModelRunner
    (describe / execute / reset / epoch), so WorkerService serves it unchanged."""

    def __init__(self, model_dir: str | Path, config, tensor_parallel_size: int):
        from worker_svc.model.config import ModelConfig
        from worker_svc.runtime.model_runner import ModelRunner, RunnerConfig

        if tensor_parallel_size < 2:
            raise ValueError("TensorParallelRunner needs tensor_parallel_size >= 2; use ModelRunner")
        config = config or RunnerConfig()
        self.size = size = tensor_parallel_size
        self.model_dir = Path(model_dir)
        check_shapes(ModelConfig.from_dir(model_dir, config.hf_overrides), size)
        device = torch.device(config.device)
        if device.type == "cuda" and (device.index or 0) + size > torch.cuda.device_count():
            raise ValueError(f"tensor parallel size {size} from {device} needs more than the "
                             f"{torch.cuda.device_count()} visible GPUs")
        self._lock = threading.Lock()
        self._closing = False
        self._last_sent = time.monotonic()
        # Port 0: the OS picks a free port for the store, so TP workers can share a host.
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                              timeout=STARTUP_TIMEOUT)
        ctx = mp.get_context("spawn")
        self.procs: list[mp.process.BaseProcess] = []
        self._pipes = []
        for rank in range(1, size):
            reader, writer = ctx.Pipe(duplex=False)  # the child reads: EOF means the leader is gone
            proc = ctx.Process(target=_rank_main, name=f"tp-rank-{rank}",
                               args=(rank, size, store.port, str(self.model_dir), config, reader))
            proc.start()
            reader.close()
            self.procs.append(proc)
            self._pipes.append(writer)
        log.info("tensor parallel size %d: ranks 1..%d are pids %s, store on 127.0.0.1:%d", size, size - 1,
                 [p.pid for p in self.procs], store.port)
        threading.Thread(target=self._watch_ranks, daemon=True, name="tp-watch").start()
        self._store = store
        try:
            self._ctrl = _init_process_group(0, size, store, rank_device(config.device, 0))
            self.runner = ModelRunner(model_dir, dataclasses.replace(config, device=rank_device(config.device, 0)))
            self._send(_RESET, epoch=self.runner.epoch)  # every rank checks plans against the leader's epoch
        except BaseException:
            self._abandon()
            raise
        threading.Thread(target=self._keepalive, daemon=True, name="tp-keepalive").start()

    # ---- the runner interface -----------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self.runner.epoch

    @property
    def kernels(self):
        return self.runner.kernels

    @property
    def batch(self):
        return self.runner.batch

    @property
    def worker_id(self) -> str:
        return self.runner.worker_id

    @property
    def pids(self) -> list[int]:
        """Process ids of ranks 1..N-1."""
        return [p.pid for p in self.procs]

    def describe(self, request: pb.DescribeRequest | None = None) -> pb.DescribeResponse:
        return self.runner.describe(request)

    def execute(self, plan: pb.StepPlan):
        data = plan.SerializeToString()  # once, whatever the number of ranks
        with self._lock:
            if self._closing:
                raise RuntimeError("the tensor-parallel group is shutting down")
            self._send(_EXECUTE, data)
            try:
                return self.runner.execute(plan)
            except PlanError:
                raise  # every rank rejects the same plan at the same point, before any collective
            except BaseException:
                log.exception("step %d failed on the leader: the ranks are out of step; exiting", plan.step)
                _exit(1)

    def reset(self) -> None:
        with self._lock:
            if self._closing:
                return
            self.runner.reset()
            self._send(_RESET, epoch=self.runner.epoch)

    def close(self, timeout: float = 10.0) -> None:
        """Stops every rank (clean shutdown)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            try:
                self._send(_STOP)
            except Exception:  # a rank already gone: the others leave when our pipes close
                log.warning("could not send stop to the ranks", exc_info=True)
                for pipe in self._pipes:
                    pipe.close()
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                log.warning("rank %s did not stop; killing it", proc.name)
                proc.kill()
                proc.join()
        for pipe in self._pipes:
            pipe.close()
        try:
            dist.destroy_process_group()
        except Exception:
            pass

    def _abandon(self) -> None:
        """Start-up failed: the other ranks go (they may be waiting in a collective)."""
        self._closing = True
        for pipe in self._pipes:
            pipe.close()
        for proc in self.procs:
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join()

    # ---- control channel ----------------------------------------------------------------------
    def _send(self, op: int, data: bytes = b"", epoch: int = 0) -> None:
        """One broadcast of (op, length, epoch), then one of the payload bytes if any."""
        dist.broadcast(torch.tensor([op, len(data), epoch], dtype=torch.int64), 0, group=self._ctrl)
        if data:
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group=self._ctrl)
        self._last_sent = time.monotonic()

    def _keepalive(self) -> None:
        while True:
            time.sleep(KEEPALIVE_S / 4)
            if time.monotonic() - self._last_sent < KEEPALIVE_S:
                continue
            with self._lock:
                if self._closing:
                    return
                if time.monotonic() - self._last_sent >= KEEPALIVE_S:
                    self._send(_NOOP)

    def _watch_ranks(self) -> None:
        """Exits the leader when any other rank ends, unless we are shutting down."""
        sentinels = {p.sentinel: p for p in self.procs}
        ended = mp.connection.wait(list(sentinels))
        if self._closing:
            return
        proc = sentinels[ended[0]]
        proc.join(1.0)
        log.error("rank %s (pid %s) exited with code %s: taking the worker down", proc.name, proc.pid,
                  proc.exitcode)
        _exit(1)


def _exit(code: int) -> None:
    logging.shutdown()
    os._exit(code)


def _rank_main(rank: int, size: int, port: int, model_dir: str, config, leader) -> None:
    """Entry point of ranks 1..N-1: load this rank's shard, then run every plan the leader sends."""
    from worker_svc.runtime.model_runner import ModelRunner

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the leader decides
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(name)s[rank {rank}] %(levelname)s %(message)s")
    stopping = threading.Event()

    def exit_with_leader() -> None:
        try:
            leader.recv()  # the leader never writes: this returns (EOFError) when it is gone
        except (EOFError, OSError):
            pass
        if not stopping.is_set():
            log.error("the leader is gone: exiting")
        _exit(0 if stopping.is_set() else 1)

    threading.Thread(target=exit_with_leader, daemon=True, name="tp-leader-watch").start()
    try:
        device = rank_device(config.device, rank)
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=STARTUP_TIMEOUT)
        ctrl = _init_process_group(rank, size, store, device)
        runner = ModelRunner(model_dir, dataclasses.replace(config, device=device))
        freeze_heap()
        _follow(runner, ctrl)
        stopping.set()
    except BaseException:
        log.exception("rank %d failed", rank)
        _exit(1)
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    _exit(0)


def _follow(runner, ctrl: dist.ProcessGroup) -> None:
    """Executes every plan the leader broadcasts, in order, until told to stop."""
    header = torch.zeros(3, dtype=torch.int64)
    while True:
        dist.broadcast(header, 0, group=ctrl)
        op, length, epoch = header.tolist()
        if op == _EXECUTE:
            payload = torch.empty(length, dtype=torch.uint8)
            dist.broadcast(payload, 0, group=ctrl)
            plan = pb.StepPlan.FromString(payload.numpy().tobytes())
            try:
                runner.execute(plan)  # launched in lockstep; only the leader answers
            except PlanError:
                pass  # the leader rejects the same plan and ends the stream; a reset follows
        elif op == _RESET:
            runner.reset(epoch)
        elif op == _STOP:
            return
        elif op != _NOOP:
            raise RuntimeError(f"unknown control op {op}")
