"""Decode steps (one token per sequence, every sequence samples) from static inputs, whole: the token
to run is gathered on the device from each row's last sampled one, and the LM head and the common
sampler (temperature or greedy: the Gumbel kernel) run inside the step, which writes its tokens back
to the rows. On a GPU each padded batch size is captured as a CUDA graph, so a step costs the host one
packed upload, one graph launch and the copy of its tokens; on a CPU the same body runs uncaptured,
so that CPU tests cover it.

The static inputs are views into one device byte buffer, laid out per batch size exactly as
uploads.pack_aligned packs the step's host arrays: the upload is the only copy. Padding rows run the
scratch row of the runner's last_token and attend to one token of a scratch block that the scheduler
never owns, where they also write their K/V. Page tables cover max_model_len (nano-vLLM's truncated
block table cannot happen here). A worker that serves LoRA adapters captures each size twice: without the
adapters' kernels, for steps where no row has one, and with them (model/lora.py), the rows' adapters an input.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import torch

from worker_svc.kernels import Kernels
from worker_svc.kernels.attention import AttentionMetadata
from worker_svc.kernels.uploads import TORCH_DTYPES, pack_aligned, pack_into, staging
from worker_svc.model.layers import CausalLM
from worker_svc.model.lora import step_adapters
from worker_svc.runtime.sampler import SamplingBatch, sample


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16))
    return sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs})


A = TypeVar("A", np.ndarray, torch.Tensor)


@dataclass(slots=True)
class DecodeInputs(Generic[A]):
    """A decode step's arrays, one entry per row (the page table: one row per row): numpy on the host,
    views into the static buffer on the device."""
    rows: A          # int64: persistent-batch rows
    input_ids: A     # int64: the token to run, or -1 for the row's last sampled token
    positions: A     # int64
    slot_mapping: A  # int64: where the token's K/V go
    seqused_k: A     # int32: context length after the step
    temperature: A   # float32
    seeds: A         # int64
    lora: A          # int64: the row's LoRA adapter, or -1
    page_table: A    # int32 [rows, max_blocks_per_seq]

    def arrays(self) -> list[A]:
        return [self.rows, self.input_ids, self.positions, self.slot_mapping, self.seqused_k, self.temperature,
                self.seeds, self.lora, self.page_table]

    def head(self, n: int) -> DecodeInputs[A]:
        return DecodeInputs(*(a[:n] for a in self.arrays()))


@dataclass(slots=True)
class DecodeBuffers:
    """A batch size's static inputs and outputs on the device."""
    inputs: DecodeInputs[torch.Tensor]
    logits: torch.Tensor
    tokens: torch.Tensor

    def head(self, n: int) -> DecodeBuffers:
        """The first n rows (the step's real ones)."""
        return DecodeBuffers(self.inputs.head(n), self.logits[:n], self.tokens[:n])


