"""Loads a Hugging Face checkpoint folder (one model.safetensors or shards listed in
model.safetensors.index.json) into a model, mapping HF names onto packed layers and keeping only
this rank's shard of each tensor."""
from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from worker_svc.model.packed_ints import PackedInts, part_names


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


KV_SCALE_NAMES = ("k_scale", "v_scale", "kv_scale")  # an fp8 KV cache's scales, as vLLM names them


# (checkpoint name, its tensor when asked for, the file it is in)
CheckpointTensor = tuple[str, Callable[[], torch.Tensor], str]


def joined(tensors: Iterator[CheckpointTensor], names: set[str], part_of: Callable[[str], tuple[str, str] | None],
           weight: Callable[[dict[str, torch.Tensor]], torch.Tensor]) -> Iterator[CheckpointTensor]:
    """The checkpoint's tensors with each quantized weight's stored parts read together as that one weight:
    part_of(name) gives a tensor's (weight's name, part) where it is such a part, None for a tensor passed on as it
    is, still unread; the weight (weight(parts), when asked for) follows its last part among `names` (a weight's
    parts may lie in different files)."""
    expected: dict[str, set[str]] = {}
    for name in names:
        if (owner := part_of(name)) is not None:
            expected.setdefault(owner[0], set()).add(owner[1])
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, get, file in tensors:
        if (owner := part_of(name)) is None:
            yield name, get, file
            continue
        target, part = owner
        got = waiting.setdefault(target, {})
        got[part] = get()
        if got.keys() == expected[target]:
            yield target, functools.partial(weight, waiting.pop(target)), file
    if waiting:
        raise KeyError(f"quantized weights without all their parts: {sorted(waiting)[:3]}")


def joined_qweights(tensors: Iterator[CheckpointTensor], names: set[str], parts: tuple[str, ...],
                    weight: Callable[[dict[str, torch.Tensor]], torch.Tensor]) -> Iterator[CheckpointTensor]:
    """joined() for the formats that store a quantized module as `qweight` beside its other `parts` (AutoAWQ's,
    GPTQ's): each module with a `qweight` among `names` read as one `*.weight`."""
    def part_of(name: str) -> tuple[str, str] | None:
        module, _, part = name.rpartition(".")
        return (f"{module}.weight", part) if part in parts and f"{module}.qweight" in names else None

    return joined(tensors, names, part_of, weight)


def checkpoint_names(model_dir: Path) -> set[str]:
    """Every tensor name of the checkpoint, from its index or its file's header (no tensor read)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return set(json.loads(index.read_text())["weight_map"])
    with safe_open(str(checkpoint_files(model_dir)[0]), framework="pt", device="cpu") as f:
        return set(f.keys())


def checkpoint_tensors(model_dir: Path) -> Iterator[CheckpointTensor]:
    """Every tensor of the checkpoint, read only when asked for (a model leaves some: vision towers)."""
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, functools.partial(f.get_tensor, name), path.name


def load_weights(model: nn.Module, model_dir: str | Path, names_only: bool = False) -> dict[str, float]:
    """Copies every checkpoint tensor into its (sharded, packed) parameter; fails on any unexpected or
    missing name (names_only: fails as a load would on names, copying nothing; tensors that a conversion below pairs
    up are still read). FP8 block-scaled weights and the quantized ones of other formats (config.weight_scheme) are
    dequantised (integer groups kept as stored where their projection was allocated so, model/packed_ints.py), an FP8
    projection's shards staged until its last is in (model/quantized.py), and a model's
    `converted` (if it has one) turns its checkpoint's own forms into the layout its parameters load (gpt-oss's MXFP4
    experts).
    Returns the checkpoint's KV-cache scales (`layers.0.self_attn.k_scale`, or ModelOpt's `self_attn.k_proj.k_scale`,
    -> value; `kv_scale` gives both), for an fp8 cache: a scale per layer and tensor (the largest, where one is stored
    per head)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules", {})
    prefixes = getattr(model, "checkpoint_prefixes", ("model.",))
    ignored = getattr(model, "ignored_prefixes", ())
    renamed = getattr(model, "renamed_fragments", {})
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    tensors = checkpoint_tensors(Path(model_dir))
    config = getattr(model, "config", None)
    block = getattr(config, "fp8_weight_block", None)
    scheme = getattr(config, "weight_scheme", None)
    if block is not None or scheme is not None:  # quantized codes in their own layouts: dequantised as they are read
        from worker_svc.model.quantized import fp8_dequantized

        names = checkpoint_names(Path(model_dir))
        if block is not None:
            tensors = fp8_dequantized(tensors, block, names)
        if scheme is not None:
            tensors = scheme.dequantized(tensors, names)
    if hasattr(model, "converted"):
        tensors = model.converted(tensors)
    loaded: set[str] = set()
    kv_scales: dict[str, float] = {}
    for hf_name, get_tensor, file in tensors:
        if hf_name.startswith(ignored):
            continue
        module, _, leaf = hf_name.rpartition(".")
        if leaf in KV_SCALE_NAMES and module.endswith((".k_proj", ".v_proj")):  # ModelOpt's: the attention's
            hf_name = f"{module.rpartition('.')[0]}.{leaf}"
        name, shard_id = _our_name(hf_name, packed, prefixes, renamed)
        if name not in params and f"{name}.weight" in params:
            name += ".weight"  # stored without its `.weight` (experts as transformers 5 saves them)
        prefix, _, leaf = name.rpartition(".")
        if leaf in KV_SCALE_NAMES:
            value = float(get_tensor().float().max())
            for which in ("k_scale", "v_scale") if leaf == "kv_scale" else (leaf,):
                kv_scales[f"{prefix}.{which}"] = value
            continue
        if name == "lm_head.weight" and tied:
            continue  # tied checkpoints may still store the head; the embedding is the source
        if name not in params:
            raise KeyError(f"unexpected checkpoint tensor {hf_name!r} in {file}")
        if names_only:
            for part_name in part_names(name) if params[name].dtype == torch.int32 else [name]:
                param = params[part_name]
                fused = shard_id is None and hasattr(param, "split_fused")
                loaded.update(f"{part_name}:{s}" for s in (_shards_of(name, param, packed) if fused else [shard_id]))
            continue
        tensor = get_tensor()
        if isinstance(tensor, PackedInts):  # integer groups: served packed where the weight was allocated so
            parts = tensor.parts(name) if params[name].dtype == torch.int32 else [(name, tensor.dequantized())]
        elif tensor.dtype == torch.float8_e4m3fn:  # dequantised with its scale before this, where it has one
            raise KeyError(f"FP8 weight {hf_name!r} in {file} without its weight_scale_inv")
        elif params[name].dtype == torch.int32:
            raise KeyError(f"{hf_name!r} in {file} is not stored in integer groups, as its module's other parts are")
        else:
            parts = [(name, tensor)]
        for part_name, tensor in parts:
            _load(params[part_name], part_name, tensor, shard_id, loaded)
        param = params[name]
        staged = getattr(param, "staged", None)
        if staged is not None and all(f"{name}:{s}" in loaded for s in _shards_of(name, param, packed)):
            staged.finish()
    expected = {f"{name}:{shard}" for name, param in params.items() for shard in _shards_of(name, param, packed)}
    if tied:
        expected = {e for e in expected if not e.startswith("lm_head.")}
    missing = expected - loaded
    if missing:
        raise KeyError(f"checkpoint in {model_dir} lacks {sorted(missing)[:5]} ({len(missing)} missing)")
    return kv_scales


