"""LoRA adapters served beside the base weights (vLLM's multi-LoRA): PEFT's layout (adapter_config.json,
adapter_model.safetensors with `base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r]),
read into host memory at start (--lora-modules) or while serving (StepPlan.load_loras; at most --max-cpu-loras of
them, the scheduler dropping one for room and having it read again as its requests need), and copied from there
into the slots allocated at start (--max-loras, --max-lora-rank) as the scheduler places them (StepPlan.lora_slots):
more adapters may be served than a step runs. An adapted projection adds
(x A^T) B^T * scale for the tokens of the sequences that run under an adapter. Each projection keeps every slot's A
and B side by side (R rows of A and R columns of B a slot, R the largest rank times the projection's packed parts: q,
k and v of a packed qkv each have their own pair), sharded as the projection's weight is (B by output rows where the
weight is column-parallel, A by input columns where it is row-parallel, so its partial sums join the weight's
all-reduce). A step computes every slot's x A^T for
every token and keeps each token's own adapter's columns (a mask from the step's adapter per token, set around the
forward by `step_adapters`) before the B product: a fixed sequence of dense kernels whatever the tokens' adapters,
so decode steps with adapters replay CUDA graphs too. It costs the slots' ranks summed as extra columns, which is
small beside the projection while few slots are allocated; a step without an adapter's token runs none of it."""
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

from common.util import cdiv
from worker_svc.model.loader import _our_name
from worker_svc.model.parallel import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear

_PROJECTIONS = (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear)

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
    """One projection's adapter slots side by side (zeros where a slot is free or its adapter leaves the projection,
    or a shard of it, alone), each adapter's scale folded into its B."""
    a: torch.Tensor  # [slots * R, in] (this rank's input columns where the projection is row-parallel)
    b: torch.Tensor  # [out, slots * R] (this rank's output rows where it is column-parallel)
    rank: int        # R: a slot's columns, the largest adapter rank times the projection's packed parts
    scale: float = 1.0  # the model's output scale of the projection (layers.scale_rows), folded into B as loaded

    def slot(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot k's rows of A and columns of B (views)."""
        return self.a[k * self.rank:(k + 1) * self.rank], self.b[:, k * self.rank:(k + 1) * self.rank]

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
    one adapter slot per token of the step, -1 for none; None: no token has one)."""
    _STEP.of_token = of_token
    try:
        yield
    finally:
        _STEP.of_token = None
        _STEP.masks.clear()


def adapter_rank(name: str, folder: str | Path) -> int:
    """The rank r of the PEFT adapter in folder; ValueError where its config cannot be read."""
    return int(_config(name, Path(folder)).get("r", 0))


def _config(name: str, folder: Path) -> dict:
    try:
        return json.loads((folder / "adapter_config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"LoRA adapter {name!r}: {folder} is not a PEFT adapter folder: {e}") from None


class LoraSlots:
    """The model's LoRA adapters: those held in host memory (`registered`, at most `capacity`), and the slots every
    projection of its decoder layers that an adapter may adapt gets (`slots` slots of `max_rank` columns per packed
    part), allocated once, so that placing an adapter into a slot or clearing one (copies into these tensors) changes
    no shape and no captured CUDA graph. Which adapter a slot holds is the PersistentBatch's to know (its rows name
    slots); this class only moves weights."""

    def __init__(self, model: nn.Module, slots: int, max_rank: int, dtype: torch.dtype, capacity: int = 0):
        """dtype: the adapters' (the model's activations'); capacity: adapters held in host memory (0: as many as
        slots)."""
        self.model, self.slots, self.max_rank = model, slots, max_rank
        self.capacity = max(capacity, slots)
        self.modules: dict[str, nn.Module] = {}
        self.registered: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}  # module -> A, B
        self.folders: dict[str, str] = {}  # of the registered ones, where each was read from
        self.dropped: dict[str, str] = {}  # adapters dropped for room, still served: where to read each again
        if not slots:
            return
        packed = getattr(model, "packed_modules", {})
        for path, module in model.named_modules():
            if (path.startswith("layers.") and isinstance(module, _PROJECTIONS)
                    and not getattr(module, "absorbed", False)):
                leaf = path.rpartition(".")[2]
                width = max_rank * (sum(target == leaf for target, _ in packed.values()) or 1)
                weight = module.weight
                module.lora = LoraWeights(
                    torch.zeros(slots * width, module.input_size, dtype=dtype, device=weight.device),
                    torch.zeros(weight.shape[0], slots * width, dtype=dtype, device=weight.device), width)
                self.modules[path] = module

    @torch.no_grad()
    def register(self, name: str, folder: str | Path) -> None:
        """Reads the PEFT adapter in `folder` into host memory under `name`, each adapted projection's share as a slot
        holds it (this rank's shard, in the slot's dtype, times the model's output scale; pinned on a GPU), so that
        placing it is a copy per projection. ValueError naming the adapter for what it cannot serve: a name held
        already, no room left (capacity), a bias, modules saved whole, DoRA, per-module ranks, a rank above max_rank,
        or a module that is not one of the decoder layers' projections (embeddings, the LM head, fused experts, MLA's
        absorbed kv_b_proj), or of another shape."""
        self.dropped.pop(name, None)  # read again, or lost where it cannot be
        if name in self.registered:
            raise ValueError(f"LoRA adapter {name!r} is loaded already")
        if len(self.registered) >= self.capacity:
            raise ValueError(f"LoRA adapter {name!r}: this worker holds {self.capacity} adapters already "
                             "(--max-cpu-loras)")
        image = {}
        found = self._read(name, Path(folder))
        # one host allocation for the whole adapter: pinning costs per allocation more than per byte
        loras = [self.modules[path].lora for path in found]
        parts = iter(_host_tensors([spec for lora in loras for spec in (
            ((lora.rank, lora.a.shape[1]), lora.a.dtype), ((lora.b.shape[0], lora.rank), lora.b.dtype))],
            pin=bool(loras) and loras[0].a.is_cuda))
        for path, shards in found.items():
            module = self.modules[path]
            block = LoraWeights(next(parts), next(parts), module.lora.rank)
            _copy_shards(name, path, module, block, shards)
            image[path] = (block.a, block.b)
        self.registered[name] = image
        self.folders[name] = str(folder)

    def forget(self, name: str) -> None:
        """Drops the adapter from host memory (a slot that holds it is the caller's to clear), and from the dropped
        ones where it is one of them."""
        if self.dropped.pop(name, None) is None:
            del self.registered[name], self.folders[name]

    def drop(self, name: str) -> None:
        """Drops the adapter from host memory for room, keeping its folder: it is still served."""
        self.dropped[name] = self.folders[name]
        del self.registered[name], self.folders[name]

    @torch.no_grad()
    def place(self, slot: int, name: str) -> None:
        """Copies the registered adapter into `slot`, replacing what it held."""
        image = self.registered[name]
        for path, module in self.modules.items():
            a, b = module.lora.slot(slot)
            if path in image:
                a.copy_(image[path][0], non_blocking=True)
                b.copy_(image[path][1], non_blocking=True)
            else:
                a.zero_()
                b.zero_()

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        for module in self.modules.values():
            for part in module.lora.slot(slot):
                part.zero_()

    def _read(self, name: str, folder: Path) -> dict[str, list[tuple[object, torch.Tensor, torch.Tensor]]]:
        """The adapter's (shard id, A, B scaled) per module path, checked against what the slots take."""
        if not self.slots:
            raise ValueError(f"LoRA adapter {name!r}: this worker has no LoRA slots (--max-loras)")
        config = _config(name, folder)
        for key, allowed in (("bias", ("none", None)), ("modules_to_save", (None, [])), ("use_dora", (False, None)),
                             ("rank_pattern", ({}, None)), ("alpha_pattern", ({}, None))):
            if config.get(key) not in allowed:
                raise ValueError(f"LoRA adapter {name!r}: {key} {config[key]!r} is not served (only {allowed[0]!r})")
        r, alpha = config.get("r"), config.get("lora_alpha")
        if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)):
            raise ValueError(f"LoRA adapter {name!r}: adapter_config.json needs a rank r and lora_alpha")
        if r > self.max_rank:
            raise ValueError(f"LoRA adapter {name!r}: rank {r} is above this worker's --max-lora-rank "
                             f"{self.max_rank}")
        scale = alpha / (math.sqrt(r) if config.get("use_rslora") else r)
        try:
            tensors = load_file(str(folder / "adapter_model.safetensors"))
        except Exception as e:  # missing, or not safetensors (safetensors' own SafetensorError)
            raise ValueError(f"LoRA adapter {name!r}: {folder / 'adapter_model.safetensors'}: {e}") from None
        model = self.model
        packed = getattr(model, "packed_modules", {})
        prefixes = getattr(model, "checkpoint_prefixes", ("model.",))
        renamed = getattr(model, "renamed_fragments", {})
        found: dict[str, list[tuple[object, torch.Tensor, torch.Tensor]]] = {}
        for key in tensors:
            if not key.endswith(_A):
                continue
            base = key[: -len(_A)]
            ours, shard = _our_name(base.removeprefix(PEFT_PREFIX) + ".weight", packed, prefixes, renamed)
            path = ours.removesuffix(".weight")
            if path not in self.modules:
                raise ValueError(f"LoRA adapter {name!r}: {base.removeprefix(PEFT_PREFIX)} is not a projection "
                                 "LoRA is served on (attention's and dense MLPs')")
            if base + _B not in tensors:
                raise ValueError(f"LoRA adapter {name!r}: {base}{_A} has no {_B.lstrip('.')}")
            found.setdefault(path, []).append((shard, tensors[key], tensors[base + _B] * scale))
        return found


