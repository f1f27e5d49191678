"""CUDA graphs for decode-only steps (one query token per sequence) at padded batch sizes.

Static input buffers cover max_num_seqs rows and a page table as wide as max_model_len needs, so a
graph never sees a truncated block table. Padding rows attend to one token in a scratch block that
the scheduler never owns, and write their K/V there.
"""
from __future__ import annotations

import torch

from worker_svc.attention import AttentionBackend, AttentionMetadata
from worker_svc.qwen3 import Qwen3ForCausalLM


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16))
    return sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs})


class DecodeGraphs:
    def __init__(self, model: Qwen3ForCausalLM, backend: AttentionBackend, max_num_seqs: int,
                 max_blocks_per_seq: int, scratch_block: int, block_size: int, device: torch.device):
        self.model, self.backend = model, backend
        self.scratch_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        n = max_num_seqs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), self.scratch_slot, dtype=torch.int64, device=device)
        self.seqused_k = torch.ones(n, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.page_table = torch.full((n, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(n, model.config.hidden_size, dtype=next(model.parameters()).dtype,
                                  device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            cu_seqlens_q=self.cu_seqlens_q[:size + 1], seqused_k=self.seqused_k[:size],
            page_table=self.page_table[:size], slot_mapping=self.slot_mapping[:size], max_seqlen_q=1,
            query_lens=[1] * size, context_lens=[1] * size)

    def _forward(self, size: int) -> None:
        self.hidden[:size] = self.model(self.input_ids[:size], self.positions[:size], self._meta(size),
                                        self.backend)

    @torch.inference_mode()
    def capture(self, sizes: list[int]) -> None:
        for size in sorted(sizes, reverse=True):  # largest first, so smaller graphs reuse its pool
            self._forward(size)  # warm-up: JIT-compiled kernels are built outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._forward(size)
            self.pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def can_run(self, size: int) -> bool:
        return bool(self.graphs) and size <= max(self.graphs)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = input_ids.shape[0]
        size = min(s for s in self.graphs if s >= n)
        width = meta.page_table.shape[1]
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = meta.slot_mapping
        self.seqused_k[:n] = meta.seqused_k
        self.page_table[:n, :width] = meta.page_table
        if size > n:  # rows a larger batch left behind become padding again
            self.slot_mapping[n:size] = self.scratch_slot
            self.seqused_k[n:size] = 1
            self.page_table[n:size, 0] = self.scratch_block
        self.graphs[size].replay()
        return self.hidden[:n]
