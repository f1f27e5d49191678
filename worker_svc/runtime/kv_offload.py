"""The host tier of the KV cache: a pool of whole blocks in (pinned) host memory, and the copies a plan asks
for between it and the GPU's blocks (scheduler_svc/block_manager.py decides them).

A host block holds one GPU block of every layer, K and V, contiguous: one copy per block each way, the
large transfers DMA engines run fastest. The copies run on their own stream. It starts after all work
queued so far (the steps before this plan wrote the blocks that go out) and the step's forward waits for
it (it may write the blocks that went out and reads those that came in); swap-outs go first, since a
plan may fill a block it has just emptied. Since plans run in order on that one pair of streams, a
host block is never overwritten before an earlier plan's copy out of it has run.
"""
from __future__ import annotations

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

    def swap(self, plan: pb.StepPlan) -> None:
        """Makes the plan's copies, swap-outs first (PersistentBatch.apply checked the columns)."""
        if not (len(plan.swap_out_blocks) or len(plan.swap_in_blocks)):
            return
        if self._stream is None:
            self._copy(plan)
            return
        current = torch.cuda.current_stream(self.kv_cache.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            self._copy(plan)
        current.wait_stream(self._stream)

    def _copy(self, plan: pb.StepPlan) -> None:
        cache, host = self.kv_cache, self.blocks
        for g, h in zip(plan.swap_out_blocks, plan.swap_out_host_blocks):
            host[h].copy_(cache[:, :, g], non_blocking=True)
        for h, g in zip(plan.swap_in_host_blocks, plan.swap_in_blocks):
            cache[:, :, g].copy_(host[h], non_blocking=True)
