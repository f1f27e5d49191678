"""LoRA adapters served beside the base weights (vLLM's multi-LoRA): PEFT's layout (adapter_config.json,
adapter_model.safetensors with `base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r]),
loaded at start. An adapted projection adds (x A^T) B^T * scale for the tokens of the sequences that run under an
adapter. Each projection keeps every adapter's A and B side by side (R rows of A and R columns of B an adapter, R
the largest rank it takes over its shards: q, k and v of a packed qkv each have their own pair), sharded as the
projection's weight is (B by output rows where the weight is column-parallel, A by input columns where it is
row-parallel, so its partial sums join the weight's all-reduce). A step computes every loaded adapter's x A^T for
every token and keeps each token's own adapter's columns (a mask from the step's adapter per token, set around the
forward by `step_adapters`) before the B product: a fixed sequence of dense kernels whatever the tokens' adapters,
so decode steps with adapters replay CUDA graphs too. It costs the adapters' ranks summed as extra columns, which
is small beside the projection while few adapters are loaded; a step without an adapter's token runs none of it."""
from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from worker_svc.model.loader import _our_name
from worker_svc.model.parallel import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear

PEFT_PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"


@dataclass(slots=True)
class _StepAdapters:
    """The step's adapter per token (an index into the adapters, -1: none), or None where no token has one; and
    the masks derived from it, one per width of the adapters' side-by-side columns, made once per step."""
    of_token: torch.Tensor | None = None
    masks: dict[tuple[int, int, torch.dtype], torch.Tensor] = field(default_factory=dict)

    def mask(self, adapters: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
        """[tokens, adapters * rank]: 1 in the columns of the token's adapter, else 0."""
        key = (adapters, rank, dtype)
        if key not in self.masks:
            column_adapter = torch.arange(adapters * rank, device=self.of_token.device) // rank
            self.masks[key] = (self.of_token[:, None] == column_adapter).to(dtype)
        return self.masks[key]


_STEP = _StepAdapters()


@dataclass(slots=True)
class LoraWeights:
    """One projection's adapters side by side, the scale folded into B (zeros where an adapter leaves the
    projection, or a shard of it, alone)."""
    a: torch.Tensor  # [adapters * R, in] (this rank's input columns where the projection is row-parallel)
    b: torch.Tensor  # [out, adapters * R] (this rank's output rows where it is column-parallel)
    rank: int        # R

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the projection's output for x) plus each token's adapter's delta."""
        if _STEP.of_token is None:
            return y
        h = x @ self.a.T
        h *= _STEP.mask(self.a.shape[0] // self.rank, self.rank, h.dtype)
        return y.addmm_(h, self.b.T)


@contextlib.contextmanager
def step_adapters(of_token: torch.Tensor | None) -> Iterator[None]:
    """Within it, adapted projections add to each token's output row the delta of its adapter (of_token: int64,
    one adapter index per token of the step, -1 for none; None: no token has one)."""
    _STEP.of_token = of_token
    try:
        yield
    finally:
        _STEP.of_token = None
        _STEP.masks.clear()


def load_adapters(model: nn.Module, adapters: dict[str, str | Path]) -> list[str]:
    """Loads each adapter (name -> PEFT folder) into the model's projections; returns the names in index order.
    ValueError naming the adapter for what it cannot serve: a bias, modules saved whole, DoRA, per-module ranks, or
    a module that is not one of the model's dense projections (embeddings, the LM head, fused experts, MLA's
    absorbed kv_b_proj)."""
    names = list(adapters)
    # module path -> adapter index -> [(shard id, A, B scaled)]
    found: dict[str, dict[int, list[tuple[object, torch.Tensor, torch.Tensor]]]] = {}
    packed = getattr(model, "packed_modules", {})
    prefixes = getattr(model, "checkpoint_prefixes", ("model.",))
    renamed = getattr(model, "renamed_fragments", {})
    for index, (name, folder) in enumerate(adapters.items()):
        folder = Path(folder)
        config = json.loads((folder / "adapter_config.json").read_text())
        for key, allowed in (("bias", ("none", None)), ("modules_to_save", (None, [])), ("use_dora", (False, None)),
                             ("rank_pattern", ({}, None)), ("alpha_pattern", ({}, None))):
            if config.get(key) not in allowed:
                raise ValueError(f"LoRA adapter {name!r}: {key} {config[key]!r} is not served (only {allowed[0]!r})")
        r, alpha = config["r"], config["lora_alpha"]
        scale = alpha / (math.sqrt(r) if config.get("use_rslora") else r)
        tensors = load_file(str(folder / "adapter_model.safetensors"))
        for key in tensors:
            if not key.endswith(_A):
                continue
            base = key[: -len(_A)]
            ours, shard = _our_name(base.removeprefix(PEFT_PREFIX) + ".weight", packed, prefixes, renamed)
            path = ours.removesuffix(".weight")
            try:
                module = model.get_submodule(path)
            except AttributeError:
                module = None
            if (not isinstance(module, (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear))
                    or getattr(module, "absorbed", False)):
                raise ValueError(f"LoRA adapter {name!r}: {base.removeprefix(PEFT_PREFIX)} is not a projection "
                                 "LoRA is served on (attention's and dense MLPs')")
            found.setdefault(path, {}).setdefault(index, []).append(
                (shard, tensors[key], tensors[base + _B] * scale))
    for path, by_adapter in found.items():
        module = model.get_submodule(path)
        weight = module.weight
        rank = max(sum(a.shape[0] for _, a, _ in parts) for parts in by_adapter.values())
        row_parallel = isinstance(module, RowParallelLinear)
        a = torch.zeros(len(names), rank, weight.shape[1], dtype=weight.dtype, device=weight.device)
        b = torch.zeros(len(names), weight.shape[0], rank, dtype=weight.dtype, device=weight.device)
        for index, parts in by_adapter.items():
            col = 0
            for shard, lora_a, lora_b in parts:
                r = lora_a.shape[0]
                # each shard's A and B go where the weight's loader puts that shard's rows (or columns)
                try:
                    if row_parallel:
                        _load(module, a[index, col:col + r], lora_a.to(weight.dtype), shard)
                        b[index, :, col:col + r] = lora_b
                    else:
                        a[index, col:col + r] = lora_a
                        _load(module, b[index, :, col:col + r], lora_b.to(weight.dtype), shard)
                except RuntimeError:  # a shape that is not this model's: an adapter of another model
                    raise ValueError(f"LoRA adapter {names[index]!r}: {path}'s A {tuple(lora_a.shape)} and B "
                                     f"{tuple(lora_b.shape)} do not fit this model's projection") from None
                col += r
        module.lora = LoraWeights(a.flatten(0, 1), b.permute(1, 0, 2).flatten(1).contiguous(), rank)
    return names


def _load(module: nn.Module, target: torch.Tensor, loaded: torch.Tensor, shard: object) -> None:
    """Copies `loaded` into `target` as the module's weight loader copies a checkpoint tensor into its weight."""
    loader = getattr(module.weight, "weight_loader", None)
    if loader is None:
        target.copy_(loaded)
    elif shard is None and hasattr(module, "split_fused"):  # an adapter of a fused projection (Phi-3's qkv_proj)
        for part_id, part in module.split_fused(loaded):
            loader(target, part, part_id)
    elif shard is None:
        loader(target, loaded)
    else:
        loader(target, loaded, shard)