class DecodeStep:
    def __init__(self, model: CausalLM, kernels: Kernels, last_token: torch.Tensor,
                 max_num_seqs: int, max_blocks_per_seq: int, scratch_block: int, block_size: int):
        self.model, self.kernels, self.last_token = model, kernels, last_token
        self.device = last_token.device
        self.width = max_blocks_per_seq
        # what padding rows run: last_token's extra row, one token in the scratch block
        self._padding = DecodeInputs(
            rows=np.array([last_token.shape[0] - 1]), input_ids=np.zeros(1, np.int64),
            positions=np.zeros(1, np.int64), slot_mapping=np.array([scratch_block * block_size]),
            seqused_k=np.ones(1, np.int32), temperature=np.zeros(1, np.float32), seeds=np.zeros(1, np.int64),
            lora=np.full(1, -1, np.int64), page_table=np.full((1, max_blocks_per_seq), scratch_block, np.int32))
        self._templates: dict[int, tuple[np.ndarray, list[int]]] = {}
        self.buffer = torch.zeros(self._template(max_num_seqs)[0].nbytes, dtype=torch.uint8, device=self.device)
        vocab = model.config.vocab_size
        self.logits = torch.empty(max_num_seqs, vocab, dtype=next(model.parameters()).dtype, device=self.device)
        self.tokens = torch.zeros(max_num_seqs, dtype=torch.int64, device=self.device)
        self.cu_seqlens_q = torch.arange(max_num_seqs + 1, dtype=torch.int32, device=self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.adapted_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # the same sizes, with LoRA adapters' kernels
        # built once (a view costs host time every step): per size the static buffer's views, per batch its rows'
        self._buffers: dict[int, DecodeBuffers] = {}
        self._heads: dict[int, DecodeBuffers] = {}

    def _pad(self, size: int) -> DecodeInputs[np.ndarray]:
        return DecodeInputs(*(np.repeat(a, size, axis=0) for a in self._padding.arrays()))

    def _template(self, size: int) -> tuple[np.ndarray, list[int]]:
        """The inputs of `size` padding rows packed, and where each array starts: the static buffer's
        layout for that size. Built once per size."""
        if size not in self._templates:
            self._templates[size] = pack_aligned(self._pad(size).arrays())
        return self._templates[size]

    def _buffers_of(self, size: int) -> DecodeBuffers:
        if size not in self._buffers:
            starts = self._template(size)[1]
            views = [self.buffer[start:start + a.nbytes // a.shape[0] * size].view(TORCH_DTYPES[a.dtype])
                     for a, start in zip(self._padding.arrays(), starts)]
            views[-1] = views[-1].view(size, self.width)
            self._buffers[size] = DecodeBuffers(DecodeInputs(*views), self.logits[:size], self.tokens[:size])
        return self._buffers[size]

    def _size(self, n: int) -> int:
        return min(s for s in self.graphs if s >= n) if self.graphs else n

    # ---- the step -----------------------------------------------------------------------------
    def _forward(self, b: DecodeBuffers, context_lens: list[int], all_greedy: bool, adapted: bool) -> None:
        v, size = b.inputs, b.tokens.shape[0]
        ids = torch.where(v.input_ids >= 0, v.input_ids, self.last_token[v.rows])
        meta = AttentionMetadata(cu_seqlens_q=self.cu_seqlens_q[:size + 1], seqused_k=v.seqused_k,
                                 page_table=v.page_table, slot_mapping=v.slot_mapping, max_seqlen_q=1,
                                 query_lens=[1] * size, context_lens=context_lens)
        with step_adapters(v.lora if adapted else None):
            hidden = self.model(ids, v.positions, meta)
        logits = self.model.compute_logits(hidden, out=b.logits)
        batch = SamplingBatch(temperature=v.temperature, seeds=v.seeds, positions=v.positions + 1, top_k=None,
                              top_p=None, min_p=None, all_greedy=all_greedy, max_logprobs=-1)
        b.tokens.copy_(sample(logits, batch, self.kernels).token_ids)
        self.last_token[v.rows] = b.tokens

    @torch.inference_mode()
    def capture(self, sizes: list[int], adapters: bool) -> None:
        """adapters: whether the model serves LoRA adapters (each size is then captured with them too)."""
        pool = None
        for adapted, graphs in ((False, self.graphs), (True, self.adapted_graphs))[:1 + adapters]:
            for size in sorted(sizes, reverse=True):  # largest first, so smaller graphs reuse its pool
                buffers = self._buffers_of(size)
                self._upload(self._pad(size), size)
                # warm-up: JIT-compiled kernels are built outside the capture
                self._forward(buffers, [1] * size, False, adapted)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._forward(buffers, [1] * size, False, adapted)
                pool = graph.pool()
                graphs[size] = graph
        torch.cuda.synchronize()

    def _upload(self, inputs: DecodeInputs[np.ndarray], size: int) -> None:
        """Packs the step's rows over the padding of its size and copies them into the static buffer."""
        template, starts = self._template(size)
        host = staging(template.nbytes, self.device)
        flat = host.numpy()
        flat[:] = template
        pack_into(flat, inputs.arrays(), starts)
        self.buffer[:template.nbytes].copy_(host, non_blocking=True)

    def run(self, inputs: DecodeInputs[np.ndarray], all_greedy: bool) -> DecodeBuffers:
        """Runs the step (on a GPU: launches it) and returns its rows' buffers; tokens are also in last_token.
        They hold until the next step's upload, which the device runs after everything launched before."""
        n = inputs.rows.shape[0]
        size = self._size(n)
        self._upload(inputs, size)
        adapted = bool((inputs.lora >= 0).any())
        graphs = self.adapted_graphs if adapted else self.graphs
        if size in graphs:
            graphs[size].replay()
        else:
            self._forward(self._buffers_of(size), inputs.seqused_k.tolist(), all_greedy, adapted)
        if n not in self._heads:
            self._heads[n] = self._buffers_of(size).head(n)
        return self._heads[n]