def wholly_loaded(model: nn.Module, hf_names: set[str]) -> set[str]:
    """The model's parameters whose every shard (or the whole of a fused one) comes from a checkpoint tensor among
    `hf_names`."""
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules", {})
    prefixes = getattr(model, "checkpoint_prefixes", ("model.",))
    shards: dict[str, set[object]] = {}
    for hf_name in hf_names:
        name, shard_id = _our_name(hf_name, packed, prefixes, getattr(model, "renamed_fragments", {}))
        shards.setdefault(name, set()).add(shard_id)
    return {name for name, got in shards.items()
            if name in params and (got == set(_shards_of(name, params[name], packed)) or got == {None})}


def _load(param: nn.Parameter, name: str, tensor: torch.Tensor, shard_id: object, loaded: set[str]) -> None:
    """Copies one checkpoint tensor into `param` (named `name`) by its loader, as shard `shard_id`."""
    staged = getattr(param, "staged", None)  # an FP8 projection's: its shards go to a buffer first
    target = param if staged is None else staged.target()
    if target.dtype != torch.float8_e4m3fn:  # an FP8 parameter's own loader quantises (the experts')
        tensor = tensor.to(target.dtype)
    loader = getattr(param, "weight_loader", None)
    # a packed parameter stored fused (Phi-3's qkv_proj, gate_up_proj): split into its shards
    fused = shard_id is None and hasattr(param, "split_fused")
    for shard_id, part in param.split_fused(tensor) if fused else [(shard_id, tensor)]:
        with torch.no_grad():
            if loader is None:
                target.data.copy_(part)
            elif shard_id is None:
                loader(target, part)
            else:
                loader(target, part, shard_id)
        loaded.add(f"{name}:{shard_id}")


def lm_head_rows(model_dir: str | Path, token_ids: list[int], tied: bool) -> torch.Tensor:
    """The LM head's rows of these tokens, in float32, as the checkpoint stores them (the input embedding's where
    the head is tied to it)."""
    suffix = "embed_tokens.weight" if tied else "lm_head.weight"
    for name, get_tensor, _ in checkpoint_tensors(Path(model_dir)):
        if name.endswith(suffix):
            return get_tensor()[token_ids].float()
    raise KeyError(f"checkpoint in {model_dir} has no {suffix} to take a classifier's rows from")


_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _our_name(hf_name: str, packed: dict[str, tuple[str, object]], prefixes: tuple[str, ...],
              renamed: dict[str, str]) -> tuple[str, object]:
    """Our parameter's name (the first of `prefixes` that matches stripped, `renamed` fragments replaced) and the
    shard id its loader takes. An expert's tensor (`mlp.experts.3.up_proj`) goes to the layer's one tensor of all
    experts (`mlp.experts.gate_up_proj`), shard (3, 1)."""
    name, shard_id = next((hf_name[len(p):] for p in prefixes if hf_name.startswith(p)), hf_name), None
    for fragment, ours in renamed.items():
        name = name.replace(fragment, ours)
    for fragment, (target, shard) in packed.items():
        if f".{fragment}." in name:
            name, shard_id = name.replace(fragment, target), shard
            break
    expert = _EXPERT.search(name)
    if expert:
        name, shard_id = name[:expert.start()] + ".experts." + name[expert.end():], (int(expert[1]), shard_id)
    return name, shard_id


def _shards_of(name: str, param: nn.Parameter, packed: dict[str, tuple[str, object]]) -> list[object]:
    if hasattr(param, "shard_ids"):  # a parameter that lists its own (the experts')
        return param.shard_ids
    shards = [shard for target, shard in packed.values() if f".{target}." in name]
    return shards or [None]
