"""Tensor-parallel building blocks (Megatron style). With no process group they run at world size 1.

Each layer holds only its rank's shard and knows how to cut that shard out of a full checkpoint
tensor (`weight_loader`), so no rank ever needs the whole model.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from common.util import cdiv
from worker_svc.kernels import Kernels


_deferred = False  # inside deferred_projections


@contextlib.contextmanager
def deferred_projections() -> Iterator[None]:
    """The linears and experts built inside leave their weights unallocated (on the meta device), for
    model/quantized.py's allocate_projections to give each the storage it is served in."""
    global _deferred
    _deferred = True
    try:
        yield
    finally:
        _deferred = False


def projection_weight(*shape: int) -> nn.Parameter:
    """A linear's (or experts') weight: unallocated inside deferred_projections."""
    return nn.Parameter(torch.empty(*shape, device="meta" if _deferred else None), requires_grad=False)


def tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def min_over_ranks(value: int, device: torch.device | str) -> int:
    """The smallest `value` over the tensor-parallel ranks (itself at world size 1)."""
    if tp_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def all_over_ranks(flags: list[bool], device: torch.device | str) -> list[bool]:
    """Each flag true on every tensor-parallel rank (the flags themselves at world size 1)."""
    if tp_size() == 1 or not flags:
        return flags
    t = torch.tensor(flags, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return [bool(x) for x in t.tolist()]


def _shard(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    return t.narrow(dim, rank * (t.shape[dim] // size), t.shape[dim] // size)


def _divide(n: int, d: int) -> int:
    if n % d:
        raise ValueError(f"{n} is not divisible by the tensor-parallel size {d}")
    return n // d


def _quantized_parts(linear: nn.Module) -> None:
    """A projection's weight_scale (its FP8 weight's block scales, model/quantized.py, or its integer groups' scales,
    model/packed_ints.py) and weight_zero (those groups' zero points): none until its weight is allocated so."""
    linear.weight_scale = linear.weight_zero = None


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W split by output rows; each rank produces a slice of y."""
    lora = None  # its LoRA adapters (model/lora.py), where some adapt it

    def __init__(self, in_features: int, out_features: int, kernels: Kernels, bias: bool = False):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.kernels = kernels
        self.input_size = in_features  # its shard's input width (its weight's, unless packed_ints.py packed it)
        _quantized_parts(self)
        self.weight = projection_weight(_divide(out_features, self.tp_size), in_features)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.weight.shape[0]), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(_shard(loaded, 0, self.tp_rank, self.tp_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernels.linear(x, self.weight, self.bias, self.weight_scale, self.weight_zero)
        return y if self.lora is None else self.lora.apply(x, y)


class HeadParallelLinear(ColumnParallelLinear):
    """A column-parallel projection onto `heads` heads of head_dim rows each, split by heads; `head_order`: each head's
    rows as stored here (MLA's q, its rope dims where the rope kernels pair them)."""

    def __init__(self, in_features: int, heads: int, head_dim: int, kernels: Kernels, head_order: list[int]):
        self.head_dim, self.head_order = head_dim, head_order
        super().__init__(in_features, heads * head_dim, kernels)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        ordered = loaded.unflatten(0, (-1, self.head_dim))[:, self.head_order].flatten(0, 1)
        param.data.copy_(_shard(ordered, 0, self.tp_rank, self.tp_size))


def _split_on_load(layer: ColumnParallelLinear) -> None:
    """The packed layer's parameters take a fused checkpoint tensor too (load_weights splits it by shard)."""
    for param in (layer.weight, layer.bias):
        if param is not None:
            param.split_fused = layer.split_fused


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate and up)."""

    def __init__(self, in_features: int, out_sizes: list[int], kernels: Kernels, bias: bool = False):
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), kernels, bias)
        _split_on_load(self)

    def split_fused(self, loaded: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """A checkpoint tensor of every projection at once (Phi-3's gate_up_proj), as (shard id, part)."""
        return list(enumerate(torch.split(loaded, self.out_sizes)))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        offset = sum(self.out_sizes[:shard_id]) // self.tp_size
        size = self.out_sizes[shard_id] // self.tp_size
        param.data.narrow(0, offset, size).copy_(_shard(loaded, 0, self.tp_rank, self.tp_size))


class QKVParallelLinear(ColumnParallelLinear):
    """Packed q, k and v projections. Query heads are split across ranks; KV heads too, or
    replicated when there are more ranks than KV heads (each rank keeps the head its queries use)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, kernels: Kernels,
                 bias: bool = False, head_order: list[int] | None = None):
        size = tp_size()
        self.head_dim, self.head_order = head_dim, head_order  # head_order: q's and k's dims within each head
        self.num_heads = _divide(num_heads, size)
        self.num_kv_heads = max(1, num_kv_heads // size)
        if num_kv_heads >= size:
            _divide(num_kv_heads, size)
        else:
            _divide(size, num_kv_heads)
        self.total_kv_heads = num_kv_heads
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * size
        super().__init__(hidden_size, out, kernels, bias)
        _split_on_load(self)

    @property
    def first_kv_head(self) -> int:
        """The first of the checkpoint's KV heads this rank keeps: rank r serves query heads [r*h, (r+1)*h), which use
        KV head r * kv_total // tp_size."""
        kv_index = self.tp_rank * self.total_kv_heads // self.tp_size
        return kv_index // self.num_kv_heads * self.num_kv_heads

    def split_fused(self, loaded: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """A checkpoint tensor of q, k and v at once (Phi-3's qkv_proj), as (shard id, part)."""
        q, kv = self.num_heads * self.tp_size * self.head_dim, self.total_kv_heads * self.head_dim
        return list(zip("qkv", torch.split(loaded, [q, kv, kv])))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, shard = 0, q_size, _shard(loaded, 0, self.tp_rank, self.tp_size)
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, shard = kv_size, loaded.narrow(0, self.first_kv_head * self.head_dim, kv_size)
        if self.head_order is not None and shard_id != "v":
            shard = shard.unflatten(0, (-1, self.head_dim))[:, self.head_order].flatten(0, 1)
        param.data.narrow(0, offset, size).copy_(shard)


class RowParallelLinear(nn.Module):
    """y = x W^T with W split by input columns; partial sums are all-reduced across ranks, or left to the caller
    (`reduce=False`: a sum of several such outputs takes one all-reduce)."""
    lora = None

    def __init__(self, in_features: int, out_features: int, kernels: Kernels, bias: bool = False,
                 reduce: bool = True):
        super().__init__()
        self.tp_rank, self.tp_size, self.reduce = tp_rank(), tp_size(), reduce
        self.kernels = kernels
        self.input_size = _divide(in_features, self.tp_size)
        _quantized_parts(self)
        self.weight = projection_weight(out_features, self.input_size)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = lambda p, w: p.data.copy_(w)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(_shard(loaded, 1, self.tp_rank, self.tp_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernels.linear(x, self.weight, None, self.weight_scale, self.weight_zero)
        if self.lora is not None:  # before the all-reduce: each rank's delta is a partial sum too
            y = self.lora.apply(x, y)
        if self.tp_size > 1 and self.reduce:
            dist.all_reduce(y)
        if self.bias is not None and (self.reduce or self.tp_rank == 0):  # once in the sum, however reduced
            y = y + self.bias
        return y


class ReplicatedLinear(nn.Module):
    """y = x W^T with the whole W on every rank (a projection too small to shard: MLA's latent ones). `row_order`:
    the checkpoint's rows as stored here."""
    lora = None

    def __init__(self, in_features: int, out_features: int, kernels: Kernels, row_order: list[int] | None = None):
        super().__init__()
        self.kernels = kernels
        self.input_size = in_features
        _quantized_parts(self)
        self.weight = projection_weight(out_features, in_features)
        if row_order is not None:
            self.weight.weight_loader = lambda param, w: param.data.copy_(w[row_order])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernels.linear(x, self.weight, None, self.weight_scale, self.weight_zero)
        return y if self.lora is None else self.lora.apply(x, y)


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; each rank looks up its own rows, others give 0."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.shard_size = cdiv(vocab_size, self.tp_size)
        self.start = self.tp_rank * self.shard_size
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        rows = loaded[self.start:self.start + self.shard_size]
        param.data[: rows.shape[0]].copy_(rows)
        param.data[rows.shape[0]:].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mask = (local >= 0) & (local < self.shard_size)
        y = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * mask.unsqueeze(-1)
        dist.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the vocabulary; each rank computes its rows and the full logits are gathered."""

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        """out: where to write the logits (decode steps' static buffer), else a new tensor."""
        if self.tp_size == 1:
            return torch.matmul(hidden, self.weight.t(), out=out)
        local = F.linear(hidden, self.weight)
        parts = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.all_gather(parts, local)
        logits = torch.cat(parts, dim=-1)[..., : self.vocab_size]
        return logits if out is None else out.copy_(logits)
