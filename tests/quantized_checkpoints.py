"""What the quantized-checkpoint tests share (tests/test_compressed_tensors.py, test_awq.py, test_gptq.py,
test_bitsandbytes.py): a model's logits served over a folder and transformers' over one, a folder written in a
format's layout, and the check that a folder serves transformers' logits over the weights its codes stand for."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from common.limits import Limits
from tests.hf_reference import from_pretrained
from tests.paged_driver import prefill_logits


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(0, 150000) for _ in range(n)] for n in (40, 90, 17)]


def serve(model_dir: Path, quantization: str = "auto") -> tuple[torch.Tensor, str]:
    """The prompts' logits served over the folder, and what its projections' weights were held in."""
    from worker_svc.runtime.model_runner import ModelRunner, RunnerConfig

    runner = ModelRunner(model_dir, RunnerConfig(device="cpu", dtype="float32", block_size=16, num_blocks=64,
                                                 limits=Limits(max_num_seqs=4), quantization=quantization))
    return torch.cat(prefill_logits(runner, prompts())), runner.projection_dtype


def served_logits(model_dir: Path) -> torch.Tensor:
    return serve(model_dir)[0]


def assert_served_packed(folder: Path, bits: int) -> None:
    """The folder's projections are served as packed integer groups (model/packed_ints.py: `--quantization packed`),
    and give the logits of its weights dequantised as they load (the default) bit for bit."""
    packed, held = serve(folder, "packed")
    dequantised, dense = serve(folder)
    assert (held, dense) == (f"int{bits}", "float32")
    assert torch.equal(packed, dequantised)


def gptq_folder(source: Path, out: Path, bits: int = 4, group_size: int = 32) -> Path:
    """`source` with every projection in GPTQModel's gptq_v2 layout: asymmetric min-max codes by group of input
    columns (in row order), qweight packed along the input rows, qzeros along the output columns."""
    from worker_svc.model.packed_ints import pack

    from worker_svc.model.loader import checkpoint_tensors

    maxq, tensors = 2 ** bits - 1, {}
    for name, get, _ in checkpoint_tensors(source):
        weight = get()
        if not name.endswith("_proj.weight"):
            tensors[name] = weight
            continue
        groups = weight.float().unflatten(1, (-1, group_size))  # [out, groups, size]
        low, high = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        scale = ((high - low).clamp_min(1e-6) / maxq).half()
        zero = (-low / scale.float()).round().clamp(0, maxq)
        codes = (groups / scale.float()[..., None] + zero[..., None]).round().clamp(0, maxq).flatten(1)
        prefix = name.removesuffix(".weight")
        tensors |= {f"{prefix}.qweight": pack(codes, bits).t().contiguous(), f"{prefix}.qzeros": pack(zero.t(), bits),
                    f"{prefix}.scales": scale.t().contiguous()}
    return quantized_folder(source, out, tensors, {"quant_method": "gptq", "bits": bits, "group_size": group_size,
                                                   "desc_act": False, "sym": False, "checkpoint_format": "gptq_v2"})


def hf_logits(model_dir: Path) -> torch.Tensor:
    reference = from_pretrained(model_dir)
    with torch.inference_mode():
        return torch.cat([reference(torch.tensor([p])).logits[0] for p in prompts()])


def quantized_folder(source: Path, out: Path, tensors: dict[str, torch.Tensor], quantization: dict) -> Path:
    """A copy of the checkpoint folder `source` holding `tensors` (in one file) and `quantization` as its
    quantization_config."""
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors", "model.safetensors.index.json"))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quantization
    (out / "config.json").write_text(json.dumps(config))
    return out


def assert_serves_transformers_logits(folder: Path, source: Path, weights: dict[str, torch.Tensor],
                                      workdir: Path) -> None:
    """The quantized `folder` serves transformers' logits over `source` with `weights` in place of its own (the
    weights its codes stand for, as a plain checkpoint), within float32's rounding, and not the unquantized model's."""
    dense = workdir / "dense"
    shutil.copytree(source, dense)
    save_file(load_file(source / "model.safetensors") | {k: v.float() for k, v in weights.items()},
              dense / "model.safetensors", metadata={"format": "pt"})
    served, theirs = served_logits(folder), hf_logits(dense)
    # float32 sums in another order: logits of ~50 differ by a few 1e-4 (the unquantized model's by ~2e-4)
    assert (served - theirs).abs().max() <= 2e-5 * theirs.abs().max()
    assert (served - served_logits(source)).abs().max() > 1e-2