def _host_tensors(specs: list[tuple[tuple[int, int], torch.dtype]], pin: bool) -> list[torch.Tensor]:
    """Zeroed tensors of these shapes and dtypes, views of one host allocation (pinned where `pin`), each starting
    16-byte aligned."""
    sizes = [cdiv(math.prod(shape) * dtype.itemsize, 16) * 16 for shape, dtype in specs]
    buffer = torch.zeros(sum(sizes), dtype=torch.uint8, pin_memory=pin)
    return [part[:math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            for part, (shape, dtype) in zip(buffer.split(sizes), specs)]


def _copy_shards(name: str, path: str, module: nn.Module, block: LoraWeights,
                 found: list[tuple[object, torch.Tensor, torch.Tensor]]) -> None:
    """One module's A and B shards into a slot's block, each shard where the weight's loader puts that shard's rows
    (or columns), B times the model's output scale."""
    row_parallel = isinstance(module, RowParallelLinear)
    col = 0
    for shard, lora_a, lora_b in found:
        r = lora_a.shape[0]
        a, b = block.a[col:col + r], block.b[:, col:col + r]
        lora_a, lora_b = lora_a.to(a.dtype), (lora_b * module.lora.scale).to(b.dtype)
        try:
            if row_parallel:
                _load(module, a, lora_a, shard)
                b.copy_(lora_b)
            else:
                a.copy_(lora_a)
                _load(module, b, lora_b, shard)
        except RuntimeError:  # a shape that is not this model's: an adapter of another model
            raise ValueError(f"LoRA adapter {name!r}: {path}'s A {tuple(lora_a.shape)} and B "
                             f"{tuple(lora_b.shape)} do not fit this model's projection") from None
        col += r


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
