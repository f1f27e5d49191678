"""LoRA adapters served beside the base weights (vLLM's multi-LoRA): PEFT's layout (adapter_config.json,
adapter_model.safetensors with `base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r]),
loaded at start. An adapted projection adds (x A^T) B^T * scale for the tokens of the sequences that run under an
adapter: each projection keeps every adapter's A and B stacked ([adapters, R, in] and [adapters, out, R], R the
largest rank it takes over its shards: q, k and v of a packed qkv each have their own pair), sharded as the
projection's weight is (B by output rows where the weight is column-parallel, A by input columns where it is
row-parallel, so its partial sums join the weight's all-reduce). The step's tokens by adapter are set around the
forward (`step_adapters`); a projection without LoRA costs nothing, a step without an adapter's token neither."""
from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from worker_svc.model.loader import _our_name
from worker_svc.model.parallel import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear

PEFT_PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"
# this step's tokens by adapter: (adapter index, row indices of the step's tokens), set by step_adapters
_STEP: list[tuple[int, torch.Tensor]] = []


@dataclass(slots=True)
class LoraWeights:
    """One projection's adapters: their A and B stacked, the scale folded into B (zeros where an adapter leaves
    the projection, or a shard of it, alone)."""
    a: torch.Tensor  # [adapters, R, in] (this rank's input columns where the projection is row-parallel)
    b: torch.Tensor  # [adapters, out, R] (this rank's output rows where it is column-parallel)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the projection's output for x) plus each adapter's delta on its tokens' rows."""
        for adapter, rows in _STEP:
            y.index_add_(0, rows, (x[rows] @ self.a[adapter].T) @ self.b[adapter].T)
        return y


@contextlib.contextmanager
def step_adapters(groups: list[tuple[int, torch.Tensor]]) -> Iterator[None]:
    """Within it, adapted projections add adapter a's delta to the rows `rows` of their outputs, for each (a, rows)."""
    _STEP[:] = groups
    try:
        yield
    finally:
        _STEP.clear()


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
                if row_parallel:
                    _load(module, a[index, col:col + r], lora_a.to(weight.dtype), shard)
                    b[index, :, col:col + r] = lora_b
                else:
                    a[index, col:col + r] = lora_a
                    _load(module, b[index, :, col:col + r], lora_b.to(weight.dtype), shard)
                col += r
        module.lora = LoraWeights(a, b)
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
