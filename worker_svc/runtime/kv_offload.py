"""The host tier of the KV cache: a pool of whole blocks in (pinned) host memory, and the copies a plan asks
for between it and the GPU's blocks (scheduler_svc/block_manager.py decides them).

A host block holds one GPU block of every layer, K and V, contiguous: one copy per block each way, the
large transfers DMA engines run fastest. Two kinds of copies, each on its own stream:
- a plan's swaps (swap-outs at reuse, then swap-ins) run before its step's forward, which waits for them (it
  may write the blocks that went out and reads those that came in). They start after all work queued so far:
  the steps before this plan wrote the blocks that go out, and may still read the free blocks that come in.
- a plan's offloads run after its step's forward (which writes none of them) on a second stream, off the
  critical path. Each GPU and host block remembers the last offload that touched it, and a later step or swap
  that fills one waits for that copy only if it is still running.
Swaps run in plan order on one stream and offloads on another, so a host block is never overwritten before an
earlier copy out of it has run: a swap-in reads a host block that an offload fills only after waiting for it,
and an offload starts after the forward, which waited for every swap of its plan and before.
"""
from __future__ import annotations

import time
from collections import deque

import numpy as np
import torch

from protos import worker_pb2 as pb


class HostKVPool:
    def __init__(self, kv_cache: torch.Tensor, num_blocks: int):
        """kv_cache: the GPU's [2, layers, blocks, ...] tensor."""
        self.kv_cache, self.num_blocks = kv_cache, num_blocks
        block = kv_cache[:, :, 0]
        cuda = kv_cache.device.type == "cuda"
        self.blocks = torch.empty((num_blocks, *block.shape), dtype=kv_cache.dtype, pin_memory=cuda)
        self._stream = torch.cuda.Stream(kv_cache.device) if cuda else None
        self._offload_stream = torch.cuda.Stream(kv_cache.device) if cuda else None
        # Offloads by number (1, 2, ...): those not known to be done, with their events; which touched each block.
        self._offloads = 0
        self._done = 0
        self._running: deque[tuple[int, torch.cuda.Event]] = deque()
        self._gpu_offload = np.zeros(kv_cache.shape[2], np.int64)
        self._host_offload = np.zeros(num_blocks, np.int64)

    def swap(self, plan: pb.StepPlan) -> None:
        """Before the step's forward: makes the plan's swaps, swap-outs first (PersistentBatch.apply checked the
        columns), after any offload still copying a block they or the step fill."""
        copies = len(plan.swap_out_blocks) or len(plan.swap_in_blocks)
        if self._stream is None:
            if copies:
                self._copy_swaps(plan)
            return
        wait = self._offload_to_wait_for(plan)
        if not copies and wait is None:
            return
        current = torch.cuda.current_stream(self.kv_cache.device)
        if copies:
            self._stream.wait_stream(current)
            if wait is not None:
                self._stream.wait_event(wait)
            with torch.cuda.stream(self._stream):
                self._copy_swaps(plan)
            current.wait_stream(self._stream)
        if wait is not None:
            current.wait_event(wait)

    def copy_in_seconds(self, blocks: int) -> float:
        """Seconds one block takes to come in from the host, timed over `blocks` copies on the swap stream
        (before serving: it overwrites GPU blocks 0..blocks-1, with zeros)."""
        self.blocks[:blocks].zero_()
        plan = pb.StepPlan(swap_in_host_blocks=range(blocks), swap_in_blocks=range(blocks))
        if self._stream is None:
            self._copy_swaps(plan)
            start = time.perf_counter()
            self._copy_swaps(plan)
            return (time.perf_counter() - start) / blocks
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._stream.wait_stream(torch.cuda.current_stream(self.kv_cache.device))  # after what wrote those blocks
        with torch.cuda.stream(self._stream):
            self._copy_swaps(plan)  # untimed: the first copy maps the pinned pages
            start.record()
            self._copy_swaps(plan)
            end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / blocks

    def offload(self, plan: pb.StepPlan) -> None:
        """After the step's forward has been queued: copies the plan's offloads out, behind it."""
        if not len(plan.offload_blocks):
            return
        cache, host = self.kv_cache, self.blocks
        if self._offload_stream is None:
            for g, h in zip(plan.offload_blocks, plan.offload_host_blocks):
                host[h].copy_(cache[:, :, g])
            return
        self._offload_stream.wait_stream(torch.cuda.current_stream(self.kv_cache.device))
        with torch.cuda.stream(self._offload_stream):
            for g, h in zip(plan.offload_blocks, plan.offload_host_blocks):
                host[h].copy_(cache[:, :, g], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self._offloads += 1
        self._running.append((self._offloads, event))
        self._gpu_offload[np.asarray(plan.offload_blocks)] = self._offloads
        self._host_offload[np.asarray(plan.offload_host_blocks)] = self._offloads

    def _offload_to_wait_for(self, plan: pb.StepPlan) -> torch.cuda.Event | None:
        """The event of the latest offload still running that copies a block this plan fills (GPU blocks it
        writes or swaps into, host blocks it swaps into or out of), if any."""
        while self._running and self._running[0][1].query():
            self._done = self._running.popleft()[0]
        if not self._running:
            return None
        gpu = [*plan.new_block_ids, *(b for ns in plan.new_seqs for b in ns.block_ids), *plan.swap_in_blocks]
        host = [*plan.swap_out_host_blocks, *plan.swap_in_host_blocks]
        latest = max(int(self._gpu_offload[gpu].max()) if gpu else 0,
                     int(self._host_offload[host].max()) if host else 0)
        if latest <= self._done:
            return None
        return next(event for number, event in self._running if number >= latest)

    def _copy_swaps(self, plan: pb.StepPlan) -> None:
        cache, host = self.kv_cache, self.blocks
        for g, h in zip(plan.swap_out_blocks, plan.swap_out_host_blocks):
            host[h].copy_(cache[:, :, g], non_blocking=True)
        for h, g in zip(plan.swap_in_host_blocks, plan.swap_in_blocks):
            cache[:, :, g].copy_(host[h], non_blocking=True)
